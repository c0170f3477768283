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
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/gateway"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
	"github.com/opendsec/dsec/internal/trajectory"
	"github.com/opendsec/dsec/internal/volume"
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
	// PausedTTL is how long a sandbox that paused at its TTL (on_timeout
	// "pause") is kept paused before it is deleted (default 24h, at most
	// MaxTTL).
	PausedTTL time.Duration
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

	// deadlineGrace replaces deadlineGrace in tests (0: deadlineGrace).
	deadlineGrace time.Duration
	// DefaultVolumeMB sizes a volume whose create gives no size (default
	// 1024); MaxVolumeMB bounds a volume (default 100 GiB).
	DefaultVolumeMB, MaxVolumeMB int64
	// Metrics, when set, is where the node registers its metrics (see
	// package metrics); nil records none.
	Metrics prometheus.Registerer
	// Webhooks receive the node's lifecycle events.
	Webhooks []Webhook
	// SampleEvery is how often each sandbox's use is sampled into its
	// history (default 5s; negative: never).
	SampleEvery time.Duration
	// LogSyncWindow is how long an answered call's trajectory entry may
	// wait for its fsync (default 10ms; negative: synced before each
	// answer). See trajectory.Store.SetSyncWindow.
	LogSyncWindow time.Duration
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
	if c.PausedTTL == 0 {
		c.PausedTTL = 24 * time.Hour
	}
	c.PausedTTL = min(c.PausedTTL, c.MaxTTL)
	if c.DefaultCPU == 0 {
		c.DefaultCPU = 1
	}
	if c.MaxVolumeMB == 0 {
		c.MaxVolumeMB = 100 << 10 // as the volume manager's default
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
	if c.SampleEvery == 0 {
		c.SampleEvery = 5 * time.Second
	}
	if c.LogSyncWindow == 0 {
		c.LogSyncWindow = 10 * time.Millisecond
	}
	if c.deadlineGrace == 0 {
		c.deadlineGrace = deadlineGrace
	}
}

// ValidName reports whether name can name a node.
func ValidName(name string) error { return sandboxid.ValidNode(name) }

// Node owns the sandboxes of one host. It is built of parts: a table of
// its sandboxes (table.go) whose states move only as sandbox.go allows,
// the create pipeline (create.go), one teardown every end goes through
// (release.go), and the trajectory log as one decorator over the calls
// that change a sandbox (log.go).
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
	changed  chan struct{} // signalled when the load changes (see LoadChanged)

	sandboxes *table
	// forkMu orders taking a fork's earlier snapshot (lookup and pin)
	// and releasing an ephemeral snapshot (check and delete).
	forkMu   sync.Mutex
	starts   *admission // start slots and the fair-share queue
	pools    *pools
	logs     *trajectory.Store
	volumes  *volume.Manager
	m        *metrics.Node // nil: no metrics
	events   *events.Hub
	gw       *gateway.Gateway
	models   modelRegistry
	rollouts rollouts
	// workers is the API rollouts' agents drive their workers through
	// (workerAPI), made once.
	workersOnce sync.Once
	workers     http.Handler
	// life ends when the node closes: the context of what the node runs
	// on its own (rollouts' agents' streams), not of any call.
	life context.Context

	trash chan string // sandbox directories to remove
	stop  chan struct{}
	wg    sync.WaitGroup
}

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
		drivers: drivers, started: time.Now(), sandboxes: newTable(), changed: make(chan struct{}, 1),
		starts: newAdmission(cfg.MaxConcurrentStarts, cfg.StartQueue), events: events.NewHub(),
		trash: make(chan string, 1024), stop: make(chan struct{}),
	}
	n.gw = gateway.New(n.models.resolve, nil, n.log)
	if cfg.Metrics != nil {
		n.m = metrics.NewNode(cfg.Metrics, n.metricsState)
	}
	n.starts.refused = n.m.Refused
	startWebhooks, err := n.webhooks(cfg.Webhooks)
	if err != nil {
		st.close()
		return nil, err
	}
	logs, err := trajectory.Open(filepath.Join(cfg.DataDir, "trajectories"))
	if err != nil {
		st.close()
		return nil, err
	}
	logs.SetSyncWindow(cfg.LogSyncWindow)
	n.logs = logs
	vols, err := volume.Open(filepath.Join(cfg.DataDir, "volumes"), volume.Config{Node: cfg.Name, DefaultMB: cfg.DefaultVolumeMB, MaxMB: cfg.MaxVolumeMB}, n.log)
	if err != nil {
		logs.Close()
		st.close()
		return nil, fmt.Errorf("open volumes: %w", err)
	}
	n.volumes = vols
	images.SetInUse(n.sandboxes.layers)
	life, endLife := context.WithCancel(context.Background())
	n.life = life
	go func() { <-n.stop; endLife() }()
	n.adopt()
	n.releaseUnusedSnapshots()
	n.removeOrphanSnapshotDirs()
	n.pools = newPools(n, cfg.Pools)
	n.wg.Add(2)
	go n.reaper()
	go n.sampler()
	go n.emptyTrash()
	for _, d := range drivers {
		if d, ok := d.(substrate.Starter); ok {
			d.Start()
		}
	}
	startWebhooks()
	return n, nil
}

// Name is the node's name.
func (n *Node) Name() string { return n.cfg.Name }

// DataDir is the node's data directory.
func (n *Node) DataDir() string { return n.cfg.DataDir }

// Images is the node's image store.
func (n *Node) Images() *image.Store { return n.images }

// Close stops the node's background work, closes its drivers (those
// built on another kind's first: substrate.BuiltOn) and its store.
// Sandboxes keep running; a new node over the same data directory
// re-adopts them.
func (n *Node) Close() error {
	close(n.stop)
	n.pools.close()
	n.wg.Wait()
	for _, layered := range []bool{true, false} {
		for _, d := range n.drivers {
			_, on := d.(substrate.BuiltOn)
			if c, ok := d.(substrate.Closer); ok && on == layered {
				c.Close()
			}
		}
	}
	n.logs.Close()
	n.volumes.Close()
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

// find returns the live sandbox id names, or else its tombstone, as ctx's
// caller sees them: a sandbox of another project is not found, live or
// deleted, with the very error an unknown ID gets. Every call that takes a
// sandbox ID from a caller goes through find (lookup, live, Get, Delete,
// the log): it is the node's one ownership check.
func (n *Node) find(ctx context.Context, id string) (*sandbox, *record, error) {
	if s := n.sandboxes.get(id); s != nil {
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
	if err := s.isEnding(); err != nil {
		return nil, err
	}
	if s.currentState() == statePaused {
		// Any call on a paused sandbox resumes it first.
		if err := n.resume(context.Background(), s); err != nil {
			return nil, err
		}
	}
	s.touch()
	return s, nil
}

// On-timeout policies (SandboxSpec.on_timeout).
const (
	OnTimeoutDelete = "delete"
	OnTimeoutPause  = "pause"
	// OnTimeoutPauseFilesystem pauses filesystem-only (Pause's fsOnly).
	OnTimeoutPauseFilesystem = "pause_filesystem"
)

// pausesAtTimeout reports whether s pauses, rather than ends, when its TTL
// or idle TTL passes.
func (s *sandbox) pausesAtTimeout() bool {
	return s.spec.OnTimeout == OnTimeoutPause || s.spec.OnTimeout == OnTimeoutPauseFilesystem
}

// deadlineGrace is how long after its TTL a sandbox ends itself if the node
// has not deleted it (the node normally does, on time).
const deadlineGrace = time.Minute

// deadline is when s's agent ends s by itself: deadlineGrace (tests: the
// node's Config.deadlineGrace) after its expiry.
func (n *Node) deadline(s *sandbox) time.Time { return s.expires.Add(n.cfg.deadlineGrace) }

// SessionLabel is the label binding a sandbox to a trainer session.
const SessionLabel = "dsec.io/session"

// watch reacts to a sandbox's instance stopping by itself.
func (n *Node) watch(s *sandbox) {
	inst := s.inst
	go func() {
		select {
		case <-inst.Done():
		case <-n.stop:
			return
		}
		if !s.currentState().ending() {
			if e := taskEnd(s, 0); e != nil {
				n.log.Info("sandbox ended by its workload", slog.String("sandbox_id", s.id), slog.String("reason", e.reason))
				n.release(context.Background(), s, e)
				return
			}
			reason := "the sandbox's init exited (crashed or killed)"
			attrs := []any{slog.String("sandbox_id", s.id)}
			if d, ok := inst.(substrate.Diagnoser); ok {
				if w := d.LastWords(); w != "" {
					reason += ": " + w
					attrs = append(attrs, slog.String("last_words", w))
				}
			}
			n.log.Warn("sandbox stopped by itself", attrs...)
			n.release(context.Background(), s, &end{reason: reason, cause: "died", infra: true})
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
	sb := &dsecv1.Sandbox{
		Id: s.id, Node: n.cfg.Name, State: s.state.public(), Spec: s.shownSpecLocked(),
		CreatedAt:    timestamppb.New(s.created),
		ExpiresAt:    timestamppb.New(s.expires),
		LastActiveAt: timestamppb.New(time.Unix(0, s.lastActive.Load())),
	}
	if s.inst != nil {
		sb.Sidecars = s.sidecarStatus()
	}
	if s.timedOut {
		sb.Reason = "ttl expired: paused (on_timeout " + s.spec.OnTimeout + ") until expires_at"
	}
	if e := s.ending; e != nil {
		// Being torn down: its end, as its tombstone will say it. (Its
		// state reads deleted meanwhile, failed once torn down for an
		// infra end, as before.)
		sb.Reason, sb.EndCause, sb.Infra, sb.EndedAt = e.reason, e.cause, e.infra, timestamppb.New(s.endedAt)
	}
	return sb
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
		EndedAt: timestamppb.New(t.Deleted), EndCause: t.Cause, Infra: t.Infra,
	}
}

// List lists the live sandboxes the caller sees (its project's; an
// operator's: all) matching the request's selector and state.
func (n *Node) List(ctx context.Context, req *dsecv1.ListSandboxesRequest) (*dsecv1.ListSandboxesResponse, error) {
	sel, err := ParseSelector(req.GetLabelSelector())
	if err != nil {
		return nil, err
	}
	all := n.sandboxes.all(func(s *sandbox) bool { return tenant.Reaches(ctx, s.project) && sel.Matches(s.spec.Labels) })
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
func (n *Node) Delete(ctx context.Context, id string) (err error) {
	defer n.m.Observe(ctx, metrics.OpDelete, n.kindOf(id), time.Now(), &err)
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
	return n.release(ctx, s, &end{reason: "deleted by the user", cause: "deleted"})
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
		if err := n.setDeadline(ctx, s, exp.Add(n.cfg.deadlineGrace)); err != nil {
			return nil, n.callFailed(s, err)
		}
		s.rec = s.record()
		if err := n.store.put(s.rec); err != nil {
			return nil, errdefs.Internal(err, "persist sandbox")
		}
	}
	return n.view(s), nil
}

// reaper deletes sandboxes whose TTL or idle TTL passed, each interval,
// and forgets tombstones past their time, each minute.
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
			n.reap(now)
			if now.Sub(lastPurge) > time.Minute {
				lastPurge = now
				n.purge(now.Add(-n.cfg.Tombstones))
			}
		}
	}
}

// reap ends the sandboxes whose TTL or idle TTL passed at now, or pauses
// those whose policy is to pause (on_timeout "pause"), and ends those kept
// paused past their paused_ttl. A paused sandbox waits for its trainer,
// not for calls: it does not idle. Every end here is the configured
// lifetime, reported as gone (infra): the sandbox vanished from under
// whoever was using it.
func (n *Node) reap(now time.Time) {
	ctx := context.Background()
	for _, s := range n.sandboxes.all(nil) {
		s.mu.Lock()
		exp, st, timedOut := s.expires, s.state, s.timedOut
		s.mu.Unlock()
		idle := time.Duration(s.spec.IdleTtlS) * time.Second
		switch {
		case st != stateRunning && st != statePaused:
		case now.After(exp) && timedOut:
			n.release(ctx, s, &end{reason: "paused ttl expired", cause: "paused_ttl", infra: true})
		case now.After(exp) && s.pausesAtTimeout():
			if err := n.pauseAtTTL(ctx, s, now); err != nil {
				n.cannotPause(s, "ttl expired", err)
			}
		case now.After(exp):
			n.release(ctx, s, &end{reason: "ttl expired", cause: "ttl", infra: true})
		case st == stateRunning && idle > 0 && now.Sub(time.Unix(0, s.lastActive.Load())) > idle:
			if !s.pausesAtTimeout() {
				n.release(ctx, s, &end{reason: "idle ttl expired", cause: "idle_ttl", infra: true})
			} else if err := n.transition(ctx, s, statePaused, func(ctx context.Context) error { return n.timeoutPauseLocked(ctx, s) }); err != nil {
				n.cannotPause(s, "idle ttl expired", err)
			}
		}
	}
}

// cannotPause ends a sandbox that reached its timeout and could not pause,
// as it would have ended without the policy.
func (n *Node) cannotPause(s *sandbox, reason string, err error) {
	if s.currentState().ending() {
		return // it died (failedLocked releases it) or was deleted meanwhile
	}
	n.log.Warn("pause at timeout", slog.String("sandbox_id", s.id), slog.Any("error", err))
	n.release(context.Background(), s, &end{reason: reason + "; the sandbox could not pause: " + errdefs.Classify(err).Msg, cause: "pause_failed", infra: true})
}

// purge forgets the tombstones, idempotency keys and trajectory logs of
// sandboxes that ended before cutoff.
func (n *Node) purge(cutoff time.Time) {
	ids, _ := n.store.purge(cutoff)
	for _, id := range ids {
		n.logs.Remove(id)
	}
	if len(ids) > 0 {
		n.logs.GCBlobs()
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
			id: r.ID, spec: spec, created: r.Created, image: r.Image, layers: r.Layers, lazy: n.images.LoadsOnDemand(r.Layers), net: att,
			dir: filepath.Join(n.cfg.DataDir, "sandboxes", r.ID), idemKey: r.IdemKey, project: tenant.OrDefault(r.Project),
			state: parseState(r.State), expires: r.Expires, rec: r, network: networkFromRecord(r.NetPolicy),
			timedOut: r.TimedOut, runStart: r.Created, stopped: r.Stopped,
		}
		if s.state != statePaused {
			s.state = stateRunning // as were records written mid-delete, and those of old stores
			s.timedOut = false
		}
		s.touch()
		drv := n.drivers[substrate.Kind(r.Kind)]
		var inst substrate.Instance
		var aerr error
		if drv == nil {
			aerr = errdefs.Unavailable("no %s driver on this node", r.Kind)
		} else {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			switch {
			case len(spec.Sidecars) > 0:
				inst, aerr = n.attachGroup(ctx, drv, s, r.Driver)
			case r.Stopped:
				// A sandbox paused filesystem-only boots from its spec
				// when resumed.
				ds := &substrate.Spec{ID: r.ID, Dir: s.dir}
				if img, err := n.images.Get(r.Image); err == nil {
					ds = n.driverSpec(s, img)
				}
				inst, aerr = drv.Attach(ctx, ds, r.Driver)
			default:
				inst, aerr = drv.Attach(ctx, &substrate.Spec{ID: r.ID, Dir: s.dir}, r.Driver)
			}
			cancel()
		}
		s.inst = inst
		if aerr != nil {
			n.log.Warn("sandbox not re-adopted", slog.String("sandbox_id", r.ID), slog.Any("error", aerr))
			n.release(context.Background(), s, &end{reason: "stopped while the node was down", cause: "node_down", infra: true})
			continue
		}
		if !r.Stopped && s.lazy && n.images.DataLost(s.layers, s.created) {
			n.log.Warn("sandbox re-adopted from an image loaded on demand whose blob server is gone: data of it not in the page cache can no longer be read, and its failed commands are answered as infrastructure errors; recreate it",
				slog.String("sandbox_id", r.ID), slog.String("image", r.Image))
		}
		n.sandboxes.commit(s)
		n.readoptVolumes(s)
		n.watch(s)
		n.readoptGateway(s)
		n.readoptRollouts(s)
		// Its sidecars are known to the sweep below only now: those of a
		// sandbox that was not re-adopted go with it.
		for _, id := range memberIDs(r.ID, spec) {
			known[id] = true
		}
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
