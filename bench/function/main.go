// Command function benchmarks function calls (not a test: it prints
// numbers and ratios measured side by side in one run): Python
// `print(sum(range(1000)))` through SandboxFusion-compatible POST /run_code at
// 1 and 64 concurrent callers, vs. a SandboxFusion-style baseline that starts
// a fresh python3 under bubblewrap per call; and a 1,000-call batch of mixed
// languages with 10% broken programs (every result's classification, and
// infra errors).
//
// With -languages (the default) it also measures every other language's
// calls/s on the polyglot image beside a fresh-process baseline, and a
// special-judge call's fan-out over its test cases.
//
// Usage:
//
//	go run ./bench/function [-n 2000] [-c 64] [-languages=false] [-only python|languages|judge]
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/bench/internal/result"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
)

const program = "print(sum(range(1000)))"

func main() {
	n := flag.Int("n", 2000, "calls per measurement")
	conc := flag.Int("c", 64, "concurrent callers")
	config := flag.String("config", "", "a `dsec serve` config file (e.g. function slots and workers)")
	langs := flag.Bool("languages", true, "measure every language on the polyglot image (bootstraps it)")
	ln := flag.Int("ln", 24, "calls per language")
	only := flag.String("only", "", "run only this part: python, languages or judge")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	var args []string
	if *config != "" {
		args = []string{"--config", *config}
	}
	images := []string{"debian"}
	if *langs {
		images = append(images, "polyglot")
	}
	srv := dsectest.Start(b, dsectest.Options{Images: images, Args: args})
	if *langs && (*only == "" || *only == "languages") {
		languages(srv.URL, *ln, 4)
	}
	if *langs && (*only == "" || *only == "judge") {
		judge(srv.URL)
	}
	if *only != "" && *only != "python" {
		return
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 256}}
	call := func() (time.Duration, error) {
		t := time.Now()
		resp, err := hc.Post(srv.URL+"/run_code", "application/json", bytes.NewReader([]byte(`{"code":"`+program+`","language":"python"}`)))
		if err != nil {
			return 0, err
		}
		var out struct {
			Status    string `json:"status"`
			RunResult struct {
				Stdout string `json:"stdout"`
			} `json:"run_result"`
		}
		err = json.NewDecoder(resp.Body).Decode(&out)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || out.Status != "Success" || out.RunResult.Stdout != "499500\n" {
			return 0, fmt.Errorf("bad answer %+v %v", out, err)
		}
		return time.Since(t), nil
	}
	// Warm up the workers at the highest concurrency measured, so the pool
	// has grown to it: the measurements are of a warm pool.
	load(1000, *conc, call)
	fmt.Printf("dsec function benchmark — %s\n\n", time.Now().Format(time.RFC3339))
	bw, err := exec.LookPath("bwrap")
	if err != nil {
		fatal(fmt.Errorf("the baseline needs bubblewrap (apt-get install bubblewrap)"))
	}
	baseline := func() (time.Duration, error) {
		t := time.Now()
		out, err := exec.Command(bw, "--ro-bind", "/usr", "/usr", "--ro-bind", "/lib", "/lib", "--ro-bind", "/lib64", "/lib64", "--ro-bind", "/bin", "/bin",
			"--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--unshare-all", "--die-with-parent", "--chdir", "/tmp",
			"/usr/bin/python3", "-c", program).Output()
		if err != nil || string(out) != "499500\n" {
			return 0, fmt.Errorf("baseline: %q %v", out, err)
		}
		return time.Since(t), nil
	}
	fmt.Println("python print(sum(range(1000))):")
	fmt.Printf("%-10s %12s %10s %10s %14s %8s\n", "callers", "dsec/s", "p50", "p99", "bwrap python/s", "ratio")
	for _, c := range []int{1, *conc} {
		rate, lat := load(*n, c, call)
		brate, _ := load(max(*n/5, 50), min(c, 8*2), baseline)
		fmt.Printf("%-10d %12.0f %10s %10s %14.0f %7.1fx\n", c, rate, pct(lat, 50), pct(lat, 99), brate, rate/brate)
		who := fmt.Sprintf("%d callers", c)
		if c == 1 {
			who = "1 caller"
		}
		result.Emit(result.Row{Key: fmt.Sprintf("run_code.c%d", c), What: "run_code python, " + who,
			Unit: "/s", Dsec: rate, Baseline: brate, BaselineName: "a fresh python in bubblewrap"},
			result.Row{Key: fmt.Sprintf("run_code.c%d.p99", c), What: "run_code python, " + who + ", p99", Unit: "ms", Dsec: result.Ms(pct(lat, 99))})
	}
	fmt.Println("(the baseline runs with at most 16 in parallel: more only queues on 2 cores)")

	fmt.Println()
	mixed(srv.URL)
}

// load runs n calls with c callers and returns calls/s and latencies.
func load(n, c int, f func() (time.Duration, error)) (float64, []time.Duration) {
	var next atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < c; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				d, err := f()
				if err != nil {
					fatal(err)
				}
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return float64(n) / time.Since(start).Seconds(), lat
}

func mixed(url string) {
	type item struct {
		req  *dsecv1.RunCodeRequest
		want string
	}
	var items []item
	for i := 0; i < 1000; i++ {
		var it item
		switch k := i % 10; {
		case k == 9:
			it = item{&dsecv1.RunCodeRequest{Language: "python", Code: "def f(:\n"}, "runtime_error"}
		case k == 8:
			it = item{&dsecv1.RunCodeRequest{Language: "cpp", Code: "int main( {"}, "compile_error"}
		case k == 7:
			it = item{&dsecv1.RunCodeRequest{Language: "c", Code: fmt.Sprintf("#include <stdio.h>\nint main(){printf(\"%%d\\n\", %d);}", i)}, "success"}
		case k%2 == 0:
			it = item{&dsecv1.RunCodeRequest{Language: "python", Code: fmt.Sprintf("print(%d)", i), Tests: []*dsecv1.TestCase{{ExpectedStdout: fmt.Sprint(i)}}}, "success"}
		default:
			it = item{&dsecv1.RunCodeRequest{Language: "bash", Code: fmt.Sprintf("echo %d", i)}, "success"}
		}
		items = append(items, it)
	}
	// One wrong answer in every 20 calls, judged.
	for i := 3; i < len(items); i += 20 {
		items[i] = item{&dsecv1.RunCodeRequest{Language: "python", Code: "print('nope')", Tests: []*dsecv1.TestCase{{ExpectedStdout: "yes"}}}, "wrong_answer"}
	}
	var calls []*dsecv1.RunCodeRequest
	for _, it := range items {
		calls = append(calls, it.req)
	}
	body, _ := json.Marshal(map[string]any{"calls": calls})
	t := time.Now()
	resp, err := http.Post(url+"/dsec.v1.FunctionService/RunCodeBatch", "application/json", bytes.NewReader(body))
	if err != nil {
		fatal(err)
	}
	var out struct {
		Results []struct {
			Status string `json:"status"`
			Infra  bool   `json:"infra"`
		} `json:"results"`
	}
	json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	took := time.Since(t)
	wrong, infra, broken := 0, 0, 0
	for i, r := range out.Results {
		if r.Infra {
			infra++
		}
		if r.Status != items[i].want {
			wrong++
		}
		if items[i].want != "success" {
			broken++
		}
	}
	fmt.Printf("mixed batch of %d calls (python, bash, c, cpp; %d broken or wrong): %s, %d misclassified, %d infra errors\n",
		len(out.Results), broken, took.Round(time.Millisecond), wrong, infra)
	_ = context.Background
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

func protojsonUnmarshal(b []byte, m *dsecv1.RunCodeResult) error {
	return protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, m)
}
