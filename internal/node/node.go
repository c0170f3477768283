// Package node is the node agent: it owns the sandboxes on one host. It
// validates and admits creates, runs them on the substrate drivers, keeps
// every sandbox in an embedded store so a restarted node re-adopts running
// sandboxes, enforces TTLs, and serves exec and file calls through each
// sandbox's agent.
//
// Sandbox IDs encode the owning node ("<random>-<node>"), so the control
// plane routes any call without a lookup.
package node

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
	"github.com/opendsec/dsec/internal/trajectory"
	"github.com/opendsec/dsec/internal/undo"
)

// Config configures a node. The zero value works once DataDir is set and a
// driver is registered.
type Config struct {
	// Name is the node's name, a DNS label that sandbox IDs carry (default
	// "local").
	Name string
	// DataDir holds the store, images and sandbox directories (required).
	DataDir string
	// CacheDir keeps bootstrapped root filesystems across data directories
	// (default DataDir/cache).
	CacheDir string
	// MaxSandboxes is the node's final admission limit (default 4096).
	MaxSandboxes int
	// DefaultTTL applies when a create gives none (default 1h); MaxTTL
	// caps every TTL (default 7 days).
	DefaultTTL, MaxTTL time.Duration
	// Defaults and limits for resources.
	DefaultCPU      float64 // default 1
	MaxCPU          float64 // default: the host's cores
	DefaultMemoryMB int64   // default 512
	MaxMemoryMB     int64   // default: the host's memory
	DefaultPids     int64   // default 1024
	MaxPids         int64   // default 65536
	// DefaultExecTimeout applies to exec calls without one (default 10m);
	// MaxExecTimeout caps them (default 24h).
	DefaultExecTimeout, MaxExecTimeout time.Duration
	// DefaultOutputBytes caps each output stream of an exec (default 1 MiB);
	// MaxOutputBytes caps what a call may ask for (default 64 MiB).
	DefaultOutputBytes, MaxOutputBytes int64
	// Tombstones keeps deleted sandboxes, and their trajectory logs,
	// answerable for this long (default 24h).
	Tombstones time.Duration
	// ReapInterval is how often TTLs are checked (default 1s).
	ReapInterval time.Duration
	// MaxConcurrentStarts bounds sandbox starts in flight (default 2 per
	// core); StartQueue bounds creates waiting for a start (default 1024).
	MaxConcurrentStarts, StartQueue int
	// Pools are warm pools of started sandboxes (default none).
	Pools []PoolConfig
	// Credentials are the brokered credentials policies may name, by
	// name (default none).
	Credentials map[string]NamedCredential
}

func (c *Config) defaults() {
	if c.Name == "" {
		c.Name = "local"
	}
	if c.CacheDir == "" {
		c.CacheDir = filepath.Join(c.DataDir, "cache")
	}
	if c.MaxSandboxes == 0 {
		c.MaxSandboxes = 4096
	}
	if c.DefaultTTL == 0 {
		c.DefaultTTL = time.Hour
	}
	if c.MaxTTL == 0 {
		c.MaxTTL = 7 * 24 * time.Hour
	}
	if c.DefaultCPU == 0 {
		c.DefaultCPU = 1
	}
	if c.MaxCPU == 0 {
		c.MaxCPU = float64(hostCPUs())
	}
	if c.DefaultMemoryMB == 0 {
		c.DefaultMemoryMB = 512
	}
	if c.MaxMemoryMB == 0 {
		c.MaxMemoryMB = hostMemoryMB()
	}
	if c.DefaultPids == 0 {
		c.DefaultPids = 1024
	}
	if c.MaxPids == 0 {
		c.MaxPids = 65536
	}
	if c.DefaultExecTimeout == 0 {
		c.DefaultExecTimeout = 10 * time.Minute
	}
	if c.MaxExecTimeout == 0 {
		c.MaxExecTimeout = 24 * time.Hour
	}
	if c.DefaultOutputBytes == 0 {
		c.DefaultOutputBytes = 1 << 20
	}
	if c.MaxOutputBytes == 0 {
		c.MaxOutputBytes = 64 << 20
	}
	if c.Tombstones == 0 {
		c.Tombstones = 24 * time.Hour
	}
	if c.MaxConcurrentStarts == 0 {
		c.MaxConcurrentStarts = 2 * hostCPUs()
	}
	if c.StartQueue == 0 {
		c.StartQueue = 1024
	}
	if c.ReapInterval == 0 {
		c.ReapInterval = time.Second
	}
}

// ValidName reports whether name can name a node.
func ValidName(name string) error { return sandboxid.ValidNode(name) }

// Node owns the sandboxes of one host.
type Node struct {
	cfg     Config
	log     *slog.Logger
	store   *store
	images  *image.Store
	net     *network.Manager
	drivers map[substrate.Kind]substrate.Driver
	started time.Time

	// creating counts admitted creates still starting, for admission;
	// admitted counts every create admitted since start (see Load).
	creating atomic.Int64
	admitted atomic.Uint64
	changed  chan struct{}  // signalled when the load changes (see LoadChanged)
	pinned   map[string]int // ephemeral snapshots held by forks in flight

	starts *admission // start slots and the fair-share queue
	pools  *pools
	logs   *trajectory.Store

	mu        sync.Mutex
	sandboxes map[string]*sandbox
	reserved  map[string]*sandbox      // starting or pooled: not live yet, layers in use
	idemWait  map[string]chan struct{} // creates in flight by idempotency key
	starting  map[string]int           // admitted creates still starting, by project

	trash chan string // sandbox directories to remove
	stop  chan struct{}
	wg    sync.WaitGroup
}

// sandbox is a live sandbox.
type sandbox struct {
	id      string
	spec    *dsecv1.SandboxSpec
	created time.Time
	image   string
	layers  []string
	net     *network.Attachment
	dir     string
	idemKey string
	project string // the project that created it (quotas count by it)

	// lastActive is the unix nano time of the last API call.
	lastActive atomic.Int64
	oomKills   atomic.Int64
	pidsHits   atomic.Int64

	mu      sync.Mutex
	state   string // running, paused, deleting
	expires time.Time
	inst    substrate.Instance
	rec     *record
	// network is the sandbox's network since a SetNetworkPolicy (nil:
	// spec.network), credentials' values included.
	network *dsecv1.Network
}

func (s *sandbox) touch() { s.lastActive.Store(time.Now().UnixNano()) }

// New opens a node over its data directory. Drivers are registered by kind;
// a kind without a driver is reported unavailable.
func New(cfg Config, log *slog.Logger, images *image.Store, net *network.Manager, drivers map[substrate.Kind]substrate.Driver) (*Node, error) {
	if cfg.DataDir == "" {
		return nil, fmt.Errorf("node needs a data directory")
	}
	cfg.defaults()
	if err := ValidName(cfg.Name); err != nil {
		return nil, err
	}
	for _, d := range []string{"sandboxes", "trash", "snapshots"} {
		if err := os.MkdirAll(filepath.Join(cfg.DataDir, d), 0o700); err != nil {
			return nil, err
		}
	}
	st, err := openStore(filepath.Join(cfg.DataDir, "node.db"))
	if err != nil {
		return nil, err
	}
	n := &Node{
		cfg: cfg, log: log.With(slog.String("node", cfg.Name)), store: st, images: images, net: net,
		drivers: drivers, started: time.Now(), sandboxes: map[string]*sandbox{}, reserved: map[string]*sandbox{}, idemWait: map[string]chan struct{}{}, pinned: map[string]int{},
		starting: map[string]int{}, changed: make(chan struct{}, 1),
		starts: newAdmission(cfg.MaxConcurrentStarts, cfg.StartQueue),
		trash:  make(chan string, 1024), stop: make(chan struct{}),
	}
	logs, err := trajectory.Open(filepath.Join(cfg.DataDir, "trajectories"))
	if err != nil {
		st.close()
		return nil, err
	}
	n.logs = logs
	images.SetInUse(n.layersInUse)
	n.adopt()
	n.releaseUnusedSnapshots()
	n.removeOrphanSnapshotDirs()
	n.pools = newPools(n, cfg.Pools)
	n.wg.Add(1)
	go n.reaper()
	go n.emptyTrash()
	return n, nil
}

// Name is the node's name.
func (n *Node) Name() string { return n.cfg.Name }

// DataDir is the node's data directory.
func (n *Node) DataDir() string { return n.cfg.DataDir }

// Images is the node's image store.
func (n *Node) Images() *image.Store { return n.images }

// Close stops the node's background work and closes its store. Sandboxes
// keep running; a new node over the same data directory re-adopts them.
func (n *Node) Close() error {
	close(n.stop)
	n.pools.close()
	n.wg.Wait()
	n.logs.Close()
	return n.store.close()
}

// newID returns "<16 random base32 chars>-<node>".
func (n *Node) newID() string { return sandboxid.New(n.cfg.Name) }

// NodeOf returns the node name a sandbox ID encodes.
func NodeOf(id string) (string, error) { return sandboxid.Node(id) }

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

func (n *Node) layersInUse() map[string]bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := map[string]bool{}
	for _, m := range []map[string]*sandbox{n.sandboxes, n.reserved} {
		for _, s := range m {
			for _, l := range s.layers {
				out[l] = true
			}
		}
	}
	return out
}

// find returns the live sandbox id names, or else its tombstone, as ctx's
// caller sees them: a sandbox of another project is not found, live or
// deleted, with the very error an unknown ID gets. Every call that takes a
// sandbox ID from a caller goes through find (lookup, live, Get, Delete,
// the log): it is the node's one ownership check.
func (n *Node) find(ctx context.Context, id string) (*sandbox, *record, error) {
	n.mu.Lock()
	s := n.sandboxes[id]
	n.mu.Unlock()
	if s != nil {
		if !tenant.Reaches(ctx, s.project) {
			return nil, nil, notFound(id)
		}
		return s, nil, nil
	}
	if node, err := NodeOf(id); err != nil {
		return nil, nil, err
	} else if node != n.cfg.Name {
		return nil, nil, errdefs.NotFound("sandbox %s belongs to node %q, not %q", id, node, n.cfg.Name)
	}
	if t, ok := n.store.tombstone(id); ok && tenant.Reaches(ctx, t.Project) {
		return nil, t, nil
	}
	return nil, nil, notFound(id)
}

// notFound is the answer for a sandbox ID the caller cannot see.
func notFound(id string) error { return errdefs.NotFound("sandbox %s not found", id) }

// lookup returns a live sandbox, or the error for a gone or unknown one.
func (n *Node) lookup(ctx context.Context, id string) (*sandbox, error) {
	s, t, err := n.find(ctx, id)
	switch {
	case err != nil:
		return nil, err
	case s != nil:
		return s, nil
	case t.Infra:
		return nil, errdefs.Gone("sandbox %s is gone: %s", id, t.Reason)
	default:
		return nil, errdefs.NotFound("sandbox %s was deleted: %s", id, t.Reason)
	}
}

// live returns a sandbox ready for a call, touching its idle timer.
func (n *Node) live(ctx context.Context, id string) (*sandbox, error) {
	s, err := n.lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	state, inst := s.state, s.inst
	s.mu.Unlock()
	if state == stateDeleting || inst == nil {
		return nil, errdefs.NotFound("sandbox %s is being deleted", id)
	}
	if state == statePaused {
		// Any call on a paused sandbox resumes it first.
		if err := n.resume(context.Background(), s); err != nil {
			return nil, err
		}
	}
	s.touch()
	return s, nil
}

// deadlineGrace is how long after its TTL a sandbox ends itself if the node
// has not deleted it (the node normally does, on time).
const deadlineGrace = time.Minute

const (
	stateRunning  = "running"
	statePaused   = "paused"
	stateDeleting = "deleting"
	stateDeleted  = "deleted"
	stateFailed   = "failed"
)

// SessionLabel is the label binding a sandbox to a trainer session.
const SessionLabel = "dsec.io/session"

// Create validates, admits and starts a sandbox.
func (n *Node) Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error) {
	return n.create(ctx, req.GetSpec(), req.GetIdempotencyKey(), req.GetProject(), nil)
}

// create is Create with labels the node itself adds (reserved ones). The
// sandbox belongs to project, whose images (and the shared ones) it may
// start from.
func (n *Node) create(ctx context.Context, in *dsecv1.SandboxSpec, key, project string, extra map[string]string) (*dsecv1.Sandbox, error) {
	project = projectOr(project)
	spec := proto.Clone(in).(*dsecv1.SandboxSpec)
	if in == nil {
		spec = &dsecv1.SandboxSpec{}
	}
	img, err := n.normalize(project, spec)
	if err != nil {
		return nil, err
	}
	if len(extra) > 0 {
		if spec.Labels == nil {
			spec.Labels = map[string]string{}
		}
		for k, v := range extra {
			spec.Labels[k] = v
		}
	}
	if len(key) > 256 {
		return nil, errdefs.Invalid("idempotency key longer than 256 bytes")
	}
	if key != "" {
		key = idemKey(project, key)
		release, existing, err := n.claimKey(ctx, key)
		if err != nil {
			return nil, err
		}
		if existing != "" {
			return n.Get(tenant.With(ctx, tenant.Caller{Project: project}), existing)
		}
		defer release()
	}
	if err := n.admit(project); err != nil {
		return nil, err
	}
	defer n.admitDone(project)
	var s *sandbox
	if img.Owner == tenant.Shared {
		// Pools hold shared images only.
		s = n.take(spec, project)
	}
	if s == nil {
		release, err := n.starts.acquire(ctx, project)
		if err != nil {
			return nil, err
		}
		s, err = n.prepare(ctx, spec, img, project)
		release()
		if err != nil {
			return nil, err
		}
	}
	s.idemKey, s.project = key, project
	if err := n.commit(ctx, s); err != nil {
		n.unreserve(s)
		s.inst.Destroy(context.WithoutCancel(ctx))
		n.net.Release(s.net)
		n.discardDir(s.dir)
		return nil, err
	}
	return n.view(s), nil
}

// idemKey is a project's idempotency key in the node's store: keys of
// different projects never meet.
func idemKey(project, key string) string {
	if project == tenant.DefaultProject {
		return key // as stores before projects had their own keys
	}
	return project + "\x00" + key
}

func projectOr(p string) string {
	if p == "" {
		return "default"
	}
	return p
}

// claimKey makes one create per idempotency key proceed; a concurrent or
// later create with the key gets the first one's sandbox.
func (n *Node) claimKey(ctx context.Context, key string) (release func(), existing string, err error) {
	for {
		if id, ok := n.store.idem(key); ok {
			return nil, id, nil
		}
		n.mu.Lock()
		wait, busy := n.idemWait[key]
		if !busy {
			done := make(chan struct{})
			n.idemWait[key] = done
			n.mu.Unlock()
			return func() {
				n.mu.Lock()
				delete(n.idemWait, key)
				n.mu.Unlock()
				close(done)
			}, "", nil
		}
		n.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, "", errdefs.Classify(ctx.Err())
		}
	}
}

// admit is the node's final admission: it refuses creates beyond its
// sandbox limit with a retryable exhausted error. An admitted create ends
// with admitDone.
func (n *Node) admit(project string) error {
	n.mu.Lock()
	live := len(n.sandboxes)
	n.mu.Unlock()
	if int(n.creating.Add(1))+live > n.cfg.MaxSandboxes {
		n.creating.Add(-1)
		return errdefs.Exhausted(5*time.Second, "node %s is full (%d sandboxes)", n.cfg.Name, n.cfg.MaxSandboxes)
	}
	n.admitted.Add(1)
	n.mu.Lock()
	n.starting[project]++
	n.mu.Unlock()
	n.loadChanged()
	return nil
}

// admitDone ends an admitted create, started or not.
func (n *Node) admitDone(project string) {
	n.mu.Lock()
	if n.starting[project]--; n.starting[project] <= 0 {
		delete(n.starting, project)
	}
	n.mu.Unlock()
	n.creating.Add(-1)
	n.loadChanged()
}

// prepare starts a sandbox's resources (directory, network, instance) for
// spec, from img (what normalize resolved), and reserves it, without
// registering it as live. On error nothing is left.
func (n *Node) prepare(ctx context.Context, spec *dsecv1.SandboxSpec, img *image.Image, project string) (_ *sandbox, err error) {
	kind := substrate.Kind(spec.Kind)
	drv := n.drivers[kind]
	var u undo.Stack
	defer u.RunUnless(&err)
	id := n.newID()
	dir := filepath.Join(n.cfg.DataDir, "sandboxes", id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, errdefs.Internal(err, "create sandbox directory")
	}
	u.Push(func() { n.discardDir(dir) })
	opts, err := n.netOptions(project, spec)
	if err != nil {
		return nil, err
	}
	att, err := n.net.Setup(ctx, id, opts)
	if err != nil {
		return nil, err
	}
	u.Push(func() { n.net.Release(att) })
	s := &sandbox{
		id: id, spec: spec, created: time.Now().UTC(), image: img.Key(), layers: img.Layers,
		net: att, dir: dir, state: stateRunning,
		expires: time.Now().Add(time.Duration(spec.TtlS) * time.Second),
	}
	s.touch()
	// Reserved first so image GC keeps the layers while the sandbox starts.
	n.reserve(s)
	u.Push(func() { n.unreserve(s) })
	inst, err := drv.Create(ctx, n.driverSpec(s, img))
	if err != nil {
		n.log.Warn("sandbox start failed", slog.String("sandbox_id", id), slog.Any("error", err))
		return nil, err
	}
	s.inst = inst
	return s, nil
}

// commit makes a prepared sandbox live: persisted, listed and watched.
func (n *Node) commit(ctx context.Context, s *sandbox) error {
	s.rec = n.recordOf(s)
	if err := n.store.put(s.rec); err != nil {
		return errdefs.Internal(err, "persist sandbox")
	}
	n.mu.Lock()
	delete(n.reserved, s.id)
	n.sandboxes[s.id] = s
	n.mu.Unlock()
	n.watch(s)
	n.log.Debug("sandbox created", slog.String("sandbox_id", s.id), slog.String("image", s.image))
	return nil
}

func (n *Node) reserve(s *sandbox) {
	n.mu.Lock()
	n.reserved[s.id] = s
	n.mu.Unlock()
}

func (n *Node) unreserve(s *sandbox) {
	n.mu.Lock()
	delete(n.reserved, s.id)
	n.mu.Unlock()
}

// imageOf is the image a spec starts from: its snapshot, else its image.
func imageOf(spec *dsecv1.SandboxSpec) string {
	if spec.Snapshot != "" {
		return spec.Snapshot
	}
	return spec.Image
}

func (n *Node) driverSpec(s *sandbox, img *image.Image) *substrate.Spec {
	env := append([]string(nil), img.Config.Env...)
	keys := make([]string, 0, len(s.spec.Env))
	for k := range s.spec.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+s.spec.Env[k])
	}
	ds := &substrate.Spec{
		ID: s.id, Dir: s.dir, Layers: n.images.LowerDirs(img), Env: env,
		User: s.spec.User, Workdir: s.spec.Workdir, Hostname: "sandbox",
		CPU: s.spec.Resources.GetCpu(), MemoryMB: s.spec.Resources.GetMemoryMb(),
		DiskMB: s.spec.Resources.GetDiskMb(), Pids: s.spec.Resources.GetPids(),
		Labels: s.spec.Labels, Deadline: s.expires.Add(deadlineGrace),
	}
	if s.net != nil {
		ds.Network = substrate.Network{Mode: s.net.Mode, NetNS: s.net.NetNS, ResolvConf: s.net.ResolvConf}
	}
	if img.Snapshot != nil && img.Snapshot.Machine {
		ds.Restore = n.snapshotDir(img.Name)
	}
	return ds
}

func (n *Node) recordOf(s *sandbox) *record {
	specJSON, _ := protojson.Marshal(s.spec)
	s.mu.Lock()
	defer s.mu.Unlock()
	r := &record{
		ID: s.id, Kind: s.spec.Kind, Image: s.image, Spec: specJSON, Layers: s.layers,
		Created: s.created, Expires: s.expires, State: s.state, Network: attachmentJSON(s.net), IdemKey: s.idemKey,
		Project: s.project, NetPolicy: networkRecord(s.network),
	}
	if s.inst != nil {
		r.Driver = s.inst.State()
	}
	return r
}

// watch reacts to a sandbox's instance stopping by itself.
func (n *Node) watch(s *sandbox) {
	inst := s.inst
	go func() {
		select {
		case <-inst.Done():
		case <-n.stop:
			return
		}
		s.mu.Lock()
		deleting := s.state == stateDeleting
		s.mu.Unlock()
		if !deleting {
			reason := "the sandbox's init exited (crashed or killed)"
			attrs := []any{slog.String("sandbox_id", s.id)}
			if d, ok := inst.(substrate.Diagnoser); ok {
				if w := d.LastWords(); w != "" {
					reason += ": " + w
					attrs = append(attrs, slog.String("last_words", w))
				}
			}
			n.log.Warn("sandbox stopped by itself", attrs...)
			n.remove(context.Background(), s, reason, true)
		}
	}()
}

// Get returns a sandbox's status, live or remembered.
func (n *Node) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	s, t, err := n.find(ctx, id)
	switch {
	case err != nil:
		return nil, err
	case s != nil:
		return n.view(s), nil
	default:
		return n.tombstoneView(t), nil
	}
}

func (n *Node) view(s *sandbox) *dsecv1.Sandbox {
	s.mu.Lock()
	defer s.mu.Unlock()
	state := s.state
	if state == stateDeleting {
		state = stateDeleted
	}
	return &dsecv1.Sandbox{
		Id: s.id, Node: n.cfg.Name, State: state, Spec: s.shownSpecLocked(),
		CreatedAt:    timestamppb.New(s.created),
		ExpiresAt:    timestamppb.New(s.expires),
		LastActiveAt: timestamppb.New(time.Unix(0, s.lastActive.Load())),
	}
}

func (n *Node) tombstoneView(t *record) *dsecv1.Sandbox {
	spec := &dsecv1.SandboxSpec{}
	protojson.Unmarshal(t.Spec, spec)
	if nw := networkFromRecord(t.NetPolicy); nw != nil {
		spec.Network = nw
	}
	spec.Network = redacted(spec.Network)
	return &dsecv1.Sandbox{
		Id: t.ID, Node: n.cfg.Name, State: t.State, Reason: t.Reason, Spec: spec,
		CreatedAt: timestamppb.New(t.Created), ExpiresAt: timestamppb.New(t.Deleted),
	}
}

// List lists the live sandboxes the caller sees (its project's; an
// operator's: all) matching the request's selector and state.
func (n *Node) List(ctx context.Context, req *dsecv1.ListSandboxesRequest) (*dsecv1.ListSandboxesResponse, error) {
	sel, err := ParseSelector(req.GetLabelSelector())
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	all := make([]*sandbox, 0, len(n.sandboxes))
	for _, s := range n.sandboxes {
		if s.inst != nil && tenant.Reaches(ctx, s.project) && sel.Matches(s.spec.Labels) {
			all = append(all, s)
		}
	}
	n.mu.Unlock()
	sort.Slice(all, func(i, j int) bool {
		if !all[i].created.Equal(all[j].created) {
			return all[i].created.Before(all[j].created)
		}
		return all[i].id < all[j].id
	})
	out := &dsecv1.ListSandboxesResponse{}
	for _, s := range all {
		v := n.view(s)
		if req.GetState() != "" && v.State != req.GetState() {
			continue
		}
		out.Sandboxes = append(out.Sandboxes, v)
	}
	return paginate(out, req.GetPageSize(), req.GetPageToken())
}

// Delete deletes a sandbox. Deleting a deleted or unknown sandbox of this
// node (or one the caller cannot see) succeeds and does nothing.
func (n *Node) Delete(ctx context.Context, id string) error {
	s, _, err := n.find(ctx, id)
	if err != nil {
		if errdefs.Is(err, errdefs.KindNotFound) {
			return nil
		}
		return err
	}
	if s == nil {
		return nil
	}
	return n.remove(ctx, s, "deleted by the user", false)
}

// remove destroys a sandbox and leaves a tombstone. infra marks ends that
// were the platform's doing (crash, eviction), which later calls report as
// a gone (infra) error rather than not found.
func (n *Node) remove(ctx context.Context, s *sandbox, reason string, infra bool) error {
	s.mu.Lock()
	if s.state == stateDeleting {
		s.mu.Unlock()
		return nil
	}
	prev := s.state
	s.state = stateDeleting
	inst := s.inst
	s.mu.Unlock()
	ctx = context.WithoutCancel(ctx)
	if inst != nil {
		if err := inst.Destroy(ctx); err != nil {
			n.log.Error("destroy sandbox", slog.String("sandbox_id", s.id), slog.Any("error", err))
			s.mu.Lock()
			s.state = prev
			s.mu.Unlock()
			return errdefs.Internal(err, "delete sandbox %s", s.id)
		}
	}
	n.net.Release(s.net)
	n.discardDir(s.dir)
	rec := s.rec
	if rec == nil {
		rec = n.recordOf(s)
	}
	t := *rec
	t.State, t.Reason, t.Deleted, t.Infra, t.Driver = stateDeleted, reason, time.Now().UTC(), infra, nil
	if infra {
		t.State = stateFailed
	}
	if err := n.store.bury(&t); err != nil {
		n.log.Error("persist sandbox deletion", slog.String("sandbox_id", s.id), slog.Any("error", err))
	}
	n.mu.Lock()
	delete(n.sandboxes, s.id)
	n.mu.Unlock()
	n.loadChanged()
	n.logs.Forget(s.id)
	n.releaseSnapshot(s.image)
	n.log.Debug("sandbox deleted", slog.String("sandbox_id", s.id), slog.String("reason", reason))
	return nil
}

// discardDir moves a sandbox directory to the trash, emptied in the
// background so a large writable layer does not delay the caller.
func (n *Node) discardDir(dir string) {
	dst := filepath.Join(n.cfg.DataDir, "trash", filepath.Base(dir)+"-"+fmt.Sprint(time.Now().UnixNano()))
	if err := os.Rename(dir, dst); err != nil {
		os.RemoveAll(dir)
		return
	}
	select {
	case n.trash <- dst:
	default:
		// The emptier is busy; it will find this one on its next pass.
	}
}

func (n *Node) emptyTrash() {
	dir := filepath.Join(n.cfg.DataDir, "trash")
	sweep := func() {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
	sweep()
	tick := time.NewTicker(30 * time.Second)
	defer tick.Stop()
	for {
		select {
		case p := <-n.trash:
			os.RemoveAll(p)
		case <-tick.C:
			sweep()
		case <-n.stop:
			return
		}
	}
}

// Keepalive resets the idle timer and optionally extends the TTL.
func (n *Node) Keepalive(ctx context.Context, req *dsecv1.KeepaliveRequest) (*dsecv1.Sandbox, error) {
	s, err := n.live(ctx, req.GetId())
	if err != nil {
		return nil, err
	}
	if ext := req.GetExtendTtlS(); ext != 0 {
		if ext < 0 || ext > int64(n.cfg.MaxTTL/time.Second) { // in seconds: no Duration overflow
			return nil, errdefs.Invalid("extend_ttl_s must be between 1 and %d", int64(n.cfg.MaxTTL.Seconds()))
		}
		s.mu.Lock()
		s.expires = time.Now().Add(time.Duration(ext) * time.Second)
		exp := s.expires
		s.mu.Unlock()
		if err := s.inst.Guest().SetDeadline(ctx, exp.Add(deadlineGrace)); err != nil {
			return nil, n.callFailed(s, err)
		}
		s.rec = n.recordOf(s)
		if err := n.store.put(s.rec); err != nil {
			return nil, errdefs.Internal(err, "persist sandbox")
		}
	}
	return n.view(s), nil
}

// reaper deletes sandboxes whose TTL or idle TTL passed, and forgets old
// tombstones.
func (n *Node) reaper() {
	defer n.wg.Done()
	tick := time.NewTicker(n.cfg.ReapInterval)
	defer tick.Stop()
	lastPurge := time.Now()
	for {
		select {
		case <-n.stop:
			return
		case now := <-tick.C:
			n.mu.Lock()
			var expired []*sandbox
			var reasons []string
			for _, s := range n.sandboxes {
				s.mu.Lock()
				exp, state, inst := s.expires, s.state, s.inst
				s.mu.Unlock()
				if inst == nil || state == stateDeleting {
					continue
				}
				idle := time.Duration(s.spec.IdleTtlS) * time.Second
				if state == statePaused {
					idle = 0 // a paused sandbox waits for its trainer, not for calls
				}
				switch {
				case now.After(exp):
					expired, reasons = append(expired, s), append(reasons, "ttl expired")
				case idle > 0 && now.Sub(time.Unix(0, s.lastActive.Load())) > idle:
					expired, reasons = append(expired, s), append(reasons, "idle ttl expired")
				}
			}
			n.mu.Unlock()
			for i, s := range expired {
				// TTL ends are the configured lifetime, reported as gone:
				// the sandbox vanished from under whoever was using it.
				n.remove(context.Background(), s, reasons[i], true)
			}
			if now.Sub(lastPurge) > time.Minute {
				lastPurge = now
				ids, _ := n.store.purge(now.Add(-n.cfg.Tombstones))
				for _, id := range ids {
					n.logs.Remove(id)
				}
				if len(ids) > 0 {
					n.logs.GCBlobs()
				}
			}
		}
	}
}

// adopt re-attaches the sandboxes a previous process of this node left
// running, and cleans up those that stopped meanwhile.
func (n *Node) adopt() {
	recs, err := n.store.live()
	if err != nil {
		n.log.Error("read sandbox records", slog.Any("error", err))
		return
	}
	known := map[string]bool{}
	for _, r := range recs {
		known[r.ID] = true
		spec := &dsecv1.SandboxSpec{}
		if err := protojson.Unmarshal(r.Spec, spec); err != nil {
			n.log.Error("unreadable sandbox record", slog.String("sandbox_id", r.ID), slog.Any("error", err))
			continue
		}
		if _, err := n.images.Get(r.Image); err != nil {
			if img := n.snapshotByID(r.Image); img != nil {
				r.Image = img.Key() // a record from before snapshots had owners
			}
		}
		att, _ := n.net.Restore(r.ID, r.Network)
		s := &sandbox{
			id: r.ID, spec: spec, created: r.Created, image: r.Image, layers: r.Layers, net: att,
			dir: filepath.Join(n.cfg.DataDir, "sandboxes", r.ID), idemKey: r.IdemKey, project: projectOr(r.Project),
			state: r.State, expires: r.Expires, rec: r, network: networkFromRecord(r.NetPolicy),
		}
		if s.state == stateDeleting || s.state == "" {
			s.state = stateRunning
		}
		s.touch()
		drv := n.drivers[substrate.Kind(r.Kind)]
		var inst substrate.Instance
		var aerr error
		if drv == nil {
			aerr = errdefs.Unavailable("no %s driver on this node", r.Kind)
		} else {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			inst, aerr = drv.Attach(ctx, &substrate.Spec{ID: r.ID, Dir: s.dir}, r.Driver)
			cancel()
		}
		n.mu.Lock()
		n.sandboxes[r.ID] = s
		n.mu.Unlock()
		s.inst = inst
		if aerr != nil {
			n.log.Warn("sandbox not re-adopted", slog.String("sandbox_id", r.ID), slog.Any("error", aerr))
			n.remove(context.Background(), s, "stopped while the node was down", true)
			continue
		}
		n.watch(s)
		n.log.Info("sandbox re-adopted", slog.String("sandbox_id", r.ID))
	}
	for _, d := range n.drivers {
		if sw, ok := d.(interface{ Sweep(func(string) bool) int }); ok {
			if k := sw.Sweep(func(id string) bool { return known[id] }); k > 0 {
				n.log.Warn("removed leftover sandboxes the store did not know", slog.Int("count", k))
			}
		}
	}
}
