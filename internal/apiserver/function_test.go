package apiserver

import (
	"encoding/json"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// TestSandboxFusionResponses: /run_code answers what SandboxFusion answers
// for the same outcome (its sandbox_api.py and runners, read at commit
// 469de08): the statuses, the message left empty but for SandboxError, no
// return code at a timeout, minus the signal for a killed process, no
// compile_result for a language SandboxFusion runs in one command.
func TestSandboxFusionResponses(t *testing.T) {
	fin := func(code int32, out string) *dsecv1.StageResult {
		return &dsecv1.StageResult{Status: "finished", ExitCode: code, Stdout: out, DurationS: 0.5}
	}
	tests := []struct {
		name string
		res  *dsecv1.RunCodeResult
		want string
	}{
		{"a program that succeeds", &dsecv1.RunCodeResult{Status: "success", Language: "python", Message: "ignored", Run: fin(0, "5\n")},
			`{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.5,"return_code":0,"stdout":"5\n","stderr":""},"executor_pod_name":null,"files":{}}`},
		{"a program that exits non-zero", &dsecv1.RunCodeResult{Status: "runtime_error", Language: "python", Run: &dsecv1.StageResult{Status: "error", ExitCode: 1, Stderr: "boom", DurationS: 0.5}},
			`{"status":"Failed","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.5,"return_code":1,"stdout":"","stderr":"boom"},"executor_pod_name":null,"files":{}}`},
		{"a program killed by a signal", &dsecv1.RunCodeResult{Status: "runtime_error", Language: "cpp", Compile: fin(0, ""), Run: &dsecv1.StageResult{Status: "error", ExitCode: 139, Signal: "SEGV", DurationS: 0.5}},
			`{"status":"Failed","message":"","compile_result":{"status":"Finished","execution_time":0.5,"return_code":0,"stdout":"","stderr":""},"run_result":{"status":"Finished","execution_time":0.5,"return_code":-11,"stdout":"","stderr":""},"executor_pod_name":null,"files":{}}`},
		{"a program that times out", &dsecv1.RunCodeResult{Status: "time_limit_exceeded", Language: "python", Run: &dsecv1.StageResult{Status: "time_limit_exceeded", ExitCode: 137, Signal: "KILL", Stdout: "partial", DurationS: 1}},
			`{"status":"Failed","message":"","compile_result":null,"run_result":{"status":"TimeLimitExceeded","execution_time":1,"return_code":null,"stdout":"partial","stderr":""},"executor_pod_name":null,"files":{}}`},
		{"a compile error has no run result", &dsecv1.RunCodeResult{Status: "compile_error", Language: "cpp", Message: "compilation failed", Compile: &dsecv1.StageResult{Status: "error", ExitCode: 1, Stderr: "error", DurationS: 0.5}},
			`{"status":"Failed","message":"","compile_result":{"status":"Finished","execution_time":0.5,"return_code":1,"stdout":"","stderr":"error"},"run_result":null,"executor_pod_name":null,"files":{}}`},
		{"a TypeScript syntax error is its run's (SandboxFusion does not compile TypeScript)", &dsecv1.RunCodeResult{Status: "compile_error", Language: "typescript", Compile: &dsecv1.StageResult{Status: "error", ExitCode: 1, Stderr: "TS1005", DurationS: 0.5}},
			`{"status":"Failed","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.5,"return_code":1,"stdout":"","stderr":"TS1005"},"executor_pod_name":null,"files":{}}`},
		{"a compiled TypeScript program answers its run only", &dsecv1.RunCodeResult{Status: "success", Language: "typescript", Compile: fin(0, ""), Run: fin(0, "5\n")},
			`{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.5,"return_code":0,"stdout":"5\n","stderr":""},"executor_pod_name":null,"files":{}}`},
		{"a platform failure is a SandboxError with its message", &dsecv1.RunCodeResult{Status: "sandbox_error", Infra: true, Language: "java", Message: "language java cannot run on image debian: its toolchain (javac, java) is not in the worker image"},
			`{"status":"SandboxError","message":"language java cannot run on image debian: its toolchain (javac, java) is not in the worker image","compile_result":null,"run_result":null,"executor_pod_name":null,"files":{}}`},
		{"fetched files are base64", &dsecv1.RunCodeResult{Status: "success", Language: "python", Run: fin(0, ""), Files: map[string][]byte{"out.txt": []byte("hi")}},
			`{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.5,"return_code":0,"stdout":"","stderr":""},"executor_pod_name":null,"files":{"out.txt":"aGk="}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := json.Marshal(toSF(tt.res))
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tt.want {
				t.Fatalf("got  %s\nwant %s", b, tt.want)
			}
		})
	}
}

// TestSandboxFusionDefaults: SandboxFusion's request defaults and what a
// node's limits clamp.
func TestSandboxFusionDefaults(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	for _, tt := range []struct {
		name string
		in   *float64
		want float64
	}{
		{"no timeout is 10 s", nil, 10},
		{"a timeout is kept", f(2.5), 2.5},
		{"a zero timeout times out at once, as SandboxFusion's", f(0), 0.001},
		{"a timeout above the node's longest is the longest", f(1e6), sfMaxTimeout},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := sfTimeout(tt.in); got != tt.want {
				t.Fatalf("sfTimeout = %v, want %v", got, tt.want)
			}
		})
	}
}
