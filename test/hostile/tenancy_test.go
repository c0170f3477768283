package hostile

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// unknownLike is a well-formed ID on the same node that no sandbox has.
func unknownLike(id string) string {
	return "aaaaaaaaaaaaaaaa" + id[16:]
}

// sameAnswer checks that a call on another project's sandbox fails exactly
// as the same call on an ID that does not exist: not found, with the same
// message (the ID aside), so the answer says nothing about the sandbox.
func sameAnswer(t *testing.T, what, victim string, call func(id string) error) {
	t.Helper()
	errVictim := call(victim)
	ghost := unknownLike(victim)
	errGhost := call(ghost)
	if errVictim == nil {
		t.Errorf("%s on another project's sandbox succeeded", what)
		return
	}
	if kindOf(errVictim) != "not_found" {
		t.Errorf("%s on another project's sandbox: %v (kind %q), want not_found", what, errVictim, kindOf(errVictim))
	}
	a := strings.ReplaceAll(errVictim.Error(), victim, "ID")
	b := strings.ReplaceAll(fmt.Sprint(errGhost), ghost, "ID")
	if a != b {
		t.Errorf("%s: another project's sandbox answers %q, an unknown ID %q: an existence oracle", what, a, b)
	}
}

func TestAnotherProjectsKeyReachesNothing(t *testing.T) {
	a, b := client(t), clientFor(t, keyB)
	ctx := ctxFor(t, 5*time.Minute)
	victim := create(t, a, dsec.CreateOptions{Labels: map[string]string{"job": "shared-name"}, IdempotencyKey: "same-key"})
	if _, err := victim.WriteFile(ctx, "/tmp/secret.txt", strings.NewReader("the answer is 42"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := victim.Exec(ctx, dsec.Cmd("echo logged")); err != nil {
		t.Fatal(err)
	}
	nb := newNeighbour(t)
	id := victim.ID
	sb := b.Raw()

	t.Run("listing shows none of them", func(t *testing.T) {
		list, err := b.List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range list {
			if s.Id == id {
				t.Fatalf("project B lists project A's sandbox %s", id)
			}
		}
		list, err = b.List(ctx, "job=shared-name")
		if err != nil || len(list) != 0 {
			t.Fatalf("project B lists %d sandboxes by A's label (%v)", len(list), err)
		}
	})
	t.Run("every verb on one of them answers as for an unknown ID", func(t *testing.T) {
		sameAnswer(t, "get", id, func(id string) error { _, err := b.Get(ctx, id); return err })
		sameAnswer(t, "exec", id, func(id string) error { _, err := b.Sandbox(id).Exec(ctx, dsec.Cmd("cat /tmp/secret.txt")); return err })
		sameAnswer(t, "exec stream", id, func(id string) error {
			st, err := b.Sandbox(id).Start(ctx, dsec.Cmd("cat /tmp/secret.txt"), false)
			if err != nil {
				return err
			}
			defer st.Close()
			_, err = st.Wait(io.Discard, io.Discard)
			return err
		})
		sameAnswer(t, "read file", id, func(id string) error {
			_, err := b.Sandbox(id).ReadFile(ctx, "/tmp/secret.txt", io.Discard)
			return err
		})
		sameAnswer(t, "write file", id, func(id string) error {
			_, err := b.Sandbox(id).WriteFile(ctx, "/tmp/planted", strings.NewReader("x"), 0o644)
			return err
		})
		sameAnswer(t, "stat", id, func(id string) error { _, err := b.Sandbox(id).Stat(ctx, "/tmp"); return err })
		sameAnswer(t, "list dir", id, func(id string) error { _, err := b.Sandbox(id).ListDir(ctx, "/tmp", 1); return err })
		sameAnswer(t, "processes", id, func(id string) error { _, err := b.Sandbox(id).Processes(ctx); return err })
		sameAnswer(t, "stats", id, func(id string) error { _, err := b.Sandbox(id).Stats(ctx); return err })
		sameAnswer(t, "keepalive", id, func(id string) error { _, err := b.Sandbox(id).Keepalive(ctx, time.Hour); return err })
		sameAnswer(t, "pause", id, func(id string) error { _, err := b.Pause(ctx, id); return err })
		sameAnswer(t, "resume", id, func(id string) error { _, err := b.Resume(ctx, id); return err })
		sameAnswer(t, "log", id, func(id string) error { _, err := b.Log(ctx, id, 0); return err })
		sameAnswer(t, "snapshot", id, func(id string) error { _, err := b.Snapshot(ctx, id, "stolen"); return err })
		sameAnswer(t, "fork", id, func(id string) error { _, err := b.Fork(ctx, &dsecv1.ForkRequest{SandboxId: id, Count: 1}); return err })
		sameAnswer(t, "replay", id, func(id string) error { _, err := b.Replay(ctx, &dsecv1.ReplayRequest{SandboxId: id}); return err })
		sameAnswer(t, "signal", id, func(id string) error {
			_, err := sb.SignalProcess(ctx, connect.NewRequest(&dsecv1.SignalProcessRequest{SandboxId: id, ProcessId: "1", Signal: "KILL"}))
			return fromConnect(err)
		})
		sameAnswer(t, "watch", id, func(id string) error {
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			st, err := sb.WatchDir(wctx, connect.NewRequest(&dsecv1.WatchDirRequest{SandboxId: id, Path: "/tmp"}))
			if err != nil {
				return fromConnect(err)
			}
			defer st.Close()
			if st.Receive() {
				return nil // the watch started: it works
			}
			return fromConnect(st.Err())
		})
	})
	t.Run("a delete of one of them does nothing", func(t *testing.T) {
		if err := b.Delete(ctx, id); err != nil {
			t.Fatalf("delete answered %v; it should answer as for an unknown ID (success)", err)
		}
		resp, err := b.Bulk(ctx, "delete", "job=shared-name")
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Ids) != 0 {
			t.Fatalf("a bulk delete by A's label reached %v", resp.Ids)
		}
		if _, err := b.Bulk(ctx, "pause", "job=shared-name"); err != nil {
			t.Fatal(err)
		}
		got, err := a.Get(ctx, id)
		if err != nil || got.State != "running" {
			t.Fatalf("project A's sandbox after B's deletes and pauses: %v, %v", got.GetState(), err)
		}
	})
	t.Run("the same idempotency key makes B its own sandbox", func(t *testing.T) {
		mine := create(t, b, dsec.CreateOptions{IdempotencyKey: "same-key"})
		if mine.ID == id {
			t.Fatalf("B's create with A's idempotency key returned A's sandbox")
		}
	})
	t.Run("the files endpoint answers as for an unknown ID", func(t *testing.T) {
		get := func(id string) (int, string) {
			req, _ := http.NewRequestWithContext(ctx, "GET", srv(t).URL+"/v1/sandboxes/"+id+"/files?path=/tmp/secret.txt", nil)
			req.Header.Set("Authorization", "Bearer "+secret(keyB))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, strings.ReplaceAll(string(body), id, "ID")
		}
		code, body := get(id)
		ghostCode, ghostBody := get(unknownLike(id))
		if code != http.StatusNotFound || code != ghostCode || body != ghostBody {
			t.Fatalf("GET another project's file: %d %q; an unknown ID: %d %q", code, body, ghostCode, ghostBody)
		}
		if strings.Contains(body, "42") {
			t.Fatalf("the file's content leaked: %q", body)
		}
	})
	t.Run("the E2B facade answers as for an unknown sandbox", func(t *testing.T) {
		e2b := func(method, path string) (int, string) {
			req, _ := http.NewRequestWithContext(ctx, method, srv(t).URL+path, nil)
			req.Header.Set("X-API-Key", secret(keyB))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(body)
		}
		for _, c := range []struct{ method, path string }{
			{"GET", "/sandboxes/%s"}, {"POST", "/sandboxes/%s/connect"}, {"POST", "/sandboxes/%s/timeout"},
			{"GET", "/sandboxes/%s/metrics"}, {"POST", "/sandboxes/%s/pause"}, {"DELETE", "/sandboxes/%s"},
		} {
			code, body := e2b(c.method, fmt.Sprintf(c.path, id))
			ghostCode, ghostBody := e2b(c.method, fmt.Sprintf(c.path, unknownLike(id)))
			body, ghostBody = strings.ReplaceAll(body, id, "ID"), strings.ReplaceAll(ghostBody, unknownLike(id), "ID")
			if code < 400 || code != ghostCode || body != ghostBody {
				t.Errorf("%s %s: %d %s; for an unknown ID: %d %s", c.method, c.path, code, body, ghostCode, ghostBody)
			}
			if strings.Contains(body, "envdAccessToken") {
				t.Errorf("%s %s leaked the sandbox's access token", c.method, c.path)
			}
		}
		code, body := e2b("GET", "/v2/sandboxes")
		if code != 200 || strings.Contains(body, id) {
			t.Errorf("E2B list as project B: %d, lists A's sandbox: %v", code, strings.Contains(body, id))
		}
		if got, err := a.Get(ctx, id); err != nil || got.State != "running" {
			t.Fatalf("project A's sandbox after B's E2B calls: %v, %v", got.GetState(), err)
		}
	})
	t.Run("snapshots, images and sessions of A are not B's", func(t *testing.T) {
		snap, err := a.Snapshot(ctx, id, "a-snap")
		if err != nil {
			t.Fatal(err)
		}
		snaps, err := b.ListSnapshots(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range snaps {
			if s.Id == snap.Id {
				t.Fatalf("B lists A's snapshot")
			}
		}
		if err := b.DeleteSnapshot(ctx, snap.Id); kindOf(err) != "not_found" {
			t.Fatalf("B deleting A's snapshot: %v", err)
		}
		if _, err := b.Create(ctx, dsec.CreateOptions{Snapshot: snap.Id}); kindOf(err) != "not_found" {
			t.Fatalf("B starting from A's snapshot: %v", err)
		}
		if _, err := a.BootstrapImage(ctx, &dsecv1.BootstrapImageRequest{Recipe: "busybox", Name: "a-private", Force: true}, nil); err != nil {
			t.Fatal(err)
		}
		imgs, err := b.ListImages(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, img := range imgs {
			if img.Name == "a-private" {
				t.Fatalf("B lists A's image")
			}
		}
		if _, err := b.Create(ctx, dsec.CreateOptions{Image: "a-private"}); kindOf(err) != "not_found" {
			t.Fatalf("B starting from A's image: %v", err)
		}
		if err := b.DeleteImage(ctx, "a-private"); kindOf(err) != "not_found" {
			t.Fatalf("B deleting A's image: %v", err)
		}
		if err := b.DeleteImage(ctx, "busybox"); kindOf(err) != "permission_denied" {
			t.Fatalf("B deleting the shared busybox image: %v", err)
		}
		if mine := create(t, a, dsec.CreateOptions{Image: "a-private"}); mine == nil {
			t.Fatal("A cannot use its own image")
		}

		if _, err := a.OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: "trainer", HeartbeatS: 1, GraceS: 2, OnExpire: "delete"}); err != nil {
			t.Fatal(err)
		}
		if _, err := b.Heartbeat(ctx, "trainer"); kindOf(err) != "not_found" {
			t.Fatalf("B heartbeating A's session: %v", err)
		}
		if _, err := b.CloseSession(ctx, "trainer", true); kindOf(err) != "not_found" {
			t.Fatalf("B closing A's session: %v", err)
		}
		sessions, err := b.ListSessions(ctx)
		if err != nil || len(sessions) != 0 {
			t.Fatalf("B lists sessions %v (%v)", sessions, err)
		}
		// B's own session of the same name, and a sandbox bound to it: A's
		// session expiring (deleting its sandboxes) must not touch it.
		if _, err := b.OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: "trainer", HeartbeatS: 60, GraceS: 600}); err != nil {
			t.Fatal(err)
		}
		bound := create(t, b, dsec.CreateOptions{Session: "trainer"})
		// A's trainer stops heartbeating: its session expires and deletes
		// its sandboxes.
		waitState(t, a, "trainer", "expired")
		if got, err := b.Get(ctx, bound.ID); err != nil || got.State != "running" {
			t.Fatalf("B's sandbox bound to its own session %q after A's expired: %v, %v", "trainer", got.GetState(), err)
		}
	})
	t.Run("an operator reaches every project", func(t *testing.T) {
		admin := clientFor(t, keyAdmin)
		if _, err := admin.Get(ctx, id); err != nil {
			t.Fatalf("the operator cannot see A's sandbox: %v", err)
		}
		list, err := admin.List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, s := range list {
			seen[s.Id] = true
		}
		if !seen[id] || !seen[nb.sb.ID] {
			t.Fatalf("the operator lists %d sandboxes, missing A's or B's", len(list))
		}
	})
	nb.check(t)
}

// waitState waits until a's session name is in state.
func waitState(t *testing.T, c *dsec.Client, name, state string) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	for {
		list, err := c.ListSessions(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range list {
			if s.Name == name && s.State == state {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("session %s never became %s", name, state)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// fromConnect turns a raw client's error into the SDK's typed error.
func fromConnect(err error) error {
	if err == nil {
		return nil
	}
	return dsec.AsError(err)
}

// childrenOf lists pid's descendants.
func childrenOf(pid int) []int {
	var out []int
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, task := range tasks {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
				out = append(out, childrenOf(c)...)
			}
		}
	}
	return out
}

// rssOf is a process's resident memory in bytes (0 if it is gone).
func rssOf(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func TestRequestsAreAuthenticatedBeforeTheirBodiesAreRead(t *testing.T) {
	s := srv(t)
	ctx := ctxFor(t, 3*time.Minute)
	nb := newNeighbour(t)
	before := serverRSS(t, s)
	// 48 unauthenticated 32 MiB requests at once, streamed (no declared
	// length): refused from their headers, never read.
	body := bytes.Repeat([]byte("x"), 32<<20)
	errs := make(chan error, 48)
	statuses := make(chan int, 48)
	for range 48 {
		go func() {
			req, _ := http.NewRequestWithContext(ctx, "POST", s.URL+"/dsec.v1.ProcessService/Exec", io.NopCloser(bytes.NewReader(body)))
			req.Header.Set("Content-Type", "application/json")
			req.ContentLength = -1
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				errs <- err
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses <- resp.StatusCode
			errs <- nil
		}()
	}
	nb.check(t)
	for range 48 {
		if err := <-errs; err != nil {
			t.Logf("request: %v (a connection closed by the server while the body was sent is fine)", err)
		}
	}
	close(statuses)
	for code := range statuses {
		if code != http.StatusUnauthorized {
			t.Errorf("an unauthenticated request answered %d, want 401", code)
		}
	}
	after := serverRSS(t, s)
	t.Logf("server resident memory: %d MiB before, %d MiB after", before>>20, after>>20)
	if after-before > 200<<20 {
		t.Errorf("the server grew by %d MiB on unauthenticated requests", (after-before)>>20)
	}

	t.Run("an oversized request is refused with 413, not a retryable 429", func(t *testing.T) {
		big, _ := json.Marshal(map[string]any{"id": strings.Repeat("x", 4<<20)})
		req, _ := http.NewRequestWithContext(ctx, "POST", s.URL+"/dsec.v1.LifecycleService/GetSandbox", bytes.NewReader(big))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+secret(keyA))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("oversized GetSandbox: %d %s, want 413", resp.StatusCode, b)
		}
	})
}

// serverRSS is the resident memory of the server's processes (dsec serve
// re-executes itself; its child runs everything).
func serverRSS(t *testing.T, s interface{ Pid() int }) int64 {
	t.Helper()
	var total int64
	for _, pid := range append([]int{s.Pid()}, childrenOf(s.Pid())...) {
		total += rssOf(pid)
	}
	return total
}

func TestDurationsCannotOverflow(t *testing.T) {
	c := client(t)
	ctx := ctxFor(t, 2*time.Minute)
	sb := create(t, c, dsec.CreateOptions{})
	raw := c.Raw()
	for _, ext := range []int64{1e18, 1 << 62, -1} {
		if _, err := raw.Keepalive(ctx, connect.NewRequest(&dsecv1.KeepaliveRequest{Id: sb.ID, ExtendTtlS: ext})); kindOf(fromConnect(err)) != "invalid" {
			t.Errorf("keepalive extend_ttl_s %d: %v, want invalid", ext, err)
		}
	}
	if got, err := c.Get(ctx, sb.ID); err != nil || got.State != "running" {
		t.Fatalf("the sandbox after the overflowing keepalives: %v, %v", got.GetState(), err)
	}
	if _, err := raw.CreateSandbox(ctx, connect.NewRequest(&dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", TtlS: 1e18}})); kindOf(fromConnect(err)) != "invalid" {
		t.Errorf("create with ttl_s 1e18: %v, want invalid", err)
	}
	for _, timeout := range []float64{1e18, math.Inf(1), math.NaN(), -1} {
		_, err := raw.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sb.ID, Argv: []string{"sleep", "100"}, TimeoutS: timeout}))
		if kindOf(fromConnect(err)) != "invalid" {
			t.Errorf("exec with timeout_s %g: %v, want invalid", timeout, err)
		}
	}
}
