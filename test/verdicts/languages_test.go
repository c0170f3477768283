package verdicts

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

const (
	success = "success"
	wa      = "wrong_answer"
	re      = "runtime_error"
	tle     = "time_limit_exceeded"
	mle     = "memory_limit_exceeded"
	ce      = "compile_error"
)

// TestEveryLanguageGetsItsVerdicts runs each language's right, wrong,
// crashing, looping and broken program as a judged call (one test case:
// "2 3" → "5") and as a plain call (SandboxFusion's /run_code), and checks
// every verdict. The right and wrong answers take both paths in every
// language (their verdicts differ between the two); a crash, a loop and a
// build failure get one verdict whichever the path (the run's or the
// build's own end), so each language takes one of the two for them, the
// languages alternating, and both paths meet every kind of end across the
// corpus: every call compiles again, and the compilers of the JVM family
// take seconds of CPU each.
func TestEveryLanguageGetsItsVerdicts(t *testing.T) {
	d := driver(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	t.Cleanup(cancel) // the parallel subtests run after this function returns
	langs, err := d.Languages(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	avail := map[string]string{}
	for _, l := range langs {
		avail[l.Name] = l.Missing
		if l.Available {
			avail[l.Name] = ""
		}
	}
	var calls, wrong atomic.Int64
	for i, lc := range Corpus {
		// The path this language's crash, loop and build failure take (a
		// test runner judges itself: the plain path, always).
		endsJudged := i%2 == 0 && !lc.Runner
		if why := avail[lc.Lang]; why != "" {
			t.Errorf("%s is not available on the polyglot image: %s", lc.Lang, why)
			continue
		}
		t.Run(lc.Lang, func(t *testing.T) {
			t.Parallel()
			tleT := lc.TLETimeout
			if tleT == 0 {
				tleT = 2
			}
			type item struct {
				name, code, judged, plain string
				timeout                   float64
			}
			// An empty verdict: that path is not taken.
			end := func(status string) (judged, plain string) {
				if endsJudged {
					return status, ""
				}
				return "", status
			}
			crashJ, crashP := end(re)
			loopJ, loopP := end(tle)
			ceJ, ceP := end(lc.CEStatus)
			items := []item{
				{"a right answer passes", lc.OK, success, success, 60},
				{"a wrong answer fails", lc.Wrong, wa, success, 60},
				{"a crash is a runtime error", lc.Crash, crashJ, crashP, 60},
				{"a loop is a time limit", lc.TLE, loopJ, loopP, tleT},
				{"a program that does not build", lc.CE, ceJ, ceP, 60},
			}
			if lc.Runner {
				// No judged call: a failing test is the runner's exit.
				items[1].plain = re
			}
			for _, it := range items {
				t.Run(it.name, func(t *testing.T) {
					t.Parallel()
					req := &dsecv1.RunCodeRequest{Language: lc.Lang, Code: it.code, Stdin: "2 3\n", RunTimeoutS: it.timeout, CompileTimeoutS: 120}
					if !lc.Runner && it.judged != "" {
						calls.Add(1)
						j := cloneReq(req)
						j.Tests = []*dsecv1.TestCase{{Stdin: "2 3\n", ExpectedStdout: "5\n"}}
						res, err := d.RunCode(ctx, j)
						if err != nil {
							t.Fatal(err)
						}
						if res.Status != it.judged {
							wrong.Add(1)
							t.Errorf("judged: %s, want %s\n%s", res.Status, it.judged, describe(res))
						}
					}
					if it.plain == "" {
						return
					}
					calls.Add(1)
					res, err := d.RunCode(ctx, req)
					if err != nil {
						t.Fatal(err)
					}
					if res.Status != it.plain {
						wrong.Add(1)
						t.Errorf("plain: %s, want %s\n%s", res.Status, it.plain, describe(res))
					}
				})
			}
		})
	}
	t.Cleanup(func() { t.Logf("%d calls, %d wrong verdicts", calls.Load(), wrong.Load()) })
}

func cloneReq(r *dsecv1.RunCodeRequest) *dsecv1.RunCodeRequest {
	return proto.Clone(r).(*dsecv1.RunCodeRequest)
}

// describe shows a result for a failure message.
func describe(res *dsecv1.RunCodeResult) string {
	var b strings.Builder
	b.WriteString("message: " + res.Message + "\n")
	show := func(name string, s *dsecv1.StageResult) {
		if s != nil {
			b.WriteString(name + ": " + s.Status + " exit " + itoa(s.ExitCode) + " signal " + s.Signal + "\n  stdout: " + clip(s.Stdout) + "\n  stderr: " + clip(s.Stderr) + "\n")
		}
	}
	show("compile", res.Compile)
	show("run", res.Run)
	for _, c := range res.Cases {
		show("case "+c.Status, c.Run)
		show("checker", c.Checker)
		if c.CheckerMessage != "" {
			b.WriteString("  checker message: " + clip(c.CheckerMessage) + "\n")
		}
	}
	return b.String()
}

func clip(s string) string {
	if len(s) > 600 {
		return s[:300] + " … " + s[len(s)-300:]
	}
	return s
}

func itoa(n int32) string { return strconv.Itoa(int(n)) }
