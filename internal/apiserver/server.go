package apiserver

import (
	"context"
	"crypto/subtle"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/session"
)

// Config configures the apiserver. The zero value serves without
// authentication, which Listen allows only on loopback.
type Config struct {
	// APIKeys are the accepted keys, each "KEY" (project "default") or
	// "PROJECT=KEY". Empty means no authentication.
	APIKeys []string
	// Version is reported by GetInfo.
	Version string
}

// Server is the HTTP front end: the Connect services and the plain HTTP
// endpoints, on one listener.
type Server struct {
	cfg    Config
	log    *slog.Logger
	router Router
	mux    *http.ServeMux
	keys   map[string]string // key → project
}

// parseKeys reads "KEY" and "PROJECT=KEY" entries.
func parseKeys(list []string) map[string]string {
	out := map[string]string{}
	for _, e := range list {
		if p, k, ok := strings.Cut(e, "="); ok {
			out[k] = p
		} else {
			out[e] = "default"
		}
	}
	return out
}

type projectKey struct{}

// projectOf is the caller's project, set by authentication.
func projectOf(ctx context.Context) string {
	if p, ok := ctx.Value(projectKey{}).(string); ok {
		return p
	}
	return "default"
}

// New builds a server over router. sessions may be nil (no SessionService).
func New(cfg Config, log *slog.Logger, router Router, sessions *session.Manager) *Server {
	s := &Server{cfg: cfg, log: log, router: router, mux: http.NewServeMux(), keys: parseKeys(cfg.APIKeys)}
	opts := []connect.HandlerOption{
		connect.WithInterceptors(&auth{keys: s.keys}),
		connect.WithReadMaxBytes(32 << 20),
		// Compressing a few hundred bytes costs more CPU (a flate state
		// reset per response) than it saves on any network.
		connect.WithCompressMinBytes(4 << 10),
	}
	s.mux.Handle(dsecv1connect.NewSandboxServiceHandler(&sandboxService{r: router, sessions: sessions}, opts...))
	if sessions != nil {
		s.mux.Handle(dsecv1connect.NewSessionServiceHandler(&sessionService{m: sessions}, opts...))
	}
	s.mux.Handle(dsecv1connect.NewImageServiceHandler(&imageService{r: router}, opts...))
	s.mux.Handle(dsecv1connect.NewFunctionServiceHandler(&functionService{r: router}, opts...))
	s.mux.HandleFunc("/run_code", s.serveRunCode)
	s.mux.Handle(dsecv1connect.NewSystemServiceHandler(&systemService{r: router, version: cfg.Version}, opts...))
	s.mux.Handle("/v1/sandboxes/{id}/files", s.requireKey(http.HandlerFunc(s.serveFiles)))
	s.mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	return s
}

// Handle mounts another handler (a compatibility facade) on the server.
func (s *Server) Handle(pattern string, h http.Handler) { s.mux.Handle(pattern, h) }

// Handler is the server's root handler.
func (s *Server) Handler() http.Handler { return s.mux }

// ErrInsecure is returned when asked to listen beyond loopback without keys.
var ErrInsecure = errors.New("refusing to listen on a non-loopback address without API keys (set DSEC_API_KEYS or --api-key)")

// CheckListen refuses a non-loopback listen address without API keys.
func CheckListen(addr string, keys []string) error {
	if len(keys) > 0 {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if host == "localhost" {
		return nil
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return ErrInsecure
	}
	return nil
}

// Serve serves on l until ctx ends, then shuts down gracefully.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	srv := &http.Server{
		Handler:           s.mux,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       5 * time.Minute,
	}
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetHTTP2(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		return nil
	}
}

// keyOf extracts an API key from Authorization: Bearer or X-API-Key.
func keyOf(h http.Header) string {
	if v := h.Get("Authorization"); v != "" {
		if k, ok := strings.CutPrefix(v, "Bearer "); ok {
			return strings.TrimSpace(k)
		}
	}
	return h.Get("X-API-Key")
}

// lookupKey returns the project of an accepted key, in constant time per
// candidate.
func lookupKey(keys map[string]string, k string) (string, bool) {
	if k == "" {
		return "", false
	}
	project, found := "", false
	for want, p := range keys {
		if subtle.ConstantTimeCompare([]byte(want), []byte(k)) == 1 {
			project, found = p, true
		}
	}
	return project, found
}

// CheckKey reports whether a request carries an accepted key (always, when
// no keys are configured). Compatibility facades use it.
func (s *Server) CheckKey(h http.Header) bool {
	_, ok := s.authenticate(h)
	return ok
}

func (s *Server) authenticate(h http.Header) (string, bool) {
	if len(s.keys) == 0 {
		return "default", true
	}
	return lookupKey(s.keys, keyOf(h))
}

type auth struct{ keys map[string]string }

func (a *auth) check(ctx context.Context, h http.Header) (context.Context, error) {
	if len(a.keys) == 0 {
		return ctx, nil
	}
	if p, ok := lookupKey(a.keys, keyOf(h)); ok {
		return context.WithValue(ctx, projectKey{}, p), nil
	}
	return ctx, errdefs.ToConnect(errdefs.Unauthenticated("missing or unknown API key (set DSEC_API_KEY)"))
}

func (a *auth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		ctx, err := a.check(ctx, req.Header())
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a *auth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a *auth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := a.check(ctx, conn.RequestHeader())
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}

func (s *Server) requireKey(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.CheckKey(r.Header) {
			writeHTTPError(w, errdefs.Unauthenticated("missing or unknown API key (set DSEC_API_KEY)"))
			return
		}
		h.ServeHTTP(w, r)
	})
}
