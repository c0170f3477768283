package image

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image/blobfs"
	"github.com/opendsec/dsec/internal/tenant"
)

// needErofs skips where the host cannot keep layers as EROFS images; CI's
// hosts can (erofs-utils is installed, the kernel mounts images from
// files), so a skip there fails CI.
func needErofs(t *testing.T, s *Store) {
	t.Helper()
	if ok, why := s.Erofs(); !ok {
		t.Skip("layers are kept as directories on this host: ", why)
	}
}

// importLayer imports an image of one layer of entries as name.
func importLayer(t *testing.T, s *Store, name string, entries []entry) *Image {
	t.Helper()
	b := tarOf(t, entries)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Import(tenant.System(context.Background()), name, "test", img, nil)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// erofsMounted counts EROFS mounts in this process's mount table.
func erofsMounted(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, " - erofs ") {
			n++
		}
	}
	return n
}

func TestErofsLayers(t *testing.T) {
	needRoot(t)
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	needErofs(t, s)
	mountedBefore := erofsMounted(t)
	entries := []entry{
		{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		{name: "etc/.wh.removed"},
		{name: "opaque/", typ: tar.TypeDir, mode: 0o755},
		{name: "opaque/.wh..wh..opq"},
		{name: "bin/tool", body: "#!/bin/sh\necho tool\n", mode: 0o4755},
		{name: "bin/link", typ: tar.TypeSymlink, link: "tool"},
	}
	img := importLayer(t, s, "layered", entries)
	id := strings.TrimPrefix(img.Layers[0], "sha256:")

	t.Run("a layer is its EROFS files, read through its mount", func(t *testing.T) {
		for _, suf := range layerSuffixes {
			if _, err := os.Stat(filepath.Join(s.dir, "layers", id+suf)); err != nil {
				t.Fatalf("no %s file: %v", suf, err)
			}
		}
		// The blob's description covers the blob, chunk by chunk.
		var desc blobfs.Blob
		b, _ := os.ReadFile(filepath.Join(s.dir, "layers", id+".chunks"))
		if err := json.Unmarshal(b, &desc); err != nil {
			t.Fatal(err)
		}
		again, err := blobfs.Describe(filepath.Join(s.dir, "layers", id+".blob"), fetchChunk)
		if err != nil || !slices.Equal(again.Digest, desc.Digest) || again.Size != desc.Size || desc.Chunk != fetchChunk {
			t.Fatalf("the blob's description %+v, the blob's %+v (%v)", desc, again, err)
		}
		if _, err := os.Lstat(filepath.Join(s.dir, "layers", id)); !os.IsNotExist(err) {
			t.Fatalf("an unpacked directory beside the image: %v", err)
		}
		dir := s.LayerDir(img.Layers[0])
		if !strings.HasPrefix(dir, "/proc/self/fd/") {
			t.Fatalf("layer directory %q is not its image's mount", dir)
		}
		checkLayerTree(t, dir)
		if got := erofsMounted(t); got != mountedBefore {
			t.Fatalf("%d EROFS mounts in the mount table, %d before: the store's mounts must be detached", got, mountedBefore)
		}
	})

	t.Run("a reopened store mounts its images again", func(t *testing.T) {
		s2, err := Open(s.Dir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		defer s2.Close()
		release, err := s2.Hold(img.Layers)
		if err != nil {
			t.Fatal(err)
		}
		release()
		checkLayerTree(t, s2.LayerDir(img.Layers[0]))
	})

	t.Run("layers stored as directories keep working", func(t *testing.T) {
		dir := t.TempDir()
		old, err := Open(dir, slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		if err := old.UseLayers("dir"); err != nil { // a store from before EROFS layers
			t.Fatal(err)
		}
		legacy := importLayer(t, old, "legacy", entries)
		lid := strings.TrimPrefix(legacy.Layers[0], "sha256:")
		now, err := Open(dir, slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		defer now.Close()
		if got := now.LayerDir(legacy.Layers[0]); got != filepath.Join(dir, "layers", lid) {
			t.Fatalf("a layer stored as a directory is at %q", got)
		}
		checkLayerTree(t, now.LayerDir(legacy.Layers[0]))
		fresh := importLayer(t, now, "fresh", []entry{{name: "new.txt", body: "new"}})
		if !strings.HasPrefix(now.LayerDir(fresh.Layers[0]), "/proc/self/fd/") {
			t.Fatalf("a new layer in a store of directories is not an image")
		}
	})

	t.Run("a corrupt image is refused with the layer named", func(t *testing.T) {
		dir := t.TempDir()
		cs, err := Open(dir, slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		bad := importLayer(t, cs, "bad", []entry{{name: "x.txt", body: "x"}})
		bid := strings.TrimPrefix(bad.Layers[0], "sha256:")
		cs.Close()
		// The superblock (at 1 KiB) overwritten.
		f, err := os.OpenFile(cs.erofsFile(bid), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteAt(make([]byte, 1024), 1024)
		f.Close()
		_, err = cs.Hold(bad.Layers)
		if !errdefs.Is(err, errdefs.KindInternal) || !strings.Contains(err.Error(), shortID(bid)) {
			t.Fatalf("hold of a corrupt layer: %v, want an internal error naming %s", err, shortID(bid))
		}
	})

	t.Run("GC closes a layer's mount and removes its image", func(t *testing.T) {
		if err := s.Delete("layered"); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(s.erofsFile(id)); !os.IsNotExist(err) {
			t.Fatalf("image file kept: %v", err)
		}
		s.mountMu.Lock()
		_, mounted := s.mounts[id]
		s.mountMu.Unlock()
		if mounted {
			t.Fatal("the collected layer's mount is still open")
		}
		if _, err := s.Hold(img.Layers); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("hold of a collected layer: %v", err)
		}
	})
}

// checkLayerTree checks the layer of TestErofsLayers' entries at dir: its
// whiteout, opaque directory, setuid file and symlink.
func checkLayerTree(t *testing.T, dir string) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(dir, "etc/removed"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Fatalf("whiteout is not a 0:0 char device: %v mode %o rdev %d", err, st.Mode, st.Rdev)
	}
	buf := make([]byte, 8)
	n, err := unix.Getxattr(filepath.Join(dir, "opaque"), "trusted.overlay.opaque", buf)
	if err != nil || string(buf[:n]) != "y" {
		t.Fatalf("opaque dir xattr: %v %q", err, buf[:max(n, 0)])
	}
	if info, err := os.Stat(filepath.Join(dir, "bin/tool")); err != nil || info.Mode()&os.ModeSetuid == 0 {
		t.Fatalf("setuid file: %v, %v", info, err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "bin/link")); err != nil || string(b) != "#!/bin/sh\necho tool\n" {
		t.Fatalf("read through the symlink: %q, %v", b, err)
	}
}

// A store on a file system the kernel cannot mount EROFS images from
// (tmpfs) keeps its layers as directories and says why.
func TestAStoreOnTmpfsKeepsDirectories(t *testing.T) {
	needRoot(t)
	if _, why := erofsSupport(); why != "" {
		t.Skip("layers are kept as directories on this host: ", why)
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	s, err := Open(dir, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	ok, why := s.Erofs()
	if ok || !strings.Contains(why, "cannot mount an EROFS image from a file in "+dir) {
		t.Fatalf("a store on tmpfs: EROFS %v (%s)", ok, why)
	}
	img := importLayer(t, s, "on-tmpfs", []entry{{name: "a.txt", body: "a"}})
	if b, err := os.ReadFile(filepath.Join(s.LayerDir(img.Layers[0]), "a.txt")); err != nil || string(b) != "a" {
		t.Fatalf("a layer on tmpfs: %q, %v", b, err)
	}
	if err := s.UseLayers("erofs"); err == nil {
		t.Fatal("image_layers erofs accepted on a file system that cannot back EROFS images")
	}
}
