package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/placement"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/tenant"
)

// RouterConfig configures a Router. The zero value works (without a
// cluster token).
type RouterConfig struct {
	// Token is the cluster token presented to node agents (env
	// DSEC_CLUSTER_TOKEN).
	Token string
	// Choices is how many fitting nodes placement samples (default 2).
	Choices int
	// Attempts is how many nodes a sandbox is tried on when nodes refuse
	// it before its create fails (default 3).
	Attempts int
	// IdempotencyTTL is how long a create's idempotency key is honoured
	// across replicas (default 24h; a node keeps its own for as long).
	IdempotencyTTL time.Duration
	// BatchRun is how many sandboxes of one batch spec go to one node
	// together (default 8; 1 spreads every sandbox on its own).
	BatchRun int
	// Metrics, when set, counts placements and routing failures.
	Metrics *metrics.API
}

// Router is the apiserver.Router of a cluster: it routes every call by the
// node a sandbox ID names, from memory, and places new sandboxes on the
// live load view. It keeps no per-sandbox state. It is safe for concurrent
// use.
type Router struct {
	cfg    RouterConfig
	state  *State
	log    *slog.Logger
	http   *http.Client
	placer *placement.Placer
	claims *claims

	mu        sync.Mutex
	remotes   map[string]*remote   // the nodes calls are routed to: members, and lapsed nodes that answer
	watchdogs map[string]*watchdog // nodes without a lease, probed

	qmu       sync.Mutex // serializes quota checks with what they admit
	buckets   map[string]*bucket
	admitting map[string]int64 // admitted, not yet counted by the placer

	afterSend func() // test hook: runs before a retried keyed create confirms
}

var _ apiserver.Router = (*Router)(nil)

// NewRouter returns the router of a replica over st.
func NewRouter(cfg RouterConfig, st *State, log *slog.Logger) *Router {
	if cfg.Attempts <= 0 {
		cfg.Attempts = 3
	}
	if cfg.IdempotencyTTL == 0 {
		cfg.IdempotencyTTL = 24 * time.Hour
	}
	if cfg.BatchRun <= 0 {
		cfg.BatchRun = 8
	}
	r := &Router{
		cfg: cfg, state: st, log: log,
		http:    &http.Client{Transport: nodeTransport()},
		placer:  placement.New(placement.Config{Choices: cfg.Choices}),
		claims:  &claims{s: st.s, ttl: cfg.IdempotencyTTL},
		remotes: map[string]*remote{}, watchdogs: map[string]*watchdog{}, buckets: map[string]*bucket{}, admitting: map[string]int64{},
	}
	st.OnNode(r.nodeChanged)
	return r
}

// nodeChanged keeps the node clients and the placer in step with the
// cluster state. A node whose lease went is not dropped on the spot: etcd
// saying the lease went does not say the node is gone (it may have been
// cut off from etcd, or etcd from everyone). It leaves placement at once,
// and a watchdog decides whether it is lapsed (it answers: calls still go
// to its last address) or lost (it does not).
func (r *Router) nodeChanged(name string, n *NodeStatus) {
	r.mu.Lock()
	old := r.remotes[name]
	switch {
	case n == nil: // forgotten
		delete(r.remotes, name)
		r.stopWatchdogLocked(name)
		r.mu.Unlock()
		if old != nil {
			old.markLost()
			r.log.Warn("node forgotten", slog.String("node", name))
		}
		r.placer.Forget(name)
		return
	case n.Load == nil:
		if old != nil && !old.lapsed.Swap(true) {
			r.log.Warn("node lapsed: its lease went; routing to it while it answers, placing nothing there", slog.String("node", name))
		}
		if r.watchdogs[name] == nil {
			w := &watchdog{}
			var ctx context.Context
			ctx, w.cancel = context.WithCancel(r.state.runContext())
			r.watchdogs[name] = w
			go r.watch(ctx, name, w)
		}
		r.mu.Unlock()
		r.placer.Forget(name)
		return
	case old == nil || old.addr != n.Load.Address:
		r.remotes[name] = newRemote(r, name, n.Load.Address)
		r.stopWatchdogLocked(name)
		r.mu.Unlock()
		if old != nil {
			old.markLost()
		}
		r.log.Info("node ready", slog.String("node", name), slog.String("address", n.Load.Address))
	default:
		r.stopWatchdogLocked(name)
		r.mu.Unlock()
		if old.lapsed.Swap(false) {
			r.log.Info("node is a member again", slog.String("node", name))
		}
	}
	r.placer.Reported(name, n.Load.Incarnation, n.Load.Admitted)
}

// watchdog is the probing of one node without a lease.
type watchdog struct{ cancel context.CancelFunc }

func (r *Router) stopWatchdogLocked(name string) {
	if w := r.watchdogs[name]; w != nil {
		w.cancel()
		delete(r.watchdogs, name)
	}
}

// Probing a node without a lease: every lapsedProbe while it answers
// (lapsed), backing off to lostProbeMax while it does not (lost). A node is
// lost when its address refuses the connection (nothing listens: at once),
// or after probeMisses probes in a row got no answer within probeTimeout
// (a host that vanished, or a node too busy to answer for seconds).
const (
	lapsedProbe  = time.Second
	lostProbeMax = 30 * time.Second
	probeTimeout = 2 * time.Second
	probeMisses  = 2
)

// watch probes node name, which has no lease, at its last address until
// ctx ends (the node has a lease again, or was forgotten). While it
// answers it stays routable (lapsed); when it does not, it is lost: calls
// in flight end and calls to it fail at once with an infra error, until it
// answers again or registers.
func (r *Router) watch(ctx context.Context, name string, w *watchdog) {
	wait := lapsedProbe
	misses := 0
	for ctx.Err() == nil {
		r.mu.Lock()
		rn := r.remotes[name]
		r.mu.Unlock()
		if rn == nil {
			if n := r.state.Node(name); n != nil && n.Address != "" {
				rn = newRemote(r, name, n.Address)
			}
		}
		var err error = errLost
		if rn != nil {
			err = rn.probe(ctx)
		}
		if err == nil {
			misses = 0
		} else if misses++; !errors.Is(err, syscall.ECONNREFUSED) && misses < probeMisses {
			err = nil // one probe without an answer: not yet lost
		}
		var lost *remote
		r.mu.Lock()
		if r.watchdogs[name] != w || ctx.Err() != nil {
			r.mu.Unlock()
			return
		}
		cur := r.remotes[name]
		switch {
		case err == nil && misses > 0:
			wait = lapsedProbe // a miss: probe again before deciding
		case err == nil:
			if cur == nil {
				rn.lapsed.Store(true)
				r.remotes[name] = rn
				r.log.Warn("node answers without a lease: routing to it again, placing nothing there", slog.String("node", name), slog.String("address", rn.addr))
			}
			wait = lapsedProbe
		case cur != nil:
			delete(r.remotes, name)
			lost, wait = cur, lapsedProbe
		default:
			wait = min(2*wait, lostProbeMax)
		}
		r.mu.Unlock()
		if lost != nil {
			lost.markLost()
			r.log.Warn("node lost: no lease and no answer", slog.String("node", name), slog.Any("error", err))
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// Sync returns once every replica's view includes the cluster state as of
// the call (Store.Sync): image operations call it after the nodes
// published their new images, so a create through any replica finds them.
func (r *Router) Sync(ctx context.Context) error { return r.state.s.Sync(ctx) }

// node returns the client of a live node, or why there is none.
func (r *Router) node(name, what string) (*remote, error) {
	r.mu.Lock()
	rn := r.remotes[name]
	r.mu.Unlock()
	if rn != nil {
		return rn, nil
	}
	if r.state.Node(name) == nil {
		r.cfg.Metrics.RoutingError("unknown_node")
		return nil, errdefs.NotFound("%s: no node %q in this cluster", what, name)
	}
	r.cfg.Metrics.RoutingError("lost")
	return nil, lostError(name)
}

func (r *Router) ForSandbox(ctx context.Context, id string) (apiserver.Node, error) {
	name, err := sandboxid.Node(id)
	if err != nil {
		return nil, err
	}
	return r.node(name, "sandbox "+id)
}

func (r *Router) ForSnapshot(ctx context.Context, id string) (apiserver.Node, error) {
	name, err := sandboxid.SnapshotNode(id)
	if err != nil {
		return nil, err
	}
	return r.node(name, "snapshot "+id)
}

// ForFunction picks a node that runs function calls, by the same load
// view as creates.
func (r *Router) ForFunction(ctx context.Context) (apiserver.Node, error) {
	res, err := r.placer.Pick(r.state.view.Load().nodes, placement.Request{Kind: "function", Project: tenant.Project(ctx)})
	if err != nil {
		return nil, err
	}
	res.Done(false, "", 0)
	return r.node(res.Node, "function call")
}

// ForBuild is the node image builds and uploads run on: the first node by
// name that is live, not draining and runs containers, so a build
// context's upload and its build go to the same node while the cluster
// does not change. The images it makes reach the other nodes on demand
// (clusternode: a create elsewhere imports them from it).
func (r *Router) ForBuild(ctx context.Context) (apiserver.Node, error) {
	for _, n := range r.state.view.Load().nodes {
		if !n.Lost && !n.Draining && n.Kinds["container"] {
			return r.node(n.Name, "image build")
		}
	}
	return nil, errdefs.Unavailable("no node can build images: none is live, not draining and running containers")
}

// Nodes lists the live nodes by name.
func (r *Router) Nodes(ctx context.Context) []apiserver.Node {
	r.mu.Lock()
	out := make([]apiserver.Node, 0, len(r.remotes))
	for _, rn := range r.remotes {
		out = append(out, rn)
	}
	r.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name() < out[j].Name() })
	return out
}

func (r *Router) Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error) {
	var keys []string
	if req.GetIdempotencyKey() != "" {
		keys = []string{req.GetIdempotencyKey()}
	}
	return itemResult(r.CreateMany(ctx, []*dsecv1.SandboxSpec{req.GetSpec()}, keys, req.GetProject()), 0)
}

// claimKey is the key of the one claim that covers a keyed create: the key
// of a single create, or P for a batch whose item keys are "P/<i>".
func claimKey(keys []string) string {
	if len(keys) == 1 {
		return keys[0]
	}
	if len(keys) == 0 || keys[0] == "" {
		return ""
	}
	p, ok := strings.CutSuffix(keys[0], "/0")
	if !ok {
		return ""
	}
	for i, k := range keys {
		if k != fmt.Sprintf("%s/%d", p, i) {
			return ""
		}
	}
	return p
}

// item is one sandbox of a create being placed.
type item struct {
	i       int
	spec    *dsecv1.SandboxSpec
	key     string
	pinned  string // a node the item must go to (a claim's, a snapshot's)
	node    string
	res     *placement.Reservation
	exclude map[string]string
	lastErr error
	adopted bool // placed by an earlier attempt's claim
}

// CreateMany places each item on a node (its claim's node when retried with
// the same idempotency key), sends each node its share at once, and places
// refused items elsewhere, up to Attempts nodes per item.
func (r *Router) CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse {
	out := &dsecv1.CreateSandboxesResponse{Results: make([]*dsecv1.CreateResult, len(specs))}
	fail := func(it *item, err error) {
		out.Results[it.i] = &dsecv1.CreateResult{Index: int32(it.i), Error: itemError(err)}
		out.Failed++
	}
	failAll := func(items []*item, err error) {
		for _, it := range items {
			fail(it, err)
		}
	}
	items := make([]*item, len(specs))
	type place struct {
		node string
		err  error
	}
	volumesAt := map[*dsecv1.SandboxSpec]place{} // the node of a spec's volumes
	for i, sp := range specs {
		if sp == nil {
			sp = &dsecv1.SandboxSpec{}
		}
		it := &item{i: i, spec: sp}
		if i < len(keys) {
			it.key = keys[i]
		}
		if sp.GetSnapshot() != "" {
			name, err := sandboxid.SnapshotNode(sp.GetSnapshot())
			if err != nil {
				it.lastErr = err
			}
			it.pinned = name
		}
		if from := sp.GetModelGateway().GetFastForwardFrom(); from != "" && it.lastErr == nil {
			// Its model calls are answered from the log of a sandbox of
			// that node.
			name, err := sandboxid.Node(from)
			switch {
			case err != nil:
				it.lastErr = errdefs.NotFound("model_gateway.fast_forward_from: sandbox %s not found", from)
			case it.pinned != "" && it.pinned != name:
				it.lastErr = errdefs.Invalid("snapshot %s is on node %s and the sandbox it fast-forwards from on node %s", sp.GetSnapshot(), it.pinned, name)
			default:
				it.pinned = name
			}
		}
		if len(sp.GetVolumes()) > 0 && it.lastErr == nil {
			// A sandbox runs where its volumes live.
			at, ok := volumesAt[sp]
			if !ok {
				at.node, at.err = apiserver.VolumesNode(ctx, r, sp)
				volumesAt[sp] = at
			}
			name := at.node
			it.lastErr = at.err
			switch {
			case it.lastErr != nil:
			case it.pinned != "" && it.pinned != name:
				it.lastErr = errdefs.Invalid("snapshot %s is on node %s and the sandbox's volumes on node %s", sp.GetSnapshot(), it.pinned, name)
			default:
				it.pinned = name
			}
		}
		items[i] = it
	}
	defer r.countPlacements(items, out)
	// A keyed create first reads its claim: items a previous attempt
	// placed go where it placed them.
	ck := claimKey(keys)
	var cl *claim
	var rev int64
	if ck != "" {
		// The claim is in etcd: without it, fail now rather than after the
		// read's timeout.
		if err := r.state.Healthy(); err != nil {
			failAll(items, err)
			return out
		}
		var err error
		if cl, rev, err = r.claims.get(ctx, project, ck); err != nil {
			failAll(items, err)
			return out
		}
		if cl != nil && len(cl.Nodes) != len(specs) {
			failAll(items, errdefs.Conflict("idempotency key %q was used for a create of %d sandboxes, not %d", ck, len(cl.Nodes), len(specs)))
			return out
		}
		if cl != nil {
			for i, n := range cl.Nodes {
				if n != "" {
					items[i].pinned, items[i].node, items[i].adopted = n, n, true
				}
			}
		}
	}
	adopted := cl != nil
	if cl == nil && ck != "" {
		cl = &claim{Nodes: make([]string, len(specs))}
	}
	var todo, fresh []*item
	for _, it := range items {
		switch {
		case it.lastErr != nil:
			fail(it, it.lastErr)
		case it.node == "":
			fresh = append(fresh, it)
			todo = append(todo, it)
		default:
			todo = append(todo, it)
		}
	}
	// New placements need a reachable cluster store and the project's
	// quota; items a claim placed were admitted when first placed.
	if len(fresh) > 0 {
		if err := r.state.Healthy(); err != nil {
			failAll(fresh, err)
			todo = claimed(todo)
			fresh = nil
		}
	}
	if len(fresh) > 0 {
		allowed, release, err := r.admitQuota(project, len(fresh))
		defer release()
		if allowed < len(fresh) {
			failAll(fresh[allowed:], err)
			refused := map[*item]bool{}
			for _, it := range fresh[allowed:] {
				refused[it] = true
			}
			keep := todo[:0]
			for _, it := range todo {
				if !refused[it] {
					keep = append(keep, it)
				}
			}
			todo = keep
		}
	}
	v := r.state.view.Load()
	for attempt := 0; len(todo) > 0; attempt++ {
		// Place what has no node yet.
		placed := false
		for idx := 0; idx < len(todo); idx++ {
			it := todo[idx]
			if it.node != "" {
				continue
			}
			if it.pinned != "" {
				it.node = it.pinned
				continue
			}
			// Items of one batch spec go in runs of up to BatchRun to one
			// node: one call per run rather than per sandbox.
			run := []*item{it}
			for j := idx + 1; j < len(todo) && len(run) < r.cfg.BatchRun; j++ {
				o := todo[j]
				if o.node != "" || o.pinned != "" || o.spec != it.spec || len(o.exclude)+len(it.exclude) > 0 {
					break
				}
				run = append(run, o)
			}
			res, err := r.placer.PickN(v.nodes, placement.Request{
				Kind: kindOf(it.spec), Image: it.spec.GetImage(), Images: sidecarImages(it.spec), Selector: it.spec.GetNodeSelector(),
				Exclude: it.exclude, Project: project, Fetchable: v.fetchable(project),
			}, len(run))
			if err != nil {
				for _, o := range run {
					o.lastErr = err
				}
				idx += len(run) - 1
				continue
			}
			for j, rs := range res {
				run[j].node, run[j].res = rs.Node, rs
				if cl != nil {
					cl.Nodes[run[j].i] = rs.Node
				}
			}
			idx += len(res) - 1
			placed = true
		}
		var ready []*item
		for _, it := range todo {
			if it.node != "" {
				ready = append(ready, it)
			} else {
				fail(it, it.lastErr)
			}
		}
		todo = ready
		if len(todo) == 0 {
			break
		}
		// Record the placement before any node creates anything, so a retry
		// through another replica goes to the same nodes.
		if ck != "" && placed {
			newRev, ok, err := r.claims.put(ctx, project, ck, cl, rev)
			if err != nil || !ok {
				for _, it := range todo {
					if it.res != nil {
						it.res.Done(false, "", 0)
					}
				}
				if err == nil {
					err = errdefs.Conflict("a concurrent create with idempotency key %q is in progress; retry", ck)
					err.(*errdefs.Error).Retryable = true
				}
				failAll(todo, err)
				break
			}
			rev = newRev
		}
		retry := r.send(ctx, todo, project, out)
		todo = todo[:0]
		for _, it := range retry {
			if it.exclude == nil {
				it.exclude = map[string]string{}
			}
			it.exclude[it.node] = errdefs.Classify(it.lastErr).Msg
			it.node, it.res, it.pinned = "", nil, ""
			if cl != nil {
				cl.Nodes[it.i] = ""
			}
			if attempt+1 >= r.cfg.Attempts {
				fail(it, refused(it))
				continue
			}
			todo = append(todo, it)
		}
	}
	if adopted {
		if r.afterSend != nil {
			r.afterSend()
		}
		r.confirm(ctx, project, ck, cl, rev, items, out)
	}
	out.Created, out.Failed = 0, 0
	for _, res := range out.Results {
		switch {
		case res == nil:
		case res.Sandbox != nil:
			out.Created++
		default:
			out.Failed++
		}
	}
	return out
}

// confirm closes the race of a retried keyed create with the attempt it
// retries: that attempt may have moved an item the claim had on node X
// (X refused it) to node Y while this one, having read the old claim,
// created it on X. Rewriting the claim unchanged (compare-and-swap on the
// revision this create read or wrote) orders the two: if it succeeds, the
// other attempt's move fails and that attempt's client retries into this
// result; if it fails, the claim moved, and sandboxes this create made on
// nodes the claim no longer names are deleted and their items sent where
// the claim says (whose node returns the other attempt's sandbox).
func (r *Router) confirm(ctx context.Context, project, ck string, cl *claim, rev int64, items []*item, out *dsecv1.CreateSandboxesResponse) {
	if _, ok, err := r.claims.put(ctx, project, ck, cl, rev); err != nil || ok {
		return
	}
	cur, _, err := r.claims.get(ctx, project, ck)
	if err != nil || cur == nil || len(cur.Nodes) != len(items) {
		return
	}
	var redo []*item
	for _, it := range items {
		res := out.Results[it.i]
		if !it.adopted || res == nil || res.Sandbox == nil {
			continue
		}
		if want := cur.Nodes[it.i]; want != "" && want != res.Sandbox.Node {
			if rn, err := r.node(res.Sandbox.Node, "duplicate"); err == nil {
				if _, err := rn.DeleteSandbox(ctx, connect.NewRequest(&dsecv1.DeleteSandboxRequest{Id: res.Sandbox.Id})); err != nil {
					r.log.Warn("delete duplicate sandbox", slog.String("sandbox_id", res.Sandbox.Id), slog.Any("error", err))
				}
			}
			out.Results[it.i] = nil
			it.node, it.pinned, it.res = want, want, nil
			redo = append(redo, it)
		}
	}
	for _, it := range r.send(ctx, redo, project, out) {
		out.Results[it.i] = &dsecv1.CreateResult{Index: int32(it.i), Error: itemError(it.lastErr)}
	}
}

// claimed keeps the items a claim placed.
func claimed(items []*item) []*item {
	var out []*item
	for _, it := range items {
		if it.node != "" {
			out = append(out, it)
		}
	}
	return out
}

// kindOf is what a spec asks of a node's Kinds: its kind, or kind/runtime
// for another of the kind's runtimes.
func kindOf(spec *dsecv1.SandboxSpec) string {
	kind := spec.GetKind()
	if kind == "" {
		kind = "container"
	}
	if spec.GetRuntime() != "" {
		return kind + "/" + spec.GetRuntime()
	}
	return kind
}

// refused is the error of an item every node it was tried on refused: the
// class of the last refusal, and each node's reason.
func refused(it *item) error {
	names := make([]string, 0, len(it.exclude))
	for n := range it.exclude {
		names = append(names, n)
	}
	sort.Strings(names)
	var parts []string
	for _, n := range names {
		parts = append(parts, n+": refused: "+it.exclude[n])
	}
	e := *errdefs.Classify(it.lastErr)
	e.Msg = fmt.Sprintf("no node took this sandbox after %d attempts (%s)", len(names), strings.Join(parts, "; "))
	e.Cause = nil
	return &e
}

// countPlacements counts each item's placement once its create is
// answered: placed on the first node tried, retried (placed after a node
// refused it) or failed.
func (r *Router) countPlacements(items []*item, out *dsecv1.CreateSandboxesResponse) {
	if r.cfg.Metrics == nil {
		return
	}
	for _, it := range items {
		switch res := out.Results[it.i]; {
		case res == nil || res.Error != nil:
			r.cfg.Metrics.Placement(metrics.PlaceFailed)
		case len(it.exclude) > 0:
			r.cfg.Metrics.Placement(metrics.PlacedRetry)
		default:
			r.cfg.Metrics.Placement(metrics.Placed)
		}
	}
}

// send creates items on their nodes, each node's share in one call, all
// nodes at once. It fills out and returns the items a node refused that
// may go elsewhere.
func (r *Router) send(ctx context.Context, items []*item, project string, out *dsecv1.CreateSandboxesResponse) []*item {
	byNode := map[string][]*item{}
	for _, it := range items {
		byNode[it.node] = append(byNode[it.node], it)
	}
	var (
		mu    sync.Mutex
		wg    sync.WaitGroup
		retry []*item
	)
	one := len(byNode) == 1
	for name, share := range byNode {
		wg.Add(1)
		f := func() {
			defer wg.Done()
			results, inc, admitted, sent, err := r.createOn(ctx, name, share, project)
			mu.Lock()
			defer mu.Unlock()
			for j, it := range share {
				var ierr error
				var sb *dsecv1.Sandbox
				answered := err == nil
				if err != nil {
					ierr = err
				} else {
					sb, ierr = itemResult(results, j)
				}
				if it.res != nil {
					it.res.Done(ierr == nil, inc, admitted)
				}
				if ierr == nil {
					out.Results[it.i] = &dsecv1.CreateResult{Index: int32(it.i), Sandbox: sb}
					continue
				}
				it.lastErr = ierr
				if movable(it, ierr, answered, sent) {
					retry = append(retry, it)
					continue
				}
				out.Results[it.i] = &dsecv1.CreateResult{Index: int32(it.i), Error: itemError(ierr)}
				out.Failed++
			}
		}
		if one {
			f() // the common single create: no goroutine
		} else {
			go f()
		}
	}
	wg.Wait()
	return retry
}

// createOn sends a node its share of a create. sent is false when the
// request never left (no live node, or the connection was refused).
func (r *Router) createOn(ctx context.Context, name string, share []*item, project string) (_ *dsecv1.CreateSandboxesResponse, inc string, admitted uint64, sent bool, _ error) {
	rn, err := r.node(name, "placement")
	if err != nil {
		return nil, "", 0, false, err
	}
	specs := make([]*dsecv1.SandboxSpec, len(share))
	keys := make([]string, len(share))
	for j, it := range share {
		specs[j], keys[j] = it.spec, it.key
	}
	resp, err := rn.createOn(ctx, specs, keys, project)
	if err != nil {
		var op *net.OpError
		return nil, "", 0, !(errors.As(err, &op) && op.Op == "dial"), err
	}
	return resp.GetResult(), resp.GetIncarnation(), resp.GetAdmitted(), true, nil
}

// movable says whether an item a node did not create may go to another
// node: the node refused it (Refusal), or the request never reached it. A
// call that broke after it was sent may have created the sandbox.
func movable(it *item, err error, answered, sent bool) bool {
	if !answered {
		return !sent && !bound(it.spec)
	}
	return Refusal(it.spec, err)
}

// Refusal says whether err, a node's answer to an item's create, is one
// the router takes elsewhere: the node cannot take it (full, draining, a
// kind or the image missing there: the view was stale) and nothing binds
// the item to that node. A node fences the idempotency key of an item it
// refuses so (node.Fence) before it answers: a create of the key still on
// its way there, from a replica that died, cannot also make one.
func Refusal(spec *dsecv1.SandboxSpec, err error) bool {
	if bound(spec) {
		return false
	}
	switch errdefs.KindOf(err) {
	case errdefs.KindExhausted, errdefs.KindUnavailable, errdefs.KindNotFound:
		return true
	}
	return false
}

// bound says whether a spec can run on one node only: its snapshot's or
// its volumes'.
func bound(spec *dsecv1.SandboxSpec) bool {
	return spec.GetSnapshot() != "" || len(spec.GetVolumes()) > 0
}

// admitQuota admits up to n creates of project under its quotas and
// returns how many, a release to call once they are placed (the placer
// counts them from then on), and why the rest were refused.
func (r *Router) admitQuota(project string, n int) (int, func(), error) {
	q, ok, replicas := r.state.quota(project)
	if !ok || n == 0 {
		return n, func() {}, nil
	}
	r.qmu.Lock()
	defer r.qmu.Unlock()
	allowed := n
	var why error
	if q.MaxSandboxes > 0 {
		used := r.state.view.Load().totals[project] + r.placer.Local(project) + r.admitting[project]
		if room := q.MaxSandboxes - used; room < int64(allowed) {
			allowed = int(max(room, 0))
			why = errdefs.Exhausted(time.Second, "project %s is at its quota of %d sandboxes (%d running or starting)", project, q.MaxSandboxes, used)
		}
	}
	if q.CreatesPerS > 0 && allowed > 0 {
		b := r.buckets[project]
		rate := q.CreatesPerS / float64(replicas)
		burst := float64(q.Burst)
		if burst == 0 {
			burst = math.Ceil(q.CreatesPerS)
		}
		burst = max(1, math.Floor(burst/float64(replicas)))
		if b == nil {
			b = &bucket{tokens: burst, at: time.Now()}
			r.buckets[project] = b
		}
		got := b.take(allowed, rate, burst)
		if got < allowed {
			wait := time.Duration(float64(time.Second) / rate)
			why = errdefs.Exhausted(wait, "project %s is at its create rate quota of %g/s", project, q.CreatesPerS)
			allowed = got
		}
	}
	r.admitting[project] += int64(allowed)
	once := sync.Once{}
	return allowed, func() {
		once.Do(func() {
			r.qmu.Lock()
			if r.admitting[project] -= int64(allowed); r.admitting[project] <= 0 {
				delete(r.admitting, project)
			}
			r.qmu.Unlock()
		})
	}, why
}

// bucket is a token bucket of one project's create rate on this replica.
type bucket struct {
	tokens float64
	at     time.Time
}

func (b *bucket) take(n int, rate, burst float64) int {
	now := time.Now()
	b.tokens = min(burst, b.tokens+now.Sub(b.at).Seconds()*rate)
	b.at = now
	got := min(n, int(b.tokens))
	b.tokens -= float64(got)
	return got
}

// SpecImages are the images a spec's node must hold: its image (unless it
// starts from a snapshot), its composed layers' and its sidecars'.
func SpecImages(spec *dsecv1.SandboxSpec) []string {
	out := sidecarImages(spec)
	if spec.GetSnapshot() == "" && spec.GetImage() != "" {
		out = append(out, spec.GetImage())
	}
	return out
}

// sidecarImages are the images of a spec's sidecars and of its composed
// layers, which its node must hold too.
func sidecarImages(spec *dsecv1.SandboxSpec) []string {
	out := append([]string(nil), spec.GetLayers()...)
	for _, sc := range spec.GetSidecars() {
		out = append(out, sc.GetImage())
	}
	return out
}
