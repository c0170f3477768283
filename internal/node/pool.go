package node

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/gateway"
	"github.com/opendsec/dsec/internal/tenant"
)

// PoolConfig is a warm pool: Size sandboxes of one shape kept started, so
// a create of that shape returns at once. The environment, labels, user,
// working directory and TTL of a create apply to a pooled sandbox when it
// is handed out; the shape (kind, image, resources, network mode) must
// match. A create's network policy is put in force at hand-out.
type PoolConfig struct {
	Kind     string  `json:"kind,omitempty"` // default container
	Image    string  `json:"image"`
	CPU      float64 `json:"cpu,omitempty"`
	MemoryMB int64   `json:"memory_mb,omitempty"`
	Pids     int64   `json:"pids,omitempty"`
	DiskMB   int64   `json:"disk_mb,omitempty"`
	Network  string  `json:"network,omitempty"`
	Runtime  string  `json:"runtime,omitempty"` // default: the kind's
	Size     int     `json:"size"`
}

// refillQuiet is how long takes from a pool at least half full must pause
// before it refills.
const refillQuiet = 50 * time.Millisecond

// pools holds the node's warm pools.
type pools struct {
	n     *Node
	byKey map[string]*pool
	stop  chan struct{}
	wg    sync.WaitGroup
}

type pool struct {
	key  string
	spec *dsecv1.SandboxSpec // normalized template
	size int

	hits, misses atomic.Int64
	lastTake     atomic.Int64 // unix nanoseconds

	mu    sync.Mutex
	ready []*sandbox
	kick  chan struct{}
}

// shapeKey identifies the shape of a normalized spec.
func shapeKey(spec *dsecv1.SandboxSpec) string {
	r := spec.Resources
	return fmt.Sprintf("%s|%s|cpu=%g|mem=%d|pids=%d|disk=%d|net=%s|bw=%d|rt=%s", spec.Kind, imageOf(spec), r.GetCpu(), r.GetMemoryMb(), r.GetPids(), r.GetDiskMb(), spec.Network.GetMode(), r.GetBandwidthMbps(), spec.Runtime)
}

func newPools(n *Node, cfgs []PoolConfig) *pools {
	ps := &pools{n: n, byKey: map[string]*pool{}, stop: make(chan struct{})}
	for _, c := range cfgs {
		spec := &dsecv1.SandboxSpec{
			Kind: c.Kind, Image: c.Image, TtlS: int64(n.cfg.MaxTTL / time.Second),
			Resources: &dsecv1.Resources{Cpu: c.CPU, MemoryMb: c.MemoryMB, Pids: c.Pids, DiskMb: c.DiskMB},
			Network:   &dsecv1.Network{Mode: c.Network}, Runtime: c.Runtime,
		}
		if _, err := n.normalize(tenant.Shared, spec); err != nil && !errdefs.Is(err, errdefs.KindNotFound) {
			n.log.Error("warm pool not started", slog.String("image", c.Image), slog.Any("error", err))
			continue
		}
		// A missing image (not bootstrapped yet) is retried by fill.
		p := &pool{key: shapeKey(spec), spec: spec, size: max(c.Size, 0), kick: make(chan struct{}, 1)}
		ps.byKey[p.key] = p
		ps.wg.Add(1)
		go ps.fill(p)
	}
	return ps
}

// fill keeps a pool at its size.
func (ps *pools) fill(p *pool) {
	defer ps.wg.Done()
	n := ps.n
	backoff := time.Second
	for {
		p.mu.Lock()
		missing := p.size - len(p.ready)
		p.mu.Unlock()
		if missing <= 0 {
			select {
			case <-p.kick:
				continue
			case <-ps.stop:
				return
			}
		}
		// A start costs ~15 ms of CPU; running it beside the creates the
		// pool serves slows them. While the pool holds half its size or
		// more, the refill waits for takes to pause.
		if 2*(p.size-missing) >= p.size {
			if wait := time.Until(time.Unix(0, p.lastTake.Load()).Add(refillQuiet)); wait > 0 {
				select {
				case <-time.After(wait):
					continue
				case <-ps.stop:
					return
				}
			}
		}
		release, err := n.starts.acquire(context.Background(), "_pool")
		if err != nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		spec := proto.Clone(p.spec).(*dsecv1.SandboxSpec)
		img, err := n.normalize(tenant.Shared, spec)
		var s *sandbox
		if err == nil {
			s, err = n.prepare(ctx, spec, img, tenant.Shared)
		}
		cancel()
		release()
		if err != nil {
			level := slog.LevelWarn
			if errdefs.Is(err, errdefs.KindNotFound) {
				level = slog.LevelDebug // the image is not imported yet
			}
			n.log.Log(context.Background(), level, "warm pool fill failed", slog.String("pool", p.key), slog.Any("error", err))
			select {
			case <-time.After(backoff):
				backoff = min(2*backoff, time.Minute)
				continue
			case <-ps.stop:
				return
			}
		}
		backoff = time.Second
		p.mu.Lock()
		p.ready = append(p.ready, s)
		p.mu.Unlock()
		select {
		case <-ps.stop:
			return
		default:
		}
	}
}

// take hands out a pooled sandbox of spec's shape, personalized for spec,
// or nil if none is ready.
func (ps *pools) take(spec *dsecv1.SandboxSpec, project string) *sandbox {
	if ps == nil {
		return nil
	}
	n := ps.n
	p := ps.byKey[shapeKey(spec)]
	if p == nil {
		return nil
	}
	for {
		p.mu.Lock()
		if len(p.ready) == 0 {
			p.mu.Unlock()
			p.misses.Add(1)
			n.m.PoolClaim(spec.GetKind(), false)
			return nil
		}
		s := p.ready[0]
		p.ready = p.ready[1:]
		p.mu.Unlock()
		p.lastTake.Store(time.Now().UnixNano())
		select {
		case p.kick <- struct{}{}:
		default:
		}
		if s.inst.Check(context.Background()) != nil {
			// Died while pooled: discard and try the next one.
			n.release(context.Background(), s, nil)
			continue
		}
		if err := ps.personalize(s, spec, project); err != nil {
			n.log.Warn("pooled sandbox unusable", slog.String("sandbox_id", s.id), slog.Any("error", err))
			continue
		}
		p.hits.Add(1)
		n.m.PoolClaim(spec.GetKind(), true)
		return s
	}
}

// personalize gives a pooled sandbox the parts of spec that are not its
// shape.
func (ps *pools) personalize(s *sandbox, spec *dsecv1.SandboxSpec, project string) error {
	n := ps.n
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if p := spec.Network.GetPolicy(); p != nil {
		pol, err := n.policyOf(project, p)
		if err == nil {
			err = n.net.SetPolicy(s.net, pol)
		}
		if err != nil {
			n.release(context.Background(), s, nil)
			return err
		}
	}
	s.spec = spec
	s.created = time.Now().UTC()
	s.expires = s.created.Add(time.Duration(spec.TtlS) * time.Second)
	s.touch()
	g := s.inst.Guest()
	if len(spec.Env) > 0 || spec.GetModelGateway().GetEnabled() {
		env := make([]string, 0, len(spec.Env))
		for k, v := range spec.Env {
			env = append(env, k+"="+v)
		}
		sort.Strings(env)
		if spec.GetModelGateway().GetEnabled() {
			// Before the spec's own: a process sees the spec's where both
			// set one.
			env = append(append([]string(nil), gateway.Env...), env...)
		}
		if err := g.SetEnv(ctx, env); err != nil {
			n.release(context.Background(), s, nil)
			return errdefs.Unavailable("prepare pooled sandbox: %v", err)
		}
	}
	if err := g.SetDeadline(ctx, n.deadline(s)); err != nil {
		n.release(context.Background(), s, nil)
		return errdefs.Unavailable("prepare pooled sandbox: %v", err)
	}
	return nil
}

// close stops refilling and destroys pooled sandboxes.
func (ps *pools) close() {
	if ps == nil {
		return
	}
	close(ps.stop)
	ps.wg.Wait()
	for _, p := range ps.byKey {
		p.mu.Lock()
		ready := p.ready
		p.ready = nil
		p.mu.Unlock()
		for _, s := range ready {
			ps.n.release(context.Background(), s, nil)
		}
	}
}

// readyByKind counts the pools' ready sandboxes by kind.
func (ps *pools) readyByKind() map[string]int {
	out := map[string]int{}
	if ps == nil {
		return out
	}
	for _, p := range ps.byKey {
		p.mu.Lock()
		out[p.spec.GetKind()] += len(p.ready)
		p.mu.Unlock()
	}
	return out
}

func (ps *pools) stats() []*dsecv1.PoolStats {
	if ps == nil {
		return nil
	}
	var out []*dsecv1.PoolStats
	for _, p := range ps.byKey {
		p.mu.Lock()
		ready := len(p.ready)
		p.mu.Unlock()
		out = append(out, &dsecv1.PoolStats{Key: p.key, Ready: int32(ready), Target: int32(p.size), Hits: p.hits.Load(), Misses: p.misses.Load()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}
