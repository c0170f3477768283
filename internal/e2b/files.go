package e2b

import (
	"compress/gzip"
	"crypto/sha256"
	"encoding/base64"
	"io"
	"mime"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// envd's plain HTTP endpoints: GET /health, GET and POST /files.

// health answers 204 while the sandbox runs and 502 otherwise (paused
// too, unless it resumes on traffic), which is how the SDKs tell a dead or
// paused sandbox from a network failure.
func (f *Facade) health(w http.ResponseWriter, r *http.Request) {
	t, err := f.resolve(r, EnvdPort)
	if err != nil {
		envdError(w, err)
		return
	}
	if _, err := f.awake(r.Context(), t.id); err != nil {
		envdError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// Signed URLs (uploadUrl, downloadUrl) carry
// signature=v1_<base64(sha256("<path>:<op>:<user>:<token>[:<expiry>]"))>.
func signature(p, op, user, token, exp string) string {
	raw := p + ":" + op + ":" + user + ":" + token
	if exp != "" {
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}

// authorizeFiles checks X-Access-Token, or a signed URL's signature for op
// ("read" or "write").
func (f *Facade) authorizeFiles(r *http.Request, id, op string) error {
	token := f.AccessToken(id)
	if h := r.Header.Get("X-Access-Token"); h != "" {
		if equal(h, token) {
			return nil
		}
		return errdefs.Unauthenticated("wrong X-Access-Token for sandbox %s", clip(id))
	}
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return errdefs.Unauthenticated("missing X-Access-Token (or a signed URL) for sandbox %s", clip(id))
	}
	exp := q.Get("signature_expiration")
	if exp != "" {
		t, err := strconv.ParseInt(exp, 10, 64)
		if err != nil || time.Now().Unix() > t {
			return errdefs.Unauthenticated("the signed URL has expired")
		}
	}
	if !equal(sig, signature(q.Get("path"), op, q.Get("username"), token, exp)) {
		return errdefs.Unauthenticated("the URL's signature does not match")
	}
	return nil
}

// files serves GET /files (download) and POST /files (upload).
func (f *Facade) files(w http.ResponseWriter, r *http.Request) {
	t, err := f.resolve(r, EnvdPort)
	if err != nil {
		envdError(w, err)
		return
	}
	if t.port != EnvdPort {
		envdError(w, errdefs.Invalid("/files is served on port %d, not %d", EnvdPort, t.port))
		return
	}
	op := "read"
	switch r.Method {
	case http.MethodGet:
	case http.MethodPost:
		op = "write"
	default:
		w.Header().Set("Allow", "GET, POST")
		envdError(w, errdefs.Invalid("method %s not allowed on /files", r.Method))
		return
	}
	if err := f.authorizeFiles(r, t.id, op); err != nil {
		envdError(w, err)
		return
	}
	r = r.WithContext(tokenHolder(r.Context()))
	n, err := f.awake(r.Context(), t.id)
	if err != nil {
		envdError(w, err)
		return
	}
	if op == "read" {
		f.download(w, r, n, t.id)
		return
	}
	f.upload(w, r, n, t.id)
}

func (f *Facade) download(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	p := r.URL.Query().Get("path")
	if p == "" {
		envdError(w, errdefs.Invalid("path is required"))
		return
	}
	started := false
	err := n.ReadFileChunks(r.Context(), &dsecv1.ReadFileRequest{SandboxId: id, Path: p, User: r.URL.Query().Get("username")}, func(m *dsecv1.ReadFileResponse) error {
		if info := m.GetInfo(); info != nil {
			h := w.Header()
			h.Set("Content-Type", "application/octet-stream")
			h.Set("Content-Length", strconv.FormatInt(info.Size, 10))
			h.Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": info.Name}))
			w.WriteHeader(http.StatusOK)
			started = true
			return nil
		}
		_, err := w.Write(m.GetData())
		return err
	})
	if err != nil && !started {
		envdError(w, f.sandboxErr(r.Context(), id, err))
	}
}

// writtenJSON is envd's EntryInfo of an upload.
type writtenJSON struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// upload writes multipart parts named "file" (each to the query's path, or
// to its file name, which the SDKs set to the target path) or, for
// application/octet-stream, the body (gunzipped with Content-Encoding:
// gzip) to the query's path.
func (f *Facade) upload(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	ctx := r.Context()
	q := r.URL.Query()
	user := q.Get("username")
	write := func(p string, body io.Reader) (*writtenJSON, error) {
		if p == "" {
			return nil, errdefs.Invalid("no target path: give ?path= or the part's file name")
		}
		resp, err := n.WriteFileFrom(ctx, &dsecv1.WriteFileHeader{SandboxId: id, Path: p, User: user}, body)
		if err != nil {
			return nil, f.sandboxErr(ctx, id, errwire.FromConnect(err))
		}
		info := resp.Msg
		return &writtenJSON{Name: path.Base(info.Path), Type: "file", Path: info.Path}, nil
	}
	var out []writtenJSON
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch {
	case mt == "multipart/form-data":
		mr, err := r.MultipartReader()
		if err != nil {
			envdError(w, errdefs.Invalid("malformed multipart body: %v", err))
			return
		}
		for {
			part, err := mr.NextRawPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				envdError(w, errdefs.Invalid("malformed multipart body: %v", err))
				return
			}
			// Part.FileName keeps only the base name; the SDKs put the
			// whole target path there.
			_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
			if dp["name"] != "file" {
				part.Close()
				continue
			}
			target := q.Get("path")
			if target == "" {
				target = dp["filename"]
			}
			res, err := write(target, part)
			part.Close()
			if err != nil {
				envdError(w, err)
				return
			}
			out = append(out, *res)
		}
	default:
		var body io.Reader = r.Body
		switch r.Header.Get("Content-Encoding") {
		case "", "identity":
		case "gzip":
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				envdError(w, errdefs.Invalid("Content-Encoding gzip: %v", err))
				return
			}
			defer zr.Close()
			body = zr
		default:
			envdError(w, errdefs.Invalid("Content-Encoding %q is not supported (use gzip)", clip(r.Header.Get("Content-Encoding"))))
			return
		}
		res, err := write(q.Get("path"), body)
		if err != nil {
			envdError(w, err)
			return
		}
		out = append(out, *res)
	}
	if len(out) == 0 {
		envdError(w, errdefs.Invalid("the upload holds no part named \"file\""))
		return
	}
	writeJSON(w, http.StatusOK, out)
}
