// Package dsec is the Go SDK for dsec. The dsec CLI is built on it.
//
//	c := dsec.FromEnv() // DSEC_URL, DSEC_API_KEY
//	sb, err := c.Create(ctx, dsec.CreateOptions{Image: "debian", TTL: 10 * time.Minute})
//	res, err := sb.Exec(ctx, dsec.Cmd("python3 -c 'print(6*7)'"))
//	defer sb.Close()
//
// Errors are *Error values carrying the server's class and its Infra and
// Retryable flags.
package dsec

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
)

// DefaultURL is the server a client talks to without DSEC_URL.
const DefaultURL = "http://127.0.0.1:7070"

// Client talks to a dsec server. It is safe for concurrent use.
type Client struct {
	url  string
	key  string
	http *http.Client
	raw  Raw
}

// Raw holds the generated Connect clients of every service, for calls the
// SDK does not wrap; their methods are named as in the proto.
type Raw struct {
	dsecv1connect.LifecycleServiceClient
	dsecv1connect.ProcessServiceClient
	dsecv1connect.FilesystemServiceClient
	dsecv1connect.SnapshotServiceClient
	dsecv1connect.LogServiceClient
	dsecv1connect.ScreenServiceClient
	Images   dsecv1connect.ImageServiceClient
	System   dsecv1connect.SystemServiceClient
	Sessions dsecv1connect.SessionServiceClient
	Function dsecv1connect.FunctionServiceClient
	Volumes  dsecv1connect.VolumeServiceClient
	Events   dsecv1connect.EventServiceClient
	Webhooks dsecv1connect.WebhookServiceClient
}

// Option configures a Client.
type Option func(*Client)

// WithAPIKey authenticates with key.
func WithAPIKey(key string) Option { return func(c *Client) { c.key = key } }

// WithHTTPClient uses hc for every request.
func WithHTTPClient(hc *http.Client) Option { return func(c *Client) { c.http = hc } }

// New returns a client for the server at url.
func New(url string, opts ...Option) *Client {
	if url == "" {
		url = DefaultURL
	}
	c := &Client{url: strings.TrimRight(url, "/")}
	for _, o := range opts {
		o(c)
	}
	if c.http == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 256
		// Cleartext HTTP/2 lets client streams (uploads) and server streams
		// share connections; the server speaks it on the same port.
		if strings.HasPrefix(c.url, "http://") {
			t.Protocols = new(http.Protocols)
			t.Protocols.SetUnencryptedHTTP2(true)
		}
		c.http = &http.Client{Transport: t}
	}
	// An exec result holds up to two streams at the largest output cap a
	// node allows (64 MiB each by default).
	copts := []connect.ClientOption{connect.WithInterceptors(keyInterceptor(c.key)), connect.WithReadMaxBytes(129 << 20)}
	c.raw = Raw{
		LifecycleServiceClient:  dsecv1connect.NewLifecycleServiceClient(c.http, c.url, copts...),
		ProcessServiceClient:    dsecv1connect.NewProcessServiceClient(c.http, c.url, copts...),
		FilesystemServiceClient: dsecv1connect.NewFilesystemServiceClient(c.http, c.url, copts...),
		SnapshotServiceClient:   dsecv1connect.NewSnapshotServiceClient(c.http, c.url, copts...),
		LogServiceClient:        dsecv1connect.NewLogServiceClient(c.http, c.url, copts...),
		ScreenServiceClient:     dsecv1connect.NewScreenServiceClient(c.http, c.url, copts...),
		Images:                  dsecv1connect.NewImageServiceClient(c.http, c.url, copts...),
		System:                  dsecv1connect.NewSystemServiceClient(c.http, c.url, copts...),
		Sessions:                dsecv1connect.NewSessionServiceClient(c.http, c.url, copts...),
		Volumes:                 dsecv1connect.NewVolumeServiceClient(c.http, c.url, copts...),
		Events:                  dsecv1connect.NewEventServiceClient(c.http, c.url, copts...),
		Webhooks:                dsecv1connect.NewWebhookServiceClient(c.http, c.url, copts...),
		// A batch of function calls answers up to 256 MiB.
		Function: dsecv1connect.NewFunctionServiceClient(c.http, c.url, connect.WithInterceptors(keyInterceptor(c.key)), connect.WithReadMaxBytes(256<<20)),
	}
	return c
}

// FromEnv returns a client configured by DSEC_URL and DSEC_API_KEY.
func FromEnv(opts ...Option) *Client {
	return New(os.Getenv("DSEC_URL"), append([]Option{WithAPIKey(os.Getenv("DSEC_API_KEY"))}, opts...)...)
}

// URL is the server's base URL.
func (c *Client) URL() string { return c.url }

// Raw returns the generated Connect clients, for calls the SDK does not wrap.
func (c *Client) Raw() Raw { return c.raw }

func keyInterceptor(key string) connect.Interceptor {
	return &keyer{key: key}
}

type keyer struct{ key string }

func (k *keyer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if k.key != "" {
			req.Header().Set("Authorization", "Bearer "+k.key)
		}
		resp, err := next(ctx, req)
		return resp, asError(err)
	}
}

func (k *keyer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if k.key != "" {
			conn.RequestHeader().Set("Authorization", "Bearer "+k.key)
		}
		return conn
	}
}

func (k *keyer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// Error is an error returned by the server.
type Error struct {
	// Kind is the error class: "invalid", "not_found", "gone", ...
	Kind    string
	Message string
	// Infra is true when the platform failed (mask the rollout rather than
	// score it).
	Infra bool
	// Retryable is true when repeating the call may succeed.
	Retryable  bool
	RetryAfter time.Duration
	Code       connect.Code
}

func (e *Error) Error() string {
	flags := ""
	if e.Infra {
		flags = ", infra"
	}
	return fmt.Sprintf("%s (%s%s)", e.Message, e.Kind, flags)
}

// AsError converts an error of a raw client (Client.Raw) into an *Error,
// as every other method of the SDK returns them.
func AsError(err error) error { return asError(err) }

// asError converts a connect error into an *Error.
func asError(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	e := &Error{Kind: strings.ToLower(ce.Code().String()), Message: ce.Message(), Code: ce.Code()}
	for _, d := range ce.Details() {
		if v, derr := d.Value(); derr == nil {
			if info, ok := v.(*dsecv1.ErrorInfo); ok {
				e.Kind, e.Infra, e.Retryable = info.Kind, info.Infra, info.Retryable
				e.RetryAfter = time.Duration(info.RetryAfterMs) * time.Millisecond
			}
		}
	}
	if e.Message == "" {
		e.Message = ce.Error()
	}
	if ce.Code() == connect.CodeUnavailable && len(ce.Details()) == 0 {
		// No detail: the server was not reached at all.
		e.Kind, e.Infra, e.Retryable = "unavailable", true, true
	}
	if ce.Code() == connect.CodeCanceled && len(ce.Details()) == 0 && (errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)) {
		// connect-go calls a connection the server reset "canceled"; the
		// caller cancelled nothing: the server went away mid-call.
		e.Kind, e.Infra, e.Retryable = "unavailable", true, true
	}
	return e
}

// IsNotFound reports whether err is a not-found error.
func IsNotFound(err error) bool { return kindOf(err) == "not_found" }

// IsGone reports whether err says a sandbox died, expired or was evicted.
func IsGone(err error) bool { return kindOf(err) == "gone" }

// IsInfra reports whether err is an infrastructure failure.
func IsInfra(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Infra
}

func kindOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return ""
}

// Info describes the deployment.
func (c *Client) Info(ctx context.Context) (*dsecv1.Info, error) {
	r, err := c.raw.System.GetInfo(ctx, connect.NewRequest(&dsecv1.GetInfoRequest{}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}
