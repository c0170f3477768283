package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
)

func TestIdempotency(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)

	t.Run("concurrent creates with one key make one sandbox", func(t *testing.T) {
		ids := make([]string, 8)
		var wg sync.WaitGroup
		for i := range ids {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				sb, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, IdempotencyKey: "once"})
				if err != nil {
					t.Error(err)
					return
				}
				ids[i] = sb.Id
			}(i)
		}
		wg.Wait()
		for _, id := range ids {
			if id != ids[0] {
				t.Fatalf("one key made several sandboxes: %v", ids)
			}
		}
		list, _ := tn.List(bg, &dsecv1.ListSandboxesRequest{})
		if len(list.Sandboxes) != 1 {
			t.Fatalf("%d sandboxes listed, want 1", len(list.Sandboxes))
		}
	})

	t.Run("a key answers its sandbox after the sandbox is deleted", func(t *testing.T) {
		first := tn.create(bg, nil)
		req := &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, IdempotencyKey: "later"}
		a, err := tn.Create(bg, req)
		if err != nil {
			t.Fatal(err)
		}
		if err := tn.Delete(bg, a.Id); err != nil {
			t.Fatal(err)
		}
		b, err := tn.Create(bg, req)
		if err != nil {
			t.Fatal(err)
		}
		if b.Id != a.Id || b.State != "deleted" || a.Id == first.Id {
			t.Fatalf("repeat got %s (%s), want %s deleted", b.Id, b.State, a.Id)
		}
	})

	t.Run("a fenced key makes nothing here until its fence is purged; a fence after the create answers its sandbox", func(t *testing.T) {
		if sb, err := tn.Fence(bg, "", "fenced"); sb != nil || err != nil {
			t.Fatalf("fence of an unused key: %v, %v", sb, err)
		}
		req := &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, IdempotencyKey: "fenced"}
		for range 2 {
			if sb, err := tn.Create(bg, req); !errdefs.Is(err, errdefs.KindUnavailable) {
				t.Fatalf("a create with a fenced key: %v, %v", sb, err)
			}
		}
		if sb, err := tn.Fence(bg, "", "fenced"); sb != nil || err != nil {
			t.Fatalf("a second fence: %v, %v", sb, err)
		}
		tn.purge(time.Now().Add(-time.Hour))
		if _, err := tn.Create(bg, req); !errdefs.Is(err, errdefs.KindUnavailable) {
			t.Fatalf("a recent fence was purged: %v", err)
		}
		tn.purge(time.Now().Add(time.Second))
		a, err := tn.Create(bg, req)
		if err != nil {
			t.Fatalf("a create once the fence was purged: %v", err)
		}
		b, err := tn.Fence(bg, "", "fenced")
		if err != nil || b.GetId() != a.Id {
			t.Fatalf("a fence of a key that made %s: %v, %v", a.Id, b, err)
		}
		if again, err := tn.Create(bg, req); err != nil || again.Id != a.Id {
			t.Fatalf("the key after a fence that found its sandbox: %v, %v", again, err)
		}
	})

	t.Run("keys are per project", func(t *testing.T) {
		a, err := tn.Create(as("a"), &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, IdempotencyKey: "shared-key", Project: "a"})
		if err != nil {
			t.Fatal(err)
		}
		b, err := tn.Create(as("b"), &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, IdempotencyKey: "shared-key", Project: "b"})
		if err != nil {
			t.Fatal(err)
		}
		if a.Id == b.Id {
			t.Fatal("two projects' creates with one key got one sandbox")
		}
	})
}

func TestReaper(t *testing.T) {
	t.Parallel()

	t.Run("the reaper deletes a sandbox past its TTL as gone", func(t *testing.T) {
		tn := newTestNode(t, nil)
		sb := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 1})
		eventually(t, "the TTL ends the sandbox", func() bool { st, _ := tn.state(sb.Id); return st == "failed" })
		if st, why := tn.state(sb.Id); st != "failed" || why != "ttl expired" {
			t.Fatalf("state %s (%s)", st, why)
		}
		_, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "true"})
		if !errdefs.Is(err, errdefs.KindGone) || !errdefs.IsInfra(err) {
			t.Fatalf("exec after expiry: %v", err)
		}
	})

	// The idle cases reap at chosen times; the reaper itself waits an hour.
	tn := newTestNode(t, func(c *Config, _ *substratetest.Fake) { c.ReapInterval = time.Hour })
	idle := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 60, IdleTtlS: 1})
	paused := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 60, IdleTtlS: 1})
	if _, err := tn.Pause(bg, paused.Id); err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	busy := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 60, IdleTtlS: 1})
	time.Sleep(300 * time.Millisecond)
	tn.sh(bg, busy.Id, "true")

	t.Run("a call resets the idle timer", func(t *testing.T) {
		tn.reap(before.Add(1200 * time.Millisecond)) // 1.2 s after the create, < 0.9 s after the call
		if st, why := tn.state(busy.Id); st != "running" {
			t.Fatalf("state %s (%s)", st, why)
		}
	})
	tn.reap(time.Now().Add(2 * time.Second))
	t.Run("a sandbox idle past its idle TTL is deleted as gone", func(t *testing.T) {
		for _, id := range []string{idle.Id, busy.Id} {
			if st, why := tn.state(id); st != "failed" || why != "idle ttl expired" {
				t.Fatalf("state %s (%s)", st, why)
			}
		}
	})
	t.Run("a paused sandbox is not idle", func(t *testing.T) {
		if st, why := tn.state(paused.Id); st != "paused" {
			t.Fatalf("state %s (%s)", st, why)
		}
	})
	t.Run("a paused sandbox past its TTL is deleted", func(t *testing.T) {
		tn.reap(time.Now().Add(time.Minute + time.Second))
		if st, why := tn.state(paused.Id); st != "failed" || why != "ttl expired" {
			t.Fatalf("state %s (%s)", st, why)
		}
	})
}

func TestTombstones(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)

	t.Run("a deleted sandbox answers not found, not infra, with its reason", func(t *testing.T) {
		sb := tn.create(bg, nil)
		if err := tn.Delete(bg, sb.Id); err != nil {
			t.Fatal(err)
		}
		if err := tn.Delete(bg, sb.Id); err != nil {
			t.Fatalf("second delete: %v", err)
		}
		if st, why := tn.state(sb.Id); st != "deleted" || why != "deleted by the user" {
			t.Fatalf("state %s (%s)", st, why)
		}
		_, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "true"})
		if !errdefs.Is(err, errdefs.KindNotFound) || errdefs.IsInfra(err) || !strings.Contains(err.Error(), "was deleted: deleted by the user") {
			t.Fatalf("exec after delete: %v", err)
		}
	})

	t.Run("a crashed sandbox answers gone, infra, with what it last said", func(t *testing.T) {
		sb := tn.create(bg, nil)
		s, _ := tn.lookup(bg, sb.Id)
		substratetest.Crash(s.inst)
		eventually(t, "the crash is noticed", func() bool { st, _ := tn.state(sb.Id); return st == "failed" })
		if _, why := tn.state(sb.Id); !strings.HasPrefix(why, "the sandbox's init exited") {
			t.Fatalf("reason %q", why)
		}
		_, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "true"})
		if !errdefs.Is(err, errdefs.KindGone) || !errdefs.IsInfra(err) {
			t.Fatalf("exec after the crash: %v", err)
		}
		list, _ := tn.List(bg, &dsecv1.ListSandboxesRequest{})
		for _, x := range list.Sandboxes {
			if x.Id == sb.Id {
				t.Fatal("a crashed sandbox is still listed")
			}
		}
	})

	t.Run("bulk deletes leave a tombstone each", func(t *testing.T) {
		a := tn.create(bg, &dsecv1.SandboxSpec{Labels: map[string]string{"job": "bulk"}})
		b := tn.create(bg, &dsecv1.SandboxSpec{Labels: map[string]string{"job": "bulk"}})
		keep := tn.create(bg, nil)
		resp, err := tn.Bulk(bg, "delete", "job=bulk", "")
		if err != nil || len(resp.Ids) != 2 || len(resp.Failures) != 0 {
			t.Fatalf("bulk: %v %v", resp, err)
		}
		for _, id := range []string{a.Id, b.Id} {
			if st, why := tn.state(id); st != "deleted" || why != "deleted by the user (by label)" {
				t.Fatalf("%s: %s (%s)", id, st, why)
			}
		}
		if st, _ := tn.state(keep.Id); st != "running" {
			t.Fatalf("an unselected sandbox is %s", st)
		}
	})
}

func TestPauseOnCall(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	sb := tn.create(bg, nil)
	tn.sh(bg, sb.Id, "echo kept > /tmp/f")
	if v, err := tn.Pause(bg, sb.Id); err != nil || v.State != "paused" {
		t.Fatalf("pause: %v %v", v, err)
	}
	if _, err := tn.Pause(bg, sb.Id); err != nil {
		t.Fatalf("pausing a paused sandbox: %v", err)
	}

	t.Run("stats neither resume a paused sandbox nor count as activity", func(t *testing.T) {
		if _, err := tn.Stats(bg, sb.Id, false); err != nil {
			t.Fatal(err)
		}
		if st, _ := tn.state(sb.Id); st != "paused" {
			t.Fatalf("state %s after stats", st)
		}
	})
	t.Run("a call on a paused sandbox resumes it first", func(t *testing.T) {
		if out := tn.sh(bg, sb.Id, "cat /tmp/f"); out != "kept\n" {
			t.Fatalf("after resume: %q", out)
		}
		if st, _ := tn.state(sb.Id); st != "running" {
			t.Fatalf("state %s after a call", st)
		}
	})
	t.Run("resuming a running sandbox succeeds", func(t *testing.T) {
		if v, err := tn.Resume(bg, sb.Id); err != nil || v.State != "running" {
			t.Fatalf("resume: %v %v", v, err)
		}
	})
	t.Run("a listing filters by state", func(t *testing.T) {
		other := tn.create(bg, nil)
		tn.Pause(bg, other.Id)
		list, err := tn.List(bg, &dsecv1.ListSandboxesRequest{State: "paused"})
		if err != nil || len(list.Sandboxes) != 1 || list.Sandboxes[0].Id != other.Id {
			t.Fatalf("paused sandboxes: %v %v", list, err)
		}
	})
}

func TestFork(t *testing.T) {
	t.Parallel()
	fail := make(chan bool, 1)
	tn := newTestNode(t, func(_ *Config, f *substratetest.Fake) {
		f.BeforeCreate = func(ctx context.Context, spec *substrate.Spec) error {
			if _, err := sandboxid.SnapshotNode(spec.Image.Name); err == nil && len(fail) > 0 { // a fork's child
				return errdefs.Unavailable("refused by the test")
			}
			return nil
		}
	})
	parent := tn.create(bg, &dsecv1.SandboxSpec{Labels: map[string]string{"job": "forked"}})
	tn.sh(bg, parent.Id, "echo from-parent > /tmp/state")

	t.Run("children start from the parent's files, labelled", func(t *testing.T) {
		resp, err := tn.Fork(bg, &dsecv1.ForkRequest{SandboxId: parent.Id, Count: 2})
		if err != nil || resp.Created != 2 {
			t.Fatalf("fork: %v %v", resp, err)
		}
		var kids []string
		for i, r := range resp.Results {
			sb := r.Sandbox
			if sb.Spec.Labels[ForkOfLabel] != parent.Id || sb.Spec.Labels[ForkIndexLabel] != fmt.Sprint(i) || sb.Spec.Labels["job"] != "forked" {
				t.Fatalf("child %d labels %v", i, sb.Spec.Labels)
			}
			if out := tn.sh(bg, sb.Id, "cat /tmp/state"); out != "from-parent\n" {
				t.Fatalf("child %d sees %q", i, out)
			}
			kids = append(kids, sb.Id)
		}
		tn.sh(bg, kids[0], "echo mine > /tmp/state")
		if out := tn.sh(bg, kids[1], "cat /tmp/state"); out != "from-parent\n" {
			t.Fatalf("children share a writable layer: %q", out)
		}

		// The fork's ephemeral snapshot lives while a child starts from it.
		if tn.snapshotByID(resp.SnapshotId) == nil {
			t.Fatal("the fork's snapshot is gone while its children run")
		}
		tn.Delete(bg, kids[0])
		if tn.snapshotByID(resp.SnapshotId) == nil {
			t.Fatal("the fork's snapshot is gone while a child runs")
		}
		tn.Delete(bg, kids[1])
		if tn.snapshotByID(resp.SnapshotId) != nil {
			t.Fatal("the fork's snapshot outlives its children")
		}
	})

	t.Run("a fork whose children all fail leaves no snapshot", func(t *testing.T) {
		fail <- true
		defer func() { <-fail }()
		resp, err := tn.Fork(bg, &dsecv1.ForkRequest{SandboxId: parent.Id, Count: 2})
		if err != nil || resp.Failed != 2 {
			t.Fatalf("fork: %v %v", resp, err)
		}
		if tn.snapshotByID(resp.SnapshotId) != nil {
			t.Fatal("the snapshot of a fork without children is kept")
		}
	})

	t.Run("a named snapshot is kept after its children", func(t *testing.T) {
		snap, err := tn.Snapshot(bg, &dsecv1.SnapshotRequest{SandboxId: parent.Id, Name: "keep"})
		if err != nil {
			t.Fatal(err)
		}
		child := tn.create(bg, &dsecv1.SandboxSpec{Snapshot: snap.Id})
		if out := tn.sh(bg, child.Id, "cat /tmp/state"); out != "from-parent\n" {
			t.Fatalf("child of the snapshot sees %q", out)
		}
		tn.Delete(bg, child.Id)
		if tn.snapshotByID(snap.Id) == nil {
			t.Fatal("a named snapshot went with its child")
		}
	})
}

func TestReadoption(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	kept := tn.create(bg, nil)
	paused := tn.create(bg, nil)
	dies := tn.create(bg, nil)
	tn.sh(bg, kept.Id, "echo kept > /tmp/f")
	tn.Pause(bg, paused.Id)
	s, _ := tn.lookup(bg, dies.Id)
	inst := s.inst
	tn.restart(func() {
		substratetest.Crash(inst)
		<-inst.Done()
	})

	t.Run("a sandbox that ran on is re-adopted with its state", func(t *testing.T) {
		if st, _ := tn.state(kept.Id); st != "running" {
			t.Fatalf("state %s", st)
		}
		if out := tn.sh(bg, kept.Id, "cat /tmp/f"); out != "kept\n" {
			t.Fatalf("after re-adoption: %q", out)
		}
	})
	t.Run("a paused sandbox is re-adopted paused and resumes on a call", func(t *testing.T) {
		if st, _ := tn.state(paused.Id); st != "paused" {
			t.Fatalf("state %s", st)
		}
		tn.sh(bg, paused.Id, "true")
		if st, _ := tn.state(paused.Id); st != "running" {
			t.Fatalf("state %s", st)
		}
	})
	t.Run("a sandbox that died while the node was down is tombstoned failed", func(t *testing.T) {
		if st, why := tn.state(dies.Id); st != "failed" || why != "stopped while the node was down" {
			t.Fatalf("state %s (%s)", st, why)
		}
		_, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: dies.Id, Cmd: "true"})
		if !errdefs.Is(err, errdefs.KindGone) || !errdefs.IsInfra(err) {
			t.Fatalf("exec: %v", err)
		}
	})
	t.Run("the load counts only the re-adopted sandboxes", func(t *testing.T) {
		if l := tn.Load(); l.Sandboxes != 2 || l.Projects[tenant.DefaultProject] != 2 {
			t.Fatalf("load %+v", l)
		}
	})
}

func TestAdmission(t *testing.T) {
	t.Parallel()

	t.Run("creates beyond the node's limit are refused as exhausted", func(t *testing.T) {
		tn := newTestNode(t, func(c *Config, _ *substratetest.Fake) { c.MaxSandboxes = 2 })
		tn.create(bg, nil)
		tn.create(bg, nil)
		_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}})
		if e := errdefs.Classify(err); e.Kind != errdefs.KindExhausted || e.RetryAfter <= 0 || !e.Retryable {
			t.Fatalf("third create: %v", err)
		}
	})

	t.Run("creates beyond the start queue are refused, and queued ones start in turn by project", func(t *testing.T) {
		gate := make(chan struct{})
		var mu sync.Mutex
		var started []string
		tn := newTestNode(t, func(c *Config, f *substratetest.Fake) {
			c.MaxConcurrentStarts, c.StartQueue = 1, 3
			f.BeforeCreate = func(ctx context.Context, spec *substrate.Spec) error {
				mu.Lock()
				for _, e := range spec.Env {
					if who, ok := strings.CutPrefix(e, "WHO="); ok {
						started = append(started, who)
					}
				}
				mu.Unlock()
				<-gate
				return nil
			}
		})
		var wg sync.WaitGroup
		create := func(project, who string) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := tn.Create(as(project), &dsecv1.CreateSandboxRequest{Project: project, Spec: &dsecv1.SandboxSpec{Image: "busybox", Env: map[string]string{"WHO": who}}})
				if err != nil {
					t.Error(err)
				}
			}()
		}
		waitQueued := func(n int) {
			eventually(t, fmt.Sprintf("%d creates wait", n), func() bool { _, q, _ := tn.starts.stats(); return q == n })
		}
		create("a", "a0")
		eventually(t, "the first create starts", func() bool { mu.Lock(); defer mu.Unlock(); return len(started) == 1 })
		create("a", "a1")
		waitQueued(1)
		create("a", "a2")
		waitQueued(2)
		create("b", "b1")
		waitQueued(3)
		_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}})
		if !errdefs.Is(err, errdefs.KindExhausted) {
			t.Fatalf("a create beyond the queue: %v", err)
		}
		if c := tn.Capacity(bg); c.QueueDepth != 3 || c.Running != 0 {
			t.Fatalf("capacity %+v", c)
		}
		if l := tn.Load(); l.Sandboxes != 4 || l.Projects["a"] != 3 || l.Projects["b"] != 1 {
			t.Fatalf("load %+v", l)
		}
		close(gate)
		wg.Wait()
		if want := []string{"a0", "a1", "b1", "a2"}; fmt.Sprint(started) != fmt.Sprint(want) {
			t.Fatalf("started %v, want %v (round-robin between projects)", started, want)
		}
	})
}

func TestTenancy(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	mine := tn.create(as("a"), nil)
	gone := tn.create(as("a"), nil)
	tn.Delete(as("a"), gone.Id)
	other := as("b")
	unknown := "aaaaaaaaaaaaaaaa-test"

	calls := []struct {
		name string
		call func(id string) error
	}{
		{"get", func(id string) error { _, err := tn.Get(other, id); return err }},
		{"exec", func(id string) error {
			_, err := tn.Exec(other, &dsecv1.ExecRequest{SandboxId: id, Cmd: "true"})
			return err
		}},
		{"write a file", func(id string) error {
			_, err := tn.WriteFile(other, &dsecv1.WriteFileHeader{SandboxId: id, Path: "/tmp/x"}, strings.NewReader("x"))
			return err
		}},
		{"pause", func(id string) error { _, err := tn.Pause(other, id); return err }},
		{"keepalive", func(id string) error {
			_, err := tn.Keepalive(other, &dsecv1.KeepaliveRequest{Id: id})
			return err
		}},
		{"snapshot", func(id string) error {
			_, err := tn.Snapshot(other, &dsecv1.SnapshotRequest{SandboxId: id})
			return err
		}},
		{"fork", func(id string) error {
			_, err := tn.Fork(other, &dsecv1.ForkRequest{SandboxId: id, Count: 1})
			return err
		}},
		{"read the log", func(id string) error {
			_, err := tn.GetLog(other, &dsecv1.GetLogRequest{SandboxId: id})
			return err
		}},
	}
	for _, c := range calls {
		t.Run("another project's "+c.name+" answers as for an unknown sandbox", func(t *testing.T) {
			want := c.call(unknown)
			if !errdefs.Is(want, errdefs.KindNotFound) {
				t.Fatalf("unknown sandbox: %v", want)
			}
			for _, id := range []string{mine.Id, gone.Id} {
				got := c.call(id)
				if !errdefs.Is(got, errdefs.KindNotFound) || strings.ReplaceAll(got.Error(), id, unknown) != want.Error() {
					t.Fatalf("%s: %v, want %v", id, got, want)
				}
			}
		})
	}
	t.Run("another project's delete does nothing", func(t *testing.T) {
		if err := tn.Delete(other, mine.Id); err != nil {
			t.Fatal(err)
		}
		if st, _ := tn.state(mine.Id); st != "running" {
			t.Fatalf("state %s", st)
		}
	})
	t.Run("listings hold only the caller's project's sandboxes, an operator's all", func(t *testing.T) {
		theirs := tn.create(other, nil)
		for ctx, want := range map[context.Context][]string{
			as("a"):                             {mine.Id},
			other:                               {theirs.Id},
			tenant.System(context.Background()): {mine.Id, theirs.Id},
			as(tenant.DefaultProject):           nil,
		} {
			list, err := tn.List(ctx, &dsecv1.ListSandboxesRequest{})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, s := range list.Sandboxes {
				got = append(got, s.Id)
			}
			sort.Strings(got)
			sort.Strings(want)
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("%s lists %v, want %v", tenant.Project(ctx), got, want)
			}
		}
	})
}

func TestWarmPools(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, func(c *Config, _ *substratetest.Fake) {
		c.Pools = []PoolConfig{{Image: "busybox", Size: 1}}
	})
	ready := func() int32 { return tn.Capacity(bg).Pools[0].Ready }
	eventually(t, "the pool fills", func() bool { return ready() == 1 })

	t.Run("a create of the pool's shape gets a pooled sandbox, personalized", func(t *testing.T) {
		sb := tn.create(bg, &dsecv1.SandboxSpec{Env: map[string]string{"GREETING": "hello"}, Labels: map[string]string{"job": "pooled"}})
		if p := tn.Capacity(bg).Pools[0]; p.Hits != 1 {
			t.Fatalf("pool %+v", p)
		}
		if out := tn.sh(bg, sb.Id, "echo $GREETING"); out != "hello\n" {
			t.Fatalf("env %q", out)
		}
		if sb.Spec.Labels["job"] != "pooled" || sb.Spec.TtlS != int64(tn.Node.cfg.DefaultTTL/time.Second) {
			t.Fatalf("spec %v", sb.Spec)
		}
	})
	t.Run("the pool refills", func(t *testing.T) {
		eventually(t, "the pool refills", func() bool { return ready() == 1 })
	})
	t.Run("pooled sandboxes are not listed", func(t *testing.T) {
		list, _ := tn.List(bg, &dsecv1.ListSandboxesRequest{})
		if len(list.Sandboxes) != 1 {
			t.Fatalf("%d listed", len(list.Sandboxes))
		}
	})
	t.Run("a create of another shape starts its own", func(t *testing.T) {
		tn.create(bg, &dsecv1.SandboxSpec{Resources: &dsecv1.Resources{MemoryMb: 256}})
		if p := tn.Capacity(bg).Pools[0]; p.Hits != 1 || p.Misses != 0 {
			t.Fatalf("pool %+v", p)
		}
	})
}

func TestCreateFailures(t *testing.T) {
	t.Parallel()
	refuse := errors.New("refused by the test")
	tn := newTestNode(t, func(_ *Config, f *substratetest.Fake) {
		f.BeforeCreate = func(ctx context.Context, spec *substrate.Spec) error {
			if slices.Contains(spec.Env, "FAIL=yes") {
				return errdefs.Unavailable("%v", refuse)
			}
			return nil
		}
	})
	_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Env: map[string]string{"FAIL": "yes"}}})
	if !errdefs.Is(err, errdefs.KindUnavailable) {
		t.Fatalf("create: %v", err)
	}

	t.Run("a failed create leaves nothing", func(t *testing.T) {
		if l := tn.Load(); l.Sandboxes != 0 || len(l.Projects) != 0 {
			t.Fatalf("load %+v", l)
		}
		if len(tn.sandboxes.layers()) != 0 {
			t.Fatalf("layers held: %v", tn.sandboxes.layers())
		}
		eventually(t, "the sandbox directory goes", func() bool {
			ents, _ := osReadDir(tn.cfg.DataDir, "sandboxes")
			return len(ents) == 0
		})
	})
	t.Run("the next create succeeds", func(t *testing.T) {
		tn.create(bg, nil)
	})
}

// stubborn is an instance that will not die.
type stubborn struct{ substrate.Instance }

func (stubborn) Destroy(context.Context) error { return errors.New("the instance will not die") }

func TestRelease(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)

	t.Run("a delete whose instance will not die fails and leaves the sandbox as it was", func(t *testing.T) {
		sb := tn.create(bg, nil)
		tn.Pause(bg, sb.Id)
		s, _ := tn.lookup(bg, sb.Id)
		real := s.inst
		s.inst = stubborn{real}
		if err := tn.Delete(bg, sb.Id); !errdefs.Is(err, errdefs.KindInternal) {
			t.Fatalf("delete: %v", err)
		}
		if st, _ := tn.state(sb.Id); st != "paused" {
			t.Fatalf("state %s", st)
		}
		s.inst = real
		if err := tn.Delete(bg, sb.Id); err != nil {
			t.Fatalf("delete again: %v", err)
		}
		if st, _ := tn.state(sb.Id); st != "deleted" {
			t.Fatalf("state %s", st)
		}
	})

	t.Run("tombstones, their keys and logs are purged after their time", func(t *testing.T) {
		req := &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, IdempotencyKey: "purged"}
		sb, err := tn.Create(bg, req)
		if err != nil {
			t.Fatal(err)
		}
		tn.sh(bg, sb.Id, "true")
		tn.Delete(bg, sb.Id)
		tn.purge(time.Now().Add(-time.Hour))
		if st, _ := tn.state(sb.Id); st != "deleted" {
			t.Fatalf("a recent tombstone was purged: %s", st)
		}
		tn.purge(time.Now().Add(time.Second))
		if _, err := tn.Get(bg, sb.Id); !errdefs.Is(err, errdefs.KindNotFound) || err.Error() != notFound(sb.Id).Error() {
			t.Fatalf("get after the purge: %v", err)
		}
		if tn.logs.Exists(sb.Id) {
			t.Fatal("the log outlived its tombstone")
		}
		again, err := tn.Create(bg, req)
		if err != nil || again.Id == sb.Id {
			t.Fatalf("the key still answers the purged sandbox: %v %v", again, err)
		}
	})
}
