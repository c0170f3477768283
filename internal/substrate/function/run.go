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
	have := w.languages
	p.release(w, slot, "")
	var out []*dsecv1.LanguageInfo
	for _, l := range languages {
		out = append(out, &dsecv1.LanguageInfo{Name: l.name, Aliases: l.aliases, Available: have[l.name], Image: img})
	}
	return out, nil
}

// RunCode runs one call. Program failures are results; the error is for
// requests that are invalid. Platform failures are results with status
// sandbox_error and infra set, so a batch reports them per item.
func (d *Driver) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("function calls cannot run on this node: %s", d.caps.Reason)
	}
	lang, call, err := d.plan(req)
	if err != nil {
		return nil, err
	}
	img := req.GetImage()
	if img == "" {
		img = d.cfg.Image
	}
	if _, err := d.images.Get(img); err != nil {
		return nil, err
	}
	start := time.Now()
	// A worker that dies under a call is the platform's failure: retry once
	// on another worker before reporting it.
	var res *dsecv1.RunCodeResult
	for attempt := 0; attempt < 2; attempt++ {
		res, err = d.runOn(ctx, d.poolFor(img), lang, req, call)
		if err != nil {
			return nil, err
		}
		if !res.Infra {
			break
		}
	}
	res.DurationS = time.Since(start).Seconds()
	res.Language = lang.name
	return res, nil
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

// plan validates a request and builds the worker call (without its
// directory and uid).
func (d *Driver) plan(req *dsecv1.RunCodeRequest) (*language, *guestv1.Call, error) {
	lang := byName[strings.ToLower(strings.TrimSpace(req.GetLanguage()))]
	if lang == nil {
		names := make([]string, 0, len(languages))
		for _, l := range languages {
			names = append(names, l.name)
		}
		return nil, nil, errdefs.Invalid("unknown language %q (have %s)", req.GetLanguage(), strings.Join(names, ", "))
	}
	if req.GetGpus() > 0 {
		if d.cfg.GPUs == 0 {
			return nil, nil, errdefs.Unimplemented("GPU function calls need a node with GPUs; this node has none")
		}
		if m := req.GetGpuMode(); m != "" && m != "shared" && m != "exclusive" {
			return nil, nil, errdefs.Invalid("gpu_mode must be shared or exclusive")
		}
		return nil, nil, errdefs.Unimplemented("GPU function calls are not implemented on this node yet")
	}
	if len(req.GetCode()) > maxCode {
		return nil, nil, errdefs.Invalid("code larger than %d bytes", maxCode)
	}
	compileT, err := timeout(req.GetCompileTimeoutS(), "compile_timeout_s")
	if err != nil {
		return nil, nil, err
	}
	runT, err := timeout(req.GetRunTimeoutS(), "run_timeout_s")
	if err != nil {
		return nil, nil, err
	}
	cpuT := req.GetCpuLimitS()
	if cpuT <= 0 || cpuT > runT {
		cpuT = runT
	}
	mem := req.GetMemoryLimitMb()
	switch {
	case mem == 0:
		mem = defaultMemMB
	case mem < 0:
		mem = 0 // the worker's limit only
	case mem < 16 || mem > d.cfg.WorkerMemoryMB:
		return nil, nil, errdefs.Invalid("memory_limit_mb must be between 16 and %d", d.cfg.WorkerMemoryMB)
	}
	maxOut := req.GetMaxOutputBytes()
	if maxOut <= 0 {
		maxOut = 1 << 20
	}
	if maxOut > 16<<20 {
		return nil, nil, errdefs.Invalid("max_output_bytes at most %d", 16<<20)
	}
	if len(req.GetFiles()) > maxFiles {
		return nil, nil, errdefs.Invalid("at most %d files", maxFiles)
	}
	if len(req.GetTests()) > maxCases {
		return nil, nil, errdefs.Invalid("at most %d test cases", maxCases)
	}
	call := &guestv1.Call{MaxFetch: 16 << 20}
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
			return nil, nil, errdefs.Invalid("file name %q must be a relative path inside the call directory", n)
		}
		total += len(c)
		call.Files = append(call.Files, &guestv1.CallFile{Path: clean, Content: c, Mode: 0o600})
	}
	if total > maxFilesBytes {
		return nil, nil, errdefs.Invalid("files larger than %d bytes in all", maxFilesBytes)
	}
	for _, f := range req.GetFetchFiles() {
		clean := path.Clean("/" + f)[1:]
		if clean == "" || strings.HasPrefix(f, "/") || strings.Contains(f, "..") {
			return nil, nil, errdefs.Invalid("fetch file %q must be a relative path inside the call directory", f)
		}
		call.Fetch = append(call.Fetch, clean)
	}
	call.Files = append(call.Files, &guestv1.CallFile{Path: lang.source, Content: []byte(req.GetCode()), Mode: 0o600})
	limits := func(t float64, cpu float64) *guestv1.CallStep {
		st := &guestv1.CallStep{
			TimeoutMs: int64(t * 1000), MaxOutput: maxOut,
			RlimitCpuS: int64(math.Ceil(cpu)), RlimitFsizeBytes: 256 << 20, RlimitNproc: 64, RlimitNofile: 1024,
		}
		if mem > 0 && !lang.noAS {
			st.RlimitAsBytes = mem << 20
		}
		return st
	}
	if lang.compile != nil {
		st := limits(compileT, compileT)
		st.Argv, st.StopOnFailure, st.RlimitNproc, st.RlimitAsBytes = lang.compile, true, 256, 0
		call.Steps = append(call.Steps, st)
	}
	run := func(stdin string) *guestv1.CallStep {
		st := limits(runT, cpuT)
		st.Argv, st.Python, st.Stdin = lang.run, lang.python, []byte(stdin)
		return st
	}
	if len(req.GetTests()) == 0 {
		call.Steps = append(call.Steps, run(req.GetStdin()))
	} else {
		size := 0
		for _, tc := range req.GetTests() {
			size += len(tc.Stdin) + len(tc.ExpectedStdout)
			call.Steps = append(call.Steps, run(tc.Stdin))
		}
		if size > maxCaseBytes {
			return nil, nil, errdefs.Invalid("test cases larger than %d bytes in all", maxCaseBytes)
		}
	}
	return lang, call, nil
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

func (d *Driver) runOn(ctx context.Context, p *pool, lang *language, req *dsecv1.RunCodeRequest, plan *guestv1.Call) (*dsecv1.RunCodeResult, error) {
	w, slot, err := p.acquire(ctx)
	if err != nil {
		if errdefs.IsInfra(err) {
			e := errdefs.Classify(err)
			return &dsecv1.RunCodeResult{Status: StatusSandbox, Infra: true, Message: e.Msg}, nil
		}
		return nil, err
	}
	call := &guestv1.Call{
		Dir: slotDir(slot), Uid: uint32(uidBase + slot), DiskBytes: d.cfg.CallDiskMB << 20,
		Files: plan.Files, Steps: plan.Steps, Fetch: plan.Fetch, MaxFetch: plan.MaxFetch,
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
		return &dsecv1.RunCodeResult{Status: StatusSandbox, Infra: true, Message: "function worker failed: " + errdefs.Classify(err).Msg}, nil
	}
	oom := w.oomSince(out)
	p.release(w, slot, out.DirtyReason)
	res := classify(lang, req, out, oom)
	if out.Dirty && len(out.Steps) < len(call.Steps) && res.Status == StatusSuccess {
		res.Status, res.Infra, res.Message = StatusSandbox, true, "the worker broke during the call: "+out.DirtyReason
	}
	return res, nil
}

// classify turns step exits into a result.
func classify(lang *language, req *dsecv1.RunCodeRequest, out *guestv1.CallResult, oom bool) *dsecv1.RunCodeResult {
	res := &dsecv1.RunCodeResult{Files: map[string][]byte{}}
	for _, f := range out.Fetched {
		if !f.Missing {
			res.Files[f.Path] = f.Content
		}
	}
	steps := out.Steps
	for _, s := range steps {
		if strings.HasPrefix(s.Error, "runner:") {
			return &dsecv1.RunCodeResult{Status: StatusSandbox, Infra: true, Message: s.Error}
		}
	}
	if lang.compile != nil {
		if len(steps) == 0 {
			return &dsecv1.RunCodeResult{Status: StatusSandbox, Infra: true, Message: "the compile step did not run"}
		}
		res.Compile = stage(steps[0], oom)
		steps = steps[1:]
		if res.Compile.Status != "finished" {
			res.Status = StatusCompile
			res.Message = "compilation failed"
			if res.Compile.Status == StatusTLE {
				res.Message = "compilation timed out"
			}
			return res
		}
	}
	if len(req.GetTests()) == 0 {
		if len(steps) == 0 {
			return &dsecv1.RunCodeResult{Status: StatusSandbox, Infra: true, Message: "the program did not run"}
		}
		res.Run = stage(steps[0], oom)
		res.Status = statusOf(res.Run)
		return res
	}
	res.Total = int32(len(req.GetTests()))
	res.Status = StatusSuccess
	stop := false
	for i, tc := range req.GetTests() {
		cr := &dsecv1.CaseResult{Index: int32(i), Name: tc.Name}
		switch {
		case stop || i >= len(steps):
			cr.Status = "not_run"
		default:
			cr.Run = stage(steps[i], oom)
			st := statusOf(cr.Run)
			switch {
			case st != StatusSuccess:
				cr.Status = st
			case matches(cr.Run.Stdout, tc.ExpectedStdout, req.GetJudge()):
				cr.Status, cr.Passed = "passed", true
			default:
				cr.Status = StatusWrongAnswer
			}
		}
		if cr.Passed {
			res.Passed++
		} else {
			if res.Status == StatusSuccess {
				res.Status = cr.Status
				if cr.Status == "not_run" {
					res.Status = StatusWrongAnswer
				}
			}
			if req.GetJudge().GetStopOnFirstFailure() {
				stop = true
			}
		}
		res.Cases = append(res.Cases, cr)
	}
	res.Message = fmt.Sprintf("%d of %d cases passed", res.Passed, res.Total)
	return res
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
	case x.Signal == int32(syscall.SIGKILL) && oom:
		s.Status = StatusMLE
	case x.ExitCode != 0 && (strings.Contains(stderr, "MemoryError") || strings.Contains(stderr, "std::bad_alloc") ||
		strings.Contains(stderr, "Cannot allocate memory") || strings.Contains(stderr, "out of memory")):
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
