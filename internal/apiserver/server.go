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
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/session"
	"github.com/opendsec/dsec/internal/tenant"
)

// Config configures the apiserver. The zero value serves without
// authentication, which Listen allows only on loopback.
type Config struct {
	// APIKeys are the accepted keys, each "KEY" (project "default") or
	// "PROJECT=KEY". Empty (and no AdminKeys, no Keys) means no
	// authentication: every caller is the default project's operator.
	APIKeys []string
	// AdminKeys are operators' keys: they reach every project's sandboxes,
	// snapshots, sessions, images and logs, and make shared images.
	AdminKeys []string
	// Keys, when set, authenticates callers instead of APIKeys and
	// AdminKeys (a cluster keeps its keys in etcd).
	Keys Keys
	// ClusterToken, when set, makes this the API of a node agent behind a
	// control plane: only callers presenting the token are accepted (API
	// keys are the control plane's business), they name the caller in the
	// Dsec-Project and Dsec-Role headers, and sessions were admitted
	// upstream.
	ClusterToken string
	// Version is reported by GetInfo.
	Version string
	// Metrics, when set, is served at /metrics (to operators: an admin
	// key, or the cluster token on a node agent) and API, when set, times
	// every call (see package metrics).
	Metrics *metrics.Registry
	API     *metrics.API
	// Hooks, when set, serves the WebhookService over its registrations
	// (run its deliveries with Hooks.Run).
	Hooks *Hooks
}

// Headers carrying the caller from the control plane to a node agent.
const (
	ProjectHeader = "Dsec-Project"
	RoleHeader    = "Dsec-Role" // "admin" for operators
)

// SetCaller writes ctx's caller into the headers of a call to a node agent.
func SetCaller(ctx context.Context, h http.Header) {
	c := tenant.From(ctx)
	h.Set(ProjectHeader, c.Project)
	if c.Admin {
		h.Set(RoleHeader, "admin")
	} else {
		h.Del(RoleHeader)
	}
}

// Keys maps API keys to callers. Implementations are safe for concurrent
// use and answer from memory (authentication is on every call's path).
type Keys interface {
	// Caller returns the caller a key authenticates; ok is false for an
	// unknown key.
	Caller(key string) (c tenant.Caller, ok bool)
	// Open reports whether callers need no key at all.
	Open() bool
}

// StaticKeys are keys given at start.
type StaticKeys map[string]tenant.Caller

var _ Keys = StaticKeys(nil)

// ParseKeys reads "KEY" and "PROJECT=KEY" entries of projects' keys and
// "KEY" entries of operators' keys.
func ParseKeys(list, admin []string) (StaticKeys, error) {
	out := StaticKeys{}
	for _, e := range list {
		p, k, ok := strings.Cut(e, "=")
		if !ok {
			p, k = tenant.DefaultProject, e
		}
		if err := tenant.ValidProject(p); err != nil {
			return nil, err
		}
		if k == "" {
			return nil, errdefs.Invalid("an API key is empty")
		}
		out[k] = tenant.Caller{Project: p}
	}
	for _, k := range admin {
		if k == "" {
			return nil, errdefs.Invalid("an admin key is empty")
		}
		out[k] = tenant.Caller{Project: tenant.DefaultProject, Admin: true}
	}
	return out, nil
}

// Caller looks key up in constant time per candidate.
func (m StaticKeys) Caller(key string) (tenant.Caller, bool) { return lookupKey(m, key) }

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
	// front routes requests before mux (Intercept); set before serving.
	front []func(*http.Request) http.Handler
}

// New builds a server over router. sessions may be nil (no
// SessionService). It fails on malformed keys.
func New(cfg Config, log *slog.Logger, router Router, sessions *session.Manager) (*Server, error) {
	keys := cfg.Keys
	if keys == nil {
		var err error
		if keys, err = ParseKeys(cfg.APIKeys, cfg.AdminKeys); err != nil {
			return nil, err
		}
	}
	s := &Server{cfg: cfg, log: log, router: router, mux: http.NewServeMux(), auth: &auth{keys: keys, token: cfg.ClusterToken}}
	gate := sessionGate{sessions: sessions, log: log}
	opts := s.ConnectOptions()
	s.HandleConnect(dsecv1connect.NewLifecycleServiceHandler(&lifecycleService{r: router, sessionGate: gate}, opts...))
	s.HandleConnect(dsecv1connect.NewProcessServiceHandler(processService{r: router}, opts...))
	s.HandleConnect(dsecv1connect.NewFilesystemServiceHandler(filesystemService{r: router}, opts...))
	s.HandleConnect(dsecv1connect.NewSnapshotServiceHandler(&snapshotService{r: router, sessionGate: gate}, opts...))
	s.HandleConnect(dsecv1connect.NewLogServiceHandler(logService{r: router}, opts...))
	s.HandleConnect(dsecv1connect.NewScreenServiceHandler(screenService{r: router}, opts...))
	if sessions != nil {
		s.HandleConnect(dsecv1connect.NewSessionServiceHandler(&sessionService{m: sessions}, opts...))
	}
	s.HandleConnect(dsecv1connect.NewImageServiceHandler(&imageService{r: router, log: log}, opts...))
	s.HandleConnect(dsecv1connect.NewVolumeServiceHandler(volumeService{r: router}, opts...))
	s.HandleConnect(dsecv1connect.NewEventServiceHandler(eventService{r: router}, opts...))
	if cfg.Hooks != nil {
		s.HandleConnect(dsecv1connect.NewWebhookServiceHandler(webhookService{cfg.Hooks}, opts...))
	}
	s.HandleConnect(dsecv1connect.NewFunctionServiceHandler(&functionService{r: router}, opts...))
	s.Handle("/run_code", s.guard(maxRunCodeBody, http.HandlerFunc(s.serveRunCode)))
	s.HandleConnect(dsecv1connect.NewSystemServiceHandler(&systemService{r: router, version: cfg.Version}, opts...))
	s.Handle("/v1/sandboxes/{id}/files", s.guard(streamed, http.HandlerFunc(s.serveFiles)))
	s.mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	s.serveMetrics()
	return s, nil
}

// NewNodeAPI is a node agent's API in a cluster: h, the node's public
// services for its own sandboxes, mounted as they are behind the cluster
// token (the caller comes in the Dsec-Project and Dsec-Role headers and
// the node checks it against every object). Nothing is routed: the
// control plane routed the call here. Mount NodeService with
// HandleConnect.
func NewNodeAPI(token string, log *slog.Logger, h NodeHandlers, reg *metrics.Registry, m *metrics.API) *Server {
	s := &Server{cfg: Config{ClusterToken: token, Metrics: reg, API: m}, log: log, mux: http.NewServeMux(), auth: &auth{token: token}}
	opts := s.ConnectOptions()
	for _, svc := range []func() (string, http.Handler){
		func() (string, http.Handler) { return dsecv1connect.NewLifecycleServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewProcessServiceHandler(h, opts...) },
		func() (string, http.Handler) {
			return dsecv1connect.NewFilesystemServiceHandler(h, opts...)
		},
		func() (string, http.Handler) { return dsecv1connect.NewSnapshotServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewLogServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewScreenServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewFunctionServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewSystemServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewImageServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewVolumeServiceHandler(h, opts...) },
		func() (string, http.Handler) { return dsecv1connect.NewEventServiceHandler(h, opts...) },
	} {
		s.HandleConnect(svc())
	}
	s.mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	s.serveMetrics()
	return s
}

// ConnectOptions are the handler options of the server's Connect services
// (and a node agent's NodeService): the largest message any procedure
// takes (each procedure's own bound is checked before its body is read:
// see guard), and the timing of every call when the server has metrics.
func (s *Server) ConnectOptions() []connect.HandlerOption {
	opts := connectOptions()
	if s.cfg.API != nil {
		opts = append(opts, connect.WithInterceptors(s.cfg.API.Interceptor()))
	}
	return opts
}

func connectOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithReadMaxBytes(maxMessage),
		// Compressing a few hundred bytes costs more CPU (a flate state
		// reset per response) than it saves on any network.
		connect.WithCompressMinBytes(4 << 10),
	}
}

// HandleConnect mounts a Connect service (the pattern and handler its
// generated constructor returns) behind authentication and the
// per-procedure body limits.
func (s *Server) HandleConnect(pattern string, h http.Handler) {
	s.mux.Handle(pattern, s.guard(procedureLimit, h))
}

// Handle mounts another handler (a compatibility facade) on the server,
// timed under its pattern when the server has metrics.
func (s *Server) Handle(pattern string, h http.Handler) {
	s.mux.Handle(pattern, s.cfg.API.Handler(pattern, h))
}

// HandlePeer mounts h for the cluster's own callers on a node agent's API
// (other nodes, the control plane): a request must carry the cluster
// token, and is not a project's call.
func (s *Server) HandlePeer(pattern string, h http.Handler) {
	s.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(s.auth.token), []byte(keyOf(r.Header))) != 1 {
			refuse(w, r, http.StatusUnauthorized, errdefs.Unauthenticated("missing or wrong cluster token (this is a node agent's peer API)"))
			return
		}
		h.ServeHTTP(w, r)
	}))
}

// serveMetrics serves the registry at /metrics to operators: callers with
// an admin key (anyone on a server without keys), or on a node agent the
// control plane's token.
func (s *Server) serveMetrics() {
	if s.cfg.Metrics == nil {
		return
	}
	h := s.cfg.Metrics.Handler()
	s.mux.Handle("GET /metrics", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, err := s.auth.check(r.Context(), r.Header)
		if err != nil {
			refuse(w, r, http.StatusUnauthorized, err)
			return
		}
		if s.auth.token == "" && !tenant.From(ctx).Admin {
			refuse(w, r, http.StatusForbidden, errdefs.PermissionDenied("metrics are for operators: use an admin key"))
			return
		}
		h.ServeHTTP(w, r)
	}))
}

// Intercept makes route see every request before the server's own routes:
// a request it returns a handler for goes there, the rest go on. (The E2B
// facade routes requests for sandbox ports by host name, whatever their
// path.) Call it before serving.
func (s *Server) Intercept(route func(*http.Request) http.Handler) {
	s.front = append(s.front, route)
}

// Handler is the server's root handler.
func (s *Server) Handler() http.Handler {
	if len(s.front) == 0 {
		return s.mux
	}
	front := s.front
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, route := range front {
			if h := route(r); h != nil {
				h.ServeHTTP(w, r)
				return
			}
		}
		s.mux.ServeHTTP(w, r)
	})
}

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
		Handler:           s.Handler(),
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
