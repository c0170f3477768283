package substratetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/undo"
)

// Fake is a driver for tests of the components above the substrates (the
// node above all) that need no root, crun or QEMU. Each instance is the
// real agent (internal/guest/agent, the code of dsec-guest) running as the
// init of its own unprivileged user, mount, PID, UTS, IPC and network
// namespaces, on an overlay of the spec's layers, and reached over the real
// guest protocol. It passes Run (fake_test.go), so it cannot drift from
// the contract the real drivers keep.
//
// It declares exec, pty, files, pause (every process of the instance
// stopped with SIGSTOP) and snapshot (the overlay's upper directory). It
// enforces no resource limits (a harness sets SkipLimits), has no egress
// network and no machine snapshots, and runs every process as root of its
// user namespace, which is the test's own user outside: a call naming
// another user fails. The test binary is the agent's binary (see the
// package's init), so nothing is built.
//
// Instances outlive the Fake that made them (a new Fake attaches to them,
// as after a node restart) but not the test process.
type Fake struct {
	kind substrate.Kind

	// BeforeCreate, if set, runs first in every Create: an error fails the
	// create (for tests of a caller's cleanup), and blocking holds it (for
	// tests of admission). Set it before the first Create.
	BeforeCreate func(ctx context.Context, spec *substrate.Spec) error
	// Runtimes are other runtimes the fake reports in its capabilities,
	// for tests of their selection (Spec.Runtime): an instance of an
	// available one runs as the default does. Set them before use.
	Runtimes []substrate.Runtime
}

var _ substrate.Driver = (*Fake)(nil)

// NewFake returns a fake driver that reports itself as kind.
func NewFake(kind substrate.Kind) *Fake { return &Fake{kind: kind} }

// Capabilities reports the fake unavailable where unprivileged user
// namespaces (or overlayfs in them) are not allowed.
func (f *Fake) Capabilities() substrate.Capabilities {
	c := substrate.Capabilities{
		Kind:    f.kind,
		Caps:    []substrate.Capability{substrate.CapExec, substrate.CapPTY, substrate.CapFiles, substrate.CapPause, substrate.CapSnapshot, substrate.CapFork},
		Details: map[string]string{"runtime": "substratetest fake: the agent in unprivileged namespaces"},
	}
	c.Runtimes = f.Runtimes
	if err := fakeProbe(); err != nil {
		c.Reason = "unprivileged user namespaces do not work here: " + err.Error()
		return c
	}
	c.Available = true
	return c
}

// fakeProbe starts one namespaced child that exits at once.
var fakeProbe = sync.OnceValue(func() error {
	cmd, err := fakeCommand(fakeConfig{Probe: true})
	if err != nil {
		return err
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, bytes.TrimSpace(out))
	}
	return nil
})

// fakeState is what an instance persists for Attach.
type fakeState struct {
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"` // of the init, in clock ticks after boot
	Socket    string `json:"socket"`     // the agent's abstract unix socket
	Dir       string `json:"dir"`        // the instance's own files
}

// Create starts an instance: the agent as the init of new namespaces, its
// root an overlay of spec.Image's layers with an upper directory in spec.Dir.
func (f *Fake) Create(ctx context.Context, spec *substrate.Spec) (_ substrate.Instance, err error) {
	if f.BeforeCreate != nil {
		if err := f.BeforeCreate(ctx, spec); err != nil {
			return nil, err
		}
	}
	if c, ok := f.Capabilities().For(spec.Runtime); !ok || !c.Available {
		return nil, errdefs.Invalid("the fake has no runtime %q", spec.Runtime)
	}
	switch {
	case len(spec.Image.Layers) == 0:
		return nil, errdefs.Invalid("the fake needs at least one layer")
	case spec.Restore != "":
		return nil, errdefs.Unimplemented("the fake has no machine snapshots")
	case spec.Network.NetNS != "":
		return nil, errdefs.Unimplemented("the fake has no egress network")
	}
	var u undo.Stack
	defer u.RunUnless(&err)
	dir := filepath.Join(spec.Dir, "fake")
	for _, d := range []string{"upper", "work", "rootfs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			return nil, errdefs.Internal(err, "create instance directory")
		}
	}
	u.Push(func() { removeAll(dir) })
	var nonce [8]byte
	rand.Read(nonce[:])
	sock := "@dsec-fake-" + hex.EncodeToString(nonce[:])
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return nil, errdefs.Internal(err, "listen for the agent")
	}
	defer l.Close() // the agent holds its own copy
	lf, err := l.File()
	if err != nil {
		return nil, errdefs.Internal(err, "listen for the agent")
	}
	defer lf.Close()
	life, err := lifeline()
	if err != nil {
		return nil, errdefs.Internal(err, "lifeline")
	}
	logf, err := os.Create(filepath.Join(dir, "init.log"))
	if err != nil {
		return nil, errdefs.Internal(err, "create init log")
	}
	defer logf.Close()
	// A layer kept as an EROFS image is the store's detached mount, named
	// by a descriptor of this process (/proc/self/fd/<n>): the init's
	// overlay, mounted in its own user namespace, may only stack mounts of
	// its own mount namespace, so a clone of each is attached under the
	// instance's directory, which the init's namespace copies, and
	// detached here once the init has answered.
	layers := spec.Image.Links()
	var attached []string
	defer func() {
		for _, a := range attached {
			unix.Unmount(a, unix.MNT_DETACH)
		}
	}()
	for i, l := range layers {
		if !strings.HasPrefix(l, "/proc/self/fd/") {
			continue
		}
		at := filepath.Join(dir, "l", strconv.Itoa(i))
		if err := os.MkdirAll(at, 0o755); err != nil {
			return nil, errdefs.Internal(err, "attach image layer")
		}
		fd, err := unix.OpenTree(unix.AT_FDCWD, l, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return nil, errdefs.Internal(err, "clone image layer")
		}
		err = unix.MoveMount(fd, "", unix.AT_FDCWD, at, unix.MOVE_MOUNT_F_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return nil, errdefs.Internal(err, "attach image layer")
		}
		attached = append(attached, at)
		layers[i] = at
	}
	cmd, err := fakeCommand(fakeConfig{
		Dir: dir, Layers: layers, Env: spec.Env, Workdir: spec.Workdir,
		Hostname: spec.Hostname, Deadline: spec.Deadline,
	})
	if err != nil {
		return nil, errdefs.Internal(err, "start instance")
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{lf, life}
	started := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, errdefs.Internal(err, "start instance")
	}
	st := fakeState{Pid: cmd.Process.Pid, StartTime: procStart(cmd.Process.Pid), Socket: sock, Dir: dir}
	inst := newFakeInstance(spec.ID, st)
	go func() {
		cmd.Wait()
		inst.exited()
	}()
	u.Push(func() { inst.Destroy(context.WithoutCancel(ctx)) })
	if err := inst.waitHello(ctx); err != nil {
		return nil, err
	}
	substrate.Step(ctx, "runtime", started) // as the container driver's: its init to the agent's answer
	return inst, nil
}

// Attach re-adopts an instance a Fake of this test process started (a
// paused one stays paused).
func (f *Fake) Attach(ctx context.Context, spec *substrate.Spec, state []byte) (substrate.Instance, error) {
	var st fakeState
	if err := json.Unmarshal(state, &st); err != nil {
		return nil, errdefs.Internal(err, "decode instance state")
	}
	// As the real drivers do, a failed attach still returns the instance,
	// for Destroy to remove what is left of it.
	inst := newFakeInstance(spec.ID, st)
	if !inst.alive() {
		inst.exited()
		return inst, errdefs.Gone("sandbox %s stopped while the node was down", spec.ID)
	}
	inst.watch()
	if inst.paused() {
		return inst, nil // its agent cannot answer until resumed
	}
	if _, err := inst.client.Hello(ctx); err != nil {
		return inst, errdefs.Gone("sandbox %s agent does not answer after the node restarted", spec.ID).WithCause(err)
	}
	return inst, nil
}

// Crash kills inst's init from outside, as a crash would. inst is an
// instance of a Fake.
func Crash(inst substrate.Instance) {
	syscall.Kill(inst.(*fakeInstance).st.Pid, syscall.SIGKILL)
}

// FakeLeaks lists what a destroyed fake instance of spec left behind.
func FakeLeaks(spec *substrate.Spec) []string {
	if _, err := os.Stat(filepath.Join(spec.Dir, "fake")); err == nil {
		return []string{"instance directory"}
	}
	return nil
}

type fakeInstance struct {
	id     string
	st     fakeState
	client *guest.Client

	done     chan struct{}
	doneOnce sync.Once

	mu        sync.Mutex
	destroyed bool
}

var (
	_ substrate.Instance    = (*fakeInstance)(nil)
	_ substrate.Diagnoser   = (*fakeInstance)(nil)
	_ substrate.Pauser      = (*fakeInstance)(nil)
	_ substrate.Snapshotter = (*fakeInstance)(nil)
)

func newFakeInstance(id string, st fakeState) *fakeInstance {
	return &fakeInstance{id: id, st: st, client: guest.NewClient(guest.UnixDialer(st.Socket)), done: make(chan struct{})}
}

func (i *fakeInstance) exited() { i.doneOnce.Do(func() { close(i.done) }) }

// watch closes done when an adopted init exits.
func (i *fakeInstance) watch() {
	fd, err := unix.PidfdOpen(i.st.Pid, 0)
	if err != nil {
		go i.poll()
		return
	}
	go func() {
		defer unix.Close(fd)
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(fds, -1); err != unix.EINTR {
				break
			}
		}
		i.exited()
	}()
}

func (i *fakeInstance) poll() {
	for i.alive() {
		time.Sleep(100 * time.Millisecond)
	}
	i.exited()
}

// waitHello waits for the agent to answer, the init to die, or ctx.
func (i *fakeInstance) waitHello(ctx context.Context) error {
	for {
		hctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := i.client.Hello(hctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-i.done:
			return errdefs.Unavailable("the instance's init exited at start: %s", i.LastWords())
		case <-ctx.Done():
			return errdefs.Classify(ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (i *fakeInstance) Guest() substrate.Guest { return i.client }

func (i *fakeInstance) State() []byte {
	b, _ := json.Marshal(i.st)
	return b
}

func (i *fakeInstance) Done() <-chan struct{} { return i.done }

// alive reports whether the init still runs (and is the same process, not
// a reused pid).
func (i *fakeInstance) alive() bool {
	p, ok := readProc(i.st.Pid)
	return ok && p.start == i.st.StartTime && p.state != 'Z' && p.state != 'X'
}

func (i *fakeInstance) Check(ctx context.Context) error {
	select {
	case <-i.done:
		return errdefs.Gone("sandbox %s has stopped", i.id)
	default:
	}
	if !i.alive() {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	return nil
}

// LastWords is the last line the init wrote.
func (i *fakeInstance) LastWords() string {
	b, _ := os.ReadFile(filepath.Join(i.st.Dir, "init.log"))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.ReplaceAll(lines[len(lines)-1], i.st.Dir, "…")
}

// Stats sums the instance's processes as /proc shows them; the fake
// enforces no limits, so it counts no OOM kills or refused forks.
func (i *fakeInstance) Stats(ctx context.Context) (substrate.Stats, error) {
	if err := i.Check(ctx); err != nil {
		return substrate.Stats{}, err
	}
	var st substrate.Stats
	tick := time.Second / 100 // USER_HZ
	for _, p := range i.processes() {
		st.Pids++
		st.MemoryBytes += p.rss * int64(os.Getpagesize())
		st.CPUTime += time.Duration(p.cpu) * tick
	}
	return st, nil
}

// Pause stops every process of the instance: the init first, so no call
// starts another, then its descendants until none is left running.
func (i *fakeInstance) Pause(ctx context.Context) error {
	if err := i.Check(ctx); err != nil {
		return err
	}
	syscall.Kill(i.st.Pid, syscall.SIGSTOP)
	for {
		stopped := true
		for _, p := range i.processes() {
			if p.state != 'T' && p.state != 'Z' {
				stopped = false
				syscall.Kill(p.pid, syscall.SIGSTOP)
			}
		}
		if stopped {
			return nil
		}
		select {
		case <-ctx.Done():
			return errdefs.Classify(ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// Resume continues every process of the instance, the init last.
func (i *fakeInstance) Resume(ctx context.Context) error {
	if err := i.Check(ctx); err != nil {
		return err
	}
	for _, p := range i.processes() {
		if p.pid != i.st.Pid {
			syscall.Kill(p.pid, syscall.SIGCONT)
		}
	}
	syscall.Kill(i.st.Pid, syscall.SIGCONT)
	return nil
}

func (i *fakeInstance) paused() bool {
	p, ok := readProc(i.st.Pid)
	return ok && p.state == 'T'
}

// Snapshot writes the overlay's upper directory, the instance paused.
func (i *fakeInstance) Snapshot(ctx context.Context, w io.Writer) error {
	if !i.paused() {
		if err := i.Pause(ctx); err != nil {
			return err
		}
		defer i.Resume(context.WithoutCancel(ctx))
	}
	// One user is mapped: the fake's host user is root inside.
	shift := image.IDShift{From: uint32(os.Getuid()), Size: 1}
	if err := image.TarOverlayUpper(filepath.Join(i.st.Dir, "upper"), w, shift); err != nil {
		return errdefs.Internal(err, "capture the writable layer")
	}
	return nil
}

// Destroy kills the init, which ends every process of its PID namespace
// (and with the last one its mounts), and removes the instance's files.
func (i *fakeInstance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.destroyed {
		return nil
	}
	i.client.Close()
	if fd, err := unix.PidfdOpen(i.st.Pid, 0); err == nil {
		if i.alive() { // the pidfd refers to the verified process
			unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		}
		unix.Close(fd)
	}
	for deadline := time.Now().Add(10 * time.Second); i.alive(); {
		if time.Now().After(deadline) {
			return errdefs.Internal(errors.New("timed out"), "kill sandbox %s", i.id)
		}
		time.Sleep(time.Millisecond)
	}
	if err := removeAll(i.st.Dir); err != nil {
		return errdefs.Internal(err, "remove instance files")
	}
	i.destroyed = true
	return nil
}

// proc is one process as /proc/<pid>/stat shows it.
type proc struct {
	pid, ppid int
	state     byte
	cpu       uint64 // utime + stime
	childCPU  uint64 // cutime + cstime: of the children it reaped
	rss       int64  // pages
	start     uint64
}

func readProc(pid int) (proc, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return proc{}, false
	}
	end := bytes.LastIndexByte(b, ')')
	if end < 0 || end+2 >= len(b) {
		return proc{}, false
	}
	f := strings.Fields(string(b[end+2:]))
	if len(f) < 22 {
		return proc{}, false
	}
	// Fields from 3 (state): ppid 4, utime 14, stime 15, cutime 16,
	// cstime 17, starttime 22, rss 24.
	num := func(k int) uint64 { v, _ := strconv.ParseUint(f[k-3], 10, 64); return v }
	p := proc{pid: pid, ppid: int(num(4)), state: f[0][0], start: num(22), rss: int64(num(24))}
	p.cpu, p.childCPU = num(14)+num(15), num(16)+num(17)
	return p, true
}

func procStart(pid int) uint64 {
	p, _ := readProc(pid)
	return p.start
}

// processes returns the init and its descendants: every process of the
// instance's PID namespace (orphans there are the init's, a subreaper).
func (i *fakeInstance) processes() []proc {
	init, ok := readProc(i.st.Pid)
	if !ok || init.start != i.st.StartTime {
		return nil
	}
	// The init reaps every process of its namespace: their CPU time is
	// its children's.
	init.cpu += init.childCPU
	ents, _ := os.ReadDir("/proc")
	children := map[int][]proc{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == i.st.Pid {
			continue
		}
		if p, ok := readProc(pid); ok {
			children[p.ppid] = append(children[p.ppid], p)
		}
	}
	out := []proc{init}
	for k := 0; k < len(out); k++ {
		out = append(out, children[out[k].pid]...)
	}
	return out
}

// removeAll removes a tree whose directories may deny their owner access
// (overlayfs's work directory, a sandbox's chmod 000).
func removeAll(dir string) error {
	err := os.RemoveAll(dir)
	for k := 0; err != nil && k < 8; k++ {
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				os.Chmod(p, 0o700)
			}
			return nil
		})
		err = os.RemoveAll(dir)
	}
	return err
}
