package function

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Test cases. A call with tests compiles its program once (and its checker
// program once), in a build call whose directory is archived and fetched
// back; then every case runs in a call of its own, in parallel on the
// pool's slots, from the archive, with only its own input; a checker
// program runs in yet another call with the input, the expected output and
// the program's output. So a program never sees expected outputs or other
// cases, cannot touch the checker, and cases spread over the node's
// workers.

// The archive travels in guest-protocol messages, which are at most 8 MiB
// (internal/guest): a larger one would break the worker's connection.
const (
	buildArchive = ".dsec-build.tgz"
	maxArchive   = 6 << 20
)

// built is a compiled program: its archived directory, or its files.
type built struct {
	files   []*guestv1.CallFile
	unpack  bool // files is the archive: unpack before running
	compile *dsecv1.StageResult
	// recompile: the build was too large to archive, so each case
	// compiles the program again (slower, the same verdicts).
	recompile *guestv1.CallStep
}

// build compiles pr once. A compile failure comes back in compile (status
// other than "finished"); infra is the platform's failure.
func (d *Driver) build(ctx context.Context, p *pool, pr *program) (b *built, infra string) {
	if pr.compileErr != "" {
		return &built{compile: compileError(pr.compileErr).Compile}, ""
	}
	if pr.compile == nil {
		return &built{files: pr.files}, ""
	}
	tar := &guestv1.CallStep{Argv: []string{"tar", "-czf", buildArchive, "--exclude=./" + buildArchive, "--exclude=./.cache", "."},
		TimeoutMs: 60000, MaxOutput: 64 << 10, RlimitNproc: 64, RlimitNofile: 1024, RlimitFsizeBytes: maxArchive + 1<<20}
	c := &guestv1.Call{Files: pr.files, Steps: []*guestv1.CallStep{pr.compile, tar}, Fetch: []string{buildArchive}, MaxFetch: maxArchive, Env: pr.env}
	out, oom, infra := d.exec(ctx, p, []*language{pr.lang}, c)
	if infra != "" {
		return nil, infra
	}
	if len(out.Steps) == 0 {
		return nil, "the compile step did not run"
	}
	b = &built{compile: stage(out.Steps[0], oom)}
	if b.compile.Status != "finished" {
		return b, ""
	}
	if len(out.Steps) < 2 || out.Steps[1].ExitCode != 0 || len(out.Fetched) != 1 || out.Fetched[0].Missing || out.Fetched[0].Truncated {
		// Too large to archive: every case compiles it again.
		b.files, b.recompile = pr.files, pr.compile
		return b, ""
	}
	b.files, b.unpack = []*guestv1.CallFile{{Path: buildArchive, Content: out.Fetched[0].Content, Mode: 0o600}}, true
	return b, ""
}

// call makes the call that runs b with stdin and args; extra files are
// written beside it.
func (b *built) call(pr *program, stdin []byte, args []string, extra ...*guestv1.CallFile) *guestv1.Call {
	c := &guestv1.Call{Files: append(append([]*guestv1.CallFile(nil), b.files...), extra...), Env: pr.env}
	if b.recompile != nil {
		c.Steps = append(c.Steps, b.recompile)
	}
	if b.unpack {
		c.Steps = append(c.Steps, &guestv1.CallStep{Argv: []string{"tar", "-xzf", buildArchive}, TimeoutMs: 60000, MaxOutput: 64 << 10,
			RlimitNproc: 64, RlimitNofile: 1024, StopOnFailure: true})
	}
	return append1(c, pr.run(stdin, args))
}

func append1(c *guestv1.Call, st *guestv1.CallStep) *guestv1.Call {
	c.Steps = append(c.Steps, st)
	return c
}

// lastStep is the result of a call's last step (the program's run), or nil
// when it did not run (the archive did not unpack).
func lastStep(c *guestv1.Call, out *guestv1.CallResult) *guestv1.Exit {
	if len(out.Steps) != len(c.Steps) {
		return nil
	}
	return out.Steps[len(out.Steps)-1]
}

// cases runs a call with tests.
func (d *Driver) cases(ctx context.Context, p *pool, pl *plan, req *dsecv1.RunCodeRequest) *dsecv1.RunCodeResult {
	tests := req.GetTests()
	res := &dsecv1.RunCodeResult{Total: int32(len(tests))}
	langs := []*language{pl.lang}
	if pl.checker != nil {
		langs = append(langs, pl.checker.lang)
	}
	// The program and the checker build side by side.
	var prog, chk *built
	var progInfra, chkInfra string
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); prog, progInfra = d.build(ctx, p, pl.program) }()
	if pl.checker != nil {
		chk, chkInfra = d.build(ctx, p, pl.checker)
	}
	wg.Wait()
	if progInfra != "" {
		return infraResult("%s", progInfra)
	}
	if prog.compile != nil && pl.lang.compile != nil || pl.compileErr != "" {
		res.Compile = prog.compile
		if prog.compile.Status != "finished" {
			res.Status, res.Message = StatusCompile, "compilation failed"
			if prog.compile.Status == StatusTLE {
				res.Message = "compilation timed out"
			}
			return res
		}
	}
	if chkInfra != "" {
		return infraResult("checker: %s", chkInfra)
	}
	if chk != nil && chk.compile != nil && (pl.checker.compile != nil || pl.checker.compileErr != "") {
		res.CheckerCompile = chk.compile
		if chk.compile.Status != "finished" {
			res.Status, res.Message = StatusJudge, "the checker did not compile"
			return res
		}
	}

	// Fan out: one goroutine per case, each waiting for a slot in the
	// pool's FIFO; with stop_on_first_failure, cases after a failing one
	// that have not started do not run.
	stop := req.GetJudge().GetStopOnFirstFailure()
	var failedAt atomic.Int64
	failedAt.Store(int64(len(tests)))
	cases := make([]*dsecv1.CaseResult, len(tests))
	infras := make([]string, len(tests))
	sem := make(chan struct{}, max(d.cfg.Slots*d.cfg.MaxWorkers, 1))
	for i, tc := range tests {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int, tc *dsecv1.TestCase) {
			defer wg.Done()
			defer func() { <-sem }()
			cr := &dsecv1.CaseResult{Index: int32(i), Name: tc.Name}
			cases[i] = cr
			if stop && failedAt.Load() < int64(i) {
				cr.Status = statusNotRun
				return
			}
			infras[i] = d.runCase(ctx, p, pl, prog, chk, tc, cr)
			if !cr.Passed && infras[i] == "" {
				for {
					cur := failedAt.Load()
					if int64(i) >= cur || failedAt.CompareAndSwap(cur, int64(i)) {
						break
					}
				}
			}
		}(i, tc)
	}
	wg.Wait()
	for i, why := range infras {
		if why != "" {
			r := infraResult("test case %d: %s", i, why)
			r.Compile, r.Total = res.Compile, res.Total
			return r
		}
	}
	res.Status = StatusSuccess
	for _, cr := range cases {
		if cr.Passed {
			res.Passed++
			continue
		}
		if res.FirstFailure == nil && cr.Status != statusNotRun {
			res.FirstFailure = cr
			res.Status = cr.Status
		}
	}
	if res.Status == StatusSuccess && res.Passed < res.Total {
		res.Status = StatusWrongAnswer
	}
	res.Cases = cases
	res.Message = fmt.Sprintf("%d of %d cases passed", res.Passed, res.Total)
	if res.FirstFailure != nil {
		res.Message += fmt.Sprintf("; first failure: case %d (%s)", res.FirstFailure.Index, res.FirstFailure.Status)
	}
	return res
}

// runCase runs one case (and its checker) into cr; it returns why the
// platform failed, or "".
func (d *Driver) runCase(ctx context.Context, p *pool, pl *plan, prog, chk *built, tc *dsecv1.TestCase, cr *dsecv1.CaseResult) string {
	c := prog.call(pl.program, []byte(tc.Stdin), pl.args)
	out, oom, infra := d.exec(ctx, p, []*language{pl.lang}, c)
	if infra != "" {
		cr.Status = StatusSandbox
		return infra
	}
	x := lastStep(c, out)
	if x == nil && prog.recompile != nil && len(out.Steps) > 0 {
		// Compiled again for this case, and it failed this time.
		if st := stage(out.Steps[0], oom); st.Status == StatusTLE {
			cr.Status = StatusSandbox
			return "the program compiled once but its recompilation for this case timed out"
		}
	}
	if x == nil {
		cr.Status = StatusSandbox
		return "the compiled program did not unpack"
	}
	cr.Run = stage(x, oom)
	if st := statusOf(cr.Run); st != StatusSuccess {
		cr.Status = st
		return ""
	}
	if cr.Run.Truncated {
		cr.Status, cr.CheckerMessage = StatusWrongAnswer, "the output exceeded max_output_bytes"
		return ""
	}
	if pl.judge != nil {
		ok, why := pl.judge(cr.Run.Stdout, tc.ExpectedStdout)
		cr.CheckerMessage = why
		if ok {
			cr.Status, cr.Passed = statusPassed, true
		} else {
			cr.Status = StatusWrongAnswer
		}
		return ""
	}
	// The checker program, in a call of its own.
	files := []*guestv1.CallFile{
		{Path: "input", Content: []byte(tc.Stdin), Mode: 0o600},
		{Path: "expected", Content: []byte(tc.ExpectedStdout), Mode: 0o600},
		{Path: "actual", Content: x.Stdout, Mode: 0o600},
	}
	cc := chk.call(pl.checker, nil, []string{"input", "expected", "actual"}, files...)
	cout, coom, infra := d.exec(ctx, p, []*language{pl.checker.lang}, cc)
	if infra != "" {
		cr.Status = StatusSandbox
		return "checker: " + infra
	}
	cx := lastStep(cc, cout)
	if cx == nil {
		cr.Status = StatusSandbox
		return "the compiled checker did not unpack"
	}
	cr.Checker = stage(cx, coom)
	msg := cr.Checker.Stdout + cr.Checker.Stderr
	if len(msg) > 4096 {
		msg = msg[:4096]
	}
	cr.CheckerMessage = msg
	switch {
	case cx.TimedOut || cx.Signal != 0 || cx.Error != "":
		cr.Status = StatusJudge
	case cx.ExitCode == 0:
		cr.Status, cr.Passed = statusPassed, true
	case cx.ExitCode == 1 || cx.ExitCode == 2:
		cr.Status = StatusWrongAnswer
	default:
		cr.Status = StatusJudge
	}
	return ""
}
