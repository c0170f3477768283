package agent

import (
	"os"
	"os/signal"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// kernelSigaction is the kernel's struct sigaction on amd64 and arm64.
type kernelSigaction struct {
	handler  uintptr
	flags    uint64
	restorer uintptr
	mask     uint64
}

const (
	sigDfl = 0
	sigIgn = 1
	// sigPerThreadSyscall is the signal the Go runtime sends its own
	// threads for syscall.AllThreadsSyscall (glibc's SIGSETXID).
	sigPerThreadSyscall = 33
)

// ignoreSignals makes the kernel drop every signal the agent does not need
// instead of delivering it, whoever sends it and however: kill(2),
// rt_sigqueueinfo with a forged si_code (which the Go runtime takes for a
// fault of its own and dies of, SIGSEGV or SIGILL alike) or F_SETOWN and
// F_SETSIG on a file (the kernel sends the signal, with a positive si_code).
// A handled signal is not enough: only an ignored one never reaches the
// runtime's handler.
//
// The runtime still believes its handler is installed, so a child the
// agent forks resets the signal to its default before exec, like every
// signal the runtime handles: children start with default dispositions.
//
// Kept: SIGCHLD (the reaper's; ignoring it would make the kernel reap
// children itself), SIGURG (the runtime's preemption), the runtime's
// per-thread syscall signal, and SIGKILL and SIGSTOP, which cannot be
// caught and which Linux never delivers to a pid namespace's init from
// inside it (gVisor does: see docs/substrates/container.md).
//
// Signals the runtime left at their default (32 and 34, whose default
// ends a process), or inherited ignored (seen with signal 32 under make)
// and left so, get a handler that returns at once (noopSignalHandler, in
// assembly: the runtime's own would pass a signal it does not handle on to
// its default, and die of it). Linux drops such a signal for an init
// anyway; gVisor does not. A handler, unlike an ignored disposition, is
// reset to the default by execve, so children start with these default
// too.
//
// It returns the signals it ignored. Real faults in the agent (a nil
// dereference) are forced by the kernel and still end it.
func ignoreSignals() []syscall.Signal {
	// The runtime leaves the stop signals at their default (the process
	// stops) until asked for them: have it install its handler, so that
	// children reset them, then ignore them like the rest.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
	// The no-op handler, with the flags and restorer the runtime installed
	// for SIGUSR1 (before that is ignored below).
	var noop kernelSigaction
	if rtSigaction(int(syscall.SIGUSR1), nil, &noop) != nil || noop.handler <= sigIgn {
		noop = kernelSigaction{}
	} else {
		noop.handler = noopSignalHandlerAddr()
		noop.mask = ^uint64(0)
	}
	var ignored []syscall.Signal
	for sig := 1; sig <= 64; sig++ {
		switch syscall.Signal(sig) {
		case syscall.SIGKILL, syscall.SIGSTOP, syscall.SIGCHLD, syscall.SIGURG, sigPerThreadSyscall:
			continue
		}
		var act kernelSigaction
		if rtSigaction(sig, nil, &act) != nil {
			continue
		}
		if act.handler == sigDfl || act.handler == sigIgn {
			// Not the runtime's: the no-op handler (or, without one, the
			// default, which Linux drops for an init).
			if noop.handler != 0 {
				rtSigaction(sig, &noop, nil)
			} else if act.handler == sigIgn {
				act.handler = sigDfl
				rtSigaction(sig, &act, nil)
			}
			continue
		}
		act.handler = sigIgn
		if rtSigaction(sig, &act, nil) == nil {
			ignored = append(ignored, syscall.Signal(sig))
		}
	}
	return ignored
}

// noopSignalHandlerAddr is the address of a signal handler that returns
// at once (noop_*.s).
func noopSignalHandlerAddr() uintptr

func rtSigaction(sig int, act, old *kernelSigaction) error {
	_, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(act)), uintptr(unsafe.Pointer(old)), 8, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}
