package qemu

import (
	"context"
	"fmt"
	"os"
	"time"
)

// SaveState stops the VM and writes its memory and device state to f
// (QEMU's migration stream: zero pages are a few bytes each). With
// ramPID, the pid of a QEMU whose RAM is its memfd, the stream leaves the
// RAM out (x-ignore-shared) and the RAM is copied to ram (see saveRAM);
// with 0, the stream holds it. The VM is left stopped ("postmigrate"):
// the caller continues it with Cont (a snapshot) or quits QEMU (a pause).
// Block devices are flushed when it returns, so disk files can be copied
// consistently before Cont.
func SaveState(ctx context.Context, q *QMP, f *os.File, ramPID int, ram string) error {
	if err := q.Execute(ctx, "stop", nil, nil); err != nil {
		return err
	}
	// Set either way: a restored QEMU started with the capability on.
	caps := []map[string]any{{"capability": "x-ignore-shared", "state": ramPID != 0}}
	if err := q.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": caps}, nil); err != nil {
		return err
	}
	// The default bandwidth cap (32 MiB/s) is for live migration over a
	// network; a file takes what the disk gives.
	if err := q.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
		return err
	}
	if err := q.SendFD(ctx, "dsec-state", f); err != nil {
		return err
	}
	if err := q.Execute(ctx, "migrate", map[string]any{"uri": "fd:dsec-state"}, nil); err != nil {
		return err
	}
	if err := waitMigration(ctx, q); err != nil {
		return err
	}
	if ramPID != 0 {
		return saveRAM(ramPID, ram)
	}
	return nil
}

// WaitIncoming waits until a QEMU started with IncomingFD has loaded its
// state, then continues the VM.
func WaitIncoming(ctx context.Context, q *QMP) error {
	if err := waitMigration(ctx, q); err != nil {
		return err
	}
	return Cont(ctx, q)
}

// Cont continues a stopped VM.
func Cont(ctx context.Context, q *QMP) error {
	return q.Execute(ctx, "cont", nil, nil)
}

func waitMigration(ctx context.Context, q *QMP) error {
	wait := 500 * time.Microsecond
	for {
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := q.Execute(ctx, "query-migrate", nil, &st); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migration: %w", ctx.Err())
		case <-time.After(wait):
		}
		wait = min(wait*2, 20*time.Millisecond)
	}
}
