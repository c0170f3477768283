package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"sort"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/session"
	"github.com/opendsec/dsec/internal/tenant"
)

// maxBatch bounds one CreateSandboxes request.
const maxBatch = 4096

func (s *sandboxService) admitSession(ctx context.Context, spec *dsecv1.SandboxSpec) error {
	if spec.GetSession() == "" || fromUpstream(ctx) {
		return nil
	}
	if s.sessions == nil {
		return errdefs.Unimplemented("sessions are not served here")
	}
	return s.sessions.Admit(ctx, spec.GetSession())
}

// settle re-checks the sessions of sandboxes just created (see
// session.Manager.Settle). A sandbox whose session expired while it
// started gets the session's action: paused, it is returned paused;
// deleted, its result becomes a conflict error.
func (s *sandboxService) settle(ctx context.Context, results []*dsecv1.CreateResult) {
	if s.sessions == nil || fromUpstream(ctx) {
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
			action, err = s.sessions.Settle(ctx, name)
			if err != nil {
				s.log.Warn("apply an expired session's action to a new sandbox", slog.String("session", name), slog.Any("error", err))
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

func (s *sandboxService) CreateSandboxes(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxesRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
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
		if err := s.admitSession(ctx, sp); err != nil {
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

func (s *sandboxService) PauseSandbox(ctx context.Context, req *connect.Request[dsecv1.PauseSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return call(ctx, s.r, req.Msg.GetId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.PauseSandboxRequest) (*dsecv1.Sandbox, error) {
		return n.Pause(ctx, m.GetId())
	})
}

func (s *sandboxService) ResumeSandbox(ctx context.Context, req *connect.Request[dsecv1.ResumeSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return call(ctx, s.r, req.Msg.GetId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.ResumeSandboxRequest) (*dsecv1.Sandbox, error) {
		return n.Resume(ctx, m.GetId())
	})
}

// bulk runs a label-selected operation on every node.
func bulk(ctx context.Context, r Router, op, selector string) (*dsecv1.BulkResponse, error) {
	if selector == "" {
		return nil, errdefs.Invalid("a label selector is required for a bulk %s", op)
	}
	out := &dsecv1.BulkResponse{}
	resps, err := fanOut(r.Nodes(ctx), func(n Node) (*dsecv1.BulkResponse, error) { return n.Bulk(ctx, op, selector) })
	if err != nil {
		return nil, err
	}
	for _, resp := range resps {
		out.Ids = append(out.Ids, resp.Ids...)
		out.Failures = append(out.Failures, resp.Failures...)
	}
	sort.Strings(out.Ids)
	return out, nil
}

// Actor adapts bulk operations for the session manager.
func Actor(r Router) session.Actor {
	return func(ctx context.Context, op, selector string) (int, error) {
		resp, err := bulk(ctx, r, op, selector)
		if err != nil {
			return 0, err
		}
		if len(resp.Failures) > 0 {
			f := resp.Failures[0]
			return len(resp.Ids), errdefs.Unavailable("%s %d sandboxes failed (first: %s: %s)", op, len(resp.Failures), f.Id, f.Error.GetMessage())
		}
		return len(resp.Ids), nil
	}
}

func (s *sandboxService) bulkRPC(ctx context.Context, op string, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	resp, err := bulk(ctx, s.r, op, req.Msg.GetLabelSelector())
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(resp), nil
}

func (s *sandboxService) PauseSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return s.bulkRPC(ctx, "pause", req)
}

func (s *sandboxService) ResumeSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return s.bulkRPC(ctx, "resume", req)
}

func (s *sandboxService) DeleteSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return s.bulkRPC(ctx, "delete", req)
}

func (s *sandboxService) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Snapshot)
}

func (s *sandboxService) ListSnapshots(ctx context.Context, req *connect.Request[dsecv1.ListSnapshotsRequest]) (*connect.Response[dsecv1.ListSnapshotsResponse], error) {
	out := &dsecv1.ListSnapshotsResponse{}
	lists, _ := fanOut(s.r.Nodes(ctx), func(n Node) ([]*dsecv1.SnapshotInfo, error) { return n.ListSnapshots(ctx), nil })
	for _, l := range lists {
		out.Snapshots = append(out.Snapshots, l...)
	}
	sort.Slice(out.Snapshots, func(i, j int) bool {
		return out.Snapshots[i].CreatedAt.AsTime().Before(out.Snapshots[j].CreatedAt.AsTime())
	})
	return connect.NewResponse(out), nil
}

func (s *sandboxService) DeleteSnapshot(ctx context.Context, req *connect.Request[dsecv1.DeleteSnapshotRequest]) (*connect.Response[dsecv1.DeleteSnapshotResponse], error) {
	n, err := s.r.ForSnapshot(ctx, req.Msg.GetId())
	if err != nil {
		return nil, wire(err)
	}
	if err := n.DeleteSnapshot(ctx, req.Msg.GetId()); err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(&dsecv1.DeleteSnapshotResponse{}), nil
}

func (s *sandboxService) Fork(ctx context.Context, req *connect.Request[dsecv1.ForkRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	if req.Msg.GetSession() != "" {
		if err := s.admitSession(ctx, &dsecv1.SandboxSpec{Session: req.Msg.GetSession()}); err != nil {
			return nil, wire(err)
		}
	}
	resp, err := call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Fork)
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

func (s *sandboxService) GetLog(ctx context.Context, req *connect.Request[dsecv1.GetLogRequest]) (*connect.Response[dsecv1.GetLogResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.GetLog)
}

func (s *sandboxService) Replay(ctx context.Context, req *connect.Request[dsecv1.ReplayRequest]) (*connect.Response[dsecv1.ReplayResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Replay)
}

// sessionService serves the SessionService.
type sessionService struct {
	m *session.Manager
}

var _ dsecv1connect.SessionServiceHandler = (*sessionService)(nil)

func unary[Req, Resp any](ctx context.Context, m *Req, f func() (*Resp, error)) (*connect.Response[Resp], error) {
	resp, err := f()
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(resp), nil
}

func (s *sessionService) OpenSession(ctx context.Context, req *connect.Request[dsecv1.OpenSessionRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(ctx, req.Msg, func() (*dsecv1.Session, error) { return s.m.Open(ctx, req.Msg) })
}

func (s *sessionService) Heartbeat(ctx context.Context, req *connect.Request[dsecv1.HeartbeatRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(ctx, req.Msg, func() (*dsecv1.Session, error) { return s.m.Heartbeat(ctx, req.Msg.GetName()) })
}

func (s *sessionService) GetSession(ctx context.Context, req *connect.Request[dsecv1.GetSessionRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(ctx, req.Msg, func() (*dsecv1.Session, error) { return s.m.Get(ctx, req.Msg.GetName()) })
}

func (s *sessionService) ListSessions(ctx context.Context, req *connect.Request[dsecv1.ListSessionsRequest]) (*connect.Response[dsecv1.ListSessionsResponse], error) {
	return unary(ctx, req.Msg, func() (*dsecv1.ListSessionsResponse, error) {
		list, err := s.m.List(ctx)
		return &dsecv1.ListSessionsResponse{Sessions: list}, err
	})
}

func (s *sessionService) CloseSession(ctx context.Context, req *connect.Request[dsecv1.CloseSessionRequest]) (*connect.Response[dsecv1.Session], error) {
	return unary(ctx, req.Msg, func() (*dsecv1.Session, error) {
		return s.m.Close(ctx, req.Msg.GetName(), req.Msg.GetDeleteSandboxes())
	})
}

func (s *systemService) GetCapacity(ctx context.Context, req *connect.Request[dsecv1.GetCapacityRequest]) (*connect.Response[dsecv1.Capacity], error) {
	out := &dsecv1.Capacity{}
	caps, _ := fanOut(s.r.Nodes(ctx), func(n Node) (*dsecv1.Capacity, error) { return n.Capacity(ctx), nil })
	for _, c := range caps {
		out.MaxSandboxes += c.MaxSandboxes
		out.Running += c.Running
		out.FreeSlots += c.FreeSlots
		out.QueueDepth += c.QueueDepth
		out.QueueLimit += c.QueueLimit
		out.StartsPerS += c.StartsPerS
		out.MaxConcurrentStarts += c.MaxConcurrentStarts
		out.Pools = append(out.Pools, c.Pools...)
	}
	return connect.NewResponse(out), nil
}
