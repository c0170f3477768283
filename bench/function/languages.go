package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/substrate/function"
	"github.com/opendsec/dsec/test/verdicts"
)

// runCode posts one call to the native API (Connect JSON).
func runCode(url string, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, time.Duration, error) {
	body, _ := protojson.Marshal(req)
	t := time.Now()
	resp, err := http.Post(url+"/dsec.v1.FunctionService/RunCode", "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return nil, 0, fmt.Errorf("%s: %s", resp.Status, b)
	}
	var out dsecv1.RunCodeResult
	if err := protojsonUnmarshal(b, &out); err != nil {
		return nil, 0, err
	}
	return &out, time.Since(t), nil
}

// languages measures each language's right program (the verdict suite's)
// as function calls on the polyglot image, beside a fresh-process baseline:
// the same compile and run commands in a new bubblewrap sandbox of the
// same root filesystem per call (SandboxFusion's way: a process tree per
// call, nothing warm).
func languages(url string, n, conc int) {
	root := polyglotRoot()
	fmt.Printf("per language, %d calls of the right program (\"2 3\" → 5) at %d callers; baseline: compile and run in a fresh bwrap sandbox of the same image per call\n", n, conc)
	fmt.Printf("%-14s %10s %10s %14s %8s\n", "language", "dsec/s", "p50", "baseline/s", "ratio")
	tsjs := filepath.Join(os.TempDir(), fmt.Sprintf("dsec-bench-ts-%d.js", os.Getpid()))
	for p, b := range function.Helpers() {
		if strings.HasSuffix(p, "ts.js") {
			os.WriteFile(tsjs, b, 0o644)
		}
	}
	defer os.Remove(tsjs)
	for _, p := range verdicts.Corpus {
		req := &dsecv1.RunCodeRequest{Language: p.Lang, Code: p.OK, Stdin: "2 3\n", Image: "polyglot", CompileTimeoutS: 120, RunTimeoutS: 60}
		call := func() (time.Duration, error) {
			res, d, err := runCode(url, req)
			if err != nil {
				return 0, err
			}
			if res.Status != "success" {
				return 0, fmt.Errorf("%s: %s %s", p.Lang, res.Status, res.Message)
			}
			return d, nil
		}
		call() // a warm worker
		rate, lat := load(n, conc, call)
		brate := 0.0
		if root != "" {
			brate, _ = load(max(n/3, 4), conc, func() (time.Duration, error) { return baseline(root, tsjs, p) })
		}
		fmt.Printf("%-14s %10.1f %10s %14.1f %7.1fx\n", p.Lang, rate, pct(lat, 50), brate, rate/brate)
	}
	fmt.Println()
}

func polyglotRoot() string {
	m, _ := filepath.Glob(filepath.Join(os.Getenv("DSEC_CACHE_DIR"), "rootfs", "polyglot-*.complete"))
	if len(m) == 0 {
		fmt.Println("(no cached polyglot root filesystem in DSEC_CACHE_DIR: no baseline)")
		return ""
	}
	return strings.TrimSuffix(m[0], ".complete")
}

func baseline(root, tsjs string, p verdicts.Program) (time.Duration, error) {
	src, compile, run, env, ok := function.Recipe(p.Lang, p.OK)
	if !ok {
		return 0, fmt.Errorf("no recipe for %s", p.Lang)
	}
	t := time.Now()
	work, err := os.MkdirTemp("", "dsec-bench-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(work)
	os.WriteFile(filepath.Join(work, src), []byte(p.OK), 0o644)
	os.WriteFile(filepath.Join(work, "stdin"), []byte("2 3\n"), 0o644)
	script := ""
	if compile != nil {
		script = shellJoin(compile) + " && "
	}
	script += shellJoin(run) + " < stdin"
	args := []string{"--ro-bind", root, "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", work, "/tmp/w",
		"--tmpfs", "/run", "--ro-bind", tsjs, "/run/dsec-fn/lib/ts.js", "--unshare-all", "--die-with-parent", "--chdir", "/tmp/w",
		"--setenv", "HOME", "/tmp/w", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8"}
	for _, e := range env {
		k, v, _ := strings.Cut(e, "=")
		args = append(args, "--setenv", k, v)
	}
	args = append(args, "/bin/sh", "-c", script)
	out, err := exec.Command("bwrap", args...).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("baseline %s: %v\n%s", p.Lang, err, out)
	}
	return time.Since(t), nil
}

func shellJoin(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

// judge measures a special-judge call's fan-out: 20 test cases of a C++
// program judged by a Python checker, where one case is slow, against the
// same call with that case alone; and the same with every case slow (the
// two cores are then the bound).
func judge(url string) {
	prog := `#include <cstdio>
int main(){ long n; scanf("%ld", &n); volatile long s = 0; for (long i = 0; i < n; i++) s += i; printf("%ld 1\n", n > 1 ? 1 : 0); }
`
	checker := "import sys\nn = int(open(sys.argv[1]).read())\na, b = map(int, open(sys.argv[3]).read().split())\nsys.exit(0 if (a, b) == ((1 if n > 1 else 0), 1) else 1)\n"
	mk := func(ns []int) *dsecv1.RunCodeRequest {
		r := &dsecv1.RunCodeRequest{Language: "cpp", Code: prog, Image: "polyglot", RunTimeoutS: 30, CompileTimeoutS: 60,
			Checker: &dsecv1.Checker{Language: "python", Code: checker}}
		for _, n := range ns {
			r.Tests = append(r.Tests, &dsecv1.TestCase{Stdin: fmt.Sprint(n), ExpectedStdout: "1 1"})
		}
		return r
	}
	const slow, fast = 600_000_000, 2_000_000
	var mixed []int
	for i := 0; i < 19; i++ {
		mixed = append(mixed, fast)
	}
	mixed = append(mixed, slow)
	var allSlow []int
	for i := 0; i < 20; i++ {
		allSlow = append(allSlow, slow/10)
	}
	measure := func(r *dsecv1.RunCodeRequest) time.Duration {
		best := time.Duration(1 << 62)
		for i := 0; i < 3; i++ {
			res, d, err := runCode(url, r)
			if err != nil || res.Status != "success" {
				fatal(fmt.Errorf("judge call: %v %v", res, err))
			}
			best = min(best, d)
		}
		return best
	}
	fmt.Println("special judge (C++ program, Python checker), best of 3:")
	one, twenty := measure(mk([]int{slow})), measure(mk(mixed))
	fmt.Printf("  the slowest case alone %s; 20 cases (19 fast, that one slow) %s: %.2fx (target ≤ 1.5x)\n", one.Round(time.Millisecond), twenty.Round(time.Millisecond), float64(twenty)/float64(one))
	one, twenty = measure(mk([]int{slow / 10})), measure(mk(allSlow))
	fmt.Printf("  one case alone %s; 20 equal cases %s: %.2fx (CPU-bound cases share 2 cores: the compile once, then 20 runs over 2 cores)\n", one.Round(time.Millisecond), twenty.Round(time.Millisecond), float64(twenty)/float64(one))
	fmt.Println()
}
