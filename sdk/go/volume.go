package dsec

import (
	"context"
	"fmt"
	"io"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// VolumeMount mounts a volume into a sandbox at create
// (CreateOptions.Volumes).
type VolumeMount struct {
	// Name is the volume's name (or ID).
	Name string
	// Path is where it appears in the sandbox (absolute).
	Path string
	// ReadOnly shares the volume read-only; otherwise the sandbox owns it
	// read-write, alone, for its life.
	ReadOnly bool
}

// ParseVolumeMount reads "name:/path" or "name:/path:ro" (":rw" is the
// default).
func ParseVolumeMount(s string) (VolumeMount, error) {
	parts := strings.Split(s, ":")
	m := VolumeMount{}
	switch {
	case len(parts) == 2:
	case len(parts) == 3 && (parts[2] == "ro" || parts[2] == "rw"):
		m.ReadOnly = parts[2] == "ro"
	default:
		return m, fmt.Errorf("volume %q: use NAME:/PATH or NAME:/PATH:ro", s)
	}
	m.Name, m.Path = parts[0], parts[1]
	if m.Name == "" || !strings.HasPrefix(m.Path, "/") {
		return m, fmt.Errorf("volume %q: use NAME:/PATH or NAME:/PATH:ro", s)
	}
	return m, nil
}

func volumeMounts(ms []VolumeMount) []*dsecv1.VolumeMount {
	var out []*dsecv1.VolumeMount
	for _, m := range ms {
		out = append(out, &dsecv1.VolumeMount{Name: m.Name, Path: m.Path, ReadOnly: m.ReadOnly})
	}
	return out
}

// VolumeOptions shape a new volume.
type VolumeOptions struct {
	// SizeMB is its size, its limit (0: the node's default).
	SizeMB int64
	Labels map[string]string
	// Node puts it on this node (cluster mode; "" lets the server choose).
	Node string
}

// CreateVolume makes an empty volume of the caller's project.
func (c *Client) CreateVolume(ctx context.Context, name string, o VolumeOptions) (*dsecv1.Volume, error) {
	r, err := c.raw.Volumes.CreateVolume(ctx, connect.NewRequest(&dsecv1.CreateVolumeRequest{Name: name, SizeMb: o.SizeMB, Labels: o.Labels, Node: o.Node}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// GetVolume returns a volume by name or ID.
func (c *Client) GetVolume(ctx context.Context, volume string) (*dsecv1.Volume, error) {
	r, err := c.raw.Volumes.GetVolume(ctx, connect.NewRequest(&dsecv1.GetVolumeRequest{Volume: volume}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// ListVolumes lists the caller's volumes, oldest first.
func (c *Client) ListVolumes(ctx context.Context) ([]*dsecv1.Volume, error) {
	r, err := c.raw.Volumes.ListVolumes(ctx, connect.NewRequest(&dsecv1.ListVolumesRequest{}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Volumes, nil
}

// DeleteVolume deletes a volume (by name or ID) and its content; a volume
// a live sandbox mounts is a conflict.
func (c *Client) DeleteVolume(ctx context.Context, volume string) error {
	_, err := c.raw.Volumes.DeleteVolume(ctx, connect.NewRequest(&dsecv1.DeleteVolumeRequest{Volume: volume}))
	return err
}

// WriteVolumeFile writes a file of a volume from r, without a sandbox. An
// existing file is a conflict unless overwrite.
func (c *Client) WriteVolumeFile(ctx context.Context, volume, path string, r io.Reader, overwrite bool) (*dsecv1.VolumeFileInfo, error) {
	hdr := &dsecv1.WriteVolumeFileHeader{Volume: volume, Path: path, Overwrite: overwrite}
	return sendStream(c.raw.Volumes.WriteVolumeFile(ctx), &dsecv1.WriteVolumeFileRequest{Msg: &dsecv1.WriteVolumeFileRequest_Header{Header: hdr}},
		func(b []byte) *dsecv1.WriteVolumeFileRequest {
			return &dsecv1.WriteVolumeFileRequest{Msg: &dsecv1.WriteVolumeFileRequest_Data{Data: b}}
		}, r, 256<<10, nil)
}

// ReadVolumeFile streams a file of a volume into w, without a sandbox.
func (c *Client) ReadVolumeFile(ctx context.Context, volume, path string, w io.Writer) (*dsecv1.VolumeFileInfo, error) {
	st, err := c.raw.Volumes.ReadVolumeFile(ctx, connect.NewRequest(&dsecv1.ReadVolumeFileRequest{Volume: volume, Path: path}))
	if err != nil {
		return nil, err
	}
	return readChunks(st, w, func(m *dsecv1.ReadVolumeFileResponse) (*dsecv1.VolumeFileInfo, []byte) {
		return m.GetInfo(), m.GetData()
	})
}

// ListVolumeDir lists a directory of a volume, depth levels deep (0: 1).
func (c *Client) ListVolumeDir(ctx context.Context, volume, path string, depth int32) ([]*dsecv1.VolumeFileInfo, error) {
	r, err := c.raw.Volumes.ListVolumeDir(ctx, connect.NewRequest(&dsecv1.ListVolumeDirRequest{Volume: volume, Path: path, Depth: depth}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Entries, nil
}

// StatVolumePath describes a path of a volume.
func (c *Client) StatVolumePath(ctx context.Context, volume, path string) (*dsecv1.VolumeFileInfo, error) {
	r, err := c.raw.Volumes.StatVolumePath(ctx, connect.NewRequest(&dsecv1.VolumePathRequest{Volume: volume, Path: path}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// MakeVolumeDir makes a directory of a volume (with parents: its missing
// parents too, and an existing directory is fine).
func (c *Client) MakeVolumeDir(ctx context.Context, volume, path string, parents bool) (*dsecv1.VolumeFileInfo, error) {
	r, err := c.raw.Volumes.MakeVolumeDir(ctx, connect.NewRequest(&dsecv1.MakeVolumeDirRequest{Volume: volume, Path: path, Parents: parents}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// RemoveVolumePath removes a file or a directory (with what it holds) of a
// volume.
func (c *Client) RemoveVolumePath(ctx context.Context, volume, path string) error {
	_, err := c.raw.Volumes.RemoveVolumePath(ctx, connect.NewRequest(&dsecv1.VolumePathRequest{Volume: volume, Path: path}))
	return err
}
