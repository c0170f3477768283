package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
	"google.golang.org/protobuf/encoding/protojson"
)

// Sidecars (SandboxSpec.sidecars).
//
// A sandbox with sidecars is a group of containers: its main container,
// made as any container sandbox is, and one further container per sidecar,
// each made by the same driver from its own image, with its own user
// namespace, root file system, disk, cgroup and agent, and joined to the
// main container's network namespace (a named one even in mode none:
// network.Options.Shared). The agent of a sidecar runs its command as a
// process tagged "service" (its output is the sidecar's log, replayed by
// ConnectProcess with that tag), and its health check through the same
// agent, so exec, files and processes reach a sidecar exactly as they
// reach a main container. The node holds the group as one instance
// (group): calls that act on the sandbox (pause, resume, delete, the
// agent's deadline) act on every container; calls that act in one name it
// (ctrOf).

const (
	maxSidecars = 8
	// mainName is the main container's name in calls.
	mainName = "main"
	// serviceTag tags a sidecar's command among its agent's processes.
	serviceTag = "service"
	// Health check defaults: between checks until the first success,
	// between checks after it, per check, failures in a row that make a
	// sidecar unhealthy.
	defaultStartInterval = 500 * time.Millisecond
	defaultInterval      = 30 * time.Second
	defaultCheckTimeout  = 30 * time.Second
	defaultRetries       = 3
	// tailBytes of a sidecar's output and of a failed check are kept for
	// errors and status.
	tailBytes = 2048
	// settleTime is how long a sidecar without a health check must run
	// before the create counts it ready: a service that fails at once
	// (a bad configuration, a missing file) fails the create with its
	// output instead of a sandbox whose sidecar is already dead.
	settleTime = 250 * time.Millisecond
)

var sidecarNameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// Sidecar states (SidecarStatus.state).
const (
	scStarting  = "starting"
	scRunning   = "running"
	scHealthy   = "healthy"
	scUnhealthy = "unhealthy"
	scExited    = "exited"
)

// Dependency conditions (SidecarDependency.condition).
const (
	condStarted   = "started"
	condHealthy   = "healthy"
	condCompleted = "completed"
)

// normalizeSidecars validates spec.Sidecars and fills in their defaults
// (command, user and working directory from their images, resources and
// health check timing from the node's defaults). spec is otherwise
// normalized.
func (n *Node) normalizeSidecars(project string, spec *dsecv1.SandboxSpec, from *image.Image) error {
	if snap := from.GetSnapshot(); snap != nil && len(snap.Sidecars) > 0 {
		// A sandbox from a snapshot of a sandbox with sidecars gets them
		// back, each from its own captured layers (its image left empty).
		if len(spec.Sidecars) > 0 {
			return errdefs.Invalid("snapshot %s has sidecars of its own: a sandbox started from it gets them (give none)", snap.ID)
		}
		for _, ss := range snap.Sidecars {
			sc := &dsecv1.Sidecar{}
			if err := protojson.Unmarshal(ss.Spec, sc); err != nil {
				return errdefs.Internal(err, "read snapshot %s's sidecar %q", snap.ID, ss.Name)
			}
			sc.Image = ""
			spec.Sidecars = append(spec.Sidecars, sc)
		}
		if len(spec.Aliases) == 0 {
			spec.Aliases = append([]string(nil), snap.Aliases...)
		}
	}
	if len(spec.Sidecars) == 0 {
		if len(spec.Aliases) > 0 {
			return errdefs.Invalid("aliases name the main container for its sidecars: a sandbox without sidecars has none")
		}
		return nil
	}
	if substrate.Kind(spec.Kind) != substrate.KindContainer || spec.Runtime != "" {
		return errdefs.Unimplemented("sidecars need kind container with its default runtime (containers of runtime gvisor cannot share a network namespace)")
	}
	if len(spec.Sidecars) > maxSidecars {
		return errdefs.Invalid("at most %d sidecars", maxSidecars)
	}
	names := map[string]bool{mainName: true}
	byName := map[string]*dsecv1.Sidecar{}
	for _, a := range spec.Aliases {
		if !sidecarNameRe.MatchString(a) {
			return errdefs.Invalid("alias %q is invalid (lower-case letters, digits, '_', '.', '-'; at most 63)", truncate(a, 64))
		}
		if names[a] || a == mainName {
			return errdefs.Invalid("alias %q is used twice", a)
		}
		names[a] = true
	}
	for _, sc := range spec.Sidecars {
		if sc == nil {
			return errdefs.Invalid("a sidecar is empty")
		}
		if !sidecarNameRe.MatchString(sc.Name) || sc.Name == mainName {
			return errdefs.Invalid("sidecar name %q is invalid (lower-case letters, digits, '_', '.', '-'; at most 63; not %q)", truncate(sc.Name, 64), mainName)
		}
		for _, name := range append([]string{sc.Name}, sc.Aliases...) {
			if !sidecarNameRe.MatchString(name) {
				return errdefs.Invalid("sidecar %q: alias %q is invalid", sc.Name, truncate(name, 64))
			}
			if names[name] {
				return errdefs.Invalid("sidecar name or alias %q is used twice", name)
			}
			names[name] = true
		}
		byName[sc.Name] = sc
	}
	for _, sc := range spec.Sidecars {
		if err := n.normalizeSidecar(project, sc, byName, from); err != nil {
			return err
		}
		if err := sidecarMounts(spec, sc); err != nil {
			return err
		}
	}
	// Dependencies form no cycle: a depth-first walk meets no sidecar it
	// is still walking below.
	const walking, walked = 1, 2
	mark := map[string]int{}
	var visit func(name string, trail []string) error
	visit = func(name string, trail []string) error {
		switch mark[name] {
		case walking:
			return errdefs.Invalid("sidecar dependencies form a cycle: %s", strings.Join(append(trail, name), " → "))
		case walked:
			return nil
		}
		mark[name] = walking
		for _, d := range byName[name].DependsOn {
			if err := visit(d.Name, append(trail, name)); err != nil {
				return err
			}
		}
		mark[name] = walked
		return nil
	}
	for _, sc := range spec.Sidecars {
		if err := visit(sc.Name, nil); err != nil {
			return err
		}
	}
	return nil
}

func (n *Node) normalizeSidecar(project string, sc *dsecv1.Sidecar, byName map[string]*dsecv1.Sidecar, from *image.Image) error {
	fail := func(format string, a ...any) error {
		return errdefs.Invalid("sidecar %q: %s", sc.Name, fmt.Sprintf(format, a...))
	}
	img, err := n.sidecarImage(project, sc, from)
	if err != nil {
		return err
	}
	// Docker's rule: an entrypoint of the sidecar's own replaces the
	// image's entrypoint and command; a command of its own, the image's
	// command. Resolved here, so the spec says what runs.
	if len(sc.Entrypoint) == 0 {
		sc.Entrypoint = append([]string(nil), img.Config.Entrypoint...)
		if len(sc.Command) == 0 {
			sc.Command = append([]string(nil), img.Config.Cmd...)
		}
	}
	if len(sc.Entrypoint)+len(sc.Command) == 0 {
		return fail("image %q has no entrypoint or command: give the sidecar a command", sc.Image)
	}
	if len(sc.Entrypoint)+len(sc.Command) > maxArgs {
		return fail("at most %d arguments in entrypoint and command", maxArgs)
	}
	if err := validEnv(sc.Env); err != nil {
		return fail("%v", errdefs.Classify(err).Msg)
	}
	if len(sc.User) > 256 || strings.ContainsAny(sc.User, "\x00\n") {
		return fail("user is malformed")
	}
	if sc.Workdir != "" && !path.IsAbs(sc.Workdir) {
		return fail("workdir must be an absolute path")
	}
	if sc.Workdir == "" {
		sc.Workdir = img.Config.Workdir
	}
	if sc.User == "" {
		sc.User = img.Config.User
	}
	if sc.Resources == nil {
		sc.Resources = &dsecv1.Resources{}
	}
	r := sc.Resources
	if err := n.defaultResources(r); err != nil {
		return fail("%s", errdefs.Classify(err).Msg)
	}
	switch {
	case r.Gpu != 0:
		return fail("resources.gpu: sidecars have no GPUs")
	case r.BandwidthMbps != 0:
		return fail("resources.bandwidth_mbps: a sidecar shares the sandbox's network, limited by the sandbox's resources.bandwidth_mbps")
	}
	if hc := sc.Healthcheck; hc != nil {
		if len(hc.Command) == 0 {
			return fail("healthcheck.command is required")
		}
		if hc.StartIntervalMs == 0 {
			hc.StartIntervalMs = defaultStartInterval.Milliseconds()
		}
		if hc.IntervalMs == 0 {
			hc.IntervalMs = defaultInterval.Milliseconds()
		}
		if hc.TimeoutMs == 0 {
			hc.TimeoutMs = defaultCheckTimeout.Milliseconds()
		}
		if hc.Retries == 0 {
			hc.Retries = defaultRetries
		}
		hour := time.Hour.Milliseconds()
		for _, f := range []struct {
			name     string
			v, lo, o int64
		}{
			{"interval_ms", hc.IntervalMs, 100, hour}, {"start_interval_ms", hc.StartIntervalMs, 100, hour},
			{"timeout_ms", hc.TimeoutMs, 100, hour}, {"start_period_ms", hc.StartPeriodMs, 0, hour},
			{"retries", int64(hc.Retries), 1, 100},
		} {
			if f.v < f.lo || f.v > f.o {
				return fail("healthcheck.%s %d out of range [%d, %d]", f.name, f.v, f.lo, f.o)
			}
		}
	}
	seen := map[string]bool{}
	for _, d := range sc.DependsOn {
		dep, ok := byName[d.GetName()]
		switch {
		case d.GetName() == sc.Name:
			return fail("it depends on itself")
		case !ok:
			return fail("depends on %q, which is no sidecar of the sandbox", truncate(d.GetName(), 64))
		case seen[d.Name]:
			return fail("depends on %q twice", d.Name)
		}
		seen[d.Name] = true
		switch d.Condition {
		case "":
			d.Condition = condStarted
		case condStarted, condCompleted:
		case condHealthy:
			if dep.Healthcheck == nil {
				return fail("depends on %q being healthy, which has no healthcheck", d.Name)
			}
		default:
			return fail("depends_on %q: condition %q (use started, healthy or completed)", d.Name, truncate(d.Condition, 64))
		}
	}
	return nil
}

// sidecarMounts checks sc's volume mounts: the sandbox's shared volumes,
// at paths as a sandbox's volumes' are.
func sidecarMounts(spec *dsecv1.SandboxSpec, sc *dsecv1.Sidecar) error {
	if len(sc.Volumes) > maxSharedVolumes {
		return errdefs.Invalid("sidecar %q: at most %d volumes", sc.Name, maxSharedVolumes)
	}
	var paths []string
	for _, m := range sc.Volumes {
		if sharedVolume(spec, m.GetName()) == nil {
			return errdefs.Invalid("sidecar %q: volume %q is none of the sandbox's shared volumes (sidecars mount those)", sc.Name, truncate(m.GetName(), 64))
		}
		if err := mountPath(m.GetPath()); err != nil {
			return errdefs.Invalid("sidecar %q: volume %q: %v", sc.Name, m.GetName(), err)
		}
		for _, other := range paths {
			if other == m.Path || strings.HasPrefix(m.Path, other+"/") || strings.HasPrefix(other, m.Path+"/") {
				return errdefs.Invalid("sidecar %q: volume paths %s and %s overlap", sc.Name, m.Path, other)
			}
		}
		paths = append(paths, m.Path)
	}
	return nil
}

// memberID is the instance ID of a sandbox's i-th sidecar (from 0).
func memberID(id string, i int) string { return fmt.Sprintf("%s_%d", id, i+1) }

// hostNames are the names every container of a sandbox resolves to
// 127.0.0.1: "main" and the main container's aliases, its sidecars' names
// and aliases.
func hostNames(spec *dsecv1.SandboxSpec) []string {
	if len(spec.Sidecars) == 0 {
		return nil
	}
	out := append([]string{mainName}, spec.Aliases...)
	for _, sc := range spec.Sidecars {
		out = append(out, sc.Name)
		out = append(out, sc.Aliases...)
	}
	return out
}

// sidecarImage is the image sidecar sc starts from: its image, or (its
// image empty) its own layers in the snapshot from the sandbox starts
// from.
func (n *Node) sidecarImage(project string, sc *dsecv1.Sidecar, from *image.Image) (*image.Image, error) {
	if sc.Image == "" {
		for _, ss := range from.GetSnapshot().GetSidecars() {
			if ss.Name == sc.Name {
				return &image.Image{Name: from.Name + "/" + ss.Name, Owner: from.Owner, Layers: ss.Layers, Config: ss.Config}, nil
			}
		}
		return nil, errdefs.Invalid("sidecar %q: image is required", sc.Name)
	}
	img, err := n.images.Lookup(project, sc.Image)
	if err != nil {
		return nil, err
	}
	switch {
	case img.Snapshot != nil:
		return nil, errdefs.Invalid("sidecar %q: %q is a snapshot; sidecars start from images (a sandbox started from a snapshot of one with sidecars gets its sidecars back)", sc.Name, sc.Image)
	case img.VM != nil:
		return nil, errdefs.Invalid("sidecar %q: %q is a VM image; sidecars are containers", sc.Name, sc.Image)
	}
	return img, nil
}

// sidecarLayers are the layers of spec's sidecars' images, held until
// release is called (image GC must not take them before the sandbox is
// reserved, which keeps them as its own). from is the snapshot the
// sandbox starts from, if any.
func (n *Node) sidecarLayers(project string, spec *dsecv1.SandboxSpec, from *image.Image) (layers []string, imgs []*image.Image, release func(), err error) {
	var holds []func()
	release = func() {
		for _, h := range holds {
			h()
		}
	}
	for _, sc := range spec.Sidecars {
		img, err := n.sidecarImage(project, sc, from)
		if err != nil {
			release()
			return nil, nil, nil, err
		}
		unhold, err := n.images.Hold(img.Layers)
		if err != nil {
			release()
			return nil, nil, nil, errdefs.NotFound("image %q of sidecar %q was deleted while a sandbox was being created from it", sc.Image, sc.Name)
		}
		holds = append(holds, unhold)
		imgs = append(imgs, img)
		layers = append(layers, img.Layers...)
	}
	return layers, imgs, release, nil
}

// group is the instance of a sandbox with sidecars: its main container's
// instance, which the sandbox's life follows (Done, Check, Stats, the
// agent calls address it), and its sidecars'.
type group struct {
	main    substrate.Instance
	members []*member
	log     *slog.Logger
}

// member is one sidecar of a running sandbox.
type member struct {
	name string
	id   string
	spec *dsecv1.Sidecar
	inst substrate.Instance
	// layers and config are the sidecar's image's (a snapshot keeps them
	// with the sidecar's own layer).
	layers []string
	config image.Config
	// paused is set while the sandbox is paused: health checks wait (a
	// frozen agent answers none).
	paused atomic.Bool
	// stop ends the member's watchers (at Destroy).
	ctx  context.Context
	stop context.CancelFunc

	mu       sync.Mutex
	state    string
	started  time.Time // when its service started
	exitCode int32
	healthy  bool   // its health check has passed at least once
	failures int    // health check failures in a row
	health   string // the last failed check's output
	tail     []byte // the service's last output
	changed  chan struct{}
}

func newMember(name, id string, spec *dsecv1.Sidecar) *member {
	ctx, stop := context.WithCancel(context.Background())
	return &member{name: name, id: id, spec: spec, ctx: ctx, stop: stop, state: scStarting, changed: make(chan struct{})}
}

// set changes the member's status under its lock and wakes its waiters.
func (m *member) set(f func()) {
	m.mu.Lock()
	f()
	close(m.changed)
	m.changed = make(chan struct{})
	m.mu.Unlock()
}

// status is the member as GetSandbox shows it.
func (m *member) status() *dsecv1.SidecarStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	return &dsecv1.SidecarStatus{Name: m.name, State: m.state, ExitCode: m.exitCode, HealthOutput: m.health}
}

// reached reports whether the member has reached cond (done) or never
// will (err).
func (m *member) reached(cond string) (done bool, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	exited := m.state == scExited
	switch cond {
	case condStarted:
		if exited && m.exitCode != 0 {
			return false, fmt.Errorf("sidecar %q exited with status %d%s", m.name, m.exitCode, tailNote(m.tail))
		}
		return m.state != scStarting, nil
	case condHealthy:
		switch {
		case m.healthy:
			return true, nil
		case exited:
			return false, fmt.Errorf("sidecar %q exited with status %d before its health check passed%s", m.name, m.exitCode, tailNote(m.tail))
		case m.state == scUnhealthy:
			return false, fmt.Errorf("sidecar %q is unhealthy: its health check failed %d times in a row%s", m.name, m.failures, tailNote([]byte(m.health)))
		}
		return false, nil
	case condCompleted:
		if !exited {
			return false, nil
		}
		if m.exitCode != 0 {
			return false, fmt.Errorf("sidecar %q exited with status %d%s", m.name, m.exitCode, tailNote(m.tail))
		}
		return true, nil
	}
	return false, fmt.Errorf("unknown condition %q", cond)
}

// ready reports whether the member is ready for the create to return:
// healthy if it has a health check, else running for settleTime; or
// exited 0.
func (m *member) ready() (bool, error) {
	m.mu.Lock()
	exited, code, started := m.state == scExited, m.exitCode, m.started
	m.mu.Unlock()
	if exited && code == 0 {
		return true, nil
	}
	if m.spec.Healthcheck != nil {
		return m.reached(condHealthy)
	}
	ok, err := m.reached(condStarted)
	return ok && time.Since(started) >= settleTime, err
}

// await waits until cond holds for m (or cannot).
func (m *member) await(ctx context.Context, cond func() (bool, error)) error {
	for {
		m.mu.Lock()
		changed := m.changed
		m.mu.Unlock()
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		// Conditions change with the member's status, and with time
		// (settleTime): both wake the wait.
		select {
		case <-changed:
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
			return errdefs.Classify(ctx.Err())
		}
	}
}

func tailNote(b []byte) string {
	s := strings.TrimSpace(strings.ToValidUTF8(string(b), "?"))
	if s == "" {
		return ""
	}
	return "; its last output: " + s
}

// keepTail appends b to a tail of at most tailBytes.
func keepTail(tail, b []byte) []byte {
	tail = append(tail, b...)
	if len(tail) > tailBytes {
		tail = append([]byte(nil), tail[len(tail)-tailBytes:]...)
	}
	return tail
}

// startSidecars starts s's sidecars beside its main container, each once
// its dependencies hold, and returns the group once every one is ready.
// On error every sidecar started is destroyed (the caller destroys main).
func (n *Node) startSidecars(ctx context.Context, s *sandbox, main substrate.Instance, imgs []*image.Image) (_ *group, err error) {
	g := &group{main: main, log: n.log}
	for i, sc := range s.spec.Sidecars {
		m := newMember(sc.Name, memberID(s.id, i), sc)
		m.layers, m.config = imgs[i].Layers, imgs[i].Config
		g.members = append(g.members, m)
	}
	defer func() {
		if err != nil {
			g.destroyMembers(context.WithoutCancel(ctx))
		}
	}()
	byName := map[string]*member{}
	for _, m := range g.members {
		byName[m.name] = m
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(g.members))
	for i, m := range g.members {
		go func() {
			err := n.startMember(ctx, s, m, imgs[i], byName)
			if err == nil {
				if err = m.await(ctx, m.ready); err != nil {
					err = sidecarError(m.name, err)
				}
			}
			if err != nil {
				cancel() // the others stop waiting and starting
			}
			errs <- err
		}()
	}
	// The error reported is the root cause: a sidecar's own failure before
	// one that waited for it, and either before the others' cancellation.
	var first error
	rank := func(err error) int {
		var d depError
		switch {
		case errors.As(err, &d):
			return 1
		case errdefs.Is(err, errdefs.KindCanceled):
			return 0
		}
		return 2
	}
	for range g.members {
		if err := <-errs; err != nil && (first == nil || rank(err) > rank(first)) {
			first = err
		}
	}
	var d depError
	if errors.As(first, &d) {
		first = d.error
	}
	if first != nil {
		return nil, first
	}
	return g, nil
}

// sidecarError is why sidecar name could not start: err's class where the
// platform or the caller's context said (a driver's error, a deadline),
// else invalid (the sidecar's own doing: it exited, or its health check
// failed).
func sidecarError(name string, err error) error {
	prefix := fmt.Sprintf("sidecar %q", name)
	var e *errdefs.Error
	if !errors.As(err, &e) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		if strings.HasPrefix(err.Error(), prefix) {
			return errdefs.Invalid("%v", err)
		}
		return errdefs.Invalid("%s: %v", prefix, err)
	}
	c := errdefs.Classify(err)
	out := errdefs.New(c.Kind, "%s: %s", prefix, c.Msg).WithCause(err)
	out.Infra, out.RetryAfter = c.Infra, c.RetryAfter
	return out
}

// depError is a sidecar that could not start because another did not
// reach its condition: the other's error is the one to report.
type depError struct{ error }

func (e depError) Unwrap() error { return e.error }

// startMember waits for m's dependencies, makes its container and starts
// its service and health check.
func (n *Node) startMember(ctx context.Context, s *sandbox, m *member, img *image.Image, byName map[string]*member) error {
	for _, d := range m.spec.DependsOn {
		dep := byName[d.Name]
		if err := dep.await(ctx, func() (bool, error) { return dep.reached(d.Condition) }); err != nil {
			if errdefs.Is(err, errdefs.KindCanceled) {
				return err
			}
			return depError{sidecarError(m.name, fmt.Errorf("it cannot start: %w", err))}
		}
	}
	inst, err := n.drivers[substrate.KindContainer].Create(ctx, n.memberSpec(s, m, img))
	if err != nil {
		return sidecarError(m.name, err)
	}
	m.inst = inst
	if err := n.startService(ctx, m); err != nil {
		return sidecarError(m.name, err)
	}
	if m.spec.Healthcheck != nil {
		go n.checkHealth(m)
	}
	return nil
}

// memberSpec is the driver spec of a sidecar of s.
func (n *Node) memberSpec(s *sandbox, m *member, img *image.Image) *substrate.Spec {
	env := append([]string(nil), img.Config.Env...)
	keys := make([]string, 0, len(m.spec.Env))
	for k := range m.spec.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+m.spec.Env[k])
	}
	r := m.spec.Resources
	ds := &substrate.Spec{
		ID: m.id, Dir: memberDir(s.dir, m.id), Image: substrate.ImageOf(n.images, img), Env: env,
		User: m.spec.User, Workdir: m.spec.Workdir, Hostname: m.name, Hosts: hostNames(s.spec),
		CPU: r.GetCpu(), MemoryMB: r.GetMemoryMb(), DiskMB: r.GetDiskMb(), Pids: r.GetPids(),
		Deadline: n.deadline(s), PrivilegeEscalation: img.Config.PrivilegeEscalation,
		Volumes: sharedMounts(s, m.spec.Volumes),
	}
	if s.net != nil {
		ds.Network = n.substrateNetwork(s.net)
	}
	return ds
}

// memberDir is a sidecar's directory, inside its sandbox's.
func memberDir(dir, id string) string { return filepath.Join(dir, "sidecars", id) }

// startService starts m's command as its agent's service process and
// watches it.
func (n *Node) startService(ctx context.Context, m *member) error {
	pg, ok := m.inst.Guest().(substrate.ProcessGuest)
	if !ok {
		return errdefs.Unimplemented("the container's agent cannot start processes")
	}
	argv := append(append([]string(nil), m.spec.Entrypoint...), m.spec.Command...)
	p, err := pg.Start(m.ctx, &guestv1.Exec{Argv: argv, Cwd: m.spec.Workdir, User: m.spec.User, Tag: serviceTag})
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		p.Close()
		return errdefs.Classify(ctx.Err())
	}
	m.set(func() { m.state, m.started = scRunning, time.Now() })
	go n.watchService(m, p)
	return nil
}

// watchService follows m's service until it exits (or the member stops),
// keeping its output's tail.
func (n *Node) watchService(m *member, p *guest.Process) {
	defer p.Close()
	for {
		msg, err := p.Recv()
		if err != nil {
			if m.ctx.Err() != nil {
				return // destroyed
			}
			// The agent went away: the sidecar's container ended (its
			// memory limit, say).
			m.set(func() { m.state, m.exitCode = scExited, -1 })
			return
		}
		if o := msg.GetOutput(); o != nil {
			m.mu.Lock()
			m.tail = keepTail(m.tail, o.GetData())
			m.mu.Unlock()
		}
		if x := msg.GetExit(); x != nil {
			code := x.GetExitCode()
			if x.GetSignal() != 0 || x.GetError() != "" {
				code = -1
			}
			m.set(func() {
				m.state, m.exitCode = scExited, code
				if e := x.GetError(); e != "" {
					m.tail = keepTail(m.tail, []byte(e))
				}
			})
			return
		}
	}
}

// checkHealth runs m's health check for its life: every start interval
// until it first passes, every interval after. Failures count once the
// start period is over; retries of them in a row make m unhealthy (and a
// later pass healthy again).
func (n *Node) checkHealth(m *member) {
	hc := m.spec.Healthcheck
	startPeriod := time.Now().Add(time.Duration(hc.StartPeriodMs) * time.Millisecond)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-timer.C:
		}
		m.mu.Lock()
		exited, everHealthy := m.state == scExited, m.healthy
		m.mu.Unlock()
		if exited {
			return
		}
		if m.paused.Load() {
			timer.Reset(time.Duration(hc.StartIntervalMs) * time.Millisecond)
			continue
		}
		ctx, cancel := context.WithTimeout(m.ctx, time.Duration(hc.TimeoutMs)*time.Millisecond)
		exit, err := m.inst.Guest().Run(ctx, &guestv1.Exec{
			Argv: hc.Command, Cwd: m.spec.Workdir, User: m.spec.User, Collect: true,
			TimeoutMs: hc.TimeoutMs, MaxOutput: tailBytes,
		})
		cancel()
		if m.ctx.Err() != nil {
			return
		}
		ok := err == nil && exit.GetExitCode() == 0 && exit.GetSignal() == 0 && !exit.GetTimedOut() && exit.GetError() == ""
		var out string
		switch {
		case err != nil:
			out = errdefs.Classify(err).Msg
		case exit.GetTimedOut():
			out = fmt.Sprintf("timed out after %d ms", hc.TimeoutMs)
		case exit.GetError() != "":
			out = exit.GetError()
		default:
			out = strings.TrimSpace(string(exit.GetStdout()) + string(exit.GetStderr()))
		}
		m.set(func() {
			if m.state == scExited || (!ok && m.paused.Load()) {
				return // a check cut short by a pause says nothing
			}
			if ok {
				m.healthy, m.failures, m.state = true, 0, scHealthy
				return
			}
			m.health = truncate(out, tailBytes)
			if time.Now().Before(startPeriod) && !m.healthy {
				return
			}
			m.failures++
			if m.failures >= int(hc.Retries) {
				m.state = scUnhealthy
			}
		})
		next := time.Duration(hc.StartIntervalMs) * time.Millisecond
		if everHealthy || ok {
			next = time.Duration(hc.IntervalMs) * time.Millisecond
		}
		timer.Reset(next)
	}
}

// member returns g's sidecar name, or nil.
func (g *group) member(name string) *member {
	for _, m := range g.members {
		if m.name == name {
			return m
		}
	}
	return nil
}

// Snapshot captures the main container's writable layer (the node
// captures the sidecars' with snapshotSidecars).
func (g *group) Snapshot(ctx context.Context, w io.Writer) error {
	sn, ok := g.main.(substrate.Snapshotter)
	if !ok {
		return errdefs.Unimplemented("the sandbox cannot snapshot")
	}
	return sn.Snapshot(ctx, w)
}

// snapshotSidecars captures each sidecar's writable layer as a layer of
// the store, held until release is called (once a snapshot record names
// them).
func (n *Node) snapshotSidecars(ctx context.Context, s *sandbox, g *group) (out []image.SnapshotSidecar, release func(), err error) {
	var releases []func()
	release = func() {
		for _, r := range releases {
			r()
		}
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	for _, m := range g.members {
		sn, ok := m.inst.(substrate.Snapshotter)
		if !ok || m.inst.Check(ctx) != nil {
			return nil, nil, errdefs.Conflict("sidecar %q of sandbox %s has ended: it cannot be snapshotted", m.name, s.id)
		}
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(sn.Snapshot(ctx, pw)) }()
		diff, _, rel, err := n.images.AddLayer(pr)
		pr.Close()
		if err != nil {
			return nil, nil, sidecarError(m.name, err)
		}
		releases = append(releases, rel)
		spec, err := protojson.Marshal(m.spec)
		if err != nil {
			return nil, nil, errdefs.Internal(err, "record sidecar %q", m.name)
		}
		out = append(out, image.SnapshotSidecar{
			Name: m.name, Spec: spec, Layers: append(append([]string(nil), m.layers...), diff), Config: m.config,
		})
	}
	return out, release, nil
}

// mainLayers are the layers of s's main container's image: s.layers
// holds them followed by each sidecar's (prepare).
func mainLayers(s *sandbox) []string {
	n := len(s.layers)
	if g, ok := s.inst.(*group); ok {
		for _, m := range g.members {
			n -= len(m.layers)
		}
	}
	return append([]string(nil), s.layers[:max(n, 0)]...)
}

func (g *group) Guest() substrate.Guest                             { return g.main.Guest() }
func (g *group) Done() <-chan struct{}                              { return g.main.Done() }
func (g *group) Check(ctx context.Context) error                    { return g.main.Check(ctx) }
func (g *group) Stats(ctx context.Context) (substrate.Stats, error) { return g.main.Stats(ctx) }

// groupState is a group's persisted state (Instance.State).
type groupState struct {
	Main    []byte        `json:"main"`
	Members []memberState `json:"members"`
}

type memberState struct {
	Name   string       `json:"name"`
	ID     string       `json:"id"`
	State  []byte       `json:"state,omitempty"`
	Layers []string     `json:"layers,omitempty"`
	Config image.Config `json:"config"`
}

func (g *group) State() []byte {
	st := groupState{Main: g.main.State()}
	for _, m := range g.members {
		ms := memberState{Name: m.name, ID: m.id, Layers: m.layers, Config: m.config}
		if m.inst != nil {
			ms.State = m.inst.State()
		}
		st.Members = append(st.Members, ms)
	}
	b, _ := json.Marshal(st)
	return b
}

// Destroy ends the sidecars, then the main container (whose network
// namespace they share).
func (g *group) Destroy(ctx context.Context) error {
	if err := g.destroyMembers(ctx); err != nil {
		return err
	}
	return g.main.Destroy(ctx)
}

func (g *group) destroyMembers(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make([]error, len(g.members))
	for i, m := range g.members {
		m.stop()
		if m.inst == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := m.inst.Destroy(ctx); err != nil {
				errs[i] = fmt.Errorf("sidecar %q: %w", m.name, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Pause freezes every container: the main one last, so nothing the
// sidecars serve it changes under a frozen caller.
func (g *group) Pause(ctx context.Context) error {
	p, ok := g.main.(substrate.Pauser)
	if !ok {
		return errdefs.Unimplemented("the sandbox cannot pause")
	}
	for _, m := range g.members {
		m.paused.Store(true)
		if mp, ok := m.inst.(substrate.Pauser); ok && m.inst != nil {
			if err := mp.Pause(ctx); err != nil {
				g.resumeMembers(context.WithoutCancel(ctx))
				return fmt.Errorf("pause sidecar %q: %w", m.name, err)
			}
		}
	}
	if err := p.Pause(ctx); err != nil {
		g.resumeMembers(context.WithoutCancel(ctx))
		return err
	}
	return nil
}

// Resume thaws the sidecars first, then the main container.
func (g *group) Resume(ctx context.Context) error {
	p, ok := g.main.(substrate.Pauser)
	if !ok {
		return errdefs.Unimplemented("the sandbox cannot pause")
	}
	if err := g.resumeMembers(ctx); err != nil {
		return err
	}
	return p.Resume(ctx)
}

func (g *group) resumeMembers(ctx context.Context) error {
	var errs []error
	for _, m := range g.members {
		if mp, ok := m.inst.(substrate.Pauser); ok && m.inst != nil {
			if err := mp.Resume(ctx); err != nil {
				errs = append(errs, fmt.Errorf("resume sidecar %q: %w", m.name, err))
				continue
			}
		}
		m.paused.Store(false)
	}
	return errors.Join(errs...)
}

// attachGroup re-adopts a sandbox with sidecars after a restart: its main
// container as any sandbox's, and each sidecar, with its service watched
// and health checked again. A sidecar that is gone shows as exited (-1);
// the sandbox lives on. As drivers do, it returns the group with an error
// when the main container is gone: releasing the group cleans up every
// container's leftovers.
func (n *Node) attachGroup(ctx context.Context, drv substrate.Driver, s *sandbox, raw []byte) (substrate.Instance, error) {
	var st groupState
	if err := json.Unmarshal(raw, &st); err != nil {
		return nil, errdefs.Internal(err, "read the sandbox's state")
	}
	main, mainErr := drv.Attach(ctx, &substrate.Spec{ID: s.id, Dir: s.dir}, st.Main)
	if main == nil {
		return nil, mainErr
	}
	g := &group{main: main, log: n.log}
	paused := s.state == statePaused
	for i, sc := range s.spec.Sidecars {
		m := newMember(sc.Name, memberID(s.id, i), sc)
		m.paused.Store(paused)
		g.members = append(g.members, m)
		var ms *memberState
		for j := range st.Members {
			if st.Members[j].ID == m.id {
				ms = &st.Members[j]
			}
		}
		exited := func(why string, err error) {
			if mainErr == nil {
				n.log.Warn("sidecar not re-adopted", slog.String("sandbox_id", s.id), slog.String("sidecar", m.name), slog.String("why", why), slog.Any("error", err))
			}
			m.set(func() { m.state, m.exitCode = scExited, -1 })
		}
		if ms == nil || len(ms.State) == 0 {
			exited("no state kept", nil)
			continue
		}
		m.layers, m.config = ms.Layers, ms.Config
		inst, err := drv.Attach(ctx, &substrate.Spec{ID: m.id, Dir: memberDir(s.dir, m.id)}, ms.State)
		m.inst = inst // even when gone: its Destroy removes what is left
		if err != nil || mainErr != nil {
			exited("its container is gone", err)
			continue
		}
		m.set(func() { m.state, m.started = scRunning, time.Now() })
		// In the background: a paused sidecar's agent answers only once
		// the sandbox resumes.
		go n.rewatchService(m)
		if sc.Healthcheck != nil {
			go n.checkHealth(m)
		}
	}
	return g, mainErr
}

// rewatchService finds a re-adopted sidecar's service again and watches
// it; a service that ended while the node was down shows as exited (-1).
func (n *Node) rewatchService(m *member) {
	pg, ok := m.inst.Guest().(substrate.ProcessGuest)
	if !ok {
		return
	}
	p, err := pg.Attach(m.ctx, "", serviceTag, true)
	if err != nil {
		if m.ctx.Err() == nil {
			m.set(func() { m.state, m.exitCode = scExited, -1 })
		}
		return
	}
	n.watchService(m, p)
}

// memberIDs are the instance IDs of a record's sidecars (known to the
// drivers' sweep).
func memberIDs(id string, spec *dsecv1.SandboxSpec) []string {
	out := make([]string, len(spec.GetSidecars()))
	for i := range out {
		out[i] = memberID(id, i)
	}
	return out
}

// ctr is one of a sandbox's containers as calls address it: its main one
// or a sidecar.
type ctr struct {
	s       *sandbox
	name    string // the sidecar's, "" for the main container
	guest   substrate.Guest
	workdir string // where commands start and relative paths lead
	user    string // whom calls act as by default
}

// ctrOf returns s's container name ("" or "main": the main one).
func (s *sandbox) ctrOf(name string) (*ctr, error) {
	if name == "" || name == mainName {
		return &ctr{s: s, guest: s.inst.Guest(), workdir: s.spec.Workdir, user: s.spec.User}, nil
	}
	if g, ok := s.inst.(*group); ok {
		if m := g.member(name); m != nil {
			if m.inst == nil {
				return nil, errdefs.Unavailable("sidecar %q of sandbox %s is not running", name, s.id)
			}
			return &ctr{s: s, name: name, guest: m.inst.Guest(), workdir: m.spec.Workdir, user: m.spec.User}, nil
		}
	}
	return nil, errdefs.NotFound("sandbox %s has no container %q", s.id, truncate(name, 64))
}

// procs is the container's agent's processes that outlive their call.
func (c *ctr) procs() (substrate.ProcessGuest, error) {
	return guestCan[substrate.ProcessGuest](c, "runs commands to completion only (use exec)")
}

// files is the container's agent's file calls.
func (c *ctr) files() (substrate.FileGuest, error) {
	return guestCan[substrate.FileGuest](c, "has no files (use kind container)")
}

// sidecarStatus is the status of s's sidecars (nil without).
func (s *sandbox) sidecarStatus() []*dsecv1.SidecarStatus {
	g, ok := s.inst.(*group)
	if !ok {
		return nil
	}
	out := make([]*dsecv1.SidecarStatus, len(g.members))
	for i, m := range g.members {
		out[i] = m.status()
	}
	return out
}

// guests are the agents of every container of s: the main one first.
func (s *sandbox) guests() []substrate.Guest {
	out := []substrate.Guest{s.inst.Guest()}
	if g, ok := s.inst.(*group); ok {
		for _, m := range g.members {
			if m.inst != nil {
				out = append(out, m.inst.Guest())
			}
		}
	}
	return out
}

// setDeadline gives every agent of s the deadline t (zero: none), the
// backstop that ends the sandbox when its node is gone. A sidecar's
// failure is logged: its own container may have ended.
func (n *Node) setDeadline(ctx context.Context, s *sandbox, t time.Time) error {
	gs := s.guests()
	if err := gs[0].SetDeadline(ctx, t); err != nil {
		return err
	}
	for _, g := range gs[1:] {
		if err := g.SetDeadline(ctx, t); err != nil {
			n.log.Warn("set a sidecar's deadline", slog.String("sandbox_id", s.id), slog.Any("error", err))
		}
	}
	return nil
}
