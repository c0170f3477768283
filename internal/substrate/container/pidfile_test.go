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

	// The wait starts before the file exists and has not ended when the
	// file is written: it returns the pid only then.
	late := filepath.Join(dir, "late")
	type result struct {
		pid int
		err error
	}
	got := make(chan result, 1)
	go func() {
		pid, err := waitPidFile(context.Background(), late, never)
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
	if _, err := waitPidFile(context.Background(), filepath.Join(dir, "none"), exited); err == nil || !strings.Contains(err.Error(), "runtime exited") {
		t.Fatalf("runtime exited without a pid file: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := waitPidFile(ctx, filepath.Join(dir, "none"), never); err == nil || !strings.Contains(err.Error(), "start deadline") {
		t.Fatalf("no pid file by the deadline: %v", err)
	}
}
