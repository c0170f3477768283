package blobfs

import (
	"bytes"
	"crypto/rand"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/erofs"
	"github.com/opendsec/dsec/internal/mountns"
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		// The test's mounts go with its private mount namespace.
		if err := mountns.Enter(); err != nil {
			panic(err)
		}
	}
	os.Exit(m.Run())
}

const chunk = 64 << 10

// layer is an EROFS image of a tree with its data in a blob of its own:
// meta holds the metadata, blob the files' chunks.
type layer struct {
	meta, blob string
	big        []byte // big.bin's content (1 MiB)
	desc       Blob
}

func makeLayer(t *testing.T) layer {
	t.Helper()
	mkfs, err := exec.LookPath("mkfs.erofs")
	if err != nil {
		t.Skip("needs mkfs.erofs (erofs-utils): ", err)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	big := make([]byte, 1<<20)
	rand.Read(big)
	os.WriteFile(filepath.Join(src, "big.bin"), big, 0o644)
	os.WriteFile(filepath.Join(src, "etc/small.txt"), []byte("small\n"), 0o644)
	l := layer{meta: filepath.Join(dir, "meta.erofs"), blob: filepath.Join(dir, "data.blob"), big: big}
	if err := erofs.Mkfs(mkfs, src, l.meta, "--chunksize=65536", "--blobdev="+l.blob); err != nil {
		t.Fatal(err)
	}
	if l.desc, err = Describe(l.blob, chunk); err != nil {
		t.Fatal(err)
	}
	return l
}

// origin serves a blob by range requests, counting the bytes it sent;
// lie makes it send wrong bytes, down makes it fail.
type origin struct {
	*httptest.Server
	sent       atomic.Int64
	lie, down  atomic.Bool
	content    []byte
	mu         sync.Mutex
	firstRange string
}

func newOrigin(t *testing.T, path string) *origin {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	o := &origin{content: b}
	o.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if o.down.Load() {
			http.Error(w, "gone", http.StatusServiceUnavailable)
			return
		}
		body := o.content
		if o.lie.Load() {
			body = bytes.Repeat([]byte{0xee}, len(o.content))
		}
		cw := &countingWriter{ResponseWriter: w, n: &o.sent}
		http.ServeContent(cw, r, "blob", time.Time{}, bytes.NewReader(body))
	}))
	t.Cleanup(o.Close)
	return o
}

type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.n.Add(int64(len(p)))
	return w.ResponseWriter.Write(p)
}

// mountLayer mounts l's metadata over the blob file at blob and returns
// the mount's root.
func mountLayer(t *testing.T, l layer, blob string) string {
	t.Helper()
	fd, err := erofs.Mount(l.meta, blob)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return erofs.FdPath(fd)
}

func newFS(t *testing.T, cache string, opts ...Options) *FS {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("needs /dev/fuse: ", err)
	}
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	f, err := Mount(filepath.Join(t.TempDir(), "mnt"), cache, o, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestALayerLoadsOnDemand(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE and EROFS mounts)")
	}
	l := makeLayer(t)
	o := newOrigin(t, l.blob)
	cache := t.TempDir()
	f := newFS(t, cache)
	path, err := f.Add("blob1", l.desc, HTTPSource{URL: o.URL})
	if err != nil {
		t.Fatal(err)
	}
	root := mountLayer(t, l, path)

	t.Run("a small file fetches only its chunks", func(t *testing.T) {
		b, err := os.ReadFile(filepath.Join(root, "etc/small.txt"))
		if err != nil || string(b) != "small\n" {
			t.Fatalf("small.txt: %q, %v", b, err)
		}
		st, _ := f.Stats("blob1")
		if st.FetchedBytes == 0 || st.FetchedBytes > 2*chunk || st.FetchedBytes >= l.desc.Size/2 {
			t.Fatalf("fetched %d bytes of a %d-byte blob for a 6-byte file: %+v", st.FetchedBytes, l.desc.Size, st)
		}
	})
	t.Run("served again, a blob keeps its open files and reads from its new source", func(t *testing.T) {
		if f.Open() != 1 {
			t.Fatalf("%d blob files open under one mount, want 1", f.Open())
		}
		o2 := newOrigin(t, l.blob)
		if p, err := f.Add("blob1", l.desc, HTTPSource{URL: o2.URL}); err != nil || p != path {
			t.Fatalf("served again: %q, %v", p, err)
		}
		o.down.Store(true)
		defer o.down.Store(false)
		b, err := os.ReadFile(filepath.Join(root, "big.bin"))
		if err != nil || !bytes.Equal(b, l.big) || o2.sent.Load() == 0 {
			t.Fatalf("big.bin through the mount made before: %d bytes, %v; %d bytes from the new source", len(b), err, o2.sent.Load())
		}
	})
	t.Run("a whole file reads back as written", func(t *testing.T) {
		b, err := os.ReadFile(filepath.Join(root, "big.bin"))
		if err != nil || !bytes.Equal(b, l.big) {
			t.Fatalf("big.bin: %d bytes, %v (equal %v)", len(b), err, bytes.Equal(b, l.big))
		}
		st, _ := f.Stats("blob1")
		if st.Cached < int(len(l.big)/chunk) || st.Failed != 0 {
			t.Fatalf("after reading 1 MiB: %+v", st)
		}
	})
	t.Run("a blob is open while a mount reads through it", func(t *testing.T) {
		// (The blob server exits only when none is.)
		fd, err := erofs.Mount(l.meta, path)
		if err != nil {
			t.Fatal(err)
		}
		if n := f.Open(); n != 2 {
			t.Fatalf("%d blob files open under two mounts, want 2", n)
		}
		unix.Close(fd)
		timeout := time.After(10 * time.Second)
		for { // the kernel releases the file once the mount went
			n, changed := f.OpenChanged()
			if n == 1 {
				break
			}
			select {
			case <-changed:
			case <-timeout:
				t.Fatalf("%d blob files open 10 s after one of two mounts went, want 1", n)
			}
		}
	})
	t.Run("chunks cached by an earlier run are not fetched again", func(t *testing.T) {
		sent := o.sent.Load()
		f2 := newFS(t, cache)
		p2, err := f2.Add("blob1", l.desc, HTTPSource{URL: o.URL})
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(mountLayer(t, l, p2), "big.bin"))
		if err != nil || !bytes.Equal(b, l.big) {
			t.Fatalf("big.bin from the cache: %d bytes, %v", len(b), err)
		}
		if st, _ := f2.Stats("blob1"); st.Fetches != 0 || o.sent.Load() != sent {
			t.Fatalf("a cached blob fetched again: %+v, %d bytes sent", st, o.sent.Load()-sent)
		}
	})
}

func TestABadSourceIsAnIOErrorAndNothingIsCached(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE and EROFS mounts)")
	}
	l := makeLayer(t)
	o := newOrigin(t, l.blob)
	f := newFS(t, t.TempDir())
	path, err := f.Add("blob2", l.desc, HTTPSource{URL: o.URL})
	if err != nil {
		t.Fatal(err)
	}
	root := mountLayer(t, l, path)
	o.lie.Store(true)
	if _, err := os.ReadFile(filepath.Join(root, "big.bin")); err == nil {
		t.Fatal("a read of bytes that do not match their digests succeeded")
	}
	st, _ := f.Stats("blob2")
	if st.Failed == 0 || st.Cached != 0 {
		t.Fatalf("after a lying source: %+v (want failures, nothing cached)", st)
	}
	o.lie.Store(false)
	o.down.Store(true)
	if _, err := os.ReadFile(filepath.Join(root, "etc/small.txt")); err == nil {
		t.Fatal("a read from a source that is down succeeded")
	}
	// The source back: the same mount reads, nothing restarted.
	o.down.Store(false)
	if b, err := os.ReadFile(filepath.Join(root, "big.bin")); err != nil || !bytes.Equal(b, l.big) {
		t.Fatalf("big.bin once the source is back: %d bytes, %v", len(b), err)
	}
}

// The chunk cache keeps to its budget by dropping the least recently read
// chunks, which are read again from the source when needed; a pinned
// blob's chunks are never dropped.
func TestTheChunkCacheKeepsToItsBudget(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE and EROFS mounts)")
	}
	l := makeLayer(t)
	o := newOrigin(t, l.blob)
	const budget = 4 * chunk
	f := newFS(t, t.TempDir(), Options{Budget: budget})
	path, err := f.Add("b", l.desc, HTTPSource{URL: o.URL})
	if err != nil {
		t.Fatal(err)
	}
	root := mountLayer(t, l, path)
	for i := 0; i < 2; i++ {
		// The file's and the blob's pages dropped first, so the second
		// pass reads the blob file again.
		dropPages(t, filepath.Join(root, "big.bin"), path)
		b, err := os.ReadFile(filepath.Join(root, "big.bin"))
		if err != nil || !bytes.Equal(b, l.big) {
			t.Fatalf("pass %d: big.bin %d bytes, %v", i, len(b), err)
		}
	}
	f.Trim() // the cache trims itself behind the reads; Trim waits for it
	c := f.Cache()
	st, _ := f.Stats("b")
	if c.Used > budget || c.Evicted == 0 || st.Cached > budget/chunk {
		t.Fatalf("a %d-byte budget after reading 1 MiB twice: %+v, %+v", budget, c, st)
	}
	if st.FetchedBytes <= int64(len(l.big)) {
		t.Fatalf("dropped chunks were not read again from the source: %+v", st)
	}
	// A prune empties the cache of what no sandbox uses.
	if n := f.Shrink(0); n != c.Used || f.Cache().Used != 0 {
		t.Fatalf("shrink to nothing dropped %d bytes of %d: %+v", n, c.Used, f.Cache())
	}

	pinned := newFS(t, t.TempDir(), Options{Budget: budget, Pinned: func(string) bool { return true }})
	p2, err := pinned.Add("b", l.desc, HTTPSource{URL: o.URL})
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(mountLayer(t, l, p2), "big.bin")); err != nil || !bytes.Equal(b, l.big) {
		t.Fatalf("pinned: big.bin %d bytes, %v", len(b), err)
	}
	pinned.Trim()
	if n := pinned.Shrink(0); n != 0 {
		t.Fatalf("shrink dropped %d bytes of a pinned blob", n)
	}
	if c := pinned.Cache(); c.Evicted != 0 || c.Used <= budget {
		t.Fatalf("a pinned blob's chunks were dropped: %+v", c)
	}
}

// dropPages drops the page cache of the files at paths.
func dropPages(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		err = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
}

func TestABadDescriptionIsRefused(t *testing.T) {
	f := &FS{root: &rootNode{blobs: map[string]*blobNode{}}, lru: newLRU(Options{}, slog.Default())}
	for _, d := range []Blob{
		{Size: 100, Chunk: 1000, Digest: []string{"x"}},            // not a power of two
		{Size: 100, Chunk: 4096},                                   // no digests
		{Size: 10000, Chunk: 4096, Digest: []string{"a", "b"}},     // one short
		{Size: 1, Chunk: 2048, Digest: []string{"a"}},              // below 4 KiB
		{Size: 4096, Chunk: 4096, Digest: []string{"a", "b", "c"}}, // too many
	} {
		if _, err := f.Add("x", d, nil); err == nil {
			t.Errorf("description %+v accepted", d)
		}
	}
}
