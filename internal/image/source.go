package image

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/opendsec/dsec/internal/errdefs"
)

var hostPlatform = v1.Platform{OS: "linux", Architecture: "amd64"}

// Auth is registry credentials given with a pull; empty fields fall back
// to the node's docker config.
type Auth struct {
	Username, Password, IdentityToken, RegistryToken string
}

// Pull imports an image from a registry. Without auth it uses the node's
// docker config (~/.docker/config.json, DOCKER_CONFIG).
func (s *Store) Pull(ctx context.Context, ref, as string, auth Auth, insecure bool, progress Progress) (*Image, error) {
	if IsURL(ref) {
		return s.PullURL(ctx, ref, as, auth, progress)
	}
	r, ropts, err := remoteRef(ctx, ref, auth, insecure)
	if err != nil {
		return nil, err
	}
	progress.report("resolve", r.String(), 0, 0)
	img, err := remote.Image(r, ropts...)
	if err != nil {
		return nil, classifyRemote(ref, err)
	}
	if as == "" {
		as = ref
	}
	if m, err := img.Manifest(); err == nil && lazyManifest(m) {
		return s.pullLazy(ctx, as, "registry:"+r.String()+" (on demand)", r.String(), img, m, func(blob *v1.Descriptor) lazySource {
			return lazySource{Registry: r.Context().RegistryStr(), Repo: r.Context().RepositoryStr(), Digest: blob.Digest.String(), Insecure: insecure, Auth: auth}
		}, progress)
	}
	return s.Import(ctx, as, "registry:"+r.String(), img, progress)
}

// classifyRemote classifies a registry call's failure by the registry's
// answer (its status and error codes), never by the message's text: a
// message also carries the registry's address, whose port may read 404.
func classifyRemote(ref string, err error) error {
	var te *transport.Error
	if errors.As(err, &te) {
		switch {
		case te.StatusCode == http.StatusNotFound || hasCode(te, transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode):
			return errdefs.NotFound("image %s not found in its registry: %v", ref, err)
		case te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden || hasCode(te, transport.UnauthorizedErrorCode, transport.DeniedErrorCode):
			return errdefs.PermissionDenied("registry refused %s: %v", ref, err)
		}
	}
	return errdefs.Unavailable("pull %s: %v", ref, err).WithCause(err)
}

// hasCode reports whether the registry's answer carries one of codes.
func hasCode(te *transport.Error, codes ...transport.ErrorCode) bool {
	for _, d := range te.Errors {
		if slices.Contains(codes, d.Code) {
			return true
		}
	}
	return false
}

// ImportPath imports a `docker save` archive, an OCI archive (a tar of an
// OCI layout) or an OCI layout directory found at path on the node.
func (s *Store) ImportPath(ctx context.Context, path, as string, progress Progress) (*Image, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, errdefs.NotFound("image source: %v", err)
	}
	if st.IsDir() {
		img, err := imageFromLayout(path)
		if err != nil {
			return nil, err
		}
		return s.Import(ctx, as, "oci-layout:"+filepath.Base(path), img, progress)
	}
	kind, err := archiveKind(path)
	if err != nil {
		return nil, err
	}
	switch kind {
	case "docker":
		img, err := tarball.ImageFromPath(path, nil)
		if err != nil {
			return nil, errdefs.Invalid("read docker archive: %v", err)
		}
		return s.Import(ctx, as, "docker-archive", img, progress)
	default:
		dir, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "oci-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		if err := extractPlain(path, dir); err != nil {
			return nil, err
		}
		img, err := imageFromLayout(dir)
		if err != nil {
			return nil, err
		}
		return s.Import(ctx, as, "oci-archive", img, progress)
	}
}

// ImportArchive imports an archive streamed by a client (see ImportPath for
// the formats).
func (s *Store) ImportArchive(ctx context.Context, r io.Reader, as string, progress Progress) (*Image, error) {
	f, err := os.CreateTemp(filepath.Join(s.dir, "tmp"), "upload-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if _, err := io.Copy(f, r); err != nil {
		return nil, errdefs.Classify(err)
	}
	if err := f.Close(); err != nil {
		return nil, err
	}
	return s.ImportPath(ctx, f.Name(), as, progress)
}

// archiveKind tells a docker archive ("docker": manifest.json at the top)
// from an OCI archive ("oci": an oci-layout file).
func archiveKind(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", errdefs.Invalid("image archive is not a tar file: %v", err)
		}
		switch strings.TrimPrefix(h.Name, "./") {
		case "manifest.json":
			return "docker", nil
		case "oci-layout":
			return "oci", nil
		}
	}
	return "", errdefs.Invalid("image archive has neither manifest.json (docker save) nor oci-layout (OCI)")
}

// extractPlain extracts an OCI archive (a tar of an OCI layout) at path
// into dir (UnpackLayout).
func extractPlain(path, dir string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return UnpackLayout(f, dir)
}

// imageFromLayout picks the linux/amd64 image of an OCI layout.
func imageFromLayout(dir string) (v1.Image, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, errdefs.Invalid("not an OCI layout: %v", err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, errdefs.Invalid("read OCI index: %v", err)
	}
	img, err := pickImage(idx, 0)
	if err != nil {
		return nil, err
	}
	return img, nil
}

func pickImage(idx v1.ImageIndex, depth int) (v1.Image, error) {
	if depth > 4 {
		return nil, errdefs.Invalid("OCI index nests too deep")
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, errdefs.Invalid("read OCI index: %v", err)
	}
	var fallback *v1.Descriptor
	for i := range m.Manifests {
		d := m.Manifests[i]
		if d.MediaType.IsIndex() {
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, errdefs.Invalid("read nested index: %v", err)
			}
			if img, err := pickImage(child, depth+1); err == nil {
				return img, nil
			}
			continue
		}
		if !d.MediaType.IsImage() {
			continue
		}
		if d.Platform == nil || d.Platform.Satisfies(hostPlatform) {
			return idx.Image(d.Digest)
		}
		if fallback == nil {
			fallback = &d
		}
	}
	if fallback != nil {
		return nil, errdefs.Invalid("OCI layout has no linux/amd64 image (found %s)", fallback.Platform)
	}
	return nil, errdefs.Invalid("OCI layout holds no image")
}
