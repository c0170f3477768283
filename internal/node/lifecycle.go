package node

import (
	"context"
	"log/slog"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
)

// Pause freezes a sandbox and releases what memory it can. Pausing a
// paused sandbox succeeds.
func (n *Node) Pause(ctx context.Context, id string) (_ *dsecv1.Sandbox, err error) {
	defer n.m.Observe(ctx, metrics.OpPause, n.kindOf(id), time.Now(), &err)
	return n.pauseBy(ctx, id, n.pause)
}

// PauseFilesystem pauses a sandbox without its memory (a filesystem-only
// pause): it stops, keeping only its file system, and resuming it boots
// it (see stopLocked). Pausing a paused sandbox succeeds and leaves it as
// it is.
func (n *Node) PauseFilesystem(ctx context.Context, id string) (_ *dsecv1.Sandbox, err error) {
	defer n.m.Observe(ctx, metrics.OpPause, n.kindOf(id), time.Now(), &err)
	return n.pauseBy(ctx, id, n.pauseFilesystem)
}

func (n *Node) pauseBy(ctx context.Context, id string, pause func(context.Context, *sandbox) error) (*dsecv1.Sandbox, error) {
	s, err := n.lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := pause(ctx, s); err != nil {
		return nil, err
	}
	return n.view(s), nil
}

// Resume thaws a paused sandbox. Resuming a running one succeeds.
func (n *Node) Resume(ctx context.Context, id string) (_ *dsecv1.Sandbox, err error) {
	defer n.m.Observe(ctx, metrics.OpResume, n.kindOf(id), time.Now(), &err)
	s, err := n.lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := n.resume(ctx, s); err != nil {
		return nil, err
	}
	s.touch()
	return n.view(s), nil
}

func (n *Node) pause(ctx context.Context, s *sandbox) error {
	return n.transition(ctx, s, statePaused, func(ctx context.Context) error { return n.freezeLocked(ctx, s) })
}

func (n *Node) pauseFilesystem(ctx context.Context, s *sandbox) error {
	return n.transition(ctx, s, statePaused, func(ctx context.Context) error { return n.stopLocked(ctx, s) })
}

// stopLocked pauses s without its memory: its instance stops (every
// process ends, the agent too, and its memory and CPU are freed) keeping
// its file system, its network and its ID; resumeLocked boots it again.
// Nothing of the sandbox's processes survives, so the agent's deadline
// goes with them (the resume sets it again).
func (n *Node) stopLocked(ctx context.Context, s *sandbox) error {
	st, ok := s.inst.(substrate.Stopper)
	if !ok {
		return errdefs.Invalid("kind %q%s cannot pause without its memory (filesystem-only): only kind container under its default runtime can", s.spec.Kind, runtimeSuffix(s.spec.Runtime))
	}
	if len(s.spec.GetVolumes()) > 0 {
		return errdefs.Invalid("a sandbox with volumes cannot pause without its memory (filesystem-only) on this node")
	}
	if err := st.Stop(ctx); err != nil {
		return err
	}
	s.stopped = true
	return nil
}

// pausesFilesystem reports whether s's timeout pauses it filesystem-only.
func (s *sandbox) pausesFilesystem() bool { return s.spec.OnTimeout == OnTimeoutPauseFilesystem }

// timeoutPauseLocked pauses s as its on_timeout says.
func (n *Node) timeoutPauseLocked(ctx context.Context, s *sandbox) error {
	if s.pausesFilesystem() {
		return n.stopLocked(ctx, s)
	}
	return n.freezeLocked(ctx, s)
}

// freezeLocked pauses s's instance. A sandbox that pauses at its timeout
// (on_timeout "pause") may stay paused past its TTL, so its agent's own
// deadline, which would end it the moment it resumed, is cleared first
// (resumeLocked sets it again).
func (n *Node) freezeLocked(ctx context.Context, s *sandbox) error {
	p, err := can[substrate.Pauser](s, "cannot pause")
	if err != nil {
		return err
	}
	if !s.pausesAtTimeout() {
		return p.Pause(ctx)
	}
	if err := n.setDeadline(ctx, s, time.Time{}); err != nil {
		return err
	}
	if err := p.Pause(ctx); err != nil {
		n.setDeadline(context.WithoutCancel(ctx), s, n.deadline(s))
		return err
	}
	return nil
}

func (n *Node) resume(ctx context.Context, s *sandbox) error {
	return n.transition(ctx, s, stateRunning, func(ctx context.Context) error { return n.resumeLocked(ctx, s) })
}

// resumeLocked resumes s's instance. A sandbox paused at its TTL starts a
// fresh TTL; one that pauses at its timeout gets its agent's deadline back.
func (n *Node) resumeLocked(ctx context.Context, s *sandbox) error {
	p, err := can[substrate.Pauser](s, "cannot pause")
	if err != nil {
		return err
	}
	cold := s.stopped
	if err := p.Resume(ctx); err != nil {
		return err
	}
	if cold {
		s.stopped = false
		n.booted(ctx, s)
	}
	// A resume is activity: the idle TTL counts from it (a session's
	// revival must not meet an idle TTL that ran out before the pause).
	s.touch()
	if s.gwKick != nil {
		// A VM's agent channel is new: its gateway listener too, now.
		select {
		case s.gwKick <- struct{}{}:
		default:
		}
	}
	if s.timedOut {
		s.expires, s.timedOut = time.Now().Add(time.Duration(s.spec.TtlS)*time.Second), false
	}
	if s.pausesAtTimeout() || cold {
		// The node enforces the TTL on its own; the agent's deadline is
		// the fallback for a node that is gone (a cold boot's agent has
		// none yet).
		if err := n.setDeadline(context.WithoutCancel(ctx), s, n.deadline(s)); err != nil {
			n.log.Warn("set the agent's deadline after a resume", slog.String("sandbox_id", s.id), slog.Any("error", err))
		}
	}
	return nil
}

// pauseAtTTL pauses s, whose TTL passed at now and whose policy is to
// pause: it is kept paused until now + paused_ttl, and resuming it starts
// a fresh TTL. A sandbox paused already (by its user or its session)
// just gets that mark.
func (n *Node) pauseAtTTL(ctx context.Context, s *sandbox, now time.Time) error {
	mark := func() { s.expires, s.timedOut = now.Add(n.cfg.PausedTTL), true }
	s.mu.Lock()
	if s.state == statePaused {
		mark()
		err := n.persistLocked(s)
		s.mu.Unlock()
		return err
	}
	s.mu.Unlock()
	return n.transition(ctx, s, statePaused, func(ctx context.Context) error {
		if err := n.timeoutPauseLocked(ctx, s); err != nil {
			return err
		}
		mark()
		return nil
	})
}

// transition moves s to paused or running through the driver (do) and
// persists the move. A sandbox in that state already is left alone.
func (n *Node) transition(ctx context.Context, s *sandbox, to state, do func(context.Context) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state == to {
		return nil
	}
	if err := s.mayLocked(to); err != nil {
		return err
	}
	if err := do(ctx); err != nil {
		return n.failedLocked(s, err)
	}
	s.moveLocked(to)
	err := n.persistLocked(s)
	typ := events.Resumed
	if to == statePaused {
		typ = events.Paused
	}
	now := time.Now().UTC()
	if to == statePaused {
		s.runEnd = now
	}
	n.publish(s, typ, to, func(ev *dsecv1.Event) {
		if s.timedOut {
			ev.Reason, ev.Cause = "ttl expired: paused until its paused_ttl", "ttl"
		}
		if to == statePaused {
			ev.Run = s.runLocked(now)
		}
	})
	if to == stateRunning {
		s.runStart, s.runEnd = now, time.Time{}
	}
	return err
}

// failedLocked turns a driver failure on a dead sandbox into gone.
func (n *Node) failedLocked(s *sandbox, err error) error {
	if s.inst.Check(context.Background()) != nil {
		go n.release(context.Background(), s, &end{reason: "the sandbox died", cause: "died", infra: true})
		return errdefs.Gone("sandbox %s died", s.id)
	}
	return err
}

// persistLocked writes the sandbox's record with its current state.
func (n *Node) persistLocked(s *sandbox) error {
	r := *s.rec
	r.State, r.Expires, r.TimedOut, r.Stopped = s.state.String(), s.expires, s.timedOut, s.stopped
	r.Network, r.NetPolicy = attachmentJSON(s.net), networkRecord(s.network)
	if s.inst != nil {
		// A pause or resume may change what the driver re-adopts from
		// (a microVM's QEMU process).
		r.Driver = s.inst.State()
	}
	if err := n.store.put(&r); err != nil {
		return errdefs.Internal(err, "persist sandbox")
	}
	s.rec = &r
	return nil
}

// Bulk pauses, resumes or deletes every live sandbox of the caller's
// (an operator: of any project) matching a non-empty label selector, in
// parallel, and reports each failure. cause is a delete's end cause: ""
// (deleted) or session_expired. Op "pause_filesystem" pauses
// filesystem-only (PauseFilesystem).
func (n *Node) Bulk(ctx context.Context, op, selector, cause string) (*dsecv1.BulkResponse, error) {
	if selector == "" {
		return nil, errdefs.Invalid("a label selector is required for a bulk %s", op)
	}
	deleted := &end{reason: "deleted by the user (by label)", cause: "deleted"}
	switch cause {
	case "":
	case "session_expired": // session.CauseExpired
		deleted = &end{reason: "its trainer session expired (on_expire: delete)", cause: "session_expired"}
	default:
		return nil, errdefs.Invalid("unknown end cause %q (want session_expired or none)", cause)
	}
	sel, err := ParseSelector(selector)
	if err != nil {
		return nil, err
	}
	var act func(context.Context, *sandbox) error
	switch op {
	case "pause":
		act = n.pause
	case "pause_filesystem":
		act = n.pauseFilesystem
	case "resume":
		act = n.resume
	case "delete":
		act = func(ctx context.Context, s *sandbox) error {
			return n.release(ctx, s, deleted)
		}
	default:
		return nil, errdefs.Invalid("unknown bulk operation %q", op)
	}
	targets := n.sandboxes.all(func(s *sandbox) bool { return tenant.Reaches(ctx, s.project) && sel.Matches(s.spec.Labels) })
	out := &dsecv1.BulkResponse{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, s := range targets {
		wg.Add(1)
		sem <- struct{}{}
		go func(s *sandbox) {
			defer wg.Done()
			defer func() { <-sem }()
			err := act(ctx, s)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				out.Failures = append(out.Failures, &dsecv1.BulkFailure{Id: s.id, Error: ItemError(err)})
				return
			}
			out.Ids = append(out.Ids, s.id)
		}(s)
	}
	wg.Wait()
	return out, nil
}

// ItemError is an error as one item of a batch answer.
func ItemError(err error) *dsecv1.ItemError {
	e := errdefs.Classify(err)
	return &dsecv1.ItemError{Kind: string(e.Kind), Message: e.Msg, Infra: e.Infra, Retryable: e.Retryable, RetryAfterMs: e.RetryAfter.Milliseconds()}
}

// Stats reports a sandbox's resource use. It neither resumes a paused
// sandbox nor counts as activity.
func (n *Node) Stats(ctx context.Context, id string, withHistory bool) (*dsecv1.SandboxStats, error) {
	s, err := n.lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := s.isEnding(); err != nil {
		return nil, err
	}
	st, err := s.inst.Stats(ctx)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.SandboxStats{
		Id: id, At: timestamppb.Now(), CpuTimeMs: st.CPUTime.Milliseconds(), MemoryBytes: st.MemoryBytes,
		Pids: st.Pids, OomKills: st.OOMKills,
		CpuLimit: s.spec.Resources.GetCpu(), MemoryLimitMb: s.spec.Resources.GetMemoryMb(),
		DiskBytes: st.DiskBytes, DiskLimitMb: st.DiskLimitBytes >> 20,
	}
	if withHistory {
		out.History = s.history.samples()
	}
	return out, nil
}

// booted prepares the agent of s's cold boot (a resume after a
// filesystem-only pause) as a create would, and records the boot in s's
// trajectory log: the processes before it are gone, its files stay. The
// agent's environment is the spec's; its deadline is set by the caller.
func (n *Node) booted(ctx context.Context, s *sandbox) {
	ctx = context.WithoutCancel(ctx)
	if len(s.spec.Env) > 0 {
		env := make([]string, 0, len(s.spec.Env))
		for k, v := range s.spec.Env {
			env = append(env, k+"="+v)
		}
		sort.Strings(env)
		if err := s.inst.Guest().SetEnv(ctx, env); err != nil {
			n.log.Warn("set the agent's environment after a cold boot", slog.String("sandbox_id", s.id), slog.Any("error", err))
		}
	}
	log, err := n.logs.Log(s.id)
	if err != nil {
		n.log.Warn("open the trajectory log", slog.String("sandbox_id", s.id), slog.Any("error", err))
		return
	}
	if _, err := log.Append(&dsecv1.LogEntry{Op: "boot", At: timestamppb.Now()}); err != nil {
		n.log.Warn("record a cold boot in the trajectory log", slog.String("sandbox_id", s.id), slog.Any("error", err))
	}
}
