package e2b

import (
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"io"
	"mime"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
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
// ("read" or "write"), as envd does: the signature first, then its expiry,
// so a forger never learns whether the expiry was the problem.
func (f *Facade) authorizeFiles(r *http.Request, id, op string) error {
	token := f.AccessToken(id)
	if h := r.Header.Get("X-Access-Token"); h != "" {
		if equal(h, token) {
			return nil
		}
		return errdefs.Unauthenticated("access token present in header but does not match")
	}
	q := r.URL.Query()
	if q.Get("signature") == "" {
		return errdefs.Unauthenticated("missing signature query parameter")
	}
	if !signedBy(q, op, token) {
		return errdefs.Unauthenticated("invalid signature")
	}
	return unexpired(q)
}

// signedBy reports whether the query's signature is the one token signs
// for op.
func signedBy(q url.Values, op, token string) bool {
	return equal(q.Get("signature"), signature(q.Get("path"), op, q.Get("username"), token, q.Get("signature_expiration")))
}

// unexpired checks a signed URL's expiry, if it has one.
func unexpired(q url.Values) error {
	exp := q.Get("signature_expiration")
	if exp == "" {
		return nil
	}
	t, err := strconv.ParseInt(exp, 10, 64)
	if err != nil {
		return errdefs.Unauthenticated("invalid signature expiration")
	}
	if time.Now().Unix() > t {
		return errdefs.Unauthenticated("signature is already expired")
	}
	return nil
}

// signedSandbox finds the sandbox whose access token signed a /files URL
// that names no sandbox (E2B_SANDBOX_URL: the SDK builds signed URLs on
// the bare sandbox URL). The signature is a hash of the token, which only
// that sandbox's holders know, so it identifies the sandbox unforgeably:
// the facade tries the token of every running sandbox (of every project,
// as the signature, not an API key, is the credential). That costs two
// hashes per sandbox of the deployment.
func (f *Facade) signedSandbox(ctx context.Context, q url.Values, op string) (string, error) {
	if q.Get("signature") == "" {
		return "", errdefs.Unauthenticated("no sandbox named and no signature: send the E2b-Sandbox-Id header, use a <port>-<sandbox id>.<domain> host or a signed URL")
	}
	all, err := apiserver.List(tenant.System(ctx), f.r, "", "")
	if err != nil {
		return "", err
	}
	for _, sb := range all {
		if (sb.State == "running" || sb.State == "paused") && signedBy(q, op, f.AccessToken(sb.Id)) {
			return sb.Id, unexpired(q)
		}
	}
	return "", errdefs.Unauthenticated("invalid signature")
}

// files serves GET /files (download) and POST /files (upload).
func (f *Facade) files(w http.ResponseWriter, r *http.Request) {
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
	t, err := f.resolve(r, EnvdPort)
	if err != nil {
		// A signed URL names its sandbox by its signature.
		id, serr := f.signedSandbox(r.Context(), r.URL.Query(), op)
		if serr != nil {
			envdError(w, serr)
			return
		}
		t = target{id: id, port: EnvdPort}
	} else {
		if t.port != EnvdPort {
			envdError(w, errdefs.Invalid("/files is served on port %d, not %d", EnvdPort, t.port))
			return
		}
		if err := f.authorizeFiles(r, t.id, op); err != nil {
			envdError(w, err)
			return
		}
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
	err := n.ReadFileChunks(r.Context(), &dsecv1.ReadFileRequest{SandboxId: id, Path: envdPath(p), User: r.URL.Query().Get("username")}, func(m *dsecv1.ReadFileResponse) error {
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
	switch {
	case err != nil && !started:
		envdError(w, f.sandboxErr(r.Context(), id, err))
	case err != nil:
		// The status is sent: break the response off, so no client takes
		// a short body for the file (and the SDKs, seeing the connection
		// drop, ask whether the sandbox still runs).
		panic(http.ErrAbortHandler)
	}
}

// writtenJSON is envd's EntryInfo of an upload.
type writtenJSON struct {
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Path     string            `json:"path"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// metadataHeader prefixes the request headers that carry an upload's
// metadata, one per key: X-Metadata-<key>: <value>.
const metadataHeader = "X-Metadata-"

// uploadMetadata collects an upload's metadata from its headers, keys
// lowercased (as envd does: header names are case-insensitive).
func uploadMetadata(h http.Header) map[string]string {
	var md map[string]string
	for name, values := range h {
		key, ok := strings.CutPrefix(http.CanonicalHeaderKey(name), metadataHeader)
		if !ok || key == "" || len(values) == 0 {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[strings.ToLower(key)] = values[0]
	}
	return md
}

// upload writes multipart parts named "file" (each to the query's path, or
// to its file name, which the SDKs set to the target path) or, for
// application/octet-stream, the body (gunzipped with Content-Encoding:
// gzip) to the query's path. X-Metadata-* headers become every file's
// metadata, replacing what it had (none: cleared), as in envd.
func (f *Facade) upload(w http.ResponseWriter, r *http.Request, n apiserver.Node, id string) {
	ctx := r.Context()
	q := r.URL.Query()
	user := q.Get("username")
	md := uploadMetadata(r.Header) // checked by the node, before it writes
	write := func(p string, body io.Reader) (*writtenJSON, error) {
		if p == "" {
			return nil, errdefs.Invalid("no target path: give ?path= or the part's file name")
		}
		resp, err := n.WriteFileFrom(ctx, &dsecv1.WriteFileHeader{SandboxId: id, Path: envdPath(p), User: user, Metadata: md}, body)
		if err != nil {
			return nil, f.sandboxErr(ctx, id, errwire.FromConnect(err))
		}
		info := resp.Msg
		// What the file holds now (read back), not what was asked for.
		return &writtenJSON{Name: path.Base(info.Path), Type: "file", Path: info.Path, Metadata: info.Metadata}, nil
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
