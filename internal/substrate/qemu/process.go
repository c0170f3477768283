package qemu

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/cgroup"
	"github.com/opendsec/dsec/internal/proc"
)

// Process is a running QEMU, started by this node process or adopted from
// an earlier one by pid and start time. QEMU outlives the node: it runs in
// its own process group and its output goes to a file.
type Process struct {
	proc.ID

	done   chan struct{}
	exited chan struct{} // closed by cmd.Wait when this process started it
	// status is cmd.Wait's answer, set before exited is closed (an
	// adopted process has none: it is not this node's child).
	status error
	waited bool
}

// ErrExitedEarly is Start's error for a QEMU that exited before Start
// returned (an *ExitedEarly says how).
var ErrExitedEarly = errors.New("QEMU exited as it started")

// ExitedEarly is Start's error for a QEMU that exited before Start
// returned: how (Reason: Process.ExitReason) and what failed then.
type ExitedEarly struct {
	Reason string
	Err    error
}

func (e *ExitedEarly) Error() string {
	return fmt.Sprintf("%v (%s): %v", ErrExitedEarly, e.Reason, e.Err)
}

func (e *ExitedEarly) Is(target error) bool { return target == ErrExitedEarly }

// Start starts binary with args, its stdout and stderr appended to
// logPath, and extra inherited files from fd 3 on. With cg set, the
// process runs in that cgroup (see cgroup.Hierarchy.Dir), which must
// exist: cloned into it on cgroup v2, moved into it before it returns on
// v1.
func Start(binary string, args []string, logPath string, extra []*os.File, cg string) (*Process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(binary, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = extra
	// Not killed by the node's terminal signals; the node may exit and
	// QEMU keeps running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	h := cgroups()
	if cg != "" && h.Mode == cgroup.V2 {
		dir, err := os.Open(h.Dir(cg, ""))
		if err != nil {
			return nil, fmt.Errorf("open the cgroup %s: %w", cg, err)
		}
		defer dir.Close()
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(dir.Fd())
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{ID: proc.Of(cmd.Process.Pid), done: make(chan struct{}), exited: make(chan struct{})}
	go func() { p.status = cmd.Wait(); p.waited = true; close(p.exited) }()
	go func() { <-p.exited; close(p.done) }()
	if cg != "" && h.Mode != cgroup.V2 {
		if err := h.Join(cg, p.Pid); err != nil {
			// A QEMU that died as it started (killed before it could be
			// moved into its cgroup) is gone, not a cgroup failure.
			select {
			case <-p.exited:
				return nil, &ExitedEarly{Reason: p.ExitReason(), Err: err}
			case <-time.After(100 * time.Millisecond):
			}
			p.Kill(10 * time.Second)
			return nil, err
		}
	}
	return p, nil
}

// cgroups is the host's cgroup hierarchy, probed once.
var cgroups = sync.OnceValue(cgroup.Probe)

// Adopt returns the process pid if it still runs and started at
// startTime, else an error.
func Adopt(pid int, startTime uint64) (*Process, error) {
	p := &Process{ID: proc.ID{Pid: pid, StartTime: startTime}, done: make(chan struct{})}
	if !p.Alive() {
		return nil, errors.New("the QEMU process is gone")
	}
	p.NotifyExit(p.done)
	return p, nil
}

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// ExitedCleanly reports, once the process has exited, whether it exited
// with status 0, and whether that is known (it is not for a process this
// node adopted rather than started).
func (p *Process) ExitedCleanly() (clean, known bool) {
	select {
	case <-p.done:
	default:
		return false, false
	}
	if !p.waited {
		return false, false
	}
	return p.status == nil, true
}

// ExitReason says how the process ended, once it has: "exit status N"
// or "killed by signal S" ("" if not known: still running, or adopted).
func (p *Process) ExitReason() string {
	select {
	case <-p.exited:
	default:
		return ""
	}
	if p.status == nil {
		return "exit status 0"
	}
	var ee *exec.ExitError
	if errors.As(p.status, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return "killed by signal " + unix.SignalName(ws.Signal())
		}
		return fmt.Sprintf("exit status %d", ee.ExitCode())
	}
	return p.status.Error()
}

// Alive reports whether the process runs (and is the same process).
func (p *Process) Alive() bool {
	select {
	case <-p.done:
		return false
	default:
	}
	return p.ID.Alive()
}

// Kill sends SIGKILL (through a pidfd, so never to a reused pid) and
// waits up to timeout for the exit.
func (p *Process) Kill(timeout time.Duration) bool {
	p.ID.Kill()
	return p.Wait(timeout)
}

// Wait waits up to timeout for the process to exit.
func (p *Process) Wait(timeout time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// RSS is the process's resident memory in bytes (0 if gone).
func (p *Process) RSS() int64 { return proc.RSS(p.Pid) }

// CPUTime is the process's user plus system CPU time.
func (p *Process) CPUTime() time.Duration { return proc.CPUTime(p.Pid) }

// ReadLogTail returns the last n bytes of a QEMU log, for error messages.
func ReadLogTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}

// Version returns the QEMU binary's version line.
func Version(binary string) (string, error) {
	out, err := exec.Command(binary, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w", binary, err)
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimPrefix(strings.TrimSpace(line), "QEMU emulator version "), nil
}
