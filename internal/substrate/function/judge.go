package function

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
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

// builtinChecker returns the built-in checker name: whether got is right
// for want, and why not.
func builtinChecker(name string, tol float64) (func(got, want string) (bool, string), error) {
	if tol < 0 || math.IsNaN(tol) {
		return nil, errdefs.Invalid("checker.float_tolerance must not be negative")
	}
	if tol == 0 {
		tol = 1e-6
	}
	switch name {
	case "", "lines":
		return func(got, want string) (bool, string) { return matches(got, want, nil), "" }, nil
	case "exact":
		return func(got, want string) (bool, string) { return got == want, "" }, nil
	case "tokens":
		return func(got, want string) (bool, string) { return tokensMatch(got, want, 0, false) }, nil
	case "case_insensitive":
		return func(got, want string) (bool, string) { return tokensMatch(got, want, 0, true) }, nil
	case "float":
		return func(got, want string) (bool, string) { return tokensMatch(got, want, tol, false) }, nil
	case "unordered_lines":
		return unorderedLines, nil
	}
	return nil, errdefs.Invalid("unknown built-in checker %q (have lines, exact, tokens, float, unordered_lines, case_insensitive)", name)
}

// tokensMatch compares whitespace-separated tokens; with tol > 0 numbers
// within tol (absolute, or relative to the expected value) match.
func tokensMatch(got, want string, tol float64, fold bool) (bool, string) {
	g, w := strings.Fields(got), strings.Fields(want)
	for i := 0; i < len(g) && i < len(w); i++ {
		a, b := g[i], w[i]
		if a == b || (fold && strings.EqualFold(a, b)) {
			continue
		}
		if tol > 0 {
			x, err1 := strconv.ParseFloat(a, 64)
			y, err2 := strconv.ParseFloat(b, 64)
			if err1 == nil && err2 == nil && !math.IsNaN(x) && !math.IsNaN(y) && !math.IsInf(x, 0) {
				if d := math.Abs(x - y); d <= tol || d <= tol*math.Abs(y) {
					continue
				}
			}
		}
		return false, fmt.Sprintf("token %d: got %.40q, want %.40q", i+1, a, b)
	}
	if len(g) != len(w) {
		return false, fmt.Sprintf("got %d tokens, want %d", len(g), len(w))
	}
	return true, ""
}

// unorderedLines accepts the expected lines (surrounding whitespace
// trimmed, empty lines ignored) in any order.
func unorderedLines(got, want string) (bool, string) {
	count := map[string]int{}
	n := 0
	for _, l := range strings.Split(want, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			count[l]++
			n++
		}
	}
	for _, l := range strings.Split(got, "\n") {
		if l = strings.TrimSpace(l); l == "" {
			continue
		}
		if count[l] == 0 {
			return false, fmt.Sprintf("unexpected line %.60q", l)
		}
		count[l]--
		n--
	}
	if n > 0 {
		return false, fmt.Sprintf("%d expected lines missing", n)
	}
	return true, ""
}
