package dsectest

import (
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/prometheus/common/expfmt"
)

// Scrape reads base's /metrics with key as a bearer credential (none when
// empty). It returns the HTTP status, the exposition, and its samples by
// series, each written name{label="value",...} with its labels sorted by
// name, a histogram as its name_count and name_sum series.
func Scrape(t TB, base, key string) (status int, text string, samples map[string]float64) {
	t.Helper()
	req, err := http.NewRequest("GET", base+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		return resp.StatusCode, string(b), nil
	}
	var p expfmt.TextParser
	families, err := p.TextToMetricFamilies(strings.NewReader(string(b)))
	if err != nil {
		t.Fatalf("parse %s/metrics: %v", base, err)
	}
	samples = map[string]float64{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() { // sorted by name
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			series := "{" + strings.Join(labels, ",") + "}"
			switch {
			case m.GetCounter() != nil:
				samples[name+series] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				samples[name+series] = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				samples[name+"_count"+series] = float64(m.GetHistogram().GetSampleCount())
				samples[name+"_sum"+series] = m.GetHistogram().GetSampleSum()
			}
		}
	}
	return resp.StatusCode, string(b), samples
}
