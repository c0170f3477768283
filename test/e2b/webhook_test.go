package e2b_test

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// e2bDelivery is what E2B's webhook receivers read (E2B's lifecycle
// webhooks documentation: the payload, and the headers they check).
type e2bDelivery struct {
	Version   string `json:"version"`
	ID        string `json:"id"`
	Type      string `json:"type"`
	EventData struct {
		SandboxMetadata map[string]string `json:"sandbox_metadata"`
		// On killed and paused events.
		Execution *struct {
			StartedAt     string `json:"started_at"`
			VCPUCount     int    `json:"vcpu_count"`
			MemoryMB      int64  `json:"memory_mb"`
			ExecutionTime int64  `json:"execution_time"`
		} `json:"execution"`
	} `json:"eventData"`
	SandboxID         string `json:"sandboxId"`
	SandboxTeamID     string `json:"sandboxTeamId"`
	SandboxTemplateID string `json:"sandboxTemplateId"`
	Timestamp         string `json:"timestamp"`
	webhookID         string
}

// e2bReceiver checks each delivery as E2B tells receivers to: the
// e2b-signature header is the unpadded base64 SHA-256 of the secret
// followed by the raw body.
type e2bReceiver struct {
	t      *testing.T
	secret string
	mu     sync.Mutex
	got    []e2bDelivery
}

func (h *e2bReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	sum := sha256.Sum256(append([]byte(h.secret), body...))
	if r.Header.Get("e2b-signature") != base64.RawStdEncoding.EncodeToString(sum[:]) || r.Header.Get("e2b-signature-version") != "v1" || r.Header.Get("e2b-delivery-id") == "" {
		h.t.Errorf("a delivery with a bad signature or headers: %v %s", r.Header, body)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	var d e2bDelivery
	if err := json.Unmarshal(body, &d); err != nil {
		h.t.Errorf("a delivery that is not E2B's payload: %s", body)
	}
	d.webhookID = r.Header.Get("e2b-webhook-id")
	h.mu.Lock()
	h.got = append(h.got, d)
	h.mu.Unlock()
}

func (h *e2bReceiver) await(typ, id string) e2bDelivery {
	h.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		h.mu.Lock()
		for _, d := range h.got {
			if d.Type == typ && d.SandboxID == id {
				h.mu.Unlock()
				return d
			}
		}
		h.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	h.t.Fatalf("no %s delivery for %s within a minute", typ, id)
	return e2bDelivery{}
}

// TestLifecycleWebhooksAsE2BRegistersThem: the calls of E2B's webhook
// documentation, unchanged, register a webhook, and its deliveries are
// what an E2B receiver verifies and reads.
func TestLifecycleWebhooksAsE2BRegistersThem(t *testing.T) {
	s := server(t)
	key := map[string]string{"X-API-Key": apiKey, "Content-Type": "application/json"}
	hook := &e2bReceiver{t: t, secret: "secret-for-event-signature-verification"}
	receiver := httptest.NewServer(hook)
	defer receiver.Close()

	r := do(t, "POST", s.URL+"/events/webhooks", key, []byte(`{"name":"My Sandbox Webhook","url":"`+receiver.URL+`/webhook","enabled":true,`+
		`"events":["sandbox.lifecycle.created","sandbox.lifecycle.updated","sandbox.lifecycle.killed"],"signatureSecret":"`+hook.secret+`"}`))
	if r.status != http.StatusCreated {
		t.Fatalf("register: %d %s", r.status, r.body)
	}
	var w struct {
		ID        string   `json:"id"`
		TeamID    string   `json:"teamID"`
		Name      string   `json:"name"`
		CreatedAt string   `json:"createdAt"`
		Enabled   bool     `json:"enabled"`
		URL       string   `json:"url"`
		Events    []string `json:"events"`
		Secret    *string  `json:"signatureSecret"`
	}
	if err := json.Unmarshal(r.body, &w); err != nil || w.ID == "" || w.Name != "My Sandbox Webhook" || !w.Enabled || len(w.Events) != 3 || w.Secret != nil || w.CreatedAt == "" {
		t.Fatalf("registered %s (%v)", r.body, err)
	}
	t.Cleanup(func() { do(t, "DELETE", s.URL+"/events/webhooks/"+w.ID, key, nil) })
	for _, bad := range []string{`{"url":"` + receiver.URL + `","events":["sandbox.exploded"],"signatureSecret":"s"}`, `{"url":"ftp://x","signatureSecret":"s"}`, `{"url":"` + receiver.URL + `"}`} {
		wantE2BError(t, do(t, "POST", s.URL+"/events/webhooks", key, []byte(bad)), http.StatusBadRequest)
	}
	wantE2BError(t, do(t, "POST", s.URL+"/events/webhooks", nil, []byte(`{}`)), http.StatusUnauthorized)

	// A sandbox created with metadata: created, then killed, in E2B's
	// payload; paused is not among the events asked for.
	rc := do(t, "POST", s.URL+"/v2/sandboxes", key, []byte(`{"templateID":"base","timeout":300,"metadata":{"rollout":"r-7"}}`))
	if rc.status != http.StatusCreated {
		t.Fatalf("create: %d %s", rc.status, rc.body)
	}
	var c created
	json.Unmarshal(rc.body, &c)
	d := hook.await("sandbox.lifecycle.created", c.SandboxID)
	if d.Version != "v2" || d.ID == "" || d.EventData.SandboxMetadata["rollout"] != "r-7" || d.SandboxTemplateID != "base" || d.webhookID != w.ID || d.Timestamp == "" {
		t.Errorf("created delivery %+v", d)
	}
	if r := do(t, "POST", s.URL+"/sandboxes/"+c.SandboxID+"/pause", key, nil); r.status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	if r := do(t, "DELETE", s.URL+"/sandboxes/"+c.SandboxID, key, nil); r.status != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.status, r.body)
	}
	if d.EventData.Execution != nil {
		t.Errorf("a created delivery with an execution: %+v", d.EventData.Execution)
	}
	killed := hook.await("sandbox.lifecycle.killed", c.SandboxID)
	// The execution that stopped: from the create to the pause (E2B's
	// eventData.execution), in whole vCPUs and milliseconds.
	x := killed.EventData.Execution
	if x == nil {
		t.Fatalf("the killed delivery has no execution: %+v", killed)
	}
	started, err := time.Parse(time.RFC3339, x.StartedAt)
	if err != nil || time.Since(started) > time.Minute || x.VCPUCount < 1 || x.MemoryMB < 16 || x.ExecutionTime < 0 || x.ExecutionTime > time.Since(started).Milliseconds()+1000 {
		t.Errorf("the killed delivery's execution: %+v (%v)", x, err)
	}
	hook.mu.Lock()
	for _, d := range hook.got {
		if d.Type == "sandbox.lifecycle.paused" {
			t.Errorf("a paused delivery, not asked for: %+v", d)
		}
	}
	hook.mu.Unlock()

	// List, get, update and delete, as E2B's API answers them.
	r = do(t, "GET", s.URL+"/events/webhooks", key, nil)
	var list []map[string]any
	if r.status != http.StatusOK || json.Unmarshal(r.body, &list) != nil || len(list) != 1 || list[0]["id"] != w.ID {
		t.Fatalf("list: %d %s", r.status, r.body)
	}
	r = do(t, "PATCH", s.URL+"/events/webhooks/"+w.ID, key, []byte(`{"enabled":false}`))
	if r.status != http.StatusOK || json.Unmarshal(r.body, &w) != nil || w.Enabled || w.Name != "My Sandbox Webhook" {
		t.Fatalf("update: %d %s", r.status, r.body)
	}
	if r := do(t, "GET", s.URL+"/events/webhooks/"+w.ID, key, nil); r.status != http.StatusOK {
		t.Fatalf("get: %d %s", r.status, r.body)
	}
	if r := do(t, "DELETE", s.URL+"/events/webhooks/"+w.ID, key, nil); r.status != http.StatusOK {
		t.Fatalf("delete: %d %s", r.status, r.body)
	}
	wantE2BError(t, do(t, "GET", s.URL+"/events/webhooks/"+w.ID, key, nil), http.StatusNotFound)
}
