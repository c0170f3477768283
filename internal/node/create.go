package node

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/gateway"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
	"github.com/opendsec/dsec/internal/undo"
)

// The create pipeline: validate and default the spec (normalize), claim
// the idempotency key, admit, take a pooled sandbox or start one (prepare,
// in a start slot), then make it live (commit).

// Create validates, admits and starts a sandbox.
func (n *Node) Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error) {
	return n.create(ctx, req.GetSpec(), req.GetIdempotencyKey(), req.GetProject(), nil)
}

// create is Create with labels the node itself adds (reserved ones). The
// sandbox belongs to project, whose images (and the shared ones) it may
// start from.
func (n *Node) create(ctx context.Context, in *dsecv1.SandboxSpec, key, project string, extra map[string]string) (_ *dsecv1.Sandbox, err error) {
	project = tenant.OrDefault(project)
	spec := proto.Clone(in).(*dsecv1.SandboxSpec)
	if in == nil {
		spec = &dsecv1.SandboxSpec{}
	}
	defer func(start time.Time) { n.m.Observe(ctx, metrics.OpCreate, spec.Kind, start, &err) }(time.Now())
	img, err := n.normalize(project, spec)
	if err != nil {
		return nil, err
	}
	// The image's layers stay until the sandbox is reserved (then live,
	// or released): a delete of the image meanwhile (a fork's snapshot
	// released, its last child gone) must not collect what it starts from.
	unhold, err := n.images.Hold(img.Layers)
	if err != nil {
		return nil, errdefs.NotFound("image %q was deleted while a sandbox was being created from it", imageOf(spec))
	}
	defer unhold()
	if len(extra) > 0 {
		if spec.Labels == nil {
			spec.Labels = map[string]string{}
		}
		for k, v := range extra {
			spec.Labels[k] = v
		}
	}
	if len(key) > 256 {
		return nil, errdefs.Invalid("idempotency key longer than 256 bytes")
	}
	if key != "" {
		key = idemKey(project, key)
		release, existing, fenced, err := n.claimKey(ctx, key)
		if err != nil {
			return nil, err
		}
		if fenced {
			return nil, errdefs.Unavailable("node %s refused this create's idempotency key before and the cluster placed it on another node", n.cfg.Name)
		}
		if existing != "" {
			return n.Get(tenant.With(ctx, tenant.Caller{Project: project}), existing)
		}
		defer release()
	}
	gw, err := n.modelGateway(ctx, project, spec, true)
	if err != nil {
		return nil, err
	}
	if err := n.admit(project); err != nil {
		n.m.Refused("full")
		return nil, err
	}
	defer n.admitDone(project)
	var s *sandbox
	if img.Owner == tenant.Shared && len(spec.Volumes) == 0 && len(spec.Sidecars) == 0 && len(spec.SharedVolumes) == 0 && len(spec.Layers) == 0 {
		// Pools hold shared images only, uncomposed, and mount no volumes
		// and have no sidecars.
		s = n.pools.take(spec, project)
	}
	if s == nil {
		waited := time.Now()
		release, err := n.starts.acquire(ctx, project)
		if err != nil {
			return nil, err
		}
		n.m.CreatePhase(spec.Kind, metrics.PhaseWait, waited)
		s, err = n.prepare(ctx, spec, img, project)
		release()
		if err != nil {
			return nil, err
		}
	}
	s.idemKey, s.project, s.gw = key, project, gw
	if gw != nil {
		if err := n.openGateway(ctx, s); err != nil {
			n.release(ctx, s, nil)
			return nil, err
		}
	}
	committed := time.Now()
	if err := n.commit(ctx, s); err != nil {
		n.release(ctx, s, nil)
		return nil, err
	}
	n.m.CreatePhase(spec.Kind, metrics.PhaseCommit, committed)
	return n.view(s), nil
}

// idemKey is a project's idempotency key in the node's store: keys of
// different projects never meet.
func idemKey(project, key string) string {
	if project == tenant.DefaultProject {
		return key // as stores before projects had their own keys
	}
	return project + "\x00" + key
}

// claimKey makes one create per idempotency key proceed; a concurrent or
// later create with the key gets the first one's sandbox (existing). A
// key fenced on this node (Fence) is neither. The store is read while the
// key is held: a create that held it before has written its record.
func (n *Node) claimKey(ctx context.Context, key string) (release func(), existing string, fenced bool, err error) {
	for {
		release, busy := n.sandboxes.claim(key)
		if release == nil {
			select {
			case <-busy:
				continue
			case <-ctx.Done():
				return nil, "", false, errdefs.Classify(ctx.Err())
			}
		}
		if id, fenced := n.store.idemOrFence(key); id != "" || fenced {
			release()
			return nil, id, fenced, nil
		}
		return release, "", false, nil
	}
}

// Fence makes sure no create with the idempotency key completes on this
// node from now on, unless one did: then it returns that sandbox. The
// cluster fences a key on a node that refused its create before it
// places the create elsewhere, so a create of the key still on its way
// to this node (sent by a replica that died meanwhile) cannot make a
// second sandbox for it here.
func (n *Node) Fence(ctx context.Context, project, key string) (*dsecv1.Sandbox, error) {
	project = tenant.OrDefault(project)
	release, existing, fenced, err := n.claimKey(ctx, idemKey(project, key))
	if err != nil || fenced {
		return nil, err
	}
	if existing != "" {
		return n.Get(tenant.With(ctx, tenant.Caller{Project: project}), existing)
	}
	defer release()
	if err := n.store.fence(idemKey(project, key), time.Now()); err != nil {
		return nil, errdefs.Internal(err, "fence idempotency key")
	}
	return nil, nil
}

// admit is the node's final admission: it refuses creates beyond its
// sandbox limit with a retryable exhausted error. An admitted create ends
// with admitDone.
func (n *Node) admit(project string) error {
	if int(n.creating.Add(1))+n.sandboxes.count() > n.cfg.MaxSandboxes {
		n.creating.Add(-1)
		return errdefs.Exhausted(5*time.Second, "node %s is full (%d sandboxes)", n.cfg.Name, n.cfg.MaxSandboxes)
	}
	n.admitted.Add(1)
	n.sandboxes.starts(project, 1)
	n.loadChanged()
	return nil
}

// admitDone ends an admitted create, started or not.
func (n *Node) admitDone(project string) {
	n.sandboxes.starts(project, -1)
	n.creating.Add(-1)
	n.loadChanged()
}

// prepare starts a sandbox's resources (directory, network, instance) for
// spec, from img (what normalize resolved), and reserves it, without
// registering it as live. On error nothing is left: the undo stack holds
// one entry, the sandbox's release, which frees whatever it holds so far.
func (n *Node) prepare(ctx context.Context, spec *dsecv1.SandboxSpec, img *image.Image, project string) (_ *sandbox, err error) {
	var u undo.Stack
	defer u.RunUnless(&err)
	s := &sandbox{
		id: n.newID(), spec: spec, created: time.Now().UTC(), image: img.Key(), layers: img.Layers, lazy: n.images.LoadsOnDemand(img.Layers),
		state: stateRunning, expires: time.Now().Add(time.Duration(spec.TtlS) * time.Second),
	}
	s.touch()
	dir := filepath.Join(n.cfg.DataDir, "sandboxes", s.id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, errdefs.Internal(err, "create sandbox directory")
	}
	s.dir = dir
	u.Push(func() { n.release(ctx, s, nil) })
	opts, err := n.netOptions(project, spec)
	if err != nil {
		return nil, err
	}
	started := time.Now()
	if s.net, err = n.net.Setup(ctx, s.id, opts); err != nil {
		return nil, err
	}
	n.m.CreatePhase(spec.Kind, metrics.PhaseNetwork, started)
	// The sidecars' images count as the sandbox's (held until then).
	var from *image.Image
	if spec.Snapshot != "" {
		from = img
	}
	scLayers, scImages, unhold, err := n.sidecarLayers(project, spec, from)
	if err != nil {
		return nil, err
	}
	defer unhold()
	s.layers = append(s.layers[:len(s.layers):len(s.layers)], scLayers...)
	// Reserved first so image GC keeps the layers while the sandbox starts.
	n.sandboxes.reserve(s)
	if err := n.makeShared(s); err != nil {
		return nil, err
	}
	if s.volumes, err = n.holdVolumes(s, project); err != nil {
		return nil, err
	}
	started = time.Now()
	steps := substrate.WithSteps(ctx, func(step string, took time.Duration) { n.m.StartStep(spec.Kind, step, took) })
	inst, err := n.drivers[substrate.Kind(spec.Kind)].Create(steps, n.driverSpec(s, img))
	if err != nil {
		n.log.Warn("sandbox start failed", slog.String("sandbox_id", s.id), slog.Any("error", err))
		return nil, err
	}
	n.m.CreatePhase(spec.Kind, metrics.PhaseInstance, started)
	s.inst = inst
	if len(spec.Sidecars) > 0 {
		g, err := n.startSidecars(ctx, s, inst, scImages)
		if err != nil {
			n.log.Warn("sandbox start failed", slog.String("sandbox_id", s.id), slog.Any("error", err))
			return nil, err // the release destroys the main container
		}
		s.inst = g
	}
	return s, nil
}

// commit makes a prepared sandbox live: persisted, listed and watched.
func (n *Node) commit(ctx context.Context, s *sandbox) error {
	s.mu.Lock()
	s.runStart = time.Now().UTC()
	s.mu.Unlock()
	s.rec = s.record()
	if err := n.store.put(s.rec); err != nil {
		return errdefs.Internal(err, "persist sandbox")
	}
	n.sandboxes.commit(s)
	n.publish(s, events.Created, stateRunning, nil)
	n.watch(s)
	n.log.Debug("sandbox created", slog.String("sandbox_id", s.id), slog.String("image", s.image))
	return nil
}

// imageOf is the image a spec starts from: its snapshot, else its image.
func imageOf(spec *dsecv1.SandboxSpec) string {
	if spec.Snapshot != "" {
		return spec.Snapshot
	}
	return spec.Image
}

func (n *Node) driverSpec(s *sandbox, img *image.Image) *substrate.Spec {
	env := append([]string(nil), img.Config.Env...)
	if s.spec.GetModelGateway().GetEnabled() {
		env = append(env, gateway.Env...)
	}
	keys := make([]string, 0, len(s.spec.Env))
	for k := range s.spec.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+s.spec.Env[k])
	}
	ds := &substrate.Spec{
		ID: s.id, Dir: s.dir, Image: substrate.ImageOf(n.images, img), Env: env,
		User: s.spec.User, Workdir: s.spec.Workdir, Hostname: "sandbox",
		CPU: s.spec.Resources.GetCpu(), MemoryMB: s.spec.Resources.GetMemoryMb(),
		DiskMB: s.spec.Resources.GetDiskMb(), Pids: s.spec.Resources.GetPids(),
		Deadline: n.deadline(s), Runtime: s.spec.Runtime, Volumes: s.volumes, Hosts: hostNames(s.spec),
		PrivilegeEscalation: img.Config.PrivilegeEscalation,
	}
	if s.net != nil {
		ds.Network = n.substrateNetwork(s.net)
	}
	if img.Snapshot != nil && img.Snapshot.Machine {
		ds.Restore = n.snapshotDir(img.Name)
	}
	return ds
}
