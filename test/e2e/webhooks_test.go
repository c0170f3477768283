package e2e

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestWebhooksRegisteredThroughTheAPI: a trainer registers its own URL
// (no server configuration), receives its project's events signed with its
// secret, and nobody else's; another project can neither see nor remove
// it; a registration survives a restart; disabled or deleted, it stops.
func TestWebhooksRegisteredThroughTheAPI(t *testing.T) {
	const keyA, keyB = "proj-a=webhook-key-of-project-a-0123", "proj-b=webhook-key-of-project-b-0123"
	secret := "a-secret-of-project-a"
	hook := &hookReceiver{t: t, secret: []byte(secret), more: make(chan struct{}, 1)}
	receiver := httptest.NewServer(hook)
	defer receiver.Close()
	const admin = "webhook-test-operator-key-0123456789"
	srv := dsectest.Start(t, dsectest.Options{APIKeys: []string{keyA, keyB}, Args: []string{"--admin-key", admin}})
	a := srv.Client()
	b := dsec.New(srv.URL, dsec.WithAPIKey(strings.SplitN(keyB, "=", 2)[1]))
	ctx := ctxFor(t, 3*time.Minute)

	// Refused: no secret, a URL that is not http(s), an unknown type, a
	// malformed selector; and without a key.
	for name, o := range map[string]dsec.WebhookOptions{
		"no secret":    {URL: receiver.URL},
		"a file URL":   {URL: "file:///etc/passwd", Secret: secret},
		"a bad type":   {URL: receiver.URL, Secret: secret, Types: []string{"exploded"}},
		"bad selector": {URL: receiver.URL, Secret: secret, Labels: "not a key=1"},
	} {
		if _, err := a.CreateWebhook(ctx, o); kind(err) != "invalid" {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
	if _, err := dsec.New(srv.URL).CreateWebhook(ctx, dsec.WebhookOptions{URL: receiver.URL, Secret: secret}); kind(err) != "unauthenticated" {
		t.Errorf("without a key: %v, want unauthenticated", err)
	}

	w, err := a.CreateWebhook(ctx, dsec.WebhookOptions{URL: receiver.URL + "/hook", Secret: secret, Name: "rollouts", Labels: "job=hooked", Types: []string{"created", "ended"}})
	if err != nil {
		t.Fatal(err)
	}
	if w.Id == "" || w.Project != "proj-a" || !w.Enabled || w.Format != "dsec" || w.Name != "rollouts" {
		t.Fatalf("registered %v", w)
	}
	// Project B sees none of it and cannot remove it.
	if list, err := b.Webhooks(ctx); err != nil || len(list) != 0 {
		t.Errorf("project B lists %v (%v)", list, err)
	}
	if err := b.DeleteWebhook(ctx, w.Id); kind(err) != "not_found" {
		t.Errorf("project B deleting A's webhook: %v, want not found", err)
	}

	// A's labelled sandbox is delivered, signed; its other sandboxes and
	// B's are not.
	mine := create(t, a, dsec.CreateOptions{Labels: map[string]string{"job": "hooked"}})
	unlabelled := create(t, a, dsec.CreateOptions{})
	theirs := create(t, b, dsec.CreateOptions{Labels: map[string]string{"job": "hooked"}})
	if got := hook.await("created", mine.ID); got.Project != "proj-a" || got.Labels["job"] != "hooked" {
		t.Errorf("delivered %v", got)
	}
	if err := mine.Close(); err != nil {
		t.Fatal(err)
	}
	if got := hook.await("ended", mine.ID); got.Cause != "deleted" || got.Infra {
		t.Errorf("delivered %v", got)
	}
	for _, ev := range hook.all() {
		if ev.SandboxId == unlabelled.ID || ev.SandboxId == theirs.ID || (ev.Type != "created" && ev.Type != "ended") {
			t.Errorf("delivered an event it did not ask for: %v", ev)
		}
	}

	// The registration survives a restart (the data directory keeps it)
	// and its secret is never shown.
	srv.Restart()
	list, err := a.Webhooks(ctx)
	if err != nil || len(list) != 1 || list[0].Id != w.Id || list[0].Url != receiver.URL+"/hook" {
		t.Fatalf("after a restart A lists %v (%v)", list, err)
	}
	if b, _ := os.ReadFile(filepath.Join(srv.DataDir, "webhooks.json")); !strings.Contains(string(b), w.Id) {
		t.Errorf("webhooks.json does not hold the registration")
	}
	if st, err := os.Stat(filepath.Join(srv.DataDir, "webhooks.json")); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("webhooks.json: %v, mode %v; want 0600 (it holds secrets)", err, st.Mode())
	}
	after := create(t, a, dsec.CreateOptions{Labels: map[string]string{"job": "hooked"}})
	hook.await("created", after.ID)

	// Disabled, then deleted: no more deliveries. Each call returns once
	// the delivery has stopped; a second webhook, still enabled, shows
	// when the events of a sandbox made afterwards have gone out.
	sentinel := &hookReceiver{t: t, secret: []byte(secret), more: make(chan struct{}, 1)}
	sentinelSrv := httptest.NewServer(sentinel)
	defer sentinelSrv.Close()
	if _, err := a.CreateWebhook(ctx, dsec.WebhookOptions{URL: sentinelSrv.URL, Secret: secret, Labels: "job=hooked", Types: []string{"created", "ended"}}); err != nil {
		t.Fatal(err)
	}
	if w, err := a.EnableWebhook(ctx, w.Id, false); err != nil || w.Enabled {
		t.Fatalf("disable: %v %v", w, err)
	}
	quiet := func(what string) {
		t.Helper()
		before := len(hook.all())
		sb := create(t, a, dsec.CreateOptions{Labels: map[string]string{"job": "hooked"}})
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
		sentinel.await("ended", sb.ID)
		if got := hook.all(); len(got) != before {
			t.Errorf("%s: %d more deliveries: %v", what, len(got)-before, got[before:])
		}
	}
	quiet("disabled")
	if err := a.DeleteWebhook(ctx, w.Id); err != nil {
		t.Fatal(err)
	}
	if list, err := a.Webhooks(ctx); err != nil || len(list) != 1 || list[0].Id == w.Id {
		t.Errorf("after delete A lists %v (%v), want the sentinel only", list, err)
	}
	quiet("deleted")

	// The CLI registers, lists and removes.
	secretFile := filepath.Join(t.TempDir(), "secret")
	os.WriteFile(secretFile, []byte(secret+"\n"), 0o600)
	id, stderr, code := srv.CLI(ctx, "", "webhook", "create", "--url", receiver.URL+"/cli", "--secret-file", secretFile, "--type", "created")
	id = strings.TrimSpace(id)
	if code != 0 || !strings.HasPrefix(id, "wh-") {
		t.Fatalf("dsec webhook create: %q %q (exit %d)", id, stderr, code)
	}
	if out, _, _ := srv.CLI(ctx, "", "webhook", "ls"); !strings.Contains(out, id) || !strings.Contains(out, "/cli") {
		t.Errorf("dsec webhook ls: %q", out)
	}
	cliSb := create(t, a, dsec.CreateOptions{})
	hook.await("created", cliSb.ID)
	if _, stderr, code := srv.CLI(ctx, "", "webhook", "rm", id); code != 0 {
		t.Errorf("dsec webhook rm: %q (exit %d)", stderr, code)
	}

	_, _, samples := dsectest.Scrape(t, srv.URL, admin)
	// (Counted since the restart: after's and the CLI's sandboxes.)
	if n := samples[`dsec_api_webhook_deliveries_total{result="delivered"}`]; n < 2 {
		t.Errorf("%v deliveries counted delivered since the restart, want at least 2", n)
	}
}

// all is every event the receiver holds.
func (h *hookReceiver) all() []*dsecv1.Event {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*dsecv1.Event(nil), h.got...)
}

// A receiver that is down or slow delays only its own deliveries: creates
// go on at their pace while every try of its deliveries fails.
func TestAWebhookThatIsDownNeverSlowsSandboxes(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	// The hanging receiver holds each delivery until dsec gives up on it
	// (its 10 s timeout), or the test ends.
	done := make(chan struct{})
	var held []time.Duration
	var mu sync.Mutex
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		io.Copy(io.Discard, r.Body) // (then the server notices a closed connection)
		select {
		case <-r.Context().Done():
		case <-done:
		}
		mu.Lock()
		held = append(held, time.Since(start))
		mu.Unlock()
	}))
	defer hang.Close()
	defer close(done)
	if _, err := c.CreateWebhook(ctx, dsec.WebhookOptions{URL: hang.URL, Secret: "s"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateWebhook(ctx, dsec.WebhookOptions{URL: "http://127.0.0.1:1/refused", Secret: "s"}); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		sb, err := c.Create(cctx, dsec.CreateOptions{Image: "busybox", TTL: time.Minute})
		cancel()
		if err != nil {
			t.Fatalf("create %d beside a hanging webhook: %v", i, err)
		}
		sb.Close()
	}
	_, _, samples := dsectest.Scrape(t, srv.URL, "")
	if samples[`dsec_api_webhook_deliveries_total{result="retried"}`] == 0 {
		t.Errorf("no delivery to the refusing URL was retried")
	}
	mu.Lock()
	t.Logf("the hanging receiver has let %d deliveries go (dsec gives each up after 10 s)", len(held))
	mu.Unlock()
}
