package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PIDNamespaceInitArg is the agent's first argument when it runs as the
// init of a workloads' pid namespace (see IsolatePIDs).
const PIDNamespaceInitArg = "pidns-init"

// IsolatePIDs returns a spawner that starts every process (execs, PTYs,
// runners) in a pid namespace of the workloads', never the agent's. It is
// for gVisor, whose kernel neither shields a pid namespace's init from its
// namespace nor checks ptrace access on /proc/<pid>/fd: there any process
// that can name the agent can stop it (kill -STOP 1) or open its
// descriptors and write into the pipes that carry other commands' output.
//
// The layout, per namespace:
//   - the forker (forker/forker.c, embedded, run from a memory file): a
//     child of the agent in the agent's namespace, started with
//     unshare(CLONE_NEWPID) done before its exec, so that its children land
//     in a new namespace. gVisor refuses that unshare to a multi-threaded
//     process (it makes it imply CLONE_THREAD) and refuses new threads to a
//     process that did it, so the forker is single-threaded C, not Go;
//   - its first child, the init (the agent's binary, PIDNamespaceInitArg):
//     PID 1 of the new namespace, it replaces the procfs at /proc by one of
//     that namespace, gives up its capabilities and only reaps orphans;
//   - then every process the agent asks the forker for (over a socket, its
//     descriptors passed along), in the workloads' namespace. This gVisor
//     ignores CLONE_PARENT, so they are the forker's children: it reaps
//     them and sends each exit to the agent, which takes it as its own
//     reaper's (Spawner.exitsTo). The pid it answers is the agent's view:
//     the agent signals the process and reports it by that pid, as before.
//
// So in a workload's /proc, PID 1 is the init (descriptors /dev/null) and
// neither the agent nor the forker has a pid a workload can name. The
// forker drops CAP_SYS_ADMIN from its bounding set once the init runs: the
// agent holds it (to make namespaces), the workloads do not, so none can
// unmount /proc (the agent's procfs is detached below it anyway).
//
// There is one mount namespace (gVisor's unshare here makes no other), so
// the workloads' /proc is the agent's /proc too: IsolatePIDs makes the
// agent's working directory its own procfs, which it reads by relative
// paths from then on (procPath). Call it before anything reads /proc, and
// start every process with a directory.
//
// A workload can stop or kill the init: that harms the workloads alone.
// Before each start the agent resumes a stopped init; when the init died
// (the kernel killed its namespace's processes with it) the processes
// started from then on get a new namespace.
//
// The agent must be root with CAP_SYS_ADMIN, and allowed unshare of
// CLONE_NEWPID, mount and umount2 by its seccomp profile.
func IsolatePIDs() (*Spawner, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find the agent's binary for the workloads' init: %w", err)
	}
	if err := unix.Chdir("/proc"); err != nil {
		return nil, fmt.Errorf("keep the agent's procfs: %w", err)
	}
	procIsolated = true
	return &Spawner{pids: &pidSpace{exe: exe}}, nil
}

// procIsolated is set when /proc is the workloads' procfs and the agent's
// own is its working directory (IsolatePIDs).
var procIsolated bool

// procPath is the path of rel ("self/fd/3", "42/stat") in the agent's
// procfs.
func procPath(rel string) string {
	if procIsolated {
		return rel
	}
	return "/proc/" + rel
}

// pidSpace is the workloads' current pid namespace and how to make the
// next.
type pidSpace struct {
	exe    string
	exited func(exitStatus) // the agent's reaper's: the forker's children exit to it
	mu     sync.Mutex       // held while a namespace is checked or made
	ns     atomic.Pointer[pidNS]
}

// pidNS is one pid namespace of workloads: its forker and init.
type pidNS struct {
	forker, init int // pids in the agent's namespace
	dead         atomic.Bool

	mu      sync.Mutex // one request at a time
	fd      int        // the agent's end of the forker's socket
	replies chan forkAnswer
}

// forkAnswer is the forker's answer to a request.
type forkAnswer struct {
	pid int
	err error
}

// forkExec starts a process in the workloads' current namespace. If the
// namespace dies under the fork, it tries once more in a new one.
func (ps *pidSpace) forkExec(path string, argv []string, attr *syscall.ProcAttr) (int, error) {
	for attempt := 0; ; attempt++ {
		ns, err := ps.current()
		if err != nil {
			return 0, err
		}
		pid, err := ns.forkExec(path, argv, attr)
		if err == nil || attempt > 0 {
			return pid, err
		}
		if errors.Is(err, syscall.ENOMEM) {
			// A fork into a namespace whose init is exiting fails with
			// ENOMEM (pid_namespaces(7); gVisor's allocateTID too). The
			// init still looks alive until it is a zombie and the forker
			// reaped it: a command started right after the one that
			// killed it lands in that window.
			ns.awaitDeath(exitingInit)
		}
		if ns.alive() {
			return pid, err
		}
	}
}

// exitingInit is how long a fork that failed with ENOMEM waits for the
// namespace's init to be seen dead before the error stands (a real
// shortage of memory).
const exitingInit = 2 * time.Second

// awaitDeath waits up to d for the namespace to be seen dead.
func (ns *pidNS) awaitDeath(d time.Duration) {
	for deadline := time.Now().Add(d); ns.alive() && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
}

// reaped tells the space that the agent reaped pid.
func (ps *pidSpace) reaped(pid int) {
	if ns := ps.ns.Load(); ns != nil && (ns.init == pid || ns.forker == pid) {
		ns.dead.Store(true)
	}
}

// current returns the namespace to start processes in: the last one,
// resumed if its init was stopped, or a new one if it died.
func (ps *pidSpace) current() (*pidNS, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ns := ps.ns.Load(); ns != nil {
		if !ns.alive() {
			ns.close()
			ps.ns.Store(nil)
		} else {
			if st := procState(ns.init); st == 'T' || st == 't' {
				// A workload stopped it (kill -STOP 1): orphans wait to be
				// reaped until it runs again.
				syscall.Kill(ns.init, syscall.SIGCONT)
			}
			return ns, nil
		}
	}
	ns, err := newPIDNS(ps.exe, ps.exited)
	if err != nil {
		return nil, err
	}
	ps.ns.Store(ns)
	return ns, nil
}

func (ns *pidNS) alive() bool {
	if ns.dead.Load() {
		return false
	}
	for _, pid := range []int{ns.init, ns.forker} {
		if st := procState(pid); st == 0 || st == 'Z' || st == 'X' {
			return false
		}
	}
	return true
}

// close ends the forker (the init, if alive, keeps the namespace's
// processes).
func (ns *pidNS) close() {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	syscall.Kill(ns.forker, syscall.SIGKILL)
	if ns.fd >= 0 {
		unix.Close(ns.fd)
		ns.fd = -1
	}
}

// newPIDNS starts a forker and waits until its init has mounted the
// namespace's /proc.
func newPIDNS(exe string, exited func(exitStatus)) (*pidNS, error) {
	bin, err := forkerFile()
	if err != nil {
		return nil, err
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	null, err := unix.Open(os.DevNull, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, err
	}
	// The binary by a path relative to the agent's working directory, its
	// procfs (no Dir: the child does not leave it before the exec).
	pid, err := syscall.ForkExec(procPath("self/fd/"+strconv.Itoa(bin)), []string{"dsec-forker", exe}, &syscall.ProcAttr{
		Env:   []string{},
		Files: []uintptr{uintptr(null), uintptr(null), uintptr(null), uintptr(fds[1])},
		Sys:   &syscall.SysProcAttr{Setsid: true, Unshareflags: unix.CLONE_NEWPID},
	})
	unix.Close(null)
	unix.Close(fds[1])
	if err != nil {
		unix.Close(fds[0])
		return nil, fmt.Errorf("start the workloads' forker (the agent needs CAP_SYS_ADMIN and unshare in its seccomp profile): %w", err)
	}
	ns := &pidNS{forker: pid, fd: fds[0]}
	init, err := ns.read(30 * time.Second)
	if err != nil {
		ns.close()
		return nil, fmt.Errorf("the workloads' pid namespace: %w", err)
	}
	ns.init = init
	ns.replies = make(chan forkAnswer, 1)
	go ns.readAll(exited)
	return ns, nil
}

var forker struct {
	once sync.Once
	fd   int
	err  error
}

// forkerFile is a memory file holding the forker's binary (forker/forker.c):
// nothing in the sandbox can change it.
func forkerFile() (int, error) {
	forker.once.Do(func() {
		if len(forkerBinary) == 0 {
			forker.err = fmt.Errorf("no workloads' forker for %s", runtime.GOARCH)
			return
		}
		fd, err := unix.MemfdCreate("dsec-forker", unix.MFD_CLOEXEC)
		if err != nil {
			forker.err = fmt.Errorf("a memory file for the workloads' forker: %w", err)
			return
		}
		if _, err := unix.Write(fd, forkerBinary); err != nil {
			unix.Close(fd)
			forker.err = fmt.Errorf("write the workloads' forker: %w", err)
			return
		}
		forker.fd = fd
	})
	return forker.fd, forker.err
}

// Bits of a request's flags (forker.c).
const (
	forkSetsid = 1 << iota
	forkSetpgid
	forkSetctty
	forkCred
)

// forkExec asks the forker to start a process: a header, the groups, then
// NUL-terminated path, dir, argv and env; attr.Files passed alongside.
func (ns *pidNS) forkExec(path string, argv []string, attr *syscall.ProcAttr) (int, error) {
	if len(argv) == 0 || len(attr.Files) > 16 {
		return 0, syscall.EINVAL
	}
	var flags, uid, gid, ctty int32
	var groups []uint32
	if s := attr.Sys; s != nil {
		if s.Setsid {
			flags |= forkSetsid
		}
		if s.Setpgid {
			flags |= forkSetpgid
		}
		if s.Setctty {
			flags |= forkSetctty
			ctty = int32(s.Ctty)
		}
		if c := s.Credential; c != nil {
			flags |= forkCred
			uid, gid, groups = int32(c.Uid), int32(c.Gid), c.Groups
		}
	}
	var b []byte
	for _, v := range []int32{flags, uid, gid, int32(len(groups)), ctty, int32(len(argv)), int32(len(attr.Env))} {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	for _, g := range groups {
		b = binary.LittleEndian.AppendUint32(b, g)
	}
	for _, s := range append(append([]string{path, attr.Dir}, argv...), attr.Env...) {
		if strings.IndexByte(s, 0) >= 0 {
			return 0, syscall.EINVAL
		}
		b = append(append(b, s...), 0)
	}
	if len(b) > 1<<18 {
		return 0, syscall.E2BIG
	}
	fds := make([]int, len(attr.Files))
	for i, f := range attr.Files {
		fds[i] = int(f)
	}
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if ns.fd < 0 {
		return 0, errors.New("the workloads' forker is gone")
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(ns.fd, b, oob, nil, 0); err != nil {
		return 0, fmt.Errorf("ask the workloads' forker: %w", err)
	}
	a, ok := <-ns.replies
	if !ok {
		return 0, errors.New("the workloads' forker exited")
	}
	return a.pid, a.err
}

// read reads the forker's first answer, the init's pid, waiting at most
// timeout.
func (ns *pidNS) read(timeout time.Duration) (int, error) {
	pfd := []unix.PollFd{{Fd: int32(ns.fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(pfd, int(timeout/time.Millisecond))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, err
		}
		if n == 0 {
			return 0, errors.New("the forker did not answer")
		}
		break
	}
	buf := make([]byte, 1024)
	n, err := ns.recv(buf)
	if err != nil {
		return 0, err
	}
	if n < 8 || binary.LittleEndian.Uint32(buf) != 0 {
		return 0, errors.New("the forker's first answer is not one")
	}
	a := answer(buf[:n])
	return a.pid, a.err
}

func (ns *pidNS) recv(buf []byte) (int, error) {
	for {
		n, _, _, _, err := unix.Recvmsg(ns.fd, buf, nil, 0)
		if err == unix.EINTR {
			continue
		}
		if err == nil && n == 0 {
			err = errors.New("the forker exited")
		}
		return n, err
	}
}

// answer decodes a reply (kind 0): a pid, or minus an errno and what
// failed.
func answer(b []byte) forkAnswer {
	v := int32(binary.LittleEndian.Uint32(b[4:]))
	switch {
	case v > 0:
		return forkAnswer{pid: int(v)}
	case len(b) > 8:
		return forkAnswer{err: fmt.Errorf("%s: %w", b[8:], syscall.Errno(-v))}
	default:
		return forkAnswer{err: syscall.Errno(-v)}
	}
}

// readAll reads the forker's messages until it exits: answers to
// requests, and its children's exits, which go to exited as if the agent
// had reaped them.
func (ns *pidNS) readAll(exited func(exitStatus)) {
	defer close(ns.replies)
	buf := make([]byte, 1024)
	for {
		n, err := ns.recv(buf)
		if err != nil || n < 8 {
			ns.dead.Store(true)
			return
		}
		switch binary.LittleEndian.Uint32(buf) {
		case 0:
			ns.replies <- answer(buf[:n])
		case 1:
			var ru unix.Rusage
			if n < 12+int(unsafe.Sizeof(ru)) {
				continue
			}
			pid := int(int32(binary.LittleEndian.Uint32(buf[4:])))
			ws := unix.WaitStatus(binary.LittleEndian.Uint32(buf[8:]))
			ru = *(*unix.Rusage)(unsafe.Pointer(&buf[12]))
			if pid == ns.init {
				ns.dead.Store(true)
			}
			if exited != nil {
				exited(exitStatus{ws: ws, ru: ru, at: time.Now(), pid: pid})
			}
		}
	}
}

// PIDNamespaceInit is the init of a workloads' pid namespace (see
// IsolatePIDs): it replaces every procfs mounted at /proc by one of its
// namespace, says so on descriptor 3, gives up its capabilities and reaps
// orphans for ever. It survives every signal but SIGKILL and SIGSTOP,
// which the agent handles.
func PIDNamespaceInit() {
	err := setUpInit()
	msg := "ok"
	if err != nil {
		msg = err.Error()
	}
	unix.Write(3, []byte(msg))
	unix.Close(3)
	if err != nil {
		os.Exit(1)
	}
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, syscall.SIGCHLD)
	tick := time.NewTicker(time.Second) // a safety net for coalesced SIGCHLDs
	for {
		for {
			pid, err := unix.Wait4(-1, nil, unix.WNOHANG, nil)
			if err == unix.EINTR {
				continue
			}
			if pid <= 0 || err != nil {
				break
			}
		}
		select {
		case <-sigs:
		case <-tick.C:
		}
	}
}

func setUpInit() error {
	if os.Getpid() != 1 {
		return fmt.Errorf("pid %d, not the init of a pid namespace", os.Getpid())
	}
	unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	ignoreSignals()
	// Every procfs mounted at /proc goes (the agent's, or the previous
	// workloads' namespace's): one left below the new /proc would show the
	// agent to a process that unmounts it. The agent keeps its own open.
	for i := 0; ; i++ {
		err := unix.Unmount("/proc", unix.MNT_DETACH)
		if err == unix.EINVAL || err == unix.ENOENT {
			break
		}
		if err != nil || i == 16 {
			return fmt.Errorf("unmount the procfs at /proc: %v", err)
		}
	}
	if err := os.MkdirAll("/proc", 0o555); err != nil {
		return err
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount the workloads' /proc: %w", err)
	}
	return dropCaps()
}

// dropCaps empties the capability sets of every thread of the process.
func dropCaps() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		return fmt.Errorf("drop the init's capabilities: %w", e)
	}
	return nil
}
