package metrics

import (
	"context"
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/opendsec/dsec/internal/errdefs"
)

func TestOutcomeSeparatesTheCallersFailuresFromThePlatforms(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		err  error
		ctx  context.Context
		want string
	}{
		{nil, context.Background(), OK},
		{errdefs.NotFound("sandbox x not found"), context.Background(), Failed},
		{errdefs.Invalid("bad spec"), context.Background(), Failed},
		// Capacity is the platform's: a full node is retryable infra.
		{errdefs.Exhausted(time.Second, "node full"), context.Background(), Infra},
		{errdefs.Unavailable("node lost").AsInfra(), context.Background(), Infra},
		{errdefs.Internal(errors.New("boom"), "create"), context.Background(), Infra},
		{context.Canceled, context.Background(), Canceled},
		// A call whose caller hung up is canceled whatever it ended with.
		{errdefs.Internal(errors.New("broken pipe"), "exec"), ctx, Canceled},
	} {
		if got := canceledOrOutcome(c.ctx, c.err); got != c.want {
			t.Errorf("outcome of %v = %s, want %s", c.err, got, c.want)
		}
	}
}

func TestANilNodeRecordsNothing(t *testing.T) {
	var m *Node
	err := errors.New("x")
	m.Observe(context.Background(), OpExec, "container", time.Now(), &err)
	m.Ended("container", "deleted")
	m.PoolClaim("container", true)
	m.Refused("full")
	m.Logged(true)
}

func TestNodeSeriesAreLabelledWithoutSandboxesAndLintClean(t *testing.T) {
	reg := NewRegistry("test")
	m := NewNode(reg, func() NodeState {
		return NodeState{Sandboxes: map[[2]string]int{{"container", "running"}: 3}, MaxSandboxes: 10, CPUs: 2}
	})
	NewAPI(reg)
	err := error(nil)
	m.Observe(context.Background(), OpCreate, "container", time.Now(), &err)
	if n := testutil.ToFloat64(m.refused.WithLabelValues("full")); n != 0 {
		t.Errorf("refusals start at %v", n)
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP dsec_sandboxes Live sandboxes on this node by kind and state.
# TYPE dsec_sandboxes gauge
dsec_sandboxes{kind="container",state="running"} 3
`), "dsec_sandboxes"); err != nil {
		t.Error(err)
	}
}

// BenchmarkObserve is what metrics add to every sandbox call: the
// operation's histogram and the API's interceptor histogram.
func BenchmarkObserve(b *testing.B) {
	reg := prometheus.NewRegistry()
	m := NewNode(reg, func() NodeState { return NodeState{} })
	api := NewAPI(reg)
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		var err error
		for pb.Next() {
			start := time.Now()
			m.Observe(ctx, OpExec, "container", start, &err)
			api.rpcDone("/dsec.v1.ProcessService/Exec", start, nil)
		}
	})
}

// TestEveryMetricIsDocumented: docs/observability.md lists every dsec_
// metric a process can serve (the operators' reference for dashboards and
// alerts), so a metric added without a line there fails here.
func TestEveryMetricIsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	// Every collector the servers register, described (a vector with no
	// series yet is not gathered, but it is described).
	rec := &recorder{Registry: NewRegistry("test")}
	NewNode(rec, func() NodeState { return NodeState{} })
	NewAPI(rec)
	descs := make(chan *prometheus.Desc, 256)
	for _, c := range rec.collectors {
		c.Describe(descs)
	}
	close(descs)
	fqName := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{"dsec_build_info": true}
	for d := range descs {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			names[m[1]] = true
		}
	}
	if len(names) < 15 {
		t.Fatalf("only %d metrics described: %v", len(names), names)
	}
	for name := range names {
		if !strings.Contains(string(doc), "`"+name) {
			t.Errorf("%s is not in docs/observability.md", name)
		}
	}
}

// recorder keeps the collectors registered through it.
type recorder struct {
	*Registry
	collectors []prometheus.Collector
}

func (r *recorder) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return r.Registry.Register(c)
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}
