package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// BootSnapshots are a driver's boot snapshots. The first boot of an image
// on a machine shape is saved right after its agent first answers, before
// anything of the sandbox's own is set; later sandboxes of the same image
// and shape restore it instead of booting, then get their own identity
// (hostname, network, clock, randomness), deadline and environment. They
// share the boot's kernel boot ID and uptime. A snapshot lives in
// Dir/<key>/ (files as a machine snapshot's: MachineFile, MemoryFile, the
// disks) and goes when Prune finds what it needs gone.
type BootSnapshots struct {
	Dir string // the driver's StateDir/boot
	Log *slog.Logger
}

// BootKey is the key of the boot snapshot of a machine shape: shape is
// the driver's machine with what differs between its sandboxes blanked
// (and anything else the boot depends on added); version is QEMU's.
func BootKey(shape any, version string) string {
	b, _ := json.Marshal(shape)
	h := sha256.Sum256(append(b, version...))
	return hex.EncodeToString(h[:12])
}

func (b BootSnapshots) dir(key string) string { return filepath.Join(b.Dir, key) }

// Find returns the directory of key's boot snapshot, if there is one.
func (b BootSnapshots) Find(key string) (string, bool) {
	dir := b.dir(key)
	if _, err := os.Stat(filepath.Join(dir, MachineFile)); err != nil {
		return "", false
	}
	return dir, true
}

// Save saves key's boot snapshot with snapshot (which writes a machine
// snapshot of the freshly booted sandbox id into the directory it is
// given), unless one exists or another create is saving it. A failure
// costs later creates a boot, nothing more.
func (b BootSnapshots) Save(ctx context.Context, key, id string, snapshot func(ctx context.Context, dir string) error) {
	dir := b.dir(key)
	if _, err := os.Stat(filepath.Join(dir, MachineFile)); err == nil {
		return
	}
	if err := os.MkdirAll(b.Dir, 0o700); err != nil {
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
	if _, err := os.Stat(filepath.Join(dir, MachineFile)); err == nil {
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
	if err := snapshot(sctx, tmp); err != nil {
		os.RemoveAll(tmp)
		b.Log.Warn("could not save the image's boot snapshot; its sandboxes boot", slog.String("sandbox_id", id), slog.Any("error", err))
		return
	}
	if err := os.Rename(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		return
	}
	b.Log.Info("saved a boot snapshot: new sandboxes of this image and shape restore it", slog.String("sandbox_id", id),
		slog.Duration("took", time.Since(start)))
}

// Prune removes the boot snapshots keep is false for (given each one's
// directory: what it needs is gone, or no create of this node would
// restore it), lock files without a snapshot, and snapshots a crash left
// half saved over an hour ago.
func (b BootSnapshots) Prune(keep func(dir string) bool) {
	ents, _ := os.ReadDir(b.Dir)
	for _, e := range ents {
		p := filepath.Join(b.Dir, e.Name())
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
		if !keep(p) {
			os.RemoveAll(p)
		}
	}
}
