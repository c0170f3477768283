// Command image benchmarks how image layers are kept and loaded, side by
// side in one run (numbers, never pass/fail).
//
//	go run ./bench/image [-rows layers,tasks,ondemand] [-image debian] [-n 100] [-runs 3] [-hold 100]
//	                     [-tasks 100] [-big polyglot] [-first "python3 -c 'print(1)'"]
//
// Row "layers": two servers, one keeping layers as EROFS files
// (--image-layers erofs), one as unpacked directories (--image-layers
// dir), both bootstrapping -image:
//   - container create (to the agent's first answer) and its first exec,
//     p50/p90/p99 on each side, in alternating rounds;
//   - disk: the data directory's allocated bytes with -hold sandboxes of
//     the image held at once, per sandbox, on each side (shared layers:
//     flat in N);
//   - the store's own bytes for the image's layers on each side.
//
// Row "tasks": -tasks distinct task images over one base (-image), each
// its own workspace layer (a sandbox of the base that wrote its files,
// committed), created round-robin, against creates of the base alone:
// create→exec→delete per second, side by side in alternating rounds.
//
// Row "ondemand": a server bootstraps -big (polyglot: Debian with
// compilers, Python, Go, Node; about 3 GB) and pushes it to the
// distribution's registry on loopback twice, as an OCI image and on
// demand (--on-demand). Then, -runs times each, alternating, a fresh
// server (cold: no layer of it, the host's page cache dropped) pulls one
// of them, creates a sandbox and runs -first in it: time from the pull's
// start to the first command's answer, and the bytes the registry sent
// before it (counted by a proxy in front of the registry), against the
// image's size.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
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
	rows := flag.String("rows", "layers,tasks,ondemand", "rows to run: layers, tasks, ondemand")
	tasks := flag.Int("tasks", 100, "row tasks: distinct task images")
	img := flag.String("image", "debian", "row layers: bootstrapped image to create sandboxes of")
	n := flag.Int("n", 100, "row layers: creates per side and round")
	runs := flag.Int("runs", 3, "rounds (alternating which side goes first)")
	hold := flag.Int("hold", 100, "row layers: sandboxes held at once for the disk row (0: skip)")
	big := flag.String("big", "polyglot", "row ondemand: the bootstrapped image to push and pull")
	first := flag.String("first", "python3 -c 'import json, sqlite3; print(1)'", "row ondemand: the first command")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	ctx := context.Background()
	fmt.Printf("dsec image benchmark — %s\n\n", time.Now().Format(time.RFC3339))
	for _, row := range strings.Split(*rows, ",") {
		switch row {
		case "layers":
			layersRow(ctx, b, *img, *n, *runs, *hold)
		case "tasks":
			tasksRow(ctx, b, *img, *tasks, *n, *runs)
		case "ondemand":
			onDemandRow(ctx, b, *big, *first, *runs)
		default:
			fatal(fmt.Errorf("unknown row %q", row))
		}
		fmt.Println()
	}
}

// layersRow compares creates from EROFS layers and from directories.
func layersRow(ctx context.Context, b *dsectest.ProgramTB, img string, n, runs, hold int) {
	var sides []*side
	for _, format := range []string{"erofs", "dir"} {
		srv := dsectest.Start(b, dsectest.Options{Images: []string{img}, Args: []string{"--image-layers", format, "--max-sandboxes", fmt.Sprint(max(hold+16, 256))}})
		sides = append(sides, &side{name: format, srv: srv, c: srv.Client()})
	}
	fmt.Printf("layers: EROFS files vs directories, image %s\n", img)
	for _, s := range sides {
		fmt.Printf("%-6s the image's layers take %s in the store\n", s.name, mib(layerBytes(ctx, s, img)))
	}
	for r := 0; r < runs; r++ {
		order := sides
		if r%2 == 1 {
			order = []*side{sides[1], sides[0]}
		}
		for _, s := range order {
			cycles(ctx, s, img, n)
		}
	}
	fmt.Printf("%-6s %30s %30s\n", "layers", "create p50 / p90 / p99", "first exec p50 / p90 / p99")
	for _, s := range sides {
		fmt.Printf("%-6s %30s %30s\n", s.name, rawcrun.Pcts(s.create), rawcrun.Pcts(s.exec))
	}
	e, d := rawcrun.Pct(sides[0].create, 50), rawcrun.Pct(sides[1].create, 50)
	fmt.Printf("create p50, EROFS files vs directories: %.2fx (below 1: EROFS faster)\n", float64(e)/float64(d))
	if hold > 0 {
		for _, s := range sides {
			held(ctx, s, img, hold)
		}
	}
	for _, s := range sides {
		s.srv.Stop()
	}
}

// tasksRow compares creates of n distinct task images over base, round-
// robin, with creates of base alone.
func tasksRow(ctx context.Context, b *dsectest.ProgramTB, base string, tasks, n, runs int) {
	srv := dsectest.Start(b, dsectest.Options{Images: []string{base}})
	defer srv.Stop()
	c := srv.Client()
	var names []string
	t0 := time.Now()
	for i := 0; i < tasks; i++ {
		sb, err := c.Create(ctx, dsec.CreateOptions{Image: base})
		if err != nil {
			fatal(err)
		}
		if _, err := sb.Exec(ctx, dsec.Cmd(fmt.Sprintf("mkdir -p /workspace && seq %d > /workspace/task && echo task-%d > /workspace/README", 1000+i, i))); err != nil {
			fatal(err)
		}
		name := fmt.Sprintf("task-%03d", i)
		if _, err := c.CommitSandbox(ctx, sb.ID, name); err != nil {
			fatal(err)
		}
		sb.Close()
		names = append(names, name)
	}
	fmt.Printf("tasks: %d task images over %s made in %s\n", tasks, base, time.Since(t0).Round(time.Second))
	rate := func(images []string) float64 {
		start := time.Now()
		for i := 0; i < n; i++ {
			img := images[i%len(images)]
			sb, err := c.Create(ctx, dsec.CreateOptions{Image: img})
			if err != nil {
				fatal(fmt.Errorf("create %s: %w", img, err))
			}
			if _, err := sb.Exec(ctx, dsec.Argv("true")); err != nil {
				fatal(err)
			}
			if err := sb.Close(); err != nil {
				fatal(err)
			}
		}
		return float64(n) / time.Since(start).Seconds()
	}
	rate(names) // every task image's layers mounted once, as a warm node has them
	var one, many []float64
	for r := 0; r < runs; r++ {
		if r%2 == 0 {
			one, many = append(one, rate([]string{base})), append(many, rate(names))
		} else {
			many, one = append(many, rate(names)), append(one, rate([]string{base}))
		}
	}
	o, m := rawcrun.Median(one), rawcrun.Median(many)
	fmt.Printf("tasks: create→exec→delete %.1f/s over %d task images round-robin vs %.1f/s of %s alone: %.0f%%\n", m, tasks, o, base, 100*m/o)
}

// onDemandRow times a cold node's pull, create and first command of a
// big image, eager against on demand.
func onDemandRow(ctx context.Context, b *dsectest.ProgramTB, big, first string, runs int) {
	src := dsectest.Start(b, dsectest.Options{Images: []string{"busybox", big}})
	c := src.Client()
	reg := dsectest.StartRegistry(b, "", "")
	proxy := countingProxy(reg.Host)
	defer proxy.close()
	size := int64(0)
	imgs, err := c.ListImages(ctx)
	if err != nil {
		fatal(err)
	}
	for _, im := range imgs {
		if im.Name == big {
			size = im.SizeBytes
		}
	}
	refs := map[string]string{"eager": proxy.host + "/bench/" + big + ":oci", "on demand": proxy.host + "/bench/" + big + ":lazy"}
	for mode, ref := range refs {
		t0 := time.Now()
		if _, err := c.PushImage(ctx, &dsecv1.PushImageRequest{Name: big, Ref: ref, Insecure: true, OnDemand: mode == "on demand"}, nil); err != nil {
			fatal(fmt.Errorf("push %s: %w", mode, err))
		}
		fmt.Printf("ondemand: pushed %s %s in %s\n", big, mode, time.Since(t0).Round(time.Second))
	}
	src.Stop()
	fmt.Printf("ondemand: %s, %s of files; first command %q on a cold node\n", big, mib(size), first)
	type result struct {
		took []time.Duration
		sent []int64
	}
	results := map[string]*result{"eager": {}, "on demand": {}}
	for r := 0; r < runs; r++ {
		order := []string{"eager", "on demand"}
		if r%2 == 1 {
			order = []string{"on demand", "eager"}
		}
		for _, mode := range order {
			srv := dsectest.Start(b, dsectest.Options{Images: []string{"busybox"}})
			c := srv.Client()
			dropCaches()
			sent := proxy.sent.Load()
			t0 := time.Now()
			if _, err := c.PullImage(ctx, &dsecv1.PullImageRequest{Ref: refs[mode], Name: big, Insecure: true}, nil); err != nil {
				fatal(fmt.Errorf("pull %s: %w", mode, err))
			}
			sb, err := c.Create(ctx, dsec.CreateOptions{Image: big})
			if err != nil {
				fatal(fmt.Errorf("create from %s: %w", mode, err))
			}
			out, err := sb.Exec(ctx, dsec.Cmd(first))
			if err != nil || out.ExitCode != 0 {
				fatal(fmt.Errorf("first command on %s: %v %+v", mode, err, out))
			}
			res := results[mode]
			res.took = append(res.took, time.Since(t0))
			res.sent = append(res.sent, proxy.sent.Load()-sent)
			sb.Close()
			srv.Stop()
		}
	}
	fmt.Printf("%-10s %14s %22s\n", "pull", "to first cmd", "registry bytes before it")
	for _, mode := range []string{"eager", "on demand"} {
		res := results[mode]
		fmt.Printf("%-10s %14s %14s (%4.1f%%)\n", mode, rawcrun.Pct(res.took, 50), mib(median64(res.sent)), 100*float64(median64(res.sent))/float64(size))
	}
	e, l := rawcrun.Pct(results["eager"].took, 50), rawcrun.Pct(results["on demand"].took, 50)
	fmt.Printf("time to first command, eager vs on demand: %.2fx faster on demand\n", float64(e)/float64(l))
}

// proxy forwards to a registry and counts the bytes it answers with.
type proxy struct {
	host string
	sent atomic.Int64
	srv  *http.Server
}

func countingProxy(registry string) *proxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatal(err)
	}
	p := &proxy{host: l.Addr().String()}
	target, _ := url.Parse("http://" + registry)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ModifyResponse = func(r *http.Response) error {
		r.Body = &countingBody{ReadCloser: r.Body, n: &p.sent}
		return nil
	}
	p.srv = &http.Server{Handler: rp}
	go p.srv.Serve(l)
	return p
}

func (p *proxy) close() { p.srv.Close() }

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// dropCaches empties the host's page cache, so a cold node reads from disk
// or the network as a fresh machine would.
func dropCaches() {
	syscall.Sync()
	os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0)
}

func median64(v []int64) int64 {
	f := make([]float64, len(v))
	for i, x := range v {
		f[i] = float64(x)
	}
	return int64(rawcrun.Median(f))
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
			for _, suffix := range []string{"", ".erofs", ".blob", ".chunks"} {
				total += allocated(p + suffix)
			}
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
