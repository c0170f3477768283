package agent

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The test runs ignoreSignals in a child copy of the test binary: it
// changes the process's signal dispositions for good.
const signalsChild = "DSEC_AGENT_SIGNALS_CHILD"

func TestEverySignalAnotherProcessCanSendIsIgnoredAndChildrenGetDefaults(t *testing.T) {
	if os.Getenv(signalsChild) == "1" {
		signalsChildMain()
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (the child copy runs as a pid namespace's init, like the agent)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestEverySignalAnotherProcessCanSendIsIgnoredAndChildrenGetDefaults$")
	cmd.Env = append(os.Environ(), signalsChild+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "survived every signal") {
		t.Fatalf("the child copy: %v\n%s", err, out)
	}
}

func signalsChildMain() {
	if os.Getpid() != 1 {
		println("not a pid namespace's init")
		os.Exit(1)
	}
	ignoreSignals()
	self := os.Getpid()
	for sig := 1; sig <= 64; sig++ {
		switch syscall.Signal(sig) {
		case syscall.SIGKILL, syscall.SIGSTOP:
			continue
		}
		syscall.Kill(self, syscall.Signal(sig))
		// A forged si_code: the runtime would take SIGSEGV or SIGILL with
		// SI_QUEUE for a fault of its own.
		info := struct {
			signo, errno, code, _ int32
			pid                   int32
			uid                   uint32
			_                     [104]byte
		}{signo: int32(sig), code: -1, pid: int32(self)}
		unix.Syscall(unix.SYS_RT_SIGQUEUEINFO, uintptr(self), uintptr(sig), uintptr(unsafe.Pointer(&info)))
	}
	time.Sleep(100 * time.Millisecond)
	out, err := exec.Command("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status").Output()
	if err != nil {
		println("grep:", err.Error())
		os.Exit(1)
	}
	if want := "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"; string(out) != want {
		println("a child's signal state is", string(out))
		os.Exit(1)
	}
	println("survived every signal")
}
