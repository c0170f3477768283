package node

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
)

// TestRuntimes checks that a sandbox's runtime (spec.runtime) is checked
// against its kind's runtimes as the node probed them, reaches the driver,
// and is reported: in the sandbox's spec, in the node's info, in its load
// for placement, and as part of a warm pool's shape.
func TestRuntimes(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string // Spec.Runtime of each create the driver saw
	tn := newTestNode(t, func(c *Config, f *substratetest.Fake) {
		f.Runtimes = []substrate.Runtime{
			{Name: "hardened", Available: true, Caps: []substrate.Capability{substrate.CapExec, substrate.CapFiles}, Details: map[string]string{"runtime": "hardened 1"}},
			{Name: "absent", Reason: "not installed here"},
		}
		f.BeforeCreate = func(_ context.Context, s *substrate.Spec) error {
			mu.Lock()
			got = append(got, s.Runtime)
			mu.Unlock()
			return nil
		}
		c.Pools = []PoolConfig{{Image: "busybox", Runtime: "hardened", Size: 1}}
	})
	created := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
	pool := func() *dsecv1.PoolStats { return tn.Capacity(bg).Pools[0] }
	eventually(t, "the pool of the runtime fills", func() bool { return pool().Ready == 1 })

	t.Run("a create of an available runtime reaches the driver with it and the sandbox says so", func(t *testing.T) {
		sb := tn.create(bg, &dsecv1.SandboxSpec{Runtime: "hardened", Resources: &dsecv1.Resources{MemoryMb: 256}})
		if sb.Spec.Runtime != "hardened" {
			t.Fatalf("the sandbox's spec says runtime %q", sb.Spec.Runtime)
		}
		if c := created(); c[len(c)-1] != "hardened" {
			t.Fatalf("the driver got runtime %q", c[len(c)-1])
		}
		if out := tn.sh(bg, sb.Id, "echo ran"); out != "ran\n" {
			t.Fatalf("exec: %q", out)
		}
	})
	t.Run("a create of the pool's shape and runtime is served by the pool", func(t *testing.T) {
		tn.create(bg, &dsecv1.SandboxSpec{Runtime: "hardened"})
		if p := pool(); p.Hits != 1 {
			t.Fatalf("pool %+v", p)
		}
	})
	t.Run("a create of the pool's shape under the default runtime is not", func(t *testing.T) {
		eventually(t, "the pool refills", func() bool { return pool().Ready == 1 })
		before := len(created())
		sb := tn.create(bg, nil)
		if p := pool(); p.Hits != 1 {
			t.Fatalf("pool %+v", p)
		}
		if sb.Spec.Runtime != "" || created()[before] != "" {
			t.Fatalf("a default create ran under runtime %q (spec %q)", created()[before], sb.Spec.Runtime)
		}
	})
	t.Run("a runtime the kind lacks is invalid and names the ones it has", func(t *testing.T) {
		_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Runtime: "kata"}})
		if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), "hardened") {
			t.Fatalf("create: %v", err)
		}
	})
	t.Run("an unavailable runtime is unavailable with the node's reason", func(t *testing.T) {
		_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Runtime: "absent"}})
		if !errdefs.Is(err, errdefs.KindUnavailable) || !strings.Contains(err.Error(), "not installed here") {
			t.Fatalf("create: %v", err)
		}
	})
	t.Run("the node's info lists each runtime of the kind with its capabilities or reason", func(t *testing.T) {
		var kind *dsecv1.KindInfo
		for _, k := range tn.Info(bg).Kinds {
			if k.Kind == "container" {
				kind = k
			}
		}
		if kind == nil || len(kind.Runtimes) != 2 {
			t.Fatalf("container kind info %v", kind)
		}
		h, a := kind.Runtimes[0], kind.Runtimes[1]
		if h.Name != "hardened" || !h.Available || !slices.Equal(h.Capabilities, []string{"exec", "files"}) || h.Details["runtime"] != "hardened 1" {
			t.Errorf("runtime %v", h)
		}
		if a.Name != "absent" || a.Available || a.Reason != "not installed here" {
			t.Errorf("runtime %v", a)
		}
	})
	t.Run("the load lists the available runtimes as kind/runtime for placement", func(t *testing.T) {
		if k := tn.Load().Kinds; !slices.Contains(k, "container/hardened") || slices.Contains(k, "container/absent") {
			t.Fatalf("kinds %v", k)
		}
	})
}
