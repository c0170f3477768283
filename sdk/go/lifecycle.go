package dsec

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
)

func (c *Client) sessionsClient() dsecv1connect.SessionServiceClient { return c.raw.Sessions }

// CreateMany creates count sandboxes of one shape and reports each.
func (c *Client) CreateMany(ctx context.Context, o CreateOptions, count int) (*dsecv1.CreateSandboxesResponse, error) {
	r, err := c.raw.CreateSandboxes(ctx, connect.NewRequest(&dsecv1.CreateSandboxesRequest{Spec: o.spec(), Count: int32(count), IdempotencyKey: o.IdempotencyKey}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Pause freezes a sandbox; any later call resumes it.
func (c *Client) Pause(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	r, err := c.raw.PauseSandbox(ctx, connect.NewRequest(&dsecv1.PauseSandboxRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// PauseFilesystem pauses a sandbox filesystem-only: its processes end and
// only its file system is kept (all its memory and CPU are released); a
// later call or Resume cold-boots it (new processes, a new boot id, the
// same ID and files). Kind container only.
func (c *Client) PauseFilesystem(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	r, err := c.raw.PauseSandbox(ctx, connect.NewRequest(&dsecv1.PauseSandboxRequest{Id: id, FilesystemOnly: true}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Resume thaws a paused sandbox.
func (c *Client) Resume(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	r, err := c.raw.ResumeSandbox(ctx, connect.NewRequest(&dsecv1.ResumeSandboxRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Bulk pauses, resumes or deletes ("pause", "resume", "delete") every
// sandbox matching selector; "pause_filesystem" pauses them
// filesystem-only (PauseFilesystem).
func (c *Client) Bulk(ctx context.Context, op, selector string) (*dsecv1.BulkResponse, error) {
	req := connect.NewRequest(&dsecv1.BulkRequest{LabelSelector: selector, FilesystemOnly: op == "pause_filesystem"})
	var r *connect.Response[dsecv1.BulkResponse]
	var err error
	switch op {
	case "pause", "pause_filesystem":
		r, err = c.raw.PauseSandboxes(ctx, req)
	case "resume":
		r, err = c.raw.ResumeSandboxes(ctx, req)
	default:
		r, err = c.raw.DeleteSandboxes(ctx, req)
	}
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Snapshot captures a sandbox.
func (c *Client) Snapshot(ctx context.Context, id, name string) (*dsecv1.SnapshotInfo, error) {
	r, err := c.raw.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: name}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// ListSnapshots lists snapshots.
func (c *Client) ListSnapshots(ctx context.Context) ([]*dsecv1.SnapshotInfo, error) {
	r, err := c.raw.ListSnapshots(ctx, connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Snapshots, nil
}

// DeleteSnapshot deletes a snapshot.
func (c *Client) DeleteSnapshot(ctx context.Context, id string) error {
	_, err := c.raw.DeleteSnapshot(ctx, connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Id: id}))
	return err
}

// Fork snapshots a sandbox and creates count children from it.
func (c *Client) Fork(ctx context.Context, req *dsecv1.ForkRequest) (*dsecv1.CreateSandboxesResponse, error) {
	r, err := c.raw.Fork(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Log reads a sandbox's trajectory log from seq from.
func (c *Client) Log(ctx context.Context, id string, from uint64) ([]*dsecv1.LogEntry, error) {
	var out []*dsecv1.LogEntry
	for {
		r, err := c.raw.GetLog(ctx, connect.NewRequest(&dsecv1.GetLogRequest{SandboxId: id, FromSeq: from}))
		if err != nil {
			return nil, err
		}
		out = append(out, r.Msg.Entries...)
		if len(r.Msg.Entries) == 0 || r.Msg.NextSeq <= from {
			return out, nil
		}
		from = r.Msg.NextSeq
	}
}

// Replay re-executes a sandbox's logged calls in a fresh sandbox.
func (c *Client) Replay(ctx context.Context, req *dsecv1.ReplayRequest) (*dsecv1.ReplayResponse, error) {
	r, err := c.raw.Replay(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Capacity says how fast to go.
func (c *Client) Capacity(ctx context.Context) (*dsecv1.Capacity, error) {
	r, err := c.raw.System.GetCapacity(ctx, connect.NewRequest(&dsecv1.GetCapacityRequest{}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// OpenSession opens (or reopens) a trainer session.
func (c *Client) OpenSession(ctx context.Context, req *dsecv1.OpenSessionRequest) (*dsecv1.Session, error) {
	r, err := c.sessionsClient().OpenSession(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Heartbeat renews a session.
func (c *Client) Heartbeat(ctx context.Context, name string) (*dsecv1.Session, error) {
	r, err := c.sessionsClient().Heartbeat(ctx, connect.NewRequest(&dsecv1.HeartbeatRequest{Name: name}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// ListSessions lists sessions.
func (c *Client) ListSessions(ctx context.Context) ([]*dsecv1.Session, error) {
	r, err := c.sessionsClient().ListSessions(ctx, connect.NewRequest(&dsecv1.ListSessionsRequest{}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Sessions, nil
}

// SetModelUpstreams replaces a session's model upstreams and limits (the
// model gateway's: CreateOptions.ModelGateway).
func (c *Client) SetModelUpstreams(ctx context.Context, req *dsecv1.SetModelUpstreamsRequest) (*dsecv1.ModelUpstreams, error) {
	r, err := c.sessionsClient().SetModelUpstreams(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// GetModelUpstreams returns a session's model upstreams, without their
// credentials.
func (c *Client) GetModelUpstreams(ctx context.Context, session string) (*dsecv1.ModelUpstreams, error) {
	r, err := c.sessionsClient().GetModelUpstreams(ctx, connect.NewRequest(&dsecv1.GetModelUpstreamsRequest{Session: session}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// StartRollout starts an agent command as a rollout in its sandbox (or
// answers the rollout of that ID: see the proto).
func (c *Client) StartRollout(ctx context.Context, req *dsecv1.StartRolloutRequest) (*dsecv1.Rollout, error) {
	r, err := c.raw.StartRollout(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// GetRollout answers a rollout; with wait > 0, once it ended or wait
// passed.
func (c *Client) GetRollout(ctx context.Context, sandbox, rollout string, wait time.Duration) (*dsecv1.Rollout, error) {
	r, err := c.raw.GetRollout(ctx, connect.NewRequest(&dsecv1.GetRolloutRequest{SandboxId: sandbox, RolloutId: rollout, WaitS: wait.Seconds()}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// WatchRollout streams a rollout's progress: entry gets each entry of its
// sandbox's log from fromSeq on (0: the one after the rollout's start) as
// it is written (the agent's model calls, the commands sent to the
// sandbox), until the rollout ended; it returns the ended rollout. A
// stream that breaks (a replica or the network went) is opened again from
// the entry after the last one given, up to 5 times in a row; ctx ends
// the watch, and an error of entry's ends it with that error.
func (c *Client) WatchRollout(ctx context.Context, sandbox, rollout string, fromSeq uint64, entry func(*dsecv1.LogEntry) error) (*dsecv1.Rollout, error) {
	failures := 0
	for {
		st, err := c.raw.WatchRollout(ctx, connect.NewRequest(&dsecv1.WatchRolloutRequest{SandboxId: sandbox, RolloutId: rollout, FromSeq: fromSeq}))
		if err == nil {
			for st.Receive() {
				failures = 0
				ev := st.Msg()
				if r := ev.GetRollout(); r != nil && r.State != "running" {
					st.Close()
					return r, nil
				}
				if e := ev.GetEntry(); e != nil {
					fromSeq = e.Seq + 1
					if e.Op == "rollout_start" || e.Op == "rollout_end" {
						continue
					}
					if err := entry(e); err != nil {
						st.Close()
						return nil, err
					}
				}
			}
			err = st.Err()
			st.Close()
		}
		err = asError(err)
		if err == nil {
			// The stream ended without the rollout's end (its replica stopped).
			err = &Error{Kind: "unavailable", Message: "the rollout's stream ended before the rollout", Infra: true, Retryable: true}
		}
		var de *Error
		if ctx.Err() != nil || !errors.As(err, &de) || !de.Retryable || failures >= 5 {
			return nil, err
		}
		failures++
		select {
		case <-time.After(time.Duration(100<<failures) * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// CloseSession ends a session.
func (c *Client) CloseSession(ctx context.Context, name string, deleteSandboxes bool) (*dsecv1.Session, error) {
	r, err := c.sessionsClient().CloseSession(ctx, connect.NewRequest(&dsecv1.CloseSessionRequest{Name: name, DeleteSandboxes: deleteSandboxes}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}
