package apiserver

import (
	"context"
	"io"
	"sort"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/sandboxid"
)

// Volumes live on nodes: a call naming a volume by ID goes to the node the
// ID names; by name, to the node that has the caller's volume of that name
// (asked of every node). Creates go to the node the request names, else to
// the one with the most free sandbox slots (sandboxes that mount the
// volume will run there).

// volumeVerbs are VolumeService's unary verbs as a node serves them
// (Node).
type volumeVerbs interface {
	CreateVolume(context.Context, *connect.Request[dsecv1.CreateVolumeRequest]) (*connect.Response[dsecv1.Volume], error)
	GetVolume(context.Context, *connect.Request[dsecv1.GetVolumeRequest]) (*connect.Response[dsecv1.Volume], error)
	ListVolumes(context.Context, *connect.Request[dsecv1.ListVolumesRequest]) (*connect.Response[dsecv1.ListVolumesResponse], error)
	DeleteVolume(context.Context, *connect.Request[dsecv1.DeleteVolumeRequest]) (*connect.Response[dsecv1.DeleteVolumeResponse], error)
	StatVolumePath(context.Context, *connect.Request[dsecv1.VolumePathRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error)
	ListVolumeDir(context.Context, *connect.Request[dsecv1.ListVolumeDirRequest]) (*connect.Response[dsecv1.ListVolumeDirResponse], error)
	MakeVolumeDir(context.Context, *connect.Request[dsecv1.MakeVolumeDirRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error)
	RemoveVolumePath(context.Context, *connect.Request[dsecv1.VolumePathRequest]) (*connect.Response[dsecv1.RemoveVolumePathResponse], error)
	SetVolumePathAttrs(context.Context, *connect.Request[dsecv1.SetVolumePathAttrsRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error)
}

// FindVolume returns the node that holds the volume ref (a name of the
// caller's project, or an ID) and the volume as the caller sees it. A
// volume the caller cannot see is not found.
func FindVolume(ctx context.Context, r Router, ref string) (Node, *dsecv1.Volume, error) {
	if ref == "" {
		return nil, nil, errdefs.Invalid("a volume name or ID is required")
	}
	q := &dsecv1.GetVolumeRequest{Volume: ref}
	if _, err := sandboxid.VolumeNode(ref); err == nil {
		n, err := r.ForSandbox(ctx, strings.TrimPrefix(ref, sandboxid.VolumePrefix))
		if err != nil {
			if errdefs.Is(err, errdefs.KindNotFound) {
				return nil, nil, errdefs.NotFound("volume %q not found", clip(ref))
			}
			return nil, nil, err
		}
		v, err := Do(ctx, n, q, Node.GetVolume)
		return n, v, err
	}
	nodes := r.Nodes(ctx)
	found, err := fanOut(nodes, func(n Node) (*dsecv1.Volume, error) {
		v, err := Do(ctx, n, q, Node.GetVolume)
		if errdefs.Is(err, errdefs.KindNotFound) {
			return nil, nil
		}
		return v, err
	})
	for i, v := range found {
		if v != nil {
			return nodes[i], v, nil
		}
	}
	if err != nil {
		return nil, nil, err
	}
	return nil, nil, errdefs.NotFound("volume %q not found", clip(ref))
}

// VolumesNode returns the node that holds every volume spec mounts (""
// if it mounts none): a sandbox runs where its volumes live. Volumes on
// different nodes are invalid; an unknown one is not found.
func VolumesNode(ctx context.Context, r Router, spec *dsecv1.SandboxSpec) (string, error) {
	node, first := "", ""
	for _, m := range spec.GetVolumes() {
		n, _, err := FindVolume(ctx, r, m.GetName())
		if err != nil {
			return "", err
		}
		if node != "" && n.Name() != node {
			return "", errdefs.Invalid("volumes %q (node %s) and %q (node %s) live on different nodes: a sandbox mounts volumes of one node", first, node, m.GetName(), n.Name())
		}
		node, first = n.Name(), m.GetName()
	}
	return node, nil
}

// volumeService serves the VolumeService.
type volumeService struct{ r Router }

var _ dsecv1connect.VolumeServiceHandler = volumeService{}

func (s volumeService) CreateVolume(ctx context.Context, req *connect.Request[dsecv1.CreateVolumeRequest]) (*connect.Response[dsecv1.Volume], error) {
	v, err := CreateVolume(ctx, s.r, req.Msg)
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(v), nil
}

// CreateVolume creates a volume of the caller's project on the node req
// names, else on the one with the most free sandbox slots. A name the
// project has on any node is a conflict.
func CreateVolume(ctx context.Context, r Router, req *dsecv1.CreateVolumeRequest) (*dsecv1.Volume, error) {
	nodes := r.Nodes(ctx)
	var target Node
	switch want := req.GetNode(); {
	case want != "":
		for _, n := range nodes {
			if n.Name() == want {
				target = n
			}
		}
		if target == nil {
			return nil, errdefs.NotFound("no reachable node %q", clip(want))
		}
	case len(nodes) == 0:
		return nil, errdefs.Unavailable("no node is reachable")
	case len(nodes) == 1:
		target = nodes[0]
	default:
		caps, _ := fanOut(nodes, func(n Node) (*connect.Response[dsecv1.Capacity], error) {
			return n.GetCapacity(ctx, connect.NewRequest(&dsecv1.GetCapacityRequest{}))
		})
		best := int64(-1)
		for i, c := range caps {
			if c != nil && c.Msg.FreeSlots > best {
				target, best = nodes[i], c.Msg.FreeSlots
			}
		}
		if target == nil {
			target = nodes[0]
		}
	}
	if len(nodes) > 1 {
		// A name is the project's across nodes. (Two creates of one name
		// racing through two replicas may both pass: names are checked on
		// each node, and the second is then reachable by its ID only.)
		if _, _, err := FindVolume(ctx, r, req.GetName()); err == nil {
			return nil, errdefs.Conflict("volume %q exists", clip(req.GetName()))
		}
	}
	return Do(ctx, target, req, Node.CreateVolume)
}

func (s volumeService) GetVolume(ctx context.Context, req *connect.Request[dsecv1.GetVolumeRequest]) (*connect.Response[dsecv1.Volume], error) {
	_, v, err := FindVolume(ctx, s.r, req.Msg.GetVolume())
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(v), nil
}

func (s volumeService) ListVolumes(ctx context.Context, req *connect.Request[dsecv1.ListVolumesRequest]) (*connect.Response[dsecv1.ListVolumesResponse], error) {
	vols, err := ListVolumes(ctx, s.r)
	if err != nil {
		return nil, wire(err)
	}
	return connect.NewResponse(&dsecv1.ListVolumesResponse{Volumes: vols}), nil
}

// ListVolumes lists the caller's volumes on every node, oldest first.
func ListVolumes(ctx context.Context, r Router) ([]*dsecv1.Volume, error) {
	lists, err := fanOut(r.Nodes(ctx), func(n Node) (*dsecv1.ListVolumesResponse, error) {
		return Do(ctx, n, &dsecv1.ListVolumesRequest{}, Node.ListVolumes)
	})
	if err != nil {
		return nil, err
	}
	var out []*dsecv1.Volume
	for _, l := range lists {
		out = append(out, l.GetVolumes()...)
	}
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if !a.CreatedAt.AsTime().Equal(b.CreatedAt.AsTime()) {
			return a.CreatedAt.AsTime().Before(b.CreatedAt.AsTime())
		}
		return a.Id < b.Id
	})
	return out, nil
}

// onVolume calls a unary verb on the node that holds the volume ref.
func onVolume[Req, Res any](ctx context.Context, r Router, ref string, req *connect.Request[Req], verb func(Node, context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	n, _, err := FindVolume(ctx, r, ref)
	if err != nil {
		return nil, wire(err)
	}
	return verb(n, ctx, connect.NewRequest(req.Msg))
}

func (s volumeService) DeleteVolume(ctx context.Context, req *connect.Request[dsecv1.DeleteVolumeRequest]) (*connect.Response[dsecv1.DeleteVolumeResponse], error) {
	return onVolume(ctx, s.r, req.Msg.GetVolume(), req, Node.DeleteVolume)
}

func (s volumeService) ReadVolumeFile(ctx context.Context, req *connect.Request[dsecv1.ReadVolumeFileRequest], st *connect.ServerStream[dsecv1.ReadVolumeFileResponse]) error {
	n, _, err := FindVolume(ctx, s.r, req.Msg.GetVolume())
	if err != nil {
		return wire(err)
	}
	return n.ReadVolumeFileChunks(ctx, req.Msg, st.Send)
}

func (s volumeService) WriteVolumeFile(ctx context.Context, st *connect.ClientStream[dsecv1.WriteVolumeFileRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	if !st.Receive() || st.Msg().GetHeader() == nil {
		return nil, wire(errdefs.Invalid("WriteVolumeFile needs a header message first"))
	}
	hdr := st.Msg().GetHeader()
	n, _, err := FindVolume(ctx, s.r, hdr.GetVolume())
	if err != nil {
		return nil, wire(err)
	}
	return n.WriteVolumeFileFrom(ctx, hdr, &streamReader{next: func() ([]byte, error) {
		if !st.Receive() {
			if err := st.Err(); err != nil {
				return nil, err
			}
			return nil, io.EOF
		}
		return st.Msg().GetData(), nil
	}})
}

func (s volumeService) StatVolumePath(ctx context.Context, req *connect.Request[dsecv1.VolumePathRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return onVolume(ctx, s.r, req.Msg.GetVolume(), req, Node.StatVolumePath)
}

func (s volumeService) ListVolumeDir(ctx context.Context, req *connect.Request[dsecv1.ListVolumeDirRequest]) (*connect.Response[dsecv1.ListVolumeDirResponse], error) {
	return onVolume(ctx, s.r, req.Msg.GetVolume(), req, Node.ListVolumeDir)
}

func (s volumeService) MakeVolumeDir(ctx context.Context, req *connect.Request[dsecv1.MakeVolumeDirRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return onVolume(ctx, s.r, req.Msg.GetVolume(), req, Node.MakeVolumeDir)
}

func (s volumeService) RemoveVolumePath(ctx context.Context, req *connect.Request[dsecv1.VolumePathRequest]) (*connect.Response[dsecv1.RemoveVolumePathResponse], error) {
	return onVolume(ctx, s.r, req.Msg.GetVolume(), req, Node.RemoveVolumePath)
}

func (s volumeService) SetVolumePathAttrs(ctx context.Context, req *connect.Request[dsecv1.SetVolumePathAttrsRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return onVolume(ctx, s.r, req.Msg.GetVolume(), req, Node.SetVolumePathAttrs)
}

// streamReader reads the data of a client stream's messages.
type streamReader struct {
	next func() ([]byte, error)
	buf  []byte
}

func (r *streamReader) Read(p []byte) (int, error) {
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
