package container

import (
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/proc"
)

// A released child is reaped when it exits, with its status, and a
// released handle's pid (-1) is never what gets waited for or signalled.
func TestAwaitChildReapsAReleasedChildWithItsStatus(t *testing.T) {
	for _, c := range []struct {
		script string
		kill   bool
		want   int
	}{
		{"exit 0", false, 0},
		{"exit 3", false, 3},
		{"sleep 60", true, -1},
	} {
		cmd := exec.Command("/bin/sh", "-c", c.script)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		child := proc.Of(cmd.Process.Pid)
		cmd.Process.Release()
		if cmd.Process.Pid != -1 {
			t.Fatalf("a released process's pid is %d", cmd.Process.Pid)
		}
		done := make(chan struct{})
		status := 99
		awaitChild(child, done, &status)
		if c.kill {
			if err := child.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%q: not reaped within 30 s", c.script)
		}
		if status != c.want {
			t.Errorf("%q: status %d, want %d", c.script, status, c.want)
		}
		if child.Alive() {
			t.Errorf("%q: still alive after its end was reported", c.script)
		}
	}
}
