package session

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// memStore is a Store in memory.
type memStore struct {
	mu sync.Mutex
	m  map[string]Record
}

func (s *memStore) GetSession(ctx context.Context, name string) (*Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.m[name]
	if !ok {
		return nil, errdefs.NotFound("session %q not found", name)
	}
	return &r, nil
}

func (s *memStore) PutSession(ctx context.Context, r *Record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[r.Name] = *r
	return nil
}

func (s *memStore) DeleteSession(ctx context.Context, name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, name)
	return nil
}

func (s *memStore) GetModels(ctx context.Context, key string) ([]byte, error) {
	return nil, errdefs.Unimplemented("memStore keeps no model upstreams (models_test.go uses the bbolt store)")
}

func (s *memStore) PutModels(ctx context.Context, key string, b []byte) error {
	return errdefs.Unimplemented("memStore keeps no model upstreams (models_test.go uses the bbolt store)")
}

func (s *memStore) ListSessions(ctx context.Context) ([]*Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*Record
	for _, r := range s.m {
		out = append(out, &r)
	}
	return out, nil
}

// In a cluster another replica, with another clock, writes a session's
// heartbeat: expiry must follow this process's clock from when it saw the
// heartbeat, whatever the stored timestamp says.
func TestExpiryIgnoresOtherClocks(t *testing.T) {
	for _, c := range []struct {
		name string
		skew time.Duration
	}{
		{"a heartbeat stamped an hour in the future still expires after the grace", time.Hour},
		{"a heartbeat stamped an hour in the past is not expired at once", -time.Hour},
		{"an exact clock expires after the grace", 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			store := &memStore{m: map[string]Record{}}
			var acted []string
			m := New(store, func(ctx context.Context, op, sel, cause string) (int, error) {
				acted = append(acted, op)
				return 1, nil
			}, slog.New(slog.DiscardHandler))
			ctx := context.Background()
			start := time.Now()
			// Another replica wrote the session with its clock.
			store.PutSession(ctx, &Record{Name: "s", HeartbeatS: 1, GraceS: 10, OnExpire: "pause", State: Active, LastHeartbeat: start.Add(c.skew)})
			m.expire(ctx, start) // first sight: grace starts
			m.expire(ctx, start.Add(9*time.Second))
			if len(acted) != 0 {
				t.Fatalf("expired within the grace: %v", acted)
			}
			m.expire(ctx, start.Add(11*time.Second))
			if len(acted) != 1 || acted[0] != "pause" {
				t.Fatalf("not expired after the grace: %v", acted)
			}
			r, _ := store.GetSession(ctx, "s")
			if r.State != Expired {
				t.Fatalf("state %s", r.State)
			}
		})
	}
}

func TestAHeartbeatSeenLateRestartsTheGrace(t *testing.T) {
	store := &memStore{m: map[string]Record{}}
	expired := 0
	m := New(store, func(ctx context.Context, op, sel, cause string) (int, error) { expired++; return 0, nil }, slog.New(slog.DiscardHandler))
	ctx := context.Background()
	if _, err := m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s", HeartbeatS: 1, GraceS: 10}); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	m.expire(ctx, t0.Add(5*time.Second))
	// A heartbeat through another replica: a new value in the store.
	r, _ := store.GetSession(ctx, "s")
	r.LastHeartbeat = r.LastHeartbeat.Add(-3 * time.Hour)
	store.PutSession(ctx, r)
	m.expire(ctx, t0.Add(8*time.Second))  // seen now
	m.expire(ctx, t0.Add(17*time.Second)) // 9 s after it was seen
	if expired != 0 {
		t.Fatal("expired within the grace of a heartbeat seen late")
	}
	m.expire(ctx, t0.Add(19*time.Second))
	if expired != 1 {
		t.Fatal("not expired after the grace")
	}
}

// sandboxes is a node's view for an Actor: which sandboxes exist and which
// are paused.
type sandboxes struct {
	mu     sync.Mutex
	live   map[string]bool // id → paused
	failOn int             // fail this many act calls first
}

func (s *sandboxes) act(ctx context.Context, op, sel, cause string) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failOn > 0 {
		s.failOn--
		return 0, errdefs.Unavailable("node unreachable")
	}
	for id := range s.live {
		switch op {
		case "pause":
			s.live[id] = true
		case "resume":
			s.live[id] = false
		case "delete":
			delete(s.live, id)
		}
	}
	return len(s.live), nil
}

func (s *sandboxes) add(id string) {
	s.mu.Lock()
	s.live[id] = false
	s.mu.Unlock()
}

func (s *sandboxes) state(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	paused, ok := s.live[id]
	switch {
	case !ok:
		return "deleted"
	case paused:
		return "paused"
	}
	return "running"
}

// A create admitted just before its session expires finishes after the
// expiry acted on the session's sandboxes: Settle catches it.
func TestASandboxCreatedAsItsSessionExpiresGetsTheAction(t *testing.T) {
	for _, onExpire := range []string{"pause", "delete"} {
		t.Run("on_expire "+onExpire, func(t *testing.T) {
			store := &memStore{m: map[string]Record{}}
			sbs := &sandboxes{live: map[string]bool{"old": false}}
			m := New(store, sbs.act, slog.New(slog.DiscardHandler))
			ctx := context.Background()
			if _, err := m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s", HeartbeatS: 1, GraceS: 2, OnExpire: onExpire}); err != nil {
				t.Fatal(err)
			}
			if err := m.Admit(ctx, "s"); err != nil { // the create is admitted...
				t.Fatal(err)
			}
			t0 := time.Now()
			m.expire(ctx, t0)
			m.expire(ctx, t0.Add(3*time.Second)) // ...the session expires while it starts...
			want := map[string]string{"pause": "paused", "delete": "deleted"}[onExpire]
			if got := sbs.state("old"); got != want {
				t.Fatalf("the existing sandbox is %s", got)
			}
			sbs.add("new") // ...and its sandbox appears after the action
			action, err := m.Settle(ctx, "s")
			if err != nil || action != onExpire {
				t.Fatalf("settle: %q %v", action, err)
			}
			if got := sbs.state("new"); got != want {
				t.Fatalf("the sandbox created during expiry is %s, want %s", got, want)
			}
		})
	}
	t.Run("an active session settles nothing", func(t *testing.T) {
		store := &memStore{m: map[string]Record{}}
		sbs := &sandboxes{live: map[string]bool{}}
		m := New(store, sbs.act, slog.New(slog.DiscardHandler))
		ctx := context.Background()
		m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s", HeartbeatS: 1, GraceS: 2})
		sbs.add("new")
		if action, _ := m.Settle(ctx, "s"); action != "" || sbs.state("new") != "running" {
			t.Fatalf("settle acted on an active session: %q %s", action, sbs.state("new"))
		}
	})
}

// The expired state is recorded before the action; an action that fails is
// retried until it reaches every node.
func TestAFailedExpiryActionIsRetried(t *testing.T) {
	store := &memStore{m: map[string]Record{}}
	sbs := &sandboxes{live: map[string]bool{"a": false}, failOn: 2}
	m := New(store, sbs.act, slog.New(slog.DiscardHandler))
	ctx := context.Background()
	m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s", HeartbeatS: 1, GraceS: 2})
	t0 := time.Now()
	m.expire(ctx, t0)
	m.expire(ctx, t0.Add(3*time.Second)) // fails (1)
	r, _ := store.GetSession(ctx, "s")
	if r.State != Expired || !r.ActionPending {
		t.Fatalf("after a failed action: state %s, pending %v", r.State, r.ActionPending)
	}
	m.expire(ctx, t0.Add(4*time.Second)) // fails (2)
	m.expire(ctx, t0.Add(5*time.Second)) // works
	r, _ = store.GetSession(ctx, "s")
	if sbs.state("a") != "paused" || r.ActionPending {
		t.Fatalf("sandbox %s, pending %v", sbs.state("a"), r.ActionPending)
	}
	// Reopening resumes.
	if s, err := m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s", HeartbeatS: 1, GraceS: 2}); err != nil || s.Resumed != 1 || sbs.state("a") != "running" {
		t.Fatalf("reopen: %v %v %s", s, err, sbs.state("a"))
	}
}
