package node

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestInfoSaysHowLayersAreKept: the node's info names the layer store's
// format, and where it is EROFS images a sandbox runs from them (the
// busybox layer is one image file, no unpacked directory).
func TestInfoSaysHowLayersAreKept(t *testing.T) {
	tn := newTestNode(t, nil)
	ok, why := tn.images.Erofs()
	want := "erofs"
	if !ok {
		want = "dir: " + why
	}
	if got := tn.Info(bg).Host["image_layers"]; got != want {
		t.Fatalf("info says image_layers %q, want %q", got, want)
	}
	if !ok {
		return
	}
	img, err := tn.images.Get("busybox")
	if err != nil {
		t.Fatal(err)
	}
	layer := filepath.Join(tn.images.Dir(), "layers", strings.TrimPrefix(img.Layers[0], "sha256:"))
	if _, err := os.Stat(layer + ".erofs"); err != nil {
		t.Fatalf("busybox's layer is not an image: %v", err)
	}
	if _, err := os.Stat(layer); !os.IsNotExist(err) {
		t.Fatalf("busybox's layer is unpacked beside its image: %v", err)
	}
	sb := tn.create(bg, nil)
	if out := tn.sh(bg, sb.Id, "echo hi > /tmp/f; cat /tmp/f; ls /bin/sh"); out != "hi\n/bin/sh\n" {
		t.Fatalf("a sandbox over the image's layer: %q", out)
	}
}
