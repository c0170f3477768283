package image

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestAnImageMovesFromAnotherNodeOnDemand: a store imports an image from
// another node's store (its peer handler over HTTP, as cluster nodes
// serve each other) without its data: the record as the peer has it, each
// layer's metadata image and description; a file read fetches the chunks
// it touches from the peer and reads back as written; a layer the peer
// itself loads on demand is served through the peer's own cache; another
// project's image is not found; and a peer that goes away fails the read
// of a chunk not cached here with EIO, nothing else.
func TestAnImageMovesFromAnotherNodeOnDemand(t *testing.T) {
	src, rec, big := taskStore(t)
	rec.Config.Env = []string{"TASK=1"}
	if err := src.put(rec); err != nil {
		t.Fatal(err)
	}
	// A project's own image, which only that project sees.
	own := importLayer(t, src, "secret", []entry{{name: "answer.txt", body: "42\n"}})
	own.Owner = "alpha"
	if err := src.put(own); err != nil {
		t.Fatal(err)
	}
	const token = "Bearer cluster-token"
	var requests, blobRanges int
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != token {
			http.Error(w, "no token", http.StatusUnauthorized)
			return
		}
		requests++
		if strings.HasSuffix(r.URL.Path, "/blob") && r.Header.Get("Range") != "" {
			blobRanges++
		}
		src.PeerHandler().ServeHTTP(w, r)
	}))
	defer peer.Close()

	dst, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	ctx := context.Background()
	if _, err := dst.ImportFromPeer(ctx, "n1", peer.URL, "beta", "task"); err == nil || !strings.Contains(err.Error(), "Unauthorized") {
		t.Fatalf("an import without the cluster token: %v", err)
	}
	dst.SetPeers(Peers{Header: http.Header{"Authorization": {token}}})
	got, err := dst.ImportFromPeer(ctx, "n1", peer.URL, "beta", "task")
	if err != nil {
		t.Fatal(err)
	}
	diff := got.Layers[0]
	t.Run("the record and metadata move, the data stays", func(t *testing.T) {
		if got.Name != "task" || got.Owner != tenant.Shared || diff != rec.Layers[0] || got.Digest != rec.Digest ||
			len(got.Config.Env) != 1 || got.Config.Env[0] != "TASK=1" || !strings.Contains(got.Source, "node n1") {
			t.Fatalf("imported %+v from %+v", got, rec)
		}
		if again, err := dst.Lookup("beta", "task"); err != nil || again.Digest != rec.Digest {
			t.Fatalf("the imported image is not in the store: %v", err)
		}
		base := dst.layerPath(diff)
		for _, suf := range []string{".erofs", ".chunks", ".lazy"} {
			if _, err := os.Stat(base + suf); err != nil {
				t.Fatalf("no %s: %v", suf, err)
			}
		}
		if _, err := os.Stat(base + ".blob"); !os.IsNotExist(err) {
			t.Fatalf("the blob was copied: %v", err)
		}
		if blobRanges != 0 {
			t.Fatalf("the import read the blob %d times", blobRanges)
		}
	})
	t.Run("a read fetches what it touches from the peer", func(t *testing.T) {
		dir := readsREADME(t, dst, got.Layers)
		if st := dst.LazyStats()[diff]; st.FetchedBytes == 0 || st.FetchedBytes > 2*fetchChunk {
			t.Fatalf("an 8-byte file fetched %+v from the peer", st)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("big.bin: %d bytes, %v", len(b), err)
		}
	})
	t.Run("another project's image is not found", func(t *testing.T) {
		if _, err := dst.ImportFromPeer(ctx, "n1", peer.URL, "beta", "secret"); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("project beta imported alpha's image: %v", err)
		}
		img, err := dst.ImportFromPeer(ctx, "n1", peer.URL, "alpha", "secret")
		if err != nil || img.Owner != "alpha" {
			t.Fatalf("alpha's own image: %+v, %v", img, err)
		}
		if _, err := dst.Lookup("beta", "secret"); err == nil {
			t.Fatal("project beta sees alpha's imported image")
		}
	})
	t.Run("a layer loaded on demand is served on from the peer's cache", func(t *testing.T) {
		third, err := Open(t.TempDir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		defer third.Close()
		relay := httptest.NewServer(dst.PeerHandler())
		defer relay.Close()
		img, err := third.ImportFromPeer(ctx, "n2", relay.URL, "beta", "task")
		if err != nil {
			t.Fatal(err)
		}
		release, err := third.Hold(img.Layers)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		before := requests
		if b, err := os.ReadFile(filepath.Join(third.LayerDir(diff), "repo/big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("big.bin through a node that loads it on demand: %d bytes, %v", len(b), err)
		}
		if requests != before {
			t.Fatalf("the relay went back to the first node %d times for chunks it had cached", requests-before)
		}
	})
	t.Run("a peer that goes away fails only the reads it must serve", func(t *testing.T) {
		fresh, err := Open(t.TempDir(), slog.Default())
		if err != nil {
			t.Fatal(err)
		}
		defer fresh.Close()
		fresh.SetPeers(Peers{Header: http.Header{"Authorization": {token}}})
		img, err := fresh.ImportFromPeer(ctx, "n1", peer.URL, "beta", "task")
		if err != nil {
			t.Fatal(err)
		}
		release, err := fresh.Hold(img.Layers)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		dir := fresh.LayerDir(diff)
		if b, err := os.ReadFile(filepath.Join(dir, "repo/README")); err != nil || string(b) != "read me\n" {
			t.Fatalf("README: %q, %v", b, err)
		}
		peer.Close()
		if _, err := os.ReadFile(filepath.Join(dir, "repo/big.bin")); !errors.Is(err, syscall.EIO) {
			t.Fatalf("a read of uncached data with its peer gone: %v, want EIO", err)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "repo/README")); err != nil || string(b) != "read me\n" {
			t.Fatalf("README from the cache with the peer gone: %q, %v", b, err)
		}
	})
	t.Run("a VM image does not move", func(t *testing.T) {
		vm := *rec
		vm.Name, vm.VM = "disk", &VMImage{}
		if err := src.put(&vm); err != nil {
			t.Fatal(err)
		}
		other := httptest.NewServer(src.PeerHandler())
		defer other.Close()
		if _, err := dst.ImportFromPeer(ctx, "n1", other.URL, "beta", "disk"); !errdefs.Is(err, errdefs.KindUnimplemented) {
			t.Fatalf("a VM image from a peer: %v, want unimplemented", err)
		}
	})
}
