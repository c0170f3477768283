package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

var (
	fnOnce sync.Once
	fnSrv  *dsectest.Server
)

// functionServer is one server with the debian image that the function
// tests share (its image and workers take a while to start); TestMain
// stops it.
func functionServer(t *testing.T) *dsectest.Server {
	if testing.Short() {
		t.Skip("bootstraps debian")
	}
	dsectest.Need(t)
	fnOnce.Do(func() { fnSrv = dsectest.Start(shared, dsectest.Options{Images: []string{"debian"}}) })
	return fnSrv
}

func runCode(t *testing.T, c dsecv1connect.FunctionServiceClient, req *dsecv1.RunCodeRequest) *dsecv1.RunCodeResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r, err := c.RunCode(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatalf("RunCode: %v", err)
	}
	return r.Msg
}

func TestFunctionCalls(t *testing.T) {
	srv := functionServer(t)
	fc := dsecv1connect.NewFunctionServiceClient(http.DefaultClient, srv.URL)
	cases := []struct {
		name   string
		req    *dsecv1.RunCodeRequest
		status string
		check  func(*testing.T, *dsecv1.RunCodeResult)
	}{
		{"python prints", &dsecv1.RunCodeRequest{Language: "python", Code: "print(sum(range(1000)))"}, "success",
			func(t *testing.T, r *dsecv1.RunCodeResult) {
				if r.Run.Stdout != "499500\n" {
					t.Fatalf("stdout %q", r.Run.Stdout)
				}
			}},
		{"python reads stdin", &dsecv1.RunCodeRequest{Language: "python", Code: "import sys; print(sys.stdin.read()[::-1])", Stdin: "abc"}, "success",
			func(t *testing.T, r *dsecv1.RunCodeResult) {
				if r.Run.Stdout != "cba\n" {
					t.Fatalf("stdout %q", r.Run.Stdout)
				}
			}},
		{"a python exception is a runtime error", &dsecv1.RunCodeRequest{Language: "python", Code: "1/0"}, "runtime_error",
			func(t *testing.T, r *dsecv1.RunCodeResult) {
				if !strings.Contains(r.Run.Stderr, "ZeroDivisionError") || strings.Contains(r.Run.Stderr, "runner.py") {
					t.Fatalf("stderr %q", r.Run.Stderr)
				}
			}},
		{"bash runs", &dsecv1.RunCodeRequest{Language: "bash", Code: "echo $((6*7))"}, "success", nil},
		{"c compiles and runs", &dsecv1.RunCodeRequest{Language: "c", Code: "#include <stdio.h>\nint main(){printf(\"%d\\n\", 7*6); return 0;}"}, "success",
			func(t *testing.T, r *dsecv1.RunCodeResult) {
				if r.Compile.Status != "finished" || r.Run.Stdout != "42\n" {
					t.Fatalf("%v", r)
				}
			}},
		{"c++ compiles and runs", &dsecv1.RunCodeRequest{Language: "cpp", Code: "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a*b<<std::endl;}", Stdin: "6 7"}, "success", nil},
		{"a compile error is the program's", &dsecv1.RunCodeRequest{Language: "c", Code: "int main( {"}, "compile_error", nil},
		{"an infinite loop exceeds the time limit", &dsecv1.RunCodeRequest{Language: "python", Code: "while True: pass", RunTimeoutS: 1}, "time_limit_exceeded", nil},
		{"a memory bomb exceeds the memory limit", &dsecv1.RunCodeRequest{Language: "python", Code: "x = bytearray(2 << 30)", MemoryLimitMb: 256}, "memory_limit_exceeded", nil},
		{"a C memory bomb exceeds the memory limit", &dsecv1.RunCodeRequest{Language: "cpp", Code: "#include <vector>\nint main(){std::vector<char> v; for(;;) v.resize(v.size()+(1<<26));}", MemoryLimitMb: 256}, "memory_limit_exceeded", nil},
		{"a fork bomb is contained", &dsecv1.RunCodeRequest{Language: "bash", Code: "b() { b | b & }; b; sleep 2", RunTimeoutS: 2}, "", nil},
		{"a yes flood is capped", &dsecv1.RunCodeRequest{Language: "bash", Code: "yes", RunTimeoutS: 1, MaxOutputBytes: 1000}, "time_limit_exceeded",
			func(t *testing.T, r *dsecv1.RunCodeResult) {
				if !r.Run.Truncated || len(r.Run.Stdout) != 1000 {
					t.Fatalf("truncated %v len %d", r.Run.Truncated, len(r.Run.Stdout))
				}
			}},
		{"a huge file is stopped by the file size limit", &dsecv1.RunCodeRequest{Language: "bash", Code: "head -c 1000000000 /dev/zero > big"}, "runtime_error", nil},
		{"files go in and come back", &dsecv1.RunCodeRequest{Language: "python", Code: "open('out.txt','w').write(open('data/in.txt').read().upper())", Files: map[string][]byte{"data/in.txt": []byte("hello")}, FetchFiles: []string{"out.txt", "missing.txt"}}, "success",
			func(t *testing.T, r *dsecv1.RunCodeResult) {
				if string(r.Files["out.txt"]) != "HELLO" || len(r.Files) != 1 {
					t.Fatalf("files %v", r.Files)
				}
			}},
		{"a program cannot see the host", &dsecv1.RunCodeRequest{Language: "python", Code: "import socket\ns=socket.socket(); s.settimeout(1); s.connect(('1.1.1.1', 80))"}, "runtime_error", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := runCode(t, fc, tc.req)
			if r.Infra {
				t.Fatalf("infra error: %v", r)
			}
			if tc.status != "" && r.Status != tc.status {
				t.Fatalf("status %q, want %q: %v", r.Status, tc.status, r)
			}
			if tc.check != nil {
				tc.check(t, r)
			}
		})
	}
	t.Run("after all of that the next call is unaffected", func(t *testing.T) {
		r := runCode(t, fc, &dsecv1.RunCodeRequest{Language: "python", Code: "print('fine')"})
		if r.Status != "success" || r.Run.Stdout != "fine\n" {
			t.Fatalf("%v", r)
		}
	})
}

func TestFunctionCallsLeaveNothingForTheNext(t *testing.T) {
	srv := functionServer(t)
	fc := dsecv1connect.NewFunctionServiceClient(http.DefaultClient, srv.URL)
	// A call that leaves files everywhere it can and a daemon behind.
	r := runCode(t, fc, &dsecv1.RunCodeRequest{Language: "bash", Code: `
echo secret > /tmp/leak; echo secret > /var/tmp/leak; echo secret > /dev/shm/leak; echo secret > mine
mkdir -p /tmp/d/e; echo x > /tmp/d/e/f
(setsid sleep 1000 &) ; nohup sleep 1000 >/dev/null 2>&1 &
echo ok`})
	if r.Status != "success" {
		t.Fatalf("%v", r)
	}
	for i := 0; i < 20; i++ { // lands on every slot
		r := runCode(t, fc, &dsecv1.RunCodeRequest{Language: "bash", Code: `
found=""
for f in /tmp/leak /var/tmp/leak /dev/shm/leak /tmp/d ../*/mine; do [ -e "$f" ] && found="$found $f"; done
ps -eo user=,args= | grep -v '^root' | grep -q '[s]leep 1000' && found="$found sleep"
ls /run/dsec-fn/calls 2>/dev/null | grep -q . && ls -la /run/dsec-fn/calls
echo "$found"`})
		if r.Status != "success" || strings.TrimSpace(r.Run.Stdout) != "" {
			t.Fatalf("call %d found leftovers: %q %q", i, r.Run.Stdout, r.Run.Stderr)
		}
	}
}

func TestFunctionJudging(t *testing.T) {
	srv := functionServer(t)
	fc := dsecv1connect.NewFunctionServiceClient(http.DefaultClient, srv.URL)
	tests := []*dsecv1.TestCase{{Stdin: "1 2", ExpectedStdout: "3"}, {Stdin: "5 5", ExpectedStdout: "10\n"}, {Stdin: "0 0", ExpectedStdout: "1"}}
	r := runCode(t, fc, &dsecv1.RunCodeRequest{Language: "python", Code: "a, b = map(int, input().split())\nprint(a + b)", Tests: tests})
	if r.Status != "wrong_answer" || r.Passed != 2 || r.Total != 3 || !r.Cases[0].Passed || r.Cases[2].Passed || r.Cases[2].Status != "wrong_answer" {
		t.Fatalf("%v", r)
	}
	r = runCode(t, fc, &dsecv1.RunCodeRequest{Language: "python", Code: "print('YES 3.14159')", Tests: []*dsecv1.TestCase{{ExpectedStdout: "yes 3.1416"}},
		Judge: &dsecv1.JudgeOptions{CaseInsensitive: true, FloatTolerance: 1e-4}})
	if r.Status != "success" || r.Passed != 1 {
		t.Fatalf("%v", r)
	}
	r = runCode(t, fc, &dsecv1.RunCodeRequest{Language: "cpp", Code: "int main(", Tests: tests})
	if r.Status != "compile_error" || r.Passed != 0 {
		t.Fatalf("%v", r)
	}
}

func TestFunctionBadRequests(t *testing.T) {
	srv := functionServer(t)
	fc := dsecv1connect.NewFunctionServiceClient(http.DefaultClient, srv.URL)
	ctx := ctxFor(t, time.Minute)
	for _, tc := range []struct {
		name string
		req  *dsecv1.RunCodeRequest
		kind string
	}{
		{"an unknown language", &dsecv1.RunCodeRequest{Language: "cobol", Code: "x"}, "invalid"},
		{"a negative timeout", &dsecv1.RunCodeRequest{Language: "python", Code: "x", RunTimeoutS: -1}, "invalid"},
		{"a file outside the call directory", &dsecv1.RunCodeRequest{Language: "python", Code: "x", Files: map[string][]byte{"../../etc/x": nil}}, "invalid"},
		{"an oversized program", &dsecv1.RunCodeRequest{Language: "python", Code: strings.Repeat("#", 2<<20)}, "invalid"},
		{"a GPU on a host without any", &dsecv1.RunCodeRequest{Language: "python", Code: "x", Gpus: 1}, "unimplemented"},
	} {
		t.Run(tc.name+" is refused", func(t *testing.T) {
			_, err := fc.RunCode(ctx, connect.NewRequest(tc.req))
			if kind(dsecErr(err)) != tc.kind {
				t.Fatalf("got %v, want %s", err, tc.kind)
			}
		})
	}
	// SandboxFusion's answers: a request its validation refuses is a 422
	// with FastAPI's detail; a file it cannot decode fails the call as a
	// SandboxError.
	for _, tc := range []struct{ name, body, want string }{
		{"invalid base64 in a SandboxFusion request is a SandboxError", `{"code":"x","language":"python","files":{"a":"!!!"}}`, "200 SandboxError"},
		{"an unknown SandboxFusion language is a 422", `{"code":"x","language":"cobol"}`, "422 "},
		{"a SandboxFusion request without code is a 422", `{"language":"python"}`, "422 "},
		{"a SandboxFusion request with a wrong type is a 422", `{"code":1,"language":"python"}`, "422 "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := http.Post(srv.URL+"/run_code", "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			var out map[string]any
			json.NewDecoder(resp.Body).Decode(&out)
			resp.Body.Close()
			status, _ := out["status"].(string)
			if got := fmt.Sprint(resp.StatusCode, " ", status); got != tc.want {
				t.Fatalf("got %q, want %q: %v", got, tc.want, out)
			}
			if resp.StatusCode == 422 && out["detail"] == nil {
				t.Fatalf("no detail: %v", out)
			}
		})
	}
}

// dsecErr converts a raw connect error like the SDK does.
func dsecErr(err error) error {
	if err == nil {
		return nil
	}
	c := dsec.New("http://unused")
	_ = c
	var ce *connect.Error
	if ok := asConnect(err, &ce); ok {
		for _, d := range ce.Details() {
			if v, e := d.Value(); e == nil {
				if info, ok := v.(*dsecv1.ErrorInfo); ok {
					return &dsec.Error{Kind: info.Kind, Message: ce.Message(), Infra: info.Infra}
				}
			}
		}
	}
	return err
}

func asConnect(err error, target **connect.Error) bool {
	ce, ok := err.(*connect.Error)
	if ok {
		*target = ce
	}
	return ok
}

func TestSandboxFusionClients(t *testing.T) {
	srv := functionServer(t)
	// The request verl's sandbox_fusion reward and tinker's client send.
	body := `{"code": "import sys\nprint(int(sys.stdin.read()) * 2)", "language": "python", "stdin": "21", "compile_timeout": 10, "run_timeout": 10, "memory_limit_MB": 1024, "files": {"helper.txt": "aGk="}, "fetch_files": ["helper.txt"]}`
	resp, err := http.Post(srv.URL+"/run_code", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	run, _ := out["run_result"].(map[string]any)
	if out["status"] != "Success" || run["status"] != "Finished" || run["stdout"] != "42\n" || run["return_code"] != 0.0 {
		t.Fatalf("response %v", out)
	}
	if files, _ := out["files"].(map[string]any); files["helper.txt"] != "aGk=" {
		t.Fatalf("files %v", out["files"])
	}
	for code, want := range map[string]string{"raise SystemExit(3)": "Failed", "while True: pass": "Failed"} {
		b, _ := json.Marshal(map[string]any{"code": code, "language": "python", "run_timeout": 1})
		resp, err := http.Post(srv.URL+"/run_code", "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		var o map[string]any
		json.NewDecoder(resp.Body).Decode(&o)
		resp.Body.Close()
		if o["status"] != want {
			t.Errorf("%q: status %v, want %s", code, o["status"], want)
		}
	}
}

func TestFunctionBatchOfMixedLanguages(t *testing.T) {
	srv := functionServer(t)
	fc := dsecv1connect.NewFunctionServiceClient(http.DefaultClient, srv.URL)
	var calls []*dsecv1.RunCodeRequest
	var want []string
	for i := 0; i < 200; i++ {
		switch {
		case i%10 == 9: // 10% broken
			calls = append(calls, &dsecv1.RunCodeRequest{Language: []string{"python", "bash", "c"}[i%3], Code: "this is not a program ("})
			want = append(want, map[int]string{0: "runtime_error", 1: "runtime_error", 2: "compile_error"}[i%3])
		case i%3 == 0:
			calls = append(calls, &dsecv1.RunCodeRequest{Language: "python", Code: fmt.Sprintf("print(%d)", i)})
			want = append(want, "success")
		case i%3 == 1:
			calls = append(calls, &dsecv1.RunCodeRequest{Language: "bash", Code: fmt.Sprintf("echo %d", i)})
			want = append(want, "success")
		default:
			calls = append(calls, &dsecv1.RunCodeRequest{Language: "c", Code: fmt.Sprintf("#include <stdio.h>\nint main(){puts(\"%d\");}", i)})
			want = append(want, "success")
		}
	}
	ctx := ctxFor(t, 10*time.Minute)
	resp, err := fc.RunCodeBatch(ctx, connect.NewRequest(&dsecv1.RunCodeBatchRequest{Calls: calls}))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Msg.Results {
		if r.Infra {
			t.Errorf("call %d: infra error %v", i, r)
			continue
		}
		if r.Status != want[i] {
			t.Errorf("call %d (%s): status %q (%s; compile %v), want %q", i, calls[i].Language, r.Status, r.Message, r.Compile, want[i])
			continue
		}
		if want[i] == "success" && strings.TrimSpace(r.GetRun().GetStdout()) != fmt.Sprint(i) {
			t.Errorf("call %d printed %q", i, r.Run.Stdout)
		}
	}
}

func TestFunctionKindThroughTheGenericAPI(t *testing.T) {
	srv := functionServer(t)
	c := srv.Client()
	ctx := ctxFor(t, 2*time.Minute)
	sb := create(t, c, dsec.CreateOptions{Kind: "function", Image: "debian"})
	r, err := sb.Exec(ctx, dsec.Cmd("echo hi > f; cat f; id -u"))
	if err != nil || !strings.HasPrefix(string(r.Stdout), "hi\n") || strings.TrimSpace(strings.Split(string(r.Stdout), "\n")[1]) == "0" {
		t.Fatalf("exec: %v %v", r, err)
	}
	r, _ = sb.Exec(ctx, dsec.Cmd("cat f"))
	if r.ExitCode == 0 {
		t.Fatal("a function sandbox kept state between calls")
	}
	if _, err := sb.WriteFile(ctx, "/x", strings.NewReader("x"), 0); kind(err) != "unimplemented" {
		t.Fatalf("files on a function sandbox: %v", err)
	}
}
