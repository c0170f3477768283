package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestMetricsAreServedToOperatorsAndScrapedByPrometheus runs the calls a
// trainer makes against a `dsec serve`, then reads /metrics as an operator
// would: refused without a key and with a project's key, exact counts with
// an admin key, clean under promtool's lint, and scraped by the
// distribution's Prometheus (through the authenticated endpoint with a
// bearer key and through --metrics-listen), whose PromQL answers the same
// counts.
func TestMetricsAreServedToOperatorsAndScrapedByPrometheus(t *testing.T) {
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatal("prometheus is not installed (scripts/setup.sh installs it): ", err)
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool is not installed (the prometheus package has it): ", err)
	}
	const admin = "metrics-operator-key"
	open := freeAddr(t)
	srv := dsectest.Start(t, dsectest.Options{APIKeys: []string{"proj=metrics-project-key"}, Args: []string{"--admin-key", admin, "--metrics-listen", open, "--pool", "busybox:1"}})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)

	if code, _, _ := dsectest.Scrape(t, srv.URL, ""); code != http.StatusUnauthorized {
		t.Errorf("/metrics without a key: %d, want 401", code)
	}
	if code, _, _ := dsectest.Scrape(t, srv.URL, srv.Key()); code != http.StatusForbidden {
		t.Errorf("/metrics with a project's key: %d, want 403", code)
	}

	// The calls: two creates, five execs (one exits non-zero: the
	// workload's answer, not a failure), an exec in an unknown sandbox, a
	// file read, a delete, and one E2B call.
	a := create(t, c, dsec.CreateOptions{})
	b := create(t, c, dsec.CreateOptions{})
	for _, cmd := range []string{"true", "true", "true", "true", "exit 3"} {
		if _, err := a.Exec(ctx, dsec.Cmd(cmd)); err != nil {
			t.Fatalf("exec %q: %v", cmd, err)
		}
	}
	if _, err := c.Sandbox("nosuchsandboxxxx-local").Exec(ctx, dsec.Cmd("true")); err == nil {
		t.Fatal("exec in an unknown sandbox succeeded")
	}
	if _, err := a.ReadFile(ctx, "/etc/passwd", io.Discard); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL+"/v2/sandboxes", nil)
	req.Header.Set("X-API-Key", srv.Key())
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
		t.Fatalf("E2B list: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}

	want := map[string]float64{
		`dsec_sandbox_operation_duration_seconds_count{kind="container",operation="create",outcome="ok"}`:   2,
		`dsec_sandbox_operation_duration_seconds_count{kind="container",operation="exec",outcome="ok"}`:     5,
		`dsec_sandbox_operation_duration_seconds_count{kind="unknown",operation="exec",outcome="error"}`:    1,
		`dsec_sandbox_operation_duration_seconds_count{kind="container",operation="file",outcome="ok"}`:     1,
		`dsec_sandbox_operation_duration_seconds_count{kind="container",operation="delete",outcome="ok"}`:   1,
		`dsec_sandbox_ends_total{cause="deleted",kind="container"}`:                                         1,
		`dsec_sandboxes{kind="container",state="running"}`:                                                  1,
		`dsec_api_rpc_duration_seconds_count{code="ok",procedure="/dsec.v1.ProcessService/Exec"}`:           5,
		`dsec_api_rpc_duration_seconds_count{code="not_found",procedure="/dsec.v1.ProcessService/Exec"}`:    1,
		`dsec_api_http_request_duration_seconds_count{code="200",handler="GET /v2/sandboxes",method="get"}`: 1,
	}
	code, text, got := dsectest.Scrape(t, srv.URL, admin)
	if code != 200 {
		t.Fatalf("/metrics with an admin key: %d: %s", code, text)
	}
	for series, v := range want {
		if got[series] != v {
			t.Errorf("%s = %v, want %v", series, got[series], v)
		}
	}
	for series := range got {
		if strings.Contains(series, a.ID) || strings.Contains(series, "proj") {
			t.Errorf("a series names a sandbox or a project: %s", series)
		}
	}
	lint := exec.Command(promtool, "check", "metrics")
	lint.Stdin = strings.NewReader(text)
	if out, err := lint.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
	if code, _, open := dsectest.Scrape(t, "http://"+open, ""); code != 200 || open[`dsec_sandboxes{kind="container",state="running"}`] != 1 {
		t.Errorf("--metrics-listen /metrics: %d", code)
	}

	// Prometheus scrapes both endpoints; PromQL sees the same counts.
	prom := startPrometheus(t, promBin, srv.Addr, admin, open)
	for series, v := range want {
		for _, job := range []string{"dsec", "dsec-open"} {
			q := strings.Replace(series, "{", `{job="`+job+`",`, 1)
			prom.await(t, q, v)
		}
	}
	prom.await(t, `count(dsec_build_info == 1)`, 2)

	// The Grafana dashboard (deploy/grafana) asks only for series dsec
	// serves, in queries this Prometheus accepts.
	checkDashboard(t, prom, got)
}

// checkDashboard runs every query of deploy/grafana/dsec.json against
// prom and checks each metric it names is one dsec serves (served holds
// the scraped series).
func checkDashboard(t *testing.T, prom *prometheus, served map[string]float64) {
	t.Helper()
	b, err := os.ReadFile("../../deploy/grafana/dsec.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("deploy/grafana/dsec.json: %v", err)
	}
	names := map[string]bool{}
	for series := range served {
		name, _, _ := strings.Cut(series, "{")
		names[name] = true
		if base, ok := strings.CutSuffix(name, "_count"); ok {
			names[base+"_bucket"] = true // a histogram's buckets
		}
	}
	metric := regexp.MustCompile(`\bdsec_[a-z_]+`)
	queries := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			queries++
			for _, m := range metric.FindAllString(tg.Expr, -1) {
				// dsec_cluster_ series are the control plane's (dsec api).
				if !names[m] && !strings.HasPrefix(m, "dsec_cluster_") {
					t.Errorf("panel %q asks for %s, which dsec does not serve", p.Title, m)
				}
			}
			q := strings.NewReplacer("$instance", ".*", "$__rate_interval", "1m").Replace(tg.Expr)
			resp, err := http.Get(prom.url + "/api/v1/query?query=" + url.QueryEscape(q))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("panel %q: Prometheus refused %s: %s", p.Title, q, body)
			}
		}
	}
	if queries < 10 {
		t.Errorf("the dashboard has %d queries", queries)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// prometheus is a Prometheus server the test started.
type prometheus struct{ url string }

// startPrometheus runs the distribution's Prometheus, scraping dsec's
// /metrics every second twice: on the API listener with the admin key as
// a bearer token (job dsec) and on the open metrics listener (job
// dsec-open). It is stopped when the test ends.
func startPrometheus(t *testing.T, bin, apiAddr, key, openAddr string) *prometheus {
	t.Helper()
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: dsec
    authorization:
      credentials: %q
    static_configs:
      - targets: [%q]
  - job_name: dsec-open
    static_configs:
      - targets: [%q]
`, key, apiAddr, openAddr)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	var log bytes.Buffer
	cmd := exec.Command(bin, "--config.file="+filepath.Join(dir, "prometheus.yml"), "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("prometheus log:\n%s", log.String())
		}
	})
	return &prometheus{url: "http://" + addr}
}

// await polls an instant query until its one result is want (the scrape
// after the calls), failing after a minute with the last answer.
func (p *prometheus) await(t *testing.T, query string, want float64) {
	t.Helper()
	var last string
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		resp, err := http.Get(p.url + "/api/v1/query?query=" + url.QueryEscape(query))
		if err != nil {
			last = err.Error()
			continue
		}
		var body struct {
			Status string
			Data   struct {
				Result []struct {
					Value [2]any
				}
			}
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil {
			last = err.Error()
			continue
		}
		last = fmt.Sprintf("%+v", body)
		if len(body.Data.Result) == 1 {
			if s, ok := body.Data.Result[0].Value[1].(string); ok {
				if v, err := strconv.ParseFloat(s, 64); err == nil && v == want {
					return
				}
			}
		}
	}
	t.Errorf("PromQL %s: want %v, last answer %s", query, want, last)
}
