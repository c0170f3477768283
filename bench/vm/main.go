// Command vm benchmarks the vm substrate (full VMs) through the API and
// prints numbers and ratios (not a test: never pass/fail).
//
//	DSEC_CACHE_DIR=... go run ./bench/vm [-runs 5] [-shots 20] [-boot auto|firmware|direct] [-memory 512]
//
// Measured, with the acceleration in use:
//   - boot to first exec: create (a cold boot of the debian-vm image,
//     systemd to multi-user.target and the agent) + exec `true`;
//   - restore from a machine snapshot to first exec: create --from a
//     snapshot of a running sandbox + exec `true`; the ratio to boot;
//   - create from the image with its boot snapshot (the default): the
//     first create boots and saves it, the next ones restore it;
//   - screenshot round trip (request → PNG bytes) of the text console.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/mountns"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func main() {
	runs := flag.Int("runs", 5, "samples of each start")
	shots := flag.Int("shots", 20, "screenshots for the round trip")
	boot := flag.String("boot", "auto", "how VMs boot: auto (the image's kernel), firmware (SeaBIOS and GRUB) or direct")
	mem := flag.Int64("memory", 512, "guest memory, MiB")
	flag.Parse()
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	if ok, why := dsectest.VMReady(); !ok {
		fatal(fmt.Errorf("cannot run full VMs here: %s", why))
	}
	prog = dsectest.Program()
	defer prog.Close()
	ctx := context.Background()
	opts := dsec.CreateOptions{Kind: "vm", Image: "debian-vm", MemoryMB: *mem, TTL: time.Hour}

	// Cold boots, machine snapshot restores and screenshots.
	cold := dsectest.Start(prog, dsectest.Options{Images: []string{"debian-vm"}, Args: []string{"--vm-cold-boot", "--vm-boot", *boot}})
	c := cold.Client()
	info, err := c.Info(ctx)
	if err != nil {
		fatal(err)
	}
	accel, reason, qemuVersion := "", "", ""
	for _, k := range info.Nodes[0].Kinds {
		if k.Kind == "vm" {
			if !k.Available {
				fatal(fmt.Errorf("vm unavailable: %s", k.Reason))
			}
			accel, reason, qemuVersion = k.Details["accel"], k.Details["accel_reason"], k.Details["qemu"]
		}
	}
	fmt.Printf("dsec vm benchmark — %s, QEMU %s, accel %s (%s), boot %s, %d MiB guests, debian-vm image\n\n",
		time.Now().Format(time.RFC3339), qemuVersion, accel, reason, *boot, *mem)

	var bootT []time.Duration
	var keep *dsec.Sandbox
	for r := 0; r < *runs; r++ {
		t0 := time.Now()
		sb := firstExec(ctx, c, opts)
		bootT = append(bootT, time.Since(t0))
		if keep == nil {
			keep = sb
		} else {
			sb.Close()
		}
	}
	report("boot to first exec", bootT)

	if _, err := keep.Exec(ctx, dsec.Cmd("echo warm > /root/state")); err != nil {
		fatal(err)
	}
	t0 := time.Now()
	snap, err := c.Snapshot(ctx, keep.ID, "bench")
	if err != nil {
		fatal(err)
	}
	fmt.Printf("%-34s %v, %s on disk\n\n", "machine snapshot of a running VM", time.Since(t0).Round(time.Millisecond), human(snap.SizeBytes))
	var restoreT []time.Duration
	for r := 0; r < *runs; r++ {
		t0 := time.Now()
		sb := firstExec(ctx, c, dsec.CreateOptions{Snapshot: snap.Id, TTL: time.Hour})
		restoreT = append(restoreT, time.Since(t0))
		sb.Close()
	}
	report("restore to first exec", restoreT)
	fmt.Printf("%-34s %.1fx faster (p50), %.1fx (p90)\n\n", "restore vs boot",
		float64(pct(bootT, 50))/float64(pct(restoreT, 50)), float64(pct(bootT, 90))/float64(pct(restoreT, 90)))

	var shotT []time.Duration
	var w, h int32
	var size int
	for i := 0; i < *shots; i++ {
		t0 := time.Now()
		s, err := keep.Screenshot(ctx)
		if err != nil {
			fatal(err)
		}
		shotT = append(shotT, time.Since(t0))
		w, h, size = s.Width, s.Height, len(s.Png)
	}
	fmt.Printf("%-34s p50 %v, p90 %v (%dx%d PNG, %s)\n\n", "screenshot round trip", pct(shotT, 50).Round(time.Microsecond),
		pct(shotT, 90).Round(time.Microsecond), w, h, human(int64(size)))
	keep.Close()
	cold.Stop()

	// The default: new sandboxes restore the image's boot snapshot.
	warm := dsectest.Start(prog, dsectest.Options{Images: []string{"debian-vm"}, Args: []string{"--vm-boot", *boot}})
	c = warm.Client()
	t0 = time.Now()
	firstExec(ctx, c, opts).Close()
	fmt.Printf("%-34s %v\n", "first create (boots, saves the boot snapshot)", time.Since(t0).Round(time.Millisecond))
	var warmT []time.Duration
	for r := 0; r < *runs; r++ {
		t0 := time.Now()
		sb := firstExec(ctx, c, opts)
		warmT = append(warmT, time.Since(t0))
		sb.Close()
	}
	report("create from the boot snapshot", warmT)
}

// firstExec creates a sandbox and runs `true` in it.
func firstExec(ctx context.Context, c *dsec.Client, o dsec.CreateOptions) *dsec.Sandbox {
	sb, err := c.Create(ctx, o)
	if err != nil {
		fatal(err)
	}
	if _, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil {
		fatal(err)
	}
	return sb
}

func report(name string, d []time.Duration) {
	fmt.Printf("%-34s p50 %v, p90 %v (min %v, max %v, n %d)\n\n", name, pct(d, 50).Round(time.Millisecond),
		pct(d, 90).Round(time.Millisecond), pct(d, 0).Round(time.Millisecond), pct(d, 100).Round(time.Millisecond), len(d))
}

// pct is the p-th percentile (nearest rank).
func pct(d []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := (p*len(s) + 99) / 100
	return s[max(0, min(i-1, len(s)-1))]
}

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20))
	default:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	}
}

// prog owns the servers.
var prog *dsectest.ProgramTB

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	dsectest.Exit(1)
}
