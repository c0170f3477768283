package apiserver

import (
	"encoding/json"
	"net/http"
	"strconv"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// serveFiles is plain HTTP file transfer, for curl and for clients that
// stream large files without framing:
//
//	GET /v1/sandboxes/{id}/files?path=P[&offset=N&max_bytes=N&user=U]  → the bytes
//	PUT /v1/sandboxes/{id}/files?path=P[&mode=0644&append=1&user=U&request_id=R]  ← the bytes
//
// Both act as user U inside the sandbox (default: the sandbox's user).
func (s *Server) serveFiles(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	q := r.URL.Query()
	n, err := s.router.ForSandbox(r.Context(), id)
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	switch r.Method {
	case http.MethodGet:
		offset, _ := strconv.ParseInt(q.Get("offset"), 10, 64)
		limit, _ := strconv.ParseInt(q.Get("max_bytes"), 10, 64)
		started := false
		err := n.ReadFileChunks(r.Context(), &dsecv1.ReadFileRequest{SandboxId: id, Container: q.Get("container"), Path: q.Get("path"), Offset: offset, MaxBytes: limit, User: q.Get("user")}, func(m *dsecv1.ReadFileResponse) error {
			if info := m.GetInfo(); info != nil {
				w.Header().Set("Content-Type", "application/octet-stream")
				if limit == 0 && offset == 0 {
					w.Header().Set("Content-Length", strconv.FormatInt(info.Size, 10))
				}
				w.Header().Set("X-Dsec-File-Mode", strconv.FormatUint(uint64(info.Mode), 8))
				w.WriteHeader(http.StatusOK)
				started = true
				return nil
			}
			_, err := w.Write(m.GetData())
			return err
		})
		switch {
		case err != nil && !started:
			writeHTTPError(w, err)
		case err != nil:
			// The status is sent: break the response off (no final chunk,
			// or fewer bytes than Content-Length) so no client takes a
			// short body for the file.
			panic(http.ErrAbortHandler)
		}
	case http.MethodPut, http.MethodPost:
		mode, _ := strconv.ParseUint(q.Get("mode"), 8, 32)
		resp, err := n.WriteFileFrom(r.Context(), &dsecv1.WriteFileHeader{
			SandboxId: id, Container: q.Get("container"), Path: q.Get("path"), Mode: uint32(mode), Append: q.Get("append") == "1" || q.Get("append") == "true", User: q.Get("user"),
			RequestId: q.Get("request_id"),
		}, r.Body)
		if err != nil {
			writeHTTPError(w, err)
			return
		}
		info := resp.Msg
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"path": info.Path, "size": info.Size, "mode": info.Mode, "replayed": info.Replayed})
	default:
		w.Header().Set("Allow", "GET, PUT")
		writeHTTPError(w, errdefs.Invalid("method %s not allowed", r.Method))
	}
}

// writeHTTPError writes a JSON error with the same classification as the
// Connect errors.
func writeHTTPError(w http.ResponseWriter, err error) {
	err = errwire.FromConnect(err)
	e := errdefs.Classify(err)
	w.Header().Set("Content-Type", "application/json")
	if e.RetryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(int((e.RetryAfter.Seconds())+0.999)))
	}
	w.WriteHeader(errwire.HTTPStatus(err))
	json.NewEncoder(w).Encode(map[string]any{
		"code": string(e.Kind), "message": e.Msg, "infra": e.Infra, "retryable": e.Retryable,
	})
}
