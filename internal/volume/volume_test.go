package volume

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/loopfs"
	"github.com/opendsec/dsec/internal/mountns"
)

// The tests make real volumes (ext4 images on loop devices) in a private
// mount namespace, as the node does.
func TestMain(m *testing.M) {
	if os.Geteuid() == 0 && loopfs.Available() == "" {
		if err := mountns.Enter(); err != nil {
			fmt.Fprintln(os.Stderr, "mount namespace:", err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

func open(t *testing.T, dir string) *Manager {
	t.Helper()
	m, err := Open(dir, Config{Node: "test"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if why := m.Unavailable(); why != "" {
		t.Skip("volumes are unavailable here: " + why)
	}
	return m
}

func newManager(t *testing.T) *Manager {
	t.Helper()
	dir := t.TempDir()
	m := open(t, dir)
	t.Cleanup(func() {
		for _, v := range m.List() {
			m.Delete(v.ID)
		}
		m.Close()
	})
	return m
}

func mustCreate(t *testing.T, m *Manager, project, name string, sizeMB int64) *Volume {
	t.Helper()
	v, err := m.Create(project, name, sizeMB, nil)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func ptr(v uint32) *uint32 { return &v }

func read(t *testing.T, m *Manager, id, p string) string {
	t.Helper()
	_, r, err := m.ReadFile(id, p)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b, _ := io.ReadAll(r)
	return string(b)
}

func TestAVolumeKeepsItsContentAcrossAReopen(t *testing.T) {
	dir := t.TempDir()
	m := open(t, dir)
	v := mustCreate(t, m, "p", "data", 32)
	if _, err := m.WriteFile(v.ID, "/kept.txt", false, Attrs{}, strings.NewReader("still here")); err != nil {
		t.Fatal(err)
	}
	m.Close()
	if m.mounted(v.ID) {
		t.Fatal("Close left the volume mounted")
	}
	m2 := open(t, dir)
	defer func() { m2.Delete(v.ID); m2.Close() }()
	got := m2.ByName("p", "data")
	if got == nil || got.ID != v.ID || got.SizeMB != 32 {
		t.Fatalf("after reopen: %+v", got)
	}
	if s := read(t, m2, v.ID, "kept.txt"); s != "still here" {
		t.Fatalf("after reopen the file reads %q", s)
	}
}

func TestNamesAreUniqueWithinAProjectOnly(t *testing.T) {
	m := newManager(t)
	mustCreate(t, m, "p", "shared-name", 16)
	if _, err := m.Create("p", "shared-name", 16, nil); !errdefs.Is(err, errdefs.KindConflict) {
		t.Fatalf("a second volume of the name in one project: %v, want conflict", err)
	}
	if _, err := m.Create("q", "shared-name", 16, nil); err != nil {
		t.Fatalf("another project's volume of the same name: %v", err)
	}
	for _, bad := range []string{"", "-x", "a/b", "..", strings.Repeat("a", 64), "vol-aaaaaaaaaaaaaaaa-test"} {
		if _, err := m.Create("p", bad, 16, nil); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("name %q: %v, want invalid", bad, err)
		}
	}
	for _, size := range []int64{-1, 8, 1 << 40} {
		if _, err := m.Create("p", "sized", size, nil); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("size %d: %v, want invalid", size, err)
		}
	}
}

func TestHolds(t *testing.T) {
	m := newManager(t)
	v := mustCreate(t, m, "p", "held", 16)
	t.Run("read-only holds are shared", func(t *testing.T) {
		for _, sb := range []string{"r1", "r2"} {
			if err := m.Hold(v.ID, sb, true); err != nil {
				t.Fatal(err)
			}
		}
	})
	t.Run("one sandbox holds it read-write, a second is refused", func(t *testing.T) {
		if err := m.Hold(v.ID, "w1", false); err != nil {
			t.Fatal(err)
		}
		err := m.Hold(v.ID, "w2", false)
		if !errdefs.Is(err, errdefs.KindConflict) || !strings.Contains(err.Error(), "w1") {
			t.Fatalf("a second read-write hold: %v, want a conflict naming w1", err)
		}
		if h := m.HoldersOf(v.ID); h.Writer != "w1" || len(h.Readers) != 2 {
			t.Fatalf("holders: %+v", h)
		}
	})
	t.Run("a held volume is not deleted", func(t *testing.T) {
		if err := m.Delete(v.ID); !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("delete of a held volume: %v, want conflict", err)
		}
	})
	t.Run("once released, another sandbox holds it and it can be deleted", func(t *testing.T) {
		m.Release("w1")
		if err := m.Hold(v.ID, "w2", false); err != nil {
			t.Fatal(err)
		}
		for _, sb := range []string{"w2", "r1", "r2"} {
			m.Release(sb)
		}
		if err := m.Delete(v.ID); err != nil {
			t.Fatal(err)
		}
		if err := m.Hold(v.ID, "w3", true); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("hold of a deleted volume: %v", err)
		}
		if _, err := os.Stat(m.image(v.ID)); !os.IsNotExist(err) {
			t.Fatalf("the deleted volume's image is still there: %v", err)
		}
	})
}

func TestAWriterPastTheSizeGetsNoSpaceAndTheHostKeepsItsDisk(t *testing.T) {
	m := newManager(t)
	v := mustCreate(t, m, "p", "small", 16)
	_, err := m.WriteFile(v.ID, "/big", false, Attrs{}, io.LimitReader(zeros{}, 64<<20))
	if !errdefs.Is(err, errdefs.KindExhausted) || errdefs.IsInfra(err) {
		t.Fatalf("writing 64 MiB into 16 MiB: %v, want exhausted (not infra)", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(m.image(v.ID), &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; used > 17<<20 {
		t.Fatalf("the image holds %d bytes of the host's disk, more than its 16 MiB", used)
	}
	if _, err := m.StatPath(v.ID, "/big"); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("a failed write left its file: %v", err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

func TestContent(t *testing.T) {
	m := newManager(t)
	v := mustCreate(t, m, "p", "content", 32)
	id := v.ID
	t.Run("the root is empty and every user may write it", func(t *testing.T) {
		list, err := m.ListDir(id, "/", 1)
		if err != nil || len(list) != 0 {
			t.Fatalf("root lists %v (%v)", list, err)
		}
		in, err := m.StatPath(id, "/")
		if err != nil || in.Type != "dir" || in.Mode != 0o777 || in.UID != 0 {
			t.Fatalf("root: %+v %v", in, err)
		}
	})
	t.Run("a written file reads back with its owner and mode", func(t *testing.T) {
		in, err := m.WriteFile(id, "hello.txt", false, Attrs{UID: ptr(1000), GID: ptr(1000), Mode: ptr(0o640)}, strings.NewReader("hello"))
		if err != nil {
			t.Fatal(err)
		}
		if in.Path != "/hello.txt" || in.Name != "hello.txt" || in.Type != "file" || in.Size != 5 || in.UID != 1000 || in.GID != 1000 || in.Mode != 0o640 {
			t.Fatalf("info: %+v", in)
		}
		if s := read(t, m, id, "/hello.txt"); s != "hello" {
			t.Fatalf("read %q", s)
		}
	})
	t.Run("an existing file is overwritten only when asked", func(t *testing.T) {
		if _, err := m.WriteFile(id, "/hello.txt", false, Attrs{}, strings.NewReader("x")); !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("write over a file without overwrite: %v", err)
		}
		if _, err := m.WriteFile(id, "/hello.txt", true, Attrs{}, strings.NewReader("new")); err != nil {
			t.Fatal(err)
		}
		if s := read(t, m, id, "/hello.txt"); s != "new" {
			t.Fatalf("read %q", s)
		}
	})
	t.Run("a missing parent is not found, and made with parents", func(t *testing.T) {
		if _, err := m.WriteFile(id, "/a/b/c.txt", false, Attrs{}, strings.NewReader("x")); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("write under a missing directory: %v", err)
		}
		if _, err := m.MakeDir(id, "/a/b", false, Attrs{}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("mkdir under a missing directory: %v", err)
		}
		in, err := m.MakeDir(id, "/a/b", true, Attrs{Mode: ptr(0o750), UID: ptr(7)})
		if err != nil || in.Type != "dir" || in.Mode != 0o750 || in.UID != 7 {
			t.Fatalf("mkdir -p: %+v %v", in, err)
		}
		if _, err := m.MakeDir(id, "/a/b", false, Attrs{}); !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("mkdir of an existing directory: %v", err)
		}
		if _, err := m.MakeDir(id, "/a/b", true, Attrs{}); err != nil {
			t.Fatalf("mkdir -p of an existing directory: %v", err)
		}
		if _, err := m.MakeDir(id, "/hello.txt", true, Attrs{}); !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("mkdir -p over a file: %v", err)
		}
	})
	t.Run("a listing goes as deep as asked", func(t *testing.T) {
		if _, err := m.WriteFile(id, "/a/b/c.txt", false, Attrs{}, strings.NewReader("x")); err != nil {
			t.Fatal(err)
		}
		names := func(depth int) string {
			list, err := m.ListDir(id, "/", depth)
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, e := range list {
				out = append(out, e.Path)
			}
			return strings.Join(out, " ")
		}
		if got := names(1); got != "/a /hello.txt" {
			t.Fatalf("depth 1: %s", got)
		}
		if got := names(3); got != "/a /a/b /a/b/c.txt /hello.txt" {
			t.Fatalf("depth 3: %s", got)
		}
		if _, err := m.ListDir(id, "/hello.txt", 1); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("list of a file: %v", err)
		}
		if _, err := m.ListDir(id, "/nope", 1); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("list of a missing path: %v", err)
		}
	})
	t.Run("attributes change", func(t *testing.T) {
		in, err := m.SetAttrs(id, "/hello.txt", Attrs{Mode: ptr(0o755), UID: ptr(1001)})
		if err != nil || in.Mode != 0o755 || in.UID != 1001 || in.GID != 0 {
			t.Fatalf("set attrs: %+v %v", in, err)
		}
		if _, err := m.SetAttrs(id, "/hello.txt", Attrs{UID: ptr(70000)}); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("uid beyond the sandboxes' range: %v", err)
		}
	})
	t.Run("a directory is removed with what it holds; the root is not", func(t *testing.T) {
		if err := m.RemovePath(id, "/a"); err != nil {
			t.Fatal(err)
		}
		if _, err := m.StatPath(id, "/a"); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("stat after remove: %v", err)
		}
		if err := m.RemovePath(id, "/a"); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("remove of a missing path: %v", err)
		}
		if err := m.RemovePath(id, "/"); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("remove of the root: %v", err)
		}
	})
}

// A sandbox writes the volume: links it made must not take the node's
// content calls (which run as root on the host) outside the volume.
func TestContentCallsStayInsideTheVolume(t *testing.T) {
	m := newManager(t)
	v := mustCreate(t, m, "p", "hostile", 16)
	host := t.TempDir()
	secret := filepath.Join(host, "secret")
	os.WriteFile(secret, []byte("host secret"), 0o600)
	src := m.Source(v.ID)
	// What a sandbox could leave in its volume.
	os.Symlink(host, filepath.Join(src, "abs"))
	os.Symlink(secret, filepath.Join(src, "file"))
	os.Symlink("../../../../../../../../"+strings.TrimPrefix(host, "/"), filepath.Join(src, "rel"))
	unix.Mkfifo(filepath.Join(src, "fifo"), 0o666)
	for _, p := range []string{"/abs/secret", "/file", "/rel/secret", "../../../../" + secret} {
		if _, r, err := m.ReadFile(v.ID, p); err == nil {
			b, _ := io.ReadAll(r)
			r.Close()
			t.Errorf("read %s gave %q", p, b)
		}
	}
	if _, err := m.WriteFile(v.ID, "/abs/new", false, Attrs{}, strings.NewReader("x")); err == nil {
		t.Error("a write through a link succeeded")
	}
	if _, err := os.Stat(filepath.Join(host, "new")); err == nil {
		t.Error("a write through a link reached the host")
	}
	if _, err := m.SetAttrs(v.ID, "/file", Attrs{Mode: ptr(0o777)}); err == nil {
		t.Error("chmod through a link succeeded")
	}
	if st, _ := os.Stat(secret); st.Mode().Perm() != 0o600 {
		t.Errorf("the host file's mode is %v", st.Mode())
	}
	if _, err := m.WriteFile(v.ID, "/file", true, Attrs{}, strings.NewReader("overwritten")); err != nil {
		t.Fatalf("overwrite of the link itself: %v", err)
	}
	if b, _ := os.ReadFile(secret); !bytes.Equal(b, []byte("host secret")) {
		t.Errorf("the host file reads %q", b)
	}
	if err := m.RemovePath(v.ID, "/abs"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(secret); err != nil {
		t.Errorf("removing a link removed what it pointed to: %v", err)
	}
	if _, _, err := m.ReadFile(v.ID, "/fifo"); !errdefs.Is(err, errdefs.KindInvalid) {
		t.Errorf("reading a FIFO: %v, want invalid at once", err)
	}
}

// BenchmarkCreateDelete times making and deleting a volume of the default
// size (1 GiB, sparse) and reports each step's p50:
//
//	go test -run '^$' -bench CreateDelete -benchtime 50x ./internal/volume/
func BenchmarkCreateDelete(b *testing.B) {
	m, err := Open(b.TempDir(), Config{Node: "bench"}, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	if why := m.Unavailable(); why != "" {
		b.Skip(why)
	}
	defer m.Close()
	var made, gone []time.Duration
	for i := 0; b.Loop(); i++ {
		t0 := time.Now()
		v, err := m.Create("p", fmt.Sprintf("v%d", i), 0, nil)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := m.Delete(v.ID); err != nil {
			b.Fatal(err)
		}
		made, gone = append(made, t1.Sub(t0)), append(gone, time.Since(t1))
	}
	p50 := func(d []time.Duration) float64 {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return float64(d[len(d)/2].Microseconds())
	}
	b.ReportMetric(p50(made), "create-p50-µs")
	b.ReportMetric(p50(gone), "delete-p50-µs")
}
