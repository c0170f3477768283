// Package function is the function substrate: short stateless calls ("run
// this program on these inputs") dispatched to warm pools of worker
// containers, per image. Each worker runs the runner (runner.py), a warm
// Python interpreter with common modules imported that forks call
// processes; each call gets storage of its own (a size-limited tmpfs
// holding its directory and, in a mount namespace per step, its /tmp,
// /var/tmp and /dev/shm), a uid of its own, per call CPU, wall, memory,
// process, file-size and output limits, and is wiped afterwards (every
// process of its uid killed, its storage emptied and unmounted). A worker
// that cannot be wiped with certainty is destroyed and replaced.
//
// The workers are containers made by the container driver, which this
// driver receives as a substrate.Driver.
package function

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
)

//go:embed runner.py
var runnerScript []byte

//go:embed ts.js
var tsScript []byte

const (
	runnerDir = "/run/dsec-fn/runner"
	callsDir  = "/run/dsec-fn/calls"
	uidBase   = 20000
)

// Config configures the driver. The zero value works.
type Config struct {
	// Image is the default worker image (default "debian").
	Image string
	// StateDir holds worker directories (required).
	StateDir string
	// Slots is how many calls one worker runs at once (default 4 per core).
	Slots int
	// MinWorkers (default 1) are kept per image once used; MaxWorkers
	// (default 4) bound each image's pool.
	MinWorkers, MaxWorkers int
	// WorkerCPU (default: all cores) and WorkerMemoryMB (default 4096) size
	// each worker; calls have their own, smaller limits.
	WorkerCPU      float64
	WorkerMemoryMB int64
	// IdleTimeout removes workers above MinWorkers unused this long
	// (default 2m).
	IdleTimeout time.Duration
	// QueueTimeout bounds the wait for a free slot (default 60s).
	QueueTimeout time.Duration
	// GrowAfter is how long a call waits for a slot before the pool starts
	// another worker (default 500ms). Calls that compute queue briefly and
	// more workers would not run them sooner on the same cores (and workers
	// competing for the cores stretch the tail: measured p99 708 ms with
	// four workers vs 174 ms with one, same throughput); calls that block
	// (sleep, I/O) hold slots long and make the wait grow.
	GrowAfter time.Duration
	// GPUs is how many GPUs the node has for function calls (default 0).
	GPUs int
	// CallDiskMB bounds one call's storage: its directory, /tmp, /var/tmp
	// and /dev/shm together (default 512). It is memory of the worker's
	// (tmpfs), counted against WorkerMemoryMB while used.
	CallDiskMB int64
}

// Driver runs function calls.
type Driver struct {
	cfg    Config
	log    *slog.Logger
	ct     substrate.Driver
	images *image.Store
	caps   substrate.Capabilities

	mu    sync.Mutex
	pools map[string]*pool // by image
	stop  chan struct{}
}

var _ substrate.Driver = (*Driver)(nil)

// New returns a driver over the container driver ct. Call Start once the
// node has swept leftovers.
func New(cfg Config, ct substrate.Driver, images *image.Store, log *slog.Logger, cores int) *Driver {
	if cfg.Image == "" {
		cfg.Image = "debian"
	}
	if cfg.Slots == 0 {
		cfg.Slots = 4 * cores
	}
	if cfg.MinWorkers == 0 {
		cfg.MinWorkers = 1
	}
	if cfg.MaxWorkers == 0 {
		cfg.MaxWorkers = 4
	}
	if cfg.WorkerCPU == 0 {
		cfg.WorkerCPU = float64(cores)
	}
	if cfg.WorkerMemoryMB == 0 {
		cfg.WorkerMemoryMB = 4096
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = 2 * time.Minute
	}
	if cfg.QueueTimeout == 0 {
		cfg.QueueTimeout = time.Minute
	}
	if cfg.GrowAfter == 0 {
		cfg.GrowAfter = 500 * time.Millisecond
	}
	if cfg.CallDiskMB == 0 {
		cfg.CallDiskMB = 512
	}
	d := &Driver{cfg: cfg, log: log, ct: ct, images: images, pools: map[string]*pool{}, stop: make(chan struct{})}
	cc := ct.Capabilities()
	d.caps = substrate.Capabilities{Kind: substrate.KindFunction, Available: cc.Available, Reason: cc.Reason,
		Caps:    []substrate.Capability{substrate.CapExec},
		Details: map[string]string{"image": cfg.Image, "slots_per_worker": fmt.Sprint(cfg.Slots), "isolation": "per-call storage (tmpfs; private /tmp, /var/tmp, /dev/shm) and uid, rlimits, worker container"}}
	if cfg.GPUs > 0 {
		d.caps.Caps = append(d.caps.Caps, substrate.CapGPU)
	}
	if !cc.Available {
		d.caps.Reason = "function workers are containers: " + cc.Reason
	}
	return d
}

// Capabilities implements substrate.Driver. Its details list the
// languages the default image's workers run ("languages"), once one of
// them has started, and those no image of this build can run
// ("languages_unavailable").
func (d *Driver) Capabilities() substrate.Capabilities {
	c := d.caps
	c.Details = maps.Clone(c.Details)
	if ls := d.KnownLanguages(); ls != nil {
		c.Details["languages"] = strings.Join(ls, " ")
	} else {
		c.Details["languages"] = "(known once a worker of " + d.cfg.Image + " has started)"
	}
	var none []string
	for _, l := range languages {
		if l.missing != "" {
			none = append(none, l.name)
		}
	}
	c.Details["languages_unavailable"] = strings.Join(none, " ")
	return c
}

// Start prewarms the default image's pool in the background.
func (d *Driver) Start() {
	if !d.caps.Available {
		return
	}
	go func() {
		// The default image may still be bootstrapping: wait for it.
		for i := 0; i < 600; i++ {
			if _, err := d.images.Get(d.cfg.Image); err == nil {
				d.poolFor(d.cfg.Image).ensure()
				return
			}
			select {
			case <-d.stop:
				return
			case <-time.After(time.Second):
			}
		}
	}()
	go d.janitor()
}

// BuiltOn implements substrate.BuiltOn: workers are containers.
func (d *Driver) BuiltOn() substrate.Kind { return substrate.KindContainer }

// Close destroys every worker, those still starting too. It is
// idempotent.
func (d *Driver) Close() {
	select {
	case <-d.stop:
		return
	default:
	}
	close(d.stop)
	d.mu.Lock()
	pools := d.pools
	d.pools = map[string]*pool{}
	d.mu.Unlock()
	for _, p := range pools {
		p.close()
	}
}

func (d *Driver) poolFor(img string) *pool {
	d.mu.Lock()
	defer d.mu.Unlock()
	p := d.pools[img]
	if p == nil {
		p = &pool{d: d, image: img}
		d.pools[img] = p
	}
	return p
}

// janitor removes idle workers above the minimum.
func (d *Driver) janitor() {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
			d.mu.Lock()
			var ps []*pool
			for _, p := range d.pools {
				ps = append(ps, p)
			}
			d.mu.Unlock()
			for _, p := range ps {
				p.shrink()
			}
		}
	}
}

// pool is the workers of one image. Free slots go to waiting calls in
// arrival order: a call that arrives while others wait queues behind them,
// so no call is starved by later ones (the tail latency of a batch is the
// straggler a trainer waits for).
type pool struct {
	d     *Driver
	image string

	mu       sync.Mutex
	workers  []*worker
	starting int
	waiters  []chan grant // FIFO
	closed   bool
	starts   sync.WaitGroup // workers starting, for close
}

// grant is a slot handed to a waiting call, or the error that ends its wait.
type grant struct {
	w    *worker
	slot int
	err  error
}

type worker struct {
	id    string
	dir   string
	inst  substrate.Instance
	agent workerAgent     // inst's
	have  map[string]bool // the programs the image has (probeScript)
	ooms  atomic.Int64    // the worker's OOM kills seen so far

	// Guarded by the pool's mu.
	slots    []bool // in use
	lastUsed time.Time
	dead     bool
}

// oomSince reports whether the worker's memory limit killed a process
// since the last look; only a call with a SIGKILLed step needs to look.
func (w *worker) oomSince(out *guestv1.CallResult) bool {
	killed := false
	for _, s := range out.Steps {
		killed = killed || s.Signal == 9
	}
	if !killed {
		return false
	}
	st, err := w.inst.Stats(context.Background())
	if err != nil {
		return false
	}
	return st.OOMKills > w.ooms.Swap(st.OOMKills)
}

// ensure starts workers up to the minimum (and one more if all are busy).
func (p *pool) ensure() {
	p.mu.Lock()
	want := p.d.cfg.MinWorkers - len(p.workers) - p.starting
	p.mu.Unlock()
	for i := 0; i < want; i++ {
		p.grow()
	}
}

// grow starts one worker in the background, unless the pool is full.
func (p *pool) grow() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.growLocked()
}

func (p *pool) growLocked() {
	if p.closed || len(p.workers)+p.starting >= p.d.cfg.MaxWorkers {
		return
	}
	p.starting++
	p.starts.Add(1)
	go func() {
		defer p.starts.Done()
		w, err := p.d.startWorker(p.image)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.starting--
		if err == nil && p.closed {
			// The driver closed while the worker started.
			p.d.destroyWorker(w)
			return
		}
		if err != nil {
			p.d.log.Warn("function worker failed to start", slog.String("image", p.image), slog.Any("error", err))
			if len(p.workers) == 0 && p.starting == 0 {
				// Nothing will free a slot: tell the waiters why.
				for _, ch := range p.waiters {
					ch <- grant{err: errdefs.Unavailable("function workers for %s cannot start: %v", p.image, err)}
				}
				p.waiters = nil
			}
			return
		}
		p.workers = append(p.workers, w)
		for slot := range w.slots {
			if len(p.waiters) == 0 {
				break
			}
			w.slots[slot] = true
			p.handLocked(w, slot)
		}
	}()
}

// handLocked gives a taken slot to the longest waiting call.
func (p *pool) handLocked(w *worker, slot int) {
	ch := p.waiters[0]
	p.waiters = p.waiters[1:]
	w.lastUsed = time.Now()
	ch <- grant{w: w, slot: slot}
}

// acquire takes a free slot, or queues for one behind the calls already
// waiting. The pool grows when nothing would free a slot, or when the call
// has waited GrowAfter.
func (p *pool) acquire(ctx context.Context) (*worker, int, error) {
	p.mu.Lock()
	if len(p.waiters) == 0 {
		if w, slot := p.takeLocked(); w != nil {
			p.mu.Unlock()
			return w, slot, nil
		}
	}
	ch := make(chan grant, 1)
	p.waiters = append(p.waiters, ch)
	if len(p.workers)+p.starting == 0 {
		p.growLocked()
	}
	p.mu.Unlock()

	deadline := time.NewTimer(p.d.cfg.QueueTimeout)
	defer deadline.Stop()
	grow := time.NewTimer(p.d.cfg.GrowAfter)
	defer grow.Stop()
	var err error
	for err == nil {
		select {
		case g := <-ch:
			return g.w, g.slot, g.err
		case <-grow.C:
			p.grow()
		case <-ctx.Done():
			err = errdefs.Classify(ctx.Err())
		case <-deadline.C:
			err = errdefs.Exhausted(time.Second, "no function slot free within %s", p.d.cfg.QueueTimeout)
		}
	}
	p.mu.Lock()
	for i, x := range p.waiters {
		if x == ch {
			p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
			p.mu.Unlock()
			return nil, 0, err
		}
	}
	p.mu.Unlock()
	// A slot was handed over as the wait ended: pass it on.
	if g := <-ch; g.w != nil {
		p.release(g.w, g.slot, "")
	}
	return nil, 0, err
}

// takeLocked returns a worker with a free slot, preferring the busiest (to
// let idle ones go), or nil.
func (p *pool) takeLocked() (*worker, int) {
	var best *worker
	bestSlot, bestBusy := -1, -1
	for _, w := range p.workers {
		if w.dead {
			continue
		}
		busy, free := 0, -1
		for i, used := range w.slots {
			if used {
				busy++
			} else if free < 0 {
				free = i
			}
		}
		if free >= 0 && busy > bestBusy {
			best, bestSlot, bestBusy = w, free, busy
		}
	}
	if best == nil {
		return nil, -1
	}
	best.slots[bestSlot] = true
	best.lastUsed = time.Now()
	return best, bestSlot
}

// release frees a slot, handing it to the longest waiting call; a dirty
// worker is destroyed and replaced.
func (p *pool) release(w *worker, slot int, dirty string) {
	p.mu.Lock()
	if dirty != "" && !w.dead {
		w.dead = true
		w.slots[slot] = false
		p.removeLocked(w)
		p.growLocked()
		p.mu.Unlock()
		p.d.log.Warn("function worker replaced: it could not be cleaned", slog.String("worker", w.id), slog.String("reason", dirty))
		return
	}
	if !w.dead && len(p.waiters) > 0 {
		p.handLocked(w, slot) // the slot stays taken, by the waiter now
	} else {
		w.slots[slot] = false
	}
	p.mu.Unlock()
}

func (p *pool) removeLocked(w *worker) {
	for i, x := range p.workers {
		if x == w {
			p.workers = append(p.workers[:i], p.workers[i+1:]...)
			break
		}
	}
	go p.d.destroyWorker(w)
}

// shrink removes idle workers above the minimum.
func (p *pool) shrink() {
	p.mu.Lock()
	var idle []*worker
	keep := len(p.workers)
	for _, w := range p.workers {
		busy := false
		for _, u := range w.slots {
			busy = busy || u
		}
		if !busy && !w.dead && keep > p.d.cfg.MinWorkers && time.Since(w.lastUsed) > p.d.cfg.IdleTimeout {
			w.dead = true
			idle = append(idle, w)
			keep--
		}
	}
	for _, w := range idle {
		p.removeLocked(w)
	}
	p.mu.Unlock()
}

func (p *pool) close() {
	p.mu.Lock()
	p.closed = true
	ws := p.workers
	p.workers = nil
	for _, ch := range p.waiters {
		ch <- grant{err: errdefs.Unavailable("the function driver is shutting down")}
	}
	p.waiters = nil
	p.mu.Unlock()
	for _, w := range ws {
		p.d.destroyWorker(w)
	}
	p.starts.Wait() // and those still starting destroy themselves
}

func (d *Driver) startWorker(img string) (_ *worker, err error) {
	rec, err := d.images.Get(img)
	if err != nil {
		return nil, err
	}
	var b [6]byte
	rand.Read(b[:])
	id := "fn-" + hex.EncodeToString(b[:])
	dir := filepath.Join(d.cfg.StateDir, "workers", id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inst, err := d.ct.Create(ctx, &substrate.Spec{
		ID: id, Dir: dir, Image: substrate.ImageOf(d.images, rec), Env: rec.Config.Env, Hostname: "function",
		CPU: d.cfg.WorkerCPU, MemoryMB: d.cfg.WorkerMemoryMB, Pids: int64(64*d.cfg.Slots + 256),
		Network: substrate.Network{Mode: "none"}, ReadOnlyRootfs: true,
		// Calls see their own storage over /tmp and /var/tmp (and /dev/shm),
		// mounted in /run/dsec-fn/calls: these hold only the runner and
		// mountpoints.
		Tmpfs: []substrate.Tmpfs{
			{Path: "/tmp", Options: "mode=1777,size=16m"},
			{Path: "/var/tmp", Options: "mode=1777,size=16m"},
			{Path: "/run/dsec-fn", Options: "mode=0711,size=16m"},
		},
		MountNamespaces: true,
	})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	agent, ok := inst.Guest().(workerAgent)
	if !ok {
		inst.Destroy(context.Background())
		os.RemoveAll(dir)
		return nil, errdefs.Internal(nil, "a function worker's agent (%T) runs no calls", inst.Guest())
	}
	w := &worker{id: id, dir: dir, inst: inst, agent: agent, slots: make([]bool, d.cfg.Slots), lastUsed: time.Now()}
	if err := d.prepareWorker(ctx, w); err != nil {
		inst.Destroy(context.Background())
		os.RemoveAll(dir)
		return nil, err
	}
	d.log.Info("function worker ready", slog.String("worker", id), slog.String("image", img), slog.Any("languages", w.languageNames()))
	return w, nil
}

// workerAgent is a worker container's agent as this driver drives it: its
// files (the runner script) and the call runner it starts and hands calls
// to, which only function workers use (the container driver's agent,
// *guest.Client, has them).
type workerAgent interface {
	substrate.Guest
	substrate.FileGuest
	StartRunner(ctx context.Context, argv, env []string) error
	Call(ctx context.Context, call *guestv1.Call) (*guestv1.CallResult, error)
}

func (d *Driver) prepareWorker(ctx context.Context, w *worker) error {
	g := w.agent
	x, err := g.Run(ctx, &guestv1.Exec{Argv: []string{"/bin/sh", "-c", "mkdir -p " + runnerDir + " " + callsDir + " " + libDir + " && chmod 700 " + runnerDir + " && chmod 711 " + callsDir + " && chmod 755 " + libDir + "; " + probeScript()}, TimeoutMs: 30000})
	if err != nil {
		return err
	}
	if x.ExitCode != 0 {
		return fmt.Errorf("prepare worker: %s", x.Stderr)
	}
	have := map[string]bool{}
	for _, b := range strings.Fields(string(x.Stdout)) {
		have[b] = true
	}
	w.have = have
	if !have["python3"] {
		return errdefs.Unavailable("function workers need python3 in their image (for the runner)")
	}
	if _, err := g.WriteFile(ctx, &guestv1.WriteFile{Path: runnerDir + "/runner.py", Mode: 0o600}, strings.NewReader(string(runnerScript))); err != nil {
		return err
	}
	// Helpers the calls run (readable by their uids).
	if _, err := g.WriteFile(ctx, &guestv1.WriteFile{Path: libDir + "/ts.js", Mode: 0o644}, strings.NewReader(string(tsScript))); err != nil {
		return err
	}
	if err := g.StartRunner(ctx, []string{"python3", "-I", runnerDir + "/runner.py"}, []string{"PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"}); err != nil {
		return err
	}
	// One call end to end (storage, namespace, uid, cleanup), so a worker
	// that cannot run calls fails here, not under every call.
	out, err := g.Call(ctx, &guestv1.Call{Dir: slotDir(0), Uid: uidBase, DiskBytes: d.cfg.CallDiskMB << 20,
		Steps: []*guestv1.CallStep{{Argv: []string{"true"}, TimeoutMs: 30000}}})
	if err != nil {
		return err
	}
	if out.Dirty || len(out.Steps) != 1 || out.Steps[0].ExitCode != 0 {
		reason := out.DirtyReason
		if reason == "" && len(out.Steps) > 0 {
			reason = out.Steps[0].Error + string(out.Steps[0].Stderr)
		}
		return errdefs.Unavailable("function worker cannot run calls: %s", reason)
	}
	return nil
}

// slotDir is where the calls of a slot keep their storage (the agent
// mounts it on the slot's first call and empties it after each).
func slotDir(slot int) string { return fmt.Sprintf("%s/s%d", callsDir, slot) }

func (d *Driver) destroyWorker(w *worker) {
	w.inst.Destroy(context.Background())
	os.RemoveAll(w.dir)
}

func (w *worker) languageNames() []string {
	var out []string
	for _, l := range languages {
		if l.lacking(w.have) == "" {
			out = append(out, l.name)
		}
	}
	return out
}
