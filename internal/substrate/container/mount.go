package container

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
)

// maxMountData is the kernel's limit on mount options (one page).
const maxMountData = 4095

// mountOverlay mounts an overlay at target whose layers are named
// relative to base: lowers (top first), upper and work. Relative names
// keep host paths out of the mount's options, which a sandbox reads in its
// own /proc/self/mountinfo.
func mountOverlay(base string, lowers []string, upper, work, target string) error {
	target, err := filepath.Abs(target)
	if err != nil {
		return errdefs.Internal(err, "mount sandbox root filesystem")
	}
	data := "lowerdir=" + strings.Join(lowers, ":") + ",upperdir=" + upper + ",workdir=" + work
	if len(data) > maxMountData {
		return errdefs.Invalid("image has too many layers for one overlay mount (%d)", len(lowers)-1)
	}
	err = inDir(base, func() error { return unix.Mount("overlay", target, "overlay", unix.MS_NODEV, data) })
	if err != nil {
		return errdefs.Internal(err, "mount sandbox root filesystem")
	}
	return nil
}

// inDir runs f on a thread of its own whose working directory is dir (the
// process's stays where it is). The thread is discarded afterwards.
func inDir(dir string, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the goroutine's end ends the thread, with its
		// own file system context.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			errc <- err
			return
		}
		if err := unix.Chdir(dir); err != nil {
			errc <- err
			return
		}
		errc <- f()
	}()
	return <-errc
}

// unmount detaches a mount; a path that is not mounted (or no longer
// exists) is fine.
func unmount(target string) error {
	err := unix.Unmount(target, unix.MNT_DETACH)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// listenSocket binds a listening unix socket at path and returns it as a
// file to pass to the agent. The path is outside the sandbox's mount
// namespace, so nothing inside can connect to it.
func listenSocket(path string) (*os.File, error) {
	os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	f, err := l.File()
	l.Close()
	if err != nil {
		os.Remove(path)
		return nil, err
	}
	return f, nil
}

func shortHash(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:4])
}
