package events

import (
	"context"
	"crypto/hmac"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

func ev(id string) *dsecv1.Event { return &dsecv1.Event{Type: Created, SandboxId: id} }

func next(t *testing.T, s *Sub) *dsecv1.Event {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	e, err := s.Next(ctx)
	if err != nil {
		t.Fatalf("no event: %v", err)
	}
	return e
}

func TestSubscribersGetWhatTheirFilterAcceptsInOrder(t *testing.T) {
	h := NewHub()
	all := h.Subscribe(nil, 0)
	defer all.Close()
	odd := h.Subscribe(func(e *dsecv1.Event) bool { return e.SandboxId[0]%2 == 1 }, 0)
	defer odd.Close()
	for _, id := range []string{"a", "b", "c", "d"} {
		h.Publish(ev(id))
	}
	for _, want := range []string{"a", "b", "c", "d"} {
		if got := next(t, all).SandboxId; got != want {
			t.Fatalf("got %s, want %s", got, want)
		}
	}
	for _, want := range []string{"a", "c"} { // 'a' and 'c' are odd bytes
		if got := next(t, odd).SandboxId; got != want {
			t.Fatalf("filtered: got %s, want %s", got, want)
		}
	}
	all.Close()
	odd.Close()
	if n := h.Subscribers(); n != 0 {
		t.Fatalf("%d subscribers after both closed", n)
	}
	h.Publish(ev("e")) // nobody listens: nothing happens
	var nilHub *Hub
	nilHub.Publish(ev("f"))
}

// A subscriber that stops reading never blocks the publisher; it loses
// what did not fit and learns, at the gap, how much.
func TestASlowSubscriberLosesEventsAndIsToldWhere(t *testing.T) {
	h := NewHub()
	s := h.Subscribe(nil, 4)
	defer s.Close()
	done := make(chan struct{})
	go func() {
		for i := range 100 {
			h.Publish(ev(strconv.Itoa(i)))
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("publishing blocked on a subscriber that does not read")
	}
	for _, want := range []string{"0", "1", "2", "3"} {
		if got := next(t, s); got.SandboxId != want {
			t.Fatalf("got %v, want %s", got, want)
		}
	}
	if got := next(t, s); got.Type != Dropped || got.Dropped != 96 {
		t.Fatalf("after the buffer: %v, want a dropped event of 96", got)
	}
	// After the gap the stream goes on, the next loss marked where it is.
	h.Publish(ev("100"))
	if got := next(t, s); got.SandboxId != "100" {
		t.Fatalf("after the gap: %v", got)
	}
	for i := range 6 {
		h.Publish(ev(strconv.Itoa(200 + i)))
	}
	h.Publish(ev("300"))
	for _, want := range []string{"200", "201", "202", "203"} {
		if got := next(t, s); got.SandboxId != want {
			t.Fatalf("got %v, want %s", got, want)
		}
	}
	if got := next(t, s); got.Type != Dropped || got.Dropped != 3 {
		t.Fatalf("second gap: %v, want 3 dropped", got)
	}
}

// receiver is a webhook receiver that checks signatures and answers with
// the codes it is given, in turn (then 204).
type receiver struct {
	t      *testing.T
	secret []byte
	mu     sync.Mutex
	codes  []int
	got    []*dsecv1.Event
	ids    []string
	tries  atomic.Int32
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.tries.Add(1)
	body, _ := io.ReadAll(req.Body)
	ts, err := strconv.ParseInt(req.Header.Get(HeaderTimestamp), 10, 64)
	if err != nil || time.Since(time.Unix(ts, 0)) > time.Minute {
		r.t.Errorf("bad timestamp %q", req.Header.Get(HeaderTimestamp))
	}
	if want := Sign(r.secret, ts, body); !hmac.Equal([]byte(want), []byte(req.Header.Get(HeaderSignature))) {
		r.t.Errorf("signature %q, want %q", req.Header.Get(HeaderSignature), want)
	}
	var raw map[string]any
	if err := json.Unmarshal(body, &raw); err != nil {
		r.t.Errorf("body is not JSON: %s", body)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.codes) > 0 {
		code := r.codes[0]
		r.codes = r.codes[1:]
		if code != 204 {
			w.WriteHeader(code)
			return
		}
	}
	e := &dsecv1.Event{}
	if err := protojson.Unmarshal(body, e); err != nil {
		r.t.Errorf("body is not an event: %v", err)
	}
	if req.Header.Get(HeaderEvent) != e.Type {
		r.t.Errorf("%s header %q for a %q event", HeaderEvent, req.Header.Get(HeaderEvent), e.Type)
	}
	r.got = append(r.got, e)
	r.ids = append(r.ids, req.Header.Get(HeaderDelivery))
	w.WriteHeader(204)
}

func (r *receiver) events() []*dsecv1.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*dsecv1.Event(nil), r.got...)
}

type counts struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counts) count(result string) { c.mu.Lock(); c.n[result]++; c.mu.Unlock() }
func (c *counts) get(result string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[result]
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
	}
}

func TestWebhooksAreSignedRetriedAndGivenUpOn(t *testing.T) {
	secret := []byte("s3cret")
	// The first event meets two 500s, then is delivered; the second a 400
	// (refused: not retried); the third five 503s (given up).
	r := &receiver{t: t, secret: secret, codes: []int{500, 500, 204, 400, 503, 503, 503, 503, 503}}
	srv := httptest.NewServer(r)
	defer srv.Close()
	h := NewHub()
	c := &counts{n: map[string]int{}}
	w := &Webhook{URL: srv.URL, Secret: secret, Backoff: time.Millisecond, Count: c.count}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx, h.Subscribe(nil, 0), slog.Default())
	waitFor(t, "the webhook subscribed", func() bool { return h.Subscribers() == 1 })
	h.Publish(ev("one"))
	h.Publish(ev("two"))
	h.Publish(ev("three"))
	h.Publish(ev("four"))
	waitFor(t, "four events' fates", func() bool { return c.get("delivered")+c.get("failed") == 4 })
	got := r.events()
	if len(got) != 2 || got[0].SandboxId != "one" || got[1].SandboxId != "four" {
		t.Fatalf("delivered %v, want one and four", got)
	}
	if c.get("delivered") != 2 || c.get("failed") != 2 || c.get("retried") != 2+4 {
		t.Fatalf("counts %v", c.n)
	}
	if n := r.tries.Load(); n != 3+1+5+1 {
		t.Fatalf("%d tries, want 10", n)
	}
	cancel()
	waitFor(t, "the webhook unsubscribed", func() bool { return h.Subscribers() == 0 })
}

// A receiver that hangs delays only its own deliveries: publishing goes
// on, the overflow is counted lost and announced by a dropped event.
func TestAHangingReceiverNeverBlocksSandboxes(t *testing.T) {
	gate, entered := make(chan struct{}), make(chan struct{}, 1)
	var mu sync.Mutex
	var got []*dsecv1.Event
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		select {
		case entered <- struct{}{}:
		default:
		}
		<-gate
		e := &dsecv1.Event{}
		body, _ := io.ReadAll(req.Body)
		protojson.Unmarshal(body, e)
		mu.Lock()
		got = append(got, e)
		mu.Unlock()
	}))
	defer srv.Close()
	open := sync.OnceFunc(func() { close(gate) })
	defer open()
	h := NewHub()
	c := &counts{n: map[string]int{}}
	w := &Webhook{URL: srv.URL, Secret: []byte("k"), Count: c.count, Timeout: time.Minute}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx, h.Subscribe(nil, 8), slog.Default())
	waitFor(t, "the webhook subscribed", func() bool { return h.Subscribers() == 1 })
	h.Publish(ev("0"))
	<-entered // the receiver holds event 0
	start := time.Now()
	for i := 1; i < 1000; i++ {
		h.Publish(ev(strconv.Itoa(i)))
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("publishing 999 events took %s behind a hanging receiver", d)
	}
	open()
	// Delivered: event 0, the 8 the buffer held, and the dropped event.
	waitFor(t, "the backlog and the dropped event delivered", func() bool { return c.get("delivered") == 1+8+1 })
	if lost := c.get("lost"); lost != 999-8 {
		t.Errorf("%d counted lost, want %d", lost, 999-8)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 10 || got[9].Type != Dropped || got[9].Dropped != 999-8 || got[8].SandboxId != "8" {
		t.Errorf("the receiver got %v, want events 0-8 then a dropped event of %d", got, 999-8)
	}
}
