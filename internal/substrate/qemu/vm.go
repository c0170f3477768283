package qemu

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/guest/portmux"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/proc"
)

// Files a VM keeps in its directory.
const (
	ConsoleFile = "console.log"  // the guest's serial console
	LogFile     = "qemu.log"     // QEMU's own output
	PauseFile   = "paused.state" // memory and devices of a paused VM
)

// VMConfig describes one sandbox's VM to NewVM. The driver builds the
// machine (its command line); VM runs it.
type VMConfig struct {
	// ID names the VM: QEMU runs with "-name dsec-<ID>", which SweepVMs
	// finds.
	ID string
	// Dir holds the VM's files (ConsoleFile, LogFile, PauseFile).
	Dir string
	// Binary is qemu-system-x86_64.
	Binary string
	// AgentSock is the unix socket of the agent's virtio-serial port (the
	// chardev QEMU listens on); QMPSock is the monitor's.
	AgentSock, QMPSock string
	// VsockCID, if not 0, reaches the agent over vhost-vsock at this guest
	// CID and VsockPort instead of the port (one connection per call).
	VsockCID, VsockPort uint32
	// Args returns QEMU's command line for the machine, without
	// -incoming. A restore appends "-incoming fd:3".
	Args func() []string
	// TapNS, if set, is the network namespace whose tap (PrepareTap)
	// backs the machine's NIC: each QEMU the VM starts (boot, restore,
	// resume) gets it opened anew as "-netdev tap,id=net0,fd=N", the
	// backend of the device the machine declares with netdev=net0.
	TapNS string
	// Cgroup, if set, is the cgroup every QEMU of the VM runs in (a path
	// below each controller's root, made at each start, removed by
	// Destroy), limited to Resources (see Resources).
	Cgroup    string
	Resources *specs.LinuxResources
	// BootTimeout bounds a boot or restore until the agent answers
	// (default 90s).
	BootTimeout time.Duration
	// Kind names the VM in messages ("microVM", "VM").
	Kind string
	// HintLine selects the lines of the guest console and QEMU's log that
	// explain a failure (a line naming QEMU itself always does).
	HintLine func(line string) bool
	// FatalLine, if set, selects guest console lines that end a start at
	// once (a kernel panic, no bootable disk) instead of at BootTimeout.
	FatalLine func(line string) bool
	// Logs are more guest log files in Dir (a firmware's) that Hint and
	// FatalLine read after the console.
	Logs []string
	// Redact lists host paths cut from messages.
	Redact []string
	// Persist, if set, is called with the new state whenever the VM's
	// process or pause state changes (the driver writes it for Attach).
	Persist func(VMState) error
	Log     *slog.Logger
}

// VMState is what a VM persists to be adopted by a later node process.
type VMState struct {
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	Paused    bool   `json:"paused"`
	// OOMBase is the guest's count of OOM kills that are not the
	// sandbox's (CountOOMKillsFromNow).
	OOMBase int64 `json:"oom_base,omitempty"`
	// RAM is the file the running QEMU maps its RAM from copy-on-write
	// (a restore of RAM saved apart: see ram.go); "" when its RAM is
	// its memfd.
	RAM string `json:"ram,omitempty"`
}

// VM is one sandbox's virtual machine across the QEMU processes that run
// it: a start boots it or restores it from a state file, a pause saves
// its memory and devices to a file and ends QEMU (freeing the memory), a
// resume restores that file in a new QEMU, a machine snapshot saves the
// state beside copies of the disks while the VM is stopped. QEMU outlives
// the node; a new node process adopts it. The agent is reached over a
// virtio-serial port multiplexed by portmux (every session sets the
// guest's clock and reseeds its randomness) or over vsock. Methods are
// safe for concurrent use.
type VM struct {
	cfg     VMConfig
	release func() // of the port's shared dialer
	client  *guest.Client
	done    chan struct{}

	mu        sync.Mutex
	st        VMState
	run       *vmRun // the running QEMU; nil while paused or destroyed
	crashed   *vmRun // the QEMU that exited by itself, ending the VM
	destroyed bool
	doneOnce  sync.Once
}

// vmRun is one QEMU process of a VM (a pause ends it, a resume starts
// another).
type vmRun struct {
	p        *Process
	intended bool // the VM ended it (pause, destroy): not a crash
}

// NewVM returns the VM of cfg in state st (the zero state: not started).
func NewVM(cfg VMConfig, st VMState) *VM {
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 90 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Kind == "" {
		cfg.Kind = "VM"
	}
	v := &VM{cfg: cfg, st: st, done: make(chan struct{})}
	if cfg.VsockCID != 0 {
		v.release = func() {}
		v.client = guest.NewClient(vsockDialer(cfg.VsockCID, cfg.VsockPort))
	} else {
		var d *portmux.Dialer
		d, v.release = channels.acquire(cfg.AgentSock)
		v.client = guest.NewClient(d.Dial)
	}
	return v
}

func (v *VM) path(name string) string { return filepath.Join(v.cfg.Dir, name) }

// Client is the VM's agent.
func (v *VM) Client() *guest.Client { return v.client }

// State is the VM's current state.
func (v *VM) State() VMState {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.st
}

// Done is closed when the VM stops by itself (QEMU exited while the VM
// was neither paused nor destroyed) or is destroyed.
func (v *VM) Done() <-chan struct{} { return v.done }

// channels holds one portmux session per agent socket in this process.
// A QEMU port admits one connection at a time, so VMs over the same
// socket in one process (a driver re-created over the same state, as the
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

// Start starts QEMU for the machine, booting it or (with r) restoring
// it, and returns once the agent answers, within
// BootTimeout. On error QEMU is stopped and its sockets removed; the
// error is unavailable (infra) with what the guest console or QEMU said
// last.
func (v *VM) Start(ctx context.Context, r *Restore) (err error) {
	os.Remove(v.cfg.AgentSock)
	os.Remove(v.cfg.QMPSock)
	args := v.cfg.Args()
	var extra []*os.File
	ram := ""
	if r != nil {
		extra = []*os.File{r.State}
		mapped := ""
		if r.RAM != "" {
			mem, err := ramFiles.open(r.RAM)
			if err != nil {
				return errdefs.Internal(err, "read the %s's saved RAM", v.cfg.Kind)
			}
			defer mem.Close()
			extra = append(extra, mem)
			mapped, ram = fmt.Sprintf("/proc/self/fd/%d", 2+len(extra)), r.RAM
		}
		if args, err = incomingArgs(args, mapped); err != nil {
			return errdefs.Internal(err, "restore the %s's RAM", v.cfg.Kind)
		}
	}
	if v.cfg.TapNS != "" {
		tap, err := network.OpenTap(v.cfg.TapNS)
		if err != nil {
			return errdefs.Unavailable("open the sandbox's tap device").WithCause(err)
		}
		defer tap.Close()
		extra = append(extra, tap)
		args = append(args, "-netdev", fmt.Sprintf("tap,id=net0,fd=%d", 2+len(extra)))
	}
	if v.cfg.Cgroup != "" {
		if _, err := cgroups().Make(v.cfg.Cgroup, v.cfg.Resources); err != nil {
			return errdefs.Internal(err, "make the %s's cgroup", v.cfg.Kind)
		}
	}
	t0 := time.Now()
	p, err := Start(v.cfg.Binary, args, v.path(LogFile), extra, v.cfg.Cgroup)
	var early *ExitedEarly
	if errors.As(err, &early) {
		return v.died("the "+v.cfg.Kind+" stopped while starting", early.Reason)
	}
	if err != nil {
		return errdefs.Unavailable("start QEMU").WithCause(err)
	}
	run := &vmRun{p: p}
	v.mu.Lock()
	v.run = run
	v.st.Pid, v.st.StartTime, v.st.RAM = p.Pid, p.StartTime, ram
	v.mu.Unlock()
	v.watch(run)
	defer func() {
		if err != nil {
			v.stop(run)
		}
	}()
	bctx, cancel := context.WithTimeout(ctx, v.cfg.BootTimeout)
	defer cancel()
	ready := make(chan error, 1)
	go func() {
		if r != nil {
			q, err := DialQMP(bctx, v.cfg.QMPSock)
			if err != nil {
				ready <- err
				return
			}
			defer q.Close()
			if ram != "" {
				if err := StartIncomingIgnoringShared(bctx, q, "fd:3"); err != nil {
					ready <- fmt.Errorf("restore: %w", err)
					return
				}
			}
			if err := WaitIncoming(bctx, q); err != nil {
				ready <- fmt.Errorf("restore: %w", err)
				return
			}
		}
		tr := time.Now()
		_, err := v.client.Hello(bctx)
		v.cfg.Log.Debug(v.cfg.Kind+" started", slog.String("sandbox_id", v.cfg.ID), slog.Bool("restore", r != nil),
			slog.Duration("qemu", tr.Sub(t0)), slog.Duration("agent", time.Since(tr)))
		ready <- err
	}()
	var fatal <-chan time.Time
	if v.cfg.FatalLine != nil {
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		fatal = t.C
	}
	for {
		select {
		case err := <-ready:
			return v.startErr(ctx, p, err)
		case <-p.Done():
			cancel()
			return v.died("the "+v.cfg.Kind+" stopped while starting", v.exitReason(p))
		case <-fatal:
			for _, f := range append([]string{ConsoleFile}, v.cfg.Logs...) {
				for _, l := range strings.Split(ReadLogTail(v.path(f), 4096), "\n") {
					if v.cfg.FatalLine(strings.TrimSpace(l)) {
						cancel()
						return v.died("the "+v.cfg.Kind+" failed to boot", "")
					}
				}
			}
		}
	}
}

// startErr is the error of a start whose agent call returned err.
func (v *VM) startErr(ctx context.Context, p *Process, err error) error {
	if err == nil {
		return nil
	}
	select {
	case <-p.Done():
		return v.died("the "+v.cfg.Kind+" stopped while starting", v.exitReason(p))
	case <-time.After(200 * time.Millisecond):
	}
	if ctx.Err() != nil {
		return errdefs.Classify(ctx.Err())
	}
	return errdefs.Unavailable("the %s's agent did not answer within %s%s", v.cfg.Kind, v.cfg.BootTimeout, v.Hint()).WithCause(err)
}

// died is the error for a QEMU that exited, with how (reason, "" if not
// known) and what the guest or QEMU said last.
func (v *VM) died(what, reason string) error {
	if reason != "" {
		what += " (" + reason + ")"
	}
	return errdefs.Unavailable("%s%s", what, v.Hint())
}

// exitReason is how QEMU process p ended, and whether its cgroup's
// memory limit killed something (a QEMU the OOM killer took says nothing
// in its log).
func (v *VM) exitReason(p *Process) string {
	reason := p.ExitReason()
	if v.cfg.Cgroup != "" {
		if n := cgroups().OOMKills(v.cfg.Cgroup); n > 0 {
			reason += fmt.Sprintf("; its cgroup's memory limit killed %d process(es)", n)
		}
	}
	return strings.TrimPrefix(reason, "; ")
}

// Hint is the end of the guest console or QEMU's log that explains a
// failure (": <line>"), for error messages, with host paths cut; "" if
// nothing does.
func (v *VM) Hint() string {
	var lines []string
	for _, f := range append(append([]string{ConsoleFile}, v.cfg.Logs...), LogFile) {
		t := ReadLogTail(v.path(f), 2048)
		for _, l := range strings.Split(t, "\n") {
			l = strings.TrimSpace(l)
			if strings.Contains(l, "qemu-system") || (v.cfg.HintLine != nil && v.cfg.HintLine(l)) {
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
	for _, p := range append([]string{v.cfg.Dir}, v.cfg.Redact...) {
		if p != "" {
			last = strings.ReplaceAll(last, p, "…")
		}
	}
	if len(last) > 300 {
		last = last[:300]
	}
	return ": " + last
}

// watch closes done when a QEMU process the VM did not end exits.
func (v *VM) watch(r *vmRun) {
	go func() {
		<-r.p.Done()
		v.mu.Lock()
		crashed := !r.intended && !v.destroyed
		if v.run == r {
			v.run = nil
		}
		if crashed {
			v.crashed = r
		}
		v.mu.Unlock()
		if crashed {
			v.cfg.Log.Warn(v.cfg.Kind+" exited by itself", slog.String("sandbox_id", v.cfg.ID), slog.String("hint", v.Hint()))
			v.closeDone()
		}
	}()
}

func (v *VM) closeDone() { v.doneOnce.Do(func() { close(v.done) }) }

// The guest's own ends, as its kernel says them on the console (at
// KERN_EMERG, so whatever the log level) before QEMU exits (-no-reboot:
// a reset ends QEMU too).
var guestEnds = []struct{ line, how string }{
	{"reboot: Power down", "powered the machine off"},
	{"reboot: Restarting system", "rebooted the machine"},
}

// EndedByGuest says, once the VM has stopped by itself, how its guest
// ended it, as a clause for "its workload …": powered it off, rebooted
// or reset it, or crashed its kernel through /proc/sysrq-trigger — what a
// workload that is root over its own kernel may do. It is "" when the
// platform failed or it cannot be told: QEMU died of a signal or an error,
// or was told to end from the host (it logs "terminating on signal"), or
// the guest's kernel panicked otherwise (its agent, PID 1, died, or the
// kernel failed). QEMU's exit status is known only for a QEMU this node
// process started; for one it adopted, only the kernel's own lines count.
// The console can be written by the guest, but only the guest can make
// QEMU exit cleanly, so a forged line changes nothing the guest did not do
// itself.
func (v *VM) EndedByGuest() string {
	select {
	case <-v.done:
	default:
		return ""
	}
	v.mu.Lock()
	r := v.crashed
	v.mu.Unlock()
	if r == nil {
		return ""
	}
	clean, known := r.p.ExitedCleanly()
	if known && !clean {
		return ""
	}
	console := ReadLogTail(v.path(ConsoleFile), 4096)
	if strings.Contains(console, "Kernel panic") {
		if strings.Contains(console, "sysrq triggered crash") {
			return "crashed its kernel through /proc/sysrq-trigger"
		}
		return ""
	}
	for _, e := range guestEnds {
		if strings.Contains(console, e.line) {
			return e.how
		}
	}
	if known && !strings.Contains(ReadLogTail(v.path(LogFile), 4096), "terminating on signal") {
		// A reset without the kernel's word: sysrq-trigger's b, a triple
		// fault.
		return "reset the machine"
	}
	return ""
}

// stop kills a QEMU process the VM ends on purpose.
func (v *VM) stop(r *vmRun) {
	v.mu.Lock()
	r.intended = true
	v.mu.Unlock()
	if !r.p.Kill(10 * time.Second) {
		v.cfg.Log.Warn("QEMU did not exit after SIGKILL", slog.String("sandbox_id", v.cfg.ID), slog.Int("pid", r.p.Pid))
	}
	os.Remove(v.cfg.AgentSock)
	os.Remove(v.cfg.QMPSock)
}

// Failed wraps an agent call that failed during a start as unavailable
// (infra), keeping cancellations and deadlines as they are.
func Failed(err error, what string) error {
	if e := errdefs.Classify(err); e.Kind == errdefs.KindCanceled || e.Kind == errdefs.KindDeadlineExceeded {
		return err
	}
	return errdefs.Unavailable("%s", what).WithCause(err)
}

// Adopt re-attaches the VM from its persisted state, as a new node
// process does: a paused VM needs its saved memory; a running one its
// QEMU (pid and start time) and an answering agent. It returns a Gone
// error if the VM no longer runs.
func (v *VM) Adopt(ctx context.Context) error {
	v.mu.Lock()
	st := v.st
	v.mu.Unlock()
	if st.Paused {
		if _, err := os.Stat(v.path(PauseFile)); err != nil {
			return errdefs.Gone("paused sandbox %s lost its saved memory", v.cfg.ID)
		}
		return nil
	}
	p, err := Adopt(st.Pid, st.StartTime)
	if err != nil {
		return errdefs.Gone("sandbox %s stopped while the node was down", v.cfg.ID)
	}
	run := &vmRun{p: p}
	v.mu.Lock()
	v.run = run
	v.mu.Unlock()
	v.watch(run)
	if _, err := v.client.Hello(ctx); err != nil {
		return errdefs.Gone("sandbox %s agent does not answer after the node restarted", v.cfg.ID).WithCause(err)
	}
	return nil
}

// Check returns nil while the VM runs or is paused, else a Gone error.
func (v *VM) Check() error {
	select {
	case <-v.done:
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	default:
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.destroyed {
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	if v.st.Paused {
		return nil
	}
	if v.run == nil || !v.run.p.Alive() {
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	return nil
}

// Usage is QEMU's resident memory and CPU time (the guest's and the
// emulation's); zero while paused.
func (v *VM) Usage() (rss int64, cpu time.Duration) {
	v.mu.Lock()
	r := v.run
	v.mu.Unlock()
	if r == nil {
		return 0, 0
	}
	return r.p.RSS(), r.p.CPUTime()
}

// Pause saves the VM's memory and devices to PauseFile and ends QEMU, so
// a paused VM holds no memory. It is idempotent. The VM counts as paused
// (Check answers nil) from the moment its memory is saved, so a call
// that breaks because QEMU goes away does not mistake the pause for a
// crash.
func (v *VM) Pause(ctx context.Context) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.destroyed {
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	if v.st.Paused {
		return nil
	}
	r := v.run
	if r == nil {
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	// The RAM goes in the stream: a pause's RAM would be mapped by one
	// VM alone (see ram.go).
	if err := v.saveLocked(ctx, v.path(PauseFile), ""); err != nil {
		os.Remove(v.path(PauseFile))
		return err
	}
	r.intended = true
	v.st = VMState{Paused: true, OOMBase: v.st.OOMBase}
	v.run = nil
	v.quit(r)
	return v.persistLocked()
}

func (v *VM) persistLocked() error {
	if v.cfg.Persist == nil {
		return nil
	}
	if err := v.cfg.Persist(v.st); err != nil {
		return errdefs.Internal(err, "persist the %s's state", v.cfg.Kind)
	}
	return nil
}

// saveLocked writes the running VM's memory and devices to path (and,
// with ram set, its RAM apart to ram when it is in a memfd; see ram.go)
// and leaves it stopped; on error the VM is continued.
func (v *VM) saveLocked(ctx context.Context, path, ram string) error {
	q, err := DialQMP(ctx, v.cfg.QMPSock)
	if err != nil {
		return v.callErrLocked(err, "reach the VM's monitor")
	}
	defer q.Close()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return errdefs.Internal(err, "create the memory snapshot file")
	}
	defer f.Close()
	ramPID := 0
	if ram != "" && v.st.RAM == "" {
		ramPID = v.run.p.Pid
	}
	if err := SaveState(ctx, q, f, ramPID, ram); err != nil {
		Cont(context.WithoutCancel(ctx), q)
		return v.callErrLocked(err, "save the VM's memory")
	}
	if err := f.Sync(); err != nil {
		Cont(context.WithoutCancel(ctx), q)
		return errdefs.Internal(err, "sync the memory snapshot")
	}
	return nil
}

// callErrLocked classifies a failure talking to QEMU: gone if it died.
func (v *VM) callErrLocked(err error, what string) error {
	if v.run == nil || !v.run.p.Alive() {
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	return errdefs.Internal(err, "%s", what)
}

// quit ends a stopped QEMU: quit through the monitor, SIGKILL if it
// lingers.
func (v *VM) quit(r *vmRun) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if q, err := DialQMP(ctx, v.cfg.QMPSock); err == nil {
		q.Execute(ctx, "quit", nil, nil)
		q.Close()
	}
	if !r.p.Wait(5 * time.Second) {
		r.p.Kill(10 * time.Second)
	}
	os.Remove(v.cfg.AgentSock)
	os.Remove(v.cfg.QMPSock)
}

// Resume restores a paused VM from its saved memory. It is idempotent.
func (v *VM) Resume(ctx context.Context) error {
	v.mu.Lock()
	if v.destroyed {
		v.mu.Unlock()
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	if !v.st.Paused {
		v.mu.Unlock()
		return nil
	}
	// Start takes mu itself; the node serializes pause, resume, snapshot
	// and destroy of one sandbox.
	v.mu.Unlock()
	f, err := os.Open(v.path(PauseFile))
	if err != nil {
		return errdefs.Gone("paused sandbox %s lost its saved memory", v.cfg.ID)
	}
	defer f.Close()
	if err := v.Start(ctx, &Restore{State: f}); err != nil {
		return err
	}
	v.mu.Lock()
	v.st.Paused = false
	err = v.persistLocked()
	v.mu.Unlock()
	os.Remove(v.path(PauseFile))
	return err
}

// SaveMachine writes the VM's memory and devices to memPath (and its RAM
// to ram, when it is in a memfd; see ram.go) and, while the VM is stopped
// (so disk and memory agree), calls copyDisks to copy its writable disks;
// then the VM continues. A paused VM's saved memory is copied as it is.
func (v *VM) SaveMachine(ctx context.Context, memPath, ram string, copyDisks func() error) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.destroyed {
		return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	}
	if v.st.Paused {
		if err := CopySparse(v.path(PauseFile), memPath); err != nil {
			return errdefs.Internal(err, "copy the paused VM's memory")
		}
	} else {
		if v.run == nil {
			return errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
		}
		if err := v.saveLocked(ctx, memPath, ram); err != nil {
			return err
		}
		defer func() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			if q, err := DialQMP(cctx, v.cfg.QMPSock); err == nil {
				if err := Cont(cctx, q); err != nil {
					v.cfg.Log.Warn("continue VM after snapshot", slog.String("sandbox_id", v.cfg.ID), slog.Any("error", err))
				}
				q.Close()
			}
		}()
	}
	// QEMU flushed the disks when the migration completed and the VM is
	// stopped.
	if err := copyDisks(); err != nil {
		return errdefs.Internal(err, "copy the writable disk")
	}
	return nil
}

// Monitor connects to the running VM's QEMU monitor, for commands beyond
// the lifecycle (screen, input). The caller closes it.
func (v *VM) Monitor(ctx context.Context) (*QMP, error) {
	v.mu.Lock()
	paused, destroyed, run := v.st.Paused, v.destroyed, v.run
	v.mu.Unlock()
	switch {
	case destroyed || (!paused && run == nil):
		return nil, errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
	case paused:
		return nil, errdefs.Conflict("sandbox %s is paused", v.cfg.ID)
	}
	q, err := DialQMP(ctx, v.cfg.QMPSock)
	if err != nil {
		if !run.p.Alive() {
			return nil, errdefs.Gone("sandbox %s has stopped", v.cfg.ID)
		}
		return nil, errdefs.Classify(err)
	}
	return q, nil
}

// Destroy kills QEMU and removes the VM's sockets and saved memory (the
// driver removes its disks). It is idempotent.
func (v *VM) Destroy() {
	v.mu.Lock()
	if v.destroyed {
		v.mu.Unlock()
		return
	}
	v.destroyed = true
	r := v.run
	st := v.st
	v.mu.Unlock()
	if r != nil {
		v.stop(r)
	} else if st.Pid > 0 {
		// Adopted but not watched, or a failed start: make sure.
		if p, err := Adopt(st.Pid, st.StartTime); err == nil {
			p.Kill(10 * time.Second)
		}
	}
	v.client.Close()
	v.release()
	os.Remove(v.cfg.AgentSock)
	os.Remove(v.cfg.QMPSock)
	os.Remove(v.path(PauseFile))
	if v.cfg.Cgroup != "" {
		if err := cgroups().Remove(v.cfg.Cgroup, 5*time.Second); err != nil {
			v.cfg.Log.Warn("remove the "+v.cfg.Kind+"'s cgroup", slog.String("sandbox_id", v.cfg.ID), slog.Any("error", err))
		}
	}
	v.closeDone()
}

// CgroupOf is the cgroup of sandbox id's QEMU, below parent (the
// sandboxes' cgroup parent): named as a container's is. Without a parent
// (cgroups off) it is "": none.
func CgroupOf(parent, id string) string {
	if parent == "" {
		return ""
	}
	return filepath.Join(parent, id)
}

// RestoreFiles prepares a start from the machine snapshot in dir: a
// sparse copy of its writable disk (diskFile) at disk, its memory state
// opened for the new QEMU's -incoming (the caller closes r.State), and
// its RAM file when the RAM was saved apart.
func RestoreFiles(dir, diskFile, disk string) (*Restore, error) {
	if err := CopySparse(filepath.Join(dir, diskFile), disk); err != nil {
		return nil, errdefs.Internal(err, "copy the snapshot's disk")
	}
	f, err := os.Open(filepath.Join(dir, MemoryFile))
	if err != nil {
		return nil, errdefs.NotFound("the machine snapshot has no memory state")
	}
	r := &Restore{State: f}
	if _, err := os.Stat(filepath.Join(dir, RAMFile)); err == nil {
		r.RAM = filepath.Join(dir, RAMFile)
	}
	return r, nil
}

// CgroupParent is the parent of a VM driver's QEMU cgroups: parent, once
// a cgroup made and removed below it (as each VM's start does) shows QEMU
// can be held to its sandbox's limits here, or "" (none) when it cannot
// or off is set. It says which in details["cgroup"], for the kind's
// capabilities, and warns when the host refuses.
func CgroupParent(parent string, off bool, kind string, details map[string]string, log *slog.Logger) string {
	if off {
		details["cgroup"] = "off (configured)"
		return ""
	}
	probe := CgroupOf(parent, "qemu-probe-"+strconv.Itoa(os.Getpid()))
	h := cgroups()
	_, err := h.Make(probe, Resources(1, 64, "kvm"))
	defer h.Remove(probe, time.Second)
	if err != nil {
		details["cgroup"] = "off: " + err.Error()
		log.Warn(kind+" run without cgroups of their own: their QEMU's CPU and memory are not limited", slog.Any("error", err))
		return ""
	}
	details["cgroup"] = fmt.Sprintf("%s/<id> (%s): CPU quota from cpu, memory limit from the guest's RAM plus QEMU's own", parent, h.Mode)
	return parent
}

// QEMUOverheadMiB is the memory a VM's QEMU may hold beyond the guest's
// RAM and TCG's translation buffer: its own heap, device state, I/O
// buffers and the page cache of the VM's disks (reclaimed first when the
// cgroup is at its limit).
const QEMUOverheadMiB = 256

// qemuPidsLimit bounds a QEMU's threads (vCPUs, I/O workers, RCU).
const qemuPidsLimit = 512

// Resources are the cgroup limits of a VM's QEMU: cpu cores of CPU time
// (0: no quota; a guest's vCPUs are whole, ceil(cpu), and the quota holds
// them to the sandbox's share), the guest's RAM plus TCG's translation
// buffer (from accel, the machine's -accel value) plus QEMUOverheadMiB of
// memory, and a bound on threads. A guest cannot spend more than its RAM
// on its own workload (its kernel's OOM killer acts first); the memory
// limit bounds what QEMU spends for it, so a VM cannot grow QEMU past
// what its sandbox was given.
func Resources(cpu float64, guestMiB int64, accel string) *specs.LinuxResources {
	mem := (guestMiB + tbMiB(accel) + QEMUOverheadMiB) << 20
	res := &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &mem}, Pids: &specs.LinuxPids{Limit: qemuPidsLimit}}
	if cpu > 0 {
		period := uint64(100000)
		quota := max(int64(cpu*float64(period)), 1000)
		res.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	return res
}

// tbMiB is the translation buffer an -accel value gives TCG (QEMU's
// default, up to 1 GiB, when it names none; none under KVM).
func tbMiB(accel string) int64 {
	name, opts, _ := strings.Cut(accel, ",")
	if name != "tcg" {
		return 0
	}
	for _, o := range strings.Split(opts, ",") {
		if v, ok := strings.CutPrefix(o, "tb-size="); ok {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil {
				return n
			}
		}
	}
	return 1024
}

// CopySparse copies a disk or memory file keeping its holes (reflinked
// where the file system can).
func CopySparse(src, dst string) error {
	out, err := exec.Command("cp", "--sparse=always", "--reflink=auto", src, dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("copy %s: %w: %s", filepath.Base(src), err, bytes.TrimSpace(out))
	}
	return nil
}

// RunDir is the directory of a driver's VM sockets (name: the driver's)
// for the state directory stateDir: short, as a socket's path is limited
// to 108 bytes, and one per state directory, so nodes on one host keep
// apart.
func RunDir(stateDir, name string) string {
	abs, _ := filepath.Abs(stateDir)
	h := sha256.Sum256([]byte(abs))
	return filepath.Join("/run/dsec", hex.EncodeToString(h[:4]), name)
}

// AgentSock is VM id's agent channel socket in runDir.
func AgentSock(runDir, id string) string { return filepath.Join(runDir, id+".agent") }

// QMPSock is VM id's monitor socket in runDir.
func QMPSock(runDir, id string) string { return filepath.Join(runDir, id+".qmp") }

// SweepVMs kills the QEMU processes started with a monitor or agent socket
// in runDir whose VM ID keep is false for (leftovers a node no longer
// knows) and removes their sockets and, with cgroupParent set, their
// cgroups. It returns how many it ended.
func SweepVMs(runDir, cgroupParent string, keep func(id string) bool) int {
	n := 0
	for _, vm := range VMProcesses() {
		if !strings.Contains(vm.Cmdline, "unix:"+runDir+"/") || keep(vm.ID) {
			continue
		}
		if p, err := Adopt(vm.Pid, proc.StartTime(vm.Pid)); err == nil {
			p.Kill(10 * time.Second)
		}
		os.Remove(AgentSock(runDir, vm.ID))
		os.Remove(QMPSock(runDir, vm.ID))
		if cg := CgroupOf(cgroupParent, vm.ID); cg != "" {
			cgroups().Remove(cg, 5*time.Second)
		}
		n++
	}
	return n
}

// VMProcess is a live QEMU process of a dsec VM.
type VMProcess struct {
	ID      string // from -name dsec-<ID>
	Pid     int
	Cmdline string // arguments separated by NUL bytes
}

// VMProcesses lists the live (not zombie) QEMU processes of dsec VMs.
func VMProcesses() []VMProcess {
	var out []VMProcess
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(b, []byte("\x00-name\x00dsec-")) {
			continue
		}
		if st, _ := os.ReadFile("/proc/" + e.Name() + "/stat"); bytes.Contains(st, []byte(") Z ")) {
			continue
		}
		args := strings.Split(string(b), "\x00")
		for k := 0; k+1 < len(args); k++ {
			if args[k] == "-name" && strings.HasPrefix(args[k+1], "dsec-") {
				out = append(out, VMProcess{ID: strings.TrimPrefix(args[k+1], "dsec-"), Pid: pid, Cmdline: string(b)})
			}
		}
	}
	return out
}
