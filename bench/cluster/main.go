// Command cluster measures the control plane of a cluster at DSec's scale:
// simulated nodes (internal/cluster/clustertest: real etcd membership with
// leases and rate-bounded load reports, sandboxes that start at once)
// behind one real `dsec api` replica, driven over Connect from this
// process. It prints placements per second and create latency through the
// replica (single creates, batches, creates with idempotency keys), the
// same creates sent straight to nodes as the baseline (the ratio is the
// replica's cost), placement decisions per second on a 160-node view, and
// how etcd writes grow with the node count.
//
//	go run ./bench/cluster [-nodes 160] [-duration 5s] [-concurrency 64] [-batch 100]
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/api/dsec/node/v1/nodev1connect"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/cluster/clustertest"
	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/placement"
	dsec "github.com/opendsec/dsec/sdk/go"
)

const token = "bench-cluster-token"

var etcdURL string

var (
	maxNodes    = flag.Int("nodes", 160, "simulated nodes (measured at a quarter, half and all of them)")
	duration    = flag.Duration("duration", 5*time.Second, "length of each measured run")
	concurrency = flag.Int("concurrency", 64, "creates in flight")
	batch       = flag.Int("batch", 100, "sandboxes per CreateSandboxes call in the batch run")
	profile     = flag.String("profile", "", "write the replica's CPU profile of the last single-create run to this file")
)

func main() {
	flag.Parse()
	p := dsectest.Program()
	defer p.Close()
	etcd := dsectest.StartEtcd(p)
	etcdURL = etcd.URL
	quiet := slog.New(slog.DiscardHandler)
	store, err := cluster.Open(cluster.Config{Endpoints: []string{etcd.URL}}, quiet)
	if err != nil {
		p.Fatal(err)
	}
	defer store.Close()

	fmt.Printf("placement decisions on a 160-node view: %s\n", pickRate())
	fmt.Printf("%-6s  %-26s  %12s  %9s  %9s  %14s  %16s  %s\n", "nodes", "run", "placements/s", "p50", "p99", "etcd writes/s", "node writes/s/node", "replica CPU per placement")
	var nodes []*clustertest.Node
	var api *dsectest.Proc
	for _, n := range []int{*maxNodes / 4, *maxNodes / 2, *maxNodes} {
		for len(nodes) < n {
			node, err := clustertest.Start(store, clustertest.Config{Name: fmt.Sprintf("sim%03d", len(nodes)), Token: token, MaxSandboxes: 1 << 20}, quiet)
			if err != nil {
				p.Fatal(err)
			}
			defer node.Close()
			nodes = append(nodes, node)
		}
		if api == nil {
			args := []string{"--log-level", "warn"}
			if *profile != "" {
				debugAddr = freeAddr(p)
				args = append(args, "--debug-listen", debugAddr)
			}
			api = dsectest.StartAPI(p, etcd, dsectest.APIOptions{Token: token, Args: args})
		}
		c := dsec.New(api.URL)
		waitNodes(p, c, n)
		apiPid = api.Pid()
		time.Sleep(2 * time.Second) // the new nodes' first publications settle

		w0, e0 := writes(nodes), proposals(etcd.URL)
		lastCPU = cpuTime(apiPid)
		time.Sleep(*duration)
		row(n, "idle", 0, nil, nodes, w0, e0)

		w0, e0 = writes(nodes), proposals(etcd.URL)
		lastCPU = cpuTime(apiPid)
		var prof chan struct{}
		if *profile != "" && n == *maxNodes {
			prof = cpuProfile(p, *profile)
		}
		count, lat := drive(*concurrency, func(ctx context.Context, i int) (int, error) {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox"})
			return 1, err
		})
		if prof != nil {
			<-prof
		}
		row(n, "create", count, lat, nodes, w0, e0)
		single := float64(count) / duration.Seconds()

		w0, e0 = writes(nodes), proposals(etcd.URL)
		lastCPU = cpuTime(apiPid)
		raw := c.Raw()
		count, lat = drive(max(1, *concurrency/16), func(ctx context.Context, i int) (int, error) {
			resp, err := raw.CreateSandboxes(ctx, connect.NewRequest(&dsecv1.CreateSandboxesRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}, Count: int32(*batch)}))
			if err != nil {
				return 0, err
			}
			if resp.Msg.Failed > 0 {
				return int(resp.Msg.Created), fmt.Errorf("%d items failed", resp.Msg.Failed)
			}
			return int(resp.Msg.Created), nil
		})
		row(n, fmt.Sprintf("batch of %d", *batch), count, lat, nodes, w0, e0)

		w0, e0 = writes(nodes), proposals(etcd.URL)
		lastCPU = cpuTime(apiPid)
		var seq atomic.Int64
		count, lat = drive(*concurrency, func(ctx context.Context, i int) (int, error) {
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", IdempotencyKey: fmt.Sprintf("bench-%d-%d", n, seq.Add(1))})
			return 1, err
		})
		row(n, "create, idempotency key", count, lat, nodes, w0, e0)

		// Baseline: the same creates sent straight to the nodes.
		direct := make([]nodev1connect.NodeServiceClient, len(nodes))
		hc := &http.Client{Transport: h2c()}
		for i, node := range nodes {
			direct[i] = nodev1connect.NewNodeServiceClient(hc, "http://"+node.Addr, connect.WithInterceptors(bearer(token)))
		}
		w0, e0 = writes(nodes), proposals(etcd.URL)
		lastCPU = cpuTime(apiPid)
		count, lat = drive(*concurrency, func(ctx context.Context, i int) (int, error) {
			_, err := direct[i%len(direct)].CreateSandboxes(ctx, connect.NewRequest(&nodev1.CreateSandboxesRequest{Specs: []*dsecv1.SandboxSpec{{Image: "busybox"}}, Project: "default"}))
			return 1, err
		})
		row(n, "baseline: straight to nodes", count, lat, nodes, w0, e0)
		fmt.Printf("%-6d  %-26s  %.2f× the baseline's rate\n", n, "create via the replica", single/(float64(count)/duration.Seconds()))
	}
}

// drive runs f from workers for the run's duration and returns how many
// placements succeeded and each call's latency.
func drive(workers int, f func(ctx context.Context, i int) (int, error)) (int, []time.Duration) {
	// Calls run without the run's deadline (one cut short would fail);
	// only those that finish in the run count.
	end := time.Now().Add(*duration)
	ctx := context.Background()
	var (
		mu    sync.Mutex
		lat   []time.Duration
		count atomic.Int64
		fails atomic.Int64
		first atomic.Pointer[error]
		wg    sync.WaitGroup
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			for i := w; time.Now().Before(end); i += workers {
				t0 := time.Now()
				n, err := f(ctx, i)
				if time.Now().After(end) {
					break
				}
				mine = append(mine, time.Since(t0))
				count.Add(int64(n))
				if err != nil {
					fails.Add(1)
					first.CompareAndSwap(nil, &err)
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	if f := fails.Load(); f > 0 {
		fmt.Fprintf(os.Stderr, "  %d calls failed, first: %v\n", f, *first.Load())
	}
	return int(count.Load()), lat
}

// row prints one run: placements/s, call latency, and etcd writes — by
// the nodes (per node) and in all (every client's writes, from etcd).
func row(nodes int, run string, count int, lat []time.Duration, sims []*clustertest.Node, w0 int64, e0 float64) {
	secs := duration.Seconds()
	cpu := cpuTime(apiPid) - lastCPU
	lastCPU = cpuTime(apiPid)
	w := float64(writes(sims)-w0) / secs
	e := (proposals(etcdURL) - e0) / secs
	p50, p99 := "-", "-"
	if len(lat) > 0 {
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		p50 = lat[len(lat)/2].Round(10 * time.Microsecond).String()
		p99 = lat[len(lat)*99/100].Round(10 * time.Microsecond).String()
	}
	perCall := "-"
	if count > 0 && !strings.HasPrefix(run, "baseline") {
		us := float64(cpu.Microseconds()) / float64(count)
		perCall = fmt.Sprintf("%.0fµs (%.0f/s per core)", us, 1e6/us)
	}
	fmt.Printf("%-6d  %-26s  %12.0f  %9s  %9s  %14.1f  %16.3f  %s\n", nodes, run, float64(count)/secs, p50, p99, e, w/float64(nodes), perCall)
}

var (
	apiPid  int
	lastCPU time.Duration
)

// cpuTime is a process's user and system CPU time (the replica runs as
// one process: `dsec api` does not re-execute itself).
func cpuTime(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100 // USER_HZ
}

// writes sums the simulated nodes' etcd writes.
func writes(nodes []*clustertest.Node) int64 {
	var n int64
	for _, s := range nodes {
		n += s.Writes()
	}
	return n
}

// proposals reads etcd's committed proposals (every write of every client).
func proposals(url string) float64 {
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "etcd_server_proposals_committed_total "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

func waitNodes(p *dsectest.ProgramTB, c *dsec.Client, n int) {
	deadline := time.Now().Add(time.Minute)
	for {
		info, err := c.Info(context.Background())
		if err == nil && len(info.Nodes) == n {
			return
		}
		if time.Now().After(deadline) {
			p.Fatalf("the replica sees %d nodes, want %d (%v)", len(info.GetNodes()), n, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// pickRate measures placement decisions on a synthetic 160-node view.
func pickRate() string {
	var view []*placement.Node
	for i := range 160 {
		view = append(view, &placement.Node{
			Name: fmt.Sprintf("n%d", i), Kinds: map[string]bool{"container": true}, Images: map[string]bool{"busybox": true},
			Sandboxes: int64(i % 50), MaxSandboxes: 1 << 20, Incarnation: "i",
		})
	}
	pl := placement.New(placement.Config{})
	r := testing.Benchmark(func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			res, err := pl.Pick(view, placement.Request{Kind: "container", Image: "busybox", Project: "p"})
			if err != nil {
				b.Fatal(err)
			}
			res.Done(false, "", 0)
		}
	})
	return fmt.Sprintf("%.0f/s on one core (%s per decision)", 1e9/float64(r.NsPerOp()), time.Duration(r.NsPerOp()))
}

// h2c is a cleartext HTTP/2 transport, as the replica uses to nodes.
func h2c() *http.Transport {
	t := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Protocols = new(http.Protocols)
	t.Protocols.SetUnencryptedHTTP2(true)
	return t
}

// bearer sends the cluster token.
func bearer(token string) connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("Authorization", "Bearer "+token)
			return next(ctx, req)
		}
	})
}

var debugAddr string

func freeAddr(p *dsectest.ProgramTB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		p.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// cpuProfile fetches the replica's CPU profile over the run into file.
func cpuProfile(p *dsectest.ProgramTB, file string) chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		secs := max(1, int(duration.Seconds())-1)
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", debugAddr, secs))
		if err != nil {
			fmt.Fprintln(os.Stderr, "profile:", err)
			return
		}
		defer resp.Body.Close()
		f, err := os.Create(file)
		if err != nil {
			fmt.Fprintln(os.Stderr, "profile:", err)
			return
		}
		defer f.Close()
		io.Copy(f, resp.Body)
	}()
	return done
}
