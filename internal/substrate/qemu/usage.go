package qemu

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/substrate"
)

// userHZ is the unit of the times in /proc/stat: USER_HZ, 100 on every
// Linux architecture QEMU runs here.
const userHZ = 100

// GuestUsage is the guest's own account of its use: memory in use
// (MemTotal less MemAvailable) and CPU time (every CPU's time less idle and
// I/O wait), read through the agent. QEMU's resident memory also holds
// guest memory the guest has freed, the translation cache and QEMU itself,
// and its CPU time the emulation's; neither is what the sandbox used.
func (v *VM) GuestUsage(ctx context.Context) (memory int64, cpu time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	meminfo, err := v.readGuestFile(ctx, "/proc/meminfo")
	if err != nil {
		return 0, 0, err
	}
	stat, err := v.readGuestFile(ctx, "/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	if memory, err = parseMeminfo(meminfo); err != nil {
		return 0, 0, err
	}
	if cpu, err = parseProcStat(stat); err != nil {
		return 0, 0, err
	}
	return memory, cpu, nil
}

func (v *VM) readGuestFile(ctx context.Context, path string) (string, error) {
	f, err := v.client.ReadFile(ctx, &guestv1.ReadFile{Path: path, Limit: 64 << 10})
	if err != nil {
		return "", err
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	return string(b), err
}

// parseMeminfo answers MemTotal less MemAvailable, in bytes.
func parseMeminfo(s string) (int64, error) {
	kb := map[string]int64{}
	for _, line := range strings.Split(s, "\n") {
		var k string
		var n int64
		if c, _ := fmt.Sscanf(line, "%s %d", &k, &n); c == 2 {
			kb[strings.TrimSuffix(k, ":")] = n
		}
	}
	total, avail := kb["MemTotal"], kb["MemAvailable"]
	if total == 0 || avail > total {
		return 0, fmt.Errorf("unreadable /proc/meminfo")
	}
	return (total - avail) << 10, nil
}

// parseProcStat answers the busy time of all CPUs from /proc/stat's "cpu"
// line: user, nice, system, irq, softirq and steal (guest time is already
// in user and nice; idle and iowait are not busy).
func parseProcStat(s string) (time.Duration, error) {
	for _, line := range strings.Split(s, "\n") {
		f := strings.Fields(line)
		if len(f) < 9 || f[0] != "cpu" {
			continue
		}
		var busy int64
		for i, v := range f[1:9] {
			if i == 3 || i == 4 { // idle, iowait
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("unreadable /proc/stat: %q", line)
			}
			busy += n
		}
		return time.Duration(busy) * time.Second / userHZ, nil
	}
	return 0, fmt.Errorf("unreadable /proc/stat: no cpu line")
}

// Stats is the VM's use for substrate.Instance.Stats: the guest's own
// (GuestUsage), or QEMU's while the agent does not answer. A paused VM
// holds no memory and reports none.
func (v *VM) Stats(ctx context.Context) substrate.Stats {
	rss, cpu := v.Usage()
	if rss == 0 {
		return substrate.Stats{}
	}
	st := substrate.Stats{MemoryBytes: rss, CPUTime: cpu}
	if mem, gcpu, err := v.GuestUsage(ctx); err == nil {
		st.MemoryBytes, st.CPUTime = mem, gcpu
	}
	return st
}
