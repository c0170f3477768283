package qemu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Process is a running QEMU, started by this node process or adopted from
// an earlier one by pid and start time. QEMU outlives the node: it runs in
// its own process group and its output goes to a file.
type Process struct {
	Pid       int
	StartTime uint64 // clock ticks since boot, against pid reuse

	done     chan struct{}
	waitOnce sync.Once
	exited   chan struct{} // closed by cmd.Wait when this process started it
}

// Start starts binary with args, its stdout and stderr appended to
// logPath, and extra inherited files from fd 3 on.
func Start(binary string, args []string, logPath string, extra []*os.File) (*Process, error) {
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
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{Pid: cmd.Process.Pid, StartTime: ProcStartTime(cmd.Process.Pid), done: make(chan struct{}), exited: make(chan struct{})}
	go func() { cmd.Wait(); close(p.exited) }()
	p.watch()
	return p, nil
}

// Adopt returns the process pid if it still runs and started at
// startTime, else an error.
func Adopt(pid int, startTime uint64) (*Process, error) {
	p := &Process{Pid: pid, StartTime: startTime, done: make(chan struct{})}
	if !p.Alive() {
		return nil, errors.New("the QEMU process is gone")
	}
	p.watch()
	return p, nil
}

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Alive reports whether the process runs (and is the same process).
func (p *Process) Alive() bool {
	if p.Pid <= 0 {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
	}
	st := ProcStartTime(p.Pid)
	return st != 0 && st == p.StartTime && !isZombie(p.Pid)
}

// watch closes done when the process exits: from cmd.Wait if this node
// started it, else with a pidfd in Go's poller (no thread per VM).
func (p *Process) watch() {
	if p.exited != nil {
		go func() { <-p.exited; close(p.done) }()
		return
	}
	fd, err := unix.PidfdOpen(p.Pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		go p.poll()
		return
	}
	if !p.Alive() { // the pidfd may name a reused pid
		unix.Close(fd)
		close(p.done)
		return
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	go func() {
		defer f.Close()
		rc, err := f.SyscallConn()
		if err != nil {
			p.poll()
			return
		}
		first := true
		rc.Read(func(uintptr) bool {
			if first {
				first = false
				return false // wait until readable: the process exited
			}
			return true
		})
		close(p.done)
	}()
}

func (p *Process) poll() {
	for {
		st := ProcStartTime(p.Pid)
		if st == 0 || st != p.StartTime || isZombie(p.Pid) {
			close(p.done)
			return
		}
		time.Sleep(time.Second)
	}
}

// Kill sends SIGKILL (through a pidfd, so never to a reused pid) and
// waits up to timeout for the exit.
func (p *Process) Kill(timeout time.Duration) bool {
	if p.Alive() {
		if fd, err := unix.PidfdOpen(p.Pid, 0); err == nil {
			if p.Alive() {
				unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
			}
			unix.Close(fd)
		}
	}
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
func (p *Process) RSS() int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(p.Pid) + "/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.ParseInt(f[1], 10, 64)
	return n * int64(os.Getpagesize())
}

// CPUTime is the process's user plus system CPU time.
func (p *Process) CPUTime() time.Duration {
	f := statFields(p.Pid)
	if len(f) < 15 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * time.Second / 100 // USER_HZ
}

// statFields are the fields of /proc/<pid>/stat after the command name
// (field 3, the state, is index 0).
func statFields(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// ProcStartTime is a process's start time in clock ticks since boot; with
// the pid it identifies a process across pid reuse. 0 if it is gone.
func ProcStartTime(pid int) uint64 {
	f := statFields(pid)
	if len(f) < 20 {
		return 0
	}
	n, _ := strconv.ParseUint(f[19], 10, 64)
	return n
}

func isZombie(pid int) bool {
	f := statFields(pid)
	return len(f) == 0 || f[0] == "Z"
}

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
