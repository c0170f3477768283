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
// caught and which the kernel never delivers to a pid namespace's init
// from inside it. Signals the runtime left at their default (it installs
// no handler for 32, for example) are dropped by the kernel for an init
// already, and stay default for children; one the agent inherited ignored
// and the runtime left so is made default (else children would inherit it
// ignored: seen with signal 32 under make).
//
// It returns the signals it ignored. Real faults in the agent (a nil
// dereference) are forced by the kernel and still end it.
func ignoreSignals() []syscall.Signal {
	// The runtime leaves the stop signals at their default (the process
	// stops) until asked for them: have it install its handler, so that
	// children reset them, then ignore them like the rest.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
	var ignored []syscall.Signal
	for sig := 1; sig <= 64; sig++ {
		switch syscall.Signal(sig) {
		case syscall.SIGKILL, syscall.SIGSTOP, syscall.SIGCHLD, syscall.SIGURG, sigPerThreadSyscall:
			continue
		}
		var act kernelSigaction
		if rtSigaction(sig, nil, &act) != nil || act.handler == sigDfl {
			continue
		}
		if act.handler == sigIgn {
			// Ignored when the agent started (inherited from whoever
			// started the node) and left so by the runtime, which then
			// never resets it for children: make it default, which for a
			// pid namespace's init the kernel drops from inside anyway.
			act.handler = sigDfl
			rtSigaction(sig, &act, nil)
			continue
		}
		act.handler = sigIgn
		if rtSigaction(sig, &act, nil) == nil {
			ignored = append(ignored, syscall.Signal(sig))
		}
	}
	return ignored
}

func rtSigaction(sig int, act, old *kernelSigaction) error {
	_, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(act)), uintptr(unsafe.Pointer(old)), 8, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}
