package e2e

import (
	"bufio"
	"crypto/hmac"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/events"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// hookReceiver is a webhook endpoint that checks each delivery's
// signature and keeps the events.
type hookReceiver struct {
	t      *testing.T
	secret []byte
	mu     sync.Mutex
	got    []*dsecv1.Event
	more   chan struct{}
}

func (h *hookReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	ts, _ := strconv.ParseInt(r.Header.Get(events.HeaderTimestamp), 10, 64)
	if !hmac.Equal([]byte(events.Sign(h.secret, ts, body)), []byte(r.Header.Get(events.HeaderSignature))) {
		h.t.Errorf("a delivery with a bad signature: %s", body)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	ev := &dsecv1.Event{}
	if err := protojson.Unmarshal(body, ev); err != nil {
		h.t.Errorf("a delivery that is not an event: %s", body)
	}
	h.mu.Lock()
	h.got = append(h.got, ev)
	h.mu.Unlock()
	select {
	case h.more <- struct{}{}:
	default:
	}
	w.WriteHeader(http.StatusNoContent)
}

// await waits until the receiver holds an event of typ for id.
func (h *hookReceiver) await(typ, id string) *dsecv1.Event {
	h.t.Helper()
	deadline := time.After(time.Minute)
	for {
		h.mu.Lock()
		for _, ev := range h.got {
			if ev.Type == typ && ev.SandboxId == id {
				h.mu.Unlock()
				return ev
			}
		}
		h.mu.Unlock()
		select {
		case <-h.more:
		case <-deadline:
			h.t.Fatalf("no %s webhook for %s within a minute", typ, id)
		}
	}
}

// TestEventsReachSubscribersWebhooksAndTheCLI follows sandboxes' lives as
// a trainer would instead of polling: through the Go SDK's subscription,
// a signed webhook and `dsec events`, each seeing only what it asked for.
func TestEventsReachSubscribersWebhooksAndTheCLI(t *testing.T) {
	secret := []byte("webhook-secret-for-tests")
	secretFile := filepath.Join(t.TempDir(), "hook.key")
	if err := os.WriteFile(secretFile, append(secret, '\n'), 0o600); err != nil {
		t.Fatal(err)
	}
	hook := &hookReceiver{t: t, secret: secret, more: make(chan struct{}, 1)}
	receiver := httptest.NewServer(hook)
	defer receiver.Close()
	srv := dsectest.Start(t, dsectest.Options{Args: []string{"--webhook", receiver.URL + "/hook", "--webhook-secret-file", secretFile}})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)

	sub, err := c.Subscribe(ctx, dsec.EventOptions{Labels: "job=events"})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	// The CLI follows ended events only, as JSON.
	cli := exec.CommandContext(ctx, srv.Bin, "--url", srv.URL, "events", "--label", "job=events", "--type", "ended", "-o", "json")
	stdout, _ := cli.StdoutPipe()
	stderr, _ := cli.StderrPipe()
	if err := cli.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cli.Process.Kill(); cli.Wait() }()
	if line, err := bufio.NewReader(stderr).ReadString('\n'); err != nil || !strings.Contains(line, "following events") {
		t.Fatalf("dsec events did not start: %q %v", line, err)
	}

	other := create(t, c, dsec.CreateOptions{Labels: map[string]string{"job": "elsewhere"}})
	sb := create(t, c, dsec.CreateOptions{Labels: map[string]string{"job": "events"}})
	if _, err := c.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	var types []string
	for len(types) < 4 {
		ev, err := sub.Next()
		if err != nil {
			t.Fatal(err)
		}
		if ev.SandboxId != sb.ID {
			t.Fatalf("the job=events subscriber got an event of %s: %v", ev.SandboxId, ev)
		}
		types = append(types, ev.Type)
		if ev.Type == "ended" && (ev.Cause != "deleted" || ev.Infra || ev.Node != "local") {
			t.Errorf("ended event %v", ev)
		}
	}
	if strings.Join(types, ",") != "created,paused,resumed,ended" {
		t.Errorf("events %v", types)
	}

	// The webhook has every sandbox's events (it filters nothing).
	for _, typ := range []string{"created", "paused", "resumed", "ended"} {
		hook.await(typ, sb.ID)
	}
	hook.await("created", other.ID)

	// The CLI printed the one ended event it was asked for.
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var printed map[string]any
	if err := json.Unmarshal([]byte(line), &printed); err != nil || printed["sandboxId"] != sb.ID || printed["type"] != "ended" || printed["cause"] != "deleted" {
		t.Errorf("dsec events printed %q", line)
	}

	// Deliveries are counted: once the server has read the receiver's
	// answer, a moment after the receiver recorded the delivery.
	var n float64
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, _, samples := dsectest.Scrape(t, srv.URL, "")
		if n = samples[`dsec_webhook_deliveries_total{result="delivered"}`]; n >= 5 || time.Now().After(deadline) {
			break
		}
	}
	if n < 5 {
		t.Errorf("%v webhook deliveries counted delivered, want at least 5", n)
	}
}
