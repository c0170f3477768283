package image

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (layer unpacking creates devices and sets owners)")
	}
}

type entry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func tarOf(t *testing.T, entries []entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: mode, Linkname: e.link, Size: int64(len(e.body))}
		if e.typ == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	return buf.Bytes()
}

func TestUnpackStaysInsideTheLayer(t *testing.T) {
	needRoot(t)
	outside := t.TempDir()
	tests := []struct {
		name    string
		entries []entry
	}{
		{"dot-dot names stay inside", []entry{{name: "../../escape", body: "x"}}},
		{"absolute names stay inside", []entry{{name: outside + "/abs", body: "x"}}},
		{"a planted absolute symlink is not followed", []entry{
			{name: "evil", typ: tar.TypeSymlink, link: outside},
			{name: "evil/through-link", body: "x"},
		}},
		{"a planted relative symlink is not followed out", []entry{
			{name: "rel", typ: tar.TypeSymlink, link: "../../../../../../" + outside},
			{name: "rel/through-rel", body: "x"},
		}},
		{"a hard link to an outside file is resolved inside", []entry{
			{name: "hl", typ: tar.TypeLink, link: outside + "/victim"},
		}},
	}
	os.WriteFile(filepath.Join(outside, "victim"), []byte("v"), 0o644)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			unpackLayer(bytes.NewReader(tarOf(t, tt.entries)), dir) // may fail; must not escape
			ents, _ := os.ReadDir(outside)
			if len(ents) != 1 || ents[0].Name() != "victim" {
				names := []string{}
				for _, e := range ents {
					names = append(names, e.Name())
				}
				t.Fatalf("files appeared outside the layer: %v", names)
			}
			if b, _ := os.ReadFile(filepath.Join(outside, "victim")); string(b) != "v" {
				t.Fatalf("outside file modified")
			}
		})
	}
}

func TestUnpackConvertsWhiteouts(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	data := tarOf(t, []entry{
		{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		{name: "etc/.wh.removed"},
		{name: "opaque/", typ: tar.TypeDir, mode: 0o755},
		{name: "opaque/.wh..wh..opq"},
		{name: "bin/tool", body: "#!/bin/sh\n", mode: 0o4755},
	})
	if _, _, err := unpackLayer(bytes.NewReader(data), dir); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(dir, "etc/removed"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Fatalf("whiteout is not a 0:0 char device: %v mode %o rdev %d", err, st.Mode, st.Rdev)
	}
	buf := make([]byte, 8)
	n, err := unix.Getxattr(filepath.Join(dir, "opaque"), "trusted.overlay.opaque", buf)
	if err != nil || string(buf[:n]) != "y" {
		t.Fatalf("opaque dir xattr: %v %q", err, buf[:n])
	}
	if info, _ := os.Stat(filepath.Join(dir, "bin/tool")); info.Mode()&os.ModeSetuid == 0 {
		t.Fatalf("setuid bit lost: %v", info.Mode())
	}
}

func testImage(t *testing.T) v1.Image {
	t.Helper()
	l1 := tarOf(t, []entry{{name: "a.txt", body: "one"}, {name: "gone.txt", body: "bye"}})
	l2 := tarOf(t, []entry{{name: "b.txt", body: "two"}, {name: ".wh.gone.txt"}})
	var layers []v1.Layer
	for _, b := range [][]byte{l1, l2} {
		b := b
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
		if err != nil {
			t.Fatal(err)
		}
		layers = append(layers, l)
	}
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := img.ConfigFile()
	cfg.Config.Env = []string{"PATH=/bin", "X=1"}
	cfg.Config.WorkingDir = "/w"
	cfg.OS, cfg.Architecture = "linux", "amd64"
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func TestImportFormats(t *testing.T) {
	needRoot(t)
	img := testImage(t)
	src := t.TempDir()
	docker := filepath.Join(src, "docker.tar")
	tag, _ := name.NewTag("example.com/test:v1")
	if err := tarball.WriteToFile(docker, tag, img); err != nil {
		t.Fatal(err)
	}
	ociDir := filepath.Join(src, "oci")
	p, err := layout.Write(ociDir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	ociTar := filepath.Join(src, "oci.tar")
	f, _ := os.Create(ociTar)
	if err := tarDir(ociDir, f); err != nil {
		t.Fatal(err)
	}
	f.Close()

	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ name, path string }{
		{"a docker save archive imports", docker},
		{"an OCI layout directory imports", ociDir},
		{"an OCI archive imports", ociTar},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := s.ImportPath(tenant.System(context.Background()), tt.path, "img-"+filepath.Base(tt.path), nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(got.Layers) != 2 || got.Config.Workdir != "/w" || len(got.Config.Env) != 2 {
				t.Fatalf("record %+v", got)
			}
			top := s.LayerDir(got.Layers[1])
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(top, "gone.txt"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
				t.Fatalf("top layer lacks the whiteout: %v", err)
			}
			if _, err := os.Stat(s.ShortLayerPath(got.Layers[0])); err != nil {
				t.Fatalf("short link: %v", err)
			}
		})
	}
	t.Run("an archive of something else is invalid", func(t *testing.T) {
		bad := filepath.Join(src, "bad.tar")
		os.WriteFile(bad, tarOf(t, []entry{{name: "hello", body: "x"}}), 0o644)
		_, err := s.ImportPath(tenant.System(context.Background()), bad, "bad", nil)
		if !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("deleting one image keeps layers another uses", func(t *testing.T) {
		a, _ := s.Get("img-docker.tar")
		if err := s.Delete("img-oci"); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(s.LayerDir(a.Layers[0])); err != nil {
			t.Fatalf("shared layer removed: %v", err)
		}
		for _, n := range []string{"img-docker.tar", "img-oci.tar"} {
			s.Delete(n)
		}
		if _, err := os.Stat(s.LayerDir(a.Layers[0])); !os.IsNotExist(err) {
			t.Fatalf("unreferenced layer kept: %v", err)
		}
	})
	t.Run("a project's image is its own and shadows a shared one", func(t *testing.T) {
		ctx := tenant.With(context.Background(), tenant.Caller{Project: "proj-a"})
		if _, err := s.ImportPath(ctx, docker, "mine", nil); err != nil {
			t.Fatal(err)
		}
		if _, err := s.ImportPath(ctx, docker, "again", nil); err != nil {
			t.Fatal(err)
		}
		if img, err := s.Lookup("proj-a", "mine"); err != nil || img.Owner != "proj-a" {
			t.Fatalf("the owner's lookup: %v, %v", img, err)
		}
		for _, other := range []string{"proj-b", tenant.Shared} {
			if _, err := s.Lookup(other, "mine"); !errdefs.Is(err, errdefs.KindNotFound) {
				t.Fatalf("lookup as %q: %v, want not found", other, err)
			}
		}
		s.ImportPath(tenant.System(context.Background()), docker, "again", nil)
		if img, _ := s.Lookup("proj-a", "again"); img.Owner != "proj-a" {
			t.Fatalf("proj-a sees %q's image, not its own", img.Owner)
		}
		if img, _ := s.Lookup("proj-b", "again"); img.Owner != tenant.Shared {
			t.Fatalf("proj-b sees %q's image, not the shared one", img.Owner)
		}
	})
	t.Run("records survive reopening", func(t *testing.T) {
		s.ImportPath(tenant.System(context.Background()), docker, "again", nil)
		s2, err := Open(s.Dir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s2.Get("again"); err != nil {
			t.Fatal(err)
		}
		if img, err := s2.Lookup("proj-a", "mine"); err != nil || img.Owner != "proj-a" {
			t.Fatalf("a project's image after reopening: %v, %v", img, err)
		}
		if _, err := s2.Get("missing"); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("missing image: %v", err)
		}
	})
}

func TestBootstrapBusybox(t *testing.T) {
	needRoot(t)
	if _, err := findBusybox(); err != nil {
		t.Skip("needs Debian's busybox-static: ", err)
	}
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	img, err := s.Bootstrap(tenant.System(context.Background()), "busybox", "", BootstrapOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dir := s.LayerDir(img.Layers[0])
	if target, err := os.Readlink(filepath.Join(dir, "bin/sh")); err != nil || target != "busybox" {
		t.Fatalf("bin/sh -> %q, %v", target, err)
	}
	again, err := s.Bootstrap(tenant.System(context.Background()), "busybox", "bb2", BootstrapOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if again.Layers[0] != img.Layers[0] {
		t.Fatalf("bootstrap is not reproducible: %s vs %s", again.Layers[0], img.Layers[0])
	}
}

// TestEmptyLayerIsAnEmptyUpper: the diff ID builds and commits compare
// with is the one an untouched writable layer captures to.
func TestEmptyLayerIsAnEmptyUpper(t *testing.T) {
	var buf bytes.Buffer
	if err := TarOverlayUpper(t.TempDir(), &buf, IDShift{}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	diff, _, err := unpackLayer(&buf, dir)
	if err != nil {
		t.Fatal(err)
	}
	if diff != EmptyLayer {
		t.Fatalf("an empty upper captures to %s, EmptyLayer is %s", diff, EmptyLayer)
	}
}
