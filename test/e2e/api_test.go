package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func create(t *testing.T, c *dsec.Client, o dsec.CreateOptions) *dsec.Sandbox {
	t.Helper()
	if o.Image == "" {
		o.Image = "busybox"
	}
	sb, err := c.Create(ctxFor(t, 2*time.Minute), o)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

func kind(err error) string {
	var e *dsec.Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return ""
}

func TestRestartReadoptsRunningSandboxes(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	sb := create(t, c, dsec.CreateOptions{Labels: map[string]string{"job": "restart"}})
	if _, err := sb.Exec(ctx, dsec.Cmd("echo before > /tmp/state; sleep 1000 >/dev/null 2>&1 &")); err != nil {
		t.Fatal(err)
	}
	for _, how := range []string{"graceful stop", "crash"} {
		t.Run("after a "+how+" the sandbox keeps its processes and files", func(t *testing.T) {
			if how == "crash" {
				srv.Kill()
				srv.Restart()
			} else {
				srv.Restart()
			}
			res, err := sb.Exec(ctx, dsec.Cmd("cat /tmp/state; ps -o args | grep -c '[s]leep 1000'"))
			if err != nil {
				t.Fatal(err)
			}
			if string(res.Stdout) != "before\n1\n" {
				t.Fatalf("after restart: %q", res.Stdout)
			}
			list, err := c.List(ctx, "job=restart")
			if err != nil || len(list) != 1 || list[0].Id != sb.ID {
				t.Fatalf("list after restart: %v %v", list, err)
			}
		})
	}
}

func TestAuth(t *testing.T) {
	t.Run("a non-loopback address without keys is refused", func(t *testing.T) {
		dsectest.Need(t)
		bin := dsectest.Binaries(t)
		out, err := exec.Command(bin+"/dsec", "serve", "--listen", "0.0.0.0:0", "--data-dir", t.TempDir()).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "refusing to listen") {
			t.Fatalf("serve on 0.0.0.0 without keys: %v\n%s", err, out)
		}
	})
	srv := dsectest.Start(t, dsectest.Options{APIKeys: []string{"k-good"}})
	ctx := ctxFor(t, time.Minute)
	t.Run("calls without the key are unauthenticated", func(t *testing.T) {
		_, err := dsec.New(srv.URL).List(ctx, "")
		if kind(err) != "unauthenticated" {
			t.Fatalf("no key: %v", err)
		}
		_, err = dsec.New(srv.URL, dsec.WithAPIKey("k-bad")).List(ctx, "")
		if kind(err) != "unauthenticated" {
			t.Fatalf("bad key: %v", err)
		}
		resp, err := http.Get(srv.URL + "/v1/sandboxes/x-local/files?path=/etc/passwd")
		if err != nil || resp.StatusCode != 401 {
			t.Fatalf("plain HTTP without key: %v %v", resp.StatusCode, err)
		}
	})
	t.Run("calls with the key work", func(t *testing.T) {
		if _, err := srv.Client().List(ctx, ""); err != nil {
			t.Fatal(err)
		}
	})
}

// TestWireProtocols calls the same API as Connect JSON (curl), Connect
// binary and gRPC.
func TestWireProtocols(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	sb := create(t, c, dsec.CreateOptions{})
	ctx := ctxFor(t, time.Minute)

	t.Run("Connect JSON over plain HTTP/1.1 (curl)", func(t *testing.T) {
		body := fmt.Sprintf(`{"sandbox_id":%q,"cmd":"echo json"}`, sb.ID)
		resp, err := http.Post(srv.URL+"/dsec.v1.ProcessService/Exec", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		// base64("json\n") is "anNvbgo="
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"stdout":"anNvbgo="`) {
			t.Fatalf("status %d body %s", resp.StatusCode, b)
		}
	})
	for _, p := range []struct {
		name string
		opt  connect.ClientOption
	}{
		{"Connect binary", connect.WithProtoJSON()},
		{"gRPC", connect.WithGRPC()},
		{"gRPC-Web", connect.WithGRPCWeb()},
	} {
		t.Run(p.name, func(t *testing.T) {
			hc := &http.Client{Transport: h2cTransport()}
			cl := dsecv1connect.NewProcessServiceClient(hc, srv.URL, p.opt)
			res, err := cl.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sb.ID, Argv: []string{"echo", p.name}}))
			if err != nil {
				t.Fatal(err)
			}
			if string(res.Msg.Stdout) != p.name+"\n" {
				t.Fatalf("stdout %q", res.Msg.Stdout)
			}
			st, err := cl.ExecStream(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sb.ID, Cmd: "echo a; echo b >&2; exit 2"}))
			if err != nil {
				t.Fatal(err)
			}
			var kinds []string
			for st.Receive() {
				switch st.Msg().Event.(type) {
				case *dsecv1.ExecEvent_Started:
					kinds = append(kinds, "started")
				case *dsecv1.ExecEvent_Stdout:
					kinds = append(kinds, "stdout")
				case *dsecv1.ExecEvent_Stderr:
					kinds = append(kinds, "stderr")
				case *dsecv1.ExecEvent_Exit:
					kinds = append(kinds, fmt.Sprintf("exit %d", st.Msg().GetExit().ExitCode))
				}
			}
			if err := st.Err(); err != nil {
				t.Fatal(err)
			}
			got := strings.Join(kinds, ",")
			if !strings.HasPrefix(got, "started,") || !strings.HasSuffix(got, ",exit 2") || !strings.Contains(got, "stdout") || !strings.Contains(got, "stderr") {
				t.Fatalf("stream events %s", got)
			}
		})
	}
}

func h2cTransport() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Protocols = new(http.Protocols)
	t.Protocols.SetUnencryptedHTTP2(true)
	return t
}

func TestBadInputGetsClearErrorsAndHurtsNoOne(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	bystander := create(t, c, dsec.CreateOptions{})
	bystander.Exec(ctx, dsec.Cmd("echo keep > /tmp/mine"))
	secret := fmt.Sprintf("/tmp/dsec-host-secret-%d", os.Getpid())
	os.WriteFile(secret, []byte("host secret"), 0o600)
	defer os.Remove(secret)

	sb := create(t, c, dsec.CreateOptions{})
	cases := []struct {
		name string
		call func() error
		kind string
	}{
		{"an unknown image is not found", func() error { _, err := c.Create(ctx, dsec.CreateOptions{Image: "no-such-image"}); return err }, "not_found"},
		{"an unknown kind is invalid", func() error {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Kind: "teapot"})
			return err
		}, "invalid"},
		{"memory beyond the host is invalid", func() error {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", MemoryMB: 1 << 40})
			return err
		}, "invalid"},
		{"negative CPU is invalid", func() error { _, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", CPU: -1}); return err }, "invalid"},
		{"a bad label key is invalid", func() error {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Labels: map[string]string{"bad key!": "v"}})
			return err
		}, "invalid"},
		{"a TTL beyond the maximum is invalid", func() error {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: 10000 * time.Hour})
			return err
		}, "invalid"},
		{"an unknown network mode is invalid", func() error {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Network: "wormhole"})
			return err
		}, "invalid"},
		{"GPUs on a host without any are unavailable", func() error {
			sbs := c.Raw()
			_, err := sbs.CreateSandbox(ctx, connect.NewRequest(&dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Resources: &dsecv1.Resources{Gpu: 1}}}))
			return err
		}, "unavailable"},
		{"a sandbox that does not exist is not found", func() error {
			_, err := c.Sandbox("aaaaaaaaaaaaaaaa-local").Exec(ctx, dsec.Cmd("true"))
			return err
		}, "not_found"},
		{"a malformed ID is invalid", func() error { _, err := c.Get(ctx, "../../etc"); return err }, "invalid"},
		{"an ID of an unknown node is not found", func() error { _, err := c.Get(ctx, "aaaaaaaaaaaaaaaa-elsewhere"); return err }, "not_found"},
		{"exec without a command is invalid", func() error { _, err := sb.Exec(ctx, dsec.ExecOptions{}); return err }, "invalid"},
		{"a negative timeout is invalid", func() error { _, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "true", Timeout: -time.Second}); return err }, "invalid"},
		{"a path through .. cannot reach the host", func() error {
			_, err := sb.ReadFile(ctx, "/../../../../.."+secret, io.Discard)
			return err
		}, "not_found"},
		{"reading a directory is invalid", func() error { _, err := sb.ReadFile(ctx, "/etc", io.Discard); return err }, "invalid"},
		{"a missing file is not found", func() error { _, err := sb.ReadFile(ctx, "/nope", io.Discard); return err }, "not_found"},
		{"reading a FIFO is invalid, at once", func() error {
			sb.Exec(ctx, dsec.Cmd("mkfifo /tmp/fifo"))
			_, err := sb.ReadFile(ctxFor(t, 20*time.Second), "/tmp/fifo", io.Discard)
			return err
		}, "invalid"},
		{"writing a FIFO is invalid, at once", func() error {
			sb.Exec(ctx, dsec.Cmd("mkfifo /tmp/fifo2"))
			_, err := sb.WriteFile(ctxFor(t, 20*time.Second), "/tmp/fifo2", strings.NewReader("x"), 0)
			return err
		}, "invalid"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if kind(err) != tc.kind {
				t.Fatalf("got %v (kind %q), want kind %q", err, kind(err), tc.kind)
			}
			if dsec.IsInfra(err) && tc.kind != "unavailable" {
				t.Fatalf("a caller error is flagged infra: %v", err)
			}
		})
	}
	t.Run("a symlink to a host path resolves inside the sandbox", func(t *testing.T) {
		sb.Exec(ctx, dsec.Cmd("ln -s "+secret+" /tmp/link"))
		_, err := sb.ReadFile(ctx, "/tmp/link", io.Discard)
		if kind(err) != "not_found" {
			t.Fatalf("read through a symlink: %v", err)
		}
	})
	t.Run("the server and other sandboxes are unaffected", func(t *testing.T) {
		res, err := bystander.Exec(ctx, dsec.Cmd("cat /tmp/mine"))
		if err != nil || string(res.Stdout) != "keep\n" {
			t.Fatalf("bystander: %v %v", res, err)
		}
	})
}

func TestWorkloadsThatMisbehaveAreContained(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	t.Run("a memory bomb is OOM-killed and reported as the task's failure", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{MemoryMB: 64})
		res, err := sb.Exec(ctx, dsec.Cmd(`awk 'BEGIN{s="xxxxxxxxxxxxxxxx"; while (1) s = s s}'`))
		if err != nil {
			t.Fatalf("the call failed instead of reporting the kill: %v", err)
		}
		if !res.OomKilled || res.Signal != "KILL" {
			t.Fatalf("result %+v", res)
		}
		if r, err := sb.Exec(ctx, dsec.Cmd("echo alive")); err != nil || string(r.Stdout) != "alive\n" {
			t.Fatalf("sandbox after OOM: %v %v", r, err)
		}
	})
	t.Run("with every pid taken the agent still answers concurrent calls", func(t *testing.T) {
		// The agent is a Go program: a runtime that needs one more thread
		// when none can be made dies, and the sandbox with it.
		sb := create(t, c, dsec.CreateOptions{Pids: 24})
		res, err := sb.Exec(ctx, dsec.Cmd(`i=0; while [ $i -lt 64 ]; do sleep 600 & i=$((i+1)); done 2>/dev/null; echo filled`))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("filling the pids limit: exit %d %q", res.ExitCode, res.Stdout)
		var wg sync.WaitGroup
		for i := 0; i < 16; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Each start fails (no pid); the agent must survive the attempt.
				sb.Exec(ctx, dsec.ExecOptions{Argv: []string{"sleep", "1"}, Timeout: 5 * time.Second})
				sb.Stat(ctx, "/proc/1/status")
			}()
		}
		wg.Wait()
		if _, err := sb.Stat(ctx, "/proc/1/status"); err != nil {
			t.Fatalf("the agent died with its pids exhausted: %v", err)
		}
		if r, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil || r.ExitCode == 0 {
			t.Logf("exec with no pid free: %+v %v", r, err)
		}
	})
	t.Run("a fork bomb is contained by the pids limit", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{Pids: 64})
		res, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "b() { b | b & }; b; sleep 3", Timeout: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if !res.TimedOut {
			t.Logf("bomb result %+v", res)
		}
		other := create(t, c, dsec.CreateOptions{})
		if r, err := other.Exec(ctx, dsec.Cmd("echo fine")); err != nil || string(r.Stdout) != "fine\n" {
			t.Fatalf("another sandbox during a fork bomb: %v %v", r, err)
		}
	})
	t.Run("a command timeout kills the whole process group", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{})
		res, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "sleep 100 & sleep 100", Timeout: 500 * time.Millisecond})
		if err != nil || !res.TimedOut {
			t.Fatalf("%+v %v", res, err)
		}
		r, _ := sb.Exec(ctx, dsec.Cmd("ps -o args | grep -c '[s]leep 100'"))
		if strings.TrimSpace(string(r.Stdout)) != "0" {
			t.Fatalf("sleeps left: %q", r.Stdout)
		}
	})
	t.Run("output beyond the cap keeps head and tail and is flagged", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{})
		res, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "echo HEAD; yes | head -c 5000000; echo; echo TAIL", MaxOutputBytes: 10000})
		if err != nil {
			t.Fatal(err)
		}
		if !res.Truncated || len(res.Stdout) != 10000 || !bytes.HasPrefix(res.Stdout, []byte("HEAD\n")) || !bytes.HasSuffix(res.Stdout, []byte("TAIL\n")) {
			t.Fatalf("truncated %v len %d", res.Truncated, len(res.Stdout))
		}
		def, _ := sb.Exec(ctx, dsec.Cmd("yes | head -c 3000000"))
		if !def.Truncated || len(def.Stdout) != 1<<20 {
			t.Fatalf("default cap: truncated %v len %d", def.Truncated, len(def.Stdout))
		}
	})
}

func TestLifetimes(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 2*time.Minute)
	t.Run("the TTL deletes the sandbox and later calls say it is gone", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{TTL: 2 * time.Second})
		time.Sleep(4 * time.Second)
		info, err := c.Get(ctx, sb.ID)
		if err != nil || info.State != "failed" || !strings.Contains(info.Reason, "ttl") {
			t.Fatalf("after ttl: %v %v", info, err)
		}
		_, err = sb.Exec(ctx, dsec.Cmd("true"))
		if !dsec.IsGone(err) || !dsec.IsInfra(err) {
			t.Fatalf("exec after ttl: %v", err)
		}
	})
	t.Run("keepalive holds off the idle TTL; silence triggers it", func(t *testing.T) {
		kept := create(t, c, dsec.CreateOptions{TTL: time.Minute, IdleTTL: 2 * time.Second})
		idle := create(t, c, dsec.CreateOptions{TTL: time.Minute, IdleTTL: 2 * time.Second})
		for i := 0; i < 5; i++ {
			time.Sleep(time.Second)
			if _, err := kept.Keepalive(ctx, 0); err != nil {
				t.Fatal(err)
			}
		}
		if info, _ := c.Get(ctx, kept.ID); info.GetState() != "running" {
			t.Fatalf("kept sandbox: %v", info)
		}
		if info, _ := c.Get(ctx, idle.ID); info.GetState() != "failed" || !strings.Contains(info.Reason, "idle") {
			t.Fatalf("idle sandbox: %v", info)
		}
	})
	t.Run("keepalive can extend the TTL", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{TTL: 2 * time.Second})
		if _, err := sb.Keepalive(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * time.Second)
		if info, _ := c.Get(ctx, sb.ID); info.GetState() != "running" {
			t.Fatalf("after extension: %v", info)
		}
	})
	t.Run("a sandbox whose init dies is reported gone, not silently replaced", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{})
		// The agent is PID 1; only the host can kill it. Find it by its
		// sandbox's cgroup.
		pids, _ := os.ReadFile(fmt.Sprintf("/sys/fs/cgroup/pids/dsec/%s/cgroup.procs", sb.ID))
		if len(pids) == 0 {
			pids, _ = os.ReadFile(fmt.Sprintf("/sys/fs/cgroup/dsec/%s/cgroup.procs", sb.ID))
		}
		first := strings.Fields(string(pids))
		if len(first) == 0 {
			t.Skip("cannot find the sandbox's processes in its cgroup")
		}
		exec.Command("kill", "-9", first[0]).Run()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			_, err := sb.Exec(ctx, dsec.Cmd("true"))
			if dsec.IsGone(err) || kind(err) == "gone" {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatal("a dead sandbox was not reported gone")
	})
}

func TestFilesStreamWithoutBuffering(t *testing.T) {
	if testing.Short() {
		t.Skip("moves 1 GiB")
	}
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	sb := create(t, c, dsec.CreateOptions{MemoryMB: 256})
	ctx := ctxFor(t, 5*time.Minute)
	const size = 1 << 30
	src := &patternReader{n: size}
	h := sha256.New()
	if _, err := sb.WriteFile(ctx, "/work/big.bin", io.TeeReader(src, h), 0o644); err != nil {
		t.Fatal(err)
	}
	want := h.Sum(nil)
	h.Reset()
	info, err := sb.ReadFile(ctx, "/work/big.bin", h)
	if err != nil {
		t.Fatal(err)
	}
	if info.Size != size || !bytes.Equal(h.Sum(nil), want) {
		t.Fatalf("read back size %d, hash match %v", info.Size, bytes.Equal(h.Sum(nil), want))
	}
	// The server never held the file: its peak RSS stays far below 1 GiB.
	if hwm := peakRSS(srv); hwm > 300<<20 {
		t.Fatalf("server peak RSS %d MiB while moving 1 GiB", hwm>>20)
	}
}

// patternReader yields n bytes of a repeating pattern.
type patternReader struct{ n, off int64 }

func (p *patternReader) Read(b []byte) (int, error) {
	if p.off >= p.n {
		return 0, io.EOF
	}
	k := min(int64(len(b)), p.n-p.off)
	for i := int64(0); i < k; i++ {
		b[i] = byte((p.off + i) * 7)
	}
	p.off += k
	return int(k), nil
}

// peakRSS reads VmHWM of the server's node process (the re-executed child).
func peakRSS(srv *dsectest.Server) int64 {
	var best int64
	for _, pid := range []int{srv.NodePid(), srv.Pid()} {
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		for _, line := range strings.Split(string(st), "\n") {
			if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
				var kb int64
				fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(v), " kB"), &kb)
				best = max(best, kb<<10)
			}
		}
	}
	return best
}

func TestConcurrentCreates(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Labels: map[string]string{"burst": "1"}})
			if err != nil {
				errs <- err
				return
			}
			defer sb.Close()
			r, err := sb.Exec(ctx, dsec.Argv("echo", fmt.Sprint(i)))
			if err != nil {
				errs <- err
			} else if string(r.Stdout) != fmt.Sprintf("%d\n", i) {
				errs <- fmt.Errorf("sandbox %d printed %q", i, r.Stdout)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestIdempotentCreate(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, time.Minute)
	var wg sync.WaitGroup
	ids := make([]string, 8)
	for i := range ids {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", IdempotencyKey: "run42/step7/member3"})
			if err == nil {
				ids[i] = sb.ID
			}
		}(i)
	}
	wg.Wait()
	for _, id := range ids {
		if id == "" || id != ids[0] {
			t.Fatalf("retried creates returned %v, want one sandbox", ids)
		}
	}
	list, _ := c.List(ctx, "")
	if len(list) != 1 {
		t.Fatalf("%d sandboxes exist", len(list))
	}
	c.Delete(ctx, ids[0])
}
