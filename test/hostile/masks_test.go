package hostile

import (
	"os"
	"strings"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// hostKernelInfo are the host kernel's files and directories a sandbox
// must not read: its memory (kcore, the kpage* maps, whose reading has
// crashed hosts), keys, timers, scheduler and firmware tables, debugfs,
// and the sysrq trigger.
var hostKernelInfo = []string{
	"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
	"/proc/timer_list", "/proc/sched_debug", "/proc/scsi", "/proc/kpagecgroup",
	"/proc/kpagecount", "/proc/kpageflags", "/proc/sysrq-trigger",
	"/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug",
}

func TestHostKernelInfoIsMaskedAndStaysMasked(t *testing.T) {
	eachRuntime(t, testHostKernelInfoIsMaskedAndStaysMasked)
}

// The root of a sandbox reads each path, tries to write into it and to
// unmount what masks it, then reads it again.
func testHostKernelInfoIsMaskedAndStaysMasked(t *testing.T, rt string) {
	sb := create(t, client(t), dsec.CreateOptions{Runtime: rt})
	// One line per path: "<path> <kind> <bytes or entries> <written> <unmounted> <after>".
	script := `for p in "$@"; do
  if [ -d "$p" ]; then k=dir; n=$(ls -A "$p" | wc -l); touch "$p/x" 2>/dev/null && w=yes || w=no
  elif [ -e "$p" ]; then k=file; n=$(head -c 4096 "$p" 2>/dev/null | wc -c); w=n/a
  else echo "$p missing"; continue; fi
  umount "$p" 2>/dev/null || umount -l "$p" 2>/dev/null && u=yes || u=no
  if [ -d "$p" ]; then a=$(ls -A "$p" | wc -l); else a=$(head -c 4096 "$p" 2>/dev/null | wc -c); fi
  echo "$p $k $n $w $u $a"
done`
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Cmd: "sh -c '" + strings.ReplaceAll(script, "'", `'\''`) + "' sh " + strings.Join(hostKernelInfo, " ")})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("inside:\n%s", r.Stdout)
	seen := map[string][]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(r.Stdout)), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			seen[f[0]] = f[1:]
		}
	}
	masked := 0
	for _, p := range hostKernelInfo {
		f := seen[p]
		if len(f) == 0 {
			t.Errorf("%s: no answer", p)
			continue
		}
		if f[0] == "missing" {
			// crun's /proc and /sys are the host kernel's: what the host
			// has, a sandbox sees (masked). gVisor's are its own.
			if _, err := os.Stat(p); err == nil && rt == "" {
				t.Errorf("%s: the host has it, the sandbox does not see it at all", p)
			}
			continue
		}
		masked++
		if len(f) != 5 {
			t.Errorf("%s: odd answer %q", p, f)
			continue
		}
		if f[1] != "0" || f[4] != "0" {
			t.Errorf("%s: the sandbox reads %s bytes or entries of it (%s after trying to unmount its mask)", p, f[1], f[4])
		}
		if f[2] == "yes" {
			t.Errorf("%s: the sandbox wrote into it", p)
		}
		if f[3] == "yes" {
			t.Errorf("%s: the sandbox unmounted its mask", p)
		}
	}
	if rt == "" && masked < 4 {
		t.Errorf("only %d of the paths exist inside: the test checks nothing", masked)
	}
}
