package errwire

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/opendsec/dsec/internal/errdefs"
)

func TestClassificationSurvivesWrappingAndTheWire(t *testing.T) {
	tests := []struct {
		name      string
		err       error
		kind      errdefs.Kind
		infra     bool
		retryable bool
	}{
		{"invalid input is the caller's", errdefs.Invalid("bad %s", "x"), errdefs.KindInvalid, false, false},
		{"a gone sandbox is infra", errdefs.Gone("died"), errdefs.KindGone, true, false},
		{"exhaustion is infra and retryable", errdefs.Exhausted(2*time.Second, "full"), errdefs.KindExhausted, true, true},
		{"an unavailable component is infra and retryable", errdefs.Unavailable("down"), errdefs.KindUnavailable, true, true},
		{"wrapping keeps the class", fmt.Errorf("start: %w", errdefs.NotFound("image x")), errdefs.KindNotFound, false, false},
		{"an unclassified error is internal", errors.New("boom"), errdefs.KindInternal, true, false},
		{"a deadline is deadline_exceeded", context.DeadlineExceeded, errdefs.KindDeadlineExceeded, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := errdefs.Classify(tt.err)
			if e.Kind != tt.kind || e.Infra != tt.infra || e.Retryable != tt.retryable {
				t.Fatalf("classify: %+v", e)
			}
			back := errdefs.Classify(FromConnect(ToConnect(tt.err)))
			if back.Kind != tt.kind || back.Infra != tt.infra || back.Retryable != tt.retryable {
				t.Fatalf("after the wire: %+v", back)
			}
		})
	}
}

func TestInternalErrorsDoNotLeakCauses(t *testing.T) {
	err := errdefs.Internal(errors.New("open /var/lib/secret/path: denied"), "mount sandbox root filesystem")
	ce := ToConnect(err).(*connect.Error)
	if ce.Message() != "mount sandbox root filesystem" {
		t.Fatalf("wire message %q", ce.Message())
	}
}

func TestRetryAfterReachesTheWire(t *testing.T) {
	ce := ToConnect(errdefs.Exhausted(1500*time.Millisecond, "full")).(*connect.Error)
	if got := ce.Meta().Get("Retry-After"); got != "2" {
		t.Fatalf("Retry-After %q", got)
	}
	if e := errdefs.Classify(FromConnect(ce)); e.RetryAfter != 1500*time.Millisecond {
		t.Fatalf("retry after %v", e.RetryAfter)
	}
}

func TestEnvdHTTPStatus(t *testing.T) {
	full := errdefs.Exhausted(0, "disk full")
	full.Retryable = false
	tests := []struct {
		name string
		err  error
		want int
	}{
		{"a sandbox that is not running is a bad gateway", errdefs.Unavailable("sandbox x is not running"), 502},
		{"a sandbox that died is a bad gateway", errdefs.Gone("sandbox x died"), 502},
		{"a full disk is insufficient storage", fmt.Errorf("write: %w", full), 507},
		{"a missing file is not found", errdefs.NotFound("no such file"), 404},
		{"a directory read as a file is a bad request", errdefs.Invalid("is a directory"), 400},
		{"a retryable exhaustion is too many requests", errdefs.Exhausted(time.Second, "busy"), 429},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := EnvdHTTPStatus(tt.err); got != tt.want {
				t.Fatalf("EnvdHTTPStatus(%v) = %d, want %d", tt.err, got, tt.want)
			}
		})
	}
}
