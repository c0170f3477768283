package function

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/container"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if err := mountns.Enter(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

// TestConformance runs the parts of the suite that apply to a stateless
// kind: exec, concurrency, destroy; the rest is skipped by capability.
func TestConformance(t *testing.T) {
	if testing.Short() {
		t.Skip("needs the debian image")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (function workers are containers)")
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		t.Skip("needs debootstrap for the debian worker image")
	}
	dir := t.TempDir()
	guestBin := filepath.Join(dir, "dsec-guest")
	build := exec.Command("go", "build", "-o", guestBin, "github.com/opendsec/dsec/cmd/dsec-guest")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build dsec-guest: %v\n%s", err, out)
	}
	store, err := image.Open(filepath.Join(dir, "images"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	img, err := store.Bootstrap(context.Background(), "debian", "", image.BootstrapOptions{CacheDir: os.Getenv("DSEC_CACHE_DIR")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ct, err := container.New(container.Config{GuestBinary: guestBin, StateDir: filepath.Join(dir, "container")}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	d := New(Config{StateDir: filepath.Join(dir, "function"), Slots: 4, MaxWorkers: 1}, ct, store, slog.Default(), runtime.NumCPU())
	defer d.Close()
	if !d.Capabilities().Available {
		t.Skip(d.Capabilities().Reason)
	}
	n := 0
	substratetest.Run(t, substratetest.Harness{
		Driver: d,
		NewSpec: func(t *testing.T) *substrate.Spec {
			n++
			return &substrate.Spec{ID: fmt.Sprintf("f%d", n), Dir: t.TempDir(), Layers: store.LowerDirs(img), Env: []string{"DSEC_TEST=42"}}
		},
		SkipLimits: true, // per-call limits are tested through RunCode
	})
}
