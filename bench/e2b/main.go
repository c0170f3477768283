// Command e2b benchmarks the E2B facade against the native API, side by
// side on one server, and prints ratios (not a test: numbers, never
// pass/fail).
//
//	go run ./bench/e2b [-n 300] [-runs 3]
//
// Measured, in one running sandbox of the base image (the SDK's default
// template) per side, N sequential round trips of:
//   - commands.run('true') through the unmodified e2b JS SDK (Connect
//     server stream, JSON codec, HTTP/1.1): what E2B users get;
//   - the same call from a Go Connect client (JSON codec, HTTP/1.1), which
//     leaves out the JS SDK's own cost;
//   - the native API's Exec of the same command (/bin/bash -l -c true,
//     which is what commands.run runs), and of plain `true` for reference.
//
// The ratio reported against the target (≤ 1.5×) is E2B SDK p50 over native
// Exec p50 of the same command.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/dsec/api/e2b/process"
	"github.com/opendsec/dsec/api/e2b/process/processconnect"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

const key = "e2b_00112233445566778899aabbccddeeff00112233"

func main() {
	n := flag.Int("n", 300, "round trips per side and run")
	runs := flag.Int("runs", 3, "repetitions (sides alternate); medians are reported")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	srv := dsectest.Start(b, dsectest.Options{Images: []string{"debian", "base"}, APIKeys: []string{key}})
	ctx := context.Background()
	c := srv.Client()
	testDir := filepath.Join(repoRoot(), "test", "e2b")
	nodeBin, nodeEnv, why, ok := dsectest.NodeJS()
	if !ok {
		fatal(fmt.Errorf("%s", why))
	}
	if _, err := os.Stat(filepath.Join(testDir, "node_modules", "e2b")); err != nil {
		cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
		cmd.Dir, cmd.Env, cmd.Stdout, cmd.Stderr = testDir, nodeEnv, os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fatal(fmt.Errorf("npm ci in %s: %w", testDir, err))
		}
	}

	fmt.Printf("dsec E2B facade benchmark — %d CPUs, %s, %d round trips per side, %d runs\n\n", runtime.NumCPU(), time.Now().Format(time.RFC3339), *n, *runs)
	var sdk, goE2B, native, nativeTrue [][]time.Duration
	for r := 0; r < *runs; r++ {
		sides := []func(){
			func() { sdk = append(sdk, e2bSDK(srv, testDir, nodeBin, nodeEnv, *n)) },
			func() { goE2B = append(goE2B, e2bGo(ctx, srv, *n)) },
			func() { native = append(native, nativeExec(ctx, c, *n, "/bin/bash", "-l", "-c", "true")) },
			func() { nativeTrue = append(nativeTrue, nativeExec(ctx, c, *n, "true")) },
		}
		// Rotate the order so no side always runs on a warmer machine.
		for i := range sides {
			sides[(i+r)%len(sides)]()
		}
	}
	fmt.Printf("%-58s %10s %10s %10s %10s\n", "round trip (median of runs)", "p50", "p90", "p99", "mean")
	row := func(name string, runs [][]time.Duration) time.Duration {
		p50, p90, p99, mean := medianOf(runs, 50), medianOf(runs, 90), medianOf(runs, 99), medianMean(runs)
		fmt.Printf("%-58s %10s %10s %10s %10s\n", name, p50, p90, p99, mean)
		return p50
	}
	a := row("E2B: commands.run('true'), e2b JS SDK", sdk)
	g := row("E2B: process.Process/Start, Go Connect client (JSON)", goE2B)
	base := row("native: Exec /bin/bash -l -c true, Go SDK", native)
	row("native: Exec true, Go SDK (reference)", nativeTrue)
	fmt.Printf("\nratio E2B JS SDK / native, same command, p50: %.2fx (target ≤ 1.5x)\n", float64(a)/float64(base))
	fmt.Printf("ratio E2B Go client / native, same command, p50: %.2fx (the facade alone)\n", float64(g)/float64(base))
}

// e2bSDK times commands.run('true') through the JS SDK.
func e2bSDK(srv *dsectest.Server, dir, nodeBin string, nodeEnv []string, n int) []time.Duration {
	cmd := exec.Command(nodeBin, "bench.mjs")
	cmd.Dir = dir
	cmd.Env = append(append([]string(nil), nodeEnv...), "E2B_API_KEY="+key, "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "N="+strconv.Itoa(n), "TEMPLATE=base")
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		fatal(fmt.Errorf("node bench.mjs: %w", err))
	}
	var us []int64
	if err := json.Unmarshal(out, &us); err != nil {
		fatal(fmt.Errorf("bench.mjs printed %q: %w", out, err))
	}
	lat := make([]time.Duration, len(us))
	for i, u := range us {
		lat[i] = time.Duration(u) * time.Microsecond
	}
	return lat
}

// e2bGo times the same Start call the SDK makes, from a Go Connect client.
func e2bGo(ctx context.Context, srv *dsectest.Server, n int) []time.Duration {
	req, _ := http.NewRequest("POST", srv.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base","timeout":600}`))
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		fatal(err)
	}
	var sb struct{ SandboxID, EnvdAccessToken string }
	json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	defer func() {
		del, _ := http.NewRequest("DELETE", srv.URL+"/sandboxes/"+sb.SandboxID, nil)
		del.Header.Set("X-API-Key", key)
		if r, err := http.DefaultClient.Do(del); err == nil {
			r.Body.Close()
		}
	}()
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 8}}
	client := processconnect.NewProcessClient(hc, srv.URL, connect.WithProtoJSON())
	stdin := false
	var lat []time.Duration
	for i := 0; i < n+20; i++ {
		t0 := time.Now()
		r := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", "true"}}, Stdin: &stdin})
		r.Header().Set("E2b-Sandbox-Id", sb.SandboxID)
		r.Header().Set("X-Access-Token", sb.EnvdAccessToken)
		st, err := client.Start(ctx, r)
		if err != nil {
			fatal(err)
		}
		ended := false
		for st.Receive() {
			ended = ended || st.Msg().GetEvent().GetEnd() != nil
		}
		if err := st.Err(); err != nil || !ended {
			fatal(fmt.Errorf("start: ended %v: %v", ended, err))
		}
		st.Close()
		if i >= 20 {
			lat = append(lat, time.Since(t0))
		}
	}
	return lat
}

// nativeExec times Exec of argv through the native API.
func nativeExec(ctx context.Context, c *dsec.Client, n int, argv ...string) []time.Duration {
	sb, err := c.Create(ctx, dsec.CreateOptions{Image: "base"})
	if err != nil {
		fatal(err)
	}
	defer sb.Close()
	var lat []time.Duration
	for i := 0; i < n+20; i++ {
		t0 := time.Now()
		res, err := sb.Exec(ctx, dsec.Argv(argv...))
		if err != nil || res.ExitCode != 0 {
			fatal(fmt.Errorf("exec %v: %v %v", argv, res, err))
		}
		if i >= 20 {
			lat = append(lat, time.Since(t0))
		}
	}
	return lat
}

func pct(d []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, len(s)*p/100)]
}

func medianOf(runs [][]time.Duration, p int) time.Duration {
	var v []time.Duration
	for _, r := range runs {
		v = append(v, pct(r, p))
	}
	return pct(v, 50).Round(10 * time.Microsecond)
}

func medianMean(runs [][]time.Duration) time.Duration {
	var v []time.Duration
	for _, r := range runs {
		var sum time.Duration
		for _, d := range r {
			sum += d
		}
		v = append(v, sum/time.Duration(len(r)))
	}
	return pct(v, 50).Round(10 * time.Microsecond)
}

func repoRoot() string {
	dir, _ := os.Getwd()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
	}
	return dir
}

// fatal reports err and exits, leaving nothing behind (dsectest.Exit).
func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
