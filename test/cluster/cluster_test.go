// Package cluster_test runs a real dsec cluster on this machine: Debian's
// etcd, three `dsec node` processes (real crun sandboxes) and two `dsec
// api` replicas on loopback, and breaks it: nodes and replicas killed,
// nodes drained, etcd stopped.
package cluster_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/api/dsec/node/v1/nodev1connect"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

const (
	token = "cluster-token-for-tests-0123456789"
	key   = "alpha=alpha-key-0123456789abcdef"
	akey  = "alpha-key-0123456789abcdef"
	admin = "operator-key-0123456789abcdef"
)

type testCluster struct {
	t     *testing.T
	etcd  *dsectest.Etcd
	nodes []*dsectest.Proc
	apis  []*dsectest.Proc
}

func (c *testCluster) api(i int) *dsec.Client { return c.apis[i].Client(akey) }

func (c *testCluster) node(name string) *dsectest.Proc {
	for _, n := range c.nodes {
		if n.Name == name {
			return n
		}
	}
	c.t.Fatalf("no node %s", name)
	return nil
}

// cli runs `dsec` with args.
func (c *testCluster) cli(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(dsectest.Binaries(c.t), "dsec"), args...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// stdin writes to a process's stdin through c (close: closes it).
func stdin(ctx context.Context, c *dsec.Client, id, pid string, data []byte, close bool) error {
	raw := c.Raw()
	_, err := raw.WriteStdin(ctx, connect.NewRequest(&dsecv1.WriteStdinRequest{SandboxId: id, ProcessId: pid, Data: data, Close: close}))
	return err
}

// eventually retries f until it returns nil or the deadline passes.
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
		time.Sleep(100 * time.Millisecond)
	}
}

func startCluster(t *testing.T) *testCluster {
	dsectest.Need(t)
	c := &testCluster{t: t, etcd: dsectest.StartEtcd(t)}
	var wg sync.WaitGroup
	c.nodes = make([]*dsectest.Proc, 3)
	for i := range c.nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.nodes[i] = dsectest.StartNode(t, c.etcd, fmt.Sprintf("n%d", i+1), dsectest.NodeOptions{
				Token: token, Args: []string{"--node-ttl", "3s", "--load-interval", "200ms", "--max-sandboxes", "40", "--label", fmt.Sprintf("rack=r%d", i+1)},
			})
		}()
	}
	wg.Wait()
	for range 2 {
		c.apis = append(c.apis, dsectest.StartAPI(t, c.etcd, dsectest.APIOptions{Token: token, APIKeys: []string{key}, Args: []string{"--admin-key", admin}}))
	}
	for i := range c.apis {
		eventually(t, "replica sees every node", 30*time.Second, func() error {
			info, err := c.api(i).Info(context.Background())
			if err != nil {
				return err
			}
			if len(info.Nodes) != 3 {
				return fmt.Errorf("%d nodes", len(info.Nodes))
			}
			return nil
		})
	}
	return c
}

func nodeOf(id string) string { return id[strings.LastIndex(id, "-")+1:] }

func create(ctx context.Context, c *dsec.Client, o dsec.CreateOptions) (*dsec.Sandbox, error) {
	if o.Image == "" {
		o.Image = "busybox"
	}
	if o.TTL == 0 {
		o.TTL = 10 * time.Minute
	}
	return c.Create(ctx, o)
}

func errOf(err error) *dsec.Error {
	var e *dsec.Error
	if errors.As(err, &e) {
		return e
	}
	return &dsec.Error{Message: fmt.Sprint(err)}
}

func TestCluster(t *testing.T) {
	c := startCluster(t)
	ctx := context.Background()
	var ids []string

	t.Run("creates spread across nodes and any replica routes to them", func(t *testing.T) {
		count := map[string]int{}
		for i := range 12 {
			sb, err := create(ctx, c.api(i%2), dsec.CreateOptions{Labels: map[string]string{"test": "spread"}})
			if err != nil {
				t.Fatal(err)
			}
			if sb.Info.Node != nodeOf(sb.ID) {
				t.Errorf("sandbox %s reports node %q", sb.ID, sb.Info.Node)
			}
			count[sb.Info.Node]++
			ids = append(ids, sb.ID)
		}
		for _, n := range []string{"n1", "n2", "n3"} {
			if count[n] < 2 {
				t.Errorf("placements %v: node %s got %d of 12", count, n, count[n])
			}
		}
		for _, id := range ids {
			for i := range c.apis {
				res, err := c.api(i).Sandbox(id).Exec(ctx, dsec.Cmd("echo $((6*7))"))
				if err != nil || res.ExitCode != 0 || strings.TrimSpace(string(res.Stdout)) != "42" {
					t.Fatalf("exec on %s through replica %d: %v %v", id, i, res, err)
				}
			}
		}
		list, err := c.api(1).List(ctx, "test=spread")
		if err != nil || len(list) != 12 {
			t.Fatalf("list through replica 1: %d sandboxes, %v", len(list), err)
		}
	})

	t.Run("each replica and node serves its metrics; together they count every call once", func(t *testing.T) {
		// So far: 12 creates through alternating replicas, each sandbox
		// exec'd through both (24 execs).
		sum := func(procs []*dsectest.Proc, cred, series string) float64 {
			total := 0.0
			for _, p := range procs {
				code, text, samples := dsectest.Scrape(t, p.URL, cred)
				if code != 200 {
					t.Fatalf("%s/metrics: %d: %s", p.URL, code, text)
				}
				total += samples[series]
			}
			return total
		}
		for _, m := range []struct {
			procs        []*dsectest.Proc
			cred, series string
			want         float64
		}{
			{c.nodes, token, `dsec_sandbox_operation_duration_seconds_count{kind="container",operation="create",outcome="ok"}`, 12},
			{c.nodes, token, `dsec_sandbox_operation_duration_seconds_count{kind="container",operation="exec",outcome="ok"}`, 24},
			{c.nodes, token, `dsec_sandboxes{kind="container",state="running"}`, 12},
			{c.apis, admin, `dsec_cluster_placements_total{result="placed"}`, 12},
			{c.apis, admin, `dsec_api_rpc_duration_seconds_count{code="ok",procedure="/dsec.v1.ProcessService/Exec"}`, 24},
			{c.apis, admin, `dsec_api_rpc_duration_seconds_count{code="ok",procedure="/dsec.v1.LifecycleService/CreateSandbox"}`, 12},
		} {
			if got := sum(m.procs, m.cred, m.series); got != m.want {
				t.Errorf("%s summed over %d processes = %v, want %v", m.series, len(m.procs), got, m.want)
			}
		}
		if code, _, _ := dsectest.Scrape(t, c.apis[0].URL, akey); code != http.StatusForbidden {
			t.Errorf("a replica's /metrics with a project's key: %d, want 403", code)
		}
		if code, _, _ := dsectest.Scrape(t, c.nodes[0].URL, akey); code != http.StatusUnauthorized {
			t.Errorf("a node's /metrics without the cluster token: %d, want 401", code)
		}
	})

	t.Run("a webhook registered through one replica is delivered once, from every node", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		var mu sync.Mutex
		got := map[string]int{} // sandbox ID → created deliveries
		receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var ev struct {
				Type      string `json:"type"`
				SandboxID string `json:"sandboxId"`
			}
			json.NewDecoder(r.Body).Decode(&ev)
			if ev.Type == "created" {
				mu.Lock()
				got[ev.SandboxID]++
				mu.Unlock()
			}
		}))
		defer receiver.Close()
		w, err := c.api(0).CreateWebhook(ctx, dsec.WebhookOptions{URL: receiver.URL, Secret: "cluster-secret", Labels: "test=webhook", Types: []string{"created"}})
		if err != nil {
			t.Fatal(err)
		}
		defer c.api(1).DeleteWebhook(context.WithoutCancel(ctx), w.Id)
		if list, err := c.api(1).Webhooks(ctx); err != nil || len(list) != 1 || list[0].Id != w.Id {
			t.Fatalf("the other replica lists %v (%v)", list, err)
		}
		delivered := func(id string) int {
			mu.Lock()
			defer mu.Unlock()
			return got[id]
		}
		// The replica that delivers picks the registration up within
		// seconds (it may be the other one): probe until a create arrives.
		deadline := time.Now().Add(30 * time.Second)
		for {
			sb, err := create(ctx, c.api(1), dsec.CreateOptions{Labels: map[string]string{"test": "webhook"}})
			if err != nil {
				t.Fatal(err)
			}
			c.api(1).Delete(ctx, sb.ID)
			time.Sleep(500 * time.Millisecond)
			if delivered(sb.ID) > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("no webhook delivery within 30 s of the registration")
			}
		}
		made := map[string]bool{}
		for range 6 {
			sb, err := create(ctx, c.api(1), dsec.CreateOptions{Labels: map[string]string{"test": "webhook"}})
			if err != nil {
				t.Fatal(err)
			}
			made[sb.ID] = true
			defer c.api(1).Delete(context.WithoutCancel(ctx), sb.ID)
		}
		for time.Now().Before(deadline.Add(30 * time.Second)) {
			n := 0
			for id := range made {
				if delivered(id) > 0 {
					n++
				}
			}
			if n == len(made) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		// One replica delivers: every delivery received is counted by the
		// replicas' metrics, all by one of them (a second delivering
		// replica would have counted the probes' by now).
		received := func() float64 {
			mu.Lock()
			defer mu.Unlock()
			n := 0
			for _, k := range got {
				n += k
			}
			return float64(n)
		}
		var counted []float64
		for {
			counted = counted[:0]
			total := 0.0
			for _, p := range c.apis {
				_, _, samples := dsectest.Scrape(t, p.URL, admin)
				v := samples[`dsec_api_webhook_deliveries_total{result="delivered"}`]
				counted, total = append(counted, v), total+v
			}
			if total == received() {
				break
			}
			if time.Now().After(deadline.Add(30 * time.Second)) {
				t.Fatalf("the replicas count %v deliveries, the receiver got %v", counted, received())
			}
			time.Sleep(50 * time.Millisecond)
		}
		delivering := 0
		for _, v := range counted {
			if v > 0 {
				delivering++
			}
		}
		if delivering != 1 {
			t.Errorf("deliveries counted per replica %v, want all %v by one replica", counted, received())
		}
		nodes := map[string]bool{}
		for id := range made {
			if n := delivered(id); n != 1 {
				t.Errorf("%s: created delivered %d times, want once", id, n)
			}
			nodes[nodeOf(id)] = true
		}
		if len(nodes) < 2 {
			t.Errorf("the creates landed on nodes %v only", nodes)
		}
	})
	t.Run("a subscription through one replica follows sandboxes on every node", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		sub, err := c.api(0).Subscribe(ctx, dsec.EventOptions{Labels: "test=events"})
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		made := map[string]bool{}
		for range 6 {
			sb, err := create(ctx, c.api(1), dsec.CreateOptions{Labels: map[string]string{"test": "events"}})
			if err != nil {
				t.Fatal(err)
			}
			made[sb.ID] = true
		}
		nodes := map[string]bool{}
		for range 6 {
			ev, err := sub.Next()
			if err != nil {
				t.Fatal(err)
			}
			if ev.Type != "created" || !made[ev.SandboxId] || ev.Node != nodeOf(ev.SandboxId) {
				t.Fatalf("event %v, want the creation of one of %v", ev, made)
			}
			nodes[ev.Node] = true
		}
		if len(nodes) < 2 {
			t.Errorf("the six creates' events came from nodes %v only", nodes)
		}
		for id := range made {
			if err := c.api(1).Delete(ctx, id); err != nil {
				t.Fatal(err)
			}
		}
		for range 6 {
			ev, err := sub.Next()
			if err != nil {
				t.Fatal(err)
			}
			if ev.Type != "ended" || !made[ev.SandboxId] || ev.Cause != "deleted" {
				t.Fatalf("event %v, want a deletion", ev)
			}
			delete(made, ev.SandboxId)
		}
	})

	t.Run("dsec get -o json shows the owning node", func(t *testing.T) {
		out, err := c.cli("--url", c.apis[1].URL, "--api-key", akey, "get", ids[0], "-o", "json")
		if err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		var got struct {
			Node string `json:"node"`
		}
		if err := json.Unmarshal([]byte(out), &got); err != nil || got.Node != nodeOf(ids[0]) {
			t.Fatalf("get -o json does not show node %s:\n%s", nodeOf(ids[0]), out)
		}
	})

	t.Run("a node selector places on the nodes with the labels", func(t *testing.T) {
		for i := range 3 {
			out, err := c.cli("--url", c.apis[i%2].URL, "--api-key", akey, "create", "--image", "busybox", "--ttl", "10m", "--node-selector", "rack=r2")
			if err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			if id := strings.TrimSpace(out); nodeOf(id) != "n2" {
				t.Fatalf("rack=r2 placed %s", id)
			}
		}
		out, err := c.cli("--url", c.apis[0].URL, "--api-key", akey, "create", "--image", "busybox", "--node-selector", "rack=r9")
		if err == nil || !strings.Contains(out, "labels do not match") {
			t.Fatalf("a selector no node matches: %v: %s", err, out)
		}
		// Every node has dsec.io/node: its name (a sandbox beside another).
		for i := range 2 {
			sb, err := create(ctx, c.api(i), dsec.CreateOptions{NodeSelector: map[string]string{"dsec.io/node": "n3"}})
			if err != nil || sb.Info.Node != "n3" {
				t.Fatalf("dsec.io/node=n3 through replica %d: %v, %v", i, sb, err)
			}
		}
	})

	t.Run("a sandbox with sidecars is placed where all its images are and reached through either replica", func(t *testing.T) {
		web := &dsecv1.Sidecar{
			Name: "web", Image: "busybox",
			Command:     []string{"sh", "-c", "mkdir -p /www && echo from-web > /www/index.html && exec httpd -f -p 8080 -h /www"},
			Healthcheck: &dsecv1.HealthCheck{Command: []string{"wget", "-qO-", "http://127.0.0.1:8080/"}, StartIntervalMs: 100, Retries: 50},
		}
		sb, err := c.api(0).Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: 10 * time.Minute, Sidecars: []*dsecv1.Sidecar{web}})
		if err != nil {
			t.Fatal(err)
		}
		defer c.api(0).Delete(ctx, sb.ID)
		if res, err := c.api(1).Sandbox(sb.ID).Exec(ctx, dsec.Cmd("wget -qO- http://web:8080/")); err != nil || string(res.Stdout) != "from-web\n" {
			t.Fatalf("main through the other replica: %v, %v", res, err)
		}
		if res, err := c.api(1).Sandbox(sb.ID).Container("web").Exec(ctx, dsec.Cmd("hostname")); err != nil || string(res.Stdout) != "web\n" {
			t.Fatalf("the sidecar through the other replica: %v, %v", res, err)
		}
		_, err = c.api(1).Create(ctx, dsec.CreateOptions{Image: "busybox", Sidecars: []*dsecv1.Sidecar{{Name: "x", Image: "no-such-image", Command: []string{"true"}}}})
		if err == nil || !strings.Contains(err.Error(), "no image no-such-image") {
			t.Fatalf("a sidecar image no node has: %v", err)
		}
	})

	t.Run("an image committed on one node starts sandboxes on the others, its data loaded on demand", func(t *testing.T) {
		on := func(n string) map[string]string { return map[string]string{"dsec.io/node": n} }
		sb, err := create(ctx, c.api(0), dsec.CreateOptions{NodeSelector: on("n1")})
		if err != nil {
			t.Fatal(err)
		}
		defer c.api(0).Delete(ctx, sb.ID)
		if _, err := sb.Exec(ctx, dsec.Cmd("mkdir -p /work && echo 42 > /work/answer.txt && head -c 3000000 /dev/urandom > /work/big.bin && md5sum /work/big.bin > /work/big.md5")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.api(0).CommitSandbox(ctx, sb.ID, "workspace"); err != nil {
			t.Fatal(err)
		}
		defer c.cli("--url", c.apis[0].URL, "--api-key", akey, "image", "rm", "workspace")
		// Through each replica, onto a node that does not hold the image.
		onNode := map[string]string{}
		startOn := func(i int, n string) {
			t.Helper()
			child, err := create(ctx, c.api(i), dsec.CreateOptions{Image: "workspace", NodeSelector: on(n)})
			if err != nil {
				t.Fatalf("a create of the image on %s through replica %d: %v", n, i, err)
			}
			onNode[n] = child.ID
			t.Cleanup(func() { c.api(0).Delete(ctx, child.ID) })
			res, err := child.Exec(ctx, dsec.Cmd("cat /work/answer.txt && md5sum -c /work/big.md5"))
			if err != nil || res.ExitCode != 0 || !strings.HasPrefix(string(res.Stdout), "42\n") {
				t.Fatalf("the workspace's files on %s: %v, %v", n, res, err)
			}
		}
		if _, err := c.api(1).PruneImages(ctx); err != nil { // what earlier tests left
			t.Fatal(err)
		}
		startOn(0, "n2")
		startOn(1, "n3")
		// A prune leaves the copies sandboxes run from; once n2's sandbox
		// is gone its copy goes, and the next create there imports it again.
		if p, err := c.api(1).PruneImages(ctx); err != nil || p.GetCopies() != 0 {
			t.Fatalf("a prune while both copies run sandboxes: %v, %v", p, err)
		}
		if err := c.api(0).Delete(ctx, onNode["n2"]); err != nil {
			t.Fatal(err)
		}
		if p, err := c.api(1).PruneImages(ctx); err != nil || p.GetCopies() != 1 {
			t.Fatalf("a prune after n2's sandbox ended: %v, %v (want one copy removed)", p, err)
		}
		startOn(0, "n2")
		// A build runs on one node (a cluster's builder); its image starts
		// sandboxes on every node the same way.
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM busybox\nCOPY note.txt /opt/note.txt\nRUN echo built >> /opt/note.txt\nENV FLAVOUR=cluster\n"), 0o644)
		os.WriteFile(filepath.Join(dir, "note.txt"), []byte("from the context\n"), 0o644)
		if out, err := c.cli("--url", c.apis[1].URL, "--api-key", akey, "image", "build", dir, "--name", "built"); err != nil {
			t.Fatalf("dsec image build through a cluster: %v: %s", err, out)
		}
		defer c.cli("--url", c.apis[0].URL, "--api-key", akey, "image", "rm", "built")
		for _, n := range []string{"n1", "n2", "n3"} {
			b, err := create(ctx, c.api(0), dsec.CreateOptions{Image: "built", NodeSelector: on(n)})
			if err != nil {
				t.Fatalf("a create of the built image on %s: %v", n, err)
			}
			defer c.api(0).Delete(ctx, b.ID)
			res, err := b.Exec(ctx, dsec.Cmd("cat /opt/note.txt; echo $FLAVOUR"))
			if err != nil || string(res.Stdout) != "from the context\nbuilt\ncluster\n" {
				t.Fatalf("the built image on %s: %v, %v", n, res, err)
			}
		}
		// Another project sees nothing of it, on any node.
		out, err := c.cli("cluster", "--etcd", c.etcd.URL, "key", "add", "tenant-w")
		if err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		_, err = create(ctx, c.apis[1].Client(strings.TrimSpace(out)), dsec.CreateOptions{Image: "workspace"})
		if err == nil || !strings.Contains(err.Error(), "no image workspace") {
			t.Fatalf("another project's create of the image: %v", err)
		}
	})

	t.Run("an exec stream and stdin pass through different replicas", func(t *testing.T) {
		sb := c.api(0).Sandbox(ids[1])
		st, err := sb.Start(ctx, dsec.Cmd("cat"), true)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		// Stdin through the other replica; the echo must come back through
		// the first while cat still runs: nothing waits for the end.
		if err := stdin(ctx, c.api(1), ids[1], st.ProcessID, []byte("ping\n"), false); err != nil {
			t.Fatal(err)
		}
		ev, err := st.Next()
		if err != nil || string(ev.GetStdout()) != "ping\n" {
			t.Fatalf("first event %v, %v", ev, err)
		}
		if err := stdin(ctx, c.api(1), ids[1], st.ProcessID, nil, true); err != nil {
			t.Fatal(err)
		}
		for {
			ev, err := st.Next()
			if err != nil {
				t.Fatal(err)
			}
			if ev.GetExit() != nil {
				break
			}
		}
	})

	t.Run("a rollout's progress streams through one replica while the other drives it", func(t *testing.T) {
		sb := c.api(0).Sandbox(ids[2])
		if _, err := sb.Exec(ctx, dsec.Cmd("mkfifo /tmp/rollout-go")); err != nil {
			t.Fatal(err)
		}
		r, err := c.api(0).StartRollout(ctx, &dsecv1.StartRolloutRequest{SandboxId: ids[2], RolloutId: "streamed",
			Cmd: "read x < /tmp/rollout-go; echo 1", Verifier: &dsecv1.RolloutVerifier{Cmd: "echo 0.5"}})
		if err != nil || r.State != "running" {
			t.Fatalf("start: %v, %v", r, err)
		}
		entries := make(chan *dsecv1.LogEntry, 8)
		type ended struct {
			r   *dsecv1.Rollout
			err error
		}
		done := make(chan ended, 1)
		go func() {
			r, err := c.api(1).WatchRollout(ctx, ids[2], "streamed", 0, func(e *dsecv1.LogEntry) error {
				entries <- e
				return nil
			})
			done <- ended{r, err}
		}()
		// A command through replica 0 reaches the watch through replica 1
		// while the agent still waits.
		if _, err := sb.Exec(ctx, dsec.Cmd("echo step")); err != nil {
			t.Fatal(err)
		}
		select {
		case e := <-entries:
			if e.Op != "exec" || !strings.Contains(strings.Join(e.Argv, " "), "echo step") {
				t.Fatalf("first entry %v", e)
			}
		case end := <-done:
			t.Fatalf("the watch ended before the rollout: %v, %v", end.r, end.err)
		case <-time.After(time.Minute):
			t.Fatal("no entry within a minute")
		}
		if _, err := sb.Exec(ctx, dsec.Cmd("echo go > /tmp/rollout-go")); err != nil {
			t.Fatal(err)
		}
		// The command that let the agent go may be logged after the
		// rollout's end (the agent exits as the fifo is written, before
		// the exec that wrote it answers): 1 or 2 commands.
		end := <-done
		if end.err != nil || end.r.State != "succeeded" || end.r.Reward != 0.5 || end.r.Commands < 1 {
			t.Fatalf("the watch ended with %v, %v", end.r, end.err)
		}
		// The CLI shows the same, for an ended rollout at once.
		out, err := c.cli("--url", c.apis[1].URL, "--api-key", akey, "rollout", "watch", ids[2], "streamed")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		last := lines[len(lines)-1]
		if err != nil || !strings.Contains(lines[0], "echo step") || !strings.Contains(last, "succeeded, reward 0.5, 0 model calls, "+fmt.Sprint(end.r.Commands)+" commands") {
			t.Fatalf("dsec rollout watch: %v:\n%s", err, out)
		}
	})

	t.Run("files stream through replicas without being buffered whole", func(t *testing.T) {
		const size = 256 << 20
		api := c.apis[0]
		before := hwm(t, api.Pid())
		h := sha256.New()
		req, _ := http.NewRequest(http.MethodPut, api.URL+"/v1/sandboxes/"+ids[2]+"/files?path=/tmp/big", io.TeeReader(io.LimitReader(zeros{}, size), h))
		req.Header.Set("Authorization", "Bearer "+akey)
		req.ContentLength = size
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("PUT: %d %s", resp.StatusCode, body)
		}
		want := h.Sum(nil)
		req, _ = http.NewRequest(http.MethodGet, c.apis[1].URL+"/v1/sandboxes/"+ids[2]+"/files?path=/tmp/big", nil)
		req.Header.Set("Authorization", "Bearer "+akey)
		resp, err = http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		h.Reset()
		n, err := io.Copy(h, resp.Body)
		resp.Body.Close()
		if err != nil || n != size || string(h.Sum(nil)) != string(want) {
			t.Fatalf("GET back through the other replica: %d bytes, %v, same content %v", n, err, string(h.Sum(nil)) == string(want))
		}
		if grew := hwm(t, api.Pid()) - before; grew > 64<<20 {
			t.Errorf("the replica's peak memory grew by %d MiB for a %d MiB upload", grew>>20, size>>20)
		}
	})

	t.Run("unknown and forged IDs get clear errors", func(t *testing.T) {
		cases := []struct {
			id, kind, says string
		}{
			{"aaaaaaaaaaaaaaaa-nosuchnode", "not_found", `no node "nosuchnode" in this cluster`},
			{"garbage", "invalid", "malformed sandbox id"},
			{"../../etc-n1", "invalid", "malformed sandbox id"},
			{"aaaaaaaaaaaaaaaa-n1", "not_found", "not found"},
		}
		for _, tc := range cases {
			_, err := c.api(0).Get(ctx, tc.id)
			e := errOf(err)
			if e.Kind != tc.kind || !strings.Contains(e.Message, tc.says) || e.Infra {
				t.Errorf("get %q: %+v, want %s saying %q", tc.id, e, tc.kind, tc.says)
			}
		}
	})

	t.Run("idempotency keys hold across replicas", func(t *testing.T) {
		a, err := create(ctx, c.api(0), dsec.CreateOptions{IdempotencyKey: "one-key"})
		if err != nil {
			t.Fatal(err)
		}
		b, err := create(ctx, c.api(1), dsec.CreateOptions{IdempotencyKey: "one-key"})
		if err != nil || b.ID != a.ID {
			t.Fatalf("retry through the other replica: %v, %v (first %s)", b, err, a.ID)
		}
		batch := func(i int) []string {
			raw := c.api(i).Raw()
			resp, err := raw.CreateSandboxes(ctx, connect.NewRequest(&dsecv1.CreateSandboxesRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", TtlS: 600}, Count: 4, IdempotencyKey: "batch-key"}))
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, r := range resp.Msg.Results {
				if r.Error != nil {
					t.Fatalf("item %d: %v", r.Index, r.Error)
				}
				out = append(out, r.Sandbox.Id)
			}
			return out
		}
		first, again := batch(0), batch(1)
		if strings.Join(first, ",") != strings.Join(again, ",") {
			t.Fatalf("batch retried through the other replica made %v, first %v", again, first)
		}
	})

	t.Run("an apiserver killed mid-create: the retry on the other replica makes no duplicate", func(t *testing.T) {
		errc := make(chan error, 1)
		go func() {
			_, err := create(ctx, c.api(0), dsec.CreateOptions{IdempotencyKey: "killed-replica", Labels: map[string]string{"test": "killed-replica"}})
			errc <- err
		}()
		time.Sleep(3 * time.Millisecond)
		c.apis[0].Kill()
		firstErr := <-errc
		t.Logf("the create on the killed replica returned %v", firstErr)
		var sb *dsec.Sandbox
		eventually(t, "create retried on the surviving replica", 30*time.Second, func() error {
			var err error
			sb, err = create(ctx, c.api(1), dsec.CreateOptions{IdempotencyKey: "killed-replica", Labels: map[string]string{"test": "killed-replica"}})
			return err
		})
		list, err := c.api(1).List(ctx, "test=killed-replica")
		if err != nil || len(list) != 1 || list[0].Id != sb.ID {
			t.Fatalf("sandboxes with the key (first attempt: %v): %d, %v", firstErr, len(list), err)
		}
		// Calls keep working through the surviving replica meanwhile.
		if _, err := c.api(1).Sandbox(ids[0]).Exec(ctx, dsec.Cmd("true")); err != nil {
			t.Fatal(err)
		}
		c.apis[0].Start()
	})

	t.Run("another project's key reaches nothing through any replica", func(t *testing.T) {
		keyOf := func(args ...string) string {
			out, err := c.cli(append([]string{"cluster", "--etcd", c.etcd.URL, "key", "add"}, args...)...)
			if err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			return strings.TrimSpace(out)
		}
		ka, kb, kops := keyOf("tenant-a"), keyOf("tenant-b"), keyOf("ops", "--admin")
		// Keys work through every replica as soon as `key add` returned.
		clients := map[string][]*dsec.Client{}
		for name, k := range map[string]string{"a": ka, "b": kb, "ops": kops} {
			for i := range c.apis {
				cl := c.apis[i].Client(k)
				if _, err := cl.List(ctx, ""); err != nil {
					t.Fatalf("replica %d right after the key was added: %v", i, err)
				}
				clients[name] = append(clients[name], cl)
			}
		}
		sb, err := create(ctx, clients["a"][0], dsec.CreateOptions{Labels: map[string]string{"tenant": "a"}})
		if err != nil {
			t.Fatal(err)
		}
		defer clients["a"][0].Delete(context.Background(), sb.ID)
		for i, b := range clients["b"] {
			if _, err := b.Get(ctx, sb.ID); errOf(err).Kind != "not_found" {
				t.Errorf("replica %d: B's get of A's sandbox: %v", i, err)
			}
			if _, err := b.Sandbox(sb.ID).Exec(ctx, dsec.Cmd("true")); errOf(err).Kind != "not_found" {
				t.Errorf("replica %d: B's exec in A's sandbox: %v", i, err)
			}
			list, err := b.List(ctx, "tenant=a")
			if err != nil || len(list) != 0 {
				t.Errorf("replica %d: B lists %d of A's sandboxes (%v)", i, len(list), err)
			}
			if resp, err := b.Bulk(ctx, "delete", "tenant=a"); err != nil || len(resp.Ids) != 0 {
				t.Errorf("replica %d: B's bulk delete by A's label: %v, %v", i, resp.GetIds(), err)
			}
			if err := b.Delete(ctx, sb.ID); err != nil {
				t.Errorf("replica %d: B's delete of A's sandbox answered %v, not as for an unknown ID", i, err)
			}
		}
		for i, ops := range clients["ops"] {
			if _, err := ops.Get(ctx, sb.ID); err != nil {
				t.Errorf("replica %d: the operator cannot see A's sandbox: %v", i, err)
			}
		}
		if r, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil || r.ExitCode != 0 {
			t.Fatalf("A's sandbox after B's attempts: %v, %v", r, err)
		}
	})
	t.Run("quotas are enforced", func(t *testing.T) {
		if out, err := c.cli("cluster", "--etcd", c.etcd.URL, "project", "set", "quota", "--max-sandboxes", "2"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		out, err := c.cli("cluster", "--etcd", c.etcd.URL, "key", "add", "quota")
		if err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		qkey := strings.TrimSpace(out)
		q := []*dsec.Client{c.apis[0].Client(qkey), c.apis[1].Client(qkey)}
		var mine []string
		for range 2 {
			sb, err := create(ctx, q[0], dsec.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			mine = append(mine, sb.ID)
		}
		_, err = create(ctx, q[0], dsec.CreateOptions{})
		if e := errOf(err); e.Kind != "exhausted" || !strings.Contains(e.Message, "quota of 2 sandboxes") {
			t.Fatalf("third create on the same replica: %+v", e)
		}
		// Replicas learn each other's creates from the nodes' load reports:
		// once etcd has them, the other replica refuses too.
		eventually(t, "the nodes report the project's sandboxes", 10*time.Second, func() error {
			out, err := c.cli("-o", "json", "cluster", "--etcd", c.etcd.URL, "nodes")
			if err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
			var rows []struct {
				Projects map[string]int64 `json:"projects"`
			}
			if err := json.Unmarshal([]byte(out), &rows); err != nil {
				return err
			}
			total := int64(0)
			for _, r := range rows {
				total += r.Projects["quota"]
			}
			if total != 2 {
				return fmt.Errorf("nodes report %d sandboxes of the project", total)
			}
			return nil
		})
		_, err = create(ctx, q[1], dsec.CreateOptions{})
		if e := errOf(err); e.Kind != "exhausted" || !strings.Contains(e.Message, "quota of 2 sandboxes") {
			t.Fatalf("create on the other replica: %+v", e)
		}
		if err := q[1].Delete(ctx, mine[0]); err != nil {
			t.Fatal(err)
		}
		// The node reports the freed slot with its next load (an
		// asynchronous event: it is no cluster write).
		eventually(t, "a freed slot is usable", 10*time.Second, func() error {
			_, err := create(ctx, q[1], dsec.CreateOptions{})
			return err
		})

		if out, err := c.cli("cluster", "--etcd", c.etcd.URL, "project", "set", "quota", "--creates-per-s", "0.2", "--burst", "2"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		// Right away, through any replica.
		_, err1 := create(ctx, q[0], dsec.CreateOptions{})
		_, err2 := create(ctx, q[0], dsec.CreateOptions{})
		if e := errOf(err2); err1 != nil || e.Kind != "exhausted" || !strings.Contains(e.Message, "create rate quota") || e.RetryAfter <= 0 {
			t.Fatalf("two creates right after the rate quota was set: %v, %+v", err1, e)
		}
		if out, err := c.cli("cluster", "--etcd", c.etcd.URL, "project", "rm", "quota"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		if _, err := create(ctx, q[1], dsec.CreateOptions{}); err != nil {
			t.Fatalf("a create right after the quota was removed: %v", err)
		}
	})

	t.Run("an image change through one replica is seen by the next create through the other", func(t *testing.T) {
		registry := startRegistry(t)
		ref := registry + "/dsec/tools:1"
		pushImage(t, ref)
		dsecCLI := func(i int, args ...string) (string, error) {
			return c.cli(append([]string{"--url", c.apis[i].URL, "--api-key", akey}, args...)...)
		}
		for i := range 2 {
			a, b := i, 1-i
			for _, imp := range [][]string{
				{"image", "bootstrap", "busybox", "--name", "fresh"},
				{"image", "import", ref, "--name", "fresh", "--insecure"},
			} {
				if out, err := dsecCLI(a, imp...); err != nil {
					t.Fatalf("%v through replica %d: %v: %s", imp, a, err, out)
				}
				out, err := dsecCLI(b, "create", "--image", "fresh", "--ttl", "10m")
				if err != nil {
					t.Fatalf("create --image fresh through replica %d right after %v through replica %d: %v: %s", b, imp[1], a, err, out)
				}
				id := strings.TrimSpace(out)
				if res, err := c.api(a).Sandbox(id).Exec(ctx, dsec.Cmd("echo ok")); err != nil || strings.TrimSpace(string(res.Stdout)) != "ok" {
					t.Fatalf("exec in the new image's sandbox: %v, %v", res, err)
				}
				if err := c.api(a).Delete(ctx, id); err != nil {
					t.Fatal(err)
				}
				if out, err := dsecCLI(a, "image", "rm", "fresh"); err != nil {
					t.Fatalf("image rm through replica %d: %v: %s", a, err, out)
				}
				out, err = dsecCLI(b, "create", "--image", "fresh")
				if err == nil || !strings.Contains(out, "no image fresh") {
					t.Fatalf("create --image fresh through replica %d right after image rm through replica %d: %v: %s", b, a, err, out)
				}
			}
		}
	})

	t.Run("a removed key is refused through every replica at once", func(t *testing.T) {
		out, err := c.cli("cluster", "--etcd", c.etcd.URL, "key", "add", "alpha")
		if err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		k := strings.TrimSpace(out)
		for i := range c.apis {
			if _, err := c.apis[i].Client(k).List(ctx, ""); err != nil {
				t.Fatalf("replica %d right after key add: %v", i, err)
			}
		}
		if out, err := c.cli("cluster", "--etcd", c.etcd.URL, "key", "rm", k); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		for i := range c.apis {
			if _, err := c.apis[i].Client(k).List(ctx, ""); errOf(err).Kind != "unauthenticated" {
				t.Fatalf("replica %d right after key rm: %v", i, err)
			}
		}
	})

	t.Run("a drained node takes no new sandboxes and keeps its own", func(t *testing.T) {
		if out, err := c.cli("cluster", "--etcd", c.etcd.URL, "drain", "n3"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		for i := range c.apis {
			info, err := c.api(i).Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range info.Nodes {
				if n.Name == "n3" && n.State != "draining" {
					t.Fatalf("replica %d right after the drain: n3 is %s", i, n.State)
				}
			}
		}
		for i := range 6 {
			sb, err := create(ctx, c.api(i%2), dsec.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if sb.Info.Node == "n3" {
				t.Fatalf("placed %s on draining n3", sb.ID)
			}
		}
		for _, id := range ids {
			if nodeOf(id) == "n3" {
				if _, err := c.api(0).Sandbox(id).Exec(ctx, dsec.Cmd("true")); err != nil {
					t.Fatalf("exec on %s of the draining node: %v", id, err)
				}
			}
		}
		// A replica's create that n3 refused while draining fences its key
		// there (the router places it elsewhere): the same create arriving
		// at n3 later (sent by a replica that died) makes nothing, undrained
		// or not.
		late := func() (*dsecv1.CreateResult, error) {
			nd := nodev1connect.NewNodeServiceClient(http.DefaultClient, c.node("n3").URL)
			req := connect.NewRequest(&nodev1.CreateSandboxesRequest{
				Specs: []*dsecv1.SandboxSpec{{Image: "busybox", TtlS: 600}}, IdempotencyKeys: []string{"refused-then-late"}, Project: "alpha",
			})
			req.Header().Set("Authorization", "Bearer "+token)
			resp, err := nd.CreateSandboxes(ctx, req)
			if err != nil {
				return nil, err
			}
			return resp.Msg.GetResult().GetResults()[0], nil
		}
		if r, err := late(); err != nil || r.GetError().GetKind() != "unavailable" || !strings.Contains(r.GetError().GetMessage(), "draining") {
			t.Fatalf("a keyed create sent to draining n3: %v, %v", r, err)
		}
		// Only n3 has rack=r3: refused while it drains, taken at once when
		// undrained, through either replica.
		for i := range c.apis {
			out, err := c.cli("--url", c.apis[i].URL, "--api-key", akey, "create", "--image", "busybox", "--node-selector", "rack=r3")
			if err == nil || !strings.Contains(out, "draining") {
				t.Fatalf("a create only n3 fits, n3 drained, through replica %d: %v: %s", i, err, out)
			}
		}
		if out, err := c.cli("cluster", "--etcd", c.etcd.URL, "undrain", "n3"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		for i := range c.apis {
			out, err := c.cli("--url", c.apis[i].URL, "--api-key", akey, "create", "--image", "busybox", "--ttl", "10m", "--node-selector", "rack=r3")
			if err != nil || nodeOf(strings.TrimSpace(out)) != "n3" {
				t.Fatalf("a create only n3 fits, right after the undrain, through replica %d: %v: %s", i, err, out)
			}
		}
		if r, err := late(); err != nil || r.GetSandbox() != nil || r.GetError().GetKind() != "unavailable" {
			t.Fatalf("the refused keyed create arriving again at n3, undrained: %v, %v", r, err)
		}
	})

	t.Run("a killed node fails fast with infra errors and its sandboxes return with it", func(t *testing.T) {
		var onN2 []string
		for _, id := range ids {
			if nodeOf(id) == "n2" {
				onN2 = append(onN2, id)
			}
		}
		// A stream in flight when the node dies ends with an infra error.
		st, err := c.api(0).Sandbox(onN2[0]).Start(ctx, dsec.Cmd("sleep 600"), false)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		streamErr := make(chan error, 1)
		go func() {
			for {
				if _, err := st.Next(); err != nil {
					streamErr <- err
					return
				}
			}
		}()
		n2 := c.node("n2")
		n2.Kill()
		select {
		case err := <-streamErr:
			if e := errOf(err); !e.Infra || !strings.Contains(e.Message, "node n2") {
				t.Fatalf("the stream in flight ended with %+v", e)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the stream in flight on a killed node hangs")
		}
		for i := range c.apis {
			cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			_, err := c.api(i).Sandbox(onN2[0]).Exec(cctx, dsec.Cmd("true"))
			cancel()
			e := errOf(err)
			if !e.Infra || e.Kind != "unavailable" || !strings.Contains(e.Message, "node n2") {
				t.Fatalf("exec on a killed node's sandbox through replica %d: %+v", i, e)
			}
		}
		eventually(t, "the node's lease expires", 20*time.Second, func() error {
			_, err := c.api(0).Sandbox(onN2[0]).Exec(ctx, dsec.Cmd("true"))
			if e := errOf(err); !strings.Contains(e.Message, "node n2 lost") {
				return err
			}
			return nil
		})
		for i := range 4 {
			sb, err := create(ctx, c.api(i%2), dsec.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if sb.Info.Node == "n2" {
				t.Fatalf("placed %s on lost n2", sb.ID)
			}
		}
		n2.Start()
		for _, id := range onN2 {
			for i := range c.apis {
				eventually(t, "sandbox reachable again", 30*time.Second, func() error {
					_, err := c.api(i).Sandbox(id).Exec(ctx, dsec.Cmd("true"))
					return err
				})
			}
		}
	})

	t.Run("sessions live in etcd and expire on one replica", func(t *testing.T) {
		s, err := c.api(0).OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: "trainer", HeartbeatS: 1, GraceS: 2})
		if err != nil {
			t.Fatal(err)
		}
		sb, err := create(ctx, c.api(1), dsec.CreateOptions{Session: s.Name})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.api(1).Heartbeat(ctx, s.Name); err != nil {
			t.Fatal(err)
		}
		eventually(t, "session expires without heartbeats", 20*time.Second, func() error {
			got, err := c.api(1).Get(ctx, sb.ID)
			if err != nil {
				return err
			}
			if got.State != "paused" {
				return fmt.Errorf("sandbox %s", got.State)
			}
			return nil
		})
		re, err := c.api(1).OpenSession(ctx, &dsecv1.OpenSessionRequest{Name: "trainer", HeartbeatS: 1, GraceS: 2})
		if err != nil || re.Resumed != 1 {
			t.Fatalf("reopen: %v, %v", re, err)
		}
		if _, err := c.api(0).CloseSession(ctx, "trainer", true); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("with etcd down routed calls work and placements are refused, then resume", func(t *testing.T) {
		// A stream open across the outage keeps working through it.
		st, err := c.api(0).Sandbox(ids[0]).Start(ctx, dsec.Cmd("cat"), true)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		echo := func(msg string) {
			t.Helper()
			if err := stdin(ctx, c.api(1), ids[0], st.ProcessID, []byte(msg), false); err != nil {
				t.Fatal(err)
			}
			ev, err := st.Next()
			if err != nil || string(ev.GetStdout()) != msg {
				t.Fatalf("echo of %q: %v, %v", msg, ev, err)
			}
		}
		echo("before\n")
		c.etcd.Kill()
		eventually(t, "creates refused with a clear infra error", 20*time.Second, func() error {
			_, err := create(ctx, c.api(0), dsec.CreateOptions{})
			if e := errOf(err); !e.Infra || !strings.Contains(e.Message, "etcd") {
				return fmt.Errorf("create: %+v", e)
			}
			return nil
		})
		for _, id := range ids[:3] {
			for i := range c.apis {
				if _, err := c.api(i).Sandbox(id).Exec(ctx, dsec.Cmd("true")); err != nil {
					t.Fatalf("exec on %s through replica %d with etcd down: %v", id, i, err)
				}
			}
		}
		echo("during\n")
		c.etcd.Start()
		eventually(t, "creates work again", 30*time.Second, func() error {
			_, err := create(ctx, c.api(1), dsec.CreateOptions{})
			return err
		})
		echo("after\n")
	})
}

// startRegistry serves an OCI registry (in memory) on loopback for t and
// returns its host:port.
func startRegistry(t *testing.T) string {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// pushImage pushes an image of one layer, the host's static busybox as
// /bin/busybox and /bin/sh, to ref.
func pushImage(t *testing.T, ref string) {
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(bb))})
	tw.Write(bb)
	tw.WriteHeader(&tar.Header{Name: "bin/sh", Typeflag: tar.TypeSymlink, Linkname: "busybox"})
	tw.Close()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config.Cmd = "linux", runtime.GOARCH, []string{"/bin/sh"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
}

// hwm is a process's peak resident memory in bytes.
func hwm(t *testing.T, pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
