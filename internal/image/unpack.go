package image

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

// unpackLayer extracts an uncompressed OCI layer tar into dir, converting
// OCI whiteouts to overlayfs ones (a 0:0 character device for a deleted
// entry, the trusted.overlay.opaque xattr for an opaque directory). It
// returns the sha256 of the stream (the layer's diff ID) and the bytes
// written.
//
// The tar is untrusted: every entry is resolved inside dir with
// RESOLVE_IN_ROOT, so neither "..", absolute names nor symlinks planted by
// earlier entries can make a write land outside dir.
func unpackLayer(r io.Reader, dir string) (diffID string, size int64, err error) {
	return extract(r, dir, true)
}

// ExtractTar extracts an uncompressed tar into the root file system at dir
// as unpackLayer does (every entry resolved inside dir, symlinks in the
// names as a chroot would resolve them), without whiteouts: a name
// starting with ".wh." is a file like any other. It returns the stream's
// sha256 (a build context is kept by it) and the bytes written. Builds
// copy files into a stage's root with it.
func ExtractTar(r io.Reader, dir string) (digest string, size int64, err error) {
	return extract(r, dir, false)
}

// extract is unpackLayer, with or without whiteouts.
func extract(r io.Reader, dir string, whiteouts bool) (diffID string, size int64, err error) {
	h := sha256.New()
	tr := tar.NewReader(io.TeeReader(r, h))
	root, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", 0, fmt.Errorf("open layer dir: %w", err)
	}
	defer unix.Close(root)
	type dirTime struct {
		name string
		t    time.Time
	}
	var dirTimes []dirTime
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", 0, fmt.Errorf("read layer: %w", err)
		}
		name := path.Clean("/" + hdr.Name)[1:]
		if name == "" {
			continue // the root itself
		}
		parent, base := path.Split(name)
		pfd, err := openInRoot(root, parent)
		if err != nil {
			return "", 0, fmt.Errorf("layer entry %q: %w", hdr.Name, err)
		}
		n, err := extractEntry(root, pfd, base, hdr, tr, whiteouts)
		unix.Close(pfd)
		if err != nil {
			return "", 0, fmt.Errorf("layer entry %q: %w", hdr.Name, err)
		}
		size += n
		if hdr.Typeflag == tar.TypeDir {
			dirTimes = append(dirTimes, dirTime{name, hdr.ModTime})
		}
	}
	// Drain trailing padding so the digest covers the whole stream.
	if _, err := io.Copy(io.Discard, io.TeeReader(r, h)); err != nil {
		return "", 0, fmt.Errorf("read layer: %w", err)
	}
	for i := len(dirTimes) - 1; i >= 0; i-- {
		d := dirTimes[i]
		ts := []unix.Timespec{unix.NsecToTimespec(d.t.UnixNano()), unix.NsecToTimespec(d.t.UnixNano())}
		unix.UtimesNanoAt(root, d.name, ts, unix.AT_SYMLINK_NOFOLLOW)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), size, nil
}

// openInRoot opens directory rel (relative to root) as an O_PATH fd,
// creating missing components, resolving everything inside root.
func openInRoot(root int, rel string) (int, error) {
	rel = strings.Trim(rel, "/")
	if rel == "" {
		return unix.Dup(root)
	}
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS}
	fd, err := unix.Openat2(root, rel, how)
	if err == nil {
		return fd, nil
	}
	if err != unix.ENOENT {
		return -1, err
	}
	// Create the parents one by one (tars may omit directory entries).
	parent, base := path.Split(rel)
	pfd, err := openInRoot(root, parent)
	if err != nil {
		return -1, err
	}
	defer unix.Close(pfd)
	if err := unix.Mkdirat(pfd, base, 0o755); err != nil && err != unix.EEXIST {
		return -1, err
	}
	return unix.Openat2(root, rel, how)
}

func extractEntry(root, pfd int, base string, hdr *tar.Header, r io.Reader, whiteouts bool) (int64, error) {
	if whiteouts && base == whiteoutOpaque {
		return 0, setXattrAt(pfd, "", "trusted.overlay.opaque", []byte("y"))
	}
	if whiteouts && strings.HasPrefix(base, whiteoutPrefix) {
		target := strings.TrimPrefix(base, whiteoutPrefix)
		removeAt(pfd, target)
		return 0, unix.Mknodat(pfd, target, unix.S_IFCHR, 0)
	}
	mode := uint32(hdr.Mode) & 0o7777
	switch hdr.Typeflag {
	case tar.TypeDir:
		var st unix.Stat_t
		if err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			removeAt(pfd, base)
		}
		if err := unix.Mkdirat(pfd, base, mode); err != nil && err != unix.EEXIST {
			return 0, err
		}
	case tar.TypeReg, tar.TypeRegA:
		removeAt(pfd, base)
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
		if err != nil {
			return 0, err
		}
		f := os.NewFile(uintptr(fd), base)
		n, err := io.Copy(f, r)
		if err == nil {
			for k, v := range hdr.PAXRecords {
				if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok && allowedXattr(name) {
					unix.Fsetxattr(fd, name, []byte(v), 0)
				}
			}
		}
		f.Close()
		if err != nil {
			return n, err
		}
		if err := finishAttrs(pfd, base, hdr, mode, false); err != nil {
			return n, err
		}
		return n, nil
	case tar.TypeSymlink:
		removeAt(pfd, base)
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return 0, err
		}
		return 0, finishAttrs(pfd, base, hdr, mode, true)
	case tar.TypeLink:
		target := path.Clean("/" + hdr.Linkname)[1:]
		tparent, tbase := path.Split(target)
		tfd, err := openInRoot(root, tparent)
		if err != nil {
			return 0, err
		}
		defer unix.Close(tfd)
		removeAt(pfd, base)
		return 0, unix.Linkat(tfd, tbase, pfd, base, 0)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		removeAt(pfd, base)
		kind := uint32(unix.S_IFIFO)
		switch hdr.Typeflag {
		case tar.TypeChar:
			kind = unix.S_IFCHR
		case tar.TypeBlock:
			kind = unix.S_IFBLK
		}
		dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
		if err := unix.Mknodat(pfd, base, kind|mode, int(dev)); err != nil {
			return 0, err
		}
	case tar.TypeXGlobalHeader, tar.TypeXHeader:
		return 0, nil
	default:
		return 0, nil // unknown types are skipped, as Docker does
	}
	return 0, finishAttrs(pfd, base, hdr, mode, false)
}

// rootless is a store run by a user other than root (the node's unit
// tests over the rootless fake driver): it cannot give files other
// owners, so every file is its user's, which a rootless sandbox maps to
// its root.
var rootless = os.Geteuid() != 0

// finishAttrs sets owner, mode and times; symlinks keep their mode.
func finishAttrs(pfd int, base string, hdr *tar.Header, mode uint32, symlink bool) error {
	if !rootless {
		if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if !symlink {
		// Fchownat clears setuid bits; set the mode after it.
		if err := unix.Fchmodat(pfd, base, mode, 0); err != nil {
			return err
		}
	}
	ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
	return nil
}

func removeAt(pfd int, base string) {
	if err := unix.Unlinkat(pfd, base, 0); err == unix.EISDIR || err == unix.EPERM {
		// A directory: remove its tree through a fresh fd.
		if fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); err == nil {
			f := os.NewFile(uintptr(fd), base)
			names, _ := f.Readdirnames(-1)
			for _, n := range names {
				removeAt(fd, n)
			}
			f.Close()
		}
		unix.Unlinkat(pfd, base, unix.AT_REMOVEDIR)
	}
}

func setXattrAt(pfd int, base, name string, value []byte) error {
	fd, err := unix.Openat(pfd, orDot(base), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fsetxattr(fd, name, value, 0)
}

func orDot(s string) string {
	if s == "" {
		return "."
	}
	return s
}

// allowedXattr keeps file capabilities and user attributes; trusted.* and
// overlay attributes from an image could forge whiteouts or redirects.
func allowedXattr(name string) bool {
	return name == "security.capability" || strings.HasPrefix(name, "user.")
}

var errLayerDigest = errors.New("layer content does not match its diff ID")
