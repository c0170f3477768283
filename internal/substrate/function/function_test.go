package function

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/container"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
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
	d, store, img := newDriver(t, Config{Slots: 4, MaxWorkers: 1})
	n := 0
	substratetest.Run(t, substratetest.Harness{
		Driver: d,
		NewSpec: func(t *testing.T) *substrate.Spec {
			n++
			return &substrate.Spec{ID: fmt.Sprintf("f%d", n), Dir: t.TempDir(), Image: substrate.ImageOf(store, img), Env: []string{"DSEC_TEST=42"}}
		},
		SkipLimits: true, // per-call limits are tested through RunCode
	})
}

// newDriver starts a driver with cfg over real containers of the debian
// image, or skips.
func newDriver(t *testing.T, cfg Config) (*Driver, *image.Store, *image.Image) {
	t.Helper()
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
	img, err := store.Bootstrap(tenant.System(context.Background()), "debian", "", image.BootstrapOptions{CacheDir: os.Getenv("DSEC_CACHE_DIR")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ct, err := container.New(container.Config{GuestBinary: guestBin, StateDir: filepath.Join(dir, "container")}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ct.Close)
	cfg.StateDir = filepath.Join(dir, "function")
	d := New(cfg, ct, store, slog.Default(), runtime.NumCPU())
	t.Cleanup(d.Close)
	if !d.Capabilities().Available {
		t.Skip(d.Capabilities().Reason)
	}
	return d, store, img
}

// TestPoolGrowsWhenCallsWait: calls that wait GrowAfter for a slot start
// another worker; calls that get a slot sooner do not.
func TestPoolGrowsWhenCallsWait(t *testing.T) {
	// GrowAfter far above a call's ~10 ms, so a busy machine's slow call is
	// not taken for a wait.
	d, _, _ := newDriver(t, Config{Slots: 1, MaxWorkers: 2, GrowAfter: 3 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	calls := func(code string, n int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "bash", Code: code})
				if err == nil && res.Status != "success" {
					err = fmt.Errorf("status %v", res.Status)
				}
				errs <- err
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	calls("true", 1) // the first worker
	p := d.poolFor(d.cfg.Image)
	calls("true", 2) // the second waits for the first's ~10 ms, not 3 s
	if n := poolSize(p); n != 1 {
		t.Fatalf("%d workers after calls that waited briefly, want 1", n)
	}
	calls("sleep 6", 2) // the second waits past GrowAfter
	if n := poolSize(p); n != 2 {
		t.Fatalf("%d workers after a call waited %v, want 2", n, d.cfg.GrowAfter)
	}
}

// TestCloseEndsWorkersStillStarting: a worker that starts while the driver
// closes is destroyed, not left running.
func TestCloseEndsWorkersStillStarting(t *testing.T) {
	d, _, _ := newDriver(t, Config{MaxWorkers: 1})
	p := d.poolFor(d.cfg.Image)
	p.grow()
	workers := filepath.Join(d.cfg.StateDir, "workers")
	deadline := time.Now().Add(time.Minute)
	for {
		ents, _ := os.ReadDir(workers)
		if len(ents) == 1 && poolSize(p) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no worker started")
		}
		time.Sleep(time.Millisecond)
	}
	d.Close()
	if ents, _ := os.ReadDir(workers); len(ents) != 0 {
		t.Fatalf("%d workers left after Close", len(ents))
	}
}

// poolSize is p's workers, started and starting.
func poolSize(p *pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.workers) + p.starting
}
