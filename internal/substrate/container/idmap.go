package container

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

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
// it by path. Creating one costs a fork and an exec (~0.4–1.5 ms here), so
// a few are made ahead in the background (usernsPool): each is used once.

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
// on a host shares the ids), so they are recorded as files in a directory
// of the host's /run (dir/<index>, created exclusively), naming the node
// (its runtime root) and the sandbox. A node re-adopts its own at start
// (adopt, then sweep frees the rest); another node's range is taken back
// only when that node's process and its sandbox's runtime state are both
// gone. Methods are safe for concurrent use.
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

// record is what a range's file says: who holds it.
func (r *idRanges) record(id string) []byte {
	self := os.Getpid()
	return []byte(fmt.Sprintf("%s\n%s\n%d %d\n", r.owner, id, self, procStartTime(self)))
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
		f, err := os.OpenFile(r.path(i), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, fs.ErrExist) && r.staleLocked(i) {
			os.Remove(r.path(i))
			f, err = os.OpenFile(r.path(i), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		}
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("record id range: %w", err)
		}
		_, err = f.Write(r.record(id))
		f.Close()
		if err != nil {
			os.Remove(r.path(i))
			return 0, fmt.Errorf("record id range: %w", err)
		}
		r.held[i] = id
		r.next = i + 1
		return i, nil
	}
	return 0, errors.New("every id range is taken")
}

// assign records that the pooled range index now belongs to sandbox id.
func (r *idRanges) assign(index int, id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held[index] = id
	os.WriteFile(r.path(index), r.record(id), 0o600)
}

// staleLocked reports whether range index, held by another node or an
// earlier process of this one, can be taken back: its node is gone and so
// is its sandbox's runtime state.
func (r *idRanges) staleLocked(index int) bool {
	b, err := os.ReadFile(r.path(index))
	if err != nil {
		return false
	}
	st, err := os.Stat(r.path(index))
	if err != nil || time.Since(st.ModTime()) < staleAfter {
		return false
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) < 3 {
		return true
	}
	owner, id := lines[0], lines[1]
	if owner == r.owner {
		return false // ours: freed by this node's sweep, never taken here
	}
	var pid int
	var start uint64
	fmt.Sscanf(lines[2], "%d %d", &pid, &start)
	if pid > 0 && procStartTime(pid) == start {
		return false
	}
	if id != "" {
		if _, err := os.Stat(filepath.Join(owner, id)); err == nil {
			return false // the sandbox still runs while its node is down
		}
	}
	return true
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
	if b, err := os.ReadFile(r.path(index)); err == nil && !bytes.HasPrefix(b, []byte(r.owner+"\n")) {
		return false
	}
	if err := os.WriteFile(r.path(index), r.record(id), 0o600); err != nil {
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
// (sandboxes that ended while it was down, its pool's) but those busy
// says are still in use. It returns how many it freed.
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
		b, err := os.ReadFile(r.path(i))
		if err != nil || !bytes.HasPrefix(b, []byte(r.owner+"\n")) {
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

	mu    sync.Mutex
	ready []*userNS
}

func newUsernsPool(ranges *idRanges, log *slog.Logger) *usernsPool {
	p := &usernsPool{ranges: ranges, log: log, kick: make(chan struct{}, 1)}
	go p.fill()
	p.refill()
	return p
}

// take returns a fresh user namespace for sandbox id, from the pool or
// made now.
func (p *usernsPool) take(id string) (*userNS, error) {
	p.mu.Lock()
	var u *userNS
	if n := len(p.ready); n > 0 {
		u, p.ready = p.ready[0], p.ready[1:]
	}
	p.mu.Unlock()
	p.refill()
	if u != nil {
		p.ranges.assign(u.index, id)
		return u, nil
	}
	return p.make(id)
}

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
			n := len(p.ready)
			p.mu.Unlock()
			if n >= usernsPoolSize {
				break
			}
			u, err := p.make("")
			if err != nil {
				p.log.Warn("make a user namespace ahead", slog.Any("error", err))
				break
			}
			p.mu.Lock()
			p.ready = append(p.ready, u)
			p.mu.Unlock()
		}
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
// effective uid, so the namespace's first process is cloned from a thread
// whose effective uid is host (a per-thread change, with the capabilities
// kept: SECBIT_NO_SETUID_FIXUP), then writes the maps as host root. The
// thread is thrown away afterwards. The process is traced: it stops at its
// exec (of the node's own binary, through /proc/self/exe, which its
// credentials reach) before running a single instruction of it, and is
// killed; the descriptor keeps the namespace.
func newUserNamespace(host uint32) (*os.File, error) {
	type result struct {
		f   *os.File
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Never unlocked: the thread's credentials are changed, so it ends
		// with this goroutine.
		runtime.LockOSThread()
		const secbitNoSetuidFixup = 1 << 2
		if _, _, e := unix.RawSyscall(unix.SYS_PRCTL, unix.PR_SET_SECUREBITS, secbitNoSetuidFixup, 0); e != 0 {
			ch <- result{err: fmt.Errorf("keep capabilities across the uid change: %w", e)}
			return
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0)>>32, uintptr(host), ^uintptr(0)>>32); e != 0 {
			ch <- result{err: fmt.Errorf("take the range's uid: %w", e)}
			return
		}
		ids := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(host), Size: idRangeSize}}
		devnull, err := os.Open(os.DevNull)
		if err != nil {
			ch <- result{err: err}
			return
		}
		defer devnull.Close()
		const exe = "/proc/self/exe"
		proc, err := os.StartProcess(exe, []string{"dsec-userns"}, &os.ProcAttr{
			Files: []*os.File{devnull, devnull, devnull},
			Sys: &syscall.SysProcAttr{
				Cloneflags:  unix.CLONE_NEWUSER,
				UidMappings: ids, GidMappings: ids, GidMappingsEnableSetgroups: true,
				Ptrace: true, Pdeathsig: syscall.SIGKILL,
			},
		})
		if err != nil {
			ch <- result{err: fmt.Errorf("start a process in a new user namespace: %w", err)}
			return
		}
		f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", proc.Pid))
		proc.Kill()
		go proc.Wait()
		ch <- result{f: f, err: err}
	}()
	r := <-ch
	return r.f, r.err
}

// attachLayers attaches each of layers (top first) at dir/<i>, id-mapped
// through userns (nil: as they are), so an overlay can take them as
// short relative lower directories. The overlay keeps private clones of
// its layers: detach the attachments once it is mounted.
func attachLayers(dir string, layers []string, userns *os.File) (detach func(), err error) {
	var attached []string
	detach = func() {
		for _, p := range attached {
			unix.Unmount(p, unix.MNT_DETACH)
		}
	}
	defer func() {
		if err != nil {
			detach()
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
	return detach, nil
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
