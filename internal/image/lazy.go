package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image/blobfs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Images loaded on demand.
//
// PushLazy writes an image to a registry as its layers' EROFS files: for
// each layer, its metadata image, its blob's description and its blob,
// three manifest layers of dsec's own media types, annotated with the
// layer's diff ID and size, under an OCI config like Push's. A node that
// pulls such an image fetches only the metadata images and descriptions
// (a few percent of the image); each layer's blob stays in the registry
// and its chunks are read by range, checked against their digests and
// cached as sandboxes touch them (blobfs). The layers keep their diff
// IDs, so a lazily pulled layer is the same layer as the one pushed, on
// every node.
//
// A lazily loaded layer's data is served by the blob server (blobd.go), a
// process apart from the node's: a sandbox keeps reading its image's data
// while its node restarts.

// Media types and annotations of a lazily loaded image's manifest.
const (
	MediaLayerMeta   types.MediaType = "application/vnd.dsec.layer.erofs.v1"
	MediaLayerChunks types.MediaType = "application/vnd.dsec.layer.chunks.v1+json"
	MediaLayerBlob   types.MediaType = "application/vnd.dsec.layer.blob.v1"

	annotLayer = "org.opendsec.dsec.layer" // the layer's diff ID
	annotSize  = "org.opendsec.dsec.size"  // the layer's files' bytes
)

// fileLayer is a file as a manifest layer, stored as it is (no
// compression): a range of the registry's blob is a range of the file.
type fileLayer struct {
	path   string
	mt     types.MediaType
	digest v1.Hash
	size   int64
}

func newFileLayer(path string, mt types.MediaType) (*fileLayer, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return nil, err
	}
	return &fileLayer{path: path, mt: mt, size: n, digest: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}}, nil
}

func (l *fileLayer) Digest() (v1.Hash, error)             { return l.digest, nil }
func (l *fileLayer) DiffID() (v1.Hash, error)             { return l.digest, nil }
func (l *fileLayer) Compressed() (io.ReadCloser, error)   { return os.Open(l.path) }
func (l *fileLayer) Uncompressed() (io.ReadCloser, error) { return os.Open(l.path) }
func (l *fileLayer) Size() (int64, error)                 { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error)  { return l.mt, nil }

// PushLazy writes img to a registry at ref as its layers' EROFS files
// (see above) and returns the manifest's digest. Every layer must be
// stored as EROFS files with a blob (a layer stored as a directory is
// invalid here: Push it).
func (s *Store) PushLazy(ctx context.Context, img *Image, ref string, auth Auth, insecure bool, progress Progress) (string, error) {
	r, ropts, release, err := s.pushable(ctx, img, ref, auth, insecure)
	if err != nil {
		return "", err
	}
	defer release()
	out, err := s.lazyImage(img)
	if err != nil {
		return "", err
	}
	return s.write(ctx, r, ref, out, ropts, progress)
}

// lazyImage is img as an OCI image of its layers' EROFS files (see
// above), which must be held.
func (s *Store) lazyImage(img *Image) (v1.Image, error) {
	out := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	var diffs []v1.Hash
	for _, diff := range img.Layers {
		base := s.layerPath(diff)
		switch {
		case exists(base+".lazy") && !exists(base+".blob"):
			return nil, errdefs.Invalid("layer %s of %s is loaded on demand here: its data is in its registry (push it as an OCI image to copy it whole)", shortID(diff), img.Name)
		case !exists(base+".blob") || !exists(base+".chunks"):
			return nil, errdefs.Invalid("layer %s of %s is not stored as EROFS files with a blob: push it as an OCI image", shortID(diff), img.Name)
		}
		size, _ := s.haveLayer(diff)
		ann := map[string]string{annotLayer: diff, annotSize: strconv.FormatInt(size, 10)}
		for _, part := range []struct {
			suffix string
			mt     types.MediaType
		}{{".erofs", MediaLayerMeta}, {".chunks", MediaLayerChunks}, {".blob", MediaLayerBlob}} {
			l, err := newFileLayer(base+part.suffix, part.mt)
			if err != nil {
				return nil, errdefs.Internal(err, "read layer %s", shortID(diff))
			}
			if out, err = mutate.Append(out, mutate.Addendum{Layer: l, MediaType: part.mt, Annotations: ann}); err != nil {
				return nil, errdefs.Internal(err, "add layer %s", shortID(diff))
			}
		}
		h, err := v1.NewHash(diff)
		if err != nil {
			return nil, errdefs.Internal(err, "layer %s", diff)
		}
		diffs = append(diffs, h)
	}
	cf, err := s.configFile(img)
	if err != nil {
		return nil, err
	}
	cf.RootFS = v1.RootFS{Type: "layers", DiffIDs: diffs}
	cf.History = nil
	if out, err = mutate.ConfigFile(out, cf); err != nil {
		return nil, errdefs.Internal(err, "make the image config")
	}
	return out, nil
}

// lazyManifest reports whether m is an image of layers' EROFS files.
func lazyManifest(m *v1.Manifest) bool {
	for _, l := range m.Layers {
		if l.MediaType == MediaLayerMeta {
			return true
		}
	}
	return false
}

// lazySource is where a lazily loaded layer's blob is read: a registry's
// blob, and how to reach it (<diff>.lazy, 0600: it may hold the
// registry's credentials, which a read after a node restart needs);
// another node's (Peer, URL: see ImportFromPeer), reached as the store's
// Peers say; or a URL on an HTTP server (URL, with Auth: see PullURL).
type lazySource struct {
	Registry string `json:"registry,omitempty"`
	Repo     string `json:"repository,omitempty"`
	Digest   string `json:"digest,omitempty"`
	Insecure bool   `json:"insecure,omitempty"`
	Auth     Auth   `json:"auth,omitzero"`
	Peer     string `json:"peer,omitempty"`
	URL      string `json:"url,omitempty"`
}

// source is the blobfs source of ls, reaching other nodes as peers says.
func (ls lazySource) source(peers func() Peers) (blobfs.Source, error) {
	if ls.Peer != "" {
		return peerSource{access: peers, url: ls.URL}, nil
	}
	if ls.URL != "" {
		return blobfs.HTTPSource{URL: ls.URL, Header: ls.Auth.header(), Client: &http.Client{Timeout: 2 * time.Minute}}, nil
	}
	var opts []name.Option
	if ls.Insecure {
		opts = append(opts, name.Insecure)
	}
	repo, err := name.NewRepository(ls.Registry+"/"+ls.Repo, opts...)
	if err != nil {
		return nil, err
	}
	var auth authn.Authenticator
	if ls.Auth != (Auth{}) {
		auth = authn.FromConfig(authn.AuthConfig{Username: ls.Auth.Username, Password: ls.Auth.Password, IdentityToken: ls.Auth.IdentityToken, RegistryToken: ls.Auth.RegistryToken})
	} else if auth, err = authn.DefaultKeychain.Resolve(repo.Registry); err != nil {
		return nil, err
	}
	rt, err := transport.NewWithContext(context.Background(), repo.Registry, auth, http.DefaultTransport, []string{repo.Scope(transport.PullScope)})
	if err != nil {
		return nil, err
	}
	url := fmt.Sprintf("%s://%s/v2/%s/blobs/%s", repo.Registry.Scheme(), repo.RegistryStr(), repo.RepositoryStr(), ls.Digest)
	return blobfs.HTTPSource{URL: url, Client: &http.Client{Transport: rt, Timeout: 2 * time.Minute}}, nil
}

// pullLazy imports img, an image of layers' EROFS files from where (a
// registry reference or a URL), as name: each layer's metadata image and
// blob description are fetched, its blob left where it is, to be read on
// demand from the source srcOf says.
func (s *Store) pullLazy(ctx context.Context, as, source, where string, img v1.Image, m *v1.Manifest, srcOf func(blob *v1.Descriptor) lazySource, progress Progress) (*Image, error) {
	if err := ValidName(as); err != nil {
		return nil, err
	}
	if _, why := erofsSupportIn(filepath.Join(s.dir, "tmp")); why != "" {
		return nil, errdefs.Unimplemented("%s is an image loaded on demand, which this node cannot mount: %s", where, why)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, errdefs.Invalid("read image config: %v", err)
	}
	digest, err := img.Digest()
	if err != nil {
		return nil, errdefs.Invalid("image digest: %v", err)
	}
	type parts struct {
		meta, chunks, blob *v1.Descriptor
		size               int64
	}
	byDiff := map[string]*parts{}
	for i := range m.Layers {
		d := &m.Layers[i]
		diff := d.Annotations[annotLayer]
		p := byDiff[diff]
		if p == nil {
			p = &parts{}
			byDiff[diff] = p
		}
		p.size, _ = strconv.ParseInt(d.Annotations[annotSize], 10, 64)
		switch d.MediaType {
		case MediaLayerMeta:
			p.meta = d
		case MediaLayerChunks:
			p.chunks = d
		case MediaLayerBlob:
			p.blob = d
		}
	}
	rec := &Image{Name: normalize(as), Owner: tenant.ImageOwner(ctx), Digest: digest.String(), Created: time.Now().UTC(), Source: source}
	var holds []func()
	defer func() {
		for _, release := range holds {
			release()
		}
	}()
	for i, h := range cfg.RootFS.DiffIDs {
		diff := h.String()
		p := byDiff[diff]
		if p == nil || p.meta == nil || p.chunks == nil || p.blob == nil {
			return nil, errdefs.Invalid("image %s: layer %s lacks its EROFS files", where, shortID(diff))
		}
		progress.report("fetch", fmt.Sprintf("layer %d/%d %s metadata", i+1, len(cfg.RootFS.DiffIDs), shortID(diff)), int64(i), int64(len(cfg.RootFS.DiffIDs)))
		release, err := s.fetchLazyLayer(ctx, img, diff, p.meta, p.chunks, p.blob, p.size, srcOf(p.blob))
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", shortID(diff), err)
		}
		holds = append(holds, release)
		rec.Layers = append(rec.Layers, diff)
		rec.Size += p.size
	}
	rec.Config = configOf(cfg.Config)
	if err := s.put(rec); err != nil {
		return nil, err
	}
	progress.report("done", rec.Name, 0, 0)
	return rec, nil
}

// fetchLazyLayer stores layer diff from img unless the store has it: its
// metadata image and blob description fetched (digests checked by the
// registry client), its blob to be read from src. It holds the layer.
func (s *Store) fetchLazyLayer(ctx context.Context, img v1.Image, diff string, meta, chunks, blob *v1.Descriptor, size int64, src lazySource) (func(), error) {
	if release, ok := s.holdIfPresent(diff); ok {
		return release, nil
	}
	out, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "lazy-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(out)
	for _, part := range []struct {
		d    *v1.Descriptor
		file string
	}{{meta, ".erofs"}, {chunks, ".chunks"}} {
		if err := fetchBlob(ctx, img, part.d, setFile(out, part.file)); err != nil {
			return nil, err
		}
	}
	var desc blobfs.Blob
	b, err := os.ReadFile(setFile(out, ".chunks"))
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, &desc); err != nil || desc.Size != blob.Size {
		return nil, errdefs.Invalid("the blob's description does not match the blob (%d bytes described, %d in the registry): %v", desc.Size, blob.Size, err)
	}
	rb, _ := json.Marshal(src)
	if err := os.WriteFile(setFile(out, ".lazy"), rb, 0o600); err != nil {
		return nil, err
	}
	return s.placeLayer(diff, out, []string{".chunks", ".lazy", ".erofs"}, size)
}

// fetchBlob writes manifest layer d of img to path; the registry client
// checks its digest as it reads.
func fetchBlob(ctx context.Context, img v1.Image, d *v1.Descriptor, path string) error {
	l, err := img.LayerByDigest(d.Digest)
	if err != nil {
		return errdefs.Unavailable("fetch %s: %v", d.Digest, err).WithCause(err)
	}
	rc, err := l.Compressed()
	if err != nil {
		return errdefs.Unavailable("fetch %s: %v", d.Digest, err).WithCause(err)
	}
	defer rc.Close()
	if err := writeFrom(path, rc); err != nil {
		var e *errdefs.Error
		if errors.As(err, &e) {
			return err // the source's own verdict (a digest that does not match: invalid)
		}
		return errdefs.Unavailable("fetch %s: %v", d.Digest, err).WithCause(err)
	}
	return nil
}

// lazyDevice serves layer id's blob from its source (<id>.lazy) and
// returns the blob file's path, the layer's device, and the blob server
// connection it is read through.
func (s *Store) lazyDevice(id string) (string, *blobClient, error) {
	base := filepath.Join(s.dir, "layers", id)
	raw, err := os.ReadFile(base + ".lazy")
	if err != nil {
		return "", nil, err
	}
	var ls lazySource
	if err := json.Unmarshal(raw, &ls); err != nil {
		return "", nil, fmt.Errorf("the layer's source: %w", err)
	}
	var desc blobfs.Blob
	b, err := os.ReadFile(base + ".chunks")
	if err != nil {
		return "", nil, err
	}
	if err := json.Unmarshal(b, &desc); err != nil {
		return "", nil, fmt.Errorf("the layer's blob description: %w", err)
	}
	c, err := s.blobServer()
	if err != nil {
		return "", nil, err
	}
	path, err := c.add(id, desc, ls)
	return path, c, err
}

// blobServer is the store's connection to its blob server, which it
// starts if none runs (blobd.go). When the server goes away (killed), the
// layers it served are lost to the sandboxes that mounted them before
// (see DataLost), the layers' mounts are made again (layerRoot), and the
// next mount starts a new server.
func (s *Store) blobServer() (*blobClient, error) {
	if c := s.connected(); c != nil {
		return c, nil
	}
	s.blobsMu.Lock()
	defer s.blobsMu.Unlock()
	if s.blobs != nil {
		return s.blobs, nil
	}
	budget := s.chunkBudget
	if budget == 0 {
		budget = defaultChunkBudget(s.dir)
	}
	detach := s.sandboxDirs
	if detach == nil {
		detach = []string{filepath.Dir(s.dir)}
	}
	c, err := connectBlobd(s.dir, budget, detach, s.log)
	if err != nil {
		return nil, err
	}
	served, err := c.stats()
	if err != nil {
		c.close()
		return nil, err
	}
	// A layer of this store the server does not serve was served, if by
	// anything, by something gone before this store opened: sandboxes
	// that mounted it before then read through a lost connection.
	for _, id := range s.lazyLayers() {
		if _, ok := served[id]; !ok && s.lost[id].Before(s.opened) {
			s.lost[id] = s.opened
		}
	}
	s.peersMu.Lock()
	h := s.peers.Header
	s.peersMu.Unlock()
	if h != nil {
		if err := c.setPeers(h); err != nil {
			c.close()
			return nil, err
		}
	}
	s.blobs = c
	go s.watchBlobServer(c)
	return c, nil
}

// connected is the store's blob server connection, if it has one whose
// server is there.
func (s *Store) connected() *blobClient {
	s.blobsMu.Lock()
	defer s.blobsMu.Unlock()
	if s.blobs != nil && s.blobs.gone() {
		s.forget(s.blobs)
	}
	return s.blobs
}

// watchBlobServer keeps the blob server's pinned set (the lazily loaded
// layers sandboxes use) current while c's session lasts, and forgets the
// server when it goes away.
func (s *Store) watchBlobServer(c *blobClient) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	last := []string{""} // none sent yet: the first tick sends
	for {
		select {
		case <-tick.C:
			pins := s.pinnedLazy()
			if !slices.Equal(pins, last) && c.setPinned(pins) == nil {
				last = pins
			}
		case <-c.done:
			s.blobsMu.Lock()
			s.forget(c)
			s.blobsMu.Unlock()
			return
		}
	}
}

// forget drops connection c, whose session ended, unless Close did: the
// lazily loaded layers are lost to what mounted them before now. Its
// caller holds blobsMu.
func (s *Store) forget(c *blobClient) {
	if s.blobs != c { // closed, or forgotten already
		return
	}
	s.blobs = nil
	now := time.Now()
	for _, id := range s.lazyLayers() {
		s.lost[id] = now
	}
	s.log.Error("the blob server went away: sandboxes started from layers loaded on demand before now cannot read their data not yet cached; new ones start a new server")
}

// lazyLayers lists the layers (hex diff IDs) loaded on demand here.
func (s *Store) lazyLayers() []string {
	ents, _ := os.ReadDir(filepath.Join(s.dir, "layers"))
	var out []string
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".lazy"); ok {
			out = append(out, id)
		}
	}
	return out
}

// pinnedLazy lists the lazily loaded layers (hex diff IDs) running
// sandboxes use, sorted.
func (s *Store) pinnedLazy() []string {
	if s.inUse == nil {
		return nil
	}
	var out []string
	for l := range s.inUse() {
		id := strings.TrimPrefix(l, "sha256:")
		if exists(filepath.Join(s.dir, "layers", id+".lazy")) {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// DataLost says whether a sandbox created at created from layers (diff
// IDs) mounted a layer loaded on demand through a blob server that has
// gone since (killed, or gone with its host): its reads of data not in
// the page cache fail, its failures may be the platform's.
func (s *Store) DataLost(layers []string, created time.Time) bool {
	if !s.LoadsOnDemand(layers) {
		return false
	}
	if _, err := s.blobServer(); err != nil {
		return true
	}
	s.blobsMu.Lock()
	defer s.blobsMu.Unlock()
	for _, l := range layers {
		if s.lost[strings.TrimPrefix(l, "sha256:")].After(created) {
			return true
		}
	}
	return false
}

// OnDemand reports, for an image some of whose layers are loaded on
// demand, their data's size and how much of it the chunk cache holds.
func (s *Store) OnDemand(img *Image) (data, cached int64, ok bool) {
	for _, diff := range img.Layers {
		base := s.layerPath(diff)
		if !exists(base + ".lazy") {
			continue
		}
		var desc blobfs.Blob
		b, err := os.ReadFile(base + ".chunks")
		if err != nil || json.Unmarshal(b, &desc) != nil {
			continue
		}
		ok = true
		data += desc.Size
		cached += blobfs.CachedBytes(filepath.Join(s.dir, "chunks"), strings.TrimPrefix(diff, "sha256:"), desc)
	}
	return data, cached, ok
}

// SetSandboxDirs names the directories under which the node mounts
// sandboxes' file systems, disks and namespaces (its data and run
// directories; default: the store's parent): the blob server detaches
// them from its copy of the node's mount namespace.
func (s *Store) SetSandboxDirs(dirs ...string) { s.sandboxDirs = dirs }

// SetChunkBudget sets the byte budget of the cache of lazily loaded
// layers' chunks (0: a quarter of the file system the store is on), for
// the blob server this store starts.
func (s *Store) SetChunkBudget(bytes int64) { s.chunkBudget = bytes }

// defaultChunkBudget is a quarter of the file system dir is on.
func defaultChunkBudget(dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0
	}
	return int64(st.Blocks) * st.Bsize / 4
}

// ChunkCache reports the cache of lazily loaded layers' chunks (zero
// before the first such layer is read).
func (s *Store) ChunkCache() blobfs.CacheStats {
	c := s.connected()
	if c == nil {
		return blobfs.CacheStats{}
	}
	st, _ := c.cache()
	return st
}

// LazyStats reports how much of each lazily loaded layer the node holds,
// by diff ID; layers whose data has not been read since the blob server
// started are not listed.
func (s *Store) LazyStats() map[string]blobfs.Stats {
	out := map[string]blobfs.Stats{}
	c := s.connected()
	if c == nil {
		return out
	}
	st, _ := c.stats()
	for id, v := range st {
		out["sha256:"+id] = v
	}
	return out
}

// LoadsOnDemand says whether any of layers (diff IDs) is loaded on demand
// here.
func (s *Store) LoadsOnDemand(layers []string) bool {
	for _, l := range layers {
		if exists(s.layerPath(l) + ".lazy") {
			return true
		}
	}
	return false
}

// LoadFailures counts the failed fetches of the data of layers (diff IDs)
// loaded on demand since the blob server started: a read that failed with
// EIO because the source did not answer or answered wrong. Layers held
// whole count nothing; it asks the blob server, so callers ask only for
// layers that LoadsOnDemand.
func (s *Store) LoadFailures(layers []string) int64 {
	c := s.connected()
	if c == nil {
		return 0
	}
	st, err := c.stats()
	if err != nil {
		return 0
	}
	var n int64
	for _, l := range layers {
		n += st[strings.TrimPrefix(l, "sha256:")].Failed
	}
	return n
}

// detachStale unmounts whatever is mounted at mnt (a blob file system a
// killed server left in a mount namespace that outlived it).
func detachStale(mnt string) {
	for unix.Unmount(mnt, unix.MNT_DETACH) == nil {
	}
}
