package cgroup

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestLimitFiles(t *testing.T) {
	period, quota, shares, mem, swap := uint64(100000), int64(50000), uint64(512), int64(64<<20), int64(128<<20)
	res := &specs.LinuxResources{
		Memory: &specs.LinuxMemory{Limit: &mem, Swap: &swap},
		CPU:    &specs.LinuxCPU{Period: &period, Quota: &quota, Shares: &shares},
		Pids:   &specs.LinuxPids{Limit: 64},
	}
	for _, tc := range []struct {
		name string
		got  []Limit
		want []Limit
	}{
		{"cgroup v1 with swap accounting", V1Limits(res, true), []Limit{
			{"memory", "memory.limit_in_bytes", "67108864"}, {"memory", "memory.memsw.limit_in_bytes", "134217728"},
			{"cpu", "cpu.cfs_period_us", "100000"}, {"cpu", "cpu.cfs_quota_us", "50000"}, {"cpu", "cpu.shares", "512"},
			{"pids", "pids.max", "64"}}},
		{"cgroup v1 without swap accounting", V1Limits(res, false), []Limit{
			{"memory", "memory.limit_in_bytes", "67108864"},
			{"cpu", "cpu.cfs_period_us", "100000"}, {"cpu", "cpu.cfs_quota_us", "50000"}, {"cpu", "cpu.shares", "512"},
			{"pids", "pids.max", "64"}}},
		{"cgroup v2", V2Limits(res), []Limit{
			{"", "memory.max", "67108864"}, {"", "memory.swap.max", "67108864"}, {"", "cpu.max", "50000 100000"},
			{"", "cpu.weight", "20"}, {"", "pids.max", "64"}}},
		{"cgroup v2 without limits", V2Limits(&specs.LinuxResources{}), []Limit{
			{"", "memory.max", "max"}, {"", "memory.swap.max", "max"}, {"", "cpu.max", "max 100000"}, {"", "pids.max", "max"}}},
	} {
		if !slices.Equal(tc.got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, tc.got, tc.want)
		}
	}
}

// TestAProcessJoinsALimitedCgroupThatIsRemovedAfterIt makes a cgroup with
// limits on this host, moves a process into it, reads the limits and the
// process's membership back, and removes the cgroup once the process is
// gone.
func TestAProcessJoinsALimitedCgroupThatIsRemovedAfterIt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	h := Probe()
	path := "/dsec-cgroup-test/" + strconv.Itoa(os.Getpid())
	t.Cleanup(func() { h.Remove(filepath.Dir(path), 5*time.Second) })
	period, quota, mem := uint64(100000), int64(25000), int64(96<<20)
	res := &specs.LinuxResources{
		Memory: &specs.LinuxMemory{Limit: &mem},
		CPU:    &specs.LinuxCPU{Period: &period, Quota: &quota},
		Pids:   &specs.LinuxPids{Limit: 16},
	}
	if _, err := h.Make(path, res); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	if err := h.Join(path, cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if n := h.Pids(path); n != 1 {
		t.Errorf("pids.current %d, want 1", n)
	}
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/cgroup")
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		inLimited := h.Mode == V2 && f[1] == ""
		for _, c := range strings.Split(f[1], ",") {
			inLimited = inLimited || slices.Contains(controllers, c)
		}
		if inLimited && f[2] != path {
			t.Errorf("the process is in %s, not %s: %s", f[2], path, line)
		}
	}
	for _, l := range h.Limits(res) {
		got, _ := os.ReadFile(filepath.Join(h.Dir(path, l.Controller), l.File))
		if strings.TrimSpace(string(got)) != l.Value && !(l.File == "pids.max" && l.Value == "max") {
			t.Errorf("%s is %q, want %q", l.File, strings.TrimSpace(string(got)), l.Value)
		}
	}
	if err := h.Remove(path, 100*time.Millisecond); err == nil {
		t.Error("a cgroup with a process in it was removed")
	}
	cmd.Process.Kill()
	cmd.Wait()
	if err := h.Remove(path, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if h.Exists(path) {
		t.Error("the cgroup is still there after Remove")
	}
}
