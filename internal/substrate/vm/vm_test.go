package vm

import (
	"bytes"
	"context"
	"crypto/des"
	"encoding/binary"
	"fmt"
	"image/png"
	"io"
	"log/slog"
	"math/bits"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
	"github.com/opendsec/dsec/internal/substrate/qemu/qemutest"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
)

var (
	guestBin  string
	layers    substrate.Image  // the debian VM image
	bbLayers  *substrate.Image // busybox: not a VM image
	kernelDir string
	stateDir  string // shared by the tests: boot snapshots are saved once
	imgDir    string // the VM image's layer directory
	setupErr  string
	// runDirs are the drivers' socket directories, removed at the end.
	runDirs = map[string]string{}
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if err := mountns.Enter(); err != nil {
			fmt.Fprintln(os.Stderr, "mount namespace:", err)
			os.Exit(1)
		}
	}
	dir, _ := os.MkdirTemp("", "dsec-vm-test")
	code := func() int {
		defer os.RemoveAll(dir)
		if os.Geteuid() != 0 {
			setupErr = "needs root"
			return m.Run()
		}
		cache := os.Getenv("DSEC_CACHE_DIR")
		if cache == "" {
			setupErr = "needs DSEC_CACHE_DIR, where the debian VM image is built once (make test sets it)"
			return m.Run()
		}
		for _, tool := range []string{"qemu-system-x86_64", "qemu-img", "debootstrap", "mkfs.ext4"} {
			if _, err := exec.LookPath(tool); err != nil {
				setupErr = "needs " + tool + " (scripts/setup.sh installs it)"
				return m.Run()
			}
		}
		kernelDir = filepath.Join(cache, "guest-kernel")
		guestBin = filepath.Join(dir, "dsec-guest")
		build := exec.Command("go", "build", "-o", guestBin, "github.com/opendsec/dsec/cmd/dsec-guest")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build dsec-guest: %v\n%s", err, out)
			return 1
		}
		store, err := image.Open(filepath.Join(dir, "images"), slog.Default())
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		ctx, cancel := context.WithTimeout(tenant.System(context.Background()), 20*time.Minute)
		defer cancel()
		img, err := store.BuildVM(ctx, "debian", "", image.BootstrapOptions{CacheDir: cache}, nil)
		if err != nil {
			fmt.Fprintln(os.Stderr, "build the debian VM image:", err)
			return 1
		}
		layers = substrate.ImageOf(store, img)
		imgDir = store.LayerDir(img.Layers[0])
		if bb, err := store.Bootstrap(ctx, "busybox", "", image.BootstrapOptions{CacheDir: cache}, nil); err == nil {
			im := substrate.ImageOf(store, bb)
			bbLayers = &im
		}
		stateDir = filepath.Join(dir, "state")
		code := m.Run()
		for _, d := range runDirs {
			os.Remove(d)
			os.Remove(filepath.Dir(d))
		}
		// Whatever the tests did, failures included: no QEMU of theirs
		// may outlive them.
		if left := qemutest.Pids(fmt.Sprintf("vm%d-", os.Getpid())); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "FAIL: QEMU processes left behind: %v\n", left)
			for _, pid := range left {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			return 1
		}
		return code
	}()
	os.Exit(code)
}

func newDriver(t *testing.T, mut func(*Config)) *Driver {
	t.Helper()
	if setupErr != "" {
		t.Skip(setupErr)
	}
	cfg := Config{GuestBinary: guestBin, StateDir: stateDir, KernelDir: kernelDir}
	if mut != nil {
		mut(&cfg)
	}
	d, err := New(cfg, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	runDirs[d.cfg.RunDir] = d.cfg.RunDir
	if !d.Capabilities().Available {
		t.Fatalf("vm unavailable: %s", d.Capabilities().Reason)
	}
	return d
}

var seq int

func newSpec(t *testing.T) *substrate.Spec {
	seq++
	return &substrate.Spec{
		ID:       fmt.Sprintf("vm%d-%d", os.Getpid(), seq),
		Dir:      t.TempDir(),
		Image:    layers,
		Hostname: "sandbox",
		CPU:      1, MemoryMB: 512, Pids: 1024,
		Network:  substrate.Network{Mode: "none"},
		Deadline: time.Now().Add(time.Hour),
	}
}

func TestConformance(t *testing.T) {
	d := newDriver(t, nil)
	substratetest.Run(t, substratetest.Harness{
		Driver:  d,
		NewSpec: newSpec,
		Restart: func(t *testing.T) substrate.Driver { return newDriver(t, nil) },
		Leaks:   func(t *testing.T, s *substrate.Spec) []string { return leaks(d, s) },
		Kill: func(t *testing.T, inst substrate.Instance) {
			syscall.Kill(inst.(*instance).VM.State().Pid, syscall.SIGKILL)
		},
		SkipLimits: true,
	})
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func run(t *testing.T, inst substrate.Instance, cmd string) string {
	t.Helper()
	x, err := inst.Guest().Run(ctxT(t, 2*time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", cmd}, TimeoutMs: 120000})
	if err != nil {
		t.Fatalf("run %q: %v", cmd, err)
	}
	if x.ExitCode != 0 {
		t.Fatalf("run %q: exit %d: %s%s", cmd, x.ExitCode, x.Stdout, x.Stderr)
	}
	return string(x.Stdout)
}

func create(t *testing.T, d *Driver, s *substrate.Spec) substrate.Instance {
	t.Helper()
	inst, err := d.Create(ctxT(t, 5*time.Minute), s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.Destroy(context.Background()) })
	return inst
}

// TestBootPaths boots the image through the firmware (SeaBIOS, then the
// GRUB the image installed in its MBR), with no boot snapshot. The other
// path, directly into the image's own kernel (Boot "auto" for an image
// with one), is TestBootSnapshots' first boot: a cold boot of a full VM
// costs TCG half a minute of CPU, which the suite spends once per path.
func TestBootPaths(t *testing.T) {
	d := newDriver(t, func(cfg *Config) { cfg.Boot = "firmware"; cfg.ColdBoot = true; cfg.StateDir = t.TempDir() })
	start := time.Now()
	inst := create(t, d, newSpec(t))
	t.Logf("booted through the firmware to the agent in %v under %s", time.Since(start).Round(time.Millisecond), d.Accel().Name)
	if _, ok := d.bootSnapshot(inst.(*instance).Machine); ok {
		t.Fatal("a cold boot saved a boot snapshot")
	}
	checkBooted(t, inst, true)
}

// checkBooted checks that inst booted the image's own kernel under
// systemd, through GRUB (firmware) or directly.
func checkBooted(t *testing.T, inst substrate.Instance, firmware bool) {
	t.Helper()
	out := run(t, inst, "cat /proc/cmdline; cat /proc/1/comm; uname -r; systemctl is-system-running --wait || true")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 {
		t.Fatalf("output:\n%s", out)
	}
	if grub := strings.Contains(lines[0], "BOOT_IMAGE="); grub != firmware {
		t.Fatalf("kernel command line %q (GRUB passes BOOT_IMAGE)", lines[0])
	}
	if lines[1] != "systemd" {
		t.Fatalf("PID 1 is %q, want systemd", lines[1])
	}
	if !strings.HasSuffix(lines[2], "-cloud-amd64") {
		t.Fatalf("kernel %q is not the image's", lines[2])
	}
	if lines[3] != "running" {
		t.Fatalf("systemd: %q", lines[3])
	}
}

// evdevReader records the tablet's absolute positions and buttons as the
// guest's kernel reports them ("type code value" lines in /tmp/ev).
const evdevReader = `
import glob, os, select, struct, sys, time
dev = None
for p in glob.glob('/sys/class/input/event*/device/name'):
    if 'Tablet' in open(p).read():
        dev = '/dev/input/' + p.split('/')[4]
fd = os.open(dev, os.O_RDONLY)
out = open('/tmp/ev', 'w')
end = time.time() + float(sys.argv[1])
while time.time() < end:
    r, _, _ = select.select([fd], [], [], 0.2)
    if r:
        data = os.read(fd, 24 * 64)
        for i in range(0, len(data), 24):
            _, _, typ, code, val = struct.unpack('llHHi', data[i:i + 24])
            if typ in (1, 3):
                out.write('%d %d %d\n' % (typ, code, val))
                out.flush()
`

// waitFor runs cmd in the guest until its output contains want.
func waitFor(t *testing.T, inst substrate.Instance, cmd, want string) string {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		x, err := inst.Guest().Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", cmd}, TimeoutMs: 30000})
		if err == nil && strings.Contains(string(x.Stdout), want) {
			return string(x.Stdout)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%q never printed %q: %v %s", cmd, want, err, x.GetStdout())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestScreenAndInput drives the VM's screen like a computer-use agent: a
// screenshot of the text console, typing into the root shell it shows,
// key combinations, and the pointer as the guest's kernel sees it.
func TestScreenAndInput(t *testing.T) {
	d := newDriver(t, nil)
	inst := create(t, d, newSpec(t))
	ctx := ctxT(t, 5*time.Minute)
	before, err := inst.(*instance).Screenshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Run("a screenshot is a PNG at the guest's resolution", func(t *testing.T) {
		img, err := png.Decode(bytes.NewReader(before.PNG))
		if err != nil {
			t.Fatal(err)
		}
		b := img.Bounds()
		if b.Dx() != before.Width || b.Dy() != before.Height {
			t.Fatalf("PNG is %dx%d, reported %dx%d", b.Dx(), b.Dy(), before.Width, before.Height)
		}
		// The console is VGA text mode: 9x16 pixel cells.
		var rows, cols int
		fmt.Sscan(run(t, inst, "stty -F /dev/tty1 size"), &rows, &cols)
		if rows == 0 || b.Dx() != cols*9 || b.Dy() != rows*16 {
			t.Fatalf("screenshot %dx%d, console %d rows x %d columns", b.Dx(), b.Dy(), rows, cols)
		}
	})
	t.Run("typed text reaches the shell on the screen", func(t *testing.T) {
		if err := inst.(*instance).SendInput(ctx, []substrate.InputAction{{Text: "echo \"typed-$((6*7))\" > /tmp/typed; echo 'ok:{}|~'\n"}}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, inst, "cat /tmp/typed 2>/dev/null", "typed-42")
		after, err := inst.(*instance).Screenshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(after.PNG, before.PNG) {
			t.Fatal("the screen did not change")
		}
	})
	t.Run("a key combination interrupts a command", func(t *testing.T) {
		if err := inst.(*instance).SendInput(ctx, []substrate.InputAction{{Text: "sleep 1234\n"}}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, inst, "pgrep -xc sleep || true", "1")
		if err := inst.(*instance).SendInput(ctx, []substrate.InputAction{{Keys: "ctrl+c"}}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, inst, "pgrep -xc sleep || true", "0")
	})
	t.Run("the pointer moves to absolute positions and clicks", func(t *testing.T) {
		if _, err := inst.Guest().(substrate.FileGuest).WriteFile(ctx, &guestv1.WriteFile{Path: "/tmp/ev.py"}, strings.NewReader(evdevReader)); err != nil {
			t.Fatal(err)
		}
		run(t, inst, "rm -f /tmp/ev; python3 /tmp/ev.py 60 >/tmp/ev.log 2>&1 &")
		waitFor(t, inst, "test -e /tmp/ev && echo ready", "ready")
		w, h := before.Width, before.Height
		err := inst.(*instance).SendInput(ctx, []substrate.InputAction{
			{Move: &substrate.Point{X: w / 2, Y: h / 4}},
			{Click: &substrate.Click{Point: substrate.Point{X: w - 1, Y: h - 1}, Button: "right"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		// EV_ABS (3) ABS_X (0) / ABS_Y (1) in QEMU's 0..32767 range;
		// EV_KEY (1) BTN_RIGHT (273) down and up.
		want := []string{
			fmt.Sprintf("3 0 %d", (w/2)*qemu.AbsMax/(w-1)), fmt.Sprintf("3 1 %d", (h/4)*qemu.AbsMax/(h-1)),
			"3 0 32767", "3 1 32767", "1 273 1", "1 273 0",
		}
		out := waitFor(t, inst, "cat /tmp/ev", "1 273 0")
		for _, line := range want {
			if !strings.Contains(out, line+"\n") {
				t.Fatalf("guest input events lack %q:\n%s", line, out)
			}
		}
	})
	t.Run("bad input is refused", func(t *testing.T) {
		for _, a := range []substrate.InputAction{
			{Move: &substrate.Point{X: before.Width, Y: 0}},
			{Keys: "ctrl+nosuchkey"},
			{Text: "naïve"},
			{Click: &substrate.Click{Button: "fourth"}},
		} {
			if err := inst.(*instance).SendInput(ctx, []substrate.InputAction{a}); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Errorf("%+v: %v", a, err)
			}
		}
	})
}

// TestBootSnapshots: the first sandbox of an image and shape boots
// (directly into the image's kernel: Boot "auto") and saves the boot
// snapshot; the next ones restore it, each with its own identity.
func TestBootSnapshots(t *testing.T) {
	d := newDriver(t, func(c *Config) { c.StateDir = t.TempDir() })
	first := newSpec(t)
	first.MemoryMB = 384 // a shape of its own
	a := create(t, d, first)
	if _, ok := d.bootSnapshot(a.(*instance).Machine); !ok {
		t.Fatal("the first boot saved no boot snapshot")
	}
	t.Run("the first boots directly into the image's kernel", func(t *testing.T) { checkBooted(t, a, false) })
	second := newSpec(t)
	second.MemoryMB, second.Hostname = 384, "other"
	second.Env = []string{"ONLY_B=yes"}
	start := time.Now()
	b := create(t, d, second)
	t.Logf("restored the boot snapshot in %v", time.Since(start).Round(time.Millisecond))
	ida := run(t, a, "cat /proc/sys/kernel/random/boot_id /etc/machine-id; hostname; echo $ONLY_B")
	idb := run(t, b, "cat /proc/sys/kernel/random/boot_id /etc/machine-id; hostname; echo $ONLY_B")
	la, lb := strings.Fields(ida), strings.Fields(idb)
	if len(la) != 3 || len(lb) != 4 {
		t.Fatalf("a: %q b: %q", ida, idb)
	}
	t.Run("a restored sandbox shares the boot", func(t *testing.T) {
		if la[0] != lb[0] {
			t.Fatalf("boot IDs %s and %s: b did not restore a's boot", la[0], lb[0])
		}
	})
	t.Run("but has its own machine ID, hostname and environment", func(t *testing.T) {
		if la[1] == lb[1] || len(lb[1]) != 32 {
			t.Fatalf("machine IDs %s and %s", la[1], lb[1])
		}
		if la[2] != "sandbox" || lb[2] != "other" || lb[3] != "yes" {
			t.Fatalf("a: %q b: %q", ida, idb)
		}
	})
	t.Run("and its own disk", func(t *testing.T) {
		run(t, a, "echo a > /root/mine")
		if out := run(t, b, "cat /root/mine 2>/dev/null || echo none"); out != "none\n" {
			t.Fatalf("b sees a's file: %q", out)
		}
	})
}

// TestPauseFreesMemoryAndSurvivesARestart: a paused VM is a file, not a
// process; a new driver adopts it and resumes it with its memory.
func TestPauseFreesMemoryAndSurvivesARestart(t *testing.T) {
	d := newDriver(t, nil)
	spec := newSpec(t)
	inst, err := d.Create(ctxT(t, 5*time.Minute), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { inst.Destroy(context.Background()) }()
	run(t, inst, "echo kept > /dev/shm/mem-only")
	if err := inst.(*instance).Pause(ctxT(t, 2*time.Minute)); err != nil {
		t.Fatal(err)
	}
	if qemutest.Running(spec.ID) {
		t.Fatal("QEMU still runs while paused")
	}
	if st, _ := inst.Stats(context.Background()); st.MemoryBytes != 0 {
		t.Fatalf("a paused VM holds %d bytes", st.MemoryBytes)
	}
	again, err := newDriver(t, nil).Attach(ctxT(t, time.Minute), spec, inst.State())
	if err != nil {
		t.Fatal(err)
	}
	inst = again
	if err := again.(*instance).Resume(ctxT(t, 3*time.Minute)); err != nil {
		t.Fatal(err)
	}
	if got := run(t, again, "cat /dev/shm/mem-only"); got != "kept\n" {
		t.Fatalf("after resume: %q", got)
	}
	if _, err := again.(*instance).Screenshot(ctxT(t, time.Minute)); err != nil {
		t.Fatalf("screenshot after resume: %v", err)
	}
}

// TestBadInput: what cannot start is refused or fails with a clear infra
// error within the boot timeout, and leaves nothing behind.
func TestBadInput(t *testing.T) {
	if setupErr != "" {
		t.Skip(setupErr)
	}
	dir := t.TempDir()
	blank := filepath.Join(dir, "blank")
	os.MkdirAll(blank, 0o755)
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", filepath.Join(blank, image.VMDiskFile), "64M").CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	os.WriteFile(filepath.Join(blank, image.VMMetaFile), []byte(`{"virtual_size":67108864,"firmware":"bios","agent":"installed"}`), 0o644)
	corrupt := func(t *testing.T, mangle func(dir string)) string {
		d := newDriver(t, nil)
		inst := create(t, d, newSpec(t))
		snap := t.TempDir()
		if err := inst.(*instance).SnapshotMachine(ctxT(t, 2*time.Minute), snap); err != nil {
			t.Fatal(err)
		}
		mangle(snap)
		return snap
	}
	cases := []struct {
		name  string
		cfg   func(*Config)
		spec  func(t *testing.T, s *substrate.Spec)
		kind  errdefs.Kind
		infra bool
		want  string
	}{
		{name: "too little memory is invalid", spec: func(t *testing.T, s *substrate.Spec) { s.MemoryMB = 128 }, kind: errdefs.KindInvalid},
		{name: "an image of file system layers is invalid", spec: func(t *testing.T, s *substrate.Spec) {
			if bbLayers == nil {
				t.Skip("needs busybox-static")
			}
			s.Image = *bbLayers
		}, kind: errdefs.KindInvalid, want: "not a VM image"},
		{name: "a disk that does not boot fails with the firmware's word", cfg: func(c *Config) { c.ColdBoot = true },
			spec: func(t *testing.T, s *substrate.Spec) {
				s.Image = substrate.Image{Layers: []substrate.Layer{{Dir: blank, Link: blank}}, VM: &image.VMImage{VirtualSize: 64 << 20, Firmware: "bios", Agent: "installed"}}
			}, kind: errdefs.KindUnavailable, infra: true, want: "No bootable device"},
		{name: "a guest without the agent hits the boot timeout",
			cfg: func(c *Config) {
				// (Whenever the timeout falls, the agent never answers:
				// a short one is as much a test and boots less under TCG.)
				c.ColdBoot, c.Boot, c.BootTimeout, c.KernelArgs = true, "direct", 6*time.Second, "systemd.mask=dsec-agent.service"
			},
			kind: errdefs.KindUnavailable, infra: true, want: "did not answer within 6s"},
		{name: "a corrupt memory snapshot fails to restore", spec: func(t *testing.T, s *substrate.Spec) {
			s.Restore = corrupt(t, func(dir string) { os.Truncate(filepath.Join(dir, qemu.MemoryFile), 4096) })
		}, kind: errdefs.KindUnavailable, infra: true, want: "stopped while starting"},
		{name: "a corrupt machine description is refused", spec: func(t *testing.T, s *substrate.Spec) {
			s.Restore = corrupt(t, func(dir string) { os.WriteFile(filepath.Join(dir, qemu.MachineFile), []byte("{garbage"), 0o600) })
		}, kind: errdefs.KindUnavailable, infra: true, want: "corrupt"},
		{name: "a snapshot directory without a machine is not found", spec: func(t *testing.T, s *substrate.Spec) { s.Restore = t.TempDir() }, kind: errdefs.KindNotFound},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newSpec(t)
			if c.spec != nil {
				c.spec(t, s)
			}
			d := newDriver(t, c.cfg)
			start := time.Now()
			_, err := d.Create(ctxT(t, 5*time.Minute), s)
			if !errdefs.Is(err, c.kind) || errdefs.IsInfra(err) != c.infra || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v (infra %v), want %s (infra %v) containing %q", err, errdefs.IsInfra(err), c.kind, c.infra, c.want)
			}
			t.Logf("failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
			if left := leaks(d, s); len(left) > 0 {
				t.Fatalf("left %v", left)
			}
		})
	}
}

// vncAuth connects to a VNC server and authenticates with password (RFB
// 3.8, VNC authentication: the challenge DES-encrypted with the password,
// each key byte's bits reversed). It reports whether the server accepted.
func vncAuth(t *testing.T, addr, password string) bool {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	version := make([]byte, 12)
	if _, err := io.ReadFull(c, version); err != nil || !strings.HasPrefix(string(version), "RFB 003.") {
		t.Fatalf("server version %q: %v", version, err)
	}
	c.Write([]byte("RFB 003.008\n"))
	var n [1]byte
	io.ReadFull(c, n[:])
	types := make([]byte, n[0])
	io.ReadFull(c, types)
	if !bytes.Contains(types, []byte{2}) {
		t.Fatalf("security types %v lack VNC authentication", types)
	}
	c.Write([]byte{2})
	challenge := make([]byte, 16)
	if _, err := io.ReadFull(c, challenge); err != nil {
		t.Fatal(err)
	}
	key := make([]byte, 8)
	copy(key, password)
	for i, b := range key {
		key[i] = bits.Reverse8(b)
	}
	block, err := des.NewCipher(key)
	if err != nil {
		t.Fatal(err)
	}
	resp := make([]byte, 16)
	block.Encrypt(resp[:8], challenge[:8])
	block.Encrypt(resp[8:], challenge[8:])
	c.Write(resp)
	var result [4]byte
	if _, err := io.ReadFull(c, result[:]); err != nil {
		t.Fatal(err)
	}
	return binary.BigEndian.Uint32(result[:]) == 0
}

// TestVNC: with vm.vnc a VM's screen is served over VNC on loopback,
// locked until OpenVNC sets a password.
func TestVNC(t *testing.T) {
	d := newDriver(t, func(c *Config) { c.VNC = true })
	inst := create(t, d, newSpec(t))
	v, err := inst.(*instance).OpenVNC(ctxT(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	host, _, _ := net.SplitHostPort(v.Address)
	if host != "127.0.0.1" || len(v.Password) != 8 || time.Until(v.Expires) < 50*time.Minute {
		t.Fatalf("OpenVNC: %+v", v)
	}
	t.Run("the password opens the screen", func(t *testing.T) {
		if !vncAuth(t, v.Address, v.Password) {
			t.Fatal("refused the password OpenVNC set")
		}
	})
	t.Run("another password does not", func(t *testing.T) {
		if vncAuth(t, v.Address, "wrong123") {
			t.Fatal("accepted a wrong password")
		}
	})
	t.Run("a new OpenVNC retires the old password", func(t *testing.T) {
		again, err := inst.(*instance).OpenVNC(ctxT(t, time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		if again.Password == v.Password || vncAuth(t, v.Address, v.Password) || !vncAuth(t, again.Address, again.Password) {
			t.Fatalf("old %q new %q", v.Password, again.Password)
		}
	})
	t.Run("without vm.vnc it is unimplemented", func(t *testing.T) {
		plain := create(t, newDriver(t, nil), newSpec(t))
		if _, err := plain.(*instance).OpenVNC(ctxT(t, time.Minute)); !errdefs.Is(err, errdefs.KindUnimplemented) {
			t.Fatalf("OpenVNC: %v", err)
		}
	})
}

// TestSweepEndsVMsTheNodeDoesNotKnow: a restarted node kills the QEMU
// processes of its run directory that its store does not know, and only
// those.
func TestSweepEndsVMsTheNodeDoesNotKnow(t *testing.T) {
	d := newDriver(t, nil)
	known, unknown := newSpec(t), newSpec(t)
	a := create(t, d, known)
	create(t, d, unknown)
	// Each VM's QEMU runs in a cgroup of its own, which goes with it.
	cg := qemu.CgroupOf(d.cfg.CgroupParent, known.ID)
	if in := qemutest.CgroupsOf(a.(*instance).VM.State().Pid); in["memory"] != cg && in[""] != cg {
		t.Fatalf("a VM's QEMU is in the cgroups %v, not its own %s", in, cg)
	}
	if qemutest.Cgroup(unknown.ID) == "" {
		t.Fatal("the unknown VM has no cgroup")
	}
	n := newDriver(t, nil).Sweep(func(id string) bool { return id != unknown.ID })
	if n != 1 {
		t.Fatalf("swept %d VMs, want 1", n)
	}
	if qemutest.Running(unknown.ID) {
		t.Fatal("the unknown VM's QEMU still runs")
	}
	if left := qemutest.Cgroup(unknown.ID); left != "" {
		t.Fatalf("the unknown VM's cgroup %s is left", left)
	}
	for _, p := range []string{d.agentSock(unknown.ID), d.qmpSock(unknown.ID)} {
		if _, err := os.Stat(p); err == nil {
			t.Fatalf("%s left", p)
		}
	}
	if got := run(t, a, "echo kept"); got != "kept\n" {
		t.Fatalf("the known VM: %q", got)
	}
}

// leaks lists what a destroyed VM left: its QEMU, sockets, disk, saved
// memory and screenshots.
func leaks(d *Driver, s *substrate.Spec) []string {
	shots, _ := filepath.Glob(filepath.Join(s.Dir, "screen-*"))
	return append(qemutest.Leftovers(d.cfg.RunDir, s.ID, s.Dir, diskFile, qemu.PauseFile), shots...)
}
