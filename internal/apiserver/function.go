package apiserver

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"

	"golang.org/x/sys/unix"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

type functionService struct{ r Router }

var _ dsecv1connect.FunctionServiceHandler = (*functionService)(nil)

func (s *functionService) RunCode(ctx context.Context, req *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResult], error) {
	n, err := s.r.ForFunction(ctx)
	if err != nil {
		return nil, wire(err)
	}
	return n.RunCode(ctx, connect.NewRequest(req.Msg))
}

func (s *functionService) RunCodeBatch(ctx context.Context, req *connect.Request[dsecv1.RunCodeBatchRequest]) (*connect.Response[dsecv1.RunCodeBatchResponse], error) {
	n, err := s.r.ForFunction(ctx)
	if err != nil {
		return nil, wire(err)
	}
	return n.RunCodeBatch(ctx, connect.NewRequest(req.Msg))
}

func (s *functionService) ListLanguages(ctx context.Context, req *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	n, err := s.r.ForFunction(ctx)
	if err != nil {
		return nil, wire(err)
	}
	return n.ListLanguages(ctx, connect.NewRequest(req.Msg))
}

// SandboxFusion's /run_code, so verl's, SkyRL's and tinker's existing
// clients work by changing the URL. The request and response are
// SandboxFusion's (bytedance/SandboxFusion, sandbox/server/sandbox_api.py):
// its defaults (compile and run timeouts 10 s, no memory limit), its
// statuses (Success when every step exited 0, Failed when one exited
// otherwise or timed out, SandboxError when the sandbox failed, with the
// message empty but for SandboxError), its command results (return_code
// null at a timeout, minus the signal for a killed process; no
// compile_result for languages SandboxFusion does not compile), and its
// validation errors (HTTP 422 with a FastAPI "detail" list). Limits beyond
// what the node allows are clamped to it, not refused.

type sfRequest struct {
	Code           *string            `json:"code"`
	Language       *string            `json:"language"`
	CompileTimeout *float64           `json:"compile_timeout"`
	RunTimeout     *float64           `json:"run_timeout"`
	MemoryLimitMB  *int64             `json:"memory_limit_MB"`
	Stdin          *string            `json:"stdin"`
	Files          map[string]*string `json:"files"`
	FetchFiles     []string           `json:"fetch_files"`
	// Args is dsec's: arguments after the program's command.
	Args []string `json:"args"`
}

type sfCommandResult struct {
	Status        string   `json:"status"`
	ExecutionTime *float64 `json:"execution_time"`
	ReturnCode    *int32   `json:"return_code"`
	Stdout        *string  `json:"stdout"`
	Stderr        *string  `json:"stderr"`
}

type sfResponse struct {
	Status          string            `json:"status"`
	Message         string            `json:"message"`
	CompileResult   *sfCommandResult  `json:"compile_result"`
	RunResult       *sfCommandResult  `json:"run_result"`
	ExecutorPodName *string           `json:"executor_pod_name"`
	Files           map[string]string `json:"files"`
}

// sfCompiled are the languages SandboxFusion runs in two commands (a
// compile_result, then a run_result); the others (typescript, C#, go_test
// and jest among them, which dsec compiles first) answer one run_result,
// as SandboxFusion's do.
var sfCompiled = map[string]bool{"cpp": true, "c": true, "go": true, "java": true, "junit": true, "rust": true, "D_ut": true, "scala": true, "verilog": true, "swift": true}

// sfMaxTimeout is the longest timeout a node accepts; SandboxFusion's
// longer ones are clamped to it.
const sfMaxTimeout = 300.0

// writeSFInvalid answers a request SandboxFusion's validation would refuse:
// HTTP 422 with FastAPI's body.
func writeSFInvalid(w http.ResponseWriter, field, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusUnprocessableEntity)
	loc := []string{"body"}
	if field != "" {
		loc = append(loc, field)
	}
	json.NewEncoder(w).Encode(map[string]any{"detail": []map[string]any{{"type": "value_error", "loc": loc, "msg": msg}}})
}

func sfTimeout(v *float64) float64 {
	switch {
	case v == nil:
		return 10
	case *v <= 0 || math.IsNaN(*v):
		return 0.001 // SandboxFusion waits no time at all: the run times out
	case *v > sfMaxTimeout:
		return sfMaxTimeout
	}
	return *v
}

func (s *Server) serveRunCode(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusMethodNotAllowed)
		w.Write([]byte(`{"detail":"Method Not Allowed"}` + "\n"))
		return
	}
	var in sfRequest
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		field := ""
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			field = te.Field
		}
		writeSFInvalid(w, field, "invalid request body: "+err.Error())
		return
	}
	switch {
	case in.Code == nil:
		writeSFInvalid(w, "code", "Field required")
		return
	case in.Language == nil:
		writeSFInvalid(w, "language", "Field required")
		return
	}
	req := &dsecv1.RunCodeRequest{Language: *in.Language, Code: *in.Code, FetchFiles: in.FetchFiles, Files: map[string][]byte{}, Args: in.Args,
		CompileTimeoutS: sfTimeout(in.CompileTimeout), RunTimeoutS: sfTimeout(in.RunTimeout), MemoryLimitMb: -1}
	if in.MemoryLimitMB != nil && *in.MemoryLimitMB > 0 {
		req.MemoryLimitMb = *in.MemoryLimitMB // a node clamps it to its workers' memory
	}
	if in.Stdin != nil {
		req.Stdin = *in.Stdin
	}
	for name, b64 := range in.Files {
		if b64 == nil || strings.Contains(name, "IGNORE_THIS_FILE") {
			continue // SandboxFusion skips both
		}
		b, err := base64.StdEncoding.DecodeString(*b64)
		if err != nil {
			// SandboxFusion fails decoding it while running the call.
			writeSF(w, &sfResponse{Status: "SandboxError", Message: fmt.Sprintf("file %q is not valid base64: %v", name, err), Files: map[string]string{}})
			return
		}
		req.Files[name] = b
	}
	// A path SandboxFusion would read outside its directory is not
	// fetched (it answers no file for a path it cannot read).
	fetch := req.FetchFiles[:0]
	for _, f := range req.FetchFiles {
		if f != "" && !strings.HasPrefix(f, "/") && !strings.Contains(f, "..") {
			fetch = append(fetch, f)
		}
	}
	req.FetchFiles = fetch
	n, err := s.router.ForFunction(r.Context())
	var res *connect.Response[dsecv1.RunCodeResult]
	if err == nil {
		res, err = n.RunCode(r.Context(), connect.NewRequest(req))
		err = errwire.FromConnect(err)
	}
	if err != nil {
		e := errdefs.Classify(err)
		if e.Kind == errdefs.KindInvalid {
			field := ""
			if strings.Contains(e.Msg, "language") {
				field = "language"
			}
			writeSFInvalid(w, field, e.Msg)
			return
		}
		if !e.Infra {
			writeHTTPError(w, err)
			return
		}
		writeSF(w, &sfResponse{Status: "SandboxError", Message: e.Msg, Files: map[string]string{}})
		return
	}
	writeSF(w, toSF(res.Msg))
}

func toSF(res *dsecv1.RunCodeResult) *sfResponse {
	out := &sfResponse{Files: map[string]string{}}
	switch res.Status {
	case "success":
		out.Status = "Success"
	case "sandbox_error":
		out.Status, out.Message = "SandboxError", res.Message
	default:
		out.Status = "Failed"
	}
	compile, run := res.Compile, res.Run
	if !sfCompiled[res.Language] && compile != nil {
		// One command in SandboxFusion: a failed compile is its run.
		if compile.Status != "finished" {
			run = compile
		}
		compile = nil
	}
	out.CompileResult = sfStage(compile)
	out.RunResult = sfStage(run)
	for k, v := range res.Files {
		out.Files[k] = base64.StdEncoding.EncodeToString(v)
	}
	return out
}

func sfStage(s *dsecv1.StageResult) *sfCommandResult {
	if s == nil || s.Status == "not_run" {
		return nil
	}
	// SandboxFusion says Finished for a process that ran (whatever its
	// return code: a signal's is minus the signal, as Python reports it)
	// and TimeLimitExceeded, without a return code, for one killed at the
	// limit.
	d, stdout, stderr := s.DurationS, s.Stdout, s.Stderr
	out := &sfCommandResult{Status: "Finished", ExecutionTime: &d, Stdout: &stdout, Stderr: &stderr}
	if s.Status == "time_limit_exceeded" {
		out.Status = "TimeLimitExceeded"
		return out
	}
	rc := s.ExitCode
	if s.Signal != "" {
		if n := unix.SignalNum("SIG" + s.Signal); n != 0 {
			rc = -int32(n)
		}
	}
	out.ReturnCode = &rc
	return out
}

func writeSF(w http.ResponseWriter, v *sfResponse) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}
