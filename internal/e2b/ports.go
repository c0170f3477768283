package e2b

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/tenant"
)

// User ports: sandbox.getHost(port) is <port>-<sandbox id>.<domain>, where
// a server the user started in the sandbox answers. The facade proxies any
// port but envd's and the code interpreter's (which it serves itself) to
// the sandbox: HTTP requests, streamed both ways, and upgrades (WebSocket)
// as raw connections. The connection to the port goes through the node and
// the sandbox's agent (apiserver.Node.DialPort), never over the sandbox's
// network, so a sandbox without network serves its ports too.
//
// Three ways to name the port, all equivalent:
//   - the host name <port>-<sandbox id>.<domain> (any path);
//   - the headers E2b-Sandbox-Id and E2b-Sandbox-Port (any path), as the
//     SDKs address envd through E2B_SANDBOX_URL;
//   - the path /sandboxes/<sandbox id>/ports/<port>/<path>, for clients that
//     can set neither (the prefix is removed before the request goes on).
//
// As on E2B, a port is public (whoever knows the sandbox ID reaches it)
// unless the sandbox was created with network.allowPublicTraffic false;
// then each request needs the sandbox's traffic access token in the
// E2b-Traffic-Access-Token header.

const (
	// trafficHeader carries a sandbox's traffic access token.
	trafficHeader = "E2b-Traffic-Access-Token"
	// trafficLabel marks a sandbox whose ports need the traffic token.
	trafficLabel = labelPrefix + "traffic"
	// maskHostLabel is the Host header requests to the sandbox's ports carry
	// (network.maskRequestHost, "${PORT}" replaced by the port).
	maskHostLabel = labelPrefix + "mask-request-host"
	// portPathPrefix starts the path form.
	portPathPrefix = "/sandboxes/"
)

// isFacadePort reports whether the facade serves port itself.
func isFacadePort(port int) bool { return port == EnvdPort || port == InterpreterPort }

// Route is the facade's front router (apiserver.Server.Intercept): a
// request naming a sandbox port by host name or by header, other than the
// ports the facade serves itself, goes to the port proxy.
func (f *Facade) Route(r *http.Request) http.Handler {
	t, ok := f.userPort(r)
	if !ok {
		return nil
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { f.proxyPort(w, r, t, "") })
}

// userPort finds the user port a request names by header or host name.
func (f *Facade) userPort(r *http.Request) (target, bool) {
	if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
		n, err := strconv.Atoi(r.Header.Get("E2b-Sandbox-Port"))
		if err != nil || isFacadePort(n) {
			return target{}, false
		}
		return target{id: id, port: n}, true
	}
	port, id, ok := f.parseHost(r.Host)
	if !ok || isFacadePort(port) {
		return target{}, false
	}
	if _, err := sandboxid.Node(id); err != nil {
		return target{}, false
	}
	return target{id: id, port: port}, true
}

func (f *Facade) mountPorts(handle func(string, http.Handler)) {
	handle("/sandboxes/{id}/ports/{port}/{rest...}", http.HandlerFunc(f.portPath))
	handle("/sandboxes/{id}/ports/{port}", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Relative links resolve against a base that ends in "/".
		u := *r.URL
		u.Path += "/"
		u.RawPath = ""
		http.Redirect(w, r, u.String(), http.StatusPermanentRedirect)
	}))
}

// portPath serves the path form.
func (f *Facade) portPath(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.Atoi(r.PathValue("port"))
	if err != nil {
		envdError(w, errdefs.Invalid("%q is not a port", clip(r.PathValue("port"))))
		return
	}
	id := r.PathValue("id")
	f.proxyPort(w, r, target{id: id, port: n}, portPathPrefix+id+"/ports/"+r.PathValue("port"))
}

// portError is the body of the proxy's own answers, as E2B's proxy writes
// them: {"sandboxId", "message", "code"} (and "port" for a closed port).
type portError struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Port      string `json:"port,omitempty"`
	Code      int    `json:"code"`
}

func sandboxNotFound(w http.ResponseWriter, id string) {
	writeJSON(w, http.StatusBadGateway, portError{SandboxID: id, Message: "The sandbox was not found", Code: http.StatusBadGateway})
}

func portClosed(w http.ResponseWriter, id string, port int) {
	writeJSON(w, http.StatusBadGateway, portError{SandboxID: id, Message: "The sandbox is running but port is not open", Port: strconv.Itoa(port), Code: http.StatusBadGateway})
}

// proxyPort forwards r to port t of its sandbox. strip is the path prefix
// of the path form ("" otherwise).
func (f *Facade) proxyPort(w http.ResponseWriter, r *http.Request, t target, strip string) {
	if t.port <= 0 || t.port > 65535 {
		envdError(w, errdefs.Invalid("%d is not a port", t.port))
		return
	}
	// The sandbox is looked up for the platform: a port is reached by its
	// sandbox ID (and, for private traffic, its token), not by an API key.
	ctx := tenant.System(r.Context())
	n, err := f.r.ForSandbox(ctx, t.id)
	if err != nil {
		sandboxNotFound(w, t.id)
		return
	}
	sb, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxRequest{Id: t.id}, apiserver.Node.GetSandbox)
	if err != nil || (sb.State != "running" && sb.State != "paused") {
		sandboxNotFound(w, t.id)
		return
	}
	labels := sb.GetSpec().GetLabels()
	if labels[trafficLabel] == "private" {
		got := r.Header.Get(trafficHeader)
		switch {
		case got == "":
			writeJSON(w, http.StatusForbidden, portError{SandboxID: t.id, Code: http.StatusForbidden,
				Message: "Sandbox is secured with traffic access token. Token header '" + strings.ToLower(trafficHeader) + "' is missing"})
			return
		case !equal(got, f.TrafficToken(t.id)):
			writeJSON(w, http.StatusForbidden, portError{SandboxID: t.id, Code: http.StatusForbidden,
				Message: "Sandbox is secured with traffic access token. Provided token in header '" + strings.ToLower(trafficHeader) + "' is invalid"})
			return
		}
	}
	// E2B's rule for a paused sandbox: 502 until connect(), unless it was
	// created with autoResume (then this request resumes it). Only an
	// authorized request may resume it.
	if sb.State == "paused" {
		if _, err := f.awake(ctx, t.id); err != nil {
			if !writePaused(w, err) {
				sandboxNotFound(w, t.id)
			}
			return
		}
	}
	host := r.Host
	if m := labels[maskHostLabel]; m != "" {
		host = strings.ReplaceAll(m, "${PORT}", strconv.Itoa(t.port))
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(&url.URL{Scheme: "http", Host: net.JoinHostPort(t.id, strconv.Itoa(t.port))})
			if strip != "" {
				pr.Out.URL.Path = "/" + strings.TrimPrefix(strings.TrimPrefix(pr.In.URL.Path, strip), "/")
				pr.Out.URL.RawPath = ""
				if raw := pr.In.URL.RawPath; raw != "" {
					pr.Out.URL.RawPath = "/" + strings.TrimPrefix(strings.TrimPrefix(raw, strip), "/")
				}
			}
			pr.Out.Host = host
			pr.SetXForwarded()
			// dsec's credentials and routing are not the sandbox's business:
			// an API key must not reach a workload that may not be trusted.
			for _, h := range []string{"X-Api-Key", trafficHeader, "E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Access-Token"} {
				pr.Out.Header.Del(h)
			}
		},
		Transport:     f.ports,
		FlushInterval: -1, // streamed as it comes (server-sent events, chunked output)
		ErrorLog:      slog.NewLogLogger(f.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			f.portFailed(w, r, t, err)
		},
	}
	rp.ServeHTTP(w, r.WithContext(ctx))
}

// portFailed answers a request the sandbox's port did not take.
func (f *Facade) portFailed(w http.ResponseWriter, r *http.Request, t target, err error) {
	if errors.Is(err, context.Canceled) && r.Context().Err() != nil {
		return // the client went away
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		err = errwire.FromConnect(ce)
	}
	switch {
	case !f.running(tenant.System(r.Context()), t.id):
		sandboxNotFound(w, t.id)
	case errdefs.KindOf(err) == errdefs.KindNotFound:
		portClosed(w, t.id, t.port)
	default:
		f.log.Debug("port proxy failed", slog.String("sandbox_id", t.id), slog.Int("port", t.port), slog.Any("error", err))
		writeJSON(w, http.StatusBadGateway, portError{SandboxID: t.id, Port: strconv.Itoa(t.port), Code: http.StatusBadGateway,
			Message: "The sandbox's port did not answer: " + errdefs.Classify(err).Msg})
	}
}

// portTransport is the HTTP transport to sandbox ports: its "addresses"
// are <sandbox id>:<port>, dialed through the sandbox's node and agent.
// Idle connections are kept a short while per sandbox port; a request
// reuses only a connection to the port it was authorized for.
func (f *Facade) portTransport() *http.Transport {
	return &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			id, p, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			port, err := strconv.ParseUint(p, 10, 16)
			if err != nil {
				return nil, err
			}
			ctx = tenant.System(ctx)
			n, err := f.r.ForSandbox(ctx, id)
			if err != nil {
				return nil, err
			}
			return n.DialPort(ctx, id, uint32(port))
		},
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   8,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: 0, // a server may take its time; the client decides
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true, // bodies pass through as the server sent them
	}
}

// portLabels records what a create's network config says about the
// sandbox's ports: private traffic (allowPublicTraffic false) and the Host
// header requests carry (maskRequestHost).
func portLabels(nw *networkJSON, labels map[string]string) error {
	if nw == nil {
		return nil
	}
	if nw.AllowPublicTraffic != nil && !*nw.AllowPublicTraffic {
		labels[trafficLabel] = "private"
	}
	if m := nw.MaskRequestHost; m != nil && *m != "" {
		host := strings.ReplaceAll(*m, "${PORT}", "1")
		if len(*m) > 253 || strings.ContainsAny(host, " /\\\t\r\n@?#") {
			return errdefs.Invalid("network.maskRequestHost %q is not a host[:port] (\"${PORT}\" stands for the port)", clip(*m))
		}
		labels[maskHostLabel] = *m
	}
	return nil
}
