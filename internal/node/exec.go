package node

import (
	"context"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/substrate"
)

const (
	maxArgs      = 4096
	maxArgBytes  = 1 << 20
	maxStdin     = 16 << 20
	keepaliveGap = 15 * time.Second
)

// guestExec turns an API exec request into the agent's.
func (n *Node) guestExec(c *ctr, req *dsecv1.ExecRequest, collect bool) (*guestv1.Exec, error) {
	argv := req.GetArgv()
	switch {
	case len(argv) > 0 && req.GetCmd() != "":
		return nil, errdefs.Invalid("give argv or cmd, not both")
	case len(argv) == 0 && req.GetCmd() == "":
		return nil, errdefs.Invalid("argv or cmd is required")
	case req.GetCmd() != "":
		argv = []string{"/bin/sh", "-c", req.GetCmd()}
	}
	if len(argv) > maxArgs {
		return nil, errdefs.Invalid("at most %d arguments", maxArgs)
	}
	total := 0
	for _, a := range argv {
		total += len(a)
		if strings.IndexByte(a, 0) >= 0 {
			return nil, errdefs.Invalid("arguments must not contain NUL bytes")
		}
	}
	if total > maxArgBytes {
		return nil, errdefs.Invalid("arguments larger than %d bytes", maxArgBytes)
	}
	if err := validEnv(req.GetEnv()); err != nil {
		return nil, err
	}
	if len(req.GetStdin()) > maxStdin {
		return nil, errdefs.Invalid("stdin larger than %d bytes; stream it with stdin_open and WriteStdin", maxStdin)
	}
	timeout := n.cfg.DefaultExecTimeout
	if t := req.GetTimeoutS(); t != 0 {
		// In seconds, NaN and infinities refused: no Duration overflow.
		if math.IsNaN(t) || t < 0 || t > n.cfg.MaxExecTimeout.Seconds() {
			return nil, errdefs.Invalid("timeout_s %g out of range (0, %g]", t, n.cfg.MaxExecTimeout.Seconds())
		}
		timeout = time.Duration(t * float64(time.Second))
	}
	maxOut := n.cfg.DefaultOutputBytes
	if m := req.GetMaxOutputBytes(); m != 0 {
		if m < 0 || m > n.cfg.MaxOutputBytes {
			return nil, errdefs.Invalid("max_output_bytes %d out of range (0, %d]", m, n.cfg.MaxOutputBytes)
		}
		maxOut = m
	}
	if req.GetStdinOpen() && collect {
		return nil, errdefs.Invalid("stdin_open needs ExecStream")
	}
	if len(req.GetTag()) > 128 {
		return nil, errdefs.Invalid("tag longer than 128 bytes")
	}
	env := make([]string, 0, len(req.GetEnv()))
	for k, v := range req.GetEnv() {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	// No cwd: the working directory, else (the agent's default) the
	// user's home; a relative one is relative to that (relPath).
	cwd := req.GetCwd()
	if cwd == "" {
		cwd = c.workdir
	} else {
		cwd = relPath(c.workdir, cwd)
	}
	user := req.GetUser()
	if user == "" {
		user = c.user
	}
	return &guestv1.Exec{
		Argv: argv, Env: env, Cwd: cwd, User: user,
		StdinOpen: req.GetStdinOpen(), StdinData: req.GetStdin(),
		TimeoutMs: timeout.Milliseconds(), MaxOutput: maxOut,
		Pty: req.GetPty(), Rows: req.GetPtyRows(), Cols: req.GetPtyCols(),
		Collect: collect, Tag: req.GetTag(),
	}, nil
}

// Exec runs a command to completion and logs it. With a request ID it is
// exactly-once: a repeat is answered from the trajectory log.
func (n *Node) Exec(ctx context.Context, req *dsecv1.ExecRequest) (_ *dsecv1.ExecResult, err error) {
	defer n.m.Observe(ctx, metrics.OpExec, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return nil, err
	}
	x, err := n.guestExec(c, req, true)
	if err != nil {
		return nil, err
	}
	e, replay, err := n.logged(ctx, s, n.execMutation(c, req, x), func(e *dsecv1.LogEntry) error {
		lost := n.loadFailures(s)
		exit, err := c.guest.Run(ctx, x)
		if err != nil {
			return err
		}
		if err := n.imageDataLost(s, exit.ExitCode != 0 || exit.Signal != 0, lost); err != nil {
			return err
		}
		e.Result = n.result(s, exit, "")
		return nil
	})
	switch {
	case err != nil:
		return nil, n.callFailed(s, err)
	case replay != nil:
		return replayed(replay), nil
	}
	e.Result.Seq = e.Seq
	return e.Result, nil
}

// execMutation is an exec as the trajectory log records it (its stdin
// kept as a blob, for replay).
func (n *Node) execMutation(c *ctr, req *dsecv1.ExecRequest, x *guestv1.Exec) mutation {
	env := map[string]string{}
	for k, v := range req.GetEnv() {
		env[k] = v
	}
	e := &dsecv1.LogEntry{Op: "exec", Container: c.name, Argv: x.Argv, Cwd: x.Cwd, Env: env, User: x.User, TimeoutS: float64(x.TimeoutMs) / 1000}
	if len(x.StdinData) > 0 {
		e.StdinDigest = n.logs.PutBlob(x.StdinData)
	}
	m := mutation{entry: e, requestID: req.GetRequestId()}
	if m.requestID != "" {
		keys := make([]string, 0, len(env))
		for k, v := range env {
			keys = append(keys, k+"="+v)
		}
		sort.Strings(keys)
		m.fingerprint = append(append([]string{"exec", x.Cwd, x.User, e.StdinDigest, fmt.Sprint(x.Pty)}, x.Argv...), keys...)
	}
	return m
}

// imageDataLost is the error of a command that failed (failed) while
// reads of its sandbox's image data failed (a layer loaded on demand whose
// source, a registry or another node, did not answer or answered wrong:
// the process read EIO), lost being the count of such failures before it
// started: the platform's failure, not the task's result. In a sandbox
// whose layers loaded on demand lost their blob server (killed, or gone
// with the host) every failed command is: its reads of data not yet in
// the page cache fail, and the node cannot tell which did. A command that
// succeeded is answered as it is.
func (n *Node) imageDataLost(s *sandbox, failed bool, lost int64) error {
	if !failed || !s.lazy {
		return nil
	}
	if n.images.DataLost(s.layers, s.created) {
		return errdefs.Unavailable("the command failed in a sandbox whose image, loaded on demand, lost the server of its data (the blob server stopped): the image data it had not yet read can no longer be read, so the failure may be the platform's; recreate the sandbox")
	}
	if n.loadFailures(s) <= lost {
		return nil
	}
	return errdefs.Unavailable("the command failed while its sandbox's image data could not be loaded: a layer loaded on demand could not be read from its source (a registry or another node); the sandbox is up, retry when the source answers")
}

// loadFailures counts the failed reads of sandbox s's image data loaded
// on demand (none for an image held whole).
func (n *Node) loadFailures(s *sandbox) int64 {
	if !s.lazy {
		return 0
	}
	return n.images.LoadFailures(s.layers)
}

// replayed is a logged exec's result, answered again.
func replayed(e *dsecv1.LogEntry) *dsecv1.ExecResult {
	r := proto.Clone(e.GetResult()).(*dsecv1.ExecResult)
	if r == nil {
		r = &dsecv1.ExecResult{}
	}
	r.Seq, r.Replayed = e.Seq, true
	return r
}

func (n *Node) result(s *sandbox, x *guestv1.Exit, pid string) *dsecv1.ExecResult {
	r := &dsecv1.ExecResult{
		ExitCode: x.ExitCode, Stdout: x.Stdout, Stderr: x.Stderr, TimedOut: x.TimedOut,
		Truncated: x.Truncated, DurationMs: x.DurationUs / 1000, ProcessId: pid,
	}
	if x.Signal != 0 {
		r.Signal = strings.TrimPrefix(unix.SignalName(syscall.Signal(x.Signal)), "SIG")
	}
	if x.ExitCode != 0 || x.Signal != 0 || x.TimedOut {
		// A command that failed may have failed of the sandbox's limits
		// (a memory bomb, a fork bomb): the task's failure, named.
		r.OomKilled, r.PidsLimited = s.limitsHitSince()
	}
	r.PidsLimited = r.PidsLimited || x.PidsLimited
	return r
}

// limitsHitSince reports whether the sandbox's memory limit killed a
// process, and whether its process limit refused a fork, since the last
// check.
func (s *sandbox) limitsHitSince() (oom, pids bool) {
	st, err := s.inst.Stats(context.Background())
	if err != nil {
		return false, false
	}
	oom = st.OOMKills > s.oomKills.Swap(st.OOMKills)
	pids = st.PidsLimitHits > s.pidsHits.Swap(st.PidsLimitHits)
	return oom, pids
}

// callFailed classifies an agent call failure: a broken channel to a dead
// sandbox is "gone" (infra), and the sandbox is cleaned up; to one its
// workload ended (substrate.TaskEnder), "gone", the task's doing.
func (n *Node) callFailed(s *sandbox, err error) error {
	if !errdefs.Is(err, errdefs.KindUnavailable) {
		return err
	}
	// Such a sandbox stops a moment after its channel breaks.
	if e := taskEnd(s, 5*time.Second); e != nil {
		go n.release(context.Background(), s, e)
		g := errdefs.Gone("sandbox %s ended: %s", s.id, e.reason).WithCause(err)
		g.Infra = false // the task's doing
		return g
	}
	if cerr := s.inst.Check(context.Background()); cerr != nil {
		go n.release(context.Background(), s, &end{reason: "the sandbox died during a call", cause: "died", infra: true})
		return errdefs.Gone("sandbox %s died during the call", s.id).WithCause(err)
	}
	return err
}

// taskEnd is the end of a sandbox whose instance its own workload ended
// (substrate.TaskEnder: runtime gvisor, by reaching a limit or killing the
// agent; a VM's guest, by ending its machine), or nil if it did not (or
// has not stopped within wait). Such an end is the task's, not the
// platform's.
func taskEnd(s *sandbox, wait time.Duration) *end {
	te, ok := s.inst.(substrate.TaskEnder)
	if !ok {
		return nil
	}
	select {
	case <-s.inst.Done():
	default:
		select {
		case <-s.inst.Done():
		case <-time.After(wait):
			return nil
		}
	}
	how := te.EndedByTask()
	if how == "" {
		return nil
	}
	cause := "workload_exit"
	if how == substrate.EndedByMemoryLimit {
		cause = "oom" // its memory cgroup's OOM kill ended it whole
	}
	what := "runtime " + s.spec.Runtime
	if s.spec.Runtime == "" {
		what = "kind " + s.spec.Kind
	}
	return &end{reason: fmt.Sprintf("its workload %s, which ends a sandbox of %s", how, what), cause: cause}
}

// ExecStream runs a command and streams its events to send. With a
// request ID, a repeat replays the logged output and exit.
func (n *Node) ExecStream(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) (err error) {
	defer n.m.Observe(ctx, metrics.OpExec, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	x, err := n.guestExec(c, req, false)
	if err != nil {
		return err
	}
	var res *dsecv1.ExecResult
	e, replay, err := n.logged(ctx, s, n.execMutation(c, req, x), func(e *dsecv1.LogEntry) error {
		pg, err := c.procs()
		if err != nil {
			return err
		}
		lost := n.loadFailures(s)
		p, err := pg.Start(ctx, x)
		if err != nil {
			return err
		}
		if res, e.Result, err = n.pump(ctx, s, p, send, x.MaxOutput); err != nil {
			return err
		}
		return n.imageDataLost(s, res.ExitCode != 0 || res.Signal != "", lost)
	})
	switch {
	case err != nil:
		return n.callFailed(s, err)
	case replay != nil:
		return sendReplay(replayed(replay), send)
	}
	res.Seq = e.Seq
	return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exit{Exit: res}})
}

// sendReplay streams a logged result as events.
func sendReplay(r *dsecv1.ExecResult, send func(*dsecv1.ExecEvent) error) error {
	if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: r.ProcessId}}}); err != nil {
		return err
	}
	if len(r.Stdout) > 0 {
		if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: r.Stdout}}); err != nil {
			return err
		}
	}
	if len(r.Stderr) > 0 {
		if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stderr{Stderr: r.Stderr}}); err != nil {
			return err
		}
	}
	exit := proto.Clone(r).(*dsecv1.ExecResult)
	exit.Stdout, exit.Stderr = nil, nil
	return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exit{Exit: exit}})
}

// ConnectProcess attaches to a running or recently finished process.
func (n *Node) ConnectProcess(ctx context.Context, req *dsecv1.ConnectProcessRequest, send func(*dsecv1.ExecEvent) error) error {
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	if req.GetProcessId() == "" && req.GetTag() == "" {
		return errdefs.Invalid("process_id or tag is required")
	}
	pg, err := c.procs()
	if err != nil {
		return err
	}
	p, err := pg.Attach(ctx, req.GetProcessId(), req.GetTag(), req.GetLiveOnly())
	if err != nil {
		return n.callFailed(s, err)
	}
	res, _, err := n.pump(ctx, s, p, send, n.cfg.DefaultOutputBytes)
	if err != nil {
		return err
	}
	return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exit{Exit: res}})
}

// pump forwards a process's events but its exit, with keepalives on quiet
// streams, and returns the exit, as sent and as logged (with head and tail
// of the output). The process keeps running if the caller goes away.
func (n *Node) pump(ctx context.Context, s *sandbox, p *guest.Process, send func(*dsecv1.ExecEvent) error, maxOut int64) (res, logged *dsecv1.ExecResult, err error) {
	defer p.Close()
	if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: p.ID, Pid: p.Pid}}}); err != nil {
		return nil, nil, err
	}
	type msg struct {
		m   *guestv1.ServerMsg
		err error
	}
	ch := make(chan msg, 16)
	go func() {
		for {
			m, err := p.Recv()
			ch <- msg{m, err}
			if err != nil || m.GetExit() != nil {
				return
			}
		}
	}()
	var out, errOut headTail
	out.max, errOut.max = maxOut, maxOut
	tick := time.NewTicker(keepaliveGap)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, nil, errdefs.Classify(ctx.Err())
		case <-tick.C:
			if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Keepalive{Keepalive: true}}); err != nil {
				return nil, nil, err
			}
			s.touch()
		case r := <-ch:
			if r.err != nil {
				return nil, nil, n.callFailed(s, r.err)
			}
			var ev *dsecv1.ExecEvent
			switch v := r.m.Msg.(type) {
			case *guestv1.ServerMsg_Output:
				if v.Output.Fd == 2 {
					errOut.add(v.Output.Data)
					ev = &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stderr{Stderr: v.Output.Data}}
				} else {
					out.add(v.Output.Data)
					ev = &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: v.Output.Data}}
				}
			case *guestv1.ServerMsg_Exit:
				s.touch()
				res := n.result(s, v.Exit, p.ID)
				logged := proto.Clone(res).(*dsecv1.ExecResult)
				logged.Stdout, logged.Stderr = out.bytes(), errOut.bytes()
				logged.Truncated = logged.Truncated || out.cut || errOut.cut
				return res, logged, nil
			default:
				continue
			}
			if err := send(ev); err != nil {
				return nil, nil, err
			}
		}
	}
}

// headTail keeps the first and last max/2 bytes of a stream.
type headTail struct {
	max        int64
	head, tail []byte
	cut        bool
}

func (h *headTail) add(b []byte) {
	half := int(h.max / 2)
	if room := half - len(h.head); room > 0 {
		k := min(room, len(b))
		h.head = append(h.head, b[:k]...)
		b = b[k:]
	}
	if len(b) == 0 {
		return
	}
	h.tail = append(h.tail, b...)
	if rest := int(h.max) - half; len(h.tail) > rest {
		h.cut = true
		h.tail = append(h.tail[:0], h.tail[len(h.tail)-rest:]...)
	}
}

func (h *headTail) bytes() []byte { return append(append([]byte(nil), h.head...), h.tail...) }

// WriteStdin writes to a process's stdin.
func (n *Node) WriteStdin(ctx context.Context, req *dsecv1.WriteStdinRequest) error {
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	if req.GetProcessId() == "" {
		return errdefs.Invalid("process_id is required")
	}
	if len(req.GetData()) > maxStdin {
		return errdefs.Invalid("stdin chunk larger than %d bytes", maxStdin)
	}
	pg, err := c.procs()
	if err != nil {
		return err
	}
	if err := pg.InputProcess(ctx, req.GetProcessId(), req.GetData(), req.GetClose()); err != nil {
		return n.callFailed(s, err)
	}
	return nil
}

// SignalProcess signals a process group.
func (n *Node) SignalProcess(ctx context.Context, req *dsecv1.SignalProcessRequest) error {
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	sig, err := ParseSignal(req.GetSignal())
	if err != nil {
		return err
	}
	pg, err := c.procs()
	if err != nil {
		return err
	}
	if err := pg.SignalProcess(ctx, req.GetProcessId(), sig); err != nil {
		return n.callFailed(s, err)
	}
	return nil
}

// ParseSignal accepts "TERM", "SIGTERM" or "15".
func ParseSignal(name string) (syscall.Signal, error) {
	if name == "" {
		return syscall.SIGTERM, nil
	}
	if v, err := strconv.Atoi(name); err == nil && v > 0 && v < 65 {
		return syscall.Signal(v), nil
	}
	s := unix.SignalNum("SIG" + strings.TrimPrefix(strings.ToUpper(name), "SIG"))
	if s == 0 {
		return 0, errdefs.Invalid("unknown signal %q", name)
	}
	return s, nil
}

// ResizePTY resizes a process's terminal.
func (n *Node) ResizePTY(ctx context.Context, req *dsecv1.ResizePTYRequest) error {
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return err
	}
	if req.GetRows() == 0 || req.GetCols() == 0 || req.GetRows() > 1000 || req.GetCols() > 1000 {
		return errdefs.Invalid("rows and cols must be between 1 and 1000")
	}
	pg, err := c.procs()
	if err != nil {
		return err
	}
	if err := pg.ResizeProcess(ctx, req.GetProcessId(), req.GetRows(), req.GetCols()); err != nil {
		return n.callFailed(s, err)
	}
	return nil
}

// ListProcesses lists the agent's processes.
func (n *Node) ListProcesses(ctx context.Context, req *dsecv1.ListProcessesRequest) (*dsecv1.ListProcessesResponse, error) {
	s, c, err := n.ctrIn(ctx, req.GetSandboxId(), req.GetContainer())
	if err != nil {
		return nil, err
	}
	pg, err := c.procs()
	if err != nil {
		return &dsecv1.ListProcessesResponse{}, nil // calls run to completion: none outlives its call
	}
	procs, err := pg.ListProcs(ctx)
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	out := &dsecv1.ListProcessesResponse{}
	for _, p := range procs {
		env := map[string]string{}
		for _, e := range p.Env {
			if k, v, ok := strings.Cut(e, "="); ok {
				env[k] = v
			}
		}
		out.Processes = append(out.Processes, &dsecv1.ProcessInfo{
			ProcessId: p.Id, Pid: p.Pid, Argv: p.Argv, Tag: p.Tag, Running: p.Running,
			ExitCode: p.ExitCode, Pty: p.Pty, Cwd: p.Cwd, Env: env,
		})
	}
	sort.Slice(out.Processes, func(i, j int) bool { return out.Processes[i].ProcessId < out.Processes[j].ProcessId })
	return out, nil
}
