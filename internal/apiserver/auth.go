package apiserver

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"net/http"
	"path"
	"strings"

	"connectrpc.com/connect"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
)

// Request body limits. Every native endpoint authenticates the caller from
// the request's headers before it reads a byte of the body, and refuses a
// body over its procedure's limit with 413 (a deterministic refusal, not a
// retryable one) before reading it when the length is declared, or stops
// reading at the limit when it is not.
const (
	// maxMessage is the largest message any procedure takes (a batch of
	// function calls).
	maxMessage = 256 << 20
	// maxUnary bounds the request of a procedure not listed in
	// procedureLimits.
	maxUnary = 1 << 20
	// maxRunCodeBody bounds SandboxFusion's POST /run_code.
	maxRunCodeBody = 64 << 20
	// streamed marks an endpoint whose body is a stream of chunks (file and
	// image uploads): its total is bounded by the disk, each message by
	// maxMessage.
	streamed = -1
)

// procedureLimits are the body limits of the procedures that take more
// than maxUnary, by procedure name (the last element of a Connect path).
var procedureLimits = map[string]int64{
	"Exec":            64 << 20, // stdin
	"ExecStream":      64 << 20,
	"WriteStdin":      16 << 20,
	"WriteFile":       streamed,
	"WriteVolumeFile": streamed,
	"UploadImage":     streamed,
	"RunCode":         maxRunCodeBody, // files
	"RunCodeBatch":    maxMessage,
	"CreateSandboxes": 64 << 20, // up to 4096 specs
	"SendInput":       4 << 20,
	"ConnectPort":     streamed, // a TCP stream (node API)
}

// procedureLimit is the body limit of a Connect route.
const procedureLimit = 0

// Authenticate returns the caller a request's credential names (an API
// key in Authorization: Bearer or X-API-Key; on a node agent the cluster
// token, with the caller in the Dsec-Project and Dsec-Role headers), and
// whether it is accepted. Without keys, every request is accepted as the
// default project's operator.
func (s *Server) Authenticate(h http.Header) (tenant.Caller, bool) {
	ctx, err := s.auth.check(context.Background(), h)
	if err != nil {
		return tenant.Caller{}, false
	}
	return tenant.From(ctx), true
}

// auth authenticates every call: API keys, or the cluster token on a node
// agent's API.
type auth struct {
	keys  Keys
	token string
}

// check returns ctx carrying the caller h authenticates.
func (a *auth) check(ctx context.Context, h http.Header) (context.Context, error) {
	if a.token != "" {
		if subtle.ConstantTimeCompare([]byte(a.token), []byte(keyOf(h))) != 1 {
			return ctx, errdefs.Unauthenticated("missing or wrong cluster token (this is a node agent; call the control plane)")
		}
		c := tenant.Caller{Project: h.Get(ProjectHeader), Admin: h.Get(RoleHeader) == "admin"}
		if c.Project == "" {
			c.Project = tenant.DefaultProject
		}
		return tenant.With(ctx, c), nil
	}
	if a.keys.Open() {
		return tenant.With(ctx, tenant.Caller{Project: tenant.DefaultProject, Admin: true}), nil
	}
	if c, ok := a.keys.Caller(keyOf(h)); ok {
		return tenant.With(ctx, c), nil
	}
	return ctx, errdefs.Unauthenticated("missing or unknown API key (set DSEC_API_KEY)")
}

// guard authenticates a request from its headers and bounds its body
// before h reads any of it. limit is the body limit in bytes, streamed for
// an upload stream, or procedureLimit to look the procedure up.
func (s *Server) guard(limit int64, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, err := s.auth.check(r.Context(), r.Header)
		if err != nil {
			refuse(w, r, http.StatusUnauthorized, err)
			return
		}
		max := limit
		if max == procedureLimit {
			max = maxUnary
			if l, ok := procedureLimits[path.Base(r.URL.Path)]; ok {
				max = l
			}
		}
		if max != streamed && r.Body != nil && r.Body != http.NoBody {
			if r.ContentLength > max {
				refuse(w, r, http.StatusRequestEntityTooLarge, errdefs.Invalid("request body of %d bytes is over this endpoint's limit of %d", r.ContentLength, max))
				return
			}
			r.Body = http.MaxBytesReader(w, r.Body, max)
		}
		h.ServeHTTP(w, r.WithContext(ctx))
	})
}

// refuse answers a request the guard turned away, in the request's own
// protocol: gRPC callers get a gRPC status, Connect and plain HTTP callers
// status (401, 413) and a JSON error body.
func refuse(w http.ResponseWriter, r *http.Request, status int, err error) {
	ct := r.Header.Get("Content-Type")
	if strings.HasPrefix(ct, "application/grpc") {
		connect.NewErrorWriter().Write(w, r, errwire.ToConnect(err))
		return
	}
	e := errdefs.Classify(err)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	body := map[string]any{"code": string(e.Kind), "message": e.Msg, "infra": e.Infra, "retryable": e.Retryable}
	if strings.HasPrefix(r.URL.Path, "/dsec.") {
		// The Connect protocol's error body.
		body = map[string]any{"code": connect.CodeOf(errwire.ToConnect(err)).String(), "message": e.Msg}
	}
	json.NewEncoder(w).Encode(body)
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

// lookupKey returns the caller of an accepted key, in constant time per
// candidate.
func lookupKey(keys map[string]tenant.Caller, k string) (tenant.Caller, bool) {
	if k == "" {
		return tenant.Caller{}, false
	}
	var c tenant.Caller
	found := false
	for want, who := range keys {
		if subtle.ConstantTimeCompare([]byte(want), []byte(k)) == 1 {
			c, found = who, true
		}
	}
	return c, found
}
