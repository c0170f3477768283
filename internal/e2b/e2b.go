// Package e2b is dsec's E2B-compatible facade: it speaks the wire protocol
// of E2B's control plane (REST, X-API-Key), of envd, the daemon inside E2B
// sandboxes (Connect RPC process and filesystem services, /files, /health)
// and of the code interpreter (/execute on port 49999), so the unmodified
// `e2b` and `@e2b/code-interpreter` SDKs drive dsec sandboxes of every kind.
//
// The facade translates; it holds no per-sandbox state. Every call goes
// through the apiserver's Router and Node interfaces, so it works the same
// against the single node of `dsec serve` and against a cluster. envd access
// tokens are derived from the sandbox ID with a keyed hash (TokenSecret), so
// any replica can check them without a lookup.
//
// The code interpreter is real: a small Python kernel (kernel.py) started
// on demand inside the sandbox listens on 127.0.0.1:49999 and keeps one
// long-lived interpreter process per context, whose globals persist between
// executions.
package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/tenant"
)

// EnvdVersion is the envd version the facade reports: the highest whose
// SDK feature gates the facade implements, stdin control on Start (0.3.0),
// the server-side default user (0.4.0), CloseStdin (0.5.2), octet-stream
// and gzip uploads (0.5.7), file metadata (0.6.2), entries in watch events
// (0.6.3) and watches with allowNetworkMounts (0.6.4: dsec watches any
// directory, so the flag changes nothing).
const EnvdVersion = "0.6.4"

// Ports the SDKs address inside a sandbox.
const (
	EnvdPort        = 49983
	InterpreterPort = 49999
)

// Config configures the facade. The zero value works once TokenSecret is
// set.
type Config struct {
	// Domain is the sandbox domain returned to the SDKs. With one, SDKs that
	// do not set E2B_SANDBOX_URL reach envd at https://49983-<id>.<Domain>,
	// and every SDK reaches user ports at https://<port>-<id>.<Domain>,
	// served by a TLS listener of dsec's (TLSConfig) or a TLS proxy in
	// front of it (the facade routes on the Host name as well as on the
	// E2b-Sandbox-Id header). It may carry a port ("sbx.example.com:8443"),
	// which the SDKs then connect to; it must not be an IP address.
	// Default "": SDKs must set E2B_SANDBOX_URL to this server, and user
	// ports are reached by header or path only.
	Domain string
	// Templates maps E2B template IDs to dsec images and kinds (default:
	// DefaultTemplates). A template ID that is not listed names an image.
	Templates map[string]Template
	// DefaultKind is the kind of sandboxes whose template names none
	// (default "container").
	DefaultKind string
	// DefaultNetwork is the network mode of sandboxes created without
	// allow_internet_access (default "none"; E2B itself defaults to
	// internet access, which is "egress").
	DefaultNetwork string
	// TokenSecret keys the envd access tokens (required; at least 16
	// bytes). Every replica serving the facade needs the same secret.
	TokenSecret []byte
	// Hooks, when set, keeps the webhooks registered at /events/webhooks
	// (without: those routes answer 501).
	Hooks *apiserver.Hooks
	// TemplateDir, when set, keeps the templates built through the facade
	// and their uploaded files (templates.go; without: the template build
	// routes answer 501).
	TemplateDir string
}

// Template is what an E2B template ID starts.
type Template struct {
	// Image is the dsec image (required).
	Image string `json:"image"`
	// Kind is the substrate (default: Config.DefaultKind).
	Kind string `json:"kind,omitempty"`
	// KindImages are images to use instead of Image for some kinds (a vm
	// boots a VM image, not file system layers), by kind (default none).
	KindImages map[string]string `json:"kind_images,omitempty"`
	// CPU (cores) and MemoryMB size the sandbox (default: the node's).
	CPU      float64 `json:"cpu,omitempty"`
	MemoryMB int64   `json:"memory_mb,omitempty"`
}

// DefaultTemplates are the templates the SDKs ask for by default: "base"
// (e2b) and "code-interpreter-v1" (@e2b/code-interpreter), both on the
// bootstrapped "base" image (`dsec image bootstrap base`: debian with
// E2B's user "user", its passwordless sudo, curl, git and python, whose
// config makes "user" the default user), or as full VMs on the debian-vm
// image (`dsec image build-vm debian`, whose user is root).
var DefaultTemplates = map[string]Template{
	"base":                {Image: "base", KindImages: map[string]string{"vm": "debian-vm"}},
	"code-interpreter-v1": {Image: "base", KindImages: map[string]string{"vm": "debian-vm"}},
}

// Authenticator checks a control-plane request's API key and returns the
// caller.
type Authenticator func(h http.Header) (c tenant.Caller, ok bool)

// Facade serves the E2B protocol.
type Facade struct {
	cfg  Config
	log  *slog.Logger
	r    apiserver.Router
	auth Authenticator
	// ports reaches sandbox ports (ports.go).
	ports *http.Transport
	// host is cfg.Domain without its port: what Host names end with.
	host string
	// tb holds the template builds this replica started (nil without
	// Config.TemplateDir).
	tb *templateBuilds
}

// New returns a facade over r. auth checks API keys (apiserver's
// Server.Authenticate).
func New(cfg Config, log *slog.Logger, r apiserver.Router, auth Authenticator) (*Facade, error) {
	if len(cfg.TokenSecret) < 16 {
		return nil, errdefs.Invalid("the E2B facade needs a token secret of at least 16 bytes")
	}
	if cfg.Templates == nil {
		cfg.Templates = DefaultTemplates
	}
	if cfg.DefaultKind == "" {
		cfg.DefaultKind = "container"
	}
	if cfg.DefaultNetwork == "" {
		cfg.DefaultNetwork = "none"
	}
	cfg.Domain = strings.TrimSuffix(strings.ToLower(cfg.Domain), ".")
	f := &Facade{cfg: cfg, log: log.With(slog.String("facade", "e2b")), r: r, auth: auth, host: domainHost(cfg.Domain)}
	f.ports = f.portTransport()
	if cfg.TemplateDir != "" {
		f.tb = &templateBuilds{dir: cfg.TemplateDir, builds: map[string]*templateBuild{}}
	}
	if cfg.Hooks != nil {
		cfg.Hooks.AddFormat(events.FormatE2B, newWebhookFormat)
	}
	return f, nil
}

// Mount registers the facade's routes with handle (apiserver's
// Server.Handle), on the native API's listener. Requests for user ports
// by host name or header need Route too (apiserver's Server.Intercept).
func (f *Facade) Mount(handle func(pattern string, h http.Handler)) {
	f.mountControl(handle)
	f.mountEnvd(handle)
	f.mountInterpreter(handle)
	f.mountPorts(handle)
	f.mountVolumes(handle)
}

// token derives a sandbox's token of one purpose.
func (f *Facade) token(purpose, id string) string {
	m := hmac.New(sha256.New, f.cfg.TokenSecret)
	m.Write([]byte(purpose + "\x00" + id))
	return hex.EncodeToString(m.Sum(nil)[:20])
}

// AccessToken is the envdAccessToken of sandbox id (X-Access-Token).
func (f *Facade) AccessToken(id string) string { return f.token("envd", id) }

// TrafficToken is the trafficAccessToken of sandbox id, which the code
// interpreter SDK sends as E2B-Traffic-Access-Token.
func (f *Facade) TrafficToken(id string) string { return f.token("traffic", id) }

func equal(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// target is the sandbox and port a data-plane request addresses.
type target struct {
	id   string
	port int
}

type targetKey struct{}

func withTarget(ctx context.Context, t target) context.Context {
	return context.WithValue(ctx, targetKey{}, t)
}

func targetOf(ctx context.Context) target {
	t, _ := ctx.Value(targetKey{}).(target)
	return t
}

// resolve finds the sandbox and port of a data-plane request: the
// E2b-Sandbox-Id and E2b-Sandbox-Port headers, else a Host name of the form
// <port>-<id>.<domain>.
func (f *Facade) resolve(r *http.Request, defaultPort int) (target, error) {
	t := target{id: r.Header.Get("E2b-Sandbox-Id"), port: defaultPort}
	if p := r.Header.Get("E2b-Sandbox-Port"); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil {
			return t, errdefs.Invalid("E2b-Sandbox-Port %q is not a port", clip(p))
		}
		t.port = n
	}
	if t.id == "" {
		port, id, ok := f.parseHost(r.Host)
		if !ok {
			return t, errdefs.Invalid("no sandbox named: send the E2b-Sandbox-Id header or use a <port>-<sandbox id>.<domain> host")
		}
		t.id, t.port = id, port
	}
	return t, nil
}

// parseHost splits "<port>-<id>.<domain>[:p]". With a configured domain the
// rest of the host must be that domain (its port aside).
func (f *Facade) parseHost(host string) (port int, id string, ok bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	label, rest, found := strings.Cut(host, ".")
	if !found || (f.host != "" && rest != f.host) {
		return 0, "", false
	}
	p, id, found := strings.Cut(label, "-")
	if !found || id == "" {
		return 0, "", false
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n > 65535 {
		return 0, "", false
	}
	return n, id, true
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
