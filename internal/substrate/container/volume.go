package container

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/substrate"
)

// Volumes.
//
// The node mounts each volume's file system in its mount namespace (see
// internal/volume); ownership on it is as sandboxes see it, 0 being their
// root. A sandbox's volumes are cloned from there (open_tree), id-mapped
// through the sandbox's user namespace like its image's layers (so its
// root, a host id of its range, writes files owned by 0 on the volume, and
// the next sandbox, in another range, sees them as its own root's), made
// read-only for a read-only mount, and attached at dir/<i> for the runtime
// to bind: the OCI spec binds dir/<i> at the volume's path, nosuid and
// nodev. A bind of an id-mapped mount keeps its mapping. The attachments
// are detached once the runtime has made the sandbox's mounts (its mount
// namespace holds its own clones), so nothing of them is left to adopt or
// destroy.

// attachVolumes attaches vols at dir/<i>, id-mapped through userns (nil:
// as they are), read-only where asked. detach undoes it.
func attachVolumes(dir string, vols []substrate.VolumeMount, userns *os.File) (detach func(), err error) {
	var attached []string
	undo := func() {
		for _, p := range attached {
			unix.Unmount(p, unix.MNT_DETACH)
		}
	}
	if len(vols) == 0 {
		return undo, nil
	}
	defer func() {
		// Not detach: an error return has set it to nil.
		if err != nil {
			undo()
		}
	}()
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return nil, err
	}
	for i, v := range vols {
		target := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(target, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
		fd, err := unix.OpenTree(unix.AT_FDCWD, v.Source, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("clone volume mount: %w", err)
		}
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
		if v.ReadOnly {
			attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
		}
		if userns != nil {
			attr.Attr_set |= unix.MOUNT_ATTR_IDMAP
			attr.Userns_fd = uint64(userns.Fd())
		}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("id-map volume mount: %w", err)
		}
		err = unix.MoveMount(fd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("attach volume mount: %w", err)
		}
		attached = append(attached, target)
	}
	return undo, nil
}

// volumeDir is where s's volumes are attached for the runtime: the
// sandbox's directory, or under gVisor its jail (the gofer, in the
// sandbox's user namespace, cannot search the node's directories).
func volumeDir(s *substrate.Spec, st state) string {
	if st.Jail != "" {
		return filepath.Join(st.Jail, "vol")
	}
	return filepath.Join(s.Dir, "vol")
}

// volumeMounts are the OCI binds of vols attached at dir/<i>.
func volumeMounts(dir string, vols []substrate.VolumeMount) []specs.Mount {
	out := make([]specs.Mount, len(vols))
	for i, v := range vols {
		mode := "rw"
		if v.ReadOnly {
			mode = "ro"
		}
		out[i] = specs.Mount{Destination: v.Path, Type: "bind", Source: filepath.Join(dir, strconv.Itoa(i)), Options: []string{"bind", mode, "nosuid", "nodev"}}
	}
	return out
}
