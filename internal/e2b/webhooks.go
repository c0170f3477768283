package e2b

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
)

// E2B's sandbox lifecycle webhooks (POST /events/webhooks and the rest):
// registrations are kept and delivered by the server's apiserver.Hooks,
// like the native WebhookService's, in E2B's payload and signature.

// E2B's event types, by the dsec event each is ("updated", a change of a
// sandbox's timeout, has no dsec event: it is accepted and never sent).
var e2bEventOf = map[string]string{
	events.Created:     "sandbox.lifecycle.created",
	events.Ended:       "sandbox.lifecycle.killed",
	events.Paused:      "sandbox.lifecycle.paused",
	events.Resumed:     "sandbox.lifecycle.resumed",
	events.Snapshotted: "sandbox.lifecycle.checkpointed",
}

const e2bUpdated = "sandbox.lifecycle.updated"

// webhookJSON is E2B's webhook registration, as the API answers it.
type webhookJSON struct {
	ID        string   `json:"id"`
	TeamID    string   `json:"teamID"`
	Name      string   `json:"name"`
	CreatedAt string   `json:"createdAt"`
	Enabled   bool     `json:"enabled"`
	URL       string   `json:"url"`
	Events    []string `json:"events"`
}

// webhookBody is the body of a registration and of its update (absent
// fields stay as they were).
type webhookBody struct {
	Name            *string  `json:"name"`
	URL             *string  `json:"url"`
	Enabled         *bool    `json:"enabled"`
	Events          []string `json:"events"`
	SignatureSecret *string  `json:"signatureSecret"`
}

// apply sets the fields b has on h (at creation, the event list even
// when absent: every event).
func (b webhookBody) apply(h *events.Hook, creating bool) error {
	if b.Name != nil {
		h.Name = *b.Name
	}
	if b.URL != nil {
		h.URL = *b.URL
	}
	if b.Enabled != nil {
		h.Enabled = *b.Enabled
	}
	if b.SignatureSecret != nil {
		h.Secret = []byte(*b.SignatureSecret)
	}
	if b.Events != nil || creating {
		return setEvents(h, b.Events)
	}
	return nil
}

func hookJSON(h *events.Hook) webhookJSON {
	evs := h.Shown
	if evs == nil {
		evs = []string{}
	}
	return webhookJSON{ID: h.ID, TeamID: h.Project, Name: h.Name, CreatedAt: h.CreatedAt.Format(time.RFC3339), Enabled: h.Enabled, URL: h.URL, Events: evs}
}

// setEvents sets h's E2B event names and the dsec types they select
// (none selected, as with only "updated": every event reaches the format,
// which sends none).
func setEvents(h *events.Hook, names []string) error {
	var types []string
	for _, n := range names {
		found := n == e2bUpdated
		for t, e := range e2bEventOf {
			if e == n {
				types, found = append(types, t), true
			}
		}
		if !found {
			return errdefs.Invalid("unknown event type %q (want sandbox.lifecycle.created, killed, updated, paused, resumed or checkpointed)", n)
		}
	}
	slices.Sort(types)
	h.Shown, h.Types = slices.Clone(names), types
	return nil
}

func (f *Facade) mountWebhooks(h func(string, func(http.ResponseWriter, *http.Request, string))) {
	h("POST /events/webhooks", f.createWebhook)
	h("GET /events/webhooks", f.listWebhooks)
	h("GET /events/webhooks/{id}", f.getWebhook)
	h("PATCH /events/webhooks/{id}", f.updateWebhook)
	h("DELETE /events/webhooks/{id}", f.deleteWebhook)
}

func (f *Facade) hooksOrError(w http.ResponseWriter) bool {
	if f.cfg.Hooks == nil {
		apiError(w, errdefs.Unimplemented("this server keeps no webhooks"))
		return false
	}
	return true
}

func (f *Facade) createWebhook(w http.ResponseWriter, r *http.Request, _ string) {
	if !f.hooksOrError(w) {
		return
	}
	var b webhookBody
	if err := decode(r, &b); err != nil {
		apiError(w, err)
		return
	}
	h := &events.Hook{Enabled: true, Format: events.FormatE2B}
	if err := b.apply(h, true); err != nil {
		apiError(w, err)
		return
	}
	if err := f.cfg.Hooks.Register(r.Context(), h); err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, hookJSON(h))
}

func (f *Facade) listWebhooks(w http.ResponseWriter, r *http.Request, _ string) {
	if !f.hooksOrError(w) {
		return
	}
	hs, err := f.cfg.Hooks.Mine(r.Context())
	if err != nil {
		apiError(w, err)
		return
	}
	out := []webhookJSON{}
	for _, h := range hs {
		if h.Format == events.FormatE2B {
			out = append(out, hookJSON(h))
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// findWebhook is the caller's E2B registration of the request's ID.
func (f *Facade) findWebhook(w http.ResponseWriter, r *http.Request) *events.Hook {
	if !f.hooksOrError(w) {
		return nil
	}
	h, err := f.cfg.Hooks.Find(r.Context(), r.PathValue("id"))
	if err == nil && h.Format != events.FormatE2B {
		err = errdefs.NotFound("webhook %s not found", r.PathValue("id"))
	}
	if err != nil {
		apiError(w, err)
		return nil
	}
	return h
}

func (f *Facade) getWebhook(w http.ResponseWriter, r *http.Request, _ string) {
	if h := f.findWebhook(w, r); h != nil {
		writeJSON(w, http.StatusOK, hookJSON(h))
	}
}

func (f *Facade) updateWebhook(w http.ResponseWriter, r *http.Request, _ string) {
	h := f.findWebhook(w, r)
	if h == nil {
		return
	}
	var b webhookBody
	if err := decode(r, &b); err != nil {
		apiError(w, err)
		return
	}
	c := *h
	if err := b.apply(&c, false); err != nil {
		apiError(w, err)
		return
	}
	if err := f.cfg.Hooks.Update(r.Context(), h, &c); err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, hookJSON(&c))
}

func (f *Facade) deleteWebhook(w http.ResponseWriter, r *http.Request, _ string) {
	h := f.findWebhook(w, r)
	if h == nil {
		return
	}
	if err := f.cfg.Hooks.Remove(r.Context(), h.ID); err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// webhookFormat delivers a registration's events as E2B does: its
// payload, and e2b-signature, the unpadded base64 SHA-256 of the secret
// followed by the body.
type webhookFormat struct {
	id    string          // the registration's
	names map[string]bool // E2B event names it asked for (empty: all)
}

func newWebhookFormat(h *events.Hook) events.Format {
	f := webhookFormat{id: h.ID, names: map[string]bool{}}
	for _, n := range h.Shown {
		f.names[n] = true
	}
	return f
}

// webhookEventJSON is the payload of one delivery.
type webhookEventJSON struct {
	Version            string         `json:"version"`
	ID                 string         `json:"id"`
	Type               string         `json:"type"`
	EventData          map[string]any `json:"eventData"`
	SandboxBuildID     string         `json:"sandboxBuildId"`
	SandboxExecutionID string         `json:"sandboxExecutionId"`
	SandboxID          string         `json:"sandboxId"`
	SandboxTeamID      string         `json:"sandboxTeamId"`
	SandboxTemplateID  string         `json:"sandboxTemplateId"`
	Timestamp          string         `json:"timestamp"`
}

func (f webhookFormat) Encode(ev *dsecv1.Event) (string, []byte, bool, error) {
	typ, ok := e2bEventOf[ev.Type]
	if !ok || (len(f.names) > 0 && !f.names[typ]) {
		return "", nil, false, nil
	}
	var id [16]byte
	rand.Read(id[:])
	labels := ev.GetLabels()
	template := labels[templateLabel]
	data := map[string]any{"sandbox_metadata": metadata(labels)}
	if run := ev.GetRun(); run != nil {
		// On killed and paused events, as E2B sends them: the execution
		// that stopped, in whole vCPUs and milliseconds.
		data["execution"] = map[string]any{
			"started_at":     run.GetStartedAt().AsTime().UTC().Format(time.RFC3339),
			"vcpu_count":     int(math.Ceil(run.GetCpu())),
			"memory_mb":      run.GetMemoryMb(),
			"execution_time": run.GetDurationMs(),
		}
	}
	b, err := json.Marshal(webhookEventJSON{
		Version: "v2", ID: hex.EncodeToString(id[:]), Type: typ,
		EventData:          data,
		SandboxExecutionID: ev.SandboxId, SandboxID: ev.SandboxId,
		SandboxTeamID: ev.Project, SandboxTemplateID: template,
		Timestamp: ev.GetAt().AsTime().UTC().Format(time.RFC3339Nano),
	})
	return typ, b, true, err
}

func (f webhookFormat) Sign(h http.Header, secret []byte, delivery string, body []byte) {
	h.Set("e2b-webhook-id", f.id)
	h.Set("e2b-delivery-id", delivery)
	h.Set("e2b-signature-version", "v1")
	h.Set("e2b-signature", WebhookSignature(secret, body))
}

// WebhookSignature is E2B's signature of a delivery's body.
func WebhookSignature(secret, body []byte) string {
	s := sha256.New()
	s.Write(secret)
	s.Write(body)
	return base64.RawStdEncoding.EncodeToString(s.Sum(nil))
}
