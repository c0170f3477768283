package e2e

import (
	"bytes"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/substrate/qemu"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestVM drives full VMs (kind vm, the debian-vm image) through the CLI,
// the Go SDK and the Python SDK as every kind is driven, plus their screen
// and input; then snapshots, forks, pauses and re-adopts them across a
// server restart.
func TestVM(t *testing.T) {
	dsectest.NeedVM(t)
	srv := dsectest.Start(t, dsectest.Options{Images: []string{"busybox", "debian-vm"}})
	c := srv.Client()
	ctx := ctxFor(t, 20*time.Minute)

	out, errOut, code := srv.CLI(ctx, "", "create", "--kind", "vm", "--image", "debian-vm", "--ttl", "20m")
	if code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	id := strings.TrimSpace(out)
	t.Cleanup(func() { c.Delete(ctxFor(t, time.Minute), id) })
	vm := c.Sandbox(id)

	t.Run("dsec exec runs under the image's own systemd and kernel", func(t *testing.T) {
		out, errOut, code := srv.CLI(ctx, "", "exec", id, "--", "sh", "-c", "cat /proc/1/comm; uname -r")
		if code != 0 || !strings.HasPrefix(out, "systemd\n") || !strings.HasSuffix(strings.TrimSpace(out), "-cloud-amd64") {
			t.Fatalf("exec: %q %q %d", out, errOut, code)
		}
	})

	t.Run("the files API works unchanged", func(t *testing.T) {
		data := bytes.Repeat([]byte("vm"), 300000)
		if _, err := vm.WriteFile(ctx, "/work/f.bin", bytes.NewReader(data), 0o644); err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if _, err := vm.ReadFile(ctx, "/work/f.bin", &buf); err != nil || !bytes.Equal(buf.Bytes(), data) {
			t.Fatalf("read back %d bytes, %v", buf.Len(), err)
		}
	})

	t.Run("dsec info reports how VMs run and that they have a screen", func(t *testing.T) {
		out, _, code := srv.CLI(ctx, "", "info")
		if code != 0 || !strings.Contains(out, "vm accel: ") || !strings.Contains(out, "screen") {
			t.Fatalf("info:\n%s", out)
		}
	})

	t.Run("dsec screenshot saves the screen as a PNG", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "out.png")
		if _, errOut, code := srv.CLI(ctx, "", "screenshot", id, file); code != 0 {
			t.Fatalf("screenshot: %s", errOut)
		}
		b, _ := os.ReadFile(file)
		img, err := png.Decode(bytes.NewReader(b))
		if err != nil || img.Bounds().Dx() != 720 || img.Bounds().Dy() != 400 {
			t.Fatalf("screenshot: %v %v", img.Bounds(), err)
		}
	})

	t.Run("dsec input types into the shell on the screen", func(t *testing.T) {
		if _, errOut, code := srv.CLI(ctx, "", "input", id, "type", "echo from-the-cli > /tmp/cli", "key", "Return"); code != 0 {
			t.Fatalf("input: %s", errOut)
		}
		waitExec(t, vm, "cat /tmp/cli 2>/dev/null", "from-the-cli\n")
	})

	t.Run("the Go SDK takes screenshots and sends input", func(t *testing.T) {
		shot, err := vm.Screenshot(ctx)
		if err != nil || shot.Width != 720 || shot.Height != 400 || len(shot.Png) == 0 {
			t.Fatalf("screenshot: %v %v", shot.GetWidth(), err)
		}
		if err := vm.Input(ctx, dsec.TypeText("echo from-go > /tmp/go"), dsec.PressKeys("Return"), dsec.Click(10, 10, "", 0)); err != nil {
			t.Fatal(err)
		}
		waitExec(t, vm, "cat /tmp/go 2>/dev/null", "from-go\n")
	})

	t.Run("the dashboard streams its screen and types into it", func(t *testing.T) {
		chromium, err := exec.LookPath("chromium")
		if err != nil {
			t.Fatal("chromium is not installed (scripts/setup.sh installs it): ", err)
		}
		browser := newBrowser(t, ctx, chromium)
		do := func(steps ...chromedp.Action[chromedp.Void]) {
			t.Helper()
			if err := chromedp.Do(browser, steps...); err != nil {
				t.Fatalf("the browser: %v", err)
			}
		}
		// An open server: any key signs in.
		do(chromedp.Navigate(srv.URL+"/ui/"), chromedp.WaitVisible(chromedp.ID("key")),
			chromedp.SendKeys(chromedp.ID("key"), "any"), chromedp.Click(chromedp.ID("signin")),
			chromedp.WaitVisible(chromedp.ID("running")))
		if _, err := chromedp.Run(browser, chromedp.Evaluate[string](`location.hash = "#/sandbox/`+id+`"`)); err != nil {
			t.Fatalf("the browser: %v", err)
		}
		// The screen is streamed: the image gets a PNG the size of the VM's.
		if _, err := chromedp.Run(browser, chromedp.Poll[bool](`(() => { const i = document.getElementById("screen");
			return !!i && i.src.startsWith("data:image/png") && i.naturalWidth === 720 && i.naturalHeight === 400; })()`)); err != nil {
			t.Fatalf("the browser: no screen shown: %v", err)
		}
		// Keys typed on the focused screen reach the VM's console, in order.
		do(chromedp.Focus(chromedp.ID("screen")), chromedp.SendKeys(chromedp.ID("screen"), "echo from-the-dashboard > /tmp/ui\r"))
		waitExec(t, vm, "cat /tmp/ui 2>/dev/null", "from-the-dashboard\n")
		shot, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
		if err == nil {
			os.WriteFile(filepath.Join(artifacts(t, "dashboard"), "vm-screen.png"), shot, 0o644)
		}
	})

	t.Run("the Python SDK creates a VM and drives its screen", func(t *testing.T) {
		_, file, _, _ := runtime.Caller(0)
		sdk := filepath.Join(filepath.Dir(file), "..", "..", "sdk", "python")
		py := exec.CommandContext(ctx, "python3", "-c", `
import dsec, os, time
c = dsec.Client(os.environ["DSEC_URL"])
sb = c.create("debian-vm", kind="vm", ttl_s=600)
try:
    png, w, h = sb.screenshot_info()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:8]
    sb.type_text("echo from-python > /tmp/py\n")
    for _ in range(100):
        if sb.exec("cat /tmp/py 2>/dev/null").stdout == "from-python\n":
            break
        time.sleep(0.2)
    print(w, h, sb.exec("cat /tmp/py").stdout.strip())
finally:
    sb.close()
`)
		py.Env = append(os.Environ(), "DSEC_URL="+srv.URL, "PYTHONPATH="+sdk)
		out, err := py.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "720 400 from-python" {
			t.Fatalf("python: %v\n%s", err, out)
		}
	})

	t.Run("kinds and images must match", func(t *testing.T) {
		if _, err := c.Create(ctx, dsec.CreateOptions{Kind: "vm", Image: "busybox"}); kind(err) != "invalid" {
			t.Fatalf("vm from a layer image: %v", err)
		}
		if _, err := c.Create(ctx, dsec.CreateOptions{Kind: "container", Image: "debian-vm"}); kind(err) != "invalid" {
			t.Fatalf("container from a VM image: %v", err)
		}
		sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", MemoryMB: 64})
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Close()
		if _, err := sb.Screenshot(ctx); kind(err) != "unimplemented" {
			t.Fatalf("a container's screenshot: %v", err)
		}
	})

	if _, err := vm.Exec(ctx, dsec.Cmd("echo parent > /root/state; (while :; do sleep 1; done) >/dev/null 2>&1 & echo $! > /root/loop")); err != nil {
		t.Fatal(err)
	}
	parentID, err := vm.Exec(ctx, dsec.Cmd("cat /etc/machine-id"))
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot(ctx, id, "warm")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("fork starts children with the parent's memory and disk and their own identity", func(t *testing.T) {
		resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: id, Count: 2})
		if err != nil || resp.Created != 2 {
			t.Fatalf("fork: %v %v", resp, err)
		}
		for _, r := range resp.Results {
			child := c.Sandbox(r.Sandbox.Id)
			x, err := child.Exec(ctx, dsec.Cmd("cat /root/state; kill -0 $(cat /root/loop) && echo running; cat /etc/machine-id"))
			if err != nil || !strings.HasPrefix(string(x.Stdout), "parent\nrunning\n") || strings.HasSuffix(string(x.Stdout), string(parentID.Stdout)) {
				t.Fatalf("child %s: %q %v (parent's machine id %q)", r.Sandbox.Id, x.GetStdout(), err, parentID.Stdout)
			}
			if _, err := child.Screenshot(ctx); err != nil {
				t.Fatalf("child screenshot: %v", err)
			}
			c.Delete(ctx, r.Sandbox.Id)
		}
	})

	t.Run("a paused VM holds no QEMU and resumes on the next call", func(t *testing.T) {
		if _, err := c.Pause(ctx, id); err != nil {
			t.Fatal(err)
		}
		if info, _ := c.Get(ctx, id); info.GetState() != "paused" {
			t.Fatalf("state %v", info.GetState())
		}
		if st, err := vm.Stats(ctx); err != nil || st.MemoryBytes != 0 {
			t.Fatalf("stats of a paused VM: %v %v", st, err)
		}
		x, err := vm.Exec(ctx, dsec.Cmd("cat /root/state"))
		if err != nil || string(x.Stdout) != "parent\n" {
			t.Fatalf("exec on a paused VM: %v %v", x, err)
		}
	})

	t.Run("VMs and machine snapshots survive a server restart", func(t *testing.T) {
		running, err := c.Create(ctx, dsec.CreateOptions{Kind: "vm", Image: "debian-vm"})
		if err != nil {
			t.Fatal(err)
		}
		defer running.Close()
		if _, err := running.Exec(ctx, dsec.Cmd("echo alive > /root/mark; sleep 600 >/dev/null 2>&1 &")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Pause(ctx, id); err != nil {
			t.Fatal(err)
		}
		srv.Restart()
		x, err := vm.Exec(ctx, dsec.Cmd("cat /root/state"))
		if err != nil || string(x.Stdout) != "parent\n" {
			t.Fatalf("exec on the paused one after restart: %v %v", x, err)
		}
		x, err = running.Exec(ctx, dsec.Cmd("cat /root/mark; pgrep -x sleep >/dev/null && echo kept"))
		if err != nil || string(x.Stdout) != "alive\nkept\n" {
			t.Fatalf("exec on the running one after restart: %v %v", x, err)
		}
		if _, err := running.Screenshot(ctx); err != nil {
			t.Fatalf("screenshot after restart: %v", err)
		}
		snaps, err := c.ListSnapshots(ctx)
		if err != nil || len(snaps) != 1 || snaps[0].Id != snap.Id || snaps[0].Kind != "vm" {
			t.Fatalf("snapshots after restart: %v %v", snaps, err)
		}
		out, errOut, code := srv.CLI(ctx, "", "create", "--from", snap.Id)
		if code != 0 {
			t.Fatalf("create from the machine snapshot: %s", errOut)
		}
		child := strings.TrimSpace(out)
		out, _, code = srv.CLI(ctx, "", "exec", child, "--", "cat", "/root/state")
		if code != 0 || out != "parent\n" {
			t.Fatalf("child of the snapshot: %q %d", out, code)
		}
		if _, _, code := srv.CLI(ctx, "", "rm", child); code != 0 {
			t.Fatal("delete child")
		}
		if err := c.DeleteSnapshot(ctx, snap.Id); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("a VM with egress is on the sandbox network, under its policy", func(t *testing.T) {
		ext := outside(t)
		nvm := create(t, c, dsec.CreateOptions{Kind: "vm", Image: "debian-vm", Network: "egress"})
		get := func(sb *dsec.Sandbox, url string) string {
			t.Helper()
			x, err := sb.Exec(ctx, dsec.ExecOptions{Timeout: time.Minute, Cmd: "python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode(), end=\"\")' " + url + " 2>&1; echo rc=$?"})
			if err != nil {
				t.Fatal(err)
			}
			return string(x.Stdout)
		}
		if a := addrOf(t, nvm); !strings.HasPrefix(a, "10.") {
			t.Fatalf("the guest's address: %q", a)
		}
		url := "http://" + ext + ":8080/"
		if out := get(nvm, url); out != "hello from outside\nrc=0\n" {
			t.Fatalf("through NAT: %q", out)
		}
		if _, err := nvm.SetNetworkPolicy(ctx, &dsec.Policy{Deny: []string{ext}}); err != nil {
			t.Fatal(err)
		}
		if out := get(nvm, url); strings.Contains(out, "rc=0") {
			t.Fatalf("a denied address: %q", out)
		}
		// A fork's children take the parent's network as it is now.
		if _, err := nvm.SetNetworkPolicy(ctx, nil); err != nil {
			t.Fatal(err)
		}
		resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: nvm.ID, Count: 1})
		if err != nil || resp.Created != 1 {
			t.Fatalf("fork: %v %v", resp, err)
		}
		child := c.Sandbox(resp.Results[0].Sandbox.Id)
		defer child.Close()
		if a, b := addrOf(t, child), addrOf(t, nvm); a == b || !strings.HasPrefix(a, "10.") {
			t.Fatalf("the child's address %q, the parent's %q", a, b)
		}
		if out := get(child, url); out != "hello from outside\nrc=0\n" {
			t.Fatalf("the child through NAT: %q", out)
		}
	})

	t.Run("deleted VMs leave no QEMU behind", func(t *testing.T) {
		if err := c.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for qemusOfDataDir(srv.DataDir) > 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%d QEMU processes left", qemusOfDataDir(srv.DataDir))
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
}

// waitExec runs cmd until its output is want.
func waitExec(t *testing.T, sb *dsec.Sandbox, cmd, want string) {
	t.Helper()
	ctx := ctxFor(t, 2*time.Minute)
	for {
		x, err := sb.Exec(ctx, dsec.Cmd(cmd))
		if err == nil && string(x.Stdout) == want {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("%q never printed %q: %v %v", cmd, want, x, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// qemusOfDataDir counts the live QEMU processes whose files are in a
// server's data directory.
func qemusOfDataDir(dataDir string) int {
	n := 0
	for _, vm := range qemu.VMProcesses() {
		if strings.Contains(vm.Cmdline, dataDir+"/") {
			n++
		}
	}
	return n
}
