package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// taskStore is a store (EROFS layers, FUSE: root) holding image "task" of
// one layer: repo/big.bin (4 MiB of random bytes, returned), repo/README
// ("read me\n") and more entries.
func taskStore(t *testing.T, more ...entry) (*Store, *Image, []byte) {
	t.Helper()
	needRoot(t)
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("needs /dev/fuse: ", err)
	}
	src, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	needErofs(t, src)
	big := make([]byte, 4<<20)
	rand.Read(big)
	rec := importLayer(t, src, "task", append([]entry{
		{name: "repo/", typ: tar.TypeDir, mode: 0o755},
		{name: "repo/big.bin", body: string(big), mode: 0o644},
		{name: "repo/README", body: "read me\n", mode: 0o644},
	}, more...))
	return src, rec, big
}

// readsREADME holds layers in s until the test ends and reads
// taskStore's repo/README from the top one, whose directory it returns.
func readsREADME(t *testing.T, s *Store, layers []string) string {
	t.Helper()
	release, err := s.Hold(layers)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(release)
	dir := s.LayerDir(layers[len(layers)-1])
	if b, err := os.ReadFile(filepath.Join(dir, "repo/README")); err != nil || string(b) != "read me\n" {
		t.Fatalf("README: %q, %v", b, err)
	}
	return dir
}

// TestAnImagePushedAsLayersLoadsOnDemand: an image pushed to the
// distribution's registry as its layers' EROFS files pulls into another
// store without its data; a file read fetches the chunks it touches,
// checked, and a whole file reads back as pushed; a reopened store reads
// from its chunk cache; an authenticating registry is read with its
// credentials; GC removes the layer's files and chunks.
func TestAnImagePushedAsLayersLoadsOnDemand(t *testing.T) {
	ctx := tenant.System(context.Background())
	src, rec, big := taskStore(t, entry{name: "etc/.wh.gone"})
	reg := dsectest.StartRegistry(t, "", "")
	ref := reg.Host + "/tasks/task:1"
	if _, err := src.PushLazy(ctx, rec, ref, Auth{}, true, nil); err != nil {
		t.Fatal(err)
	}
	blobSize := func(s *Store, diff string) int64 {
		st, err := os.Stat(src.layerPath(diff) + ".blob")
		if err != nil {
			t.Fatal(err)
		}
		return st.Size()
	}(src, rec.Layers[0])

	dstDir := t.TempDir()
	dst, err := Open(dstDir, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	got, err := dst.Pull(ctx, ref, "task", Auth{}, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	diff := got.Layers[0]
	t.Run("the pull fetches the metadata, not the data", func(t *testing.T) {
		if len(got.Layers) != 1 || diff != rec.Layers[0] || !strings.Contains(got.Source, "on demand") {
			t.Fatalf("pulled %+v, pushed layers %v", got, rec.Layers)
		}
		base := dst.layerPath(diff)
		for _, suf := range []string{".erofs", ".chunks", ".lazy"} {
			if _, err := os.Stat(base + suf); err != nil {
				t.Fatalf("no %s: %v", suf, err)
			}
		}
		if _, err := os.Stat(base + ".blob"); !os.IsNotExist(err) {
			t.Fatalf("the blob was pulled: %v", err)
		}
		if st, _ := os.Stat(base + ".lazy"); st.Mode().Perm() != 0o600 {
			t.Fatalf("the layer's source record is %v, want 0600 (it may hold credentials)", st.Mode().Perm())
		}
		// Its data is not here to push on demand again.
		if _, err := dst.PushLazy(ctx, got, reg.Host+"/tasks/again:1", Auth{}, true, nil); !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), "loaded on demand") {
			t.Fatalf("an on-demand push of a layer loaded on demand: %v", err)
		}
	})
	t.Run("a small file fetches a chunk, a big one reads back whole", func(t *testing.T) {
		dir := readsREADME(t, dst, got.Layers)
		st := dst.LazyStats()[diff]
		if st.FetchedBytes == 0 || st.FetchedBytes > 2*fetchChunk || st.FetchedBytes*4 > blobSize {
			t.Fatalf("an 8-byte file fetched %d bytes of a %d-byte blob: %+v", st.FetchedBytes, blobSize, st)
		}
		data, cached, ok := dst.OnDemand(got)
		if !ok || data != blobSize || cached != st.FetchedBytes {
			t.Fatalf("on demand after one small file: %d of %d bytes here (%v), fetched %d", cached, data, ok, st.FetchedBytes)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("big.bin: %d bytes, %v", len(b), err)
		}
		if _, cached, _ := dst.OnDemand(got); cached < int64(len(big)) {
			t.Fatalf("on demand after reading 4 MiB: %d bytes here", cached)
		}
		if _, _, ok := src.OnDemand(rec); ok {
			t.Fatal("an image whose layers are all here is reported as loaded on demand")
		}
		if c := dst.ChunkCache(); c.Budget <= 0 || c.Used < int64(len(big)) {
			t.Fatalf("the chunk cache after reading 4 MiB: %+v", c)
		}
		var wh unix.Stat_t
		if err := unix.Lstat(filepath.Join(dir, "etc/gone"), &wh); err != nil || wh.Mode&unix.S_IFMT != unix.S_IFCHR {
			t.Fatalf("the whiteout: %v", err)
		}
	})
	t.Run("a reopened store reads from its chunk cache", func(t *testing.T) {
		dst.Close()
		again, err := Open(dstDir, slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		defer again.Close()
		release, err := again.Hold(got.Layers)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := again.blobServer(); err != nil {
			t.Fatal(err)
		}
		before := again.LazyStats()[diff] // the blob server's counts, if it is the one before
		if b, err := os.ReadFile(filepath.Join(again.LayerDir(diff), "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("big.bin after reopening: %d bytes, %v", len(b), err)
		}
		if st := again.LazyStats()[diff]; st.Fetches != before.Fetches {
			t.Fatalf("after reopening: %+v (before the read %+v), want no fetch", st, before)
		}
		release()
		if err := again.Delete("task"); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{again.layerPath(diff) + ".lazy", again.layerPath(diff) + ".erofs", filepath.Join(dstDir, "chunks", strings.TrimPrefix(diff, "sha256:"))} {
			if _, err := os.Stat(p); !os.IsNotExist(err) {
				t.Errorf("%s kept after the image's deletion: %v", p, err)
			}
		}
	})
	t.Run("an authenticating registry is read with its credentials", func(t *testing.T) {
		locked := dsectest.StartRegistry(t, "trainer", "s3cret-pass")
		ref := locked.Host + "/tasks/task:1"
		auth := Auth{Username: "trainer", Password: "s3cret-pass"}
		if _, err := src.PushLazy(ctx, rec, ref, auth, true, nil); err != nil {
			t.Fatal(err)
		}
		other, _ := Open(t.TempDir(), slog.Default())
		defer other.Close()
		got, err := other.Pull(ctx, ref, "task", auth, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := other.Hold(got.Layers); err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(filepath.Join(other.LayerDir(got.Layers[0]), "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("big.bin through an authenticating registry: %d bytes, %v", len(b), err)
		}
	})
	t.Run("a layer stored as a directory is pushed as an OCI image, not lazily", func(t *testing.T) {
		old, _ := Open(t.TempDir(), slog.Default())
		old.UseLayers("dir")
		dirImg := importLayer(t, old, "old", []entry{{name: "a.txt", body: "a"}})
		if _, err := old.PushLazy(ctx, dirImg, reg.Host+"/tasks/old:1", Auth{}, true, nil); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("a lazy push of a directory layer: %v, want invalid", err)
		}
	})
}

// TestTheBlobServerOutlivesItsNode: the data of layers loaded on demand is
// served by a process of its own. A store that goes away without closing
// (its node killed) leaves its mounts reading, and the store opened next
// connects to the same server; a killed server loses the data to the
// mounts made through it, which DataLost says, and the next mount starts
// a new server; with no store connected and no mount left, the server
// exits by itself.
func TestTheBlobServerOutlivesItsNode(t *testing.T) {
	ctx := tenant.System(context.Background())
	src, rec, big := taskStore(t)
	reg := dsectest.StartRegistry(t, "", "")
	ref := reg.Host + "/tasks/task:1"
	if _, err := src.PushLazy(ctx, rec, ref, Auth{}, true, nil); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	first, err := Open(dir, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(first.Close)
	got, err := first.Pull(ctx, ref, "task", Auth{}, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	diff := got.Layers[0]
	created := time.Now() // a sandbox's, created before the node went away
	mnt := readsREADME(t, first, got.Layers)
	server := first.connected().hello.PID

	// The node is killed: its connection ends, its mounts stay (the
	// sandboxes' overlays hold them).
	c := first.connected()
	first.blobsMu.Lock()
	first.blobs = nil
	first.blobsMu.Unlock()
	c.close()

	second, err := Open(dir, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(second.Close)
	if second.DataLost(got.Layers, created) {
		t.Fatal("a sandbox's layer is lost although its blob server runs on")
	}
	if pid := second.connected().hello.PID; pid != server {
		t.Fatalf("the store after the restart started blob server %d, want %d's", pid, server)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
		t.Fatalf("big.bin through the mount made before the restart: %d bytes, %v", len(b), err)
	}

	// Killed, the server takes the data of the mounts made through it.
	c = second.connected()
	if err := unix.Kill(server, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select { // the store's session with it ends
	case <-c.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the session with a killed blob server still open 30 s on")
	}
	if !second.DataLost(got.Layers, created) {
		t.Fatal("a sandbox started before its blob server was killed is not told its data is lost")
	}
	if second.DataLost(got.Layers, time.Now()) {
		t.Fatal("a sandbox started after the blob server's death is told its data is lost")
	}
	release, err := second.Hold(got.Layers)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(second.LayerDir(diff), "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
		t.Fatalf("big.bin through a new mount: %d bytes, %v", len(b), err)
	}
	next := second.connected().hello.PID
	if next == server {
		t.Fatal("no new blob server")
	}

	// No store connected, no mount left: the server exits.
	release()
	second.Close()
	first.Close()
	if !exits(t, next, 30*time.Second) {
		c := &blobClient{hc: &http.Client{Transport: blobdTransport(dir)}}
		var h blobdHello
		err := c.call(context.Background(), http.MethodGet, "/hello", nil, &h)
		t.Fatalf("the idle blob server still runs 30 s on: %+v %v", h, err)
	}
}

// exits waits up to d for process pid to exit (its pidfd turns readable)
// and says whether it did.
func exits(t *testing.T, pid int, d time.Duration) bool {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if err == unix.ESRCH {
		return true // gone and reaped
	}
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	deadline := time.Now().Add(d)
	for {
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, max(int(time.Until(deadline).Milliseconds()), 0))
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			t.Fatal(err)
		}
		return n > 0
	}
}
