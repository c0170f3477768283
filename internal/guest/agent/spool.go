package agent

import (
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// spoolBudget bounds the bytes all tails hold at once, in the spool's page
// cache (charged to the agent's own memory cgroup) or in memory: a sandbox
// running many execs at the largest cap must not make the agent exceed its
// memory. A tail gets what is left of the budget when it starts; one that
// gets less than its share keeps fewer last bytes (the output is marked
// truncated, as for any cut).
const spoolBudget = 128 << 20

var spoolLeft = struct {
	mu sync.Mutex
	n  int64
}{n: spoolBudget}

func reserveSpool(want int64) int64 {
	spoolLeft.mu.Lock()
	defer spoolLeft.mu.Unlock()
	got := min(want, spoolLeft.n)
	spoolLeft.n -= got
	return got
}

func releaseSpool(n int64) {
	spoolLeft.mu.Lock()
	spoolLeft.n += n
	spoolLeft.mu.Unlock()
}

// tailSpool keeps the last max bytes of a stream. With a spool directory
// it keeps them in an unlinked file there (a ring), not in the agent's
// memory: a caller may ask for up to 64 MiB per stream, more than a small
// sandbox's agent may hold. The node passes the directory (outside the
// sandbox's root filesystem) as an inherited descriptor; the files have no
// name, so nothing in the sandbox can reach them. Without a directory, or
// if the file cannot be made, the bytes stay in memory.
type tailSpool struct {
	max      int64 // bytes kept: the reservation from the budget
	n        int64 // bytes written in all
	f        *os.File
	mem      *tailBuf
	released bool
}

// newTailSpool returns a tail keeping the last max bytes, or fewer if the
// spool budget is short.
func newTailSpool(dir *os.File, max int64) *tailSpool {
	max = reserveSpool(max)
	t := &tailSpool{max: max}
	if dir != nil && max > 0 {
		fd, err := unix.Openat(int(dir.Fd()), ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err == nil {
			t.f = os.NewFile(uintptr(fd), "tail")
			return t
		}
	}
	t.mem = &tailBuf{max: int(max)}
	return t
}

// add appends b and reports whether bytes have been dropped so far.
func (t *tailSpool) add(b []byte) bool {
	if t.mem != nil && t.max > 0 {
		return t.mem.add(b)
	}
	if t.max <= 0 {
		t.n += int64(len(b))
		return t.n > 0
	}
	if int64(len(b)) > t.max {
		t.n += int64(len(b)) - t.max
		b = b[int64(len(b))-t.max:]
	}
	for len(b) > 0 {
		off := t.n % t.max
		k := min(int64(len(b)), t.max-off)
		if _, err := t.f.WriteAt(b[:k], off); err != nil {
			// The spool's disk is full: keep what fits in memory from now
			// on (the ring's content is lost; the output is marked
			// truncated either way).
			t.f.Close()
			t.f = nil
			t.mem = &tailBuf{max: int(t.max)}
			t.mem.add(b)
			t.mem.full = true
			return true
		}
		t.n += k
		b = b[k:]
	}
	return t.n > t.max
}

// each calls fn with the kept bytes in order, in chunks of at most size
// bytes (fn must not keep a chunk), and releases the spool.
func (t *tailSpool) each(size int, fn func([]byte)) {
	defer t.close()
	if t.mem != nil {
		b := t.mem.bytes()
		for len(b) > 0 {
			k := min(len(b), size)
			fn(b[:k])
			b = b[k:]
		}
		t.mem = nil
		return
	}
	if t.f == nil {
		return
	}
	buf := make([]byte, size)
	read := func(off, end int64) {
		for off < end {
			k := min(int64(size), end-off)
			n, err := t.f.ReadAt(buf[:k], off)
			if n > 0 {
				fn(buf[:n])
			}
			if err != nil || n == 0 {
				return
			}
			off += int64(n)
		}
	}
	if t.n <= t.max {
		read(0, t.n)
		return
	}
	start := t.n % t.max
	read(start, t.max)
	read(0, start)
}

// close releases the spool (and its share of the budget) without reading
// it. It is idempotent.
func (t *tailSpool) close() {
	if t.f != nil {
		t.f.Close()
		t.f = nil
	}
	t.mem = nil
	if !t.released {
		t.released = true
		releaseSpool(t.max)
	}
}
