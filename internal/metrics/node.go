package metrics

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Operations: the operation label of dsec_sandbox_operation_duration_seconds.
// Every surface (the native API, E2B, SandboxFusion, the SDKs) reaches a
// sandbox through the node, so each call is counted once, here.
const (
	OpCreate  = "create"
	OpDelete  = "delete"
	OpExec    = "exec"     // exec, streamed exec and background processes
	OpFile    = "file"     // every file call: read, write, list, stat, ...
	OpRunCode = "run_code" // a function call (SandboxFusion's run_code)
	// OpRunCodeBatch is a batch of function calls, counted once.
	OpRunCodeBatch = "run_code_batch"
	OpPause        = "pause"
	OpResume       = "resume"
	OpSnapshot     = "snapshot"
	OpFork         = "fork"
)

// Node is a node agent's metrics. The zero value is not usable; a nil
// *Node records nothing (tests build nodes without metrics).
type Node struct {
	ops       *prometheus.HistogramVec
	ends      *prometheus.CounterVec
	pool      *prometheus.CounterVec
	refused   *prometheus.CounterVec
	images    *prometheus.HistogramVec
	imageRead prometheus.Counter
	logged    *prometheus.CounterVec
	replayed  *prometheus.CounterVec
	webhooks  *prometheus.CounterVec
	models    *prometheus.HistogramVec
	tokens    *prometheus.CounterVec
	phases    *prometheus.HistogramVec
	steps     *prometheus.HistogramVec
}

// Create phases (CreatePhase): where a create's time goes on the node.
const (
	PhaseWait     = "wait"     // for a start slot
	PhaseNetwork  = "network"  // the sandbox's network (namespace, veth, rules)
	PhaseInstance = "instance" // the substrate's start: runtime or VM, to the agent's first answer
	PhaseCommit   = "commit"   // the record made durable and the sandbox live
)

// NodeState is what a scrape reads of a node's state at that moment.
type NodeState struct {
	// Sandboxes counts live sandboxes by kind and state.
	Sandboxes map[[2]string]int
	// Starting counts admitted creates still starting; Queued those
	// waiting for a start slot; StartSlots is the slots' number.
	Starting, Queued, StartSlots int
	// MaxSandboxes is the admission limit.
	MaxSandboxes int
	// Pooled counts started sandboxes waiting in warm pools, by kind.
	Pooled map[string]int
	// CPUs and MemoryBytes are what the node offers sandboxes.
	CPUs        float64
	MemoryBytes int64
}

// NewNode registers a node's metrics on r; state is called on every
// scrape (it must be cheap and safe to call concurrently).
func NewNode(r prometheus.Registerer, state func() NodeState) *Node {
	m := &Node{
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "sandbox", Name: "operation_duration_seconds",
			Help:    "Sandbox operations on this node by operation, sandbox kind and outcome (ok; error: the caller's or the workload's; infra: the platform's; canceled), and how long they took.",
			Buckets: durations,
		}, []string{"operation", "kind", "outcome"}),
		ends: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "sandbox", Name: "ends_total",
			Help: "Sandboxes that ended on this node, by kind and cause (deleted, session_expired, ttl, idle_ttl, paused_ttl, workload_exit, oom, died, pause_failed, node_down).",
		}, []string{"kind", "cause"}),
		pool: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "warm_pool_claims_total",
			Help: "Creates that matched a warm pool's shape, by kind and result: hit (took a started sandbox) or miss (the pool was empty).",
		}, []string{"kind", "result"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "admission_refusals_total",
			Help: "Creates the node refused before starting them, by reason: full (the sandbox limit), queue_full (the start queue), queue_timeout (no start slot before the deadline).",
		}, []string{"reason"}),
		images: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "image", Name: "operation_duration_seconds",
			Help:    "Image pulls, bootstraps and uploads by operation and outcome, and how long they took.",
			Buckets: []float64{.1, .5, 1, 5, 10, 30, 60, 120, 300, 600, 1800},
		}, []string{"operation", "outcome"}),
		imageRead: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "image", Name: "upload_bytes_total",
			Help: "Bytes of image archives and VM disks uploaded to the node.",
		}),
		logged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "trajectory", Name: "entries_total",
			Help: "Calls the trajectory logs recorded, by how they were answered: run (executed and recorded) or replayed (answered from the log: a resumed trainer fast-forwarding).",
		}, []string{"result"}),
		replayed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "trajectory", Name: "replays_total",
			Help: "Replays of a trajectory log into a new sandbox by outcome.",
		}, []string{"outcome"}),
	}
	m.webhooks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "webhook_deliveries_total",
		Help: "Webhook deliveries of lifecycle events by result: delivered, retried (a try failed; another follows), failed (given up after its tries, or refused by the receiver), lost (the receiver fell too far behind).",
	}, []string{"result"})
	m.models = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: "model_gateway", Name: "call_duration_seconds",
		Help:    "Model calls through the gateway by outcome (ok; replayed: answered from a recorded log; error: the request's own, or refused; infra: the upstream or the platform failed; canceled: the agent went away) and how long they took.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600},
	}, []string{"outcome"})
	m.tokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: "model_gateway", Name: "tokens_total",
		Help: "Tokens of the model calls the upstreams answered, by type: prompt or completion (replayed calls are not counted).",
	}, []string{"type"})
	m.phases = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: "sandbox", Name: "create_phase_duration_seconds",
		Help:    "Where creates' time goes on this node, by sandbox kind and phase: wait (for a start slot), network, instance (the substrate's start, to the agent's first answer), commit (the record made durable). Warm pools' starts are counted too.",
		Buckets: durations,
	}, []string{"kind", "phase"})
	m.steps = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: "sandbox", Name: "start_step_duration_seconds",
		Help:    "The steps of the instance phase of creates on this node, by sandbox kind and step, as the substrate reports them (container: prepare, mount, files, cgroups, spec, runtime, init).",
		Buckets: stepDurations,
	}, []string{"kind", "step"})
	r.MustRegister(m.ops, m.ends, m.pool, m.refused, m.images, m.imageRead, m.logged, m.replayed, m.webhooks, m.models, m.tokens, m.phases, m.steps, stateCollector(state))
	// Series whose label values are known start at zero, so a rate over
	// them is defined from the first scrape.
	for _, reason := range []string{"full", "queue_full", "queue_timeout"} {
		m.refused.WithLabelValues(reason)
	}
	for _, result := range []string{"run", "replayed"} {
		m.logged.WithLabelValues(result)
	}
	for _, o := range []string{"ok", "replayed", "error", "infra", "canceled"} {
		m.models.WithLabelValues(o)
	}
	for _, typ := range []string{"prompt", "completion"} {
		m.tokens.WithLabelValues(typ)
	}
	return m
}

// CreatePhase records how long one phase of a create of kind took since
// start.
func (m *Node) CreatePhase(kind, phase string, start time.Time) {
	if m == nil {
		return
	}
	m.phases.WithLabelValues(kind, phase).Observe(time.Since(start).Seconds())
}

// StartStep records that one step of a substrate's start of a sandbox of
// kind took took (substrate.Step).
func (m *Node) StartStep(kind, step string, took time.Duration) {
	if m == nil {
		return
	}
	m.steps.WithLabelValues(kind, step).Observe(took.Seconds())
}

// Observe records one operation on a sandbox of kind that started at
// start and ended with err. Call it deferred:
//
//	defer m.Observe(ctx, metrics.OpExec, kind, time.Now(), &err)
func (m *Node) Observe(ctx context.Context, op, kind string, start time.Time, err *error) {
	if m == nil {
		return
	}
	if kind == "" {
		kind = "unknown" // the sandbox was not found
	}
	m.ops.WithLabelValues(op, kind, canceledOrOutcome(ctx, *err)).Observe(time.Since(start).Seconds())
}

// Ended counts a sandbox of kind that ended for cause.
func (m *Node) Ended(kind, cause string) {
	if m != nil {
		m.ends.WithLabelValues(kind, cause).Inc()
	}
}

// PoolClaim counts a create that matched a warm pool: hit when it took a
// started sandbox.
func (m *Node) PoolClaim(kind string, hit bool) {
	if m == nil {
		return
	}
	result := "miss"
	if hit {
		result = "hit"
	}
	m.pool.WithLabelValues(kind, result).Inc()
}

// Refused counts a create refused at admission for reason.
func (m *Node) Refused(reason string) {
	if m != nil {
		m.refused.WithLabelValues(reason).Inc()
	}
}

// Image records an image operation: pull, bootstrap or upload.
func (m *Node) Image(op string, start time.Time, err error) {
	if m != nil {
		m.images.WithLabelValues(op, Outcome(err)).Observe(time.Since(start).Seconds())
	}
}

// ImageBytes counts uploaded image bytes.
func (m *Node) ImageBytes(n int64) {
	if m != nil && n > 0 {
		m.imageRead.Add(float64(n))
	}
}

// Logged counts a call the trajectory log recorded; replayed when it was
// answered from the log.
func (m *Node) Logged(replayed bool) {
	if m == nil {
		return
	}
	result := "run"
	if replayed {
		result = "replayed"
	}
	m.logged.WithLabelValues(result).Inc()
}

// ModelCall records a model call through the gateway: its outcome (see
// the metric's help), how long it took and the upstream's tokens.
func (m *Node) ModelCall(outcome string, d time.Duration, prompt, completion int64) {
	if m == nil {
		return
	}
	m.models.WithLabelValues(outcome).Observe(d.Seconds())
	if outcome != "replayed" {
		m.tokens.WithLabelValues("prompt").Add(float64(prompt))
		m.tokens.WithLabelValues("completion").Add(float64(completion))
	}
}

// Webhook counts a webhook delivery's result.
func (m *Node) Webhook(result string) {
	if m != nil {
		m.webhooks.WithLabelValues(result).Inc()
	}
}

// Replay counts a replay of a trajectory log.
func (m *Node) Replay(err error) {
	if m != nil {
		m.replayed.WithLabelValues(Outcome(err)).Inc()
	}
}

// state is the collector of NodeState's gauges, read at each scrape.
type state struct {
	read                                      func() NodeState
	sandboxes, starting, queued, slots, limit *prometheus.Desc
	pooled, cpus, memory                      *prometheus.Desc
}

func stateCollector(read func() NodeState) *state {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, labels, nil)
	}
	return &state{
		read:      read,
		sandboxes: d("sandboxes", "Live sandboxes on this node by kind and state.", "kind", "state"),
		starting:  d("sandbox_starts_in_flight", "Admitted creates still starting."),
		queued:    d("admission_queue_depth", "Creates waiting for a start slot."),
		slots:     d("admission_start_slots", "Sandbox starts the node runs at once."),
		limit:     d("sandboxes_max", "The node's admission limit: live and starting sandboxes at most."),
		pooled:    d("warm_pool_sandboxes", "Started sandboxes waiting in warm pools, by kind.", "kind"),
		cpus:      d("node_capacity_cpus", "CPUs the node offers sandboxes."),
		memory:    d("node_capacity_memory_bytes", "Memory the node offers sandboxes."),
	}
}

func (s *state) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{s.sandboxes, s.starting, s.queued, s.slots, s.limit, s.pooled, s.cpus, s.memory} {
		ch <- d
	}
}

func (s *state) Collect(ch chan<- prometheus.Metric) {
	st := s.read()
	for k, n := range st.Sandboxes {
		ch <- prometheus.MustNewConstMetric(s.sandboxes, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
	for k, n := range st.Pooled {
		ch <- prometheus.MustNewConstMetric(s.pooled, prometheus.GaugeValue, float64(n), k)
	}
	ch <- prometheus.MustNewConstMetric(s.starting, prometheus.GaugeValue, float64(st.Starting))
	ch <- prometheus.MustNewConstMetric(s.queued, prometheus.GaugeValue, float64(st.Queued))
	ch <- prometheus.MustNewConstMetric(s.slots, prometheus.GaugeValue, float64(st.StartSlots))
	ch <- prometheus.MustNewConstMetric(s.limit, prometheus.GaugeValue, float64(st.MaxSandboxes))
	ch <- prometheus.MustNewConstMetric(s.cpus, prometheus.GaugeValue, st.CPUs)
	ch <- prometheus.MustNewConstMetric(s.memory, prometheus.GaugeValue, float64(st.MemoryBytes))
}
