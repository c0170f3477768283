package node

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway/gatewaytest"
	"github.com/opendsec/dsec/internal/session"
)

// withModels gives tn a session store (the one `dsec serve` uses) whose
// session s of the default project has m as its upstream, with a key.
func withModels(t *testing.T, tn *testNode, m *gatewaytest.Model) {
	t.Helper()
	store, err := session.OpenBolt(filepath.Join(t.TempDir(), "control.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	cfg := &dsecv1.ModelUpstreams{Session: "s", Upstreams: []*dsecv1.ModelUpstream{{Name: "vllm", BaseUrl: m.URL, ApiKey: "sk-on-the-server", Models: []string{"policy"}}}}
	b, _ := protojson.Marshal(cfg)
	if err := store.PutModels(context.Background(), session.Key("default", "s"), b); err != nil {
		t.Fatal(err)
	}
	tn.UseModelRegistry(func(ctx context.Context, project, name string) (*dsecv1.ModelUpstreams, error) {
		return session.Models(ctx, store, project, name)
	})
}

// chatIn makes a chat completion from inside sandbox id, with busybox's
// wget and the address and key the sandbox's environment gives, and
// returns the answer.
func chatIn(t *testing.T, tn *testNode, id, content string) string {
	t.Helper()
	body := fmt.Sprintf(`{"model":"policy","messages":[{"role":"user","content":%q}]}`, content)
	return tn.sh(bg, id, `wget -q -O - --header "Authorization: Bearer $OPENAI_API_KEY" --header 'Content-Type: application/json' --post-data '`+body+`' "$OPENAI_BASE_URL/chat/completions"`)
}

func modelCalls(t *testing.T, tn *testNode, id string) []*dsecv1.ModelCall {
	t.Helper()
	l, err := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: id})
	if err != nil {
		t.Fatal(err)
	}
	var out []*dsecv1.ModelCall
	for _, e := range l.Entries {
		if e.Op == "model_call" {
			out = append(out, e.ModelCall)
		}
	}
	return out
}

func TestAnAgentInTheSandboxReachesItsSessionsModelThroughTheGateway(t *testing.T) {
	tn := newTestNode(t, nil)
	m := gatewaytest.NewModel(t)
	withModels(t, tn, m)
	// No network: the gateway is on the sandbox's own loopback.
	sb := tn.create(bg, &dsecv1.SandboxSpec{Session: "s", ModelGateway: &dsecv1.ModelGateway{Enabled: true}})

	env := tn.sh(bg, sb.Id, "env")
	if !strings.Contains(env, "OPENAI_BASE_URL=http://127.0.0.1:4319/v1") || strings.Contains(env, "sk-on-the-server") {
		t.Fatalf("the sandbox's environment:\n%s", env)
	}
	if got := chatIn(t, tn, sb.Id, "hello"); !strings.Contains(got, "echo: hello") {
		t.Fatalf("the model call answered %q", got)
	}
	if got := m.Auth[0]; got != "Bearer sk-on-the-server" {
		t.Fatalf("the upstream got %q, want the session's key", got)
	}
	calls := modelCalls(t, tn, sb.Id)
	if len(calls) != 1 || calls[0].Index != 1 || calls[0].Status != 200 || calls[0].Upstream != "vllm" || calls[0].CompletionTokens != 2 {
		t.Fatalf("the log holds %v", calls)
	}
	if strings.Contains(tn.sh(bg, sb.Id, "cat /proc/1/environ | tr '\\0' '\\n'; ls -a / /tmp"), "sk-on-the-server") {
		t.Fatal("the upstream's key is inside the sandbox")
	}

	t.Run("a sandbox fast-forwarded from it gets the recorded answers without the upstream", func(t *testing.T) {
		m.Calls.Store(0)
		again := tn.create(bg, &dsecv1.SandboxSpec{Session: "s", ModelGateway: &dsecv1.ModelGateway{Enabled: true, FastForwardFrom: sb.Id}})
		if got := chatIn(t, tn, again.Id, "hello"); !strings.Contains(got, "echo: hello") {
			t.Fatalf("answered %q", got)
		}
		if n := m.Calls.Load(); n != 0 {
			t.Fatalf("the upstream got %d calls for the recorded prefix", n)
		}
		chatIn(t, tn, again.Id, "and then")
		if n := m.Calls.Load(); n != 1 {
			t.Fatalf("the call past the prefix reached the upstream %d times, want 1", n)
		}
		calls := modelCalls(t, tn, again.Id)
		if len(calls) != 2 || !calls[0].Replayed || calls[1].Replayed || calls[1].Index != 2 {
			t.Fatalf("the resumed sandbox's log holds %v", calls)
		}
	})

	t.Run("a node restart keeps the gateway and the numbering", func(t *testing.T) {
		tn.restart(nil)
		withModels(t, tn, m)
		chatIn(t, tn, sb.Id, "after the restart")
		calls := modelCalls(t, tn, sb.Id)
		if len(calls) != 2 || calls[1].Index != 2 {
			t.Fatalf("after a restart the log holds %v", calls)
		}
	})
}

func TestBadModelGatewaySpecs(t *testing.T) {
	tn := newTestNode(t, nil)
	for _, tc := range []struct {
		name string
		spec *dsecv1.SandboxSpec
		kind errdefs.Kind
	}{
		{"fast-forwarded without the gateway", &dsecv1.SandboxSpec{Image: "busybox", Session: "s", ModelGateway: &dsecv1.ModelGateway{FastForwardFrom: "x"}}, errdefs.KindInvalid},
		{"fast-forwarded from a sandbox of another project", &dsecv1.SandboxSpec{Image: "busybox", Session: "s", ModelGateway: &dsecv1.ModelGateway{Enabled: true, FastForwardFrom: tn.create(as("other"), nil).Id}}, errdefs.KindNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: tc.spec, Project: "default"})
			if !errdefs.Is(err, tc.kind) {
				t.Fatalf("create: %v, want %s", err, tc.kind)
			}
		})
	}
}
