package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
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
// Directories are found as the call's user (inside the sandbox's root) and
// watched through their open descriptors, so the user's permissions apply
// and no link leads outside.
type watcher struct {
	f         *os.File
	fd        int
	root      string
	id        identity
	recursive bool
	dirs      map[int]string // watch descriptor → directory relative to root
}

// serveWatch answers a Watch call: Done once the watches are in place, then
// one FsEvent per change until the client closes the connection.
func serveWatch(m *guestv1.Watch, r *guest.Reader, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	root, id, err := callPath(m.Path, m.User)
	if err != nil {
		fail(err)
		return
	}
	// Non-blocking, so the file joins Go's poller and Close ends a Read.
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		fail(inotifyLimit(err))
		return
	}
	wt := &watcher{f: os.NewFile(uintptr(fd), "inotify"), fd: fd, root: root, id: id, recursive: m.Recursive, dirs: map[int]string{}}
	defer wt.f.Close()
	err = asUser(id, func() error {
		dir, err := openIn(root, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if errors.Is(err, unix.ENOTDIR) {
			return &codedError{guest.CodeNotDir, root + " is not a directory"}
		}
		if err != nil {
			return pathErr("watch", root, err)
		}
		defer unix.Close(dir)
		if err := wt.addFD(dir, ""); err != nil {
			return err
		}
		if !m.Recursive {
			return nil
		}
		return below(dir, "", func(rel string, sub int) error {
			if sub < 0 {
				return errSkip
			}
			if err := wt.addFD(sub, rel); err != nil {
				return err
			}
			return nil
		})
	})
	if err != nil {
		fail(err)
		return
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
				if m.IncludeInfo && (e.Op == "create" || e.Op == "write" || e.Op == "chmod") {
					// Best effort: the entry may be gone again.
					asUser(id, func() error {
						e.Info, _ = statIn(filepath.Join(root, e.Name), nil)
						return nil
					})
				}
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
			asUser(wt.id, func() error {
				out = append(out, wt.existing(rel)...)
				return nil
			})
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

// addFD watches the open directory fd, rel below the root. inotify takes a
// path: the descriptor's /proc link, which names exactly the directory
// already resolved (a process may follow its own /proc/self/fd links
// whatever its credentials).
func (wt *watcher) addFD(fd int, rel string) error {
	if len(wt.dirs) >= maxWatchDirs {
		return &codedError{guest.CodeInvalid, "the watched tree has more than 8192 directories; watch a narrower path"}
	}
	wd, err := unix.InotifyAddWatch(wt.fd, procPath("self/fd/"+strconv.Itoa(fd)), watchMask)
	if err != nil {
		if errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ENOENT) {
			return err // raced with a removal or replaced by a file
		}
		if errors.Is(err, syscall.EACCES) {
			return pathErr("watch", filepath.Join(wt.root, rel), err)
		}
		return inotifyLimit(err)
	}
	wt.dirs[wd] = rel
	return nil
}

// errSkip tells below not to descend into a directory.
var errSkip = errors.New("skip")

// below calls visit for every entry below the open directory dir (rel is
// its path relative to the watched root), depth first, never following
// symlinks. sub is the entry opened as a directory, or -1 for other
// entries and directories the caller may not read; visit returning errSkip
// skips a directory's contents, any other error ends the walk.
func below(dir int, rel string, visit func(rel string, sub int) error) error {
	d, err := unix.Dup(dir)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(d), rel)
	names, _ := f.Readdirnames(-1)
	f.Close()
	for _, name := range names {
		r := filepath.Join(rel, name)
		sub, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			sub = -1
		}
		err = visit(r, sub)
		if err == nil && sub >= 0 {
			err = below(sub, r, visit)
		}
		if sub >= 0 {
			unix.Close(sub)
		}
		if err != nil && err != errSkip {
			return err
		}
	}
	return nil
}

// existing lists what a directory that just appeared already holds, as
// creations, and watches it and its subdirectories. It runs as the
// watch's user.
func (wt *watcher) existing(rel string) []*guestv1.FsEvent {
	dir, err := openIn(filepath.Join(wt.root, rel), unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil // gone again, or replaced by a file
	}
	defer unix.Close(dir)
	if wt.addFD(dir, rel) != nil {
		return nil
	}
	var out []*guestv1.FsEvent
	below(dir, rel, func(r string, sub int) error {
		out = append(out, &guestv1.FsEvent{Name: r, Op: "create"})
		if sub >= 0 && wt.addFD(sub, r) != nil {
			return errSkip
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
