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
)

// Config configures the apiserver. The zero value serves without
// authentication, which Listen allows only on loopback.
type Config struct {
	// APIKeys are the accepted keys. Empty means no authentication.
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
}

// New builds a server over router.
func New(cfg Config, log *slog.Logger, router Router) *Server {
	s := &Server{cfg: cfg, log: log, router: router, mux: http.NewServeMux()}
	opts := []connect.HandlerOption{
		connect.WithInterceptors(authInterceptor(cfg.APIKeys)),
		connect.WithReadMaxBytes(32 << 20),
	}
	s.mux.Handle(dsecv1connect.NewSandboxServiceHandler(&sandboxService{r: router}, opts...))
	s.mux.Handle(dsecv1connect.NewImageServiceHandler(&imageService{r: router}, opts...))
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

func validKey(keys []string, k string) bool {
	if k == "" {
		return false
	}
	ok := false
	for _, want := range keys {
		if subtle.ConstantTimeCompare([]byte(want), []byte(k)) == 1 {
			ok = true
		}
	}
	return ok
}

// CheckKey reports whether a request carries an accepted key (always, when
// no keys are configured). Compatibility facades use it.
func (s *Server) CheckKey(h http.Header) bool {
	return len(s.cfg.APIKeys) == 0 || validKey(s.cfg.APIKeys, keyOf(h))
}

func authInterceptor(keys []string) connect.Interceptor {
	return &auth{keys: keys}
}

type auth struct{ keys []string }

func (a *auth) check(h http.Header) error {
	if len(a.keys) == 0 || validKey(a.keys, keyOf(h)) {
		return nil
	}
	return errdefs.ToConnect(errdefs.Unauthenticated("missing or unknown API key (set DSEC_API_KEY)"))
}

func (a *auth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if err := a.check(req.Header()); err != nil {
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
		if err := a.check(conn.RequestHeader()); err != nil {
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
