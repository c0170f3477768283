package volume

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
)

// The content of a volume, from the host, without a sandbox.
//
// The node runs these calls as root, over a file system that sandboxes
// write: every path resolves inside the volume's root. The volume's root
// is opened first, then each path with openat2(RESOLVE_IN_ROOT |
// RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV): ".." and absolute symbolic
// links stay inside the root, and nothing crosses into another file
// system. What a call changes it reaches through descriptors of what it
// resolved (fchown, fchmod, *at calls on a resolved parent, with
// AT_SYMLINK_NOFOLLOW for the last name), never through a path the kernel
// would walk again from the host's root. Files are opened without
// blocking (a FIFO a sandbox made does not stall the node) and only
// regular files are read or overwritten.

// Info is a path of a volume.
type Info struct {
	// Path is the path inside the volume ("/" is its root).
	Path string
	Name string
	// Type is "file", "dir", "symlink" or "other".
	Type                string
	Size                int64
	Mode                uint32 // permission bits, at most 07777
	UID, GID            uint32
	Atime, Mtime, Ctime time.Time
	// Target is a symbolic link's target, as written.
	Target string
}

// Attrs are the owner and mode to give a path: nil fields are left as
// they are (a new path gets the default).
type Attrs struct {
	Mode     *uint32
	UID, GID *uint32
}

// maxID is the largest uid or gid the content calls give: sandboxes map
// ids 0 to 65535 (their user namespace's range).
const maxID = 65535

func (a Attrs) valid() error {
	switch {
	case a.Mode != nil && *a.Mode > 0o7777:
		return errdefs.Invalid("mode %#o: at most 07777", *a.Mode)
	case a.UID != nil && *a.UID > maxID:
		return errdefs.Invalid("uid %d out of range [0, %d] (the ids sandboxes map)", *a.UID, maxID)
	case a.GID != nil && *a.GID > maxID:
		return errdefs.Invalid("gid %d out of range [0, %d] (the ids sandboxes map)", *a.GID, maxID)
	}
	return nil
}

// Limits of a listing.
const (
	// MaxDepth bounds a listing's depth.
	MaxDepth = 16
	// maxEntries bounds a listing's entries.
	maxEntries = 100000
)

// clean makes p a clean absolute path inside the volume.
func clean(p string) (string, error) {
	if len(p) > 4096 {
		return "", errdefs.Invalid("path longer than 4096 bytes")
	}
	for i := 0; i < len(p); i++ {
		if p[i] == 0 {
			return "", errdefs.Invalid("path contains a NUL byte")
		}
	}
	return path.Clean("/" + p), nil
}

// root opens volume id's root (the mounted file system's root directory).
func (m *Manager) root(id string) (int, error) {
	if m.unavailable != "" {
		return -1, errdefs.Unavailable("volumes are unavailable on node %s: %s", m.cfg.Node, m.unavailable)
	}
	if m.Get(id) == nil {
		return -1, errdefs.NotFound("volume %q not found", clip(id))
	}
	if !m.mounted(id) {
		return -1, errdefs.Unavailable("volume %s is not mounted on node %s", id, m.cfg.Node).AsInfra()
	}
	fd, err := unix.Open(m.Source(id), unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, errdefs.Internal(err, "open volume %s", id)
	}
	return fd, nil
}

const resolve = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// openIn opens p (relative to root, resolved inside it) with flags.
func openIn(root int, p string, flags int, mode uint32) (int, error) {
	rel := p[1:]
	if rel == "" {
		rel = "."
	}
	for {
		fd, err := unix.Openat2(root, rel, &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: resolve})
		if err == unix.EINTR || err == unix.EAGAIN {
			continue // EAGAIN: a rename raced the resolution
		}
		return fd, err
	}
}

// parent opens the directory that holds p (not "/") and returns it with
// p's last name.
func parent(root int, p string) (int, string, error) {
	dir, name := path.Split(p)
	fd, err := openIn(root, path.Clean(dir), unix.O_PATH|unix.O_DIRECTORY, 0)
	return fd, name, err
}

// fail classifies a system error of a content call on p.
func fail(p string, err error) error {
	if err == nil {
		return nil
	}
	var e *errdefs.Error
	if errors.As(err, &e) {
		return err
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return errdefs.Internal(err, "volume path %s", p)
	}
	switch errno {
	case unix.ENOENT:
		return errdefs.NotFound("path %s not found", p)
	case unix.ENOTDIR:
		return errdefs.NotFound("path %s not found (a parent is not a directory)", p)
	case unix.EEXIST:
		return errdefs.Conflict("path %s exists", p)
	case unix.EISDIR:
		return errdefs.Invalid("path %s is a directory", p)
	case unix.ENOTEMPTY:
		return errdefs.Conflict("directory %s is not empty", p)
	case unix.ENOSPC, unix.EDQUOT, unix.EFBIG:
		e := errdefs.Exhausted(0, "the volume is full (path %s)", p)
		e.Infra, e.Retryable = false, false
		return e
	case unix.ELOOP, unix.EXDEV, unix.ENAMETOOLONG, unix.EINVAL:
		return errdefs.Invalid("path %s cannot be resolved inside the volume (%v)", p, errno)
	case unix.EACCES, unix.EPERM, unix.EROFS:
		return errdefs.PermissionDenied("path %s: %v", p, errno)
	}
	return errdefs.Internal(err, "volume path %s", p)
}

func typeOf(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return "file"
	case unix.S_IFDIR:
		return "dir"
	case unix.S_IFLNK:
		return "symlink"
	}
	return "other"
}

func infoOf(p string, st *unix.Stat_t) *Info {
	name := path.Base(p)
	if p == "/" {
		name = "/"
	}
	return &Info{
		Path: p, Name: name, Type: typeOf(st.Mode), Size: st.Size, Mode: st.Mode & 0o7777,
		UID: st.Uid, GID: st.Gid,
		Atime: time.Unix(st.Atim.Unix()), Mtime: time.Unix(st.Mtim.Unix()), Ctime: time.Unix(st.Ctim.Unix()),
	}
}

// statAt describes name in dir without following a symbolic link.
func statAt(dir int, name, p string) (*Info, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW|unix.AT_EMPTY_PATH); err != nil {
		return nil, err
	}
	in := infoOf(p, &st)
	if in.Type == "symlink" {
		buf := make([]byte, 4096)
		if n, err := unix.Readlinkat(dir, name, buf); err == nil {
			in.Target = string(buf[:n])
		}
	}
	return in, nil
}

// StatPath describes a path of volume id; a symbolic link is described, not
// followed.
func (m *Manager) StatPath(id, p string) (*Info, error) {
	p, err := clean(p)
	if err != nil {
		return nil, err
	}
	root, err := m.root(id)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	if p == "/" {
		in, err := statAt(root, "", p)
		return in, fail(p, err)
	}
	dir, name, err := parent(root, p)
	if err != nil {
		return nil, fail(p, err)
	}
	defer unix.Close(dir)
	in, err := statAt(dir, name, p)
	if err != nil {
		return nil, fail(p, err)
	}
	return in, nil
}

// ListDir lists a directory of volume id, depth levels deep (1: its
// entries), sorted by path. Symbolic links are listed, not followed.
func (m *Manager) ListDir(id, p string, depth int) ([]*Info, error) {
	p, err := clean(p)
	if err != nil {
		return nil, err
	}
	if depth == 0 {
		depth = 1
	}
	if depth < 1 || depth > MaxDepth {
		return nil, errdefs.Invalid("depth %d out of range [1, %d]", depth, MaxDepth)
	}
	root, err := m.root(id)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	fd, err := openIn(root, p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		if errors.Is(err, unix.ENOTDIR) {
			return nil, errdefs.Invalid("path %s is not a directory", p)
		}
		return nil, fail(p, err)
	}
	var out []*Info
	if err := list(fd, p, depth, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// list appends the entries of the open directory dir (at p) to out,
// descending depth-1 more levels into subdirectories. It closes dir.
func list(dir int, p string, depth int, out *[]*Info) error {
	f := os.NewFile(uintptr(dir), p)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return fail(p, err)
	}
	sort.Strings(names)
	for _, name := range names {
		if len(*out) >= maxEntries {
			return errdefs.Invalid("directory %s holds more than %d entries at depth %d: list a deeper path", p, maxEntries, depth)
		}
		cp := path.Join(p, name)
		in, err := statAt(dir, name, cp)
		if err != nil {
			continue // removed meanwhile
		}
		*out = append(*out, in)
		if depth > 1 && in.Type == "dir" {
			sub, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				continue
			}
			if err := list(sub, cp, depth-1, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// ReadFile opens a regular file of volume id for reading, with its info.
func (m *Manager) ReadFile(id, p string) (*Info, io.ReadCloser, error) {
	p, err := clean(p)
	if err != nil {
		return nil, nil, err
	}
	root, err := m.root(id)
	if err != nil {
		return nil, nil, err
	}
	defer unix.Close(root)
	fd, err := openIn(root, p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fail(p, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, nil, fail(p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			return nil, nil, errdefs.Invalid("path %s is a directory", p)
		}
		return nil, nil, errdefs.Invalid("path %s is not a regular file", p)
	}
	// Blocking reads from here: a regular file does not stall.
	unix.SetNonblock(fd, false)
	return infoOf(p, &st), os.NewFile(uintptr(fd), p), nil
}

// WriteFile writes a regular file of volume id from r: into a new file beside
// it, renamed over the path once complete (an existing file is a conflict
// unless overwrite; a directory always is). A missing parent directory is
// not found. The file gets a's owner (default 0:0) and mode (default
// 0644).
func (m *Manager) WriteFile(id, p string, overwrite bool, a Attrs, r io.Reader) (*Info, error) {
	p, err := clean(p)
	if err != nil {
		return nil, err
	}
	if err := a.valid(); err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, errdefs.Invalid("path / is the volume's root directory")
	}
	root, err := m.root(id)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	dir, name, err := parent(root, p)
	if err != nil {
		return nil, fail(path.Dir(p), err)
	}
	defer unix.Close(dir)
	if in, err := statAt(dir, name, p); err == nil {
		switch {
		case in.Type == "dir":
			return nil, errdefs.Conflict("path %s is a directory", p)
		case !overwrite:
			return nil, errdefs.Conflict("path %s exists (ask to overwrite it)", p)
		}
	}
	tmp := ".dsec-write-" + randomName()
	fd, err := unix.Openat(dir, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fail(p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	done := false
	defer func() {
		f.Close()
		if !done {
			unix.Unlinkat(dir, tmp, 0)
		}
	}()
	if _, err := io.Copy(f, r); err != nil {
		var errno syscall.Errno
		if errors.As(err, &errno) {
			return nil, fail(p, err)
		}
		return nil, errdefs.Invalid("read the upload: %v", err)
	}
	if err := own(fd, a, 0o644); err != nil {
		return nil, fail(p, err)
	}
	flags := uint(unix.RENAME_NOREPLACE)
	if overwrite {
		flags = 0
	}
	if err := unix.Renameat2(dir, tmp, dir, name, flags); err != nil {
		return nil, fail(p, err)
	}
	done = true
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fail(p, err)
	}
	return infoOf(p, &st), nil
}

// own gives the open file fd a's owner (default 0:0) and mode (default
// def): chmod after chown, which clears set-id bits.
func own(fd int, a Attrs, def uint32) error {
	uid, gid, mode := 0, 0, def
	if a.UID != nil {
		uid = int(*a.UID)
	}
	if a.GID != nil {
		gid = int(*a.GID)
	}
	if a.Mode != nil {
		mode = *a.Mode
	}
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return err
	}
	return unix.Fchmod(fd, mode)
}

func randomName() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// MakeDir makes a directory of volume id with a's owner (default 0:0) and
// mode (default 0755). An existing path is a conflict unless parents is
// set and it is a directory; a missing parent is not found unless parents
// is set, which makes the missing parents too (with the same owner and
// mode).
func (m *Manager) MakeDir(id, p string, parents bool, a Attrs) (*Info, error) {
	p, err := clean(p)
	if err != nil {
		return nil, err
	}
	if err := a.valid(); err != nil {
		return nil, err
	}
	root, err := m.root(id)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	if p == "/" {
		if !parents {
			return nil, errdefs.Conflict("path / exists")
		}
		in, err := statAt(root, "", p)
		return in, fail(p, err)
	}
	// From the root down: each name made (or, for parents, found) in the
	// directory resolved before it.
	dir, err := unix.Dup(root)
	if err != nil {
		return nil, fail(p, err)
	}
	defer func() { unix.Close(dir) }()
	cur := "/"
	names := strings.Split(p[1:], "/")
	for i, name := range names {
		cur = path.Join(cur, name)
		last := i == len(names)-1
		made := false
		if last || parents {
			switch err := unix.Mkdirat(dir, name, 0o700); {
			case err == nil:
				made = true
			case !errors.Is(err, unix.EEXIST):
				return nil, fail(cur, err)
			case last && !parents:
				return nil, errdefs.Conflict("path %s exists", cur)
			}
		}
		next, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			if errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
				return nil, errdefs.Conflict("path %s exists and is not a directory", cur)
			}
			return nil, fail(cur, err)
		}
		if made {
			if err := own(next, a, 0o755); err != nil {
				unix.Close(next)
				return nil, fail(cur, err)
			}
		}
		unix.Close(dir)
		dir = next
	}
	in, err := statAt(dir, "", p)
	return in, fail(p, err)
}

// RemovePath removes a path of volume id: a file, a symbolic link (not what it
// points to), or a directory with everything in it. The root cannot be
// removed.
func (m *Manager) RemovePath(id, p string) error {
	p, err := clean(p)
	if err != nil {
		return err
	}
	if p == "/" {
		return errdefs.Invalid("the volume's root directory cannot be removed (remove what it holds)")
	}
	root, err := m.root(id)
	if err != nil {
		return err
	}
	defer unix.Close(root)
	dir, name, err := parent(root, p)
	if err != nil {
		return fail(p, err)
	}
	defer unix.Close(dir)
	return fail(p, removeAt(dir, name))
}

// removeAt removes name in dir, and what it holds if it is a directory
// (never following a symbolic link).
func removeAt(dir int, name string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return unix.Unlinkat(dir, name, 0)
	}
	sub, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(sub), name)
	for {
		names, err := f.Readdirnames(256)
		for _, n := range names {
			if err := removeAt(sub, n); err != nil && !errors.Is(err, unix.ENOENT) {
				f.Close()
				return err
			}
		}
		if err == io.EOF || len(names) == 0 {
			break
		}
		if err != nil {
			f.Close()
			return err
		}
		// Entries were removed under the directory's read position: read
		// it again from the start.
		f.Seek(0, io.SeekStart)
	}
	f.Close()
	return unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
}

// SetAttrs changes a path's owner and mode (those a sets). A symbolic
// link is followed inside the volume: what it points to changes.
func (m *Manager) SetAttrs(id, p string, a Attrs) (*Info, error) {
	p, err := clean(p)
	if err != nil {
		return nil, err
	}
	if err := a.valid(); err != nil {
		return nil, err
	}
	root, err := m.root(id)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	// O_PATH: any type of file (a FIFO too) opens without side effects.
	fd, err := openIn(root, p, unix.O_PATH, 0)
	if err != nil {
		return nil, fail(p, err)
	}
	defer unix.Close(fd)
	if a.UID != nil || a.GID != nil {
		uid, gid := -1, -1
		if a.UID != nil {
			uid = int(*a.UID)
		}
		if a.GID != nil {
			gid = int(*a.GID)
		}
		if err := unix.Fchownat(fd, "", uid, gid, unix.AT_EMPTY_PATH); err != nil {
			return nil, fail(p, err)
		}
	}
	if a.Mode != nil {
		// fchmod refuses O_PATH descriptors; the descriptor's own /proc
		// link names exactly the file resolved (the node's /proc, not the
		// volume's).
		if err := unix.Chmod("/proc/self/fd/"+strconv.Itoa(fd), *a.Mode); err != nil {
			return nil, fail(p, err)
		}
	}
	in, err := statAt(fd, "", p)
	return in, fail(p, err)
}
