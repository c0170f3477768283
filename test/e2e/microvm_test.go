package e2e

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
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

// TestMicroVMEgress puts microVMs on the sandbox network the way containers
// are (issue 18): the guest's NIC sits on a tap in the sandbox's network
// namespace, so the host's rules, policy and connection log hold for it
// unchanged. Before, a microVM had no network at all and egress was
// refused as unimplemented.
func TestMicroVMEgress(t *testing.T) {
	dsectest.NeedMicroVM(t)
	srv := dsectest.Start(t, dsectest.Options{})
	ext := outside(t)
	c := srv.Client()
	ctx := ctxFor(t, 10*time.Minute)
	extURL := "http://" + ext + ":8080/"

	host, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	go http.Serve(host, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("host service\n")) }))
	hostPort := host.Addr().(*net.TCPAddr).Port

	vm := create(t, c, dsec.CreateOptions{Kind: "microvm", MemoryMB: 256, Network: "egress"})
	peer := create(t, c, dsec.CreateOptions{Network: "egress"})
	if _, err := peer.Exec(ctx, dsec.Cmd("mkdir -p /srv && echo peer > /srv/index.html && httpd -p 8000 -h /srv")); err != nil {
		t.Fatal(err)
	}
	vmAddr, peerAddr := addrOf(t, vm), addrOf(t, peer)

	t.Run("the guest has the sandbox's address and reaches the outside through NAT", func(t *testing.T) {
		if !strings.HasPrefix(vmAddr, "10.") || vmAddr == peerAddr {
			t.Fatalf("the guest's address %q (the peer container's %q)", vmAddr, peerAddr)
		}
		if out, ok := fetchFrom(t, vm, extURL); !ok || out != "hello from outside\n" {
			t.Fatalf("got %q ok=%v", out, ok)
		}
		if _, err := vm.Exec(ctx, dsec.Cmd("mkdir -p /srv && echo vm > /srv/index.html && httpd -p 8000 -h /srv")); err != nil {
			t.Fatal(err)
		}
		if out, ok := fetchFrom(t, vm, "http://127.0.0.1:8000/"); !ok || out != "vm\n" {
			t.Fatalf("the guest's own server: %q", out)
		}
		if out, ok := fetchFrom(t, peer, "http://"+vmAddr+":8000/"); ok {
			t.Fatalf("another sandbox reached the microVM's server: %q", out)
		}
	})
	t.Run("the guest reaches neither the host's services nor another sandbox", func(t *testing.T) {
		r, err := vm.Exec(ctx, dsec.Cmd("ip route | awk '/default/ {print $3}'"))
		if err != nil {
			t.Fatal(err)
		}
		gw := strings.TrimSpace(string(r.Stdout))
		for _, url := range []string{fmt.Sprintf("http://%s:%d/", gw, hostPort), "http://" + peerAddr + ":8000/", "http://169.254.169.254/"} {
			if out, ok := fetchFrom(t, vm, url); ok {
				t.Errorf("reached %s: %q", url, out)
			}
		}
	})
	t.Run("a policy holds for the guest, changed at runtime, and its connections are logged", func(t *testing.T) {
		if _, err := vm.SetNetworkPolicy(ctx, &dsec.Policy{Deny: []string{ext}}); err != nil {
			t.Fatal(err)
		}
		if out, ok := fetchFrom(t, vm, extURL); ok {
			t.Fatalf("reached a denied address: %q", out)
		}
		if _, err := vm.SetNetworkPolicy(ctx, &dsec.Policy{Allow: []string{ext + "/32"}}); err != nil {
			t.Fatal(err)
		}
		if out, ok := fetchFrom(t, vm, extURL); !ok {
			t.Fatalf("an allowed address: %q", out)
		}
		log, err := vm.NetworkLog(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		var deny, allow bool
		for _, r := range log.Records {
			if r.Address == ext && r.Port == 8080 {
				deny = deny || r.Verdict == "deny"
				allow = allow || r.Verdict == "allow"
			}
		}
		if !deny || !allow {
			t.Fatalf("the connection log lacks the denied or the allowed connection to %s: %v", ext, log.Records)
		}
		if _, err := vm.SetNetworkPolicy(ctx, nil); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("a fork child takes its own address and keeps the network", func(t *testing.T) {
		resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: vm.ID, Count: 1})
		if err != nil || resp.Created != 1 {
			t.Fatalf("fork: %v %v", resp, err)
		}
		child := c.Sandbox(resp.Results[0].Sandbox.Id)
		defer child.Close()
		if a := addrOf(t, child); a == vmAddr || !strings.HasPrefix(a, "10.") {
			t.Fatalf("the child's address %q (the parent's %q)", a, vmAddr)
		}
		if out, ok := fetchFrom(t, child, extURL); !ok {
			t.Fatalf("the child: %q", out)
		}
		if out, ok := fetchFrom(t, vm, extURL); !ok {
			t.Fatalf("the parent after the fork: %q", out)
		}
	})
	t.Run("a paused guest resumes with its network", func(t *testing.T) {
		if _, err := c.Pause(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		if out, ok := fetchFrom(t, vm, extURL); !ok {
			t.Fatalf("after resume: %q", out)
		}
		if a := addrOf(t, vm); a != vmAddr {
			t.Fatalf("address after resume %q, was %q", a, vmAddr)
		}
	})
	t.Run("a microVM without network cannot be made into one with egress", func(t *testing.T) {
		plain := create(t, c, dsec.CreateOptions{Kind: "microvm", MemoryMB: 256})
		snap, err := c.Snapshot(ctx, plain.ID, "")
		if err != nil {
			t.Fatal(err)
		}
		defer c.DeleteSnapshot(ctx, snap.Id)
		_, err = c.Create(ctx, dsec.CreateOptions{Snapshot: snap.Id, Network: "egress"})
		if kind(err) != "invalid" || !strings.Contains(err.Error(), "without a network interface") {
			t.Fatalf("egress from a snapshot without a NIC: %v", err)
		}
	})
}
