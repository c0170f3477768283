package e2e

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func TestSessionsSnapshotsAndLogsSurviveRestart(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	if _, err := c.OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: "trainer-a", HeartbeatS: 60, GraceS: 600}); err != nil {
		t.Fatal(err)
	}
	sb := create(t, c, dsec.CreateOptions{Session: "trainer-a"})
	first, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "echo once >> /tmp/t; wc -l < /tmp/t", RequestID: "traj/1"})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot(ctx, sb.ID, "before-restart")
	if err != nil {
		t.Fatal(err)
	}
	srv.Restart()

	t.Run("the session is still there", func(t *testing.T) {
		list, err := c.ListSessions(ctx)
		if err != nil || len(list) != 1 || list[0].Name != "trainer-a" || list[0].State != "active" {
			t.Fatalf("sessions after restart: %v %v", list, err)
		}
	})
	t.Run("the trajectory log still answers a repeated request", func(t *testing.T) {
		again, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "echo once >> /tmp/t; wc -l < /tmp/t", RequestID: "traj/1"})
		if err != nil {
			t.Fatal(err)
		}
		if !again.Replayed || string(again.Stdout) != string(first.Stdout) || again.Seq != first.Seq {
			t.Fatalf("after restart: %+v (first %+v)", again, first)
		}
		entries, err := c.Log(ctx, sb.ID, 0)
		if err != nil || len(entries) < 1 || entries[0].RequestId != "traj/1" {
			t.Fatalf("log after restart: %v %v", entries, err)
		}
	})
	t.Run("the snapshot still starts sandboxes", func(t *testing.T) {
		snaps, err := c.ListSnapshots(ctx)
		if err != nil || len(snaps) != 1 || snaps[0].Id != snap.Id {
			t.Fatalf("snapshots after restart: %v %v", snaps, err)
		}
		child := create(t, c, dsec.CreateOptions{Snapshot: snap.Id})
		r, err := child.Exec(ctx, dsec.Cmd("cat /tmp/t"))
		if err != nil || string(r.Stdout) != "once\n" {
			t.Fatalf("child: %v %v", r, err)
		}
	})
	t.Run("a paused sandbox stays paused across a restart and resumes on a call", func(t *testing.T) {
		if _, err := c.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		srv.Restart()
		if info, _ := c.Get(ctx, sb.ID); info.GetState() != "paused" {
			t.Fatalf("state after restart: %v", info)
		}
		r, err := sb.Exec(ctx, dsec.Cmd("echo back"))
		if err != nil || string(r.Stdout) != "back\n" {
			t.Fatalf("exec on a paused, re-adopted sandbox: %v %v", r, err)
		}
	})
	t.Run("an answered call is in the log when its node is killed right after", func(t *testing.T) {
		// The log is written and synced before the answer: a crash of
		// the node process loses nothing it answered, and the call is
		// not run twice.
		cmd := dsec.ExecOptions{Cmd: "echo crash >> /tmp/crash; wc -l < /tmp/crash", RequestID: "traj/crash"}
		first, err := sb.Exec(ctx, cmd)
		if err != nil || string(first.Stdout) != "1\n" {
			t.Fatalf("the call: %v %v", first, err)
		}
		srv.Kill()
		srv.Restart()
		again, err := sb.Exec(ctx, cmd)
		if err != nil || !again.Replayed || again.Seq != first.Seq || string(again.Stdout) != "1\n" {
			t.Fatalf("the call repeated after its node was killed: %+v %v (first %+v)", again, err, first)
		}
		if r, err := sb.Exec(ctx, dsec.Cmd("wc -l < /tmp/crash")); err != nil || string(r.Stdout) != "1\n" {
			t.Fatalf("the command ran %q times: %v", r.GetStdout(), err)
		}
	})
}

func TestSessionExpiryPausesAndReopeningResumes(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 2*time.Minute)
	for _, tc := range []struct{ onExpire, want string }{{"pause", "paused"}, {"delete", "deleted"}} {
		t.Run("on_expire "+tc.onExpire, func(t *testing.T) {
			name := "s-" + tc.onExpire
			if _, err := c.OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: name, HeartbeatS: 1, GraceS: 2, OnExpire: tc.onExpire}); err != nil {
				t.Fatal(err)
			}
			sb := create(t, c, dsec.CreateOptions{Session: name})
			// No heartbeats: the trainer "died".
			deadline := time.Now().Add(15 * time.Second)
			var state string
			for time.Now().Before(deadline) {
				info, _ := c.Get(ctx, sb.ID)
				if state = info.GetState(); state == tc.want {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if state != tc.want {
				t.Fatalf("state %q, want %q", state, tc.want)
			}
			if tc.onExpire == "delete" {
				// Its end says the session's expiry ended it.
				if info, err := c.Get(ctx, sb.ID); err != nil || info.GetEndCause() != "session_expired" || info.GetInfra() {
					t.Fatalf("get after the expiry: %v (%v); want end cause session_expired, not infra", info, err)
				}
			}
			if _, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Session: name}); kind(err) != "conflict" {
				t.Fatalf("create in an expired session: %v", err)
			}
			s, err := c.OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: name, HeartbeatS: 1, GraceS: 2, OnExpire: tc.onExpire})
			if err != nil {
				t.Fatal(err)
			}
			if tc.onExpire == "pause" {
				if s.Resumed != 1 {
					t.Fatalf("reopen resumed %d sandboxes", s.Resumed)
				}
				if info, _ := c.Get(ctx, sb.ID); info.GetState() != "running" {
					t.Fatalf("after reopening: %v", info)
				}
			}
			c.CloseSession(ctx, name, true)
			_, _, samples := dsectest.Scrape(t, srv.URL, "")
			if n := samples[`dsec_session_expiries_total{action="`+tc.onExpire+`"}`]; n != 1 {
				t.Errorf("%v %s expiries counted, want 1", n, tc.onExpire)
			}
		})
	}
}

func TestBurstOverCapacityQueuesAndNeverFailsWithServerErrors(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{Args: []string{"--max-starts", "2", "--start-queue", "6"}})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	const burst = 80 // 10x the 8 starts the node takes at once (2 running + 6 queued)
	var mu sync.Mutex
	kinds := map[string]int{}
	var created []string
	var wg sync.WaitGroup
	for i := 0; i < burst; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Labels: map[string]string{"burst": "1"}})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				var e *dsec.Error
				if errors.As(err, &e) && e.Kind == "exhausted" && e.RetryAfter <= 0 {
					kinds["exhausted without retry-after"]++
					return
				}
				kinds[kind(err)]++
				return
			}
			kinds["ok"]++
			created = append(created, sb.ID)
		}()
	}
	wg.Wait()
	for k, n := range kinds {
		if k != "ok" && k != "exhausted" {
			t.Errorf("%d creates failed with %q", n, k)
		}
	}
	if kinds["exhausted"] == 0 {
		t.Errorf("no create was refused: the queue bound did not apply (%v)", kinds)
	}
	for _, id := range created {
		if _, err := c.Sandbox(id).Exec(ctx, dsec.Cmd("true")); err != nil {
			t.Errorf("accepted sandbox %s unusable: %v", id, err)
		}
	}
	t.Logf("burst of %d: %v", burst, kinds)
	c.Bulk(ctx, "delete", "burst=1")
}

func TestWarmPool(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{Args: []string{"--pool", "busybox:2"}})
	c := srv.Client()
	ctx := ctxFor(t, 2*time.Minute)
	waitReady := func(n int32) *dsecv1.PoolStats {
		deadline := time.Now().Add(30 * time.Second)
		for {
			capy, err := c.Capacity(ctx)
			if err == nil && len(capy.Pools) == 1 && capy.Pools[0].Ready >= n {
				return capy.Pools[0]
			}
			if time.Now().After(deadline) {
				t.Fatalf("pool not ready: %v %v", capy, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitReady(2)
	sb := create(t, c, dsec.CreateOptions{Env: map[string]string{"FROM_SPEC": "yes"}, Labels: map[string]string{"p": "1"}, TTL: 90 * time.Second})
	st := waitReady(1)
	if st.Hits != 1 {
		t.Fatalf("pool stats %v", st)
	}
	r, err := sb.Exec(ctx, dsec.Cmd("echo $FROM_SPEC"))
	if err != nil || string(r.Stdout) != "yes\n" {
		t.Fatalf("a pooled sandbox lacks its spec's environment: %v %v", r, err)
	}
	info, _ := c.Get(ctx, sb.ID)
	if d := time.Until(info.ExpiresAt.AsTime()); d > 91*time.Second || d < 60*time.Second {
		t.Fatalf("a pooled sandbox's TTL is %v, want the create's 90s", d)
	}
	// A refill that yields to takes still happens once they pause.
	waitReady(2)
	// More creates at once than the pool holds: at least one misses. One
	// after another, each could find a sandbox the pool refilled after
	// the last (CI: 3 creates in a row, 3 hits).
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: 90 * time.Second})
			if err != nil {
				t.Errorf("create: %v", err)
				return
			}
			t.Cleanup(func() { sb.Close() })
		}()
	}
	wg.Wait()
	capy, _ := c.Capacity(ctx)
	if capy.Pools[0].Misses < 1 || capy.Pools[0].Hits < 2 {
		t.Fatalf("draining the pool: %v", capy.Pools[0])
	}
}

func TestReplayIntoAFreshSandboxReportsDivergence(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 2*time.Minute)
	sb := create(t, c, dsec.CreateOptions{})
	steps := []string{"echo deterministic > /work/a", "cat /work/a", "cat /proc/sys/kernel/random/uuid"}
	sb.WriteFile(ctx, "/work/in.txt", strings.NewReader("input"), 0o600)
	for _, s := range steps {
		if _, err := sb.Exec(ctx, dsec.Cmd("mkdir -p /work; "+s)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := sb.Exec(ctx, dsec.ExecOptions{Argv: []string{"cat"}, Stdin: []byte("stdin replays too")}); err != nil {
		t.Fatal(err)
	}
	sb.Close() // replay works from the log after the sandbox is gone
	resp, err := c.Replay(ctx, &dsecv1.ReplayRequest{SandboxId: sb.ID})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range resp.Steps {
		got = append(got, fmt.Sprintf("%s:%v", s.Op, s.Diverged))
	}
	want := "write_file:false,exec:false,exec:false,exec:true,exec:false"
	if strings.Join(got, ",") != want || resp.Diverged != 1 {
		t.Fatalf("replay steps %s (diverged %d), want %s", strings.Join(got, ","), resp.Diverged, want)
	}
	if _, err := c.Get(ctx, resp.SandboxId); err != nil {
		t.Fatal(err)
	}
	if info, _ := c.Get(ctx, resp.SandboxId); info.State != "deleted" {
		t.Fatalf("the replay sandbox was kept: %v", info.State)
	}
}

func TestForkGivesEachChildItsOwnLayer(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	parent := create(t, c, dsec.CreateOptions{Labels: map[string]string{"job": "grpo"}})
	parent.Exec(ctx, dsec.Cmd("mkdir -p /repo && echo base > /repo/f && rm -rf /usr/bin/vi"))
	layersDir := filepath.Join(srv.DataDir, "images", "layers")
	layersBefore := countEntries(t, layersDir)
	resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: parent.ID, Count: 8, IdempotencyKey: "g1"})
	if err != nil || resp.Created != 8 {
		t.Fatalf("fork: %v %v", resp, err)
	}
	again, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: parent.ID, Count: 8, IdempotencyKey: "g1"})
	if err != nil || again.Results[3].Sandbox.Id != resp.Results[3].Sandbox.Id {
		t.Fatalf("a retried fork made new children")
	}
	// The retry's own snapshot started no child, so it is gone already.
	if snaps, _ := c.ListSnapshots(ctx); len(snaps) != 1 {
		t.Fatalf("after a fork and its retry: %d snapshots, want 1", len(snaps))
	}
	for i, r := range resp.Results {
		kid := c.Sandbox(r.Sandbox.Id)
		if _, err := kid.Exec(ctx, dsec.Cmd(fmt.Sprintf("echo %d >> /repo/f", i))); err != nil {
			t.Fatal(err)
		}
	}
	for i, r := range resp.Results {
		out, _ := c.Sandbox(r.Sandbox.Id).Exec(ctx, dsec.Cmd("cat /repo/f; test -e /usr/bin/vi || echo no-vi"))
		if string(out.Stdout) != fmt.Sprintf("base\n%d\nno-vi\n", i) {
			t.Fatalf("child %d sees %q", i, out.Stdout)
		}
		if r.Sandbox.Spec.Labels["job"] != "grpo" || r.Sandbox.Spec.Labels["dsec.io/fork-of"] != parent.ID {
			t.Fatalf("child labels %v", r.Sandbox.Spec.Labels)
		}
	}
	pr, _ := parent.Exec(ctx, dsec.Cmd("cat /repo/f"))
	if string(pr.Stdout) != "base\n" {
		t.Fatalf("children wrote into the parent: %q", pr.Stdout)
	}
	if _, err := c.Bulk(ctx, "delete", "dsec.io/fork-of="+parent.ID); err != nil {
		t.Fatal(err)
	}
	// A fork's snapshot lives as long as its children: with the last one
	// deleted, the snapshot and its layer are gone.
	if snaps, _ := c.ListSnapshots(ctx); len(snaps) != 0 {
		t.Fatalf("fork snapshots outlived their children: %v", snaps)
	}
	if n := countEntries(t, layersDir); n != layersBefore {
		t.Fatalf("layer files: %d before the fork, %d after its children were deleted", layersBefore, n)
	}
}

func countEntries(t *testing.T, dir string) int {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}
