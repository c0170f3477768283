package cluster_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/cluster/clustertest"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/errdefs"
)

// The control plane alone, against a real etcd: simulated nodes stand in
// for node agents (test/cluster runs the real ones).

const token = "router-test-token"

// nodeTTL is the simulated nodes' lease TTL.
const nodeTTL = 15 * time.Second

type env struct {
	t     testing.TB
	etcd  *dsectest.Etcd
	store *cluster.Store
	nodes map[string]*clustertest.Node
}

func newEnv(t testing.TB) *env {
	e := &env{t: t, etcd: dsectest.StartEtcd(t), nodes: map[string]*clustertest.Node{}}
	s, err := cluster.Open(cluster.Config{Endpoints: []string{e.etcd.URL}, Timeout: 2 * time.Second}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	e.store = s
	return e
}

func (e *env) node(cfg clustertest.Config) *clustertest.Node {
	// A lease long enough to outlive etcd's stalls on a loaded host (a 2 s
	// lease lapsed under CI's load and every placement said "no lease"):
	// these tests end nodes by closing them, which revokes the lease.
	cfg.Token, cfg.TTL, cfg.Interval = token, nodeTTL, 50*time.Millisecond
	n, err := clustertest.Start(e.store, cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(n.Close)
	e.nodes[cfg.Name] = n
	return n
}

// router starts a replica's view and router and waits until it sees n
// live nodes.
func (e *env) router(n int) *cluster.Router {
	r, _ := e.replica(n)
	return r
}

// replica starts a replica — its view, router and registration — and
// waits until it joined and sees n live nodes.
func (e *env) replica(n int) (*cluster.Router, *cluster.State) {
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	quiet := slog.New(slog.DiscardHandler)
	st, err := e.store.NewState(nil, nil, true, quiet)
	if err != nil {
		e.t.Fatal(err)
	}
	// The router comes after the view's first read, as it can in dsec api
	// (which starts the view first): it must learn the nodes read before
	// it listened.
	go st.Run(ctx)
	select {
	case <-st.Synced():
	case <-time.After(15 * time.Second):
		e.t.Fatal("the replica's view did not read the cluster state")
	}
	r := cluster.NewRouter(cluster.RouterConfig{Token: token}, st, quiet)
	go e.store.RunReplica(ctx, cluster.NewReplicaID(), "", st, quiet)
	select {
	case <-st.Joined():
	case <-time.After(15 * time.Second):
		e.t.Fatal("the replica did not join")
	}
	waitFor(e.t, fmt.Sprintf("%d live nodes", n), func() error {
		nodes := r.Nodes(ctx)
		if got := len(nodes); got != n {
			return fmt.Errorf("%d live nodes", got)
		}
		// Known is not placeable: a node's lease is its own key, which can
		// reach the view after its registration (placement says "no lease").
		for _, rn := range nodes {
			if ns := st.Node(rn.Name()); ns == nil || ns.Load == nil {
				return fmt.Errorf("node %s has no lease yet", rn.Name())
			}
		}
		return nil
	})
	return r, st
}

func waitFor(t testing.TB, what string, f func() error) {
	t.Helper()
	waitWithin(t, 15*time.Second, what, f)
}

// waitWithin waits as waitFor does, up to d.
func waitWithin(t testing.TB, d time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func spec(image string) *dsecv1.SandboxSpec { return &dsecv1.SandboxSpec{Image: image} }

func TestRouterPlacesAroundRefusals(t *testing.T) {
	e := newEnv(t)
	e.node(clustertest.Config{Name: "a"})
	e.node(clustertest.Config{Name: "b"})
	e.node(clustertest.Config{Name: "c", Images: []string{"busybox", "debian"}, Labels: map[string]string{"gpu": "yes"}})
	r := e.router(3)
	ctx := context.Background()

	t.Run("a refusing node's sandboxes go to the others", func(t *testing.T) {
		e.nodes["a"].Refuse(errdefs.Exhausted(time.Second, "node a is full"))
		defer e.nodes["a"].Refuse(nil)
		resp := r.CreateMany(ctx, []*dsecv1.SandboxSpec{spec("busybox"), spec("busybox"), spec("busybox"), spec("busybox"), spec("busybox"), spec("busybox")}, nil, "p")
		if resp.Created != 6 {
			t.Fatalf("created %d of 6: %v", resp.Created, resp.Results)
		}
		for _, res := range resp.Results {
			if res.Sandbox.Node == "a" {
				t.Fatalf("placed on the refusing node: %v", res.Sandbox.Id)
			}
		}
	})

	t.Run("when every node refuses the error says why, node by node", func(t *testing.T) {
		for _, name := range []string{"a", "b", "c"} {
			e.nodes[name].Refuse(errdefs.Exhausted(time.Second, "node %s is full", name))
		}
		defer func() {
			for _, n := range e.nodes {
				n.Refuse(nil)
			}
		}()
		_, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("busybox"), Project: "p"})
		if !errdefs.Is(err, errdefs.KindExhausted) || !errdefs.IsInfra(err) {
			t.Fatalf("error %v, want exhausted (infra)", err)
		}
		for _, name := range []string{"a", "b", "c"} {
			if !strings.Contains(err.Error(), name+": refused: node "+name+" is full") {
				t.Errorf("error %q does not say why %s refused", err, name)
			}
		}
	})

	t.Run("an image and a node selector only one node has go there", func(t *testing.T) {
		for range 5 {
			sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("debian"), Project: "p"})
			if err != nil || sb.Node != "c" {
				t.Fatalf("debian: %v, %v", sb, err)
			}
			sp := spec("busybox")
			sp.NodeSelector = map[string]string{"gpu": "yes"}
			sb, err = r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: sp, Project: "p"})
			if err != nil || sb.Node != "c" {
				t.Fatalf("gpu=yes: %v, %v", sb, err)
			}
		}
		_, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("ubuntu"), Project: "p"})
		if !errdefs.Is(err, errdefs.KindNotFound) || !strings.Contains(err.Error(), "no image ubuntu") {
			t.Fatalf("an image no node has: %v", err)
		}
	})

	t.Run("IDs of unknown nodes and forged IDs get clear errors", func(t *testing.T) {
		_, err := r.ForSandbox(ctx, "aaaaaaaaaaaaaaaa-zz")
		if !errdefs.Is(err, errdefs.KindNotFound) || !strings.Contains(err.Error(), `no node "zz" in this cluster`) {
			t.Errorf("unknown node: %v", err)
		}
		for _, id := range []string{"", "x", "aaaaaaaaaaaaaaaa-", "AAAAAAAAAAAAAAAA-a", "aaaaaaaaaaaaaaaa-a/../b"} {
			if _, err := r.ForSandbox(ctx, id); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Errorf("forged id %q: %v", id, err)
			}
		}
	})

	t.Run("a retried keyed batch goes to the same nodes through another replica", func(t *testing.T) {
		r2 := e.router(3)
		specs := []*dsecv1.SandboxSpec{spec("busybox"), spec("busybox"), spec("busybox"), spec("busybox")}
		keys := []string{"k/0", "k/1", "k/2", "k/3"}
		first := r.CreateMany(ctx, specs, keys, "p")
		again := r2.CreateMany(ctx, specs, keys, "p")
		for i := range specs {
			if first.Results[i].Sandbox.GetId() == "" || first.Results[i].Sandbox.GetId() != again.Results[i].Sandbox.GetId() {
				t.Fatalf("item %d: %v then %v", i, first.Results[i], again.Results[i])
			}
		}
		other := r2.CreateMany(ctx, specs[:2], keys[:2], "p")
		if other.Failed != 2 || !strings.Contains(other.Results[0].Error.GetMessage(), "was used for a create of 4") {
			t.Fatalf("the key reused for another batch: %v", other.Results)
		}
	})

	t.Run("a retry that raced the first attempt's move of an item makes no duplicate", func(t *testing.T) {
		// The retry reads a claim naming a; meanwhile the first attempt,
		// refused by a, moves the item to b and creates it there.
		if err := e.store.PutClaim("p", "race", []string{"a"}); err != nil {
			t.Fatal(err)
		}
		var first *dsecv1.Sandbox
		cluster.SetAfterSend(r, func() {
			if err := e.store.PutClaim("p", "race", []string{"b"}); err != nil {
				t.Error(err)
			}
			resp, err := e.nodes["b"].CreateSandboxes(ctx, connect.NewRequest(&nodev1.CreateSandboxesRequest{Specs: []*dsecv1.SandboxSpec{spec("busybox")}, IdempotencyKeys: []string{"race"}, Project: "p"}))
			if err != nil {
				t.Error(err)
				return
			}
			first = resp.Msg.Result.Results[0].Sandbox
		})
		defer cluster.SetAfterSend(r, nil)
		onA := e.nodes["a"].Count()
		sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("busybox"), IdempotencyKey: "race", Project: "p"})
		if err != nil {
			t.Fatal(err)
		}
		if first == nil || sb.Id != first.Id {
			t.Fatalf("the retry returned %s, the first attempt made %v", sb.Id, first)
		}
		if got := e.nodes["a"].Count(); got != onA {
			t.Fatalf("node a holds %d sandboxes, %d before: the duplicate stayed", got, onA)
		}
	})

	t.Run("a lost node's sandboxes fail fast with an infra error", func(t *testing.T) {
		var id string
		for id == "" {
			sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("busybox"), Project: "p"})
			if err != nil {
				t.Fatal(err)
			}
			if sb.Node == "b" {
				id = sb.Id
			}
		}
		// Closing b revokes its lease; should the revocation fail (etcd
		// stalls on a loaded host), the lease lapses at its TTL: b is
		// lost within that, and its sandboxes' routes say so.
		e.nodes["b"].Close()
		waitWithin(t, 15*time.Second+nodeTTL, "node b lost", func() error {
			_, err := r.ForSandbox(ctx, id)
			if err == nil || !strings.Contains(err.Error(), "node b lost") || !errdefs.IsInfra(err) {
				return fmt.Errorf("route: %v", err)
			}
			return nil
		})
		for range 10 {
			sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("busybox"), Project: "p"})
			if err != nil || sb.Node == "b" {
				t.Fatalf("create with b lost: %v, %v", sb, err)
			}
		}
	})

	t.Run("with etcd down placements are refused and routing goes on", func(t *testing.T) {
		sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("busybox"), Project: "p"})
		if err != nil {
			t.Fatal(err)
		}
		e.etcd.Kill()
		defer e.etcd.Start()
		waitFor(t, "placements refused", func() error {
			_, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec("busybox"), Project: "p"})
			if !errdefs.Is(err, errdefs.KindUnavailable) || !strings.Contains(err.Error(), "etcd") {
				return fmt.Errorf("create: %v", err)
			}
			return nil
		})
		n, err := r.ForSandbox(ctx, sb.Id)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxRequest{Id: sb.Id}, apiserver.Node.GetSandbox); err != nil {
			t.Fatalf("get with etcd down: %v", err)
		}
	})
}

func TestQuotas(t *testing.T) {
	e := newEnv(t)
	e.node(clustertest.Config{Name: "a"})
	e.node(clustertest.Config{Name: "b"})
	ctx := context.Background()
	if err := e.store.PutProject(ctx, "small", cluster.Project{MaxSandboxes: 5}); err != nil {
		t.Fatal(err)
	}
	r := e.router(2)
	waitFor(t, "quota known", func() error {
		resp := r.CreateMany(ctx, []*dsecv1.SandboxSpec{spec("busybox")}, nil, "probe")
		if resp.Created != 1 {
			return fmt.Errorf("probe create failed")
		}
		return nil
	})
	specs := make([]*dsecv1.SandboxSpec, 8)
	for i := range specs {
		specs[i] = spec("busybox")
	}
	waitFor(t, "the project's quota applies", func() error {
		resp := r.CreateMany(ctx, specs, nil, "small")
		if resp.Created != 5 || resp.Failed != 3 {
			return fmt.Errorf("created %d, failed %d", resp.Created, resp.Failed)
		}
		return nil
	})
	resp := r.CreateMany(ctx, specs[:1], nil, "small")
	if resp.Failed != 1 || !strings.Contains(resp.Results[0].Error.GetMessage(), "quota of 5 sandboxes") {
		t.Fatalf("over the quota: %v", resp.Results)
	}
	if other := r.CreateMany(ctx, specs, nil, "other"); other.Created != 8 {
		t.Fatalf("a project without quotas: %d created", other.Created)
	}
}
