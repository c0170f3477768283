// Package blobfs serves a node's lazily loaded layer data: each blob (the
// data device of a layer's EROFS image, made with mkfs.erofs --blobdev) is
// a read-only file of a FUSE file system the node mounts once, whose
// bytes are fetched from a Source in fixed chunks on first read, checked
// against the chunk's digest, and kept in an on-disk chunk cache. The
// layer's EROFS metadata image is local and names the blob file as its
// device, so a sandbox starts from an image whose data the node does not
// hold: the kernel reads through EROFS, EROFS through this file, and only
// the chunks a sandbox touches ever cross the network (DSec's on-demand
// loading; issue 19).
//
// A chunk that cannot be fetched, or whose bytes do not match its digest,
// fails the read with EIO: the reading process sees an I/O error, the
// sandbox and the node stay up, and nothing wrong is cached.
package blobfs

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Source reads a blob's bytes.
type Source interface {
	// ReadAt reads len(p) bytes at off (fewer only at the blob's end).
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
}

// HTTPSource reads a blob by HTTP range requests: a registry's blob URL,
// another node's, an object store's.
type HTTPSource struct {
	URL    string
	Header http.Header // e.g. Authorization
	Client *http.Client
}

// ReadAt implements Source.
func (s HTTPSource) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL, nil)
	if err != nil {
		return 0, err
	}
	for k, v := range s.Header {
		req.Header[k] = v
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+int64(len(p))-1))
	c := s.Client
	if c == nil {
		c = http.DefaultClient
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusPartialContent {
		return 0, fmt.Errorf("range read of %s: %s", req.URL.Redacted(), resp.Status)
	}
	n, err := io.ReadFull(resp.Body, p)
	if err == io.ErrUnexpectedEOF {
		err = nil // the blob's end
	}
	return n, err
}

// Blob describes one blob: its size, its chunk size and each chunk's
// SHA-256 (hex), in order.
type Blob struct {
	Size   int64    `json:"size"`
	Chunk  int64    `json:"chunk"`
	Digest []string `json:"chunks"`
}

// Describe reads the blob at path and describes it in chunks of chunk
// bytes (a power of two of at least 4 KiB).
func Describe(path string, chunk int64) (Blob, error) {
	f, err := os.Open(path)
	if err != nil {
		return Blob{}, err
	}
	defer f.Close()
	b := Blob{Chunk: chunk}
	buf := make([]byte, chunk)
	for {
		n, err := io.ReadFull(f, buf)
		if n > 0 {
			sum := sha256.Sum256(buf[:n])
			b.Digest = append(b.Digest, hex.EncodeToString(sum[:]))
			b.Size += int64(n)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return b, nil
		}
		if err != nil {
			return Blob{}, err
		}
	}
}

// CachedBytes is how many bytes of blob name of description d the chunk
// cache in directory cache holds (by its chunk marks, whether or not the
// blob is being served).
func CachedBytes(cache, name string, d Blob) int64 {
	marks, err := os.ReadFile(filepath.Join(cache, name+".chunks"))
	if err != nil {
		return 0
	}
	var n int64
	for c, m := range marks {
		if m == 1 && int64(c)*d.Chunk < d.Size {
			n += min(d.Chunk, d.Size-int64(c)*d.Chunk)
		}
	}
	return n
}

// Stats are a blob's counters.
type Stats struct {
	// Chunks is the blob's chunk count, Cached those on the node.
	Chunks, Cached int
	// Hits are reads of cached chunks; Fetches chunks fetched from the
	// source, FetchedBytes their bytes; Failed fetches that failed or
	// were refused (a digest mismatch).
	Hits, Fetches, FetchedBytes, Failed int64
}

// CacheStats are the chunk cache's: its budget (0: none), the bytes it
// holds, and the bytes it dropped to stay within the budget.
type CacheStats struct {
	Budget, Used, Evicted int64
}

// Trim drops chunks until the cache is within its budget, as the cache
// does by itself after the fetch that takes it over, and returns when
// done.
func (f *FS) Trim() { f.lru.evict(-1) }

// Shrink drops the least recently read chunks of blobs no running
// sandbox uses (see Options.Pinned) until the cache holds at most limit
// bytes or only such blobs' chunks, and returns the bytes it dropped
// (`dsec image prune`).
func (f *FS) Shrink(limit int64) int64 { return f.lru.evict(max(limit, 0)) }

// Cache reports the chunk cache's use.
func (f *FS) Cache() CacheStats {
	f.lru.mu.Lock()
	defer f.lru.mu.Unlock()
	return CacheStats{Budget: f.lru.budget, Used: f.lru.used, Evicted: f.lru.evicted}
}

// FS is a node's mount of lazily loaded blobs.
type FS struct {
	dir, cache string
	log        *slog.Logger
	server     *fuse.Server
	root       *rootNode
	lru        *lru
	// opens counts the blob files open (an EROFS mount holds its
	// device open for as long as it lives).
	opens openCount
}

// Open reports how many blob files are open: while any is, a mount
// reads through this file system.
func (f *FS) Open() int64 {
	n, _ := f.OpenChanged()
	return n
}

// OpenChanged reports how many blob files are open and a channel closed
// when that changes (the kernel releases a file after the mount holding
// it went, asynchronously).
func (f *FS) OpenChanged() (int64, <-chan struct{}) {
	f.opens.mu.Lock()
	defer f.opens.mu.Unlock()
	return f.opens.n, f.opens.changed
}

// openCount counts open blob files; changed is closed and replaced at
// each change.
type openCount struct {
	mu      sync.Mutex
	n       int64
	changed chan struct{}
}

func (o *openCount) add(d int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.n += d
	close(o.changed)
	o.changed = make(chan struct{})
}

// Options are a mount's settings.
type Options struct {
	// Budget is the chunk cache's size in bytes (0: no limit). Past it,
	// the least recently read chunks are dropped (read again from their
	// source when next needed), never a chunk of a pinned blob.
	Budget int64
	// Pinned says whether a blob's chunks must stay (a running sandbox's
	// layer). Nil: none is.
	Pinned func(name string) bool
}

// Mount mounts the blob file system at dir, with its chunk cache in cache.
func Mount(dir, cache string, opts Options, log *slog.Logger) (*FS, error) {
	for _, d := range []string{dir, cache} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	f := &FS{dir: dir, cache: cache, log: log, root: &rootNode{blobs: map[string]*blobNode{}}, lru: newLRU(opts, log),
		opens: openCount{changed: make(chan struct{})}}
	timeout := time.Hour // the set of blobs changes only through Add and Remove
	server, err := fs.Mount(dir, f.root, &fs.Options{
		EntryTimeout: &timeout, AttrTimeout: &timeout,
		MountOptions: fuse.MountOptions{
			DirectMount: true, FsName: "dsec-blobs", Name: "dsecblobs",
			AllowOther:   true, // the kernel reads for EROFS on behalf of any sandbox
			MaxReadAhead: 128 << 10,
			// A FUSE mount with passthrough counts as a stacked file
			// system, and EROFS refuses a device file on one.
			DisabledCapabilities: fuse.CAP_PASSTHROUGH,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("mount the blob file system at %s: %w", dir, err)
	}
	f.server = server
	return f, nil
}

// Wait returns once the file system is no longer served: unmounted by
// Close, or detached by anything else (its mountpoint removed).
func (f *FS) Wait() { f.server.Wait() }

// Close unmounts the file system.
func (f *FS) Close() error {
	f.lru.close()
	return f.server.Unmount()
}

// Add serves blob name (a digest's hex: a file name) of description d
// from src, and returns its path. Chunks cached by an earlier Add of the
// same name (another run of the node) are used. A blob served already
// with the same description stays as it is, open files and all, and
// reads from src from now on.
func (f *FS) Add(name string, d Blob, src Source) (string, error) {
	if d.Chunk < 4096 || d.Chunk&(d.Chunk-1) != 0 || int64(len(d.Digest)) != (d.Size+d.Chunk-1)/d.Chunk {
		return "", fmt.Errorf("blob %s: a bad description (%d bytes, chunks of %d, %d digests)", name, d.Size, d.Chunk, len(d.Digest))
	}
	f.root.mu.Lock()
	old := f.root.blobs[name]
	f.root.mu.Unlock()
	if old != nil && slices.Equal(old.desc.Digest, d.Digest) && old.desc.Size == d.Size && old.desc.Chunk == d.Chunk {
		old.src.Store(&source{src})
		return filepath.Join(f.dir, name), nil
	}
	data, err := os.OpenFile(filepath.Join(f.cache, name), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return "", err
	}
	if err := data.Truncate(d.Size); err != nil {
		data.Close()
		return "", err
	}
	b := &blobNode{name: name, desc: d, data: data, log: f.log, lru: f.lru, opens: &f.opens,
		present: make([]bool, len(d.Digest)), inflight: map[int]*fetch{}}
	b.src.Store(&source{src})
	// The chunk map: one byte per chunk, 1 once its bytes were written
	// and synced (a lost mark costs a refetch, never a wrong byte).
	if marks, err := os.ReadFile(filepath.Join(f.cache, name+".chunks")); err == nil && len(marks) == len(d.Digest) {
		for i, m := range marks {
			b.present[i] = m == 1
		}
	}
	if b.marks, err = os.OpenFile(filepath.Join(f.cache, name+".chunks"), os.O_RDWR|os.O_CREATE, 0o600); err != nil {
		data.Close()
		return "", err
	}
	b.marks.Truncate(int64(len(d.Digest)))
	for c, ok := range b.present {
		if ok {
			f.lru.add(b, c) // least recent: read before this run
		}
	}
	f.root.mu.Lock()
	old = f.root.blobs[name]
	f.root.blobs[name] = b
	f.root.mu.Unlock()
	if old != nil {
		old.close()
		f.lru.forget(old)
	}
	return filepath.Join(f.dir, name), nil
}

// Remove stops serving blob name and removes its cached chunks.
func (f *FS) Remove(name string) {
	f.root.mu.Lock()
	b := f.root.blobs[name]
	delete(f.root.blobs, name)
	f.root.mu.Unlock()
	if b != nil {
		b.close()
		f.lru.forget(b)
	}
	os.Remove(filepath.Join(f.cache, name))
	os.Remove(filepath.Join(f.cache, name+".chunks"))
}

// Stats reports blob name's counters.
func (f *FS) Stats(name string) (Stats, bool) {
	f.root.mu.Lock()
	b := f.root.blobs[name]
	f.root.mu.Unlock()
	if b == nil {
		return Stats{}, false
	}
	return b.stats(), true
}

// Names lists the blobs served.
func (f *FS) Names() []string {
	f.root.mu.Lock()
	defer f.root.mu.Unlock()
	var out []string
	for n := range f.root.blobs {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

type rootNode struct {
	fs.Inode
	mu    sync.Mutex
	blobs map[string]*blobNode
}

var _ = (fs.NodeLookuper)((*rootNode)(nil))
var _ = (fs.NodeReaddirer)((*rootNode)(nil))

func (r *rootNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	r.mu.Lock()
	b := r.blobs[name]
	r.mu.Unlock()
	if b == nil {
		return nil, syscall.ENOENT
	}
	b.attr(&out.Attr)
	return r.NewInode(ctx, b, fs.StableAttr{Mode: fuse.S_IFREG}), 0
}

func (r *rootNode) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ents []fuse.DirEntry
	for n := range r.blobs {
		ents = append(ents, fuse.DirEntry{Name: n, Mode: fuse.S_IFREG})
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name < ents[j].Name })
	return fs.NewListDirStream(ents), 0
}

// blobNode is one blob's file.
type blobNode struct {
	fs.Inode
	name  string
	desc  Blob
	src   atomic.Pointer[source]
	log   *slog.Logger
	opens *openCount // the file system's

	data, marks *os.File
	lru         *lru
	// evictMu: a read holds it (shared) from its chunks' check to its
	// copy, an eviction (exclusive) while it drops a chunk, so no read
	// copies a chunk being dropped.
	evictMu sync.RWMutex

	mu       sync.Mutex
	present  []bool
	inflight map[int]*fetch
	closed   bool

	hits, fetches, fetched, failed atomic.Int64
}

// source boxes a blob's Source (which Add may replace).
type source struct{ Source }

// fetch is a chunk being fetched; err is set when done closes.
type fetch struct {
	done chan struct{}
	err  error
}

var _ = (fs.NodeGetattrer)((*blobNode)(nil))
var _ = (fs.NodeOpener)((*blobNode)(nil))
var _ = (fs.NodeReader)((*blobNode)(nil))
var _ = (fs.NodeReleaser)((*blobNode)(nil))

func (b *blobNode) attr(a *fuse.Attr) {
	a.Mode = fuse.S_IFREG | 0o444
	a.Size = uint64(b.desc.Size)
	a.Blocks = (a.Size + 511) / 512
}

func (b *blobNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	b.attr(&out.Attr)
	return 0
}

func (b *blobNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0 {
		return nil, 0, syscall.EROFS
	}
	b.opens.add(1)
	// A handle, so that the file's release reaches Release (with none,
	// the bridge keeps no entry for it and drops the release).
	return &openBlob{}, fuse.FOPEN_KEEP_CACHE, 0
}

// openBlob is an open blob file's handle (reads go to the blob's node).
type openBlob struct{ _ byte }

func (b *blobNode) Release(ctx context.Context, fh fs.FileHandle) syscall.Errno {
	b.opens.add(-1)
	return 0
}

func (b *blobNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if off >= b.desc.Size {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), b.desc.Size)
	b.evictMu.RLock()
	defer b.evictMu.RUnlock()
	for c := int(off / b.desc.Chunk); int64(c)*b.desc.Chunk < end; c++ {
		if err := b.ensure(ctx, c); err != nil {
			b.log.Warn("a layer's data cannot be read", slog.String("blob", b.name), slog.Int("chunk", c), slog.Any("error", err))
			return nil, syscall.EIO
		}
	}
	n, err := b.data.ReadAt(dest[:end-off], off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:n]), 0
}

// ensure makes chunk c present in the cache, fetching it once however
// many reads want it at once.
func (b *blobNode) ensure(ctx context.Context, c int) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return errors.New("the blob is no longer served")
	}
	if b.present[c] {
		b.mu.Unlock()
		b.hits.Add(1)
		b.lru.touch(b, c)
		return nil
	}
	f := b.inflight[c]
	if f == nil {
		f = &fetch{done: make(chan struct{})}
		b.inflight[c] = f
		go b.fetch(c, f)
	}
	b.mu.Unlock()
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// fetch fetches chunk c into the cache, checks it and marks it present.
func (b *blobNode) fetch(c int, f *fetch) {
	off := int64(c) * b.desc.Chunk
	size := min(b.desc.Chunk, b.desc.Size-off)
	err := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		buf := make([]byte, size)
		n, err := b.src.Load().ReadAt(ctx, buf, off)
		if err != nil {
			return err
		}
		if int64(n) != size {
			return fmt.Errorf("chunk %d: %d bytes of %d", c, n, size)
		}
		sum := sha256.Sum256(buf)
		if got := hex.EncodeToString(sum[:]); got != b.desc.Digest[c] {
			return fmt.Errorf("chunk %d: digest %s, want %s", c, got[:12], b.desc.Digest[c][:12])
		}
		if _, err := b.data.WriteAt(buf, off); err != nil {
			return err
		}
		if err := b.data.Sync(); err != nil {
			return err
		}
		b.fetched.Add(size)
		_, err = b.marks.WriteAt([]byte{1}, int64(c))
		return err
	}()
	b.fetches.Add(1)
	if err != nil {
		b.failed.Add(1)
	}
	b.mu.Lock()
	delete(b.inflight, c)
	if err == nil {
		b.present[c] = true
	}
	b.mu.Unlock()
	if err == nil {
		b.lru.add(b, c) // counted before its readers go on
	}
	f.err = err
	close(f.done)
}

func (b *blobNode) stats() Stats {
	b.mu.Lock()
	cached := 0
	for _, p := range b.present {
		if p {
			cached++
		}
	}
	b.mu.Unlock()
	return Stats{Chunks: len(b.present), Cached: cached, Hits: b.hits.Load(), Fetches: b.fetches.Load(),
		FetchedBytes: b.fetched.Load(), Failed: b.failed.Load()}
}

func (b *blobNode) close() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.data.Close()
	b.marks.Close()
}

// lru orders the cached chunks of every blob by their last read, and keeps
// their bytes within the budget: a goroutine of its own drops chunks when
// an add takes the cache over it.
type lru struct {
	mu      sync.Mutex
	budget  int64
	used    int64
	evicted int64
	order   *list.List // of chunkRef, most recently read first
	at      map[chunkRef]*list.Element
	pinned  func(name string) bool
	log     *slog.Logger
	warned  time.Time
	kick    chan struct{}
	stop    chan struct{}

	evicting sync.Mutex
}

type chunkRef struct {
	b *blobNode
	c int
}

func newLRU(opts Options, log *slog.Logger) *lru {
	l := &lru{budget: opts.Budget, order: list.New(), at: map[chunkRef]*list.Element{}, pinned: opts.Pinned, log: log,
		kick: make(chan struct{}, 1), stop: make(chan struct{})}
	go func() {
		for {
			select {
			case <-l.kick:
				l.evict(-1)
			case <-l.stop:
				return
			}
		}
	}()
	return l
}

func (l *lru) close() { close(l.stop) }

func (b *blobNode) chunkSize(c int) int64 {
	return min(b.desc.Chunk, b.desc.Size-int64(c)*b.desc.Chunk)
}

// add counts chunk c of b as cached and most recently read (least
// recently, for chunks found in the cache at Add: see there).
func (l *lru) add(b *blobNode, c int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ref := chunkRef{b, c}
	if e, ok := l.at[ref]; ok {
		l.order.MoveToFront(e)
		return
	}
	l.at[ref] = l.order.PushFront(ref)
	l.used += b.chunkSize(c)
	if l.budget > 0 && l.used > l.budget {
		select {
		case l.kick <- struct{}{}:
		default:
		}
	}
}

// touch marks chunk c of b most recently read.
func (l *lru) touch(b *blobNode, c int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e, ok := l.at[chunkRef{b, c}]; ok {
		l.order.MoveToFront(e)
	}
}

// forget drops b's chunks from the order (b is no longer served).
func (l *lru) forget(b *blobNode) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for ref, e := range l.at {
		if ref.b == b {
			l.order.Remove(e)
			delete(l.at, ref)
			l.used -= b.chunkSize(ref.c)
		}
	}
}

// evict drops the least recently read chunks of unpinned blobs until the
// cache holds at most limit bytes (limit < 0: its budget) and returns the
// bytes dropped. What cannot be dropped (every chunk left is a pinned
// blob's) stays, with a warning when over the budget. The chunk is taken
// out of the order first and dropped without the order's lock: a drop
// waits for the reads of its blob in flight, which may be touching the
// order.
func (l *lru) evict(limit int64) (dropped int64) {
	l.evicting.Lock() // one at a time: Trim returns once the goroutine's drops are done
	defer l.evicting.Unlock()
	pinned := map[string]bool{} // asked once per blob and round
	isPinned := func(name string) bool {
		p, ok := pinned[name]
		if !ok {
			p = l.pinned != nil && l.pinned(name)
			pinned[name] = p
		}
		return p
	}
	for {
		l.mu.Lock()
		to := limit
		if to < 0 {
			to = l.budget
			if to <= 0 {
				to = l.used
			}
		}
		if l.used <= to {
			l.mu.Unlock()
			return dropped
		}
		var victim *list.Element
		for e := l.order.Back(); e != nil; e = e.Prev() {
			if ref := e.Value.(chunkRef); !isPinned(ref.b.name) {
				victim = e
				break
			}
		}
		if victim == nil {
			if l.budget > 0 && l.used > l.budget && time.Since(l.warned) > time.Minute {
				l.warned = time.Now()
				l.log.Warn("the layer chunk cache is over its budget: what it holds is running sandboxes' layers",
					slog.Int64("used", l.used), slog.Int64("budget", l.budget))
			}
			l.mu.Unlock()
			return dropped
		}
		ref := victim.Value.(chunkRef)
		size := ref.b.chunkSize(ref.c)
		l.order.Remove(victim)
		delete(l.at, ref)
		l.used -= size
		l.mu.Unlock()
		if ref.b.drop(ref.c) {
			l.mu.Lock()
			l.evicted += size
			l.mu.Unlock()
			dropped += size
		}
	}
}

// drop removes chunk c from the cache (its mark first, then its bytes)
// once no read of the blob is copying (a read may be copying c), unless
// it is not cached (any more) or being fetched again (the fetch counts it
// when it lands).
func (b *blobNode) drop(c int) bool {
	b.evictMu.Lock()
	defer b.evictMu.Unlock()
	b.mu.Lock()
	if b.closed || !b.present[c] || b.inflight[c] != nil {
		b.mu.Unlock()
		return false
	}
	b.present[c] = false
	b.mu.Unlock()
	b.marks.WriteAt([]byte{0}, int64(c))
	off := int64(c) * b.desc.Chunk
	unix.Fallocate(int(b.data.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, b.chunkSize(c))
	return true
}
