package errdefs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
)

func TestClassificationSurvivesWrappingAndTheWire(t *testing.T) {
	tests := []struct {
		name      string
		err       error
		kind      Kind
		infra     bool
		retryable bool
	}{
		{"invalid input is the caller's", Invalid("bad %s", "x"), KindInvalid, false, false},
		{"a gone sandbox is infra", Gone("died"), KindGone, true, false},
		{"exhaustion is infra and retryable", Exhausted(2*time.Second, "full"), KindExhausted, true, true},
		{"an unavailable component is infra and retryable", Unavailable("down"), KindUnavailable, true, true},
		{"wrapping keeps the class", fmt.Errorf("start: %w", NotFound("image x")), KindNotFound, false, false},
		{"an unclassified error is internal", errors.New("boom"), KindInternal, true, false},
		{"a deadline is deadline_exceeded", context.DeadlineExceeded, KindDeadlineExceeded, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := Classify(tt.err)
			if e.Kind != tt.kind || e.Infra != tt.infra || e.Retryable != tt.retryable {
				t.Fatalf("classify: %+v", e)
			}
			back := Classify(FromConnect(ToConnect(tt.err)))
			if back.Kind != tt.kind || back.Infra != tt.infra || back.Retryable != tt.retryable {
				t.Fatalf("after the wire: %+v", back)
			}
		})
	}
}

func TestInternalErrorsDoNotLeakCauses(t *testing.T) {
	err := Internal(errors.New("open /var/lib/secret/path: denied"), "mount sandbox root filesystem")
	ce := ToConnect(err).(*connect.Error)
	if ce.Message() != "mount sandbox root filesystem" {
		t.Fatalf("wire message %q", ce.Message())
	}
}

func TestRetryAfterReachesTheWire(t *testing.T) {
	ce := ToConnect(Exhausted(1500*time.Millisecond, "full")).(*connect.Error)
	if got := ce.Meta().Get("Retry-After"); got != "2" {
		t.Fatalf("Retry-After %q", got)
	}
	if e := Classify(FromConnect(ce)); e.RetryAfter != 1500*time.Millisecond {
		t.Fatalf("retry after %v", e.RetryAfter)
	}
}
