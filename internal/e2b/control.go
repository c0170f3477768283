package e2b

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
)

// The control plane: E2B's REST API (api.e2b.app), authenticated with
// X-API-Key against dsec's API keys.

const (
	// labelPrefix marks labels the facade keeps for itself; metadata keys
	// may not use it.
	labelPrefix = "e2b.dev/"
	// templateLabel remembers the template ID a sandbox was created from.
	templateLabel = labelPrefix + "template"
	// metadataLabel holds, as a JSON object, the metadata whose keys cannot
	// be label keys (E2B allows any string).
	metadataLabel = labelPrefix + "metadata"
	// maxLabelValue is the node's limit on a label value.
	maxLabelValue = 1024
	// clientID is the required, deprecated clientID field.
	clientID = "dsec"
	// maxBody bounds control-plane request bodies.
	maxBody = 1 << 20
	// Create defaults, in seconds: v2 (POST /v2/sandboxes) and the
	// deprecated v1 (POST /sandboxes).
	defaultTimeoutV2 = 300
	defaultTimeoutV1 = 15
	// maxTimeoutS bounds a timeout before it becomes a Duration (which it
	// would overflow); the node refuses more than its own maximum TTL.
	maxTimeoutS = 1 << 32
	// metricsWindow is how long GET /sandboxes/{id}/metrics watches the
	// sandbox's CPU time to report its current CPU use.
	metricsWindow = 200 * time.Millisecond
)

var kinds = map[string]bool{"container": true, "microvm": true, "vm": true}

// labelKey is the node's label key syntax: metadata with such keys become
// labels of their own, which native label selectors can use.
var labelKey = regexp.MustCompile(`^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)

func (f *Facade) mountControl(handle func(string, http.Handler)) {
	h := func(pattern string, fn func(http.ResponseWriter, *http.Request, string)) {
		handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			caller, ok := f.auth(r.Header)
			if !ok {
				apiError(w, errdefs.Unauthenticated("missing or unknown API key: set E2B_API_KEY to a dsec API key"))
				return
			}
			// Every call the handler makes acts for the caller: another
			// project's sandboxes are not found.
			fn(w, r.WithContext(tenant.With(r.Context(), caller)), caller.Project)
		}))
	}
	h("POST /v2/sandboxes", func(w http.ResponseWriter, r *http.Request, p string) { f.create(w, r, p, defaultTimeoutV2) })
	h("POST /sandboxes", func(w http.ResponseWriter, r *http.Request, p string) { f.create(w, r, p, defaultTimeoutV1) })
	h("GET /v2/sandboxes", f.list)
	h("GET /sandboxes", f.listV1)
	h("GET /sandboxes/{id}", f.get)
	h("DELETE /sandboxes/{id}", f.kill)
	h("POST /sandboxes/{id}/timeout", f.setTimeout)
	h("POST /sandboxes/{id}/refreshes", f.refresh)
	h("POST /sandboxes/{id}/pause", f.pause)
	h("POST /sandboxes/{id}/resume", f.resume)
	h("POST /sandboxes/{id}/connect", f.connect)
	h("POST /v2/sandboxes/{id}/connect", f.connect)
	h("GET /sandboxes/{id}/metrics", f.metrics)
	h("POST /sandboxes/{id}/fork", f.fork)
	h("PUT /sandboxes/{id}/network", f.updateNetwork)
	f.mountSnapshots(h)
	f.mountWebhooks(h)
	f.mountTemplates(h, handle)
	unsupported := func(w http.ResponseWriter, r *http.Request, _ string) {
		apiError(w, errdefs.Unimplemented("%s %s is not supported by dsec's E2B facade (see docs/e2b.md)", r.Method, r.URL.Path))
	}
	h("/sandboxes/", unsupported)
	h("/v2/sandboxes/", unsupported)
	h("/snapshots", unsupported)
	h("/templates/", unsupported)
}

// newSandbox is the body of POST /v2/sandboxes (NewSandboxV2) and of the
// deprecated POST /sandboxes (NewSandbox).
type newSandbox struct {
	TemplateID string            `json:"templateID"`
	Timeout    *int64            `json:"timeout"`
	Metadata   map[string]string `json:"metadata"`
	EnvVars    map[string]string `json:"envVars"`
	AutoPause  *bool             `json:"autoPause"`
	AutoResume *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume"`
	AutoPauseMemory     *bool           `json:"autoPauseMemory"`
	AllowInternetAccess *bool           `json:"allow_internet_access"`
	Network             *networkJSON    `json:"network"`
	MCP                 json.RawMessage `json:"mcp"`
	IAM                 json.RawMessage `json:"iam"`
	VolumeMounts        json.RawMessage `json:"volumeMounts"`
}

// sandboxJSON is E2B's Sandbox (create and connect answers).
type sandboxJSON struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken string  `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

// detailJSON is E2B's SandboxDetail and, without the token, ListedSandbox.
type detailJSON struct {
	SandboxID       string            `json:"sandboxID"`
	TemplateID      string            `json:"templateID"`
	ClientID        string            `json:"clientID"`
	CPUCount        int               `json:"cpuCount"`
	MemoryMB        int64             `json:"memoryMB"`
	DiskSizeMB      int64             `json:"diskSizeMB"`
	EnvdVersion     string            `json:"envdVersion"`
	StartedAt       string            `json:"startedAt"`
	EndAt           string            `json:"endAt"`
	State           string            `json:"state"`
	Metadata        map[string]string `json:"metadata"`
	EnvdAccessToken string            `json:"envdAccessToken,omitempty"`
	Domain          *string           `json:"domain,omitempty"`
	Lifecycle       *lifecycleJSON    `json:"lifecycle,omitempty"`
	VolumeMounts    []volumeMountJSON `json:"volumeMounts,omitempty"`
}

func decode(r *http.Request, v any) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return errdefs.Invalid("read body: %v", err)
	}
	if len(b) > maxBody {
		return errdefs.Invalid("body larger than %d bytes", maxBody)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return errdefs.Invalid("body is not valid JSON for this call: %v", err)
	}
	return nil
}

// present reports whether an optional JSON field carries a value.
func present(m json.RawMessage) bool {
	s := strings.TrimSpace(string(m))
	return s != "" && s != "null" && s != "{}" && s != "[]"
}

// spec turns a create body into a sandbox spec.
func (f *Facade) spec(in *newSandbox, defaultTimeout int64) (*dsecv1.SandboxSpec, error) {
	switch {
	case present(in.IAM):
		return nil, errdefs.Invalid("IAM tokens are not supported")
	}
	mounts, err := parseVolumeMounts(in.VolumeMounts)
	if err != nil {
		return nil, err
	}
	tpl := in.TemplateID
	if tpl == "" {
		tpl = "base"
	}
	if len(tpl) > 256 {
		return nil, errdefs.Invalid("templateID longer than 256 bytes")
	}
	spec := &dsecv1.SandboxSpec{Env: in.EnvVars, Labels: map[string]string{templateLabel: tpl}, Resources: &dsecv1.Resources{}, Volumes: mounts}
	name := tpl
	if k, rest, ok := strings.Cut(tpl, "/"); ok && kinds[k] {
		spec.Kind, name = k, rest
	}
	if t, ok := f.cfg.Templates[name]; ok {
		spec.Image = t.Image
		if spec.Kind == "" {
			spec.Kind = t.Kind
		}
		if spec.Kind == "" {
			spec.Kind = f.cfg.DefaultKind
		}
		if img, ok := t.KindImages[spec.Kind]; ok {
			spec.Image = img
		}
		spec.Resources.Cpu, spec.Resources.MemoryMb = t.CPU, t.MemoryMB
	} else if isSnapshotID(name) {
		// A snapshot starts sandboxes of the kind it was taken from
		// (the node's default for file system snapshots: container).
		spec.Snapshot = name
	} else {
		spec.Image = name
	}
	if spec.Kind == "" && spec.Snapshot == "" {
		spec.Kind = f.cfg.DefaultKind
	}
	timeout := defaultTimeout
	if in.Timeout != nil {
		timeout = *in.Timeout
	}
	if timeout < 1 {
		return nil, errdefs.Invalid("timeout must be at least 1 second")
	}
	spec.TtlS = timeout
	other := map[string]string{}
	for k, v := range in.Metadata {
		switch {
		case strings.HasPrefix(k, labelPrefix) || strings.HasPrefix(k, "dsec.io/"):
			return nil, errdefs.Invalid("metadata key %q: the %s and dsec.io/ prefixes are reserved", clip(k), labelPrefix)
		case labelKey.MatchString(k):
			spec.Labels[k] = v
		default:
			other[k] = v
		}
	}
	if len(other) > 0 {
		b, _ := json.Marshal(other)
		if len(b) > maxLabelValue {
			return nil, errdefs.Invalid("metadata with keys that are not label keys ([prefix/]name of letters, digits, '-', '_', '.') must fit in %d bytes of JSON", maxLabelValue)
		}
		spec.Labels[metadataLabel] = string(b)
	}
	if err := lifecycleSpec(in, spec); err != nil {
		return nil, err
	}
	nw, err := f.createNetwork(in.AllowInternetAccess, in.Network)
	if err != nil {
		return nil, err
	}
	spec.Network = nw
	if err := portLabels(in.Network, spec.Labels); err != nil {
		return nil, err
	}
	return spec, nil
}

func (f *Facade) create(w http.ResponseWriter, r *http.Request, project string, defaultTimeout int64) {
	var in newSandbox
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	spec, err := f.spec(&in, defaultTimeout)
	if err != nil {
		apiError(w, err)
		return
	}
	if img, ok := f.templateImage(r.Context(), spec.Image); ok {
		spec.Image = img // a template built here, by its ID
	}
	sb, err := f.r.Create(r.Context(), &dsecv1.CreateSandboxRequest{Spec: spec, Project: project})
	if err != nil {
		apiError(w, withBootstrapHint(err, spec.Image))
		return
	}
	if _, builtIn := f.cfg.Templates[in.TemplateID]; f.tb != nil && spec.Image != "" && !builtIn && in.TemplateID != "" {
		// A template built here may have a start command.
		if err := f.startTemplate(r.Context(), sb.Id, spec.Image); err != nil {
			apiError(w, err)
			return
		}
	}
	writeJSON(w, http.StatusCreated, f.sandboxJSON(sb))
}

func (f *Facade) domain() *string {
	if f.cfg.Domain == "" {
		return nil
	}
	d := f.cfg.Domain
	return &d
}

func templateOf(sb *dsecv1.Sandbox) string {
	if t := sb.GetSpec().GetLabels()[templateLabel]; t != "" {
		return t
	}
	return sb.GetSpec().GetImage()
}

func (f *Facade) sandboxJSON(sb *dsecv1.Sandbox) sandboxJSON {
	return sandboxJSON{
		SandboxID: sb.Id, TemplateID: templateOf(sb), ClientID: clientID, EnvdVersion: EnvdVersion,
		EnvdAccessToken: f.AccessToken(sb.Id), TrafficAccessToken: f.TrafficToken(sb.Id), Domain: f.domain(),
	}
}

// metadata is a sandbox's E2B metadata: its labels without the reserved
// ones, and the metadata kept in metadataLabel.
func metadata(labels map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range labels {
		if !strings.HasPrefix(k, labelPrefix) && !strings.HasPrefix(k, "dsec.io/") {
			out[k] = v
		}
	}
	if b := labels[metadataLabel]; b != "" {
		var other map[string]string
		if json.Unmarshal([]byte(b), &other) == nil {
			for k, v := range other {
				out[k] = v
			}
		}
	}
	return out
}

func (f *Facade) detailJSON(sb *dsecv1.Sandbox, withToken bool) detailJSON {
	res := sb.GetSpec().GetResources()
	d := detailJSON{
		SandboxID: sb.Id, TemplateID: templateOf(sb), ClientID: clientID,
		CPUCount: int(math.Ceil(res.GetCpu())), MemoryMB: res.GetMemoryMb(), DiskSizeMB: res.GetDiskMb(),
		EnvdVersion: EnvdVersion,
		StartedAt:   sb.GetCreatedAt().AsTime().UTC().Format(time.RFC3339Nano),
		EndAt:       sb.GetExpiresAt().AsTime().UTC().Format(time.RFC3339Nano),
		State:       sb.GetState(), Metadata: metadata(sb.GetSpec().GetLabels()),
		VolumeMounts: volumeMountsJSON(sb.GetSpec()),
	}
	if withToken {
		d.Lifecycle = lifecycleOf(sb)
		d.EnvdAccessToken = f.AccessToken(sb.Id)
		d.Domain = f.domain()
	}
	return d
}

// live returns a sandbox's node and status. Unknown, malformed and deleted
// sandboxes are not found: E2B forgets a sandbox once it ends.
func (f *Facade) live(ctx context.Context, id string) (apiserver.Node, *dsecv1.Sandbox, error) {
	n, err := f.r.ForSandbox(ctx, id)
	if err != nil {
		if errdefs.Is(err, errdefs.KindInvalid) {
			return nil, nil, errdefs.NotFound("sandbox %s not found", clip(id))
		}
		return nil, nil, err
	}
	sb, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxRequest{Id: id}, apiserver.Node.GetSandbox)
	if err != nil {
		if errdefs.Is(err, errdefs.KindInvalid) {
			return nil, nil, errdefs.NotFound("sandbox %s not found", clip(id))
		}
		return nil, nil, err
	}
	if sb.State != "running" && sb.State != "paused" {
		return nil, nil, errdefs.NotFound("sandbox %s not found (%s: %s)", clip(id), sb.State, sb.Reason)
	}
	return n, sb, nil
}

func (f *Facade) get(w http.ResponseWriter, r *http.Request, _ string) {
	_, sb, err := f.live(r.Context(), r.PathValue("id"))
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, f.detailJSON(sb, true))
}

func (f *Facade) kill(w http.ResponseWriter, r *http.Request, _ string) {
	id := r.PathValue("id")
	n, _, err := f.live(r.Context(), id)
	if err != nil {
		apiError(w, err)
		return
	}
	if _, err := apiserver.Do(r.Context(), n, &dsecv1.DeleteSandboxRequest{Id: id}, apiserver.Node.DeleteSandbox); err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (f *Facade) setTimeout(w http.ResponseWriter, r *http.Request, _ string) {
	var in struct {
		Timeout int64 `json:"timeout"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	f.extend(w, r, in.Timeout)
}

// refresh is the older keepalive call: {duration: s}.
func (f *Facade) refresh(w http.ResponseWriter, r *http.Request, _ string) {
	var in struct {
		Duration int64 `json:"duration"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	if in.Duration == 0 {
		in.Duration = defaultTimeoutV2
	}
	f.extend(w, r, in.Duration)
}

// extend makes a sandbox end timeout seconds from now.
func (f *Facade) extend(w http.ResponseWriter, r *http.Request, timeout int64) {
	id := r.PathValue("id")
	if timeout < 1 {
		apiError(w, errdefs.Invalid("timeout must be at least 1 second"))
		return
	}
	n, sb, err := f.live(r.Context(), id)
	if err != nil {
		apiError(w, err)
		return
	}
	if sb.State == "paused" {
		// E2B sets the timeout of running sandboxes only; a native
		// keepalive would resume this one.
		apiError(w, errdefs.NotFound("sandbox %s is paused: connect() resumes it", id))
		return
	}
	if _, err := apiserver.Do(r.Context(), n, &dsecv1.KeepaliveRequest{Id: id, ExtendTtlS: timeout}, apiserver.Node.Keepalive); err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (f *Facade) pause(w http.ResponseWriter, r *http.Request, _ string) {
	id := r.PathValue("id")
	var in struct {
		Memory *bool `json:"memory"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	// keepMemory: false is the node's filesystem-only pause: connect()
	// cold-boots the sandbox on its kept files.
	fsOnly := in.Memory != nil && !*in.Memory
	n, sb, err := f.live(r.Context(), id)
	if err != nil {
		apiError(w, err)
		return
	}
	if sb.State == "paused" {
		apiError(w, errdefs.Conflict("sandbox %s is already paused", id))
		return
	}
	if _, err := apiserver.Do(r.Context(), n, &dsecv1.PauseSandboxRequest{Id: id, FilesystemOnly: fsOnly}, apiserver.Node.PauseSandbox); err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// connect resumes a paused sandbox (201) or returns a running one (200),
// extending its timeout if the request gives a longer one.
func (f *Facade) connect(w http.ResponseWriter, r *http.Request, _ string) {
	var in struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	f.wake(w, r, in.Timeout, false, false)
}

// resume is the deprecated resume call: a running sandbox is a conflict.
func (f *Facade) resume(w http.ResponseWriter, r *http.Request, _ string) {
	var in struct {
		Timeout   *int64 `json:"timeout"`
		AutoPause bool   `json:"autoPause"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	f.wake(w, r, in.Timeout, in.AutoPause, true)
}

// wake resumes a paused sandbox, or with pausedOnly refuses a running
// one. autoPause (the deprecated resume's) asks for the timeout policy the
// sandbox must have been created with: dsec cannot change it afterwards.
func (f *Facade) wake(w http.ResponseWriter, r *http.Request, timeout *int64, autoPause, pausedOnly bool) {
	ctx := r.Context()
	id := r.PathValue("id")
	n, sb, err := f.live(ctx, id)
	if err != nil {
		apiError(w, err)
		return
	}
	if autoPause && sb.GetSpec().GetOnTimeout() != onTimeoutPause {
		apiError(w, errdefs.Invalid("autoPause on resume: dsec sets a sandbox's timeout policy at create only (lifecycle onTimeout \"pause\")"))
		return
	}
	status := http.StatusOK
	if sb.State == "paused" {
		if sb, err = apiserver.Do(ctx, n, &dsecv1.ResumeSandboxRequest{Id: id}, apiserver.Node.ResumeSandbox); err != nil {
			apiError(w, err)
			return
		}
		status = http.StatusCreated
	} else if pausedOnly {
		apiError(w, errdefs.Conflict("sandbox %s is already running", id))
		return
	}
	if timeout != nil && *timeout > 0 && (*timeout > maxTimeoutS || time.Now().Add(time.Duration(*timeout)*time.Second).After(sb.GetExpiresAt().AsTime())) {
		if sb, err = apiserver.Do(ctx, n, &dsecv1.KeepaliveRequest{Id: id, ExtendTtlS: *timeout}, apiserver.Node.Keepalive); err != nil {
			apiError(w, err)
			return
		}
	}
	writeJSON(w, status, f.sandboxJSON(sb))
}

// metricJSON is E2B's SandboxMetric.
type metricJSON struct {
	Timestamp     string  `json:"timestamp"`
	TimestampUnix int64   `json:"timestampUnix"`
	CPUUsedPct    float64 `json:"cpuUsedPct"`
	CPUCount      int     `json:"cpuCount"`
	MemUsed       int64   `json:"memUsed"`
	MemTotal      int64   `json:"memTotal"`
	MemCache      int64   `json:"memCache"`
	DiskUsed      int64   `json:"diskUsed"`
	DiskTotal     int64   `json:"diskTotal"`
}

// metrics reports the sandbox's use over its life as the node sampled it
// (every 5 s, the last 15 minutes), between start and end when given: CPU
// use over each interval, memory and disk in use against the limits. A
// sandbox too young for two samples gets one taken now over a short
// window.
func (f *Facade) metrics(w http.ResponseWriter, r *http.Request, _ string) {
	ctx := r.Context()
	id := r.PathValue("id")
	n, _, err := f.live(ctx, id)
	if err != nil {
		apiError(w, err)
		return
	}
	q := r.URL.Query()
	var bounds [2]int64
	for i, k := range []string{"start", "end"} {
		if v := q.Get(k); v != "" {
			if bounds[i], err = strconv.ParseInt(v, 10, 64); err != nil {
				apiError(w, errdefs.Invalid("%s must be a unix time in seconds", k))
				return
			}
		}
	}
	st, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxStatsRequest{Id: id, History: true}, apiserver.Node.GetSandboxStats)
	if err != nil {
		apiError(w, err)
		return
	}
	samples := st.History
	if len(samples) < 2 {
		// Two samples now, a short window apart.
		select {
		case <-time.After(metricsWindow):
		case <-ctx.Done():
			return
		}
		b, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxStatsRequest{Id: id}, apiserver.Node.GetSandboxStats)
		if err != nil {
			apiError(w, err)
			return
		}
		samples = []*dsecv1.StatsSample{
			{At: st.At, CpuTimeMs: st.CpuTimeMs, MemoryBytes: st.MemoryBytes, DiskBytes: st.DiskBytes},
			{At: b.At, CpuTimeMs: b.CpuTimeMs, MemoryBytes: b.MemoryBytes, DiskBytes: b.DiskBytes},
		}
	}
	cpus := int(math.Ceil(st.CpuLimit))
	out := []metricJSON{}
	for i := 1; i < len(samples); i++ {
		a, b := samples[i-1], samples[i]
		at := b.At.AsTime()
		if (bounds[0] != 0 && at.Unix() < bounds[0]) || (bounds[1] != 0 && at.Unix() > bounds[1]) {
			continue
		}
		pct := 0.0
		if dt := at.Sub(a.At.AsTime()); dt > 0 && cpus > 0 {
			pct = float64(b.CpuTimeMs-a.CpuTimeMs) / float64(dt.Milliseconds()) / float64(cpus) * 100
		}
		out = append(out, metricJSON{
			Timestamp: at.UTC().Format(time.RFC3339Nano), TimestampUnix: at.Unix(),
			// Sampling skew aside, the use is bounded by the CPUs.
			CPUUsedPct: math.Round(min(max(pct, 0), 100)*100) / 100, CPUCount: cpus,
			MemUsed: b.MemoryBytes, MemTotal: st.MemoryLimitMb << 20,
			DiskUsed: b.DiskBytes, DiskTotal: st.DiskLimitMb << 20,
		})
	}
	writeJSON(w, http.StatusOK, out)
}

// fork snapshots a running sandbox and starts count children from it
// (dsec's Fork), answering one result per child.
func (f *Facade) fork(w http.ResponseWriter, r *http.Request, _ string) {
	ctx := r.Context()
	id := r.PathValue("id")
	var in struct {
		Timeout *int64 `json:"timeout"`
		Count   int32  `json:"count"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	if in.Count == 0 {
		in.Count = 1
	}
	n, _, err := f.live(ctx, id)
	if err != nil {
		apiError(w, err)
		return
	}
	resp, err := apiserver.Do(ctx, n, &dsecv1.ForkRequest{SandboxId: id, Count: in.Count}, apiserver.Node.Fork)
	if err != nil {
		apiError(w, err)
		return
	}
	type result struct {
		Sandbox *sandboxJSON `json:"sandbox,omitempty"`
		Error   *errorBody   `json:"error,omitempty"`
	}
	out := make([]result, len(resp.Results))
	for i, res := range resp.Results {
		if e := res.GetError(); e != nil {
			code := errwire.HTTPStatus(&errdefs.Error{Kind: errdefs.Kind(e.Kind)})
			out[i].Error = &errorBody{Code: code, Message: e.Message}
			continue
		}
		sb := res.GetSandbox()
		if in.Timeout != nil && *in.Timeout > 0 {
			if kept, err := apiserver.Do(ctx, n, &dsecv1.KeepaliveRequest{Id: sb.Id, ExtendTtlS: *in.Timeout}, apiserver.Node.Keepalive); err == nil {
				sb = kept
			} else {
				out[i].Error = &errorBody{Code: errwire.HTTPStatus(err), Message: errdefs.Classify(err).Msg}
				continue
			}
		}
		j := f.sandboxJSON(sb)
		out[i].Sandbox = &j
	}
	writeJSON(w, http.StatusCreated, out)
}

// listQuery is a parsed GET /v2/sandboxes.
type listQuery struct {
	metadata     map[string]string
	states       map[string]bool
	template     string
	startedAfter time.Time
	desc         bool // newest first (E2B's default)
	limit        int
	after        *cursor // the last item of the previous page
}

const (
	defaultListLimit = 100
	maxListLimit     = 1000
)

func parseListQuery(q url.Values) (*listQuery, error) {
	lq := &listQuery{metadata: map[string]string{}, desc: true, template: q.Get("template")}
	if m := q.Get("metadata"); m != "" {
		pairs, err := url.ParseQuery(m)
		if err != nil {
			return nil, errdefs.Invalid("metadata must be URL-encoded key=value pairs")
		}
		for k, vs := range pairs {
			// The SDKs encode keys and values once more before building
			// the query string.
			lq.metadata[unescape(k)] = unescape(vs[len(vs)-1])
		}
	}
	if s := q.Get("state"); s != "" {
		lq.states = map[string]bool{}
		for _, st := range strings.Split(s, ",") {
			switch st = strings.TrimSpace(st); st {
			case "running", "paused":
				lq.states[st] = true
			default:
				return nil, errdefs.Invalid("state %q: use running or paused", clip(st))
			}
		}
	}
	if s := q.Get("startedAfter"); s != "" {
		t, err := time.Parse(time.RFC3339, s)
		if err != nil {
			return nil, errdefs.Invalid("startedAfter must be an RFC 3339 time")
		}
		lq.startedAfter = t
	}
	switch q.Get("order") {
	case "", "desc":
	case "asc":
		lq.desc = false
	default:
		return nil, errdefs.Invalid("order must be asc or desc")
	}
	var err error
	if lq.limit, lq.after, err = parsePage(q.Get("limit"), q.Get("nextToken")); err != nil {
		return nil, err
	}
	return lq, nil
}

func unescape(s string) string {
	if u, err := url.QueryUnescape(s); err == nil {
		return u
	}
	return s
}

// selectorSafe reports whether a metadata value can be part of a label
// selector; other pairs are matched after listing.
func selectorSafe(s string) bool { return s != "" && !strings.ContainsAny(s, ",=! ") }

func (lq *listQuery) matches(sb *dsecv1.Sandbox) bool {
	md := metadata(sb.GetSpec().GetLabels())
	for k, v := range lq.metadata {
		if got, ok := md[k]; !ok || got != v {
			return false
		}
	}
	if lq.states != nil && !lq.states[sb.State] {
		return false
	}
	if lq.template != "" && templateOf(sb) != lq.template {
		return false
	}
	if !lq.startedAfter.IsZero() && !sb.GetCreatedAt().AsTime().After(lq.startedAfter) {
		return false
	}
	return sb.State == "running" || sb.State == "paused"
}

// sandboxes lists the sandboxes of every node matching lq, oldest first
// (the control plane's listing, filtered by what E2B asks beyond labels).
func (f *Facade) sandboxes(ctx context.Context, lq *listQuery) ([]*dsecv1.Sandbox, error) {
	var sel []string
	for k, v := range lq.metadata {
		if labelKey.MatchString(k) && selectorSafe(v) {
			sel = append(sel, k+"="+v)
		}
	}
	sort.Strings(sel)
	listed, err := apiserver.List(ctx, f.r, strings.Join(sel, ","), "")
	if err != nil {
		return nil, err
	}
	var all []*dsecv1.Sandbox
	for _, sb := range listed {
		if lq.matches(sb) {
			all = append(all, sb)
		}
	}
	return all, nil
}

// list is GET /v2/sandboxes: filters, order (newest first unless asc) and
// X-Next-Token paging.
func (f *Facade) list(w http.ResponseWriter, r *http.Request, _ string) {
	lq, err := parseListQuery(r.URL.Query())
	if err != nil {
		apiError(w, err)
		return
	}
	all, err := f.sandboxes(r.Context(), lq)
	if err != nil {
		apiError(w, err)
		return
	}
	keys := make([]cursor, len(all))
	for i, sb := range all {
		keys[i] = cursor{sb.GetCreatedAt().AsTime(), sb.Id}
	}
	page, next := pageOf(keys, lq.desc, lq.after, lq.limit)
	out := make([]detailJSON, 0, len(page))
	for _, i := range page {
		out = append(out, f.detailJSON(all[i], false))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

// listV1 is the deprecated GET /sandboxes: every running sandbox matching
// the metadata filter, unpaged.
func (f *Facade) listV1(w http.ResponseWriter, r *http.Request, _ string) {
	q := url.Values{}
	if m := r.URL.Query().Get("metadata"); m != "" {
		q.Set("metadata", m)
	}
	lq, err := parseListQuery(q)
	if err != nil {
		apiError(w, err)
		return
	}
	lq.states = map[string]bool{"running": true}
	all, err := f.sandboxes(r.Context(), lq)
	if err != nil {
		apiError(w, err)
		return
	}
	out := make([]detailJSON, 0, len(all))
	for _, sb := range all {
		out = append(out, f.detailJSON(sb, false))
	}
	writeJSON(w, http.StatusOK, out)
}

// withBootstrapHint says how to build the base image, which the SDKs'
// default templates start, when a create failed for want of it.
func withBootstrapHint(err error, image string) error {
	if image == "base" && errdefs.Is(err, errdefs.KindNotFound) && strings.Contains(err.Error(), `image "base"`) {
		return errdefs.NotFound("%v: the E2B SDKs' default templates start the base image; build it with `dsec image bootstrap base` (or serve with --bootstrap busybox,debian,base)", err)
	}
	return err
}
