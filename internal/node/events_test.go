package node

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
)

// watcher is a subscription of the test's, its events on a channel.
type watcher struct {
	t  *testing.T
	ch chan *dsecv1.Event
}

// watch subscribes as ctx's caller and returns once the subscription is in
// place (its first event, a heartbeat, arrived).
func watch(t *testing.T, tn *testNode, ctx context.Context, req *dsecv1.SubscribeRequest) *watcher {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	w := &watcher{t: t, ch: make(chan *dsecv1.Event, 1000)}
	errc := make(chan error, 1)
	go func() {
		errc <- tn.Service().Events(ctx, req, func(ev *dsecv1.Event) error { w.ch <- ev; return nil }, true)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("subscription ended with %v", err)
		}
	})
	if first := w.next(); first.Type != events.Heartbeat {
		t.Fatalf("first event %v, want a heartbeat", first)
	}
	return w
}

func (w *watcher) next() *dsecv1.Event {
	w.t.Helper()
	select {
	case ev := <-w.ch:
		return ev
	case <-time.After(30 * time.Second):
		w.t.Fatal("no event within 30 s")
		return nil
	}
}

// expect reads events until one of typ for sandbox id, failing on an
// event of id out of order (another type of id first).
func (w *watcher) expect(typ, id string) *dsecv1.Event {
	w.t.Helper()
	for {
		ev := w.next()
		if ev.SandboxId != id {
			continue
		}
		if ev.Type != typ {
			w.t.Fatalf("sandbox %s: event %s (%v) before %s", id, ev.Type, ev, typ)
		}
		return ev
	}
}

func TestEventsFollowEverySandboxFromCreateToEnd(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	all := watch(t, tn, bg, &dsecv1.SubscribeRequest{})
	jobY := watch(t, tn, bg, &dsecv1.SubscribeRequest{LabelSelector: "job=y", Types: []string{"ended"}})
	other := watch(t, tn, as("other"), &dsecv1.SubscribeRequest{})

	a := tn.create(bg, &dsecv1.SandboxSpec{Labels: map[string]string{"job": "x"}})
	b := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 1, Labels: map[string]string{"job": "y"}})
	if ev := all.expect(events.Created, a.Id); ev.Labels["job"] != "x" || ev.Node != "test" || ev.Project != tenant.DefaultProject || ev.Kind != "container" || ev.State != "running" || ev.At == nil {
		t.Fatalf("created event %v", ev)
	}
	if _, err := tn.Pause(bg, a.Id); err != nil {
		t.Fatal(err)
	}
	if ev := all.expect(events.Paused, a.Id); ev.State != "paused" {
		t.Fatalf("paused event %v", ev)
	}
	if _, err := tn.Resume(bg, a.Id); err != nil {
		t.Fatal(err)
	}
	all.expect(events.Resumed, a.Id)
	snap, err := tn.Snapshot(bg, &dsecv1.SnapshotRequest{SandboxId: a.Id, Name: "snap"})
	if err != nil {
		t.Fatal(err)
	}
	if ev := all.expect(events.Snapshotted, a.Id); ev.SnapshotId != snap.Id {
		t.Fatalf("snapshotted event %v, want snapshot %s", ev, snap.Id)
	}
	fork, err := tn.Fork(bg, &dsecv1.ForkRequest{SandboxId: a.Id, Count: 1})
	if err != nil || fork.Created != 1 {
		t.Fatalf("fork: %v %v", fork, err)
	}
	child := fork.Results[0].Sandbox.Id
	if ev := all.expect(events.Forked, a.Id); !slices.Equal(ev.Children, []string{child}) || ev.SnapshotId != fork.SnapshotId {
		t.Fatalf("forked event %v, want child %s", ev, child)
	}
	if err := tn.Delete(bg, a.Id); err != nil {
		t.Fatal(err)
	}
	if ev := all.expect(events.Ended, a.Id); ev.Cause != "deleted" || ev.Infra || ev.State != "deleted" || ev.Reason == "" {
		t.Fatalf("ended event %v", ev)
	}
	// b ends at its TTL, the platform's doing; the job=y subscriber, which
	// asked for ends only, sees that and nothing of a's.
	if ev := jobY.next(); ev.SandboxId != b.Id || ev.Type != events.Ended || ev.Cause != "ttl" || !ev.Infra || ev.State != "failed" {
		t.Fatalf("job=y subscriber's first event %v, want b's end at its TTL", ev)
	}
	// After the end, get says when and why.
	for _, c := range []struct {
		id, cause string
		infra     bool
	}{{a.Id, "deleted", false}, {b.Id, "ttl", true}} {
		sb, err := tn.Get(bg, c.id)
		if err != nil {
			t.Fatal(err)
		}
		if sb.EndCause != c.cause || sb.Infra != c.infra || sb.EndedAt == nil || sb.Reason == "" {
			t.Errorf("get %s after its end: cause %q infra %v ended %v reason %q", c.id, sb.EndCause, sb.Infra, sb.EndedAt, sb.Reason)
		}
	}
	// The other project saw none of this: its first event is its own.
	mine := tn.create(as("other"), nil)
	if ev := other.next(); ev.SandboxId != mine.Id || ev.Type != events.Created {
		t.Fatalf("another project's subscriber's first event %v, want its own sandbox's", ev)
	}
}

func TestASubscriptionAsksOnlyForWhatItMaySee(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	for _, c := range []struct {
		ctx  context.Context
		req  *dsecv1.SubscribeRequest
		kind errdefs.Kind
	}{
		{bg, &dsecv1.SubscribeRequest{LabelSelector: "bad key=x"}, errdefs.KindInvalid},
		{bg, &dsecv1.SubscribeRequest{Types: []string{"exploded"}}, errdefs.KindInvalid},
		{as("a"), &dsecv1.SubscribeRequest{Project: "b"}, errdefs.KindPermissionDenied},
	} {
		err := tn.Subscribe(c.ctx, c.req, func(*dsecv1.Event) error { return nil }, false)
		if !errdefs.Is(err, c.kind) {
			t.Errorf("subscribe %v: %v, want %s", c.req, err, c.kind)
		}
	}
	// An operator may narrow to one project.
	op := tenant.With(context.Background(), tenant.Caller{Project: tenant.DefaultProject, Admin: true})
	w := watch(t, tn, op, &dsecv1.SubscribeRequest{Project: "b"})
	tn.create(as("a"), nil)
	sb := tn.create(as("b"), nil)
	if ev := w.next(); ev.SandboxId != sb.Id {
		t.Fatalf("operator narrowed to project b got %v first", ev)
	}
}

func TestEachSandboxKeepsAHistoryOfItsUse(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, func(c *Config, _ *substratetest.Fake) { c.SampleEvery = 200 * time.Millisecond })
	sb := tn.create(bg, nil)
	tn.sh(bg, sb.Id, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done") // some CPU
	var st *dsecv1.SandboxStats
	eventually(t, "two samples in the sandbox's history", func() bool {
		var err error
		if st, err = tn.Stats(bg, sb.Id, true); err != nil {
			t.Fatal(err)
		}
		return len(st.History) >= 2
	})
	for i, s := range st.History {
		if s.At == nil || s.MemoryBytes <= 0 || s.Pids < 1 {
			t.Errorf("sample %d: %v", i, s)
		}
		if i > 0 {
			prev := st.History[i-1]
			if !s.At.AsTime().After(prev.At.AsTime()) || s.CpuTimeMs < prev.CpuTimeMs {
				t.Errorf("samples out of order: %v then %v", prev, s)
			}
		}
	}
	if now, err := tn.Stats(bg, sb.Id, false); err != nil || len(now.History) != 0 {
		t.Errorf("stats without history: %v %v", now, err)
	}
	// Its history ends with it: a query after the end is a clear not
	// found, saying it ended and why.
	if err := tn.Delete(bg, sb.Id); err != nil {
		t.Fatal(err)
	}
	if _, err := tn.Stats(bg, sb.Id, true); !errdefs.Is(err, errdefs.KindNotFound) || !strings.Contains(err.Error(), "deleted by the user") {
		t.Errorf("the history of an ended sandbox: %v, want not found saying it was deleted", err)
	}
}

func TestAHistoryKeepsItsLastSamplesInOrder(t *testing.T) {
	var h history
	for i := range historyLen + 7 {
		h.add(usage{at: int64(i)})
	}
	got := h.samples()
	if len(got) != historyLen || got[0].At.AsTime().UnixMilli() != 7 || got[historyLen-1].At.AsTime().UnixMilli() != historyLen+6 {
		t.Fatalf("%d samples from %v to %v", len(got), got[0].At.AsTime().UnixMilli(), got[len(got)-1].At.AsTime().UnixMilli())
	}
}
