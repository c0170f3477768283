// Command dashboard measures how fast the web dashboard's pages load on a
// node holding many sandboxes (numbers, never pass/fail):
//
//	go run ./bench/dashboard [-n 5000] [-runs 5]
//
// In the distribution's headless Chromium, signed in with an API key, it
// times the first page (navigation to the overview until its numbers are
// drawn) and the sandboxes page (until its first rows are drawn), first
// beside one sandbox, then beside n idle ones, median of runs each.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

const key = "bench-dashboard-key-0123456789"

func main() {
	n := flag.Int("n", 5000, "idle sandboxes to hold")
	runs := flag.Int("runs", 5, "page loads per measurement; medians are reported")
	flag.Parse()
	chromium, err := exec.LookPath("chromium")
	if err != nil {
		fatal(fmt.Errorf("chromium is not installed (scripts/setup.sh installs it): %w", err))
	}
	b := dsectest.Program()
	defer b.Close()
	srv := dsectest.Start(b, dsectest.Options{APIKeys: []string{"bench=" + key}, Args: []string{"--max-sandboxes", strconv.Itoa(*n + 64)}})
	c := dsec.New(srv.URL, dsec.WithAPIKey(key))
	ctx := context.Background()

	// Chromium's profile and its singleton socket (made under TMPDIR) go in
	// a directory of the bench's, removed on every exit path.
	dir := b.TempDir()
	alloc, cancel := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1280, 900),
		chromedp.UserDataDir(filepath.Join(dir, "profile")), chromedp.Env("TMPDIR="+dir))...)
	defer cancel()
	browser, cancel := chromedp.NewContext(alloc)
	defer cancel()
	if err := chromedp.Do(browser, chromedp.Navigate(srv.URL+"/ui/"), chromedp.WaitVisible(chromedp.ID("key"))); err != nil {
		fatal(err)
	}
	if _, err := chromedp.Run(browser, chromedp.Evaluate[bool](`sessionStorage.setItem("dsec-api-key", "`+key+`"), true`)); err != nil {
		fatal(err)
	}

	fmt.Printf("dsec dashboard benchmark — %d CPUs, %s\n\n", runtime.NumCPU(), time.Now().Format(time.RFC3339))
	if _, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: 24 * time.Hour, Labels: map[string]string{"bench": "dashboard"}}); err != nil {
		fatal(err)
	}
	measure(browser, srv.URL, 1, *runs)

	start := time.Now()
	made := 1
	for made < *n {
		batch := min(100, *n-made)
		resp, err := c.CreateMany(ctx, dsec.CreateOptions{Image: "busybox", TTL: 24 * time.Hour, CPU: 0.1, MemoryMB: 64, Labels: map[string]string{"bench": "dashboard"}}, batch)
		if err != nil {
			fatal(err)
		}
		for _, r := range resp.Results {
			if r.Error != nil {
				fatal(fmt.Errorf("create: %s", r.Error.Message))
			}
		}
		before := made
		made += batch
		if made/1000 > before/1000 {
			fmt.Printf("  %d sandboxes after %s\n", made, time.Since(start).Round(time.Second))
		}
	}
	measure(browser, srv.URL, made, *runs)
	if _, err := c.Bulk(ctx, "delete", "bench=dashboard"); err != nil {
		fatal(err)
	}
}

// measure times the overview and the sandboxes page, runs times each.
func measure(browser context.Context, url string, sandboxes, runs int) {
	var first, list []time.Duration
	for range runs {
		start := time.Now()
		if err := chromedp.Do(browser, chromedp.Navigate(url+"/ui/#/"), chromedp.WaitVisible(chromedp.CSS("#running b"))); err != nil {
			fatal(err)
		}
		first = append(first, time.Since(start))
		start = time.Now()
		if err := chromedp.Do(browser, chromedp.Navigate(url+"/ui/#/sandboxes"), chromedp.WaitVisible(chromedp.CSS("#sandboxes tbody tr"))); err != nil {
			fatal(err)
		}
		list = append(list, time.Since(start))
		// A navigation that changes only the fragment loads nothing: leave
		// the page so the next run loads it afresh.
		if err := chromedp.Do(browser, chromedp.Navigate("about:blank")); err != nil {
			fatal(err)
		}
	}
	if err := chromedp.Do(browser, chromedp.Navigate(url+"/ui/#/"), chromedp.WaitVisible(chromedp.CSS("#running b"))); err != nil {
		fatal(err)
	}
	shown, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS("#running b")))
	if err != nil {
		fatal(err)
	}
	fmt.Printf("with %d sandboxes (the overview shows %s running): first page (overview) p50 %s max %s; sandboxes page (first 100 rows) p50 %s max %s\n",
		sandboxes, shown, p50(first), maxOf(first), p50(list), maxOf(list))
}

func p50(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2].Round(time.Millisecond)
}

func maxOf(d []time.Duration) time.Duration {
	m := d[0]
	for _, x := range d {
		m = max(m, x)
	}
	return m.Round(time.Millisecond)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
