package container

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/opendsec/dsec/internal/proc"
	"golang.org/x/sys/unix"
)

// User namespaces.
//
// Every sandbox (unless the node runs them as host root, Config.HostRoot)
// gets a user namespace of its own that maps its ids 0..65535 to a range of
// unprivileged host ids no other live sandbox holds: root inside is a
// nobody outside, and every per-user count the kernel keeps (inotify
// instances and watches, processes, user namespaces, ...) is kept per
// (namespace, id) and charged, up the chain of namespaces, to the host id
// that *created* the namespace. crun would create it as host root, which
// would charge every sandbox's inotify instances to root again; so the
// driver creates it itself, as the range's first host id, and crun joins
// it by path. Creating one costs two execs (~1–2 ms here), so a few are
// made ahead in the background (usernsPool): each is used once.

const (
	// idRangeSize is how many ids a sandbox's user namespace maps.
	idRangeSize = 65536
	// defaultIDBase is the first host id of range 0, and defaultIDRanges
	// how many ranges there are: host ids 2^30 .. 2^31-1, above any
	// distribution's users and below 2^31 (the egress namespaces' ICMP
	// datagram sockets are open to gids 0..2^31-1).
	defaultIDBase   = 1 << 30
	defaultIDRanges = 1 << 14
	// usernsPoolSize is how many user namespaces are made ahead.
	usernsPoolSize = 4
	// idRangesDir records the ranges in use on this host.
	idRangesDir = "/run/dsec/ids"
	// staleAfter is how old another node's range must be before it may be
	// taken back when that node and its sandbox are both gone.
	staleAfter = 2 * time.Minute
)

// idRanges hands out ranges of host ids. Ranges are host-wide (every node
// on a host shares the ids), so each range in use is recorded in a
// directory of the host's /run as a symbolic link (dir/<index>, made
// exclusively when the range is taken for the pool; a link, not a file, so
// that recording costs no data write) naming the node (its runtime root
// and process). Nothing is written when a create takes a pooled range: the
// sandbox's range is in its state. A node re-adopts its own at start
// (adopt, then sweep frees the rest); another node's range is taken back
// only when that node's process is gone and no process on the host runs
// as one of the range's ids (its sandbox may outlive it). Methods are
// safe for concurrent use.
type idRanges struct {
	dir   string
	base  uint32
	count int
	owner string // the driver's runtime root
	log   *slog.Logger

	mu   sync.Mutex
	held map[int]string // index → sandbox ID, "" while pooled
	next int
}

func newIDRanges(dir, owner string, log *slog.Logger) (*idRanges, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	return &idRanges{dir: dir, base: defaultIDBase, count: defaultIDRanges, owner: owner, log: log, held: map[int]string{}}, nil
}

// hostID is the first host id of range index.
func (r *idRanges) hostID(index int) uint32 { return r.base + uint32(index)*idRangeSize }

func (r *idRanges) path(index int) string { return filepath.Join(r.dir, strconv.Itoa(index)) }

// record is what a range's link says: "<owner> <pid> <start time>".
func (r *idRanges) record() string {
	self := os.Getpid()
	return fmt.Sprintf("%s %d %d", r.owner, self, proc.StartTime(self))
}

// parseRecord splits a record; ok is false for a malformed one.
func parseRecord(rec string) (owner string, pid int, start uint64, ok bool) {
	f := strings.Fields(rec)
	if len(f) != 3 {
		return "", 0, 0, false
	}
	pid, _ = strconv.Atoi(f[1])
	start, _ = strconv.ParseUint(f[2], 10, 64)
	return f[0], pid, start, true
}

// alloc takes a free range for sandbox id ("" for the pool).
func (r *idRanges) alloc(id string) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for n := 0; n < r.count; n++ {
		i := (r.next + n) % r.count
		if _, ok := r.held[i]; ok {
			continue
		}
		err := os.Symlink(r.record(), r.path(i))
		if errors.Is(err, fs.ErrExist) && r.staleLocked(i) {
			os.Remove(r.path(i))
			err = os.Symlink(r.record(), r.path(i))
		}
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("record id range: %w", err)
		}
		r.held[i] = id
		r.next = i + 1
		return i, nil
	}
	return 0, errors.New("every id range is taken")
}

// setLocked rewrites range index's record as this node process's.
func (r *idRanges) setLocked(index int) error {
	tmp := r.path(index) + ".new"
	os.Remove(tmp)
	if err := os.Symlink(r.record(), tmp); err != nil {
		return err
	}
	return os.Rename(tmp, r.path(index))
}

// assign notes that the pooled range index now belongs to sandbox id.
func (r *idRanges) assign(index int, id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held[index] = id
}

// staleLocked reports whether range index, held by another node, can be
// taken back: its node is gone and no process runs as one of its ids.
func (r *idRanges) staleLocked(index int) bool {
	var st unix.Stat_t
	if unix.Lstat(r.path(index), &st) != nil || time.Since(time.Unix(st.Mtim.Unix())) < staleAfter {
		return false
	}
	rec, _ := os.Readlink(r.path(index)) // "" for a malformed record
	owner, pid, start, ok := parseRecord(rec)
	if ok && owner == r.owner {
		return false // ours: freed by this node's sweep, never taken here
	}
	if ok && pid > 0 && proc.StartTime(pid) == start {
		return false
	}
	// The sandbox may still run while its node is down.
	return !runsAs(r.hostID(index), idRangeSize)
}

// runsAs reports whether a process on the host runs with a real uid in
// first..first+n-1.
func runsAs(first uint32, n uint32) bool {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		var st unix.Stat_t
		if unix.Stat("/proc/"+e.Name(), &st) != nil {
			continue
		}
		if st.Uid >= first && st.Uid-first < n {
			return true
		}
	}
	return false
}

// ours reports whether a record names this node.
func (r *idRanges) ours(rec string) bool {
	owner, _, _, ok := parseRecord(rec)
	return ok && owner == r.owner
}

// adopt marks range index as held by sandbox id after a restart, and
// reports whether it may (the range's record names this node, or is
// missing and no one else took it).
func (r *idRanges) adopt(index int, id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if index < 0 || index >= r.count {
		return false
	}
	if rec, err := os.Readlink(r.path(index)); err == nil && !r.ours(rec) {
		return false
	}
	if err := r.setLocked(index); err != nil {
		return false
	}
	r.held[index] = id
	return true
}

// free gives range index back.
func (r *idRanges) free(index int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.held, index)
	os.Remove(r.path(index))
}

// sweep frees every range recorded for this node that it does not hold
// (sandboxes that ended while it was down, an earlier pool's) but those
// busy says are still in use. It returns how many it freed.
func (r *idRanges) sweep(busy func(index int) bool) int {
	ents, err := os.ReadDir(r.dir)
	if err != nil {
		return 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range ents {
		i, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if _, ok := r.held[i]; ok || busy(i) {
			continue
		}
		rec, err := os.Readlink(r.path(i))
		if err != nil || !r.ours(rec) {
			continue
		}
		if os.Remove(r.path(i)) == nil {
			n++
		}
	}
	return n
}

// heldCount is how many ranges this node holds (for tests).
func (r *idRanges) heldCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.held)
}

// userNS is a user namespace made for one sandbox: its ids 0..65535 map
// to range index's host ids.
type userNS struct {
	index int
	host  uint32 // first host id
	f     *os.File
}

// path is where crun opens the namespace (the node's descriptor).
func (u *userNS) path() string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), u.f.Fd())
}

func (u *userNS) close() {
	if u != nil && u.f != nil {
		u.f.Close()
	}
}

// usernsPool makes user namespaces ahead of the creates that use them.
type usernsPool struct {
	ranges *idRanges
	log    *slog.Logger
	kick   chan struct{}

	mu     sync.Mutex
	closed bool
	ready  []*userNS
}

func newUsernsPool(ranges *idRanges, log *slog.Logger) *usernsPool {
	p := &usernsPool{ranges: ranges, log: log, kick: make(chan struct{}, 1)}
	go p.fill()
	p.refill()
	return p
}

// take returns a fresh user namespace for sandbox id, from the pool or
// made now. Call refill once the create is done: making the next one
// meanwhile would compete with it.
func (p *usernsPool) take(id string) (*userNS, error) {
	p.mu.Lock()
	var u *userNS
	if n := len(p.ready); n > 0 {
		u, p.ready = p.ready[0], p.ready[1:]
	}
	p.mu.Unlock()
	if u != nil {
		p.ranges.assign(u.index, id)
		return u, nil
	}
	return p.make(id)
}

// refill makes the pool full again, in the background.
func (p *usernsPool) refill() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// fill keeps usernsPoolSize namespaces ready. It runs for the node's life.
func (p *usernsPool) fill() {
	for range p.kick {
		for {
			p.mu.Lock()
			n, closed := len(p.ready), p.closed
			p.mu.Unlock()
			if n >= usernsPoolSize || closed {
				break
			}
			u, err := p.make("")
			if err != nil {
				p.log.Warn("make a user namespace ahead", slog.Any("error", err))
				break
			}
			p.mu.Lock()
			if closed = p.closed; !closed {
				p.ready = append(p.ready, u)
			}
			p.mu.Unlock()
			if closed {
				u.close()
				p.ranges.free(u.index)
			}
		}
	}
}

// close frees the pool's namespaces and ranges; a later take makes one.
func (p *usernsPool) close() {
	p.mu.Lock()
	ready := p.ready
	p.ready, p.closed = nil, true
	p.mu.Unlock()
	for _, u := range ready {
		u.close()
		p.ranges.free(u.index)
	}
}

// pooled reports whether range index is in the pool (not a sandbox's).
func (p *usernsPool) pooled(index int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range p.ready {
		if u.index == index {
			return true
		}
	}
	return false
}

func (p *usernsPool) make(id string) (*userNS, error) {
	i, err := p.ranges.alloc(id)
	if err != nil {
		return nil, err
	}
	host := p.ranges.hostID(i)
	f, err := newUserNamespace(host)
	if err != nil {
		p.ranges.free(i)
		return nil, err
	}
	return &userNS{index: i, host: host, f: f}, nil
}

// newUserNamespace makes a user namespace owned by host id host, mapping
// ids 0..idRangeSize-1 to host.., and returns it open.
//
// The kernel charges a namespace's per-user counts to its creator's
// effective uid, so the namespace is made by a process whose effective uid
// is host: util-linux's unshare(1), started (vfork and exec) from a thread
// whose effective uid is host (a per-thread change, with the capabilities
// kept: SECBIT_NO_SETUID_FIXUP; the thread is thrown away afterwards).
// Once it has unshared, the node writes the maps, opens the namespace and
// kills it. Forking the node itself instead (cloning straight into the
// namespace) would mark the node's whole memory copy-on-write: measured
// here, it made the node's next steps of a create several times slower.
func newUserNamespace(host uint32) (*os.File, error) {
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		return nil, errors.New("unshare(1) not found (apt-get install util-linux)")
	}
	type started struct {
		cmd *exec.Cmd
		err error
	}
	ch := make(chan started, 1)
	go func() {
		// Never unlocked: the thread's credentials are changed, so it ends
		// with this goroutine. They are given back first all the same: a
		// thread Go cannot end (the process's main thread, whose
		// credentials ps and /proc/<pid>/status show) is kept parked as
		// it is.
		runtime.LockOSThread()
		const secbitNoSetuidFixup = 1 << 2
		if _, _, e := unix.RawSyscall(unix.SYS_PRCTL, unix.PR_SET_SECUREBITS, secbitNoSetuidFixup, 0); e != 0 {
			ch <- started{err: fmt.Errorf("keep capabilities across the uid change: %w", e)}
			return
		}
		defer unix.RawSyscall(unix.SYS_PRCTL, unix.PR_SET_SECUREBITS, 0, 0)
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0)>>32, uintptr(host), ^uintptr(0)>>32); e != 0 {
			ch <- started{err: fmt.Errorf("take the range's uid: %w", e)}
			return
		}
		cmd := exec.Command(unshare, "--user", "sleep", "60")
		err := cmd.Start()
		unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0)>>32, 0, ^uintptr(0)>>32)
		ch <- started{cmd: cmd, err: err}
	}()
	st := <-ch
	if st.err != nil {
		return nil, fmt.Errorf("start unshare: %w", st.err)
	}
	defer func() {
		st.cmd.Process.Kill()
		go st.cmd.Wait()
	}()
	self, err := os.Readlink("/proc/self/ns/user")
	if err != nil {
		return nil, err
	}
	proc := fmt.Sprintf("/proc/%d/", st.cmd.Process.Pid)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Microsecond) {
		ns, err := os.Readlink(proc + "ns/user")
		if err != nil {
			return nil, fmt.Errorf("unshare ended early: %w", err)
		}
		if ns != self {
			break
		}
		if time.Now().After(deadline) {
			return nil, errors.New("unshare did not make a user namespace within 10s")
		}
	}
	m := []byte(fmt.Sprintf("0 %d %d\n", host, idRangeSize))
	for _, f := range []string{"uid_map", "gid_map"} {
		if err := os.WriteFile(proc+f, m, 0); err != nil {
			return nil, fmt.Errorf("write %s: %w", f, err)
		}
	}
	f, err := os.Open(proc + "ns/user")
	if err != nil {
		return nil, err
	}
	// The process could have ended and its pid been reused in between:
	// the namespace must be the one the map was written for.
	if uid, err := unix.IoctlGetUint32(int(f.Fd()), nsGetOwnerUID); err != nil || uid != host {
		f.Close()
		return nil, fmt.Errorf("the new user namespace is not the range's (owner %d): %v", uid, err)
	}
	return f, nil
}

// nsGetOwnerUID is NS_GET_OWNER_UID: the uid that owns a user namespace.
const nsGetOwnerUID = 0xb704

// attachLayers attaches each of layers (top first) at dir/<i>, id-mapped
// through userns (nil: as they are), so an overlay can take them as
// short relative lower directories. The overlay keeps private clones of
// its layers: detach the attachments once it is mounted.
func attachLayers(dir string, layers []string, userns *os.File) (detach func(), err error) {
	var attached []string
	undo := func() {
		for _, p := range attached {
			unix.Unmount(p, unix.MNT_DETACH)
		}
	}
	defer func() {
		// Not detach: an error return has set it to nil.
		if err != nil {
			undo()
		}
	}()
	for i, l := range layers {
		target := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(target, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
		fd, err := unix.OpenTree(unix.AT_FDCWD, l, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("clone layer: %w", err)
		}
		if userns != nil {
			attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns.Fd())}
			if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
				unix.Close(fd)
				return nil, fmt.Errorf("id-map layer: %w", err)
			}
		}
		err = unix.MoveMount(fd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("attach layer: %w", err)
		}
		attached = append(attached, target)
	}
	return undo, nil
}

// mountSysfs mounts at target a read-only sysfs of the network namespace
// at netns, from a thread that joins it (and is discarded afterwards).
func mountSysfs(netns, target string) error {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	f, err := os.Open(netns)
	if err != nil {
		return err
	}
	defer f.Close()
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the thread ends in the sandbox's namespace.
		runtime.LockOSThread()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		errc <- unix.Mount("sysfs", target, "sysfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")
	}()
	return <-errc
}
