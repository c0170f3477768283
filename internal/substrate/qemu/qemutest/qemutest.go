// Package qemutest holds what the tests of QEMU drivers share: finding,
// killing and accounting for the QEMU processes and files of their VMs.
package qemutest

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"

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

// Kill kills VM id's QEMU, as a crash would.
func Kill(id string) {
	for _, p := range qemu.VMProcesses() {
		if p.ID == id {
			syscall.Kill(p.Pid, syscall.SIGKILL)
		}
	}
}

// Leftovers lists what a destroyed VM left: its QEMU, its sockets in
// runDir and those of files (names in dir) that exist.
func Leftovers(runDir, id, dir string, files ...string) []string {
	var out []string
	if Running(id) {
		out = append(out, "QEMU process")
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
