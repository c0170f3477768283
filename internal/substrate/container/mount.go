package container

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
)

// maxMountData is the kernel's limit on mount options (one page).
const maxMountData = 4095

// mountOverlay mounts lowers (top first) under upper at target.
func mountOverlay(lowers []string, upper, work, target string) error {
	data := "lowerdir=" + strings.Join(lowers, ":") + ",upperdir=" + upper + ",workdir=" + work
	if len(data) > maxMountData {
		return errdefs.Invalid("image has too many layers for one overlay mount (%d)", len(lowers)-1)
	}
	if err := unix.Mount("overlay", target, "overlay", unix.MS_NODEV, data); err != nil {
		return errdefs.Internal(err, "mount sandbox root filesystem")
	}
	return nil
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
