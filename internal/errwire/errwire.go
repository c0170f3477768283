// Package errwire is the one place where dsec's error vocabulary
// (internal/errdefs) meets the wire: Connect codes with an ErrorInfo detail
// and Retry-After, and HTTP statuses for the plain HTTP endpoints and the
// compatibility facades. It is kept out of errdefs so that the in-sandbox
// agent, which uses the vocabulary, carries no HTTP or Connect code.
package errwire

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// This file is the one place where errors meet the wire.

var connectCodes = map[errdefs.Kind]connect.Code{
	errdefs.KindInvalid:          connect.CodeInvalidArgument,
	errdefs.KindNotFound:         connect.CodeNotFound,
	errdefs.KindConflict:         connect.CodeAlreadyExists,
	errdefs.KindExhausted:        connect.CodeResourceExhausted,
	errdefs.KindUnavailable:      connect.CodeUnavailable,
	errdefs.KindGone:             connect.CodeFailedPrecondition,
	errdefs.KindUnauthenticated:  connect.CodeUnauthenticated,
	errdefs.KindPermissionDenied: connect.CodePermissionDenied,
	errdefs.KindUnimplemented:    connect.CodeUnimplemented,
	errdefs.KindDeadlineExceeded: connect.CodeDeadlineExceeded,
	errdefs.KindCanceled:         connect.CodeCanceled,
	errdefs.KindInternal:         connect.CodeInternal,
}

var httpStatuses = map[errdefs.Kind]int{
	errdefs.KindInvalid:          http.StatusBadRequest,
	errdefs.KindNotFound:         http.StatusNotFound,
	errdefs.KindConflict:         http.StatusConflict,
	errdefs.KindExhausted:        http.StatusTooManyRequests,
	errdefs.KindUnavailable:      http.StatusServiceUnavailable,
	errdefs.KindGone:             http.StatusGone,
	errdefs.KindUnauthenticated:  http.StatusUnauthorized,
	errdefs.KindPermissionDenied: http.StatusForbidden,
	errdefs.KindUnimplemented:    http.StatusNotImplemented,
	errdefs.KindDeadlineExceeded: http.StatusGatewayTimeout,
	errdefs.KindCanceled:         499,
	errdefs.KindInternal:         http.StatusInternalServerError,
}

// HTTPStatus is the status code for err on plain HTTP surfaces (the
// compatibility facades).
func HTTPStatus(err error) int {
	if s, ok := httpStatuses[errdefs.KindOf(err)]; ok {
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
	e := errdefs.Classify(err)
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

// Classified reports whether err is a Connect error that carries dsec's
// classification (an ErrorInfo detail): a node's or a server's answer.
func Classified(err error) bool {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return false
	}
	for _, d := range ce.Details() {
		if v, derr := d.Value(); derr == nil {
			if _, ok := v.(*dsecv1.ErrorInfo); ok {
				return true
			}
		}
	}
	return false
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
			return &errdefs.Error{
				Kind:       errdefs.Kind(info.Kind),
				Msg:        ce.Message(),
				Infra:      info.Infra,
				Retryable:  info.Retryable,
				RetryAfter: time.Duration(info.RetryAfterMs) * time.Millisecond,
			}
		}
	}
	for k, c := range connectCodes {
		if c == ce.Code() && k != errdefs.KindGone {
			e := errdefs.New(k, "%s", ce.Message())
			return e
		}
	}
	return errdefs.Unavailable("%s", ce.Message()).WithCause(err)
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
	e := errdefs.Classify(err)
	switch {
	case e == nil:
		return http.StatusOK
	case e.Kind == errdefs.KindGone || e.Kind == errdefs.KindUnavailable:
		return http.StatusBadGateway
	case e.Kind == errdefs.KindExhausted && !e.Retryable:
		return http.StatusInsufficientStorage
	}
	return HTTPStatus(err)
}
