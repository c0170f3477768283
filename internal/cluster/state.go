package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/placement"
	"github.com/opendsec/dsec/internal/tenant"
)

// State is an apiserver replica's live view of the cluster state — nodes
// with their loads and drain marks, projects, API keys and replicas — kept
// by one watch. Every read is from memory: authentication and routing cost
// no etcd request, and a replica keeps routing to the nodes it knows while
// etcd is down. It is safe for concurrent use.
type State struct {
	s         *Store
	log       *slog.Logger
	static    apiserver.StaticKeys
	allowOpen bool

	mu       sync.RWMutex
	nodes    map[string]*NodeStatus
	projects map[string]Project
	keys     map[string]tenant.Caller // key hash → caller
	replicas map[string]bool
	onNode   []func(name string, n *NodeStatus) // called with mu not held, under hookMu, in event order
	runCtx   context.Context                    // Run's

	// hookMu orders the calls to onNode: a listener's first calls (the
	// nodes the view had when it registered) come before any change after.
	hookMu sync.Mutex

	pnodes map[string]*placement.Node // each node's placement entry, rebuilt when it changes (under mu)
	view   atomic.Pointer[view]
	lastOK atomic.Int64 // monotonic nanoseconds (since start) of the last answer from etcd
	start  time.Time
	synced chan struct{}
	once   sync.Once

	// The revision the view has applied, and a channel closed (and
	// replaced) whenever it advances.
	amu      sync.Mutex
	applied  int64
	advanced chan struct{}

	// This replica's acknowledgements of sync barriers (see Store.Sync).
	ackMu    sync.Mutex
	ackID    string           // this replica's ID ("" before it registered)
	ackLease clientv3.LeaseID // its registration's lease
	barrier  int64            // the newest barrier the view has applied
	acked    int64            // the newest barrier acknowledged under ackLease
	ackKick  chan struct{}
	joined   chan struct{}
	joinOnce sync.Once
}

// view is what placement reads, rebuilt after each batch of changes.
type view struct {
	nodes  []*placement.Node
	totals map[string]int64 // sandboxes by project over live nodes
}

// fetchable says, for project, whether a live node of v holds an image
// (its own or the shared one): a node lacking it can load it from there
// (clusternode's pull on demand).
func (v *view) fetchable(project string) func(image string) bool {
	return func(img string) bool {
		for _, n := range v.nodes {
			if !n.Lost && (n.Images[img] || n.Images[tenant.ImageKey(project, img)]) {
				return true
			}
		}
		return false
	}
}

var _ apiserver.Keys = (*State)(nil)

// NewState returns a view of the cluster state; Run keeps it. static are
// projects' keys given at start ("KEY" or "PROJECT=KEY") and admin
// operators' keys; allowOpen lets callers in without a key while no key
// exists at all (only for a loopback listener).
func (s *Store) NewState(static, admin []string, allowOpen bool, log *slog.Logger) (*State, error) {
	keys, err := apiserver.ParseKeys(static, admin)
	if err != nil {
		return nil, err
	}
	st := &State{
		s: s, log: log, static: keys, allowOpen: allowOpen,
		nodes: map[string]*NodeStatus{}, projects: map[string]Project{}, keys: map[string]tenant.Caller{}, replicas: map[string]bool{},
		pnodes: map[string]*placement.Node{}, start: time.Now(), synced: make(chan struct{}),
		advanced: make(chan struct{}), ackKick: make(chan struct{}, 1), joined: make(chan struct{}),
	}
	st.view.Store(&view{totals: map[string]int64{}})
	return st, nil
}

// OnNode registers f to be called whenever a node's entry changes (load,
// drain mark, registration, loss), first with every node the view has: a
// listener registered after Run read the state (a replica's router, when
// the first read was quick) misses none of them. Without that, a router
// whose nodes' entries did not change again saw none of them (a replica
// listed 0 of 3 live nodes for 30 s in CI).
func (st *State) OnNode(f func(name string, n *NodeStatus)) {
	st.hookMu.Lock()
	defer st.hookMu.Unlock()
	st.mu.Lock()
	st.onNode = append(st.onNode, f)
	nodes := maps.Clone(st.nodes)
	st.mu.Unlock()
	for name, n := range nodes {
		f(name, n)
	}
}

// runContext is Run's context: what the view's followers (the router's
// probes) live by.
func (st *State) runContext() context.Context {
	st.mu.RLock()
	defer st.mu.RUnlock()
	if st.runCtx == nil {
		return context.Background()
	}
	return st.runCtx
}

// Synced is closed once the first full read of the state is done.
func (st *State) Synced() <-chan struct{} { return st.synced }

// Joined is closed once this replica is registered (RunReplica) and its
// view includes its own registration: from then on, every write that
// waits for replicas (Store.Sync) waits for this one, so the replica may
// serve.
func (st *State) Joined() <-chan struct{} { return st.joined }

// Run keeps the view until ctx ends.
func (st *State) Run(ctx context.Context) {
	st.mu.Lock()
	st.runCtx = ctx
	st.mu.Unlock()
	go st.probe(ctx)
	go st.ackLoop(ctx)
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		rev, err := st.reload(ctx)
		if err != nil {
			st.log.Warn("read cluster state", slog.Any("error", err))
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 5*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
		st.once.Do(func() { close(st.synced) })
		if err := st.watch(ctx, rev); err != nil && ctx.Err() == nil {
			st.log.Warn("cluster state watch ended; reading it again", slog.Any("error", err))
		}
	}
}

func (st *State) ok() { st.lastOK.Store(int64(time.Since(st.start))) }

// Healthy returns nil while etcd answers, else an unavailable (infra) error
// saying since when it does not.
func (st *State) Healthy() error {
	last := time.Duration(st.lastOK.Load())
	if last == 0 {
		select {
		case <-st.synced:
		default:
			return errdefs.Unavailable("cluster store (etcd) not reached yet: placing no new sandboxes")
		}
	}
	if d := time.Since(st.start) - last; d > 3*time.Second {
		return errdefs.Unavailable("cluster store (etcd) unreachable for %s: placing no new sandboxes (calls to existing sandboxes still reach their nodes)", d.Round(time.Second))
	}
	return nil
}

// probe reads one key every second to know whether etcd answers (a watch
// alone stays silent through an outage).
func (st *State) probe(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := st.s.cli.Get(pctx, st.s.prefix+"health", clientv3.WithCountOnly())
		cancel()
		if err == nil {
			st.ok()
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// reload reads the whole cluster/ directory and replaces the view.
func (st *State) reload(ctx context.Context) (int64, error) {
	gctx, cancel := st.s.ctx(ctx)
	defer cancel()
	resp, err := st.s.cli.Get(gctx, st.s.prefix+dirCluster, clientv3.WithPrefix())
	if err != nil {
		return 0, unavailable(err, "read cluster state")
	}
	st.ok()
	st.mu.Lock()
	old := st.nodes
	st.nodes, st.projects, st.keys, st.replicas = map[string]*NodeStatus{}, map[string]Project{}, map[string]tenant.Caller{}, map[string]bool{}
	changed := map[string]bool{}
	for name := range old {
		changed[name] = true
	}
	var barrier int64
	for _, kv := range resp.Kvs {
		if name := st.applyLocked(mvccpb.PUT, kv); name != "" {
			changed[name] = true
		}
		if string(kv.Key) == st.s.prefix+keySync {
			barrier = kv.ModRevision
		}
	}
	st.mu.Unlock()
	st.publish(changed)
	st.advance(resp.Header.Revision, barrier)
	return resp.Header.Revision, nil
}

func (st *State) watch(ctx context.Context, rev int64) error {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for wr := range st.s.cli.Watch(wctx, st.s.prefix+dirCluster, clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
		if err := wr.Err(); err != nil {
			return err
		}
		st.ok()
		changed := map[string]bool{}
		var rev, barrier int64
		st.mu.Lock()
		for _, ev := range wr.Events {
			if name := st.applyLocked(ev.Type, ev.Kv); name != "" {
				changed[name] = true
			}
			rev = max(rev, ev.Kv.ModRevision)
			if ev.Type == mvccpb.PUT && string(ev.Kv.Key) == st.s.prefix+keySync {
				barrier = ev.Kv.ModRevision
			}
		}
		st.mu.Unlock()
		st.publish(changed)
		st.advance(rev, barrier)
	}
	return ctx.Err()
}

// advance records that the view (placement view, node clients, keys,
// quotas) includes every change up to revision rev, and barrier, the
// newest sync barrier among them (0 if none), which it acknowledges.
func (st *State) advance(rev, barrier int64) {
	st.amu.Lock()
	if rev > st.applied {
		st.applied = rev
		close(st.advanced)
		st.advanced = make(chan struct{})
	}
	st.amu.Unlock()
	if barrier == 0 {
		return
	}
	st.ackMu.Lock()
	st.barrier = max(st.barrier, barrier)
	st.ackMu.Unlock()
	st.kickAck()
}

// WaitApplied returns once the view includes every change up to revision
// rev, or with ctx's error.
func (st *State) WaitApplied(ctx context.Context, rev int64) error {
	for {
		st.amu.Lock()
		applied, ch := st.applied, st.advanced
		st.amu.Unlock()
		if applied >= rev {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// registered is told by RunReplica that this replica is registered as id
// under lease, by the write at revision rev.
func (st *State) registered(id string, lease clientv3.LeaseID, rev int64) {
	st.ackMu.Lock()
	st.ackID, st.ackLease, st.acked = id, lease, 0
	st.ackMu.Unlock()
	st.kickAck()
	go func() {
		if st.WaitApplied(context.Background(), rev) == nil {
			st.joinOnce.Do(func() { close(st.joined) })
		}
	}()
}

func (st *State) kickAck() {
	select {
	case st.ackKick <- struct{}{}:
	default:
	}
}

// ackLoop acknowledges the newest sync barrier the view has applied, under
// this replica's lease (acks/<id> = the barrier's revision), until ctx
// ends. Acknowledgements coalesce: one write covers every barrier up to
// it.
func (st *State) ackLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-st.ackKick:
		}
		for ctx.Err() == nil {
			st.ackMu.Lock()
			id, lease, want, done := st.ackID, st.ackLease, st.barrier, st.acked
			st.ackMu.Unlock()
			if id == "" || want <= done {
				break
			}
			pctx, cancel := st.s.ctx(ctx)
			_, err := st.s.cli.Put(pctx, st.s.key(dirAcks, id), strconv.FormatInt(want, 10), clientv3.WithLease(lease))
			cancel()
			if err == nil {
				st.ackMu.Lock()
				if st.ackLease == lease {
					st.acked = max(st.acked, want)
				}
				st.ackMu.Unlock()
				continue
			}
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				break // registering again; registered kicks
			}
			st.log.Warn("acknowledge sync barrier", slog.Any("error", err))
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// applyLocked applies one change and returns the node it concerns ("" if
// none).
func (st *State) applyLocked(typ mvccpb.Event_EventType, kv *mvccpb.KeyValue) string {
	k := strings.TrimPrefix(string(kv.Key), st.s.prefix)
	put := typ == mvccpb.PUT
	node := func(name string) *NodeStatus {
		n := st.nodes[name]
		if n == nil {
			n = &NodeStatus{Registration: Registration{Name: name}}
		} else {
			c := *n // copy on write: callers hold old pointers
			n = &c
		}
		st.nodes[name] = n
		return n
	}
	switch {
	case strings.HasPrefix(k, dirNodes):
		name := strings.TrimPrefix(k, dirNodes)
		if !put {
			delete(st.nodes, name)
			return name
		}
		n := node(name)
		json.Unmarshal(kv.Value, &n.Registration)
		n.Name = name
		return name
	case strings.HasPrefix(k, dirAlive):
		name := strings.TrimPrefix(k, dirAlive)
		n := node(name)
		n.Load = nil
		if put {
			l := &nodev1.Load{}
			if proto.Unmarshal(kv.Value, l) == nil {
				n.Load = l
				if n.Address == "" {
					n.Address = l.Address
				}
			}
		}
		return name
	case strings.HasPrefix(k, dirDrain):
		name := strings.TrimPrefix(k, dirDrain)
		node(name).Draining = put
		return name
	case strings.HasPrefix(k, dirProjects):
		name := strings.TrimPrefix(k, dirProjects)
		var p Project
		if put && json.Unmarshal(kv.Value, &p) == nil {
			st.projects[name] = p
		} else {
			delete(st.projects, name)
		}
	case strings.HasPrefix(k, dirKeys):
		h := strings.TrimPrefix(k, dirKeys)
		var r KeyRecord
		if put && json.Unmarshal(kv.Value, &r) == nil {
			st.keys[h] = tenant.Caller{Project: r.Project, Admin: r.Admin}
		} else {
			delete(st.keys, h)
		}
	case strings.HasPrefix(k, dirReplicas):
		id := strings.TrimPrefix(k, dirReplicas)
		if put {
			st.replicas[id] = true
		} else {
			delete(st.replicas, id)
		}
	}
	return ""
}

// publish rebuilds the placement view and tells listeners which nodes
// changed.
func (st *State) publish(changed map[string]bool) {
	if len(changed) == 0 {
		return
	}
	st.hookMu.Lock()
	defer st.hookMu.Unlock()
	st.mu.Lock()
	for name := range changed {
		if n := st.nodes[name]; n != nil {
			st.pnodes[name] = placementNode(n)
		} else {
			delete(st.pnodes, name)
		}
	}
	v := &view{totals: map[string]int64{}, nodes: make([]*placement.Node, 0, len(st.pnodes))}
	for _, pn := range st.pnodes {
		v.nodes = append(v.nodes, pn)
	}
	sort.Slice(v.nodes, func(i, j int) bool { return v.nodes[i].Name < v.nodes[j].Name })
	for _, n := range st.nodes {
		if n.Load != nil {
			for p, c := range n.Load.Projects {
				v.totals[p] += c
			}
		}
	}
	type call struct {
		name string
		n    *NodeStatus
	}
	var calls []call
	for name := range changed {
		calls = append(calls, call{name, st.nodes[name]})
	}
	hooks := st.onNode
	st.mu.Unlock()
	st.view.Store(v)
	for _, c := range calls {
		for _, f := range hooks {
			f(c.name, c.n)
		}
	}
}

func placementNode(n *NodeStatus) *placement.Node {
	p := &placement.Node{Name: n.Name, Lost: n.Load == nil, Draining: n.Draining, Labels: n.Labels}
	if l := n.Load; l != nil {
		p.Draining = p.Draining || l.Draining
		p.Sandboxes, p.MaxSandboxes = l.Sandboxes, l.MaxSandboxes
		p.Incarnation, p.Admitted = l.Incarnation, l.Admitted
		p.Kinds = make(map[string]bool, len(l.Kinds))
		for _, k := range l.Kinds {
			p.Kinds[k] = true
		}
		p.Images = make(map[string]bool, len(l.Images))
		for _, img := range l.Images {
			p.Images[img] = true
		}
		if len(l.Labels) > 0 {
			p.Labels = l.Labels
		}
	}
	return p
}

// Node returns a node's entry (nil if the cluster never had it).
func (st *State) Node(name string) *NodeStatus {
	st.mu.RLock()
	defer st.mu.RUnlock()
	return st.nodes[name]
}

// Caller returns the caller an API key authenticates (apiserver.Keys).
func (st *State) Caller(key string) (tenant.Caller, bool) {
	if key == "" {
		return tenant.Caller{}, false
	}
	if c, ok := st.static.Caller(key); ok {
		return c, true
	}
	st.mu.RLock()
	defer st.mu.RUnlock()
	c, ok := st.keys[HashKey(key)]
	return c, ok
}

// Open reports whether callers need no key: only when allowed and no key
// exists at all.
func (st *State) Open() bool {
	if !st.allowOpen || !st.static.Open() {
		return false
	}
	st.mu.RLock()
	defer st.mu.RUnlock()
	return len(st.keys) == 0
}

// quota returns a project's quotas and the number of replicas sharing its
// create rate.
func (st *State) quota(project string) (Project, bool, int) {
	st.mu.RLock()
	defer st.mu.RUnlock()
	p, ok := st.projects[project]
	return p, ok, max(1, len(st.replicas))
}
