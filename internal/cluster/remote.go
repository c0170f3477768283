package cluster

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/api/dsec/node/v1/nodev1connect"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
)

// remote is a node agent as the apiserver sees it: a Connect client of the
// node's API (the public services for its own sandboxes, and NodeService).
// Every call ends, with a "node lost" error, as soon as the node's
// membership lease expires; a call to a node that does not answer fails
// with an unreachable error rather than hanging. Streams pass through a
// message at a time, never buffered whole.
type remote struct {
	name, addr string
	router     *Router
	sb         dsecv1connect.SandboxServiceClient
	img        dsecv1connect.ImageServiceClient
	sys        dsecv1connect.SystemServiceClient
	fn         dsecv1connect.FunctionServiceClient
	nd         nodev1connect.NodeServiceClient

	lapsed atomic.Bool     // the node has no lease but answers: routed to, not placed on
	lost   context.Context // done once the node is lost
	lose   context.CancelCauseFunc
}

var _ apiserver.Node = (*remote)(nil)

// errLost is the cause of calls ended by the node's loss.
var errLost = errors.New("node lost")

// nodeTransport is the HTTP transport to node agents: cleartext HTTP/2
// (streams share connections), short dials, and pings that find a dead
// peer in seconds.
func nodeTransport() *http.Transport {
	t := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 15 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		HTTP2:               &http.HTTP2Config{SendPingTimeout: 10 * time.Second, PingTimeout: 5 * time.Second},
	}
	t.Protocols = new(http.Protocols)
	t.Protocols.SetUnencryptedHTTP2(true)
	return t
}

func newRemote(r *Router, name, addr string) *remote {
	base := "http://" + addr
	opts := []connect.ClientOption{
		connect.WithInterceptors(&nodeAuth{token: r.cfg.Token}),
		// An exec result holds up to two streams at the largest output cap
		// a node allows (64 MiB each by default): a smaller bound would
		// fail such a result on every try.
		connect.WithReadMaxBytes(129 << 20),
		connect.WithSendMaxBytes(64 << 20),
		// Node traffic stays in the data center: compression costs CPU on
		// both ends for little.
		connect.WithAcceptCompression("gzip", nil, nil),
	}
	rn := &remote{
		name: name, addr: addr, router: r,
		sb:  dsecv1connect.NewSandboxServiceClient(r.http, base, opts...),
		img: dsecv1connect.NewImageServiceClient(r.http, base, opts...),
		sys: dsecv1connect.NewSystemServiceClient(r.http, base, opts...),
		fn:  dsecv1connect.NewFunctionServiceClient(r.http, base, opts...),
		nd:  nodev1connect.NewNodeServiceClient(r.http, base, opts...),
	}
	rn.lost, rn.lose = context.WithCancelCause(context.Background())
	return rn
}

// markLost ends every call in flight to the node.
func (r *remote) markLost() { r.lose(errLost) }

// begin bounds a call by ctx and by the node's membership.
func (r *remote) begin(ctx context.Context) (context.Context, func()) {
	cctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(r.lost, func() { cancel(errLost) })
	return cctx, func() { stop(); cancel(nil) }
}

// lostError is the error of a call to a lost node.
func lostError(name string) error {
	return errdefs.Unavailable("node %s lost: its membership lease went and it does not answer; its sandboxes are unreachable until it returns", name)
}

// probe asks the node for its load: nil if it answers as itself.
func (r *remote) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	l, err := unary(r, ctx, &nodev1.GetLoadRequest{}, r.nd.GetLoad)
	if err != nil {
		return err
	}
	if l.Name != "" && l.Name != r.name {
		return errdefs.Unavailable("node %s's address %s answers as node %s", r.name, r.addr, l.Name)
	}
	return nil
}

// fail classifies err from a call made with cctx.
func (r *remote) fail(cctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(context.Cause(cctx), errLost) {
		return lostError(r.name)
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		for _, d := range ce.Details() {
			if v, derr := d.Value(); derr == nil {
				if _, ok := v.(*dsecv1.ErrorInfo); ok {
					return errwire.FromConnect(err) // the node's own answer
				}
			}
		}
	}
	if cctx.Err() != nil {
		return errdefs.Classify(cctx.Err())
	}
	var e *errdefs.Error
	if errors.As(err, &e) {
		return err
	}
	// Keep the transport error (a refused dial says nothing was sent), not
	// the connect error around it: that one would go to the wire as is.
	cause := err
	if ce != nil {
		if cause = ce.Unwrap(); cause == nil {
			cause = errors.New(ce.Message())
		}
	}
	return errdefs.Unavailable("node %s unreachable: its sandboxes cannot be reached until it answers again", r.name).WithCause(cause)
}

// unary runs one unary call.
func unary[Req, Resp any](r *remote, ctx context.Context, req *Req, f func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error)) (*Resp, error) {
	cctx, done := r.begin(ctx)
	defer done()
	resp, err := f(cctx, connect.NewRequest(req))
	if err != nil {
		return nil, r.fail(cctx, err)
	}
	return resp.Msg, nil
}

// serverStream relays a server stream message by message.
func serverStream[Req, Msg any](r *remote, ctx context.Context, req *Req, f func(context.Context, *connect.Request[Req]) (*connect.ServerStreamForClient[Msg], error), send func(*Msg) error) error {
	cctx, done := r.begin(ctx)
	defer done()
	stream, err := f(cctx, connect.NewRequest(req))
	if err != nil {
		return r.fail(cctx, err)
	}
	defer stream.Close()
	for stream.Receive() {
		if err := send(stream.Msg()); err != nil {
			return err
		}
	}
	return r.fail(cctx, stream.Err())
}

// nodeAuth sends the cluster token and the caller (its project and
// role), which the node checks every object against.
type nodeAuth struct{ token string }

func (a *nodeAuth) set(ctx context.Context, h http.Header) {
	if a.token != "" {
		h.Set("Authorization", "Bearer "+a.token)
	}
	apiserver.SetCaller(ctx, h)
}

func (a *nodeAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		a.set(ctx, req.Header())
		return next(ctx, req)
	}
}

func (a *nodeAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		a.set(ctx, conn.RequestHeader())
		return conn
	}
}

func (a *nodeAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func (r *remote) Name() string { return r.name }

// Info is the node's own description, with its state in the cluster.
func (r *remote) Info(ctx context.Context) *dsecv1.NodeInfo {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	state := "ready"
	if n := r.router.state.Node(r.name); n != nil {
		state = n.State()
	}
	if r.lapsed.Load() {
		state = "lapsed"
	}
	info, err := unary(r, ctx, &dsecv1.GetInfoRequest{}, r.sys.GetInfo)
	if err != nil || len(info.Nodes) == 0 {
		return &dsecv1.NodeInfo{Name: r.name, Address: r.addr, State: "unreachable"}
	}
	ni := info.Nodes[0]
	ni.Address, ni.State = r.addr, state
	return ni
}

// createOn creates sandboxes on this node through NodeService.
func (r *remote) createOn(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) (*nodev1.CreateSandboxesResponse, error) {
	ctx = tenant.With(ctx, tenant.Caller{Project: project, Admin: tenant.From(ctx).Admin})
	return unary(r, ctx, &nodev1.CreateSandboxesRequest{Specs: specs, IdempotencyKeys: keys, Project: project}, r.nd.CreateSandboxes)
}

func (r *remote) Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error) {
	resp, err := r.createOn(ctx, []*dsecv1.SandboxSpec{req.GetSpec()}, []string{req.GetIdempotencyKey()}, req.GetProject())
	if err != nil {
		return nil, err
	}
	return itemResult(resp.GetResult(), 0)
}

// itemResult is item i of a batch answer as a single answer.
func itemResult(resp *dsecv1.CreateSandboxesResponse, i int) (*dsecv1.Sandbox, error) {
	if i >= len(resp.GetResults()) {
		return nil, errdefs.Internal(nil, "node answered %d results for %d items", len(resp.GetResults()), i+1)
	}
	res := resp.Results[i]
	if e := res.GetError(); e != nil {
		return nil, fromItemError(e)
	}
	return res.GetSandbox(), nil
}

func fromItemError(e *dsecv1.ItemError) *errdefs.Error {
	return &errdefs.Error{Kind: errdefs.Kind(e.Kind), Msg: e.Message, Infra: e.Infra, Retryable: e.Retryable, RetryAfter: time.Duration(e.RetryAfterMs) * time.Millisecond}
}

func itemError(err error) *dsecv1.ItemError {
	e := errdefs.Classify(err)
	return &dsecv1.ItemError{Kind: string(e.Kind), Message: e.Msg, Infra: e.Infra, Retryable: e.Retryable, RetryAfterMs: e.RetryAfter.Milliseconds()}
}

func (r *remote) CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse {
	resp, err := r.createOn(ctx, specs, keys, project)
	if err != nil {
		out := &dsecv1.CreateSandboxesResponse{Failed: int32(len(specs))}
		for i := range specs {
			out.Results = append(out.Results, &dsecv1.CreateResult{Index: int32(i), Error: itemError(err)})
		}
		return out
	}
	return resp.GetResult()
}

func (r *remote) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	return unary(r, ctx, &dsecv1.GetSandboxRequest{Id: id}, r.sb.GetSandbox)
}

func (r *remote) List(ctx context.Context, req *dsecv1.ListSandboxesRequest) (*dsecv1.ListSandboxesResponse, error) {
	return unary(r, ctx, req, r.sb.ListSandboxes)
}

func (r *remote) Delete(ctx context.Context, id string) error {
	_, err := unary(r, ctx, &dsecv1.DeleteSandboxRequest{Id: id}, r.sb.DeleteSandbox)
	return err
}

func (r *remote) Keepalive(ctx context.Context, req *dsecv1.KeepaliveRequest) (*dsecv1.Sandbox, error) {
	return unary(r, ctx, req, r.sb.Keepalive)
}

func (r *remote) Exec(ctx context.Context, req *dsecv1.ExecRequest) (*dsecv1.ExecResult, error) {
	return unary(r, ctx, req, r.sb.Exec)
}

func (r *remote) ExecStream(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
	return serverStream(r, ctx, req, r.sb.ExecStream, send)
}

func (r *remote) ConnectProcess(ctx context.Context, req *dsecv1.ConnectProcessRequest, send func(*dsecv1.ExecEvent) error) error {
	return serverStream(r, ctx, req, r.sb.ConnectProcess, send)
}

func (r *remote) WriteStdin(ctx context.Context, req *dsecv1.WriteStdinRequest) error {
	_, err := unary(r, ctx, req, r.sb.WriteStdin)
	return err
}

func (r *remote) SignalProcess(ctx context.Context, req *dsecv1.SignalProcessRequest) error {
	_, err := unary(r, ctx, req, r.sb.SignalProcess)
	return err
}

func (r *remote) ResizePTY(ctx context.Context, req *dsecv1.ResizePTYRequest) error {
	_, err := unary(r, ctx, req, r.sb.ResizePTY)
	return err
}

func (r *remote) ListProcesses(ctx context.Context, req *dsecv1.ListProcessesRequest) (*dsecv1.ListProcessesResponse, error) {
	return unary(r, ctx, req, r.sb.ListProcesses)
}

func (r *remote) ReadFile(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) error {
	return serverStream(r, ctx, req, r.sb.ReadFile, send)
}

// chunk is the size of data messages relayed to a node.
const chunk = 256 << 10

// WriteFile streams r to the node in chunks as it arrives.
func (r *remote) WriteFile(ctx context.Context, hdr *dsecv1.WriteFileHeader, body io.Reader) (*dsecv1.FileInfo, error) {
	cctx, done := r.begin(ctx)
	defer done()
	stream := r.sb.WriteFile(cctx)
	err := stream.Send(&dsecv1.WriteFileRequest{Msg: &dsecv1.WriteFileRequest_Header{Header: hdr}})
	buf := make([]byte, chunk)
	for err == nil {
		n, rerr := body.Read(buf)
		if n > 0 {
			err = stream.Send(&dsecv1.WriteFileRequest{Msg: &dsecv1.WriteFileRequest_Data{Data: buf[:n]}})
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			// The caller's upload broke: abandon the write on the node.
			done()
			stream.CloseAndReceive()
			return nil, errdefs.Invalid("read upload: %v", rerr)
		}
	}
	// io.EOF from Send means the node answered early; the answer says why.
	resp, cerr := stream.CloseAndReceive()
	if cerr != nil {
		return nil, r.fail(cctx, cerr)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, r.fail(cctx, err)
	}
	return resp.Msg, nil
}

func (r *remote) Stat(ctx context.Context, req *dsecv1.StatRequest) (*dsecv1.FileInfo, error) {
	return unary(r, ctx, req, r.sb.Stat)
}

func (r *remote) WatchDir(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error {
	return serverStream(r, ctx, req, r.sb.WatchDir, send)
}

func (r *remote) Stats(ctx context.Context, id string) (*dsecv1.SandboxStats, error) {
	return unary(r, ctx, &dsecv1.GetSandboxStatsRequest{Id: id}, r.sb.GetSandboxStats)
}

func (r *remote) Screenshot(ctx context.Context, req *dsecv1.ScreenshotRequest) (*dsecv1.ScreenshotResponse, error) {
	return unary(r, ctx, req, r.sb.Screenshot)
}

func (r *remote) SendInput(ctx context.Context, req *dsecv1.SendInputRequest) error {
	_, err := unary(r, ctx, req, r.sb.SendInput)
	return err
}

func (r *remote) OpenVNC(ctx context.Context, req *dsecv1.OpenVNCRequest) (*dsecv1.OpenVNCResponse, error) {
	return unary(r, ctx, req, r.sb.OpenVNC)
}

func (r *remote) ListDir(ctx context.Context, req *dsecv1.ListDirRequest) (*dsecv1.ListDirResponse, error) {
	return unary(r, ctx, req, r.sb.ListDir)
}

func (r *remote) MakeDir(ctx context.Context, req *dsecv1.MakeDirRequest) (*dsecv1.FileInfo, error) {
	return unary(r, ctx, req, r.sb.MakeDir)
}

func (r *remote) Remove(ctx context.Context, req *dsecv1.RemoveRequest) error {
	_, err := unary(r, ctx, req, r.sb.Remove)
	return err
}

func (r *remote) Rename(ctx context.Context, req *dsecv1.RenameRequest) (*dsecv1.FileInfo, error) {
	return unary(r, ctx, req, r.sb.Rename)
}

func (r *remote) Pause(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	return unary(r, ctx, &dsecv1.PauseSandboxRequest{Id: id}, r.sb.PauseSandbox)
}

func (r *remote) Resume(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	return unary(r, ctx, &dsecv1.ResumeSandboxRequest{Id: id}, r.sb.ResumeSandbox)
}

func (r *remote) Bulk(ctx context.Context, op, selector string) (*dsecv1.BulkResponse, error) {
	req := &dsecv1.BulkRequest{LabelSelector: selector}
	switch op {
	case "pause":
		return unary(r, ctx, req, r.sb.PauseSandboxes)
	case "resume":
		return unary(r, ctx, req, r.sb.ResumeSandboxes)
	case "delete":
		return unary(r, ctx, req, r.sb.DeleteSandboxes)
	}
	return nil, errdefs.Invalid("unknown bulk operation %q", op)
}

func (r *remote) Snapshot(ctx context.Context, req *dsecv1.SnapshotRequest) (*dsecv1.SnapshotInfo, error) {
	return unary(r, ctx, req, r.sb.Snapshot)
}

func (r *remote) ListSnapshots(ctx context.Context) []*dsecv1.SnapshotInfo {
	resp, err := unary(r, ctx, &dsecv1.ListSnapshotsRequest{}, r.sb.ListSnapshots)
	if err != nil {
		return nil
	}
	return resp.Snapshots
}

func (r *remote) DeleteSnapshot(ctx context.Context, id string) error {
	_, err := unary(r, ctx, &dsecv1.DeleteSnapshotRequest{Id: id}, r.sb.DeleteSnapshot)
	return err
}

// Fork creates children on the parent's node; they count against the
// project's quotas like any create.
func (r *remote) Fork(ctx context.Context, req *dsecv1.ForkRequest) (*dsecv1.CreateSandboxesResponse, error) {
	allowed, release, err := r.router.admitQuota(tenant.Project(ctx), int(req.GetCount()))
	defer release()
	if allowed < int(req.GetCount()) {
		return nil, err
	}
	return unary(r, ctx, req, r.sb.Fork)
}

func (r *remote) GetLog(ctx context.Context, req *dsecv1.GetLogRequest) (*dsecv1.GetLogResponse, error) {
	return unary(r, ctx, req, r.sb.GetLog)
}

func (r *remote) Replay(ctx context.Context, req *dsecv1.ReplayRequest) (*dsecv1.ReplayResponse, error) {
	return unary(r, ctx, req, r.sb.Replay)
}

func (r *remote) Capacity(ctx context.Context) *dsecv1.Capacity {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := unary(r, ctx, &dsecv1.GetCapacityRequest{}, r.sys.GetCapacity)
	if err != nil {
		return &dsecv1.Capacity{}
	}
	return c
}

func (r *remote) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, error) {
	return unary(r, ctx, req, r.fn.RunCode)
}

func (r *remote) RunCodeBatch(ctx context.Context, reqs []*dsecv1.RunCodeRequest) ([]*dsecv1.RunCodeResult, error) {
	resp, err := unary(r, ctx, &dsecv1.RunCodeBatchRequest{Calls: reqs}, r.fn.RunCodeBatch)
	if err != nil {
		return nil, err
	}
	return resp.Results, nil
}

func (r *remote) Languages(ctx context.Context, image string) ([]*dsecv1.LanguageInfo, error) {
	resp, err := unary(r, ctx, &dsecv1.ListLanguagesRequest{Image: image}, r.fn.ListLanguages)
	if err != nil {
		return nil, err
	}
	return resp.Languages, nil
}

func (r *remote) ListImages(ctx context.Context) []*dsecv1.Image {
	resp, err := unary(r, ctx, &dsecv1.ListImagesRequest{}, r.img.ListImages)
	if err != nil {
		return nil
	}
	return resp.Images
}

func (r *remote) GetImage(ctx context.Context, name string) (*dsecv1.Image, error) {
	return unary(r, ctx, &dsecv1.GetImageRequest{Name: name}, r.img.GetImage)
}

func (r *remote) DeleteImage(ctx context.Context, name string) error {
	_, err := unary(r, ctx, &dsecv1.DeleteImageRequest{Name: name}, r.img.DeleteImage)
	return err
}

// importImage relays an import's progress; its last message carries the
// image.
func importImage[Req any](r *remote, ctx context.Context, req *Req, f func(context.Context, *connect.Request[Req]) (*connect.ServerStreamForClient[dsecv1.ImageProgress], error), progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	var img *dsecv1.Image
	err := serverStream(r, ctx, req, f, func(p *dsecv1.ImageProgress) error {
		if p.GetImage() != nil {
			img = p.GetImage()
			return nil
		}
		if progress != nil {
			progress(p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if img == nil {
		return nil, errdefs.Unavailable("node %s ended the import without an image", r.name)
	}
	return img, nil
}

func (r *remote) PullImage(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	return importImage(r, ctx, req, r.img.PullImage, progress)
}

func (r *remote) BootstrapImage(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	return importImage(r, ctx, req, r.img.BootstrapImage, progress)
}

func (r *remote) UploadImage(ctx context.Context, hdr *dsecv1.UploadImageHeader, body io.Reader) (*dsecv1.Image, error) {
	cctx, done := r.begin(ctx)
	defer done()
	stream := r.img.UploadImage(cctx)
	err := stream.Send(&dsecv1.UploadImageRequest{Msg: &dsecv1.UploadImageRequest_Header{Header: hdr}})
	buf := make([]byte, chunk)
	for err == nil {
		n, rerr := body.Read(buf)
		if n > 0 {
			err = stream.Send(&dsecv1.UploadImageRequest{Msg: &dsecv1.UploadImageRequest_Data{Data: buf[:n]}})
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			done()
			stream.CloseAndReceive()
			return nil, errdefs.Invalid("read upload: %v", rerr)
		}
	}
	resp, cerr := stream.CloseAndReceive()
	if cerr != nil {
		return nil, r.fail(cctx, cerr)
	}
	return resp.Msg, nil
}
