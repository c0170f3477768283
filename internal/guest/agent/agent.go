// Package agent is dsec-guest, the agent inside every container and VM
// sandbox. It starts and tracks processes (streams, stdin, signals, PTYs,
// background processes a later call can attach to) and serves filesystem
// operations, one call per connection (see api/dsec/guest/v1).
//
// The agent is the sandbox's init: it reaps every process, ignores every
// signal a process in the sandbox can send (see ignoreSignals), lives in
// cgroups of its own where the node provides them (see Shield), so the
// sandbox's OOM killer and pids limit never reach it, and is not dumpable,
// so processes in the sandbox cannot ptrace it or read its file
// descriptors. Its channel to the node is a listening socket it
// inherits; the socket has no path inside the sandbox.
package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// Version is the agent's protocol version.
const Version = "1"

// Agent serves the guest protocol.
type Agent struct {
	log   *slog.Logger
	procs *procTable
	boot  time.Time

	// powerOff ends the sandbox at its deadline by powering the machine
	// off (the agent is a service of a full VM, not its init).
	powerOff bool

	// spawner forks every process (nil: from any thread, no cgroups);
	// spoolDir holds spooled output (nil: memory). Both are set before
	// Serve.
	spawner  *Spawner
	spoolDir *os.File

	mu       sync.Mutex
	deadline *time.Timer
	env      []string // added to the agent's own environment for processes
	runner   *runner  // the function runner, if started

	calls callSlots // function calls' storage (call.go)
	ports portListeners
}

// New returns an agent. Call Harden once, early, when running as a
// sandbox's init.
func New(log *slog.Logger) *Agent {
	a := &Agent{log: log, procs: newProcTable(), boot: time.Now()}
	go a.procs.reap()
	return a
}

// UseSpawner makes the agent start every process with sp (see Shield).
// Call it before Serve.
func (a *Agent) UseSpawner(sp *Spawner) {
	a.spawner = sp
	a.procs.mu.Lock()
	a.procs.onReap = sp.reaped
	a.procs.mu.Unlock()
	sp.exitsTo(a.procs.exited)
}

// SpoolIn makes the agent spool collected output in dir, a directory
// outside the sandbox's reach (see tailSpool). Call it before Serve.
func (a *Agent) SpoolIn(dir *os.File) { a.spoolDir = dir }

// Harden applies the protections an agent running as a sandbox's init
// needs: no ptrace or /proc/<pid>/fd access from the sandbox, no death by
// any signal a process can send (see ignoreSignals), and child-reaping for
// orphans.
func Harden() {
	unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	ignoreSignals()
}

// Serve accepts connections on l until l fails.
func (a *Agent) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return err
		}
		go a.serveConn(c)
	}
}

// connSink sends a process's events on one connection.
type connSink struct{ w *guest.Writer }

func (s connSink) send(m *guestv1.ServerMsg) error { return s.w.Write(m) }

func (a *Agent) serveConn(c net.Conn) {
	defer c.Close()
	r := guest.NewReader(c)
	w := guest.NewWriter(c)
	call := new(guestv1.ClientMsg)
	if err := r.Read(call); err != nil {
		return
	}
	if h := call.GetHello(); h != nil && h.Keep {
		a.serveKept(r, w)
		return
	}
	a.serveCall(call, c, r, w, nil)
}

// serveKept serves the calls of a kept connection one after another (see
// the protocol's top comment), from its Hello's answer until the client
// closes it. One goroutine reads the connection throughout: the next call
// waits there until the previous one is answered, and its end (gone) is
// the caller going away for an exec running then.
func (a *Agent) serveKept(r *guest.Reader, w *guest.Writer) {
	h := a.hello()
	h.Keep = true
	if w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Hello{Hello: h}}) != nil {
		return
	}
	calls := make(chan *guestv1.ClientMsg)
	gone, quit := make(chan struct{}), make(chan struct{})
	defer close(quit)
	go func() {
		defer close(gone)
		for {
			m := new(guestv1.ClientMsg)
			if r.Read(m) != nil {
				return
			}
			select {
			case calls <- m:
			case <-quit:
				return
			}
		}
	}()
	for {
		select {
		case m := <-calls:
			a.serveCall(m, nil, nil, w, gone)
		case <-gone:
			return
		}
	}
}

// serveCall serves one call. On a connection of its own c and r are the
// connection and its reader; on a kept one they are nil, gone is closed
// when the connection ends, and calls that read more of the connection
// are refused.
func (a *Agent) serveCall(call *guestv1.ClientMsg, c net.Conn, r *guest.Reader, w *guest.Writer, gone <-chan struct{}) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	done := func() { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Done{Done: &guestv1.Done{}}}) }
	if r == nil && !keptCall(call) {
		fail(invalid("call %T needs a connection of its own", call.Msg))
		return
	}
	switch m := call.Msg.(type) {
	case *guestv1.ClientMsg_Hello:
		h := a.hello()
		h.Keep = r == nil
		w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Hello{Hello: h}})
	case *guestv1.ClientMsg_Exec:
		a.serveExec(m.Exec, r, w, gone)
	case *guestv1.ClientMsg_Attach:
		p := a.procs.find(m.Attach.Id, m.Attach.Tag)
		if p == nil {
			fail(notFound("no process %q", m.Attach.Id+m.Attach.Tag))
			return
		}
		a.attach(p, !m.Attach.LiveOnly, r, w)
	case *guestv1.ClientMsg_Input:
		p := a.procs.find(m.Input.Id, "")
		if p == nil {
			fail(notFound("no process %q", m.Input.Id))
			return
		}
		if err := deliverInput(p, m.Input); err != nil {
			fail(err)
			return
		}
		done()
	case *guestv1.ClientMsg_Signal:
		p := a.procs.find(m.Signal.Id, "")
		if p == nil {
			fail(notFound("no process %q", m.Signal.Id))
			return
		}
		if err := p.signal(syscall.Signal(m.Signal.Signal)); err != nil {
			fail(err)
			return
		}
		done()
	case *guestv1.ClientMsg_Resize:
		p := a.procs.find(m.Resize.Id, "")
		if p == nil {
			fail(notFound("no process %q", m.Resize.Id))
			return
		}
		if err := p.resize(m.Resize.Rows, m.Resize.Cols); err != nil {
			fail(invalid("%v", err))
			return
		}
		done()
	case *guestv1.ClientMsg_ListProcs:
		w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Procs{Procs: &guestv1.Procs{Procs: a.procs.list()}}})
	case *guestv1.ClientMsg_ReadFile:
		serveRead(m.ReadFile, w)
	case *guestv1.ClientMsg_WriteFile:
		serveWrite(m.WriteFile, r, w)
	case *guestv1.ClientMsg_Watch:
		serveWatch(m.Watch, r, w)
	case *guestv1.ClientMsg_DialPort:
		serveDialPort(m.DialPort, c, r, w)
	case *guestv1.ClientMsg_ListenPort:
		a.serveListenPort(m.ListenPort, c, r, w)
	case *guestv1.ClientMsg_TakeConn:
		a.serveTakeConn(m.TakeConn, c, r, w)
	case *guestv1.ClientMsg_Sync:
		unix.Sync()
		done()
	case *guestv1.ClientMsg_SetEnv:
		a.mu.Lock()
		a.env = mergeEnv(a.env, m.SetEnv.Env)
		a.mu.Unlock()
		done()
	case *guestv1.ClientMsg_StartRunner:
		if err := a.startRunner(m.StartRunner); err != nil {
			fail(err)
			return
		}
		done()
	case *guestv1.ClientMsg_Call:
		w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_CallResult{CallResult: a.runCall(m.Call)}})
	case *guestv1.ClientMsg_SetDeadline:
		a.SetDeadline(time.UnixMilli(m.SetDeadline.UnixMs))
		done()
	default:
		reply, err := fileCall(call)
		if err != nil {
			fail(err)
			return
		}
		w.Write(reply)
	}
}

// PowerOffAtDeadline makes the deadline power the machine off instead of
// ending the agent: in a full VM the agent is a service of the guest's own
// init, and only the machine's end ends the sandbox. Call it before
// SetDeadline.
func (a *Agent) PowerOffAtDeadline() { a.powerOff = true }

// SetDeadline makes the agent end the sandbox at t (the zero time clears
// it): every process is killed and the agent exits, so the runtime tears
// the sandbox down even when no node is there to do it (in a full VM the
// machine powers off).
func (a *Agent) SetDeadline(t time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.deadline != nil {
		a.deadline.Stop()
		a.deadline = nil
	}
	if t.IsZero() || t.Unix() <= 0 {
		return
	}
	a.deadline = time.AfterFunc(time.Until(t), func() {
		a.log.Warn("sandbox deadline passed; ending the sandbox")
		if a.powerOff {
			unix.Sync()
			unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
		}
		if os.Getpid() == 1 {
			syscall.Kill(-1, syscall.SIGKILL)
		}
		os.Exit(0)
	})
}

// baseEnv is the environment processes start from: the agent's own (the
// image's and the spec's, under a container runtime) and SetEnv's. The
// HOME=/root the runtimes give the agent, root's home, is left out:
// withLoginEnv sets each process's HOME to its user's home. (A HOME=/root
// that an image or spec sets under a container runtime is left out with
// it; any other HOME they set holds for every user.)
func (a *Agent) baseEnv() []string {
	own := os.Environ()
	for i, e := range own {
		if e == "HOME="+rootIdentity.home {
			own = append(own[:i:i], own[i+1:]...)
			break
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return mergeEnv(own, a.env)
}

func (a *Agent) hello() *guestv1.HelloReply {
	var u unix.Utsname
	unix.Uname(&u)
	host, _ := os.Hostname()
	return &guestv1.HelloReply{
		Version:    Version,
		Pid:        int32(os.Getpid()),
		Kernel:     unix.ByteSliceToString(u.Release[:]),
		Hostname:   host,
		BootUnixMs: a.boot.UnixMilli(),
	}
}

// keptCall reports whether call may run on a kept connection: every
// message after it goes from the agent to the client.
func keptCall(call *guestv1.ClientMsg) bool {
	switch m := call.Msg.(type) {
	case *guestv1.ClientMsg_Exec:
		return m.Exec.Collect && !m.Exec.StdinOpen
	case *guestv1.ClientMsg_Attach, *guestv1.ClientMsg_ReadFile, *guestv1.ClientMsg_WriteFile,
		*guestv1.ClientMsg_Watch, *guestv1.ClientMsg_DialPort, *guestv1.ClientMsg_ListenPort,
		*guestv1.ClientMsg_TakeConn, *guestv1.ClientMsg_Data, *guestv1.ClientMsg_End:
		return false
	}
	return true
}

func (a *Agent) serveExec(x *guestv1.Exec, r *guest.Reader, w *guest.Writer, gone <-chan struct{}) {
	s := connSink{w}
	var started func(*proc)
	if !x.Collect {
		started = func(p *proc) {
			w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Started{Started: &guestv1.Started{Id: p.id, Pid: int32(p.pid)}}})
		}
	}
	p, err := a.start(x, s, started)
	if err != nil {
		// A command that cannot start is the task's failure, reported as an
		// exit (127 like a shell), not as a broken call.
		w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Exit{Exit: &guestv1.Exit{
			ExitCode: 127, Error: err.Error(), Stderr: []byte(err.Error() + "\n"),
			PidsLimited: errors.Is(err, syscall.EAGAIN),
		}}})
		return
	}
	// Collect mode too: stdin larger than a frame arrives as Input.
	a.follow(p, s, r, gone)
}

// attach streams an existing process: replayed output (with replay), then
// live events.
func (a *Agent) attach(p *proc, replay bool, r *guest.Reader, w *guest.Writer) {
	s := connSink{w}
	// The answer and the subscription are one step: output the process
	// writes once the client has its answer (and may send input) is live
	// output, never taken for what was buffered before the attach.
	if err := p.subscribe(s, replay, &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Started{Started: &guestv1.Started{Id: p.id, Pid: int32(p.pid)}}}); err != nil {
		return
	}
	a.follow(p, s, r, nil)
}

// follow applies the client's input, signals and resizes read from r until
// the process exits or the client goes away (r ends, or gone is closed on a
// kept connection, which carries none of them). The process outlives the
// connection.
func (a *Agent) follow(p *proc, s sink, r *guest.Reader, gone <-chan struct{}) {
	if r != nil {
		gone = a.control(p, r)
	}
	select {
	case <-p.done:
	case <-gone:
		p.unsubscribe(s)
	}
}

// control applies the Input, Signal and Resize messages read from r to p
// until r ends, and then closes the channel it returns.
func (a *Agent) control(p *proc, r *guest.Reader) <-chan struct{} {
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for {
			m := new(guestv1.ClientMsg)
			if err := r.Read(m); err != nil {
				return
			}
			switch v := m.Msg.(type) {
			case *guestv1.ClientMsg_Input:
				deliverInput(p, v.Input)
			case *guestv1.ClientMsg_Signal:
				p.signal(syscall.Signal(v.Signal.Signal))
			case *guestv1.ClientMsg_Resize:
				p.resize(v.Resize.Rows, v.Resize.Cols)
			}
		}
	}()
	return gone
}

func deliverInput(p *proc, in *guestv1.Input) error {
	if len(in.Data) > 0 {
		if err := p.writeStdin(in.Data); err != nil {
			return invalid("%v", err)
		}
	}
	if in.Eof {
		p.closeStdin()
	}
	return nil
}

// ListenFD returns the listening socket inherited as file descriptor fd.
func ListenFD(fd int) (net.Listener, error) {
	unix.CloseOnExec(fd)
	f := os.NewFile(uintptr(fd), "listener")
	if f == nil {
		return nil, errors.New("bad listener fd")
	}
	defer f.Close()
	return net.FileListener(f)
}

// errors with wire codes

type codedError struct {
	code string
	msg  string
}

func (e *codedError) Error() string { return e.msg }

// WireCode is the code guest.ToWire sends.
func (e *codedError) WireCode() string { return e.code }

func notFound(format string, args ...any) error {
	return &codedError{guest.CodeNotFound, fmt.Sprintf(format, args...)}
}

func invalid(format string, args ...any) error {
	return &codedError{guest.CodeInvalid, fmt.Sprintf(format, args...)}
}
