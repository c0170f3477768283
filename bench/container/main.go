// Command container benchmarks the container substrate through the API,
// side by side with a raw crun loop on the same root filesystem, and
// prints ratios (not a test: numbers, never pass/fail).
//
//	go run ./bench/container [-n 200] [-par 1,2,4,8] [-runs 3] [-idle 1000] [-profile dir]
//
// Measured:
//   - create→exec(true)→delete through the API vs. mount overlay + `crun run
//     true` + umount (crun's default spec), at the same parallelism;
//   - exec(true) round trip in a running sandbox vs. `crun exec`;
//   - host memory per idle sandbox with -idle N sandboxes held at once, and
//     the CPU the host and the server spend while they idle;
//   - with -profile, the server's CPU profile and execution trace under a
//     sequential create→exec→delete loop (where the create path's time goes).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/bench/internal/rawcrun"
	"github.com/opendsec/dsec/bench/internal/result"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func main() {
	n := flag.Int("n", 200, "iterations per parallelism level and side")
	pars := flag.String("par", "1,2,4,8", "parallelism levels")
	runs := flag.Int("runs", 3, "repetitions; medians are reported")
	idle := flag.Int("idle", 0, "also hold this many idle sandboxes and report memory per sandbox")
	execN := flag.Int("exec", 500, "exec round trips to time")
	pool := flag.Int("pool", 0, "serve creates from a warm pool of this size (0: cold creates)")
	profile := flag.String("profile", "", "also profile the server under a sequential create→exec→delete loop, after the measurements: a CPU profile and an execution trace (go tool trace -pprof=syscall: its off-CPU time) in this directory")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	args := []string{"--max-sandboxes", strconv.Itoa(max(*idle+64, 4096))}
	if *pool > 0 {
		args = append(args, "--pool", fmt.Sprintf("busybox:%d", *pool))
	}
	metricsAddr := freeAddr()
	args = append(args, "--metrics-listen", metricsAddr)
	debug := ""
	if *profile != "" {
		debug = freeAddr()
		args = append(args, "--debug-listen", debug)
	}
	srv := dsectest.Start(b, dsectest.Options{Args: args})
	c := srv.Client()
	ctx := context.Background()
	raw, err := rawcrun.Beside(ctx, c, srv.DataDir, b.TempDir())
	if err != nil {
		fatal(err)
	}
	b.Cleanup(raw.Close) // before the temporary directories go, on any exit

	fmt.Printf("dsec container benchmark — %d CPUs, %s\n", runtimeCPUs(), time.Now().Format(time.RFC3339))
	fmt.Printf("raw baseline: mount overlay of the same busybox layers + `crun run` (crun's default spec) of `true` + umount\n")
	fmt.Printf("dsec side: warm pool of %d (0 = every create starts a container)\n\n", *pool)
	fmt.Printf("%-4s %12s %12s %7s   %s\n", "par", "dsec/s", "raw/s", "ratio", "dsec latency p50/p90/p99 (create→exec→delete)")
	for _, ps := range strings.Split(*pars, ",") {
		par, _ := strconv.Atoi(ps)
		var ratios, ds, rs []float64
		var lat []time.Duration
		for r := 0; r < *runs; r++ {
			// Alternate order so neither side always runs on a warmer machine.
			var d, w float64
			var l []time.Duration
			var err error
			if r%2 == 0 {
				d, l = cycleAPI(ctx, c, *n, par)
				w, err = raw.Cycle(*n, par)
			} else {
				w, err = raw.Cycle(*n, par)
				d, l = cycleAPI(ctx, c, *n, par)
			}
			if err != nil {
				fatal(err)
			}
			ds, rs, ratios = append(ds, d), append(rs, w), append(ratios, d/w)
			lat = append(lat, l...)
		}
		fmt.Printf("%-4d %12.1f %12.1f %6.2fx   %s\n", par, rawcrun.Median(ds), rawcrun.Median(rs), rawcrun.Median(ratios), rawcrun.Pcts(lat))
		result.Emit(result.Row{Key: fmt.Sprintf("cycle.par%d", par), What: fmt.Sprintf("create→exec→delete, %d in parallel", par),
			Unit: "/s", Dsec: rawcrun.Median(ds), Baseline: rawcrun.Median(rs), BaselineName: "overlay + crun run + umount"})
	}

	before := phases(b, metricsAddr)
	fmt.Println("sequential cycle:", breakdown(ctx, c, 50))
	fmt.Println("  its creates on the node (mean):", phaseDelta(before, phases(b, metricsAddr)))
	fmt.Println()
	d50, d99 := execAPI(ctx, c, *execN)
	r50, r99, err := raw.ExecLatency(*execN / 5)
	if err != nil {
		fatal(err)
	}
	fmt.Printf("exec(true) round trip: dsec p50 %s p99 %s; crun exec p50 %s p99 %s; dsec is %.1fx faster at p50\n",
		d50, d99, r50, r99, float64(r50)/float64(d50))
	result.Emit(result.Row{Key: "exec.p50", What: "exec(true) round trip, p50", Unit: "ms", Dsec: result.Ms(d50), Baseline: result.Ms(r50), BaselineName: "crun exec"},
		result.Row{Key: "exec.p99", What: "exec(true) round trip, p99", Unit: "ms", Dsec: result.Ms(d99), Baseline: result.Ms(r99), BaselineName: "crun exec"})

	if *idle > 0 {
		fmt.Println()
		idleDensity(ctx, c, *idle)
	}
	if *profile != "" {
		fmt.Println()
		profileServer(ctx, c, debug, *profile)
	}
}

// profileServer takes the server's CPU profile (10 s) and then its
// execution trace (3 s), each while a sequential create→exec→delete loop
// runs, into dir; then the same (exec-cpu.pprof, exec.trace) while a
// sequential exec(true) loop runs in one sandbox.
func profileServer(ctx context.Context, c *dsec.Client, debug, dir string) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fatal(err)
	}
	profileUnder(debug, dir, "server", "create→exec→delete cycles", func() { cycleAPI(ctx, c, 1, 1) })
	sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox"})
	if err != nil {
		fatal(err)
	}
	defer sb.Close()
	profileUnder(debug, dir, "exec", "exec(true) round trips", func() {
		if _, err := sb.Exec(ctx, dsec.Argv("true")); err != nil {
			fatal(err)
		}
	})
}

// profileUnder takes the server's CPU profile and execution trace into
// dir (<name>-cpu.pprof, <name>.trace) while work runs again and again.
func profileUnder(debug, dir, name, what string, work func()) {
	for _, p := range []struct{ file, url string }{
		{name + "-cpu.pprof", "http://" + debug + "/debug/pprof/profile?seconds=10"},
		{name + ".trace", "http://" + debug + "/debug/pprof/trace?seconds=3"},
	} {
		done := make(chan error, 1)
		go func() {
			resp, err := http.Get(p.url)
			if err != nil {
				done <- err
				return
			}
			defer resp.Body.Close()
			f, err := os.Create(filepath.Join(dir, p.file))
			if err == nil {
				_, err = io.Copy(f, resp.Body)
				f.Close()
			}
			done <- err
		}()
		cycles := 0
		for running := true; running; {
			select {
			case err := <-done:
				if err != nil {
					fatal(err)
				}
				running = false
			default:
				work()
				cycles++
			}
		}
		fmt.Printf("profile: %s over %d %s\n", filepath.Join(dir, p.file), cycles, what)
	}
}

// phases scrapes the server's create-phase histograms (series name →
// value: each phase's _sum and _count for container sandboxes).
func phases(b dsectest.TB, addr string) map[string]float64 {
	code, text, samples := dsectest.Scrape(b, "http://"+addr, "")
	if code != http.StatusOK {
		fatal(fmt.Errorf("scrape %s: %d %s", addr, code, text))
	}
	return samples
}

// phaseDelta is each phase's mean between two scrapes, and the
// container driver's steps inside the instance phase.
func phaseDelta(a, b map[string]float64) string {
	mean := func(name, label string, values []string) string {
		var parts []string
		for _, v := range values {
			series := fmt.Sprintf(`{kind="container",%s=%q}`, label, v)
			n := b[name+"_count"+series] - a[name+"_count"+series]
			if n <= 0 {
				continue
			}
			d := time.Duration((b[name+"_sum"+series] - a[name+"_sum"+series]) / n * float64(time.Second))
			parts = append(parts, fmt.Sprintf("%s %s", v, d.Round(10*time.Microsecond)))
		}
		return strings.Join(parts, ", ")
	}
	return mean("dsec_sandbox_create_phase_duration_seconds", "phase", []string{"wait", "network", "instance", "commit"}) +
		"; instance: " + mean("dsec_sandbox_start_step_duration_seconds", "step", []string{"prepare", "mount", "files", "cgroups", "spec", "runtime", "init"})
}

// freeAddr is a loopback address with a port free now.
func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func cycleAPI(ctx context.Context, c *dsec.Client, n, par int) (float64, []time.Duration) {
	var next atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < par; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				t0 := time.Now()
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
				mu.Lock()
				lat = append(lat, time.Since(t0))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return float64(n) / time.Since(start).Seconds(), lat
}

// breakdown times each step of a sequential cycle.
func breakdown(ctx context.Context, c *dsec.Client, n int) string {
	var cr, ex, de []time.Duration
	for i := 0; i < n; i++ {
		t0 := time.Now()
		sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox"})
		if err != nil {
			fatal(err)
		}
		t1 := time.Now()
		if _, err := sb.Exec(ctx, dsec.Argv("true")); err != nil {
			fatal(err)
		}
		t2 := time.Now()
		sb.Close()
		cr, ex, de = append(cr, t1.Sub(t0)), append(ex, time.Since(t1)-time.Since(t2)), append(de, time.Since(t2))
	}
	result.Emit(result.Row{Key: "create.p50", What: "create alone (sequential cycle), p50", Unit: "ms", Dsec: result.Ms(rawcrun.Pct(cr, 50))})
	return fmt.Sprintf("create %s, exec %s, delete %s (p50)", rawcrun.Pct(cr, 50), rawcrun.Pct(ex, 50), rawcrun.Pct(de, 50))
}

func execAPI(ctx context.Context, c *dsec.Client, n int) (p50, p99 time.Duration) {
	sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox"})
	if err != nil {
		fatal(err)
	}
	defer sb.Close()
	var lat []time.Duration
	for i := 0; i < n+20; i++ {
		t0 := time.Now()
		if _, err := sb.Exec(ctx, dsec.Argv("true")); err != nil {
			fatal(err)
		}
		if i >= 20 {
			lat = append(lat, time.Since(t0))
		}
	}
	return rawcrun.Pct(lat, 50), rawcrun.Pct(lat, 99)
}

func idleDensity(ctx context.Context, c *dsec.Client, n int) {
	before := memAvailable()
	start := time.Now()
	ids := make([]*dsec.Sandbox, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", MemoryMB: 64, Labels: map[string]string{"bench": "idle"}})
				if err != nil {
					failed.Add(1)
					fmt.Fprintln(os.Stderr, "create:", err)
					continue
				}
				ids[i] = sb
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	time.Sleep(5 * time.Second) // let the agents settle
	after := memAvailable()
	pss := pssOf("guest") + pssOf("crun")
	// What holding them costs while nothing happens: the whole host's CPU
	// and the server's own (its watches and the agents' wakeups), over a
	// quiet window.
	const quiet = 20 * time.Second
	h0, s0 := hostBusy(), cpuOf("dsec")
	time.Sleep(quiet)
	h1, s1 := hostBusy(), cpuOf("dsec")
	alive := 0
	whys := map[string]int{}
	for _, sb := range ids {
		if sb != nil {
			if _, err := sb.Exec(ctx, dsec.Argv("true")); err == nil {
				alive++
			} else {
				whys[err.Error()]++
			}
		}
	}
	for why, n := range whys {
		fmt.Fprintf(os.Stderr, "exec failed %d times: %s\n", n, why)
	}
	fmt.Printf("idle density: %d sandboxes held (%d create errors, %d answer exec) in %s\n", n-int(failed.Load()), failed.Load(), alive, took.Round(time.Millisecond))
	fmt.Printf("host memory per idle sandbox: %.2f MiB (MemAvailable drop); agent+runtime PSS %.2f MiB per sandbox\n",
		float64(before-after)/float64(n)/(1<<20), float64(pss)/float64(n)/(1<<20))
	fmt.Printf("CPU while they idle (%s): host %.1f%% of one CPU, dsec server processes %.1f%%\n",
		quiet, 100*float64(h1-h0)/float64(quiet), 100*float64(s1-s0)/float64(quiet))
	wg = sync.WaitGroup{}
	next.Store(0)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				if ids[i] != nil {
					ids[i].Close()
				}
			}
		}()
	}
	wg.Wait()
}

func memAvailable() int64 {
	b, _ := os.ReadFile("/proc/meminfo")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// pidsNamed lists the processes whose command is comm.
func pidsNamed(comm string) []string {
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		if c, _ := os.ReadFile("/proc/" + e.Name() + "/comm"); strings.TrimSpace(string(c)) == comm {
			out = append(out, e.Name())
		}
	}
	return out
}

// pssOf sums the proportional set size of processes named comm.
func pssOf(comm string) int64 {
	var total int64
	for _, pid := range pidsNamed(comm) {
		b, _ := os.ReadFile("/proc/" + pid + "/smaps_rollup")
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "Pss:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}

// clockTick is the kernel's USER_HZ (the unit of /proc's CPU times).
const clockTick = 10 * time.Millisecond

// hostBusy is the host's CPU time spent not idle since boot (/proc/stat).
func hostBusy() time.Duration {
	b, _ := os.ReadFile("/proc/stat")
	line, _, _ := strings.Cut(string(b), "\n")
	// cpu user nice system idle iowait irq softirq steal (guest time is
	// already in user and nice)
	f := strings.Fields(line)
	var busy int64
	for i, v := range f[1:min(len(f), 9)] {
		n, _ := strconv.ParseInt(v, 10, 64)
		if i != 3 && i != 4 { // idle, iowait
			busy += n
		}
	}
	return time.Duration(busy) * clockTick
}

// cpuOf sums the user and system CPU time of processes named comm.
func cpuOf(comm string) time.Duration {
	var total int64
	for _, pid := range pidsNamed(comm) {
		b, _ := os.ReadFile("/proc/" + pid + "/stat")
		// pid (comm) state ppid ...: utime and stime are fields 14 and 15.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) < 13 {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		total += u + s
	}
	return time.Duration(total) * clockTick
}

func runtimeCPUs() int {
	var set unix.CPUSet
	unix.SchedGetaffinity(0, &set)
	return set.Count()
}

// fatal reports err and exits, leaving nothing behind (dsectest.Exit).
func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
