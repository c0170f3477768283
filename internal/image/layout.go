package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/opendsec/dsec/internal/errdefs"
)

// Images on a plain HTTP server or an object store.
//
// Export writes an image of layers' EROFS files (PushLazy's) as a tar of
// an OCI image layout: oci-layout, index.json and blobs/sha256/<hex>.
// Unpacked under a prefix of any HTTP server or object store that answers
// GET with range requests (S3, GCS, MinIO, nginx, a CDN), it is a source
// like a registry: PullURL reads index.json, the manifest, the config and
// each layer's metadata image and blob description whole (their digests
// checked), and each layer's blob by range as sandboxes touch it, in
// checked chunks. A layout of an ordinary OCI image (gzip layers) imports
// whole the same way.

// Export writes img, whose layers must be stored as EROFS files with a
// blob, to w as a tar of an OCI image layout (see above).
func (s *Store) Export(ctx context.Context, img *Image, w io.Writer) error {
	if img.VM != nil || img.Snapshot != nil && img.Snapshot.Machine {
		return errdefs.Invalid("image %s is a VM disk or machine snapshot: only layered images are exported", img.Name)
	}
	release, err := s.Hold(img.Layers)
	if err != nil {
		return err
	}
	defer release()
	out, err := s.lazyImage(img)
	if err != nil {
		return err
	}
	manifest, err := out.RawManifest()
	if err != nil {
		return errdefs.Internal(err, "the image's manifest")
	}
	digest, err := out.Digest()
	if err != nil {
		return errdefs.Internal(err, "the image's digest")
	}
	config, err := out.RawConfigFile()
	if err != nil {
		return errdefs.Internal(err, "the image's config")
	}
	index, _ := json.Marshal(v1.IndexManifest{SchemaVersion: 2, MediaType: types.OCIImageIndex, Manifests: []v1.Descriptor{{
		MediaType: types.OCIManifestSchema1, Digest: digest, Size: int64(len(manifest)),
		Annotations: map[string]string{"org.opencontainers.image.ref.name": img.Name},
	}}})
	tw := tar.NewWriter(w)
	now := time.Now()
	file := func(name string, size int64, r io.Reader) error {
		if err := ctx.Err(); err != nil {
			return errdefs.Classify(err)
		}
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: size, ModTime: now, Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := io.CopyN(tw, r, size)
		return err
	}
	small := func(name string, b []byte) error { return file(name, int64(len(b)), bytes.NewReader(b)) }
	if err := tw.WriteHeader(&tar.Header{Name: "blobs/sha256/", Mode: 0o755, ModTime: now, Typeflag: tar.TypeDir}); err != nil {
		return err
	}
	cd, err := out.ConfigName()
	if err != nil {
		return errdefs.Internal(err, "the image's config digest")
	}
	if err := small(layoutBlob(cd), config); err != nil {
		return err
	}
	layers, err := out.Layers()
	if err != nil {
		return errdefs.Internal(err, "the image's layers")
	}
	seen := map[v1.Hash]bool{}
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			return errdefs.Internal(err, "a layer's digest")
		}
		if seen[d] {
			continue
		}
		seen[d] = true
		size, err := l.Size()
		if err != nil {
			return errdefs.Internal(err, "a layer's size")
		}
		rc, err := l.Compressed()
		if err != nil {
			return errdefs.Internal(err, "read a layer")
		}
		err = file(layoutBlob(d), size, rc)
		rc.Close()
		if err != nil {
			return err
		}
	}
	if err := small(layoutBlob(digest), manifest); err != nil {
		return err
	}
	if err := small("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := small("index.json", index); err != nil {
		return err
	}
	return tw.Close()
}

// UnpackLayout writes the entries of a tar of an OCI layout (Export's,
// an OCI archive) into dir: directories and regular files, each once,
// their names kept inside dir; anything else is refused.
func UnpackLayout(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return errdefs.Invalid("read the OCI layout's tar: %v", err)
		}
		dst := filepath.Join(dir, filepath.Clean("/"+h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return err
			}
		case tar.TypeReg, tar.TypeRegA:
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return err
			}
			out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o644)
			if err != nil {
				return errdefs.Invalid("OCI layout entry %q: %v", h.Name, err)
			}
			_, err = io.Copy(out, tr)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		default:
			return errdefs.Invalid("OCI layout entry %q has unsupported type %c", h.Name, h.Typeflag)
		}
	}
}

// IsURL says whether ref names an image layout on an HTTP server (see
// PullURL) rather than a registry reference.
func IsURL(ref string) bool {
	return strings.HasPrefix(ref, "http://") || strings.HasPrefix(ref, "https://")
}

// PullURL imports the image of the OCI image layout at base (an http or
// https URL of the directory holding its index.json) as name: an image of
// layers' EROFS files loaded on demand from there, any other image whole.
// Auth's username and password are sent as basic authentication, its
// registry token as a bearer token.
func (s *Store) PullURL(ctx context.Context, base, as string, auth Auth, progress Progress) (*Image, error) {
	if as == "" {
		return nil, errdefs.Invalid("an image pulled from a URL needs a name")
	}
	if err := ValidName(as); err != nil {
		return nil, err
	}
	if !strings.HasSuffix(base, "/") {
		base += "/"
	}
	pu, err := url.Parse(base)
	if err != nil {
		return nil, errdefs.Invalid("%q: %v", base, err)
	}
	// Credentials in the URL are sent as basic authentication (Go's
	// client does), kept with the layer's source (0600), and named nowhere
	// else.
	pu.User = nil
	shown := pu.String()
	// No deadline on a whole read (an ordinary layout's layers may take
	// minutes); a server that does not answer is given up after a minute.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.ResponseHeaderTimeout = time.Minute
	u := urlLayout{base: base, shown: shown, header: auth.header(), client: &http.Client{Transport: tr}}
	progress.report("resolve", shown, 0, 0)
	var index v1.IndexManifest
	if err := u.getJSON(ctx, "index.json", nil, &index); err != nil {
		return nil, err
	}
	var desc *v1.Descriptor
	for i, d := range index.Manifests {
		if d.MediaType != types.OCIManifestSchema1 && d.MediaType != types.DockerManifestSchema2 {
			continue
		}
		if d.Platform == nil || d.Platform.Satisfies(hostPlatform) {
			desc = &index.Manifests[i]
			break
		}
	}
	if desc == nil {
		return nil, errdefs.Invalid("%sindex.json names no image manifest for linux/amd64", shown)
	}
	img, err := partial.CompressedToImage(&urlImage{u: u, ctx: ctx, desc: *desc})
	if err != nil {
		return nil, errdefs.Invalid("the image at %s: %v", shown, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, classifyURL(shown, err)
	}
	if lazyManifest(m) {
		return s.pullLazy(ctx, as, shown+" (on demand)", shown, img, m, func(blob *v1.Descriptor) lazySource {
			return lazySource{URL: u.base + layoutBlob(blob.Digest), Auth: auth}
		}, progress)
	}
	return s.Import(ctx, as, shown, img, progress)
}

// header is auth as HTTP headers for a plain HTTP source.
func (a Auth) header() http.Header {
	h := http.Header{}
	switch {
	case a.RegistryToken != "":
		h.Set("Authorization", "Bearer "+a.RegistryToken)
	case a.Username != "" || a.Password != "":
		h.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(a.Username+":"+a.Password)))
	}
	return h
}

// urlLayout reads an OCI image layout over HTTP: at base, named shown
// in messages (base without its credentials).
type urlLayout struct {
	base, shown string
	header      http.Header
	client      *http.Client
}

// layoutBlob is the path of blob h in an OCI image layout.
func layoutBlob(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }

// get opens path under the layout; a refusal is an error of the kind its
// status says.
func (u urlLayout) get(ctx context.Context, path string) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.base+path, nil)
	if err != nil {
		return nil, errdefs.Invalid("%v", err)
	}
	for k, v := range u.header {
		req.Header[k] = v
	}
	resp, err := u.client.Do(req)
	if err != nil {
		return nil, errdefs.Unavailable("%v", err).WithCause(err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusNotFound:
			return nil, errdefs.NotFound("%s%s: %s", u.shown, path, resp.Status)
		case http.StatusUnauthorized, http.StatusForbidden:
			return nil, errdefs.PermissionDenied("%s%s: %s", u.shown, path, resp.Status)
		}
		return nil, errdefs.Unavailable("%s%s: %s", u.shown, path, resp.Status)
	}
	return resp.Body, nil
}

// getJSON decodes path (at most 16 MiB), checked against digest when one
// is given.
func (u urlLayout) getJSON(ctx context.Context, path string, digest *v1.Hash, v any) error {
	b, err := u.getSmall(ctx, path, digest)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return errdefs.Invalid("%s%s: %v", u.shown, path, err)
	}
	return nil
}

func (u urlLayout) getSmall(ctx context.Context, path string, digest *v1.Hash) ([]byte, error) {
	rc, err := u.get(ctx, path)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, 16<<20))
	if err != nil {
		return nil, errdefs.Unavailable("read %s%s: %v", u.shown, path, err).WithCause(err)
	}
	if digest != nil {
		if sum := sha256.Sum256(b); digest.Algorithm != "sha256" || hex.EncodeToString(sum[:]) != digest.Hex {
			return nil, errdefs.Invalid("%s%s does not match its digest %s", u.shown, path, digest)
		}
	}
	return b, nil
}

// urlImage is the image a layout's manifest names, its blobs read over
// HTTP and checked against their digests.
type urlImage struct {
	u    urlLayout
	ctx  context.Context
	desc v1.Descriptor
}

func (i *urlImage) MediaType() (types.MediaType, error) { return i.desc.MediaType, nil }

func (i *urlImage) RawManifest() ([]byte, error) {
	return i.u.getSmall(i.ctx, layoutBlob(i.desc.Digest), &i.desc.Digest)
}

func (i *urlImage) RawConfigFile() ([]byte, error) {
	m, err := partial.Manifest(i)
	if err != nil {
		return nil, err
	}
	return i.u.getSmall(i.ctx, layoutBlob(m.Config.Digest), &m.Config.Digest)
}

func (i *urlImage) LayerByDigest(h v1.Hash) (partial.CompressedLayer, error) {
	m, err := partial.Manifest(i)
	if err != nil {
		return nil, err
	}
	for _, d := range m.Layers {
		if d.Digest != h {
			continue
		}
		return &urlBlob{i: i, desc: d}, nil
	}
	return nil, fmt.Errorf("the manifest has no layer %s", h)
}

// urlBlob is a manifest layer read whole over HTTP, its digest checked at
// its end.
type urlBlob struct {
	i    *urlImage
	desc v1.Descriptor
}

func (b *urlBlob) Digest() (v1.Hash, error)            { return b.desc.Digest, nil }
func (b *urlBlob) Size() (int64, error)                { return b.desc.Size, nil }
func (b *urlBlob) MediaType() (types.MediaType, error) { return b.desc.MediaType, nil }

func (b *urlBlob) Compressed() (io.ReadCloser, error) {
	if b.desc.Digest.Algorithm != "sha256" {
		return nil, errdefs.Invalid("layer digest %s: only sha256 is read", b.desc.Digest)
	}
	rc, err := b.i.u.get(b.i.ctx, layoutBlob(b.desc.Digest))
	if err != nil {
		return nil, err
	}
	return &verified{rc: rc, h: sha256.New(), want: b.desc.Digest.Hex, left: b.desc.Size, name: b.i.u.shown + layoutBlob(b.desc.Digest)}, nil
}

// verified reads a blob of a known size and digest, failing at its end
// if either is wrong.
type verified struct {
	rc   io.ReadCloser
	h    hash.Hash
	want string
	left int64
	name string
}

func (v *verified) Read(p []byte) (int, error) {
	if int64(len(p)) > v.left+1 {
		p = p[:v.left+1]
	}
	n, err := v.rc.Read(p)
	v.h.Write(p[:n])
	v.left -= int64(n)
	if v.left < 0 {
		return n, errdefs.Invalid("%s is longer than its manifest says", v.name)
	}
	if err == io.EOF {
		if v.left > 0 {
			return n, errdefs.Unavailable("%s ended %d bytes short", v.name, v.left)
		}
		if hex.EncodeToString(v.h.Sum(nil)) != v.want {
			return n, errdefs.Invalid("%s does not match its digest sha256:%s", v.name, v.want)
		}
	}
	return n, err
}

func (v *verified) Close() error { return v.rc.Close() }

// classifyURL classifies a failure to read a layout over HTTP: the
// errors of get keep their kinds.
func classifyURL(base string, err error) error {
	var e *errdefs.Error
	if errors.As(err, &e) {
		return err
	}
	return errdefs.Unavailable("%s: %v", base, err).WithCause(err)
}
