package microvm

import (
	"os"
	"path/filepath"

	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// Boot snapshots (qemu.BootSnapshots): the first boot of an image on a
// machine shape (CPUs, memory, writable disk size, accelerator, channel,
// kernel arguments, a NIC or none) is saved for the next sandboxes of that
// image and shape to restore: a restore under TCG takes a fraction of a
// boot's time and CPU. A restored sandbox gets its own hostname and
// network from the agent, as a fork child does (the NIC's hardware MAC
// stays the first sandbox's; the guest's interface takes its own).
// Snapshots go when the kernel, initramfs or image disk they hold is no
// longer this node's (at driver start). The image disk's name holds the
// agent's digest: a new agent makes new disks, and so new snapshots.

// bootShape is what a boot snapshot's sandboxes share.
type bootShape struct {
	Machine machine `json:"machine"`
	DiskMB  int64   `json:"disk_mb"`
}

// bootKey identifies the boot snapshot of machine m with a writable disk
// of diskMB: m without what differs between its sandboxes, and the QEMU
// version.
func (d *Driver) bootKey(m machine, diskMB int64) string {
	m.CID, m.Hostname, m.Deadline = 0, "", 0
	if m.Net != "" {
		m.Net = "nic"
	}
	return qemu.BootKey(bootShape{m, diskMB}, d.version)
}

// pruneBootSnapshots removes the boot snapshots no create of this node
// would restore.
func (d *Driver) pruneBootSnapshots() {
	d.boots.Prune(func(dir string) bool {
		m, err := qemu.ReadMachine[machine](dir)
		if err != nil || m.Kernel != d.kernel.Vmlinux || m.Release != d.kernel.Release || m.Initrd != d.initrd {
			return false
		}
		_, err = os.Stat(m.Image)
		if err == nil {
			_, err = os.Stat(filepath.Join(dir, diskFile))
		}
		return err == nil
	})
}
