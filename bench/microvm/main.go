// Command microvm benchmarks the microvm substrate through the API, side
// by side with raw QEMU runs of the same kernel and snapshots, and prints
// numbers and ratios (not a test: never pass/fail).
//
//	DSEC_CACHE_DIR=... go run ./bench/microvm [-runs 5] [-fork 8] [-density 16] [-settle 20s] [-ksm]
//
// Measured:
//   - boot to first exec (create + exec `true`) vs a raw QEMU boot of the
//     same kernel, machine and accelerator with a busybox initramfs that
//     prints a marker;
//   - restore from a machine snapshot to first exec vs a raw QEMU
//     `-incoming` restore of the same snapshot (start → state loaded and
//     running);
//   - a create that restores its image's boot snapshot (the default: the
//     boot row's server boots every sandbox) to first exec, against the
//     same raw restore;
//   - fork N from one running sandbox: per-child cost and memory;
//   - density: N idle 128 MiB sandboxes, host memory per VM after they
//     settle (PSS of each QEMU: its own pages plus its share of pages
//     shared with the others, such as the kernel file), and idle CPU per VM.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/bench/internal/result"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/proc"
	"github.com/opendsec/dsec/internal/substrate/microvm"
	"github.com/opendsec/dsec/internal/substrate/qemu"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func main() {
	runs := flag.Int("runs", 5, "samples of boot and of restore, per side")
	forkN := flag.Int("fork", 8, "children to fork from one sandbox")
	density := flag.Int("density", 16, "idle sandboxes to hold for the density measurement (0 skips)")
	settle := flag.Duration("settle", 20*time.Second, "how long idle VMs settle before memory is measured")
	ksm := flag.Bool("ksm", false, "enable KSM (/sys/kernel/mm/ksm/run) for the fork and density runs, restored afterwards")
	mem := flag.Int64("memory", 128, "guest memory, MiB")
	tb := flag.Int("tb", 0, "TCG translation buffer per VM, MiB (0: the driver's default)")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	cache := os.Getenv("DSEC_CACHE_DIR")
	k, err := qemu.FindKernel(filepath.Join(cache, "guest-kernel"))
	if err != nil {
		fatal(fmt.Errorf("%v (set DSEC_CACHE_DIR)", err))
	}
	bin, err := qemu.FindBinary("")
	if err != nil {
		fatal(err)
	}
	b := dsectest.Program()
	defer b.Close()
	srvArgs := []string{"--max-sandboxes", "4096"}
	if *tb > 0 {
		cfg := filepath.Join(b.TempDir(), "dsec.yaml")
		os.WriteFile(cfg, []byte(fmt.Sprintf("microvm:\n  tb_size_mib: %d\n", *tb)), 0o600)
		srvArgs = append(srvArgs, "--config", cfg)
	}
	// Every create of this server boots; the boot-snapshot row has a
	// server of its own.
	srv := dsectest.Start(b, dsectest.Options{Args: append(srvArgs, "--microvm-cold-boot")})
	c := srv.Client()
	ctx := context.Background()
	info, err := c.Info(ctx)
	if err != nil {
		fatal(err)
	}
	accel := "tcg"
	for _, kd := range info.Nodes[0].Kinds {
		if kd.Kind == "microvm" {
			if !kd.Available {
				fatal(fmt.Errorf("microvm unavailable: %s", kd.Reason))
			}
			accel = kd.Details["accel"]
		}
	}
	tbMiB := 32
	if *tb > 0 {
		tbMiB = *tb
	}
	accelArg := qemu.Accel{Name: accel}.Arg(tbMiB)
	fmt.Printf("dsec microvm benchmark — %s, QEMU %s, guest kernel %s, accel %s, %d MiB guests\n\n",
		time.Now().Format(time.RFC3339), mustVersion(bin), k.Release, accelArg, *mem)

	tmp := b.TempDir()
	opts := dsec.CreateOptions{Kind: "microvm", Image: "busybox", MemoryMB: *mem, DiskMB: 256, TTL: time.Hour}

	// Boot.
	initrd := filepath.Join(tmp, "marker.cpio")
	img, err := qemu.MarkerInitramfs("/bin/busybox", "DSEC-BENCH-MARKER")
	if err != nil {
		fatal(err)
	}
	os.WriteFile(initrd, img, 0o600)
	var rawBoot, dsecBoot []time.Duration
	for r := 0; r < *runs; r++ {
		rawBoot = append(rawBoot, rawBootOnce(bin, k, initrd, accelArg, *mem, tmp))
		t0 := time.Now()
		sb, err := c.Create(ctx, opts)
		if err != nil {
			fatal(err)
		}
		if _, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil {
			fatal(err)
		}
		dsecBoot = append(dsecBoot, time.Since(t0))
		sb.Close()
	}
	report("boot to first exec", dsecBoot, "raw boot to marker", rawBoot)
	result.Emit(result.Row{Key: "microvm.boot", What: "microVM boot to first exec, p50", Unit: "ms",
		Dsec: result.Ms(p50(dsecBoot)), Baseline: result.Ms(p50(rawBoot)), BaselineName: "raw QEMU boot to a marker"})

	// Restore.
	parent, err := c.Create(ctx, opts)
	if err != nil {
		fatal(err)
	}
	if _, err := parent.Exec(ctx, dsec.Cmd("echo warm > /state; sleep 1")); err != nil {
		fatal(err)
	}
	snap, err := c.Snapshot(ctx, parent.ID, "bench")
	if err != nil {
		fatal(err)
	}
	snapDir := filepath.Join(srv.DataDir, "snapshots", snap.Id)
	st, _ := os.Stat(filepath.Join(snapDir, "state"))
	fmt.Printf("machine snapshot: %.1f MiB on disk (memory stream %.1f MiB)\n", float64(snap.SizeBytes)/(1<<20), float64(st.Size())/(1<<20))
	var rawRestore, dsecRestore []time.Duration
	for r := 0; r < *runs; r++ {
		rawRestore = append(rawRestore, rawRestoreOnce(bin, snapDir, tmp, r))
		t0 := time.Now()
		sb, err := c.Create(ctx, dsec.CreateOptions{Snapshot: snap.Id, TTL: time.Hour})
		if err != nil {
			fatal(err)
		}
		if _, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil {
			fatal(err)
		}
		dsecRestore = append(dsecRestore, time.Since(t0))
		sb.Close()
	}
	report("restore to first exec", dsecRestore, "raw -incoming restore", rawRestore)
	result.Emit(result.Row{Key: "microvm.restore", What: "microVM restore to first exec, p50", Unit: "ms",
		Dsec: result.Ms(p50(dsecRestore)), Baseline: result.Ms(p50(rawRestore)), BaselineName: "raw QEMU -incoming restore"})

	// A create of the same image and shape on a server that keeps boot
	// snapshots: its first create boots and saves one, the next restore it.
	bootSrv := dsectest.Start(b, dsectest.Options{Args: srvArgs})
	bc := bootSrv.Client()
	var dsecBootSnap []time.Duration
	for r := 0; r <= *runs; r++ {
		t0 := time.Now()
		sb, err := bc.Create(ctx, opts)
		if err != nil {
			fatal(err)
		}
		if _, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil {
			fatal(err)
		}
		if r > 0 {
			dsecBootSnap = append(dsecBootSnap, time.Since(t0))
		}
		sb.Close()
	}
	report("create from the image's boot snapshot to first exec", dsecBootSnap, "raw -incoming restore", rawRestore)

	restoreKSM := func() {}
	if *ksm {
		old, _ := os.ReadFile("/sys/kernel/mm/ksm/run")
		if err := os.WriteFile("/sys/kernel/mm/ksm/run", []byte("1"), 0); err != nil {
			fmt.Println("KSM: cannot enable:", err)
		} else {
			restoreKSM = func() { os.WriteFile("/sys/kernel/mm/ksm/run", bytes.TrimSpace(old), 0) }
			defer restoreKSM()
			fmt.Println("KSM enabled for the fork and density runs")
		}
	}

	// Fork.
	if *forkN > 0 {
		t0 := time.Now()
		resp, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: parent.ID, Count: int32(*forkN)})
		if err != nil {
			fatal(err)
		}
		total := time.Since(t0)
		var ids []string
		for _, r := range resp.Results {
			if r.Sandbox != nil {
				ids = append(ids, r.Sandbox.Id)
			}
		}
		for _, id := range ids {
			if x, err := c.Sandbox(id).Exec(ctx, dsec.Cmd("cat /state")); err != nil || string(x.Stdout) != "warm\n" {
				fatal(fmt.Errorf("fork child %s: %v %v", id, x, err))
			}
		}
		time.Sleep(*settle)
		rss, _ := vmStats(ids)
		fmt.Printf("fork %d: %d created in %v, %v per child; child PSS %.1f MiB each (KSM pages_sharing %s)\n",
			*forkN, len(ids), total.Round(time.Millisecond), (total / time.Duration(max(1, len(ids)))).Round(time.Millisecond),
			float64(rss)/float64(max(1, len(ids)))/(1<<20), ksmSharing())
		result.Emit(result.Row{Key: "microvm.fork", What: fmt.Sprintf("fork %d microVMs from one, per child", *forkN), Unit: "ms",
			Dsec: result.Ms(total) / float64(max(1, len(ids)))},
			result.Row{Key: "microvm.fork.pss", What: fmt.Sprintf("fork %d microVMs from one, PSS per idle child", *forkN), Unit: "MiB",
				Dsec: float64(rss) / float64(max(1, len(ids))) / (1 << 20)})
		for _, id := range ids {
			c.Sandbox(id).Close()
		}
	}
	parent.Close()

	// Density: sandboxes that boot (this server) and sandboxes restored
	// from the image's boot snapshot (every create of a default server
	// after the first), whose untouched RAM is shared.
	for _, dc := range []struct {
		how string
		c   *dsec.Client
	}{{"booted", c}, {"restored from the boot snapshot", bc}} {
		if *density == 0 {
			break
		}
		c := dc.c
		t0 := time.Now()
		resp, err := c.CreateMany(ctx, opts, *density)
		if err != nil {
			fatal(err)
		}
		var ids []string
		for _, r := range resp.Results {
			if r.Sandbox != nil {
				ids = append(ids, r.Sandbox.Id)
			}
		}
		fmt.Printf("density (%s): %d/%d idle sandboxes started in %v\n", dc.how, len(ids), *density, time.Since(t0).Round(time.Millisecond))
		time.Sleep(*settle)
		rss0, cpu0 := vmStats(ids)
		w0 := time.Now()
		time.Sleep(10 * time.Second)
		rss1, cpu1 := vmStats(ids)
		wall := time.Since(w0)
		n := float64(max(1, len(ids)))
		var alive int
		var wg sync.WaitGroup
		var mu sync.Mutex
		for _, id := range ids {
			wg.Add(1)
			go func(id string) {
				defer wg.Done()
				if x, err := c.Sandbox(id).Exec(ctx, dsec.Cmd("echo ok")); err == nil && string(x.Stdout) == "ok\n" {
					mu.Lock()
					alive++
					mu.Unlock()
				}
			}(id)
		}
		wg.Wait()
		fmt.Printf("density (%s): PSS per idle VM %.1f MiB (%.1f after %v more), idle CPU per VM %.2f%% of a core; %d/%d answer exec afterwards\n",
			dc.how, float64(rss0)/n/(1<<20), float64(rss1)/n/(1<<20), wall.Round(time.Second),
			100*float64(cpu1-cpu0)/n/float64(wall), alive, len(ids))
		fmt.Printf("density: KSM pages_sharing %s\n", ksmSharing())
		for _, id := range ids {
			c.Sandbox(id).Close()
		}
	}
}

func rawBootOnce(bin string, k *qemu.Kernel, initrd, accel string, mem int64, tmp string) time.Duration {
	log := filepath.Join(tmp, "raw-boot.log")
	os.Remove(log)
	args := qemu.MarkerArgs(k, initrd, accel, int(mem))
	t0 := time.Now()
	p, err := qemu.Start(bin, args, log, nil, "")
	if err != nil {
		fatal(err)
	}
	defer p.Kill(5 * time.Second)
	for {
		if b, _ := os.ReadFile(log); bytes.Contains(b, []byte("DSEC-BENCH-MARKER")) {
			return time.Since(t0)
		}
		select {
		case <-p.Done():
			fatal(fmt.Errorf("raw boot exited: %s", qemu.ReadLogTail(log, 500)))
		case <-time.After(time.Millisecond):
		}
		if time.Since(t0) > 2*time.Minute {
			fatal(fmt.Errorf("raw boot did not reach its marker"))
		}
	}
}

func rawRestoreOnce(bin, snapDir, tmp string, r int) time.Duration {
	dir := filepath.Join(tmp, fmt.Sprintf("raw-restore-%d", r))
	os.MkdirAll(dir, 0o700)
	defer os.RemoveAll(dir)
	disk := filepath.Join(dir, "disk.img")
	if err := copyFile(filepath.Join(snapDir, "disk.img"), disk); err != nil {
		fatal(err)
	}
	qmpSock := filepath.Join(dir, "q")
	args, deferred, err := microvm.SnapshotArgs(snapDir, fmt.Sprintf("benchraw%d", r), disk, filepath.Join(dir, "a"), qmpSock, filepath.Join(dir, "console"))
	if err != nil {
		fatal(err)
	}
	f, err := os.Open(filepath.Join(snapDir, "state"))
	if err != nil {
		fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	p, err := qemu.Start(bin, args, filepath.Join(dir, "log"), []*os.File{f}, "")
	if err != nil {
		fatal(err)
	}
	defer p.Kill(5 * time.Second)
	q, err := qemu.DialQMP(ctx, qmpSock)
	if err != nil {
		fatal(err)
	}
	defer q.Close()
	if deferred {
		if err := qemu.StartIncomingIgnoringShared(ctx, q, "fd:3"); err != nil {
			fatal(err)
		}
	}
	if err := qemu.WaitIncoming(ctx, q); err != nil {
		fatal(err)
	}
	return time.Since(t0)
}

// vmStats sums the proportional set size (PSS: shared pages such as the
// kernel file and QEMU's binary divided among the processes mapping them)
// and CPU time of the QEMU processes of sandboxes ids.
func vmStats(ids []string) (pss int64, cpu time.Duration) {
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	for _, vm := range qemu.VMProcesses() {
		if !want[vm.ID] {
			continue
		}
		if p, err := qemu.Adopt(vm.Pid, proc.StartTime(vm.Pid)); err == nil {
			pss += procPSS(vm.Pid)
			cpu += p.CPUTime()
		}
	}
	return pss, cpu
}

// procPSS is a process's proportional set size in bytes.
func procPSS(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Pss:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func ksmSharing() string {
	b, err := os.ReadFile("/sys/kernel/mm/ksm/pages_sharing")
	if err != nil {
		return "n/a"
	}
	run, _ := os.ReadFile("/sys/kernel/mm/ksm/run")
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return fmt.Sprintf("%d (%.1f MiB; ksm run=%s)", n, float64(n*4096)/(1<<20), strings.TrimSpace(string(run)))
}

func report(name string, d []time.Duration, base string, raw []time.Duration) {
	pd, pr := p50(d), p50(raw)
	fmt.Printf("%-24s p50 %8v  (min %v, max %v)\n", name, pd.Round(time.Millisecond), minD(d).Round(time.Millisecond), maxD(d).Round(time.Millisecond))
	fmt.Printf("%-24s p50 %8v  (min %v, max %v)\n", base, pr.Round(time.Millisecond), minD(raw).Round(time.Millisecond), maxD(raw).Round(time.Millisecond))
	fmt.Printf("%-24s %.2fx\n\n", "ratio", float64(pd)/float64(pr))
}

func p50(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func minD(d []time.Duration) time.Duration {
	m := d[0]
	for _, x := range d {
		m = min(m, x)
	}
	return m
}

func maxD(d []time.Duration) time.Duration {
	m := d[0]
	for _, x := range d {
		m = max(m, x)
	}
	return m
}

func copyFile(src, dst string) error {
	out, err := exec.Command("cp", "--sparse=always", src, dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cp: %v: %s", err, out)
	}
	return nil
}

func mustVersion(bin string) string {
	v, _ := qemu.Version(bin)
	return v
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
