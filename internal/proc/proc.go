// Package proc names host processes across pid reuse — a pid with its
// start time — and watches, waits for and signals them through pidfds,
// so a node that restarts can adopt the processes an earlier node started
// (container runtimes and inits, QEMU) without ever signalling a stranger
// that reused a pid. The container and VM drivers share it.
package proc

import (
	"bytes"
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ID is one process: its pid and its start time in clock ticks since boot
// (field 22 of /proc/<pid>/stat). The zero ID names no process.
type ID struct {
	Pid       int
	StartTime uint64
}

// Of returns the ID of the process running as pid now (StartTime 0 if
// none does).
func Of(pid int) ID { return ID{Pid: pid, StartTime: StartTime(pid)} }

// StartTime is pid's start time in clock ticks since boot, 0 if no
// process has that pid.
func StartTime(pid int) uint64 {
	f := statFields(pid)
	if len(f) < 20 {
		return 0
	}
	n, _ := strconv.ParseUint(f[19], 10, 64)
	return n
}

// Parent is pid's parent's pid, 0 if no process has that pid.
func Parent(pid int) int {
	f := statFields(pid)
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.Atoi(f[1])
	return n
}

// Alive reports whether the process runs: its pid exists, started at
// StartTime, and is not a zombie.
func (id ID) Alive() bool {
	if id.Pid <= 0 || id.StartTime == 0 {
		return false
	}
	f := statFields(id.Pid)
	if len(f) < 20 || f[0] == "Z" {
		return false
	}
	n, _ := strconv.ParseUint(f[19], 10, 64)
	return n == id.StartTime
}

// Signal sends sig through a pidfd opened while the process was verified
// alive, so never to a process that reused the pid. A process that is
// gone is no error.
func (id ID) Signal(sig syscall.Signal) error {
	fd, err := id.open(0)
	if err != nil || fd < 0 {
		return err
	}
	defer unix.Close(fd)
	if err := unix.PidfdSendSignal(fd, sig, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return err
	}
	return nil
}

// Kill sends SIGKILL (see Signal).
func (id ID) Kill() error { return id.Signal(syscall.SIGKILL) }

// open returns a pidfd of the process, or -1 if it is gone. The pidfd is
// opened before the liveness check, so it names the verified process.
func (id ID) open(flags int) (int, error) {
	if !id.Alive() {
		return -1, nil
	}
	fd, err := unix.PidfdOpen(id.Pid, flags)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return -1, nil
		}
		return -1, err
	}
	if !id.Alive() {
		unix.Close(fd)
		return -1, nil
	}
	return fd, nil
}

// exitCheck is how often a process watched through its pidfd is also
// checked through /proc: a pidfd that never polls readable (seen twice in
// CI: a sandbox's init killed and reaped, its watcher still waiting a
// minute later) delays the news of its exit by at most this much.
var exitCheck = 20 * time.Second

// NotifyExit closes done when the process exits (at once if it is gone):
// a pidfd in Go's poller, no thread per process, checked through /proc
// every exitCheck too, or a poll every second where pidfds are missing.
func (id ID) NotifyExit(done chan struct{}) {
	fd, err := id.open(unix.PIDFD_NONBLOCK)
	if err != nil {
		go id.poll(done, time.Second)
		return
	}
	if fd < 0 {
		close(done)
		return
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	check := exitCheck
	go func() {
		defer f.Close()
		rc, err := f.SyscallConn()
		if err != nil {
			id.poll(done, time.Second)
			return
		}
		for {
			f.SetReadDeadline(time.Now().Add(check))
			first := true
			err := rc.Read(func(uintptr) bool {
				if first {
					first = false
					return false // wait until readable: the process exited
				}
				return true
			})
			if !errors.Is(err, os.ErrDeadlineExceeded) || !id.Alive() {
				break
			}
		}
		close(done)
	}()
}

func (id ID) poll(done chan struct{}, every time.Duration) {
	for id.Alive() {
		time.Sleep(every)
	}
	close(done)
}

// Wait waits up to timeout for the process to exit and reports whether
// it did.
func (id ID) Wait(timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	fd, err := id.open(unix.PIDFD_NONBLOCK)
	switch {
	case err == nil && fd < 0:
		return true
	case err == nil:
		defer unix.Close(fd)
		for {
			ms := max(int(time.Until(deadline).Milliseconds()), 0)
			n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, ms)
			switch {
			case n > 0:
				return true
			case errors.Is(err, unix.EINTR):
			case err != nil || ms == 0:
				return !id.Alive()
			}
		}
	}
	for id.Alive() { // no pidfds here
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	return true
}

// RSS is the process's resident memory in bytes (0 if gone).
func RSS(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/statm")
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

// CPUTime is the process's user plus system CPU time (0 if gone).
func CPUTime(pid int) time.Duration {
	f := statFields(pid)
	if len(f) < 15 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * time.Second / 100 // USER_HZ
}

// statFields are the fields of /proc/<pid>/stat after the command name
// (the state, field 3, is index 0), or nil if there is no such process.
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
