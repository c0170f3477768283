package gateway

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway/gatewaytest"
)

// trajectory is a sandbox's recorded calls.
type trajectory struct {
	mu      sync.Mutex
	entries []*dsecv1.LogEntry
}

func (tr *trajectory) record(c *dsecv1.ModelCall, start time.Time, d time.Duration, err error) {
	e := &dsecv1.LogEntry{Op: "model_call", At: timestamppb.New(start), DurationMs: d.Milliseconds(), ModelCall: c}
	if err != nil {
		ce := errdefs.Classify(err)
		e.Error = &dsecv1.ItemError{Kind: string(ce.Kind), Message: ce.Msg, Infra: ce.Infra}
	}
	tr.mu.Lock()
	e.Seq = uint64(len(tr.entries) + 1)
	tr.entries = append(tr.entries, e)
	tr.mu.Unlock()
}

func (tr *trajectory) all() []*dsecv1.LogEntry {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([]*dsecv1.LogEntry(nil), tr.entries...)
}

// registry is a resolver over one session's registration.
type registry struct {
	mu  sync.Mutex
	cfg map[string]*dsecv1.ModelUpstreams
}

func (r *registry) set(session string, u *dsecv1.ModelUpstreams) {
	r.mu.Lock()
	r.cfg[session] = u
	r.mu.Unlock()
}

func (r *registry) resolve(_ context.Context, project, session string) (*dsecv1.ModelUpstreams, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg[project+"/"+session], nil
}

// sandbox is a sandbox served by the gateway on a loopback listener of
// its own (in a node, the agent's listener inside the sandbox).
type sandbox struct {
	url string
	tr  *trajectory
}

func serveSandbox(t *testing.T, g *Gateway, id, session string, prefix []*dsecv1.ModelCall) *sandbox {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := &trajectory{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.Serve(&Sandbox{ID: id, Project: "p", Session: session, Record: tr.record, Prefix: prefix}, l)
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return &sandbox{url: "http://" + l.Addr().String(), tr: tr}
}

func newGateway(t *testing.T) (*Gateway, *registry) {
	reg := &registry{cfg: map[string]*dsecv1.ModelUpstreams{}}
	return New(reg.resolve, nil, slog.New(slog.DiscardHandler)), reg
}

// call posts a request as an agent would, with the placeholder key.
func call(t *testing.T, sb *sandbox, path, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, sb.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer dsec-gateway")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func chat(content string, stream bool) string {
	return mustJSON(map[string]any{"model": "policy", "stream": stream, "messages": []any{map[string]any{"role": "user", "content": content}}})
}

func upstreams(m *gatewaytest.Model) *dsecv1.ModelUpstreams {
	return &dsecv1.ModelUpstreams{Upstreams: []*dsecv1.ModelUpstream{{Name: "vllm", BaseUrl: m.URL, ApiKey: "sk-secret", Models: []string{"policy"}, TimeoutS: 5, IdleTimeoutS: 0.5}}}
}

func TestACallIsForwardedWithTheServersCredentialAndRecorded(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	reg.set("p/s", upstreams(m))
	sb := serveSandbox(t, g, "sb1", "s", nil)

	resp, body := call(t, sb, "/v1/chat/completions", chat("hi", false))
	if resp.StatusCode != 200 || !strings.Contains(body, "echo: hi") {
		t.Fatalf("answer %d %s", resp.StatusCode, body)
	}
	if got := m.Auth[0]; got != "Bearer sk-secret" {
		t.Fatalf("the upstream got credential %q, want the registered one (never the sandbox's placeholder)", got)
	}
	es := sb.tr.all()
	if len(es) != 1 {
		t.Fatalf("%d entries recorded, want 1", len(es))
	}
	mc := es[0].ModelCall
	if mc.Index != 1 || mc.Upstream != "vllm" || mc.Model != "policy" || mc.Status != 200 || mc.Request != chat("hi", false) || mc.Response != body {
		t.Fatalf("recorded %+v", mc)
	}
	if mc.PromptTokens != 3 || mc.CompletionTokens != 2 || fmt.Sprint(mc.TokenIds) != "[7 8]" || fmt.Sprint(mc.Logprobs) != "[-0.5 -1.5]" || fmt.Sprint(mc.PromptTokenIds) != "[1 2 3]" {
		t.Fatalf("tokens recorded: %d %d %v %v %v", mc.PromptTokens, mc.CompletionTokens, mc.TokenIds, mc.Logprobs, mc.PromptTokenIds)
	}
	if strings.Contains(mc.Request+mc.Response, "sk-secret") {
		t.Fatal("the credential is in the log")
	}
}

func TestAStreamPassesThroughAsItComesAndIsRecordedWhole(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	reg.set("p/s", upstreams(m))
	sb := serveSandbox(t, g, "sb1", "s", nil)

	resp, body := call(t, sb, "/v1/chat/completions", chat("hi", true))
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("stream %d %q %q", resp.StatusCode, resp.Header.Get("Content-Type"), body)
	}
	mc := sb.tr.all()[0].ModelCall
	if mc.Response != body || mc.PromptTokens != 3 || mc.CompletionTokens != 2 || fmt.Sprint(mc.TokenIds) != "[10 11]" || fmt.Sprint(mc.Logprobs) != "[-0.25 -0.25]" {
		t.Fatalf("recorded %+v", mc)
	}
}

func TestRateLimitsOfTheUpstreamAreWaitedOutNotSurfaced(t *testing.T) {
	m := gatewaytest.NewModel(t)
	m.Set(func(m *gatewaytest.Model) { m.RateLimit = 3 })
	g, reg := newGateway(t)
	reg.set("p/s", upstreams(m))
	sb := serveSandbox(t, g, "sb1", "s", nil)

	resp, body := call(t, sb, "/v1/chat/completions", chat("hi", false))
	if resp.StatusCode != 200 {
		t.Fatalf("answer %d %s, want the call to succeed after the upstream's 429s", resp.StatusCode, body)
	}
	e := sb.tr.all()[0]
	if e.ModelCall.Retries != 3 || e.Error != nil || m.Calls.Load() != 4 {
		t.Fatalf("retries %d, error %v, upstream calls %d", e.ModelCall.Retries, e.Error, m.Calls.Load())
	}
}

func TestAnUpstreamThatFailsIsAnInfraFailureTheAgentSeesCleanly(t *testing.T) {
	down := gatewaytest.NewModel(t)
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	deadURL := "http://" + l.Addr().String() + "/v1"
	l.Close()
	for _, tc := range []struct {
		name, mode string
		stream     bool
		status     int
	}{
		{"an upstream that refuses connections", "down", false, 502},
		{"an upstream that answers garbage", "garbage", false, 502},
		{"an upstream that hangs", "hang", false, 504},
		{"an upstream that hangs before its stream", "hang", true, 504},
		{"an upstream that stalls mid-stream", "stall", true, 200},
		{"an upstream that cuts its stream", "truncate", true, 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, reg := newGateway(t)
			u := upstreams(down)
			u.Upstreams[0].TimeoutS = 1
			if tc.mode == "down" {
				u.Upstreams[0].BaseUrl = deadURL
			} else {
				down.Set(func(m *gatewaytest.Model) { m.Mode = tc.mode })
			}
			reg.set("p/s", u)
			sb := serveSandbox(t, g, "sb1", "s", nil)
			resp, body := call(t, sb, "/v1/chat/completions", chat("hi", tc.stream))
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d (%s), want %d", resp.StatusCode, body, tc.status)
			}
			if !strings.Contains(body, `"error"`) {
				t.Fatalf("the agent got %q, want an error it can read", body)
			}
			if tc.status != 200 && resp.Header.Get("X-Dsec-Infra") != "true" {
				t.Fatal("no X-Dsec-Infra on the answer")
			}
			e := sb.tr.all()[0]
			if e.Error == nil || !e.Error.Infra {
				t.Fatalf("recorded error %v, want an infra failure", e.Error)
			}
			if len(Completed(sb.tr.all())) != 0 {
				t.Fatal("a failed call is in the replayable prefix")
			}
		})
	}
}

func TestAModelNoUpstreamServesIsRefused(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	reg.set("p/s", upstreams(m))
	sb := serveSandbox(t, g, "sb1", "s", nil)
	resp, body := call(t, sb, "/v1/chat/completions", `{"model":"gpt-9","messages":[]}`)
	if resp.StatusCode != 403 || m.Calls.Load() != 0 {
		t.Fatalf("status %d %s, upstream calls %d", resp.StatusCode, body, m.Calls.Load())
	}
	other := serveSandbox(t, g, "sb2", "another-session", nil)
	if resp, _ := call(t, other, "/v1/chat/completions", chat("hi", false)); resp.StatusCode != 403 {
		t.Fatalf("a session that registered nothing got %d", resp.StatusCode)
	}
}

func TestAResumedSandboxIsFastForwardedThroughTheRecordedCallsThenGoesLive(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	reg.set("p/s", upstreams(m))
	first := serveSandbox(t, g, "sb1", "s", nil)
	var answers []string
	for i, stream := range []bool{false, true, false} {
		_, body := call(t, first, "/v1/chat/completions", chat(fmt.Sprint("turn ", i), stream))
		answers = append(answers, body)
	}
	if m.Calls.Load() != 3 {
		t.Fatalf("%d upstream calls", m.Calls.Load())
	}

	t.Run("the same calls are answered from the log, the next one live", func(t *testing.T) {
		m.Calls.Store(0)
		resumed := serveSandbox(t, g, "sb2", "s", Completed(first.tr.all()))
		for i, stream := range []bool{false, true, false} {
			resp, body := call(t, resumed, "/v1/chat/completions", chat(fmt.Sprint("turn ", i), stream))
			if body != answers[i] || resp.Header.Get("X-Dsec-Replayed") != "true" {
				t.Fatalf("call %d answered %q, recorded %q", i+1, body, answers[i])
			}
		}
		if n := m.Calls.Load(); n != 0 {
			t.Fatalf("the upstream got %d calls for the recorded prefix, want 0", n)
		}
		call(t, resumed, "/v1/chat/completions", chat("turn 3", false))
		if n := m.Calls.Load(); n != 1 {
			t.Fatalf("the call past the prefix reached the upstream %d times, want 1", n)
		}
		es := resumed.tr.all()
		if len(es) != 4 || !es[0].ModelCall.Replayed || es[3].ModelCall.Replayed || es[3].ModelCall.Index != 4 {
			t.Fatalf("resumed log %v", es)
		}
		if got := len(Completed(es)); got != 4 {
			t.Fatalf("the resumed log replays %d calls, want 4 (its own prefix for a second resume)", got)
		}
	})

	t.Run("a call that differs from the recorded one is a divergence and goes live", func(t *testing.T) {
		m.Calls.Store(0)
		resumed := serveSandbox(t, g, "sb3", "s", Completed(first.tr.all()))
		call(t, resumed, "/v1/chat/completions", chat("turn 0", false))
		_, body := call(t, resumed, "/v1/chat/completions", chat("something else", false))
		if !strings.Contains(body, "something else") {
			t.Fatalf("the diverging call was answered %q", body)
		}
		call(t, resumed, "/v1/chat/completions", chat("turn 2", false))
		if n := m.Calls.Load(); n != 2 {
			t.Fatalf("%d upstream calls, want 2 (the diverging one and every one after)", n)
		}
		mc := resumed.tr.all()[1].ModelCall
		if !mc.Diverged || mc.Replayed || !strings.Contains(mc.Detail, "call 2") || !strings.Contains(mc.Detail, "messages") {
			t.Fatalf("divergence recorded as %+v", mc)
		}
	})
}

func TestASandboxThatFloodsTheGatewayMeetsItsOwnLimitNotItsNeighbours(t *testing.T) {
	m := gatewaytest.NewModel(t)
	hold := make(chan struct{})
	m.Set(func(m *gatewaytest.Model) { m.Hold = hold })
	g, reg := newGateway(t)
	u := upstreams(m)
	u.Limits = &dsecv1.ModelLimits{PerSandboxConcurrent: 2}
	reg.set("p/s", u)
	flood := serveSandbox(t, g, "sb1", "s", nil)
	neighbour := serveSandbox(t, g, "sb2", "s", nil)

	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); call(t, flood, "/v1/chat/completions", chat("held", false)) }()
	}
	waitCalls(t, m, 2)
	if resp, _ := call(t, flood, "/v1/chat/completions", chat("third", false)); resp.StatusCode != 429 {
		t.Fatalf("a third call of the flooding sandbox got %d, want 429", resp.StatusCode)
	}
	done := make(chan int)
	go func() {
		resp, _ := call(t, neighbour, "/v1/chat/completions", chat("mine", false))
		done <- resp.StatusCode
	}()
	waitCalls(t, m, 3)
	close(hold)
	if st := <-done; st != 200 {
		t.Fatalf("the neighbour got %d", st)
	}
	wg.Wait()
}

func TestASessionsLimitsHoldItsCalls(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	u := upstreams(m)
	u.Limits = &dsecv1.ModelLimits{TokenBudget: 10}
	reg.set("p/s", u)
	sb := serveSandbox(t, g, "sb1", "s", nil)
	for i := 0; i < 2; i++ {
		if resp, _ := call(t, sb, "/v1/chat/completions", chat("hi", false)); resp.StatusCode != 200 {
			t.Fatalf("call %d: %d", i, resp.StatusCode)
		}
	}
	resp, body := call(t, sb, "/v1/chat/completions", chat("hi", false))
	if resp.StatusCode != 429 || !strings.Contains(body, "budget") || resp.Header.Get("X-Dsec-Infra") != "" {
		t.Fatalf("past the budget: %d %s", resp.StatusCode, body)
	}

	t.Run("max_concurrent makes calls wait for a slot", func(t *testing.T) {
		hold := make(chan struct{})
		m.Set(func(m *gatewaytest.Model) { m.Hold = hold })
		u := upstreams(m)
		u.Limits = &dsecv1.ModelLimits{MaxConcurrent: 1}
		reg.set("p/s2", u)
		a := serveSandbox(t, g, "sb2", "s2", nil)
		b := serveSandbox(t, g, "sb3", "s2", nil)
		m.Calls.Store(0)
		results := make(chan int, 2)
		go func() { resp, _ := call(t, a, "/v1/chat/completions", chat("a", false)); results <- resp.StatusCode }()
		waitCalls(t, m, 1)
		m.Set(func(m *gatewaytest.Model) { m.Peak = 0 })
		go func() { resp, _ := call(t, b, "/v1/chat/completions", chat("b", false)); results <- resp.StatusCode }()
		close(hold)
		if a, b := <-results, <-results; a != 200 || b != 200 {
			t.Fatalf("statuses %d %d", a, b)
		}
		if m.Calls.Load() != 2 || m.Peak != 1 {
			t.Fatalf("%d upstream calls, %d at once: the slot did not hold the second call", m.Calls.Load(), m.Peak)
		}
	})
}

func TestAnthropicsMessagesGoWithItsOwnHeaders(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	u := upstreams(m)
	u.Upstreams[0].Api = "anthropic"
	reg.set("p/s", u)
	sb := serveSandbox(t, g, "sb1", "s", nil)
	// ANTHROPIC_BASE_URL has no /v1: the SDK calls /v1/messages below it.
	resp, body := call(t, sb, "/v1/messages", `{"model":"policy","max_tokens":8,"messages":[{"role":"user","content":"hey"}]}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "echo: hey") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if m.Auth[0] != "sk-secret" {
		t.Fatalf("upstream credential %q, want x-api-key", m.Auth[0])
	}
	if mc := sb.tr.all()[0].ModelCall; mc.PromptTokens != 3 || mc.CompletionTokens != 2 {
		t.Fatalf("usage %d %d", mc.PromptTokens, mc.CompletionTokens)
	}
}

func TestModelsListsTheSessionsModels(t *testing.T) {
	m := gatewaytest.NewModel(t)
	g, reg := newGateway(t)
	reg.set("p/s", upstreams(m))
	sb := serveSandbox(t, g, "sb1", "s", nil)
	resp, err := http.Get(sb.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	if !strings.Contains(line, `"id":"policy"`) {
		t.Fatalf("models: %s", line)
	}
}

func waitCalls(t *testing.T, m *gatewaytest.Model, n int64) {
	t.Helper()
	if !m.WaitCalls(n, 10*time.Second) {
		t.Fatalf("the model got %d calls within 10s, want %d", m.Calls.Load(), n)
	}
}

func TestTheGatewayNeverDialsLinkLocalAddresses(t *testing.T) {
	// A cloud's metadata service answers on 169.254.169.254: an upstream
	// registered there (or a name resolving there) is not dialed.
	g, reg := newGateway(t)
	reg.set("p/s", &dsecv1.ModelUpstreams{Upstreams: []*dsecv1.ModelUpstream{{Name: "meta", BaseUrl: "http://169.254.169.254/latest", TimeoutS: 5}}})
	sb := serveSandbox(t, g, "sb1", "s", nil)
	resp, body := call(t, sb, "/v1/chat/completions", chat("hi", false))
	if resp.StatusCode != 502 {
		t.Fatalf("status %d %s", resp.StatusCode, body)
	}
	e := sb.tr.all()[0]
	if e.Error == nil || !strings.Contains(e.Error.Message, "unreachable") {
		t.Fatalf("recorded %v", e.Error)
	}
	if err := refuseLinkLocal("tcp", "169.254.169.254:80", nil); err == nil {
		t.Fatal("a link-local address is dialed")
	}
	if err := refuseLinkLocal("tcp", "127.0.0.1:8000", nil); err != nil {
		t.Fatalf("a loopback upstream is refused: %v", err)
	}
}
