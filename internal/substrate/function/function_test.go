package function

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
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

// TestInfraFailuresAreNeverVerdicts: what the platform lacks or breaks
// comes back as sandbox_error with infra set, never as a verdict on the
// program (a wrong reward).
func TestInfraFailuresAreNeverVerdicts(t *testing.T) {
	d, _, _ := newDriver(t, Config{Slots: 2, MaxWorkers: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	infra := func(t *testing.T, res *dsecv1.RunCodeResult, err error, mention string) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if res.Status != StatusSandbox || !res.Infra || !strings.Contains(res.Message, mention) {
			t.Fatalf("status %s infra %v message %q, want sandbox_error, infra, mentioning %q", res.Status, res.Infra, res.Message, mention)
		}
	}
	t.Run("a language whose toolchain the image lacks names it", func(t *testing.T) {
		res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "java", Code: "public class Main { public static void main(String[] a) {} }"})
		infra(t, res, err, "javac")
	})
	t.Run("a judged call in a language the image lacks", func(t *testing.T) {
		res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "rust", Code: "fn main(){}", Tests: []*dsecv1.TestCase{{ExpectedStdout: ""}}})
		infra(t, res, err, "rustc")
	})
	t.Run("a checker in a language the image lacks", func(t *testing.T) {
		res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)", Tests: []*dsecv1.TestCase{{ExpectedStdout: "1"}},
			Checker: &dsecv1.Checker{Language: "ruby", Code: "exit 0"}})
		infra(t, res, err, "ruby")
	})
	t.Run("a language no image of this build has", func(t *testing.T) {
		res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "julia", Code: "println(1)"})
		infra(t, res, err, "not packaged")
	})
	t.Run("an unknown language is the caller's error", func(t *testing.T) {
		_, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "cobol", Code: "x"})
		if !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("err %v, want invalid", err)
		}
	})
	t.Run("an image the caller names that is not here is the caller's error", func(t *testing.T) {
		_, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)", Image: "no-such-image"})
		if !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("err %v, want not_found", err)
		}
	})
	t.Run("the node's own image missing is infra", func(t *testing.T) {
		nd := New(Config{Image: "no-such-image", StateDir: t.TempDir()}, d.ct, d.images, slog.Default(), 1)
		defer nd.Close()
		res, err := nd.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"})
		infra(t, res, err, "no-such-image")
	})
	// Workers killed under calls: every attempt's worker dies, so the call
	// must come back as infra after its retry.
	kill := func(t *testing.T, how func(w *worker)) {
		t.Helper()
		p := d.poolFor(d.cfg.Image)
		stop := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			seen := map[*worker]bool{}
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				p.mu.Lock()
				var busy []*worker
				for _, w := range p.workers {
					for _, used := range w.slots {
						if used && !seen[w] {
							seen[w] = true
							busy = append(busy, w)
							break
						}
					}
				}
				p.mu.Unlock()
				for _, w := range busy {
					time.Sleep(300 * time.Millisecond) // the call is under way
					how(w)
				}
			}
		}()
		for _, tests := range [][]*dsecv1.TestCase{nil, {{ExpectedStdout: "5\n"}}} {
			res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "python", Code: "import time\ntime.sleep(3)\nprint(5)", Tests: tests})
			if err != nil {
				t.Fatal(err)
			}
			if res.Status != StatusSandbox || !res.Infra {
				t.Errorf("tests %d: status %s infra %v (%s), want sandbox_error with infra", len(tests), res.Status, res.Infra, res.Message)
			}
		}
		close(stop)
		<-done
	}
	t.Run("a worker killed mid-call is infra", func(t *testing.T) {
		kill(t, func(w *worker) { w.inst.Destroy(context.Background()) })
	})
	t.Run("a runner killed mid-call is infra", func(t *testing.T) {
		kill(t, func(w *worker) {
			w.inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"pkill", "-KILL", "-f", "runner.py"}, TimeoutMs: 5000})
		})
	})
	t.Run("the pool recovers", func(t *testing.T) {
		res, err := d.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "python", Code: "print(5)"})
		if err != nil || res.Status != StatusSuccess {
			t.Fatalf("after the kills: %v %v", res, err)
		}
	})
}
