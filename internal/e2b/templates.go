package e2b

// Template builds: the SDKs' Template.build, Template.buildInBackground,
// Template.getBuildStatus and Template.exists over dsec's own image builds
// (`dsec image build`). The SDK's flow, and what dsec does at each call:
//
//   - POST /v3/templates {name, tags, cpuCount, memoryMB} registers a build
//     of template name ("name" or "name:tag") and answers its templateID
//     (one per project and name, whatever the tag) and a new buildID;
//   - GET /templates/{id}/files/{hash} says whether the files of a COPY
//     step (the SDK's tar of them, named by its hash) are here, with a
//     signed URL to PUT that tar to (served below; no API key, as E2B's
//     presigned storage URLs);
//   - POST /v2/templates/{id}/builds/{buildID} starts the build: its steps
//     become a Dockerfile (FROM the base image or template; COPY from the
//     uploaded files, RUN, ENV, WORKDIR, USER; the start and ready commands
//     as labels), its files one build context, and the node builds the
//     image under the template's name (and each tag's);
//   - GET /templates/{id}/builds/{buildID}/status?logsOffset=N reports the
//     build (building, ready, or error with the failing step, which the SDK
//     maps back to the line of the user's code) and its log from entry N;
//   - GET /templates/aliases/{name} finds a template by name.
//
// Sandbox.create(name) then starts the image (an unknown template ID names
// an image), or Sandbox.create(templateID). A template with a start
// command runs it in each new sandbox, which is answered once the ready
// command succeeds: E2B starts it once at build time and snapshots the
// running sandbox, which a container cannot keep.
//
// Builds run on the server's only node (as `dsec image build` does on a
// cluster of one); the uploads and the template records live in
// Config.TemplateDir, a build's status in this process for an hour after it
// ended.

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
)

const (
	// templateIDPrefix starts the IDs of templates built through the
	// facade.
	templateIDPrefix = "tpl-"
	// maxTemplateUpload bounds one COPY step's tar.
	maxTemplateUpload = 8 << 30
	// uploadURLTTL is how long a signed upload URL is valid.
	uploadURLTTL = time.Hour
	// buildStatusKept is how long a finished build's status is kept.
	buildStatusKept = time.Hour
	// statusLogEntries is the most log entries a status answer carries, as
	// E2B's (the SDK asks again until none are left).
	statusLogEntries = 100
	// filesPrefix is where a COPY step's files sit in the build context:
	// filesPrefix/<hash>/<their paths in the SDK's context directory>.
	filesPrefix = "e2b-files"
	// The labels that keep a template's start and ready commands.
	startCmdLabel = "dev.e2b.start-cmd"
	readyCmdLabel = "dev.e2b.ready-cmd"
	// readyTimeout bounds the wait for a template's ready command at a
	// sandbox's create.
	readyTimeout = 5 * time.Minute
	// E2B's step names around the user's steps (the SDK maps "base" to
	// its FROM and "finalize" to its start command).
	baseStep     = "base"
	finalizeStep = "finalize"
)

// filesHash is the syntax of a COPY step's files hash (the SDK's SHA-256 in
// hex).
var filesHash = regexp.MustCompile(`^[0-9a-f]{16,128}$`)

// E2B's default base image (Template().fromBaseImage(), and the SDK's
// default) and the code interpreter's are what the "base" template
// starts here.
var e2bBaseImages = map[string]bool{"e2bdev/base": true, "e2bdev/base:latest": true, "e2bdev/code-interpreter": true, "e2bdev/code-interpreter:latest": true}

// templateBuilds holds the builds this replica started.
type templateBuilds struct {
	dir string

	mu     sync.Mutex
	builds map[string]*templateBuild // by build ID
}

// templateRecord is a template the facade registered: its owner and name
// (its image's, without the tag), kept in dir/templates/<id>.json.
type templateRecord struct {
	Project string `json:"project"`
	Name    string `json:"name"`
	// Latest is the image its last successful build made (name or
	// name:tag), which its ID starts.
	Latest string `json:"latest,omitempty"`
}

// templateBuild is one build of a template.
type templateBuild struct {
	project, templateID, buildID string
	// image is the name built (the template's name and tag); tags are
	// further names of the same image (name:tag).
	image string
	tags  []string
	cpu   float64
	memMB int64

	mu       sync.Mutex
	status   string // waiting (requested), building, ready, error
	logs     []buildLogJSON
	reason   *buildReasonJSON
	finished time.Time
}

// buildLogJSON is E2B's BuildLogEntry.
type buildLogJSON struct {
	Timestamp string `json:"timestamp"`
	Level     string `json:"level"`
	Message   string `json:"message"`
	Step      string `json:"step,omitempty"`
}

// buildReasonJSON is E2B's BuildStatusReason.
type buildReasonJSON struct {
	Message    string         `json:"message"`
	Step       string         `json:"step,omitempty"`
	LogEntries []buildLogJSON `json:"logEntries"`
}

func (b *templateBuild) log(level, step, msg string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logs = append(b.logs, buildLogJSON{Timestamp: time.Now().UTC().Format(time.RFC3339Nano), Level: level, Message: msg, Step: step})
}

// end marks the build ready, or failed with err at step.
func (b *templateBuild) end(err error, step string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.finished = time.Now()
	if err == nil {
		b.status = "ready"
		return
	}
	b.status = "error"
	tail := b.logs[max(len(b.logs)-20, 0):]
	b.reason = &buildReasonJSON{Message: errdefs.Classify(err).Msg, Step: step, LogEntries: append([]buildLogJSON{}, tail...)}
}

func (f *Facade) mountTemplates(h func(string, func(http.ResponseWriter, *http.Request, string)), handle func(string, http.Handler)) {
	if f.tb == nil {
		return // no Config.TemplateDir: the catch-all answers 501
	}
	h("POST /v3/templates", f.requestBuild)
	h("POST /v2/templates", f.requestBuild)
	h("GET /templates/{id}/files/{hash}", f.templateFiles)
	h("POST /v2/templates/{id}/builds/{build}", f.startBuild)
	h("GET /templates/{id}/builds/{build}/status", f.buildStatus)
	h("GET /templates/aliases/{alias}", f.templateAlias)
	// The signed upload URL: no API key, its signature instead.
	handle("PUT /templates/{id}/files/{hash}/upload", http.HandlerFunc(f.uploadTemplateFiles))
}

// templateID is the ID of project's template name (without its tag).
func (f *Facade) templateID(project, name string) string {
	return templateIDPrefix + f.token("template", project+"\x00"+name)[:20]
}

// splitTag splits "name:tag" (the tag may be empty).
func splitTag(s string) (name, tag string) {
	if i := strings.LastIndexByte(s, ':'); i > 0 && !strings.Contains(s[i:], "/") {
		return s[:i], s[i+1:]
	}
	return s, ""
}

// validTemplateName checks a template name or tag as E2B's API does, in
// dsec's terms: lower-case letters, digits, '.', '_', '-' and '/', at most
// 128 bytes.
var validTemplateName = regexp.MustCompile(`^[a-z0-9][a-z0-9._/-]{0,127}$`)

func (t *templateBuilds) recordPath(id string) string {
	return filepath.Join(t.dir, "templates", id+".json")
}

func (t *templateBuilds) filesPath(project, hash string) string {
	return filepath.Join(t.dir, "files", hex.EncodeToString([]byte(project)), hash+".tar")
}

// record returns template id, if the caller reaches it.
func (f *Facade) templateRecord(ctx context.Context, id string) (*templateRecord, error) {
	b, err := os.ReadFile(f.tb.recordPath(filepath.Base(id)))
	if err != nil || !strings.HasPrefix(id, templateIDPrefix) {
		return nil, errdefs.NotFound("template %s not found", clip(id))
	}
	var rec templateRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, errdefs.Internal(err, "read template %s", clip(id))
	}
	if !tenant.Reaches(ctx, rec.Project) {
		return nil, errdefs.NotFound("template %s not found", clip(id))
	}
	return &rec, nil
}

// templateImage is the image template ID id starts, if it is one of the
// caller's.
func (f *Facade) templateImage(ctx context.Context, id string) (string, bool) {
	if f.tb == nil || !strings.HasPrefix(id, templateIDPrefix) {
		return "", false
	}
	rec, err := f.templateRecord(ctx, id)
	if err != nil {
		return "", false
	}
	if rec.Latest != "" {
		return rec.Latest, true
	}
	return rec.Name, true
}

// requestBuild is POST /v3/templates (and /v2/templates, whose body names
// the template "alias").
func (f *Facade) requestBuild(w http.ResponseWriter, r *http.Request, project string) {
	var in struct {
		Name     string   `json:"name"`
		Alias    string   `json:"alias"`
		Tags     []string `json:"tags"`
		CPUCount float64  `json:"cpuCount"`
		MemoryMB int64    `json:"memoryMB"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	full := in.Name
	if full == "" {
		full = in.Alias
	}
	name, tag := splitTag(full)
	if !validTemplateName.MatchString(name) || tag != "" && !validTemplateName.MatchString(tag) {
		apiError(w, errdefs.Invalid("template name %q: use lower-case letters, digits, '.', '_', '-' and '/' (at most 128), and optionally :tag", clip(full)))
		return
	}
	if _, ok := f.cfg.Templates[name]; ok {
		apiError(w, errdefs.Conflict("template %s is one of the server's own", name))
		return
	}
	for _, t := range in.Tags {
		if !validTemplateName.MatchString(t) {
			apiError(w, errdefs.Invalid("tag %q: use lower-case letters, digits, '.', '_', '-' and '/'", clip(t)))
			return
		}
	}
	id := f.templateID(project, name)
	record := templateRecord{Project: project, Name: name}
	if old, err := f.templateRecord(r.Context(), id); err == nil {
		record.Latest = old.Latest
	}
	rec, _ := json.Marshal(record)
	if err := writeFileAtomic(f.tb.recordPath(id), rec); err != nil {
		apiError(w, errdefs.Internal(err, "record the template"))
		return
	}
	b := &templateBuild{project: project, templateID: id, buildID: newBuildID(), image: full, cpu: in.CPUCount, memMB: in.MemoryMB, status: "waiting"}
	for _, t := range in.Tags {
		b.tags = append(b.tags, name+":"+t)
	}
	f.tb.add(b)
	tags := append([]string{}, in.Tags...)
	if tag != "" {
		tags = append([]string{tag}, tags...)
	}
	writeJSON(w, http.StatusAccepted, map[string]any{
		"templateID": id, "buildID": b.buildID, "names": []string{name}, "aliases": []string{name},
		"tags": tags, "public": false,
	})
}

func newBuildID() string {
	var b [16]byte
	rand.Read(b[:])
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

func (t *templateBuilds) add(b *templateBuild) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, old := range t.builds {
		old.mu.Lock()
		gone := !old.finished.IsZero() && time.Since(old.finished) > buildStatusKept
		old.mu.Unlock()
		if gone {
			delete(t.builds, id)
		}
	}
	t.builds[b.buildID] = b
}

// build returns build buildID of template id, if the caller reaches it.
func (f *Facade) templateBuild(ctx context.Context, id, buildID string) (*templateBuild, error) {
	f.tb.mu.Lock()
	b := f.tb.builds[buildID]
	f.tb.mu.Unlock()
	if b == nil || b.templateID != id || !tenant.Reaches(ctx, b.project) {
		return nil, errdefs.NotFound("build %s of template %s not found (a build's status is kept by the server that started it, for an hour after it ended)", clip(buildID), clip(id))
	}
	return b, nil
}

// templateFiles is GET /templates/{id}/files/{hash}: whether a COPY step's
// files are here, and where to PUT them.
func (f *Facade) templateFiles(w http.ResponseWriter, r *http.Request, _ string) {
	id, hash := r.PathValue("id"), r.PathValue("hash")
	rec, err := f.templateRecord(r.Context(), id)
	if err != nil {
		apiError(w, err)
		return
	}
	if !filesHash.MatchString(hash) {
		apiError(w, errdefs.Invalid("files hash %q is not a hex digest", clip(hash)))
		return
	}
	_, err = os.Stat(f.tb.filesPath(rec.Project, hash))
	exp := strconv.FormatInt(time.Now().Add(uploadURLTTL).Unix(), 10)
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	url := fmt.Sprintf("%s://%s/templates/%s/files/%s/upload?expires=%s&signature=%s", scheme, r.Host, id, hash, exp, f.uploadSignature(id, hash, exp))
	writeJSON(w, http.StatusCreated, map[string]any{"present": err == nil, "url": url})
}

func (f *Facade) uploadSignature(id, hash, exp string) string {
	return f.token("template-upload", id+"\x00"+hash+"\x00"+exp)
}

// uploadTemplateFiles is the signed upload URL: PUT a COPY step's tar
// (gzipped or not).
func (f *Facade) uploadTemplateFiles(w http.ResponseWriter, r *http.Request) {
	id, hash := r.PathValue("id"), r.PathValue("hash")
	q := r.URL.Query()
	exp, err := strconv.ParseInt(q.Get("expires"), 10, 64)
	if err != nil || !equal(q.Get("signature"), f.uploadSignature(id, hash, q.Get("expires"))) {
		apiError(w, errdefs.PermissionDenied("the upload URL's signature does not match"))
		return
	}
	if time.Now().Unix() > exp {
		apiError(w, errdefs.PermissionDenied("the upload URL expired"))
		return
	}
	b, err := os.ReadFile(f.tb.recordPath(filepath.Base(id)))
	var rec templateRecord
	if err != nil || json.Unmarshal(b, &rec) != nil || !filesHash.MatchString(hash) {
		apiError(w, errdefs.NotFound("template %s not found", clip(id)))
		return
	}
	dst := f.tb.filesPath(rec.Project, hash)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		apiError(w, errdefs.Internal(err, "store the files"))
		return
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), hash+".*.tmp")
	if err != nil {
		apiError(w, errdefs.Internal(err, "store the files"))
		return
	}
	defer os.Remove(tmp.Name())
	n, err := io.Copy(tmp, io.LimitReader(r.Body, maxTemplateUpload+1))
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		apiError(w, errdefs.Unavailable("receive the files: %v", err))
		return
	case n > maxTemplateUpload:
		apiError(w, errdefs.Invalid("the files' tar is larger than %d bytes", int64(maxTemplateUpload)))
		return
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		apiError(w, errdefs.Internal(err, "store the files"))
		return
	}
	w.WriteHeader(http.StatusOK)
}

// templateStep is E2B's TemplateStep.
type templateStep struct {
	Type      string   `json:"type"`
	Args      []string `json:"args"`
	FilesHash string   `json:"filesHash"`
	Force     bool     `json:"force"`
}

// buildStart is E2B's TemplateBuildStartV2.
type buildStart struct {
	Force             bool            `json:"force"`
	FromImage         string          `json:"fromImage"`
	FromImageRegistry json.RawMessage `json:"fromImageRegistry"`
	FromTemplate      string          `json:"fromTemplate"`
	StartCmd          string          `json:"startCmd"`
	ReadyCmd          string          `json:"readyCmd"`
	Steps             []templateStep  `json:"steps"`
}

// startBuild is POST /v2/templates/{id}/builds/{build}.
func (f *Facade) startBuild(w http.ResponseWriter, r *http.Request, _ string) {
	ctx := r.Context()
	b, err := f.templateBuild(ctx, r.PathValue("id"), r.PathValue("build"))
	if err != nil {
		apiError(w, err)
		return
	}
	var in buildStart
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	base, err := f.baseImage(ctx, &in)
	if err != nil {
		apiError(w, err)
		return
	}
	plan, err := planBuild(&in, base, f.imageUser(ctx, base))
	if err != nil {
		apiError(w, err)
		return
	}
	for _, h := range plan.hashes {
		if _, err := os.Stat(f.tb.filesPath(b.project, h)); err != nil {
			apiError(w, errdefs.Invalid("the files of hash %s were not uploaded (GET /templates/%s/files/%s gives the URL)", h, b.templateID, h))
			return
		}
	}
	b.mu.Lock()
	if b.status != "waiting" {
		b.mu.Unlock()
		apiError(w, errdefs.Conflict("build %s was started already", b.buildID))
		return
	}
	b.status = "building"
	b.mu.Unlock()
	go f.runBuild(tenant.With(context.WithoutCancel(ctx), tenant.From(ctx)), b, plan, in.Force)
	w.WriteHeader(http.StatusAccepted)
}

// buildPlan is a template build as dsec builds it.
type buildPlan struct {
	dockerfile string
	// hashes are the COPY steps' files, each once, in order.
	hashes []string
	// steps names each Dockerfile instruction after FROM by the E2B step
	// it comes from ("1" for the first of the template's steps).
	steps []string
}

// baseImage is the image a build starts from: its fromImage (E2B's base
// images are the "base" template's), or its fromTemplate's image.
func (f *Facade) baseImage(ctx context.Context, in *buildStart) (string, error) {
	if present(in.FromImageRegistry) {
		return "", errdefs.Invalid("fromImageRegistry: dsec builds from the images its node holds (pull or build the base image first); registry credentials are not supported")
	}
	switch {
	case in.FromTemplate != "" && in.FromImage != "":
		return "", errdefs.Invalid("give fromImage or fromTemplate, not both")
	case in.FromTemplate != "":
		if img, ok := f.templateImage(ctx, in.FromTemplate); ok {
			return img, nil
		}
		if t, ok := f.cfg.Templates[in.FromTemplate]; ok {
			return t.Image, nil
		}
		return in.FromTemplate, nil
	case in.FromImage == "" || e2bBaseImages[in.FromImage]:
		if t, ok := f.cfg.Templates["base"]; ok {
			return t.Image, nil
		}
		return "base", nil
	}
	return in.FromImage, nil
}

// planBuild turns a build's steps into a Dockerfile FROM base, whose user
// is user.
func planBuild(in *buildStart, base, user string) (*buildPlan, error) {
	if !oneLine(base) || strings.ContainsAny(base, " \t$") {
		return nil, errdefs.Invalid("base image %q is not an image name", clip(base))
	}
	p := &buildPlan{}
	var df strings.Builder
	fmt.Fprintf(&df, "FROM %s\n", base)
	add := func(step, line string) {
		df.WriteString(line + "\n")
		p.steps = append(p.steps, step)
	}
	seen := map[string]bool{}
	for i, s := range in.Steps {
		step := strconv.Itoa(i + 1)
		switch s.Type {
		case "COPY":
			if len(s.Args) < 2 || s.Args[0] == "" || s.Args[1] == "" {
				return nil, errdefs.Invalid("step %s: COPY needs a source and a destination", step)
			}
			if !filesHash.MatchString(s.FilesHash) {
				return nil, errdefs.Invalid("step %s: COPY without a files hash", step)
			}
			if !seen[s.FilesHash] {
				seen[s.FilesHash] = true
				p.hashes = append(p.hashes, s.FilesHash)
			}
			src := pathClean(s.Args[0])
			if src == "" || strings.ContainsAny(s.Args[0]+s.Args[1], "$\r\n") {
				// (The builder expands variables in COPY's words.)
				return nil, errdefs.Invalid("step %s: COPY %q %q: a source inside the context directory, and no '$' or line breaks", step, clip(s.Args[0]), clip(s.Args[1]))
			}
			line := "COPY"
			if len(s.Args) > 2 && s.Args[2] != "" {
				line += " --chown=" + s.Args[2]
			}
			if len(s.Args) > 3 && s.Args[3] != "" {
				if _, err := strconv.ParseUint(s.Args[3], 8, 32); err != nil {
					return nil, errdefs.Invalid("step %s: COPY mode %q is not octal", step, clip(s.Args[3]))
				}
				line += " --chmod=" + s.Args[3]
			}
			from, dest := filesPrefix+"/"+s.FilesHash+"/"+src, s.Args[1]
			if i := strings.IndexAny(src, "*?["); i >= 0 {
				// A pattern copies what it matches into a directory
				// (E2B's copy('dir/*', 'dir')). The uploaded tar holds
				// just the matches, so the directory above the pattern is
				// copied whole: its symbolic links stay links (a
				// Dockerfile's COPY would follow each match that is one,
				// and fail on a dangling one, which E2B copies).
				from = filesPrefix + "/" + s.FilesHash + "/" + src[:strings.LastIndexByte("/"+src[:i], '/')]
				from = strings.TrimSuffix(from, "/") + "/"
				dest = strings.TrimSuffix(dest, "/") + "/"
			}
			add(step, line+" "+jsonArray(from, dest))
		case "RUN":
			if len(s.Args) < 1 || strings.TrimSpace(s.Args[0]) == "" {
				return nil, errdefs.Invalid("step %s: RUN needs a command", step)
			}
			// E2B runs a step's command as its user, if it names one, and
			// the template's user stays.
			as := ""
			if len(s.Args) > 1 {
				as = s.Args[1]
			}
			if as != "" && as != user {
				add(step, "USER "+as)
			}
			add(step, "RUN "+jsonArray("/bin/sh", "-c", `if command -v bash >/dev/null 2>&1; then exec bash -c "$0"; fi; exec sh -c "$0"`, s.Args[0]))
			if as != "" && as != user {
				add(step, "USER "+user)
			}
		case "ENV":
			if len(s.Args) == 0 || len(s.Args)%2 != 0 {
				return nil, errdefs.Invalid("step %s: ENV needs names and values in pairs", step)
			}
			line := "ENV"
			for j := 0; j < len(s.Args); j += 2 {
				v, err := dockerQuote(s.Args[j+1])
				if err != nil || !envName.MatchString(s.Args[j]) {
					return nil, errdefs.Invalid("step %s: ENV %q: a name of letters, digits and '_' and a value of one line", step, clip(s.Args[j]))
				}
				line += " " + s.Args[j] + "=" + v
			}
			add(step, line)
		case "WORKDIR":
			if len(s.Args) != 1 || s.Args[0] == "" {
				return nil, errdefs.Invalid("step %s: WORKDIR needs one directory", step)
			}
			dir, err := dockerQuote(s.Args[0])
			if err != nil {
				return nil, errdefs.Invalid("step %s: WORKDIR %q: %v", step, clip(s.Args[0]), err)
			}
			add(step, "WORKDIR "+dir)
		case "USER":
			if len(s.Args) != 1 || !validUser.MatchString(s.Args[0]) {
				return nil, errdefs.Invalid("step %s: USER needs one user name", step)
			}
			user = s.Args[0]
			add(step, "USER "+user)
		default:
			return nil, errdefs.Invalid("step %s: %q steps are not supported (COPY, RUN, ENV, WORKDIR, USER are)", step, clip(s.Type))
		}
	}
	if in.StartCmd != "" || in.ReadyCmd != "" {
		var labels []string
		for _, kv := range [][2]string{{startCmdLabel, in.StartCmd}, {readyCmdLabel, in.ReadyCmd}} {
			k, v := kv[0], kv[1]
			if v == "" {
				continue
			}
			q, err := dockerQuote(v)
			if err != nil {
				return nil, errdefs.Invalid("the start and ready commands must be one line each")
			}
			labels = append(labels, k+"="+q)
		}
		add(finalizeStep, "LABEL "+strings.Join(labels, " "))
	}
	p.dockerfile = df.String()
	return p, nil
}

var (
	envName   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	validUser = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$`)
)

// imageUser is the user an image runs as ("root" when it names none or
// cannot be found: the build then fails at FROM anyway).
func (f *Facade) imageUser(ctx context.Context, name string) string {
	for _, n := range f.r.Nodes(ctx) {
		if img, err := n.Image(ctx, name); err == nil {
			if u := img.GetConfig().GetUser(); u != "" {
				return u
			}
			return "root"
		}
	}
	return "root"
}

func pathClean(p string) string { return filepath.ToSlash(filepath.Clean("/" + p))[1:] }

func oneLine(s string) bool { return !strings.ContainsAny(s, "\r\n") }

// jsonArray is a Dockerfile exec-form array of args (RUN's are not
// expanded; COPY's are, so its callers refuse '$').
func jsonArray(args ...string) string {
	var b strings.Builder
	e := json.NewEncoder(&b)
	e.SetEscapeHTML(false)
	e.Encode(args)
	return strings.TrimSpace(b.String())
}

// dockerQuote is v as one double-quoted Dockerfile word, unexpanded.
func dockerQuote(v string) (string, error) {
	if !oneLine(v) {
		return "", errors.New("a value of several lines")
	}
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, `$`, `\$`)
	return `"` + r.Replace(v) + `"`, nil
}

// runBuild builds b as planned, on the server's only node.
func (f *Facade) runBuild(ctx context.Context, b *templateBuild, p *buildPlan, force bool) {
	step := baseStep
	err := func() error {
		nodes := f.r.Nodes(ctx)
		if len(nodes) != 1 {
			return errdefs.Unimplemented("template builds need a server of one node (this cluster has %d): build with `dsec image build` on one node and push the image to a registry the cluster pulls from", len(nodes))
		}
		n := nodes[0]
		b.log("info", baseStep, "Building the template's image with dsec (Dockerfile below)")
		for _, l := range strings.Split(strings.TrimSpace(p.dockerfile), "\n") {
			b.log("debug", baseStep, l)
		}
		digest := ""
		if len(p.hashes) > 0 {
			pr, pw := io.Pipe()
			go func() { pw.CloseWithError(f.tb.writeContext(pw, b.project, p.hashes)) }()
			c, err := n.UploadContext(ctx, &dsecv1.UploadBuildContextHeader{}, pr)
			pr.CloseWithError(errors.New("the upload ended"))
			if err != nil {
				return fmt.Errorf("upload the template's files: %w", err)
			}
			digest = c.GetDigest()
		}
		req := &dsecv1.BuildImageRequest{Name: b.image, Dockerfile: p.dockerfile, ContextDigest: digest, NoCache: force, Network: "egress"}
		if b.cpu > 0 || b.memMB > 0 {
			req.Resources = &dsecv1.Resources{Cpu: b.cpu, MemoryMb: b.memMB}
		}
		progress := func(pr *dsecv1.ImageProgress) {
			if s := int(pr.GetStep()); s >= 2 && s-2 < len(p.steps) {
				step = p.steps[s-2] // the builder's step 1 is the FROM
			}
			msg := strings.TrimRight(pr.GetMessage(), "\n")
			if msg == "" {
				return
			}
			if pr.GetCached() {
				msg += " (cached)"
			}
			b.log("info", step, msg)
		}
		if _, err := n.Build(ctx, req, progress); err != nil {
			return err
		}
		for _, tag := range b.tags {
			req.Name, req.NoCache = tag, false // the same steps: every one cached
			if _, err := n.Build(ctx, req, progress); err != nil {
				return fmt.Errorf("tag %s: %w", tag, err)
			}
		}
		step = finalizeStep
		name, _ := splitTag(b.image)
		rec, _ := json.Marshal(templateRecord{Project: b.project, Name: name, Latest: b.image})
		if err := writeFileAtomic(f.tb.recordPath(b.templateID), rec); err != nil {
			return errdefs.Internal(err, "record the template")
		}
		b.log("info", finalizeStep, "Template "+b.image+" is ready")
		return nil
	}()
	if err != nil {
		if errwire.Classified(err) {
			err = errwire.FromConnect(err) // the node's answer
		}
		f.log.Info("template build failed", slog.String("template", b.image), slog.String("build_id", b.buildID), slog.Any("error", err))
		b.log("error", step, errdefs.Classify(err).Msg)
	}
	b.end(err, step)
}

// writeContext writes the build context of a template build: each COPY
// step's files under filesPrefix/<hash>/.
func (t *templateBuilds) writeContext(w io.Writer, project string, hashes []string) error {
	tw := tar.NewWriter(w)
	for _, h := range hashes {
		if err := t.copyFiles(tw, project, h); err != nil {
			return fmt.Errorf("the files of hash %s: %w", h, err)
		}
	}
	return tw.Close()
}

func (t *templateBuilds) copyFiles(tw *tar.Writer, project, hash string) error {
	f, err := os.Open(t.filesPath(project, hash))
	if err != nil {
		return err
	}
	defer f.Close()
	br := bufio.NewReader(f)
	var r io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return err
		}
		defer zr.Close()
		r = zr
	}
	tr := tar.NewReader(r)
	dirs := map[string]bool{}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		name := pathClean(hdr.Name)
		if name == "" || name == ".." || strings.HasPrefix(name, "../") {
			continue
		}
		// The SDK's tar lists the files it matched, not always their
		// directories: make each parent, as a context directory has.
		for d := filepath.Dir(name); d != "." && !dirs[d]; d = filepath.Dir(d) {
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: filesPrefix + "/" + hash + "/" + d + "/", Mode: 0o755, ModTime: hdr.ModTime}); err != nil {
				return err
			}
		}
		if hdr.Typeflag == tar.TypeDir {
			if dirs[name] {
				continue
			}
			dirs[name] = true
		}
		hdr.Name = filesPrefix + "/" + hash + "/" + name
		if hdr.Typeflag == tar.TypeLink {
			hdr.Linkname = filesPrefix + "/" + hash + "/" + pathClean(hdr.Linkname)
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if _, err := io.Copy(tw, tr); err != nil {
			return err
		}
	}
}

// buildStatus is GET /templates/{id}/builds/{build}/status.
func (f *Facade) buildStatus(w http.ResponseWriter, r *http.Request, _ string) {
	b, err := f.templateBuild(r.Context(), r.PathValue("id"), r.PathValue("build"))
	if err != nil {
		apiError(w, err)
		return
	}
	offset := 0
	if s := r.URL.Query().Get("logsOffset"); s != "" {
		if offset, err = strconv.Atoi(s); err != nil || offset < 0 {
			apiError(w, errdefs.Invalid("logsOffset %q is not a count", clip(s)))
			return
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	entries := []buildLogJSON{}
	if offset < len(b.logs) {
		entries = b.logs[offset:min(len(b.logs), offset+statusLogEntries)]
	}
	lines := make([]string, len(entries))
	for i, e := range entries {
		lines[i] = "[" + e.Timestamp + "] " + e.Message
	}
	out := map[string]any{"buildID": b.buildID, "templateID": b.templateID, "status": b.status, "logEntries": entries, "logs": lines}
	if b.reason != nil {
		out["reason"] = b.reason
	}
	writeJSON(w, http.StatusOK, out)
}

// templateAlias is GET /templates/aliases/{alias}: the template of that
// name, if the caller has one (or the server's own).
func (f *Facade) templateAlias(w http.ResponseWriter, r *http.Request, project string) {
	alias := r.PathValue("alias")
	if _, ok := f.cfg.Templates[alias]; ok {
		writeJSON(w, http.StatusOK, map[string]any{"templateID": alias, "public": true})
		return
	}
	name, _ := splitTag(alias)
	id := f.templateID(project, name)
	if _, err := f.templateRecord(r.Context(), id); err == nil && f.isImage(r, alias) {
		writeJSON(w, http.StatusOK, map[string]any{"templateID": id, "public": false})
		return
	}
	apiError(w, errdefs.NotFound("template %s not found", clip(alias)))
}

// startTemplateCommand runs the start command of sandbox id's image, if it
// has one, in the background, and returns once its ready command succeeds
// (E2B's templates start it before they are snapshotted).
func (f *Facade) startTemplateCommand(ctx context.Context, n apiserver.Node, id, image string) error {
	img, err := n.Image(ctx, image)
	if err != nil {
		return nil // a snapshot, or an image that went: nothing to start
	}
	labels := img.GetConfig().GetLabels()
	start, ready := labels[startCmdLabel], labels[readyCmdLabel]
	if start == "" {
		return nil
	}
	started := errors.New("started")
	err = n.ExecEvents(ctx, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"/bin/sh", "-c", start}, TimeoutS: maxExecTimeoutS, Tag: internalTag + "start"},
		func(ev *dsecv1.ExecEvent) error {
			if _, ok := ev.Event.(*dsecv1.ExecEvent_Started); ok {
				return started // it runs on without this stream
			}
			return nil
		})
	if err != nil && !errors.Is(err, started) {
		return fmt.Errorf("the template's start command: %w", err)
	}
	if ready == "" {
		return nil
	}
	deadline := time.Now().Add(readyTimeout)
	for {
		res, err := apiserver.Do(ctx, n, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"/bin/sh", "-c", ready}, TimeoutS: 60}, apiserver.Node.Exec)
		if err != nil {
			return fmt.Errorf("the template's ready command: %w", err)
		}
		if res.ExitCode == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errdefs.New(errdefs.KindDeadlineExceeded, "the template's ready command %q did not succeed in %v (last exit %d)", clip(ready), readyTimeout, res.ExitCode)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// writeFileAtomic writes b to path through a temporary file.
func writeFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// startTemplate runs a new sandbox's template start command (see
// startTemplateCommand); if it fails, the sandbox is deleted, as a create
// that failed leaves none.
func (f *Facade) startTemplate(ctx context.Context, id, image string) error {
	n, err := f.r.ForSandbox(ctx, id)
	if err != nil {
		return err
	}
	if err := f.startTemplateCommand(ctx, n, id, image); err != nil {
		apiserver.Do(context.WithoutCancel(ctx), n, &dsecv1.DeleteSandboxRequest{Id: id}, apiserver.Node.DeleteSandbox)
		return err
	}
	return nil
}
