package microvm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/guest/portmux"
	"github.com/opendsec/dsec/internal/qemu"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/undo"
)

// Files in a sandbox's directory and in a machine snapshot directory.
const (
	stateFile   = "vm.json"      // the instance's state, for Attach
	diskFile    = "disk.img"     // the writable ext4 disk
	consoleFile = "console.log"  // the guest's serial console
	qemuLog     = "qemu.log"     // QEMU's own output
	pauseFile   = "paused.state" // memory and devices of a paused VM
	machineFile = "machine.json" // a snapshot's machine
	memFile     = "state"        // a snapshot's memory and devices
)

// state is what an instance persists (in its directory and through the
// node) to be re-adopted.
type state struct {
	Pid       int     `json:"pid"`
	StartTime uint64  `json:"start_time"`
	Paused    bool    `json:"paused"`
	Machine   machine `json:"machine"`
	Dir       string  `json:"dir"`
}

type instance struct {
	d       *Driver
	id      string
	dialer  *portmux.Dialer
	release func() // of the dialer
	client  *guest.Client
	done    chan struct{}

	mu        sync.Mutex
	st        state
	run       *vmRun // the running QEMU; nil while paused or destroyed
	destroyed bool
	doneOnce  sync.Once
}

// vmRun is one QEMU process of an instance (a pause ends it, a resume
// starts another).
type vmRun struct {
	p        *qemu.Process
	intended bool // the driver ended it (pause, destroy): not a crash
}

var (
	_ substrate.Instance  = (*instance)(nil)
	_ substrate.Diagnoser = (*instance)(nil)
)

func (d *Driver) newInstance(id string, st state) *instance {
	i := &instance{d: d, id: id, st: st, done: make(chan struct{})}
	i.dialer, i.release = channels.acquire(d.agentSock(id))
	dial := i.dialer.Dial
	if st.Machine.Vsock {
		dial = vsockDialer(st.Machine.CID, vsockPort)
	}
	i.client = guest.NewClient(dial)
	return i
}

func (i *instance) path(name string) string { return filepath.Join(i.st.Dir, name) }

// channels holds one portmux session per agent socket in this process.
// A QEMU port admits one connection at a time, so instances of the same VM
// in one process (a driver re-created over the same state, as the
// conformance suite's restart does) share it; a new node process
// reconnects once the old one's connection is gone.
var channels = &channelSet{m: map[string]*sharedDialer{}}

type channelSet struct {
	mu sync.Mutex
	m  map[string]*sharedDialer
}

type sharedDialer struct {
	d    *portmux.Dialer
	refs int
}

func (c *channelSet) acquire(sock string) (*portmux.Dialer, func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	sd := c.m[sock]
	if sd == nil {
		sd = &sharedDialer{d: portmux.NewDialer(func(ctx context.Context) (net.Conn, error) {
			var nd net.Dialer
			return nd.DialContext(ctx, "unix", sock)
		})}
		// Every session sets the guest's clock and seeds its randomness:
		// a restored or resumed VM has a stale clock and the random state
		// of its snapshot.
		sd.d.Payload = func() []byte {
			var seed [32]byte
			rand.Read(seed[:])
			return guest.StartPayload(time.Now(), seed[:])
		}
		c.m[sock] = sd
	}
	sd.refs++
	var once sync.Once
	return sd.d, func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if sd.refs--; sd.refs == 0 {
				sd.d.Close()
				delete(c.m, sock)
			}
		})
	}
}

// Create implements substrate.Driver.
func (d *Driver) Create(ctx context.Context, s *substrate.Spec) (_ substrate.Instance, err error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("microVMs cannot run on this node: %s", d.caps.Reason)
	}
	if s.MemoryMB < 64 {
		return nil, errdefs.Invalid("a microvm needs at least 64 MiB of memory (resources.memory_mb %d)", s.MemoryMB)
	}
	diskMB := s.DiskMB
	if diskMB == 0 {
		diskMB = d.cfg.DefaultDiskMB
	}
	if diskMB < minDiskMB || diskMB > d.cfg.MaxDiskMB {
		return nil, errdefs.Invalid("resources.disk_mb %d out of range [%d, %d] for a microvm", diskMB, minDiskMB, d.cfg.MaxDiskMB)
	}
	var u undo.Stack
	defer u.RunUnless(&err)
	i := d.newInstance(s.ID, state{Dir: s.Dir})
	u.Push(func() { i.Destroy(context.WithoutCancel(ctx)) })
	disk := i.path(diskFile)
	var m machine
	var incoming *os.File
	if s.Restore != "" {
		m, err = d.restoreMachine(s.Restore)
		if err != nil {
			return nil, err
		}
		if st, err := os.Stat(filepath.Join(s.Restore, diskFile)); err == nil && s.DiskMB > 0 && st.Size() > s.DiskMB<<20 {
			return nil, errdefs.Invalid("the snapshot's disk (%d MiB) is larger than resources.disk_mb %d", st.Size()>>20, s.DiskMB)
		}
		if err := copySparse(filepath.Join(s.Restore, diskFile), disk); err != nil {
			return nil, errdefs.Internal(err, "copy the snapshot's disk")
		}
		incoming, err = os.Open(filepath.Join(s.Restore, memFile))
		if err != nil {
			return nil, errdefs.NotFound("the machine snapshot has no memory state")
		}
		defer incoming.Close()
	} else {
		img, err := d.imageDisk(s.Layers)
		if err != nil {
			return nil, err
		}
		tmpl, err := d.diskTemplate(diskMB)
		if err != nil {
			return nil, errdefs.Internal(err, "create the writable disk template")
		}
		if err := copySparse(tmpl, disk); err != nil {
			return nil, errdefs.Internal(err, "create the writable disk")
		}
		host := s.Hostname
		if host == "" {
			host = "sandbox"
		}
		var deadline int64
		if !s.Deadline.IsZero() {
			deadline = s.Deadline.Unix()
		}
		m = machine{
			CPUs: cpusFor(s.CPU), MemoryMB: s.MemoryMB, Kernel: d.kernel.Vmlinux, Release: d.kernel.Release,
			Initrd: d.initrd, Image: img, Accel: d.accel.Arg(d.cfg.TBSizeMiB), Vsock: d.vsock,
			Hostname: host, Deadline: deadline, ExtraArgs: d.cfg.KernelArgs,
		}
		if d.vsock {
			m.CID = cidFor(s.ID)
		}
	}
	if incoming != nil && d.vsock {
		m.CID = cidFor(s.ID)
	}
	i.st.Machine = m
	if err := i.start(ctx, incoming); err != nil {
		return nil, err
	}
	if incoming != nil {
		// Clock and randomness came with the channel's session; a
		// hostname other than the snapshot's takes an exec.
		if s.Hostname != "" && s.Hostname != m.Hostname {
			if err := i.freshIdentity(ctx, s.Hostname); err != nil {
				return nil, err
			}
		}
		if !s.Deadline.IsZero() {
			if err := i.client.SetDeadline(ctx, s.Deadline); err != nil {
				return nil, i.failed(err, "set the restored sandbox's deadline")
			}
		}
	}
	if len(s.Env) > 0 {
		if err := i.client.SetEnv(ctx, s.Env); err != nil {
			return nil, i.failed(err, "set the sandbox's environment")
		}
	}
	if err := i.saveState(); err != nil {
		return nil, errdefs.Internal(err, "persist microvm state")
	}
	return i, nil
}

// restoreMachine reads a snapshot's machine and checks it can run here.
func (d *Driver) restoreMachine(dir string) (machine, error) {
	var m machine
	b, err := os.ReadFile(filepath.Join(dir, machineFile))
	if err != nil {
		return m, errdefs.NotFound("machine snapshot not found")
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, errdefs.Internal(err, "decode the machine snapshot")
	}
	if m.Release != d.kernel.Release {
		return m, errdefs.Unavailable("the snapshot was taken with guest kernel %s; this node has %s", m.Release, d.kernel.Release)
	}
	for _, f := range []string{m.Kernel, m.Initrd, m.Image} {
		if _, err := os.Stat(f); err != nil {
			return m, errdefs.Unavailable("a file the snapshot's machine needs is gone (kernel, initramfs or image disk)")
		}
	}
	return m, nil
}

// start starts QEMU for the instance's machine, booting or (with
// incoming) restoring, and returns once the agent answers. On error QEMU
// is stopped and its sockets removed.
func (i *instance) start(ctx context.Context, incoming *os.File) (err error) {
	d := i.d
	m := &i.st.Machine
	agentSock, qmpSock := d.agentSock(i.id), d.qmpSock(i.id)
	os.Remove(agentSock)
	os.Remove(qmpSock)
	args := m.args(i.id, i.path(diskFile), agentSock, qmpSock, i.path(consoleFile))
	var extra []*os.File
	if incoming != nil {
		args = append(args, "-incoming", "fd:3")
		extra = []*os.File{incoming}
	}
	t0 := time.Now()
	p, err := qemu.Start(d.qemu, args, i.path(qemuLog), extra)
	if err != nil {
		return errdefs.Unavailable("start QEMU").WithCause(err)
	}
	run := &vmRun{p: p}
	i.mu.Lock()
	i.run = run
	i.st.Pid, i.st.StartTime = p.Pid, p.StartTime
	i.mu.Unlock()
	i.watch(run)
	defer func() {
		if err != nil {
			i.stop(run)
		}
	}()
	bctx, cancel := context.WithTimeout(ctx, d.cfg.BootTimeout)
	defer cancel()
	ready := make(chan error, 1)
	go func() {
		if incoming != nil {
			q, err := qemu.DialQMP(bctx, qmpSock)
			if err != nil {
				ready <- err
				return
			}
			defer q.Close()
			if err := qemu.WaitIncoming(bctx, q); err != nil {
				ready <- fmt.Errorf("restore: %w", err)
				return
			}
		}
		tr := time.Now()
		_, err := i.client.Hello(bctx)
		d.log.Debug("microVM started", slog.String("sandbox_id", i.id), slog.Bool("restore", incoming != nil),
			slog.Duration("qemu", tr.Sub(t0)), slog.Duration("agent", time.Since(tr)))
		ready <- err
	}()
	select {
	case err := <-ready:
		if err == nil {
			return nil
		}
		select {
		case <-p.Done():
			return i.died("the microVM stopped while starting")
		case <-time.After(200 * time.Millisecond):
		}
		if ctx.Err() != nil {
			return errdefs.Classify(ctx.Err())
		}
		return errdefs.Unavailable("the microVM's agent did not answer within %s%s", d.cfg.BootTimeout, i.consoleHint()).WithCause(err)
	case <-p.Done():
		cancel()
		return i.died("the microVM stopped while starting")
	}
}

// died is the error for a QEMU that exited, with what the guest or QEMU
// said last.
func (i *instance) died(what string) error {
	return errdefs.Unavailable("%s%s", what, i.consoleHint())
}

// LastWords implements substrate.Diagnoser.
func (i *instance) LastWords() string { return strings.TrimPrefix(i.consoleHint(), ": ") }

// consoleHint is the end of the guest console (init failures, kernel
// panics) or of QEMU's log, for error messages; host paths are cut.
func (i *instance) consoleHint() string {
	var lines []string
	for _, f := range []string{consoleFile, qemuLog} {
		t := qemu.ReadLogTail(i.path(f), 2048)
		for _, l := range strings.Split(t, "\n") {
			l = strings.TrimSpace(l)
			if strings.Contains(l, "dsec-init:") || strings.Contains(l, "Kernel panic") || strings.Contains(l, "qemu-system") {
				lines = append(lines, l)
			}
		}
	}
	if len(lines) == 0 {
		return ""
	}
	last := lines[len(lines)-1]
	if j := strings.Index(last, "qemu-system-x86_64: "); j >= 0 {
		last = last[j+len("qemu-system-x86_64: "):]
	}
	last = strings.ReplaceAll(last, i.d.cfg.StateDir, "…")
	last = strings.ReplaceAll(last, i.st.Dir, "…")
	if len(last) > 300 {
		last = last[:300]
	}
	return ": " + last
}

// watch closes done when a QEMU process the driver did not end exits.
func (i *instance) watch(r *vmRun) {
	go func() {
		<-r.p.Done()
		i.mu.Lock()
		crashed := !r.intended && !i.destroyed
		if i.run == r {
			i.run = nil
		}
		i.mu.Unlock()
		if crashed {
			i.d.log.Warn("microVM exited by itself", slog.String("sandbox_id", i.id), slog.String("hint", i.consoleHint()))
			i.closeDone()
		}
	}()
}

func (i *instance) closeDone() { i.doneOnce.Do(func() { close(i.done) }) }

// stop kills a QEMU process the driver ends on purpose.
func (i *instance) stop(r *vmRun) {
	i.mu.Lock()
	r.intended = true
	i.mu.Unlock()
	if !r.p.Kill(10 * time.Second) {
		i.d.log.Warn("QEMU did not exit after SIGKILL", slog.String("sandbox_id", i.id), slog.Int("pid", r.p.Pid))
	}
	os.Remove(i.d.agentSock(i.id))
	os.Remove(i.d.qmpSock(i.id))
}

// freshIdentity gives a restored VM its own hostname (clock and
// randomness come with every channel session).
func (i *instance) freshIdentity(ctx context.Context, hostname string) error {
	argv := []string{"/.dsec/guest", "identity", "-hostname", hostname}
	x, err := i.client.Run(ctx, &guestv1.Exec{Argv: argv, TimeoutMs: 30000})
	if err != nil {
		return i.failed(err, "give the restored VM its identity")
	}
	if x.ExitCode != 0 {
		return errdefs.Internal(fmt.Errorf("exit %d: %s", x.ExitCode, bytes.TrimSpace(x.Stderr)), "give the restored VM its identity")
	}
	return nil
}

// failed wraps an agent call failure during a start.
func (i *instance) failed(err error, what string) error {
	if e := errdefs.Classify(err); e.Kind == errdefs.KindCanceled || e.Kind == errdefs.KindDeadlineExceeded {
		return err
	}
	return errdefs.Unavailable("%s", what).WithCause(err)
}

func (i *instance) saveState() error {
	i.mu.Lock()
	b, err := json.Marshal(i.st)
	i.mu.Unlock()
	if err != nil {
		return err
	}
	tmp := i.path(stateFile + ".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, i.path(stateFile))
}

// Attach implements substrate.Driver.
func (d *Driver) Attach(ctx context.Context, s *substrate.Spec, raw []byte) (substrate.Instance, error) {
	var st state
	// The instance's own file is newer than the node's record after a
	// pause or resume.
	if b, err := os.ReadFile(filepath.Join(s.Dir, stateFile)); err == nil {
		raw = b
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return nil, errdefs.Internal(err, "decode microvm state")
	}
	st.Dir = s.Dir
	i := d.newInstance(s.ID, st)
	if st.Paused {
		if _, err := os.Stat(i.path(pauseFile)); err != nil {
			return i, errdefs.Gone("paused sandbox %s lost its saved memory", s.ID)
		}
		return i, nil
	}
	p, err := qemu.Adopt(st.Pid, st.StartTime)
	if err != nil {
		return i, errdefs.Gone("sandbox %s stopped while the node was down", s.ID)
	}
	run := &vmRun{p: p}
	i.run = run
	i.watch(run)
	if _, err := i.client.Hello(ctx); err != nil {
		return i, errdefs.Gone("sandbox %s agent does not answer after the node restarted", s.ID).WithCause(err)
	}
	return i, nil
}

func (i *instance) Guest() substrate.Guest { return i.client }

func (i *instance) State() []byte {
	i.mu.Lock()
	defer i.mu.Unlock()
	b, _ := json.Marshal(i.st)
	return b
}

func (i *instance) Done() <-chan struct{} { return i.done }

func (i *instance) Check(ctx context.Context) error {
	select {
	case <-i.done:
		return errdefs.Gone("sandbox %s has stopped", i.id)
	default:
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.destroyed {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	if i.st.Paused {
		return nil
	}
	if i.run == nil || !i.run.p.Alive() {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	return nil
}

// Stats reports QEMU's resident memory and CPU time (the guest's and the
// emulation's). A paused VM holds no memory.
func (i *instance) Stats(ctx context.Context) (substrate.Stats, error) {
	i.mu.Lock()
	r := i.run
	i.mu.Unlock()
	if r == nil {
		return substrate.Stats{}, nil
	}
	return substrate.Stats{MemoryBytes: r.p.RSS(), CPUTime: r.p.CPUTime()}, nil
}

// Pause saves the VM's memory and devices to a file and stops QEMU, so a
// paused microVM holds no memory. It is idempotent. The instance counts as
// paused (Check answers nil) from the moment its memory is saved, so a call
// that breaks because QEMU goes away does not mistake the pause for a
// crash.
func (i *instance) Pause(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.destroyed {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	if i.st.Paused {
		return nil
	}
	r := i.run
	if r == nil {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	if err := i.saveLocked(ctx, i.path(pauseFile)); err != nil {
		os.Remove(i.path(pauseFile))
		return err
	}
	r.intended = true
	i.st.Paused, i.st.Pid, i.st.StartTime = true, 0, 0
	i.run = nil
	i.quit(r)
	return i.saveStateLocked()
}

// saveLocked writes the running VM's memory and devices to path and leaves
// it stopped; on error the VM is continued.
func (i *instance) saveLocked(ctx context.Context, path string) error {
	q, err := qemu.DialQMP(ctx, i.d.qmpSock(i.id))
	if err != nil {
		return i.callErrLocked(err, "reach the VM's monitor")
	}
	defer q.Close()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return errdefs.Internal(err, "create the memory snapshot file")
	}
	defer f.Close()
	if err := qemu.SaveState(ctx, q, f); err != nil {
		qemu.Cont(context.WithoutCancel(ctx), q)
		return i.callErrLocked(err, "save the VM's memory")
	}
	if err := f.Sync(); err != nil {
		qemu.Cont(context.WithoutCancel(ctx), q)
		return errdefs.Internal(err, "sync the memory snapshot")
	}
	return nil
}

// callErrLocked classifies a failure talking to QEMU: gone if it died.
func (i *instance) callErrLocked(err error, what string) error {
	if i.run == nil || !i.run.p.Alive() {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	return errdefs.Internal(err, "%s", what)
}

// quit ends a stopped QEMU: quit through the monitor, SIGKILL if it
// lingers.
func (i *instance) quit(r *vmRun) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if q, err := qemu.DialQMP(ctx, i.d.qmpSock(i.id)); err == nil {
		q.Execute(ctx, "quit", nil, nil)
		q.Close()
	}
	if !r.p.Wait(5 * time.Second) {
		r.p.Kill(10 * time.Second)
	}
	os.Remove(i.d.agentSock(i.id))
	os.Remove(i.d.qmpSock(i.id))
}

// Resume restores a paused VM from its saved memory. It is idempotent.
func (i *instance) Resume(ctx context.Context) error {
	i.mu.Lock()
	if i.destroyed {
		i.mu.Unlock()
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	if !i.st.Paused {
		i.mu.Unlock()
		return nil
	}
	// Holding mu for the whole restore keeps a concurrent pause, snapshot
	// or destroy out; start takes mu itself, so release around it.
	i.mu.Unlock()
	f, err := os.Open(i.path(pauseFile))
	if err != nil {
		return errdefs.Gone("paused sandbox %s lost its saved memory", i.id)
	}
	defer f.Close()
	if err := i.start(ctx, f); err != nil {
		return err
	}
	i.mu.Lock()
	i.st.Paused = false
	err = i.saveStateLocked()
	i.mu.Unlock()
	os.Remove(i.path(pauseFile))
	return err
}

func (i *instance) saveStateLocked() error {
	b, err := json.Marshal(i.st)
	if err != nil {
		return err
	}
	tmp := i.path(stateFile + ".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return errdefs.Internal(err, "persist microvm state")
	}
	if err := os.Rename(tmp, i.path(stateFile)); err != nil {
		return errdefs.Internal(err, "persist microvm state")
	}
	return nil
}

// Snapshot implements substrate.Instance: microVM snapshots are machine
// snapshots (SnapshotMachine), not filesystem layers.
func (i *instance) Snapshot(context.Context, io.Writer) error {
	return errdefs.Unimplemented("microvm snapshots hold memory and disk: use a machine snapshot")
}

// SnapshotMachine writes memory, devices and the writable disk into dir.
// A running VM is stopped for the capture (so disk and memory agree) and
// continued; a paused one is copied as it is.
func (i *instance) SnapshotMachine(ctx context.Context, dir string) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.destroyed {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	mb, err := json.Marshal(i.st.Machine)
	if err != nil {
		return errdefs.Internal(err, "encode the machine")
	}
	if i.st.Paused {
		if err := copySparse(i.path(pauseFile), filepath.Join(dir, memFile)); err != nil {
			return errdefs.Internal(err, "copy the paused VM's memory")
		}
	} else {
		if i.run == nil {
			return errdefs.Gone("sandbox %s has stopped", i.id)
		}
		if err := i.saveLocked(ctx, filepath.Join(dir, memFile)); err != nil {
			return err
		}
		defer func() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			if q, err := qemu.DialQMP(cctx, i.d.qmpSock(i.id)); err == nil {
				if err := qemu.Cont(cctx, q); err != nil {
					i.d.log.Warn("continue VM after snapshot", slog.String("sandbox_id", i.id), slog.Any("error", err))
				}
				q.Close()
			}
		}()
	}
	// The disk is consistent with the memory: QEMU flushed it when the
	// migration completed and the VM is stopped.
	if err := copySparse(i.path(diskFile), filepath.Join(dir, diskFile)); err != nil {
		return errdefs.Internal(err, "copy the writable disk")
	}
	if err := os.WriteFile(filepath.Join(dir, machineFile), mb, 0o600); err != nil {
		return errdefs.Internal(err, "write the machine snapshot")
	}
	return nil
}

// Destroy kills QEMU and removes the instance's sockets, disk and saved
// memory. It is idempotent.
func (i *instance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	if i.destroyed {
		i.mu.Unlock()
		return nil
	}
	i.destroyed = true
	r := i.run
	i.mu.Unlock()
	if r != nil {
		i.stop(r)
	} else if i.st.Pid > 0 {
		// Adopted but not watched, or a failed start: make sure.
		if p, err := qemu.Adopt(i.st.Pid, i.st.StartTime); err == nil {
			p.Kill(10 * time.Second)
		}
	}
	i.release()
	os.Remove(i.d.agentSock(i.id))
	os.Remove(i.d.qmpSock(i.id))
	var errs []error
	for _, f := range []string{diskFile, pauseFile} {
		if err := os.Remove(i.path(f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	i.closeDone()
	if err := errors.Join(errs...); err != nil {
		return errdefs.Internal(err, "remove the microVM's disk")
	}
	return nil
}
