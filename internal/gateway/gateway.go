// Package gateway is the node's model gateway: an OpenAI-compatible HTTP
// endpoint (chat completions and completions, streaming or not, and
// Anthropic's messages) that agents inside sandboxes call at
// http://127.0.0.1:4319/v1 on their own loopback. The node serves it on a
// listener the sandbox's agent opens (guest ListenPort), so it is reached
// whatever the sandbox's network; a connection's sandbox is the one whose
// listener accepted it, which no process inside can forge.
//
// Each call is forwarded to an upstream the sandbox's session registered
// (by the request's model), with the upstream's credential added here:
// no credential is ever inside a sandbox. Every call is recorded in the
// sandbox's trajectory (the Sandbox's Record), request and response as
// they passed, with the upstream's token counts, token IDs and log
// probabilities where it returned them.
//
// Fast-forward: a sandbox attached with a prefix (the completed calls of
// an earlier sandbox's log) has its n-th call answered from the n-th
// recorded one while the requests are equal, without reaching the
// upstream; the first that differs is logged as a divergence (with its
// position) and goes live, as do all after it and all past the prefix.
// Calls are numbered in the order they reach the gateway.
//
// Failures are classified for the trainer: an upstream that refuses
// connections, answers 5xx past its retries, hangs, truncates a stream
// or returns what is not its protocol is an infra failure (the agent gets
// a clean error, status 502 or 504 with X-Dsec-Infra: true, and the log
// entry an infra error); an upstream's 429s and transient 5xx are waited
// out with backoff within the upstream's timeout; an upstream's 4xx are
// the request's and pass through as they are.
package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// Port is the gateway's port on every sandbox's loopback.
const Port = 4319

// Env is the environment every process of a sandbox with the gateway
// gets: the variables OpenAI's and Anthropic's SDKs (and the agent
// scaffolds built on them) read. The keys are placeholders the gateway
// ignores.
var Env = []string{
	"OPENAI_BASE_URL=http://127.0.0.1:" + strconv.Itoa(Port) + "/v1",
	"OPENAI_API_KEY=dsec-gateway",
	"ANTHROPIC_BASE_URL=http://127.0.0.1:" + strconv.Itoa(Port),
	"ANTHROPIC_API_KEY=dsec-gateway",
	"DSEC_MODEL_GATEWAY=http://127.0.0.1:" + strconv.Itoa(Port) + "/v1",
}

const (
	// maxRequest bounds a request body (a long context with images).
	maxRequest = 32 << 20
	// maxResponse bounds an answer the gateway records.
	maxResponse = 32 << 20
	// Defaults of ModelUpstream and ModelLimits.
	defaultTimeout      = 600 * time.Second
	defaultIdleTimeout  = 120 * time.Second
	defaultPerSandbox   = 16
	firstBackoff        = 250 * time.Millisecond
	maxBackoff          = 8 * time.Second
	maxDownRetries      = 3
	anthropicAPIVersion = "2023-06-01"
)

// Resolver returns the upstreams and limits of a project's session (nil
// and no error when it registered none). The gateway asks at every call,
// so a change applies to the next one.
type Resolver func(ctx context.Context, project, session string) (*dsecv1.ModelUpstreams, error)

// Sandbox is one sandbox as the gateway serves it: who it is, where its
// calls go, and its place in them, which outlives any one listener (a VM
// paused and resumed is served anew, its calls numbered on).
type Sandbox struct {
	ID, Project, Session string
	// Record appends a call to the sandbox's trajectory; err is the
	// call's failure (nil when it was answered).
	Record func(c *dsecv1.ModelCall, start time.Time, d time.Duration, err error)
	// Prefix are the recorded calls the sandbox is fast-forwarded through,
	// in order (see Completed).
	Prefix []*dsecv1.ModelCall
	// Touch, if set, is told of each call as it starts (the sandbox is
	// active while its agent waits for a model).
	Touch func()
	// Workers, if set, serves the dsec API paths (/dsec.v1.*) for the
	// sandboxes the sandbox's rollouts drive (rollout workers).
	Workers http.Handler

	mu       sync.Mutex
	next     uint64 // the last call's index
	diverged bool   // live from here on
	inflight int
	idle     *sync.Cond // signalled when inflight drops to 0 (on mu)
}

// Drain waits until none of the sandbox's calls is in flight, or d
// passed: once its agent is gone, its log then holds every call it made.
func (sb *Sandbox) Drain(d time.Duration) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.idle == nil {
		sb.idle = sync.NewCond(&sb.mu)
	}
	t := time.AfterFunc(d, func() {
		sb.mu.Lock()
		sb.idle.Broadcast()
		sb.mu.Unlock()
	})
	defer t.Stop()
	for deadline := time.Now().Add(d); sb.inflight > 0 && time.Now().Before(deadline); {
		sb.idle.Wait()
	}
}

// Continue sets where a sandbox's calls go on from, after a node restart:
// its own log so far. Calls are numbered after the last one, and a
// sandbox that made a live call within its prefix's span (it diverged)
// stays live.
func (sb *Sandbox) Continue(own []*dsecv1.LogEntry) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	for _, e := range own {
		mc := e.GetModelCall()
		if mc == nil {
			continue
		}
		sb.next = max(sb.next, mc.Index)
		if mc.Diverged {
			sb.diverged = true
		}
	}
}

// Gateway serves the sandboxes of one node. It is safe for concurrent use.
type Gateway struct {
	resolve Resolver
	client  *http.Client
	log     *slog.Logger

	mu       sync.Mutex
	sessions map[string]*sessionLimits
}

// New returns a gateway that finds upstreams with resolve and reaches them
// with transport (nil: a default one).
func New(resolve Resolver, transport http.RoundTripper, log *slog.Logger) *Gateway {
	if transport == nil {
		transport = &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second, Control: refuseLinkLocal}).DialContext,
			MaxIdleConnsPerHost: 256,
			IdleConnTimeout:     90 * time.Second,
			ForceAttemptHTTP2:   true,
		}
	}
	return &Gateway{resolve: resolve, client: &http.Client{Transport: transport}, log: log, sessions: map[string]*sessionLimits{}}
}

// refuseLinkLocal keeps the gateway from dialing what no model server
// is: link-local addresses (a cloud's metadata service among them),
// multicast and unspecified ones. It checks the address dialed, after
// name resolution, so a name that resolves there is refused too.
func refuseLinkLocal(network, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsMulticast() || ip.IsUnspecified() {
		return fmt.Errorf("the model gateway does not dial %s", host)
	}
	return nil
}

// Completed returns the calls of a trajectory that a fast-forward replays:
// those the upstream (or an earlier replay) answered, in order. A call
// that failed for the platform's sake (an upstream down) is not among
// them: a resumed rollout makes it again, live.
func Completed(entries []*dsecv1.LogEntry) []*dsecv1.ModelCall {
	var out []*dsecv1.ModelCall
	for _, e := range entries {
		if mc := e.GetModelCall(); mc != nil && e.GetError() == nil && mc.Status != 0 {
			out = append(out, mc)
		}
	}
	return out
}

// Serve answers sb's calls on l until l fails (the sandbox ends) and
// returns then. Calls in flight finish on their own.
func (g *Gateway) Serve(sb *Sandbox, l net.Listener) error {
	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { g.serveHTTP(sb, w, r) }),
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       5 * time.Minute,
		ErrorLog:          slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
	}
	err := srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) || errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// position numbers a call and returns the recorded call it is to be
// compared with (nil: live).
func (sb *Sandbox) position() (uint64, *dsecv1.ModelCall) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.next++
	i := sb.next
	if sb.diverged || i > uint64(len(sb.Prefix)) {
		return i, nil
	}
	return i, sb.Prefix[i-1]
}

func (sb *Sandbox) diverge() {
	sb.mu.Lock()
	sb.diverged = true
	sb.mu.Unlock()
}

// admit counts a call in flight unless the sandbox has limit of them.
func (sb *Sandbox) admit(limit int) bool {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.inflight >= limit {
		return false
	}
	sb.inflight++
	return true
}

func (sb *Sandbox) leave() {
	sb.mu.Lock()
	sb.inflight--
	if sb.inflight == 0 && sb.idle != nil {
		sb.idle.Broadcast()
	}
	sb.mu.Unlock()
}

// endpoints are the paths served, below /v1, and their API.
var endpoints = map[string]string{
	"/v1/chat/completions": "openai",
	"/v1/completions":      "openai",
	"/v1/messages":         "anthropic",
}

func (g *Gateway) serveHTTP(sb *Sandbox, w http.ResponseWriter, r *http.Request) {
	if sb.Touch != nil {
		sb.Touch()
	}
	if r.Method == http.MethodGet && (r.URL.Path == "/v1/models" || r.URL.Path == "/models") {
		g.serveModels(sb, w, r)
		return
	}
	path := r.URL.Path
	if strings.HasPrefix(path, "/dsec.v1.") {
		if sb.Workers == nil {
			writeError(w, http.StatusNotFound, "not_found", "this sandbox drives no other sandbox", false)
			return
		}
		sb.Workers.ServeHTTP(w, r)
		return
	}
	if !strings.HasPrefix(path, "/v1/") {
		path = "/v1" + path // ANTHROPIC_BASE_URL has no /v1; some clients drop it
	}
	if _, ok := endpoints[path]; !ok || r.Method != http.MethodPost {
		writeError(w, http.StatusNotFound, "not_found", fmt.Sprintf("the model gateway serves POST /v1/chat/completions, /v1/completions and /v1/messages, and GET /v1/models; not %s %s", r.Method, r.URL.Path), false)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxRequest))
	if err != nil {
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", maxRequest), false)
		return
	}
	var head struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	if err := json.Unmarshal(body, &head); err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "request body is not JSON: "+err.Error(), false)
		return
	}
	cfg, err := g.resolve(r.Context(), sb.Project, sb.Session)
	if err != nil {
		// The registry is the platform's: its failure is infra.
		g.log.Warn("model gateway: upstreams unavailable", slog.String("sandbox_id", sb.ID), slog.Any("error", err))
		writeError(w, http.StatusServiceUnavailable, "upstream_unavailable", "the model gateway cannot read the session's upstreams", true)
		return
	}
	limits := cfg.GetLimits()
	per := int(limits.GetPerSandboxConcurrent())
	if per <= 0 {
		per = defaultPerSandbox
	}
	if !sb.admit(per) {
		writeError(w, http.StatusTooManyRequests, "rate_limit_error", fmt.Sprintf("this sandbox has %d model calls in flight, its limit", per), false)
		return
	}
	defer sb.leave()

	call := &dsecv1.ModelCall{Endpoint: path, Model: head.Model, Stream: head.Stream, Request: string(body)}
	start := time.Now()
	idx, recorded := sb.position()
	call.Index = idx
	if recorded != nil {
		same, detail := sameRequest(recorded, call)
		if same {
			sb.Record(replayed(call, recorded), start, time.Since(start), nil)
			replay(w, recorded)
			return
		}
		sb.diverge()
		call.Diverged, call.Detail = true, fmt.Sprintf("call %d differs from the recorded one: %s; live from here", idx, detail)
	}
	up := pick(cfg.GetUpstreams(), head.Model)
	if up == nil {
		msg := fmt.Sprintf("no upstream of session %q or of its project serves model %q", sb.Session, head.Model)
		if sb.Session == "" {
			msg = fmt.Sprintf("no upstream of the project serves model %q (SetModelUpstreams)", head.Model)
		}
		writeError(w, http.StatusForbidden, "permission_error", msg, false)
		call.Status = http.StatusForbidden
		sb.Record(call, start, time.Since(start), errdefs.PermissionDenied("%s", msg))
		return
	}
	call.Upstream = up.Name
	lim := g.limits(sb, limits)
	release, err := lim.acquire(r.Context())
	if err != nil {
		status := http.StatusTooManyRequests
		writeError(w, status, "insufficient_quota", err.Error(), false)
		call.Status = int32(status)
		sb.Record(call, start, time.Since(start), err)
		return
	}
	// The answer is recorded before the agent gets it (a stream: once it
	// ended), so an answered call is in the log when a rollout resumes.
	hw := &heldWriter{w: w}
	err = g.forward(r.Context(), hw, up, r.Header, call, start)
	release(call.PromptTokens + call.CompletionTokens)
	sb.Record(call, start, time.Since(start), err)
	hw.release()
}

// heldWriter holds an answer back until release, unless it streams: a
// Flush passes what was written and everything after straight through.
type heldWriter struct {
	w      http.ResponseWriter
	status int
	body   bytes.Buffer
	direct bool
}

func (h *heldWriter) Header() http.Header { return h.w.Header() }

func (h *heldWriter) WriteHeader(status int) {
	if h.direct {
		h.w.WriteHeader(status)
		return
	}
	if h.status == 0 {
		h.status = status
	}
}

func (h *heldWriter) Write(b []byte) (int, error) {
	if h.direct {
		return h.w.Write(b)
	}
	if h.status == 0 {
		h.status = http.StatusOK
	}
	return h.body.Write(b)
}

// Flush starts streaming.
func (h *heldWriter) Flush() {
	if !h.direct {
		h.release()
		h.direct = true
	}
	if f, ok := h.w.(http.Flusher); ok {
		f.Flush()
	}
}

// release sends what was held.
func (h *heldWriter) release() {
	if h.direct || h.status == 0 {
		return
	}
	h.w.WriteHeader(h.status)
	h.w.Write(h.body.Bytes())
	h.status = 0
	h.body.Reset()
}

// sameRequest compares a call with the recorded one at its position: the
// same endpoint and the same JSON (key order and spacing aside).
func sameRequest(rec, call *dsecv1.ModelCall) (bool, string) {
	if rec.Endpoint != call.Endpoint {
		return false, fmt.Sprintf("endpoint %s, recorded %s", call.Endpoint, rec.Endpoint)
	}
	var a, b map[string]any
	if json.Unmarshal([]byte(rec.Request), &a) != nil || json.Unmarshal([]byte(call.Request), &b) != nil {
		if rec.Request == call.Request {
			return true, ""
		}
		return false, "request body differs"
	}
	var keys []string
	for k := range a {
		keys = append(keys, k)
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	var diff []string
	for _, k := range keys {
		x, _ := json.Marshal(a[k])
		y, _ := json.Marshal(b[k])
		if !bytes.Equal(x, y) {
			diff = append(diff, k)
		}
	}
	if len(diff) == 0 {
		return true, ""
	}
	slices.Sort(diff)
	return false, "field " + strings.Join(diff, ", ") + " differs"
}

// replayed completes call as answered from rec.
func replayed(call, rec *dsecv1.ModelCall) *dsecv1.ModelCall {
	call.Replayed = true
	call.Upstream = rec.Upstream
	call.Status = rec.Status
	call.Response = rec.Response
	call.PromptTokens, call.CompletionTokens = rec.PromptTokens, rec.CompletionTokens
	call.TokenIds, call.Logprobs, call.PromptTokenIds = rec.TokenIds, rec.Logprobs, rec.PromptTokenIds
	return call
}

// replay answers from a recorded call.
func replay(w http.ResponseWriter, rec *dsecv1.ModelCall) {
	if rec.Stream {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
	} else {
		w.Header().Set("Content-Type", "application/json")
	}
	w.Header().Set("X-Dsec-Replayed", "true")
	w.WriteHeader(int(rec.Status))
	io.WriteString(w, rec.Response)
}

// pick returns the upstream for model: the first that lists it, else the
// first that lists none.
func pick(ups []*dsecv1.ModelUpstream, model string) *dsecv1.ModelUpstream {
	var fallback *dsecv1.ModelUpstream
	for _, u := range ups {
		if len(u.Models) == 0 {
			if fallback == nil {
				fallback = u
			}
			continue
		}
		for _, m := range u.Models {
			if m == model {
				return u
			}
		}
	}
	return fallback
}

func (g *Gateway) serveModels(sb *Sandbox, w http.ResponseWriter, r *http.Request) {
	cfg, err := g.resolve(r.Context(), sb.Project, sb.Session)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, "upstream_unavailable", "the model gateway cannot read the session's upstreams", true)
		return
	}
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		OwnedBy string `json:"owned_by"`
	}
	out := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: []model{}}
	seen := map[string]bool{}
	for _, u := range cfg.GetUpstreams() {
		for _, m := range u.Models {
			if !seen[m] {
				seen[m] = true
				out.Data = append(out.Data, model{ID: m, Object: "model", OwnedBy: u.Name})
			}
		}
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

// writeError answers with an error in OpenAI's shape (which Anthropic's
// clients read as well: they look at the status).
func writeError(w http.ResponseWriter, status int, typ, msg string, infra bool) {
	w.Header().Set("Content-Type", "application/json")
	if infra {
		w.Header().Set("X-Dsec-Infra", "true")
	}
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(errorBody(typ, msg))
}

func errorBody(typ, msg string) map[string]any {
	return map[string]any{"type": "error", "error": map[string]any{"message": msg, "type": typ}}
}

// forward makes the call live: to up, with its credential, retrying its
// rate limits and transient failures, and streams or copies the answer to
// w while recording it in call. It returns the call's failure, classified
// (infra for the upstream's), after answering the agent.
func (g *Gateway) forward(ctx context.Context, w http.ResponseWriter, up *dsecv1.ModelUpstream, in http.Header, call *dsecv1.ModelCall, start time.Time) error {
	timeout := seconds(up.TimeoutS, defaultTimeout)
	idle := seconds(up.IdleTimeoutS, defaultIdleTimeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	url := strings.TrimSuffix(up.BaseUrl, "/") + strings.TrimPrefix(call.Endpoint, "/v1")
	backoff := firstBackoff
	down := 0
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(call.Request))
		if err != nil {
			return g.fail(w, call, http.StatusBadGateway, "upstream_error", fmt.Sprintf("upstream %s: bad base URL", up.Name), errdefs.Unavailable("upstream %s has a bad base URL", up.Name))
		}
		setUpstreamHeaders(req.Header, in, up)
		resp, err := g.client.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return g.timedOut(w, call, up, timeout, ctx)
			}
			down++
			if down > maxDownRetries || !wait(ctx, backoff) {
				if errors.Is(context.Cause(ctx), context.Canceled) {
					return errdefs.New(errdefs.KindCanceled, "the agent closed the connection")
				}
				return g.fail(w, call, http.StatusBadGateway, "upstream_error", fmt.Sprintf("upstream %s is unreachable", up.Name), errdefs.Unavailable("upstream %s is unreachable: %v", up.Name, err))
			}
			backoff = min(2*backoff, maxBackoff)
			call.Retries++
			continue
		}
		if retryable(resp.StatusCode) {
			after := retryAfter(resp.Header, backoff)
			io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			if !wait(ctx, after) {
				return g.timedOut(w, call, up, timeout, ctx)
			}
			backoff = min(2*backoff, maxBackoff)
			call.Retries++
			continue
		}
		defer resp.Body.Close()
		call.FirstByteMs = time.Since(start).Milliseconds()
		if resp.StatusCode >= 500 {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
			call.Response = string(b)
			return g.fail(w, call, http.StatusBadGateway, "upstream_error", fmt.Sprintf("upstream %s answered %d", up.Name, resp.StatusCode), errdefs.Unavailable("upstream %s answered %d", up.Name, resp.StatusCode))
		}
		if call.Stream && resp.StatusCode == http.StatusOK && strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			return g.stream(ctx, w, up, resp, call, idle)
		}
		return g.copyAnswer(ctx, w, up, resp, call, idle)
	}
}

// copyAnswer passes a whole answer on, once it is read and checked.
func (g *Gateway) copyAnswer(ctx context.Context, w http.ResponseWriter, up *dsecv1.ModelUpstream, resp *http.Response, call *dsecv1.ModelCall, idle time.Duration) error {
	ir := newIdleReader(resp.Body, idle)
	defer ir.stop()
	body, err := io.ReadAll(io.LimitReader(ir, maxResponse+1))
	if err == nil && len(body) > maxResponse {
		err = fmt.Errorf("answer over %d bytes", maxResponse)
	}
	if err != nil {
		if ir.stalled.Load() {
			return g.fail(w, call, http.StatusGatewayTimeout, "upstream_error", fmt.Sprintf("upstream %s stopped answering", up.Name), errdefs.Unavailable("upstream %s hung: nothing for %s", up.Name, idle))
		}
		return g.fail(w, call, http.StatusBadGateway, "upstream_error", fmt.Sprintf("upstream %s broke off its answer", up.Name), errdefs.Unavailable("upstream %s broke off its answer: %v", up.Name, err))
	}
	call.Response = string(body)
	if resp.StatusCode == http.StatusOK && !json.Valid(body) {
		return g.fail(w, call, http.StatusBadGateway, "upstream_error", fmt.Sprintf("upstream %s answered with what is not JSON", up.Name), errdefs.Unavailable("upstream %s answered with what is not JSON", up.Name))
	}
	if resp.StatusCode == http.StatusOK {
		var u usage
		u.addJSON(body)
		u.into(call)
	}
	call.Status = int32(resp.StatusCode)
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.WriteHeader(resp.StatusCode)
	w.Write(body)
	if resp.StatusCode >= 400 {
		// The request's own fault, as the upstream judged it.
		return errdefs.Invalid("upstream %s answered %d", up.Name, resp.StatusCode)
	}
	return nil
}

// stream passes server-sent events on as they come, and checks that the
// stream ends as its protocol ends it.
func (g *Gateway) stream(ctx context.Context, w http.ResponseWriter, up *dsecv1.ModelUpstream, resp *http.Response, call *dsecv1.ModelCall, idle time.Duration) error {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	call.Status = http.StatusOK
	flush := func() {}
	if f, ok := w.(http.Flusher); ok {
		flush = f.Flush
	}
	flush()
	var rec bytes.Buffer
	var u usage
	var line []byte
	done := false
	end := func(err error) error {
		call.Response = rec.String()
		u.into(call)
		return err
	}
	fail := func(msg string, err error) error {
		ev := "data: " + mustJSON(errorBody("upstream_error", msg)) + "\n\n"
		io.WriteString(w, ev)
		flush()
		rec.WriteString(ev)
		return end(err)
	}
	ir := newIdleReader(resp.Body, idle)
	defer ir.stop()
	buf := make([]byte, 32<<10)
	for {
		n, err := ir.Read(buf)
		if b := buf[:n]; n > 0 {
			if rec.Len() < maxResponse {
				rec.Write(b)
			}
			if _, werr := w.Write(b); werr != nil {
				return end(errdefs.New(errdefs.KindCanceled, "the agent closed the connection mid-stream"))
			}
			flush()
			for _, c := range b {
				if c != '\n' {
					line = append(line, c)
					continue
				}
				if d, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r"), []byte("data:")); ok {
					d = bytes.TrimSpace(d)
					if string(d) == "[DONE]" {
						done = true
					} else {
						if bytes.Contains(d, []byte(`"message_stop"`)) {
							done = true
						}
						u.addJSON(d)
					}
				}
				line = line[:0]
			}
		}
		switch {
		case err == nil:
		case errors.Is(err, io.EOF) && done:
			return end(nil)
		case ir.stalled.Load():
			return fail(fmt.Sprintf("upstream %s stopped streaming", up.Name), errdefs.Unavailable("upstream %s hung: nothing for %s", up.Name, idle))
		case errors.Is(context.Cause(ctx), context.Canceled):
			return end(errdefs.New(errdefs.KindCanceled, "the agent closed the connection mid-stream"))
		case ctx.Err() != nil:
			return fail("the model call timed out", errdefs.Unavailable("upstream %s timed out", up.Name))
		default:
			return fail(fmt.Sprintf("upstream %s ended its stream early", up.Name), errdefs.Unavailable("upstream %s truncated its stream", up.Name))
		}
	}
}

// idleReader reads an answer's body and closes it when nothing came for
// idle (stalled is then set), so a read blocked on a hung upstream ends.
type idleReader struct {
	body    io.ReadCloser
	idle    time.Duration
	t       *time.Timer
	stalled atomic.Bool
}

func newIdleReader(body io.ReadCloser, idle time.Duration) *idleReader {
	r := &idleReader{body: body, idle: idle}
	r.t = time.AfterFunc(idle, func() {
		r.stalled.Store(true)
		body.Close()
	})
	return r
}

func (r *idleReader) Read(p []byte) (int, error) {
	n, err := r.body.Read(p)
	if n > 0 {
		r.t.Reset(r.idle)
	}
	return n, err
}

func (r *idleReader) stop() { r.t.Stop() }

// fail answers the agent with an error and returns err.
func (g *Gateway) fail(w http.ResponseWriter, call *dsecv1.ModelCall, status int, typ, msg string, err error) error {
	call.Status = int32(status)
	writeError(w, status, typ, msg, errdefs.IsInfra(err))
	return err
}

func (g *Gateway) timedOut(w http.ResponseWriter, call *dsecv1.ModelCall, up *dsecv1.ModelUpstream, timeout time.Duration, ctx context.Context) error {
	if errors.Is(context.Cause(ctx), context.Canceled) {
		// The agent gave up; nothing to answer.
		return errdefs.New(errdefs.KindCanceled, "the agent closed the connection")
	}
	return g.fail(w, call, http.StatusGatewayTimeout, "upstream_error", fmt.Sprintf("upstream %s did not answer within %s", up.Name, timeout), errdefs.Unavailable("upstream %s did not answer within %s", up.Name, timeout))
}

// setUpstreamHeaders sets what the upstream is sent: the content headers
// and Anthropic's version from the agent, the credential from the
// registration. The agent's own Authorization and x-api-key (placeholders)
// are not passed on.
func setUpstreamHeaders(h, in http.Header, up *dsecv1.ModelUpstream) {
	h.Set("Content-Type", "application/json")
	if a := in.Get("Accept"); a != "" {
		h.Set("Accept", a)
	}
	if up.Api == "anthropic" {
		v := in.Get("anthropic-version")
		if v == "" {
			v = anthropicAPIVersion
		}
		h.Set("anthropic-version", v)
		if b := in.Get("anthropic-beta"); b != "" {
			h.Set("anthropic-beta", b)
		}
		if up.ApiKey != "" {
			h.Set("x-api-key", up.ApiKey)
		}
		return
	}
	if up.ApiKey != "" {
		h.Set("Authorization", "Bearer "+up.ApiKey)
	}
}

func retryable(status int) bool {
	return status == http.StatusTooManyRequests || status == http.StatusBadGateway || status == http.StatusServiceUnavailable || status == http.StatusGatewayTimeout || status == 529
}

// retryAfter is the upstream's Retry-After (seconds), else backoff with
// jitter.
func retryAfter(h http.Header, backoff time.Duration) time.Duration {
	if s, err := strconv.ParseFloat(h.Get("Retry-After"), 64); err == nil && s >= 0 {
		return min(time.Duration(s*float64(time.Second)), time.Minute)
	}
	return backoff/2 + rand.N(backoff/2+1)
}

func wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func seconds(s float64, def time.Duration) time.Duration {
	if s <= 0 {
		return def
	}
	return time.Duration(s * float64(time.Second))
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
