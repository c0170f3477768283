package agent

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Spawner forks every process the agent starts from one OS thread that
// lives in the sandbox's cgroups, while the rest of the agent lives in
// cgroups of its own, out of the sandbox's reach (cgroup v1, where
// membership is per thread and a child is born in the cgroups of the
// thread that forked it).
//
// The node creates the agent's cgroups (memory and pids, beside the
// sandbox's) and hands the agent, as inherited descriptors it opened
// itself (cgroup v1 checks the opener's credentials), their cgroup.procs
// files and the sandbox's tasks files. Shield moves the whole agent into
// its own cgroups, then moves the spawner thread, and only it, back into
// the sandbox's. So:
//   - what the agent allocates is charged to its own memory cgroup: a
//     sandbox that fills its memory limit (a fork bomb's kernel memory, a
//     memory bomb of many small processes) is OOM-killed process by
//     process, and the agent is never a candidate: the memory cgroup's OOM
//     killer considers processes by their leader thread, which stays in
//     the agent's cgroup;
//   - the agent's threads count against its own pids cgroup, so a sandbox
//     whose pids are all taken cannot stop the runtime starting a thread
//     (new threads are made by threads in the agent's cgroup: the runtime
//     makes them from its template thread when the asking one is locked);
//   - every child is born in the sandbox's cgroups, and counted, limited
//     and killed there.
//
// With the sandbox's pids cgroup directory, each exec also gets a pids
// cgroup of its own below the sandbox's (the spawner thread steps into it
// for the fork): at a timeout every process the exec started, in its
// process group or not, is found and killed there.
//
// A nil *Spawner forks from whichever thread asks, with no cgroups: the
// agent in a VM, where the whole guest kernel is the sandbox's.
//
// A spawner from IsolatePIDs (gVisor) has no cgroups either: it starts
// processes in the workloads' pid namespace instead.
type Spawner struct {
	pids *pidSpace // set by IsolatePIDs: every process starts there
	reqs chan func()
	home []*os.File // tasks files of the sandbox's cgroups
	// execDir is the sandbox's pids cgroup directory (nil: no per-exec
	// cgroups); pidsHome is its tasks file, among home.
	execDir  *os.File
	pidsHome *os.File
	seq      atomic.Uint64

	mu        sync.Mutex
	pending   []string // exec cgroups still holding processes when their exec ended
	lastSweep time.Time
}

// Shield moves the agent into the cgroups whose cgroup.procs files are
// join, starts the spawner thread and moves it into the cgroups whose
// tasks files are home. pidsDir, if set, is the sandbox's pids cgroup
// directory, where per-exec cgroups are made; pidsHome must then be its
// tasks file (one of home). Call it early, before anything locks an OS
// thread (so the runtime's template thread is made inside the agent's
// cgroups). On error nothing has been moved unless the error says so.
func Shield(join, home []*os.File, pidsDir, pidsHome *os.File) (*Spawner, error) {
	for _, f := range join {
		if err := writeCgroup(f, "0"); err != nil {
			return nil, fmt.Errorf("join the agent's cgroup: %w", err)
		}
	}
	sp := &Spawner{reqs: make(chan func()), home: home, execDir: pidsDir, pidsHome: pidsHome}
	ready := make(chan error, 1)
	var serve func()
	serve = func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// The leader thread is the one the OOM killer looks at: it
			// stays in the agent's cgroups. This goroutine keeps it, so
			// the next one gets another thread.
			go serve()
			select {}
		}
		for _, f := range home {
			if err := writeCgroup(f, "0"); err != nil {
				ready <- fmt.Errorf("move the spawner thread into the sandbox's cgroup (the agent is in its own already): %w", err)
				// Unlocked goroutines never run on a thread left locked
				// and exiting: the runtime ends the thread with it.
				return
			}
		}
		ready <- nil
		for fn := range sp.reqs {
			fn()
		}
	}
	go serve()
	if err := <-ready; err != nil {
		return nil, err
	}
	return sp, nil
}

func writeCgroup(f *os.File, v string) error {
	_, err := f.WriteAt([]byte(v), 0)
	if errors.Is(err, syscall.ESPIPE) {
		_, err = f.Write([]byte(v))
	}
	return err
}

// execCgroup is the pids cgroup of one exec, below the sandbox's.
type execCgroup struct {
	sp   *Spawner
	name string

	mu     sync.Mutex
	killed bool
	hits   int // fork failures before the kill (which refuses every fork)
}

// forkExec starts a process from the spawner thread, in an exec cgroup of
// its own when perExec (and the spawner has a pids cgroup directory). It
// returns the cgroup (nil without one).
func (sp *Spawner) forkExec(path string, argv []string, attr *syscall.ProcAttr, perExec bool) (int, *execCgroup, error) {
	if sp == nil {
		pid, err := syscall.ForkExec(path, argv, attr)
		return pid, nil, err
	}
	if sp.pids != nil {
		pid, err := sp.pids.forkExec(path, argv, attr)
		return pid, nil, err
	}
	var cg *execCgroup
	if perExec && sp.execDir != nil {
		sp.sweep()
		name := "exec-" + strconv.FormatUint(sp.seq.Add(1), 10)
		if err := unix.Mkdirat(int(sp.execDir.Fd()), name, 0o755); err == nil {
			cg = &execCgroup{sp: sp, name: name}
		}
	}
	var pid int
	var err error
	done := make(chan struct{})
	sp.reqs <- func() {
		defer close(done)
		if cg != nil {
			// Step into the exec's cgroup for the fork only: the child is
			// born there; the thread goes home right after.
			if err := cg.write("tasks", "0"); err != nil {
				cg.remove()
				cg = nil
			}
		}
		pid, err = syscall.ForkExec(path, argv, attr)
		if cg != nil {
			if herr := writeCgroup(sp.pidsHome, "0"); herr != nil {
				// The thread is stuck in this exec's cgroup: later children
				// would be killed with it. Only a broken cgroup fs does this.
				panic("dsec-guest: spawner thread cannot leave an exec cgroup: " + herr.Error())
			}
		}
	}
	<-done
	if err != nil && cg != nil {
		cg.remove()
		cg = nil
	}
	return pid, cg, err
}

func (cg *execCgroup) write(file, v string) error {
	fd, err := unix.Openat(int(cg.sp.execDir.Fd()), cg.name+"/"+file, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(v))
	return err
}

// limitHits counts forks in the exec's cgroup that the sandbox's pids
// limit refused (those the kill refused are not counted).
func (cg *execCgroup) limitHits() int {
	cg.mu.Lock()
	defer cg.mu.Unlock()
	if cg.killed {
		return cg.hits
	}
	return cg.forkFailures()
}

// forkFailures counts forks in the exec's cgroup that a pids limit (its
// own or the sandbox's) refused.
func (cg *execCgroup) forkFailures() int {
	fd, err := unix.Openat(int(cg.sp.execDir.Fd()), cg.name+"/pids.events", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	f := os.NewFile(uintptr(fd), "pids.events")
	defer f.Close()
	b, _ := readAll(f)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "max "); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

func (cg *execCgroup) pids() []int {
	fd, err := unix.Openat(int(cg.sp.execDir.Fd()), cg.name+"/cgroup.procs", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	f := os.NewFile(uintptr(fd), "cgroup.procs")
	defer f.Close()
	b, _ := readAll(f)
	var out []int
	for _, l := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(l); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

func readAll(f *os.File) ([]byte, error) {
	var out []byte
	buf := make([]byte, 4096)
	for {
		n, err := f.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil || n == 0 {
			return out, nil
		}
	}
}

// kill kills every process in the exec's cgroup, whatever its session or
// process group: forks are refused first (pids.max 0), so nothing can
// outrun the kill, then every member is killed until none is left (a fork
// under way when the limit dropped can still add one).
func (cg *execCgroup) kill() {
	cg.mu.Lock()
	if !cg.killed {
		cg.hits, cg.killed = cg.forkFailures(), true
	}
	cg.mu.Unlock()
	cg.write("pids.max", "0")
	for i := 0; i < 50; i++ {
		pids := cg.pids()
		live := 0
		for _, pid := range pids {
			if !isZombie(pid) {
				live++
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		if live == 0 {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(procPath(strconv.Itoa(pid) + "/stat"))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(b), ')')
	return i >= 0 && i+2 < len(b) && b[i+2] == 'Z'
}

// remove removes the exec's cgroup, now or, while processes it started
// still run (a background server), once they are gone.
func (cg *execCgroup) remove() {
	if unix.Unlinkat(int(cg.sp.execDir.Fd()), cg.name, unix.AT_REMOVEDIR) == nil {
		return
	}
	cg.sp.mu.Lock()
	cg.sp.pending = append(cg.sp.pending, cg.name)
	cg.sp.mu.Unlock()
}

// sweep removes exec cgroups whose last process has gone, at most once a
// second (each holds a live process, so there are at most as many as the
// sandbox's pids limit).
func (sp *Spawner) sweep() {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if len(sp.pending) == 0 || time.Since(sp.lastSweep) < time.Second {
		return
	}
	sp.lastSweep = time.Now()
	kept := sp.pending[:0]
	for _, name := range sp.pending {
		if unix.Unlinkat(int(sp.execDir.Fd()), name, unix.AT_REMOVEDIR) != nil {
			kept = append(kept, name)
		}
	}
	sp.pending = kept
}

// reaped tells the spawner that the agent reaped pid (a workloads' init or
// forker, perhaps).
func (sp *Spawner) reaped(pid int) {
	if sp != nil && sp.pids != nil {
		sp.pids.reaped(pid)
	}
}

// exitsTo makes the spawner report the exits of processes it reaps itself
// (the workloads' forker's children) to exited.
func (sp *Spawner) exitsTo(exited func(exitStatus)) {
	if sp != nil && sp.pids != nil {
		sp.pids.mu.Lock()
		sp.pids.exited = exited
		sp.pids.mu.Unlock()
		// The first namespace is made now, not on the first exec's path.
		go sp.pids.current()
	}
}
