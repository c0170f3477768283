package node

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
)

// sample returns the value of the series name{labels} in reg: a counter's
// or gauge's value, a histogram's count; -1 when there is no such series.
func sample(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			if len(got) != len(labels) {
				continue
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				return m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				return m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return -1
}

// op is the labels of one operation series.
func op(operation, kind, outcome string) map[string]string {
	return map[string]string{"operation": operation, "kind": kind, "outcome": outcome}
}

func TestMetricsCountEveryCallOnceByKindAndOutcome(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	tn := newTestNode(t, func(c *Config, _ *substratetest.Fake) {
		c.Metrics = reg
		c.MaxSandboxes = 2
	})
	const ops = "dsec_sandbox_operation_duration_seconds"
	a := tn.create(bg, nil)
	x := tn.create(bg, nil)
	if _, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox"}}); !errdefs.Is(err, errdefs.KindExhausted) {
		t.Fatalf("a create beyond the node's limit: %v, want exhausted", err)
	}
	if err := tn.Delete(bg, x.Id); err != nil {
		t.Fatal(err)
	}
	b := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 1})
	if _, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "no-such-image"}}); err == nil {
		t.Fatal("a create of an unknown image succeeded")
	}
	for range 3 {
		tn.sh(bg, a.Id, "true")
	}
	if r, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: a.Id, Cmd: "exit 7"}); err != nil || r.ExitCode != 7 {
		t.Fatalf("exec of exit 7: %v, %v", r, err)
	}
	if _, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: "nosuchsandboxxxx-test", Cmd: "true"}); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("exec in an unknown sandbox: %v", err)
	}
	// Another project's sandbox is not found either, and counts as such.
	if _, err := tn.Exec(as("other"), &dsecv1.ExecRequest{SandboxId: a.Id, Cmd: "true"}); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("exec in another project's sandbox: %v", err)
	}
	readAll(t, tn, bg, a.Id, "/etc/passwd")
	// Its end is counted before its tombstone answers (a sandbox still
	// ending answers "deleting").
	eventually(t, "the 1 s sandbox ends at its TTL", func() bool { st, _ := tn.state(b.Id); return st == "failed" })
	if err := tn.Delete(bg, a.Id); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{ops, op("create", "container", "ok"), 3},
		{ops, op("create", "container", "infra"), 1}, // the node is full
		{ops, op("create", "container", "error"), 1}, // an unknown image
		{ops, op("exec", "container", "ok"), 4},      // a non-zero exit is the workload's answer
		{ops, op("exec", "unknown", "error"), 1},
		{ops, op("exec", "container", "error"), 1},
		{ops, op("file", "container", "ok"), 1},
		{ops, op("delete", "container", "ok"), 2},
		{"dsec_sandbox_ends_total", map[string]string{"kind": "container", "cause": "ttl"}, 1},
		{"dsec_sandbox_ends_total", map[string]string{"kind": "container", "cause": "deleted"}, 2},
		{"dsec_admission_refusals_total", map[string]string{"reason": "full"}, 1},
		{"dsec_trajectory_entries_total", map[string]string{"result": "run"}, 4}, // the execs (reads change nothing: not logged)
		{"dsec_sandboxes", map[string]string{"kind": "container", "state": "running"}, 0},
		{"dsec_sandboxes", map[string]string{"kind": "container", "state": "paused"}, 0},
		{"dsec_sandboxes_max", nil, 2},
		// Each create that started (3) waited for a slot, made its network
		// and instance, and was committed.
		{"dsec_sandbox_create_phase_duration_seconds", map[string]string{"kind": "container", "phase": "wait"}, 3},
		{"dsec_sandbox_create_phase_duration_seconds", map[string]string{"kind": "container", "phase": "network"}, 3},
		{"dsec_sandbox_create_phase_duration_seconds", map[string]string{"kind": "container", "phase": "instance"}, 3},
		{"dsec_sandbox_create_phase_duration_seconds", map[string]string{"kind": "container", "phase": "commit"}, 3},
		// The driver's steps of each start (the fake reports one).
		{"dsec_sandbox_start_step_duration_seconds", map[string]string{"kind": "container", "step": "runtime"}, 3},
	} {
		if got := sample(t, reg, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}

	// The gauges follow the node's sandboxes.
	tn.create(bg, nil)
	if got := sample(t, reg, "dsec_sandboxes", map[string]string{"kind": "container", "state": "running"}); got != 1 {
		t.Errorf("running sandboxes = %v after a create, want 1", got)
	}
}
