package node

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
	"github.com/opendsec/dsec/internal/trajectory"
)

const maxRequestID = 256

// mutation is a call that changes a sandbox, as the trajectory log
// records it: its entry (operation and arguments), and for a request ID
// the parts of the request that must match for a repeat to be replayed.
type mutation struct {
	entry       *dsecv1.LogEntry
	requestID   string
	fingerprint []string
}

// logged runs a mutating call (an exec or a file change) under its
// sandbox's trajectory log. It is the decorator every such verb goes
// through, the one place the log's rules live:
//
//   - With a request ID the call is exactly-once: the ID is claimed
//     before anything runs. A repeat gets the logged entry as replay and
//     nothing runs (the verb answers from it, marked replayed); a repeat
//     with a different fingerprint is a conflict; a concurrent one waits.
//   - run performs the call and completes the entry with what it did
//     (result, size, content digest). The entry is appended durably before
//     logged returns it, with its sequence number; a log that cannot
//     record it fails the call (internal).
//   - A call that fails is logged with its error, not under its request
//     ID, which stays free so a retry runs; run's error is returned as is.
func (n *Node) logged(ctx context.Context, s *sandbox, m mutation, run func(*dsecv1.LogEntry) error) (done, replay *dsecv1.LogEntry, err error) {
	if len(m.requestID) > maxRequestID {
		return nil, nil, errdefs.Invalid("request_id longer than %d bytes", maxRequestID)
	}
	log, err := n.logs.Log(s.id)
	if err != nil {
		return nil, nil, errdefs.Internal(err, "open trajectory log")
	}
	var claim func(*dsecv1.LogEntry) (*dsecv1.LogEntry, error)
	if c := m.entry.GetContainer(); c != "" {
		m.fingerprint = append(m.fingerprint, "container", c)
	}
	if m.requestID != "" {
		replay, claim, err = log.Claim(m.requestID, trajectory.Fingerprint(m.fingerprint...), ctx.Done())
		if err != nil || replay != nil {
			if replay != nil {
				n.m.Logged(true)
			}
			return nil, replay, err
		}
	}
	start := time.Now()
	err = run(m.entry)
	e := m.entry
	e.At = timestamppb.New(start.UTC())
	e.DurationMs = time.Since(start).Milliseconds()
	if err != nil {
		if claim != nil {
			claim(nil)
		}
		e.Error = ItemError(err)
		log.Append(e)
		n.m.Logged(false)
		return nil, nil, err
	}
	if claim != nil {
		e, err = claim(e)
	} else {
		e, err = log.Append(e)
	}
	if err != nil {
		return nil, nil, errdefs.Internal(err, "record the call in the trajectory log")
	}
	n.m.Logged(false)
	return e, nil, nil
}

// GetLog reads a sandbox's trajectory log, live or recently deleted.
func (n *Node) GetLog(ctx context.Context, req *dsecv1.GetLogRequest) (*dsecv1.GetLogResponse, error) {
	id := req.GetSandboxId()
	if _, _, err := n.find(ctx, id); err != nil {
		return nil, err
	}
	if !n.logs.Exists(id) {
		return &dsecv1.GetLogResponse{SandboxId: id, NextSeq: 1}, nil
	}
	log, err := n.logs.Log(id)
	if err != nil {
		return nil, errdefs.Internal(err, "open trajectory log")
	}
	limit := int(req.GetLimit())
	if limit <= 0 || limit > 10000 {
		limit = 10000
	}
	entries, next, err := log.Read(req.GetFromSeq(), limit)
	if err != nil {
		return nil, err
	}
	return &dsecv1.GetLogResponse{SandboxId: id, Entries: entries, NextSeq: next}, nil
}

// specOf returns the spec and project of a live or recently deleted
// sandbox the caller can see.
func (n *Node) specOf(ctx context.Context, id string) (*dsecv1.SandboxSpec, string, error) {
	s, t, err := n.find(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if s != nil {
		return s.currentSpec(), s.project, nil
	}
	spec := &dsecv1.SandboxSpec{}
	if err := protojson.Unmarshal(t.Spec, spec); err != nil {
		return nil, "", errdefs.Internal(err, "decode sandbox record")
	}
	return spec, tenant.OrDefault(t.Project), nil
}

// Replay re-executes a sandbox's logged mutating calls, in order, in a new
// sandbox started from the same image or snapshot, and reports where the
// results diverged.
func (n *Node) Replay(ctx context.Context, req *dsecv1.ReplayRequest) (_ *dsecv1.ReplayResponse, err error) {
	defer func() { n.m.Replay(err) }()
	id := req.GetSandboxId()
	spec, project, err := n.specOf(ctx, id)
	if err != nil {
		return nil, err
	}
	if !n.logs.Exists(id) {
		return nil, errdefs.NotFound("sandbox %s has no trajectory log", id)
	}
	log, err := n.logs.Log(id)
	if err != nil {
		return nil, err
	}
	entries, _, err := log.Read(0, 0)
	if err != nil {
		return nil, err
	}
	spec.Session = ""
	// Model calls are the agent's, not calls to re-execute: the replay
	// sandbox has no gateway (and no session to take upstreams from).
	spec.ModelGateway = nil
	labels := map[string]string{}
	for k, v := range spec.Labels {
		if !strings.HasPrefix(k, "dsec.io/") {
			labels[k] = v
		}
	}
	spec.Labels = labels
	if spec.Snapshot != "" {
		spec.Image = ""
	}
	sb, err := n.create(ctx, spec, "", project, map[string]string{"dsec.io/replay-of": id})
	if err != nil {
		return nil, fmt.Errorf("start the replay sandbox: %w", err)
	}
	if !req.GetKeep() {
		defer n.Delete(context.WithoutCancel(ctx), sb.Id)
	}
	out := &dsecv1.ReplayResponse{SandboxId: sb.Id}
	for _, e := range entries {
		if req.GetUntilSeq() > 0 && e.Seq > req.GetUntilSeq() {
			break
		}
		if e.Error != nil || e.Op == "model_call" {
			continue // did not complete the first time; not a command
		}
		step := &dsecv1.ReplayStep{Seq: e.Seq, Op: e.Op, RequestId: e.RequestId}
		diverged, detail := n.replayOne(ctx, sb.Id, e)
		step.Diverged, step.Detail = diverged, detail
		out.Replayed++
		if diverged {
			out.Diverged++
		}
		out.Steps = append(out.Steps, step)
	}
	return out, nil
}

func (n *Node) replayOne(ctx context.Context, id string, e *dsecv1.LogEntry) (bool, string) {
	switch e.Op {
	case "exec":
		req := &dsecv1.ExecRequest{SandboxId: id, Argv: e.Argv, Cwd: e.Cwd, Env: e.Env, User: e.User, TimeoutS: e.TimeoutS}
		if e.StdinDigest != "" {
			f, err := n.logs.OpenBlob(e.StdinDigest)
			if err != nil {
				return true, "stdin was not recorded"
			}
			b, _ := io.ReadAll(f)
			f.Close()
			req.Stdin = b
		}
		r, err := n.Exec(ctx, req)
		if err != nil {
			return true, "exec failed: " + err.Error()
		}
		want := e.GetResult()
		var diffs []string
		if r.ExitCode != want.GetExitCode() {
			diffs = append(diffs, fmt.Sprintf("exit code %d, was %d", r.ExitCode, want.GetExitCode()))
		}
		if string(r.Stdout) != string(want.GetStdout()) {
			diffs = append(diffs, "stdout differs")
		}
		if string(r.Stderr) != string(want.GetStderr()) {
			diffs = append(diffs, "stderr differs")
		}
		return len(diffs) > 0, strings.Join(diffs, "; ")
	case "write_file":
		f, err := n.logs.OpenBlob(e.ContentDigest)
		if err != nil {
			return true, "content was not recorded"
		}
		defer f.Close()
		info, err := n.WriteFile(ctx, &dsecv1.WriteFileHeader{SandboxId: id, Path: e.Path, Mode: e.Mode, User: e.User, Metadata: e.Metadata}, f)
		if err != nil {
			return true, "write failed: " + err.Error()
		}
		if info.Size != e.Size {
			return true, fmt.Sprintf("size %d, was %d", info.Size, e.Size)
		}
	default:
		if replay := fileReplays[e.Op]; replay != nil {
			if err := replay(ctx, n, id, e); err != nil {
				return true, err.Error()
			}
		}
	}
	return false, ""
}
