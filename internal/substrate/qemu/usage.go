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

// guestUsage is the guest's own account of its use: memory in use
// (MemTotal less MemAvailable), CPU time (every CPU's time less idle and
// I/O wait) and the processes its kernel's OOM killer killed since it
// booted (/proc/vmstat's oom_kill), read through the agent. QEMU's
// resident memory also holds guest memory the guest has freed, the
// translation cache and QEMU itself, and its CPU time the emulation's;
// neither is what the sandbox used.
func (v *VM) guestUsage(ctx context.Context) (st substrate.Stats, err error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	meminfo, err := v.readGuestFile(ctx, "/proc/meminfo")
	if err != nil {
		return st, err
	}
	stat, err := v.readGuestFile(ctx, "/proc/stat")
	if err != nil {
		return st, err
	}
	if st.MemoryBytes, err = parseMeminfo(meminfo); err != nil {
		return st, err
	}
	if st.CPUTime, err = parseProcStat(stat); err != nil {
		return st, err
	}
	st.OOMKills, err = v.guestOOMKills(ctx)
	return st, err
}

// guestOOMKills is the guest kernel's count of OOM kills since it booted.
func (v *VM) guestOOMKills(ctx context.Context) (int64, error) {
	vmstat, err := v.readGuestFile(ctx, "/proc/vmstat")
	if err != nil {
		return 0, err
	}
	return parseOOMKills(vmstat)
}

// parseOOMKills answers /proc/vmstat's oom_kill.
func parseOOMKills(s string) (int64, error) {
	for _, line := range strings.Split(s, "\n") {
		if n, ok := strings.CutPrefix(line, "oom_kill "); ok {
			return strconv.ParseInt(strings.TrimSpace(n), 10, 64)
		}
	}
	return 0, fmt.Errorf("unreadable /proc/vmstat: no oom_kill")
}

// CountOOMKillsFromNow makes Stats count the guest's OOM kills from now
// on: a VM restored from another's snapshot (a fork child) wakes with its
// parent's count, which are not its own.
func (v *VM) CountOOMKillsFromNow(ctx context.Context) error {
	n, err := v.guestOOMKills(ctx)
	if err != nil {
		return err
	}
	v.mu.Lock()
	v.st.OOMBase = n
	v.mu.Unlock()
	return nil
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
	if g, err := v.guestUsage(ctx); err == nil {
		v.mu.Lock()
		g.OOMKills = max(0, g.OOMKills-v.st.OOMBase)
		v.mu.Unlock()
		st = g
	}
	return st
}
