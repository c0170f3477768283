// Package metrics holds dsec's Prometheus metrics: one registry per server
// process (`dsec serve`, `dsec api`, `dsec node`), the node's metrics
// (sandbox operations, ends, warm pools, admission, images, trajectory
// logs, sandboxes by kind and state) and the API's (every procedure of the
// native API, placement and routing in a cluster), served at /metrics.
//
// Names follow Prometheus conventions: a dsec_ prefix, base units
// (seconds, bytes), _total on counters. No label names a sandbox, a
// project, a key or an image: every label value comes from a small fixed
// set, so a node with 5,000 sandboxes has as many series as one with none.
package metrics

import (
	"context"
	"net/http"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/opendsec/dsec/internal/errdefs"
)

const namespace = "dsec"

// Outcomes: the outcome label of a call.
const (
	// OK is a call that did what it was asked.
	OK = "ok"
	// Failed is a call refused or failed for its caller's or its
	// workload's reason (invalid, not found, a conflict): the platform
	// worked.
	Failed = "error"
	// Infra is a call the platform failed or had no capacity for
	// (errdefs' infra errors, exhausted included): a trainer masks the
	// rollout.
	Infra = "infra"
	// Canceled is a call its caller gave up on.
	Canceled = "canceled"
)

// Outcome is err's outcome label.
func Outcome(err error) string {
	switch {
	case err == nil:
		return OK
	case errdefs.IsInfra(err):
		return Infra
	case errdefs.Is(err, errdefs.KindCanceled):
		return Canceled
	default:
		return Failed
	}
}

// Registry is one process's metrics: the Go runtime's and the process's,
// dsec_build_info, and whatever the process's parts register.
type Registry struct{ *prometheus.Registry }

// NewRegistry returns a registry with the runtime, process and build
// information collectors registered.
func NewRegistry(version string) *Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	goVersion := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		goVersion = bi.GoVersion
	}
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "build_info",
		Help:        "The dsec build serving: always 1, its version in labels.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": goVersion},
	})
	info.Set(1)
	r.MustRegister(info)
	return &Registry{r}
}

// Handler serves the registry in the Prometheus text or protobuf format,
// as the scraper asks. A collector that fails is logged by the handler
// and the rest is still served.
func (r *Registry) Handler() http.Handler {
	return promhttp.HandlerFor(r.Registry, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError, Registry: r.Registry})
}

// durations are the buckets of call latencies: from a 1 ms exec to a
// full VM's minute-long cold boot.
var durations = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120}

// stepDurations are the buckets of parts of a create, from 100 µs.
var stepDurations = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

// canceledOrOutcome classifies err, counting a call whose context ended
// as canceled whatever error it ended with.
func canceledOrOutcome(ctx context.Context, err error) string {
	if err != nil && ctx.Err() == context.Canceled {
		return Canceled
	}
	return Outcome(err)
}
