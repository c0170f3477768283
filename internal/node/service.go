package node

import (
	"context"
	"errors"
	"io"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
)

// Service is the node's sandbox API: the public services (api/dsec/v1)
// for this node's own sandboxes, as their generated Connect handler
// interfaces, which the proto documents call by call. The control plane
// routes a call naming a sandbox to its node's Service unchanged: in
// `dsec serve` in process, in a cluster over the node API (a node agent
// mounts the Service behind the cluster token). Creates here start on this
// node (placement and sessions were decided by the caller); lists and bulk
// operations cover this node.
//
// A unary verb is written once, as its handler method; a streaming verb
// has its handler method (for the node API) and a callback form (for the
// control plane in process, which cannot make Connect's stream types).
// Errors are the node's, mapped to Connect once, here.
type Service struct{ n *Node }

// Service returns the node's sandbox API.
func (n *Node) Service() *Service { return &Service{n} }

var (
	_ dsecv1connect.LifecycleServiceHandler  = (*Service)(nil)
	_ dsecv1connect.ProcessServiceHandler    = (*Service)(nil)
	_ dsecv1connect.FilesystemServiceHandler = (*Service)(nil)
	_ dsecv1connect.SnapshotServiceHandler   = (*Service)(nil)
	_ dsecv1connect.LogServiceHandler        = (*Service)(nil)
	_ dsecv1connect.ScreenServiceHandler     = (*Service)(nil)
	_ dsecv1connect.FunctionServiceHandler   = (*Service)(nil)
	_ dsecv1connect.SystemServiceHandler     = (*Service)(nil)
	_ dsecv1connect.EventServiceHandler      = (*Service)(nil)
)

// Name is the node's name.
func (s *Service) Name() string { return s.n.Name() }

// answer wraps a node result as a Connect response, or its error as a
// Connect error.
func answer[T any](v *T, err error) (*connect.Response[T], error) {
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(v), nil
}

// done answers a verb whose result is an empty message.
func done[T any](err error) (*connect.Response[T], error) {
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(new(T)), nil
}

// Lifecycle.

// CreateSandbox starts a sandbox of the caller's project on this node.
func (s *Service) CreateSandbox(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	m := req.Msg
	if m.GetCompose() != "" || len(m.GetComposeOverrides()) > 0 {
		// The API server reads compose files; a node is given specs.
		return nil, errwire.ToConnect(errdefs.Invalid("a node takes specs, not compose files: create through the API"))
	}
	return answer(s.n.create(ctx, m.GetSpec(), m.GetIdempotencyKey(), tenant.Project(ctx), nil))
}

// CreateMany creates one sandbox per spec on this node for project, with
// each item's idempotency key (or none), as placement decided.
func (s *Service) CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse {
	return s.n.CreateMany(ctx, specs, keys, project)
}

func (s *Service) CreateSandboxes(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxesRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	m := req.Msg
	specs := m.GetSpecs()
	if len(specs) == 0 {
		for i := int32(0); i < m.GetCount(); i++ {
			specs = append(specs, m.GetSpec())
		}
	}
	return answer(s.n.CreateMany(ctx, specs, ItemKeys(m.GetIdempotencyKey(), len(specs)), tenant.Project(ctx)), nil)
}

func (s *Service) GetSandbox(ctx context.Context, req *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return answer(s.n.Get(ctx, req.Msg.GetId()))
}

func (s *Service) ListSandboxes(ctx context.Context, req *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	return answer(s.n.List(ctx, req.Msg))
}

func (s *Service) DeleteSandbox(ctx context.Context, req *connect.Request[dsecv1.DeleteSandboxRequest]) (*connect.Response[dsecv1.DeleteSandboxResponse], error) {
	return done[dsecv1.DeleteSandboxResponse](s.n.Delete(ctx, req.Msg.GetId()))
}

func (s *Service) Keepalive(ctx context.Context, req *connect.Request[dsecv1.KeepaliveRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return answer(s.n.Keepalive(ctx, req.Msg))
}

func (s *Service) PauseSandbox(ctx context.Context, req *connect.Request[dsecv1.PauseSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return answer(s.n.pauseRequest(ctx, req.Msg))
}

func (s *Service) ResumeSandbox(ctx context.Context, req *connect.Request[dsecv1.ResumeSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return answer(s.n.Resume(ctx, req.Msg.GetId()))
}

func (s *Service) PauseSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return answer(s.n.Bulk(ctx, pauseOp(req.Msg.GetFilesystemOnly()), req.Msg.GetLabelSelector(), ""))
}

func (s *Service) ResumeSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return answer(s.n.Bulk(ctx, "resume", req.Msg.GetLabelSelector(), ""))
}

func (s *Service) DeleteSandboxes(ctx context.Context, req *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error) {
	return answer(s.n.Bulk(ctx, "delete", req.Msg.GetLabelSelector(), req.Msg.GetCause()))
}

func (s *Service) GetSandboxStats(ctx context.Context, req *connect.Request[dsecv1.GetSandboxStatsRequest]) (*connect.Response[dsecv1.SandboxStats], error) {
	return answer(s.n.Stats(ctx, req.Msg.GetId(), req.Msg.GetHistory()))
}

func (s *Service) SetNetworkPolicy(ctx context.Context, req *connect.Request[dsecv1.SetNetworkPolicyRequest]) (*connect.Response[dsecv1.Network], error) {
	return answer(s.n.SetNetworkPolicy(ctx, req.Msg))
}

func (s *Service) GetNetworkPolicy(ctx context.Context, req *connect.Request[dsecv1.GetNetworkPolicyRequest]) (*connect.Response[dsecv1.Network], error) {
	return answer(s.n.GetNetworkPolicy(ctx, req.Msg.GetId()))
}

// Processes.

func (s *Service) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResult], error) {
	return answer(s.n.Exec(ctx, req.Msg))
}

func (s *Service) ExecStream(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	return s.ExecEvents(ctx, req.Msg, st.Send)
}

// ExecEvents is ExecStream with a callback for each event.
func (s *Service) ExecEvents(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
	return stream(send, func(send func(*dsecv1.ExecEvent) error) error { return s.n.ExecStream(ctx, req, send) })
}

// stream runs a node stream whose messages go to send, and returns send's
// own error as it is (it is the caller's) and the node's as a Connect
// error.
func stream[T any](send func(*T) error, run func(func(*T) error) error) error {
	var sendErr error
	err := run(func(m *T) error {
		if err := send(m); err != nil {
			sendErr = err
			return err
		}
		return nil
	})
	if err != nil && sendErr != nil && errors.Is(err, sendErr) {
		return sendErr
	}
	return errwire.ToConnect(err)
}

func (s *Service) ConnectProcess(ctx context.Context, req *connect.Request[dsecv1.ConnectProcessRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	return s.ProcessEvents(ctx, req.Msg, st.Send)
}

// ProcessEvents is ConnectProcess with a callback for each event.
func (s *Service) ProcessEvents(ctx context.Context, req *dsecv1.ConnectProcessRequest, send func(*dsecv1.ExecEvent) error) error {
	return stream(send, func(send func(*dsecv1.ExecEvent) error) error { return s.n.ConnectProcess(ctx, req, send) })
}

func (s *Service) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return done[dsecv1.WriteStdinResponse](s.n.WriteStdin(ctx, req.Msg))
}

func (s *Service) SignalProcess(ctx context.Context, req *connect.Request[dsecv1.SignalProcessRequest]) (*connect.Response[dsecv1.SignalProcessResponse], error) {
	return done[dsecv1.SignalProcessResponse](s.n.SignalProcess(ctx, req.Msg))
}

func (s *Service) ResizePTY(ctx context.Context, req *connect.Request[dsecv1.ResizePTYRequest]) (*connect.Response[dsecv1.ResizePTYResponse], error) {
	return done[dsecv1.ResizePTYResponse](s.n.ResizePTY(ctx, req.Msg))
}

func (s *Service) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return answer(s.n.ListProcesses(ctx, req.Msg))
}

// Files.

func (s *Service) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest], st *connect.ServerStream[dsecv1.ReadFileResponse]) error {
	return s.ReadFileChunks(ctx, req.Msg, st.Send)
}

// ReadFileChunks is ReadFile with a callback for the info and each chunk.
func (s *Service) ReadFileChunks(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) error {
	return stream(send, func(send func(*dsecv1.ReadFileResponse) error) error { return s.n.ReadFile(ctx, req, send) })
}

func (s *Service) WriteFile(ctx context.Context, st *connect.ClientStream[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.FileInfo], error) {
	if !st.Receive() || st.Msg().GetHeader() == nil {
		if err := st.Err(); err != nil {
			return nil, errwire.ToConnect(errdefs.Invalid("read upload: %v", err))
		}
		return nil, errwire.ToConnect(errdefs.Invalid("WriteFile needs a header message first"))
	}
	return s.WriteFileFrom(ctx, st.Msg().GetHeader(), streamData(st))
}

// WriteFileFrom is WriteFile with the header read and the data a reader.
func (s *Service) WriteFileFrom(ctx context.Context, hdr *dsecv1.WriteFileHeader, r io.Reader) (*connect.Response[dsecv1.FileInfo], error) {
	return answer(s.n.WriteFile(ctx, hdr, r))
}

func (s *Service) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], st *connect.ServerStream[dsecv1.WatchDirEvent]) error {
	return s.WatchEvents(ctx, req.Msg, st.Send)
}

// WatchEvents is WatchDir with a callback for each event.
func (s *Service) WatchEvents(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error {
	return stream(send, func(send func(*dsecv1.WatchDirEvent) error) error { return s.n.WatchDir(ctx, req, send) })
}

// Events.

// Subscribe streams the node's lifecycle events the caller may see.
func (s *Service) Subscribe(ctx context.Context, req *connect.Request[dsecv1.SubscribeRequest], st *connect.ServerStream[dsecv1.Event]) error {
	return s.Events(ctx, req.Msg, st.Send, true)
}

// Events is Subscribe with a callback for each event; heartbeats false
// sends only the first (see Node.Subscribe).
func (s *Service) Events(ctx context.Context, req *dsecv1.SubscribeRequest, send func(*dsecv1.Event) error, heartbeats bool) error {
	return stream(send, func(send func(*dsecv1.Event) error) error { return s.n.Subscribe(ctx, req, send, heartbeats) })
}

// Snapshots.

func (s *Service) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	return answer(s.n.Snapshot(ctx, req.Msg))
}

func (s *Service) ListSnapshots(ctx context.Context, req *connect.Request[dsecv1.ListSnapshotsRequest]) (*connect.Response[dsecv1.ListSnapshotsResponse], error) {
	return answer(&dsecv1.ListSnapshotsResponse{Snapshots: s.n.ListSnapshots(ctx)}, nil)
}

func (s *Service) DeleteSnapshot(ctx context.Context, req *connect.Request[dsecv1.DeleteSnapshotRequest]) (*connect.Response[dsecv1.DeleteSnapshotResponse], error) {
	return done[dsecv1.DeleteSnapshotResponse](s.n.DeleteSnapshot(ctx, req.Msg.GetId()))
}

func (s *Service) Fork(ctx context.Context, req *connect.Request[dsecv1.ForkRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	return answer(s.n.Fork(ctx, req.Msg))
}

// Logs.

func (s *Service) GetLog(ctx context.Context, req *connect.Request[dsecv1.GetLogRequest]) (*connect.Response[dsecv1.GetLogResponse], error) {
	return answer(s.n.GetLog(ctx, req.Msg))
}

func (s *Service) GetNetworkLog(ctx context.Context, req *connect.Request[dsecv1.GetNetworkLogRequest]) (*connect.Response[dsecv1.GetNetworkLogResponse], error) {
	return answer(s.n.GetNetworkLog(ctx, req.Msg))
}

func (s *Service) Replay(ctx context.Context, req *connect.Request[dsecv1.ReplayRequest]) (*connect.Response[dsecv1.ReplayResponse], error) {
	return answer(s.n.Replay(ctx, req.Msg))
}

func (s *Service) StartRollout(ctx context.Context, req *connect.Request[dsecv1.StartRolloutRequest]) (*connect.Response[dsecv1.Rollout], error) {
	return answer(s.n.StartRollout(ctx, req.Msg))
}

func (s *Service) WatchRollout(ctx context.Context, req *connect.Request[dsecv1.WatchRolloutRequest], st *connect.ServerStream[dsecv1.RolloutEvent]) error {
	return stream(st.Send, func(send func(*dsecv1.RolloutEvent) error) error { return s.n.WatchRollout(ctx, req.Msg, send) })
}

func (s *Service) GetRollout(ctx context.Context, req *connect.Request[dsecv1.GetRolloutRequest]) (*connect.Response[dsecv1.Rollout], error) {
	return answer(s.n.GetRollout(ctx, req.Msg))
}

// Screens.

func (s *Service) Screenshot(ctx context.Context, req *connect.Request[dsecv1.ScreenshotRequest]) (*connect.Response[dsecv1.ScreenshotResponse], error) {
	return answer(s.n.Screenshot(ctx, req.Msg))
}

func (s *Service) SendInput(ctx context.Context, req *connect.Request[dsecv1.SendInputRequest]) (*connect.Response[dsecv1.SendInputResponse], error) {
	return done[dsecv1.SendInputResponse](s.n.SendInput(ctx, req.Msg))
}

func (s *Service) OpenVNC(ctx context.Context, req *connect.Request[dsecv1.OpenVNCRequest]) (*connect.Response[dsecv1.OpenVNCResponse], error) {
	return answer(s.n.OpenVNC(ctx, req.Msg))
}

// Function calls.

func (s *Service) RunCode(ctx context.Context, req *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResult], error) {
	return answer(s.n.RunCode(ctx, req.Msg))
}

func (s *Service) RunCodeBatch(ctx context.Context, req *connect.Request[dsecv1.RunCodeBatchRequest]) (*connect.Response[dsecv1.RunCodeBatchResponse], error) {
	res, err := s.n.RunCodeBatch(ctx, req.Msg.GetCalls())
	return answer(&dsecv1.RunCodeBatchResponse{Results: res}, err)
}

func (s *Service) ListLanguages(ctx context.Context, req *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	langs, err := s.n.Languages(ctx, req.Msg.GetImage())
	return answer(&dsecv1.ListLanguagesResponse{Languages: langs}, err)
}

// The node's own description.

func (s *Service) GetInfo(ctx context.Context, req *connect.Request[dsecv1.GetInfoRequest]) (*connect.Response[dsecv1.Info], error) {
	return answer(&dsecv1.Info{Nodes: []*dsecv1.NodeInfo{s.n.Info(ctx)}}, nil)
}

func (s *Service) GetCapacity(ctx context.Context, req *connect.Request[dsecv1.GetCapacityRequest]) (*connect.Response[dsecv1.Capacity], error) {
	return answer(s.n.Capacity(ctx), nil)
}

// Images: this node's, as ImageService's handler (the node API), and with
// callbacks for progress (the control plane in process).

var _ dsecv1connect.ImageServiceHandler = (*Service)(nil)

func (s *Service) ListImages(ctx context.Context, req *connect.Request[dsecv1.ListImagesRequest]) (*connect.Response[dsecv1.ListImagesResponse], error) {
	return answer(&dsecv1.ListImagesResponse{Images: s.Images(ctx)}, nil)
}

func (s *Service) GetImage(ctx context.Context, req *connect.Request[dsecv1.GetImageRequest]) (*connect.Response[dsecv1.Image], error) {
	return answer(s.n.GetImage(ctx, req.Msg.GetName()))
}

func (s *Service) DeleteImage(ctx context.Context, req *connect.Request[dsecv1.DeleteImageRequest]) (*connect.Response[dsecv1.DeleteImageResponse], error) {
	return done[dsecv1.DeleteImageResponse](s.n.DeleteImage(ctx, req.Msg.GetName()))
}

// progressStream sends an import's progress and, last, the image.
func progressStream(st *connect.ServerStream[dsecv1.ImageProgress], run func(func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)) error {
	var sendErr error
	img, err := run(func(p *dsecv1.ImageProgress) {
		if sendErr == nil {
			sendErr = st.Send(p)
		}
	})
	if err != nil {
		return err
	}
	if sendErr != nil {
		return sendErr
	}
	return st.Send(&dsecv1.ImageProgress{Phase: "done", Message: img.GetName(), Image: img})
}

func (s *Service) PullImage(ctx context.Context, req *connect.Request[dsecv1.PullImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return progressStream(st, func(p func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) { return s.Pull(ctx, req.Msg, p) })
}

func (s *Service) ExportImage(ctx context.Context, req *connect.Request[dsecv1.ExportImageRequest], st *connect.ServerStream[dsecv1.ExportImageChunk]) error {
	return s.Export(ctx, req.Msg, st.Send)
}

// Export sends an image as a tar of an OCI image layout, in chunks.
func (s *Service) Export(ctx context.Context, req *dsecv1.ExportImageRequest, send func(*dsecv1.ExportImageChunk) error) error {
	return stream(send, func(send func(*dsecv1.ExportImageChunk) error) error { return s.n.ExportImage(ctx, req, send) })
}

func (s *Service) PushImage(ctx context.Context, req *connect.Request[dsecv1.PushImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return progressStream(st, func(p func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) { return s.Push(ctx, req.Msg, p) })
}

func (s *Service) BootstrapImage(ctx context.Context, req *connect.Request[dsecv1.BootstrapImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return progressStream(st, func(p func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) { return s.Bootstrap(ctx, req.Msg, p) })
}

func (s *Service) UploadImage(ctx context.Context, st *connect.ClientStream[dsecv1.UploadImageRequest]) (*connect.Response[dsecv1.Image], error) {
	if !st.Receive() || st.Msg().GetHeader() == nil {
		return nil, errwire.ToConnect(errdefs.Invalid("UploadImage needs a header message first"))
	}
	return answer(s.Upload(ctx, st.Msg().GetHeader(), streamData(st)))
}

// streamData reads the data of a client stream's messages after its
// header.
func streamData[T any, P interface {
	*T
	GetData() []byte
}](st *connect.ClientStream[T]) io.Reader {
	return &chunkReader{next: func() ([]byte, error) {
		if !st.Receive() {
			if err := st.Err(); err != nil {
				return nil, err
			}
			return nil, io.EOF
		}
		return P(st.Msg()).GetData(), nil
	}}
}

// chunkReader reads the data of a stream's messages.
type chunkReader struct {
	next func() ([]byte, error)
	buf  []byte
}

func (r *chunkReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		b, err := r.next()
		if err != nil {
			return 0, err
		}
		r.buf = b
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// Images lists the images the caller sees on this node.
func (s *Service) Images(ctx context.Context) []*dsecv1.Image { return s.n.ListImages(ctx) }

// Image returns an image as the caller sees it.
func (s *Service) Image(ctx context.Context, name string) (*dsecv1.Image, error) {
	img, err := s.n.GetImage(ctx, name)
	return img, errwire.ToConnect(err)
}

// RemoveImage removes an image as the caller sees it.
func (s *Service) RemoveImage(ctx context.Context, name string) error {
	return errwire.ToConnect(s.n.DeleteImage(ctx, name))
}

// Pull imports an image from a registry.
func (s *Service) Pull(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	img, err := s.n.PullImage(ctx, req, progress)
	return img, errwire.ToConnect(err)
}

// Push writes an image to a registry.
func (s *Service) Push(ctx context.Context, req *dsecv1.PushImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	img, err := s.n.PushImage(ctx, req, progress)
	return img, errwire.ToConnect(err)
}

// Upload imports an archive or a VM disk streamed by the client.
func (s *Service) Upload(ctx context.Context, hdr *dsecv1.UploadImageHeader, r io.Reader) (*dsecv1.Image, error) {
	img, err := s.n.UploadImage(ctx, hdr, r)
	return img, errwire.ToConnect(err)
}

// Bootstrap builds a base image offline.
func (s *Service) Bootstrap(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	img, err := s.n.BootstrapImage(ctx, req, progress)
	return img, errwire.ToConnect(err)
}

// Builds and commits.

func (s *Service) BuildImage(ctx context.Context, req *connect.Request[dsecv1.BuildImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return progressStream(st, func(p func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) { return s.Build(ctx, req.Msg, p) })
}

func (s *Service) UploadBuildContext(ctx context.Context, st *connect.ClientStream[dsecv1.UploadBuildContextRequest]) (*connect.Response[dsecv1.BuildContext], error) {
	if !st.Receive() || st.Msg().GetHeader() == nil {
		return nil, errwire.ToConnect(errdefs.Invalid("UploadBuildContext needs a header message first"))
	}
	return answer(s.UploadContext(ctx, st.Msg().GetHeader(), streamData(st)))
}

func (s *Service) CommitSandbox(ctx context.Context, req *connect.Request[dsecv1.CommitSandboxRequest]) (*connect.Response[dsecv1.Image], error) {
	return answer(s.Commit(ctx, req.Msg))
}

func (s *Service) PruneBuildCache(ctx context.Context, req *connect.Request[dsecv1.PruneBuildCacheRequest]) (*connect.Response[dsecv1.PruneBuildCacheResponse], error) {
	return answer(s.PruneCache(ctx))
}

// Build builds an image from a Dockerfile on this node.
func (s *Service) Build(ctx context.Context, req *dsecv1.BuildImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	img, err := s.n.BuildImage(ctx, req, progress)
	return img, errwire.ToConnect(err)
}

// UploadContext stores a build context streamed by the client.
func (s *Service) UploadContext(ctx context.Context, hdr *dsecv1.UploadBuildContextHeader, r io.Reader) (*dsecv1.BuildContext, error) {
	c, err := s.n.UploadBuildContext(ctx, r)
	return c, errwire.ToConnect(err)
}

// Commit stores a sandbox's files as an image.
func (s *Service) Commit(ctx context.Context, req *dsecv1.CommitSandboxRequest) (*dsecv1.Image, error) {
	img, err := s.n.CommitSandbox(ctx, req)
	return img, errwire.ToConnect(err)
}

// PruneCache removes what the node keeps as a cache for the caller (see
// Node.PruneImages).
func (s *Service) PruneCache(ctx context.Context) (*dsecv1.PruneBuildCacheResponse, error) {
	p := s.n.PruneImages(ctx)
	return &dsecv1.PruneBuildCacheResponse{Removed: p.BuildSteps, Copies: p.Copies, LayerBytes: p.LayerBytes, ChunkBytes: p.ChunkBytes}, nil
}

// pauseRequest pauses as req says (filesystem-only or not).
func (n *Node) pauseRequest(ctx context.Context, req *dsecv1.PauseSandboxRequest) (*dsecv1.Sandbox, error) {
	if req.GetFilesystemOnly() {
		return n.PauseFilesystem(ctx, req.GetId())
	}
	return n.Pause(ctx, req.GetId())
}

// pauseOp is Bulk's pause operation.
func pauseOp(fsOnly bool) string {
	if fsOnly {
		return "pause_filesystem"
	}
	return "pause"
}
