package image

import (
	"context"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/opendsec/dsec/internal/errdefs"
)

// remoteRef parses a registry reference and the options a call to its
// registry takes: auth if given, else the node's docker config
// (~/.docker/config.json, DOCKER_CONFIG).
func remoteRef(ctx context.Context, ref string, auth Auth, insecure bool) (name.Reference, []remote.Option, error) {
	var opts []name.Option
	if insecure {
		opts = append(opts, name.Insecure)
	}
	r, err := name.ParseReference(ref, opts...)
	if err != nil {
		return nil, nil, errdefs.Invalid("bad image reference %q: %v", ref, err)
	}
	ropts := []remote.Option{remote.WithContext(ctx), remote.WithPlatform(hostPlatform)}
	if auth != (Auth{}) {
		ropts = append(ropts, remote.WithAuth(authn.FromConfig(authn.AuthConfig{
			Username: auth.Username, Password: auth.Password, IdentityToken: auth.IdentityToken, RegistryToken: auth.RegistryToken,
		})))
	} else {
		ropts = append(ropts, remote.WithAuthFromKeychain(authn.DefaultKeychain))
	}
	return r, ropts, nil
}

// Push writes img to a registry at ref as an OCI image for linux/amd64:
// each of its layers archived from the store (OCI whiteouts; owners,
// modes, times, hard links and file capabilities as stored; gzip) and its
// configuration (environment, user, working directory, entrypoint, cmd,
// labels, exposed ports). It returns the manifest's digest. A layer
// archived from the store has the diff ID of that archive, which for an
// imported layer differs from the one its registry had: the content is
// the same. The image's layers are held while they are read. VM images
// and machine snapshots have no layers to push (invalid).
func (s *Store) Push(ctx context.Context, img *Image, ref string, auth Auth, insecure bool, progress Progress) (string, error) {
	r, ropts, release, err := s.pushable(ctx, img, ref, auth, insecure)
	if err != nil {
		return "", err
	}
	defer release()
	out, err := s.ociImage(img)
	if err != nil {
		return "", err
	}
	return s.write(ctx, r, ref, out, ropts, progress)
}

// pushable checks img can be pushed (VM images and machine snapshots
// have no layers to push), parses ref and holds img's layers until
// release is called.
func (s *Store) pushable(ctx context.Context, img *Image, ref string, auth Auth, insecure bool) (name.Reference, []remote.Option, func(), error) {
	if img.VM != nil || img.Snapshot != nil && img.Snapshot.Machine {
		return nil, nil, nil, errdefs.Invalid("image %s is a VM disk or machine snapshot: only layered images are pushed", img.Name)
	}
	r, ropts, err := remoteRef(ctx, ref, auth, insecure)
	if err != nil {
		return nil, nil, nil, err
	}
	release, err := s.Hold(img.Layers)
	if err != nil {
		return nil, nil, nil, err
	}
	return r, ropts, release, nil
}

// write writes out to a registry at r (ref as the caller named it),
// reporting upload progress, and returns the manifest's digest.
func (s *Store) write(ctx context.Context, r name.Reference, ref string, out v1.Image, ropts []remote.Option, progress Progress) (string, error) {
	digest, err := out.Digest()
	if err != nil {
		return "", errdefs.Internal(err, "archive the image's layers")
	}
	updates := make(chan v1.Update, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for u := range updates {
			progress.report("upload", r.String(), u.Complete, u.Total)
		}
	}()
	err = remote.Write(r, out, append(ropts, remote.WithProgress(updates))...)
	<-done
	if err != nil {
		if ctx.Err() != nil {
			return "", errdefs.Classify(ctx.Err())
		}
		return "", classifyRemote(ref, err)
	}
	progress.report("pushed", r.Context().String()+"@"+digest.String(), 0, 0)
	return digest.String(), nil
}

// ociImage is img as an OCI image whose layers are read from the store
// (each archived twice: once for its digests, once to send).
func (s *Store) ociImage(img *Image) (v1.Image, error) {
	out := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	for _, diff := range img.Layers {
		dir := s.LayerDir(diff)
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			pr, pw := io.Pipe()
			go func() { pw.CloseWithError(TarOverlayUpper(dir, pw, IDShift{})) }()
			return pr, nil
		}, tarball.WithMediaType(types.OCILayer))
		if err != nil {
			return nil, errdefs.Internal(err, "archive layer %s", shortID(diff))
		}
		if out, err = mutate.AppendLayers(out, l); err != nil {
			return nil, errdefs.Internal(err, "archive layer %s", shortID(diff))
		}
	}
	cf, err := out.ConfigFile()
	if err != nil {
		return nil, errdefs.Internal(err, "make the image config")
	}
	own, err := s.configFile(img)
	if err != nil {
		return nil, err
	}
	own.RootFS, own.History = cf.RootFS, cf.History
	out, err = mutate.ConfigFile(out, own)
	if err != nil {
		return nil, errdefs.Internal(err, "make the image config")
	}
	return out, nil
}

// configFile is img's OCI configuration (without its layers): platform,
// creation time, environment, user, working directory, entrypoint, cmd,
// labels and exposed ports.
func (s *Store) configFile(img *Image) (*v1.ConfigFile, error) {
	cf := &v1.ConfigFile{}
	cf.OS, cf.Architecture = hostPlatform.OS, hostPlatform.Architecture
	cf.Created = v1.Time{Time: img.Created}
	c := img.Config
	cf.Config.Env, cf.Config.WorkingDir, cf.Config.User = slices.Clone(c.Env), c.Workdir, c.User
	cf.Config.Entrypoint, cf.Config.Cmd = slices.Clone(c.Entrypoint), slices.Clone(c.Cmd)
	cf.Config.Labels = maps.Clone(c.Labels)
	if len(c.ExposedPorts) > 0 {
		cf.Config.ExposedPorts = map[string]struct{}{}
		for _, p := range c.ExposedPorts {
			cf.Config.ExposedPorts[p] = struct{}{}
		}
	}
	return cf, nil
}

// configOf is the part of an OCI config a sandbox uses.
func configOf(c v1.Config) Config {
	out := Config{Env: c.Env, Workdir: c.WorkingDir, User: c.User, Entrypoint: c.Entrypoint, Cmd: c.Cmd, Labels: c.Labels}
	for p := range c.ExposedPorts {
		if !strings.Contains(p, "/") {
			p += "/tcp"
		}
		out.ExposedPorts = append(out.ExposedPorts, p)
	}
	slices.Sort(out.ExposedPorts)
	return out
}
