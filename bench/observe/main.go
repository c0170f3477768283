// Command observe measures what observability costs and how fast events
// travel (numbers, never pass/fail):
//
//		go run ./bench/observe [-n 200] [-par 4] [-runs 3]
//
//	  - create→exec(true)→delete throughput of a server with metrics, history
//	    sampling, an event subscriber and a webhook, side by side with one
//	    with all of them off (--no-metrics --sample-every -1s, nobody
//	    subscribed), alternating, as a ratio;
//	  - the delay from a state change (the event's time) to its arrival at
//	    an SDK subscriber, p50/p99, at the create rate the machine reaches.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func main() {
	n := flag.Int("n", 200, "create→exec→delete cycles per side and run")
	par := flag.Int("par", 4, "cycles at once")
	runs := flag.Int("runs", 3, "repetitions; medians are reported")
	flag.Parse()
	b := dsectest.Program()
	defer b.Close()

	// A webhook receiver that accepts everything; for the webhook
	// registered through the API (path /api) it keeps each event's delay.
	var hooked atomic.Int64
	var hookMu sync.Mutex
	var hookDelays []time.Duration
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hooked.Add(1)
		if r.URL.Path == "/api" {
			var ev struct {
				At time.Time `json:"at"`
			}
			if json.NewDecoder(r.Body).Decode(&ev) == nil && !ev.At.IsZero() {
				hookMu.Lock()
				hookDelays = append(hookDelays, time.Since(ev.At))
				hookMu.Unlock()
			}
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer hook.Close()
	secret := filepath.Join(b.TempDir(), "hook.key")
	if err := os.WriteFile(secret, []byte("bench-secret"), 0o600); err != nil {
		fatal(err)
	}
	on := dsectest.Start(b, dsectest.Options{Args: []string{"--webhook", hook.URL, "--webhook-secret-file", secret}})
	off := dsectest.Start(b, dsectest.Options{Args: []string{"--no-metrics", "--sample-every", "-1s"}})
	ctx := context.Background()
	onC, offC := on.Client(), off.Client()
	if _, err := onC.CreateWebhook(ctx, dsec.WebhookOptions{URL: hook.URL + "/api", Secret: "bench-secret", Types: []string{"created", "ended"}}); err != nil {
		fatal(err)
	}

	// The "on" side has a subscriber, which measures delays as it reads.
	sub, err := onC.Subscribe(ctx, dsec.EventOptions{Types: []string{"created", "ended"}})
	if err != nil {
		fatal(err)
	}
	var mu sync.Mutex
	var delays []time.Duration
	go func() {
		for {
			ev, err := sub.Next()
			if err != nil {
				return
			}
			d := time.Since(ev.At.AsTime())
			mu.Lock()
			delays = append(delays, d)
			mu.Unlock()
		}
	}()

	fmt.Printf("dsec observability benchmark — %d CPUs, %s\n", runtime.NumCPU(), time.Now().Format(time.RFC3339))
	fmt.Printf("on: metrics, history sampling every 5 s, one event subscriber, a node's webhook and one registered through the API; off: none of them\n\n")
	var ratios, onRates, offRates []float64
	for r := 0; r < *runs; r++ {
		var a, o float64
		if r%2 == 0 {
			a, o = cycle(ctx, onC, *n, *par), cycle(ctx, offC, *n, *par)
		} else {
			o, a = cycle(ctx, offC, *n, *par), cycle(ctx, onC, *n, *par)
		}
		onRates, offRates, ratios = append(onRates, a), append(offRates, o), append(ratios, a/o)
	}
	fmt.Printf("create→exec→delete at %d at once: on %.1f/s, off %.1f/s, on/off %.3f (median of %d)\n",
		*par, median(onRates), median(offRates), median(ratios), *runs)
	time.Sleep(time.Second) // the last events
	mu.Lock()
	sort.Slice(delays, func(i, j int) bool { return delays[i] < delays[j] })
	fmt.Printf("event delay, state change to SDK subscriber: p50 %s p99 %s over %d events at %.1f creates/s\n",
		pct(delays, 50), pct(delays, 99), len(delays), median(onRates))
	mu.Unlock()
	hookMu.Lock()
	sort.Slice(hookDelays, func(i, j int) bool { return hookDelays[i] < hookDelays[j] })
	fmt.Printf("event delay, state change to the API-registered webhook's receiver: p50 %s p99 %s over %d deliveries\n",
		pct(hookDelays, 50), pct(hookDelays, 99), len(hookDelays))
	hookMu.Unlock()
	fmt.Printf("webhook deliveries: %d\n", hooked.Load())
	sub.Close()
}

// cycle runs n create→exec(true)→delete cycles, par at once, and returns
// cycles per second.
func cycle(ctx context.Context, c *dsec.Client, n, par int) float64 {
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range par {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox"})
				if err != nil {
					fatal(err)
				}
				if _, err := sb.Exec(ctx, dsec.Argv("true")); err != nil {
					fatal(err)
				}
				if err := sb.Close(); err != nil {
					fatal(err)
				}
			}
		}()
	}
	wg.Wait()
	return float64(n) / time.Since(start).Seconds()
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return d[min(len(d)-1, len(d)*p/100)].Round(10 * time.Microsecond)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
