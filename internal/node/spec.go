package node

import (
	"encoding/json"
	"math"
	"regexp"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
)

const (
	maxLabels     = 64
	maxEnv        = 256
	maxEnvBytes   = 128 << 10
	maxValueBytes = 1024
)

var (
	labelKeyRe = regexp.MustCompile(`^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)
	envKeyRe   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	sessionRe  = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)
)

// normalize fills defaults into spec and validates it against the node's
// limits, and resolves its image (or snapshot) as project sees it (its own
// images and snapshots, and the shared images; tenant.Shared sees only the
// shared images). Every rejection is an invalid (task) error naming the
// field, or not found for an image the project cannot see.
func (n *Node) normalize(project string, spec *dsecv1.SandboxSpec) (*image.Image, error) {
	img, imgErr := n.images.Lookup(project, imageOf(spec))
	if imgErr == nil && spec.Snapshot != "" && img.Snapshot == nil {
		img, imgErr = nil, errdefs.NotFound("snapshot %q not found", spec.Snapshot)
	}
	if spec.Kind == "" && imgErr == nil && img.Snapshot != nil && img.Snapshot.Machine {
		// A machine snapshot starts sandboxes of its own kind.
		spec.Kind = img.Snapshot.Kind
	}
	if spec.Kind == "" {
		spec.Kind = string(substrate.KindContainer)
	}
	kind := substrate.Kind(spec.Kind)
	known := false
	for _, k := range substrate.Kinds {
		known = known || k == kind
	}
	if !known {
		return nil, errdefs.Invalid("unknown kind %q (use function, container, microvm or vm)", spec.Kind)
	}
	drv := n.drivers[kind]
	if drv == nil {
		return nil, errdefs.Unimplemented("kind %q is not served by node %s", spec.Kind, n.cfg.Name)
	}
	if caps := drv.Capabilities(); !caps.Available {
		return nil, errdefs.Unavailable("kind %q is unavailable on node %s: %s", spec.Kind, n.cfg.Name, caps.Reason)
	}
	// The sandbox's runtime: its capabilities are the sandbox's.
	caps, ok := drv.Capabilities().For(spec.Runtime)
	if !ok {
		return nil, errdefs.Invalid("kind %q has no runtime %q%s", spec.Kind, spec.Runtime, runtimeNames(drv.Capabilities()))
	}
	if !caps.Available {
		return nil, errdefs.Unavailable("runtime %q of kind %q is unavailable on node %s: %s", spec.Runtime, spec.Kind, n.cfg.Name, caps.Reason)
	}
	if spec.Image == "" && spec.Snapshot == "" {
		return nil, errdefs.Invalid("spec.image (or spec.snapshot) is required")
	}
	switch spec.OnTimeout {
	case "", OnTimeoutDelete:
	case OnTimeoutPause:
		if !caps.Has(substrate.CapPause) {
			return nil, errdefs.Invalid("on_timeout %q: kind %q%s cannot pause", spec.OnTimeout, spec.Kind, runtimeSuffix(spec.Runtime))
		}
	case OnTimeoutPauseFilesystem:
		if substrate.Kind(spec.Kind) != substrate.KindContainer || spec.Runtime != "" {
			return nil, errdefs.Invalid("on_timeout %q: kind %q%s cannot pause without its memory (only kind container under its default runtime can)", spec.OnTimeout, spec.Kind, runtimeSuffix(spec.Runtime))
		}
	default:
		return nil, errdefs.Invalid("on_timeout %q (use delete, pause or pause_filesystem)", truncate(spec.OnTimeout, 64))
	}
	if spec.Resources == nil {
		spec.Resources = &dsecv1.Resources{}
	}
	r := spec.Resources
	if err := n.defaultResources(r); err != nil {
		return nil, err
	}
	switch {
	case r.Gpu < 0:
		return nil, errdefs.Invalid("resources.gpu must not be negative")
	case r.Gpu > 0:
		return nil, errdefs.Unavailable("node %s has no GPUs", n.cfg.Name)
	}
	if spec.TtlS == 0 {
		spec.TtlS = int64(n.cfg.DefaultTTL / time.Second)
	}
	// Compared in seconds: a huge ttl_s must not wrap around in a Duration.
	if spec.TtlS < 0 || spec.TtlS > int64(n.cfg.MaxTTL/time.Second) {
		return nil, errdefs.Invalid("ttl_s %d out of range [1, %d]", spec.TtlS, int64(n.cfg.MaxTTL/time.Second))
	}
	if spec.IdleTtlS < 0 || spec.IdleTtlS > spec.TtlS {
		return nil, errdefs.Invalid("idle_ttl_s %d out of range [0, ttl_s]", spec.IdleTtlS)
	}
	if len(spec.Labels) > maxLabels {
		return nil, errdefs.Invalid("at most %d labels", maxLabels)
	}
	for k, v := range spec.Labels {
		if strings.HasPrefix(k, "dsec.io/") && !(k == SessionLabel && v == spec.Session) {
			return nil, errdefs.Invalid("label %q: the dsec.io/ prefix is reserved", k)
		}
		if !labelKeyRe.MatchString(k) {
			return nil, errdefs.Invalid("label key %q is not a valid key ([prefix/]name, alphanumerics, '-', '_', '.')", k)
		}
		if len(v) > maxValueBytes {
			return nil, errdefs.Invalid("label %q value longer than %d bytes", k, maxValueBytes)
		}
	}
	if err := validEnv(spec.Env); err != nil {
		return nil, err
	}
	if err := checkModelGateway(spec); err != nil {
		return nil, err
	}
	if spec.Network == nil {
		spec.Network = &dsecv1.Network{}
	}
	switch spec.Network.Mode {
	case "":
		spec.Network.Mode = network.ModeNone
		if spec.Network.Policy != nil {
			// A policy is for egress.
			spec.Network.Mode = network.ModeEgress
			if why := n.net.EgressUnavailable(); why != "" {
				return nil, errdefs.Unavailable("egress networking is unavailable on node %s: %s", n.cfg.Name, why)
			}
			if !caps.Has(substrate.CapNetworkEgress) {
				return nil, errdefs.Unimplemented("kind %q%s has no egress networking", spec.Kind, runtimeSuffix(spec.Runtime))
			}
		}
	case network.ModeNone:
	case network.ModeEgress:
		if why := n.net.EgressUnavailable(); why != "" {
			return nil, errdefs.Unavailable("egress networking is unavailable on node %s: %s", n.cfg.Name, why)
		}
		if !caps.Has(substrate.CapNetworkEgress) {
			return nil, errdefs.Unimplemented("kind %q%s has no egress networking", spec.Kind, runtimeSuffix(spec.Runtime))
		}
	default:
		return nil, errdefs.Invalid("network.mode %q (use none or egress)", spec.Network.Mode)
	}
	if err := n.normalizeNetwork(project, spec); err != nil {
		return nil, err
	}
	if spec.Snapshot != "" && imgErr == nil {
		restoreShared(spec, img)
	}
	if err := n.normalizeShared(spec); err != nil {
		return nil, err
	}
	if err := n.normalizeVolumes(project, spec, caps); err != nil {
		return nil, err
	}
	if len(spec.User) > 256 || strings.ContainsAny(spec.User, "\x00\n") {
		return nil, errdefs.Invalid("spec.user is malformed")
	}
	if spec.Workdir != "" && !strings.HasPrefix(spec.Workdir, "/") {
		return nil, errdefs.Invalid("spec.workdir must be an absolute path")
	}
	if imgErr != nil {
		return nil, imgErr
	}
	if spec.Snapshot != "" {
		if img.Snapshot.Machine && img.Snapshot.Kind != spec.Kind {
			return nil, errdefs.Invalid("snapshot %s holds a %s machine (memory and disk); it starts only %s sandboxes, not %s", spec.Snapshot, img.Snapshot.Kind, img.Snapshot.Kind, spec.Kind)
		}
		if !img.Snapshot.Machine && kind == substrate.KindVM {
			return nil, errdefs.Invalid("snapshot %s holds %s file system layers; kind vm boots VM images", spec.Snapshot, img.Snapshot.Kind)
		}
		spec.Image = img.Snapshot.BaseImage
	} else if img.Snapshot != nil {
		return nil, errdefs.Invalid("%q is a snapshot: pass it as spec.snapshot", spec.Image)
	} else if isVM := img.VM != nil; isVM != (kind == substrate.KindVM) {
		if isVM {
			return nil, errdefs.Invalid("%q is a VM image (a bootable disk): create it with kind vm", spec.Image)
		}
		return nil, errdefs.Invalid("kind vm boots VM images; %q holds file system layers (build one with `dsec image build-vm debian`, or import a disk with `dsec image import-vm`)", spec.Image)
	}
	if spec.Workdir == "" {
		spec.Workdir = img.Config.Workdir
	}
	if spec.User == "" {
		spec.User = img.Config.User
	}
	if spec.Session != "" {
		if !sessionRe.MatchString(spec.Session) {
			return nil, errdefs.Invalid("session name %q is invalid", spec.Session)
		}
		if spec.Labels == nil {
			spec.Labels = map[string]string{}
		}
		spec.Labels[SessionLabel] = spec.Session
	}
	var from *image.Image
	if spec.Snapshot != "" {
		from = img
	}
	if err := n.normalizeSidecars(project, spec, from); err != nil {
		return nil, err
	}
	return n.compose(project, spec, img)
}

// maxComposed bounds spec.layers.
const maxComposed = 16

// compose stacks the layers of spec.layers' images over img's (a copy):
// the sandbox's filesystem; its configuration stays img's.
func (n *Node) compose(project string, spec *dsecv1.SandboxSpec, img *image.Image) (*image.Image, error) {
	if len(spec.Layers) == 0 {
		return img, nil
	}
	if substrate.Kind(spec.Kind) != substrate.KindContainer {
		return nil, errdefs.Invalid("spec.layers composes container sandboxes; kind %s boots one image's disk", spec.Kind)
	}
	if len(spec.Layers) > maxComposed {
		return nil, errdefs.Invalid("spec.layers: at most %d images", maxComposed)
	}
	out := *img
	out.Layers = append([]string(nil), img.Layers...)
	// A layer already in the stack is not stacked again: a toolkit
	// committed over the base contributes its own layers, and does not put
	// the base's back over a workspace's changes to them.
	have := map[string]bool{}
	for _, l := range out.Layers {
		have[l] = true
	}
	for _, name := range spec.Layers {
		l, err := n.images.Lookup(project, name)
		switch {
		case err != nil:
			return nil, errdefs.NotFound("spec.layers: image %q not found", truncate(name, 256))
		case l.VM != nil:
			return nil, errdefs.Invalid("spec.layers: %q is a VM image (a bootable disk), not file system layers", name)
		case l.Snapshot != nil && l.Snapshot.Machine:
			return nil, errdefs.Invalid("spec.layers: %q is a machine snapshot (memory and disk), not file system layers", name)
		}
		for _, d := range l.Layers {
			if !have[d] {
				have[d] = true
				out.Layers = append(out.Layers, d)
			}
		}
	}
	return &out, nil // the driver refuses more layers than one overlay mount takes
}

// defaultResources gives r's unset cpu, memory and pids the node's
// defaults and checks them, and the disk size, against its maxima.
func (n *Node) defaultResources(r *dsecv1.Resources) error {
	if r.Cpu == 0 {
		r.Cpu = n.cfg.DefaultCPU
	}
	if r.MemoryMb == 0 {
		r.MemoryMb = n.cfg.DefaultMemoryMB
	}
	if r.Pids == 0 {
		r.Pids = n.cfg.DefaultPids
	}
	switch {
	case math.IsNaN(r.Cpu) || r.Cpu < 0.01 || r.Cpu > n.cfg.MaxCPU:
		return errdefs.Invalid("resources.cpu %g out of range [0.01, %g]", r.Cpu, n.cfg.MaxCPU)
	case r.MemoryMb < 16 || r.MemoryMb > n.cfg.MaxMemoryMB:
		return errdefs.Invalid("resources.memory_mb %d out of range [16, %d]", r.MemoryMb, n.cfg.MaxMemoryMB)
	case r.Pids < 8 || r.Pids > n.cfg.MaxPids:
		return errdefs.Invalid("resources.pids %d out of range [8, %d]", r.Pids, n.cfg.MaxPids)
	case r.DiskMb < 0:
		return errdefs.Invalid("resources.disk_mb must not be negative")
	}
	return nil
}

// runtimeNames lists c's runtimes for an error message ("" if none).
func runtimeNames(c substrate.Capabilities) string {
	if len(c.Runtimes) == 0 {
		return " (it has only its default: leave runtime empty)"
	}
	names := make([]string, len(c.Runtimes))
	for i, r := range c.Runtimes {
		names[i] = r.Name
	}
	return " (use " + strings.Join(names, ", ") + ", or leave it empty for the default)"
}

// runtimeSuffix names a non-default runtime in a message about its kind.
func runtimeSuffix(runtime string) string {
	if runtime == "" {
		return ""
	}
	return " (runtime " + runtime + ")"
}

func validEnv(env map[string]string) error {
	if len(env) > maxEnv {
		return errdefs.Invalid("at most %d environment variables", maxEnv)
	}
	total := 0
	for k, v := range env {
		if !envKeyRe.MatchString(k) {
			return errdefs.Invalid("environment variable name %q is invalid", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return errdefs.Invalid("environment variable %q contains a NUL byte", k)
		}
		total += len(k) + len(v)
	}
	if total > maxEnvBytes {
		return errdefs.Invalid("environment larger than %d bytes", maxEnvBytes)
	}
	return nil
}

// Selector is a parsed label selector: comma-separated requirements, each
// "k=v" (or "k==v"), "k!=v", "k" (has k) or "!k" (lacks k).
type Selector []requirement

type requirement struct {
	key, value string
	op         string // "=", "!=", "exists", "!exists"
}

// ParseSelector parses a label selector.
func ParseSelector(s string) (Selector, error) {
	var sel Selector
	if strings.TrimSpace(s) == "" {
		return sel, nil
	}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		var r requirement
		switch {
		case strings.Contains(part, "!="):
			k, v, _ := strings.Cut(part, "!=")
			r = requirement{strings.TrimSpace(k), strings.TrimSpace(v), "!="}
		case strings.Contains(part, "=="):
			k, v, _ := strings.Cut(part, "==")
			r = requirement{strings.TrimSpace(k), strings.TrimSpace(v), "="}
		case strings.Contains(part, "="):
			k, v, _ := strings.Cut(part, "=")
			r = requirement{strings.TrimSpace(k), strings.TrimSpace(v), "="}
		case strings.HasPrefix(part, "!"):
			r = requirement{strings.TrimSpace(part[1:]), "", "!exists"}
		default:
			r = requirement{part, "", "exists"}
		}
		if !labelKeyRe.MatchString(r.key) {
			return nil, errdefs.Invalid("label selector %q: bad key %q", s, r.key)
		}
		sel = append(sel, r)
	}
	return sel, nil
}

// Matches reports whether labels satisfy every requirement.
func (sel Selector) Matches(labels map[string]string) bool {
	for _, r := range sel {
		v, ok := labels[r.key]
		switch r.op {
		case "=":
			if !ok || v != r.value {
				return false
			}
		case "!=":
			if ok && v == r.value {
				return false
			}
		case "exists":
			if !ok {
				return false
			}
		case "!exists":
			if ok {
				return false
			}
		}
	}
	return true
}

func paginate(out *dsecv1.ListSandboxesResponse, size int32, token string) (*dsecv1.ListSandboxesResponse, error) {
	if size <= 0 || size > 10000 {
		size = 10000
	}
	start := 0
	if token != "" {
		// The token is the ID after which the next page starts.
		start = len(out.Sandboxes)
		for i, s := range out.Sandboxes {
			if s.Id == token {
				start = i + 1
				break
			}
		}
	}
	all := out.Sandboxes
	end := min(start+int(size), len(all))
	page := &dsecv1.ListSandboxesResponse{Sandboxes: all[start:end]}
	if end < len(all) {
		page.NextPageToken = all[end-1].Id
	}
	return page, nil
}

func hostCPUs() int { return runtime.NumCPU() }

func hostMemoryMB() int64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 1 << 14
	}
	return int64(si.Totalram) * int64(si.Unit) >> 20
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }
