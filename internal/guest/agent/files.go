package agent

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// maxPath bounds paths from callers.
const maxPath = 4096

// cleanPath validates a path from the node. The agent's root is the
// sandbox's root, so ".." and absolute symlinks cannot leave the sandbox;
// the checks here only reject malformed input.
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

func fileInfo(path string, st fs.FileInfo, n names) *guestv1.FileInfo {
	i := &guestv1.FileInfo{
		Path:        path,
		Name:        filepath.Base(path),
		Size:        st.Size(),
		Mode:        uint32(st.Mode().Perm()),
		MtimeUnixMs: st.ModTime().UnixMilli(),
	}
	switch {
	case st.Mode().IsRegular():
		i.Type = "file"
	case st.IsDir():
		i.Type = "dir"
	case st.Mode()&fs.ModeSymlink != 0:
		i.Type = "symlink"
		i.SymlinkTarget, _ = os.Readlink(path)
	default:
		i.Type = "other"
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		if n == nil {
			n = names{}
		}
		i.Owner = n.lookup("/etc/passwd", sys.Uid)
		i.Group = n.lookup("/etc/group", sys.Gid)
	}
	return i
}

func statPath(p string) (*guestv1.FileInfo, error) {
	p, err := cleanPath(p)
	if err != nil {
		return nil, err
	}
	st, err := os.Lstat(p)
	if err != nil {
		return nil, err
	}
	return fileInfo(p, st, nil), nil
}

func listDir(p string, depth int32) ([]*guestv1.FileInfo, error) {
	p, err := cleanPath(p)
	if err != nil {
		return nil, err
	}
	if depth <= 0 {
		depth = 1
	}
	st, err := os.Stat(p)
	if err != nil {
		return nil, err
	}
	if !st.IsDir() {
		return nil, &codedError{guest.CodeNotDir, p + " is not a directory"}
	}
	var out []*guestv1.FileInfo
	n := names{}
	const maxEntries = 100000
	var walk func(dir string, level int32) error
	walk = func(dir string, level int32) error {
		ents, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if len(out) >= maxEntries {
				return invalid("directory listing exceeds %d entries; list a narrower path", maxEntries)
			}
			full := filepath.Join(dir, e.Name())
			info, err := e.Info()
			if err != nil {
				continue // removed meanwhile
			}
			out = append(out, fileInfo(full, info, n))
			if e.IsDir() && level < depth {
				if err := walk(full, level+1); err != nil && !errors.Is(err, fs.ErrPermission) {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(p, 1); err != nil {
		return nil, err
	}
	return out, nil
}

func makeDir(p, user string) (*guestv1.FileInfo, error) {
	p, err := cleanPath(p)
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(p); err == nil {
		if !st.IsDir() {
			return nil, &codedError{guest.CodeExists, p + " exists and is not a directory"}
		}
		return fileInfo(p, st, nil), nil
	}
	id, err := resolveUser(user)
	if err != nil {
		return nil, invalid("%v", err)
	}
	if err := mkdirAllOwned(p, id); err != nil {
		return nil, err
	}
	return statPath(p)
}

// mkdirAllOwned creates p and missing parents, owned by id.
func mkdirAllOwned(p string, id identity) error {
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return nil
		}
		return &codedError{guest.CodeNotDir, p + " is not a directory"}
	}
	if parent := filepath.Dir(p); parent != p {
		if err := mkdirAllOwned(parent, id); err != nil {
			return err
		}
	}
	if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if id.uid != 0 || id.gid != 0 {
		os.Lchown(p, int(id.uid), int(id.gid))
	}
	return nil
}

func remove(p string, recursive bool) error {
	p, err := cleanPath(p)
	if err != nil {
		return err
	}
	if p == "/" {
		return invalid("refusing to remove /")
	}
	if _, err := os.Lstat(p); err != nil {
		return err
	}
	if recursive {
		return os.RemoveAll(p)
	}
	return os.Remove(p)
}

func rename(from, to string) (*guestv1.FileInfo, error) {
	from, err := cleanPath(from)
	if err != nil {
		return nil, err
	}
	to, err = cleanPath(to)
	if err != nil {
		return nil, err
	}
	if err := os.Rename(from, to); err != nil {
		return nil, err
	}
	return statPath(to)
}

func serveRead(rf *guestv1.ReadFile, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	p, err := cleanPath(rf.Path)
	if err != nil {
		fail(err)
		return
	}
	// O_NONBLOCK: opening a FIFO would otherwise wait for a writer,
	// forever, holding one of the agent's threads.
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		fail(err)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		fail(err)
		return
	}
	if st.IsDir() {
		fail(&codedError{guest.CodeIsDir, p + " is a directory"})
		return
	}
	if !st.Mode().IsRegular() {
		fail(invalid("%s is not a regular file", p))
		return
	}
	if rf.Offset > 0 {
		if _, err := f.Seek(rf.Offset, io.SeekStart); err != nil {
			fail(err)
			return
		}
	}
	if err := w.Write(infoMsg(fileInfo(p, st, nil))); err != nil {
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
	p, err := cleanPath(wf.Path)
	if err != nil {
		fail(err)
		return
	}
	id, err := resolveUser(wf.User)
	if err != nil {
		fail(invalid("%v", err))
		return
	}
	if wf.Mkdirs {
		if err := mkdirAllOwned(filepath.Dir(p), id); err != nil {
			fail(err)
			return
		}
	}
	mode := fs.FileMode(wf.Mode & 0o7777)
	if mode == 0 {
		mode = 0o644
	}
	flags := os.O_WRONLY | os.O_CREATE
	if wf.Append {
		flags |= os.O_APPEND
	} else {
		flags |= os.O_TRUNC
	}
	_, statErr := os.Lstat(p)
	created := errors.Is(statErr, fs.ErrNotExist)
	// O_NONBLOCK, then only regular files: a FIFO would block the open.
	f, err := os.OpenFile(p, flags|syscall.O_NONBLOCK, mode)
	if errors.Is(err, syscall.ENXIO) {
		err = invalid("%s is not a regular file", p)
	}
	if err != nil {
		fail(err)
		return
	}
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		f.Close()
		fail(invalid("%s is not a regular file", p))
		return
	}
	if created {
		f.Chmod(mode) // not subject to umask
		if id.uid != 0 || id.gid != 0 {
			f.Chown(int(id.uid), int(id.gid))
		}
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
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		fail(werr)
		return
	}
	info, err := statPath(p)
	if err != nil {
		fail(err)
		return
	}
	w.Write(infoMsg(info))
}
