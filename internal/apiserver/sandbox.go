package apiserver

import (
	"context"
	"io"
	"log/slog"
	"sort"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/session"
	"github.com/opendsec/dsec/internal/tenant"
)

// sandboxService translates the SandboxService to nodes.
type sandboxService struct {
	r        Router
	sessions *session.Manager
	log      *slog.Logger
}

var _ dsecv1connect.SandboxServiceHandler = (*sandboxService)(nil)

func wire(err error) error { return errwire.ToConnect(err) }

// call routes a unary call by sandbox ID.
func call[Req, Resp any](ctx context.Context, r Router, id string, req *Req, f func(Node, context.Context, *Req) (*Resp, error)) (*connect.Response[Resp], error) {
	n, err := r.ForSandbox(ctx, id)
	if err != nil {
		return nil, wire(err)
	}
	resp, err := f(n, ctx, req)
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(resp), nil
}

func (s *sandboxService) CreateSandbox(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	if err := s.admitSession(ctx, req.Msg.GetSpec()); err != nil {
		return nil, wire(err)
	}
	req.Msg.Project = tenant.Project(ctx)
	sb, err := s.r.Create(ctx, req.Msg)
	if err != nil {
		return nil, wire(err)
	}
	res := []*dsecv1.CreateResult{{Sandbox: sb}}
	s.settle(ctx, res)
	if e := res[0].GetError(); e != nil {
		return nil, wire(errdefs.Conflict("%s", e.GetMessage()))
	}
	return connect.NewResponse(sb), nil
}

func (s *sandboxService) GetSandbox(ctx context.Context, req *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return call(ctx, s.r, req.Msg.GetId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.GetSandboxRequest) (*dsecv1.Sandbox, error) {
		return n.Get(ctx, m.GetId())
	})
}

func (s *sandboxService) ListSandboxes(ctx context.Context, req *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	all := &dsecv1.ListSandboxesResponse{}
	q := &dsecv1.ListSandboxesRequest{LabelSelector: req.Msg.GetLabelSelector(), State: req.Msg.GetState()}
	lists, err := fanOut(s.r.Nodes(ctx), func(n Node) (*dsecv1.ListSandboxesResponse, error) { return n.List(ctx, q) })
	if err != nil {
		return nil, wire(err)
	}
	for _, resp := range lists {
		all.Sandboxes = append(all.Sandboxes, resp.Sandboxes...)
	}
	sort.SliceStable(all.Sandboxes, func(i, j int) bool {
		a, b := all.Sandboxes[i], all.Sandboxes[j]
		if !a.CreatedAt.AsTime().Equal(b.CreatedAt.AsTime()) {
			return a.CreatedAt.AsTime().Before(b.CreatedAt.AsTime())
		}
		return a.Id < b.Id
	})
	return connect.NewResponse(page(all, req.Msg.GetPageSize(), req.Msg.GetPageToken())), nil
}

// page cuts a listing sorted by creation; the token is the last ID sent.
func page(all *dsecv1.ListSandboxesResponse, size int32, token string) *dsecv1.ListSandboxesResponse {
	if size <= 0 || size > 10000 {
		size = 10000
	}
	start := 0
	if token != "" {
		start = len(all.Sandboxes)
		for i, s := range all.Sandboxes {
			if s.Id == token {
				start = i + 1
				break
			}
		}
	}
	end := min(start+int(size), len(all.Sandboxes))
	out := &dsecv1.ListSandboxesResponse{Sandboxes: all.Sandboxes[start:end]}
	if end < len(all.Sandboxes) {
		out.NextPageToken = all.Sandboxes[end-1].Id
	}
	return out
}

func (s *sandboxService) DeleteSandbox(ctx context.Context, req *connect.Request[dsecv1.DeleteSandboxRequest]) (*connect.Response[dsecv1.DeleteSandboxResponse], error) {
	return call(ctx, s.r, req.Msg.GetId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.DeleteSandboxRequest) (*dsecv1.DeleteSandboxResponse, error) {
		return &dsecv1.DeleteSandboxResponse{}, n.Delete(ctx, m.GetId())
	})
}

func (s *sandboxService) Keepalive(ctx context.Context, req *connect.Request[dsecv1.KeepaliveRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return call(ctx, s.r, req.Msg.GetId(), req.Msg, Node.Keepalive)
}

func (s *sandboxService) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResult], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Exec)
}

func (s *sandboxService) ExecStream(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	n, err := s.r.ForSandbox(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return wire(err)
	}
	return wire(n.ExecStream(ctx, req.Msg, stream.Send))
}

func (s *sandboxService) ConnectProcess(ctx context.Context, req *connect.Request[dsecv1.ConnectProcessRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	n, err := s.r.ForSandbox(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return wire(err)
	}
	return wire(n.ConnectProcess(ctx, req.Msg, stream.Send))
}

func (s *sandboxService) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.WriteStdinRequest) (*dsecv1.WriteStdinResponse, error) {
		return &dsecv1.WriteStdinResponse{}, n.WriteStdin(ctx, m)
	})
}

func (s *sandboxService) SignalProcess(ctx context.Context, req *connect.Request[dsecv1.SignalProcessRequest]) (*connect.Response[dsecv1.SignalProcessResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.SignalProcessRequest) (*dsecv1.SignalProcessResponse, error) {
		return &dsecv1.SignalProcessResponse{}, n.SignalProcess(ctx, m)
	})
}

func (s *sandboxService) ResizePTY(ctx context.Context, req *connect.Request[dsecv1.ResizePTYRequest]) (*connect.Response[dsecv1.ResizePTYResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.ResizePTYRequest) (*dsecv1.ResizePTYResponse, error) {
		return &dsecv1.ResizePTYResponse{}, n.ResizePTY(ctx, m)
	})
}

func (s *sandboxService) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.ListProcesses)
}

func (s *sandboxService) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest], stream *connect.ServerStream[dsecv1.ReadFileResponse]) error {
	n, err := s.r.ForSandbox(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return wire(err)
	}
	return wire(n.ReadFile(ctx, req.Msg, stream.Send))
}

func (s *sandboxService) WriteFile(ctx context.Context, stream *connect.ClientStream[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	if !stream.Receive() {
		if err := stream.Err(); err != nil {
			return nil, wire(errdefs.Invalid("read upload: %v", err))
		}
		return nil, wire(errdefs.Invalid("WriteFile needs a header message first"))
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, wire(errdefs.Invalid("WriteFile needs a header message first"))
	}
	n, err := s.r.ForSandbox(ctx, hdr.GetSandboxId())
	if err != nil {
		return nil, wire(err)
	}
	info, err := n.WriteFile(ctx, hdr, &writeFileReader{stream: stream})
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(info), nil
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

func (s *sandboxService) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Stat)
}

func (s *sandboxService) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.ListDir)
}

func (s *sandboxService) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.MakeDir)
}

func (s *sandboxService) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.RemoveRequest) (*dsecv1.RemoveResponse, error) {
		return &dsecv1.RemoveResponse{}, n.Remove(ctx, m)
	})
}

func (s *sandboxService) Rename(ctx context.Context, req *connect.Request[dsecv1.RenameRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Rename)
}

func (s *sandboxService) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], stream *connect.ServerStream[dsecv1.WatchDirEvent]) error {
	n, err := s.r.ForSandbox(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return wire(err)
	}
	return wire(n.WatchDir(ctx, req.Msg, stream.Send))
}

func (s *sandboxService) Screenshot(ctx context.Context, req *connect.Request[dsecv1.ScreenshotRequest]) (*connect.Response[dsecv1.ScreenshotResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.Screenshot)
}

func (s *sandboxService) SendInput(ctx context.Context, req *connect.Request[dsecv1.SendInputRequest]) (*connect.Response[dsecv1.SendInputResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.SendInputRequest) (*dsecv1.SendInputResponse, error) {
		return &dsecv1.SendInputResponse{}, n.SendInput(ctx, m)
	})
}

func (s *sandboxService) OpenVNC(ctx context.Context, req *connect.Request[dsecv1.OpenVNCRequest]) (*connect.Response[dsecv1.OpenVNCResponse], error) {
	return call(ctx, s.r, req.Msg.GetSandboxId(), req.Msg, Node.OpenVNC)
}

func (s *sandboxService) GetSandboxStats(ctx context.Context, req *connect.Request[dsecv1.GetSandboxStatsRequest]) (*connect.Response[dsecv1.SandboxStats], error) {
	return call(ctx, s.r, req.Msg.GetId(), req.Msg, func(n Node, ctx context.Context, m *dsecv1.GetSandboxStatsRequest) (*dsecv1.SandboxStats, error) {
		return n.Stats(ctx, m.GetId())
	})
}
