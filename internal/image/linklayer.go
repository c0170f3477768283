package image

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A bootstrapped image's layers are its cached builds (cache/rootfs/<key>),
// written as tars and unpacked into the store: for the debian root
// filesystem, tens of thousands of files read, hashed and written again by
// every store on the host (each test server, each node of a one-host
// cluster), about 6.7 CPU-seconds each. The build never changes once
// complete (a forced rebuild makes a new directory), so a store that finds
// the layer's diff ID recorded beside the build (the first import's, by
// the tar) links the build's files into its layer instead: the same
// content, by the same rules as unpacking the tar would give it, without
// reading a byte of it. Where linking cannot be done (another file system,
// a store without root), the tar is the way.

// layerMemo is what the first import of a cached build recorded: the diff
// ID and size of its tar, and which build it was (its directory's inode
// and completion stamp: a memo left by an import of a build since rebuilt
// names another).
type layerMemo struct {
	Diff  string `json:"diff"`
	Size  int64  `json:"size"`
	Build string `json:"build"`
	// Overlay says the tar was of an overlayfs upper directory (whiteouts
	// and opaque directories written as OCI's).
	Overlay bool `json:"overlay"`
}

func (b *cachedBuild) memoPath() string { return b.dir + ".layer" }

// identity names the build now in b.dir ("" if it cannot be read).
func (b *cachedBuild) identity() string {
	st, err := os.Stat(b.dir)
	if err != nil {
		return ""
	}
	stamp, err := os.ReadFile(b.dir + ".complete")
	if err != nil {
		return ""
	}
	return strconv.FormatUint(st.Sys().(*syscall.Stat_t).Ino, 10) + "@" + strings.TrimSpace(string(stamp))
}

// memo returns the recorded layer of the build now in b.dir, written as
// overlay says.
func (b *cachedBuild) memo(overlay bool) (layerMemo, bool) {
	var m layerMemo
	raw, err := os.ReadFile(b.memoPath())
	if err != nil || json.Unmarshal(raw, &m) != nil {
		return m, false
	}
	id := b.identity()
	return m, id != "" && m.Build == id && m.Overlay == overlay && strings.HasPrefix(m.Diff, "sha256:")
}

// remember records the layer an import by tar made of the build (stores
// on one host may write it at once: writeFileAtomic).
func (b *cachedBuild) remember(diff string, size int64, overlay bool) {
	if id := b.identity(); id != "" {
		raw, _ := json.Marshal(layerMemo{Diff: diff, Size: size, Build: id, Overlay: overlay})
		writeFileAtomic(b.memoPath(), raw)
	}
}

// linkLayer makes the layer diff of the build in src by linking its files
// (linkTree) and stores it, held until release is called.
func (s *Store) linkLayer(diff, src string, overlay bool) (release func(), err error) {
	// Where the store keeps EROFS images, the build's layer files are
	// made once per host, in a directory beside the build (by its layer's
	// diff ID: content-addressed), and linked into each store: once they
	// are there, the build's files are not read at all.
	var cache string
	if ok, _ := s.Erofs(); ok {
		cache = src + "." + strings.TrimPrefix(diff, "sha256:") + ".erofs.d"
		if _, err := cachedSize(cache); err == nil {
			return s.commitLayer(diff, "", cache)
		}
	}
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "layer-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	if err := linkTree(src, tmp, overlay); err != nil {
		return nil, err
	}
	return s.commitLayer(diff, tmp, cache)
}

// linkTree fills dst with what unpacking writeTar(src, overlay) into it
// would: each regular file whose only extended attribute (if any) is a
// file capability is a hard link to src's (same inode: its owner, mode,
// times and capability are the file's); a file with other attributes
// (an overlayfs upper's trusted.overlay.*, user.*), which the tar leaves
// out, is copied without them; directories, symlinks and devices are made
// anew with src's owner, mode and modification time; files linked
// together in src are linked together in dst; sockets are left out. With
// overlay, a whiteout (a 0/0 character device) is one as unpacking makes
// it, and an opaque directory is marked opaque.
func linkTree(src, dst string, overlay bool) error {
	type dirAttrs struct {
		path string
		st   *syscall.Stat_t
	}
	var dirs []dirAttrs
	first := map[[2]uint64]string{} // src (dev, inode) → its first path in dst
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		st := info.Sys().(*syscall.Stat_t)
		out := filepath.Join(dst, rel)
		mode := st.Mode & 0o7777
		switch info.Mode().Type() {
		case fs.ModeDir:
			if err := unix.Mkdir(out, mode); err != nil {
				return err
			}
			if overlay {
				if v, err := getXattr(p, "trusted.overlay.opaque"); err == nil && string(v) == "y" {
					if err := unix.Lsetxattr(out, "trusted.overlay.opaque", []byte("y"), 0); err != nil {
						return err
					}
				}
			}
			dirs = append(dirs, dirAttrs{out, st})
			return nil
		case fs.ModeSocket:
			return nil
		case fs.ModeSymlink:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if err := os.Symlink(target, out); err != nil {
				return err
			}
			return setAttrs(out, st, true)
		case fs.ModeCharDevice | fs.ModeDevice, fs.ModeDevice, fs.ModeNamedPipe:
			if overlay && info.Mode()&fs.ModeCharDevice != 0 && st.Rdev == 0 {
				return unix.Mknod(out, unix.S_IFCHR, 0) // a whiteout, as unpacking makes one
			}
			if err := unix.Mknod(out, st.Mode&unix.S_IFMT|mode, int(st.Rdev)); err != nil {
				return err
			}
			return setAttrs(out, st, false)
		case 0: // a regular file
			key := [2]uint64{st.Dev, st.Ino}
			if prev, ok := first[key]; ok {
				return os.Link(prev, out)
			}
			first[key] = out
			plain, capab, err := onlyCapability(p)
			if err != nil {
				return err
			}
			if plain {
				return os.Link(p, out)
			}
			return copyFile(p, out, st, capab)
		default:
			return fmt.Errorf("%s: a file of type %v", rel, info.Mode().Type())
		}
	})
	if err != nil {
		return err
	}
	// Directories' times last, deepest first: making their entries
	// changed them.
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := setAttrs(dirs[i].path, dirs[i].st, false); err != nil {
			return err
		}
	}
	return nil
}

// onlyCapability reports whether the file at p has no extended attribute
// but a file capability, and that capability.
func onlyCapability(p string) (bool, []byte, error) {
	buf := make([]byte, 1024)
	n, err := unix.Llistxattr(p, buf)
	if err == unix.ERANGE {
		return false, nil, nil // many attributes: copy it
	}
	if err != nil && err != unix.ENOTSUP {
		return false, nil, err
	}
	plain := true
	var capab []byte
	for _, name := range strings.Split(string(buf[:max(n, 0)]), "\x00") {
		switch name {
		case "":
		case "security.capability":
			capab, _ = getXattr(p, name)
		default:
			plain = false
		}
	}
	return plain, capab, nil
}

// copyFile copies the regular file src to dst with src's owner, mode,
// modification time and capability, and no other attribute.
func copyFile(src, dst string, st *syscall.Stat_t, capab []byte) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	if err == nil && len(capab) > 0 {
		err = unix.Fsetxattr(int(out.Fd()), "security.capability", capab, 0)
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return setAttrs(dst, st, false)
}

// setAttrs gives p st's owner, mode (not a symlink's) and modification
// time by unpacking's own rules (finishAttrs).
func setAttrs(p string, st *syscall.Stat_t, symlink bool) error {
	hdr := &tar.Header{Uid: int(st.Uid), Gid: int(st.Gid), ModTime: time.Unix(st.Mtim.Unix())}
	return finishAttrs(unix.AT_FDCWD, p, hdr, st.Mode&0o7777, symlink)
}
