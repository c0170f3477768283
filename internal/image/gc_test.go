package image

import (
	"bytes"
	"log/slog"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestGCKeepsHeldLayers: a layer on its way into a record (a snapshot's,
// between AddLayer and Put) and the layers of an image a sandbox is being
// created from (between the lookup and the sandbox's reservation) survive
// a GC; once let go and unnamed, they are collected.
func TestGCKeepsHeldLayers(t *testing.T) {
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	layer := func(body string) (string, func()) {
		t.Helper()
		diff, _, release, err := s.AddLayer(bytes.NewReader(tarOf(t, []entry{{name: "f", body: body}})))
		if err != nil {
			t.Fatal(err)
		}
		return diff, release
	}
	record := func(name, diff string) *Image {
		return &Image{Name: name, Owner: tenant.DefaultProject, Layers: []string{diff}, Created: time.Now().UTC(), Digest: diff}
	}

	t.Run("a layer added for a record survives a GC before the record is put", func(t *testing.T) {
		diff, release := layer("snapshot")
		s.GC() // another image deleted meanwhile
		if err := s.Put(record("snap", diff)); err != nil {
			t.Fatalf("put after a GC: %v", err)
		}
		release()
		s.GC()
		if _, ok := s.haveLayer(diff); !ok {
			t.Fatal("a layer a record names was collected")
		}
	})

	t.Run("a held layer survives its image's delete", func(t *testing.T) {
		img, err := s.Get(tenant.ImageKey(tenant.DefaultProject, "snap"))
		if err != nil {
			t.Fatal(err)
		}
		release, err := s.Hold(img.Layers)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Delete(img.Key()); err != nil { // runs a GC
			t.Fatal(err)
		}
		if _, ok := s.haveLayer(img.Layers[0]); !ok {
			t.Fatal("a held layer was collected")
		}
		release()
		release() // idempotent
		s.GC()
		if _, ok := s.haveLayer(img.Layers[0]); ok {
			t.Fatal("a layer nothing holds or names outlived a GC")
		}
		if _, err := s.Hold(img.Layers); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("hold of a collected layer: %v, want not found", err)
		}
	})

	t.Run("a layer added again is held anew", func(t *testing.T) {
		diff, release := layer("again")
		again, release2 := layer("again")
		if again != diff {
			t.Fatalf("one tar, two diff IDs: %s %s", diff, again)
		}
		release()
		s.GC()
		if _, ok := s.haveLayer(diff); !ok {
			t.Fatal("a layer still held by its second AddLayer was collected")
		}
		release2()
		s.GC()
		if _, ok := s.haveLayer(diff); ok {
			t.Fatal("a layer nothing holds or names outlived a GC")
		}
	})
}
