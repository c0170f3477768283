// Package session holds trainer leases. A trainer opens a named session
// and heartbeats it; sandboxes created with the session carry the label
// dsec.io/session=<name>. When heartbeats stop for longer than the grace
// period, the session expires and its sandboxes are paused (default) or
// deleted; a trainer that reopens the session (or heartbeats again) gets
// them back, resumed. Sandboxes keep their own TTLs, so none is ever left
// without an owner.
//
// Sessions are control-plane state: the Store is an embedded bbolt file in
// `dsec serve` and etcd in a cluster.
package session

import (
	"context"
	"log/slog"
	"regexp"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Label is the label that binds a sandbox to a session.
const Label = "dsec.io/session"

// States.
const (
	Active  = "active"
	Expired = "expired"
	Closed  = "closed"
)

// Record is a persisted session.
type Record struct {
	Name string `json:"name"`
	// Project owns the session ("" is the default project): only its
	// callers see it, and its expiry acts on its project's sandboxes.
	Project       string    `json:"project,omitempty"`
	HeartbeatS    int64     `json:"heartbeat_s"`
	GraceS        int64     `json:"grace_s"`
	OnExpire      string    `json:"on_expire"`
	State         string    `json:"state"`
	Created       time.Time `json:"created"`
	LastHeartbeat time.Time `json:"last_heartbeat"`
	ExpiredAt     time.Time `json:"expired_at,omitempty"`
	// ActionPending is set while an expired session's action (pause or
	// delete) has not reached every node yet; it is retried every tick.
	ActionPending bool `json:"action_pending,omitempty"`
}

// Store persists sessions by key (Key).
type Store interface {
	GetSession(ctx context.Context, key string) (*Record, error) // NotFound if missing
	PutSession(ctx context.Context, r *Record) error             // under r.Key()
	DeleteSession(ctx context.Context, key string) error
	ListSessions(ctx context.Context) ([]*Record, error)
	// GetModels returns what PutModels stored under key (nil if nothing);
	// PutModels with nil removes it. A session's model upstreams live
	// apart from its record (models.go).
	GetModels(ctx context.Context, key string) ([]byte, error)
	PutModels(ctx context.Context, key string, b []byte) error
}

// Key is where a session of project named name is stored: its name for
// the default project (as before projects), "<project>/<name>" otherwise.
// Session names hold no '/'.
func Key(project, name string) string {
	if project == "" || project == tenant.DefaultProject {
		return name
	}
	return project + "/" + name
}

// Key is where r is stored.
func (r *Record) Key() string { return Key(r.Project, r.Name) }

// forProject returns ctx acting for r's project, so the sandboxes a
// session's action reaches are its own project's only.
func (r *Record) forProject(ctx context.Context) context.Context {
	return tenant.With(ctx, tenant.Caller{Project: r.Project})
}

// Actor applies a bulk operation ("pause", "resume", "delete") to every
// sandbox matching a label selector, on every node, and returns how many
// it reached. cause is a delete's end cause ("" for deleted, or
// CauseExpired).
type Actor func(ctx context.Context, op, selector, cause string) (int, error)

// CauseExpired is the end cause of the sandboxes an expired session's
// "delete" ends.
const CauseExpired = "session_expired"

var nameRe = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)

// Manager runs sessions. It is safe for concurrent use.
//
// Expiry never compares a stored timestamp with this machine's clock (in a
// cluster another replica, with another clock, wrote it): a session's grace
// runs on this process's monotonic clock from when it first saw the
// session's current heartbeat. A manager that starts (or, in a cluster,
// becomes the one that expires sessions) so counts grace from its start.
type Manager struct {
	store Store
	act   Actor
	log   *slog.Logger

	mu   sync.Mutex // serializes state changes of sessions
	seen map[string]beat

	expired func(action string) // counts expiries (CountExpiries)
}

// CountExpiries has f told of each session this manager expires, with the
// session's action (pause or delete). Call before Run.
func (m *Manager) CountExpiries(f func(action string)) { m.expired = f }

// beat is a heartbeat value and when this process first saw it.
type beat struct {
	value time.Time
	at    time.Time // monotonic
}

// New returns a manager. Run starts expiring sessions.
func New(store Store, act Actor, log *slog.Logger) *Manager {
	return &Manager{store: store, act: act, log: log, seen: map[string]beat{}}
}

func selector(name string) string { return Label + "=" + name }

// Open opens a session, or reopens an existing one: a reopened session
// that had expired is active again and its paused sandboxes are resumed.
func (m *Manager) Open(ctx context.Context, req *dsecv1.OpenSessionRequest) (*dsecv1.Session, error) {
	if !nameRe.MatchString(req.GetName()) {
		return nil, errdefs.Invalid("session name %q must be 1 to 63 letters, digits, '.', '_' or '-'", req.GetName())
	}
	hb, grace, onExpire := req.GetHeartbeatS(), req.GetGraceS(), req.GetOnExpire()
	if hb == 0 {
		hb = 5
	}
	if grace == 0 {
		grace = max(30, 3*hb)
	}
	if onExpire == "" {
		onExpire = "pause"
	}
	switch {
	case hb < 1 || hb > 3600:
		return nil, errdefs.Invalid("heartbeat_s must be between 1 and 3600")
	case grace < hb || grace > 86400:
		return nil, errdefs.Invalid("grace_s must be between heartbeat_s and 86400")
	case onExpire != "pause" && onExpire != "delete":
		return nil, errdefs.Invalid("on_expire must be pause or delete")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now().UTC()
	project := tenant.Project(ctx)
	r, err := m.store.GetSession(ctx, Key(project, req.GetName()))
	if err != nil && !errdefs.Is(err, errdefs.KindNotFound) {
		return nil, err
	}
	if r == nil || r.State == Closed {
		r = &Record{Name: req.GetName(), Project: project, Created: now}
	}
	r.HeartbeatS, r.GraceS, r.OnExpire = hb, grace, onExpire
	resumed, err := m.reviveLocked(ctx, r, now)
	if err != nil {
		return nil, err
	}
	v := view(r)
	v.Resumed = int32(resumed)
	return v, nil
}

// reviveLocked makes r active as of now, resuming its sandboxes if it had
// expired with "pause".
func (m *Manager) reviveLocked(ctx context.Context, r *Record, now time.Time) (int, error) {
	wasExpired := r.State == Expired
	r.State, r.LastHeartbeat, r.ExpiredAt, r.ActionPending = Active, now, time.Time{}, false
	if err := m.store.PutSession(ctx, r); err != nil {
		return 0, err
	}
	m.seen[r.Key()] = beat{value: r.LastHeartbeat, at: time.Now()}
	if !wasExpired || r.OnExpire != "pause" {
		return 0, nil
	}
	n, err := m.act(r.forProject(ctx), "resume", selector(r.Name), "")
	if err != nil {
		return n, err
	}
	m.log.Info("session revived; sandboxes resumed", slog.String("session", r.Name), slog.Int("sandboxes", n))
	return n, nil
}

// Heartbeat renews a session. A heartbeat on an expired session revives
// it (its trainer was only unreachable).
func (m *Manager) Heartbeat(ctx context.Context, name string) (*dsecv1.Session, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.get(ctx, name)
	if err != nil {
		return nil, err
	}
	if r.State == Closed {
		return nil, errdefs.NotFound("session %q is closed", name)
	}
	resumed, err := m.reviveLocked(ctx, r, time.Now().UTC())
	if err != nil {
		return nil, err
	}
	v := view(r)
	v.Resumed = int32(resumed)
	return v, nil
}

// get reads the session named name of ctx's caller's project.
func (m *Manager) get(ctx context.Context, name string) (*Record, error) {
	r, err := m.store.GetSession(ctx, Key(tenant.Project(ctx), name))
	if errdefs.Is(err, errdefs.KindNotFound) {
		return nil, errdefs.NotFound("session %q not found", name)
	}
	return r, err
}

// Get returns a session of the caller's project.
func (m *Manager) Get(ctx context.Context, name string) (*dsecv1.Session, error) {
	r, err := m.get(ctx, name)
	if err != nil {
		return nil, err
	}
	return view(r), nil
}

// List lists the sessions the caller sees (its project's; an operator's:
// all) by name.
func (m *Manager) List(ctx context.Context) ([]*dsecv1.Session, error) {
	rs, err := m.store.ListSessions(ctx)
	if err != nil {
		return nil, err
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].Key() < rs[j].Key() })
	out := make([]*dsecv1.Session, 0, len(rs))
	for _, r := range rs {
		if tenant.Reaches(ctx, r.Project) {
			out = append(out, view(r))
		}
	}
	return out, nil
}

// Close ends a session; with deleteSandboxes its sandboxes are deleted,
// otherwise they live on under their TTLs.
func (m *Manager) Close(ctx context.Context, name string, deleteSandboxes bool) (*dsecv1.Session, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.get(ctx, name)
	if err != nil {
		return nil, err
	}
	if deleteSandboxes {
		if _, err := m.act(r.forProject(ctx), "delete", selector(name), ""); err != nil {
			return nil, err
		}
	} else if r.State == Expired && r.OnExpire == "pause" {
		// Leave nothing frozen behind an ended lease.
		m.act(r.forProject(ctx), "resume", selector(name), "")
	}
	r.State = Closed
	if err := m.store.PutModels(ctx, r.Key(), nil); err != nil {
		return nil, err
	}
	if err := m.store.DeleteSession(ctx, r.Key()); err != nil {
		return nil, err
	}
	return view(r), nil
}

// Admit checks that a create may bind to session name: it must exist in
// the caller's project and be active.
func (m *Manager) Admit(ctx context.Context, name string) error {
	r, err := m.store.GetSession(ctx, Key(tenant.Project(ctx), name))
	if err != nil {
		if errdefs.Is(err, errdefs.KindNotFound) {
			return errdefs.NotFound("session %q does not exist; open it first", name)
		}
		return err
	}
	if r.State != Active {
		return errdefs.Conflict("session %q is %s; reopen it first", name, r.State)
	}
	return nil
}

// Settle is called after sandboxes bound to session name were created. A
// session that expired while they started (after Admit) may have applied
// its action before they existed: Settle applies it again, to every
// sandbox of the session, and returns the action ("" while the session
// is active). Expiry records the state before it acts, so a create either
// is seen by the expiry's action or sees the expired state here.
func (m *Manager) Settle(ctx context.Context, name string) (string, error) {
	r, err := m.store.GetSession(ctx, Key(tenant.Project(ctx), name))
	if err != nil || r.State != Expired {
		return "", nil // active, or closed (its sandboxes live on under their TTLs)
	}
	if _, err := m.act(r.forProject(ctx), r.OnExpire, selector(name), CauseExpired); err != nil {
		return r.OnExpire, err
	}
	return r.OnExpire, nil
}

// Run expires sessions whose heartbeats stopped, until ctx ends.
func (m *Manager) Run(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			m.expire(ctx, now)
		}
	}
}

func (m *Manager) expire(ctx context.Context, now time.Time) {
	rs, err := m.store.ListSessions(ctx)
	if err != nil {
		m.log.Warn("list sessions", slog.Any("error", err))
		return
	}
	live := map[string]bool{}
	for _, r := range rs {
		if r.State == Expired && r.ActionPending {
			m.apply(ctx, r.Key())
			continue
		}
		if r.State != Active {
			continue
		}
		live[r.Key()] = true
		m.mu.Lock()
		b, ok := m.seen[r.Key()]
		if !ok || !b.value.Equal(r.LastHeartbeat) {
			// A heartbeat this process had not seen: grace starts now.
			m.seen[r.Key()] = beat{value: r.LastHeartbeat, at: now}
			m.mu.Unlock()
			continue
		}
		m.mu.Unlock()
		if now.Sub(b.at) <= time.Duration(r.GraceS)*time.Second {
			continue
		}
		m.mu.Lock()
		cur, err := m.store.GetSession(ctx, r.Key())
		if err != nil || cur.State != Active || !cur.LastHeartbeat.Equal(r.LastHeartbeat) {
			m.mu.Unlock()
			continue // heartbeat or reopen meanwhile
		}
		// The state first, then the action: a create that raced past Admit
		// sees the state in Settle if the action missed its sandbox.
		cur.State, cur.ExpiredAt, cur.ActionPending = Expired, time.Now().UTC(), true
		err = m.store.PutSession(ctx, cur)
		delete(m.seen, cur.Key())
		m.mu.Unlock()
		if err != nil {
			m.log.Warn("expire session", slog.String("session", cur.Name), slog.Any("error", err))
			continue
		}
		if m.expired != nil {
			m.expired(cur.OnExpire)
		}
		m.apply(ctx, cur.Key())
	}
	m.mu.Lock()
	for name := range m.seen {
		if !live[name] {
			delete(m.seen, name)
		}
	}
	m.mu.Unlock()
}

// apply carries out an expired session's action (stored under key) and
// clears ActionPending; on failure it stays pending, retried next tick.
func (m *Manager) apply(ctx context.Context, key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	cur, err := m.store.GetSession(ctx, key)
	if err != nil || cur.State != Expired || !cur.ActionPending {
		return // revived, closed or done meanwhile
	}
	n, err := m.act(cur.forProject(ctx), cur.OnExpire, selector(cur.Name), CauseExpired)
	if err != nil {
		m.log.Warn("expire session", slog.String("session", cur.Name), slog.Any("error", err))
		return
	}
	cur.ActionPending = false
	if err := m.store.PutSession(ctx, cur); err != nil {
		m.log.Warn("expire session", slog.String("session", cur.Name), slog.Any("error", err))
		return
	}
	m.log.Warn("session expired: heartbeats stopped", slog.String("session", cur.Name), slog.String("action", cur.OnExpire), slog.Int("sandboxes", n))
}

func view(r *Record) *dsecv1.Session {
	v := &dsecv1.Session{
		Name: r.Name, State: r.State, HeartbeatS: r.HeartbeatS, GraceS: r.GraceS, OnExpire: r.OnExpire,
		CreatedAt: timestamppb.New(r.Created), LastHeartbeat: timestamppb.New(r.LastHeartbeat),
	}
	if !r.ExpiredAt.IsZero() {
		v.ExpiredAt = timestamppb.New(r.ExpiredAt)
	}
	return v
}
