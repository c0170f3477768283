package node

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
)

// end is why a live sandbox ended, as its tombstone keeps it.
type end struct {
	reason string
	// cause is the reason's class, a metrics label: deleted,
	// session_expired, ttl, idle_ttl, paused_ttl, workload_exit, oom, died,
	// pause_failed or node_down.
	cause string
	// infra marks ends that were the platform's doing (crash, TTL,
	// eviction, a failed re-adoption): later calls answer gone (infra)
	// rather than not found.
	infra bool
}

// release is the one teardown of a sandbox, whatever it reached: a start
// that failed part way (prepare's undo), a create that could not be
// committed, a pooled sandbox discarded, and every end of a live one (a
// delete, TTL or idle expiry, a crash, a failed re-adoption). It moves the
// sandbox to deleting (a release of a sandbox already ending returns nil
// at once), destroys its instance, releases its network and directory,
// leaves a tombstone if why is set, and forgets the sandbox.
//
// why is set for sandboxes that went live, and only for them: it keeps
// the reason, and the tombstone answers later calls (deleted or failed).
// Their instance must die: if it cannot be destroyed, the sandbox stays as
// it was and the error is returned, for the caller to retry. A sandbox
// that never went live is released whatever its instance does. ctx bounds
// nothing: the teardown finishes.
func (n *Node) release(ctx context.Context, s *sandbox, why *end) error {
	s.mu.Lock()
	prev := s.state
	if err := s.moveLocked(stateDeleting); err != nil {
		s.mu.Unlock()
		return nil // ending already
	}
	inst, rec := s.inst, s.rec
	endedAt := time.Now().UTC()
	s.ending, s.endedAt = why, endedAt
	run := s.runLocked(endedAt)
	s.mu.Unlock()
	ctx = context.WithoutCancel(ctx)
	s.stopGateway()
	if inst != nil {
		if err := inst.Destroy(ctx); err != nil {
			n.log.Error("destroy sandbox", slog.String("sandbox_id", s.id), slog.Any("error", err))
			if why != nil {
				s.mu.Lock()
				s.undeleteLocked(prev)
				s.ending = nil
				s.mu.Unlock()
				return errdefs.Internal(err, "delete sandbox %s", s.id)
			}
		}
	}
	if s.gw != nil {
		// The agent is gone: its model calls in flight end now; once they
		// are recorded the log is final.
		s.gw.Drain(5 * time.Second)
	}
	n.net.Release(s.net)
	n.volumes.Release(s.id)
	n.dropShared(s)
	if s.dir != "" {
		n.discardDir(s.dir)
	}
	final := stateDeleted
	if why != nil {
		if why.infra {
			final = stateFailed
		}
		if rec == nil {
			rec = s.record()
		}
		t := *rec
		t.State, t.Reason, t.Cause, t.Deleted, t.Infra, t.Driver = final.String(), why.reason, why.cause, endedAt, why.infra, nil
		if err := n.store.bury(&t); err != nil {
			n.log.Error("persist sandbox deletion", slog.String("sandbox_id", s.id), slog.Any("error", err))
		}
		n.m.Ended(s.spec.GetKind(), why.cause)
	}
	n.sandboxes.forget(s)
	s.mu.Lock()
	s.moveLocked(final)
	s.mu.Unlock()
	if why != nil {
		n.publish(s, events.Ended, final, func(ev *dsecv1.Event) {
			ev.Reason, ev.Cause, ev.Infra, ev.Run = why.reason, why.cause, why.infra, run
		})
	}
	if why != nil {
		n.loadChanged()
		n.logs.Forget(s.id)
		n.log.Debug("sandbox deleted", slog.String("sandbox_id", s.id), slog.String("reason", why.reason))
	}
	n.releaseSnapshot(s.image)
	return nil
}

// discardDir moves a sandbox directory to the trash, emptied in the
// background so a large writable layer does not delay the caller.
func (n *Node) discardDir(dir string) {
	dst := filepath.Join(n.cfg.DataDir, "trash", filepath.Base(dir)+"-"+fmt.Sprint(time.Now().UnixNano()))
	if err := os.Rename(dir, dst); err != nil {
		os.RemoveAll(dir)
		return
	}
	select {
	case n.trash <- dst:
	default:
		// The emptier is busy; it will find this one on its next pass.
	}
}

func (n *Node) emptyTrash() {
	dir := filepath.Join(n.cfg.DataDir, "trash")
	sweep := func() {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
	sweep()
	tick := time.NewTicker(30 * time.Second)
	defer tick.Stop()
	for {
		select {
		case p := <-n.trash:
			os.RemoveAll(p)
		case <-tick.C:
			sweep()
		case <-n.stop:
			return
		}
	}
}
