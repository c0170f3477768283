package substratetest

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestFakeConformance: the fake passes the suite every driver passes, so
// tests written against it test what the real drivers do.
func TestFakeConformance(t *testing.T) {
	store, err := image.Open(filepath.Join(t.TempDir(), "images"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	img, err := store.Bootstrap(tenant.System(context.Background()), "busybox", "", image.BootstrapOptions{}, nil)
	if err != nil {
		t.Skipf("needs Debian's busybox-static: %v", err)
	}
	layers := substrate.ImageOf(store, img)
	n := 0
	Run(t, Harness{
		Driver: NewFake(substrate.KindContainer),
		NewSpec: func(t *testing.T) *substrate.Spec {
			n++
			return &substrate.Spec{
				ID: fmt.Sprintf("fake%d-%d", os.Getpid(), n), Dir: t.TempDir(), Image: layers,
				Hostname: "sandbox", Env: img.Config.Env,
			}
		},
		Restart:    func(t *testing.T) substrate.Driver { return NewFake(substrate.KindContainer) },
		Leaks:      func(t *testing.T, spec *substrate.Spec) []string { return FakeLeaks(spec) },
		Kill:       func(t *testing.T, inst substrate.Instance) { Crash(inst) },
		SkipLimits: true, // the fake enforces none
	})
}
