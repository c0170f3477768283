// Package rawcrun is the benches' baseline for containers: what the host
// does with no dsec at all, the same busybox layers mounted as an overlay
// and run by `crun run` with crun's default spec. Benches run it side by
// side with dsec and report ratios.
package rawcrun

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// Baseline makes bundles over one set of lower layers.
type Baseline struct {
	dir     string
	lowers  string
	seq     atomic.Int64
	mounted []string // layers' EROFS images mounted for it (Beside)
}

// New makes bundles in dir over layers (topmost first).
func New(dir string, layers []string) *Baseline {
	return &Baseline{dir: dir, lowers: strings.Join(layers, ":")}
}

// Beside makes bundles in dir over the busybox layers of a running
// server (its client c, its data directory): the same directories, or
// the same EROFS images, each mounted once for the baseline as the
// server mounts it (Close unmounts them).
func Beside(ctx context.Context, c *dsec.Client, dataDir, dir string) (*Baseline, error) {
	layers, err := BusyboxLayers(ctx, c, dataDir)
	if err != nil {
		return nil, err
	}
	var mounted []string
	for i, l := range layers {
		if _, err := os.Stat(l + ".erofs"); err != nil {
			continue
		}
		target := filepath.Join(dir, fmt.Sprintf("layer-%d", i))
		if err := os.MkdirAll(target, 0o755); err != nil {
			return nil, err
		}
		opts := ""
		if _, err := os.Stat(l + ".blob"); err == nil {
			opts = "device=" + l + ".blob" // the layer's data
		}
		if err := unix.Mount(l+".erofs", target, "erofs", unix.MS_RDONLY, opts); err != nil {
			for _, m := range mounted {
				unix.Unmount(m, unix.MNT_DETACH)
			}
			return nil, fmt.Errorf("mount layer image %s: %w", l+".erofs", err)
		}
		mounted = append(mounted, target)
		layers[i] = target
	}
	r := New(dir, layers)
	r.mounted = mounted
	return r, nil
}

// Close unmounts the layer images Beside mounted (again: nothing).
func (r *Baseline) Close() {
	for _, m := range r.mounted {
		unix.Unmount(m, unix.MNT_DETACH)
	}
	r.mounted = nil
}

// Bundle makes an OCI bundle (crun's default spec, args as its process)
// whose root is mounted by Mount.
func (r *Baseline) Bundle(args []string) (string, error) {
	b := filepath.Join(r.dir, fmt.Sprintf("b%d", r.seq.Add(1)))
	for _, d := range []string{"rootfs", "upper", "work"} {
		if err := os.MkdirAll(filepath.Join(b, d), 0o755); err != nil {
			return "", err
		}
	}
	out, err := exec.Command("crun", "spec", "--bundle", b).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("crun spec: %v %s", err, out)
	}
	var spec map[string]any
	cfg := filepath.Join(b, "config.json")
	raw, err := os.ReadFile(cfg)
	if err != nil {
		return "", err
	}
	if err := json.Unmarshal(raw, &spec); err != nil {
		return "", err
	}
	p := spec["process"].(map[string]any)
	p["terminal"] = false
	p["args"] = args
	spec["root"] = map[string]any{"path": filepath.Join(b, "rootfs")}
	raw, _ = json.Marshal(spec)
	return b, os.WriteFile(cfg, raw, 0o644)
}

// Mount mounts a fresh overlay (empty upper) at b's root.
func (r *Baseline) Mount(b string) error {
	for _, d := range []string{"upper", "work"} {
		os.RemoveAll(filepath.Join(b, d))
		if err := os.MkdirAll(filepath.Join(b, d), 0o755); err != nil {
			return err
		}
	}
	data := "lowerdir=" + r.lowers + ",upperdir=" + filepath.Join(b, "upper") + ",workdir=" + filepath.Join(b, "work")
	if err := unix.Mount("overlay", filepath.Join(b, "rootfs"), "overlay", 0, data); err != nil {
		return fmt.Errorf("mount overlay: %w", err)
	}
	return nil
}

// Unmount unmounts b's root.
func (r *Baseline) Unmount(b string) { unix.Unmount(filepath.Join(b, "rootfs"), 0) }

// Run mounts b's root, runs its process to its end with crun as container
// id, and unmounts: one create→run→delete.
func (r *Baseline) Run(b, id string) error {
	if err := r.Mount(b); err != nil {
		return err
	}
	defer r.Unmount(b)
	if out, err := exec.Command("crun", "run", "--bundle", b, id).CombinedOutput(); err != nil {
		return fmt.Errorf("crun run: %v %s", err, out)
	}
	return nil
}

// Cycle runs `true` n times, par at once, and returns the rate.
func (r *Baseline) Cycle(n, par int) (float64, error) {
	var next atomic.Int64
	bundles := make([]string, par)
	for i := range bundles {
		b, err := r.Bundle([]string{"true"})
		if err != nil {
			return 0, err
		}
		bundles[i] = b
	}
	start := time.Now()
	var wg sync.WaitGroup
	var first atomic.Value
	for w := 0; w < par; w++ {
		wg.Add(1)
		go func(b string) {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(n) || first.Load() != nil {
					return
				}
				if err := r.Run(b, fmt.Sprintf("raw%d-%d", os.Getpid(), i)); err != nil {
					first.CompareAndSwap(nil, err)
				}
			}
		}(bundles[w])
	}
	wg.Wait()
	if err, _ := first.Load().(error); err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// ExecLatency times n `crun exec true` in one running container.
func (r *Baseline) ExecLatency(n int) (p50, p99 time.Duration, err error) {
	b, err := r.Bundle([]string{"sleep", "1000"})
	if err != nil {
		return 0, 0, err
	}
	if err := r.Mount(b); err != nil {
		return 0, 0, err
	}
	defer r.Unmount(b)
	id := fmt.Sprintf("rawexec%d", os.Getpid())
	// The detached container inherits crun's stdio: a pipe would never close.
	if err := exec.Command("crun", "run", "--detach", "--bundle", b, id).Run(); err != nil {
		return 0, 0, fmt.Errorf("crun run -d: %v", err)
	}
	defer exec.Command("crun", "delete", "--force", id).Run()
	var lat []time.Duration
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if out, err := exec.Command("crun", "exec", id, "true").CombinedOutput(); err != nil {
			return 0, 0, fmt.Errorf("crun exec: %v %s", err, out)
		}
		lat = append(lat, time.Since(t0))
	}
	return Pct(lat, 50), Pct(lat, 99), nil
}

// BusyboxLayers are the busybox image's layers in a server's data
// directory, topmost first: each a directory, or beside its EROFS image
// (the path plus ".erofs").
func BusyboxLayers(ctx context.Context, c *dsec.Client, dataDir string) ([]string, error) {
	imgs, err := c.ListImages(ctx)
	if err != nil {
		return nil, err
	}
	for _, img := range imgs {
		if img.Name == "busybox" {
			var out []string
			for i := len(img.Layers) - 1; i >= 0; i-- {
				out = append(out, filepath.Join(dataDir, "images", "layers", strings.TrimPrefix(img.Layers[i], "sha256:")))
			}
			return out, nil
		}
	}
	return nil, fmt.Errorf("no busybox image")
}

// Pct is the p-th percentile of d.
func Pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, len(s)*p/100)].Round(10 * time.Microsecond)
}

// Pcts is p50 / p90 / p99 of d.
func Pcts(d []time.Duration) string {
	return fmt.Sprintf("%s / %s / %s", Pct(d, 50), Pct(d, 90), Pct(d, 99))
}

// Median is the median of v.
func Median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}
