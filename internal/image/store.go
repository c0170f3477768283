// Package image is a node's image store: OCI images imported from a
// registry, an OCI layout or a `docker save` archive, or bootstrapped
// offline, kept as content-addressed unpacked layers that every sandbox of
// an image shares read-only as overlayfs lower directories.
//
// Layout under the store's directory:
//
//	layers/<hex diff id>/   one unpacked layer (overlayfs whiteouts)
//	l/<short>               a short symlink to a layer, for mount options
//	refs/<hex of name>.json one image record
//	tmp/                    work in progress; cleared on open
package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Image is one stored image.
type Image struct {
	Name string `json:"name"`
	// Owner is the project that owns the image, or tenant.Shared for an
	// image every project sees (made by an operator or the server itself).
	// A project's own image shadows a shared one of the same name for it.
	Owner   string    `json:"owner,omitempty"`
	Digest  string    `json:"digest"`
	Layers  []string  `json:"layers"` // diff IDs, bottom first
	Size    int64     `json:"size"`
	Created time.Time `json:"created"`
	Source  string    `json:"source"`
	Config  Config    `json:"config"`
	// Snapshot is set when the image is a sandbox's snapshot.
	Snapshot *SnapshotMeta `json:"snapshot,omitempty"`
	// VM is set when the image is a bootable disk for kind vm (see
	// VMImage); its one layer holds the disk.
	VM *VMImage `json:"vm,omitempty"`
	// BuildCache is set on a build's cached step (its state after the
	// step): such records are no image of their own, listed nowhere, and
	// go with `dsec image prune`.
	BuildCache *BuildCacheMeta `json:"build_cache,omitempty"`
	// Copy is set on an image this node imported from another on demand
	// (ImportFromPeer): the node may remove it to make room (budget.go);
	// it is imported again when needed.
	Copy bool `json:"copy,omitempty"`
}

// BuildCacheMeta describes a cached build step.
type BuildCacheMeta struct {
	// Key is the step's cache key: its parent's, its instruction as
	// expanded, the environment and arguments it saw, and the digest of
	// the files it copied.
	Key string `json:"key"`
	// Step is the instruction, for `dsec image prune` to report.
	Step string `json:"step"`
}

// SnapshotMeta describes a snapshot image.
type SnapshotMeta struct {
	ID        string `json:"id"`
	Name      string `json:"name,omitempty"`
	SandboxID string `json:"sandbox_id"`
	Kind      string `json:"kind"`
	BaseImage string `json:"base_image"`
	// Size is the size of the snapshot's own layer.
	Size int64 `json:"size"`
	// Ephemeral snapshots exist to start a fork's children and are
	// deleted once no sandbox starts from them.
	Ephemeral bool `json:"ephemeral,omitempty"`
	// Machine snapshots (kinds with memory snapshots) hold memory, device
	// state and the writable disk in a directory the node keeps; the
	// record's Layers are the sandbox's image layers, and only sandboxes
	// of Kind start from it.
	Machine bool `json:"machine,omitempty"`
	// ForkKey is the idempotency key (as the node stores it) of the fork
	// an ephemeral snapshot was taken for: its repeat starts the children
	// it lacks from this snapshot while it exists.
	ForkKey string `json:"fork_key,omitempty"`
	// Sidecars are the snapshotted sandbox's sidecars, each captured as
	// layers of its own: a sandbox started from the snapshot gets them
	// back. Aliases are its main container's.
	Sidecars []SnapshotSidecar `json:"sidecars,omitempty"`
	Aliases  []string          `json:"aliases,omitempty"`
	// Shared are the sandbox's shared volumes (not their content: a
	// sandbox from the snapshot gets them empty) and SharedMounts its main
	// container's mounts of them.
	Shared       []SnapshotShared `json:"shared,omitempty"`
	SharedMounts []SnapshotMount  `json:"shared_mounts,omitempty"`
}

// SnapshotShared is a shared volume of a snapshotted sandbox.
type SnapshotShared struct {
	Name   string `json:"name"`
	SizeMB int64  `json:"size_mb"`
}

// SnapshotMount is a mount of a shared volume.
type SnapshotMount struct {
	Name     string `json:"name"`
	Path     string `json:"path"`
	ReadOnly bool   `json:"read_only,omitempty"`
}

// GetSnapshot is img's snapshot metadata: nil for a plain image, or no
// image.
func (img *Image) GetSnapshot() *SnapshotMeta {
	if img == nil {
		return nil
	}
	return img.Snapshot
}

// GetSidecars is m's sidecars (none for nil).
func (m *SnapshotMeta) GetSidecars() []SnapshotSidecar {
	if m == nil {
		return nil
	}
	return m.Sidecars
}

// SnapshotSidecar is one sidecar in a snapshot: its spec as the node
// keeps it (protojson of a dsecv1.Sidecar) and the image it starts from:
// its image's layers and its own captured layer, and its image's config.
type SnapshotSidecar struct {
	Name   string          `json:"name"`
	Spec   json.RawMessage `json:"spec"`
	Layers []string        `json:"layers"`
	Config Config          `json:"config"`
}

// Config is the part of an OCI image config a sandbox uses.
type Config struct {
	Env        []string `json:"env,omitempty"`
	Workdir    string   `json:"workdir,omitempty"`
	User       string   `json:"user,omitempty"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
	// PrivilegeEscalation lets a sandbox's processes gain privileges when
	// they execute a file (setuid and setgid binaries such as sudo, file
	// capabilities), up to what the sandbox's root holds: container
	// sandboxes of the image run without no_new_privs, but only where
	// they have a user namespace, whose root is no host root (see
	// substrate.Spec.PrivilegeEscalation). Only recipes set it (the "base"
	// recipe, for its user's sudo); imported images never have it, and a
	// snapshot keeps its image's.
	PrivilegeEscalation bool `json:"privilege_escalation,omitempty"`
	// Labels and ExposedPorts are a built image's LABELs and EXPOSEs.
	Labels       map[string]string `json:"labels,omitempty"`
	ExposedPorts []string          `json:"exposed_ports,omitempty"`
}

// Progress receives import progress. It may be nil.
type Progress func(phase, msg string, done, total int64)

func (p Progress) report(phase, msg string, done, total int64) {
	if p != nil {
		p(phase, msg, done, total)
	}
}

// Store is a node's image store. It is safe for concurrent use.
type Store struct {
	dir string
	log *slog.Logger

	// inUse reports layers held by live sandboxes; GC keeps them.
	inUse func() map[string]bool

	// layerMu orders what changes the layers directory: a layer's arrival
	// (commitLayer), holds on layers (Hold, AddLayer), records naming
	// them (put) and GC's choice and removal, so that GC never removes a
	// layer between its arrival or its lookup and its record or its
	// user's reservation. Order: layerMu, then mu (and inUse's locks).
	layerMu sync.Mutex
	held    map[string]int // layers (hex diff IDs) held by calls in flight

	unpackMu  sync.Mutex
	unpacking map[string]*sync.WaitGroup

	// noLinks makes bootstrapped layers always imported by tar (tests
	// compare the two ways).
	noLinks bool

	mu     sync.Mutex
	images map[string]*Image
	used   map[string]time.Time // each image's last lookup (budget.go)
	// budget is the layers' byte budget (SetBudget).
	budget int64

	// mkfs is mkfs.erofs when new file system layers are kept as EROFS
	// images (erofs.go); "" keeps them as directories, because of
	// noErofs.
	mkfs, noErofs string
	// mounts are the mounted layers' images: hex diff ID → detached
	// mount's descriptor.
	mountMu sync.Mutex
	mounts  map[string]int
	// mountedVia is, for a lazily loaded layer's mount, the blob server
	// connection its data is read through; stale are mounts whose server
	// went away, closed once nothing holds the layer (layerRoot).
	mountedVia map[string]*blobClient
	stale      map[string][]int

	// blobs is the connection to the blob server, which serves lazily
	// loaded layers' data (blobd.go, lazy.go), made on first use. lost
	// says, by hex diff ID, when such a layer's mounts made before lost
	// their server (see DataLost); opened is when the store opened.
	blobsMu sync.Mutex
	blobs   *blobClient
	lost    map[string]time.Time
	opened  time.Time
	// chunkBudget is the chunk cache's byte budget (SetChunkBudget).
	chunkBudget int64
	// sandboxDirs are where the node mounts sandboxes' (SetSandboxDirs).
	sandboxDirs []string
	// peers reaches other nodes' stores (SetPeers, peer.go).
	peersMu sync.Mutex
	peers   Peers
}

// Open opens (creating if needed) the store in dir.
func Open(dir string, log *slog.Logger) (*Store, error) {
	for _, d := range []string{"layers", "l", "refs", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			return nil, fmt.Errorf("create image store: %w", err)
		}
	}
	os.RemoveAll(filepath.Join(dir, "tmp"))
	os.MkdirAll(filepath.Join(dir, "tmp"), 0o700)
	s := &Store{dir: dir, log: log, images: map[string]*Image{}, used: map[string]time.Time{}, unpacking: map[string]*sync.WaitGroup{}, held: map[string]int{}, mounts: map[string]int{}, mountedVia: map[string]*blobClient{}, stale: map[string][]int{},
		lost: map[string]time.Time{}, opened: time.Now()}
	s.mkfs, s.noErofs = erofsSupportIn(filepath.Join(dir, "tmp")) // see UseLayers
	ents, err := os.ReadDir(filepath.Join(dir, "refs"))
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".tmp") {
			// A write a crash interrupted (writeFileAtomic): not a record.
			os.Remove(filepath.Join(dir, "refs", e.Name()))
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, "refs", e.Name()))
		if err != nil {
			continue
		}
		var img Image
		if err := json.Unmarshal(b, &img); err != nil {
			log.Warn("skipping unreadable image record", slog.String("file", e.Name()), slog.Any("error", err))
			continue
		}
		if img.Snapshot != nil && img.Owner == tenant.Shared {
			// A snapshot from before snapshots had owners: the default
			// project's, as every sandbox then was.
			img.Owner = tenant.DefaultProject
			if err := s.put(&img); err != nil {
				log.Warn("migrate snapshot record", slog.String("file", e.Name()), slog.Any("error", err))
				continue
			}
			os.Remove(filepath.Join(dir, "refs", e.Name()))
			continue
		}
		s.images[img.Key()] = &img
		s.used[img.Key()] = img.Created
	}
	return s, nil
}

// SetInUse installs the function GC asks for layers held by sandboxes.
func (s *Store) SetInUse(f func() map[string]bool) { s.inUse = f }

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

// normalize maps "name:latest" and "name" to one key.
func normalize(name string) string {
	return strings.TrimSuffix(name, ":latest")
}

// ValidName reports whether name can name an image.
func ValidName(name string) error {
	if name == "" || len(name) > 255 {
		return errdefs.Invalid("image name must be 1 to 255 characters")
	}
	for _, r := range name {
		if r < 0x21 || r > 0x7e {
			return errdefs.Invalid("image name %q has a character outside printable ASCII", name)
		}
	}
	return nil
}

// Key is the image's key in the store: its name for a shared image,
// "<owner> <name>" for a project's (tenant.ImageKey).
func (img *Image) Key() string { return tenant.ImageKey(img.Owner, img.Name) }

// Get returns the image with key (see Image.Key): a shared image by its
// name.
func (s *Store) Get(key string) (*Image, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if img, ok := s.images[normalize(key)]; ok {
		s.touch(img.Key())
		return img, nil
	}
	return nil, errdefs.NotFound("image %q not found (see `dsec image ls`)", key)
}

// Lookup returns the image named name as project owner sees it: its own
// image of that name, else the shared one. A shared owner sees only
// shared images.
func (s *Store) Lookup(owner, name string) (*Image, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	name = normalize(name)
	if owner != tenant.Shared {
		if img, ok := s.images[tenant.ImageKey(owner, name)]; ok {
			s.touch(img.Key())
			return img, nil
		}
	}
	if img, ok := s.images[name]; ok {
		s.touch(img.Key())
		return img, nil
	}
	return nil, errdefs.NotFound("image %q not found (see `dsec image ls`)", name)
}

// List returns all images sorted by name.
func (s *Store) List() []*Image {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Image, 0, len(s.images))
	for _, img := range s.images {
		out = append(out, img)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// LayerDir is the directory of a layer: its EROFS image's mount (a path
// only this process can use: see erofs.go) or its unpacked directory.
// Layers are mounted by Hold, which says why one cannot be; a layer that
// cannot be mounted here is logged and named by a path that does not
// exist.
func (s *Store) LayerDir(diffID string) string {
	id := strings.TrimPrefix(diffID, "sha256:")
	dir, err := s.layerRoot(id)
	if err != nil {
		s.log.Warn("image layer cannot be mounted", slog.String("layer", shortID(id)), slog.Any("error", err))
		return filepath.Join(s.dir, "layers", id)
	}
	return dir
}

// ShortLayerPath is a short path to a layer, for overlay mount options whose
// length the kernel limits to one page.
func (s *Store) ShortLayerPath(diffID string) string {
	if dir := s.LayerDir(diffID); strings.HasPrefix(dir, "/proc/self/fd/") {
		return dir
	}
	return filepath.Join(s.dir, "l", shortID(diffID))
}

// layerPath is where layer diffID is stored, without an extension: its
// directory, or beside its image, size marker and short link.
func (s *Store) layerPath(diffID string) string {
	return filepath.Join(s.dir, "layers", strings.TrimPrefix(diffID, "sha256:"))
}

func shortID(diffID string) string {
	h := strings.TrimPrefix(diffID, "sha256:")
	if len(h) > 12 {
		h = h[:12]
	}
	return h
}

// Import stores img under name, unpacking the layers the store lacks.
func (s *Store) Import(ctx context.Context, name, source string, img v1.Image, progress Progress) (*Image, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, errdefs.Invalid("read image config: %v", err)
	}
	digest, err := img.Digest()
	if err != nil {
		return nil, errdefs.Invalid("image digest: %v", err)
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, errdefs.Invalid("read image layers: %v", err)
	}
	if err := s.admit(); err != nil {
		return nil, err
	}
	defer s.fit()
	var total int64
	for _, l := range layers {
		if sz, err := l.Size(); err == nil {
			total += sz
		}
	}
	rec := &Image{Name: normalize(name), Owner: tenant.ImageOwner(ctx), Digest: digest.String(), Created: time.Now().UTC(), Source: source}
	var done int64
	var holds []func()
	defer func() {
		for _, release := range holds {
			release()
		}
	}()
	for i, l := range layers {
		if err := ctx.Err(); err != nil {
			return nil, errdefs.Classify(err)
		}
		diff, err := l.DiffID()
		if err != nil {
			return nil, errdefs.Invalid("layer %d diff id: %v", i, err)
		}
		sz, _ := l.Size()
		msg := fmt.Sprintf("layer %d/%d %s", i+1, len(layers), shortID(diff.String()))
		n, release, err := s.ensureLayer(diff.String(), func() (io.ReadCloser, error) { return l.Uncompressed() }, func(d int64) {
			progress.report("unpack", msg, done+min(d, sz), total)
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", msg, err)
		}
		holds = append(holds, release)
		done += sz
		rec.Size += n
		rec.Layers = append(rec.Layers, diff.String())
		progress.report("unpack", msg, done, total)
	}
	rec.Config = configOf(cfg.Config)
	if err := s.put(rec); err != nil {
		return nil, err
	}
	progress.report("done", rec.Name, total, total)
	return rec, nil
}

// EmptyLayer is the diff ID of a layer without entries (the tar
// TarOverlayUpper writes for an empty writable layer): a build step or a
// commit that changed no file adds no layer.
const EmptyLayer = "sha256:5f70bf18a086007016e948b04aed3b82103a36bea41755b6cddfaf10ace3c6ef"

// AddLayer stores a layer from an uncompressed tar stream (snapshots use
// it) and returns its diff ID, held (see Hold) until release is called:
// the caller puts the record naming it, then releases it.
func (s *Store) AddLayer(r io.Reader) (diff string, size int64, release func(), err error) {
	if err := s.admit(); err != nil {
		return "", 0, nil, err
	}
	defer s.fit()
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "layer-")
	if err != nil {
		return "", 0, nil, err
	}
	defer os.RemoveAll(tmp)
	diff, size, err = unpackLayer(r, tmp)
	if err != nil {
		return "", 0, nil, err
	}
	if release, err = s.commitLayer(diff, tmp, ""); err != nil {
		return "", 0, nil, err
	}
	return diff, size, release, nil
}

// Hold keeps layers in the store, whatever records name them, until
// release is called (once): a create holds its image's layers until its
// sandbox is reserved, so a delete of the image meanwhile (a fork's
// snapshot released) frees nothing it starts from. It fails with a
// not-found error if a layer is not in the store (its image deleted and
// collected before the hold). Safe for concurrent use.
func (s *Store) Hold(layers []string) (release func(), err error) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	for _, l := range layers {
		if _, ok := s.haveLayer(l); !ok {
			return nil, errdefs.NotFound("layer %s is not in the store", shortID(l))
		}
		if _, err := s.layerRoot(strings.TrimPrefix(l, "sha256:")); err != nil {
			return nil, errdefs.Internal(err, "mount image layer %s: %v", shortID(l), err)
		}
	}
	return s.holdLocked(layers), nil
}

// holdLocked holds layers; s.layerMu is held.
func (s *Store) holdLocked(layers []string) func() {
	for _, l := range layers {
		s.held[strings.TrimPrefix(l, "sha256:")]++
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			s.layerMu.Lock()
			defer s.layerMu.Unlock()
			for _, l := range layers {
				id := strings.TrimPrefix(l, "sha256:")
				if s.held[id]--; s.held[id] <= 0 {
					delete(s.held, id)
				}
			}
		})
	}
}

// ensureLayer unpacks a layer unless the store has it, and holds it (see
// Hold) until release is called. Concurrent imports of one layer unpack
// it once.
func (s *Store) ensureLayer(diffID string, open func() (io.ReadCloser, error), progress func(int64)) (int64, func(), error) {
	for {
		s.layerMu.Lock()
		if sz, ok := s.haveLayer(diffID); ok {
			release := s.holdLocked([]string{diffID})
			s.layerMu.Unlock()
			return sz, release, nil
		}
		s.layerMu.Unlock()
		s.unpackMu.Lock()
		if wg, busy := s.unpacking[diffID]; busy {
			s.unpackMu.Unlock()
			wg.Wait()
			continue
		}
		wg := new(sync.WaitGroup)
		wg.Add(1)
		s.unpacking[diffID] = wg
		s.unpackMu.Unlock()
		n, release, err := s.unpack(diffID, open, progress)
		s.unpackMu.Lock()
		delete(s.unpacking, diffID)
		s.unpackMu.Unlock()
		wg.Done()
		return n, release, err
	}
}

func (s *Store) haveLayer(diffID string) (int64, bool) {
	b, err := os.ReadFile(s.layerPath(diffID) + ".size")
	if err != nil {
		return 0, false
	}
	var n int64
	fmt.Sscan(string(b), &n)
	return n, true
}

func (s *Store) unpack(diffID string, open func() (io.ReadCloser, error), progress func(int64)) (int64, func(), error) {
	rc, err := open()
	if err != nil {
		return 0, nil, errdefs.Unavailable("open layer: %v", err).WithCause(err)
	}
	defer rc.Close()
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "layer-")
	if err != nil {
		return 0, nil, err
	}
	defer os.RemoveAll(tmp)
	got, size, err := unpackLayer(&countingReader{r: rc, report: progress}, tmp)
	if err != nil {
		return 0, nil, errdefs.Invalid("unpack layer: %v", err)
	}
	if got != diffID {
		return 0, nil, errdefs.Invalid("%v: got %s, want %s", errLayerDigest, got, diffID)
	}
	release, err := s.commitLayer(diffID, tmp, "")
	if err != nil {
		return 0, nil, err
	}
	return size, release, nil
}

// commitLayer stores the file system layer unpacked in tmp: as its EROFS
// image where the store keeps them (from cache, a host-wide copy of the
// image, when cache is not "": tmp is then read only if the copy is
// missing, and may be ""), as the directory itself otherwise. See
// commitDir.
func (s *Store) commitLayer(diffID, tmp, cache string) (release func(), err error) {
	if s.mkfs == "" {
		return s.commitDir(diffID, tmp)
	}
	if release, ok := s.holdIfPresent(diffID); ok {
		return release, nil
	}
	// The files are made outside the lock (a large layer takes seconds;
	// creates hold layers meanwhile), then renamed into place under it.
	out, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "set-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(out)
	size, err := s.makeErofs(tmp, cache, out)
	if err != nil {
		return nil, fmt.Errorf("store layer: %w", err)
	}
	return s.placeLayer(diffID, out, layerSuffixes, size)
}

// placeLayer moves layer diffID's files (suffixes, in order: the metadata
// image last) from set directory out into the store, then its size marker
// (which means "complete"), unless the store has the layer meanwhile, and
// holds it.
func (s *Store) placeLayer(diffID, out string, suffixes []string, size int64) (func(), error) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	if _, ok := s.haveLayer(diffID); ok {
		return s.holdLocked([]string{diffID}), nil
	}
	os.RemoveAll(s.layerPath(diffID)) // a directory of an interrupted commit
	for _, suf := range suffixes {
		if err := os.Rename(setFile(out, suf), s.layerPath(diffID)+suf); err != nil {
			return nil, fmt.Errorf("store layer: %w", err)
		}
	}
	if err := writeFileAtomic(s.layerPath(diffID)+".size", []byte(fmt.Sprint(size))); err != nil {
		return nil, err
	}
	return s.holdLocked([]string{diffID}), nil
}

// holdIfPresent holds layer diffID if the store has it.
func (s *Store) holdIfPresent(diffID string) (func(), bool) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	if _, ok := s.haveLayer(diffID); ok {
		return s.holdLocked([]string{diffID}), true
	}
	return nil, false
}

// commitDir moves an unpacked layer into place as a directory, with its
// short link and size marker (the marker is written last and means
// "complete"), unless the store has it, and holds it (see Hold) until
// release is called. VM disk layers are directories (QEMU opens their
// files), as are file system layers on a host without EROFS.
func (s *Store) commitDir(diffID, tmp string) (release func(), err error) {
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	if _, ok := s.haveLayer(diffID); ok {
		return s.holdLocked([]string{diffID}), nil
	}
	dst := s.layerPath(diffID)
	os.RemoveAll(dst)
	if err := os.Rename(tmp, dst); err != nil {
		return nil, fmt.Errorf("store layer: %w", err)
	}
	if err := os.Chmod(dst, 0o755); err != nil {
		return nil, err
	}
	link := filepath.Join(s.dir, "l", shortID(diffID))
	os.Remove(link)
	if err := os.Symlink(filepath.Join("..", "layers", strings.TrimPrefix(diffID, "sha256:")), link); err != nil {
		return nil, fmt.Errorf("link layer: %w", err)
	}
	size, _ := dirSize(dst)
	if err := writeFileAtomic(dst+".size", []byte(fmt.Sprint(size))); err != nil {
		return nil, err
	}
	return s.holdLocked([]string{diffID}), nil
}

// put writes a record. Its layers must be held (or named by another
// record) until it returns.
func (s *Store) put(img *Image) error {
	b, err := json.MarshalIndent(img, "", "  ")
	if err != nil {
		return err
	}
	if err := writeFileAtomic(s.refPath(img.Key()), b); err != nil {
		return fmt.Errorf("write image record: %w", err)
	}
	s.mu.Lock()
	s.images[img.Key()] = img
	s.touch(img.Key())
	s.mu.Unlock()
	return nil
}

// Put stores a record whose layers are already in the store (snapshots),
// under img.Owner.
func (s *Store) Put(img *Image) error {
	if err := ValidName(img.Name); err != nil {
		return err
	}
	release, err := s.Hold(img.Layers)
	if err != nil {
		return err
	}
	defer release()
	img.Name = normalize(img.Name)
	return s.put(img)
}

func (s *Store) refPath(key string) string {
	h := sha256.Sum256([]byte(key))
	return filepath.Join(s.dir, "refs", hex.EncodeToString(h[:16])+".json")
}

// Delete removes the image with key (see Image.Key) and frees layers
// nothing else uses.
func (s *Store) Delete(key string) error {
	s.mu.Lock()
	img, ok := s.images[normalize(key)]
	if ok {
		delete(s.images, img.Key())
		delete(s.used, img.Key())
	}
	s.mu.Unlock()
	if !ok {
		return errdefs.NotFound("image %q not found", key)
	}
	if err := os.Remove(s.refPath(img.Key())); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	s.GC()
	return nil
}

// GC removes layers that no image references, no sandbox uses and no
// call holds (see Hold). Its choice and the layers' unlinking are atomic
// with respect to layers arriving, holds and records being put; the
// removed files are deleted after.
func (s *Store) GC() {
	var doomed []string
	defer func() {
		for _, d := range doomed {
			os.RemoveAll(d)
		}
	}()
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	keep := s.busyLayers()
	s.mu.Lock()
	for _, img := range s.images {
		for _, id := range recordLayers(img) {
			keep[id] = true
		}
	}
	s.mu.Unlock()
	for id := range s.storedLayers() {
		if keep[id] {
			continue
		}
		if s.isUnpacking("sha256:" + id) {
			continue
		}
		os.Remove(filepath.Join(s.dir, "layers", id+".size"))
		os.Remove(filepath.Join(s.dir, "l", shortID(id)))
		// An image: its mount closed (nothing holds the layer; the
		// sandboxes' clones of it are their own), the file removed.
		s.unmountLayer(id)
		for _, suf := range layerSuffixes {
			os.Remove(filepath.Join(s.dir, "layers", id+suf))
		}
		if os.Remove(filepath.Join(s.dir, "layers", id+".lazy")) == nil {
			s.dropLazy(id)
		}
		// Out of the way at once (a rename), deleted after the lock.
		dir := filepath.Join(s.dir, "layers", id)
		if _, err := os.Lstat(dir); err != nil {
			continue
		}
		trash, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "gc-")
		if err != nil || os.Rename(dir, filepath.Join(trash, id)) != nil {
			os.RemoveAll(dir)
		}
		if err == nil {
			doomed = append(doomed, trash)
		}
	}
}

// busyLayers are the layers (hex diff IDs) sandboxes use or calls hold.
// s.layerMu is held.
func (s *Store) busyLayers() map[string]bool {
	busy := map[string]bool{}
	if s.inUse != nil {
		for l := range s.inUse() {
			busy[strings.TrimPrefix(l, "sha256:")] = true
		}
	}
	for id := range s.held {
		busy[id] = true
	}
	return busy
}

func (s *Store) isUnpacking(diffID string) bool {
	s.unpackMu.Lock()
	defer s.unpackMu.Unlock()
	_, ok := s.unpacking[diffID]
	return ok
}

type countingReader struct {
	r      io.Reader
	n      int64
	report func(int64)
	last   time.Time
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if c.report != nil && time.Since(c.last) > 200*time.Millisecond {
		c.last = time.Now()
		c.report(c.n)
	}
	return n, err
}

// writeFileAtomic writes b to path (mode 0600) by a file of its own
// renamed into place: a reader sees the old content or the new, and
// writers at once (stores on one host writing beside a cached build) do
// not write into one another's.
// writeFrom writes what r reads to a new (or truncated) file at path.
func writeFrom(path string, r io.Reader) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func writeFileAtomic(path string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}

func dirSize(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n, err
}
