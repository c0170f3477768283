package agent

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// maxWatchDirs bounds the directories one recursive watch covers (each is
// an inotify watch, a kernel resource shared by every sandbox of the host's
// user).
const maxWatchDirs = 8192

// watchMask is what a watch reports, the way fsnotify (and so E2B's envd)
// reports it.
const watchMask = unix.IN_CREATE | unix.IN_MOVED_TO | unix.IN_MODIFY | unix.IN_DELETE |
	unix.IN_MOVED_FROM | unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR

// watcher is one watch call: an inotify instance over a directory tree.
type watcher struct {
	f         *os.File
	fd        int
	root      string
	recursive bool
	dirs      map[int]string // watch descriptor → directory relative to root
}

// serveWatch answers a Watch call: Done once the watches are in place, then
// one FsEvent per change until the client closes the connection.
func serveWatch(m *guestv1.Watch, r *guest.Reader, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	root, err := cleanPath(m.Path)
	if err != nil {
		fail(err)
		return
	}
	st, err := os.Stat(root)
	if err != nil {
		fail(err)
		return
	}
	if !st.IsDir() {
		fail(&codedError{guest.CodeNotDir, root + " is not a directory"})
		return
	}
	// Non-blocking, so the file joins Go's poller and Close ends a Read.
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		fail(inotifyLimit(err))
		return
	}
	wt := &watcher{f: os.NewFile(uintptr(fd), "inotify"), fd: fd, root: root, recursive: m.Recursive, dirs: map[int]string{}}
	defer wt.f.Close()
	if err := wt.add(""); err != nil {
		fail(err)
		return
	}
	if m.Recursive {
		if err := wt.addTree(""); err != nil {
			fail(err)
			return
		}
	}
	if err := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Done{Done: &guestv1.Done{}}}); err != nil {
		return
	}
	// The client sends nothing more; its closing the connection ends the
	// watch.
	go func() {
		for {
			if err := r.Read(new(guestv1.ClientMsg)); err != nil {
				wt.f.Close()
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := wt.f.Read(buf)
		if err != nil {
			return
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := ""
			if ev.Len > 0 {
				b := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(ev.Len)]
				name = unix.ByteSliceToString(b)
			}
			off += unix.SizeofInotifyEvent + int(ev.Len)
			out, gone := wt.event(ev, name)
			if gone {
				fail(notFound("the watched directory %s was removed", root))
				return
			}
			for _, e := range out {
				if err := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_FsEvent{FsEvent: e}}); err != nil {
					return
				}
			}
		}
	}
}

// event translates one inotify event; gone reports that the watched root
// itself went away.
func (wt *watcher) event(ev *unix.InotifyEvent, name string) (out []*guestv1.FsEvent, gone bool) {
	mask := ev.Mask
	if mask&unix.IN_Q_OVERFLOW != 0 {
		return []*guestv1.FsEvent{{Overflow: true}}, false
	}
	dir, known := wt.dirs[int(ev.Wd)]
	if !known {
		return nil, false
	}
	if mask&unix.IN_IGNORED != 0 {
		delete(wt.dirs, int(ev.Wd))
		return nil, dir == ""
	}
	if name == "" {
		// Events on a watched directory itself: its parent reports them,
		// except for the root, whose removal or move ends the watch.
		if dir == "" && mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 {
			return nil, true
		}
		return nil, false
	}
	rel := filepath.Join(dir, name)
	add := func(op string) { out = append(out, &guestv1.FsEvent{Name: rel, Op: op}) }
	switch {
	case mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		add("create")
		if wt.recursive && mask&unix.IN_ISDIR != 0 {
			// A new (or moved-in) directory: watch it and what it already
			// holds. Entries made before its watch existed are reported as
			// creations, so nothing is silently missed.
			if wt.add(rel) == nil {
				out = append(out, wt.existing(rel)...)
			}
		}
	case mask&unix.IN_DELETE != 0:
		add("remove")
	case mask&unix.IN_MOVED_FROM != 0:
		add("rename")
	case mask&unix.IN_MODIFY != 0:
		add("write")
	case mask&unix.IN_ATTRIB != 0:
		add("chmod")
	}
	return out, false
}

// add watches the directory rel (relative to the root).
func (wt *watcher) add(rel string) error {
	if len(wt.dirs) >= maxWatchDirs {
		return &codedError{guest.CodeInvalid, "the watched tree has more than 8192 directories; watch a narrower path"}
	}
	wd, err := unix.InotifyAddWatch(wt.fd, filepath.Join(wt.root, rel), watchMask)
	if err != nil {
		if errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ENOENT) {
			return err // raced with a removal or replaced by a file
		}
		return inotifyLimit(err)
	}
	wt.dirs[wd] = rel
	return nil
}

// addTree watches every directory below rel.
func (wt *watcher) addTree(rel string) error {
	return filepath.WalkDir(filepath.Join(wt.root, rel), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrPermission) || errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if !d.IsDir() {
			return nil
		}
		r, _ := filepath.Rel(wt.root, p)
		if r == "." || r == rel {
			return nil
		}
		if err := wt.add(r); err != nil && !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ENOTDIR) {
			return err
		}
		return nil
	})
}

// existing lists what a directory that just appeared already holds, as
// creations, and watches its subdirectories.
func (wt *watcher) existing(rel string) []*guestv1.FsEvent {
	var out []*guestv1.FsEvent
	filepath.WalkDir(filepath.Join(wt.root, rel), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		r, _ := filepath.Rel(wt.root, p)
		if r == rel {
			return nil
		}
		out = append(out, &guestv1.FsEvent{Name: r, Op: "create"})
		if d.IsDir() {
			if wt.add(r) != nil {
				return filepath.SkipDir
			}
		}
		return nil
	})
	return out
}

// inotifyLimit explains the errors the kernel's inotify limits produce.
func inotifyLimit(err error) error {
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENOSPC) {
		return &codedError{guest.CodeNoSpace, "the host's inotify limits are reached (fs.inotify.max_user_instances, fs.inotify.max_user_watches): " + err.Error()}
	}
	return err
}
