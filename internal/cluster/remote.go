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

	// The node's sandbox services: a generated client's unary method has
	// the generated handler's signature, so these are the apiserver.Node
	// verbs with no code here. Streams and the rest are below.
	dsecv1connect.LifecycleServiceClient
	dsecv1connect.ProcessServiceClient
	dsecv1connect.FilesystemServiceClient
	dsecv1connect.SnapshotServiceClient
	dsecv1connect.LogServiceClient
	dsecv1connect.ScreenServiceClient
	dsecv1connect.FunctionServiceClient
	dsecv1connect.VolumeServiceClient

	sys dsecv1connect.SystemServiceClient
	img dsecv1connect.ImageServiceClient
	ev  dsecv1connect.EventServiceClient
	nd  nodev1connect.NodeServiceClient

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
	rn := &remote{name: name, addr: addr, router: r}
	rn.lost, rn.lose = context.WithCancelCause(context.Background())
	opts := []connect.ClientOption{
		// The node's answer (or why there was none) on every call.
		connect.WithInterceptors(&nodeAuth{token: r.cfg.Token}, nodeCalls{rn}),
		// An exec result holds up to two streams at the largest output cap
		// a node allows (64 MiB each by default): a smaller bound would
		// fail such a result on every try.
		connect.WithReadMaxBytes(129 << 20),
		connect.WithSendMaxBytes(64 << 20),
		// Node traffic stays in the data center: compression costs CPU on
		// both ends for little.
		connect.WithAcceptCompression("gzip", nil, nil),
	}
	rn.LifecycleServiceClient = dsecv1connect.NewLifecycleServiceClient(r.http, base, opts...)
	rn.ProcessServiceClient = dsecv1connect.NewProcessServiceClient(r.http, base, opts...)
	rn.FilesystemServiceClient = dsecv1connect.NewFilesystemServiceClient(r.http, base, opts...)
	rn.SnapshotServiceClient = dsecv1connect.NewSnapshotServiceClient(r.http, base, opts...)
	rn.LogServiceClient = dsecv1connect.NewLogServiceClient(r.http, base, opts...)
	rn.ScreenServiceClient = dsecv1connect.NewScreenServiceClient(r.http, base, opts...)
	rn.FunctionServiceClient = dsecv1connect.NewFunctionServiceClient(r.http, base, opts...)
	rn.VolumeServiceClient = dsecv1connect.NewVolumeServiceClient(r.http, base, opts...)
	rn.sys = dsecv1connect.NewSystemServiceClient(r.http, base, opts...)
	rn.img = dsecv1connect.NewImageServiceClient(r.http, base, opts...)
	rn.ev = dsecv1connect.NewEventServiceClient(r.http, base, opts...)
	rn.nd = nodev1connect.NewNodeServiceClient(r.http, base, opts...)
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

// unary runs one unary call and returns its classified error (errdefs):
// for the control plane's own use of a node (creates, probes).
func unary[Req, Resp any](r *remote, ctx context.Context, req *Req, f func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error)) (*Resp, error) {
	resp, err := f(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, errwire.FromConnect(err)
	}
	return resp.Msg, nil
}

// nodeCalls bounds every call to the node by the caller's context and by
// the node's membership (a lost node ends its calls at once), and turns a
// failure to reach the node into an unavailable (infra) error naming it;
// the node's own answers pass unchanged.
type nodeCalls struct{ r *remote }

func (c nodeCalls) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		cctx, done := c.r.begin(ctx)
		defer done()
		resp, err := next(cctx, req)
		if err != nil {
			return nil, errwire.ToConnect(c.r.fail(cctx, err))
		}
		return resp, nil
	}
}

func (c nodeCalls) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		cctx, done := c.r.begin(ctx)
		return &nodeConn{StreamingClientConn: next(cctx, spec), r: c.r, cctx: cctx, done: done}
	}
}

func (nodeCalls) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// nodeConn is a stream to a node, classified as nodeCalls classifies.
type nodeConn struct {
	connect.StreamingClientConn
	r    *remote
	cctx context.Context
	done func()
}

func (c *nodeConn) Receive(m any) error {
	err := c.StreamingClientConn.Receive(m)
	if err != nil && !errors.Is(err, io.EOF) {
		return errwire.ToConnect(c.r.fail(c.cctx, err))
	}
	return err
}

func (c *nodeConn) CloseResponse() error {
	defer c.done()
	return c.StreamingClientConn.CloseResponse()
}

// relay passes a server stream's messages to send, one at a time.
func relay[Msg any](st *connect.ServerStreamForClient[Msg], err error, send func(*Msg) error) error {
	if err != nil {
		return err
	}
	defer st.Close()
	for st.Receive() {
		if err := send(st.Msg()); err != nil {
			return err
		}
	}
	return st.Err()
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

// GetInfo is the node's own description, with its state in the cluster.
func (r *remote) GetInfo(ctx context.Context, req *connect.Request[dsecv1.GetInfoRequest]) (*connect.Response[dsecv1.Info], error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	state := "ready"
	if n := r.router.state.Node(r.name); n != nil {
		state = n.State()
	}
	if r.lapsed.Load() {
		state = "lapsed"
	}
	ni := &dsecv1.NodeInfo{Name: r.name, Address: r.addr, State: "unreachable"}
	if info, err := r.sys.GetInfo(ctx, req); err == nil && len(info.Msg.Nodes) > 0 {
		ni = info.Msg.Nodes[0]
		ni.Address, ni.State = r.addr, state
	}
	return connect.NewResponse(&dsecv1.Info{Nodes: []*dsecv1.NodeInfo{ni}}), nil
}

// GetCapacity is the node's capacity, or none if it does not answer soon.
func (r *remote) GetCapacity(ctx context.Context, req *connect.Request[dsecv1.GetCapacityRequest]) (*connect.Response[dsecv1.Capacity], error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if c, err := r.sys.GetCapacity(ctx, req); err == nil {
		return c, nil
	}
	return connect.NewResponse(&dsecv1.Capacity{}), nil
}

// createOn creates sandboxes on this node through NodeService.
func (r *remote) createOn(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) (*nodev1.CreateSandboxesResponse, error) {
	ctx = tenant.With(ctx, tenant.Caller{Project: project, Admin: tenant.From(ctx).Admin})
	return unary(r, ctx, &nodev1.CreateSandboxesRequest{Specs: specs, IdempotencyKeys: keys, Project: project}, r.nd.CreateSandboxes)
}

// CreateSandbox creates one sandbox on this node (placement chose it).
func (r *remote) CreateSandbox(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	resp, err := r.createOn(ctx, []*dsecv1.SandboxSpec{req.Msg.GetSpec()}, []string{req.Msg.GetIdempotencyKey()}, tenant.Project(ctx))
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	sb, err := itemResult(resp.GetResult(), 0)
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	return connect.NewResponse(sb), nil
}

// itemResult is item i of a batch answer as a single answer.
func itemResult(resp *dsecv1.CreateSandboxesResponse, i int) (*dsecv1.Sandbox, error) {
	if i >= len(resp.GetResults()) {
		return nil, errdefs.Internal(nil, "node answered %d results for %d items", len(resp.GetResults()), i+1)
	}
	res := resp.Results[i]
	if e := res.GetError(); e != nil {
		return nil, FromItemError(e)
	}
	return res.GetSandbox(), nil
}

// FromItemError is the error of a batch item's answer.
func FromItemError(e *dsecv1.ItemError) *errdefs.Error {
	return &errdefs.Error{Kind: errdefs.Kind(e.Kind), Msg: e.Message, Infra: e.Infra, Retryable: e.Retryable, RetryAfter: time.Duration(e.RetryAfterMs) * time.Millisecond}
}

func itemError(err error) *dsecv1.ItemError {
	e := errdefs.Classify(errwire.FromConnect(err))
	return &dsecv1.ItemError{Kind: string(e.Kind), Message: e.Msg, Infra: e.Infra, Retryable: e.Retryable, RetryAfterMs: e.RetryAfter.Milliseconds()}
}

// CreateMany creates sandboxes on this node with their keys, as placed.
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

// Fork creates children on the parent's node; they count against the
// project's quotas like any create.
func (r *remote) Fork(ctx context.Context, req *connect.Request[dsecv1.ForkRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	allowed, release, err := r.router.admitQuota(tenant.Project(ctx), int(req.Msg.GetCount()))
	defer release()
	if allowed < int(req.Msg.GetCount()) {
		return nil, errwire.ToConnect(err)
	}
	return r.SnapshotServiceClient.Fork(ctx, req)
}

func (r *remote) ExecEvents(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
	st, err := r.ProcessServiceClient.ExecStream(ctx, connect.NewRequest(req))
	return relay(st, err, send)
}

func (r *remote) ProcessEvents(ctx context.Context, req *dsecv1.ConnectProcessRequest, send func(*dsecv1.ExecEvent) error) error {
	st, err := r.ProcessServiceClient.ConnectProcess(ctx, connect.NewRequest(req))
	return relay(st, err, send)
}

func (r *remote) ReadFileChunks(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) error {
	st, err := r.FilesystemServiceClient.ReadFile(ctx, connect.NewRequest(req))
	return relay(st, err, send)
}

func (r *remote) WatchEvents(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error {
	st, err := r.FilesystemServiceClient.WatchDir(ctx, connect.NewRequest(req))
	return relay(st, err, send)
}

// WatchRollout relays the node's stream of a rollout's progress.
func (r *remote) WatchRollout(ctx context.Context, req *connect.Request[dsecv1.WatchRolloutRequest], st *connect.ServerStream[dsecv1.RolloutEvent]) error {
	// A request of its own: the caller's headers (its accepted
	// compressions) are not this client's.
	cs, err := r.LogServiceClient.WatchRollout(ctx, connect.NewRequest(req.Msg))
	return relay(cs, err, st.Send)
}

// Events relays the node's event stream; the node's later heartbeats
// only when heartbeats is set (the first always: it says the
// subscription is in place).
func (r *remote) Events(ctx context.Context, req *dsecv1.SubscribeRequest, send func(*dsecv1.Event) error, heartbeats bool) error {
	st, err := r.ev.Subscribe(ctx, connect.NewRequest(req))
	first := true
	return relay(st, err, func(ev *dsecv1.Event) error {
		if !first && !heartbeats && ev.GetType() == "heartbeat" {
			return nil
		}
		first = false
		return send(ev)
	})
}

// chunk is the size of data messages relayed to a node.
const chunk = 256 << 10

// upload streams a header and then body to a client stream in chunks as
// it arrives, and returns the node's answer.
func upload[Req, Res any](st *connect.ClientStreamForClient[Req, Res], header *Req, body io.Reader, data func([]byte) *Req) (*connect.Response[Res], error) {
	err := st.Send(header)
	buf := make([]byte, chunk)
	for err == nil {
		n, rerr := body.Read(buf)
		if n > 0 {
			err = st.Send(data(buf[:n]))
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			// The caller's upload broke: abandon it on the node.
			st.CloseAndReceive()
			return nil, errwire.ToConnect(errdefs.Invalid("read upload: %v", rerr))
		}
	}
	// io.EOF from Send means the node answered early; the answer says why.
	resp, cerr := st.CloseAndReceive()
	if cerr != nil {
		return nil, cerr
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return resp, nil
}

// WriteFileFrom streams a file to the node as it arrives.
func (r *remote) WriteFileFrom(ctx context.Context, hdr *dsecv1.WriteFileHeader, body io.Reader) (*connect.Response[dsecv1.FileInfo], error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	return upload(r.FilesystemServiceClient.WriteFile(ctx), &dsecv1.WriteFileRequest{Msg: &dsecv1.WriteFileRequest_Header{Header: hdr}}, body,
		func(b []byte) *dsecv1.WriteFileRequest {
			return &dsecv1.WriteFileRequest{Msg: &dsecv1.WriteFileRequest_Data{Data: b}}
		})
}

func (r *remote) ReadVolumeFileChunks(ctx context.Context, req *dsecv1.ReadVolumeFileRequest, send func(*dsecv1.ReadVolumeFileResponse) error) error {
	st, err := r.VolumeServiceClient.ReadVolumeFile(ctx, connect.NewRequest(req))
	return relay(st, err, send)
}

// WriteVolumeFileFrom streams a volume's file to the node as it arrives.
func (r *remote) WriteVolumeFileFrom(ctx context.Context, hdr *dsecv1.WriteVolumeFileHeader, body io.Reader) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	return upload(r.VolumeServiceClient.WriteVolumeFile(ctx), &dsecv1.WriteVolumeFileRequest{Msg: &dsecv1.WriteVolumeFileRequest_Header{Header: hdr}}, body,
		func(b []byte) *dsecv1.WriteVolumeFileRequest {
			return &dsecv1.WriteVolumeFileRequest{Msg: &dsecv1.WriteVolumeFileRequest_Data{Data: b}}
		})
}

// Images.

func (r *remote) Images(ctx context.Context) []*dsecv1.Image {
	resp, err := r.img.ListImages(ctx, connect.NewRequest(&dsecv1.ListImagesRequest{}))
	if err != nil {
		return nil
	}
	return resp.Msg.Images
}

func (r *remote) Image(ctx context.Context, name string) (*dsecv1.Image, error) {
	resp, err := r.img.GetImage(ctx, connect.NewRequest(&dsecv1.GetImageRequest{Name: name}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (r *remote) RemoveImage(ctx context.Context, name string) error {
	_, err := r.img.DeleteImage(ctx, connect.NewRequest(&dsecv1.DeleteImageRequest{Name: name}))
	return err
}

// importImage relays an import's progress; its last message carries the
// image.
func importImage(r *remote, st *connect.ServerStreamForClient[dsecv1.ImageProgress], err error, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	var img *dsecv1.Image
	err = relay(st, err, func(p *dsecv1.ImageProgress) error {
		if p.GetImage() != nil {
			img = p.GetImage()
		} else if progress != nil {
			progress(p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if img == nil {
		return nil, errwire.ToConnect(errdefs.Unavailable("node %s ended the import without an image", r.name))
	}
	return img, nil
}

func (r *remote) Pull(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := r.img.PullImage(ctx, connect.NewRequest(req))
	return importImage(r, st, err, progress)
}

func (r *remote) Push(ctx context.Context, req *dsecv1.PushImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := r.img.PushImage(ctx, connect.NewRequest(req))
	return importImage(r, st, err, progress)
}

func (r *remote) Export(ctx context.Context, req *dsecv1.ExportImageRequest, send func(*dsecv1.ExportImageChunk) error) error {
	st, err := r.img.ExportImage(ctx, connect.NewRequest(req))
	return relay(st, err, send)
}

func (r *remote) Bootstrap(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := r.img.BootstrapImage(ctx, connect.NewRequest(req))
	return importImage(r, st, err, progress)
}

func (r *remote) Upload(ctx context.Context, hdr *dsecv1.UploadImageHeader, body io.Reader) (*dsecv1.Image, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	resp, err := upload(r.img.UploadImage(ctx), &dsecv1.UploadImageRequest{Msg: &dsecv1.UploadImageRequest_Header{Header: hdr}}, body,
		func(b []byte) *dsecv1.UploadImageRequest {
			return &dsecv1.UploadImageRequest{Msg: &dsecv1.UploadImageRequest_Data{Data: b}}
		})
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (r *remote) UploadContext(ctx context.Context, hdr *dsecv1.UploadBuildContextHeader, body io.Reader) (*dsecv1.BuildContext, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	resp, err := upload(r.img.UploadBuildContext(ctx), &dsecv1.UploadBuildContextRequest{Msg: &dsecv1.UploadBuildContextRequest_Header{Header: hdr}}, body,
		func(b []byte) *dsecv1.UploadBuildContextRequest {
			return &dsecv1.UploadBuildContextRequest{Msg: &dsecv1.UploadBuildContextRequest_Data{Data: b}}
		})
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (r *remote) Build(ctx context.Context, req *dsecv1.BuildImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := r.img.BuildImage(ctx, connect.NewRequest(req))
	return importImage(r, st, err, progress)
}

func (r *remote) Commit(ctx context.Context, req *dsecv1.CommitSandboxRequest) (*dsecv1.Image, error) {
	resp, err := r.img.CommitSandbox(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (r *remote) PruneCache(ctx context.Context) (*dsecv1.PruneBuildCacheResponse, error) {
	resp, err := r.img.PruneBuildCache(ctx, connect.NewRequest(&dsecv1.PruneBuildCacheRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}
