// Command lifecycle benchmarks the RL lifecycle (not a test: it prints
// numbers and ratios measured side by side in one run): create from a warm
// pool vs. a cold create (p50/p99); fork N children from a prepared sandbox
// vs. N fresh creates that redo the preparation; a fast-forwarded (replayed)
// exec vs. the live exec it replaces; a burst of creates 10x over the node's
// start capacity (5xx count, and whether every accepted create works).
//
// Usage:
//
//	go run ./bench/lifecycle [-n 100] [-fork 32]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/bench/internal/result"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func main() {
	n := flag.Int("n", 100, "creates per pool measurement")
	forkN := flag.Int("fork", 32, "children per fork")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	ctx := context.Background()
	fmt.Printf("dsec lifecycle benchmark — %s\n\n", time.Now().Format(time.RFC3339))

	// Warm pool vs cold.
	srv := dsectest.Start(b, dsectest.Options{Args: []string{"--pool", "busybox:16"}})
	c := srv.Client()
	waitPool(ctx, c, 16)
	warm := createLatency(ctx, c, *n, dsec.CreateOptions{Image: "busybox"}, func() { waitPool(ctx, c, 16) })
	cold := createLatency(ctx, c, *n, dsec.CreateOptions{Image: "busybox", MemoryMB: 256}, nil) // another shape: no pool
	fmt.Printf("create from a warm pool: p50 %s p99 %s; cold create p50 %s p99 %s (%.1fx faster at p50)\n",
		pct(warm, 50), pct(warm, 99), pct(cold, 50), pct(cold, 99), float64(pct(cold, 50))/float64(pct(warm, 50)))

	// Fork vs fresh creates that redo the setup.
	const setup = "mkdir -p /repo && cd /repo && i=0; while [ $i -lt 400 ]; do echo file $i > f$i; i=$((i+1)); done; head -c 30000000 /dev/zero | sha256sum > sum"
	parent, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", MemoryMB: 256})
	if err != nil {
		fatal(err)
	}
	t0 := time.Now()
	if _, err := parent.Exec(ctx, dsec.Cmd(setup)); err != nil {
		fatal(err)
	}
	setupTime := time.Since(t0)
	t0 = time.Now()
	resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: parent.ID, Count: int32(*forkN)})
	if err != nil || resp.Failed > 0 {
		fatal(fmt.Errorf("fork: %v %v", err, resp.GetFailed()))
	}
	forkTime := time.Since(t0)
	c.Bulk(ctx, "delete", "dsec.io/fork-of="+parent.ID)
	t0 = time.Now()
	fresh, err := c.CreateMany(ctx, dsec.CreateOptions{Image: "busybox", MemoryMB: 256, Labels: map[string]string{"fresh": "1"}}, *forkN)
	if err != nil || fresh.Failed > 0 {
		fatal(fmt.Errorf("fresh: %v", err))
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for _, r := range fresh.Results {
		wg.Add(1)
		sem <- struct{}{}
		go func(id string) {
			defer wg.Done()
			defer func() { <-sem }()
			c.Sandbox(id).Exec(ctx, dsec.Cmd(setup))
		}(r.Sandbox.Id)
	}
	wg.Wait()
	freshTime := time.Since(t0)
	c.Bulk(ctx, "delete", "fresh=1")
	fmt.Printf("fork %d children of a prepared sandbox (setup took %s): %s total, %s per child; %d fresh creates + setup: %s (fork is %.1fx faster)\n",
		*forkN, setupTime.Round(time.Millisecond), forkTime.Round(time.Millisecond), (forkTime / time.Duration(*forkN)).Round(10*time.Microsecond),
		*forkN, freshTime.Round(time.Millisecond), float64(freshTime)/float64(forkTime))
	result.Emit(result.Row{Key: "fork.container", What: fmt.Sprintf("fork %d from a running container, per child", *forkN), Unit: "ms",
		Dsec: result.Ms(forkTime) / float64(*forkN), Baseline: result.Ms(freshTime) / float64(*forkN), BaselineName: "a fresh create + its setup"})

	// Fast-forward vs live.
	for _, cmd := range []string{"true", "head -c 20000000 /dev/zero | sha256sum"} {
		var live, replay []time.Duration
		for i := 0; i < 30; i++ {
			rid := "ff/" + strconv.Itoa(i) + "/" + cmd
			t := time.Now()
			if _, err := parent.Exec(ctx, dsec.ExecOptions{Cmd: cmd, RequestID: rid}); err != nil {
				fatal(err)
			}
			live = append(live, time.Since(t))
			t = time.Now()
			r, err := parent.Exec(ctx, dsec.ExecOptions{Cmd: cmd, RequestID: rid})
			if err != nil || !r.Replayed {
				fatal(fmt.Errorf("replay: %v", err))
			}
			replay = append(replay, time.Since(t))
		}
		fmt.Printf("fast-forward of %q: replayed p50 %s vs live p50 %s (%.1fx faster)\n", cmd, pct(replay, 50), pct(live, 50), float64(pct(live, 50))/float64(pct(replay, 50)))
		if cmd == "true" {
			result.Emit(result.Row{Key: "replay.p50", What: "fast-forward of a logged exec(true), p50", Unit: "ms",
				Dsec: result.Ms(pct(replay, 50)), Baseline: result.Ms(pct(live, 50)), BaselineName: "the live exec"})
		}
	}
	parent.Close()

	// Burst over capacity.
	burstSrv := dsectest.Start(b, dsectest.Options{Args: []string{"--max-starts", "4", "--start-queue", "16"}})
	bc := burstSrv.Client()
	const capacity = 4 + 16
	burst := 10 * capacity
	var mu sync.Mutex
	kinds := map[string]int{}
	var ok []string
	t0 = time.Now()
	for i := 0; i < burst; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := bc.Create(ctx, dsec.CreateOptions{Image: "busybox", Labels: map[string]string{"burst": "1"}})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				var e *dsec.Error
				k := "other"
				if errors.As(err, &e) {
					k = e.Kind
				}
				kinds[k]++
				return
			}
			ok = append(ok, sb.ID)
		}()
	}
	wg.Wait()
	took := time.Since(t0)
	working := 0
	for _, id := range ok {
		if _, err := bc.Sandbox(id).Exec(ctx, dsec.Cmd("true")); err == nil {
			working++
		}
	}
	fivexx := 0
	for k, v := range kinds {
		if k != "exhausted" {
			fivexx += v
		}
	}
	fmt.Printf("burst of %d creates (10x the %d the node starts or queues at once) in %s: %d accepted (%d work), %d refused with 429+Retry-After, %d other errors (5xx)\n",
		burst, capacity, took.Round(time.Millisecond), len(ok), working, kinds["exhausted"], fivexx)
	bc.Bulk(ctx, "delete", "burst=1")
}

func waitPool(ctx context.Context, c *dsec.Client, n int32) {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		if capy, err := c.Capacity(ctx); err == nil && len(capy.Pools) > 0 && capy.Pools[0].Ready >= n {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	fatal(fmt.Errorf("pool did not fill"))
}

// createLatency times creates (and deletes outside the timing); refill,
// if set, runs between creates so each one meets a full pool.
func createLatency(ctx context.Context, c *dsec.Client, n int, o dsec.CreateOptions, refill func()) []time.Duration {
	var lat []time.Duration
	for i := 0; i < n; i++ {
		if refill != nil && i%8 == 0 {
			refill()
		}
		t := time.Now()
		sb, err := c.Create(ctx, o)
		if err != nil {
			fatal(err)
		}
		lat = append(lat, time.Since(t))
		sb.Close()
	}
	return lat
}

func pct(d []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, len(s)*p/100)].Round(10 * time.Microsecond)
}

// fatal reports err and exits, leaving nothing behind (dsectest.Exit).
func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
