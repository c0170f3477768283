// Command report runs the benchmarks behind issue 20's table in one go —
// the create cycle and exec round trip (bench/container), function calls
// (bench/function), fork and fast-forward (bench/lifecycle), time to first
// command (bench/burst) and microVMs (bench/microvm) — and prints every row
// beside the baseline its bench ran side by side with it, the speed against
// that baseline, and the target, as a table on stdout and, with -json, as
// JSON. Each bench's own output goes to stderr as it runs.
//
//	make bench-report          (or: go run ./bench/report -json report.json)
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/opendsec/dsec/bench/internal/result"
)

// bench is one benchmark program and the arguments the report runs it with.
type bench struct {
	name        string
	args, quick []string
}

var benches = []bench{
	{"container", []string{"-n", "60", "-par", "1,4", "-runs", "3", "-exec", "2000"}, []string{"-n", "10", "-par", "1,4", "-runs", "1", "-exec", "200"}},
	{"function", []string{"-languages=false", "-only", "python", "-n", "1000"}, []string{"-languages=false", "-only", "python", "-n", "100"}},
	{"lifecycle", []string{"-n", "50", "-fork", "32"}, []string{"-n", "10", "-fork", "8"}},
	{"burst", []string{"-runs", "1"}, []string{"-runs", "1", "-n", "20"}},
	{"microvm", []string{"-runs", "3", "-fork", "4", "-density", "0", "-settle", "5s"}, []string{"-runs", "1", "-fork", "2", "-density", "0", "-settle", "1s"}},
}

// target is issue 20's target for one row; met nil: shown without one.
type target struct {
	want string
	met  func(r result.Row) bool
}

var targets = map[string]target{
	"cycle.par1":       {"≥ 1.5× the raw loop", func(r result.Row) bool { return r.Dsec >= 1.5*r.Baseline }},
	"cycle.par4":       {"≥ 1.5× the raw loop", func(r result.Row) bool { return r.Dsec >= 1.5*r.Baseline }},
	"exec.p50":         {"≤ 1 ms and ≥ 10× faster", func(r result.Row) bool { return r.Dsec <= 1 && r.Baseline >= 10*r.Dsec }},
	"run_code.c1":      {"≥ 10× the baseline", func(r result.Row) bool { return r.Dsec >= 10*r.Baseline }},
	"run_code.c64":     {"≥ 1,000/s and ≥ 10×", func(r result.Row) bool { return r.Dsec >= 1000 && r.Dsec >= 10*r.Baseline }},
	"fork.container":   {"≤ 10 ms per child", func(r result.Row) bool { return r.Dsec <= 10 }},
	"replay.p50":       {"≤ 0.3 ms", func(r result.Row) bool { return r.Dsec <= 0.3 }},
	"burst.warm.burst": {"p99 ≤ 250 ms", func(r result.Row) bool { return r.Dsec <= 250 }},
	"burst.cold.burst": {"p99 ≤ 2 s", func(r result.Row) bool { return r.Dsec <= 2000 }},
	"microvm.boot":     {"≤ 1.2× the raw boot", func(r result.Row) bool { return r.Dsec <= 1.2*r.Baseline }},
	"microvm.restore":  {"≤ 1.5× the raw restore", func(r result.Row) bool { return r.Dsec <= 1.5*r.Baseline }},
	"microvm.fork":     {"≤ 150 ms per child", func(r result.Row) bool { return r.Dsec <= 150 }},
	"microvm.fork.pss": {"≤ 30 MiB", func(r result.Row) bool { return r.Dsec <= 30 }},
}

// line is one row of the report.
type line struct {
	Bench string `json:"bench"`
	result.Row
	// Speed is dsec's speed against the baseline: above 1, dsec is faster.
	Speed  float64 `json:"speed,omitempty"`
	Target string  `json:"target,omitempty"`
	Met    *bool   `json:"met,omitempty"`
}

type report struct {
	Date   string            `json:"date"`
	Commit string            `json:"commit"`
	CPUs   int               `json:"cpus"`
	Kernel string            `json:"kernel"`
	Rows   []line            `json:"rows"`
	Failed map[string]string `json:"failed,omitempty"`
}

func main() {
	out := flag.String("json", "", "also write the report here, as JSON")
	quick := flag.Bool("quick", false, "few iterations: checks that every bench runs, numbers too noisy to compare")
	skip := flag.String("skip", "", "comma-separated benches to leave out (container, function, lifecycle, burst, microvm)")
	flag.Parse()

	skipped := map[string]bool{}
	for _, s := range strings.Split(*skip, ",") {
		skipped[strings.TrimSpace(s)] = true
	}
	rep := report{Date: time.Now().UTC().Format(time.RFC3339), Commit: commit(), CPUs: runtime.NumCPU(), Kernel: kernel(), Failed: map[string]string{}}
	dir, err := os.MkdirTemp("", "dsec-bench-report")
	if err != nil {
		fatal(err)
	}
	defer os.RemoveAll(dir)
	for _, b := range benches {
		if skipped[b.name] {
			continue
		}
		args := b.args
		if *quick {
			args = b.quick
		}
		rows, err := run(b.name, args, filepath.Join(dir, b.name+".jsonl"))
		if err != nil {
			rep.Failed[b.name] = err.Error()
		}
		for _, r := range rows {
			rep.Rows = append(rep.Rows, judge(b.name, r))
		}
	}
	show(rep)
	if *out != "" {
		data, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(*out, append(data, '\n'), 0o644); err != nil {
			fatal(err)
		}
	}
	if len(rep.Failed) > 0 {
		os.Exit(1)
	}
}

// run runs one bench, its output to stderr, and reads the rows it emitted.
func run(name string, args []string, rows string) ([]result.Row, error) {
	fmt.Fprintf(os.Stderr, "\n=== bench/%s %s\n", name, strings.Join(args, " "))
	cmd := exec.Command("go", append([]string{"run", "./bench/" + name}, args...)...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.Env = append(os.Environ(), result.Env+"="+rows)
	runErr := cmd.Run()
	f, err := os.Open(rows)
	if err != nil {
		if runErr != nil {
			return nil, runErr
		}
		return nil, fmt.Errorf("it reported no rows")
	}
	defer f.Close()
	var out []result.Row
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r result.Row
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return out, fmt.Errorf("row %q: %w", sc.Text(), err)
		}
		out = append(out, r)
	}
	return out, runErr
}

// judge computes a row's speed against its baseline and its target's verdict.
func judge(name string, r result.Row) line {
	l := line{Bench: name, Row: r}
	if r.Baseline > 0 && r.Dsec > 0 {
		if r.Unit == "/s" {
			l.Speed = r.Dsec / r.Baseline
		} else {
			l.Speed = r.Baseline / r.Dsec
		}
	}
	if t, ok := targets[r.Key]; ok && t.met != nil {
		met := t.met(r)
		l.Target, l.Met = t.want, &met
	}
	return l
}

func show(rep report) {
	fmt.Printf("dsec benchmark report — %s, commit %s, %d CPUs, kernel %s\n", rep.Date, rep.Commit, rep.CPUs, rep.Kernel)
	fmt.Println("speed: dsec against the baseline run beside it (above 1: dsec is faster)")
	fmt.Println()
	fmt.Printf("%-58s %11s %11s %7s  %-24s %s\n", "path", "dsec", "baseline", "speed", "target", "")
	for _, l := range rep.Rows {
		base, speed := "", ""
		if l.Baseline > 0 {
			base = num(l.Baseline, l.Unit)
		}
		if l.Speed > 0 {
			speed = fmt.Sprintf("%.2f×", l.Speed)
		}
		verdict := ""
		if l.Met != nil {
			verdict = "not met"
			if *l.Met {
				verdict = "met"
			}
		}
		fmt.Printf("%-58s %11s %11s %7s  %-24s %s\n", l.What, num(l.Dsec, l.Unit), base, speed, l.Target, verdict)
	}
	fmt.Println()
	seen := map[string]bool{}
	for _, l := range rep.Rows {
		if l.BaselineName != "" && !seen[l.Bench+l.BaselineName] {
			seen[l.Bench+l.BaselineName] = true
			fmt.Printf("baseline (bench/%s): %s\n", l.Bench, l.BaselineName)
		}
	}
	for name, err := range rep.Failed {
		fmt.Printf("bench/%s failed: %s\n", name, err)
	}
}

func num(v float64, unit string) string {
	switch {
	case unit == "/s":
		return fmt.Sprintf("%.1f/s", v)
	case v >= 100:
		return fmt.Sprintf("%.0f %s", v, unit)
	default:
		return fmt.Sprintf("%.2f %s", v, unit)
	}
}

func commit() string {
	out, err := exec.Command("git", "describe", "--always", "--dirty").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

func kernel() string {
	b, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return strings.TrimSpace(string(b))
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "report:", err)
	os.Exit(1)
}
