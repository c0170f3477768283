package qemu

import (
	"testing"
	"time"
)

func TestGuestUsageParsing(t *testing.T) {
	mem, err := parseMeminfo("MemTotal:        1000 kB\nMemFree:          100 kB\nMemAvailable:     400 kB\n")
	if err != nil || mem != 600<<10 {
		t.Fatalf("meminfo: %d %v", mem, err)
	}
	if _, err := parseMeminfo("MemTotal: 10 kB\nMemAvailable: 20 kB\n"); err == nil {
		t.Fatal("available over total accepted")
	}
	// user nice system idle iowait irq softirq steal guest guest_nice
	cpu, err := parseProcStat("cpu  100 20 30 5000 70 1 2 3 0 0\ncpu0 100 20 30 5000 70 1 2 3 0 0\nintr 1\n")
	if err != nil || cpu != 1560*time.Millisecond {
		t.Fatalf("stat: %v %v", cpu, err)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4 5 6 7 8\n", "cpu 1 2 x 4 5 6 7 8\n"} {
		if _, err := parseProcStat(bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

func TestParseOOMKills(t *testing.T) {
	n, err := parseOOMKills("nr_free_pages 1000\noom_kill 3\nnr_dirty 2\n")
	if err != nil || n != 3 {
		t.Fatalf("oom_kill: %d %v", n, err)
	}
	if _, err := parseOOMKills("nr_free_pages 1000\n"); err == nil {
		t.Fatal("a vmstat without oom_kill was read")
	}
}
