// Package qemutest holds what the tests of QEMU drivers share: finding,
// killing and accounting for the QEMU processes and files of their VMs.
package qemutest

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/opendsec/dsec/internal/cgroup"
	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// Pids lists the live QEMU processes whose VM ID starts with prefix.
func Pids(prefix string) []int {
	var out []int
	for _, p := range qemu.VMProcesses() {
		if strings.HasPrefix(p.ID, prefix) {
			out = append(out, p.Pid)
		}
	}
	return out
}

// Running reports whether VM id's QEMU runs.
func Running(id string) bool {
	for _, p := range qemu.VMProcesses() {
		if p.ID == id {
			return true
		}
	}
	return false
}

// Cgroup is a cgroup directory of VM id's QEMU (below the drivers'
// default parent) that exists in some controller's hierarchy, or "".
func Cgroup(id string) string {
	h := cgroup.Probe()
	for _, c := range []string{"memory", "cpu", "pids"} {
		if d := h.Dir(qemu.CgroupOf("/dsec", id), c); dirExists(d) {
			return d
		}
	}
	return ""
}

func dirExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// CgroupsOf lists the cgroups process pid is in, by controller name
// ("" for cgroup v2's).
func CgroupsOf(pid int) map[string]string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	out := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			out[c] = f[2]
		}
	}
	return out
}

// Kill kills VM id's QEMU, as a crash would.
func Kill(id string) {
	for _, p := range qemu.VMProcesses() {
		if p.ID == id {
			syscall.Kill(p.Pid, syscall.SIGKILL)
		}
	}
}

// Leftovers lists what a destroyed VM left: its QEMU, its cgroup (below
// the default parent), its sockets in runDir and those of files (names in
// dir) that exist.
func Leftovers(runDir, id, dir string, files ...string) []string {
	var out []string
	if Running(id) {
		out = append(out, "QEMU process")
	}
	if cg := Cgroup(id); cg != "" {
		out = append(out, "cgroup "+cg)
	}
	paths := []string{qemu.AgentSock(runDir, id), qemu.QMPSock(runDir, id)}
	for _, f := range files {
		paths = append(paths, filepath.Join(dir, f))
	}
	for _, p := range paths {
		if _, err := os.Stat(p); err == nil {
			out = append(out, p)
		}
	}
	return out
}
