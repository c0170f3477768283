// Package errdefs is dsec's one error vocabulary.
//
// Every error that crosses a component boundary carries a Kind and two
// flags: Infra says the platform failed (a trainer masks the rollout rather
// than scoring it) and Retryable says repeating the call may succeed. Errors
// are created with the constructors below and wrapped with fmt.Errorf("...:
// %w", err); the classification survives wrapping. The mapping to wire codes
// lives in wire.go and nowhere else.
package errdefs

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"
)

// Kind is an error class.
type Kind string

const (
	KindInvalid          Kind = "invalid"
	KindNotFound         Kind = "not_found"
	KindConflict         Kind = "conflict"
	KindExhausted        Kind = "exhausted"
	KindUnavailable      Kind = "unavailable"
	KindGone             Kind = "gone"
	KindUnauthenticated  Kind = "unauthenticated"
	KindPermissionDenied Kind = "permission_denied"
	KindUnimplemented    Kind = "unimplemented"
	KindDeadlineExceeded Kind = "deadline_exceeded"
	KindCanceled         Kind = "canceled"
	KindInternal         Kind = "internal"
)

// Error is a classified error. Msg is safe to show to users: it never holds
// host paths or secrets; those stay in Cause, which is logged, not returned.
type Error struct {
	Kind       Kind
	Msg        string
	Infra      bool
	Retryable  bool
	RetryAfter time.Duration
	Cause      error
}

func (e *Error) Error() string {
	if e.Cause != nil && e.Msg == "" {
		return e.Cause.Error()
	}
	return e.Msg
}

func (e *Error) Unwrap() error { return e.Cause }

// defaults gives each kind its usual flags.
var defaults = map[Kind]struct{ infra, retryable bool }{
	KindInvalid:          {false, false},
	KindNotFound:         {false, false},
	KindConflict:         {false, false},
	KindExhausted:        {true, true},
	KindUnavailable:      {true, true},
	KindGone:             {true, false},
	KindUnauthenticated:  {false, false},
	KindPermissionDenied: {false, false},
	KindUnimplemented:    {false, false},
	KindDeadlineExceeded: {false, false},
	KindCanceled:         {false, false},
	KindInternal:         {true, false},
}

// New returns an error of kind k with the kind's default flags.
func New(k Kind, format string, args ...any) *Error {
	d := defaults[k]
	return &Error{Kind: k, Msg: fmt.Sprintf(format, args...), Infra: d.infra, Retryable: d.retryable}
}

// Invalid reports bad input from the caller.
func Invalid(format string, args ...any) *Error { return New(KindInvalid, format, args...) }

// NotFound reports a missing object (sandbox, image, file, process).
func NotFound(format string, args ...any) *Error { return New(KindNotFound, format, args...) }

// Conflict reports a request that contradicts current state.
func Conflict(format string, args ...any) *Error { return New(KindConflict, format, args...) }

// Exhausted reports missing capacity or quota; retry later.
func Exhausted(retryAfter time.Duration, format string, args ...any) *Error {
	e := New(KindExhausted, format, args...)
	e.RetryAfter = retryAfter
	return e
}

// Unavailable reports a platform component that cannot serve right now.
func Unavailable(format string, args ...any) *Error { return New(KindUnavailable, format, args...) }

// Gone reports a sandbox that died, expired or was evicted. It is never
// silently replaced: the caller decides.
func Gone(format string, args ...any) *Error { return New(KindGone, format, args...) }

// Unauthenticated reports a missing or wrong API key.
func Unauthenticated(format string, args ...any) *Error {
	return New(KindUnauthenticated, format, args...)
}

// PermissionDenied reports an authenticated caller without the right.
func PermissionDenied(format string, args ...any) *Error {
	return New(KindPermissionDenied, format, args...)
}

// Unimplemented reports a verb the substrate or server does not support.
func Unimplemented(format string, args ...any) *Error {
	return New(KindUnimplemented, format, args...)
}

// Internal wraps an unexpected platform failure. The cause is kept for logs;
// users see msg. A cause that is the platform's own disk running out of
// space (ENOSPC, EDQUOT) is not unexpected: it becomes an unavailable,
// retryable infra error that says so (disk space comes back; a sandbox's
// own full disk reaches callers through the agent's codes instead).
func Internal(cause error, format string, args ...any) *Error {
	if errors.Is(cause, syscall.ENOSPC) || errors.Is(cause, syscall.EDQUOT) {
		e := New(KindUnavailable, "the node is out of disk space (%s)", fmt.Sprintf(format, args...))
		e.Cause, e.RetryAfter = cause, 10*time.Second
		return e
	}
	e := New(KindInternal, format, args...)
	e.Cause = cause
	return e
}

// WithCause attaches cause to e and returns e.
func (e *Error) WithCause(cause error) *Error { e.Cause = cause; return e }

// AsInfra marks e as an infrastructure failure and returns e.
func (e *Error) AsInfra() *Error { e.Infra = true; return e }

// Classify returns the classified error inside err, deriving one for
// context errors and unclassified errors (which are internal).
func Classify(err error) *Error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		if e.Msg == "" {
			c := *e
			c.Msg = err.Error()
			return &c
		}
		return e
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return New(KindDeadlineExceeded, "deadline exceeded")
	case errors.Is(err, context.Canceled):
		return New(KindCanceled, "canceled")
	}
	return Internal(err, "internal error")
}

// KindOf returns err's kind ("" for nil).
func KindOf(err error) Kind {
	if err == nil {
		return ""
	}
	return Classify(err).Kind
}

// Is reports whether err is of kind k.
func Is(err error, k Kind) bool { return err != nil && KindOf(err) == k }

// IsInfra reports whether err is an infrastructure failure.
func IsInfra(err error) bool { return err != nil && Classify(err).Infra }
