package image

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/erofs"
	"github.com/opendsec/dsec/internal/image/blobfs"
)

// File system layers as EROFS images.
//
// Where the host can (mkfs.erofs from erofs-utils, a kernel that mounts an
// EROFS image from a regular file), every file system layer the store
// takes in (imported, bootstrapped, a snapshot's captured layer) is kept
// as one read-only EROFS image, layers/<hex diff ID>.erofs: one file per
// layer instead of a tree of thousands, written once, read by the kernel
// as a file system.
//
// The store mounts each image it is asked for once, as a detached mount
// (fsopen, fsmount: in no mount table), and keeps the mount's descriptor;
// the layer's directory is then /proc/self/fd/<descriptor>, which this
// process resolves into the mount's root. Sandboxes clone that mount (the
// container driver's id-mapped lower layers) or name it as an overlay's
// lower directory, so every sandbox of a layer shares one superblock and
// one page cache. Nothing is left mounted on the host: a node that is
// killed leaves no mount behind, and the runtime's copy of the host's
// mount table does not grow with the number of layers.
//
// Only this process can use such a path: it is for the node's own
// mounts and reads, never for a child process (VM disk layers, whose files
// QEMU opens, stay directories). A layer's mount is closed only by GC,
// under the rules that keep a layer a sandbox or a call holds.
//
// Layers stored as directories (by a store from before, or on a host
// without EROFS) keep working: a layer is an image if its .erofs file is
// there, a directory otherwise.

// erofsSupport is whether this host can keep layers as EROFS images:
// mkfs is mkfs.erofs's path, "" with the reason in why.
var erofsSupport = sync.OnceValues(func() (mkfs, why string) {
	mkfs, err := exec.LookPath("mkfs.erofs")
	if err != nil {
		return "", "no mkfs.erofs (install erofs-utils)"
	}
	if why := probeErofs(mkfs, ""); why != "" {
		return "", why
	}
	return mkfs, ""
})

// erofsSupportIn is erofsSupport for layers stored in dir: the kernel
// mounts an EROFS image only from a file system that reads through the
// page cache's own paths (not tmpfs, for one). Probed once per file
// system.
func erofsSupportIn(dir string) (mkfs, why string) {
	if mkfs, why = erofsSupport(); why != "" {
		return "", why
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return "", err.Error()
	}
	if v, ok := probedFS.Load(st.Dev); ok {
		why = v.(string)
	} else {
		why = probeErofs(mkfs, dir)
		probedFS.Store(st.Dev, why)
	}
	if why != "" {
		return "", why
	}
	return mkfs, ""
}

// probedFS caches erofsSupportIn's answer by file system (device).
var probedFS sync.Map

// probeErofs makes a small EROFS image in a temporary directory under
// dir ("": the system's) and mounts it from there; "" if that works, else
// why not.
func probeErofs(mkfs, dir string) string {
	tmp, err := os.MkdirTemp(dir, "dsec-erofs-probe-")
	if err != nil {
		return err.Error()
	}
	defer os.RemoveAll(tmp)
	src := filepath.Join(tmp, "src")
	if err := os.Mkdir(src, 0o755); err != nil {
		return err.Error()
	}
	if err := os.WriteFile(filepath.Join(src, "probe"), []byte("erofs"), 0o644); err != nil {
		return err.Error()
	}
	img := filepath.Join(tmp, "probe.erofs")
	if err := erofs.Mkfs(mkfs, src, img); err != nil {
		return err.Error()
	}
	fd, err := erofs.Mount(img)
	if err != nil {
		where := "a file"
		if dir != "" {
			where = "a file in " + dir
		}
		return fmt.Sprintf("the kernel cannot mount an EROFS image from %s: %v", where, err)
	}
	defer unix.Close(fd)
	b, err := os.ReadFile(erofs.FdPath(fd) + "/probe")
	if err != nil || string(b) != "erofs" {
		return fmt.Sprintf("an EROFS image mounted from a file reads wrong: %q, %v", b, err)
	}
	return ""
}

// erofsFile is the EROFS image of layer id (hex diff ID).
func (s *Store) erofsFile(id string) string {
	return filepath.Join(s.dir, "layers", id+".erofs")
}

// Erofs says whether the store keeps new file system layers as EROFS
// images, and if not, why.
func (s *Store) Erofs() (bool, string) {
	if s.mkfs != "" {
		return true, ""
	}
	return false, s.noErofs
}

// layerRoot is the directory of layer id (hex diff ID): its image's
// mount, mounted if it is not yet, or its directory.
func (s *Store) layerRoot(id string) (string, error) {
	s.mountMu.Lock()
	defer s.mountMu.Unlock()
	if fd, ok := s.mounts[id]; ok {
		if c := s.mountedVia[id]; c == nil || !c.gone() {
			return erofs.FdPath(fd), nil
		}
		// Its data's server went away: mounted again through a new one,
		// the old mount closed once nothing holds the layer (a create
		// holding it may be opening its directory now).
		s.stale[id] = append(s.stale[id], fd)
		delete(s.mounts, id)
		delete(s.mountedVia, id)
	}
	file := s.erofsFile(id)
	if _, err := os.Stat(file); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return filepath.Join(s.dir, "layers", id), nil
		}
		return "", err
	}
	var devices []string
	var via *blobClient
	base := filepath.Join(s.dir, "layers", id)
	switch {
	case exists(base + ".blob"):
		devices = append(devices, base+".blob")
	case exists(base + ".lazy"):
		blob, c, err := s.lazyDevice(id)
		if err != nil {
			return "", fmt.Errorf("layer %s: its data: %w", shortID(id), err)
		}
		devices, via = append(devices, blob), c
	}
	fd, err := erofs.Mount(file, devices...)
	if err != nil {
		return "", fmt.Errorf("layer %s: %w", shortID(id), err)
	}
	s.mounts[id] = fd
	if via != nil {
		s.mountedVia[id] = via
	}
	return erofs.FdPath(fd), nil
}

// unmountLayer closes layer id's mount, if it has one (GC: nothing holds
// the layer).
func (s *Store) unmountLayer(id string) {
	s.mountMu.Lock()
	defer s.mountMu.Unlock()
	if fd, ok := s.mounts[id]; ok {
		unix.Close(fd)
		delete(s.mounts, id)
		delete(s.mountedVia, id)
	}
	for _, fd := range s.stale[id] {
		unix.Close(fd)
	}
	delete(s.stale, id)
}

// Close closes the layers' mounts (sandboxes' own mounts of them stay)
// and its connection to the blob server (which serves on while mounts
// read through it).
func (s *Store) Close() {
	s.mountMu.Lock()
	for id, fd := range s.mounts {
		unix.Close(fd)
		delete(s.mounts, id)
		delete(s.mountedVia, id)
	}
	for id, fds := range s.stale {
		for _, fd := range fds {
			unix.Close(fd)
		}
		delete(s.stale, id)
	}
	s.mountMu.Unlock()
	s.blobsMu.Lock()
	c := s.blobs
	s.blobs = nil
	s.blobsMu.Unlock()
	if c != nil {
		c.close()
	}
}

// dropLazy stops serving lazily loaded layer id and removes its cached
// chunks (GC).
func (s *Store) dropLazy(id string) {
	if c := s.connected(); c != nil && c.remove(id) == nil {
		return
	}
	os.Remove(filepath.Join(s.dir, "chunks", id))
	os.Remove(filepath.Join(s.dir, "chunks", id+".chunks"))
}

// A layer's EROFS files, stored beside each other as <hex diff ID> plus:
//
//	.erofs   the metadata image: the tree, owners, modes, attributes, and
//	         each file's data as 64 KiB chunks of the blob
//	.blob    the files' data, the image's device
//	.chunks  the blob's description (blobfs.Blob): size and each 256 KiB
//	         chunk's SHA-256, what another node checks when it loads the
//	         layer's data on demand from this one or from a registry
//
// (A layer stored before blobs existed is one .erofs image holding its
// data; it is mounted without a device.)
const (
	erofsChunk = 64 << 10  // mkfs.erofs --chunksize
	fetchChunk = 256 << 10 // the unit a blob's data is checked and fetched in
)

// layerSuffixes are a layer's EROFS files, in the order they are put in
// place: the metadata image, whose presence means "an image", last.
var layerSuffixes = []string{".blob", ".chunks", ".erofs"}

// setFile maps a layer file's suffix to its name in a set directory.
func setFile(dir, suffix string) string { return filepath.Join(dir, strings.TrimPrefix(suffix, ".")) }

// makeSet writes the EROFS files of the file system layer unpacked in src
// into set directory dir (blob, chunks, erofs and size) and returns the
// layer's size (its files' bytes).
func (s *Store) makeSet(src, dir string) (int64, error) {
	size, _ := dirSize(src)
	blob := setFile(dir, ".blob")
	if err := erofs.Mkfs(s.mkfs, src, setFile(dir, ".erofs"), fmt.Sprintf("--chunksize=%d", erofsChunk), "--blobdev="+blob); err != nil {
		return 0, err
	}
	desc, err := blobfs.Describe(blob, fetchChunk)
	if err != nil {
		return 0, fmt.Errorf("describe the layer's blob: %w", err)
	}
	b, _ := json.Marshal(desc)
	if err := os.WriteFile(setFile(dir, ".chunks"), b, 0o644); err != nil {
		return 0, err
	}
	return size, os.WriteFile(filepath.Join(dir, "size"), []byte(fmt.Sprint(size)), 0o644)
}

// makeErofs writes the EROFS files of the file system layer unpacked in
// tmp into set directory out and returns the layer's size, from cache (a
// host-wide set directory of the layer, made first if missing) when cache
// is not "": tmp is then read only if the cache lacks the set, and may be
// "".
func (s *Store) makeErofs(tmp, cache, out string) (int64, error) {
	if cache == "" {
		return s.makeSet(tmp, out)
	}
	size, err := cachedSize(cache)
	if err != nil {
		if tmp == "" {
			return 0, fmt.Errorf("no EROFS layer at %s: %w", cache, err)
		}
		// Made beside the cache's place and renamed into it whole: stores
		// on one host making it at once do not mix their files.
		mine, err := os.MkdirTemp(filepath.Dir(cache), filepath.Base(cache)+".*.tmp")
		if err != nil {
			return 0, err
		}
		defer os.RemoveAll(mine)
		if size, err = s.makeSet(tmp, mine); err != nil {
			return 0, err
		}
		if err := os.Rename(mine, cache); err != nil {
			if _, err2 := cachedSize(cache); err2 != nil {
				return 0, err // not another store's complete set either
			}
		}
	}
	for _, suf := range layerSuffixes {
		src, dst := setFile(cache, suf), setFile(out, suf)
		if err := os.Link(src, dst); err != nil {
			// Another file system: a copy.
			if err := copyTo(src, dst); err != nil {
				return 0, err
			}
		}
	}
	return size, nil
}

// cachedSize reads the size recorded in a host-wide set directory; a set
// without one is not complete.
func cachedSize(cache string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(cache, "size"))
	if err != nil {
		return 0, err
	}
	var n int64
	if _, err := fmt.Sscan(string(b), &n); err != nil {
		return 0, err
	}
	return n, nil
}

// exists says whether path names something.
func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// copyTo copies file src to dst (through a temporary file).
func copyTo(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	tmp := dst + ".tmp"
	err = writeFrom(tmp, in)
	if err == nil {
		err = os.Rename(tmp, dst)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// UseLayers sets how new file system layers are kept: "erofs" (an error
// if the host cannot), "dir", or "" and "auto": EROFS images where the
// host can. Layers already stored either way keep working.
func (s *Store) UseLayers(format string) error {
	mkfs, why := erofsSupportIn(filepath.Join(s.dir, "tmp"))
	switch format {
	case "", "auto":
		s.mkfs, s.noErofs = mkfs, why
	case "erofs":
		if mkfs == "" {
			return fmt.Errorf("image layers as EROFS images: %s", why)
		}
		s.mkfs, s.noErofs = mkfs, ""
	case "dir":
		s.mkfs, s.noErofs = "", "image_layers is dir"
	default:
		return fmt.Errorf("image layers %q: erofs, dir or auto", format)
	}
	if s.mkfs != "" {
		s.log.Info("image layers are kept as EROFS images")
	} else {
		s.log.Info("image layers are kept as directories", slog.String("reason", s.noErofs))
	}
	return nil
}
