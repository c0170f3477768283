package main

import (
	"testing"

	"github.com/opendsec/dsec/bench/internal/result"
)

func TestJudge(t *testing.T) {
	for _, tc := range []struct {
		row   result.Row
		speed float64
		met   *bool
	}{
		// A rate: dsec's over the baseline's.
		{result.Row{Key: "cycle.par1", Unit: "/s", Dsec: 30, Baseline: 60}, 0.5, ptr(false)},
		{result.Row{Key: "cycle.par4", Unit: "/s", Dsec: 90, Baseline: 60}, 1.5, ptr(true)},
		// A time: the baseline's over dsec's; the exec target needs both.
		{result.Row{Key: "exec.p50", Unit: "ms", Dsec: 0.9, Baseline: 8.1}, 9, ptr(false)},
		{result.Row{Key: "exec.p50", Unit: "ms", Dsec: 1.1, Baseline: 22}, 20, ptr(false)},
		{result.Row{Key: "exec.p50", Unit: "ms", Dsec: 0.5, Baseline: 5}, 10, ptr(true)},
		// No baseline: no speed; a row without a target gets no verdict.
		{result.Row{Key: "microvm.fork.pss", Unit: "MiB", Dsec: 29}, 0, ptr(true)},
		{result.Row{Key: "exec.p99", Unit: "ms", Dsec: 3, Baseline: 6}, 2, nil},
	} {
		l := judge("b", tc.row)
		if l.Speed != tc.speed {
			t.Errorf("%s %v: speed %v, want %v", tc.row.Key, tc.row, l.Speed, tc.speed)
		}
		if (l.Met == nil) != (tc.met == nil) || l.Met != nil && *l.Met != *tc.met {
			t.Errorf("%s %v: met %v, want %v", tc.row.Key, tc.row, deref(l.Met), deref(tc.met))
		}
	}
}

func ptr(b bool) *bool { return &b }

func deref(b *bool) any {
	if b == nil {
		return nil
	}
	return *b
}
