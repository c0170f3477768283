package dsec

import (
	"context"
	"errors"
	"io"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// ListImages lists the images the deployment can start sandboxes from.
func (c *Client) ListImages(ctx context.Context) ([]*dsecv1.Image, error) {
	r, err := c.raw.Images.ListImages(ctx, connect.NewRequest(&dsecv1.ListImagesRequest{}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Images, nil
}

// DeleteImage removes an image.
func (c *Client) DeleteImage(ctx context.Context, name string) error {
	_, err := c.raw.Images.DeleteImage(ctx, connect.NewRequest(&dsecv1.DeleteImageRequest{Name: name}))
	return err
}

// progressStream drains an image progress stream.
func progressStream(st *connect.ServerStreamForClient[dsecv1.ImageProgress], progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	defer st.Close()
	var img *dsecv1.Image
	for st.Receive() {
		p := st.Msg()
		if p.Image != nil {
			img = p.Image
		}
		if progress != nil {
			progress(p)
		}
	}
	if err := st.Err(); err != nil {
		return nil, asError(err)
	}
	if img == nil {
		return nil, errors.New("image stream ended without a result")
	}
	return img, nil
}

// PushImage writes an image to a registry; the final progress message
// (phase "done") names the pushed reference by digest.
func (c *Client) PushImage(ctx context.Context, req *dsecv1.PushImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := c.raw.Images.PushImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, asError(err)
	}
	return progressStream(st, progress)
}

// ExportImage writes an image of the caller's project (or a shared one) to
// w as a tar of an OCI image layout of its layers' EROFS files: unpacked
// under a prefix of an HTTP server or object store that answers range
// requests, PullImage with ref "https://host/prefix/" loads it on demand.
func (c *Client) ExportImage(ctx context.Context, name string, w io.Writer) error {
	st, err := c.raw.Images.ExportImage(ctx, connect.NewRequest(&dsecv1.ExportImageRequest{Name: name}))
	if err != nil {
		return asError(err)
	}
	defer st.Close()
	for st.Receive() {
		if _, err := w.Write(st.Msg().GetData()); err != nil {
			return err
		}
	}
	if err := st.Err(); err != nil {
		return asError(err)
	}
	return nil
}

// PullImage imports an image from a registry on every node (or, ref an
// http(s) URL, from the OCI image layout there: see ExportImage).
func (c *Client) PullImage(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := c.raw.Images.PullImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return progressStream(st, progress)
}

// BootstrapImage builds a base image offline ("busybox" or "debian"; with
// req.Vm a bootable VM image for kind vm).
func (c *Client) BootstrapImage(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := c.raw.Images.BootstrapImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return progressStream(st, progress)
}

// UploadImage imports an archive (`docker save` or a tar of an OCI layout)
// read from r. sent reports bytes uploaded.
func (c *Client) UploadImage(ctx context.Context, name string, size int64, r io.Reader, sent func(int64)) (*dsecv1.Image, error) {
	return c.upload(ctx, &dsecv1.UploadImageHeader{Name: name, Size: size}, r, sent)
}

// UploadVMImage imports a bootable disk image (qcow2 or raw) that runs
// dsec-guest, read from r, as a VM image for kind vm.
func (c *Client) UploadVMImage(ctx context.Context, name string, size int64, r io.Reader, sent func(int64)) (*dsecv1.Image, error) {
	return c.upload(ctx, &dsecv1.UploadImageHeader{Name: name, Size: size, Format: "vm"}, r, sent)
}

func (c *Client) upload(ctx context.Context, hdr *dsecv1.UploadImageHeader, r io.Reader, sent func(int64)) (*dsecv1.Image, error) {
	return sendStream(c.raw.Images.UploadImage(ctx), &dsecv1.UploadImageRequest{Msg: &dsecv1.UploadImageRequest_Header{Header: hdr}},
		func(b []byte) *dsecv1.UploadImageRequest {
			return &dsecv1.UploadImageRequest{Msg: &dsecv1.UploadImageRequest_Data{Data: b}}
		}, r, 1<<20, sent)
}

// sendStream makes a client-streaming call: the header message, then r in
// data messages of up to chunk bytes (sent reports the bytes sent so far;
// it may be nil), then the answer. A send that fails means the server
// answered early: the answer says why. r's own errors are returned as
// they are.
func sendStream[Req, Res any](st *connect.ClientStreamForClient[Req, Res], header *Req, data func([]byte) *Req, r io.Reader, chunk int, sent func(int64)) (*Res, error) {
	if err := st.Send(header); err != nil && !errors.Is(err, io.EOF) {
		return nil, asError(err)
	}
	buf := make([]byte, chunk)
	var total int64
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if st.Send(data(buf[:n])) != nil {
				break
			}
			total += int64(n)
			if sent != nil {
				sent(total)
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			st.CloseAndReceive()
			return nil, err
		}
	}
	resp, err := st.CloseAndReceive()
	if err != nil {
		return nil, asError(err)
	}
	return resp.Msg, nil
}

// UploadBuildContext sends a build context (a tar of the files a
// Dockerfile's COPY and ADD read, such as buildctx.Tar writes) for
// BuildImage, which names it by the returned digest.
func (c *Client) UploadBuildContext(ctx context.Context, r io.Reader, sent func(int64)) (*dsecv1.BuildContext, error) {
	return sendStream(c.raw.Images.UploadBuildContext(ctx),
		&dsecv1.UploadBuildContextRequest{Msg: &dsecv1.UploadBuildContextRequest_Header{Header: &dsecv1.UploadBuildContextHeader{}}},
		func(b []byte) *dsecv1.UploadBuildContextRequest {
			return &dsecv1.UploadBuildContextRequest{Msg: &dsecv1.UploadBuildContextRequest_Data{Data: b}}
		}, r, 1<<20, sent)
}

// BuildImage builds an image from a Dockerfile (req.Dockerfile, with the
// context req.ContextDigest names), streaming each step and its output to
// progress.
func (c *Client) BuildImage(ctx context.Context, req *dsecv1.BuildImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error) {
	st, err := c.raw.Images.BuildImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, asError(err)
	}
	return progressStream(st, progress)
}

// CommitSandbox stores a container sandbox's files and environment as an
// image named name.
func (c *Client) CommitSandbox(ctx context.Context, sandboxID, name string) (*dsecv1.Image, error) {
	r, err := c.raw.Images.CommitSandbox(ctx, connect.NewRequest(&dsecv1.CommitSandboxRequest{SandboxId: sandboxID, Name: name}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}

// PruneBuildCache removes the caller's build cache and returns how many
// cached steps went.
func (c *Client) PruneBuildCache(ctx context.Context) (int64, error) {
	r, err := c.raw.Images.PruneBuildCache(ctx, connect.NewRequest(&dsecv1.PruneBuildCacheRequest{}))
	if err != nil {
		return 0, asError(err)
	}
	return r.Msg.GetRemoved(), nil
}

// PruneImages removes what the nodes keep as a cache for the caller: its
// build cache and the copies of images nodes loaded from each other that
// no sandbox uses (an operator's: every project's, and the cached chunks
// of layers loaded on demand no sandbox uses). It says what went.
func (c *Client) PruneImages(ctx context.Context) (*dsecv1.PruneBuildCacheResponse, error) {
	r, err := c.raw.Images.PruneBuildCache(ctx, connect.NewRequest(&dsecv1.PruneBuildCacheRequest{}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}
