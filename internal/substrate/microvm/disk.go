package microvm

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/erofs"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// skeletonVersion changes when the skeleton layer does, so image disks are
// rebuilt.
const skeletonVersion = "1"

// imageDisk returns the read-only EROFS disk of an image: its layers
// merged (through a read-only overlay mount on the host) under a skeleton
// layer holding the agent binary and the mountpoints the init needs. It is
// built once per (layers, agent) and shared by every VM of the image;
// concurrent callers wait for one build.
func (d *Driver) imageDisk(layers []substrate.Layer) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "skeleton %s\nguest %s\n", skeletonVersion, d.guestDigest)
	for _, l := range layers {
		fmt.Fprintln(h, strings.TrimPrefix(l.DiffID, "sha256:"))
	}
	key := hex.EncodeToString(h.Sum(nil)[:12])
	dir := filepath.Join(d.cfg.StateDir, "disks")
	path := filepath.Join(dir, key+".erofs")
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", errdefs.Internal(err, "create image disk directory")
	}
	unlock, err := qemu.LockFile(path + ".lock")
	if err != nil {
		return "", errdefs.Internal(err, "lock image disk")
	}
	defer unlock()
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	work, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		return "", errdefs.Internal(err, "create image disk build directory")
	}
	defer os.RemoveAll(work)
	skel := filepath.Join(work, "skel")
	if err := d.writeSkeleton(skel); err != nil {
		return "", errdefs.Internal(err, "write the skeleton layer")
	}
	merged := filepath.Join(work, "merged")
	if err := os.Mkdir(merged, 0o755); err != nil {
		return "", errdefs.Internal(err, "create merge mountpoint")
	}
	lowers := []string{skel}
	for _, l := range layers {
		lowers = append(lowers, l.Link)
	}
	opts := "lowerdir=" + strings.Join(lowers, ":")
	if len(opts) > 4095 {
		return "", errdefs.Invalid("image has too many layers (%d)", len(layers))
	}
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_RDONLY, opts); err != nil {
		return "", errdefs.Internal(err, "mount image layers")
	}
	defer unix.Unmount(merged, unix.MNT_DETACH)
	if err := erofs.Mkfs(d.mkfsErofs, merged, path); err != nil {
		return "", errdefs.Internal(err, "build the image disk")
	}
	return path, nil
}

// writeSkeleton writes the top image layer: the agent at /.dsec/guest and
// the mountpoints the init uses, so nothing of the kind lands in a
// sandbox's writable layer.
func (d *Driver) writeSkeleton(dir string) error {
	for _, sub := range []string{"proc", "sys", "dev", "run", "tmp", "etc", ".dsec/etc"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return err
		}
	}
	os.Chmod(filepath.Join(dir, "tmp"), 0o1777|os.ModeSticky)
	for _, f := range []string{"etc/hostname", "etc/hosts", "etc/resolv.conf"} {
		if err := os.WriteFile(filepath.Join(dir, f), nil, 0o644); err != nil {
			return err
		}
	}
	return copyFile(d.cfg.GuestBinary, filepath.Join(dir, ".dsec/guest"), 0o755)
}

// diskTemplate returns an empty ext4 file system of sizeMB (sparse),
// built once per size; sandboxes get sparse copies.
func (d *Driver) diskTemplate(sizeMB int64) (string, error) {
	dir := filepath.Join(d.cfg.StateDir, "templates")
	path := filepath.Join(dir, fmt.Sprintf("ext4-%d.img", sizeMB))
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	unlock, err := qemu.LockFile(path + ".lock")
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	tmp := path + ".tmp"
	os.Remove(tmp)
	// No journal (a sandbox's disk does not outlive a crash of its VM), no
	// reserved blocks, and inode tables initialized now rather than by a
	// kernel thread in every guest.
	cmd := exec.Command(d.mkfsExt4, "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-m", "0",
		"-E", "lazy_itable_init=0,nodiscard", "-L", "dsec-disk", tmp, fmt.Sprintf("%dM", sizeMB))
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("mkfs.ext4: %w: %s", err, bytes.TrimSpace(out))
	}
	return path, os.Rename(tmp, path)
}

func copyFile(src, dst string, perm os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
