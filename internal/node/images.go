package node

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
)

func imageView(img *image.Image) *dsecv1.Image {
	v := &dsecv1.Image{
		Name: img.Name, Digest: img.Digest, Layers: img.Layers, SizeBytes: img.Size,
		CreatedAt: timestamppb.New(img.Created), Source: img.Source,
		Config: &dsecv1.ImageConfig{
			Env: img.Config.Env, Workdir: img.Config.Workdir, User: img.Config.User,
			Entrypoint: img.Config.Entrypoint, Cmd: img.Config.Cmd,
			Labels: img.Config.Labels, ExposedPorts: img.Config.ExposedPorts,
		},
	}
	if m := img.VM; m != nil {
		v.Vm = &dsecv1.VMImageInfo{DiskBytes: m.VirtualSize, Firmware: m.Firmware, DirectBoot: m.DirectBoot, Agent: m.Agent}
	}
	return v
}

// ListImages lists the node's images the caller sees: the shared ones and
// its project's own (an operator: all).
func (n *Node) ListImages(ctx context.Context) []*dsecv1.Image {
	var out []*dsecv1.Image
	for _, img := range n.images.List() {
		if img.BuildCache == nil && tenant.Sees(ctx, img.Owner) {
			out = append(out, n.imageView(img))
		}
	}
	return out
}

// imageView is imageView with what this node holds of the image's layers
// loaded on demand.
func (n *Node) imageView(img *image.Image) *dsecv1.Image {
	v := imageView(img)
	if data, cached, ok := n.images.OnDemand(img); ok {
		v.OnDemand = &dsecv1.OnDemandInfo{DataBytes: data, CachedBytes: cached}
	}
	return v
}

// GetImage returns one image as the caller sees it: its project's own of
// that name, else the shared one.
func (n *Node) GetImage(ctx context.Context, name string) (*dsecv1.Image, error) {
	img, err := n.images.Lookup(tenant.Project(ctx), name)
	if err != nil {
		return nil, err
	}
	return n.imageView(img), nil
}

// DeleteImage removes an image as the caller sees it. Running sandboxes of
// it keep their layers. Only operators delete shared images.
func (n *Node) DeleteImage(ctx context.Context, name string) error {
	img, err := n.images.Lookup(tenant.Project(ctx), name)
	if err != nil {
		return err
	}
	if img.Owner == tenant.Shared && !tenant.From(ctx).Admin {
		return errdefs.PermissionDenied("image %q is shared by every project; only an operator can delete it", name)
	}
	return n.images.Delete(img.Key())
}

// Progress receives image import progress.
type Progress func(*dsecv1.ImageProgress)

func (p Progress) image() image.Progress {
	if p == nil {
		return nil
	}
	return func(phase, msg string, done, total int64) {
		p(&dsecv1.ImageProgress{Phase: phase, Message: msg, DoneBytes: done, TotalBytes: total})
	}
}

// PullImage imports an image from a registry.
func (n *Node) PullImage(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (_ *dsecv1.Image, err error) {
	defer func(start time.Time) { n.m.Image("pull", start, err) }(time.Now())
	if req.GetRef() == "" {
		return nil, errdefs.Invalid("ref is required")
	}
	a := req.GetAuth()
	img, err := n.images.Pull(ctx, req.GetRef(), req.GetName(), image.Auth{
		Username: a.GetUsername(), Password: a.GetPassword(), IdentityToken: a.GetIdentityToken(), RegistryToken: a.GetRegistryToken(),
	}, req.GetInsecure(), Progress(progress).image())
	if err != nil {
		return nil, err
	}
	return imageView(img), nil
}

// PushImage writes an image the caller sees to a registry (see
// image.Store.Push); progress gets "upload" messages and, once written,
// phase "pushed" with the reference by digest.
func (n *Node) PushImage(ctx context.Context, req *dsecv1.PushImageRequest, progress func(*dsecv1.ImageProgress)) (_ *dsecv1.Image, err error) {
	defer func(start time.Time) { n.m.Image("push", start, err) }(time.Now())
	if req.GetRef() == "" {
		return nil, errdefs.Invalid("ref is required")
	}
	img, err := n.images.Lookup(tenant.Project(ctx), req.GetName())
	if err != nil {
		return nil, err
	}
	if img.BuildCache != nil {
		return nil, errdefs.NotFound("image %q not found", req.GetName())
	}
	a := req.GetAuth()
	push := n.images.Push
	if req.GetOnDemand() {
		push = n.images.PushLazy
	}
	if _, err := push(ctx, img, req.GetRef(), image.Auth{
		Username: a.GetUsername(), Password: a.GetPassword(), IdentityToken: a.GetIdentityToken(), RegistryToken: a.GetRegistryToken(),
	}, req.GetInsecure(), Progress(progress).image()); err != nil {
		return nil, err
	}
	return imageView(img), nil
}

// ExportImage sends an image the caller sees as a tar of an OCI image
// layout of its layers' EROFS files (image.Store.Export), in chunks of at
// most exportChunk bytes.
func (n *Node) ExportImage(ctx context.Context, req *dsecv1.ExportImageRequest, send func(*dsecv1.ExportImageChunk) error) (err error) {
	defer func(start time.Time) { n.m.Image("export", start, err) }(time.Now())
	img, err := n.images.Lookup(tenant.Project(ctx), req.GetName())
	if err != nil {
		return err
	}
	if img.BuildCache != nil {
		return errdefs.NotFound("image %q not found", req.GetName())
	}
	w := bufio.NewWriterSize(chunkWriter(func(b []byte) error { return send(&dsecv1.ExportImageChunk{Data: b}) }), exportChunk)
	if err := n.images.Export(ctx, img, w); err != nil {
		return err
	}
	return w.Flush()
}

const exportChunk = 1 << 20

// chunkWriter sends what is written in messages of at most exportChunk
// bytes. The slice is not kept: a stream's Send marshals the message
// before it returns.
type chunkWriter func([]byte) error

func (c chunkWriter) Write(p []byte) (int, error) {
	for off := 0; off < len(p); off += exportChunk {
		if err := c(p[off:min(off+exportChunk, len(p))]); err != nil {
			return off, err
		}
	}
	return len(p), nil
}

// UploadImage imports an archive streamed by the client: an image
// archive, or (format "vm") a bootable disk image for kind vm.
func (n *Node) UploadImage(ctx context.Context, hdr *dsecv1.UploadImageHeader, r io.Reader) (_ *dsecv1.Image, err error) {
	defer func(start time.Time) { n.m.Image("upload", start, err) }(time.Now())
	if err := image.ValidName(hdr.GetName()); err != nil {
		return nil, err
	}
	var img *image.Image
	r = countingReader{r, n.m.ImageBytes}
	switch hdr.GetFormat() {
	case "":
		img, err = n.images.ImportArchive(ctx, r, hdr.GetName(), nil)
	case "vm":
		img, err = n.images.ImportVM(ctx, r, hdr.GetName(), nil)
	default:
		return nil, errdefs.Invalid("upload format %q (use \"\" for an image archive or \"vm\" for a VM disk)", hdr.GetFormat())
	}
	if err != nil {
		return nil, err
	}
	return imageView(img), nil
}

// BootstrapImage builds a base image offline: file system layers, or
// with req.Vm a bootable VM image.
func (n *Node) BootstrapImage(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (_ *dsecv1.Image, err error) {
	defer func(start time.Time) { n.m.Image("bootstrap", start, err) }(time.Now())
	name := req.GetName()
	if name == "" {
		name = req.GetRecipe()
		if req.GetVm() {
			name += "-vm"
		}
	}
	if !req.GetForce() {
		if img, err := n.images.Lookup(tenant.Project(ctx), name); err == nil {
			if (img.VM != nil) != req.GetVm() {
				return nil, errdefs.Conflict("image %q exists and is not a %s", name, map[bool]string{true: "VM image", false: "layer image"}[req.GetVm()])
			}
			return imageView(img), nil
		}
	}
	opts := image.BootstrapOptions{CacheDir: n.cfg.CacheDir, Packages: req.GetPackages(), Force: req.GetForce(), DiskMB: req.GetDiskMb()}
	var img *image.Image
	if req.GetVm() {
		img, err = n.images.BuildVM(ctx, req.GetRecipe(), name, opts, Progress(progress).image())
	} else {
		img, err = n.images.Bootstrap(ctx, req.GetRecipe(), name, opts, Progress(progress).image())
	}
	if err != nil {
		return nil, err
	}
	return imageView(img), nil
}

// Info describes the node: its kinds, their capabilities and its load.
func (n *Node) Info(ctx context.Context) *dsecv1.NodeInfo {
	count := n.sandboxes.count()
	info := &dsecv1.NodeInfo{
		Name: n.cfg.Name, State: "ready", Sandboxes: int64(count), MaxSandboxes: int64(n.cfg.MaxSandboxes),
		CpuCores: float64(hostCPUs()), MemoryMb: hostMemoryMB(), Host: map[string]string{},
	}
	if why := n.net.EgressUnavailable(); why != "" {
		info.Host["network_egress"] = "unavailable: " + why
	} else {
		info.Host["network_egress"] = "available"
	}
	if ok, why := n.images.Erofs(); ok {
		info.Host["image_layers"] = "erofs"
	} else {
		info.Host["image_layers"] = "dir: " + why
	}
	info.Host["image_store"] = fmt.Sprintf("layers take %d MiB of a %d MiB budget", n.images.LayerBytes()>>20, n.images.Budget()>>20)
	if c := n.images.ChunkCache(); c.Budget > 0 {
		var hits, fetches int64
		for _, st := range n.images.LazyStats() {
			hits, fetches = hits+st.Hits, fetches+st.Fetches
		}
		info.Host["image_chunk_cache"] = fmt.Sprintf("%d MiB of %d MiB (%d MiB dropped to stay within it); reads since start: %d from the cache, %d fetched",
			c.Used>>20, c.Budget>>20, c.Evicted>>20, hits, fetches)
	}
	for _, k := range substrate.Kinds {
		d := n.drivers[k]
		if d == nil {
			info.Kinds = append(info.Kinds, &dsecv1.KindInfo{Kind: string(k), Reason: "not built into this node"})
			continue
		}
		c := d.Capabilities()
		ki := &dsecv1.KindInfo{Kind: string(k), Available: c.Available, Reason: c.Reason, Details: c.Details}
		for _, x := range c.Caps {
			ki.Capabilities = append(ki.Capabilities, string(x))
		}
		for _, r := range c.Runtimes {
			ri := &dsecv1.RuntimeInfo{Name: r.Name, Available: r.Available, Reason: r.Reason, Details: r.Details}
			for _, x := range r.Caps {
				ri.Capabilities = append(ri.Capabilities, string(x))
			}
			ki.Runtimes = append(ki.Runtimes, ri)
		}
		info.Kinds = append(info.Kinds, ki)
	}
	return info
}

// Capacity reports the node's room: slots, the start queue, the recent
// start rate and its warm pools.
func (n *Node) Capacity(ctx context.Context) *dsecv1.Capacity {
	running := int64(n.sandboxes.count())
	_, queued, rate := n.starts.stats()
	free := int64(n.cfg.MaxSandboxes) - running - n.creating.Load()
	return &dsecv1.Capacity{
		MaxSandboxes: int64(n.cfg.MaxSandboxes), Running: running, FreeSlots: max(free, 0),
		QueueDepth: int64(queued), QueueLimit: int64(n.cfg.StartQueue),
		StartsPerS: rate, MaxConcurrentStarts: int64(n.cfg.MaxConcurrentStarts),
		Pools: n.pools.stats(),
	}
}

// countingReader tells count how many bytes each read returned.
type countingReader struct {
	r     io.Reader
	count func(int64)
}

func (c countingReader) Read(p []byte) (int, error) {
	k, err := c.r.Read(p)
	c.count(int64(k))
	return k, err
}
