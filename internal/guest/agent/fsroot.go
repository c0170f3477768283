package agent

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
)

// File calls act for the trainer inside the sandbox, so they get no more
// than the sandbox's user would:
//
//   - Paths resolve inside the agent's root, which is the sandbox's, with
//     openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS): ".." and absolute
//     symlinks stay inside, and /proc's links to other files
//     (/proc/PID/fd/N, cwd, root, exe, ns, map_files) are not followed. A
//     link the sandbox's user made therefore cannot lead the agent to what
//     it holds itself, such as its stdio (a file on the host for
//     containers). Kernels without openat2 (before 5.6) get the same rules
//     from a walk in user space (openSlow).
//   - The agent's own /proc entries (its memory, environment, fds) are
//     refused however they are reached (ownProc): procfs lets a process
//     open its own entries whatever its credentials.
//   - Each call runs as its user (asUser): fsuid, fsgid and supplementary
//     groups set on one locked OS thread, so the kernel checks the user's
//     permissions and what the call creates is the user's. A non-zero fsuid
//     also drops the thread's file capabilities (CAP_DAC_OVERRIDE and the
//     like), as setfsuid(2) documents.

// resolveFlags are the openat2 resolution rules of every file call.
const resolveFlags = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS

// haveOpenat2 reports whether the kernel (and the sandbox's seccomp
// profile) has openat2.
var haveOpenat2 = sync.OnceValue(func() bool {
	fd, err := unix.Openat2(unix.AT_FDCWD, "/", &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
})

// openIn opens p, an absolute clean path, inside the agent's root; the
// last component is followed if it is a symlink (inside the root, like the
// others). It returns the file descriptor (close-on-exec) or an errno.
func openIn(p string, flags int, mode uint32) (int, error) {
	root, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(root)
	return openAt(root, p, flags, mode)
}

// openAt opens p inside the directory root as if root were "/": ".." and
// absolute symlinks stay inside it, magic links are refused.
func openAt(root int, p string, flags int, mode uint32) (int, error) {
	if !haveOpenat2() {
		return openSlow(root, p, flags|unix.O_CLOEXEC, mode)
	}
	how := &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: resolveFlags}
	for i := 0; ; i++ {
		fd, err := unix.Openat2(root, p, how)
		// EAGAIN: a rename or mount raced the resolution of "..".
		if err == unix.EAGAIN && i < 32 {
			continue
		}
		return fd, err
	}
}

// maxLinks is how many symlinks one resolution follows, as the kernel's.
const maxLinks = 40

// openSlow resolves p from root component by component, following
// symlinks itself with openat2's IN_ROOT and NO_MAGICLINKS rules: ".." at
// the root stays there, absolute targets restart from the root, and a
// symlink in a procfs directory below /proc itself (where the magic links
// live) is refused with ELOOP, as openat2 refuses magic links.
func openSlow(root int, p string, flags int, mode uint32) (int, error) {
	stack := []int{root} // directories from the root down; the root is the caller's
	defer func() {
		for _, fd := range stack[1:] {
			unix.Close(fd)
		}
	}()
	pop := func(n int) {
		for len(stack) > n {
			unix.Close(stack[len(stack)-1])
			stack = stack[:len(stack)-1]
		}
	}
	rest := strings.Split(p, "/")
	links := 0
	for len(rest) > 0 {
		comp := rest[0]
		rest = rest[1:]
		switch comp {
		case "", ".":
			continue
		case "..":
			pop(max(len(stack)-1, 1))
			continue
		}
		cur := stack[len(stack)-1]
		last := len(rest) == 0 || allEmpty(rest)
		var st unix.Stat_t
		serr := unix.Fstatat(cur, comp, &st, unix.AT_SYMLINK_NOFOLLOW)
		if serr == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
			if last && flags&(unix.O_CREAT|unix.O_EXCL) == unix.O_CREAT|unix.O_EXCL {
				return -1, unix.EEXIST
			}
			if inProcBelowRoot(cur) {
				return -1, unix.ELOOP
			}
			if links++; links > maxLinks {
				return -1, unix.ELOOP
			}
			target, err := readlinkAt(cur, comp)
			if err != nil {
				return -1, err
			}
			if strings.HasPrefix(target, "/") {
				pop(1)
			}
			rest = append(strings.Split(target, "/"), rest...)
			continue
		}
		if last {
			return unix.Openat(cur, comp, flags|unix.O_NOFOLLOW, mode)
		}
		if serr != nil {
			return -1, serr
		}
		fd, err := unix.Openat(cur, comp, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		stack = append(stack, fd)
	}
	// p named the root, or a directory that ".." led back to.
	return unix.Openat(stack[len(stack)-1], ".", flags, mode)
}

func allEmpty(s []string) bool {
	for _, c := range s {
		if c != "" && c != "." {
			return false
		}
	}
	return true
}

// inProcBelowRoot reports whether dir is a procfs directory other than
// procfs's root: where /proc's magic links are.
func inProcBelowRoot(dir int) bool {
	var fs unix.Statfs_t
	if unix.Fstatfs(dir, &fs) != nil || fs.Type != unix.PROC_SUPER_MAGIC {
		return false
	}
	var st unix.Stat_t
	const procRootIno = 1
	return unix.Fstat(dir, &st) != nil || st.Ino != procRootIno
}

// readlinkAt reads the symlink name in dir.
func readlinkAt(dir int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dir, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
		if size > maxPath {
			return "", unix.ENAMETOOLONG
		}
	}
}

// openParent opens the directory holding p (O_PATH) and returns it with
// p's last component. p must not be "/".
func openParent(p string) (int, string, error) {
	i := strings.LastIndexByte(p, '/')
	dir, name := p[:i], p[i+1:]
	if dir == "" {
		dir = "/"
	}
	fd, err := openIn(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	return fd, name, err
}

// ownProc reports whether fd, an open file, is one of the agent's own
// /proc entries (/proc/<agent pid or one of its threads>/...). The check
// costs one fstatfs for files outside procfs. A file whose file system
// does not answer fstatfs (gVisor's procfs files do not) is judged by its
// path alone.
func ownProc(fd int) bool {
	var fs unix.Statfs_t
	statfsErr := unix.Fstatfs(fd, &fs)
	if statfsErr == nil && fs.Type != unix.PROC_SUPER_MAGIC {
		return false
	}
	target, err := os.Readlink(procPath("self/fd/" + strconv.Itoa(fd)))
	if err != nil {
		return true // cannot tell: refuse
	}
	// The component below procfs's mount point names the task.
	parts := strings.Split(target, "/")
	for i := 1; i < len(parts); i++ {
		var st unix.Statfs_t
		if unix.Statfs("/"+strings.Join(parts[1:i], "/"), &st) != nil || st.Type != unix.PROC_SUPER_MAGIC {
			continue
		}
		task := parts[i]
		if _, err := strconv.Atoi(task); err != nil {
			return task == "self" || task == "thread-self"
		}
		if task == strconv.Itoa(os.Getpid()) {
			return true
		}
		// One of the agent's threads (each has a /proc/<tid> too).
		return unix.Access(procPath("self/task/"+task), unix.F_OK) == nil
	}
	// No procfs on the way: a procfs file (by fstatfs) is refused, a file
	// whose file system did not say is not one.
	return statfsErr == nil
}

// pathErr is the error of op on the sandbox path p. It names p only, never
// anything the resolution met on the way.
func pathErr(op, p string, err error) error {
	if errors.Is(err, unix.ELOOP) {
		return &codedError{guest.CodePermission, fmt.Sprintf("%s %s: refused: the path goes through a /proc link to another file (/proc/PID/fd, cwd, root, exe) or a symbolic link loop", op, p)}
	}
	return &os.PathError{Op: op, Path: p, Err: err}
}

// errOwnProc refuses the agent's own /proc entries.
func errOwnProc(op, p string) error {
	return &codedError{guest.CodePermission, fmt.Sprintf("%s %s: permission denied: the file belongs to the sandbox's agent", op, p)}
}

// fsIDs reports whether this kernel has setfsuid and setfsgid. gVisor's
// has neither: there a call switches its thread's effective ids instead,
// which file checks follow as well (and which the thread's saved id, root,
// lets it switch back from).
var fsIDs = sync.OnceValue(func() bool {
	_, err := unix.SetfsuidRetUid(-1) // -1 changes nothing and returns the current
	return err == nil
})

// The agent's own file-system credentials, to return to after a call.
var agentCreds = sync.OnceValue(func() (c struct {
	fsuid, fsgid int
	groups       []int
}) {
	if fsIDs() {
		c.fsuid, _ = unix.SetfsuidRetUid(-1)
		c.fsgid, _ = unix.SetfsgidRetGid(-1)
	} else {
		c.fsuid, c.fsgid = unix.Geteuid(), unix.Getegid()
	}
	c.groups, _ = unix.Getgroups()
	return c
})

// isAgent reports whether id's credentials are the agent's own (root), so
// a call as id needs no switch.
func (id identity) isAgent() bool {
	c := agentCreds()
	if int(id.uid) != c.fsuid || int(id.gid) != c.fsgid {
		return false
	}
	for _, g := range id.groups {
		if int(g) != c.fsgid && !containsInt(c.groups, int(g)) {
			return false
		}
	}
	return true
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// asUser runs fn with id's file-system credentials and returns its error.
// It is safe with Go's reuse of threads: fn runs on a goroutine locked to
// its OS thread, and only that thread's credentials change (setfsuid,
// setfsgid and the raw setgroups system call are per thread; Go's
// syscall.Setgroups, which changes every thread, is not used). The thread
// is given back to the runtime only once the agent's credentials are
// restored; if they cannot be, the goroutine ends still locked and the
// runtime discards the thread. fn must not start goroutines that touch
// files: they run on other threads, with the agent's credentials.
func asUser(id identity, fn func() error) error {
	if id.isAgent() {
		return fn()
	}
	creds := agentCreds()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := setFSCreds(int(id.uid), int(id.gid), groupsOf(id)); err != nil {
			// Whatever the thread's credentials are now, it dies with this
			// goroutine (still locked).
			done <- &codedError{guest.CodeInternal, "act as user " + id.name + ": " + err.Error()}
			return
		}
		err := fn()
		if setFSCreds(creds.fsuid, creds.fsgid, creds.groups) == nil {
			runtime.UnlockOSThread()
		}
		done <- err
	}()
	return <-done
}

func groupsOf(id identity) []int {
	gs := make([]int, 0, len(id.groups)+1)
	gs = append(gs, int(id.gid))
	for _, g := range id.groups {
		if int(g) != int(id.gid) {
			gs = append(gs, int(g))
		}
	}
	return gs
}

// setFSCreds sets the calling thread's supplementary groups, fsgid and
// fsuid (or, without those, its effective ids: see fsIDs), and checks that
// they took.
func setFSCreds(uid, gid int, groups []int) error {
	if !fsIDs() {
		return setEffectiveIDs(uid, gid, groups)
	}
	// unix.Setgroups is the raw system call: this thread only.
	if err := unix.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	unix.SetfsgidRetGid(gid)
	if cur, _ := unix.SetfsgidRetGid(-1); cur != gid {
		return fmt.Errorf("setfsgid %d: still %d", gid, cur)
	}
	unix.SetfsuidRetUid(uid)
	if cur, _ := unix.SetfsuidRetUid(-1); cur != uid {
		return fmt.Errorf("setfsuid %d: still %d", uid, cur)
	}
	return nil
}

// setEffectiveIDs sets the calling thread's supplementary groups and
// effective gid and uid, through the raw system calls (this thread only;
// Go's syscall.Setresuid would change every thread). It becomes root
// again first: only root may change its groups and gid. Leaving root for
// another uid clears the thread's effective capabilities; coming back
// restores them from its permitted set, which a saved uid of root keeps.
func setEffectiveIDs(uid, gid int, groups []int) error {
	const keep = ^uintptr(0) >> 32 // (uid_t)-1: leave unchanged
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, 0, keep); e != 0 {
		return fmt.Errorf("setresuid to root: %w", e)
	}
	if err := unix.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, keep, uintptr(gid), keep); e != 0 {
		return fmt.Errorf("setresgid %d: %w", gid, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, uintptr(uid), keep); e != 0 {
		return fmt.Errorf("setresuid %d: %w", uid, e)
	}
	if cur := unix.Getegid(); cur != gid {
		return fmt.Errorf("setresgid %d: still %d", gid, cur)
	}
	if cur := unix.Geteuid(); cur != uid {
		return fmt.Errorf("setresuid %d: still %d", uid, cur)
	}
	return nil
}
