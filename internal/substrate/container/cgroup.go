package container

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

type cgroupMode int

const (
	cgroupV1 cgroupMode = iota + 1
	cgroupHybrid
	cgroupV2
)

func (m cgroupMode) String() string {
	switch m {
	case cgroupV1:
		return "v1"
	case cgroupHybrid:
		return "hybrid (v1 controllers, cgroup2 hidden in the node's mount namespace)"
	case cgroupV2:
		return "v2"
	}
	return "unknown"
}

// cgroups reads a sandbox's cgroup files. The runtime creates and removes
// the cgroups; the driver reads them, writes memory.reclaim, and rewrites
// or lifts the CPU quota (cpudebt.go).
type cgroups struct {
	mode           cgroupMode
	root           string // /sys/fs/cgroup
	swapAccounting bool
}

func probeCgroups() cgroups {
	c := cgroups{root: "/sys/fs/cgroup"}
	var st unix.Statfs_t
	if unix.Statfs(c.root, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		c.mode = cgroupV2
		c.swapAccounting = fileExists(filepath.Join(c.root, "memory.swap.max")) || fileExists(filepath.Join(c.root, "init.scope", "memory.swap.max"))
		return c
	}
	c.mode = cgroupV1
	if _, err := os.Stat(filepath.Join(c.root, "unified")); err == nil {
		c.mode = cgroupHybrid
	}
	c.swapAccounting = fileExists(filepath.Join(c.root, "memory", "memory.memsw.limit_in_bytes"))
	return c
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// dir is a sandbox's cgroup directory for a v1 controller, or the v2 one.
func (c cgroups) dir(path, controller string) string {
	if c.mode == cgroupV2 {
		return filepath.Join(c.root, path)
	}
	return filepath.Join(c.root, controller, path)
}

func readInt(p string) int64 {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// keyed reads "key value" lines (memory.events, cpu.stat, oom_control).
func keyed(p, key string) int64 {
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

func (c cgroups) memory(path string) int64 {
	if c.mode == cgroupV2 {
		return readInt(filepath.Join(c.dir(path, ""), "memory.current"))
	}
	return readInt(filepath.Join(c.dir(path, "memory"), "memory.usage_in_bytes"))
}

func (c cgroups) cpu(path string) time.Duration {
	if c.mode == cgroupV2 {
		return time.Duration(keyed(filepath.Join(c.dir(path, ""), "cpu.stat"), "usage_usec")) * time.Microsecond
	}
	return time.Duration(readInt(filepath.Join(c.dir(path, "cpuacct"), "cpuacct.usage")))
}

func (c cgroups) pids(path string) int64 {
	return readInt(filepath.Join(c.dir(path, "pids"), "pids.current"))
}

// oomKills counts OOM kills inside the cgroup.
func (c cgroups) oomKills(path string) int64 {
	if c.mode == cgroupV2 {
		return keyed(filepath.Join(c.dir(path, ""), "memory.events"), "oom_kill")
	}
	return keyed(filepath.Join(c.dir(path, "memory"), "memory.oom_control"), "oom_kill")
}

// reclaim asks the kernel to reclaim the cgroup's memory (v2 only; v1 has
// no equivalent for a populated cgroup). It reports whether it could.
func (c cgroups) reclaim(path string) bool {
	if c.mode != cgroupV2 {
		return false
	}
	cur := c.memory(path)
	if cur <= 0 {
		return true
	}
	err := os.WriteFile(filepath.Join(c.dir(path, ""), "memory.reclaim"), []byte(strconv.FormatInt(cur, 10)), 0)
	return err == nil
}

// exists reports whether the sandbox's cgroup is still there.
func (c cgroups) exists(path string) bool {
	return fileExists(c.dir(path, "pids"))
}

// frozen reports whether the sandbox's cgroup is frozen (paused).
func (c cgroups) frozen(path string) bool {
	if c.mode == cgroupV2 {
		return readInt(filepath.Join(c.dir(path, ""), "cgroup.freeze")) == 1
	}
	b, err := os.ReadFile(filepath.Join(c.dir(path, "freezer"), "freezer.state"))
	return err == nil && strings.TrimSpace(string(b)) == "FROZEN"
}
