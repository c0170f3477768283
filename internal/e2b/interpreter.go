package e2b

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
)

// The code interpreter (@e2b/code-interpreter, port 49999): POST /execute
// streams NDJSON; /contexts manages interpreter contexts. Each call runs a
// tiny client in the sandbox (bash connecting to the kernel's loopback
// port) whose stdin is the request and whose stdout is the kernel's answer;
// the kernel (kernel.py) is started on first use.

//go:embed kernel.py
var kernelSource string

// kernelBoot runs the kernel source given as the next argument.
const kernelBoot = "import sys; exec(sys.argv[1])"

// kernelClient relays stdin to the kernel and the answer to stdout; 97
// means nothing listens (the kernel is not started yet).
var kernelClient = fmt.Sprintf(`{ exec 3<>/dev/tcp/127.0.0.1/%d; } 2>/dev/null || exit 97
cat >&3
exec cat <&3`, InterpreterPort)

const (
	exitNoKernel = 97
	// kernelTag tags the facade's processes, which List hides.
	kernelTag = internalTag + "code-interpreter"
	// maxCode bounds an /execute body.
	maxCode = 16 << 20
)

func (f *Facade) mountInterpreter(handle func(string, http.Handler)) {
	handle("POST /execute", http.HandlerFunc(f.execute))
	handle("POST /contexts", http.HandlerFunc(f.createContext))
	handle("GET /contexts", http.HandlerFunc(f.listContexts))
	handle("DELETE /contexts/{id}", http.HandlerFunc(f.deleteContext))
	handle("POST /contexts/{id}/restart", http.HandlerFunc(f.restartContext))
}

// interpreterNode authorizes a code-interpreter request (X-Access-Token or
// E2B-Traffic-Access-Token: the SDK sends only the latter on /contexts) and
// returns its sandbox's node. Calls on it use tokenHolder(r.Context()).
func (f *Facade) interpreterNode(r *http.Request) (apiserver.Node, string, error) {
	t, err := f.resolve(r, InterpreterPort)
	if err != nil {
		return nil, "", err
	}
	if t.port != InterpreterPort {
		return nil, "", errdefs.Invalid("the code interpreter is served on port %d, not %d", InterpreterPort, t.port)
	}
	access, traffic := r.Header.Get("X-Access-Token"), r.Header.Get("E2B-Traffic-Access-Token")
	if !(access != "" && equal(access, f.AccessToken(t.id))) && !(traffic != "" && equal(traffic, f.TrafficToken(t.id))) {
		return nil, "", errdefs.Unauthenticated("missing or wrong X-Access-Token / E2B-Traffic-Access-Token for sandbox %s", clip(t.id))
	}
	n, err := f.awake(tokenHolder(r.Context()), t.id)
	if err != nil {
		return nil, "", err
	}
	return n, t.id, nil
}

// kernelHeader is the kernel's first answer line: empty, or an error of
// one of dsec's kinds (not_found, invalid).
type kernelHeader struct {
	Error   string `json:"error"`
	Message string `json:"message"`
}

// err is the header's error, nil when the kernel accepted the request.
func (h kernelHeader) err() error {
	switch errdefs.Kind(h.Error) {
	case "":
		return nil
	case errdefs.KindNotFound, errdefs.KindInvalid:
		return errdefs.New(errdefs.Kind(h.Error), "%s", h.Message)
	}
	return errdefs.Internal(nil, "the code interpreter answered %s: %s", clip(h.Error), clip(h.Message))
}

// kernelCall sends one request to the sandbox's kernel, starting the kernel
// if needed. header receives the kernel's status line; body then receives
// the rest of the answer as it arrives. Once header was called, errors are
// the caller's to report (the response has started).
func (f *Facade) kernelCall(ctx context.Context, n apiserver.Node, id string, req any, header func(kernelHeader), body func([]byte) error) error {
	line, err := json.Marshal(req)
	if err != nil {
		return errdefs.Invalid("encode request: %v", err)
	}
	line = append(line, '\n')
	for attempt := 0; ; attempt++ {
		err := f.kernelExchange(ctx, n, id, line, header, body)
		if err != errNoKernel || attempt > 0 {
			return err
		}
		if err := f.startKernel(ctx, n, id); err != nil {
			return err
		}
	}
}

// errNoKernel reports that no kernel listens in the sandbox.
var errNoKernel = errdefs.NotFound("the code interpreter is not running")

// kernelExchange runs the client once.
func (f *Facade) kernelExchange(ctx context.Context, n apiserver.Node, id string, line []byte, header func(kernelHeader), body func([]byte) error) error {
	var pending []byte
	var stderr bytes.Buffer
	var procID string
	headerDone, exited := false, false
	err := n.ExecEvents(ctx, &dsecv1.ExecRequest{
		SandboxId: id, Argv: []string{"/bin/bash", "-c", kernelClient}, Stdin: line, Tag: kernelTag,
		TimeoutS: maxExecTimeoutS, MaxOutputBytes: maxOutputBytes,
	}, func(ev *dsecv1.ExecEvent) error {
		switch e := ev.Event.(type) {
		case *dsecv1.ExecEvent_Started:
			procID = e.Started.ProcessId
		case *dsecv1.ExecEvent_Stderr:
			if stderr.Len() < 4096 {
				stderr.Write(e.Stderr)
			}
		case *dsecv1.ExecEvent_Stdout:
			if headerDone {
				return body(e.Stdout)
			}
			pending = append(pending, e.Stdout...)
			i := bytes.IndexByte(pending, '\n')
			if i < 0 {
				return nil
			}
			var h kernelHeader
			if err := json.Unmarshal(pending[:i], &h); err != nil {
				return errdefs.Internal(err, "the code interpreter answered %q", clip(string(pending[:i])))
			}
			headerDone = true
			header(h)
			if rest := pending[i+1:]; len(rest) > 0 {
				return body(rest)
			}
		case *dsecv1.ExecEvent_Exit:
			x := e.Exit
			exited = true
			switch {
			case headerDone:
			case x.ExitCode == exitNoKernel:
				return errNoKernel
			case x.ExitCode == 127:
				return errdefs.Invalid("the code interpreter needs bash and python3 in the sandbox: %s", strings.TrimSpace(stderr.String()))
			default:
				return errdefs.Internal(nil, "the code interpreter's client ended with %d before answering: %s", x.ExitCode, clip(strings.TrimSpace(stderr.String())))
			}
		}
		return nil
	})
	if err != nil && !exited && procID != "" {
		// The caller went away: end the client, which interrupts the
		// execution it was waiting for.
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		apiserver.Do(kctx, n, &dsecv1.SignalProcessRequest{SandboxId: id, ProcessId: procID, Signal: "KILL"}, apiserver.Node.SignalProcess)
		cancel()
	}
	return err
}

// startKernel starts the sandbox's kernel and returns once it listens.
func (f *Facade) startKernel(ctx context.Context, n apiserver.Node, id string) error {
	res, err := apiserver.Do(ctx, n, &dsecv1.ExecRequest{
		SandboxId: id, Argv: []string{"python3", "-c", kernelBoot, kernelSource, "manager", strconv.Itoa(InterpreterPort)},
		TimeoutS: 60, Tag: kernelTag,
	}, apiserver.Node.Exec)
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		msg := strings.TrimSpace(string(res.Stderr))
		if res.ExitCode == 127 {
			return errdefs.Invalid("the code interpreter needs python3 in the sandbox: %s", clip(msg))
		}
		return errdefs.Internal(nil, "the code interpreter did not start (exit %d): %s", res.ExitCode, clip(msg))
	}
	f.log.Debug("code interpreter started", slog.String("sandbox_id", id))
	return nil
}

// executeRequest is the body of POST /execute.
type executeRequest struct {
	Code      string            `json:"code"`
	ContextID string            `json:"context_id,omitempty"`
	Language  string            `json:"language,omitempty"`
	EnvVars   map[string]string `json:"env_vars,omitempty"`
}

// execute streams an execution's output as NDJSON, flushed as it comes.
func (f *Facade) execute(w http.ResponseWriter, r *http.Request) {
	n, id, err := f.interpreterNode(r)
	r = r.WithContext(tokenHolder(r.Context()))
	if err != nil {
		envdError(w, err)
		return
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, maxCode+1))
	if err != nil || len(b) > maxCode {
		envdError(w, errdefs.Invalid("the request body must be JSON of at most %d bytes", maxCode))
		return
	}
	var in executeRequest
	if err := json.Unmarshal(b, &in); err != nil {
		envdError(w, errdefs.Invalid("the request body is not valid JSON: %v", err))
		return
	}
	if in.ContextID != "" && in.Language != "" {
		envdError(w, errdefs.Invalid("give context_id or language, not both"))
		return
	}
	req := map[string]any{"op": "execute", "code": in.Code, "context_id": in.ContextID, "language": in.Language, "env_vars": in.EnvVars}
	flush := func() {
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
	}
	answered, ok := false, false
	err = f.kernelCall(r.Context(), n, id, req, func(h kernelHeader) {
		answered = true
		if err := h.err(); err != nil {
			envdError(w, err)
			return
		}
		ok = true
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.WriteHeader(http.StatusOK)
		flush()
	}, func(chunk []byte) error {
		if !ok {
			return nil
		}
		if _, err := w.Write(chunk); err != nil {
			return err
		}
		flush()
		return nil
	})
	if err != nil && !answered {
		envdError(w, f.sandboxErr(r.Context(), id, err))
	}
}

// contextCall runs a context operation whose answer is one JSON value.
func (f *Facade) contextCall(w http.ResponseWriter, r *http.Request, req map[string]any) {
	n, id, err := f.interpreterNode(r)
	r = r.WithContext(tokenHolder(r.Context()))
	if err != nil {
		envdError(w, err)
		return
	}
	var kerr error
	var answer []byte
	err = f.kernelCall(r.Context(), n, id, req, func(h kernelHeader) {
		kerr = h.err()
	}, func(chunk []byte) error {
		answer = append(answer, chunk...)
		return nil
	})
	switch {
	case err != nil:
		envdError(w, f.sandboxErr(r.Context(), id, err))
	case kerr != nil:
		envdError(w, kerr)
	default:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		w.Write(bytes.TrimSpace(answer))
	}
}

func (f *Facade) createContext(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Language string `json:"language"`
		Cwd      string `json:"cwd"`
	}
	if err := decode(r, &in); err != nil {
		envdError(w, err)
		return
	}
	f.contextCall(w, r, map[string]any{"op": "create_context", "language": in.Language, "cwd": in.Cwd})
}

func (f *Facade) listContexts(w http.ResponseWriter, r *http.Request) {
	f.contextCall(w, r, map[string]any{"op": "list_contexts"})
}

func (f *Facade) deleteContext(w http.ResponseWriter, r *http.Request) {
	f.contextCall(w, r, map[string]any{"op": "delete_context", "id": r.PathValue("id")})
}

func (f *Facade) restartContext(w http.ResponseWriter, r *http.Request) {
	f.contextCall(w, r, map[string]any{"op": "restart_context", "id": r.PathValue("id")})
}
