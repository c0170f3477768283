package node

import (
	"os"
	"path/filepath"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/loopfs"
	"github.com/opendsec/dsec/internal/substrate"
	"golang.org/x/sys/unix"
)

// Shared volumes (SandboxSpec.shared_volumes): file systems of one
// sandbox, which its containers mount by name — Compose's named volumes
// between services. Each is an ext4 image in the sandbox's directory
// (loopfs, as project volumes and sandbox disks are), mounted in the
// node's mount namespace at DIR/shared/<name> while the sandbox starts;
// the container driver clones that mount into each container, id-mapped
// through the container's user namespace, so a file one container's root
// writes is root's in every other. The containers' clones keep the file
// system; release unmounts the node's mount, and the loop device detaches
// itself once the last clone is gone, with its image in the discarded
// directory.

const (
	maxSharedVolumes      = 8
	defaultSharedVolumeMB = 1024
)

// sharedVolume returns spec's shared volume name, or nil.
func sharedVolume(spec *dsecv1.SandboxSpec, name string) *dsecv1.SharedVolume {
	for _, v := range spec.GetSharedVolumes() {
		if v.GetName() == name {
			return v
		}
	}
	return nil
}

// normalizeShared checks spec's shared volumes and fills in their size.
func (n *Node) normalizeShared(spec *dsecv1.SandboxSpec) error {
	vols := spec.GetSharedVolumes()
	if len(vols) == 0 {
		return nil
	}
	if substrate.Kind(spec.Kind) != substrate.KindContainer || spec.Runtime != "" {
		return errdefs.Unimplemented("shared volumes need kind container with its default runtime")
	}
	if len(vols) > maxSharedVolumes {
		return errdefs.Invalid("at most %d shared volumes", maxSharedVolumes)
	}
	if why := loopfs.Available(); why != "" {
		return errdefs.Unavailable("shared volumes are unavailable on node %s: %s", n.cfg.Name, why)
	}
	seen := map[string]bool{}
	for _, v := range vols {
		if !sidecarNameRe.MatchString(v.GetName()) {
			return errdefs.Invalid("shared volume name %q is invalid (lower-case letters, digits, '_', '.', '-'; at most 63)", truncate(v.GetName(), 64))
		}
		if seen[v.Name] {
			return errdefs.Invalid("shared volume %q is declared twice", v.Name)
		}
		seen[v.Name] = true
		if v.SizeMb == 0 {
			v.SizeMb = defaultSharedVolumeMB
		}
		if v.SizeMb < 16 || v.SizeMb > n.cfg.MaxVolumeMB {
			return errdefs.Invalid("shared volume %q: size_mb %d out of range [16, %d]", v.Name, v.SizeMb, n.cfg.MaxVolumeMB)
		}
	}
	return nil
}

// sharedDir is where the node mounts s's shared volume name.
func sharedDir(dir, name string) string { return filepath.Join(dir, "shared", name) }

// makeShared makes and mounts s's shared volumes, empty. On error what it
// made is left for dropShared.
func (n *Node) makeShared(s *sandbox) error {
	for _, v := range s.spec.GetSharedVolumes() {
		dir := sharedDir(s.dir, v.Name)
		if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
			return errdefs.Internal(err, "make shared volume %q", v.Name)
		}
		if err := loopfs.Make(dir+".img", v.SizeMb, loopfs.Options{}); err != nil {
			return errdefs.Internal(err, "make shared volume %q", v.Name)
		}
		if err := loopfs.AttachMount(dir+".img", dir); err != nil {
			return errdefs.Internal(err, "mount shared volume %q", v.Name)
		}
		os.Remove(filepath.Join(dir, "lost+found"))
	}
	return nil
}

// dropShared unmounts s's shared volumes from the node (after a restart
// they are not mounted there: nothing to do); their images go with s's
// directory.
func (n *Node) dropShared(s *sandbox) {
	if s.dir == "" {
		return
	}
	for _, v := range s.spec.GetSharedVolumes() {
		unix.Unmount(sharedDir(s.dir, v.Name), unix.MNT_DETACH)
	}
}

// sharedMounts are the driver mounts of a container's mounts of shared
// volumes.
func sharedMounts(s *sandbox, mounts []*dsecv1.VolumeMount) []substrate.VolumeMount {
	var out []substrate.VolumeMount
	for _, m := range mounts {
		if sharedVolume(s.spec, m.GetName()) != nil {
			out = append(out, substrate.VolumeMount{Source: sharedDir(s.dir, m.GetName()), Path: m.GetPath(), ReadOnly: m.GetReadOnly()})
		}
	}
	return out
}

// sharedMeta is what a snapshot keeps of s's shared volumes.
func sharedMeta(spec *dsecv1.SandboxSpec) (vols []image.SnapshotShared, mounts []image.SnapshotMount) {
	for _, v := range spec.GetSharedVolumes() {
		vols = append(vols, image.SnapshotShared{Name: v.Name, SizeMB: v.SizeMb})
	}
	for _, m := range spec.GetVolumes() {
		if sharedVolume(spec, m.GetName()) != nil {
			mounts = append(mounts, image.SnapshotMount{Name: m.Name, Path: m.Path, ReadOnly: m.ReadOnly})
		}
	}
	return vols, mounts
}

// restoreShared gives a sandbox started from a snapshot that declares no
// shared volumes the snapshot's (empty) and its main container's mounts
// of them, as its sidecars get theirs (normalizeSidecars).
func restoreShared(spec *dsecv1.SandboxSpec, from *image.Image) {
	snap := from.GetSnapshot()
	if snap == nil || len(snap.Shared) == 0 || len(spec.SharedVolumes) > 0 {
		return
	}
	for _, v := range snap.Shared {
		spec.SharedVolumes = append(spec.SharedVolumes, &dsecv1.SharedVolume{Name: v.Name, SizeMb: v.SizeMB})
	}
	for _, m := range snap.SharedMounts {
		spec.Volumes = append(spec.Volumes, &dsecv1.VolumeMount{Name: m.Name, Path: m.Path, ReadOnly: m.ReadOnly})
	}
}
