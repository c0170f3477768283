package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestMicroVM drives microvm sandboxes through the CLI, the Go SDK and the
// Python SDK exactly as containers are driven, then snapshots, forks,
// pauses and re-adopts them across a server restart.
func TestMicroVM(t *testing.T) {
	release := dsectest.NeedMicroVM(t)
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 10*time.Minute)

	out, errOut, code := srv.CLI(ctx, "", "create", "--kind", "microvm", "--image", "busybox", "--memory", "256M", "--ttl", "10m")
	if code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	id := strings.TrimSpace(out)
	t.Cleanup(func() { c.Delete(ctxFor(t, time.Minute), id) })

	t.Run("dsec exec runs in the guest kernel", func(t *testing.T) {
		out, errOut, code := srv.CLI(ctx, "", "exec", id, "--", "uname", "-r")
		if code != 0 || strings.TrimSpace(out) != release {
			t.Fatalf("uname -r: %q %q %d, want %s", out, errOut, code, release)
		}
	})

	vm := c.Sandbox(id)
	t.Run("the files API works unchanged", func(t *testing.T) {
		data := bytes.Repeat([]byte("microvm"), 100000)
		if _, err := vm.WriteFile(ctx, "/work/f.bin", bytes.NewReader(data), 0o644); err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if _, err := vm.ReadFile(ctx, "/work/f.bin", &buf); err != nil || !bytes.Equal(buf.Bytes(), data) {
			t.Fatalf("read back %d bytes, %v", buf.Len(), err)
		}
	})

	t.Run("dsec info reports how microVMs run", func(t *testing.T) {
		out, _, code := srv.CLI(ctx, "", "info")
		if code != 0 || !strings.Contains(out, "microvm accel: ") || !strings.Contains(out, "memory_snapshot") {
			t.Fatalf("info:\n%s", out)
		}
	})

	t.Run("the Python SDK creates and drives a microVM", func(t *testing.T) {
		_, file, _, _ := runtime.Caller(0)
		sdk := filepath.Join(filepath.Dir(file), "..", "..", "sdk", "python")
		py := exec.CommandContext(ctx, "python3", "-c", `
import dsec, os
c = dsec.Client(os.environ["DSEC_URL"])
sb = c.create("busybox", kind="microvm", memory_mb=256, ttl_s=600)
try:
    r = sb.exec("uname -r; echo hi > /tmp/x; cat /tmp/x")
    sb.write_file("/tmp/y", b"from python")
    print(r.stdout.strip().replace("\n", " "), sb.read_file("/tmp/y").decode())
finally:
    sb.close()
`)
		py.Env = append(os.Environ(), "DSEC_URL="+srv.URL, "PYTHONPATH="+sdk)
		out, err := py.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != release+" hi from python" {
			t.Fatalf("python: %v\n%s", err, out)
		}
	})

	if _, err := vm.Exec(ctx, dsec.Cmd("echo parent > /state; (while :; do sleep 1; done) & echo $! > /tmp/loop")); err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot(ctx, id, "warm")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("fork starts children with the parent's memory and disk", func(t *testing.T) {
		resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: id, Count: 2})
		if err != nil || resp.Created != 2 {
			t.Fatalf("fork: %v %v", resp, err)
		}
		for _, r := range resp.Results {
			child := c.Sandbox(r.Sandbox.Id)
			x, err := child.Exec(ctx, dsec.Cmd("cat /state; kill -0 $(cat /tmp/loop) && echo running"))
			if err != nil || string(x.Stdout) != "parent\nrunning\n" {
				t.Fatalf("child %s: %v %v", r.Sandbox.Id, x, err)
			}
			c.Delete(ctx, r.Sandbox.Id)
		}
	})

	t.Run("a paused microVM resumes on the next call", func(t *testing.T) {
		if _, err := c.Pause(ctx, id); err != nil {
			t.Fatal(err)
		}
		if info, _ := c.Get(ctx, id); info.GetState() != "paused" {
			t.Fatalf("state %v", info.GetState())
		}
		x, err := vm.Exec(ctx, dsec.Cmd("cat /state"))
		if err != nil || string(x.Stdout) != "parent\n" {
			t.Fatalf("exec on a paused microVM: %v %v", x, err)
		}
	})

	t.Run("microVMs and machine snapshots survive a server restart", func(t *testing.T) {
		running, err := c.Create(ctx, dsec.CreateOptions{Kind: "microvm", Image: "busybox", MemoryMB: 256})
		if err != nil {
			t.Fatal(err)
		}
		defer running.Close()
		if _, err := running.Exec(ctx, dsec.Cmd("echo alive > /tmp/mark; sleep 600 &")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Pause(ctx, id); err != nil {
			t.Fatal(err)
		}
		srv.Restart()
		x, err := vm.Exec(ctx, dsec.Cmd("cat /state"))
		if err != nil || string(x.Stdout) != "parent\n" {
			t.Fatalf("exec on the paused one after restart: %v %v", x, err)
		}
		x, err = running.Exec(ctx, dsec.Cmd("cat /tmp/mark; ps -o args | grep -q '^sleep 600' && echo kept"))
		if err != nil || string(x.Stdout) != "alive\nkept\n" {
			t.Fatalf("exec on the running one after restart: %v %v", x, err)
		}
		snaps, err := c.ListSnapshots(ctx)
		if err != nil || len(snaps) != 1 || snaps[0].Id != snap.Id || snaps[0].Kind != "microvm" {
			t.Fatalf("snapshots after restart: %v %v", snaps, err)
		}
		out, errOut, code := srv.CLI(ctx, "", "create", "--from", snap.Id)
		if code != 0 {
			t.Fatalf("create from the machine snapshot: %s", errOut)
		}
		child := strings.TrimSpace(out)
		out, _, code = srv.CLI(ctx, "", "exec", child, "--", "cat", "/state")
		if code != 0 || out != "parent\n" {
			t.Fatalf("child of the snapshot: %q %d", out, code)
		}
		if _, _, code := srv.CLI(ctx, "", "rm", child); code != 0 {
			t.Fatal("delete child")
		}
		if err := c.DeleteSnapshot(ctx, snap.Id); err != nil {
			t.Fatal(err)
		}
		if ents, _ := os.ReadDir(filepath.Join(srv.DataDir, "snapshots")); len(ents) != 0 {
			t.Fatalf("snapshot files left after delete: %v", ents)
		}
	})

	t.Run("a machine snapshot does not start another kind", func(t *testing.T) {
		s2, err := c.Snapshot(ctx, id, "")
		if err != nil {
			t.Fatal(err)
		}
		defer c.DeleteSnapshot(ctx, s2.Id)
		_, err = c.Create(ctx, dsec.CreateOptions{Kind: "container", Snapshot: s2.Id})
		if kind(err) != "invalid" {
			t.Fatalf("container from a microvm snapshot: %v", err)
		}
	})
}

// TestMicroVMDebian runs the debian image (python3, gcc) as a microVM.
func TestMicroVMDebian(t *testing.T) {
	if testing.Short() {
		t.Skip("bootstraps debian")
	}
	dsectest.NeedMicroVM(t)
	srv := dsectest.Start(t, dsectest.Options{Images: []string{"debian"}})
	c := srv.Client()
	ctx := ctxFor(t, 10*time.Minute)
	sb, err := c.Create(ctx, dsec.CreateOptions{Kind: "microvm", Image: "debian", MemoryMB: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	x, err := sb.Exec(ctx, dsec.Cmd("python3 -c 'print(6*7)' && echo 'int main(){return 3;}' > /tmp/a.c && gcc -o /tmp/a /tmp/a.c && /tmp/a; echo $?"))
	if err != nil || string(x.Stdout) != "42\n3\n" {
		t.Fatalf("debian microVM: %v %v", x, err)
	}
}
