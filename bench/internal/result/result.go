// Package result carries a benchmark's measurements to bench/report: each
// bench prints its own table and, when run by the report, also appends its
// rows as JSON lines to the file named by $DSEC_BENCH_ROWS.
package result

import (
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// Env names the file rows are appended to.
const Env = "DSEC_BENCH_ROWS"

// Row is one measurement beside its baseline, measured in the same run.
type Row struct {
	// Key names the measurement for the report ("exec.p50").
	Key string `json:"key"`
	// What the row measures, in words.
	What string `json:"what"`
	// Unit of Dsec and Baseline: "ms", "/s" or "MiB".
	Unit string  `json:"unit"`
	Dsec float64 `json:"dsec"`
	// Baseline is the same work done without dsec (0: none), named by
	// BaselineName.
	Baseline     float64 `json:"baseline,omitempty"`
	BaselineName string  `json:"baseline_name,omitempty"`
}

// Ms is d in milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Emit appends rows to $DSEC_BENCH_ROWS when it is set.
func Emit(rows ...Row) {
	path := os.Getenv(Env)
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench rows:", err)
		os.Exit(1)
	}
	defer f.Close()
	enc := json.NewEncoder(f)
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			fmt.Fprintln(os.Stderr, "bench rows:", err)
			os.Exit(1)
		}
	}
}
