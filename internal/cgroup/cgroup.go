// Package cgroup reads, makes, limits and removes the node's cgroups, on
// cgroup v1 (a hierarchy per controller, also on hybrid hosts, whose
// cgroup2 mount the node hides in its own mount namespace) and v2. An OCI
// runtime makes a container's cgroups itself; the node makes those of what
// it starts without one: a gVisor sandbox's limits, a VM's QEMU.
package cgroup

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// Mode is the host's cgroup layout.
type Mode int

const (
	V1 Mode = iota + 1
	Hybrid
	V2
)

func (m Mode) String() string {
	switch m {
	case V1:
		return "v1"
	case Hybrid:
		return "hybrid (v1 controllers, cgroup2 hidden in the node's mount namespace)"
	case V2:
		return "v2"
	}
	return "unknown"
}

// Hierarchy is the host's cgroup file system. Paths are a cgroup's path
// below each controller's root ("/dsec/<id>").
type Hierarchy struct {
	Mode           Mode
	Root           string // /sys/fs/cgroup
	SwapAccounting bool
}

// Probe finds how the host mounts cgroups.
func Probe() Hierarchy {
	h := Hierarchy{Root: "/sys/fs/cgroup"}
	var st unix.Statfs_t
	if unix.Statfs(h.Root, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		h.Mode = V2
		h.SwapAccounting = fileExists(filepath.Join(h.Root, "memory.swap.max")) || fileExists(filepath.Join(h.Root, "init.scope", "memory.swap.max"))
		return h
	}
	h.Mode = V1
	if _, err := os.Stat(filepath.Join(h.Root, "unified")); err == nil {
		h.Mode = Hybrid
	}
	h.SwapAccounting = fileExists(filepath.Join(h.Root, "memory", "memory.memsw.limit_in_bytes"))
	return h
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// Dir is a cgroup's directory for a v1 controller, or the v2 one.
func (h Hierarchy) Dir(path, controller string) string {
	if h.Mode == V2 {
		return filepath.Join(h.Root, path)
	}
	return filepath.Join(h.Root, controller, path)
}

// ReadInt reads a file holding one integer (0 if it cannot).
func ReadInt(p string) int64 {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// Keyed reads the value of key in a file of "key value" lines
// (memory.events, cpu.stat, oom_control).
func Keyed(p, key string) int64 {
	f, err := os.Open(p)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if ok && k == key {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// Memory is the cgroup's memory use in bytes.
func (h Hierarchy) Memory(path string) int64 {
	if h.Mode == V2 {
		return ReadInt(filepath.Join(h.Dir(path, ""), "memory.current"))
	}
	return ReadInt(filepath.Join(h.Dir(path, "memory"), "memory.usage_in_bytes"))
}

// CPU is the CPU time the cgroup's processes used.
func (h Hierarchy) CPU(path string) time.Duration {
	if h.Mode == V2 {
		return time.Duration(Keyed(filepath.Join(h.Dir(path, ""), "cpu.stat"), "usage_usec")) * time.Microsecond
	}
	return time.Duration(ReadInt(filepath.Join(h.Dir(path, "cpuacct"), "cpuacct.usage")))
}

// Pids counts the cgroup's tasks.
func (h Hierarchy) Pids(path string) int64 {
	return ReadInt(filepath.Join(h.Dir(path, "pids"), "pids.current"))
}

// OOMKills counts OOM kills inside the cgroup.
func (h Hierarchy) OOMKills(path string) int64 {
	if h.Mode == V2 {
		return Keyed(filepath.Join(h.Dir(path, ""), "memory.events"), "oom_kill")
	}
	return Keyed(filepath.Join(h.Dir(path, "memory"), "memory.oom_control"), "oom_kill")
}

// Reclaim asks the kernel to reclaim the cgroup's memory (v2 only; v1 has
// no equivalent for a populated cgroup). It reports whether it could.
func (h Hierarchy) Reclaim(path string) bool {
	if h.Mode != V2 {
		return false
	}
	cur := h.Memory(path)
	if cur <= 0 {
		return true
	}
	err := os.WriteFile(filepath.Join(h.Dir(path, ""), "memory.reclaim"), []byte(strconv.FormatInt(cur, 10)), 0)
	return err == nil
}

// Exists reports whether the cgroup is there.
func (h Hierarchy) Exists(path string) bool {
	return fileExists(h.Dir(path, "pids"))
}

// Frozen reports whether the cgroup is frozen.
func (h Hierarchy) Frozen(path string) bool {
	if h.Mode == V2 {
		return ReadInt(filepath.Join(h.Dir(path, ""), "cgroup.freeze")) == 1
	}
	b, err := os.ReadFile(filepath.Join(h.Dir(path, "freezer"), "freezer.state"))
	return err == nil && strings.TrimSpace(string(b)) == "FROZEN"
}

// Limit is a value to write into a cgroup file.
type Limit struct{ Controller, File, Value string }

// Limits are res's memory, CPU and pids limits in this host's files, in
// the order they may be written.
func (h Hierarchy) Limits(res *specs.LinuxResources) []Limit {
	if h.Mode == V2 {
		return V2Limits(res)
	}
	return V1Limits(res, h.SwapAccounting)
}

// V1Limits are the memory, CPU and pids limits of res in cgroup v1 files,
// in the order they may be written (memsw after the memory limit, the
// period before the quota).
func V1Limits(res *specs.LinuxResources, swap bool) []Limit {
	var l []Limit
	if m := res.Memory; m != nil && m.Limit != nil {
		l = append(l, Limit{"memory", "memory.limit_in_bytes", strconv.FormatInt(*m.Limit, 10)})
		if swap && m.Swap != nil {
			l = append(l, Limit{"memory", "memory.memsw.limit_in_bytes", strconv.FormatInt(*m.Swap, 10)})
		}
	} else {
		l = append(l, Limit{"memory", "memory.limit_in_bytes", "-1"})
	}
	if c := res.CPU; c != nil && c.Quota != nil && c.Period != nil {
		l = append(l, Limit{"cpu", "cpu.cfs_period_us", strconv.FormatUint(*c.Period, 10)},
			Limit{"cpu", "cpu.cfs_quota_us", strconv.FormatInt(*c.Quota, 10)})
		if c.Shares != nil {
			l = append(l, Limit{"cpu", "cpu.shares", strconv.FormatUint(*c.Shares, 10)})
		}
	}
	pids := "max"
	if res.Pids != nil && res.Pids.Limit > 0 {
		pids = strconv.FormatInt(res.Pids.Limit, 10)
	}
	return append(l, Limit{"pids", "pids.max", pids})
}

// V2Limits are the same in cgroup v2 files.
func V2Limits(res *specs.LinuxResources) []Limit {
	mem, swap := "max", "max"
	if m := res.Memory; m != nil && m.Limit != nil {
		mem = strconv.FormatInt(*m.Limit, 10)
		if m.Swap != nil {
			swap = strconv.FormatInt(max(*m.Swap-*m.Limit, 0), 10)
		}
	}
	cpu := "max 100000"
	var weight []Limit
	if c := res.CPU; c != nil && c.Quota != nil && c.Period != nil {
		cpu = strconv.FormatInt(*c.Quota, 10) + " " + strconv.FormatUint(*c.Period, 10)
		if c.Shares != nil {
			weight = []Limit{{"", "cpu.weight", strconv.FormatUint(SharesToWeight(*c.Shares), 10)}}
		}
	}
	pids := "max"
	if res.Pids != nil && res.Pids.Limit > 0 {
		pids = strconv.FormatInt(res.Pids.Limit, 10)
	}
	l := append([]Limit{{"", "memory.max", mem}, {"", "memory.swap.max", swap}, {"", "cpu.max", cpu}}, weight...)
	return append(l, Limit{"", "pids.max", pids})
}

// SharesToWeight converts cgroup v1 CPU shares (2–262144) to a cgroup v2
// weight (1–10000) as crun and runc do.
func SharesToWeight(shares uint64) uint64 {
	if shares == 0 {
		return 100
	}
	return 1 + ((min(max(shares, 2), 262144) - 2) * 9999 / 262142)
}

// Make makes the cgroup at path (in every controller's hierarchy res
// limits, on v1) and writes res's limits into it; it returns the
// directories it made, in the order made, for an undo. A cgroup that is
// there already gets the limits rewritten.
func (h Hierarchy) Make(path string, res *specs.LinuxResources) (made []string, err error) {
	for _, l := range h.Limits(res) {
		p := h.Dir(path, l.Controller)
		if _, err := os.Stat(p); err != nil {
			if h.Mode == V2 {
				// The controllers must be on for the parent's children.
				parent := filepath.Dir(p)
				if err := os.MkdirAll(parent, 0o755); err != nil {
					return made, err
				}
				os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte("+memory +pids +cpu"), 0)
			}
			if err := os.MkdirAll(p, 0o755); err != nil {
				return made, fmt.Errorf("create cgroup %s: %w", p, err)
			}
			made = append(made, p)
		}
		if err := os.WriteFile(filepath.Join(p, l.File), []byte(l.Value), 0); err != nil {
			return made, fmt.Errorf("limit the cgroup %s (%s): %w", path, l.File, err)
		}
	}
	if h.Mode != V2 {
		// CPU time is counted in cpuacct (its own hierarchy on some hosts,
		// mounted with cpu on most).
		p := h.Dir(path, "cpuacct")
		if _, err := os.Stat(p); err != nil {
			if err := os.MkdirAll(p, 0o755); err != nil {
				return made, fmt.Errorf("create cgroup %s: %w", p, err)
			}
			made = append(made, p)
		}
	}
	return made, nil
}

// controllers are the v1 hierarchies a process joins (Join): those Make
// limits, and cpuacct.
var controllers = []string{"memory", "cpu", "cpuacct", "pids"}

// Join moves the process pid into the cgroup at path (every controller's
// on v1; a hierarchy mounted for several, as cpu,cpuacct, is written
// once per name, which is harmless).
func (h Hierarchy) Join(path string, pid int) error {
	if h.Mode == V2 {
		return os.WriteFile(filepath.Join(h.Dir(path, ""), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
	}
	for _, c := range controllers {
		if err := os.WriteFile(filepath.Join(h.Dir(path, c), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("join the %s cgroup %s: %w", c, path, err)
		}
	}
	return nil
}

// Remove removes the cgroup at path and those below it in every
// hierarchy, retrying for up to wait while they still empty (the kernel
// takes a moment to release a killed process's cgroup). A missing one is
// fine; the error is the last one met.
func (h Hierarchy) Remove(path string, wait time.Duration) error {
	var dirs []string
	if h.Mode == V2 {
		dirs = []string{h.Dir(path, "")}
	} else {
		ents, err := os.ReadDir(h.Root)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if e.IsDir() && e.Name() != "unified" {
				dirs = append(dirs, filepath.Join(h.Root, e.Name(), path))
			}
		}
	}
	deadline := time.Now().Add(wait)
	var last error
	for _, d := range dirs {
		for {
			err := RemoveTree(d)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				last = err
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return last
}

// RemoveTree removes a cgroup directory and the cgroups below it. A
// missing one is fine.
func RemoveTree(p string) error {
	ents, err := os.ReadDir(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	for _, e := range ents {
		if e.IsDir() {
			if err := RemoveTree(filepath.Join(p, e.Name())); err != nil {
				return err
			}
		}
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
