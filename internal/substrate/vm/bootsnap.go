package vm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/opendsec/dsec/internal/substrate/qemu"
	"golang.org/x/sys/unix"
)

// Boot snapshots. The first boot of an image on a machine shape (CPUs,
// memory, disk size, boot path, accelerator, agent) is saved right after
// its agent first answers, before anything of the sandbox's own is set;
// later sandboxes of the same image and shape restore it instead of
// booting, then get their own identity (hostname, machine ID, clock,
// randomness), deadline and environment. They share the boot's kernel
// boot ID and uptime. Boot snapshots live in StateDir/boot/<key>/ (files
// as a machine snapshot's) and go when their image's disk or the agent
// they hold is gone.

// bootKey identifies the boot snapshot of machine m: m without what
// differs between its sandboxes, and the QEMU version.
func (d *Driver) bootKey(m machine) string {
	m.CID, m.Hostname = 0, ""
	b, _ := json.Marshal(m)
	h := sha256.Sum256(append(b, d.version...))
	return hex.EncodeToString(h[:12])
}

func (d *Driver) bootDir(m machine) string {
	return filepath.Join(d.cfg.StateDir, "boot", d.bootKey(m))
}

// bootSnapshot returns the boot snapshot of machine m, if there is one.
func (d *Driver) bootSnapshot(m machine) (string, bool) {
	dir := d.bootDir(m)
	if _, err := os.Stat(filepath.Join(dir, qemu.MachineFile)); err != nil {
		return "", false
	}
	return dir, true
}

// saveBootSnapshot saves a freshly booted VM as its machine's boot
// snapshot, unless one exists or another create is saving it. A failure
// costs later creates a boot, nothing more.
func (d *Driver) saveBootSnapshot(ctx context.Context, i *instance) {
	dir := d.bootDir(i.Machine)
	if _, err := os.Stat(filepath.Join(dir, qemu.MachineFile)); err == nil {
		return
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return
	}
	lf, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return
	}
	defer lf.Close()
	if unix.Flock(int(lf.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		return // another create is saving it
	}
	if _, err := os.Stat(filepath.Join(dir, qemu.MachineFile)); err == nil {
		return
	}
	start := time.Now()
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return
	}
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := i.SnapshotMachine(sctx, tmp); err != nil {
		os.RemoveAll(tmp)
		d.log.Warn("could not save the image's boot snapshot; its sandboxes boot", slog.String("sandbox_id", i.ID), slog.Any("error", err))
		return
	}
	if err := os.Rename(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		return
	}
	d.log.Info("saved a boot snapshot: new sandboxes of this image restore it", slog.String("sandbox_id", i.ID),
		slog.String("layer", i.Machine.Layer), slog.Duration("took", time.Since(start)))
}

// pruneBootSnapshots removes boot snapshots whose image disk is gone or
// that hold another agent than this node's (none of its creates would
// restore them).
func (d *Driver) pruneBootSnapshots() {
	root := filepath.Join(d.cfg.StateDir, "boot")
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		p := filepath.Join(root, e.Name())
		if !e.IsDir() {
			if filepath.Ext(e.Name()) == ".lock" {
				if _, err := os.Stat(p[:len(p)-len(".lock")]); err != nil {
					os.Remove(p)
				}
			}
			continue
		}
		if filepath.Ext(e.Name()) == ".tmp" {
			// Being saved, unless left by a crash long ago.
			if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Hour {
				os.RemoveAll(p)
			}
			continue
		}
		var m machine
		b, err := os.ReadFile(filepath.Join(p, qemu.MachineFile))
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err == nil {
			_, err = os.Stat(m.Base)
		}
		if err != nil || m.AgentDisk != d.agentDisk {
			os.RemoveAll(p)
		}
	}
}
