package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// A call slot is the storage and the mount namespace of one call uid,
// made on its first call and kept for the worker's life: the calls of a
// uid run one at a time, and each finds it empty.
//
// The storage is a tmpfs of its own (size-limited) mounted at the call
// directory the node names for the uid. It holds the call's working
// directory and what its processes see as /tmp, /var/tmp and /dev/shm:
// the slot's namespace has those bound over them, and the runner moves
// each call process into it (setns) before dropping to the uid. One call
// therefore cannot fill another's /tmp, nor read it. Making the namespace
// once per slot, not per call, keeps namespace creation and teardown (a
// copy of the mount table, and an RCU grace period when it goes) off the
// call's path; cleanup empties the storage instead.
//
// The storage root is root's (mode 0711), so a call cannot rename or
// remove the directories its namespace binds; the directories are the
// uid's, and their mode and owner are reset after each call.

// privateDirs are the slot directories a call's processes see elsewhere:
// subdirectory of the storage → where it is bound.
var privateDirs = [][2]string{{"tmp", "/tmp"}, {"var-tmp", "/var/tmp"}, {"shm", "/dev/shm"}}

// slotDirs are the subdirectories of a slot's storage, the working
// directory first.
var slotDirs = []string{"work", "tmp", "var-tmp", "shm"}

const (
	// defaultCallDisk bounds a call's storage when the node gives no size.
	defaultCallDisk = 512 << 20
	// callInodes bounds the files of one call (each costs kernel memory
	// that the size does not count).
	callInodes = 65536
)

// callSlots are the agent's call slots, by storage directory. The zero
// value is ready.
type callSlots struct {
	mu    sync.Mutex
	slots map[string]*callSlot
}

type callSlot struct {
	dir  string
	uid  int
	nsfd int // the slot's mount namespace
}

// get returns the slot of dir for uid, making it (size bytes of storage,
// 0 for the default) on first use.
func (cs *callSlots) get(dir string, uid int, size int64) (*callSlot, error) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if s := cs.slots[dir]; s != nil {
		if s.uid != uid {
			return nil, fmt.Errorf("call directory %s belongs to uid %d, not %d", dir, s.uid, uid)
		}
		return s, nil
	}
	s, err := newCallSlot(dir, uid, size)
	if err != nil {
		return nil, err
	}
	if cs.slots == nil {
		cs.slots = map[string]*callSlot{}
	}
	cs.slots[dir] = s
	return s, nil
}

func newCallSlot(dir string, uid int, size int64) (*callSlot, error) {
	if size <= 0 {
		size = defaultCallDisk
	}
	if err := os.Mkdir(dir, 0o711); err != nil {
		return nil, err
	}
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=0711,uid=0,gid=0", size, callInodes)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("mount a tmpfs (the worker needs CAP_SYS_ADMIN and mount in its seccomp profile): %w", err)
	}
	s := &callSlot{dir: dir, uid: uid, nsfd: -1}
	err := s.reset()
	if err == nil {
		s.nsfd, err = slotNamespace(dir)
	}
	if err != nil {
		unix.Unmount(dir, unix.MNT_DETACH)
		os.Remove(dir)
		return nil, err
	}
	return s, nil
}

// work is the slot's working directory.
func (s *callSlot) work() string { return filepath.Join(s.dir, "work") }

// reset gives the slot's directories back their mode and owner.
func (s *callSlot) reset() error {
	for _, sub := range slotDirs {
		p := filepath.Join(s.dir, sub)
		if err := os.Mkdir(p, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		if err := os.Lchown(p, s.uid, s.uid); err != nil {
			return err
		}
		if err := os.Chmod(p, 0o700); err != nil {
			return err
		}
	}
	return nil
}

// empty removes everything the call left in the slot's storage and resets
// its directories.
func (s *callSlot) empty() error {
	for _, sub := range slotDirs {
		p := filepath.Join(s.dir, sub)
		ents, err := os.ReadDir(p)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := os.RemoveAll(filepath.Join(p, e.Name())); err != nil {
				return err
			}
		}
	}
	// Anything else at the top (the root is root's: nothing should be).
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !contains(slotDirs, e.Name()) {
			if err := os.RemoveAll(filepath.Join(s.dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return s.reset()
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// slotNamespace makes a mount namespace in which the slot's directories of
// dir are bound over /tmp, /var/tmp and /dev/shm, and returns a descriptor
// that keeps it alive. It is made on a thread of its own that is never
// given back to Go's scheduler (its mount namespace is not the agent's):
// the thread ends with its goroutine.
func slotNamespace(dir string) (int, error) {
	type result struct {
		fd  int
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // and never unlocked
		fd, err := func() (int, error) {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return -1, fmt.Errorf("unshare a mount namespace: %w", err)
			}
			// Nothing made here may propagate back to the worker's mounts.
			if err := unix.Mount("none", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
				return -1, fmt.Errorf("make mounts private: %w", err)
			}
			for _, b := range privateDirs {
				if err := unix.Mount(filepath.Join(dir, b[0]), b[1], "", unix.MS_BIND, ""); err != nil {
					return -1, fmt.Errorf("bind over %s: %w", b[1], err)
				}
			}
			return unix.Open(procPath("thread-self/ns/mnt"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		}()
		done <- result{fd, err}
	}()
	r := <-done
	return r.fd, r.err
}
