package container

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The runtime may write its pid file well after the agent answered (a
// loaded host); the wait ends with the file, the runtime's exit or the
// start deadline, whichever comes first.
func TestWaitPidFileWaitsForALateRuntime(t *testing.T) {
	dir := t.TempDir()
	never := make(chan struct{})
	any := func(int) bool { return true }

	// The wait starts before the file exists and has not ended when the
	// file is written: it returns the pid only then.
	late := filepath.Join(dir, "late")
	type result struct {
		pid int
		err error
	}
	got := make(chan result, 1)
	go func() {
		pid, err := waitPidFile(context.Background(), late, never, any)
		got <- result{pid, err}
	}()
	select {
	case r := <-got:
		t.Fatalf("the wait ended before the pid file existed: %v", r)
	default:
	}
	if err := os.WriteFile(late+".tmp", []byte("4242\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(late+".tmp", late); err != nil {
		t.Fatal(err)
	}
	if r := <-got; r.err != nil || r.pid != 4242 {
		t.Fatalf("late pid file: %d, %v", r.pid, r.err)
	}

	exited := make(chan struct{})
	close(exited)
	if _, err := waitPidFile(context.Background(), filepath.Join(dir, "none"), exited, any); err == nil || !strings.Contains(err.Error(), "runtime exited") {
		t.Fatalf("runtime exited without a pid file: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := waitPidFile(ctx, filepath.Join(dir, "none"), never, any); err == nil || !strings.Contains(err.Error(), "start deadline") {
		t.Fatalf("no pid file by the deadline: %v", err)
	}
}

// A pid file that does not name the container's init yet (an earlier
// start's, or one the runtime is still writing) is waited past, not
// taken.
func TestWaitPidFileTakesOnlyTheInitsPid(t *testing.T) {
	p := filepath.Join(t.TempDir(), "pid")
	if err := os.WriteFile(p, []byte("1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	never := make(chan struct{})
	got := make(chan int, 1)
	checked := make(chan int, 1)
	valid := func(pid int) bool {
		select {
		case checked <- pid:
		default:
		}
		return pid == 4343
	}
	go func() {
		pid, _ := waitPidFile(context.Background(), p, never, valid)
		got <- pid
	}()
	if pid := <-checked; pid != 1 {
		t.Fatalf("checked pid %d first", pid)
	}
	select {
	case pid := <-got:
		t.Fatalf("took pid %d, which is not the init's", pid)
	default:
	}
	if err := os.WriteFile(p, []byte("4343\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if pid := <-got; pid != 4343 {
		t.Fatalf("took pid %d", pid)
	}
}
