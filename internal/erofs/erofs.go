// Package erofs makes EROFS images with the distribution's mkfs.erofs and
// mounts them from their files (no loop device) as detached mounts.
package erofs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Mkfs writes an EROFS image of directory src to dst (through a
// temporary file of its own beside it: dst is complete or absent, and
// stores on one host making the same image do not write into each
// other's). Owners, modes,
// modification times, hard links, devices (overlayfs whiteouts among
// them) and extended attributes (opaque directories, file capabilities)
// are the directory's. args are further mkfs.erofs options (e.g.
// --chunksize and --blobdev: the data in a blob of its own).
func Mkfs(mkfs, src, dst string, args ...string) error {
	f, err := os.CreateTemp(filepath.Dir(dst), filepath.Base(dst)+".*.tmp")
	if err != nil {
		return err
	}
	tmp := f.Name()
	f.Close()
	argv := append([]string{"--quiet", "--preserve-mtime"}, args...)
	out, err := exec.Command(mkfs, append(argv, tmp, src)...).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("mkfs.erofs: %w: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// Mount mounts the EROFS image in file read-only as a detached mount
// (in no mount table) and returns its descriptor (close-on-exec). devices
// are the image's extra devices (its blobs), files too.
func Mount(file string, devices ...string) (int, error) {
	fsfd, err := unix.Fsopen("erofs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen erofs: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", file); err != nil {
		return -1, fmt.Errorf("erofs source %s: %w", file, err)
	}
	for _, d := range devices {
		if err := unix.FsconfigSetString(fsfd, "device", d); err != nil {
			return -1, fmt.Errorf("erofs device %s: %w", d, err)
		}
	}
	if err := unix.FsconfigSetFlag(fsfd, "ro"); err != nil {
		return -1, fmt.Errorf("erofs ro: %w", err)
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("mount erofs %s: %w", file, err)
	}
	fd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_RDONLY)
	if err != nil {
		return -1, fmt.Errorf("fsmount erofs %s: %w", file, err)
	}
	return fd, nil
}

// FdPath is the path of descriptor fd in this process: a mount's root.
// It ends in "/.", so the magic link is followed even by a walk that
// takes its root as it is (filepath.WalkDir does not follow a symlink).
func FdPath(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) + "/." }
