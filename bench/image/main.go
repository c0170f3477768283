// Command image benchmarks how image layers are kept, side by side in one
// run (numbers, never pass/fail): two servers, one keeping layers as EROFS
// images (--image-layers erofs), one as unpacked directories (--image-layers
// dir), both bootstrapping the same image.
//
//	go run ./bench/image [-image debian] [-n 100] [-runs 3] [-hold 100]
//
// Measured:
//   - container create (to the agent's first answer) and its first exec,
//     p50/p90/p99 on each side, in alternating rounds;
//   - disk: the data directory's allocated bytes with -hold sandboxes of
//     the image held at once, per sandbox, on each side (shared layers:
//     flat in N);
//   - the store's own bytes for the image's layers on each side.
package main

import (
	"context"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/dsec/bench/internal/rawcrun"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

type side struct {
	name string
	srv  *dsectest.Server
	c    *dsec.Client
	// create and first exec latencies over every round
	create, exec []time.Duration
}

func main() {
	img := flag.String("image", "debian", "bootstrapped image to create sandboxes of")
	n := flag.Int("n", 100, "creates per side and round")
	runs := flag.Int("runs", 3, "rounds (alternating which side goes first)")
	hold := flag.Int("hold", 100, "sandboxes held at once for the disk row (0: skip)")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	ctx := context.Background()
	var sides []*side
	for _, format := range []string{"erofs", "dir"} {
		srv := dsectest.Start(b, dsectest.Options{Images: []string{*img}, Args: []string{"--image-layers", format, "--max-sandboxes", fmt.Sprint(max(*hold+16, 256))}})
		sides = append(sides, &side{name: format, srv: srv, c: srv.Client()})
	}
	fmt.Printf("dsec image layers benchmark — image %s, %s\n\n", *img, time.Now().Format(time.RFC3339))
	for _, s := range sides {
		fmt.Printf("%-6s the image's layers take %s in the store\n", s.name, mib(layerBytes(ctx, s, *img)))
	}
	fmt.Println()
	for r := 0; r < *runs; r++ {
		order := sides
		if r%2 == 1 {
			order = []*side{sides[1], sides[0]}
		}
		for _, s := range order {
			cycles(ctx, s, *img, *n)
		}
	}
	fmt.Printf("%-6s %30s %30s\n", "layers", "create p50 / p90 / p99", "first exec p50 / p90 / p99")
	for _, s := range sides {
		fmt.Printf("%-6s %30s %30s\n", s.name, rawcrun.Pcts(s.create), rawcrun.Pcts(s.exec))
	}
	e, d := rawcrun.Pct(sides[0].create, 50), rawcrun.Pct(sides[1].create, 50)
	fmt.Printf("create p50, EROFS images vs directories: %.2fx (below 1: images faster)\n", float64(e)/float64(d))

	if *hold > 0 {
		fmt.Println()
		for _, s := range sides {
			held(ctx, s, *img, *hold)
		}
	}
	for _, s := range sides {
		s.srv.Stop()
	}
}

// cycles creates n sandboxes of img one after another on s, each followed
// by its first exec and its delete, and records the create and exec times.
func cycles(ctx context.Context, s *side, img string, n int) {
	for i := 0; i < n; i++ {
		t0 := time.Now()
		sb, err := s.c.Create(ctx, dsec.CreateOptions{Image: img})
		if err != nil {
			fatal(fmt.Errorf("%s: create: %w", s.name, err))
		}
		t1 := time.Now()
		if _, err := sb.Exec(ctx, dsec.Argv("true")); err != nil {
			fatal(fmt.Errorf("%s: exec: %w", s.name, err))
		}
		s.create, s.exec = append(s.create, t1.Sub(t0)), append(s.exec, time.Since(t1))
		if err := sb.Close(); err != nil {
			fatal(fmt.Errorf("%s: delete: %w", s.name, err))
		}
	}
}

// held reports the data directory's allocated bytes before and with n
// sandboxes of img held on s, and per sandbox.
func held(ctx context.Context, s *side, img string, n int) {
	before := allocated(s.srv.DataDir)
	var sbs []*dsec.Sandbox
	for i := 0; i < n; i++ {
		sb, err := s.c.Create(ctx, dsec.CreateOptions{Image: img})
		if err != nil {
			fatal(fmt.Errorf("%s: create %d: %w", s.name, i, err))
		}
		sbs = append(sbs, sb)
	}
	with := allocated(s.srv.DataDir)
	fmt.Printf("%-6s disk: %s before, %s with %d sandboxes held: %s per sandbox\n",
		s.name, mib(before), mib(with), n, mib((with-before)/int64(n)))
	for _, sb := range sbs {
		if err := sb.Close(); err != nil {
			fatal(err)
		}
	}
}

// layerBytes is what the image's layers take in s's store.
func layerBytes(ctx context.Context, s *side, img string) int64 {
	imgs, err := s.c.ListImages(ctx)
	if err != nil {
		fatal(err)
	}
	for _, im := range imgs {
		if im.Name != img {
			continue
		}
		var total int64
		for _, l := range im.Layers {
			p := filepath.Join(s.srv.DataDir, "images", "layers", strings.TrimPrefix(l, "sha256:"))
			total += allocated(p) + allocated(p+".erofs")
		}
		return total
	}
	fatal(fmt.Errorf("%s: no image %s", s.name, img))
	return 0
}

// allocated is the bytes allocated to the files under path (each inode
// once; nothing under mounts below it: a sandbox's disk counts as its
// image file).
func allocated(path string) int64 {
	root, err := os.Lstat(path)
	if err != nil {
		return 0
	}
	dev := root.Sys().(*syscall.Stat_t).Dev
	seen := map[uint64]bool{}
	var total int64
	filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		st := info.Sys().(*syscall.Stat_t)
		if st.Dev != dev {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if !seen[st.Ino] {
			seen[st.Ino] = true
			total += st.Blocks * 512
		}
		return nil
	})
	return total
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// fatal reports err and exits, leaving nothing behind (dsectest.Exit).
func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
