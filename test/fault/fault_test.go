// Package fault_test breaks a real dsec cluster on purpose — Debian's etcd,
// `dsec node` processes with real crun sandboxes and two `dsec api`
// replicas on loopback — and checks what its users see: etcd stopped for
// 30 s, one node cut off from etcd longer than its lease, an apiserver
// replica killed -9 in the middle of a burst of creates. Times are measured
// and logged; the assertions on them are only generous safety margins
// (this machine is shared and noisy), the behaviour is what is asserted.
package fault_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

const (
	token = "cluster-token-for-fault-tests-0123"
	key   = "faults=faults-key-0123456789abcdef"
	akey  = "faults-key-0123456789abcdef"
)

type cluster struct {
	t     *testing.T
	etcd  *dsectest.Etcd
	nodes []*dsectest.Proc
	cut   map[string]*dsectest.Proxy // nodes that reach etcd through a proxy
	apis  []*dsectest.Proc
}

// nodeSpec is one node: reaching etcd through a proxy the test can cut, or
// not.
type nodeSpec struct {
	name    string
	proxied bool
}

// startCluster starts etcd, the nodes (each labelled rack=<name>, a 3 s
// lease and 200 ms load interval, plus args) and two replicas.
func startCluster(t *testing.T, nodes []nodeSpec, args ...string) *cluster {
	dsectest.Need(t)
	c := &cluster{t: t, etcd: dsectest.StartEtcd(t), cut: map[string]*dsectest.Proxy{}}
	c.nodes = make([]*dsectest.Proc, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		etcd := c.etcd
		if n.proxied {
			p := dsectest.StartProxy(t, strings.TrimPrefix(c.etcd.URL, "http://"))
			c.cut[n.name] = p
			etcd = p.Etcd()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.nodes[i] = dsectest.StartNode(t, etcd, n.name, dsectest.NodeOptions{
				Token: token, Args: append([]string{"--node-ttl", "3s", "--load-interval", "200ms", "--label", "rack=" + n.name}, args...),
			})
		}()
	}
	wg.Wait()
	for range 2 {
		c.apis = append(c.apis, dsectest.StartAPI(t, c.etcd, dsectest.APIOptions{Token: token, APIKeys: []string{key}}))
	}
	for i := range c.apis {
		eventually(t, "replica sees every node as a member", 30*time.Second, func() error { return c.members(i, len(nodes)) })
	}
	return c
}

func (c *cluster) api(i int) *dsec.Client { return c.apis[i].Client(akey) }

// members returns nil when replica i routes to n nodes, all ready.
func (c *cluster) members(i, n int) error {
	info, err := c.api(i).Info(context.Background())
	if err != nil {
		return err
	}
	if len(info.Nodes) != n {
		return fmt.Errorf("%d nodes", len(info.Nodes))
	}
	for _, nd := range info.Nodes {
		if nd.State != "ready" {
			return fmt.Errorf("node %s is %s", nd.Name, nd.State)
		}
	}
	return nil
}

// stuck logs where the cluster's running processes wait, when a call got
// no answer: each one's goroutines that are in a create, and the path of a
// file with all of them.
func (c *cluster) stuck(why string) {
	f, err := os.CreateTemp("", "dsec-fault-goroutines-*.txt")
	if err != nil {
		c.t.Logf("%s; no goroutine dump: %v", why, err)
		return
	}
	defer f.Close()
	var b strings.Builder
	for _, p := range append(append([]*dsectest.Proc(nil), c.apis...), c.nodes...) {
		if !p.Running() {
			continue
		}
		all := p.Goroutines()
		fmt.Fprintf(f, "=== %s\n%s\n", p, all)
		for _, g := range strings.Split(all, "\n\n") {
			if strings.Contains(strings.ToLower(g), "create") {
				fmt.Fprintf(&b, "--- %s\n%s\n", p, g)
			}
		}
	}
	c.t.Logf("%s; goroutines of every process in %s, those in a create:\n%s", why, f.Name(), b.String())
}

// state is node's state as replica i reports it ("" when it does not
// route to it).
func (c *cluster) state(i int, node string) string {
	info, err := c.api(i).Info(context.Background())
	if err != nil {
		return ""
	}
	for _, nd := range info.Nodes {
		if nd.Name == node {
			return nd.State
		}
	}
	return ""
}

func eventually(t *testing.T, what string, d time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still %v after %s", what, err, d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// until retries f until it returns nil and returns how long that took from
// since (it fails t after d).
func until(t *testing.T, what string, since time.Time, d time.Duration, f func() error) time.Duration {
	t.Helper()
	eventually(t, what, d-time.Since(since), f)
	return time.Since(since)
}

func errOf(err error) *dsec.Error {
	var e *dsec.Error
	if errors.As(err, &e) {
		return e
	}
	return &dsec.Error{Message: fmt.Sprint(err)}
}

func create(ctx context.Context, c *dsec.Client, o dsec.CreateOptions) (*dsec.Sandbox, error) {
	if o.Image == "" {
		o.Image = "busybox"
	}
	if o.TTL == 0 {
		o.TTL = 10 * time.Minute
	}
	return c.Create(ctx, o)
}

// onNode creates a sandbox on node through replica 0.
func (c *cluster) onNode(node string) string {
	c.t.Helper()
	sb, err := create(context.Background(), c.api(0), dsec.CreateOptions{NodeSelector: map[string]string{"rack": node}})
	if err != nil {
		c.t.Fatalf("create on %s: %v", node, err)
	}
	return sb.ID
}

// echo is a `cat` whose stream was opened through replica 0 and whose
// stdin is written through replica 1.
type echo struct {
	t  *testing.T
	c  *cluster
	id string
	st *dsec.Stream
}

func (c *cluster) startEcho(id string) *echo {
	c.t.Helper()
	st, err := c.api(0).Sandbox(id).Start(context.Background(), dsec.Cmd("cat"), true)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { st.Close() })
	return &echo{t: c.t, c: c, id: id, st: st}
}

func (e *echo) check(msg string) {
	e.t.Helper()
	raw := e.c.api(1).Raw()
	if _, err := raw.WriteStdin(context.Background(), connect.NewRequest(&dsecv1.WriteStdinRequest{SandboxId: e.id, ProcessId: e.st.ProcessID, Data: []byte(msg)})); err != nil {
		e.t.Fatalf("stdin %q through replica 1: %v", msg, err)
	}
	ev, err := e.st.Next()
	if err != nil || string(ev.GetStdout()) != msg {
		e.t.Fatalf("echo of %q through the stream opened before: %v, %v", msg, ev, err)
	}
}

// execEverywhere runs `true` in each sandbox through each replica.
func (c *cluster) execEverywhere(ids []string) error {
	for _, id := range ids {
		for i := range c.apis {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err := c.api(i).Sandbox(id).Exec(ctx, dsec.Cmd("true"))
			cancel()
			if err != nil {
				return fmt.Errorf("exec in %s through replica %d: %w", id, i, err)
			}
		}
	}
	return nil
}

// createThroughBoth creates a sandbox through each replica (only on nodes
// with selector's labels, if given).
func (c *cluster) createThroughBoth(selector map[string]string) error {
	for i := range c.apis {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		sb, err := create(ctx, c.api(i), dsec.CreateOptions{NodeSelector: selector, TTL: time.Minute})
		cancel()
		if err != nil {
			return fmt.Errorf("create through replica %d: %w", i, err)
		}
		c.api(i).Delete(context.Background(), sb.ID)
	}
	return nil
}

func TestEtcdOutage(t *testing.T) {
	const outage = 30 * time.Second
	c := startCluster(t, []nodeSpec{{"n1", false}, {"n2", false}, {"n3", true}, {"n4", false}})
	ids := []string{c.onNode("n1"), c.onNode("n2"), c.onNode("n3")}
	onN4 := c.onNode("n4")
	streams := []*echo{c.startEcho(ids[0]), c.startEcho(ids[2])}
	for _, e := range streams {
		e.check("before\n")
	}

	// etcd goes away for everyone; n3, behind its proxy, stays away from it
	// for longer, so its lease expires after etcd returned; n4 dies during
	// the outage.
	c.etcd.Kill()
	c.cut["n3"].Cut()
	down := time.Now()
	n4 := c.nodes[3]
	n4.Kill()
	// etcd cannot say n4 went, but n4 does not answer: calls fail at once
	// with an infra error rather than hang.
	for i := range c.apis {
		start := time.Now()
		_, err := c.api(i).Sandbox(onN4).Exec(context.Background(), dsec.Cmd("true"))
		if e := errOf(err); !e.Infra || e.Kind != "unavailable" || !strings.Contains(e.Message, "node n4") || time.Since(start) > 5*time.Second {
			t.Fatalf("exec on killed n4 through replica %d with etcd down: %+v after %s", i, e, time.Since(start))
		}
	}

	refused := until(t, "creates refused with a clear infra error", down, 20*time.Second, func() error {
		for i := range c.apis {
			_, err := create(context.Background(), c.api(i), dsec.CreateOptions{})
			if e := errOf(err); !e.Infra || e.Kind != "unavailable" || !strings.Contains(e.Message, "etcd") {
				return fmt.Errorf("create through replica %d: %+v", i, e)
			}
		}
		return nil
	})
	t.Logf("creates refused %s after etcd stopped", refused.Round(time.Millisecond))
	// Throughout the outage: every node's sandboxes answer through both
	// replicas, creates are refused at once, streams go on.
	for time.Since(down) < outage {
		if err := c.execEverywhere(ids); err != nil {
			t.Fatalf("%s into the outage: %v", time.Since(down).Round(time.Second), err)
		}
		start := time.Now()
		_, err := create(context.Background(), c.api(1), dsec.CreateOptions{})
		if e := errOf(err); !e.Infra || !strings.Contains(e.Message, "etcd") || time.Since(start) > 5*time.Second {
			t.Fatalf("a create during the outage: %+v after %s", e, time.Since(start))
		}
		for _, e := range streams {
			e.check("during\n")
		}
		time.Sleep(2 * time.Second)
	}

	c.etcd.Start()
	back := time.Now()
	routable := until(t, "every node routable through both replicas", back, 30*time.Second, func() error { return c.execEverywhere(ids) })
	accepted := until(t, "creates accepted through both replicas", back, 30*time.Second, func() error {
		return c.createThroughBoth(map[string]string{"rack": "n1"})
	})
	members := until(t, "n1 and n2 members", back, 30*time.Second, func() error {
		for i := range c.apis {
			for _, n := range []string{"n1", "n2"} {
				if s := c.state(i, n); s != "ready" {
					return fmt.Errorf("replica %d: %s is %q", i, n, s)
				}
			}
		}
		return nil
	})
	t.Logf("after etcd returned: every node routable in %s, creates accepted in %s, n1 and n2 members in %s",
		routable.Round(time.Millisecond), accepted.Round(time.Millisecond), members.Round(time.Millisecond))
	if routable > 10*time.Second || accepted > 15*time.Second {
		t.Errorf("recovery took %s (routing) and %s (creates); targets 2 s and 5 s", routable, accepted)
	}
	for _, e := range streams {
		e.check("after\n")
	}

	// n3 could not renew its lease: once etcd expired it, replicas route
	// to n3 while it answers and place nothing there.
	lapsed := until(t, "n3 lapsed on both replicas", back, 30*time.Second, func() error {
		for i := range c.apis {
			if s := c.state(i, "n3"); s != "lapsed" {
				return fmt.Errorf("replica %d: n3 is %q", i, s)
			}
		}
		return nil
	})
	t.Logf("n3's lease expired and it lapsed %s after etcd returned", lapsed.Round(time.Millisecond))
	if err := c.execEverywhere(ids); err != nil {
		t.Fatalf("with n3 lapsed: %v", err)
	}
	streams[1].check("lapsed\n")
	for i := range c.apis {
		_, err := create(context.Background(), c.api(i), dsec.CreateOptions{NodeSelector: map[string]string{"rack": "n3"}})
		if e := errOf(err); e.Kind != "unavailable" || !e.Infra {
			t.Fatalf("a create only lapsed n3 fits, through replica %d: %+v", i, e)
		}
	}

	// n4's lease expired too, and n4 does not answer: lost.
	lost := until(t, "n4 lost on both replicas", back, 30*time.Second, func() error {
		for i := range c.apis {
			start := time.Now()
			_, err := c.api(i).Sandbox(onN4).Exec(context.Background(), dsec.Cmd("true"))
			if e := errOf(err); !e.Infra || !strings.Contains(e.Message, "node n4 lost") || time.Since(start) > time.Second {
				return fmt.Errorf("replica %d: %+v after %s", i, e, time.Since(start))
			}
		}
		return nil
	})
	t.Logf("killed n4 lost %s after etcd returned", lost.Round(time.Millisecond))
	n4.Start()
	returned := time.Now()
	reach := until(t, "n4's sandbox reachable again", returned, 60*time.Second, func() error { return c.execEverywhere([]string{onN4}) })
	t.Logf("restarted n4's sandbox reachable %s after n4 answered", reach.Round(time.Millisecond))

	c.cut["n3"].Restore()
	reached := time.Now()
	again := until(t, "n3 takes creates again through both replicas", reached, 30*time.Second, func() error {
		return c.createThroughBoth(map[string]string{"rack": "n3"})
	})
	t.Logf("n3 registered again and took creates %s after it reached etcd", again.Round(time.Millisecond))
	if again > 10*time.Second {
		t.Errorf("n3 took %s to register again; target 2 s", again)
	}
	for _, e := range streams {
		e.check("end\n")
	}
}

func TestReplicaKilledDuringKeyedBurst(t *testing.T) {
	const n = 200
	c := startCluster(t, []nodeSpec{{"n1", false}, {"n2", false}, {"n3", false}}, "--max-sandboxes", "100")
	ctx := context.Background()
	run := fmt.Sprintf("r%d", time.Now().UnixNano()%1e6)
	keyOf := func(i int) string { return fmt.Sprintf("burst-%s-%03d", run, i) }
	opts := func(i int) dsec.CreateOptions {
		return dsec.CreateOptions{IdempotencyKey: keyOf(i), TTL: 10 * time.Minute, Labels: map[string]string{"burst": run, "key": fmt.Sprintf("k%03d", i)}}
	}

	var (
		mu       sync.Mutex
		got      = map[int]string{} // item → the sandbox its create answered
		retries  int
		finished int
		killed   = make(chan struct{})
	)
	// Each create starts on replica i%2; on an infra or retryable error it
	// is retried, with the same key, on the other replica.
	clients := []*dsec.Client{c.api(0), c.api(1)}
	createOne := func(i int) error {
		r := i % 2
		var last error
		timeouts := 0
		for attempt := 0; attempt < 40; attempt++ {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			sb, err := create(cctx, clients[r], opts(i))
			timedOut := errors.Is(cctx.Err(), context.DeadlineExceeded)
			cancel()
			if err == nil {
				mu.Lock()
				got[i] = sb.ID
				finished++
				if finished == n/4 {
					close(killed) // a quarter in: kill replica 0
				}
				mu.Unlock()
				return nil
			}
			last = err
			e := errOf(err)
			if timedOut {
				// The client's own deadline: a client retries with the same
				// key, which is what the key is for (a slow machine), but not
				// for ever (a create that hangs).
				if timeouts++; timeouts == 1 {
					c.stuck(fmt.Sprintf("item %d through replica %d: no answer within 30 s (%v)", i, r, err))
				}
				if timeouts == 3 {
					return fmt.Errorf("item %d: no answer within 30 s, 3 times", i)
				}
				t.Logf("item %d through replica %d: no answer within 30 s (%v); retrying", i, r, err)
			} else if !e.Infra && !e.Retryable && e.Kind != "" {
				return fmt.Errorf("item %d through replica %d: %w", i, r, err)
			}
			mu.Lock()
			retries++
			mu.Unlock()
			r = 1 - r
			time.Sleep(time.Duration(50+25*attempt) * time.Millisecond)
		}
		return fmt.Errorf("item %d: gave up after 40 attempts: %w", i, last)
	}

	work := make(chan int)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				if err := createOne(i); err != nil {
					errs <- err
				}
			}
		}()
	}
	start := time.Now()
	go func() {
		<-killed
		c.apis[0].Kill()
		t.Logf("replica 0 killed -9 after %s", time.Since(start).Round(time.Millisecond))
	}()
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	t.Logf("%d keyed creates in %s, %d retried on the other replica", n, time.Since(start).Round(time.Millisecond), retries)

	// Every key maps to exactly one sandbox: the one its create answered.
	check := func(what string) {
		list, err := c.api(1).List(ctx, "burst="+run)
		if err != nil {
			t.Fatal(err)
		}
		byKey := map[string][]string{}
		for _, sb := range list {
			byKey[sb.GetSpec().GetLabels()["key"]] = append(byKey[sb.GetSpec().GetLabels()["key"]], sb.Id)
		}
		for i := range n {
			k := fmt.Sprintf("k%03d", i)
			if ids := byKey[k]; len(ids) != 1 || ids[0] != got[i] {
				t.Errorf("%s: key %s has sandboxes %v, its create answered %s", what, keyOf(i), ids, got[i])
			}
		}
		if len(list) != n {
			t.Errorf("%s: %d sandboxes for %d keys", what, len(list), n)
		}
	}
	check("after the burst")
	// A retry of every key through the surviving replica returns the same
	// sandbox and makes none.
	for i := range n {
		sb, err := create(ctx, c.api(1), opts(i))
		if err != nil || sb.ID != got[i] {
			t.Fatalf("key %s retried: %v, %v (first %s)", keyOf(i), sb, err, got[i])
		}
	}
	check("after every key was retried")
}
