package errdefs

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// This file is the one place where errors meet the wire.

var connectCodes = map[Kind]connect.Code{
	KindInvalid:          connect.CodeInvalidArgument,
	KindNotFound:         connect.CodeNotFound,
	KindConflict:         connect.CodeAlreadyExists,
	KindExhausted:        connect.CodeResourceExhausted,
	KindUnavailable:      connect.CodeUnavailable,
	KindGone:             connect.CodeFailedPrecondition,
	KindUnauthenticated:  connect.CodeUnauthenticated,
	KindPermissionDenied: connect.CodePermissionDenied,
	KindUnimplemented:    connect.CodeUnimplemented,
	KindDeadlineExceeded: connect.CodeDeadlineExceeded,
	KindCanceled:         connect.CodeCanceled,
	KindInternal:         connect.CodeInternal,
}

var httpStatuses = map[Kind]int{
	KindInvalid:          http.StatusBadRequest,
	KindNotFound:         http.StatusNotFound,
	KindConflict:         http.StatusConflict,
	KindExhausted:        http.StatusTooManyRequests,
	KindUnavailable:      http.StatusServiceUnavailable,
	KindGone:             http.StatusGone,
	KindUnauthenticated:  http.StatusUnauthorized,
	KindPermissionDenied: http.StatusForbidden,
	KindUnimplemented:    http.StatusNotImplemented,
	KindDeadlineExceeded: http.StatusGatewayTimeout,
	KindCanceled:         499,
	KindInternal:         http.StatusInternalServerError,
}

// HTTPStatus is the status code for err on plain HTTP surfaces (the
// compatibility facades).
func HTTPStatus(err error) int {
	if s, ok := httpStatuses[KindOf(err)]; ok {
		return s
	}
	return http.StatusInternalServerError
}

// ToConnect converts err into a connect error with an ErrorInfo detail.
func ToConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	e := Classify(err)
	code, ok := connectCodes[e.Kind]
	if !ok {
		code = connect.CodeUnknown
	}
	out := connect.NewError(code, errors.New(e.Msg))
	info := &dsecv1.ErrorInfo{
		Kind:         string(e.Kind),
		Infra:        e.Infra,
		Retryable:    e.Retryable,
		RetryAfterMs: e.RetryAfter.Milliseconds(),
	}
	if d, derr := connect.NewErrorDetail(info); derr == nil {
		out.AddDetail(d)
	}
	if e.RetryAfter > 0 {
		out.Meta().Set("Retry-After", retryAfterSeconds(e.RetryAfter))
	}
	return out
}

// FromConnect converts an error returned by a connect client back into a
// classified error, so a node's answer keeps its class across the apiserver.
func FromConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	for _, d := range ce.Details() {
		v, derr := d.Value()
		if derr != nil {
			continue
		}
		if info, ok := v.(*dsecv1.ErrorInfo); ok {
			return &Error{
				Kind:       Kind(info.Kind),
				Msg:        ce.Message(),
				Infra:      info.Infra,
				Retryable:  info.Retryable,
				RetryAfter: time.Duration(info.RetryAfterMs) * time.Millisecond,
			}
		}
	}
	for k, c := range connectCodes {
		if c == ce.Code() && k != KindGone {
			e := New(k, "%s", ce.Message())
			return e
		}
	}
	return Unavailable("%s", ce.Message()).WithCause(err)
}

func retryAfterSeconds(d time.Duration) string {
	s := int64((d + time.Second - 1) / time.Second)
	return strconv.FormatInt(max(s, 1), 10)
}

// EnvdHTTPStatus is the status for err on the plain HTTP endpoints of the
// E2B facade's sandbox side (/files, /health, /execute, /contexts): E2B's
// SDKs read 502 as "the sandbox is not running" (their TimeoutError) and
// 507 as a full disk. Everything else is HTTPStatus.
func EnvdHTTPStatus(err error) int {
	e := Classify(err)
	switch {
	case e == nil:
		return http.StatusOK
	case e.Kind == KindGone || e.Kind == KindUnavailable:
		return http.StatusBadGateway
	case e.Kind == KindExhausted && !e.Retryable:
		return http.StatusInsufficientStorage
	}
	return HTTPStatus(err)
}
