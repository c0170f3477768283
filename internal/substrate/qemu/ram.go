package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
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

// withRAMFile rewrites a machine's command line to map its RAM from file
// (copy-on-write). Its stream, saved with x-ignore-shared, is loaded with
// the capability set (StartIncomingIgnoringShared).
func withRAMFile(args []string, file string) ([]string, error) {
	out := make([]string, 0, len(args)+2)
	found := false
	for _, a := range args {
		if rest, ok := strings.CutPrefix(a, memfdRAM); ok {
			// QEMU's option syntax doubles a comma inside a value.
			a = "memory-backend-file,id=mem," + rest + ",mem-path=" + strings.ReplaceAll(file, ",", ",,") + ",share=off"
			found = true
		}
		out = append(out, a)
	}
	if !found {
		return nil, errors.New("the machine declares no memfd RAM backend to map a RAM file in place of")
	}
	return out, nil
}

// RestoreArgs is a machine's command line (args, without -incoming) for
// a restore of the machine snapshot in dir: with its RAM file mapped if
// the RAM was saved apart, which deferred reports (the stream is then
// loaded through StartIncomingIgnoringShared).
func RestoreArgs(args []string, dir string) (_ []string, deferred bool, _ error) {
	ram := filepath.Join(dir, RAMFile)
	if _, err := os.Stat(ram); err != nil {
		return args, false, nil
	}
	args, err := withRAMFile(args, ram)
	return args, err == nil, err
}

// StartIncomingIgnoringShared starts the incoming migration from uri of a
// QEMU started with "-incoming defer" for a stream saved with
// x-ignore-shared (its RAM mapped from a file: withRAMFile).
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

// loadSealed copies the RAM file at path (size bytes) into a new memfd
// and seals it against writes and size changes.
func loadSealed(path string, size int64) (*os.File, error) {
	src, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	fd, err := unix.MemfdCreate("dsec-ram", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "memfd:dsec-ram")
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, err
	}
	if err := copyPages(src, f, size); err != nil {
		f.Close()
		return nil, fmt.Errorf("load the RAM file: %w", err)
	}
	seals := unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal the RAM memfd: %w", err)
	}
	return f, nil
}

// saveRAM copies the guest RAM of QEMU process pid (its memfd, found
// among its open files) into a new sparse file at dst: the memfd's data
// extents, without the pages in them that are all zero. It writes dst
// through a temporary file renamed into place, so a VM mapping an
// earlier file of that name keeps its pages.
func saveRAM(pid int, dst string) error {
	src, err := openMemfd(pid)
	if err != nil {
		return err
	}
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return err
	}
	tmp := dst + ".tmp"
	out, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	defer out.Close()
	if err := out.Truncate(st.Size()); err != nil {
		return err
	}
	if err := copyPages(src, out, st.Size()); err != nil {
		return fmt.Errorf("copy the guest RAM: %w", err)
	}
	if err := out.Sync(); err != nil {
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// openMemfd opens QEMU process pid's guest RAM memfd (QEMU names it after
// its backend type) for reading.
func openMemfd(pid int) (*os.File, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if l, err := os.Readlink(p); err == nil && strings.HasPrefix(l, "/memfd:memory-backend-memfd ") {
			return os.Open(p)
		}
	}
	return nil, errors.New("QEMU holds no guest RAM memfd")
}

// copyPages copies src's data extents to dst at the same offsets, leaving
// holes where src has them and where a page is all zero.
func copyPages(src, dst *os.File, size int64) error {
	const page = 4096
	buf := make([]byte, 1<<20)
	zero := make([]byte, page)
	fd := int(src.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil {
			if errors.Is(err, unix.ENXIO) {
				return nil // no data after off
			}
			return err
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		for pos := data; pos < hole; {
			n, err := src.ReadAt(buf[:min(int64(len(buf)), hole-pos)], pos)
			if n == 0 && err != nil {
				if err == io.EOF {
					break
				}
				return err
			}
			// Write the runs of pages that are not all zero.
			for i := 0; i < n; {
				if bytes.Equal(buf[i:min(i+page, n)], zero[:min(page, n-i)]) {
					i += page
					continue
				}
				j := i + page
				for j < n && !bytes.Equal(buf[j:min(j+page, n)], zero[:min(page, n-j)]) {
					j += page
				}
				j = min(j, n)
				if _, err := dst.WriteAt(buf[i:j], pos+int64(i)); err != nil {
					return err
				}
				i = j
			}
			pos += int64(n)
		}
		off = hole
	}
	return nil
}
