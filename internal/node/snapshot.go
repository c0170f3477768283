package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
)

// Labels the node sets on forked sandboxes.
const (
	ForkOfLabel    = "dsec.io/fork-of"
	ForkIndexLabel = "dsec.io/fork-index"
)

func (n *Node) newSnapshotID() string { return sandboxid.NewSnapshot(n.cfg.Name) }

// NodeOfSnapshot returns the node a snapshot ID names.
func NodeOfSnapshot(id string) (string, error) { return sandboxid.SnapshotNode(id) }

// Snapshot captures a sandbox. Kinds with layer snapshots (containers)
// capture the writable layer, consistently (frozen), as a new read-only
// layer stacked on the image: children share everything below it. Kinds
// with memory snapshots (microVMs) capture the whole machine: memory,
// devices and disk, kept in the node's snapshots/<id> directory; children
// start where the parent was, running processes included. Either way the
// snapshot is an image record: listed, deleted and kept across restarts
// the same way.
func (n *Node) Snapshot(ctx context.Context, req *dsecv1.SnapshotRequest) (_ *dsecv1.SnapshotInfo, err error) {
	defer n.m.Observe(ctx, metrics.OpSnapshot, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	info, err := n.snapshot(ctx, req, false, "")
	if err != nil {
		return nil, err
	}
	if s := n.sandboxes.get(req.GetSandboxId()); s != nil {
		n.publish(s, events.Snapshotted, s.currentState(), func(ev *dsecv1.Event) { ev.SnapshotId = info.Id })
	}
	return info, nil
}

// snapshot takes a snapshot; an ephemeral one is a fork's, forkKey its
// idempotency key (or none).
func (n *Node) snapshot(ctx context.Context, req *dsecv1.SnapshotRequest, ephemeral bool, forkKey string) (*dsecv1.SnapshotInfo, error) {
	s, err := n.lookup(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if len(req.GetName()) > 128 {
		return nil, errdefs.Invalid("snapshot name longer than 128 bytes")
	}
	if m, ok := s.inst.(substrate.MachineSnapshotter); ok {
		return n.machineSnapshot(ctx, s, m, req, ephemeral, forkKey)
	}
	diff, size, release, err := n.captureLayer(ctx, s)
	if err != nil {
		return nil, err
	}
	// Held until the record names it: a GC meanwhile (another fork's
	// snapshot released) would take it.
	defer release()
	// Each sidecar is captured the same way, one after another (the group
	// is not frozen as one: each container is, while its layer is read).
	var sidecars []image.SnapshotSidecar
	if g, ok := s.inst.(*group); ok {
		var releaseSidecars func()
		if sidecars, releaseSidecars, err = n.snapshotSidecars(ctx, s, g); err != nil {
			return nil, err
		}
		defer releaseSidecars()
	}
	shared, sharedMounts := sharedMeta(s.spec)
	cfg := n.snapshotConfig(s)
	id := n.newSnapshotID()
	rec := &image.Image{
		Name: id, Owner: s.project, Layers: append(mainLayers(s), diff), Size: size,
		Created: time.Now().UTC(), Source: "snapshot:" + s.id, Config: cfg, Digest: diff,
		Snapshot: &image.SnapshotMeta{ID: id, Name: req.GetName(), SandboxID: s.id, Kind: s.spec.Kind, BaseImage: s.spec.Image, Size: size, Ephemeral: ephemeral, ForkKey: forkKey,
			Sidecars: sidecars, Aliases: s.spec.Aliases, Shared: shared, SharedMounts: sharedMounts},
	}
	if err := n.images.Put(rec); err != nil {
		return nil, err
	}
	return n.snapshotView(rec), nil
}

// captureLayer stores s's writable layer (captured consistently: frozen)
// as a layer, held until release is called.
func (n *Node) captureLayer(ctx context.Context, s *sandbox) (diff string, size int64, release func(), err error) {
	snap, err := can[substrate.Snapshotter](s, "cannot snapshot")
	if err != nil {
		return "", 0, nil, err
	}
	s.touch()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(snap.Snapshot(ctx, pw)) }()
	diff, size, release, err = n.images.AddLayer(pr)
	pr.Close()
	if err != nil {
		return "", 0, nil, n.callFailed(s, errdefs.Classify(err))
	}
	return diff, size, release, nil
}

// CommitSandbox stores a container sandbox's files (its image's layers
// and its writable layer) and its environment, user and working
// directory as an image of the caller's project. The sandbox runs on.
func (n *Node) CommitSandbox(ctx context.Context, req *dsecv1.CommitSandboxRequest) (_ *dsecv1.Image, err error) {
	defer func(start time.Time) { n.m.Image("commit", start, err) }(time.Now())
	if err := image.ValidName(req.GetName()); err != nil {
		return nil, err
	}
	if strings.HasPrefix(req.GetName(), buildCachePrefix) {
		return nil, errdefs.Invalid("image names starting with %q are the build cache's", buildCachePrefix)
	}
	s, err := n.live(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if _, ok := s.inst.(substrate.MachineSnapshotter); ok {
		return nil, errdefs.Invalid("sandbox %s is a %s: commit captures a container's files (snapshot it instead)", s.id, s.spec.Kind)
	}
	diff, size, release, err := n.captureLayer(ctx, s)
	if err != nil {
		return nil, err
	}
	defer release()
	base := int64(0)
	if img, err := n.images.Get(s.image); err == nil {
		base = img.Size
	}
	layers := mainLayers(s)
	if diff != image.EmptyLayer {
		layers = append(layers, diff)
	}
	cfg := n.snapshotConfig(s)
	rec := &image.Image{
		Name: req.GetName(), Owner: s.project, Layers: layers, Size: base + size,
		Created: time.Now().UTC(), Source: "commit:" + s.id, Config: cfg, Digest: configDigest(layers, cfg),
	}
	if err := n.images.Put(rec); err != nil {
		return nil, err
	}
	n.loadChanged()
	return imageView(rec), nil
}

// snapshotConfig is the image config a snapshot's children start with:
// the base image's, with the sandbox's environment, user and workdir.
func (n *Node) snapshotConfig(s *sandbox) image.Config {
	base := image.Config{}
	if img, err := n.images.Get(s.image); err == nil {
		base = img.Config
	}
	cfg := base
	cfg.Env = append([]string(nil), base.Env...)
	for k, v := range s.spec.Env {
		cfg.Env = append(cfg.Env, k+"="+v)
	}
	cfg.Workdir, cfg.User = s.spec.Workdir, s.spec.User
	return cfg
}

// snapshotDir is where a machine snapshot's files live.
func (n *Node) snapshotDir(id string) string {
	return filepath.Join(n.cfg.DataDir, "snapshots", id)
}

// machineSnapshot captures a sandbox's whole machine through its driver.
func (n *Node) machineSnapshot(ctx context.Context, s *sandbox, m substrate.MachineSnapshotter, req *dsecv1.SnapshotRequest, ephemeral bool, forkKey string) (_ *dsecv1.SnapshotInfo, err error) {
	s.touch()
	id := n.newSnapshotID()
	dir := n.snapshotDir(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, errdefs.Internal(err, "create snapshot directory")
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()
	if err := s.isEnding(); err != nil {
		return nil, err
	}
	if err := m.SnapshotMachine(ctx, dir); err != nil {
		return nil, n.callFailed(s, errdefs.Classify(err))
	}
	size := diskUsage(dir)
	rec := &image.Image{
		Name: id, Owner: s.project, Layers: append([]string(nil), s.layers...), Size: size,
		Created: time.Now().UTC(), Source: "snapshot:" + s.id, Config: n.snapshotConfig(s), Digest: "machine:" + id,
		Snapshot: &image.SnapshotMeta{ID: id, Name: req.GetName(), SandboxID: s.id, Kind: s.spec.Kind, BaseImage: s.spec.Image, Size: size, Ephemeral: ephemeral, Machine: true, ForkKey: forkKey},
	}
	if err := n.images.Put(rec); err != nil {
		return nil, err
	}
	return n.snapshotView(rec), nil
}

// diskUsage is the space a directory's files take (sparse disks count
// what they hold).
func diskUsage(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			var st unix.Stat_t
			if unix.Stat(p, &st) == nil {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}

// deleteSnapshot removes a snapshot's record and, for a machine snapshot,
// its files.
func (n *Node) deleteSnapshot(img *image.Image) error {
	if err := n.images.Delete(img.Key()); err != nil {
		return err
	}
	if img.Snapshot != nil && img.Snapshot.Machine {
		if err := os.RemoveAll(n.snapshotDir(img.Name)); err != nil {
			return errdefs.Internal(err, "remove snapshot files")
		}
	}
	return nil
}

// removeOrphanSnapshotDirs removes machine snapshot directories without a
// record (a snapshot interrupted by a crash), at start.
func (n *Node) removeOrphanSnapshotDirs() {
	ents, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, "snapshots"))
	for _, e := range ents {
		if img := n.snapshotByID(e.Name()); img == nil || !img.Snapshot.Machine {
			os.RemoveAll(filepath.Join(n.cfg.DataDir, "snapshots", e.Name()))
		}
	}
}

// snapshotByID returns the snapshot with ID id, whichever project owns it,
// or nil.
func (n *Node) snapshotByID(id string) *image.Image {
	for _, img := range n.images.List() {
		if img.Snapshot != nil && img.Name == id {
			return img
		}
	}
	return nil
}

func (n *Node) snapshotView(img *image.Image) *dsecv1.SnapshotInfo {
	m := img.Snapshot
	return &dsecv1.SnapshotInfo{
		Id: m.ID, Name: m.Name, SandboxId: m.SandboxID, Kind: m.Kind, Image: m.BaseImage,
		SizeBytes: m.Size, CreatedAt: timestamppb.New(img.Created), Node: n.cfg.Name,
	}
}

// ListSnapshots lists the node's snapshots the caller sees (its
// project's; an operator's: all).
func (n *Node) ListSnapshots(ctx context.Context) []*dsecv1.SnapshotInfo {
	var out []*dsecv1.SnapshotInfo
	for _, img := range n.images.List() {
		if img.Snapshot != nil && tenant.Reaches(ctx, img.Owner) {
			out = append(out, n.snapshotView(img))
		}
	}
	return out
}

// DeleteSnapshot deletes a snapshot; sandboxes created from it keep its
// layers (and started from a machine snapshot, need nothing of it).
func (n *Node) DeleteSnapshot(ctx context.Context, id string) error {
	img := n.snapshotByID(id)
	if img == nil || !tenant.Reaches(ctx, img.Owner) {
		return errdefs.NotFound("snapshot %q not found", id)
	}
	return n.deleteSnapshot(img)
}

// releaseSnapshot deletes an ephemeral (fork) snapshot once no live
// sandbox starts from it and no fork is between snapshotting and
// creating its children. The layers stay while sandboxes use them. A
// started child of a machine snapshot needs nothing of it, so machine
// snapshots go as soon as their fork is done. key is the snapshot's image
// key (image.Image.Key).
func (n *Node) releaseSnapshot(key string) {
	n.forkMu.Lock()
	defer n.forkMu.Unlock()
	img, err := n.images.Get(key)
	if err != nil || img.Snapshot == nil || !img.Snapshot.Ephemeral {
		return
	}
	if !n.sandboxes.holds(key, !img.Snapshot.Machine) {
		if err := n.deleteSnapshot(img); err != nil {
			n.log.Warn("delete fork snapshot", slog.String("snapshot_id", img.Name), slog.Any("error", err))
		}
	}
}

// releaseUnusedSnapshots deletes every ephemeral snapshot no sandbox
// starts from (at start, after re-adoption).
func (n *Node) releaseUnusedSnapshots() {
	for _, img := range n.images.List() {
		if img.Snapshot != nil && img.Snapshot.Ephemeral {
			n.releaseSnapshot(img.Key())
		}
	}
}

// pinForkSnapshot pins and returns the ephemeral snapshot of parent an
// earlier fork with forkKey took, if it still exists, or nil.
func (n *Node) pinForkSnapshot(parent *sandbox, forkKey string) *dsecv1.SnapshotInfo {
	if forkKey == "" {
		return nil
	}
	n.forkMu.Lock()
	defer n.forkMu.Unlock()
	for _, img := range n.images.List() {
		if m := img.Snapshot; m != nil && m.Ephemeral && m.ForkKey == forkKey && m.SandboxID == parent.id && img.Owner == parent.project {
			n.sandboxes.pin(img.Key(), 1)
			return n.snapshotView(img)
		}
	}
	return nil
}

// CreateMany creates one sandbox per spec, concurrently, and reports each;
// keys, if given, holds each item's idempotency key.
func (n *Node) CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse {
	return n.createMany(ctx, specs, keys, project, nil)
}

// ItemKeys derives per-item idempotency keys "<key>/<i>".
func ItemKeys(key string, n int) []string {
	if key == "" {
		return nil
	}
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s/%d", key, i)
	}
	return out
}

func (n *Node) createMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string, extra func(int) map[string]string) *dsecv1.CreateSandboxesResponse {
	out := &dsecv1.CreateSandboxesResponse{Results: make([]*dsecv1.CreateResult, len(specs))}
	var wg sync.WaitGroup
	var mu sync.Mutex
	sem := make(chan struct{}, 64)
	for i, spec := range specs {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int, spec *dsecv1.SandboxSpec) {
			defer wg.Done()
			defer func() { <-sem }()
			k := ""
			if i < len(keys) {
				k = keys[i]
			}
			var labels map[string]string
			if extra != nil {
				labels = extra(i)
			}
			sb, err := n.create(ctx, spec, k, project, labels)
			r := &dsecv1.CreateResult{Index: int32(i), Sandbox: sb}
			mu.Lock()
			if err != nil {
				r.Error = ItemError(err)
				out.Failed++
			} else {
				out.Created++
			}
			out.Results[i] = r
			mu.Unlock()
		}(i, spec)
	}
	wg.Wait()
	return out
}

// Fork snapshots a sandbox and creates count children from the snapshot,
// each with the parent's spec, labels marking the fork, and its own
// writable layer.
func (n *Node) Fork(ctx context.Context, req *dsecv1.ForkRequest) (_ *dsecv1.CreateSandboxesResponse, err error) {
	defer n.m.Observe(ctx, metrics.OpFork, n.kindOf(req.GetSandboxId()), time.Now(), &err)
	if req.GetCount() < 1 || req.GetCount() > 1024 {
		return nil, errdefs.Invalid("count must be between 1 and 1024")
	}
	parent, err := n.lookup(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if v := readWriteVolume(parent.spec); v != "" {
		return nil, errdefs.Conflict("sandbox %s mounts volume %q read-write, which one sandbox at a time does: its children cannot (mount it read-only to fork)", parent.id, v)
	}
	// A repeat (a resumed trainer's) answers the children the first call
	// made, adopted by their idempotency keys, and starts those it lacks
	// from the first call's snapshot while that exists (pinned here, so
	// its release by the first call, ending meanwhile, waits for this
	// one), else from a snapshot of its own.
	forkKey := ""
	if req.GetIdempotencyKey() != "" {
		forkKey = idemKey(parent.project, req.GetIdempotencyKey())
	}
	snap := n.pinForkSnapshot(parent, forkKey)
	if snap == nil {
		snap, err = n.snapshot(ctx, &dsecv1.SnapshotRequest{SandboxId: req.GetSandboxId(), Name: "fork of " + req.GetSandboxId()}, true, forkKey)
		if err != nil {
			return nil, err
		}
		n.sandboxes.pin(tenant.ImageKey(parent.project, snap.Id), 1)
	}
	snapKey := tenant.ImageKey(parent.project, snap.Id)
	defer func() {
		n.sandboxes.pin(snapKey, -1)
		n.releaseSnapshot(snapKey)
	}()
	base := parent.currentSpec()
	base.Snapshot, base.Image = snap.Id, ""
	// The children's sidecars (and the names they answer to) come from
	// the snapshot, each from its own captured layer.
	base.Sidecars, base.Aliases = nil, nil
	// The snapshot holds the parent's composed layers already.
	base.Layers = nil
	labels := map[string]string{}
	for k, v := range base.Labels {
		if !strings.HasPrefix(k, "dsec.io/") {
			labels[k] = v
		}
	}
	for k, v := range req.GetLabels() {
		labels[k] = v
	}
	base.Labels = labels
	if req.GetSession() != "" {
		base.Session = req.GetSession()
	}
	specs := make([]*dsecv1.SandboxSpec, req.GetCount())
	for i := range specs {
		specs[i] = base
	}
	// Children count against the parent's project.
	resp := n.createMany(ctx, specs, ItemKeys(req.GetIdempotencyKey(), len(specs)), parent.project, func(i int) map[string]string {
		return map[string]string{ForkOfLabel: parent.id, ForkIndexLabel: fmt.Sprint(i)}
	})
	resp.SnapshotId = snap.Id
	n.publish(parent, events.Forked, parent.currentState(), func(ev *dsecv1.Event) {
		ev.SnapshotId = snap.Id
		for _, r := range resp.Results {
			if r.GetSandbox() != nil {
				ev.Children = append(ev.Children, r.GetSandbox().GetId())
			}
		}
	})
	return resp, nil
}

// configDigest names an image by its layers and configuration.
func configDigest(layers []string, cfg image.Config) string {
	b, _ := json.Marshal(struct {
		Layers []string     `json:"layers"`
		Config image.Config `json:"config"`
	}{layers, cfg})
	h := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(h[:])
}
