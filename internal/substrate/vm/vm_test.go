package vm

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/qemu"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
)

var (
	guestBin  string
	layers    []string // the debian VM image
	bbLayers  []string // busybox: not a VM image
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
		for _, tool := range []string{"qemu-system-x86_64", "qemu-img", "debootstrap", "debugfs"} {
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
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		img, err := store.BuildVM(ctx, "debian", "", image.BootstrapOptions{CacheDir: cache}, nil)
		if err != nil {
			fmt.Fprintln(os.Stderr, "build the debian VM image:", err)
			return 1
		}
		layers = store.LowerDirs(img)
		imgDir = store.LayerDir(img.Layers[0])
		if bb, err := store.Bootstrap(ctx, "busybox", "", image.BootstrapOptions{CacheDir: cache}, nil); err == nil {
			bbLayers = store.LowerDirs(bb)
		}
		stateDir = filepath.Join(dir, "state")
		code := m.Run()
		for _, d := range runDirs {
			os.Remove(d)
			os.Remove(filepath.Dir(d))
		}
		// Whatever the tests did, failures included: no QEMU of theirs
		// may outlive them.
		if left := qemusOf(fmt.Sprintf("vm%d-", os.Getpid())); len(left) > 0 {
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
		Layers:   layers,
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
			syscall.Kill(inst.(*instance).vm.State().Pid, syscall.SIGKILL)
		},
		SkipLimits: true,
	})
}

// leaks lists what a destroyed VM left: its QEMU, sockets, disk and
// saved memory.
func leaks(d *Driver, s *substrate.Spec) []string {
	var out []string
	if qemuRunning(s.ID) {
		out = append(out, "QEMU process")
	}
	for _, p := range []string{d.agentSock(s.ID), d.qmpSock(s.ID), filepath.Join(s.Dir, diskFile), filepath.Join(s.Dir, qemu.PauseFile)} {
		if _, err := os.Stat(p); err == nil {
			out = append(out, p)
		}
	}
	shots, _ := filepath.Glob(filepath.Join(s.Dir, "screen-*"))
	return append(out, shots...)
}

// qemuRunning reports whether a QEMU of sandbox id runs.
func qemuRunning(id string) bool {
	for _, pid := range qemusOf(id) {
		if pid > 0 {
			return true
		}
	}
	return false
}

// qemusOf lists the live QEMU processes whose sandbox ID starts with prefix.
func qemusOf(prefix string) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(b, []byte("\x00dsec-"+prefix)) {
			continue
		}
		st, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
		if bytes.Contains(st, []byte(") Z ")) {
			continue
		}
		var pid int
		fmt.Sscan(e.Name(), &pid)
		out = append(out, pid)
	}
	return out
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

// TestBootPaths boots the image both ways a VM boots, with no boot
// snapshot: through the firmware (SeaBIOS, then the GRUB the image
// installed in its MBR) and directly into the image's own kernel.
func TestBootPaths(t *testing.T) {
	for _, c := range []struct{ boot, name string }{
		{"firmware", "a VM boots through SeaBIOS and its own GRUB"},
		{"direct", "a VM boots directly into its image's kernel"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDriver(t, func(cfg *Config) { cfg.Boot = c.boot; cfg.ColdBoot = true })
			start := time.Now()
			inst := create(t, d, newSpec(t))
			t.Logf("booted (%s) to the agent in %v under %s", c.boot, time.Since(start).Round(time.Millisecond), d.Accel().Name)
			out := run(t, inst, "cat /proc/cmdline; cat /proc/1/comm; uname -r; systemctl is-system-running --wait || true")
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if len(lines) != 4 {
				t.Fatalf("output:\n%s", out)
			}
			if grub := strings.Contains(lines[0], "BOOT_IMAGE="); grub != (c.boot == "firmware") {
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
		})
	}
}
