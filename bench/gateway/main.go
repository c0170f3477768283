// Command gateway benchmarks the model gateway (not a test: it prints
// numbers measured side by side in one run). One load generator
// (bench/gateway/client, a static binary) calls a deterministic model
// server (gatewaytest.Model) directly from the host, and the same binary
// calls it from inside sandboxes through their gateway (agent listener,
// node, upstream, trajectory record):
//
//   - sequential non-streamed chat completions: p50 and p99 of each path
//     and the p50 the gateway adds (target: <= 2 ms);
//   - concurrent streaming calls (default 500, spread over 10 sandboxes,
//     each stream 20 chunks 50 ms apart): how many complete, and their
//     time, beside the same number straight to the model (target: all
//     500 on one 2-core node).
//
// Usage:
//
//	go run ./bench/gateway [-n 1000] [-runs 3] [-streams 500] [-sandboxes 10]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/gateway/gatewaytest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

type result struct {
	Calls     int     `json:"calls"`
	Failed    int     `json:"failed"`
	Latencies []int64 `json:"latencies_us"`
	FirstErr  string  `json:"first_error"`
}

func main() {
	n := flag.Int("n", 1000, "sequential calls per path and run")
	runs := flag.Int("runs", 3, "side-by-side runs of the sequential measurement")
	streams := flag.Int("streams", 500, "concurrent streaming calls")
	sandboxes := flag.Int("sandboxes", 10, "sandboxes the streaming calls come from")
	chunks := flag.Int("chunks", 20, "chunks per stream")
	delay := flag.Duration("chunk-delay", 50*time.Millisecond, "pause before each chunk")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	ctx := context.Background()
	model := gatewaytest.NewModel(b)
	bin := filepath.Join(b.TempDir(), "client")
	build := exec.Command("go", "build", "-o", bin, "./bench/gateway/client")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		fatal(fmt.Errorf("build the client: %v\n%s", err, out))
	}
	client, err := os.ReadFile(bin)
	if err != nil {
		fatal(err)
	}

	srv := dsectest.Start(b, dsectest.Options{Images: []string{"busybox"}})
	c := srv.Client()
	if _, err := c.OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: "bench", HeartbeatS: 3600, GraceS: 86400}); err != nil {
		fatal(err)
	}
	if _, err := c.SetModelUpstreams(ctx, &dsecv1.SetModelUpstreamsRequest{Session: "bench",
		Upstreams: []*dsecv1.ModelUpstream{{Name: "model", BaseUrl: model.URL, Models: []string{"policy"}}},
		Limits:    &dsecv1.ModelLimits{PerSandboxConcurrent: int32(*streams)}}); err != nil {
		fatal(err)
	}
	sbs := make([]*dsec.Sandbox, *sandboxes)
	for i := range sbs {
		sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Session: "bench", ModelGateway: true, CPU: 2, MemoryMB: 1024})
		if err != nil {
			fatal(err)
		}
		defer sb.Close()
		if _, err := sb.WriteFile(ctx, "/client", strings.NewReader(string(client)), 0o755); err != nil {
			fatal(err)
		}
		sbs[i] = sb
	}
	inside := func(sb *dsec.Sandbox, args string) result {
		r, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "/client " + args + ` "$OPENAI_BASE_URL"`, Timeout: 30 * time.Minute})
		if err != nil {
			fatal(err)
		}
		return parse(r.Stdout, r.Stderr)
	}
	outside := func(args ...string) result {
		out, err := exec.Command(bin, append(args, model.URL)...).Output()
		if err != nil {
			fatal(fmt.Errorf("client on the host: %v", err))
		}
		return parse(out, nil)
	}

	fmt.Printf("sequential chat completions, %d per path and run (p50 / p99, µs):\n", *n)
	var added []float64
	for run := 1; run <= *runs; run++ {
		d := outside("seq", fmt.Sprint(*n))
		g := inside(sbs[0], fmt.Sprintf("seq %d", *n))
		dp50, gp50 := pct(d.Latencies, 50), pct(g.Latencies, 50)
		added = append(added, float64(gp50-dp50)/1000)
		fmt.Printf("  run %d: direct %d / %d, through the gateway %d / %d (failed %d); the gateway adds %.2f ms at p50\n",
			run, dp50, pct(d.Latencies, 99), gp50, pct(g.Latencies, 99), g.Failed, float64(gp50-dp50)/1000)
	}
	sort.Float64s(added)
	fmt.Printf("  added p50, median of runs: %.2f ms (target <= 2 ms)\n", added[len(added)/2])

	model.Set(func(m *gatewaytest.Model) { m.Chunks, m.ChunkDelay = *chunks, *delay })
	fmt.Printf("\n%d concurrent streaming calls (%d chunks %s apart):\n", *streams, *chunks, *delay)
	start := time.Now()
	d := outside("streams", fmt.Sprint(*streams))
	fmt.Printf("  direct: %d of %d complete in %s, p50 %d ms, p99 %d ms%s\n", d.Calls-d.Failed, d.Calls, time.Since(start).Round(time.Millisecond),
		pct(d.Latencies, 50)/1000, pct(d.Latencies, 99)/1000, errNote(d))
	per := *streams / *sandboxes
	var mu sync.Mutex
	var all result
	var wg sync.WaitGroup
	start = time.Now()
	for _, sb := range sbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := inside(sb, fmt.Sprintf("streams %d", per))
			mu.Lock()
			all.Calls += r.Calls
			all.Failed += r.Failed
			all.Latencies = append(all.Latencies, r.Latencies...)
			if all.FirstErr == "" {
				all.FirstErr = r.FirstErr
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	fmt.Printf("  through the gateway, %d sandboxes x %d: %d of %d complete in %s, p50 %d ms, p99 %d ms%s\n", *sandboxes, per, all.Calls-all.Failed, all.Calls,
		time.Since(start).Round(time.Millisecond), pct(all.Latencies, 50)/1000, pct(all.Latencies, 99)/1000, errNote(all))
}

func parse(out, stderr []byte) result {
	var r result
	if err := json.Unmarshal(out, &r); err != nil {
		fatal(fmt.Errorf("client output %q: %v (stderr %s)", out, err, stderr))
	}
	return r
}

func pct(us []int64, p int) int64 {
	if len(us) == 0 {
		return 0
	}
	s := append([]int64(nil), us...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, len(s)*p/100)]
}

func errNote(r result) string {
	if r.FirstErr == "" {
		return ""
	}
	return "; first error: " + r.FirstErr
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench/gateway:", err)
	dsectest.Exit(1)
}
