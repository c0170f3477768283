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
// crashing, looping and broken program, once as a judged call (one test
// case: "2 3" → "5") and once as a plain call (SandboxFusion's /run_code),
// and checks every verdict.
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
	for _, lc := range Corpus {
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
			items := []item{
				{"a right answer passes", lc.OK, success, success, 60},
				{"a wrong answer fails", lc.Wrong, wa, success, 60},
				{"a crash is a runtime error", lc.Crash, re, re, 60},
				{"a loop is a time limit", lc.TLE, tle, tle, tleT},
				{"a program that does not build", lc.CE, lc.CEStatus, lc.CEStatus, 60},
			}
			if lc.Runner {
				// A test runner judges itself: its failing test is its exit.
				items[1].judged, items[1].plain = re, re
			}
			for _, it := range items {
				t.Run(it.name, func(t *testing.T) {
					t.Parallel()
					req := &dsecv1.RunCodeRequest{Language: lc.Lang, Code: it.code, Stdin: "2 3\n", RunTimeoutS: it.timeout, CompileTimeoutS: 120}
					if !lc.Runner {
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
