package image

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// staticServer serves dir as a plain HTTP server does (Go's file server:
// GET, HEAD, range requests), behind basic authentication when user is
// set, and counts the bytes it sends per path.
type staticServer struct {
	*httptest.Server
	mu   sync.Mutex
	sent map[string]int64
}

func serveDir(t *testing.T, dir, user, pass string) *staticServer {
	t.Helper()
	s := &staticServer{sent: map[string]int64{}}
	files := http.FileServer(http.Dir(dir))
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, _ := r.BasicAuth(); user != "" && (u != user || p != pass) {
			http.Error(w, "who are you", http.StatusUnauthorized)
			return
		}
		cw := &countingWriter{ResponseWriter: w}
		files.ServeHTTP(cw, r)
		s.mu.Lock()
		s.sent[r.URL.Path] += cw.n
		s.mu.Unlock()
	}))
	t.Cleanup(s.Close)
	return s
}

// sentUnder is the bytes sent of paths with prefix.
func (s *staticServer) sentUnder(prefix string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	for p, b := range s.sent {
		if strings.HasPrefix(p, prefix) {
			n += b
		}
	}
	return n
}

type countingWriter struct {
	http.ResponseWriter
	n int64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.ResponseWriter.Write(b)
	c.n += int64(n)
	return n, err
}

// TestAnImageExportedToAPlainHTTPServerLoadsOnDemand: an exported image,
// unpacked under a prefix of a plain HTTP server, pulls into another store
// with its metadata only (the server's credentials sent); a file read
// fetches the ranges it touches and reads back whole; a wrong answer of
// the server or no credentials is a clear error that stores nothing; an
// ordinary OCI layout on such a server imports whole.
func TestAnImageExportedToAPlainHTTPServerLoadsOnDemand(t *testing.T) {
	ctx := tenant.System(context.Background())
	src, rec, big := taskStore(t)
	var tarball bytes.Buffer
	if err := src.Export(ctx, rec, &tarball); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := UnpackLayout(bytes.NewReader(tarball.Bytes()), filepath.Join(root, "tasks", "task")); err != nil {
		t.Fatal(err)
	}
	srv := serveDir(t, root, "reader", "secret")
	url := srv.URL + "/tasks/task/"
	auth := Auth{Username: "reader", Password: "secret"}
	blobs := "/tasks/task/blobs/"

	dst, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dst.Close)
	got, err := dst.Pull(ctx, url, "task", auth, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Layers) != 1 || got.Layers[0] != rec.Layers[0] || !strings.Contains(got.Source, "on demand") {
		t.Fatalf("pulled %+v, exported layers %v", got, rec.Layers)
	}
	if n := srv.sentUnder(blobs); n*4 > int64(len(big)) {
		t.Fatalf("the pull read %d bytes of an image of %d", n, len(big))
	}

	t.Run("a file read fetches what it touches; a big file reads back whole", func(t *testing.T) {
		before := srv.sentUnder(blobs)
		dir := readsREADME(t, dst, got.Layers)
		if n := srv.sentUnder(blobs) - before; n == 0 || n > 2*fetchChunk {
			t.Fatalf("an 8-byte file fetched %d bytes", n)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("big.bin: %d bytes, %v", len(b), err)
		}
	})

	t.Run("credentials in the URL are sent and shown nowhere", func(t *testing.T) {
		img, err := dst.Pull(ctx, strings.Replace(url, "http://", "http://reader:secret@", 1), "task-in-url", Auth{}, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(img.Source, "secret") || !strings.Contains(img.Source, srv.Listener.Addr().String()) {
			t.Fatalf("the image's source: %q", img.Source)
		}
	})

	t.Run("without the server's credentials the pull is refused", func(t *testing.T) {
		_, err := dst.Pull(ctx, url, "task-2", Auth{}, false, nil)
		if !errdefs.Is(err, errdefs.KindPermissionDenied) {
			t.Fatalf("a pull without credentials: %v, want permission denied", err)
		}
		if _, err := dst.Pull(ctx, url, "", auth, false, nil); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("a pull from a URL without a name: %v, want invalid", err)
		}
	})

	t.Run("a metadata blob that does not match its digest stores nothing", func(t *testing.T) {
		lying := filepath.Join(root, "tasks", "lying")
		if err := UnpackLayout(bytes.NewReader(tarball.Bytes()), lying); err != nil {
			t.Fatal(err)
		}
		// The layer's metadata image rewritten: it no longer matches its
		// digest.
		lp, err := layout.FromPath(lying)
		if err != nil {
			t.Fatal(err)
		}
		idx, _ := lp.ImageIndex()
		im, _ := idx.IndexManifest()
		m, err := lp.Image(im.Manifests[0].Digest)
		if err != nil {
			t.Fatal(err)
		}
		mf, _ := m.Manifest()
		for _, d := range mf.Layers {
			if d.MediaType == MediaLayerMeta {
				p := filepath.Join(lying, "blobs", "sha256", d.Digest.Hex)
				b, _ := os.ReadFile(p)
				b[len(b)/2] ^= 0xff
				os.WriteFile(p, b, 0o644)
			}
		}
		other, err := Open(t.TempDir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(other.Close)
		_, err = other.Pull(ctx, srv.URL+"/tasks/lying", "task", auth, false, nil)
		if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), "digest") {
			t.Fatalf("a lying blob: %v, want invalid naming the digest", err)
		}
		if len(other.storedLayers()) != 0 || len(other.List()) != 0 {
			t.Fatalf("a refused pull stored %v, %v", other.storedLayers(), other.List())
		}
	})

	t.Run("an ordinary OCI layout imports whole", func(t *testing.T) {
		p, err := layout.Write(filepath.Join(root, "plain"), empty.Index)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.AppendImage(testImage(t)); err != nil {
			t.Fatal(err)
		}
		img, err := dst.Pull(ctx, srv.URL+"/plain/", "plain", auth, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(img.Layers) != 2 || strings.Contains(img.Source, "on demand") || img.Config.Workdir != "/w" {
			t.Fatalf("imported %+v", img)
		}
		release, err := dst.Hold(img.Layers)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		if b, err := os.ReadFile(filepath.Join(dst.LayerDir(img.Layers[1]), "b.txt")); err != nil || string(b) != "two" {
			t.Fatalf("b.txt: %q, %v", b, err)
		}
	})
}
