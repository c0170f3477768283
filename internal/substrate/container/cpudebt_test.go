package container

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/substrate"
)

func TestRepayingIsAStallWithinTheQuotaNotRunningAtIt(t *testing.T) {
	ms := time.Millisecond
	limit := cpuLimit{quota: 100 * ms, period: 100 * ms}
	start := cpuSample{periods: 100, throttled: 90, usage: 50 * time.Second, hasUsage: true}
	for _, tc := range []struct {
		name  string
		end   cpuSample
		limit cpuLimit
		want  bool
	}{
		{"throttled in every period with no CPU", cpuSample{110, 100, 50 * time.Second, true}, limit, true},
		{"throttled in all but one, a sliver of CPU", cpuSample{110, 99, 50*time.Second + 90*ms, true}, limit, true},
		{"running at its quota (throttled every period, using it)", cpuSample{110, 100, 51 * time.Second, true}, limit, false},
		{"a tenth of its quota is not a stall", cpuSample{110, 100, 50*time.Second + 100*ms, true}, limit, false},
		{"throttled in some periods only", cpuSample{110, 95, 50 * time.Second, true}, limit, false},
		{"too few periods to tell", cpuSample{103, 93, 50 * time.Second, true}, limit, false},
		{"no quota", cpuSample{110, 100, 50 * time.Second, true}, cpuLimit{quota: -1, period: 100 * ms}, false},
		{"half a CPU, stalled", cpuSample{110, 100, 50*time.Second + 40*ms, true}, cpuLimit{quota: 50 * ms, period: 100 * ms}, true},
	} {
		if got := repaying(start, tc.end, tc.limit); got != tc.want {
			t.Errorf("%s: repaying = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestForgivingCPUDebtKeepsTheLimit: forgiving a sandbox's CPU debt writes
// its quota again, not another; lifting it (before a delete's kill)
// removes it.
func TestForgivingCPUDebtKeepsTheLimit(t *testing.T) {
	d := newDriver(t, t.TempDir())
	spec := &substrate.Spec{ID: fmt.Sprintf("debt%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
		CPU: 0.5, MemoryMB: 64, Pids: 64, Network: substrate.Network{Mode: "none"}}
	inst, err := d.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	path := d.cgroupPath(spec.ID)
	before, raw := d.cgroups.cpuLimit(path)
	if before.quota != 50*time.Millisecond || before.period != 100*time.Millisecond {
		t.Fatalf("the sandbox's CPU limit reads %v per %v (%q), want 50ms per 100ms", before.quota, before.period, raw)
	}
	if err := d.cgroups.forgiveCPUDebt(path); err != nil {
		t.Fatal(err)
	}
	if after, _ := d.cgroups.cpuLimit(path); after != before {
		t.Errorf("after forgiving its debt the limit is %v per %v, want %v per %v", after.quota, after.period, before.quota, before.period)
	}
	s := d.cgroups.cpuSample(path)
	if s.periods < 0 || s.throttled < 0 || d.cgroups.CPU(path) <= 0 {
		t.Errorf("the sandbox's CPU accounting reads %+v, usage %v", s, d.cgroups.CPU(path))
	}
	d.cgroups.liftCPULimit(path)
	if l, raw := d.cgroups.cpuLimit(path); l.quota > 0 {
		t.Errorf("a lifted limit reads %q", raw)
	}
}
