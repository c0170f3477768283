package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
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
//
// The membership fails static: an etcd that does not answer never ends it.
// The lease is renewed through an outage (etcd extends every lease by its
// TTL when it regains a leader), and only etcd's answer that the lease is
// gone — it expired while etcd ran, or was revoked — makes the node
// register again, at once. The node serves its sandboxes throughout.
type Member struct {
	s   *Store
	cfg MemberConfig
	log *slog.Logger

	draining atomic.Bool
	writes   atomic.Int64
	active   atomic.Bool     // a session holds a lease
	publish  chan chan error // Publish's requests, served by the session
}

// NewMember returns a node's membership; Run keeps it.
func (s *Store) NewMember(cfg MemberConfig, log *slog.Logger) *Member {
	if cfg.TTL == 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.Interval == 0 {
		cfg.Interval = time.Second
	}
	return &Member{s: s, cfg: cfg, log: log.With(slog.String("node", cfg.Name)), publish: make(chan chan error)}
}

// Draining reports whether the node is marked to drain.
func (m *Member) Draining() bool { return m.draining.Load() }

// Writes counts the etcd writes the membership made (for benchmarks).
func (m *Member) Writes() int64 { return m.writes.Load() }

// Publish writes the node's load now, outside the interval, and returns
// once etcd has it (or ctx ends, or the write fails): what changed before
// the call (an image imported or removed) is then in the cluster state.
// It fails at once when the node is not a member at the moment.
func (m *Member) Publish(ctx context.Context) error {
	if !m.active.Load() {
		return errdefs.Unavailable("node %s is not a member of the cluster now (etcd unreachable?)", m.cfg.Name)
	}
	reply := make(chan error, 1)
	select {
	case m.publish <- reply:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-reply:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// publishTimeout bounds one load publication, so the membership's loop
// stays responsive while etcd does not answer (a failed publication is
// retried the next interval).
const publishTimeout = 2 * time.Second

// revokeTimeout bounds a leaving node's revocation of its lease. It is
// longer than one publication's: a loaded etcd stalls for seconds, and a
// revocation that fails leaves the node a member, routed to while it no
// longer answers, until its lease's TTL runs out.
const revokeTimeout = 10 * time.Second

// Run registers the node and publishes load() whenever changed fires (at
// most once per Interval, and only what differs), until ctx ends; then it
// revokes the lease, so the node leaves at once. It survives etcd outages
// (see Member); when etcd says the lease is gone it registers again at
// once, with a new one.
func (m *Member) Run(ctx context.Context, load func() *nodev1.Load, changed <-chan struct{}) {
	var backoff time.Duration
	for ctx.Err() == nil {
		began := time.Now()
		err := m.session(ctx, load, changed)
		if ctx.Err() != nil {
			return
		}
		if time.Since(began) >= time.Second {
			backoff = 0 // a membership that lasted: register again at once
		} else {
			backoff = min(max(2*backoff, 100*time.Millisecond), time.Second)
		}
		if errors.Is(err, errLeaseGone) {
			m.log.Warn("cluster membership lapsed; registering again", slog.Any("error", err))
		} else {
			m.log.Warn("cluster membership not established; retrying", slog.Any("error", err))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// session is one lease's life: it returns errLeaseGone when etcd says the
// lease is gone, another error when the membership could not be set up,
// and nil when ctx ends (after revoking the lease).
func (m *Member) session(ctx context.Context, load func() *nodev1.Load, changed <-chan struct{}) error {
	cli, s := m.s.cli, m.s
	if err := m.register(ctx); err != nil {
		return err
	}
	lease, err := m.takeOver(ctx)
	if err != nil {
		return err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	revoke := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), revokeTimeout)
		if _, err := cli.Revoke(rctx, lease); err != nil {
			m.log.Warn("revoke the node's lease on leaving: it lapses at its TTL", slog.Any("error", err))
		}
		cancel()
	}
	leaseGone := make(chan error, 1)
	go func() { leaseGone <- s.keepLease(sctx, lease) }()

	aliveKey := s.key(dirAlive, m.cfg.Name)
	drainKey := s.key(dirDrain, m.cfg.Name)
	var last []byte
	var lastAt time.Time
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
		pctx, cancel := context.WithTimeout(sctx, min(s.timeout, publishTimeout))
		defer cancel()
		if _, err := cli.Put(pctx, aliveKey, string(b), clientv3.WithLease(lease)); err != nil {
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				return errLeaseGone
			}
			return unavailable(err, "publish load")
		}
		m.writes.Add(1)
		last, lastAt = b, time.Now()
		return nil
	}
	if err := publish(); err != nil {
		revoke()
		return err
	}
	m.active.Store(true)
	defer m.active.Store(false)

	// The node's own drain mark and alive entry, read and then watched.
	// The watches outlive etcd outages (the client resumes them); only a
	// compaction or a closed watch makes them read again. The alive
	// entry's deletion says at once that the lease is gone.
	var drainW, aliveW clientv3.WatchChan
	wcancel := func() {}
	defer func() { wcancel() }()
	watchOwn := func() error {
		wcancel()
		drainW, aliveW, wcancel = nil, nil, func() {}
		gctx, gcancel := context.WithTimeout(sctx, min(s.timeout, publishTimeout))
		resp, err := cli.Txn(gctx).Then(clientv3.OpGet(drainKey), clientv3.OpGet(aliveKey)).Commit()
		gcancel()
		if err != nil {
			return unavailable(err, "read drain mark")
		}
		if len(resp.Responses[1].GetResponseRange().Kvs) == 0 {
			return errLeaseGone
		}
		m.setDrain(len(resp.Responses[0].GetResponseRange().Kvs) > 0)
		wctx, c := context.WithCancel(sctx)
		rev := clientv3.WithRev(resp.Header.Revision + 1)
		drainW, aliveW, wcancel = cli.Watch(wctx, drainKey, rev), cli.Watch(wctx, aliveKey, rev, clientv3.WithFilterPut()), c
		return nil
	}
	if err := watchOwn(); err != nil {
		if errors.Is(err, errLeaseGone) {
			return err
		}
		m.log.Warn("drain mark unreadable; retrying", slog.Any("error", err))
	}
	if err := m.tryPublish(publish); errors.Is(err, errLeaseGone) { // the drain mark just read
		return err
	}
	rewatch := func() error {
		if err := watchOwn(); err != nil {
			if errors.Is(err, errLeaseGone) {
				return err
			}
			m.log.Warn("drain mark unreadable; retrying", slog.Any("error", err))
		}
		return nil
	}

	timer := time.NewTimer(m.cfg.Interval)
	defer timer.Stop()
	pendingChange := false
	for {
		select {
		case <-ctx.Done():
			revoke() // leave at once rather than after the TTL
			return nil
		case err := <-leaseGone:
			return err
		case wr, ok := <-aliveW:
			if !ok || wr.Err() != nil {
				if err := rewatch(); err != nil {
					return err
				}
				continue
			}
			if len(wr.Events) > 0 {
				return errLeaseGone // deleted: expired or revoked
			}
		case wr, ok := <-drainW:
			if !ok || wr.Err() != nil {
				if err := rewatch(); err != nil {
					return err
				}
				pendingChange = true
				continue
			}
			for _, ev := range wr.Events {
				m.setDrain(ev.Type == clientv3.EventTypePut)
			}
			pendingChange = true
			if m.tryPublish(publish) == nil { // drains take effect at once
				pendingChange = false
			}
		case reply := <-m.publish:
			err := publish()
			if err == nil {
				pendingChange = false
			}
			reply <- err
			if errors.Is(err, errLeaseGone) {
				return err
			}
		case <-changed:
			pendingChange = true
		case <-timer.C:
			if wait := m.cfg.Interval - time.Since(lastAt); wait > 0 {
				timer.Reset(wait) // at most one write per interval
				continue
			}
			if drainW == nil {
				if err := rewatch(); err != nil {
					return err
				}
			}
			// Every interval, whether signalled or not: what the node does
			// not signal (kinds) changes rarely, and an unchanged load is
			// not written.
			err := m.tryPublish(publish)
			if err == nil {
				pendingChange = false
			} else if errors.Is(err, errLeaseGone) {
				return err
			}
			timer.Reset(m.cfg.Interval)
			continue
		}
		// Publish a change now if the last publication is old enough; the
		// timer catches the rest.
		if pendingChange && time.Since(lastAt) >= m.cfg.Interval {
			err := m.tryPublish(publish)
			if err == nil {
				pendingChange = false
			} else if errors.Is(err, errLeaseGone) {
				return err
			}
		}
	}
}

// tryPublish publishes, and logs a failure (etcd unreachable: the next
// interval tries again; the lease, renewed apart, keeps the node a member).
func (m *Member) tryPublish(publish func() error) error {
	err := publish()
	if err != nil && !errors.Is(err, errLeaseGone) {
		m.log.Warn("publish load", slog.Any("error", err))
	}
	return err
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
