package metrics

import (
	"context"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// API is an API server's metrics: every call of the native API by
// procedure and code, every request of the HTTP surfaces (E2B,
// SandboxFusion, file transfer) by route and status, and in a cluster the
// control plane's placement decisions and routing failures. A nil *API
// records nothing.
type API struct {
	rpc        *prometheus.HistogramVec
	http       *prometheus.HistogramVec
	placements *prometheus.CounterVec
	routing    *prometheus.CounterVec
	webhooks   *prometheus.CounterVec
	sessions   *prometheus.CounterVec
}

// NewAPI registers an API server's metrics on r.
func NewAPI(r prometheus.Registerer) *API {
	m := &API{
		rpc: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "api", Name: "rpc_duration_seconds",
			Help:    "Calls of the native API by procedure and Connect code (ok for success), and how long they took (a stream: until it ended).",
			Buckets: durations,
		}, []string{"procedure", "code"}),
		http: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "api", Name: "http_request_duration_seconds",
			Help:    "Requests of the HTTP surfaces (the E2B and SandboxFusion APIs, file transfer, sandbox ports) by route and HTTP status, and how long they took.",
			Buckets: durations,
		}, []string{"handler", "method", "code"}),
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "cluster", Name: "placements_total",
			Help: "Creates the control plane placed, by result: placed (on the first node chosen), retried (on another node after one refused) or failed (no node took it, or the create itself failed).",
		}, []string{"result"}),
		routing: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "cluster", Name: "routing_errors_total",
			Help: "Calls the control plane could not route to their node, by reason: unknown_node (the ID names no node of the cluster) or lost (the node is gone from the cluster's view).",
		}, []string{"reason"}),
		webhooks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "api", Name: "webhook_deliveries_total",
			Help: "Deliveries to the webhooks registered through the API (WebhookService, E2B's /events/webhooks) by result: delivered, retried (a try failed; another follows), failed (given up after its tries, or refused by the receiver), lost (the receiver fell too far behind).",
		}, []string{"result"}),
		sessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "session", Name: "expiries_total",
			Help: "Trainer sessions that expired (their heartbeats stopped past the grace) by the action taken on their sandboxes: pause or delete. In a cluster, counted by the replica that expires sessions.",
		}, []string{"action"}),
	}
	r.MustRegister(m.rpc, m.http, m.placements, m.routing, m.webhooks, m.sessions)
	for _, a := range []string{"pause", "delete"} {
		m.sessions.WithLabelValues(a)
	}
	return m
}

// SessionExpired counts a session's expiry.
func (m *API) SessionExpired(action string) {
	if m != nil {
		m.sessions.WithLabelValues(action).Inc()
	}
}

// Interceptor times every call of the Connect services it is given to.
func (m *API) Interceptor() connect.Interceptor { return interceptor{m} }

type interceptor struct{ m *API }

func (i interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		start := time.Now()
		res, err := next(ctx, req)
		i.m.rpcDone(req.Spec().Procedure, start, err)
		return res, err
	}
}

func (i interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		err := next(ctx, conn)
		i.m.rpcDone(conn.Spec().Procedure, start, err)
		return err
	}
}

func (m *API) rpcDone(procedure string, start time.Time, err error) {
	code := "ok"
	if err != nil {
		code = connect.CodeOf(err).String() // unknown for an unmapped error
	}
	m.rpc.WithLabelValues(procedure, code).Observe(time.Since(start).Seconds())
}

// Handler times h's requests under the route name handler.
func (m *API) Handler(handler string, h http.Handler) http.Handler {
	if m == nil {
		return h
	}
	return promhttp.InstrumentHandlerDuration(m.http.MustCurryWith(prometheus.Labels{"handler": handler}), h)
}

// Placement results.
const (
	Placed      = "placed"
	PlacedRetry = "retried"
	PlaceFailed = "failed"
)

// Placement counts a placement decision.
func (m *API) Placement(result string) {
	if m != nil {
		m.placements.WithLabelValues(result).Inc()
	}
}

// Webhook counts a delivery's result to a registered webhook.
func (m *API) Webhook(result string) {
	if m != nil {
		m.webhooks.WithLabelValues(result).Inc()
	}
}

// RoutingError counts a call that could not reach its sandbox's node.
func (m *API) RoutingError(reason string) {
	if m != nil {
		m.routing.WithLabelValues(reason).Inc()
	}
}
