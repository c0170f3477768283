package container

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"github.com/opendsec/dsec/internal/cgroup"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/proc"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
)

var (
	guestBin string
	layers   substrate.Image
	setupErr string
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if err := mountns.Enter(); err != nil {
			fmt.Fprintln(os.Stderr, "mount namespace:", err)
			os.Exit(1)
		}
	}
	dir, _ := os.MkdirTemp("", "dsec-container-test")
	code := func() int {
		defer os.RemoveAll(dir)
		if os.Geteuid() != 0 {
			setupErr = "needs root"
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
		img, err := store.Bootstrap(tenant.System(context.Background()), "busybox", "", image.BootstrapOptions{}, nil)
		if err != nil {
			setupErr = "needs Debian's busybox-static: " + err.Error()
			return m.Run()
		}
		layers = substrate.ImageOf(store, img)
		return m.Run()
	}()
	os.Exit(code)
}

func newDriver(t *testing.T, state string) *Driver {
	t.Helper()
	if setupErr != "" {
		t.Skip(setupErr)
	}
	d, err := New(Config{GuestBinary: guestBin, StateDir: state}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	return d
}

func TestConformance(t *testing.T) {
	state := t.TempDir()
	d := newDriver(t, state)
	n := 0
	substratetest.Run(t, substratetest.Harness{
		Driver: d,
		NewSpec: func(t *testing.T) *substrate.Spec {
			n++
			return &substrate.Spec{
				ID:       fmt.Sprintf("ct%d-%d", os.Getpid(), n),
				Dir:      t.TempDir(),
				Image:    layers,
				Hostname: "sandbox",
				CPU:      1, MemoryMB: 256, Pids: 256,
				Network: substrate.Network{Mode: "none"},
			}
		},
		Restart: func(t *testing.T) substrate.Driver { return newDriver(t, state) },
		Leaks:   func(t *testing.T, s *substrate.Spec) []string { return leaks(d, s) },
		Kill: func(t *testing.T, inst substrate.Instance) {
			syscall.Kill(inner(inst).st.Pid, syscall.SIGKILL)
		},
	})
}

// TestConformanceUnderGVisor runs the suite on sandboxes with runtime
// gvisor (runsc).
func TestConformanceUnderGVisor(t *testing.T) {
	state := t.TempDir()
	d := newDriver(t, state)
	needGVisor(t, d)
	n := 0
	substratetest.Run(t, substratetest.Harness{
		Driver:  d,
		Runtime: substrate.RuntimeGVisor,
		NewSpec: func(t *testing.T) *substrate.Spec {
			n++
			return &substrate.Spec{
				ID:       fmt.Sprintf("gv%d-%d", os.Getpid(), n),
				Dir:      t.TempDir(),
				Image:    layers,
				Hostname: "sandbox",
				CPU:      1, MemoryMB: 256, Pids: 256,
				Network: substrate.Network{Mode: "none"},
				Runtime: substrate.RuntimeGVisor,
			}
		},
		Restart: func(t *testing.T) substrate.Driver { return newDriver(t, state) },
		Leaks:   func(t *testing.T, s *substrate.Spec) []string { return leaks(d, s) },
		// A platform failure: runsc dies, and the sandbox with it. (A
		// SIGKILL of the sandbox's kernel process, runsc's exit code 137,
		// reads from the host like its workload killing the agent: see
		// instance.readEndedBy.)
		Kill: func(t *testing.T, inst substrate.Instance) {
			syscall.Kill(inner(inst).st.RuntimePid, syscall.SIGKILL)
		},
		LimitsEndInstance: true,
	})
}

// needGVisor skips t where runsc cannot run sandboxes.
func needGVisor(t *testing.T, d *Driver) {
	t.Helper()
	if d.gvisor == nil {
		t.Skipf("no gvisor runtime: %s", d.gvisorReason)
	}
}

// leaks lists what a destroyed sandbox left: mounts, cgroups, runtime state,
// its agent socket.
func leaks(d *Driver, s *substrate.Spec) []string {
	var out []string
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if bytes.Contains(mi, []byte(s.Dir)) {
		out = append(out, "mount under "+s.Dir)
	}
	for _, ctrl := range []string{"pids", "memory", "cpu", ""} {
		if ctrl == "" && d.cgroups.Mode != cgroup.V2 {
			continue
		}
		for _, p := range []string{d.cgroups.Dir(d.cgroupPath(s.ID), ctrl), d.cgroups.Dir(d.cgroupPath(s.ID)+agentSuffix, ctrl)} {
			if _, err := os.Stat(p); err == nil {
				out = append(out, "cgroup "+p)
			}
		}
	}
	if _, err := os.Stat(filepath.Join(d.runRoot, s.ID)); err == nil {
		out = append(out, "runtime state")
	}
	if d.gvisor != nil && d.gvisor.exists(s.ID) {
		out = append(out, "runsc state")
	}
	if _, err := os.Stat(d.sockPath(s.ID)); err == nil {
		out = append(out, "agent socket")
	}
	return out
}

func TestGuestChannelIsNotReachableFromInside(t *testing.T) {
	d := newDriver(t, t.TempDir())
	spec := &substrate.Spec{ID: fmt.Sprintf("chan%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 256, Pids: 256, CPU: 1}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	checks := []struct {
		name string
		cmd  string
	}{
		{"no unix socket of the agent is visible", "cat /proc/net/unix | grep -v Path | grep -q ."},
		{"the agent's fds cannot be followed", "readlink /proc/1/fd/3 || cat /proc/1/fd/3 || readlink /proc/1/fd/5 || cat /proc/1/fd/9"},
		{"no process inherits the agent's descriptors", "test $(ls /proc/self/fd | wc -l) -gt 4"},
		{"the agent's memory cannot be read", "head -c1 /proc/1/mem"},
		{"the agent's environment cannot be read", "cat /proc/1/environ"},
		{"the agent cannot be killed from inside", "kill -9 1; kill -TERM 1; sleep 0.2; kill -0 1 && exit 1"},
		{"the agent binary is read-only", "echo x > /.dsec/guest"},
	}
	for _, c := range checks {
		t.Run(c.name, func(t *testing.T) {
			x, err := inst.Guest().Run(context.Background(), (&runExec{c.cmd}).exec())
			if err != nil {
				t.Fatal(err)
			}
			if x.ExitCode == 0 {
				t.Fatalf("%q succeeded inside the sandbox: %s", c.cmd, x.Stdout)
			}
		})
	}
	if err := inst.Check(context.Background()); err != nil {
		t.Fatalf("sandbox died: %v", err)
	}
}

func TestSandboxesHaveNoRawSocketsButPing(t *testing.T) {
	d := newDriver(t, t.TempDir())
	// A layer over the image with a copy of busybox carrying
	// cap_net_raw+ep, as Debian installs ping.
	top := t.TempDir()
	if err := os.MkdirAll(filepath.Join(top, "opt"), 0o755); err != nil {
		t.Fatal(err)
	}
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Skip("needs Debian's busybox-static")
	}
	capped := filepath.Join(top, "opt", "busybox")
	if err := os.WriteFile(capped, bb, 0o755); err != nil {
		t.Fatal(err)
	}
	// VFS_CAP_REVISION_2, effective, permitted = 1<<CAP_NET_RAW.
	xattr := []byte{0x01, 0x00, 0x00, 0x02, 0x00, 0x20, 0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	if err := syscall.Setxattr(capped, "security.capability", xattr, 0); err != nil {
		t.Skipf("cannot set file capabilities here: %v", err)
	}
	spec := &substrate.Spec{ID: fmt.Sprintf("raw%d", os.Getpid()), Dir: t.TempDir(), Image: substrate.Image{Layers: append([]substrate.Layer{{Dir: top, Link: top}}, layers.Layers...)}, Hostname: "sandbox", MemoryMB: 256, Pids: 256, CPU: 1}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	run := func(t *testing.T, cmd string) (int32, string) {
		t.Helper()
		x, err := inst.Guest().Run(context.Background(), (&runExec{cmd + " 2>&1"}).exec())
		if err != nil {
			t.Fatal(err)
		}
		return x.ExitCode, string(x.Stdout)
	}
	t.Run("CAP_NET_RAW is in no set a process uses", func(t *testing.T) {
		for _, cmd := range []string{"cat /proc/self/status", "/opt/busybox cat /proc/self/status"} {
			_, out := run(t, cmd)
			for _, line := range strings.Split(out, "\n") {
				f := strings.Fields(line)
				if len(f) != 2 || !strings.HasPrefix(f[0], "Cap") || f[0] == "CapBnd:" {
					continue
				}
				v, err := strconv.ParseUint(f[1], 16, 64)
				if err != nil {
					t.Fatalf("%q: %v", line, err)
				}
				if v&(1<<13) != 0 { // CAP_NET_RAW
					t.Errorf("%s: %s has CAP_NET_RAW", cmd, line)
				}
			}
		}
	})
	t.Run("raw and packet sockets are refused", func(t *testing.T) {
		for _, cmd := range []string{"ping -c1 -W1 127.0.0.1", "arping -c1 -w1 -I lo 127.0.0.1", "/opt/busybox arping -c1 -w1 -I lo 127.0.0.1"} {
			if code, out := run(t, cmd); code == 0 || !strings.Contains(strings.ToLower(out), "permi") {
				t.Errorf("%s: exit %d, %q", cmd, code, out)
			}
		}
	})
	t.Run("a binary with file capability cap_net_raw+ep still runs", func(t *testing.T) {
		if code, out := run(t, "/opt/busybox true"); code != 0 {
			t.Errorf("exit %d, %q", code, out)
		}
	})
	t.Run("ICMP datagram sockets are open to every group", func(t *testing.T) {
		// Every group of the sandbox's user namespace (all of them without).
		want := "0 65535"
		if d.cfg.HostRoot {
			want = "0 2147483647"
		}
		if _, out := run(t, "cat /proc/sys/net/ipv4/ping_group_range"); strings.Join(strings.Fields(out), " ") != want {
			t.Errorf("ping_group_range %q, want %q", out, want)
		}
	})
}

func TestHundredCreateDeleteCyclesLeaveNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("slow")
	}
	d := newDriver(t, t.TempDir())
	// Only this test's processes count: other test packages run sandboxes
	// on this host at the same time.
	tag := fmt.Sprintf("cyc%d-", os.Getpid())
	before := snapshotHost(tag)
	for i := 0; i < 100; i++ {
		spec := &substrate.Spec{ID: fmt.Sprintf("cyc%d-%d", os.Getpid(), i), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 128, Pids: 64, CPU: 1}
		inst, err := d.Create(context.Background(), spec)
		if err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
		if _, err := inst.Guest().Run(context.Background(), (&runExec{"sleep 100 & true"}).exec()); err != nil {
			t.Fatalf("cycle %d exec: %v", i, err)
		}
		if i == 0 {
			if mid := snapshotHost(tag); mid.procs["guest"] == 0 || mid.procs["sleep"] == 0 {
				t.Fatalf("the process count does not see this test's sandbox: %v", mid.procs)
			}
		}
		if err := inst.Destroy(context.Background()); err != nil {
			t.Fatalf("cycle %d destroy: %v", i, err)
		}
		if left := leaks(d, spec); len(left) > 0 {
			t.Fatalf("cycle %d left %v", i, left)
		}
	}
	after := snapshotHost(tag)
	if after.mounts > before.mounts {
		t.Fatalf("after 100 cycles: mounts %d→%d", before.mounts, after.mounts)
	}
	// The sandboxes' file systems go back to the pool or away.
	for deadline := time.Now().Add(10 * time.Second); d.disk.held() > diskPoolMax; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 100 cycles: %d sandbox file systems, the pool keeps at most %d", d.disk.held(), diskPoolMax)
		}
	}
	if n := d.ranges.heldCount(); n > usernsPoolSize {
		t.Errorf("after 100 cycles: %d id ranges held, the pool keeps %d", n, usernsPoolSize)
	}
	for name, n := range after.procs {
		if n > before.procs[name] {
			out, _ := exec.Command("ps", "-eo", "pid,ppid,stat,etime,comm").Output()
			t.Errorf("after 100 cycles: %d more %q processes\n%s", n-before.procs[name], name, out)
		}
	}
	threadsAreRoot(t)
}

type hostCounts struct {
	mounts int
	procs  map[string]int // by command name, for the sandbox side: agents, runtimes, sleeps
}

// snapshotHost counts this process's mounts (but the sandbox file systems
// made ahead, which come and go) and the sandbox-side processes
// (agents, runtimes, sleeps) whose command line or cgroup names tag, the
// prefix of this test's sandbox IDs.
func snapshotHost(tag string) hostCounts {
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	ents, _ := os.ReadDir("/proc")
	procs := map[string]int{}
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		comm, err := os.ReadFile("/proc/" + e.Name() + "/comm")
		if err != nil {
			continue
		}
		if pid, _ := strconv.Atoi(e.Name()); !proc.Of(pid).Alive() {
			continue // exited; waiting for the host's init to reap it
		}
		cmdline, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		cgroup, _ := os.ReadFile("/proc/" + e.Name() + "/cgroup")
		if !strings.Contains(string(cmdline), tag) && !strings.Contains(string(cgroup), tag) {
			continue
		}
		switch name := strings.TrimSpace(string(comm)); name {
		case "guest", "sleep", "crun", "runc", "sh":
			procs[name]++
		}
	}
	mounts := 0
	for _, l := range strings.Split(string(mi), "\n") {
		if l != "" && !strings.Contains(l, "/disks/") {
			mounts++
		}
	}
	return hostCounts{mounts: mounts, procs: procs}
}

// The kernel keeps, for every memory cgroup, a slot for every file
// system's shrinker: a sandbox's file systems and memory cgroups each cost
// memory in proportion to the host's sandboxes (1.3 MiB per sandbox at
// 3,890 sandboxes with 11 and 2), which is what bounds how many a node
// holds. A sandbox makes the file systems its isolation needs (proc, sysfs,
// /dev, devpts, /dev/shm, mqueue, its root's overlay and its disk) and no
// more, and one memory cgroup.
func TestASandboxMakesOnlyTheFileSystemsAndMemoryCgroupsItNeeds(t *testing.T) {
	d := newDriver(t, t.TempDir())
	spec := &substrate.Spec{ID: fmt.Sprintf("fs%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
		MemoryMB: 64, Pids: 64, CPU: 1, DiskMB: 64, Network: substrate.Network{Mode: "none"}}
	// The memory cgroups the sandbox made: new under the parent and named
	// by its ID (its agent's are in its node's agents' cgroup, made once
	// and shared). Other packages' sandboxes come and go under the same
	// parent, and the test may not count theirs.
	dirs := func() map[string]bool {
		out := map[string]bool{}
		filepath.WalkDir(d.cgroups.Dir(d.cfg.CgroupParent, "memory"), func(p string, e fs.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				out[p] = true
			}
			return nil
		})
		return out
	}
	was := dirs()
	memcgs := func() (n int) {
		for p := range dirs() {
			if !was[p] && strings.Contains(p, spec.ID) {
				n++
			}
		}
		return n
	}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	devices := func(mountinfo string) map[string]string {
		b, err := os.ReadFile(mountinfo)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, l := range strings.Split(string(b), "\n") {
			// id parent major:minor root mountpoint ... - type source ...
			if f := strings.Fields(l); len(f) > 8 {
				if _, post, ok := strings.Cut(l, " - "); ok {
					out[f[2]] = strings.Fields(post)[0] + " at " + f[4]
				}
			}
		}
		return out
	}
	host := devices("/proc/self/mountinfo")
	var made []string
	for dev, what := range devices(fmt.Sprintf("/proc/%d/mountinfo", inner(inst).st.Pid)) {
		if _, shared := host[dev]; !shared {
			made = append(made, what)
		}
	}
	sort.Strings(made)
	t.Logf("file systems the sandbox made (its disk is below the overlay): %s", strings.Join(made, ", "))
	// proc, sysfs, tmpfs /dev, devpts, /dev/shm, mqueue, overlay.
	if len(made) > 7 {
		t.Errorf("the sandbox made %d file systems, want at most 7 (no tmpfs per masked directory): %s", len(made), strings.Join(made, ", "))
	}
	if d.shieldable() {
		if n := memcgs(); n > 1 {
			t.Errorf("the sandbox made %d memory cgroups, want 1 (agents share one)", n)
		}
	}
}

// TestAStoppingNodeLeavesAnotherNodesAgentsCgroupsAlone: two nodes on a
// host share the cgroup parent (the tests' servers do); one that stops
// with no sandbox left removed the agents' cgroups the other's next
// agent was about to join ("join the agent's cgroup: write fd5: no such
// device", a CI run's flake).
func TestAStoppingNodeLeavesAnotherNodesAgentsCgroupsAlone(t *testing.T) {
	a := newDriver(t, t.TempDir())
	if !a.shieldable() {
		t.Skipf("agents are shielded on cgroup v1 controllers only; this host has %s", a.cgroups.Mode)
	}
	b, err := New(Config{GuestBinary: guestBin, StateDir: t.TempDir()}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if a.cfg.CgroupParent != b.cfg.CgroupParent || a.agentsCgroup() == b.agentsCgroup() {
		t.Fatalf("parents %q and %q, agents' cgroups %q and %q: want one parent, two agents' cgroups", a.cfg.CgroupParent, b.cfg.CgroupParent, a.agentsCgroup(), b.agentsCgroup())
	}
	b.Close()
	spec := &substrate.Spec{ID: fmt.Sprintf("stop%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 64, Pids: 64, CPU: 1}
	inst, err := a.Create(context.Background(), spec)
	if err != nil {
		t.Fatalf("a create after another node stopped: %v", err)
	}
	inst.Destroy(context.Background())
	for _, c := range []string{"memory", "cpu"} {
		if _, err := os.Stat(b.cgroups.Dir(b.agentsCgroup(), c)); err == nil {
			t.Errorf("the stopped node's agents' %s cgroup is still there", c)
		}
	}
}

func TestTheAgentLivesInItsOwnCgroupsAndChildrenInTheSandboxs(t *testing.T) {
	d := newDriver(t, t.TempDir())
	if !d.shieldable() {
		t.Skipf("agents are shielded on cgroup v1 controllers only; this host has %s", d.cgroups.Mode)
	}
	spec := &substrate.Spec{ID: fmt.Sprintf("cg%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 64, Pids: 64, CPU: 1}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	member := func(cgroupFile, controller string) string {
		b, _ := os.ReadFile(cgroupFile)
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.SplitN(l, ":", 3); len(f) == 3 && slices.Contains(strings.Split(f[1], ","), controller) {
				return f[2]
			}
		}
		return ""
	}
	pid := inner(inst).st.Pid
	for _, c := range shieldedControllers {
		if got, want := member(fmt.Sprintf("/proc/%d/cgroup", pid), c), d.agentCgroup(spec.ID, c); got != want {
			t.Errorf("the agent is in %s cgroup %q, want %q", c, got, want)
		}
	}
	if got := cgroup.ReadInt(filepath.Join(d.cgroups.Dir(d.agentsCgroup(), "cpu"), "cpu.shares")); got != agentsCPUShares {
		t.Errorf("the agents' cpu cgroup weighs %d, want %d", got, agentsCPUShares)
	}
	x, err := inst.Guest().Run(context.Background(), (&runExec{"cat /proc/self/cgroup"}).exec())
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "cgroup")
	os.WriteFile(f, x.Stdout, 0o600)
	for _, c := range []string{"memory", "cpu"} {
		if got, want := member(f, c), d.cgroupPath(spec.ID); got != want {
			t.Errorf("a child is in %s cgroup %q, want the sandbox's %q", c, got, want)
		}
	}
	if got := member(f, "pids"); !strings.HasPrefix(got, d.cgroupPath(spec.ID)+"/exec-") {
		t.Errorf("a child is in pids cgroup %q, want an exec's below the sandbox's", got)
	}
	// Threads the runtime starts later, while execs block their threads,
	// are made in the agent's cgroups too: only the spawner is in the
	// sandbox's.
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inst.Guest().Run(context.Background(), (&runExec{"sleep 0.3"}).exec())
		}()
	}
	wg.Wait()
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	inSandbox := 0
	for _, task := range tasks {
		for _, c := range shieldedControllers {
			if member(fmt.Sprintf("/proc/%d/task/%s/cgroup", pid, task.Name()), c) != d.agentCgroup(spec.ID, c) {
				inSandbox++
			}
		}
	}
	t.Logf("the agent runs %d threads", len(tasks))
	if inSandbox != len(shieldedControllers) {
		t.Errorf("of the agent's %d threads, %d memberships are outside its cgroups, want %d (the spawner's)", len(tasks), inSandbox, len(shieldedControllers))
	}
}

type runExec struct{ cmd string }

func (r *runExec) exec() *guestv1.Exec {
	return &guestv1.Exec{Argv: []string{"sh", "-c", r.cmd}, TimeoutMs: 10000}
}

// BenchmarkCreateExecDestroy times a sandbox's life with and without a
// user namespace and a disk of its own, side by side: each iteration runs
// one life under each configuration in turn, so the host's load weighs on
// all alike, and the p50 of each step is reported per configuration:
//
//	go test -run '^$' -bench CreateExecDestroy -benchtime 200x ./internal/substrate/container/
func BenchmarkCreateExecDestroy(b *testing.B) {
	if setupErr != "" {
		b.Skip(setupErr)
	}
	cases := []struct {
		name  string
		cfg   Config
		d     *Driver
		steps [3][]time.Duration // create, exec, destroy
	}{
		{name: "hostroot", cfg: Config{HostRoot: true, NoDiskLimits: true}},
		{name: "userns", cfg: Config{NoDiskLimits: true}},
		{name: "disk", cfg: Config{HostRoot: true}},
		{name: "userns+disk", cfg: Config{}},
	}
	for i := range cases {
		cfg := cases[i].cfg
		cfg.GuestBinary, cfg.StateDir = guestBin, b.TempDir()
		d, err := New(cfg, slog.New(slog.DiscardHandler))
		if err != nil {
			b.Fatal(err)
		}
		cases[i].d = d
		defer d.Close()
	}
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		for c := range cases {
			bc := &cases[c]
			spec := &substrate.Spec{
				ID: fmt.Sprintf("bench%d-%d-%d", os.Getpid(), c, i), Dir: b.TempDir(), Image: layers, Hostname: "sandbox",
				CPU: 1, MemoryMB: 256, Pids: 256, Network: substrate.Network{Mode: "none"},
			}
			t0 := time.Now()
			inst, err := bc.d.Create(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			if _, err := inst.Guest().Run(ctx, &guestv1.Exec{Argv: []string{"true"}}); err != nil {
				b.Fatal(err)
			}
			t2 := time.Now()
			if err := inst.Destroy(ctx); err != nil {
				b.Fatal(err)
			}
			bc.steps[0] = append(bc.steps[0], t1.Sub(t0))
			bc.steps[1] = append(bc.steps[1], t2.Sub(t1))
			bc.steps[2] = append(bc.steps[2], time.Since(t2))
		}
	}
	p50 := func(d []time.Duration) float64 {
		d = append([]time.Duration(nil), d...)
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return float64(d[len(d)/2].Microseconds())
	}
	for _, bc := range cases {
		b.ReportMetric(p50(bc.steps[0]), bc.name+"-create-p50-µs")
		b.ReportMetric(p50(bc.steps[2]), bc.name+"-destroy-p50-µs")
	}
}

func TestSandboxRootIsAnUnprivilegedHostUserWithItsOwnDisk(t *testing.T) {
	d := newDriver(t, t.TempDir())
	spec := &substrate.Spec{ID: fmt.Sprintf("uns%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
		MemoryMB: 256, Pids: 256, CPU: 1, DiskMB: 64, Network: substrate.Network{Mode: "none"}}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	st := inner(inst).st
	run := func(script string) *guestv1.Exit {
		t.Helper()
		x, err := inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"/bin/sh", "-c", script}, TimeoutMs: 30000})
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	t.Run("root inside maps to the sandbox's range", func(t *testing.T) {
		x := run("cat /proc/self/uid_map; id -u; touch /made-by-root; ls -ln / | grep -c ' 0 *0 '")
		f := strings.Fields(string(x.Stdout))
		if len(f) < 5 || f[0] != "0" || f[1] != strconv.Itoa(int(st.HostID)) || f[2] != "65536" || f[3] != "0" {
			t.Fatalf("uid_map and id: %q %s", x.Stdout, x.Stderr)
		}
		if n, _ := strconv.Atoi(f[4]); n < 5 {
			t.Errorf("the image's root-owned files do not look root-owned inside: %q", x.Stdout)
		}
		var fi syscall.Stat_t
		if err := syscall.Stat(filepath.Join(st.upper(), "made-by-root"), &fi); err != nil {
			t.Fatal(err)
		}
		if fi.Uid != st.HostID || fi.Uid < defaultIDBase {
			t.Errorf("a file root made inside is owned by host uid %d, want %d", fi.Uid, st.HostID)
		}
	})
	t.Run("the bind-mounted /etc files are root's inside", func(t *testing.T) {
		if x := run("echo 10.0.0.9 extra >> /etc/hosts && grep -c extra /etc/hosts"); x.ExitCode != 0 {
			t.Errorf("root cannot write /etc/hosts: %s", x.Stderr)
		}
	})
	t.Run("df shows the sandbox's disk and writes stop at it", func(t *testing.T) {
		x := run("df -k / | tail -1")
		f := strings.Fields(string(x.Stdout))
		if len(f) < 2 {
			t.Fatalf("df: %q %s", x.Stdout, x.Stderr)
		}
		if kb, _ := strconv.Atoi(f[1]); kb > 64<<10 || kb < 32<<10 {
			t.Errorf("df / says %d KiB, want about 64 MiB", kb)
		}
		x = run("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; echo rc=$?")
		if !strings.Contains(string(x.Stdout), "No space left") {
			t.Errorf("filling the disk: %q", x.Stdout)
		}
		s, _ := inst.Stats(context.Background())
		if s.DiskLimitBytes != 64<<20 || s.DiskBytes < 32<<20 {
			t.Errorf("stats: disk %d of %d", s.DiskBytes, s.DiskLimitBytes)
		}
	})
}

func TestARestartedNodeRemountsTheDiskAndSnapshotsShiftOwners(t *testing.T) {
	state := t.TempDir()
	d := newDriver(t, state)
	if d.disk == nil || d.userns == nil {
		t.Skip("needs user namespaces and disk limits")
	}
	spec := &substrate.Spec{ID: fmt.Sprintf("re%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
		MemoryMB: 256, Pids: 256, CPU: 1, DiskMB: 32, Network: substrate.Network{Mode: "none"}}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	if x, err := inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"/bin/sh", "-c",
		"echo root > /by-root && echo user > /by-user && chown 1000:1000 /by-user && setcap cap_net_raw+ep /by-root 2>/dev/null; true"}}); err != nil || x.ExitCode != 0 {
		t.Fatalf("write files: %v %v", err, x)
	}
	// A node restarted in a new mount namespace no longer has the
	// sandbox's file system mounted.
	st := inner(inst).st
	if err := unix.Unmount(st.Disk.dir, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	d2 := newDriver(t, state)
	inst2, err := d2.Attach(context.Background(), spec, inst.State())
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := inner(inst2).Snapshot(context.Background(), &buf); err != nil {
		t.Fatalf("snapshot after the restart: %v", err)
	}
	owners := map[string][2]int{}
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		owners[h.Name] = [2]int{h.Uid, h.Gid}
	}
	for name, want := range map[string][2]int{"by-root": {0, 0}, "by-user": {1000, 1000}} {
		if got, ok := owners[name]; !ok || got != want {
			t.Errorf("%s in the snapshot: owner %v (found %v), want %v as the sandbox saw it", name, got, ok, want)
		}
	}
	x, err := inst2.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"/bin/sh", "-c", "df -k / | tail -1"}})
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(string(x.Stdout)); len(f) < 2 {
		t.Errorf("df / after the restart: %q", x.Stdout)
	} else if kb, _ := strconv.Atoi(f[1]); kb > 32<<10 || kb < 16<<10 {
		t.Errorf("df / after the restart says %d KiB, want the sandbox's 32 MiB", kb)
	}
	if s, _ := inst2.Stats(context.Background()); s.DiskLimitBytes != 32<<20 {
		t.Errorf("the adopted sandbox's disk limit: %d", s.DiskLimitBytes)
	}
	if err := inst2.Destroy(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestAStateOfANewerNodeIsNotAdopted(t *testing.T) {
	d := newDriver(t, t.TempDir())
	s := &substrate.Spec{ID: "sb-newer", Dir: t.TempDir()}
	_, err := d.Attach(context.Background(), s, []byte(`{"version": 99, "pid": 1, "start_time": 1}`))
	if err == nil || errdefs.Is(err, errdefs.KindGone) || !strings.Contains(err.Error(), "version 99") {
		t.Fatalf("adopting a state of version 99: %v; want a refusal naming the version, not gone (the sandbox may live)", err)
	}
}

// BenchmarkRuntimes times a sandbox's life under crun and under gVisor
// side by side, from one driver (user namespace and disk on, the
// defaults): each iteration runs one life per runtime in turn, so the
// host's load weighs on both alike. A life is a create, execExecs
// exec(true) round trips and a destroy; p50s are reported per runtime:
//
//	go test -run '^$' -bench Runtimes -benchtime 40x ./internal/substrate/container/
func BenchmarkRuntimes(b *testing.B) {
	if setupErr != "" {
		b.Skip(setupErr)
	}
	const execExecs = 20
	d, err := New(Config{GuestBinary: guestBin, StateDir: b.TempDir()}, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	if d.gvisor == nil {
		b.Skipf("no gvisor runtime: %s", d.gvisorReason)
	}
	runtimes := []struct {
		name, runtime string
		steps         [3][]time.Duration // create, exec, destroy
	}{{name: "crun"}, {name: "gvisor", runtime: substrate.RuntimeGVisor}}
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		for r := range runtimes {
			rt := &runtimes[r]
			spec := &substrate.Spec{
				ID: fmt.Sprintf("rt%d-%d-%d", os.Getpid(), r, i), Dir: b.TempDir(), Image: layers, Hostname: "sandbox",
				CPU: 1, MemoryMB: 256, Pids: 256, Network: substrate.Network{Mode: "none"}, Runtime: rt.runtime,
			}
			t0 := time.Now()
			inst, err := d.Create(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			rt.steps[0] = append(rt.steps[0], time.Since(t0))
			for range execExecs {
				t1 := time.Now()
				if _, err := inst.Guest().Run(ctx, &guestv1.Exec{Argv: []string{"true"}}); err != nil {
					b.Fatal(err)
				}
				rt.steps[1] = append(rt.steps[1], time.Since(t1))
			}
			t2 := time.Now()
			if err := inst.Destroy(ctx); err != nil {
				b.Fatal(err)
			}
			rt.steps[2] = append(rt.steps[2], time.Since(t2))
		}
	}
	p50 := func(d []time.Duration) float64 {
		d = append([]time.Duration(nil), d...)
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return float64(d[len(d)/2].Microseconds())
	}
	for _, rt := range runtimes {
		b.ReportMetric(p50(rt.steps[0]), rt.name+"-create-p50-µs")
		b.ReportMetric(p50(rt.steps[1]), rt.name+"-exec-p50-µs")
		b.ReportMetric(p50(rt.steps[2]), rt.name+"-destroy-p50-µs")
	}
}

// threadsAreRoot fails unless every thread of the test process (the node,
// here) has root's user IDs: making a user namespace as a sandbox's host
// user must leave no thread with that user's IDs (a thread Go cannot end,
// the main one, would keep them, and ps would show the node as that user).
func threadsAreRoot(t *testing.T) {
	t.Helper()
	tasks, _ := filepath.Glob("/proc/self/task/*/status")
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // the thread ended
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "Uid:") && strings.Join(strings.Fields(line)[1:], " ") != "0 0 0 0" {
				t.Errorf("%s: %s", f, line)
			}
		}
	}
}

// TestAGVisorSandboxIsHeldToItsLimits reads back, from the host, the cgroup
// files of a gVisor sandbox (runsc does not write them: the node does) and
// checks that runsc's sandbox process is in those cgroups.
func TestAGVisorSandboxIsHeldToItsLimits(t *testing.T) {
	d := newDriver(t, t.TempDir())
	needGVisor(t, d)
	spec := &substrate.Spec{ID: fmt.Sprintf("gvl%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
		CPU: 0.5, MemoryMB: 64, Pids: 64, Network: substrate.Network{Mode: "none"}, Runtime: substrate.RuntimeGVisor}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	files := map[string]map[string]string{ // controller -> file -> value
		"memory": {"memory.limit_in_bytes": strconv.Itoa(64 << 20)},
		"cpu":    {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "50000", "cpu.shares": "512"},
		"pids":   {"pids.max": strconv.Itoa(64*gvisorTasksPerProcess + gvisorBaseTasks)},
	}
	if d.cgroups.Mode == cgroup.V2 {
		files = map[string]map[string]string{"": {"memory.max": strconv.Itoa(64 << 20), "cpu.max": "50000 100000",
			"cpu.weight": "20", "pids.max": strconv.Itoa(64*gvisorTasksPerProcess + gvisorBaseTasks)}}
	}
	// runsc's sandbox process (its Sentry, argv[0] "runsc-sandbox"), a
	// child of the `runsc run` the node started.
	sentry := 0
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if strings.HasPrefix(string(cmdline), "runsc-sandbox\x00") && strings.Contains(string(cmdline), spec.ID) {
			sentry = pid
		}
	}
	if sentry == 0 {
		t.Fatal("no runsc-sandbox process for the sandbox")
	}
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sentry))
	if err != nil {
		t.Fatal(err)
	}
	for ctrl, want := range files {
		dir := d.cgroups.Dir(d.cgroupPath(spec.ID), ctrl)
		for file, value := range want {
			b, err := os.ReadFile(filepath.Join(dir, file))
			if err != nil {
				t.Errorf("%s: %v", file, err)
			} else if got := strings.TrimSpace(string(b)); got != value {
				t.Errorf("%s holds %q, want %q", file, got, value)
			}
		}
		member := false
		for _, l := range strings.Split(string(cg), "\n") {
			f := strings.SplitN(l, ":", 3)
			if len(f) == 3 && slices.Contains(strings.Split(f[1], ","), ctrl) && f[2] == d.cgroupPath(spec.ID) {
				member = true
			}
		}
		if !member {
			t.Errorf("runsc's sandbox process %d is not in the sandbox's %q cgroup %s:\n%s", sentry, ctrl, d.cgroupPath(spec.ID), cg)
		}
	}
}

// TestAFailedAttachUndoesWhatItDid: an attach that fails half way (its
// second layer or volume is missing) returns the error, leaves nothing
// mounted, and does not panic (a named result set to nil by the error
// return was once the deferred cleanup).
func TestAFailedAttachUndoesWhatItDid(t *testing.T) {
	good := t.TempDir()
	missing := filepath.Join(t.TempDir(), "gone")
	for name, attach := range map[string]func(dir string) (func(), error){
		"layers": func(dir string) (func(), error) { return attachLayers(dir, []string{good, missing}, nil) },
		"volumes": func(dir string) (func(), error) {
			return attachVolumes(dir, []substrate.VolumeMount{{Source: good, Path: "/a"}, {Source: missing, Path: "/b"}}, nil)
		},
	} {
		dir := t.TempDir()
		detach, err := attach(dir)
		if err == nil {
			detach()
			t.Fatalf("%s: attaching a missing source succeeded", name)
		}
		mi, _ := os.ReadFile("/proc/self/mountinfo")
		if strings.Contains(string(mi), dir) {
			t.Errorf("%s: a failed attach left a mount under %s", name, dir)
		}
	}
}

// TestACreateWhoseCallerGoesAwayAnswersCanceledAndLeavesNothing: a create
// whose caller's context ends part way (a trainer SIGKILLed while its
// fork's children start) answers canceled, not the agent's start timeout,
// and leaves no mount, cgroup, runtime state or socket; or, if it was
// done first, it made a working sandbox.
func TestACreateWhoseCallerGoesAwayAnswersCanceledAndLeavesNothing(t *testing.T) {
	d := newDriver(t, t.TempDir())
	for i, after := range []time.Duration{0, 10 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond, 500 * time.Millisecond, 800 * time.Millisecond} {
		spec := &substrate.Spec{ID: fmt.Sprintf("gone%d-%d", os.Getpid(), i), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 128, Pids: 64, CPU: 1}
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(after, cancel)
		inst, err := d.Create(ctx, spec)
		cancel()
		if err == nil {
			if err := inst.Destroy(context.Background()); err != nil {
				t.Fatalf("cancel after %v: destroy: %v", after, err)
			}
		} else if k := errdefs.KindOf(err); k != errdefs.KindCanceled {
			t.Errorf("cancel after %v: %v (%s), want canceled", after, err, k)
		}
		if left := leaks(d, spec); len(left) > 0 {
			t.Errorf("cancel after %v: left %v", after, left)
		}
	}
}

// TestACreateGivenUpBeforeTheRuntimeRecordedItsContainerEnds: on a loaded
// host the runtime can take longer to record a container than the caller
// waits. A delete sent then finds nothing and the runtime goes on to start
// the container; the abandoned create must still end (it used to wait for
// that runtime for ever, holding its idempotency key: a replica killed
// during a burst left retried creates unanswered) and leave nothing. The
// runtime here is crun behind a wrapper that waits before running it.
func TestACreateGivenUpBeforeTheRuntimeRecordedItsContainerEnds(t *testing.T) {
	if setupErr != "" {
		t.Skip(setupErr)
	}
	crun, err := exec.LookPath("crun")
	if err != nil {
		t.Fatal("needs crun (apt-get install crun)")
	}
	slow := filepath.Join(t.TempDir(), "crun-slow-start")
	script := "#!/bin/sh\ncase \" $* \" in *\" run \"*) sleep 1 ;; esac\nexec " + crun + " \"$@\"\n"
	if err := os.WriteFile(slow, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	// As the host's root the late runtime starts the container; in a user
	// namespace it finds the namespace gone and fails: both must end.
	for _, hostRoot := range []bool{true, false} {
		t.Run(fmt.Sprintf("host root %v", hostRoot), func(t *testing.T) {
			d, err := New(Config{GuestBinary: guestBin, StateDir: t.TempDir(), Runtime: slow, HostRoot: hostRoot}, slog.Default())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(d.Close)
			spec := &substrate.Spec{ID: fmt.Sprintf("slow%d-%v", os.Getpid(), hostRoot), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 128, Pids: 64, CPU: 1}
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(200*time.Millisecond, cancel) // while the wrapper waits
			done := make(chan error, 1)
			go func() {
				inst, err := d.Create(ctx, spec)
				if err == nil {
					inst.Destroy(context.Background())
				}
				done <- err
			}()
			select {
			case err := <-done:
				if k := errdefs.KindOf(err); k != errdefs.KindCanceled {
					t.Errorf("create: %v (%s), want canceled", err, k)
				}
			case <-time.After(45 * time.Second):
				t.Fatal("the create whose caller went away did not end within 45 s: it waits for a runtime that started the container after the delete")
			}
			if left := leaks(d, spec); len(left) > 0 {
				t.Errorf("left %v", left)
			}
		})
	}
}
