package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Guest RAM saved apart from the migration stream.
//
// A VM that booted has its RAM in a memfd (the machines' "mem" backend).
// A machine snapshot of it (a boot snapshot, a snapshot to fork from)
// runs the migration with x-ignore-shared, which leaves shared RAM out of
// the stream, and copies the memfd's pages into a sparse file beside it
// (RAMFile: only the pages the guest touched, zero pages left as holes).
// That takes a fraction of a second where the stream took seconds: QEMU
// zero-checks every page of the RAM for the stream, which allocates every
// page of a memfd the guest never touched.
//
// A restore of such a snapshot maps the RAM copy-on-write from a sealed
// memfd holding the file's pages (ramFiles: one per file, shared by every
// VM restored from it) and loads only the devices from the stream: the
// guest runs at once, its untouched pages are the memfd's, shared, and
// each VM's writes go to pages of its own, charged to its QEMU. The seals
// (no writes, no size change) are what make the sharing safe: QEMU
// discards the RAM a guest gives back (free page reporting, a balloon
// inflated by a guest driver of its own) by punching holes in the file
// behind it, which on a shared file would zero the pages of every other VM
// mapping it; on a sealed memfd the punch fails. The cost: such a VM's
// RAM does not shrink when its guest frees memory (QEMU logs each refused
// discard), where a booted VM's does.
//
// A restored VM's RAM is that private mapping, which x-ignore-shared does
// not leave out: its snapshots and its pauses (a booted VM's too: a
// pause's RAM would be mapped by one VM alone) put the RAM in the stream,
// as before, and a restore of one loads it into a memfd.

// RAMFile is a machine snapshot's guest RAM, when saved apart.
const RAMFile = "memory.raw"

// Restore is what a start restores: a migration stream (the caller
// closes it) and, when the RAM was saved apart, the RAM file mapped
// copy-on-write ("" when the stream holds the RAM).
type Restore struct {
	State *os.File
	RAM   string
}

// memfdRAM begins the memory backend every machine declares (drivers'
// args): guest RAM in a memfd, named mem.
const memfdRAM = "memory-backend-memfd,id=mem,"

// incomingArgs completes a machine's command line (args) for a restore
// whose stream is fd 3: with ram, the path QEMU maps its RAM from
// copy-on-write in place of the memfd, and "-incoming defer" (the stream
// was saved with x-ignore-shared, which StartIncomingIgnoringShared sets
// before loading it); without, "-incoming fd:3".
func incomingArgs(args []string, ram string) ([]string, error) {
	if ram == "" {
		return append(args, "-incoming", "fd:3"), nil
	}
	out := make([]string, 0, len(args)+2)
	found := false
	for _, a := range args {
		if rest, ok := strings.CutPrefix(a, memfdRAM); ok {
			// QEMU's option syntax doubles a comma inside a value.
			a = "memory-backend-file,id=mem," + rest + ",mem-path=" + strings.ReplaceAll(ram, ",", ",,") + ",share=off"
			found = true
		}
		out = append(out, a)
	}
	if !found {
		return nil, errors.New("the machine declares no memfd RAM backend to map a RAM file in place of")
	}
	return append(out, "-incoming", "defer"), nil
}

// RestoreArgs is a machine's command line (args, without -incoming) for
// a restore of the machine snapshot in dir from fd 3 (incomingArgs: its
// RAM file mapped if the RAM was saved apart), and whether the stream is
// then loaded through StartIncomingIgnoringShared.
func RestoreArgs(args []string, dir string) (_ []string, deferred bool, _ error) {
	ram := filepath.Join(dir, RAMFile)
	if _, err := os.Stat(ram); err != nil {
		ram = ""
	}
	args, err := incomingArgs(args, ram)
	return args, ram != "", err
}

// StartIncomingIgnoringShared starts the incoming migration from uri of a
// QEMU started with "-incoming defer" for a stream saved with
// x-ignore-shared (its RAM mapped from a file: incomingArgs).
func StartIncomingIgnoringShared(ctx context.Context, q *QMP, uri string) error {
	caps := []map[string]any{{"capability": "x-ignore-shared", "state": true}}
	if err := q.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": caps}, nil); err != nil {
		return err
	}
	return q.Execute(ctx, "migrate-incoming", map[string]any{"uri": uri}, nil)
}

// ramFiles are the sealed memfds restores map their RAM from.
var ramFiles = &ramCache{m: map[string]*ramEntry{}, budget: 4 << 30}

// ramCache holds one sealed memfd per RAM file, loaded on the first
// restore of it and dropped when the file is gone or changed, or when the
// memfds held exceed budget bytes (least recently used first). A dropped
// memfd lives on in the QEMUs that map it.
type ramCache struct {
	mu     sync.Mutex
	m      map[string]*ramEntry
	budget int64
}

type ramEntry struct {
	f    *os.File
	id   fileID
	size int64
	used time.Time
}

// fileID tells a file from another of the same path.
type fileID struct {
	dev, ino uint64
	mtime    int64
	size     int64
}

func idOf(path string) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fileID{}, err
	}
	return fileID{dev: st.Dev, ino: st.Ino, mtime: st.Mtim.Nano(), size: st.Size}, nil
}

// open returns the sealed memfd of the RAM file at path, for a restore
// to map copy-on-write; the caller closes it (its QEMU keeps it open).
func (c *ramCache) open(path string) (*os.File, error) {
	id, err := idOf(path)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var held int64
	for p, e := range c.m {
		if cur, err := idOf(p); err != nil || cur != e.id {
			e.f.Close()
			delete(c.m, p)
			continue
		}
		held += e.size
	}
	e := c.m[path]
	if e == nil {
		f, err := loadSealed(path, id.size)
		if err != nil {
			return nil, err
		}
		e = &ramEntry{f: f, id: id, size: id.size}
		c.m[path] = e
		held += e.size
		for held > c.budget && len(c.m) > 1 {
			var lru string
			for p, o := range c.m {
				if p != path && (lru == "" || o.used.Before(c.m[lru].used)) {
					lru = p
				}
			}
			held -= c.m[lru].size
			c.m[lru].f.Close()
			delete(c.m, lru)
		}
	}
	e.used = time.Now()
	fd, err := unix.Dup(int(e.f.Fd()))
	if err != nil {
		return nil, err
	}
	unix.CloseOnExec(fd)
	return os.NewFile(uintptr(fd), e.f.Name()), nil
}

// loadSealed copies the RAM file at path (size bytes) into a new memfd,
// holes kept (CopySparse), and seals it against writes and size changes.
func loadSealed(path string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate("dsec-ram", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "memfd:dsec-ram")
	if err := CopySparse(path, fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)); err != nil {
		f.Close()
		return nil, fmt.Errorf("load the RAM file: %w", err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, err
	}
	seals := unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal the RAM memfd: %w", err)
	}
	return f, nil
}

// saveRAM copies the guest RAM of QEMU process pid (its memfd, found
// among its open files) into a new sparse file at dst (CopySparse: the
// pages the guest never touched, and those that are all zero, are holes)
// and syncs it.
func saveRAM(pid int, dst string) error {
	src, err := memfdPath(pid)
	if err != nil {
		return err
	}
	if err := CopySparse(src, dst); err != nil {
		return fmt.Errorf("copy the guest RAM: %w", err)
	}
	f, err := os.Open(dst)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// memfdPath is the path (through /proc) of QEMU process pid's guest RAM
// memfd (QEMU names it after its backend type).
func memfdPath(pid int) (string, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if l, err := os.Readlink(p); err == nil && strings.HasPrefix(l, "/memfd:memory-backend-memfd ") {
			return p, nil
		}
	}
	return "", errors.New("QEMU holds no guest RAM memfd")
}
