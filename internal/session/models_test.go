package session

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

func TestASessionsModelUpstreams(t *testing.T) {
	store, err := OpenBolt(filepath.Join(t.TempDir(), "control.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	m := New(store, func(context.Context, string, string, string) (int, error) { return 0, nil }, slog.Default())
	ctx := tenant.With(context.Background(), tenant.Caller{Project: "p"})
	up := func(url string) *dsecv1.SetModelUpstreamsRequest {
		return &dsecv1.SetModelUpstreamsRequest{Session: "s", Upstreams: []*dsecv1.ModelUpstream{{Name: "vllm", BaseUrl: url, ApiKey: "sk-1", Models: []string{"m"}}}}
	}

	if _, err := m.SetModels(ctx, up("http://10.0.0.5:8000/v1")); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("upstreams of a session that does not exist: %v", err)
	}
	if _, err := m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"ftp://x/v1", "http://user:pw@x/v1", "http://x/v1?a=", "http://x/v1#f", "/v1", "http:///v1"} {
		if _, err := m.SetModels(ctx, up(bad)); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("base_url %q: %v, want invalid", bad, err)
		}
	}
	got, err := m.SetModels(ctx, up("http://10.0.0.5:8000/v1"))
	if err != nil {
		t.Fatal(err)
	}
	if u := got.Upstreams[0]; u.ApiKey != "" || !u.HasApiKey {
		t.Fatalf("the answer shows the key: %v", u)
	}
	if u, _ := m.GetModels(ctx, "s"); u.Upstreams[0].ApiKey != "" || !u.Upstreams[0].HasApiKey {
		t.Fatalf("get shows the key: %v", u)
	}
	// The gateway's read has the key; another project's session of the
	// same name has nothing.
	full, err := Models(context.Background(), store, "p", "s")
	if err != nil || full.Upstreams[0].ApiKey != "sk-1" {
		t.Fatalf("the gateway reads %v, %v", full, err)
	}
	if other, err := Models(context.Background(), store, "q", "s"); other != nil || err != nil {
		t.Fatalf("project q reads %v, %v", other, err)
	}
	if _, err := m.GetModels(tenant.With(context.Background(), tenant.Caller{Project: "q"}), "s"); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("project q gets %v", err)
	}

	t.Run("a project's own upstreams come after its sessions'", func(t *testing.T) {
		shared := &dsecv1.SetModelUpstreamsRequest{Upstreams: []*dsecv1.ModelUpstream{{Name: "hosted", BaseUrl: "https://api.example.com/v1", ApiKey: "sk-2"}},
			Limits: &dsecv1.ModelLimits{MaxConcurrent: 8}}
		if _, err := m.SetModels(ctx, shared); err != nil {
			t.Fatal(err)
		}
		if got, _ := m.GetModels(ctx, ""); len(got.Upstreams) != 1 || got.Upstreams[0].ApiKey != "" || !got.Upstreams[0].HasApiKey {
			t.Fatalf("the project's: %v", got)
		}
		both, err := Models(context.Background(), store, "p", "s")
		if err != nil || len(both.Upstreams) != 2 || both.Upstreams[0].Name != "vllm" || both.Upstreams[1].Name != "hosted" || both.Limits.GetMaxConcurrent() != 8 {
			t.Fatalf("session s reaches %v, %v", both, err)
		}
		alone, err := Models(context.Background(), store, "p", "")
		if err != nil || len(alone.Upstreams) != 1 || alone.Upstreams[0].ApiKey != "sk-2" {
			t.Fatalf("a sandbox without a session reaches %v, %v", alone, err)
		}
		if other, err := Models(context.Background(), store, "q", ""); other != nil || err != nil {
			t.Fatalf("project q reaches %v, %v", other, err)
		}
	})

	t.Run("a heartbeat keeps them", func(t *testing.T) {
		if _, err := m.Heartbeat(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if full, _ := Models(context.Background(), store, "p", "s"); full == nil || len(full.Upstreams) != 2 || full.Upstreams[0].Name != "vllm" {
			t.Fatalf("after a heartbeat: %v", full)
		}
	})

	t.Run("closing the session removes them", func(t *testing.T) {
		if _, err := m.Close(ctx, "s", false); err != nil {
			t.Fatal(err)
		}
		if full, err := Models(context.Background(), store, "p", "s"); len(full.GetUpstreams()) != 1 || full.Upstreams[0].Name != "hosted" || err != nil {
			t.Fatalf("after close (the project's remain): %v, %v", full, err)
		}
		if _, err := m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s"}); err != nil {
			t.Fatal(err)
		}
		if u, err := m.GetModels(ctx, "s"); err != nil || len(u.Upstreams) != 0 || !strings.Contains(u.Session, "s") {
			t.Fatalf("a reopened session has %v, %v", u, err)
		}
	})
}
