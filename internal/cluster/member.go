package cluster

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// MemberConfig configures a node's membership. Name and Address are
// required; the other zero values are the documented defaults.
type MemberConfig struct {
	Name string
	// Address is host:port where apiservers reach the node API.
	Address string
	Labels  map[string]string
	// TTL is the membership lease: a node that stops renewing it for this
	// long is lost (default 10s). Expiry is etcd's timer, not a comparison
	// of clocks.
	TTL time.Duration
	// Interval is the least time between two load publications (default
	// 1s): a node writes at most one key per Interval, and only when its
	// load changed.
	Interval time.Duration
}

// Member keeps a node in the cluster: its registration, its load under its
// lease, and its drain mark. It is safe for concurrent use.
type Member struct {
	s   *Store
	cfg MemberConfig
	log *slog.Logger

	draining atomic.Bool
	writes   atomic.Int64
}

// NewMember returns a node's membership; Run keeps it.
func (s *Store) NewMember(cfg MemberConfig, log *slog.Logger) *Member {
	if cfg.TTL == 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.Interval == 0 {
		cfg.Interval = time.Second
	}
	return &Member{s: s, cfg: cfg, log: log.With(slog.String("node", cfg.Name))}
}

// Draining reports whether the node is marked to drain.
func (m *Member) Draining() bool { return m.draining.Load() }

// Writes counts the etcd writes the membership made (for benchmarks).
func (m *Member) Writes() int64 { return m.writes.Load() }

// Run registers the node and publishes load() whenever changed fires (at
// most once per Interval, and only what differs), until ctx ends; then it
// revokes the lease, so the node leaves at once. It survives etcd outages:
// when the lease is lost it registers again with a new one.
func (m *Member) Run(ctx context.Context, load func() *nodev1.Load, changed <-chan struct{}) {
	backoff := 200 * time.Millisecond
	for ctx.Err() == nil {
		err := m.session(ctx, load, changed)
		if ctx.Err() != nil {
			return
		}
		m.log.Warn("cluster membership lost; registering again", slog.Any("error", err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// session is one lease's life.
func (m *Member) session(ctx context.Context, load func() *nodev1.Load, changed <-chan struct{}) error {
	cli, s := m.s.cli, m.s
	if err := m.register(ctx); err != nil {
		return err
	}
	lease, err := m.takeOver(ctx)
	if err != nil {
		return err
	}
	kctx, kcancel := context.WithCancel(ctx)
	defer kcancel()
	keep, err := cli.KeepAlive(kctx, lease)
	if err != nil {
		return unavailable(err, "keep lease")
	}
	// The drain mark, read and then watched. The watch outlives etcd
	// outages (the client resumes it); only a compaction or a closed watch
	// makes it read again. An outage alone never ends the lease's life:
	// only a lease that could not be renewed does.
	drainKey := s.key(dirDrain, m.cfg.Name)
	watchDrain := func() (clientv3.WatchChan, context.CancelFunc, error) {
		gctx, gcancel := s.ctx(ctx)
		resp, err := cli.Get(gctx, drainKey)
		gcancel()
		if err != nil {
			return nil, nil, unavailable(err, "read drain mark")
		}
		m.setDrain(len(resp.Kvs) > 0)
		wctx, wcancel := context.WithCancel(ctx)
		return cli.Watch(wctx, drainKey, clientv3.WithRev(resp.Header.Revision+1)), wcancel, nil
	}
	watch, wcancel, err := watchDrain()
	if err != nil {
		return err
	}
	defer func() { wcancel() }()

	aliveKey := s.key(dirAlive, m.cfg.Name)
	var last []byte
	var lastAt time.Time
	timer := time.NewTimer(0)
	defer timer.Stop()
	publish := func() error {
		l := load()
		l.Name, l.Address, l.Labels, l.Draining = m.cfg.Name, m.cfg.Address, m.cfg.Labels, m.Draining()
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(l)
		if err != nil {
			return err
		}
		if string(b) == string(last) {
			return nil
		}
		pctx, cancel := s.ctx(ctx)
		defer cancel()
		if _, err := cli.Put(pctx, aliveKey, string(b), clientv3.WithLease(lease)); err != nil {
			return unavailable(err, "publish load")
		}
		m.writes.Add(1)
		last, lastAt = b, time.Now()
		return nil
	}
	pendingChange := true
	for {
		select {
		case <-ctx.Done():
			// Leave at once rather than after the TTL.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			cli.Revoke(rctx, lease)
			cancel()
			return nil
		case _, ok := <-keep:
			if !ok {
				return errdefs.Unavailable("membership lease expired or etcd unreachable")
			}
		case wr, ok := <-watch:
			if !ok || wr.Err() != nil {
				wcancel()
				if watch, wcancel, err = watchDrain(); err != nil {
					// Read again on the next tick rather than drop the lease.
					watch, wcancel = nil, func() {}
					m.log.Warn("drain mark unreadable; retrying", slog.Any("error", err))
				}
				continue
			}
			for _, ev := range wr.Events {
				m.setDrain(ev.Type == clientv3.EventTypePut)
			}
			pendingChange = true
			if m.tryPublish(publish) { // drains take effect at once
				pendingChange = false
			}
		case <-changed:
			pendingChange = true
		case <-timer.C:
			if wait := m.cfg.Interval - time.Since(lastAt); wait > 0 {
				timer.Reset(wait) // at most one write per interval
				continue
			}
			if watch == nil {
				if w, c, err := watchDrain(); err == nil {
					watch, wcancel = w, c
				}
			}
			// Every interval, whether signalled or not: what the node does
			// not signal (images, kinds) changes rarely, and an unchanged
			// load is not written.
			if m.tryPublish(publish) {
				pendingChange = false
			}
			timer.Reset(m.cfg.Interval)
			continue
		}
		// Publish a change now if the last publication is old enough; the
		// timer catches the rest.
		if pendingChange && time.Since(lastAt) >= m.cfg.Interval && m.tryPublish(publish) {
			pendingChange = false
		}
	}
}

// tryPublish publishes, and logs a failure (etcd unreachable: the next
// interval tries again; the lease, renewed apart, keeps the node a member).
func (m *Member) tryPublish(publish func() error) bool {
	if err := publish(); err != nil {
		m.log.Warn("publish load", slog.Any("error", err))
		return false
	}
	return true
}

func (m *Member) setDrain(v bool) {
	if m.draining.Swap(v) != v {
		m.log.Info("drain mark changed", slog.Bool("draining", v))
	}
}

// register writes the node's permanent entry if it changed.
func (m *Member) register(ctx context.Context) error {
	s := m.s
	key := s.key(dirNodes, m.cfg.Name)
	gctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.cli.Get(gctx, key)
	if err != nil {
		return unavailable(err, "read registration")
	}
	reg := Registration{Name: m.cfg.Name, Address: m.cfg.Address, Labels: m.cfg.Labels, Registered: time.Now().UTC()}
	if len(resp.Kvs) > 0 {
		var old Registration
		if json.Unmarshal(resp.Kvs[0].Value, &old) == nil && old.Address == reg.Address && mapsEqual(old.Labels, reg.Labels) {
			return nil
		}
	}
	b, _ := json.Marshal(reg)
	if _, err := s.cli.Put(gctx, key, string(b)); err != nil {
		return unavailable(err, "register")
	}
	m.writes.Add(1)
	return nil
}

// takeOver grants the membership lease. Another live process with this
// name at another address keeps it (and this one waits); an entry at this
// node's own address is a previous process of this node that died (this
// process holds the address now), so its lease is revoked.
func (m *Member) takeOver(ctx context.Context) (clientv3.LeaseID, error) {
	s := m.s
	aliveKey := s.key(dirAlive, m.cfg.Name)
	gctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.cli.Get(gctx, aliveKey)
	if err != nil {
		return 0, unavailable(err, "read membership")
	}
	if len(resp.Kvs) > 0 {
		old := &nodev1.Load{}
		proto.Unmarshal(resp.Kvs[0].Value, old)
		if old.Address != m.cfg.Address {
			return 0, errdefs.Conflict("node name %s is held by a live node at %s", m.cfg.Name, old.Address)
		}
		if resp.Kvs[0].Lease != 0 {
			s.cli.Revoke(gctx, clientv3.LeaseID(resp.Kvs[0].Lease))
		}
	}
	g, err := s.cli.Grant(gctx, int64((m.cfg.TTL+time.Second-1)/time.Second))
	if err != nil {
		return 0, unavailable(err, "grant lease")
	}
	return g.ID, nil
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
