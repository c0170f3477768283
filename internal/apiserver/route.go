package apiserver

import (
	"context"
	"io"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// This file routes every call that names a sandbox to the node that owns
// it, unchanged: one line per verb. What the verb does, and what it
// answers, is the node's (internal/node, Service) and the proto's.

// route calls a unary verb on the node that owns sandbox id, with the
// request's message in a request of its own: none of the caller's
// headers (its API key among them) travels on to a node.
func route[Req, Res any](ctx context.Context, r Router, id string, req *connect.Request[Req], verb func(Node, context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	n, err := r.ForSandbox(ctx, id)
	if err != nil {
		return nil, wire(err)
	}
	return verb(n, ctx, connect.NewRequest(req.Msg))
}

// node returns the node that owns sandbox id, as a Connect error.
func node(ctx context.Context, r Router, id string) (Node, error) {
	n, err := r.ForSandbox(ctx, id)
	return n, wire(err)
}

// The lifecycle verbs that name a sandbox (the rest of LifecycleService
// places, lists and bulk-acts across nodes: lifecycle.go).

func (s *lifecycleService) GetSandbox(ctx context.Context, req *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.GetSandbox)
}

func (s *lifecycleService) DeleteSandbox(ctx context.Context, req *connect.Request[dsecv1.DeleteSandboxRequest]) (*connect.Response[dsecv1.DeleteSandboxResponse], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.DeleteSandbox)
}

func (s *lifecycleService) Keepalive(ctx context.Context, req *connect.Request[dsecv1.KeepaliveRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.Keepalive)
}

func (s *lifecycleService) PauseSandbox(ctx context.Context, req *connect.Request[dsecv1.PauseSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.PauseSandbox)
}

func (s *lifecycleService) ResumeSandbox(ctx context.Context, req *connect.Request[dsecv1.ResumeSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.ResumeSandbox)
}

func (s *lifecycleService) GetSandboxStats(ctx context.Context, req *connect.Request[dsecv1.GetSandboxStatsRequest]) (*connect.Response[dsecv1.SandboxStats], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.GetSandboxStats)
}

func (s *lifecycleService) SetNetworkPolicy(ctx context.Context, req *connect.Request[dsecv1.SetNetworkPolicyRequest]) (*connect.Response[dsecv1.Network], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.SetNetworkPolicy)
}

func (s *lifecycleService) GetNetworkPolicy(ctx context.Context, req *connect.Request[dsecv1.GetNetworkPolicyRequest]) (*connect.Response[dsecv1.Network], error) {
	return route(ctx, s.r, req.Msg.GetId(), req, Node.GetNetworkPolicy)
}

// processVerbs are ProcessService's unary verbs as a node serves them
// (Node).
type processVerbs interface {
	Exec(context.Context, *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResult], error)
	WriteStdin(context.Context, *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error)
	SignalProcess(context.Context, *connect.Request[dsecv1.SignalProcessRequest]) (*connect.Response[dsecv1.SignalProcessResponse], error)
	ResizePTY(context.Context, *connect.Request[dsecv1.ResizePTYRequest]) (*connect.Response[dsecv1.ResizePTYResponse], error)
	ListProcesses(context.Context, *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error)
}

// processService routes the ProcessService.
type processService struct{ r Router }

var _ dsecv1connect.ProcessServiceHandler = processService{}

func (s processService) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResult], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Exec)
}

func (s processService) ExecStream(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	n, err := node(ctx, s.r, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return n.ExecEvents(ctx, req.Msg, st.Send)
}

func (s processService) ConnectProcess(ctx context.Context, req *connect.Request[dsecv1.ConnectProcessRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	n, err := node(ctx, s.r, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return n.ProcessEvents(ctx, req.Msg, st.Send)
}

func (s processService) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.WriteStdin)
}

func (s processService) SignalProcess(ctx context.Context, req *connect.Request[dsecv1.SignalProcessRequest]) (*connect.Response[dsecv1.SignalProcessResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.SignalProcess)
}

func (s processService) ResizePTY(ctx context.Context, req *connect.Request[dsecv1.ResizePTYRequest]) (*connect.Response[dsecv1.ResizePTYResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.ResizePTY)
}

func (s processService) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.ListProcesses)
}

// filesystemVerbs are FilesystemService's unary verbs as a node serves
// them (Node).
type filesystemVerbs interface {
	Stat(context.Context, *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.FileInfo], error)
	ListDir(context.Context, *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error)
	MakeDir(context.Context, *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.FileInfo], error)
	Remove(context.Context, *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error)
	Rename(context.Context, *connect.Request[dsecv1.RenameRequest]) (*connect.Response[dsecv1.FileInfo], error)
	ChangeMode(context.Context, *connect.Request[dsecv1.ChangeModeRequest]) (*connect.Response[dsecv1.FileInfo], error)
}

// filesystemService routes the FilesystemService.
type filesystemService struct{ r Router }

var _ dsecv1connect.FilesystemServiceHandler = filesystemService{}

func (s filesystemService) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest], st *connect.ServerStream[dsecv1.ReadFileResponse]) error {
	n, err := node(ctx, s.r, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return n.ReadFileChunks(ctx, req.Msg, st.Send)
}

func (s filesystemService) WriteFile(ctx context.Context, st *connect.ClientStream[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	hdr, body, err := writeFileStream(st)
	if err != nil {
		return nil, err
	}
	n, err := node(ctx, s.r, hdr.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return n.WriteFileFrom(ctx, hdr, body)
}

func (s filesystemService) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Stat)
}

func (s filesystemService) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.ListDir)
}

func (s filesystemService) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.MakeDir)
}

func (s filesystemService) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Remove)
}

func (s filesystemService) Rename(ctx context.Context, req *connect.Request[dsecv1.RenameRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Rename)
}

func (s filesystemService) ChangeMode(ctx context.Context, req *connect.Request[dsecv1.ChangeModeRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.ChangeMode)
}

func (s filesystemService) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], st *connect.ServerStream[dsecv1.WatchDirEvent]) error {
	n, err := node(ctx, s.r, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return n.WatchEvents(ctx, req.Msg, st.Send)
}

// logService routes the LogService.
type logService struct{ r Router }

var _ dsecv1connect.LogServiceHandler = logService{}

func (s logService) GetLog(ctx context.Context, req *connect.Request[dsecv1.GetLogRequest]) (*connect.Response[dsecv1.GetLogResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.GetLog)
}

func (s logService) Replay(ctx context.Context, req *connect.Request[dsecv1.ReplayRequest]) (*connect.Response[dsecv1.ReplayResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Replay)
}

func (s logService) StartRollout(ctx context.Context, req *connect.Request[dsecv1.StartRolloutRequest]) (*connect.Response[dsecv1.Rollout], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.StartRollout)
}

func (s logService) GetRollout(ctx context.Context, req *connect.Request[dsecv1.GetRolloutRequest]) (*connect.Response[dsecv1.Rollout], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.GetRollout)
}

func (s logService) WatchRollout(ctx context.Context, req *connect.Request[dsecv1.WatchRolloutRequest], st *connect.ServerStream[dsecv1.RolloutEvent]) error {
	n, err := node(ctx, s.r, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	return n.WatchRollout(ctx, req, st)
}

func (s logService) GetNetworkLog(ctx context.Context, req *connect.Request[dsecv1.GetNetworkLogRequest]) (*connect.Response[dsecv1.GetNetworkLogResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.GetNetworkLog)
}

// screenService routes the ScreenService.
type screenService struct{ r Router }

var _ dsecv1connect.ScreenServiceHandler = screenService{}

func (s screenService) Screenshot(ctx context.Context, req *connect.Request[dsecv1.ScreenshotRequest]) (*connect.Response[dsecv1.ScreenshotResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Screenshot)
}

func (s screenService) SendInput(ctx context.Context, req *connect.Request[dsecv1.SendInputRequest]) (*connect.Response[dsecv1.SendInputResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.SendInput)
}

func (s screenService) OpenVNC(ctx context.Context, req *connect.Request[dsecv1.OpenVNCRequest]) (*connect.Response[dsecv1.OpenVNCResponse], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.OpenVNC)
}

// The snapshot verbs that name a sandbox or a snapshot (ListSnapshots
// spans nodes: lifecycle.go).

func (s *snapshotService) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	return route(ctx, s.r, req.Msg.GetSandboxId(), req, Node.Snapshot)
}

func (s *snapshotService) DeleteSnapshot(ctx context.Context, req *connect.Request[dsecv1.DeleteSnapshotRequest]) (*connect.Response[dsecv1.DeleteSnapshotResponse], error) {
	n, err := s.r.ForSnapshot(ctx, req.Msg.GetId())
	if err != nil {
		return nil, wire(err)
	}
	return n.DeleteSnapshot(ctx, connect.NewRequest(req.Msg))
}

// writeFileStream reads a WriteFile stream's header and returns it with a
// reader of its data.
func writeFileStream(st *connect.ClientStream[dsecv1.WriteFileRequest]) (*dsecv1.WriteFileHeader, io.Reader, error) {
	if !st.Receive() {
		if err := st.Err(); err != nil {
			return nil, nil, wire(errdefs.Invalid("read upload: %v", err))
		}
		return nil, nil, wire(errdefs.Invalid("WriteFile needs a header message first"))
	}
	hdr := st.Msg().GetHeader()
	if hdr == nil {
		return nil, nil, wire(errdefs.Invalid("WriteFile needs a header message first"))
	}
	return hdr, &writeFileReader{stream: st}, nil
}

// writeFileReader reads the data messages of a WriteFile stream.
type writeFileReader struct {
	stream *connect.ClientStream[dsecv1.WriteFileRequest]
	buf    []byte
}

func (r *writeFileReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		if !r.stream.Receive() {
			if err := r.stream.Err(); err != nil {
				return 0, err
			}
			return 0, io.EOF
		}
		r.buf = r.stream.Msg().GetData()
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// Do calls a unary verb of node n with req and returns its result, with
// its error classified again (errdefs): for callers in process, such as
// the compatibility facades, that work with the vocabulary rather than the
// wire.
func Do[Req, Res any](ctx context.Context, n Node, req *Req, verb func(Node, context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (*Res, error) {
	resp, err := verb(n, ctx, connect.NewRequest(req))
	if err != nil {
		return nil, errwire.FromConnect(err)
	}
	return resp.Msg, nil
}
