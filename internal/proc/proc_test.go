package proc

import (
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func start(t *testing.T, args ...string) (*exec.Cmd, ID) {
	t.Helper()
	cmd := exec.Command(args[0], args[1:]...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, Of(cmd.Process.Pid)
}

func TestAProcessIsAliveUntilItExitsAndKillEndsIt(t *testing.T) {
	_, id := start(t, "sleep", "60")
	if !id.Alive() {
		t.Fatal("a running sleep is not alive")
	}
	done := make(chan struct{})
	id.NotifyExit(done)
	if id.Wait(50 * time.Millisecond) {
		t.Fatal("Wait says a running process exited")
	}
	if err := id.Kill(); err != nil {
		t.Fatal(err)
	}
	if !id.Wait(10 * time.Second) {
		t.Fatal("the killed process did not exit")
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("NotifyExit did not close done")
	}
	if id.Alive() {
		t.Fatal("a killed process (a zombie until reaped) is alive")
	}
}

// The pidfd's wait is checked through /proc every exitCheck: a check
// finding the process alive goes on waiting, and its exit still closes
// done.
func TestNotifyExitWaitsAcrossItsChecks(t *testing.T) {
	defer func(old time.Duration) { exitCheck = old }(exitCheck)
	exitCheck = 5 * time.Millisecond
	_, id := start(t, "sleep", "60")
	done := make(chan struct{})
	id.NotifyExit(done)
	select {
	case <-done:
		t.Fatal("NotifyExit closed done for a running process")
	case <-time.After(100 * time.Millisecond): // about 20 checks
	}
	if err := id.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("NotifyExit did not close done after the exit")
	}
}

func TestAReusedPidIsNotTheSameProcess(t *testing.T) {
	_, id := start(t, "sleep", "60")
	other := ID{Pid: id.Pid, StartTime: id.StartTime + 1}
	if other.Alive() {
		t.Fatal("a pid with another start time is alive")
	}
	if err := other.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if !id.Alive() {
		t.Fatal("signalling a stale ID reached the process that has its pid")
	}
	done := make(chan struct{})
	other.NotifyExit(done)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("NotifyExit of a gone process did not close done at once")
	}
}

func TestTheZeroIDNamesNoProcess(t *testing.T) {
	var id ID
	if id.Alive() || !id.Wait(0) || id.Kill() != nil {
		t.Fatal("the zero ID acts as a process")
	}
}
