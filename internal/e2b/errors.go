package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// E2B's error body, everywhere outside Connect: {"code": <HTTP status>,
// "message": "..."}. The JS SDK reads the code from the body (kill() returns
// false on {"code":404}), the Python SDK from the status.
type errorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// writeError writes err as E2B's error body with status.
func writeError(w http.ResponseWriter, status int, err error) {
	e := errdefs.Classify(err)
	if e.RetryAfter > 0 {
		// The SDKs retry a 429 only with an integer number of seconds.
		w.Header().Set("Retry-After", strconv.Itoa(int(e.RetryAfter.Seconds()+0.999)))
	}
	writeJSON(w, status, errorBody{Code: status, Message: e.Msg})
}

// apiError writes a control-plane error.
func apiError(w http.ResponseWriter, err error) { writeError(w, errwire.HTTPStatus(err), err) }

// envdError writes an error of the sandbox side's plain HTTP endpoints.
func envdError(w http.ResponseWriter, err error) {
	if !writePaused(w, err) {
		writeError(w, errwire.EnvdHTTPStatus(err), err)
	}
}

// notRunning is how the data plane reports a sandbox that does not run
// (unknown, deleted, expired or dead): E2B's proxy answers 502, which the
// SDKs turn into their "sandbox timeout" errors.
func notRunning(id string) error {
	return errdefs.Unavailable("sandbox %s is not running", clip(id))
}

// sandboxErr tells a failure of the sandbox itself from one of the
// operation: a not-found, gone or unavailable error on a sandbox that no
// longer runs becomes notRunning; anything else is returned as is (a
// missing file stays not found).
func (f *Facade) sandboxErr(ctx context.Context, id string, err error) error {
	if errwire.Classified(err) {
		err = errwire.FromConnect(err) // a node's answer
	}
	switch errdefs.KindOf(err) {
	case errdefs.KindNotFound, errdefs.KindGone, errdefs.KindUnavailable, errdefs.KindInvalid:
	default:
		return err
	}
	if f.running(ctx, id) {
		return err
	}
	return notRunning(id)
}

// running reports whether sandbox id exists and is running or paused.
func (f *Facade) running(ctx context.Context, id string) bool {
	n, err := f.r.ForSandbox(ctx, id)
	if err != nil {
		return false
	}
	sb, err := apiserver.Do(context.WithoutCancel(ctx), n, &dsecv1.GetSandboxRequest{Id: id}, apiserver.Node.GetSandbox)
	return err == nil && (sb.GetState() == "running" || sb.GetState() == "paused")
}

// rpcErr converts an error of an envd RPC for the Connect wire.
func (f *Facade) rpcErr(ctx context.Context, id string, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(*connect.Error); ok && !errwire.Classified(err) {
		return err // the facade's own
	}
	return errwire.ToConnect(f.sandboxErr(ctx, id, err))
}
