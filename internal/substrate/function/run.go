package function

import (
	"context"
	"fmt"
	"math"
	"path"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// Limits on requests.
const (
	maxCode        = 1 << 20
	maxFiles       = 64
	maxFilesBytes  = 32 << 20
	maxCases       = 1000
	maxCaseBytes   = 8 << 20
	maxTimeout     = 300.0
	defaultTimeout = 10.0
	defaultMemMB   = 1024
	maxBatch       = 4096
)

// Statuses of a RunCodeResult.
const (
	StatusSuccess     = "success"
	StatusWrongAnswer = "wrong_answer"
	StatusCompile     = "compile_error"
	StatusRuntime     = "runtime_error"
	StatusTLE         = "time_limit_exceeded"
	StatusMLE         = "memory_limit_exceeded"
	StatusSandbox     = "sandbox_error"
)

// Statuses of a RunCodeResult and a CaseResult besides the above.
const (
	StatusJudge  = "judge_error"
	statusPassed = "passed"
	statusNotRun = "not_run"
)

// Languages reports the languages of an image's workers (starting one if
// needed).
func (d *Driver) Languages(ctx context.Context, img string) ([]*dsecv1.LanguageInfo, error) {
	if img == "" {
		img = d.cfg.Image
	}
	if _, err := d.images.Get(img); err != nil {
		return nil, err
	}
	p := d.poolFor(img)
	w, slot, err := p.acquire(ctx)
	if err != nil {
		return nil, err
	}
	have := w.have
	p.release(w, slot, "")
	var out []*dsecv1.LanguageInfo
	for _, l := range languages {
		why := l.lacking(have)
		out = append(out, &dsecv1.LanguageInfo{Name: l.name, Aliases: l.aliases, Available: why == "", Missing: why, Image: img})
	}
	return out, nil
}

// KnownLanguages reports the languages the default image's workers run,
// once a worker of it has started (nil before).
func (d *Driver) KnownLanguages() []string {
	d.mu.Lock()
	p := d.pools[d.cfg.Image]
	d.mu.Unlock()
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, w := range p.workers {
		var out []string
		for _, l := range languages {
			if l.lacking(w.have) == "" {
				out = append(out, l.name)
			}
		}
		sort.Strings(out)
		return out
	}
	return nil
}

// RunCode runs one call. Program failures are results; the error is for
// requests that are invalid. Platform failures are results with status
// sandbox_error and infra set, so a batch reports them per item: a worker
// that died, the node's function image missing, a language whose
// toolchain the image lacks.
func (d *Driver) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("function calls cannot run on this node: %s", d.caps.Reason)
	}
	start := time.Now()
	pl, err := d.plan(req)
	if err != nil {
		return nil, err
	}
	var res *dsecv1.RunCodeResult
	switch {
	case pl.lang.missing != "":
		res = infraResult("language %s cannot run on this node: %s", pl.lang.name, pl.lang.missing)
	case pl.checker != nil && pl.checker.lang.missing != "":
		res = infraResult("checker language %s cannot run on this node: %s", pl.checker.lang.name, pl.checker.lang.missing)
	default:
		img := req.GetImage()
		if img == "" {
			img = d.cfg.Image
		}
		if _, err := d.images.Get(img); err != nil {
			if req.GetImage() != "" {
				return nil, err // the caller named an image that is not here
			}
			res = infraResult("the node's function image %q is not on this node", img)
			break
		}
		p := d.poolFor(img)
		if len(req.GetTests()) == 0 {
			res = d.single(ctx, p, pl)
		} else {
			res = d.cases(ctx, p, pl, req)
		}
	}
	if ctx.Err() != nil && res.Infra {
		// The caller went away (or its deadline passed): that is its
		// error, not a platform failure.
		return nil, errdefs.Classify(ctx.Err())
	}
	res.DurationS = time.Since(start).Seconds()
	res.Language = pl.lang.name
	return res, nil
}

func infraResult(format string, args ...any) *dsecv1.RunCodeResult {
	return &dsecv1.RunCodeResult{Status: StatusSandbox, Infra: true, Message: fmt.Sprintf(format, args...)}
}

// RunCodeBatch runs calls concurrently and returns their results in order.
func (d *Driver) RunCodeBatch(ctx context.Context, reqs []*dsecv1.RunCodeRequest) ([]*dsecv1.RunCodeResult, error) {
	if len(reqs) > maxBatch {
		return nil, errdefs.Invalid("at most %d calls per batch", maxBatch)
	}
	out := make([]*dsecv1.RunCodeResult, len(reqs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, max(d.cfg.Slots*d.cfg.MaxWorkers, 1))
	for i, r := range reqs {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int, r *dsecv1.RunCodeRequest) {
			defer wg.Done()
			defer func() { <-sem }()
			res, err := d.RunCode(ctx, r)
			if err != nil {
				e := errdefs.Classify(err)
				status := StatusSandbox
				res = &dsecv1.RunCodeResult{Status: status, Infra: e.Infra, Message: e.Msg}
				if !e.Infra {
					res.Status = "invalid_request"
				}
			}
			out[i] = res
		}(i, r)
	}
	wg.Wait()
	return out, nil
}

// program is a planned program: the program of a call, or its checker.
type program struct {
	lang    *language
	files   []*guestv1.CallFile // the user's files and the source
	compile *guestv1.CallStep   // nil for interpreted languages
	// compileErr is a compile error found before compiling (a Scala
	// program without an object to run).
	compileErr string
	run        func(stdin []byte, args []string) *guestv1.CallStep
	env        []string
}

// plan is a validated request.
type plan struct {
	*program
	fetch   []string
	args    []string
	stdin   string
	checker *program
	judge   func(got, want string) (bool, string) // a built-in checker
	checkT  float64
}

// limits of one call's steps.
type stepLimits struct {
	compileT, runT, cpuT float64
	mem, maxOut          int64
}

// plan validates a request and builds the calls' steps (without their
// directories and uids).
func (d *Driver) plan(req *dsecv1.RunCodeRequest) (*plan, error) {
	lang := lookup(req.GetLanguage())
	if lang == nil {
		return nil, errdefs.Invalid("unknown language %q (have %s)", req.GetLanguage(), strings.Join(LanguageNames(), ", "))
	}
	if req.GetGpus() > 0 {
		if d.cfg.GPUs == 0 {
			return nil, errdefs.Unimplemented("GPU function calls need a node with GPUs; this node has none")
		}
		if m := req.GetGpuMode(); m != "" && m != "shared" && m != "exclusive" {
			return nil, errdefs.Invalid("gpu_mode must be shared or exclusive")
		}
		return nil, errdefs.Unimplemented("GPU function calls are not implemented on this node yet")
	}
	if len(req.GetCode()) > maxCode {
		return nil, errdefs.Invalid("code larger than %d bytes", maxCode)
	}
	var lim stepLimits
	var err error
	if lim.compileT, err = timeout(req.GetCompileTimeoutS(), "compile_timeout_s"); err != nil {
		return nil, err
	}
	if lim.runT, err = timeout(req.GetRunTimeoutS(), "run_timeout_s"); err != nil {
		return nil, err
	}
	lim.cpuT = req.GetCpuLimitS()
	if lim.cpuT <= 0 || lim.cpuT > lim.runT {
		lim.cpuT = lim.runT
	}
	lim.mem = req.GetMemoryLimitMb()
	switch {
	case lim.mem == 0:
		lim.mem = defaultMemMB
	case lim.mem < 0:
		lim.mem = 0 // the worker's limit only
	case lim.mem > d.cfg.WorkerMemoryMB:
		lim.mem = d.cfg.WorkerMemoryMB
	}
	lim.maxOut = req.GetMaxOutputBytes()
	if lim.maxOut <= 0 {
		lim.maxOut = 1 << 20
	}
	if lim.maxOut > 16<<20 {
		return nil, errdefs.Invalid("max_output_bytes at most %d", 16<<20)
	}
	if len(req.GetFiles()) > maxFiles {
		return nil, errdefs.Invalid("at most %d files", maxFiles)
	}
	if len(req.GetTests()) > maxCases {
		return nil, errdefs.Invalid("at most %d test cases", maxCases)
	}
	if len(req.GetArgs()) > 256 {
		return nil, errdefs.Invalid("at most 256 args")
	}
	pl := &plan{args: req.GetArgs(), stdin: req.GetStdin()}
	var files []*guestv1.CallFile
	total := 0
	names := make([]string, 0, len(req.GetFiles()))
	for n := range req.GetFiles() {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c := req.GetFiles()[n]
		clean := path.Clean("/" + n)[1:]
		if clean == "" || clean != strings.TrimPrefix(n, "./") || strings.HasPrefix(n, "/") {
			return nil, errdefs.Invalid("file name %q must be a relative path inside the call directory", n)
		}
		total += len(c)
		files = append(files, &guestv1.CallFile{Path: clean, Content: c, Mode: 0o600})
	}
	if total > maxFilesBytes {
		return nil, errdefs.Invalid("files larger than %d bytes in all", maxFilesBytes)
	}
	for _, f := range req.GetFetchFiles() {
		clean := path.Clean("/" + f)[1:]
		if clean == "" || strings.HasPrefix(f, "/") || strings.Contains(f, "..") {
			return nil, errdefs.Invalid("fetch file %q must be a relative path inside the call directory", f)
		}
		pl.fetch = append(pl.fetch, clean)
	}
	pl.program = planProgram(lang, req.GetCode(), files, lim)
	size := 0
	for _, tc := range req.GetTests() {
		size += len(tc.Stdin) + len(tc.ExpectedStdout)
	}
	if size > maxCaseBytes {
		return nil, errdefs.Invalid("test cases larger than %d bytes in all", maxCaseBytes)
	}
	ck := req.GetChecker()
	switch {
	case ck.GetCode() != "":
		cl := lookup(ck.GetLanguage())
		if cl == nil {
			return nil, errdefs.Invalid("unknown checker language %q (have %s)", ck.GetLanguage(), strings.Join(LanguageNames(), ", "))
		}
		if len(ck.GetCode()) > maxCode {
			return nil, errdefs.Invalid("checker code larger than %d bytes", maxCode)
		}
		if pl.checkT, err = timeout(ck.GetTimeoutS(), "checker.timeout_s"); err != nil {
			return nil, err
		}
		pl.checker = planProgram(cl, ck.GetCode(), nil, stepLimits{compileT: lim.compileT, runT: pl.checkT, cpuT: pl.checkT, mem: defaultMemMB, maxOut: 64 << 10})
	case ck != nil:
		j, err := builtinChecker(ck.GetBuiltin(), ck.GetFloatTolerance())
		if err != nil {
			return nil, err
		}
		pl.judge = j
	default:
		o := req.GetJudge()
		pl.judge = func(got, want string) (bool, string) { return matches(got, want, o), "" }
	}
	return pl, nil
}

// planProgram builds the steps of code in lang.
func planProgram(lang *language, code string, files []*guestv1.CallFile, lim stepLimits) *program {
	pr := &program{lang: lang, env: lang.env}
	if lang.missing != "" {
		return pr
	}
	src := lang.source
	if lang.sourceOf != nil {
		if s, err := lang.sourceOf(code); err == nil {
			src = s
		}
	}
	if lang.transform != nil {
		code = lang.transform(code)
	}
	pr.files = append(append([]*guestv1.CallFile(nil), files...), &guestv1.CallFile{Path: src, Content: []byte(code), Mode: 0o600})
	limits := func(t, cpu float64) *guestv1.CallStep {
		st := &guestv1.CallStep{
			TimeoutMs: int64(t * 1000), MaxOutput: lim.maxOut,
			RlimitCpuS: int64(math.Ceil(cpu)), RlimitFsizeBytes: 256 << 20, RlimitNproc: 64, RlimitNofile: 1024,
		}
		if lim.mem > 0 && !lang.noAS {
			st.RlimitAsBytes = lim.mem << 20
		}
		return st
	}
	if lang.compile != nil {
		st := limits(lim.compileT, lim.compileT)
		st.Argv, st.StopOnFailure, st.RlimitNproc, st.RlimitAsBytes = lang.compile, true, 256, 0
		pr.compile = st
	}
	argv := lang.run
	if lang.runOf != nil {
		if argv = lang.runOf(code); argv == nil {
			pr.compileErr = "no object to run: a Scala program declares an object with a main method"
			argv = []string{"false"}
		}
	}
	if lang.heap != "" && lim.mem > 0 {
		argv = append([]string{argv[0], fmt.Sprintf(lang.heap, lim.mem)}, argv[1:]...)
	}
	pr.run = func(stdin []byte, args []string) *guestv1.CallStep {
		st := limits(lim.runT, lim.cpuT)
		st.Argv = append(append([]string(nil), argv...), args...)
		st.Python, st.Stdin = lang.python, stdin
		if lang.noAS {
			// Runtimes of many threads (the JVM's compilers and
			// collectors) count them against the process limit.
			st.RlimitNproc = 256
		}
		return st
	}
	return pr
}

func timeout(v float64, name string) (float64, error) {
	switch {
	case v == 0:
		return defaultTimeout, nil
	case v < 0 || v > maxTimeout || math.IsNaN(v):
		return 0, errdefs.Invalid("%s must be between 0 and %g", name, maxTimeout)
	}
	return v, nil
}

// exec runs call on a slot of p, after checking that the worker runs
// every language in langs. A worker that fails under the call (dies, its
// runner dies, it cannot be cleaned mid-call) is the platform's failure:
// the call is retried once on another worker before it is reported. infra
// is then why the platform failed, and out is nil.
func (d *Driver) exec(ctx context.Context, p *pool, langs []*language, plan *guestv1.Call) (out *guestv1.CallResult, oom bool, infra string) {
	for attempt := 0; attempt < 2; attempt++ {
		if ctx.Err() != nil {
			return nil, false, "the call was cancelled: " + ctx.Err().Error()
		}
		out, oom, infra = d.execOnce(ctx, p, langs, plan)
		if infra == "" || strings.HasPrefix(infra, "language ") {
			return out, oom, infra
		}
	}
	return nil, false, infra
}

func (d *Driver) execOnce(ctx context.Context, p *pool, langs []*language, plan *guestv1.Call) (*guestv1.CallResult, bool, string) {
	w, slot, err := p.acquire(ctx)
	if err != nil {
		return nil, false, errdefs.Classify(err).Msg
	}
	for _, l := range langs {
		if why := l.lacking(w.have); why != "" {
			p.release(w, slot, "")
			return nil, false, fmt.Sprintf("language %s cannot run on image %s: %s", l.name, p.image, why)
		}
	}
	call := &guestv1.Call{
		Dir: slotDir(slot), Uid: uint32(uidBase + slot), DiskBytes: d.cfg.CallDiskMB << 20,
		Files: plan.Files, Steps: plan.Steps, Fetch: plan.Fetch, MaxFetch: plan.MaxFetch, Env: plan.Env,
	}
	var budget time.Duration
	for _, s := range call.Steps {
		budget += time.Duration(s.TimeoutMs)*time.Millisecond + time.Second
	}
	cctx, cancel := context.WithTimeout(ctx, budget+30*time.Second)
	out, err := w.agent.Call(cctx, call)
	cancel()
	if err != nil {
		reason := "call failed: " + err.Error()
		if w.inst.Check(context.Background()) != nil {
			reason = "the worker died"
		}
		p.release(w, slot, reason)
		return nil, false, "function worker failed: " + errdefs.Classify(err).Msg
	}
	oom := w.oomSince(out)
	p.release(w, slot, out.DirtyReason)
	for _, s := range out.Steps {
		if strings.HasPrefix(s.Error, "runner:") {
			return nil, false, "function worker failed: " + s.Error
		}
	}
	if out.Dirty && len(out.Steps) < len(call.Steps) {
		// A step did not run and the worker broke: whatever stopped it
		// was the platform (a failed step that stops the rest leaves a
		// clean worker).
		stopped := false
		for i, s := range out.Steps {
			stopped = stopped || (call.Steps[i].StopOnFailure && (s.ExitCode != 0 || s.TimedOut || s.Error != ""))
		}
		if !stopped {
			return nil, false, "the worker broke during the call: " + out.DirtyReason
		}
	}
	return out, oom, ""
}

// single runs a call without tests: compile and run in one worker call.
func (d *Driver) single(ctx context.Context, p *pool, pl *plan) *dsecv1.RunCodeResult {
	if pl.compileErr != "" {
		return compileError(pl.compileErr)
	}
	c := &guestv1.Call{Files: pl.files, Fetch: pl.fetch, MaxFetch: 16 << 20, Env: pl.env}
	if pl.compile != nil {
		c.Steps = append(c.Steps, pl.compile)
	}
	c.Steps = append(c.Steps, pl.run([]byte(pl.stdin), pl.args))
	out, oom, infra := d.exec(ctx, p, []*language{pl.lang}, c)
	if infra != "" {
		return infraResult("%s", infra)
	}
	res := &dsecv1.RunCodeResult{Files: map[string][]byte{}}
	for _, f := range out.Fetched {
		if !f.Missing {
			res.Files[f.Path] = f.Content
		}
	}
	steps := out.Steps
	if pl.compile != nil {
		if len(steps) == 0 {
			return infraResult("the compile step did not run")
		}
		res.Compile = stage(steps[0], oom)
		steps = steps[1:]
		if res.Compile.Status != "finished" {
			res.Status, res.Message = StatusCompile, "compilation failed"
			if res.Compile.Status == StatusTLE {
				res.Message = "compilation timed out"
				if c := res.Compile; c.CpuS < c.DurationS/2 {
					// A compiler does not wait: one that ran out of wall
					// time with its CPU time well below it was starved by
					// a busy host, which is no fault of the program.
					r := infraResult("the host was too busy to compile the program within its compile timeout (%.1fs of CPU in %.1fs)", c.CpuS, c.DurationS)
					r.Compile = c
					return r
				}
			}
			return res
		}
	}
	if len(steps) == 0 {
		return infraResult("the program did not run")
	}
	res.Run = stage(steps[0], oom)
	res.Status = statusOf(res.Run)
	return res
}

func compileError(msg string) *dsecv1.RunCodeResult {
	return &dsecv1.RunCodeResult{Status: StatusCompile, Message: msg,
		Compile: &dsecv1.StageResult{Status: "error", ExitCode: 1, Stderr: msg + "\n"}}
}

func statusOf(s *dsecv1.StageResult) string {
	switch s.Status {
	case "finished":
		return StatusSuccess
	case StatusTLE:
		return StatusTLE
	case StatusMLE:
		return StatusMLE
	}
	return StatusRuntime
}

// stage reads one step's exit.
func stage(x *guestv1.Exit, oom bool) *dsecv1.StageResult {
	s := &dsecv1.StageResult{
		ExitCode: x.ExitCode, Stdout: text(x.Stdout), Stderr: text(x.Stderr), Truncated: x.Truncated,
		DurationS: float64(x.DurationUs) / 1e6, CpuS: float64(x.CpuUs) / 1e6, MaxRssKb: x.MaxRssKb,
	}
	if x.Signal != 0 {
		s.Signal = strings.TrimPrefix(unix.SignalName(syscall.Signal(x.Signal)), "SIG")
	}
	stderr := string(x.Stderr)
	switch {
	case x.TimedOut || x.Signal == int32(syscall.SIGXCPU):
		s.Status = StatusTLE
	case x.ExitCode == 128+int32(syscall.SIGXCPU) && strings.Contains(stderr, "CPU time limit exceeded"):
		// A launcher script (kotlinc, scala) whose program the CPU limit
		// ended: its shell says so and exits 128+SIGXCPU.
		s.Status = StatusTLE
	case x.Signal == int32(syscall.SIGKILL) && oom:
		s.Status = StatusMLE
	case x.ExitCode != 0 && outOfMemory(stderr):
		s.Status = StatusMLE
	case x.Error != "" || x.ExitCode != 0:
		s.Status = "error"
	default:
		s.Status = "finished"
	}
	if x.Error != "" && s.Stderr == "" {
		s.Stderr = x.Error
	}
	return s
}

// text makes output valid UTF-8 for the API's string fields.
func text(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return strings.ToValidUTF8(string(b), "\uFFFD")
}

// oomMarks are what runtimes print when an allocation fails: the
// program's memory limit, not a crash.
var oomMarks = []string{
	"MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory",
	"java.lang.OutOfMemoryError", "JavaScript heap out of memory", "memory allocation of ",
	"System.OutOfMemoryException", "cannot allocate vector of size", "core.exception.OutOfMemoryError",
	"failed to allocate memory", "[FATAL] tried to allocate", "NoMemoryError",
}

func outOfMemory(stderr string) bool {
	for _, m := range oomMarks {
		if strings.Contains(stderr, m) {
			return true
		}
	}
	return false
}
