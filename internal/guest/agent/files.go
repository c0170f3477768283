package agent

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// maxPath bounds paths from callers.
const maxPath = 4096

// userPath expands a path of a call acting as id: "~" and "~/..." name
// its home directory (from the sandbox's /etc/passwd); other paths must be
// absolute. It returns the path cleaned (cleanPath).
func userPath(p string, id identity) (string, error) {
	if p == "~" || strings.HasPrefix(p, "~/") {
		p = id.home + p[1:]
	} else if strings.HasPrefix(p, "~") {
		return "", invalid("path %.80q: only ~ and ~/ expand (to the user's home directory), not ~name", p)
	}
	return cleanPath(p)
}

// callPath resolves the user of a file call (fileUser) and its path
// (userPath).
func callPath(p, user string) (string, identity, error) {
	id, err := fileUser(user)
	if err != nil {
		return "", identity{}, err
	}
	p, err = userPath(p, id)
	return p, id, err
}

// cleanPath validates a path from the node and cleans it. Resolving it is
// openIn's work (inside the sandbox's root); the checks here only reject
// malformed input.
func cleanPath(p string) (string, error) {
	if p == "" {
		return "", invalid("empty path")
	}
	if len(p) > maxPath {
		return "", invalid("path longer than %d bytes", maxPath)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", invalid("path contains a NUL byte")
	}
	if !filepath.IsAbs(p) {
		return "", invalid("path %q is not absolute", p)
	}
	return filepath.Clean(p), nil
}

// fileUser resolves the user a file call acts as.
func fileUser(spec string) (identity, error) {
	id, err := resolveUser(spec)
	if err != nil {
		return identity{}, invalid("%v", err)
	}
	return id, nil
}

// fileCall answers the file calls of one message and one reply, each
// acting as its message's user; any other call is invalid.
func fileCall(call *guestv1.ClientMsg) (*guestv1.ServerMsg, error) {
	var info *guestv1.FileInfo
	var err error
	switch m := call.Msg.(type) {
	case *guestv1.ClientMsg_Stat:
		info, err = statPath(m.Stat)
	case *guestv1.ClientMsg_ListDir:
		entries, err := listDir(m.ListDir)
		return &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Entries{Entries: &guestv1.Entries{Entries: entries}}}, err
	case *guestv1.ClientMsg_MakeDir:
		info, err = makeDir(m.MakeDir)
	case *guestv1.ClientMsg_Remove:
		return &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Done{Done: &guestv1.Done{}}}, remove(m.Remove)
	case *guestv1.ClientMsg_Rename:
		info, err = rename(m.Rename)
	case *guestv1.ClientMsg_ChangeMode:
		info, err = changeMode(m.ChangeMode)
	default:
		return nil, invalid("unsupported call %T", call.Msg)
	}
	return infoMsg(info), err
}

func infoMsg(i *guestv1.FileInfo) *guestv1.ServerMsg {
	return &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Info{Info: i}}
}

// names caches user and group names for one call.
type names map[string]string

func (n names) lookup(file string, id uint32) string {
	k := file + ":" + strconv.FormatUint(uint64(id), 10)
	if v, ok := n[k]; ok {
		return v
	}
	v := nameOf(file, id)
	n[k] = v
	return v
}

// fileInfo describes the entry name of directory dir, whose status is st,
// as path (name "": dir is the entry itself, -1: not open). The target of a
// symlink is read and resolved, except for /proc's magic links (whose
// targets are the agent's or another process's files); files and
// directories report their metadata.
func fileInfo(path string, dir int, name string, st *unix.Stat_t, n names) *guestv1.FileInfo {
	i := &guestv1.FileInfo{
		Path:        path,
		Name:        filepath.Base(path),
		Size:        st.Size,
		Mode:        st.Mode & 0o777,
		MtimeUnixMs: time.Unix(st.Mtim.Unix()).UnixMilli(),
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		i.Type = "file"
	case unix.S_IFDIR:
		i.Type = "dir"
	case unix.S_IFLNK:
		i.Type = "symlink"
		if n == nil {
			n = names{}
		}
		if dir >= 0 && name != "" && !inProcBelowRoot(dir) {
			i.SymlinkTarget, _ = readlinkAt(dir, name)
			i.Target = linkTarget(path, n)
		}
	default:
		i.Type = "other"
	}
	if (i.Type == "file" || i.Type == "dir") && dir >= 0 {
		// The entry through the descriptor of its directory (or its own):
		// no path is resolved again.
		if name == "" {
			i.Metadata = readMetadata(procPath("self/fd/"+strconv.Itoa(dir)), true)
		} else {
			i.Metadata = readMetadata(procPath("self/fd/"+strconv.Itoa(dir)+"/"+name), false)
		}
	}
	if n == nil {
		n = names{}
	}
	i.Owner = n.lookup("/etc/passwd", st.Uid)
	i.Group = n.lookup("/etc/group", st.Gid)
	return i
}

// linkTarget describes what the symlink at path resolves to inside the
// root (every link followed, by the rules of openIn), named by its
// absolute path; nil when it dangles, loops or is refused.
func linkTarget(path string, n names) *guestv1.FileInfo {
	fd, err := openIn(path, unix.O_PATH, 0)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return nil
	}
	// The descriptor's /proc link names the file as the agent's root
	// sees it: the sandbox's.
	real, err := os.Readlink(procPath("self/fd/" + strconv.Itoa(fd)))
	if err != nil || !filepath.IsAbs(real) {
		return nil
	}
	return fileInfo(real, fd, "", &st, n)
}

// statIn returns the info of p itself (a symlink is not followed). It runs
// with the caller's credentials.
func statIn(p string, n names) (*guestv1.FileInfo, error) {
	var st unix.Stat_t
	if p == "/" {
		fd, err := openIn(p, unix.O_PATH|unix.O_DIRECTORY, 0)
		if err != nil {
			return nil, pathErr("stat", p, err)
		}
		defer unix.Close(fd)
		if err := unix.Fstat(fd, &st); err != nil {
			return nil, pathErr("stat", p, err)
		}
		return fileInfo(p, fd, "", &st, n), nil
	}
	dir, name, err := openParent(p)
	if err != nil {
		return nil, pathErr("stat", p, err)
	}
	defer unix.Close(dir)
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, pathErr("stat", p, err)
	}
	return fileInfo(p, dir, name, &st, n), nil
}

func statPath(m *guestv1.Path) (*guestv1.FileInfo, error) {
	p, id, err := callPath(m.Path, m.User)
	if err != nil {
		return nil, err
	}
	var info *guestv1.FileInfo
	err = asUser(id, func() (err error) {
		info, err = statIn(p, nil)
		return err
	})
	return info, err
}

// maxEntries bounds a listing.
const maxEntries = 100000

// listDir lists a directory to m.Depth levels, each directory's entries
// sorted by name and followed by what they hold (as E2B's envd walks).
func listDir(m *guestv1.ListDir) ([]*guestv1.FileInfo, error) {
	p, id, err := callPath(m.Path, m.User)
	if err != nil {
		return nil, err
	}
	depth := m.Depth
	if depth <= 0 {
		depth = 1
	}
	var out []*guestv1.FileInfo
	err = asUser(id, func() error {
		fd, err := openIn(p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if errors.Is(err, unix.ENOTDIR) {
			return &codedError{guest.CodeNotDir, p + " is not a directory"}
		}
		if err != nil {
			return pathErr("open", p, err)
		}
		n := names{}
		var walk func(dir int, path string, level int32) error
		walk = func(dir int, path string, level int32) error {
			f := os.NewFile(uintptr(dir), path)
			defer f.Close()
			ents, err := f.Readdirnames(-1)
			if err != nil {
				return pathErr("list", path, underlying(err))
			}
			sort.Strings(ents)
			for _, name := range ents {
				if len(out) >= maxEntries {
					return invalid("directory listing exceeds %d entries; list a narrower path", maxEntries)
				}
				var st unix.Stat_t
				if unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
					continue // removed meanwhile
				}
				full := filepath.Join(path, name)
				out = append(out, fileInfo(full, dir, name, &st, n))
				if st.Mode&unix.S_IFMT == unix.S_IFDIR && level < depth {
					sub, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
					if err != nil {
						continue // not the user's to read, or replaced meanwhile
					}
					if err := walk(sub, full, level+1); err != nil && !errors.Is(err, fs.ErrPermission) {
						return err
					}
				}
			}
			return nil
		}
		return walk(fd, p, 1)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// underlying is the errno inside an os error.
func underlying(err error) error {
	var errno unix.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return err
}

func makeDir(m *guestv1.MakeDir) (*guestv1.FileInfo, error) {
	p, id, err := callPath(m.Path, m.User)
	if err != nil {
		return nil, err
	}
	var info *guestv1.FileInfo
	err = asUser(id, func() error {
		fd, err := mkdirAll(p)
		if err != nil {
			return err
		}
		unix.Close(fd)
		info, err = statIn(p, nil)
		return err
	})
	return info, err
}

// mkdirAll creates p and its missing parents (with the caller's
// credentials, so they are the caller's) and returns p opened O_PATH. A
// symlink to a directory counts as one, inside the root.
func mkdirAll(p string) (int, error) {
	fd, err := openIn(p, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err == nil {
		return fd, nil
	}
	if errors.Is(err, unix.ENOTDIR) {
		if _, serr := statIn(p, nil); serr == nil {
			return -1, &codedError{guest.CodeExists, p + " exists and is not a directory"}
		}
	}
	if !errors.Is(err, unix.ENOENT) || p == "/" {
		return -1, pathErr("mkdir", p, err)
	}
	parent, err := mkdirAll(filepath.Dir(p))
	if err != nil {
		return -1, err
	}
	defer unix.Close(parent)
	name := filepath.Base(p)
	if err := unix.Mkdirat(parent, name, 0o755); err != nil && err != unix.EEXIST {
		return -1, pathErr("mkdir", p, err)
	}
	fd, err = unix.Openat(parent, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		// Made meanwhile as something else (a symlink is resolved in the
		// root; anything else is refused).
		if fd, err = openIn(p, unix.O_PATH|unix.O_DIRECTORY, 0); err != nil {
			return -1, pathErr("mkdir", p, err)
		}
	}
	return fd, nil
}

func remove(m *guestv1.Remove) error {
	p, id, err := callPath(m.Path, m.User)
	if err != nil {
		return err
	}
	if p == "/" {
		return invalid("refusing to remove /")
	}
	return asUser(id, func() error {
		dir, name, err := openParent(p)
		if err != nil {
			return pathErr("remove", p, err)
		}
		defer unix.Close(dir)
		var st unix.Stat_t
		if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return pathErr("remove", p, err)
		}
		if m.Recursive {
			return removeAll(dir, name, p)
		}
		err = unix.Unlinkat(dir, name, 0)
		if err == unix.EISDIR || (err == unix.EPERM && st.Mode&unix.S_IFMT == unix.S_IFDIR) {
			err = unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
		}
		if err != nil {
			return pathErr("remove", p, err)
		}
		return nil
	})
}

// removeAll removes name in dir and, if it is a directory, everything
// below it, never following symlinks. path names it in errors.
func removeAll(dir int, name, path string) error {
	err := unix.Unlinkat(dir, name, 0)
	if err == nil || err == unix.ENOENT {
		return nil
	}
	if err != unix.EISDIR && err != unix.EPERM {
		return pathErr("remove", path, err)
	}
	for round := 0; ; round++ {
		sub, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == unix.ENOENT {
			return nil
		}
		if err != nil {
			return pathErr("remove", path, err)
		}
		f := os.NewFile(uintptr(sub), path)
		ents, rerr := f.Readdirnames(-1)
		var first error
		for _, e := range ents {
			if err := removeAll(sub, e, filepath.Join(path, e)); err != nil && first == nil {
				first = err
			}
		}
		f.Close()
		if rerr != nil {
			return pathErr("remove", path, underlying(rerr))
		}
		if first != nil {
			return first
		}
		err = unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
		if err == nil || err == unix.ENOENT {
			return nil
		}
		// Entries made meanwhile: go again, a few times.
		if err != unix.ENOTEMPTY || round == 8 {
			return pathErr("remove", path, err)
		}
	}
}

func rename(m *guestv1.Rename) (*guestv1.FileInfo, error) {
	from, id, err := callPath(m.From, m.User)
	if err != nil {
		return nil, err
	}
	to, err := userPath(m.To, id)
	if err != nil {
		return nil, err
	}
	if from == "/" || to == "/" {
		return nil, invalid("refusing to rename /")
	}
	var info *guestv1.FileInfo
	err = asUser(id, func() error {
		fromDir, fromName, err := openParent(from)
		if err != nil {
			return pathErr("rename", from, err)
		}
		defer unix.Close(fromDir)
		toDir, toName, err := openParent(to)
		if err != nil {
			return pathErr("rename", to, err)
		}
		defer unix.Close(toDir)
		if err := unix.Renameat(fromDir, fromName, toDir, toName); err != nil {
			return pathErr("rename", from, err)
		}
		info, err = statIn(to, nil)
		return err
	})
	return info, err
}

// changeMode sets a path's permission bits as the user: the kernel lets
// only its owner (or root) do it. A symlink is followed inside the root
// (links have no mode of their own).
func changeMode(m *guestv1.ChangeMode) (*guestv1.FileInfo, error) {
	p, id, err := callPath(m.Path, m.User)
	if err != nil {
		return nil, err
	}
	if m.Mode&^0o7777 != 0 {
		return nil, invalid("mode %#o has bits beyond 07777", m.Mode)
	}
	var info *guestv1.FileInfo
	err = asUser(id, func() error {
		fd, err := openIn(p, unix.O_PATH, 0)
		if err != nil {
			return pathErr("chmod", p, err)
		}
		defer unix.Close(fd)
		// fchmod(2) refuses an O_PATH descriptor; its /proc/self/fd entry
		// names the very file resolved inside the root.
		if err := unix.Fchmodat(unix.AT_FDCWD, procPath("self/fd/"+strconv.Itoa(fd)), m.Mode, 0); err != nil {
			return pathErr("chmod", p, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return pathErr("stat", p, err)
		}
		info = fileInfo(p, fd, "", &st, nil)
		return nil
	})
	return info, err
}

func serveRead(rf *guestv1.ReadFile, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	p, id, err := callPath(rf.Path, rf.User)
	if err != nil {
		fail(err)
		return
	}
	// Opened as the user; reading an open file checks nothing more, so the
	// rest runs with the agent's credentials.
	var f *os.File
	var info *guestv1.FileInfo
	err = asUser(id, func() error {
		// O_NONBLOCK: opening a FIFO would otherwise wait for a writer,
		// forever, holding one of the agent's threads.
		fd, err := openIn(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
		if err != nil {
			return pathErr("open", p, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return pathErr("open", p, err)
		}
		switch {
		case st.Mode&unix.S_IFMT == unix.S_IFDIR:
			unix.Close(fd)
			return &codedError{guest.CodeIsDir, p + " is a directory"}
		case st.Mode&unix.S_IFMT != unix.S_IFREG:
			unix.Close(fd)
			return invalid("%s is not a regular file", p)
		case ownProc(fd):
			unix.Close(fd)
			return errOwnProc("open", p)
		}
		f = os.NewFile(uintptr(fd), p)
		info = fileInfo(p, -1, "", &st, nil)
		return nil
	})
	if err != nil {
		fail(err)
		return
	}
	defer f.Close()
	if rf.Offset > 0 {
		if _, err := f.Seek(rf.Offset, io.SeekStart); err != nil {
			fail(err)
			return
		}
	}
	if err := w.Write(infoMsg(info)); err != nil {
		return
	}
	var r io.Reader = f
	if rf.Limit > 0 {
		r = io.LimitReader(f, rf.Limit)
	}
	buf := make([]byte, guest.ChunkSize)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if werr := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Data{Data: buf[:n]}}); werr != nil {
				return
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			fail(err)
			return
		}
	}
	w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_End{End: &guestv1.End{}}})
}

func serveWrite(wf *guestv1.WriteFile, r *guest.Reader, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	p, id, err := callPath(wf.Path, wf.User)
	if err != nil {
		fail(err)
		return
	}
	if p == "/" {
		fail(&codedError{guest.CodeIsDir, "/ is a directory"})
		return
	}
	if err := guest.ValidateMetadata(wf.Metadata); err != nil {
		fail(invalid("%v", err))
		return
	}
	mode := uint32(wf.Mode & 0o7777)
	if mode == 0 {
		mode = 0o644
	}
	flags := unix.O_WRONLY | unix.O_CREAT | unix.O_NONBLOCK | unix.O_NOCTTY
	if wf.Append {
		flags |= unix.O_APPEND
	} else {
		flags |= unix.O_TRUNC
	}
	// Created, opened and given its mode as the user (so the file is the
	// user's); the data is written through the open file afterwards.
	var f *os.File
	err = asUser(id, func() error {
		if wf.Mkdirs {
			fd, err := mkdirAll(filepath.Dir(p))
			if err != nil {
				return err
			}
			unix.Close(fd)
		}
		created := true
		fd, err := openIn(p, flags|unix.O_EXCL, mode)
		if err == unix.EEXIST {
			created = false
			fd, err = openIn(p, flags, mode)
		}
		// O_NONBLOCK, then only regular files: a FIFO would block the open.
		if err == unix.ENXIO {
			return invalid("%s is not a regular file", p)
		}
		if err != nil {
			return pathErr("open", p, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			unix.Close(fd)
			return invalid("%s is not a regular file", p)
		}
		if ownProc(fd) {
			unix.Close(fd)
			return errOwnProc("open", p)
		}
		if created {
			unix.Fchmod(fd, mode) // not subject to umask
		}
		f = os.NewFile(uintptr(fd), p)
		return nil
	})
	if err != nil {
		fail(err)
		return
	}
	var werr error
	for {
		m := new(guestv1.ClientMsg)
		if err := r.Read(m); err != nil {
			f.Close()
			return // the client went away; the partial file stays, as with any interrupted write
		}
		switch v := m.Msg.(type) {
		case *guestv1.ClientMsg_Data:
			if werr == nil {
				_, werr = f.Write(v.Data)
			}
			continue
		case *guestv1.ClientMsg_End:
		default:
			f.Close()
			fail(invalid("unexpected %T in a file upload", m.Msg))
			return
		}
		break
	}
	if werr == nil && (!wf.Append || len(wf.Metadata) > 0) {
		// Once the data is in: an interrupted upload keeps the old
		// metadata. As the user, who may write the file.
		werr = asUser(id, func() error { return writeMetadata(int(f.Fd()), wf.Metadata) })
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		fail(werr)
		return
	}
	info, err := statPath(&guestv1.Path{Path: p, User: wf.User})
	if err != nil {
		fail(err)
		return
	}
	w.Write(infoMsg(info))
}
