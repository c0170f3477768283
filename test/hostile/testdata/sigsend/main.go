// Command sigsend sends a signal to PID 1 the ways a process inside a
// sandbox can, beyond kill(2): `sigsend queue N` with rt_sigqueueinfo and
// a forged si_code (SI_QUEUE, which the Go runtime takes for a fault), and
// `sigsend sigio N` by making PID 1 the owner of a pipe with F_SETOWN and
// F_SETSIG, so the kernel itself sends N (si_code POLL_IN) when the pipe
// becomes readable. The hostile tests build it statically and upload it.
package main

import (
	"fmt"
	"os"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: sigsend queue|sigio SIGNAL")
		os.Exit(2)
	}
	sig, err := strconv.Atoi(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	switch os.Args[1] {
	case "queue":
		err = queue(sig)
	case "sigio":
		err = sigio(sig)
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// siginfo is the kernel's siginfo_t, as far as rt_sigqueueinfo reads it.
type siginfo struct {
	Signo int32
	Errno int32
	Code  int32
	_     int32
	Pid   int32
	UID   uint32
	Value uint64
	_     [96]byte
}

func queue(sig int) error {
	info := siginfo{Signo: int32(sig), Code: -1 /* SI_QUEUE */, Pid: int32(os.Getpid())}
	_, _, e := unix.Syscall(unix.SYS_RT_SIGQUEUEINFO, 1, uintptr(sig), uintptr(unsafe.Pointer(&info)))
	if e != 0 {
		return fmt.Errorf("rt_sigqueueinfo: %w", e)
	}
	return nil
}

func sigio(sig int) error {
	var p [2]int
	if err := unix.Pipe(p[:]); err != nil {
		return err
	}
	if _, err := unix.FcntlInt(uintptr(p[0]), unix.F_SETOWN, 1); err != nil {
		return fmt.Errorf("F_SETOWN: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(p[0]), unix.F_SETSIG, sig); err != nil {
		return fmt.Errorf("F_SETSIG: %w", err)
	}
	fl, err := unix.FcntlInt(uintptr(p[0]), unix.F_GETFL, 0)
	if err != nil {
		return err
	}
	if _, err := unix.FcntlInt(uintptr(p[0]), unix.F_SETFL, fl|unix.O_ASYNC); err != nil {
		return fmt.Errorf("O_ASYNC: %w", err)
	}
	_, err = unix.Write(p[1], []byte{1})
	return err
}
