package vm

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"

	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// Boot snapshots (qemu.BootSnapshots): the first boot of an image on a
// machine shape (CPUs, memory, disk size, boot path, accelerator, agent,
// NIC) is saved for the next sandboxes of that image and shape to
// restore. They go when their image's disk or the agent they hold is gone
// (at driver start).

// bootKey identifies the boot snapshot of machine m: m without what
// differs between its sandboxes, and the QEMU version.
func (d *Driver) bootKey(m machine) string {
	m.CID, m.Hostname = 0, ""
	return qemu.BootKey(m, d.version)
}

// bootSnapshot returns the boot snapshot of machine m, if there is one.
func (d *Driver) bootSnapshot(m machine) (string, bool) { return d.boots.Find(d.bootKey(m)) }

// saveBootSnapshot saves a freshly booted VM as its machine's boot
// snapshot, unless one exists or another create is saving it.
func (d *Driver) saveBootSnapshot(ctx context.Context, i *instance) {
	d.boots.Save(ctx, d.bootKey(i.Machine), i.ID, i.SnapshotMachine)
}

// pruneBootSnapshots removes boot snapshots whose image disk is gone or
// that hold another agent than this node's (none of its creates would
// restore them).
func (d *Driver) pruneBootSnapshots() {
	d.boots.Prune(func(dir string) bool {
		var m machine
		b, err := os.ReadFile(filepath.Join(dir, qemu.MachineFile))
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err == nil {
			_, err = os.Stat(m.Base)
		}
		return err == nil && m.AgentDisk == d.agentDisk
	})
}
