package verdicts

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

	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/substrate/container"
	"github.com/opendsec/dsec/internal/substrate/function"
	"github.com/opendsec/dsec/internal/tenant"
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if err := mountns.Enter(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	code := m.Run()
	if shared != nil {
		shared.Close()
		sharedCt.Close() // the user namespaces and disks it made ahead
	}
	os.RemoveAll(sharedDir)
	os.Exit(code)
}

var (
	once      sync.Once
	shared    *function.Driver
	sharedCt  *container.Driver // shared's workers'
	sharedDir string
	sharedErr error
)

// driver is a function driver over real workers of the polyglot image,
// shared by the package's tests (the image is imported once).
func driver(t *testing.T) *function.Driver {
	t.Helper()
	if testing.Short() {
		t.Skip("needs the polyglot image")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (function workers are containers)")
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		t.Skip("needs debootstrap for the polyglot worker image")
	}
	once.Do(func() { shared, sharedCt, sharedErr = start() })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	if !shared.Capabilities().Available {
		t.Skip(shared.Capabilities().Reason)
	}
	return shared
}

func start() (*function.Driver, *container.Driver, error) {
	dir, err := os.MkdirTemp("", "dsec-verdicts-")
	if err != nil {
		return nil, nil, err
	}
	sharedDir = dir
	guestBin := filepath.Join(dir, "dsec-guest")
	build := exec.Command("go", "build", "-o", guestBin, "github.com/opendsec/dsec/cmd/dsec-guest")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return nil, nil, fmt.Errorf("build dsec-guest: %v\n%s", err, out)
	}
	store, err := image.Open(filepath.Join(dir, "images"), slog.Default())
	if err != nil {
		return nil, nil, err
	}
	// Each phase logged as it starts (not the build's own output): the
	// import is this package's critical path on a fresh machine.
	last := ""
	progress := func(phase, msg string, done, total int64) {
		if phase != "build" || strings.HasPrefix(msg, "building ") {
			if phase+msg != last {
				last = phase + msg
				slog.Info("polyglot image", "phase", phase, "step", msg)
			}
		}
	}
	slog.Info("polyglot image: importing", "cache", os.Getenv("DSEC_CACHE_DIR"))
	if _, err := store.Bootstrap(tenant.System(context.Background()), "polyglot", "", image.BootstrapOptions{CacheDir: os.Getenv("DSEC_CACHE_DIR")}, progress); err != nil {
		return nil, nil, err
	}
	ct, err := container.New(container.Config{GuestBinary: guestBin, StateDir: filepath.Join(dir, "container")}, slog.Default())
	if err != nil {
		return nil, nil, err
	}
	d := function.New(function.Config{Image: "polyglot", StateDir: filepath.Join(dir, "function"), MaxWorkers: 2}, ct, store, slog.Default(), runtime.NumCPU())
	d.Start()
	return d, ct, nil
}
