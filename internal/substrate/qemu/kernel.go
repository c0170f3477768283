package qemu

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Kernel is a guest kernel prepared by scripts/setup.sh (see
// scripts/guest-kernel.sh): an uncompressed vmlinux (booted through its PVH
// entry, which skips the decompressor) and the modules the guest's
// initramfs loads, extracted from Debian's linux-image-cloud-amd64.
//
//	<dir>/vmlinux
//	<dir>/release           the kernel release, e.g. 6.1.0-57-cloud-amd64
//	<dir>/modules/<name>.ko
type Kernel struct {
	Dir     string
	Vmlinux string
	Release string
}

// FindKernel returns the kernel in dir, or an error that says how to get
// one.
func FindKernel(dir string) (*Kernel, error) {
	k := &Kernel{Dir: dir, Vmlinux: filepath.Join(dir, "vmlinux")}
	if st, err := os.Stat(k.Vmlinux); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("no guest kernel in %s (run `dsec setup --cache-dir %s`, which extracts Debian's linux-image-cloud-amd64 there)", dir, filepath.Dir(dir))
	}
	b, err := os.ReadFile(filepath.Join(dir, "release"))
	if err != nil {
		return nil, fmt.Errorf("guest kernel in %s has no release file: %w", dir, err)
	}
	k.Release = strings.TrimSpace(string(b))
	return k, nil
}

// Module is the path of a kernel module of k.
func (k *Kernel) Module(name string) string {
	return filepath.Join(k.Dir, "modules", name+".ko")
}

// HasModule reports whether k ships module name.
func (k *Kernel) HasModule(name string) bool {
	_, err := os.Stat(k.Module(name))
	return err == nil
}

// TSCKHz is the host's TSC frequency in kHz, passed to guests as
// tsc_early_khz: under TCG, concurrent guests calibrating the TSC against
// a slow emulated PIT disagree and hang. 0 if unknown.
func TSCKHz() int {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "cpu MHz" {
			mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int(mhz * 1000)
			}
		}
	}
	return 0
}
