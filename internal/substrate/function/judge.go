package function

import (
	"math"
	"strconv"
	"strings"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// matches compares a program's output with the expected output: by
// default line by line with surrounding whitespace trimmed and trailing
// empty lines ignored; optionally ignoring case; optionally accepting
// numbers within a tolerance (token by token).
func matches(got, want string, o *dsecv1.JudgeOptions) bool {
	if o.GetExact() {
		return got == want
	}
	g, w := lines(got), lines(want)
	if len(g) != len(w) {
		return false
	}
	for i := range g {
		if !lineMatches(g[i], w[i], o) {
			return false
		}
	}
	return true
}

func lines(s string) []string {
	s = strings.ReplaceAll(s, "\r\n", "\n")
	ls := strings.Split(s, "\n")
	for i := range ls {
		ls[i] = strings.TrimSpace(ls[i])
	}
	for len(ls) > 0 && ls[len(ls)-1] == "" {
		ls = ls[:len(ls)-1]
	}
	return ls
}

func lineMatches(g, w string, o *dsecv1.JudgeOptions) bool {
	if o.GetCaseInsensitive() {
		g, w = strings.ToLower(g), strings.ToLower(w)
	}
	if g == w {
		return true
	}
	tol := o.GetFloatTolerance()
	if tol <= 0 {
		return false
	}
	gt, wt := strings.Fields(g), strings.Fields(w)
	if len(gt) != len(wt) {
		return false
	}
	for i := range gt {
		if gt[i] == wt[i] {
			continue
		}
		a, err1 := strconv.ParseFloat(gt[i], 64)
		b, err2 := strconv.ParseFloat(wt[i], 64)
		if err1 != nil || err2 != nil || math.IsNaN(a) || math.IsNaN(b) {
			return false
		}
		if diff := math.Abs(a - b); diff > tol && diff > tol*math.Max(math.Abs(a), math.Abs(b)) {
			return false
		}
	}
	return true
}
