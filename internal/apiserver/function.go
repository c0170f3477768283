package apiserver

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"

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

// SandboxFusion's /run_code, so verl's and tinker's existing clients work
// by changing the URL (bytedance/SandboxFusion RunCodeRequest and
// RunCodeResponse).

type sfRequest struct {
	Code           string            `json:"code"`
	Language       string            `json:"language"`
	CompileTimeout *float64          `json:"compile_timeout"`
	RunTimeout     *float64          `json:"run_timeout"`
	MemoryLimitMB  *int64            `json:"memory_limit_MB"`
	Stdin          *string           `json:"stdin"`
	Files          map[string]string `json:"files"`
	FetchFiles     []string          `json:"fetch_files"`
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

// sfLanguages are SandboxFusion languages dsec does not run.
var sfLanguages = map[string]string{"typescript": "", "python_gpu": "", "cuda": "", "go_test": "", "pytest": "", "junit": "", "jest": ""}

func (s *Server) serveRunCode(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		writeHTTPError(w, errdefs.Invalid("POST a RunCodeRequest"))
		return
	}
	var in sfRequest
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		writeHTTPError(w, errdefs.Invalid("bad request body: %v", err))
		return
	}
	req := &dsecv1.RunCodeRequest{Language: in.Language, Code: in.Code, FetchFiles: in.FetchFiles, Files: map[string][]byte{}}
	if v, ok := sfLanguages[in.Language]; ok && v == "" {
		writeSF(w, &sfResponse{Status: "SandboxError", Message: "language " + in.Language + " is not supported"})
		return
	}
	if in.CompileTimeout != nil {
		req.CompileTimeoutS = *in.CompileTimeout
	}
	if in.RunTimeout != nil {
		req.RunTimeoutS = *in.RunTimeout
	}
	if in.MemoryLimitMB != nil {
		req.MemoryLimitMb = *in.MemoryLimitMB
		if req.MemoryLimitMb < 0 {
			req.MemoryLimitMb = -1
		}
	}
	if in.Stdin != nil {
		req.Stdin = *in.Stdin
	}
	for name, b64 := range in.Files {
		b, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			writeHTTPError(w, errdefs.Invalid("file %q is not valid base64", name))
			return
		}
		req.Files[name] = b
	}
	n, err := s.router.ForFunction(r.Context())
	var res *connect.Response[dsecv1.RunCodeResult]
	if err == nil {
		res, err = n.RunCode(r.Context(), connect.NewRequest(req))
		err = errwire.FromConnect(err)
	}
	if err != nil {
		e := errdefs.Classify(err)
		if !e.Infra {
			// SandboxFusion answers bad requests with a SandboxError body; a
			// 4xx here keeps clients from retrying what cannot succeed.
			writeHTTPError(w, err)
			return
		}
		writeSF(w, &sfResponse{Status: "SandboxError", Message: e.Msg})
		return
	}
	writeSF(w, toSF(res.Msg))
}

func toSF(res *dsecv1.RunCodeResult) *sfResponse {
	out := &sfResponse{Message: res.Message, Files: map[string]string{}}
	switch res.Status {
	case "success":
		out.Status = "Success"
	case "sandbox_error":
		out.Status = "SandboxError"
	default:
		out.Status = "Failed"
	}
	out.CompileResult = sfStage(res.Compile)
	out.RunResult = sfStage(res.Run)
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
	// return code) and TimeLimitExceeded for one killed at the limit.
	out := &sfCommandResult{Status: "Finished", ExecutionTime: &s.DurationS, ReturnCode: &s.ExitCode, Stdout: &s.Stdout, Stderr: &s.Stderr}
	if s.Status == "time_limit_exceeded" {
		out.Status = "TimeLimitExceeded"
	}
	return out
}

func writeSF(w http.ResponseWriter, v *sfResponse) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}
