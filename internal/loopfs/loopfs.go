// Package loopfs makes file systems of a bounded size out of sparse image
// files: an ext4 image attached to a loop device and mounted. A writer past
// the size or the inodes gets ENOSPC and nothing outside the image is
// touched; blocks freed inside go back to the host (the mount discards and
// the loop device punches holes in the image).
//
// The container substrate keeps each sandbox's writable layer on one
// (internal/substrate/container, disk.go); the node keeps each volume on
// one (internal/volume).
//
// A loop device is attached with autoclear: it detaches itself once its
// last mount is gone, in whatever mount namespace. A process restarted
// while mounts of an image live on (in a sandbox's mount namespace) finds
// the image's loop device again (Attached) and mounts that one: a second
// loop device over the same image would be a second file system over the
// same blocks.
package loopfs

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Available says why this host cannot make loop file systems ("" if it
// can): mkfs.ext4 and loop devices are needed.
func Available() string {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		return "mkfs.ext4 not found (apt-get install e2fsprogs)"
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "no loop devices (/dev/loop-control)"
	}
	return ""
}

// Options shape a new file system.
type Options struct {
	// BytesPerInode sizes the inode count from the size (default 16 KiB).
	BytesPerInode int
	// Journal keeps an ext4 journal (default none: the file system does not
	// outlive the host, or its writer accepts losing the last writes in a
	// crash).
	Journal bool
}

// Make creates img, a sparse ext4 image of sizeMB whose root directory is
// owned by 0:0 (mkfs makes a lost+found directory in it). On error img is
// removed.
func Make(img string, sizeMB int64, o Options) (err error) {
	if o.BytesPerInode == 0 {
		o.BytesPerInode = 16 << 10
	}
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.Remove(img)
		}
	}()
	err = f.Truncate(sizeMB << 20)
	f.Close()
	if err != nil {
		return err
	}
	features := "^has_journal"
	if o.Journal {
		features = "has_journal"
	}
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", "-i", strconv.Itoa(o.BytesPerInode), "-m", "0",
		"-O", features, "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", img).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mkfs.ext4: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// MountFlags are the flags every loop file system is mounted with: no
// set-user-ID programs and no device nodes act from it, and reads do not
// write access times.
const MountFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOATIME

// Mount mounts the ext4 file system on dev at dir (made if missing), with
// MountFlags, discarding freed blocks.
func Mount(dev, dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := unix.Mount(dev, dir, "ext4", MountFlags, "discard"); err != nil {
		return fmt.Errorf("mount a loop file system: %w", err)
	}
	return nil
}

// Loops maps the backing files of a host's attached loop devices, by
// (device, inode), to the devices.
type Loops map[[2]uint64]string

// Attached returns this host's attached loop devices.
func Attached() Loops {
	out := Loops{}
	ents, _ := os.ReadDir("/sys/block")
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if _, err := os.Stat(filepath.Join("/sys/block", e.Name(), "loop")); err != nil {
			continue // not attached
		}
		f, err := os.Open("/dev/" + e.Name())
		if err != nil {
			continue
		}
		info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		f.Close()
		if err == nil {
			out[[2]uint64{info.Device, info.Inode}] = "/dev/" + e.Name()
		}
	}
	return out
}

// Of returns the loop device img is attached to, or "".
func (l Loops) Of(img string) string {
	var st unix.Stat_t
	if unix.Stat(img, &st) != nil {
		return ""
	}
	return l[[2]uint64{st.Dev, st.Ino}]
}

// Attach attaches img to a free loop device that detaches itself once
// nothing uses it: it is returned open, to be closed once mounted.
func Attach(img string) (string, *os.File, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return "", nil, err
	}
	defer ctl.Close()
	backing, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		return "", nil, err
	}
	defer backing.Close()
	for tries := 0; tries < 16; tries++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", nil, err
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		f, err := os.OpenFile(dev, os.O_RDWR, 0)
		if err != nil {
			return "", nil, err
		}
		// Direct I/O: the image's pages are not cached twice (in the
		// file system's and in the host's).
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
		err = unix.IoctlLoopConfigure(int(f.Fd()), &cfg)
		if errors.Is(err, unix.EINVAL) {
			cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
			err = unix.IoctlLoopConfigure(int(f.Fd()), &cfg)
		}
		if errors.Is(err, unix.EBUSY) {
			f.Close()
			continue // another process took it first
		}
		if err != nil {
			f.Close()
			return "", nil, err
		}
		return dev, f, nil
	}
	return "", nil, errors.New("no free loop device")
}

// AttachMount attaches img to a loop device and mounts it at dir.
func AttachMount(img, dir string) error {
	dev, held, err := Attach(img)
	if err != nil {
		return fmt.Errorf("attach a loop device: %w", err)
	}
	err = Mount(dev, dir)
	held.Close() // the mount holds it now, or it detaches
	return err
}
