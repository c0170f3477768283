package events

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Webhook delivery headers. The signature is the hex HMAC-SHA256, keyed
// with the webhook's secret, of "<timestamp>.<body>": a receiver
// recomputes it, compares in constant time, and refuses old timestamps
// (a replayed delivery).
const (
	HeaderSignature = "Dsec-Signature" // "sha256=<hex>"
	HeaderTimestamp = "Dsec-Timestamp" // unix seconds
	HeaderDelivery  = "Dsec-Delivery"  // unique per event, the same on each retry
	HeaderEvent     = "Dsec-Event"     // the event's type
)

// Sign is the signature of body sent at timestamp with secret.
func Sign(secret []byte, timestamp int64, body []byte) string {
	m := hmac.New(sha256.New, secret)
	fmt.Fprintf(m, "%d.", timestamp)
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// Webhook posts each event it is given to a URL.
type Webhook struct {
	// URL receives a POST of each event as JSON (the Event message's JSON
	// form).
	URL string
	// Secret keys the signature (required).
	Secret []byte
	// Attempts bounds the tries of one event (default 5); the waits
	// between them double from Backoff (default 500 ms). A 2xx answer
	// delivers it; a 4xx other than 408 and 429 refuses it at once.
	Attempts int
	Backoff  time.Duration
	// Timeout bounds each try (default 10 s).
	Timeout time.Duration
	// Client posts (default: a client of its own).
	Client *http.Client
	// Format is how deliveries look (default: the Event's JSON, signed
	// in Dsec-Signature).
	Format Format
	// Count, when set, is told each event's fate: delivered, retried (a
	// try failed, another follows), failed (given up) or lost (the
	// subscription's buffer overflowed while the receiver was slow).
	Count func(result string)
}

func (w *Webhook) defaults() {
	if w.Attempts <= 0 {
		w.Attempts = 5
	}
	if w.Backoff <= 0 {
		w.Backoff = 500 * time.Millisecond
	}
	if w.Timeout <= 0 {
		w.Timeout = 10 * time.Second
	}
	if w.Client == nil {
		w.Client = &http.Client{}
	}
	if w.Count == nil {
		w.Count = func(string) {}
	}
	if w.Format == nil {
		w.Format = dsecFormat{}
	}
}

// Run delivers sub's events, one at a time and in order, until ctx ends;
// it closes sub. A receiver that is slow or down only ever delays its own
// deliveries: the events behind it wait in sub's buffer, and those that do
// not fit are counted lost and announced by a dropped event.
func (w *Webhook) Run(ctx context.Context, sub *Sub, log *slog.Logger) {
	defer sub.Close()
	w.defaults()
	for {
		ev, err := sub.Next(ctx)
		if err != nil {
			return
		}
		if ev.Type == Dropped {
			for range ev.Dropped {
				w.Count("lost")
			}
		}
		if err := w.deliver(ctx, ev); err != nil {
			if ctx.Err() != nil {
				return
			}
			if err == errLeftOut {
				continue
			}
			w.Count("failed")
			log.Warn("webhook delivery failed", slog.String("url", w.URL), slog.String("event", ev.Type),
				slog.String("sandbox_id", ev.SandboxId), slog.Any("error", err))
			continue
		}
		w.Count("delivered")
	}
}

// errLeftOut is deliver's answer for an event the format leaves out.
var errLeftOut = errors.New("not delivered in this format")

// deliver posts ev, retrying as configured.
func (w *Webhook) deliver(ctx context.Context, ev *dsecv1.Event) error {
	typ, body, ok, err := w.Format.Encode(ev)
	if err != nil {
		return err
	}
	if !ok {
		return errLeftOut
	}
	var id [12]byte
	rand.Read(id[:])
	delivery := hex.EncodeToString(id[:])
	wait := w.Backoff
	for attempt := 1; ; attempt++ {
		retry, err := w.post(ctx, typ, delivery, body)
		if err == nil {
			return nil
		}
		if !retry || attempt >= w.Attempts {
			return fmt.Errorf("after %d tries: %w", attempt, err)
		}
		w.Count("retried")
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
		wait *= 2
	}
}

// post makes one try; retry says whether another may succeed.
func (w *Webhook) post(ctx context.Context, typ, delivery string, body []byte) (retry bool, _ error) {
	ctx, cancel := context.WithTimeout(ctx, w.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", w.URL, bytes.NewReader(body))
	if err != nil {
		return false, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "dsec-webhook/1")
	req.Header.Set(HeaderEvent, typ)
	w.Format.Sign(req.Header, w.Secret, delivery, body)
	resp, err := w.Client.Do(req)
	if err != nil {
		return true, err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	switch c := resp.StatusCode; {
	case c >= 200 && c < 300:
		return false, nil
	case c == http.StatusRequestTimeout || c == http.StatusTooManyRequests || c >= 500:
		return true, fmt.Errorf("%s answered %s", w.URL, resp.Status)
	default:
		return false, fmt.Errorf("%s refused the event: %s", w.URL, resp.Status)
	}
}
