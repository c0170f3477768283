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

	late := filepath.Join(dir, "late")
	go func() {
		time.Sleep(300 * time.Millisecond)
		os.WriteFile(late+".tmp", []byte("4242\n"), 0o600)
		os.Rename(late+".tmp", late)
	}()
	if pid, err := waitPidFile(context.Background(), late, never); err != nil || pid != 4242 {
		t.Fatalf("late pid file: %d, %v", pid, err)
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
