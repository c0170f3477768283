package microvm

import (
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
	"github.com/opendsec/dsec/internal/cgroup"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/proc"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
	"github.com/opendsec/dsec/internal/substrate/qemu/qemutest"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
	"golang.org/x/sys/unix"
)

var (
	guestBin  string
	layers    substrate.Image
	kernelDir string
	stateDir  string // shared by the tests: image disks are built once
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
	dir, _ := os.MkdirTemp("", "dsec-microvm-test")
	code := func() int {
		defer os.RemoveAll(dir)
		if os.Geteuid() != 0 {
			setupErr = "needs root"
			return m.Run()
		}
		cache := os.Getenv("DSEC_CACHE_DIR")
		if cache == "" {
			setupErr = "needs DSEC_CACHE_DIR with a guest kernel (make test sets it; scripts/setup.sh extracts the kernel)"
			return m.Run()
		}
		kernelDir = filepath.Join(cache, "guest-kernel")
		if _, err := os.Stat(filepath.Join(kernelDir, "vmlinux")); err != nil {
			setupErr = "needs the guest kernel in " + kernelDir + " (run scripts/setup.sh)"
			return m.Run()
		}
		if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
			setupErr = "needs qemu-system-x86_64 (apt-get install qemu-system-x86)"
			return m.Run()
		}
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
		img, err := store.Bootstrap(tenant.System(context.Background()), "busybox", "", image.BootstrapOptions{CacheDir: cache}, nil)
		if err != nil {
			setupErr = "needs Debian's busybox-static: " + err.Error()
			return m.Run()
		}
		layers = substrate.ImageOf(store, img)
		stateDir = filepath.Join(dir, "state")
		code := m.Run()
		for _, d := range runDirs {
			os.Remove(d)
			os.Remove(filepath.Dir(d))
		}
		// Whatever the tests did, failures included: no QEMU of theirs
		// may outlive them.
		if left := qemutest.Pids(fmt.Sprintf("mvm%d-", os.Getpid())); len(left) > 0 {
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
		t.Fatalf("microvm unavailable: %s", d.Capabilities().Reason)
	}
	return d
}

var seq int

func newSpec(t *testing.T) *substrate.Spec {
	seq++
	return &substrate.Spec{
		ID:       fmt.Sprintf("mvm%d-%d", os.Getpid(), seq),
		Dir:      t.TempDir(),
		Image:    layers,
		Hostname: "sandbox",
		CPU:      1, MemoryMB: 128, DiskMB: 256, Pids: 256,
		Network: substrate.Network{Mode: "none"},
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
	x, err := inst.Guest().Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", cmd}, TimeoutMs: 60000})
	if err != nil {
		t.Fatalf("run %q: %v", cmd, err)
	}
	if x.ExitCode != 0 {
		t.Fatalf("run %q: exit %d: %s%s", cmd, x.ExitCode, x.Stdout, x.Stderr)
	}
	return string(x.Stdout)
}

func TestTheGuestRunsItsOwnKernel(t *testing.T) {
	d := newDriver(t, nil)
	inst, err := d.Create(ctxT(t, 3*time.Minute), newSpec(t))
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	if got := strings.TrimSpace(run(t, inst, "uname -r")); got != d.kernel.Release {
		t.Fatalf("uname -r = %q, want the guest kernel %q", got, d.kernel.Release)
	}
	t.Run("the root file system is the image over a writable disk", func(t *testing.T) {
		out := run(t, inst, "cat /proc/mounts")
		if !strings.Contains(out, "overlay / overlay") {
			t.Fatalf("mounts:\n%s", out)
		}
		run(t, inst, "echo x > /bin/new-file && test -f /bin/new-file")
	})
	t.Run("the agent's port is not reachable from inside", func(t *testing.T) {
		x, err := inst.Guest().Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c",
			"ls /dev/vport* 2>/dev/null; for p in /sys/class/virtio-ports/*; do cat /dev/${p##*/} </dev/null; done"}, TimeoutMs: 10000})
		if err != nil {
			t.Fatal(err)
		}
		if x.ExitCode == 0 || len(x.Stdout) > 0 {
			t.Fatalf("the port is reachable: exit %d stdout %q stderr %q", x.ExitCode, x.Stdout, x.Stderr)
		}
		x, err = inst.Guest().Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c",
			"for p in /sys/class/virtio-ports/*; do mknod /tmp/p c $(cat $p/dev | tr : ' ') && cat /tmp/p </dev/null; done"}, TimeoutMs: 10000, User: "65534"})
		if err != nil {
			t.Fatal(err)
		}
		if x.ExitCode == 0 {
			t.Fatalf("an unprivileged process opened the port: %q %q", x.Stdout, x.Stderr)
		}
	})
	t.Run("the disk size is enforced", func(t *testing.T) {
		x, err := inst.Guest().Run(ctxT(t, 2*time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", "dd if=/dev/zero of=/big bs=1M count=400 2>&1; r=$?; rm -f /big; exit $r"}, TimeoutMs: 120000})
		if err != nil {
			t.Fatal(err)
		}
		if x.ExitCode == 0 || !strings.Contains(string(x.Stdout), "No space left") {
			t.Fatalf("wrote 400 MiB to a 256 MiB disk: exit %d %s", x.ExitCode, x.Stdout)
		}
		run(t, inst, "echo still > /ok && cat /ok")
	})
}

func TestMachineSnapshotsRestoreAndFork(t *testing.T) {
	d := newDriver(t, nil)
	parent, err := d.Create(ctxT(t, 3*time.Minute), newSpec(t))
	if err != nil {
		t.Fatal(err)
	}
	defer parent.Destroy(context.Background())
	run(t, parent, "echo on-disk > /state; (while :; do sleep 1; done) & echo $! > /tmp/loop-pid; head -c 16 /dev/urandom | od -An -tx1 > /tmp/seed0")
	snap := t.TempDir()
	if err := parent.(*instance).SnapshotMachine(ctxT(t, 2*time.Minute), snap); err != nil {
		t.Fatal(err)
	}
	t.Run("the parent keeps running after the snapshot", func(t *testing.T) {
		if got := run(t, parent, "cat /state"); got != "on-disk\n" {
			t.Fatalf("parent: %q", got)
		}
	})
	var children []substrate.Instance
	for k := 0; k < 2; k++ {
		s := newSpec(t)
		s.Restore = snap
		s.Env = []string{"CHILD=" + fmt.Sprint(k)}
		c, err := d.Create(ctxT(t, 3*time.Minute), s)
		if err != nil {
			t.Fatalf("restore child %d: %v", k, err)
		}
		defer c.Destroy(context.Background())
		children = append(children, c)
	}
	t.Run("children have the parent's files and processes", func(t *testing.T) {
		for _, c := range children {
			if got := run(t, c, "cat /state; kill -0 $(cat /tmp/loop-pid) && echo loop-alive"); got != "on-disk\nloop-alive\n" {
				t.Fatalf("child: %q", got)
			}
		}
	})
	t.Run("children have their own disks", func(t *testing.T) {
		run(t, children[0], "echo mine > /state")
		if got := run(t, children[1], "cat /state"); got != "on-disk\n" {
			t.Fatalf("child 1 sees child 0's write: %q", got)
		}
		if got := run(t, parent, "cat /state"); got != "on-disk\n" {
			t.Fatalf("parent sees a child's write: %q", got)
		}
	})
	t.Run("children have a current clock and their own environment", func(t *testing.T) {
		for k, c := range children {
			out := run(t, c, "date +%s; echo $CHILD")
			var ts, env int
			fmt.Sscan(out, &ts, &env)
			if d := time.Since(time.Unix(int64(ts), 0)); d > time.Minute || d < -time.Minute {
				t.Fatalf("child %d clock off by %v", k, d)
			}
			if env != k {
				t.Fatalf("child %d env %q", k, out)
			}
		}
	})
	t.Run("children draw different random numbers", func(t *testing.T) {
		a := run(t, children[0], "head -c 16 /dev/urandom | od -An -tx1")
		b := run(t, children[1], "head -c 16 /dev/urandom | od -An -tx1")
		if a == b {
			t.Fatalf("both children drew %s", a)
		}
	})
}

func TestPauseFreesMemoryAndResumeRestores(t *testing.T) {
	d := newDriver(t, nil)
	spec := newSpec(t)
	inst, err := d.Create(ctxT(t, 3*time.Minute), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { inst.Destroy(context.Background()) }()
	run(t, inst, "echo kept > /tmp/mem-only")
	// A stream open across the pause breaks when QEMU goes; the instance
	// must still count as alive (paused), never as crashed.
	proc, err := inst.Guest().(substrate.ProcessGuest).Start(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	defer proc.Close()
	checks := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		defer close(checks)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := inst.Check(context.Background()); err != nil {
				checks <- err
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	err = inst.(*instance).Pause(ctxT(t, 2*time.Minute))
	close(stop)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-checks; err != nil {
		t.Fatalf("check during the pause: %v", err)
	}
	if qemutest.Running(spec.ID) {
		t.Fatal("QEMU still runs while paused")
	}
	if st, _ := inst.Stats(context.Background()); st.MemoryBytes != 0 {
		t.Fatalf("a paused VM holds %d bytes", st.MemoryBytes)
	}
	t.Run("a paused VM survives a driver restart", func(t *testing.T) {
		again, err := newDriver(t, nil).Attach(ctxT(t, time.Minute), spec, inst.State())
		if err != nil {
			t.Fatal(err)
		}
		if err := again.(*instance).Resume(ctxT(t, 3*time.Minute)); err != nil {
			t.Fatal(err)
		}
		if got := run(t, again, "cat /tmp/mem-only"); got != "kept\n" {
			t.Fatalf("after resume: %q", got)
		}
		inst = again
	})
}

func TestBadInput(t *testing.T) {
	d := newDriver(t, nil)
	cases := []struct {
		name string
		mut  func(*substrate.Spec)
		kind errdefs.Kind
	}{
		{"a disk too small for the writable layer is invalid", func(s *substrate.Spec) { s.DiskMB = 8 }, errdefs.KindInvalid},
		{"too little memory is invalid", func(s *substrate.Spec) { s.MemoryMB = 32 }, errdefs.KindInvalid},
		{"a snapshot directory without a machine is not found", func(s *substrate.Spec) { s.Restore = t.TempDir() }, errdefs.KindNotFound},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newSpec(t)
			c.mut(s)
			_, err := d.Create(ctxT(t, time.Minute), s)
			if !errdefs.Is(err, c.kind) {
				t.Fatalf("got %v, want %s", err, c.kind)
			}
			if left := leaks(d, s); len(left) > 0 {
				t.Fatalf("left %v", left)
			}
		})
	}
}

func TestFailuresAreInfraErrorsAndLeaveNothing(t *testing.T) {
	cases := []struct {
		name string
		cfg  func(*Config)
		spec func(*substrate.Spec)
		kill bool // kill QEMU while the guest boots
		want string
	}{
		{
			name: "a guest kernel that panics is reported with the panic",
			spec: func(s *substrate.Spec) { s.MemoryMB = 64 }, // too small for this kernel and initramfs
			want: "Kernel panic",
		},
		{
			name: "a guest that never starts its agent hits the boot timeout",
			cfg:  func(c *Config) { c.BootTimeout = 5 * time.Second; c.KernelArgs = "dsec.init=hold" },
			want: "did not answer",
		},
		{
			name: "a QEMU that dies while the guest boots is reported",
			// A boot, not a restore of the shape's boot snapshot, which
			// can end before the kill lands.
			cfg:  func(c *Config) { c.ColdBoot = true },
			kill: true,
			want: "stopped while starting",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newDriver(t, c.cfg)
			s := newSpec(t)
			if c.spec != nil {
				c.spec(s)
			}
			if c.kill {
				go func() {
					for i := 0; i < 2000 && !qemutest.Running(s.ID); i++ {
						time.Sleep(5 * time.Millisecond)
					}
					qemutest.Kill(s.ID)
				}()
			}
			start := time.Now()
			inst, err := d.Create(ctxT(t, 3*time.Minute), s)
			if err == nil {
				inst.Destroy(context.Background())
				t.Fatal("create succeeded")
			}
			if !errdefs.IsInfra(err) || !strings.Contains(err.Error(), c.want) || c.kill && !strings.Contains(err.Error(), "killed by signal SIGKILL") {
				t.Fatalf("got %v (infra %v), want an infra error containing %q", err, errdefs.IsInfra(err), c.want)
			}
			t.Logf("failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
			if left := leaks(d, s); len(left) > 0 {
				t.Fatalf("left %v", left)
			}
		})
	}
}

func TestMissingKernelMakesTheKindUnavailable(t *testing.T) {
	if setupErr != "" {
		t.Skip(setupErr)
	}
	d, err := New(Config{GuestBinary: guestBin, StateDir: t.TempDir(), KernelDir: t.TempDir()}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	caps := d.Capabilities()
	if caps.Available || !strings.Contains(caps.Reason, "no guest kernel") {
		t.Fatalf("capabilities: %+v", caps)
	}
	_, err = d.Create(context.Background(), newSpec(t))
	if !errdefs.Is(err, errdefs.KindUnavailable) || !errdefs.IsInfra(err) {
		t.Fatalf("create: %v", err)
	}
}

// leaks lists what a destroyed microVM left: its QEMU, sockets, disk and
// saved memory.
func leaks(d *Driver, s *substrate.Spec) []string {
	return qemutest.Leftovers(d.cfg.RunDir, s.ID, s.Dir, diskFile, qemu.PauseFile)
}

// TestAGuestSpinningItsVCPUIsHeldToTheSandboxsCPUShare: a microVM's vCPUs
// are whole (cpu 0.5 gets one), and under TCG a guest that spins on one
// makes QEMU take a whole host core. QEMU runs in a cgroup of the
// sandbox's own, at its CPU share and with its guest's memory plus
// QEMU's own as the limit, and the cgroup goes with the sandbox.
func TestAGuestSpinningItsVCPUIsHeldToTheSandboxsCPUShare(t *testing.T) {
	d := newDriver(t, nil)
	spec := newSpec(t)
	spec.CPU = 0.5
	inst, err := d.Create(ctxT(t, 3*time.Minute), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	pid := inst.(*instance).VM.State().Pid
	h := cgroup.Probe()
	cg := qemu.CgroupOf(d.cfg.CgroupParent, spec.ID)
	in := qemutest.CgroupsOf(pid)
	for _, c := range []string{"memory", "cpu", "pids"} {
		if h.Mode == cgroup.V2 {
			c = ""
		}
		if in[c] != cg {
			t.Fatalf("QEMU's %s cgroup is %q, not the sandbox's %s", c, in[c], cg)
		}
	}
	wantMem := (spec.MemoryMB + int64(d.cfg.TBSizeMiB) + qemu.QEMUOverheadMiB) << 20
	memFile, quotaFile := filepath.Join(h.Dir(cg, "memory"), "memory.limit_in_bytes"), filepath.Join(h.Dir(cg, "cpu"), "cpu.cfs_quota_us")
	wantQuota := "50000"
	if h.Mode == cgroup.V2 {
		memFile, quotaFile, wantQuota = filepath.Join(h.Dir(cg, ""), "memory.max"), filepath.Join(h.Dir(cg, ""), "cpu.max"), "50000 100000"
	}
	if got := cgroup.ReadInt(memFile); got != wantMem {
		t.Errorf("memory limit %d, want %d (guest, translation buffer, QEMU's own)", got, wantMem)
	}
	if b, _ := os.ReadFile(quotaFile); strings.TrimSpace(string(b)) != wantQuota {
		t.Errorf("CPU quota %q, want %q", strings.TrimSpace(string(b)), wantQuota)
	}
	throttled := func() int64 { return cgroup.Keyed(filepath.Join(h.Dir(cg, "cpu"), "cpu.stat"), "nr_throttled") }
	before, cpu0, t0 := throttled(), proc.CPUTime(pid), time.Now()
	run(t, inst, "timeout 5 sh -c 'while :; do :; done' || true")
	share := float64(proc.CPUTime(pid)-cpu0) / float64(time.Since(t0))
	t.Logf("QEMU used %.2f of a core while its guest spun for 5 s", share)
	if share > 0.65 {
		t.Errorf("QEMU used %.2f of a core, more than the sandbox's 0.5", share)
	}
	if throttled() == before {
		t.Error("the spinning guest's QEMU was never throttled")
	}
	inst.Destroy(context.Background())
	if left := qemutest.Cgroup(spec.ID); left != "" {
		t.Errorf("the cgroup %s is left after the sandbox", left)
	}
}

// TestLaterSandboxesOfAShapeRestoreTheImagesBootSnapshot: the first boot
// of an image on a machine shape is saved; the next sandbox of that shape
// restores it (QEMU starts with -incoming) with its own
// hostname, deadline and nothing of the first one's own files; a cold-boot
// driver boots.
func TestLaterSandboxesOfAShapeRestoreTheImagesBootSnapshot(t *testing.T) {
	d := newDriver(t, nil)
	disk := newShapeDisk()
	shape := func(host string) *substrate.Spec {
		s := newSpec(t)
		s.MemoryMB, s.DiskMB, s.Hostname = 144, disk, host // a shape no other test or run uses
		return s
	}
	first := shape("")
	a, err := d.Create(ctxT(t, 3*time.Minute), first)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Destroy(context.Background())
	if _, ok := d.boots.Find(d.bootKey(a.(*instance).Machine, first.DiskMB)); !ok {
		t.Fatal("the first boot of the shape saved no boot snapshot")
	}
	// A restore is a QEMU started with -incoming.
	restored := func(id string) bool {
		for _, p := range qemu.VMProcesses() {
			if p.ID == id {
				return strings.Contains(p.Cmdline, "\x00-incoming\x00")
			}
		}
		t.Fatalf("no QEMU runs sandbox %s", id)
		return false
	}
	if restored(first.ID) {
		t.Error("the first sandbox of the shape was restored")
	}
	run(t, a, "echo mine > /root/first")
	second := shape("second")
	second.Deadline = time.Now().Add(time.Hour)
	start := time.Now()
	b, err := d.Create(ctxT(t, 3*time.Minute), second)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Destroy(context.Background())
	t.Logf("the second sandbox started in %v", time.Since(start))
	if !restored(second.ID) {
		t.Error("the second sandbox booted instead of restoring the boot snapshot")
	}
	if got := run(t, b, "hostname"); got != "second\n" {
		t.Errorf("the restored sandbox's hostname is %q", got)
	}
	if got := run(t, b, "cat /root/first 2>&1 || true"); !strings.Contains(got, "No such file") {
		t.Errorf("the restored sandbox has the first one's file: %q", got)
	}
	if got := run(t, a, "hostname"); got != "sandbox\n" {
		t.Errorf("the first sandbox's hostname changed to %q", got)
	}
	cold := newDriver(t, func(c *Config) { c.ColdBoot = true })
	third := shape("")
	c, err := cold.Create(ctxT(t, 3*time.Minute), third)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Destroy(context.Background())
	if restored(third.ID) {
		t.Error("a cold-boot driver restored the boot snapshot")
	}
}

// TestARestoredGuestGivingMemoryBackChangesNoOtherSandboxsRAM attacks the
// RAM that sandboxes restored from one boot snapshot share (see
// qemu/ram.go): a restored guest fills memory and frees it, so its kernel
// reports the pages free and QEMU discards them, which on the shared RAM
// would punch holes every other sandbox of the shape reads as zeros. The
// discards must be refused (QEMU logs each) and the shared RAM must still
// hold the snapshot's bytes; a later sandbox still restores and runs.
func TestARestoredGuestGivingMemoryBackChangesNoOtherSandboxsRAM(t *testing.T) {
	d := newDriver(t, nil)
	disk := newShapeDisk()
	shape := func() *substrate.Spec {
		s := newSpec(t)
		s.MemoryMB, s.DiskMB = 176, disk // a shape no other test or run uses
		return s
	}
	first := shape()
	a, err := d.Create(ctxT(t, 3*time.Minute), first)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Destroy(context.Background())
	dir, ok := d.boots.Find(d.bootKey(a.(*instance).Machine, first.DiskMB))
	if !ok {
		t.Fatal("the first boot of the shape saved no boot snapshot")
	}
	ram := filepath.Join(dir, qemu.RAMFile)
	stream, err1 := os.Stat(filepath.Join(dir, qemu.MemoryFile))
	saved, err2 := os.Stat(ram)
	if err1 != nil || err2 != nil {
		t.Fatalf("the boot snapshot has no stream or no RAM file: %v, %v", err1, err2)
	}
	if stream.Size() > 4<<20 || saved.Size() != first.MemoryMB<<20 {
		t.Errorf("the boot snapshot's stream is %d bytes and its RAM file %d: the RAM went in the stream", stream.Size(), saved.Size())
	}
	want := digestOf(t, ram)

	second := shape()
	b, err := d.Create(ctxT(t, 3*time.Minute), second)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Destroy(context.Background())
	shared := sharedRAMOf(t, second.ID)
	run(t, b, "mkdir -p /tmp/fill && mount -t tmpfs -o size=96m tmpfs /tmp/fill && "+
		"dd if=/dev/urandom of=/tmp/fill/x bs=1M count=80 2>/dev/null && rm /tmp/fill/x && umount /tmp/fill")
	// The guest reports free memory in batches a few seconds apart; QEMU
	// logs each discard it could not make. Without the seal no line
	// comes (the discard went through): the shared RAM tells.
	refused := logSays(t, filepath.Join(second.Dir, qemu.LogFile), "ram_block_discard_range", time.Minute)
	if got := digestOf(t, shared); got != want {
		t.Fatal("the RAM restored sandboxes share changed after a guest gave memory back")
	}
	if !refused {
		t.Fatal("the restored guest's freed memory was never discarded (no refused discard in QEMU's log)")
	}
	if got := digestOf(t, ram); got != want {
		t.Fatal("the boot snapshot's RAM file changed")
	}
	third := shape()
	c, err := d.Create(ctxT(t, 3*time.Minute), third)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Destroy(context.Background())
	if got := run(t, c, "echo alive"); got != "alive\n" {
		t.Errorf("a sandbox restored after the attack: %q", got)
	}
}

// shapeDisks counts the writable disk sizes newShapeDisk gave out.
var shapeDisks int64

// newShapeDisk is a writable disk size (MiB) no sandbox of this test
// process had yet: the machine shape of a test that needs its first
// sandbox to boot (the tests share a state directory, and so its boot
// snapshots, also across the runs of -count).
func newShapeDisk() int64 {
	shapeDisks++
	return 300 + shapeDisks
}

// sharedRAMOf is the path (through /proc) of the RAM that sandbox id's
// QEMU maps copy-on-write: the sealed memfd restores share.
func sharedRAMOf(t *testing.T, id string) string {
	t.Helper()
	for _, p := range qemu.VMProcesses() {
		if p.ID != id {
			continue
		}
		dir := fmt.Sprintf("/proc/%d/fd", p.Pid)
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if l, _ := os.Readlink(filepath.Join(dir, e.Name())); strings.HasPrefix(l, "/memfd:dsec-ram") {
				return filepath.Join(dir, e.Name())
			}
		}
		t.Fatalf("sandbox %s's QEMU maps no shared RAM (was it restored?)", id)
	}
	t.Fatalf("no QEMU runs sandbox %s", id)
	return ""
}

// logSays waits up to timeout for the file at path to contain s, woken
// by its writes (inotify), and says whether it did.
func logSays(t *testing.T, path, s string, timeout time.Duration) bool {
	t.Helper()
	in, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(in)
	if _, err := unix.InotifyAddWatch(in, path, unix.IN_MODIFY); err != nil {
		t.Fatalf("watch %s: %v", path, err)
	}
	buf := make([]byte, 4096)
	for deadline := time.Now().Add(timeout); ; {
		if b, _ := os.ReadFile(path); strings.Contains(string(b), s) {
			return true
		}
		left := time.Until(deadline)
		if left <= 0 {
			return false
		}
		fds := []unix.PollFd{{Fd: int32(in), Events: unix.POLLIN}}
		if _, err := unix.Poll(fds, int(left.Milliseconds())+1); err != nil && err != unix.EINTR {
			t.Fatal(err)
		}
		unix.Read(in, buf) // drain: the next write wakes the poll again
	}
}

func digestOf(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("sha256sum", path).Output()
	if err != nil {
		t.Fatalf("digest of %s: %v", path, err)
	}
	return strings.Fields(string(out))[0]
}
