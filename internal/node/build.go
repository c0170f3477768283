package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dockerfile"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
)

// Builds (`dsec image build`): a Dockerfile's stages run one step after
// another. Steps that change only the image's configuration (ENV, USER,
// CMD...) change the build's state; steps that change files become one
// layer each: RUN in a container sandbox of the caller's project, started
// from the state so far, whose writable layer is captured as a snapshot
// is; COPY, ADD and WORKDIR on the node, into a private overlay of the
// state's layers. After each such step the state is kept as a build cache
// record (image.BuildCacheMeta), keyed by its parent's key, the step as
// expanded, the environment and arguments it saw and the files it copied:
// a later build that reaches the same key takes the record's layers
// instead of running the step.

const (
	// BuildLabel marks the sandboxes a build runs its RUN steps in (its
	// value: the image being built).
	BuildLabel = "dsec.io/build"
	// buildCachePrefix starts the names of build cache records.
	buildCachePrefix   = "dsec-build-cache/"
	defaultStepTimeout = time.Hour
	// outputTail is how much of a failed RUN's output its error quotes.
	outputTail = 2048
)

// buildState is a stage's state: its layers and configuration, its cache
// key, and the image record whose layers are its layers (what a RUN's
// sandbox starts from; "" while the stage has no files).
type buildState struct {
	layers []string
	size   int64
	cfg    image.Config
	key    string
	rec    string
	shell  []string
	// args are the stage's ARGs in scope, with their values.
	args map[string]string
}

func (st *buildState) clone() *buildState {
	c := *st
	c.layers = slices.Clone(st.layers)
	c.cfg.Env = slices.Clone(st.cfg.Env)
	c.cfg.Entrypoint = slices.Clone(st.cfg.Entrypoint)
	c.cfg.Cmd = slices.Clone(st.cfg.Cmd)
	c.cfg.ExposedPorts = slices.Clone(st.cfg.ExposedPorts)
	c.cfg.Labels = maps.Clone(st.cfg.Labels)
	c.shell = slices.Clone(st.shell)
	c.args = map[string]string{}
	return &c
}

// getenv looks name up in the state's environment.
func (st *buildState) getenv(name string) (string, bool) {
	for i := len(st.cfg.Env) - 1; i >= 0; i-- {
		if k, v, _ := strings.Cut(st.cfg.Env[i], "="); k == name {
			return v, true
		}
	}
	return "", false
}

func (st *buildState) setenv(name, value string) {
	st.cfg.Env = slices.DeleteFunc(st.cfg.Env, func(kv string) bool { k, _, _ := strings.Cut(kv, "="); return k == name })
	st.cfg.Env = append(st.cfg.Env, name+"="+value)
}

// lookup is the variables a step's words see: the environment, then the
// stage's ARGs (ENV wins, as in Docker).
func (st *buildState) lookup(name string) (string, bool) {
	if v, ok := st.getenv(name); ok {
		return v, true
	}
	v, ok := st.args[name]
	return v, ok
}

// chain extends the state's cache key with parts.
func (st *buildState) chain(parts ...any) {
	b, _ := json.Marshal(append([]any{st.key}, parts...))
	h := sha256.Sum256(b)
	st.key = hex.EncodeToString(h[:])
}

type builder struct {
	n        *Node
	project  string
	req      *dsecv1.BuildImageRequest
	file     *dockerfile.File
	progress func(*dsecv1.ImageProgress)
	// context is the build context's directory ("" without one).
	context string
	global  map[string]string
	used    map[string]bool // build args some ARG declared
	stages  []*buildState   // by index, once built
	names   map[string]int
	step    int32
	steps   int32
	tmp     string
	holds   []func() // layer holds, released when the build ends
}

// BuildImage builds an image from a Dockerfile (see builder), streaming
// progress, and stores it under req.Name for the caller's project.
func (n *Node) BuildImage(ctx context.Context, req *dsecv1.BuildImageRequest, progress func(*dsecv1.ImageProgress)) (_ *dsecv1.Image, err error) {
	defer func(start time.Time) { n.m.Image("build", start, err) }(time.Now())
	if err := image.ValidName(req.GetName()); err != nil {
		return nil, err
	}
	if strings.HasPrefix(req.GetName(), buildCachePrefix) {
		return nil, errdefs.Invalid("image names starting with %q are the build cache's", buildCachePrefix)
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.Unavailable("node %s runs unprivileged: builds mount overlays and need root", n.cfg.Name)
	}
	if t := req.GetStepTimeoutS(); t < 0 || t > int64(n.cfg.MaxTTL/time.Second) {
		return nil, errdefs.Invalid("step_timeout_s %d out of range [0, %d]", t, int64(n.cfg.MaxTTL/time.Second))
	}
	switch req.GetNetwork() {
	case "", "none", "egress":
	default:
		return nil, errdefs.Invalid("network %q (use none or egress)", truncate(req.GetNetwork(), 64))
	}
	file, err := dockerfile.Parse(strings.NewReader(req.GetDockerfile()))
	if err != nil {
		return nil, err
	}
	project := tenant.OrDefault(tenant.Project(ctx))
	b := &builder{n: n, project: project, req: req, file: file, progress: progress, names: map[string]int{}, used: map[string]bool{}}
	if progress == nil {
		b.progress = func(*dsecv1.ImageProgress) {}
	}
	if d := req.GetContextDigest(); d != "" {
		dir, err := n.buildContext(project, d)
		if err != nil {
			return nil, err
		}
		b.context = dir
	}
	if b.tmp, err = os.MkdirTemp(n.buildDir("tmp"), "build-"); err != nil {
		return nil, errdefs.Internal(err, "create build directory")
	}
	defer os.RemoveAll(b.tmp)
	defer func() {
		for _, release := range b.holds {
			release()
		}
	}()
	img, err := b.run(ctx)
	if err != nil {
		return nil, err
	}
	return imageView(img), nil
}

// buildDir is a directory of the node's build files, created if missing.
func (n *Node) buildDir(sub string) string {
	d := filepath.Join(n.cfg.DataDir, "build", sub)
	os.MkdirAll(d, 0o700)
	return d
}

func (b *builder) run(ctx context.Context) (*image.Image, error) {
	// Global ARGs: their defaults, or the build's values.
	b.global = map[string]string{}
	for _, a := range b.file.Args {
		v, given := b.req.GetBuildArgs()[a.Name]
		if given {
			b.used[a.Name] = true
		} else if a.Default != nil {
			var err error
			if v, err = dockerfile.Expand(*a.Default, b.lookupGlobal); err != nil {
				return nil, errdefs.Invalid("ARG %s: %s", a.Name, errdefs.Classify(err).Msg)
			}
		} else {
			continue
		}
		b.global[a.Name] = v
	}
	for i, st := range b.file.Stages {
		if st.Name != "" {
			b.names[st.Name] = i
		}
	}
	target := len(b.file.Stages) - 1
	if t := b.req.GetTarget(); t != "" {
		i, ok := b.names[strings.ToLower(t)]
		if !ok {
			return nil, errdefs.Invalid("target stage %q is not in the Dockerfile", truncate(t, 64))
		}
		target = i
	}
	need, err := b.needed(target)
	if err != nil {
		return nil, err
	}
	for i := range b.file.Stages {
		if need[i] {
			b.steps += int32(len(b.file.Stages[i].Steps)) + 1
		}
	}
	b.stages = make([]*buildState, len(b.file.Stages))
	for i, st := range b.file.Stages {
		if !need[i] {
			continue
		}
		s, err := b.stage(ctx, i, st)
		if err != nil {
			return nil, err
		}
		b.stages[i] = s
	}
	for name := range b.req.GetBuildArgs() {
		if !b.used[name] {
			b.progress(&dsecv1.ImageProgress{Phase: "build", Message: fmt.Sprintf("warning: build arg %s was not consumed by any ARG", name)})
		}
	}
	st := b.stages[target]
	img := &image.Image{
		Name: b.req.GetName(), Owner: b.project, Layers: st.layers, Size: st.size, Created: time.Now().UTC(),
		Source: "build", Config: st.cfg, Digest: "sha256:" + st.key,
	}
	if err := b.n.images.Put(img); err != nil {
		return nil, err
	}
	b.n.loadChanged()
	return img, nil
}

func (b *builder) lookupGlobal(name string) (string, bool) {
	v, ok := b.global[name]
	return v, ok
}

// stageRef returns the index of the earlier stage ref names (by name or
// number), if it names one.
func (b *builder) stageRef(ref string, before int) (int, bool) {
	if i, ok := b.names[strings.ToLower(ref)]; ok && i < before {
		return i, true
	}
	if i, err := strconv.Atoi(ref); err == nil && i >= 0 && i < before {
		return i, true
	}
	return 0, false
}

// needed returns the stages target depends on (itself included): the
// stages its FROM and COPY --from name, and theirs.
func (b *builder) needed(target int) (map[int]bool, error) {
	need := map[int]bool{}
	var visit func(i int) error
	visit = func(i int) error {
		if need[i] {
			return nil
		}
		need[i] = true
		st := b.file.Stages[i]
		base, err := dockerfile.Expand(st.Base, b.lookupGlobal)
		if err != nil {
			return errdefs.Invalid("line %d: FROM: %s", st.Line, errdefs.Classify(err).Msg)
		}
		refs := []string{base}
		for _, s := range st.Steps {
			if from, ok := s.Flags["from"]; ok && s.Command == "COPY" {
				refs = append(refs, from)
			}
		}
		for _, r := range refs {
			if j, ok := b.stageRef(r, i); ok {
				if err := visit(j); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return need, visit(target)
}

// report announces a step.
func (b *builder) report(line int, text string, cached bool) {
	b.step++
	msg := fmt.Sprintf("[%d/%d] %s", b.step, b.steps, text)
	if cached {
		msg += " (cached)"
	}
	b.progress(&dsecv1.ImageProgress{Phase: "step", Message: msg, Step: b.step, Steps: b.steps, Cached: cached})
}

// stage builds stage i.
func (b *builder) stage(ctx context.Context, i int, st *dockerfile.Stage) (*buildState, error) {
	base, _ := dockerfile.Expand(st.Base, b.lookupGlobal) // needed checked it
	if p := st.Platform; p != "" && p != "linux/amd64" && p != "$BUILDPLATFORM" && p != "$TARGETPLATFORM" {
		return nil, errdefs.Unimplemented("line %d: FROM --platform=%s: this node builds linux/amd64 only", st.Line, truncate(p, 64))
	}
	var s *buildState
	if j, ok := b.stageRef(base, i); ok {
		s = b.stages[j].clone()
	} else if strings.EqualFold(base, "scratch") {
		s = &buildState{key: "scratch", args: map[string]string{}}
	} else {
		img, err := b.n.images.Lookup(b.project, base)
		if err != nil {
			return nil, errdefs.NotFound("line %d: FROM %s: no image %q on node %s (pull, bootstrap, upload or build it first)", st.Line, truncate(base, 128), truncate(base, 128), b.n.cfg.Name)
		}
		if img.VM != nil || img.Snapshot != nil && img.Snapshot.Machine {
			return nil, errdefs.Invalid("line %d: FROM %s: a VM image or machine snapshot has no layers to build on", st.Line, truncate(base, 128))
		}
		if err := b.hold(img.Layers); err != nil {
			return nil, errdefs.NotFound("line %d: FROM %s: the image was removed as the build started", st.Line, truncate(base, 128))
		}
		s = (&buildState{layers: img.Layers, size: img.Size, cfg: img.Config, rec: img.Name, key: "from"}).clone()
		s.chain(img.Digest, img.Layers)
	}
	if s.shell == nil {
		s.shell = []string{"/bin/sh", "-c"}
	}
	b.report(st.Line, "FROM "+base, false)
	for _, step := range st.Steps {
		if err := b.doStep(ctx, i, s, step); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// stepErr prefixes err's message with a step's place, keeping its class.
func stepErr(err error, format string, args ...any) error {
	e := *errdefs.Classify(err)
	e.Msg = fmt.Sprintf(format, args...) + ": " + e.Msg
	return &e
}

// unsupported names what a build refuses: an unimplemented error (what
// dsec does not build), unlike a step's own failure (invalid).
func unsupported(step *dockerfile.Step, what string) error {
	return errdefs.Unimplemented("line %d: %s is not supported by dsec image build", step.Line, what)
}

// onlyFlags refuses flags of step other than allowed.
func onlyFlags(step *dockerfile.Step, allowed ...string) error {
	for _, f := range slices.Sorted(maps.Keys(step.Flags)) {
		if !slices.Contains(allowed, f) {
			return unsupported(step, step.Command+" --"+truncate(f, 32))
		}
	}
	return nil
}

// expandAll expands each word of step.
func expandAll(step *dockerfile.Step, words []string, lookup func(string) (string, bool)) ([]string, error) {
	out := make([]string, len(words))
	for i, w := range words {
		v, err := dockerfile.Expand(w, lookup)
		if err != nil {
			return nil, errdefs.Invalid("line %d: %s: %s", step.Line, step.Command, errdefs.Classify(err).Msg)
		}
		out[i] = v
	}
	return out, nil
}

// doStep runs one step of stage i on s.
func (b *builder) doStep(ctx context.Context, i int, s *buildState, step *dockerfile.Step) error {
	if err := ctx.Err(); err != nil {
		return errdefs.Classify(err)
	}
	switch step.Command {
	case "ENV":
		kv, err := dockerfile.KeyValues(step, s.lookup)
		if err != nil {
			return err
		}
		for _, p := range kv {
			s.setenv(p[0], p[1])
		}
	case "LABEL", "MAINTAINER":
		kv := [][2]string{{"maintainer", strings.Join(step.Args, " ")}}
		if step.Command == "LABEL" {
			var err error
			if kv, err = dockerfile.KeyValues(step, s.lookup); err != nil {
				return err
			}
		}
		if s.cfg.Labels == nil {
			s.cfg.Labels = map[string]string{}
		}
		for _, p := range kv {
			s.cfg.Labels[p[0]] = p[1]
		}
	case "ARG":
		args, err := dockerfile.ArgsOf(step)
		if err != nil {
			return err
		}
		for _, a := range args {
			v, given := b.req.GetBuildArgs()[a.Name]
			switch g, global := b.global[a.Name]; {
			case given:
				b.used[a.Name] = true
			case a.Default != nil:
				if v, err = dockerfile.Expand(*a.Default, s.lookup); err != nil {
					return errdefs.Invalid("line %d: ARG %s: %s", step.Line, a.Name, errdefs.Classify(err).Msg)
				}
			case global:
				v = g
			default:
				delete(s.args, a.Name)
				continue
			}
			s.args[a.Name] = v
		}
	case "USER":
		w, err := expandAll(step, step.Args, s.lookup)
		if err != nil {
			return err
		}
		if len(w) != 1 || w[0] == "" {
			return errdefs.Invalid("line %d: USER takes one user[:group]", step.Line)
		}
		s.cfg.User = w[0]
	case "ENTRYPOINT", "CMD":
		argv := step.Args
		if !step.JSON {
			argv = append(slices.Clone(s.shell), step.Args[0])
		}
		if step.Command == "ENTRYPOINT" {
			s.cfg.Entrypoint, s.cfg.Cmd = argv, nil
		} else {
			s.cfg.Cmd = argv
		}
	case "SHELL":
		if len(step.Args) == 0 {
			return errdefs.Invalid("line %d: SHELL needs a command", step.Line)
		}
		s.shell = slices.Clone(step.Args)
	case "EXPOSE":
		w, err := expandAll(step, step.Args, s.lookup)
		if err != nil {
			return err
		}
		for _, p := range w {
			port, proto, _ := strings.Cut(p, "/")
			if proto == "" {
				proto = "tcp"
			}
			if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || proto != "tcp" && proto != "udp" && proto != "sctp" {
				return errdefs.Invalid("line %d: EXPOSE %q: want port[/tcp|udp|sctp]", step.Line, truncate(p, 32))
			}
			if e := port + "/" + proto; !slices.Contains(s.cfg.ExposedPorts, e) {
				s.cfg.ExposedPorts = append(s.cfg.ExposedPorts, e)
			}
		}
	case "HEALTHCHECK":
		if !strings.EqualFold(strings.TrimSpace(step.Args[0]), "NONE") {
			return unsupported(step, "HEALTHCHECK (sandboxes have no health checks; only HEALTHCHECK NONE is accepted)")
		}
	case "WORKDIR":
		w, err := expandAll(step, step.Args, s.lookup)
		if err != nil {
			return err
		}
		if len(w) != 1 || w[0] == "" {
			return errdefs.Invalid("line %d: WORKDIR takes one path", step.Line)
		}
		dir := w[0]
		if !path.IsAbs(dir) {
			dir = path.Join("/", s.cfg.Workdir, dir)
		}
		s.cfg.Workdir = path.Clean(dir)
		return b.files(ctx, s, step, "WORKDIR "+s.cfg.Workdir, nil, func(root string) error {
			if dirExists(root, s.cfg.Workdir) {
				return nil
			}
			return writeTar(root, func(t *tarWriter) error { return t.dir(s.cfg.Workdir, 0o755, 0, 0) })
		})
	case "RUN":
		return b.runStep(ctx, s, step)
	case "COPY", "ADD":
		return b.copyStep(ctx, i, s, step)
	case "VOLUME":
		return unsupported(step, "VOLUME (give a sandbox volumes when you create it)")
	case "STOPSIGNAL":
		return unsupported(step, "STOPSIGNAL")
	case "ONBUILD":
		return unsupported(step, "ONBUILD")
	default:
		return unsupported(step, step.Command)
	}
	s.chain(step.Command, step.Original, s.cfg)
	b.report(step.Line, step.Original, false)
	return nil
}

// cached looks a step's key up in the build cache; on a hit s takes the
// record's state.
func (b *builder) cached(s *buildState, key string) bool {
	if b.req.GetNoCache() {
		return false
	}
	img, err := b.n.images.Get(tenant.ImageKey(b.project, buildCachePrefix+key))
	if err != nil || img.BuildCache == nil || img.BuildCache.Key != key {
		return false
	}
	if b.hold(img.Layers) != nil {
		return false // collected meanwhile: run the step
	}
	s.layers, s.size, s.rec, s.key = slices.Clone(img.Layers), img.Size, img.Name, key
	return true
}

// commit ends a step that changed files: layer (when it is not empty) is
// stacked on s, and s is kept in the build cache under key.
func (b *builder) commit(s *buildState, key, step, diff string, size int64) error {
	layers := slices.Clone(s.layers)
	if diff != "" && diff != image.EmptyLayer {
		layers = append(layers, diff)
	}
	rec := &image.Image{
		Name: buildCachePrefix + key, Owner: b.project, Layers: layers, Size: s.size + size, Created: time.Now().UTC(),
		Source: "build cache", Config: s.cfg, Digest: "sha256:" + key, BuildCache: &image.BuildCacheMeta{Key: key, Step: step},
	}
	if err := b.n.images.Put(rec); err != nil {
		return err
	}
	if err := b.hold(layers); err != nil {
		return err
	}
	s.layers, s.size, s.rec, s.key = layers, rec.Size, rec.Name, key
	return nil
}

// hold keeps layers in the store until the build ends, whatever happens
// to the records naming them meanwhile (a prune, an image removed): the
// build's later steps and its image stack on them.
func (b *builder) hold(layers []string) error {
	release, err := b.n.images.Hold(layers)
	if err != nil {
		return err
	}
	b.holds = append(b.holds, release)
	return nil
}

// stepKey is the cache key of a step that changes files.
func (s *buildState) stepKey(parts ...any) string {
	c := *s
	c.chain(parts...)
	return c.key
}

// runStep runs a RUN step in a sandbox started from s.
func (b *builder) runStep(ctx context.Context, s *buildState, step *dockerfile.Step) error {
	if err := onlyFlags(step); err != nil {
		return err
	}
	argv := step.Args
	if !step.JSON {
		script := step.Args[0]
		if len(step.Heredocs) > 0 {
			if strings.HasPrefix(strings.TrimSpace(script), "<<") && len(step.Heredocs) == 1 && !strings.ContainsAny(strings.TrimSpace(script), " \t") {
				// RUN <<EOF: the here-document is the script.
				if strings.HasPrefix(step.Heredocs[0].Content, "#!") {
					return unsupported(step, "a RUN here-document with its own interpreter (#!)")
				}
				script = step.Heredocs[0].Content
			} else {
				// The here-documents feed the command: the shell reads
				// them after its line, as it would in a script.
				var sb strings.Builder
				sb.WriteString(script)
				sb.WriteString("\n")
				for _, h := range step.Heredocs {
					sb.WriteString(h.Content)
					sb.WriteString(h.Name + "\n")
				}
				script = sb.String()
			}
		}
		argv = append(slices.Clone(s.shell), script)
	}
	if s.rec == "" {
		return errdefs.Invalid("line %d: RUN in a stage without files (FROM scratch) has no shell or program to run", step.Line)
	}
	env := map[string]string{}
	for k, v := range s.args {
		env[k] = v
	}
	for _, kv := range s.cfg.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	key := s.stepKey("RUN", argv, env, s.cfg.User, s.cfg.Workdir)
	if b.cached(s, key) {
		b.report(step.Line, step.Original, true)
		return nil
	}
	b.report(step.Line, step.Original, false)
	timeout := time.Duration(b.req.GetStepTimeoutS()) * time.Second
	if timeout == 0 {
		timeout = defaultStepTimeout
	}
	spec := &dsecv1.SandboxSpec{
		Kind: string(substrate.KindContainer), Image: s.rec, TtlS: int64((timeout + 5*time.Minute) / time.Second),
		Resources: proto.Clone(b.req.GetResources()).(*dsecv1.Resources),
	}
	if b.req.GetResources() == nil {
		spec.Resources = nil
	}
	if net := b.req.GetNetwork(); net != "" {
		spec.Network = &dsecv1.Network{Mode: net}
	}
	sb, err := b.n.create(ctx, spec, "", b.project, map[string]string{BuildLabel: b.req.GetName()})
	if err != nil {
		return stepErr(err, "line %d: RUN: start its sandbox", step.Line)
	}
	defer func() {
		if err := b.n.Delete(context.WithoutCancel(ctx), sb.GetId()); err != nil && !errdefs.Is(err, errdefs.KindNotFound) {
			b.n.log.Warn("delete a build step's sandbox", slog.String("sandbox_id", sb.GetId()), slog.Any("error", err))
		}
	}()
	cwd := s.cfg.Workdir
	if cwd == "" {
		cwd = "/"
	}
	user := s.cfg.User
	if user == "" {
		user = "root"
	}
	var tail []byte
	var res *dsecv1.ExecResult
	err = b.n.ExecStream(ctx, &dsecv1.ExecRequest{SandboxId: sb.GetId(), Argv: argv, Env: env, Cwd: cwd, User: user, TimeoutS: timeout.Seconds()}, func(ev *dsecv1.ExecEvent) error {
		out := ev.GetStdout()
		if out == nil {
			out = ev.GetStderr()
		}
		if len(out) > 0 {
			tail = append(tail, out...)
			if len(tail) > outputTail {
				tail = tail[len(tail)-outputTail:]
			}
			b.progress(&dsecv1.ImageProgress{Phase: "output", Message: string(out), Step: b.step, Steps: b.steps})
		}
		if ev.GetExit() != nil {
			res = ev.GetExit()
		}
		return nil
	})
	if err != nil {
		return stepErr(err, "line %d: RUN", step.Line)
	}
	switch {
	case res == nil:
		return errdefs.Unavailable("line %d: RUN: the command ended without a result", step.Line)
	case res.GetTimedOut():
		return errdefs.Invalid("line %d: %s: timed out after %s; its output ended with:\n%s", step.Line, truncate(step.Original, 200), timeout, tail)
	case res.GetExitCode() != 0:
		return errdefs.Invalid("line %d: %s: exit code %d; its output ended with:\n%s", step.Line, truncate(step.Original, 200), res.GetExitCode(), tail)
	}
	sbx := b.n.sandboxes.get(sb.GetId())
	if sbx == nil {
		return errdefs.Unavailable("line %d: RUN: its sandbox ended before its files were captured", step.Line)
	}
	diff, size, release, err := b.n.captureLayer(ctx, sbx)
	if err != nil {
		return stepErr(err, "line %d: RUN: capture its files", step.Line)
	}
	defer release()
	return b.commit(s, key, step.Original, diff, size)
}

// files runs a step that writes files on the node: write fills a private
// overlay of s's layers (its root), whose new files become the step's
// layer. key parts are the step's, beyond s's key and what.
func (b *builder) files(ctx context.Context, s *buildState, step *dockerfile.Step, what string, parts []any, write func(root string) error) error {
	if err := ctx.Err(); err != nil {
		return errdefs.Classify(err)
	}
	key := s.stepKey(append([]any{what}, parts...)...)
	if b.cached(s, key) {
		b.report(step.Line, step.Original, true)
		return nil
	}
	b.report(step.Line, step.Original, false)
	var diff string
	var size int64
	release := func() {}
	err := b.withRoot(s.layers, true, func(root, upper string) error {
		if err := write(root); err != nil {
			return err
		}
		if ents, _ := os.ReadDir(upper); len(ents) == 0 {
			return nil // nothing changed: no layer
		}
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(image.TarOverlayUpper(upper, pw, image.IDShift{})) }()
		d, sz, rel, err := b.n.images.AddLayer(pr)
		pr.Close()
		if err != nil {
			return errdefs.Internal(err, "store the step's layer")
		}
		// The record is put below, once the overlay is gone; the hold
		// keeps the layer until then.
		diff, size, release = d, sz, rel
		return nil
	})
	defer release()
	if err != nil {
		return stepErr(err, "line %d: %s", step.Line, step.Command)
	}
	return b.commit(s, key, step.Original, diff, size)
}

// contextTTL is how long an uploaded build context is kept after its
// last upload or use.
const contextTTL = time.Hour

// maxContextBytes bounds an uploaded build context (the tar as sent), so
// one upload cannot fill the node's disk.
const maxContextBytes = 8 << 30

// errContextTooLarge ends the read of a context past maxContextBytes.
var errContextTooLarge = errdefs.Invalid("the build context is larger than %d GiB: leave out what the build does not copy (.dockerignore)", maxContextBytes>>30)

// limitedReader reads at most n bytes of r: past them, it fails with
// errContextTooLarge unless r has ended.
type limitedReader struct {
	r io.Reader
	n int64
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		var b [1]byte
		for {
			k, err := l.r.Read(b[:])
			switch {
			case k > 0:
				return 0, errContextTooLarge
			case err != nil:
				return 0, err
			}
		}
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	k, err := l.r.Read(p)
	l.n -= int64(k)
	return k, err
}

// contextPath is where a project's build context of digest lives.
func (n *Node) contextPath(project, digest string) string {
	h := sha256.Sum256([]byte(project + " " + digest))
	return filepath.Join(n.buildDir("contexts"), hex.EncodeToString(h[:16]))
}

// buildContext returns an uploaded context's directory, marking it used.
func (n *Node) buildContext(project, digest string) (string, error) {
	dir := n.contextPath(project, digest)
	if _, err := os.Stat(dir); err != nil {
		return "", errdefs.NotFound("build context %s not found on node %s (upload it first; contexts are kept an hour)", truncate(digest, 80), n.cfg.Name)
	}
	now := time.Now()
	os.Chtimes(dir, now, now)
	return dir, nil
}

// UploadBuildContext stores a build context (a tar) for the caller's
// project, by the digest of the tar as sent, and removes the contexts no
// upload or build used for contextTTL.
func (n *Node) UploadBuildContext(ctx context.Context, r io.Reader) (_ *dsecv1.BuildContext, err error) {
	defer func(start time.Time) { n.m.Image("context", start, err) }(time.Now())
	if os.Geteuid() != 0 {
		return nil, errdefs.Unavailable("node %s runs unprivileged: builds mount overlays and need root", n.cfg.Name)
	}
	n.removeOldContexts()
	project := tenant.OrDefault(tenant.Project(ctx))
	tmp, err := os.MkdirTemp(n.buildDir("tmp"), "context-")
	if err != nil {
		return nil, errdefs.Internal(err, "create build context directory")
	}
	defer os.RemoveAll(tmp)
	root := filepath.Join(tmp, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, errdefs.Internal(err, "create build context directory")
	}
	digest, size, err := image.ExtractTar(&limitedReader{countingReader{r, n.m.ImageBytes}, maxContextBytes}, root)
	if err != nil {
		if errors.Is(err, errContextTooLarge) {
			return nil, errContextTooLarge
		}
		if errdefs.KindOf(err) == errdefs.KindCanceled || errdefs.KindOf(err) == errdefs.KindDeadlineExceeded {
			return nil, err
		}
		return nil, errdefs.Invalid("read the build context: %v", cleanPathErr(err))
	}
	files := int64(0)
	filepath.WalkDir(root, func(_ string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			files++
		}
		return nil
	})
	dst := n.contextPath(project, digest)
	if err := os.Rename(root, dst); err != nil {
		if _, serr := os.Stat(dst); serr != nil {
			return nil, errdefs.Internal(err, "store the build context")
		}
		now := time.Now()
		os.Chtimes(dst, now, now) // the same context again
	}
	return &dsecv1.BuildContext{Digest: digest, SizeBytes: size, Files: files}, nil
}

// removeOldContexts removes build contexts unused for contextTTL.
func (n *Node) removeOldContexts() {
	dir := n.buildDir("contexts")
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > contextTTL {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}

// PruneImages removes what the node keeps as a cache for the caller (its
// project's; an operator's: every project's and the shared images'): the
// build cache and the copies of other nodes' images no sandbox uses,
// freeing layers no image uses; an operator's also drops the cached
// chunks of layers loaded on demand no sandbox uses.
func (n *Node) PruneImages(ctx context.Context) image.Pruned {
	c := tenant.From(ctx)
	p := n.images.Prune(func(owner string) bool {
		return c.Admin || (owner != tenant.Shared && owner == c.Project)
	}, c.Admin)
	if p.Copies > 0 {
		n.ImagesChanged()
	}
	return p
}
