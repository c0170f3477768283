package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"sort"

	"github.com/opendsec/dsec/internal/compose"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/session"
	"github.com/opendsec/dsec/internal/tenant"
)

// This file is the work that spans nodes: placing creates (with their
// trainer sessions), listing, bulk operations by label and snapshot
// listings. Verbs that name a sandbox are routed in route.go.

// maxBatch bounds one CreateSandboxes request.
const maxBatch = 4096

func wire(err error) error { return errwire.ToConnect(err) }

// sessionGate admits creates into trainer sessions and settles them.
type sessionGate struct {
	sessions *session.Manager
	log      *slog.Logger
}

func (g sessionGate) admit(ctx context.Context, spec *dsecv1.SandboxSpec) error {
	if spec.GetSession() == "" {
		return nil
	}
	if g.sessions == nil {
		return errdefs.Unimplemented("sessions are not served here")
	}
	return g.sessions.Admit(ctx, spec.GetSession())
}

// settle re-checks the sessions of sandboxes just created (see
// session.Manager.Settle). A sandbox whose session expired while it
// started gets the session's action: paused, it is returned paused;
// deleted, its result becomes a conflict error.
func (g sessionGate) settle(ctx context.Context, results []*dsecv1.CreateResult) {
	if g.sessions == nil {
		return
	}
	done := map[string]string{}
	for _, r := range results {
		name := r.GetSandbox().GetSpec().GetSession()
		if name == "" {
			continue
		}
		action, seen := done[name]
		if !seen {
			var err error
			action, err = g.sessions.Settle(ctx, name)
			if err != nil {
				g.log.Warn("apply an expired session's action to a new sandbox", slog.String("session", name), slog.Any("error", err))
			}
			done[name] = action
		}
		switch action {
		case "pause":
			r.Sandbox.State = "paused"
		case "delete":
			r.Error = itemError(errdefs.Conflict("session %q expired while sandbox %s started; it was deleted with the session's sandboxes", name, r.Sandbox.GetId()))
			r.Sandbox = nil
		}
	}
}

func itemError(err error) *dsecv1.ItemError {
	e := errdefs.Classify(err)
	return &dsecv1.ItemError{Kind: string(e.Kind), Message: e.Msg, Infra: e.Infra, Retryable: e.Retryable, RetryAfterMs: e.RetryAfter.Milliseconds()}
}

// lifecycleService serves the LifecycleService.
type lifecycleService struct {
	r Router
	sessionGate
}

var _ dsecv1connect.LifecycleServiceHandler = (*lifecycleService)(nil)

func (s *lifecycleService) CreateSandbox(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	if err := applyCompose(req.Msg); err != nil {
		return nil, wire(err)
	}
	if err := s.admit(ctx, req.Msg.GetSpec()); err != nil {
		return nil, wire(err)
	}
	req.Msg.Project = tenant.Project(ctx)
	sb, err := s.r.Create(ctx, req.Msg)
	if err != nil {
		return nil, wire(err)
	}
	res := []*dsecv1.CreateResult{{Sandbox: sb}}
	s.settle(ctx, res)
	if e := res[0].GetError(); e != nil {
		return nil, wire(errdefs.Conflict("%s", e.GetMessage()))
	}
	return connect.NewResponse(sb), nil
}

func (s *lifecycleService) CreateSandboxes(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxesRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	m := req.Msg
	specs := m.GetSpecs()
	switch {
	case len(specs) > 0 && m.GetCount() > 0:
		return nil, wire(errdefs.Invalid("give spec with count, or specs, not both"))
	case len(specs) == 0:
		if m.GetCount() < 1 || m.GetCount() > maxBatch {
			return nil, wire(errdefs.Invalid("count must be between 1 and %d", maxBatch))
		}
		for i := int32(0); i < m.GetCount(); i++ {
			specs = append(specs, m.GetSpec())
		}
	case len(specs) > maxBatch:
		return nil, wire(errdefs.Invalid("at most %d specs", maxBatch))
	}
	for _, sp := range specs {
		if err := s.admit(ctx, sp); err != nil {
			return nil, wire(err)
		}
	}
	// Item i keeps the idempotency key "<key>/<i>" wherever it is placed.
	var keys []string
	if k := m.GetIdempotencyKey(); k != "" {
		keys = make([]string, len(specs))
		for i := range keys {
			keys[i] = fmt.Sprintf("%s/%d", k, i)
		}
	}
	out := s.r.CreateMany(ctx, specs, keys, tenant.Project(ctx))
	s.settle(ctx, out.GetResults())
	recount(out)
	return connect.NewResponse(out), nil
}

func (s *lifecycleService) ListSandboxes(ctx context.Context, req *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	all, err := List(ctx, s.r, req.Msg.GetLabelSelector(), req.Msg.GetState())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(page(&dsecv1.ListSandboxesResponse{Sandboxes: all}, req.Msg.GetPageSize(), req.Msg.GetPageToken())), nil
}

// List is every sandbox of the caller's on every node matching the label
// selector and state ("" for any), oldest first (ties by ID): the nodes
// are asked concurrently, each paged through to its end. The native
// listing and the E2B facade's both read it.
func List(ctx context.Context, r Router, selector, state string) ([]*dsecv1.Sandbox, error) {
	lists, err := fanOut(r.Nodes(ctx), func(n Node) ([]*dsecv1.Sandbox, error) {
		var out []*dsecv1.Sandbox
		token := ""
		for {
			// A request of its own for each call: a request's headers
			// are written as it is sent.
			q := &dsecv1.ListSandboxesRequest{LabelSelector: selector, State: state, PageSize: 10000, PageToken: token}
			resp, err := n.ListSandboxes(ctx, connect.NewRequest(q))
			if err != nil {
				return nil, err
			}
			out = append(out, resp.Msg.Sandboxes...)
			if token = resp.Msg.NextPageToken; token == "" {
				return out, nil
			}
		}
	})
	if err != nil {
		return nil, err
	}
	var all []*dsecv1.Sandbox
	for _, l := range lists {
		all = append(all, l...)
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if !a.CreatedAt.AsTime().Equal(b.CreatedAt.AsTime()) {
			return a.CreatedAt.AsTime().Before(b.CreatedAt.AsTime())
		}
		return a.Id < b.Id
	})
	return all, nil
}

// page cuts a listing sorted by creation; the token is the last ID sent.
func page(all *dsecv1.ListSandboxesResponse, size int32, token string) *dsecv1.ListSandboxesResponse {
	if size <= 0 || size > 10000 {
		size = 10000
	}
	start := 0
	if token != "" {
		start = len(all.Sandboxes)
		for i, s := range all.Sandboxes {
			if s.Id == token {
				start = i + 1
				break
			}
		}
	}
	end := min(start+int(size), len(all.Sandboxes))
	out := &dsecv1.ListSandboxesResponse{Sandboxes: all.Sandboxes[start:end]}
	if end < len(all.Sandboxes) {
		out.NextPageToken = all.Sandboxes[end-1].Id
	}
	return out
}

// bulkOps are the label-selected operations, by name, as node verbs.
var bulkOps = map[string]func(Node, context.Context, *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error){
	"pause": Node.PauseSandboxes, "resume": Node.ResumeSandboxes, "delete": Node.DeleteSandboxes,
	"pause_filesystem": Node.PauseSandboxes, // with BulkRequest.filesystem_only
}

// Bulk runs a label-selected operation ("pause", "pause_filesystem",
// "resume", "delete") on
// the caller's sandboxes on every node and gathers the results.
func Bulk(ctx context.Context, r Router, op, selector, cause string) (*dsecv1.BulkResponse, error) {
	verb, ok := bulkOps[op]
	switch {
	case !ok:
		return nil, wire(errdefs.Invalid("unknown bulk operation %q", op))
	case selector == "":
		return nil, wire(errdefs.Invalid("a label selector is required for a bulk %s", op))
	}
	q := &dsecv1.BulkRequest{LabelSelector: selector, Cause: cause, FilesystemOnly: op == "pause_filesystem"}
	resps, err := fanOut(r.Nodes(ctx), func(n Node) (*connect.Response[dsecv1.BulkResponse], error) {
		return verb(n, ctx, connect.NewRequest(q))
	})
	if err != nil {
		return nil, err
	}
	out := &dsecv1.BulkResponse{}
	for _, resp := range resps {
		out.Ids = append(out.Ids, resp.Msg.Ids...)
		out.Failures = append(out.Failures, resp.Msg.Failures...)
	}
	sort.Strings(out.Ids)
	return out, nil
}

// Actor adapts bulk operations for the session manager.
func Actor(r Router) session.Actor {
	return func(ctx context.Context, op, selector, cause string) (int, error) {
		resp, err := Bulk(ctx, r, op, selector, cause)
		if err != nil {
			return 0, errwire.FromConnect(err)
		}
		if len(resp.Failures) > 0 {
			f := resp.Failures[0]
			return len(resp.Ids), errdefs.Unavailable("%s %d sandboxes failed (first: %s: %s)", op, len(resp.Failures), f.Id, f.Error.GetMessage())
		}
		return len(resp.Ids), nil
	}
}

func (s *lifecycleService) bulk(ctx context.Context, op string, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	resp, err := Bulk(ctx, s.r, op, req.Msg.GetLabelSelector(), req.Msg.GetCause())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (s *lifecycleService) PauseSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	op := "pause"
	if req.Msg.GetFilesystemOnly() {
		op = "pause_filesystem"
	}
	return s.bulk(ctx, op, req)
}

func (s *lifecycleService) ResumeSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return s.bulk(ctx, "resume", req)
}

func (s *lifecycleService) DeleteSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return s.bulk(ctx, "delete", req)
}

// snapshotService serves the SnapshotService.
type snapshotService struct {
	r Router
	sessionGate
}

var _ dsecv1connect.SnapshotServiceHandler = (*snapshotService)(nil)

func (s *snapshotService) ListSnapshots(ctx context.Context, req *connect.Request[dsecv1.ListSnapshotsRequest]) (*connect.Response[dsecv1.ListSnapshotsResponse], error) {
	lists, _ := fanOut(s.r.Nodes(ctx), func(n Node) (*connect.Response[dsecv1.ListSnapshotsResponse], error) {
		return n.ListSnapshots(ctx, connect.NewRequest(req.Msg))
	})
	out := &dsecv1.ListSnapshotsResponse{}
	for _, l := range lists {
		if l != nil {
			out.Snapshots = append(out.Snapshots, l.Msg.Snapshots...)
		}
	}
	sort.Slice(out.Snapshots, func(i, j int) bool {
		return out.Snapshots[i].CreatedAt.AsTime().Before(out.Snapshots[j].CreatedAt.AsTime())
	})
	return connect.NewResponse(out), nil
}

func (s *snapshotService) Fork(ctx context.Context, req *connect.Request[dsecv1.ForkRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	if err := s.admit(ctx, &dsecv1.SandboxSpec{Session: req.Msg.GetSession()}); err != nil {
		return nil, wire(err)
	}
	resp, err := route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Fork)
	if err == nil {
		s.settle(ctx, resp.Msg.GetResults())
		recount(resp.Msg)
	}
	return resp, err
}

// recount sets a batch's totals from its results.
func recount(out *dsecv1.CreateSandboxesResponse) {
	out.Created, out.Failed = 0, 0
	for _, r := range out.GetResults() {
		if r.GetError() != nil {
			out.Failed++
		} else {
			out.Created++
		}
	}
}

// sessionService serves the SessionService.
type sessionService struct {
	m *session.Manager
}

var _ dsecv1connect.SessionServiceHandler = (*sessionService)(nil)

func unary[Resp any](f func() (*Resp, error)) (*connect.Response[Resp], error) {
	resp, err := f()
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(resp), nil
}

func (s *sessionService) OpenSession(ctx context.Context, req *connect.Request[dsecv1.OpenSessionRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(func() (*dsecv1.Session, error) { return s.m.Open(ctx, req.Msg) })
}

func (s *sessionService) Heartbeat(ctx context.Context, req *connect.Request[dsecv1.HeartbeatRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(func() (*dsecv1.Session, error) { return s.m.Heartbeat(ctx, req.Msg.GetName()) })
}

func (s *sessionService) GetSession(ctx context.Context, req *connect.Request[dsecv1.GetSessionRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(func() (*dsecv1.Session, error) { return s.m.Get(ctx, req.Msg.GetName()) })
}

func (s *sessionService) ListSessions(ctx context.Context, req *connect.Request[dsecv1.ListSessionsRequest]) (*connect.Response[dsecv1.ListSessionsResponse], error) {
	return unary(func() (*dsecv1.ListSessionsResponse, error) {
		list, err := s.m.List(ctx)
		return &dsecv1.ListSessionsResponse{Sessions: list}, err
	})
}

func (s *sessionService) CloseSession(ctx context.Context, req *connect.Request[dsecv1.CloseSessionRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(func() (*dsecv1.Session, error) {
		return s.m.Close(ctx, req.Msg.GetName(), req.Msg.GetDeleteSandboxes())
	})
}

func (s *sessionService) SetModelUpstreams(ctx context.Context, req *connect.Request[dsecv1.SetModelUpstreamsRequest]) (*connect.Response[dsecv1.ModelUpstreams], error) {
	return unary(func() (*dsecv1.ModelUpstreams, error) { return s.m.SetModels(ctx, req.Msg) })
}

func (s *sessionService) GetModelUpstreams(ctx context.Context, req *connect.Request[dsecv1.GetModelUpstreamsRequest]) (*connect.Response[dsecv1.ModelUpstreams], error) {
	return unary(func() (*dsecv1.ModelUpstreams, error) { return s.m.GetModels(ctx, req.Msg.GetSession()) })
}

func (s *systemService) GetCapacity(ctx context.Context, req *connect.Request[dsecv1.GetCapacityRequest]) (*connect.Response[dsecv1.Capacity], error) {
	out := &dsecv1.Capacity{}
	caps, _ := fanOut(s.r.Nodes(ctx), func(n Node) (*connect.Response[dsecv1.Capacity], error) {
		return n.GetCapacity(ctx, connect.NewRequest(req.Msg))
	})
	for _, c := range caps {
		if c == nil {
			continue
		}
		out.MaxSandboxes += c.Msg.MaxSandboxes
		out.Running += c.Msg.Running
		out.FreeSlots += c.Msg.FreeSlots
		out.QueueDepth += c.Msg.QueueDepth
		out.QueueLimit += c.Msg.QueueLimit
		out.StartsPerS += c.Msg.StartsPerS
		out.MaxConcurrentStarts += c.Msg.MaxConcurrentStarts
		out.Pools = append(out.Pools, c.Msg.Pools...)
	}
	return connect.NewResponse(out), nil
}

// applyCompose makes a create's compose file part of its spec (the main
// container and its sidecars), so placement and the node see one spec.
func applyCompose(req *dsecv1.CreateSandboxRequest) error {
	if req.GetCompose() == "" {
		if len(req.GetComposeOverrides()) > 0 {
			return errdefs.Invalid("compose_overrides are laid over a compose file: give compose too")
		}
		return nil
	}
	size := len(req.Compose)
	overrides := make([][]byte, len(req.ComposeOverrides))
	for i, o := range req.ComposeOverrides {
		size += len(o)
		overrides[i] = []byte(o)
	}
	if size > 1<<20 || len(overrides) > 16 {
		return errdefs.Invalid("compose files larger than 1 MiB together, or more than 16 overrides")
	}
	f, err := compose.Parse([]byte(req.Compose), overrides...)
	if err != nil {
		return err
	}
	if req.Spec == nil {
		req.Spec = &dsecv1.SandboxSpec{}
	}
	if err := compose.Apply(f, req.Spec); err != nil {
		return err
	}
	req.Compose, req.ComposeOverrides = "", nil
	return nil
}
