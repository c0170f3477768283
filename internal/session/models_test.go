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

	t.Run("a heartbeat keeps them", func(t *testing.T) {
		if _, err := m.Heartbeat(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if full, _ := Models(context.Background(), store, "p", "s"); full == nil || len(full.Upstreams) != 1 {
			t.Fatalf("after a heartbeat: %v", full)
		}
	})

	t.Run("closing the session removes them", func(t *testing.T) {
		if _, err := m.Close(ctx, "s", false); err != nil {
			t.Fatal(err)
		}
		if full, err := Models(context.Background(), store, "p", "s"); full != nil || err != nil {
			t.Fatalf("after close: %v, %v", full, err)
		}
		if _, err := m.Open(ctx, &dsecv1.OpenSessionRequest{Name: "s"}); err != nil {
			t.Fatal(err)
		}
		if u, err := m.GetModels(ctx, "s"); err != nil || len(u.Upstreams) != 0 || !strings.Contains(u.Session, "s") {
			t.Fatalf("a reopened session has %v, %v", u, err)
		}
	})
}
