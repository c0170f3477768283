package node

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
	"github.com/opendsec/dsec/internal/volume"
)

// Volumes (internal/volume keeps them): the API's verbs, and the mounts of
// sandboxes. A volume belongs to a project like a sandbox: findVolume is
// the one check of every name or ID a caller gives.

// maxVolumeMounts bounds a sandbox's volumes.
const maxVolumeMounts = 16

// findVolume returns the volume a caller names: by ID (a volume of any
// project the caller reaches) or by name (its project's). A volume of
// another project answers as one that does not exist.
func (n *Node) findVolume(ctx context.Context, ref string) (*volume.Volume, error) {
	return n.volumeOf(ctx, tenant.Project(ctx), ref)
}

// volumeOf is findVolume for a name of project's.
func (n *Node) volumeOf(ctx context.Context, project, ref string) (*volume.Volume, error) {
	if volume.IsID(ref) {
		if v := n.volumes.Get(ref); v != nil && tenant.Reaches(ctx, v.Project) {
			return v, nil
		}
	} else if v := n.volumes.ByName(project, ref); v != nil {
		return v, nil
	}
	return nil, volumeNotFound(ref)
}

// volumeNotFound is the answer for a volume the caller cannot see.
func volumeNotFound(ref string) error {
	return errdefs.NotFound("volume %q not found", truncate(ref, 80))
}

func (n *Node) volumeView(v *volume.Volume) *dsecv1.Volume {
	h := n.volumes.HoldersOf(v.ID)
	return &dsecv1.Volume{
		Id: v.ID, Name: v.Name, Node: n.cfg.Name, SizeMb: v.SizeMB, UsedBytes: n.volumes.Used(v.ID),
		CreatedAt: timestamppb.New(v.Created), Labels: v.Labels, Writer: h.Writer, Readers: h.Readers,
	}
}

// CreateVolume makes a volume of the caller's project on this node.
func (n *Node) CreateVolume(ctx context.Context, req *dsecv1.CreateVolumeRequest) (*dsecv1.Volume, error) {
	v, err := n.volumes.Create(tenant.Project(ctx), req.GetName(), req.GetSizeMb(), req.GetLabels())
	if err != nil {
		return nil, err
	}
	return n.volumeView(v), nil
}

// GetVolume returns a volume the caller sees.
func (n *Node) GetVolume(ctx context.Context, ref string) (*dsecv1.Volume, error) {
	v, err := n.findVolume(ctx, ref)
	if err != nil {
		return nil, err
	}
	return n.volumeView(v), nil
}

// ListVolumes lists the node's volumes the caller sees (its project's; an
// operator's: all), oldest first.
func (n *Node) ListVolumes(ctx context.Context) []*dsecv1.Volume {
	var out []*dsecv1.Volume
	for _, v := range n.volumes.List() {
		if tenant.Reaches(ctx, v.Project) {
			out = append(out, n.volumeView(v))
		}
	}
	return out
}

// DeleteVolume deletes a volume the caller sees; one a sandbox mounts is a
// conflict.
func (n *Node) DeleteVolume(ctx context.Context, ref string) error {
	v, err := n.findVolume(ctx, ref)
	if err != nil {
		return err
	}
	return n.volumes.Delete(v.ID)
}

// normalizeVolumes checks a spec's volume mounts: names of project's
// volumes on this node, paths inside the sandbox, a kind (and runtime)
// that mounts volumes.
func (n *Node) normalizeVolumes(project string, spec *dsecv1.SandboxSpec, caps substrate.Capabilities) error {
	vols := spec.GetVolumes()
	if len(vols) == 0 {
		return nil
	}
	if len(vols) > maxVolumeMounts {
		return errdefs.Invalid("at most %d volumes", maxVolumeMounts)
	}
	seen := map[string]bool{}
	for i, m := range vols {
		if m.GetName() == "" {
			return errdefs.Invalid("volumes[%d].name is required", i)
		}
		if err := mountPath(m.GetPath()); err != nil {
			return errdefs.Invalid("volumes[%d] (%s): %v", i, truncate(m.GetName(), 80), err)
		}
		for other := range seen {
			if other == m.Path || strings.HasPrefix(m.Path, other+"/") || strings.HasPrefix(other, m.Path+"/") {
				return errdefs.Invalid("volumes[%d]: path %s and another volume's %s overlap (volumes are mounted side by side)", i, m.Path, other)
			}
		}
		seen[m.Path] = true
	}
	if !caps.Has(substrate.CapVolumes) {
		return errdefs.Invalid("kind %q%s cannot mount volumes (kind container can); see docs/volumes.md", spec.Kind, runtimeSuffix(spec.Runtime))
	}
	ctx := tenant.With(context.Background(), tenant.Caller{Project: project})
	for _, m := range vols {
		if sharedVolume(spec, m.GetName()) != nil {
			continue // the sandbox's own (shared.go)
		}
		if _, err := n.volumeOf(ctx, project, m.GetName()); err != nil {
			return err
		}
	}
	return nil
}

// mountPath checks where a volume appears: an absolute, clean path, not
// the root, outside what the runtime and the agent own.
func mountPath(p string) error {
	switch {
	case len(p) > 1024:
		return errors.New("path longer than 1024 bytes")
	case !strings.HasPrefix(p, "/") || path.Clean(p) != p || strings.ContainsAny(p, "\x00,:"):
		return errors.New("path must be absolute and clean (no '..', no trailing '/', no ',' or ':')")
	case p == "/":
		return errors.New("a volume cannot be mounted at /")
	}
	for _, owned := range []string{"/proc", "/sys", "/dev", "/.dsec", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"} {
		if p == owned || strings.HasPrefix(p, owned+"/") {
			return errors.New("path " + p + " is the runtime's (" + owned + ")")
		}
	}
	return nil
}

// holdVolumes takes s's volumes for it (read-only, or read-write alone)
// and returns their mounts for its driver. A volume another sandbox holds
// read-write, asked read-write, is a conflict. What it took is released
// with the sandbox (release).
func (n *Node) holdVolumes(s *sandbox, project string) ([]substrate.VolumeMount, error) {
	var out []substrate.VolumeMount
	ctx := tenant.With(context.Background(), tenant.Caller{Project: project})
	for _, m := range s.spec.GetVolumes() {
		if sharedVolume(s.spec, m.GetName()) != nil {
			continue // below
		}
		v, err := n.volumeOf(ctx, project, m.GetName())
		if err != nil {
			return nil, err
		}
		if err := n.volumes.Hold(v.ID, s.id, m.GetReadOnly()); err != nil {
			return nil, err
		}
		src, err := n.volumes.Ready(v.ID)
		if err != nil {
			return nil, err
		}
		out = append(out, substrate.VolumeMount{Source: src, Path: m.GetPath(), ReadOnly: m.GetReadOnly()})
	}
	return append(out, sharedMounts(s, s.spec.GetVolumes())...), nil
}

// readoptVolumes takes a re-adopted sandbox's volumes again (its mount
// namespace kept them across the restart).
func (n *Node) readoptVolumes(s *sandbox) {
	ctx := tenant.With(context.Background(), tenant.Caller{Project: s.project})
	for _, m := range s.spec.GetVolumes() {
		if sharedVolume(s.spec, m.GetName()) != nil {
			continue
		}
		v, err := n.volumeOf(ctx, s.project, m.GetName())
		if err == nil {
			err = n.volumes.Hold(v.ID, s.id, m.GetReadOnly())
		}
		if err != nil {
			n.log.Warn("re-adopted sandbox's volume not held", slog.String("sandbox_id", s.id), slog.String("volume", m.GetName()), slog.Any("error", err))
		}
	}
}

// readWriteVolume names a volume spec mounts read-write ("" if none).
func readWriteVolume(spec *dsecv1.SandboxSpec) string {
	for _, m := range spec.GetVolumes() {
		if !m.GetReadOnly() && sharedVolume(spec, m.GetName()) == nil {
			return m.GetName()
		}
	}
	return ""
}

// The content of volumes, without a sandbox.

func volumeFileInfo(in *volume.Info) *dsecv1.VolumeFileInfo {
	return &dsecv1.VolumeFileInfo{
		Path: in.Path, Name: in.Name, Type: in.Type, Size: in.Size, Mode: in.Mode, Uid: in.UID, Gid: in.GID,
		Atime: timestamppb.New(in.Atime), Mtime: timestamppb.New(in.Mtime), Ctime: timestamppb.New(in.Ctime),
		SymlinkTarget: in.Target,
	}
}

func attrs(mode, uid, gid *uint32) volume.Attrs { return volume.Attrs{Mode: mode, UID: uid, GID: gid} }

// ReadVolumeFile streams a file of a volume: its info, then its data.
func (n *Node) ReadVolumeFile(ctx context.Context, req *dsecv1.ReadVolumeFileRequest, send func(*dsecv1.ReadVolumeFileResponse) error) error {
	v, err := n.findVolume(ctx, req.GetVolume())
	if err != nil {
		return err
	}
	in, r, err := n.volumes.ReadFile(v.ID, req.GetPath())
	if err != nil {
		return err
	}
	defer r.Close()
	if err := send(&dsecv1.ReadVolumeFileResponse{Msg: &dsecv1.ReadVolumeFileResponse_Info{Info: volumeFileInfo(in)}}); err != nil {
		return err
	}
	buf := make([]byte, 256<<10)
	for {
		k, err := r.Read(buf)
		if k > 0 {
			if err := send(&dsecv1.ReadVolumeFileResponse{Msg: &dsecv1.ReadVolumeFileResponse_Data{Data: buf[:k]}}); err != nil {
				return err
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return errdefs.Internal(err, "read %s", in.Path)
		}
	}
}

// WriteVolumeFile writes a file of a volume from r.
func (n *Node) WriteVolumeFile(ctx context.Context, hdr *dsecv1.WriteVolumeFileHeader, r io.Reader) (*dsecv1.VolumeFileInfo, error) {
	v, err := n.findVolume(ctx, hdr.GetVolume())
	if err != nil {
		return nil, err
	}
	in, err := n.volumes.WriteFile(v.ID, hdr.GetPath(), hdr.GetOverwrite(), attrs(hdr.Mode, hdr.Uid, hdr.Gid), r)
	if err != nil {
		return nil, err
	}
	return volumeFileInfo(in), nil
}

// StatVolumePath describes a path of a volume.
func (n *Node) StatVolumePath(ctx context.Context, req *dsecv1.VolumePathRequest) (*dsecv1.VolumeFileInfo, error) {
	v, err := n.findVolume(ctx, req.GetVolume())
	if err != nil {
		return nil, err
	}
	in, err := n.volumes.StatPath(v.ID, req.GetPath())
	if err != nil {
		return nil, err
	}
	return volumeFileInfo(in), nil
}

// ListVolumeDir lists a directory of a volume.
func (n *Node) ListVolumeDir(ctx context.Context, req *dsecv1.ListVolumeDirRequest) (*dsecv1.ListVolumeDirResponse, error) {
	v, err := n.findVolume(ctx, req.GetVolume())
	if err != nil {
		return nil, err
	}
	list, err := n.volumes.ListDir(v.ID, req.GetPath(), int(req.GetDepth()))
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListVolumeDirResponse{Entries: make([]*dsecv1.VolumeFileInfo, len(list))}
	for i, in := range list {
		out.Entries[i] = volumeFileInfo(in)
	}
	return out, nil
}

// MakeVolumeDir makes a directory of a volume.
func (n *Node) MakeVolumeDir(ctx context.Context, req *dsecv1.MakeVolumeDirRequest) (*dsecv1.VolumeFileInfo, error) {
	v, err := n.findVolume(ctx, req.GetVolume())
	if err != nil {
		return nil, err
	}
	in, err := n.volumes.MakeDir(v.ID, req.GetPath(), req.GetParents(), attrs(req.Mode, req.Uid, req.Gid))
	if err != nil {
		return nil, err
	}
	return volumeFileInfo(in), nil
}

// RemoveVolumePath removes a path of a volume.
func (n *Node) RemoveVolumePath(ctx context.Context, req *dsecv1.VolumePathRequest) error {
	v, err := n.findVolume(ctx, req.GetVolume())
	if err != nil {
		return err
	}
	return n.volumes.RemovePath(v.ID, req.GetPath())
}

// SetVolumePathAttrs changes a path's owner and mode.
func (n *Node) SetVolumePathAttrs(ctx context.Context, req *dsecv1.SetVolumePathAttrsRequest) (*dsecv1.VolumeFileInfo, error) {
	v, err := n.findVolume(ctx, req.GetVolume())
	if err != nil {
		return nil, err
	}
	in, err := n.volumes.SetAttrs(v.ID, req.GetPath(), attrs(req.Mode, req.Uid, req.Gid))
	if err != nil {
		return nil, err
	}
	return volumeFileInfo(in), nil
}

// VolumeService, as the node serves it for its own volumes (the node API),
// with callbacks for the streams (the control plane in process).

var _ dsecv1connect.VolumeServiceHandler = (*Service)(nil)

func (s *Service) CreateVolume(ctx context.Context, req *connect.Request[dsecv1.CreateVolumeRequest]) (*connect.Response[dsecv1.Volume], error) {
	return answer(s.n.CreateVolume(ctx, req.Msg))
}

func (s *Service) GetVolume(ctx context.Context, req *connect.Request[dsecv1.GetVolumeRequest]) (*connect.Response[dsecv1.Volume], error) {
	return answer(s.n.GetVolume(ctx, req.Msg.GetVolume()))
}

func (s *Service) ListVolumes(ctx context.Context, req *connect.Request[dsecv1.ListVolumesRequest]) (*connect.Response[dsecv1.ListVolumesResponse], error) {
	return answer(&dsecv1.ListVolumesResponse{Volumes: s.n.ListVolumes(ctx)}, nil)
}

func (s *Service) DeleteVolume(ctx context.Context, req *connect.Request[dsecv1.DeleteVolumeRequest]) (*connect.Response[dsecv1.DeleteVolumeResponse], error) {
	return done[dsecv1.DeleteVolumeResponse](s.n.DeleteVolume(ctx, req.Msg.GetVolume()))
}

func (s *Service) ReadVolumeFile(ctx context.Context, req *connect.Request[dsecv1.ReadVolumeFileRequest], st *connect.ServerStream[dsecv1.ReadVolumeFileResponse]) error {
	return s.ReadVolumeFileChunks(ctx, req.Msg, st.Send)
}

// ReadVolumeFileChunks is ReadVolumeFile with a callback for the info and
// each chunk.
func (s *Service) ReadVolumeFileChunks(ctx context.Context, req *dsecv1.ReadVolumeFileRequest, send func(*dsecv1.ReadVolumeFileResponse) error) error {
	return stream(send, func(send func(*dsecv1.ReadVolumeFileResponse) error) error { return s.n.ReadVolumeFile(ctx, req, send) })
}

func (s *Service) WriteVolumeFile(ctx context.Context, st *connect.ClientStream[dsecv1.WriteVolumeFileRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	if !st.Receive() || st.Msg().GetHeader() == nil {
		if err := st.Err(); err != nil {
			return nil, errwire.ToConnect(errdefs.Invalid("read upload: %v", err))
		}
		return nil, errwire.ToConnect(errdefs.Invalid("WriteVolumeFile needs a header message first"))
	}
	return s.WriteVolumeFileFrom(ctx, st.Msg().GetHeader(), streamData(st))
}

// WriteVolumeFileFrom is WriteVolumeFile with the header read and the data
// a reader.
func (s *Service) WriteVolumeFileFrom(ctx context.Context, hdr *dsecv1.WriteVolumeFileHeader, r io.Reader) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return answer(s.n.WriteVolumeFile(ctx, hdr, r))
}

func (s *Service) StatVolumePath(ctx context.Context, req *connect.Request[dsecv1.VolumePathRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return answer(s.n.StatVolumePath(ctx, req.Msg))
}

func (s *Service) ListVolumeDir(ctx context.Context, req *connect.Request[dsecv1.ListVolumeDirRequest]) (*connect.Response[dsecv1.ListVolumeDirResponse], error) {
	return answer(s.n.ListVolumeDir(ctx, req.Msg))
}

func (s *Service) MakeVolumeDir(ctx context.Context, req *connect.Request[dsecv1.MakeVolumeDirRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return answer(s.n.MakeVolumeDir(ctx, req.Msg))
}

func (s *Service) RemoveVolumePath(ctx context.Context, req *connect.Request[dsecv1.VolumePathRequest]) (*connect.Response[dsecv1.RemoveVolumePathResponse], error) {
	return done[dsecv1.RemoveVolumePathResponse](s.n.RemoveVolumePath(ctx, req.Msg))
}

func (s *Service) SetVolumePathAttrs(ctx context.Context, req *connect.Request[dsecv1.SetVolumePathAttrsRequest]) (*connect.Response[dsecv1.VolumeFileInfo], error) {
	return answer(s.n.SetVolumePathAttrs(ctx, req.Msg))
}
