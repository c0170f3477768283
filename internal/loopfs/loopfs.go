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
	"sync"

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
//
// mkfs scans the host's mounts (tens of milliseconds where a node holds
// thousands of sandboxes, each with its mounts): the first image of each
// shape is made by mkfs, as a template beside img, and every image is a
// sparse copy of its template (a few hundred KiB of data). The copies share
// the template's UUID, which no one here reads.
func Make(img string, sizeMB int64, o Options) (err error) {
	if o.BytesPerInode == 0 {
		o.BytesPerInode = 16 << 10
	}
	tmpl := filepath.Join(filepath.Dir(img), fmt.Sprintf(".template-%dm-%d-%t.ext4", sizeMB, o.BytesPerInode, o.Journal))
	if err := makeTemplate(tmpl, sizeMB, o); err != nil {
		return err
	}
	return copySparse(tmpl, img)
}

// templateMu serializes the making of templates.
var templateMu sync.Mutex

func makeTemplate(tmpl string, sizeMB int64, o Options) error {
	templateMu.Lock()
	defer templateMu.Unlock()
	if _, err := os.Stat(tmpl); err == nil {
		return nil
	}
	tmp := tmpl + ".new"
	os.Remove(tmp) // a crash's
	if err := mkfs(tmp, sizeMB, o); err != nil {
		return err
	}
	return os.Rename(tmp, tmpl)
}

func mkfs(img string, sizeMB int64, o Options) (err error) {
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
	// No blocks reserved for growing the file system online (resize_inode):
	// nothing grows these, and mkfs would write 4 MiB of them into every
	// image (228 KiB without, for 10 GiB), each a sandbox create's write
	// to the node's disk and page cache.
	features := "^has_journal,^resize_inode"
	if o.Journal {
		features = "has_journal,^resize_inode"
	}
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", "-i", strconv.Itoa(o.BytesPerInode), "-m", "0",
		"-O", features, "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", img).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mkfs.ext4: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// copySparse copies src to dst (created; removed on error), its data
// ranges only: dst is as sparse as src.
func copySparse(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(dst)
		}
	}()
	if err := out.Truncate(st.Size()); err != nil {
		return err
	}
	for off := int64(0); off < st.Size(); {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole is left
		}
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		for r, w := data, data; r < hole; {
			n, err := unix.CopyFileRange(int(in.Fd()), &r, int(out.Fd()), &w, int(hole-r), 0)
			if err != nil {
				return fmt.Errorf("copy %s: %w", src, err)
			}
			if n == 0 {
				return fmt.Errorf("copy %s: short copy", src)
			}
		}
		off = hole
	}
	return nil
}

// MountFlags are the flags every loop file system is mounted with: no
// set-user-ID programs and no device nodes act from it, and reads do not
// write access times.
const MountFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOATIME

// Mount mounts the ext4 file system on dev at dir (made if missing), with
// MountFlags, discarding freed blocks. Its inode tables are not zeroed
// in the background (noinit_itable): the image was made sparse, they read
// as zeros already, and a kernel thread zeroing every sandbox's in turn is
// work a dense node does not need.
func Mount(dev, dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := unix.Mount(dev, dir, "ext4", MountFlags, "discard,noinit_itable"); err != nil {
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
