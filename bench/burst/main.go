// Command burst measures time to first command, the way users now compare
// sandbox providers: n sandboxes asked for at once, each followed by its
// first command (exec `true`), timed from its request to the command's
// answer. The same n arrivals are also spread evenly over -stagger, and
// made one after another. Each pattern runs cold (every create starts a
// container) and from a warm pool of n, and beside each the host's own
// floor for the same arrivals: an overlay of the same busybox layers and
// `crun run true` (bench/internal/rawcrun). Numbers, never pass/fail.
//
//	go run ./bench/burst [-n 100] [-runs 3] [-stagger 2s] [-json out.json]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/opendsec/dsec/bench/internal/rawcrun"
	"github.com/opendsec/dsec/bench/internal/result"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// outcome is one pattern's numbers, as printed and written to -json.
type outcome struct {
	Start   string  `json:"start"` // cold or warm
	Pattern string  `json:"pattern"`
	N       int     `json:"n"`
	DsecP50 float64 `json:"dsec_p50_ms"`
	DsecP99 float64 `json:"dsec_p99_ms"`
	RawP50  float64 `json:"raw_p50_ms"`
	RawP99  float64 `json:"raw_p99_ms"`
	Failed  int     `json:"failed"`
}

func main() {
	n := flag.Int("n", 100, "sandboxes per pattern")
	runs := flag.Int("runs", 3, "repetitions of each pattern; percentiles are over all of them")
	stagger := flag.Duration("stagger", 2*time.Second, "the staggered pattern spreads its arrivals over this long")
	out := flag.String("json", "", "also write the results here, as JSON")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()

	fmt.Printf("dsec burst benchmark: time from create to the answer of the first command — %d sandboxes, %d runs, %s\n",
		*n, *runs, time.Now().Format(time.RFC3339))
	fmt.Printf("floor: overlay of the same layers + `crun run true` for the same arrivals\n\n")
	fmt.Printf("%-5s %-11s %24s %24s %8s %s\n", "start", "pattern", "dsec p50 / p99", "floor p50 / p99", "p99 ×", "failed")
	patterns := []struct {
		name, words string
		offset      func(i int) time.Duration // -1: after the previous one's answer
	}{
		{"burst", "at once", func(int) time.Duration { return 0 }},
		{"staggered", "over " + stagger.String(), func(i int) time.Duration { return time.Duration(i) * *stagger / time.Duration(*n) }},
		{"sequential", "one after another", func(int) time.Duration { return -1 }},
	}
	var results []outcome
	for _, start := range []string{"cold", "warm"} {
		args := []string{"--max-sandboxes", strconv.Itoa(*n*2 + 64)}
		if start == "warm" {
			args = append(args, "--pool", fmt.Sprintf("busybox:%d", *n))
		}
		srv := dsectest.Start(b, dsectest.Options{Args: args})
		c := srv.Client()
		ctx := context.Background()
		raw, err := rawcrun.Beside(ctx, c, srv.DataDir, b.TempDir())
		if err != nil {
			fatal(err)
		}
		b.Cleanup(raw.Close) // on any exit: before the temporary directories go
		bundles := make([]string, *n)
		for i := range bundles {
			if bundles[i], err = raw.Bundle([]string{"true"}); err != nil {
				fatal(err)
			}
		}
		for _, p := range patterns {
			var dl, rl []time.Duration
			failed := 0
			for r := 0; r < *runs; r++ {
				if start == "warm" {
					waitPool(ctx, c, *n)
				}
				d, f := arrivals(*n, p.offset, func(int) error { return firstCommand(ctx, c) })
				dl, failed = append(dl, d...), failed+f
				deleteAll(ctx, c)
				// The floor's create and first command: a fresh overlay and
				// `crun run true`, with its unmount (the floor has no cheaper
				// way to end its container; dsec's deletes are not timed).
				w, f := arrivals(*n, p.offset, func(i int) error {
					return raw.Run(bundles[i], fmt.Sprintf("burst%d-%d-%s", os.Getpid(), r, filepath.Base(bundles[i])))
				})
				if f > 0 {
					fatal(fmt.Errorf("the floor failed %d times", f))
				}
				rl = append(rl, w...)
			}
			res := outcome{Start: start, Pattern: p.name, N: *n, Failed: failed,
				DsecP50: ms(rawcrun.Pct(dl, 50)), DsecP99: ms(rawcrun.Pct(dl, 99)), RawP50: ms(rawcrun.Pct(rl, 50)), RawP99: ms(rawcrun.Pct(rl, 99))}
			results = append(results, res)
			result.Emit(result.Row{Key: "burst." + start + "." + p.name, What: fmt.Sprintf("time to first command, %s start, %d %s, p99", start, *n, p.words),
				Unit: "ms", Dsec: res.DsecP99, Baseline: res.RawP99, BaselineName: "overlay + crun run true, same arrivals"})
			fmt.Printf("%-5s %-11s %24s %24s %7.2fx %d\n", start, p.name,
				fmt.Sprintf("%s / %s", rawcrun.Pct(dl, 50), rawcrun.Pct(dl, 99)),
				fmt.Sprintf("%s / %s", rawcrun.Pct(rl, 50), rawcrun.Pct(rl, 99)),
				res.DsecP99/res.RawP99, failed)
		}
		raw.Close()
		srv.Stop()
	}
	if *out != "" {
		data, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(*out, data, 0o644); err != nil {
			fatal(err)
		}
	}
}

// arrivals runs f for i in [0, n), each at offset(i) from the start (or,
// where offset is negative, after the previous one returned), and returns
// each one's duration from its arrival and how many failed.
func arrivals(n int, offset func(int) time.Duration, f func(int) error) ([]time.Duration, int) {
	lat := make([]time.Duration, 0, n)
	var mu sync.Mutex
	failed := 0
	one := func(i int) {
		t0 := time.Now()
		err := f(i)
		d := time.Since(t0)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			if failed == 0 {
				fmt.Fprintln(os.Stderr, "bench:", err)
			}
			failed++
			return
		}
		lat = append(lat, d)
	}
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		off := offset(i)
		if off < 0 {
			one(i)
			continue
		}
		time.Sleep(time.Until(start.Add(off)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			one(i)
		}()
	}
	wg.Wait()
	return lat, failed
}

// firstCommand creates a sandbox and runs its first command.
func firstCommand(ctx context.Context, c *dsec.Client) error {
	sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Labels: map[string]string{"bench": "burst"}})
	if err != nil {
		return err
	}
	_, err = sb.Exec(ctx, dsec.Argv("true"))
	return err
}

// deleteAll deletes the run's sandboxes.
func deleteAll(ctx context.Context, c *dsec.Client) {
	list, err := c.List(ctx, "bench=burst")
	if err != nil {
		fatal(err)
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, sb := range list {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := c.Sandbox(sb.Id).Close(); err != nil {
				fatal(err)
			}
		}()
	}
	wg.Wait()
}

// waitPool waits until the warm pool holds n sandboxes.
func waitPool(ctx context.Context, c *dsec.Client, n int) {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		capa, err := c.Capacity(ctx)
		if err != nil {
			fatal(err)
		}
		ready := 0
		for _, p := range capa.Pools {
			ready += int(p.Ready)
		}
		if ready >= n {
			return
		}
		if time.Now().After(deadline) {
			fatal(fmt.Errorf("the warm pool holds %d of %d after 5 minutes", ready, n))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// fatal reports err and exits, leaving nothing behind (dsectest.Exit).
func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
