package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	clientv3 "go.etcd.io/etcd/client/v3"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/cluster/clustertest"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/errdefs"
)

// cutOff starts a simulated node that reaches etcd through a proxy the
// test can cut: etcd stays up for everyone else.
func (e *env) cutOff(cfg clustertest.Config) (*clustertest.Node, *dsectest.Proxy) {
	p := dsectest.StartProxy(e.t, strings.TrimPrefix(e.etcd.URL, "http://"))
	s, err := cluster.Open(cluster.Config{Endpoints: []string{p.Etcd().URL}, Timeout: 2 * time.Second}, slog.New(slog.DiscardHandler))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { s.Close() })
	cfg.Token, cfg.TTL, cfg.Interval = token, 2*time.Second, 50*time.Millisecond
	n, err := clustertest.Start(s, cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(n.Close)
	e.nodes[cfg.Name] = n
	return n, p
}

// aliveLease is the lease of node's alive entry (0 if it has none).
func (e *env) aliveLease(node string) clientv3.LeaseID {
	resp, err := e.store.Client().Get(context.Background(), "/dsec/cluster/alive/"+node)
	if err != nil || len(resp.Kvs) == 0 {
		return 0
	}
	return clientv3.LeaseID(resp.Kvs[0].Lease)
}

func onlyOn(node string) *dsecv1.SandboxSpec {
	sp := spec("busybox")
	sp.NodeSelector = map[string]string{"name": node}
	return sp
}

func TestMembershipFailsStatic(t *testing.T) {
	e := newEnv(t)
	e.node(clustertest.Config{Name: "a", Labels: map[string]string{"name": "a"}})
	c, proxy := e.cutOff(clustertest.Config{Name: "c", Labels: map[string]string{"name": "c"}})
	d, dProxy := e.cutOff(clustertest.Config{Name: "d", Labels: map[string]string{"name": "d"}})
	r := e.router(3)
	ctx := context.Background()

	t.Run("a member keeps its lease through an etcd outage longer than its TTL", func(t *testing.T) {
		before := e.aliveLease("a")
		e.etcd.Kill()
		time.Sleep(4 * time.Second) // twice the nodes' TTL
		e.etcd.Start()
		back := time.Now()
		waitFor(t, "node a is a member", func() error {
			if e.aliveLease("a") == 0 {
				return errors.New("no alive entry")
			}
			return nil
		})
		waitFor(t, "placements on a resume", func() error {
			_, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("a"), Project: "p"})
			return err
		})
		t.Logf("placements resumed %s after etcd returned; lease kept: %v", time.Since(back).Round(time.Millisecond), e.aliveLease("a") == before)
	})

	var onC string
	t.Run("a node cut off from etcd lapses: routed to while it answers, placed on never", func(t *testing.T) {
		sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("c"), Project: "p"})
		if err != nil {
			t.Fatal(err)
		}
		onC = sb.Id
		proxy.Cut()
		waitFor(t, "c's lease expires", func() error {
			if e.aliveLease("c") != 0 {
				return errors.New("c still has a lease")
			}
			return nil
		})
		// Once the replica saw the lease go (its view lags etcd: under load
		// by more than a create's round trip), c still answers.
		if err := r.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		_, err = r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("c"), Project: "p"})
		if !errdefs.Is(err, errdefs.KindUnavailable) {
			t.Fatalf("a create only c fits, with c lapsed: %v", err)
		}
		for range 3 {
			n, err := r.ForSandbox(ctx, onC)
			if err != nil {
				t.Fatalf("route to lapsed c: %v", err)
			}
			if _, err := apiserver.Do(ctx, n, &dsecv1.GetSandboxRequest{Id: onC}, apiserver.Node.GetSandbox); err != nil {
				t.Fatalf("get on lapsed c: %v", err)
			}
			if info := nodeInfo(ctx, n); info.State != "lapsed" {
				t.Fatalf("c's state %q, want lapsed", info.State)
			}
			time.Sleep(500 * time.Millisecond) // across the watchdog's probes
		}
	})

	t.Run("a lapsed node registers again as soon as it reaches etcd", func(t *testing.T) {
		proxy.Restore()
		back := time.Now()
		waitFor(t, "c takes creates again", func() error {
			_, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("c"), Project: "p"})
			return err
		})
		took := time.Since(back)
		t.Logf("c registered again and took a create %s after it reached etcd", took.Round(time.Millisecond))
		if took > 10*time.Second {
			t.Fatalf("c took %s to register again", took)
		}
	})

	t.Run("a lapsed node that stops answering is lost: calls fail at once with an infra error", func(t *testing.T) {
		proxy.Cut()
		waitFor(t, "c lapses", func() error {
			if e.aliveLease("c") != 0 {
				return errors.New("c still has a lease")
			}
			return nil
		})
		c.Close()
		waitFor(t, "c lost", func() error {
			_, err := r.ForSandbox(ctx, onC)
			if err == nil || !strings.Contains(err.Error(), "node c lost") || !errdefs.IsInfra(err) {
				return fmt.Errorf("route: %v", err)
			}
			return nil
		})
		start := time.Now()
		if _, err := r.ForSandbox(ctx, onC); err == nil || time.Since(start) > time.Second {
			t.Fatalf("a call to lost c: %v after %s", err, time.Since(start))
		}
	})

	t.Run("a lapsed node that answers nothing is lost within seconds, and a call waiting on it ends", func(t *testing.T) {
		sb, err := r.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("d"), Project: "p"})
		if err != nil {
			t.Fatal(err)
		}
		n, err := r.ForSandbox(ctx, sb.Id)
		if err != nil {
			t.Fatal(err)
		}
		dProxy.Cut()
		d.Hang(true)
		defer d.Hang(false)
		start := time.Now()
		_, err = apiserver.Do(ctx, n, &dsecv1.GetSandboxRequest{Id: sb.Id}, apiserver.Node.GetSandbox) // waits: d does not answer
		took := time.Since(start)
		if err == nil || !strings.Contains(err.Error(), "node d lost") || !errdefs.IsInfra(err) {
			t.Fatalf("a call waiting on d when it was lost: %v", err)
		}
		t.Logf("the call waiting on d ended %s after d stopped answering (lease %s, two probes)", took.Round(time.Millisecond), 2*time.Second)
		if took > 20*time.Second {
			t.Fatalf("the call waited %s", took)
		}
	})
}

func TestWritesAreReadThroughEveryReplica(t *testing.T) {
	e := newEnv(t)
	e.node(clustertest.Config{Name: "a", Labels: map[string]string{"name": "a"}})
	e.node(clustertest.Config{Name: "b", Labels: map[string]string{"name": "b"}})
	_, st1 := e.replica(2)
	r2, st2 := e.replica(2)
	ctx := context.Background()

	t.Run("a new key authenticates through every replica once added, and no longer once removed", func(t *testing.T) {
		for i := range 5 {
			key := fmt.Sprintf("a-key-of-project-q-%04d", i)
			if err := e.store.AddKey(ctx, key, "q", "", false); err != nil {
				t.Fatal(err)
			}
			for j, st := range []*cluster.State{st1, st2} {
				if c, ok := st.Caller(key); !ok || c.Project != "q" {
					t.Fatalf("replica %d right after the key was added: %v, %v", j, c, ok)
				}
			}
			if err := e.store.RemoveKey(ctx, key); err != nil {
				t.Fatal(err)
			}
			for j, st := range []*cluster.State{st1, st2} {
				if _, ok := st.Caller(key); ok {
					t.Fatalf("replica %d right after the key was removed still accepts it", j)
				}
			}
		}
	})

	t.Run("a quota applies through every replica once set", func(t *testing.T) {
		if err := e.store.PutProject(ctx, "q", cluster.Project{CreatesPerS: 0.001, Burst: 2}); err != nil {
			t.Fatal(err)
		}
		defer e.store.DeleteProject(ctx, "q")
		// Two replicas: a burst of 1 each.
		resp := r2.CreateMany(ctx, []*dsecv1.SandboxSpec{spec("busybox"), spec("busybox")}, nil, "q")
		if resp.Created != 1 || !strings.Contains(resp.Results[1].GetError().GetMessage(), "create rate quota") {
			t.Fatalf("two creates right after the quota was set: %v", resp.Results)
		}
	})

	t.Run("a drained node takes nothing, and an undrained one takes creates, right away", func(t *testing.T) {
		for range 3 {
			if err := e.store.SetDrain(ctx, "b", true); err != nil {
				t.Fatal(err)
			}
			if _, err := r2.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("b"), Project: "p"}); !errdefs.Is(err, errdefs.KindUnavailable) || !strings.Contains(err.Error(), "draining") {
				t.Fatalf("a create only b fits, right after b was drained: %v", err)
			}
			if err := e.store.SetDrain(ctx, "b", false); err != nil {
				t.Fatal(err)
			}
			if _, err := r2.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: onlyOn("b"), Project: "p"}); err != nil {
				t.Fatalf("a create only b fits, right after b was undrained: %v", err)
			}
		}
	})

	t.Run("a replica that does not acknowledge is named after the timeout", func(t *testing.T) {
		// A replica entry whose replica never watches: registered, silent.
		cli := e.store.Client()
		g, err := cli.Grant(ctx, 30)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, "/dsec/cluster/replicas/silent", `{"id":"silent","address":"10.0.0.9:7070"}`, clientv3.WithLease(g.ID)); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err = e.store.PutProject(ctx, "r", cluster.Project{MaxSandboxes: 3})
		var u *cluster.UnconfirmedError
		if !errors.As(err, &u) || len(u.Replicas) != 1 || !strings.Contains(u.Replicas[0], "silent at 10.0.0.9:7070") {
			t.Fatalf("a write with a silent replica: %v", err)
		}
		t.Logf("reported after %s: %v", time.Since(start).Round(time.Millisecond), err)
		// The live replicas did see it.
		cli.Revoke(ctx, g.ID)
		if err := e.store.DeleteProject(ctx, "r"); err != nil {
			t.Fatalf("once the silent replica's lease went: %v", err)
		}
	})
}

// What read-your-writes costs, and what the alternative would: a write
// followed by a barrier both replicas acknowledge, against the write
// alone, and against the linearizable read of etcd's revision a replica
// would need before each request if readers waited instead of writers.
func BenchmarkReadYourWrites(b *testing.B) {
	e := newEnv(b)
	e.node(clustertest.Config{Name: "a"})
	e.replica(1)
	e.replica(1)
	ctx := context.Background()
	cli := e.store.Client()
	b.Run("a project write with its sync barrier", func(b *testing.B) {
		for b.Loop() {
			if err := e.store.PutProject(ctx, "bench", cluster.Project{MaxSandboxes: 10}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("the same write without the barrier", func(b *testing.B) {
		for b.Loop() {
			if _, err := cli.Put(ctx, "/dsec/cluster/projects/bench", `{"max_sandboxes":10}`); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("a linearizable read of the revision (per request, if readers waited)", func(b *testing.B) {
		for b.Loop() {
			if _, err := cli.Get(ctx, "/dsec/cluster/sync", clientv3.WithCountOnly()); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// nodeInfo is a node's description as the replica reports it.
func nodeInfo(ctx context.Context, n apiserver.Node) *dsecv1.NodeInfo {
	resp, err := n.GetInfo(ctx, connect.NewRequest(&dsecv1.GetInfoRequest{}))
	if err != nil || len(resp.Msg.Nodes) == 0 {
		return &dsecv1.NodeInfo{}
	}
	return resp.Msg.Nodes[0]
}
