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
)

// imageService translates the ImageService. Images live on nodes; a
// cluster-wide operation runs on every node, and returns once placement
// everywhere sees its result (settle).
type imageService struct {
	r   Router
	log *slog.Logger
}

// syncer is a Router whose placement reads nodes' images from a view that
// lags them (a cluster's replicas): Sync returns once every replica's view
// includes what the nodes published before the call.
type syncer interface {
	Sync(ctx context.Context) error
}

// settle makes an image operation's result visible to placement through
// every replica before the operation answers: the nodes published their
// images before answering, and Sync waits for the replicas' views. A
// replica that does not confirm is logged (it sees the images when it
// reaches etcd again); the images are on the nodes either way.
func (s *imageService) settle(ctx context.Context) {
	sy, ok := s.r.(syncer)
	if !ok {
		return
	}
	if err := sy.Sync(ctx); err != nil {
		s.log.Warn("image change not confirmed by every replica", slog.Any("error", err))
	}
}

var _ dsecv1connect.ImageServiceHandler = (*imageService)(nil)

func (s *imageService) ListImages(ctx context.Context, req *connect.Request[dsecv1.ListImagesRequest]) (*connect.Response[dsecv1.ListImagesResponse], error) {
	seen := map[string]*dsecv1.Image{}
	lists, _ := fanOut(s.r.Nodes(ctx), func(n Node) ([]*dsecv1.Image, error) { return n.Images(ctx), nil })
	for _, l := range lists {
		for _, img := range l {
			seen[img.Name] = img
		}
	}
	out := &dsecv1.ListImagesResponse{}
	for _, img := range seen {
		out.Images = append(out.Images, img)
	}
	sort.Slice(out.Images, func(i, j int) bool { return out.Images[i].Name < out.Images[j].Name })
	return connect.NewResponse(out), nil
}

func (s *imageService) GetImage(ctx context.Context, req *connect.Request[dsecv1.GetImageRequest]) (*connect.Response[dsecv1.Image], error) {
	var lastErr error = errdefs.NotFound("image %q not found", req.Msg.GetName())
	for _, n := range s.r.Nodes(ctx) {
		img, err := n.Image(ctx, req.Msg.GetName())
		if err == nil {
			return connect.NewResponse(img), nil
		}
		lastErr = err
	}
	return nil, wire(lastErr)
}

func (s *imageService) DeleteImage(ctx context.Context, req *connect.Request[dsecv1.DeleteImageRequest]) (*connect.Response[dsecv1.DeleteImageResponse], error) {
	found := false
	for _, n := range s.r.Nodes(ctx) {
		err := errwire.FromConnect(n.RemoveImage(ctx, req.Msg.GetName()))
		if err == nil {
			found = true
		} else if !errdefs.Is(err, errdefs.KindNotFound) {
			return nil, wire(err)
		}
	}
	if !found {
		return nil, wire(errdefs.NotFound("image %q not found", req.Msg.GetName()))
	}
	s.settle(ctx)
	return connect.NewResponse(&dsecv1.DeleteImageResponse{}), nil
}

// eachNode runs an image import on every node, streaming progress, and
// sends the image as the final message.
func (s *imageService) eachNode(ctx context.Context, stream *connect.ServerStream[dsecv1.ImageProgress], run func(Node, func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)) error {
	var img *dsecv1.Image
	for _, n := range s.r.Nodes(ctx) {
		var sendErr error
		progress := func(p *dsecv1.ImageProgress) {
			if sendErr == nil {
				sendErr = stream.Send(p)
			}
		}
		got, err := run(n, progress)
		if err != nil {
			return wire(err)
		}
		if sendErr != nil {
			return sendErr
		}
		img = got
	}
	s.settle(ctx)
	return stream.Send(&dsecv1.ImageProgress{Phase: "done", Message: img.GetName(), Image: img})
}

func (s *imageService) PullImage(ctx context.Context, req *connect.Request[dsecv1.PullImageRequest], stream *connect.ServerStream[dsecv1.ImageProgress]) error {
	return s.eachNode(ctx, stream, func(n Node, p func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
		return n.Pull(ctx, req.Msg, p)
	})
}

// PushImage pushes the image from the first node that has it (every
// node's copy has the same layers).
// holder is a node holding image name, as ctx's caller sees it: one
// holding its data whole (where it was made or pulled) before one that
// loads some of it on demand (a copy from another node, a pull of an
// image pushed on demand).
func (s *imageService) holder(ctx context.Context, name string) (Node, error) {
	var partial Node
	for _, n := range s.r.Nodes(ctx) {
		img, err := n.Image(ctx, name)
		switch {
		case err != nil:
		case img.GetOnDemand() == nil:
			return n, nil
		case partial == nil:
			partial = n
		}
	}
	if partial == nil {
		return nil, errdefs.NotFound("image %q not found", name)
	}
	return partial, nil
}

func (s *imageService) ExportImage(ctx context.Context, req *connect.Request[dsecv1.ExportImageRequest], stream *connect.ServerStream[dsecv1.ExportImageChunk]) error {
	from, err := s.holder(ctx, req.Msg.GetName())
	if err != nil {
		return wire(err)
	}
	return from.Export(ctx, req.Msg, stream.Send)
}

func (s *imageService) PushImage(ctx context.Context, req *connect.Request[dsecv1.PushImageRequest], stream *connect.ServerStream[dsecv1.ImageProgress]) error {
	from, err := s.holder(ctx, req.Msg.GetName())
	if err != nil {
		return wire(err)
	}
	var sendErr error
	pushed := ""
	img, err := from.Push(ctx, req.Msg, func(p *dsecv1.ImageProgress) {
		if p.GetPhase() == "pushed" {
			pushed = p.GetMessage()
		}
		if sendErr == nil {
			sendErr = stream.Send(p)
		}
	})
	if err != nil {
		return wire(err)
	}
	if sendErr != nil {
		return sendErr
	}
	return stream.Send(&dsecv1.ImageProgress{Phase: "done", Message: pushed, Image: img})
}

func (s *imageService) BootstrapImage(ctx context.Context, req *connect.Request[dsecv1.BootstrapImageRequest], stream *connect.ServerStream[dsecv1.ImageProgress]) error {
	return s.eachNode(ctx, stream, func(n Node, p func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
		return n.Bootstrap(ctx, req.Msg, p)
	})
}

func (s *imageService) UploadImage(ctx context.Context, stream *connect.ClientStream[dsecv1.UploadImageRequest]) (*connect.Response[dsecv1.Image], error) {
	if !stream.Receive() || stream.Msg().GetHeader() == nil {
		return nil, wire(errdefs.Invalid("UploadImage needs a header message first"))
	}
	hdr := stream.Msg().GetHeader()
	n, err := s.oneNode(ctx, "uploading an image")
	if err != nil {
		return nil, err
	}
	img, err := n.Upload(ctx, hdr, streamData(stream))
	if err != nil {
		return nil, wire(err)
	}
	s.settle(ctx)
	return connect.NewResponse(img), nil
}

// builder is a Router of several nodes that chooses the one node builds
// and uploads run on (a cluster's: the other nodes load the images it
// makes from it on demand).
type builder interface {
	ForBuild(ctx context.Context) (Node, error)
}

// oneNode is the node builds and uploads run on: the router's choice, or
// the only node.
func (s *imageService) oneNode(ctx context.Context, what string) (Node, error) {
	if b, ok := s.r.(builder); ok {
		n, err := b.ForBuild(ctx)
		if err != nil {
			return nil, wire(err)
		}
		return n, nil
	}
	nodes := s.r.Nodes(ctx)
	if len(nodes) != 1 {
		return nil, wire(errdefs.Unimplemented("%s on a cluster of %d nodes: build on one node and push the image to a registry the cluster pulls from", what, len(nodes)))
	}
	return nodes[0], nil
}

func (s *imageService) UploadBuildContext(ctx context.Context, stream *connect.ClientStream[dsecv1.UploadBuildContextRequest]) (*connect.Response[dsecv1.BuildContext], error) {
	if !stream.Receive() || stream.Msg().GetHeader() == nil {
		return nil, wire(errdefs.Invalid("UploadBuildContext needs a header message first"))
	}
	hdr := stream.Msg().GetHeader()
	n, err := s.oneNode(ctx, "building an image")
	if err != nil {
		return nil, err
	}
	c, err := n.UploadContext(ctx, hdr, streamData(stream))
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(c), nil
}

func (s *imageService) BuildImage(ctx context.Context, req *connect.Request[dsecv1.BuildImageRequest], stream *connect.ServerStream[dsecv1.ImageProgress]) error {
	n, err := s.oneNode(ctx, "building an image")
	if err != nil {
		return err
	}
	var sendErr error
	img, err := n.Build(ctx, req.Msg, func(p *dsecv1.ImageProgress) {
		if sendErr == nil {
			sendErr = stream.Send(p)
		}
	})
	if err != nil {
		return wire(err)
	}
	if sendErr != nil {
		return sendErr
	}
	s.settle(ctx)
	return stream.Send(&dsecv1.ImageProgress{Phase: "done", Message: img.GetName(), Image: img})
}

func (s *imageService) CommitSandbox(ctx context.Context, req *connect.Request[dsecv1.CommitSandboxRequest]) (*connect.Response[dsecv1.Image], error) {
	n, err := s.r.ForSandbox(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, wire(err)
	}
	img, err := n.Commit(ctx, req.Msg)
	if err != nil {
		return nil, wire(err)
	}
	s.settle(ctx)
	return connect.NewResponse(img), nil
}

func (s *imageService) PruneBuildCache(ctx context.Context, req *connect.Request[dsecv1.PruneBuildCacheRequest]) (*connect.Response[dsecv1.PruneBuildCacheResponse], error) {
	each, err := fanOut(s.r.Nodes(ctx), func(n Node) (*dsecv1.PruneBuildCacheResponse, error) { return n.PruneCache(ctx) })
	if err != nil {
		return nil, wire(err)
	}
	out := &dsecv1.PruneBuildCacheResponse{}
	for _, p := range each {
		out.Removed += p.GetRemoved()
		out.Copies += p.GetCopies()
		out.LayerBytes += p.GetLayerBytes()
		out.ChunkBytes += p.GetChunkBytes()
	}
	s.settle(ctx)
	return connect.NewResponse(out), nil
}

// uploadReader reads the data of a client stream's messages after its
// header.
type uploadReader struct {
	next func() (data []byte, ok bool, err error)
	buf  []byte
}

// streamData reads stream's data messages.
func streamData[T any, P interface {
	*T
	GetData() []byte
}](stream *connect.ClientStream[T]) *uploadReader {
	return &uploadReader{next: func() ([]byte, bool, error) {
		if !stream.Receive() {
			return nil, false, stream.Err()
		}
		return P(stream.Msg()).GetData(), true, nil
	}}
}

func (r *uploadReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		b, ok, err := r.next()
		if err != nil {
			return 0, err
		}
		if !ok {
			return 0, io.EOF
		}
		r.buf = b
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// systemService reports the deployment.
type systemService struct {
	r       Router
	version string
}

var _ dsecv1connect.SystemServiceHandler = (*systemService)(nil)

func (s *systemService) GetInfo(ctx context.Context, req *connect.Request[dsecv1.GetInfoRequest]) (*connect.Response[dsecv1.Info], error) {
	info := &dsecv1.Info{Version: s.version}
	infos, _ := fanOut(s.r.Nodes(ctx), func(n Node) (*connect.Response[dsecv1.Info], error) {
		return n.GetInfo(ctx, connect.NewRequest(req.Msg))
	})
	for _, i := range infos {
		if i != nil {
			info.Nodes = append(info.Nodes, i.Msg.Nodes...)
		}
	}
	return connect.NewResponse(info), nil
}
