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
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/session"
)

// Config configures the apiserver. The zero value serves without
// authentication, which Listen allows only on loopback.
type Config struct {
	// APIKeys are the accepted keys, each "KEY" (project "default") or
	// "PROJECT=KEY". Empty (and no Keys) means no authentication.
	APIKeys []string
	// Keys, when set, authenticates callers instead of APIKeys (a cluster
	// keeps its keys in etcd).
	Keys Keys
	// ClusterToken, when set, makes this the API of a node agent behind a
	// control plane: only callers presenting the token are accepted (API
	// keys are the control plane's business), they name the caller's
	// project in the Dsec-Project header, and sessions were admitted
	// upstream.
	ClusterToken string
	// Version is reported by GetInfo.
	Version string
}

// ProjectHeader carries the caller's project from the control plane to a
// node agent.
const ProjectHeader = "Dsec-Project"

// Keys maps API keys to projects. Implementations are safe for concurrent
// use and answer from memory (authentication is on every call's path).
type Keys interface {
	// Project returns the project of key; ok is false for an unknown key.
	Project(key string) (project string, ok bool)
	// Open reports whether callers need no key at all.
	Open() bool
}

// StaticKeys are keys given at start: "KEY" (project "default") or
// "PROJECT=KEY" entries.
type StaticKeys map[string]string

var _ Keys = StaticKeys(nil)

// ParseKeys reads "KEY" and "PROJECT=KEY" entries.
func ParseKeys(list []string) StaticKeys {
	out := StaticKeys{}
	for _, e := range list {
		if p, k, ok := strings.Cut(e, "="); ok {
			out[k] = p
		} else {
			out[e] = "default"
		}
	}
	return out
}

// Project looks key up in constant time per candidate.
func (m StaticKeys) Project(key string) (string, bool) { return lookupKey(m, key) }

// Open is true without keys.
func (m StaticKeys) Open() bool { return len(m) == 0 }

// Server is the HTTP front end: the Connect services and the plain HTTP
// endpoints, on one listener.
type Server struct {
	cfg    Config
	log    *slog.Logger
	router Router
	mux    *http.ServeMux
	auth   *auth
}

type projectKey struct{}

// ProjectOf is the caller's project, set by authentication ("default"
// without one).
func ProjectOf(ctx context.Context) string {
	if p, ok := ctx.Value(projectKey{}).(string); ok {
		return p
	}
	return "default"
}

// WithProject returns ctx carrying project as the caller's project.
func WithProject(ctx context.Context, project string) context.Context {
	return context.WithValue(ctx, projectKey{}, project)
}

func projectOf(ctx context.Context) string { return ProjectOf(ctx) }

type upstreamKey struct{}

// fromUpstream reports whether the call came from a control plane (a node
// agent's API), which admitted its session already.
func fromUpstream(ctx context.Context) bool { return ctx.Value(upstreamKey{}) != nil }

// New builds a server over router. sessions may be nil (no SessionService).
func New(cfg Config, log *slog.Logger, router Router, sessions *session.Manager) *Server {
	keys := cfg.Keys
	if keys == nil {
		keys = ParseKeys(cfg.APIKeys)
	}
	s := &Server{cfg: cfg, log: log, router: router, mux: http.NewServeMux(), auth: &auth{keys: keys, token: cfg.ClusterToken}}
	opts := []connect.HandlerOption{
		connect.WithInterceptors(s.auth),
		connect.WithReadMaxBytes(32 << 20),
		// Compressing a few hundred bytes costs more CPU (a flate state
		// reset per response) than it saves on any network.
		connect.WithCompressMinBytes(4 << 10),
	}
	s.mux.Handle(dsecv1connect.NewSandboxServiceHandler(&sandboxService{r: router, sessions: sessions, log: log}, opts...))
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

// Interceptor is the server's authentication, for other Connect services
// mounted with Handle (a node agent's NodeService).
func (s *Server) Interceptor() connect.Interceptor { return s.auth }

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
	_, ok := s.Authenticate(h)
	return ok
}

// Authenticate returns the project of the credential a request carries
// (an API key in Authorization: Bearer or X-API-Key; the cluster token on a
// node agent), and whether it is accepted (any request is, as project
// "default", when no keys are configured).
func (s *Server) Authenticate(h http.Header) (project string, ok bool) {
	ctx, err := s.auth.check(context.Background(), h)
	if err != nil {
		return "", false
	}
	return ProjectOf(ctx), true
}

// auth authenticates every call: API keys, or the cluster token on a node
// agent's API.
type auth struct {
	keys  Keys
	token string
}

func (a *auth) check(ctx context.Context, h http.Header) (context.Context, error) {
	if a.token != "" {
		if subtle.ConstantTimeCompare([]byte(a.token), []byte(keyOf(h))) != 1 {
			return ctx, errwire.ToConnect(errdefs.Unauthenticated("missing or wrong cluster token (this is a node agent; call the control plane)"))
		}
		p := h.Get(ProjectHeader)
		if p == "" {
			p = "default"
		}
		return context.WithValue(WithProject(ctx, p), upstreamKey{}, true), nil
	}
	if a.keys.Open() {
		return ctx, nil
	}
	if p, ok := a.keys.Project(keyOf(h)); ok {
		return WithProject(ctx, p), nil
	}
	return ctx, errwire.ToConnect(errdefs.Unauthenticated("missing or unknown API key (set DSEC_API_KEY)"))
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

// requireKey authenticates plain HTTP endpoints and puts the caller's
// project in the request's context.
func (s *Server) requireKey(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, err := s.auth.check(r.Context(), r.Header)
		if err != nil {
			writeHTTPError(w, errwire.FromConnect(err))
			return
		}
		h.ServeHTTP(w, r.WithContext(ctx))
	})
}
