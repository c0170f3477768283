package e2b

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"path"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/e2b/filesystem"
	"github.com/opendsec/dsec/api/e2b/filesystem/filesystemconnect"
	"github.com/opendsec/dsec/api/e2b/process"
	"github.com/opendsec/dsec/api/e2b/process/processconnect"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/tenant"
)

// The sandbox side: envd's Connect services (process.Process,
// filesystem.Filesystem), routed to the sandbox named by the E2b-Sandbox-Id
// header or the Host name, and authorized by X-Access-Token.

const (
	// maxExecTimeoutS is the lifetime of a process started without
	// Connect-Timeout-Ms (timeoutMs: 0): the node's default maximum.
	maxExecTimeoutS = 86400
	// maxOutputBytes is how much of each output stream a process forwards:
	// the node's default maximum (E2B itself has no limit).
	maxOutputBytes = 64 << 20
	// internalTag prefixes the tags of the facade's own processes (the code
	// interpreter's), which List does not show.
	internalTag = "e2b.dev/"
)

func (f *Facade) mountEnvd(handle func(string, http.Handler)) {
	opts := []connect.HandlerOption{
		connect.WithInterceptors(streamErrors{}),
		connect.WithReadMaxBytes(32 << 20),
		// As the native API: compressing small messages costs more CPU
		// than it saves.
		connect.WithCompressMinBytes(4 << 10),
	}
	prefix, h := processconnect.NewProcessHandler(&processService{f: f}, opts...)
	f.mountService(handle, prefix, h, process.File_e2b_process_process_proto.Services().ByName("Process"))
	prefix, h = filesystemconnect.NewFilesystemHandler(&filesystemService{f: f}, opts...)
	f.mountService(handle, prefix, h, filesystem.File_e2b_filesystem_filesystem_proto.Services().ByName("Filesystem"))
	handle("GET /health", http.HandlerFunc(f.health))
	handle("/files", http.HandlerFunc(f.files))
}

// mountService mounts a Connect service: requests are routed to their
// sandbox; unknown methods get Connect's "unimplemented".
func (f *Facade) mountService(handle func(string, http.Handler), prefix string, h http.Handler, desc protoreflect.ServiceDescriptor) {
	known := map[string]bool{}
	methods := desc.Methods()
	for i := 0; i < methods.Len(); i++ {
		known[prefix+string(methods.Get(i).Name())] = true
	}
	ew := connect.NewErrorWriter()
	handle(prefix, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !known[r.URL.Path] {
			// An error in the request's own protocol (unary or stream), not
			// the mux's plain-text 404.
			ew.Write(w, r, errwire.ToConnect(errdefs.Unimplemented("%s is not implemented by dsec's envd", clip(r.URL.Path))))
			return
		}
		// The access token is checked from the headers, before the body
		// is read.
		t, err := f.resolve(r, EnvdPort)
		if err != nil {
			ew.Write(w, r, errwire.ToConnect(err))
			return
		}
		ctx, err := f.envdAuth(withTarget(r.Context(), t), r.Header)
		if err != nil {
			ew.Write(w, r, errwire.ToConnect(err))
			return
		}
		h.ServeHTTP(w, r.WithContext(ctx))
	}))
}

type userKey struct{}

func userOf(ctx context.Context) string {
	u, _ := ctx.Value(userKey{}).(string)
	return u
}

// envdAuth checks that an envd call names a sandbox on the envd port and
// carries its access token, and takes the user from Authorization: Basic.
// The context it returns acts for the token's holder (tokenHolder).
func (f *Facade) envdAuth(ctx context.Context, h http.Header) (context.Context, error) {
	t := targetOf(ctx)
	if t.port != EnvdPort {
		return ctx, errdefs.Unavailable("port %d of sandbox %s is not served: dsec forwards only envd (%d) and the code interpreter (%d)", t.port, clip(t.id), EnvdPort, InterpreterPort)
	}
	if !equal(h.Get("X-Access-Token"), f.AccessToken(t.id)) {
		return ctx, errdefs.Unauthenticated("missing or wrong X-Access-Token for sandbox %s", clip(t.id))
	}
	if auth := h.Get("Authorization"); auth != "" {
		enc, ok := strings.CutPrefix(auth, "Basic ")
		if !ok {
			return ctx, errdefs.Unauthenticated("Authorization must be Basic <user:>")
		}
		b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(enc))
		if err != nil {
			return ctx, errdefs.Unauthenticated("Authorization: malformed Basic credentials")
		}
		user, _, _ := strings.Cut(string(b), ":")
		ctx = context.WithValue(ctx, userKey{}, user)
	}
	return tokenHolder(ctx), nil
}

// tokenHolder returns ctx acting for the holder of a sandbox's access
// token. The token (checked before) was handed out only to a caller of the
// sandbox's project, and names the sandbox: every node call the facade
// makes with this context addresses that one sandbox (targetOf(ctx).id),
// never another, so it may act with the platform's own reach.
func tokenHolder(ctx context.Context) context.Context { return tenant.System(ctx) }

// streamErrors reports unreadable request streams as the client's error
// (requestConn).
type streamErrors struct{}

func (streamErrors) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc { return next }

func (streamErrors) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (streamErrors) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return next(ctx, requestConn{conn})
	}
}

// requestConn reports a request stream that cannot be read (a truncated or
// malformed envelope) as the client's error, invalid_argument, where
// connect-go says internal.
type requestConn struct{ connect.StreamingHandlerConn }

func (c requestConn) Receive(m any) error {
	err := c.StreamingHandlerConn.Receive(m)
	if err == nil || errors.Is(err, io.EOF) {
		return err // EOF ends the request stream
	}
	if ce := new(connect.Error); errors.As(err, &ce) && (ce.Code() == connect.CodeInternal || ce.Code() == connect.CodeUnknown) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("malformed request: %s", ce.Message()))
	}
	return err
}

// node is the node owning the request's sandbox, which runs (awake).
func (f *Facade) node(ctx context.Context) (apiserver.Node, string, error) {
	id := targetOf(ctx).id
	n, err := f.awake(ctx, id)
	if err != nil {
		return nil, id, errwire.ToConnect(err)
	}
	return n, id, nil
}

// processService is envd's process.Process over the node's processes.
type processService struct{ f *Facade }

var _ processconnect.ProcessHandler = (*processService)(nil)

func (p *processService) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	n, id, err := p.f.node(ctx)
	if err != nil {
		return err
	}
	cfg := req.Msg.GetProcess()
	if cfg.GetCmd() == "" {
		return errwire.ToConnect(errdefs.Invalid("process.cmd is required"))
	}
	if strings.HasPrefix(req.Msg.GetTag(), internalTag) {
		return errwire.ToConnect(errdefs.Invalid("tags starting with %s are reserved", internalTag))
	}
	cwd := cfg.GetCwd()
	if cwd != "" {
		cwd = envdPath(cwd)
	}
	xr := &dsecv1.ExecRequest{
		SandboxId: id, Argv: append([]string{cfg.GetCmd()}, cfg.GetArgs()...), Env: cfg.GetEnvs(), Cwd: cwd,
		User: userOf(ctx), StdinOpen: req.Msg.Stdin == nil || req.Msg.GetStdin(), Tag: req.Msg.GetTag(),
		TimeoutS: maxExecTimeoutS, MaxOutputBytes: maxOutputBytes,
	}
	if pty := req.Msg.GetPty(); pty != nil {
		xr.Pty, xr.PtyRows, xr.PtyCols = true, pty.GetSize().GetRows(), pty.GetSize().GetCols()
	}
	// The request's deadline (Connect-Timeout-Ms) is the process's
	// lifetime, as in envd: the agent kills it then, client or no client.
	if d, ok := ctx.Deadline(); ok {
		xr.TimeoutS = min(max(time.Until(d).Seconds(), 0.001), maxExecTimeoutS)
	}
	sent := false
	err = n.ExecEvents(ctx, xr, func(ev *dsecv1.ExecEvent) error {
		out, err := processEvent(ev, xr.Pty)
		if err != nil || out == nil {
			return err
		}
		sent = true
		return stream.Send(&process.StartResponse{Event: out})
	})
	return p.f.streamErr(ctx, id, sent, err)
}

// streamErr converts the error that ended a server stream, like rpcErr,
// except that a stream which has sent events and ended because its
// sandbox is gone (killed, or at its end of life) is cut off, as envd's
// streams are when it dies with its sandbox: the SDKs then ask GET /health
// and report that the sandbox was killed or reached its end of life,
// rather than a timeout.
func (f *Facade) streamErr(ctx context.Context, id string, sent bool, err error) error {
	if err == nil {
		return nil
	}
	if sent && ctx.Err() == nil && !f.running(ctx, id) {
		panic(http.ErrAbortHandler)
	}
	return f.rpcErr(ctx, id, err)
}

// errTimedOut ends a stream whose process the deadline killed.
var errTimedOut = errdefs.New(errdefs.KindDeadlineExceeded, "the process was killed at its deadline (timeoutMs)")

// processEvent translates a node event; nil means there is nothing to send.
func processEvent(ev *dsecv1.ExecEvent, pty bool) (*process.ProcessEvent, error) {
	switch e := ev.Event.(type) {
	case *dsecv1.ExecEvent_Started:
		return &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: uint32(e.Started.Pid)}}}, nil
	case *dsecv1.ExecEvent_Stdout:
		d := &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: e.Stdout}}
		if pty {
			d.Output = &process.ProcessEvent_DataEvent_Pty{Pty: e.Stdout}
		}
		return &process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: d}}, nil
	case *dsecv1.ExecEvent_Stderr:
		return &process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: e.Stderr}}}}, nil
	case *dsecv1.ExecEvent_Keepalive:
		return &process.ProcessEvent{Event: &process.ProcessEvent_Keepalive{Keepalive: &process.ProcessEvent_KeepAlive{}}}, nil
	case *dsecv1.ExecEvent_Exit:
		x := e.Exit
		if x.TimedOut {
			return nil, errTimedOut
		}
		// As envd reports Go's os.ProcessState: a signal's end is exit code
		// -1, not exited, "signal: killed"; a failure's error is its status.
		end := &process.ProcessEvent_EndEvent{ExitCode: x.ExitCode, Exited: x.Signal == "", Status: fmt.Sprintf("exit status %d", x.ExitCode)}
		if x.Signal != "" {
			end.ExitCode = -1
			end.Status = "signal: " + x.Signal
			if n := unix.SignalNum("SIG" + x.Signal); n != 0 {
				end.Status = "signal: " + n.String()
			}
		}
		if end.ExitCode != 0 {
			msg := end.Status
			end.Error = &msg
		}
		if x.Truncated {
			msg := fmt.Sprintf("output truncated: each stream forwards at most %d bytes", maxOutputBytes)
			if end.Error != nil {
				msg = *end.Error + "; " + msg
			}
			end.Error = &msg
		}
		return &process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}}, nil
	}
	return nil, nil
}

// selected finds the running process a selector names, by pid or tag
// (the facade's own processes are never selected).
func (f *Facade) selected(ctx context.Context, n apiserver.Node, id string, sel *process.ProcessSelector) (*dsecv1.ProcessInfo, error) {
	var match func(*dsecv1.ProcessInfo) bool
	var what string
	switch s := sel.GetSelector().(type) {
	case *process.ProcessSelector_Tag:
		match, what = func(p *dsecv1.ProcessInfo) bool { return p.Tag == s.Tag }, fmt.Sprintf("tag %q", clip(s.Tag))
	case *process.ProcessSelector_Pid:
		match, what = func(p *dsecv1.ProcessInfo) bool { return uint32(p.Pid) == s.Pid }, fmt.Sprintf("pid %d", s.Pid)
	default:
		return nil, errdefs.Invalid("a process selector (pid or tag) is required")
	}
	list, err := apiserver.Do(ctx, n, &dsecv1.ListProcessesRequest{SandboxId: id}, apiserver.Node.ListProcesses)
	if err != nil {
		return nil, err
	}
	for _, p := range list.Processes {
		if p.Running && !strings.HasPrefix(p.Tag, internalTag) && match(p) {
			return p, nil
		}
	}
	return nil, errdefs.NotFound("no running process with %s", what)
}

// onProcess runs do on the running process sel names. A failure because the
// process ended meanwhile is not_found, as for a process that was never
// there (the SDKs' kill() then answers false).
func (f *Facade) onProcess(ctx context.Context, n apiserver.Node, id string, sel *process.ProcessSelector, do func(*dsecv1.ProcessInfo) error) error {
	proc, err := f.selected(ctx, n, id, sel)
	if err != nil {
		return err
	}
	if err := do(proc); err != nil {
		if _, again := f.selected(ctx, n, id, sel); errdefs.Is(again, errdefs.KindNotFound) {
			return errdefs.NotFound("process %d ended", proc.Pid)
		}
		return err
	}
	return nil
}

func (p *processService) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	n, id, err := p.f.node(ctx)
	if err != nil {
		return err
	}
	proc, err := p.f.selected(ctx, n, id, req.Msg.GetProcess())
	if err != nil {
		return p.f.rpcErr(ctx, id, err)
	}
	sent := false
	err = n.ProcessEvents(ctx, &dsecv1.ConnectProcessRequest{SandboxId: id, ProcessId: proc.ProcessId, LiveOnly: true}, func(ev *dsecv1.ExecEvent) error {
		out, err := processEvent(ev, proc.Pty)
		if err != nil || out == nil {
			return err
		}
		sent = true
		return stream.Send(&process.ConnectResponse{Event: out})
	})
	return p.f.streamErr(ctx, id, sent, err)
}

func (p *processService) List(ctx context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	n, id, err := p.f.node(ctx)
	if err != nil {
		return nil, err
	}
	list, err := apiserver.Do(ctx, n, &dsecv1.ListProcessesRequest{SandboxId: id}, apiserver.Node.ListProcesses)
	if err != nil {
		return nil, p.f.rpcErr(ctx, id, err)
	}
	out := &process.ListResponse{}
	for _, pr := range list.Processes {
		if !pr.Running || strings.HasPrefix(pr.Tag, internalTag) || len(pr.Argv) == 0 {
			continue
		}
		info := &process.ProcessInfo{
			Config: &process.ProcessConfig{Cmd: pr.Argv[0], Args: pr.Argv[1:], Envs: pr.Env},
			Pid:    uint32(pr.Pid),
		}
		if pr.Cwd != "" {
			info.Config.Cwd = &pr.Cwd
		}
		if pr.Tag != "" {
			info.Tag = &pr.Tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

// input writes to (or closes) the stdin of the selected process.
func (p *processService) input(ctx context.Context, sel *process.ProcessSelector, data []byte, eof bool) error {
	n, id, err := p.f.node(ctx)
	if err != nil {
		return err
	}
	err = p.f.onProcess(ctx, n, id, sel, func(proc *dsecv1.ProcessInfo) error {
		_, err := apiserver.Do(ctx, n, &dsecv1.WriteStdinRequest{SandboxId: id, ProcessId: proc.ProcessId, Data: data, Close: eof}, apiserver.Node.WriteStdin)
		return err
	})
	return p.f.rpcErr(ctx, id, err)
}

func inputBytes(in *process.ProcessInput) []byte {
	if b := in.GetPty(); b != nil {
		return b
	}
	return in.GetStdin()
}

func (p *processService) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	if err := p.input(ctx, req.Msg.GetProcess(), inputBytes(req.Msg.GetInput()), false); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

func (p *processService) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	if err := p.input(ctx, req.Msg.GetProcess(), nil, true); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

func (p *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	var sel *process.ProcessSelector
	for stream.Receive() {
		switch e := stream.Msg().GetEvent().(type) {
		case *process.StreamInputRequest_Start:
			sel = e.Start.GetProcess()
		case *process.StreamInputRequest_Data:
			if sel == nil {
				return nil, errwire.ToConnect(errdefs.Invalid("StreamInput needs a start event first"))
			}
			if err := p.input(ctx, sel, inputBytes(e.Data.GetInput()), false); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.StreamInputResponse{}), nil
}

func (p *processService) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	n, id, err := p.f.node(ctx)
	if err != nil {
		return nil, err
	}
	var sig string
	switch req.Msg.GetSignal() {
	case process.Signal_SIGNAL_SIGKILL:
		sig = "KILL"
	case process.Signal_SIGNAL_SIGTERM:
		sig = "TERM"
	default:
		return nil, errwire.ToConnect(errdefs.Invalid("signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM"))
	}
	err = p.f.onProcess(ctx, n, id, req.Msg.GetProcess(), func(proc *dsecv1.ProcessInfo) error {
		_, err := apiserver.Do(ctx, n, &dsecv1.SignalProcessRequest{SandboxId: id, ProcessId: proc.ProcessId, Signal: sig}, apiserver.Node.SignalProcess)
		return err
	})
	if err != nil {
		return nil, p.f.rpcErr(ctx, id, err)
	}
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

func (p *processService) Update(ctx context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	n, id, err := p.f.node(ctx)
	if err != nil {
		return nil, err
	}
	size := req.Msg.GetPty().GetSize()
	if size == nil {
		return connect.NewResponse(&process.UpdateResponse{}), nil
	}
	err = p.f.onProcess(ctx, n, id, req.Msg.GetProcess(), func(proc *dsecv1.ProcessInfo) error {
		_, err := apiserver.Do(ctx, n, &dsecv1.ResizePTYRequest{SandboxId: id, ProcessId: proc.ProcessId, Rows: size.GetRows(), Cols: size.GetCols()}, apiserver.Node.ResizePTY)
		return err
	})
	if err != nil {
		return nil, p.f.rpcErr(ctx, id, err)
	}
	return connect.NewResponse(&process.UpdateResponse{}), nil
}

// filesystemService is envd's filesystem.Filesystem over the node's files.
type filesystemService struct {
	f *Facade
	filesystemconnect.UnimplementedFilesystemHandler
}

var _ filesystemconnect.FilesystemHandler = (*filesystemService)(nil)

// envdPath maps a path of an envd call to the native API's. envd
// resolves a relative path against the user's home directory, whatever the
// sandbox's working directory; the native API resolves "~/..." so (and
// other relative paths against the working directory). An empty path is
// the working directory, else the home, in both.
func envdPath(p string) string {
	switch {
	case p == "":
		return "."
	case strings.HasPrefix(p, "/"), strings.HasPrefix(p, "~"):
		return p
	}
	return "~/" + p
}

// entry translates a node's file info as envd reports it: a symlink has
// the permission string of the link ("Lrwxrwxrwx") but the type, mode and
// metadata of what it resolves to, and that entry's absolute path as its
// target (itself, with no type, when it dangles).
func entry(i *dsecv1.FileInfo) *filesystem.EntryInfo {
	e := &filesystem.EntryInfo{
		Name: i.Name, Path: i.Path, Size: i.Size, Mode: i.Mode, Owner: i.Owner, Group: i.Group,
		ModifiedTime: i.Mtime, Metadata: i.Metadata,
	}
	mode := fs.FileMode(i.Mode) & fs.ModePerm
	switch i.Type {
	case "file":
		e.Type = filesystem.FileType_FILE_TYPE_FILE
	case "dir":
		e.Type = filesystem.FileType_FILE_TYPE_DIRECTORY
		mode |= fs.ModeDir
	case "symlink":
		mode |= fs.ModeSymlink
		target, t := i.Path, i.Target
		e.Mode, e.Metadata = 0, nil
		if t != nil {
			target, e.Mode, e.Metadata = t.Path, t.Mode, t.Metadata
			e.Type = entryType(t.Type)
		}
		e.SymlinkTarget = &target
	default:
		mode |= fs.ModeIrregular
	}
	if i.Mode&uint32(syscall.S_ISUID) != 0 {
		mode |= fs.ModeSetuid
	}
	e.Permissions = mode.String()
	if e.ModifiedTime == nil {
		e.ModifiedTime = timestamppb.New(time.Unix(0, 0))
	}
	return e
}

// entryType is envd's type of an entry that is not a symlink.
func entryType(t string) filesystem.FileType {
	switch t {
	case "file":
		return filesystem.FileType_FILE_TYPE_FILE
	case "dir":
		return filesystem.FileType_FILE_TYPE_DIRECTORY
	}
	return filesystem.FileType_FILE_TYPE_UNSPECIFIED
}

func (s *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	n, id, err := s.f.node(ctx)
	if err != nil {
		return nil, err
	}
	info, err := apiserver.Do(ctx, n, &dsecv1.StatRequest{SandboxId: id, Path: envdPath(req.Msg.GetPath()), User: userOf(ctx)}, apiserver.Node.Stat)
	if err != nil {
		return nil, s.f.rpcErr(ctx, id, err)
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: entry(info)}), nil
}

// MakeDir creates a directory and its parents, owned by the request's
// user; an existing one (or a symlink to one) is already_exists (the SDK's
// makeDir returns false), anything else there invalid_argument, as in
// envd.
func (s *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	n, id, err := s.f.node(ctx)
	if err != nil {
		return nil, err
	}
	p := envdPath(req.Msg.GetPath())
	if info, err := apiserver.Do(ctx, n, &dsecv1.StatRequest{SandboxId: id, Path: p, User: userOf(ctx)}, apiserver.Node.Stat); err == nil {
		if info.Type == "dir" || info.GetTarget().GetType() == "dir" {
			return nil, errwire.ToConnect(errdefs.Conflict("directory %s already exists", clip(info.Path)))
		}
		return nil, errwire.ToConnect(errdefs.Invalid("%s already exists and is not a directory", clip(info.Path)))
	} else if !errdefs.Is(err, errdefs.KindNotFound) {
		return nil, s.f.rpcErr(ctx, id, err)
	}
	info, err := apiserver.Do(ctx, n, &dsecv1.MakeDirRequest{SandboxId: id, Path: p, User: userOf(ctx)}, apiserver.Node.MakeDir)
	if err != nil {
		return nil, s.f.rpcErr(ctx, id, err)
	}
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: entry(info)}), nil
}

// Move renames, creating the destination's parent directories as envd does.
func (s *filesystemService) Move(ctx context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	n, id, err := s.f.node(ctx)
	if err != nil {
		return nil, err
	}
	src, dst := envdPath(req.Msg.GetSource()), envdPath(req.Msg.GetDestination())
	if parent := path.Dir(dst); parent != "/" && parent != "~" {
		if _, err := apiserver.Do(ctx, n, &dsecv1.StatRequest{SandboxId: id, Path: parent, User: userOf(ctx)}, apiserver.Node.Stat); errdefs.Is(err, errdefs.KindNotFound) {
			if _, err := apiserver.Do(ctx, n, &dsecv1.MakeDirRequest{SandboxId: id, Path: parent, User: userOf(ctx)}, apiserver.Node.MakeDir); err != nil {
				return nil, s.f.rpcErr(ctx, id, err)
			}
		}
	}
	info, err := apiserver.Do(ctx, n, &dsecv1.RenameRequest{SandboxId: id, From: src, To: dst, User: userOf(ctx)}, apiserver.Node.Rename)
	if err != nil {
		return nil, s.f.rpcErr(ctx, id, err)
	}
	return connect.NewResponse(&filesystem.MoveResponse{Entry: entry(info)}), nil
}

func (s *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	n, id, err := s.f.node(ctx)
	if err != nil {
		return nil, err
	}
	depth := req.Msg.GetDepth()
	if depth == 0 {
		depth = 1
	}
	if depth > 64 {
		return nil, errwire.ToConnect(errdefs.Invalid("depth must be between 1 and 64"))
	}
	list, err := apiserver.Do(ctx, n, &dsecv1.ListDirRequest{SandboxId: id, Path: envdPath(req.Msg.GetPath()), Depth: int32(depth), User: userOf(ctx)}, apiserver.Node.ListDir)
	if err != nil {
		return nil, s.f.rpcErr(ctx, id, err)
	}
	out := &filesystem.ListDirResponse{}
	for _, e := range list.Entries {
		out.Entries = append(out.Entries, entry(e))
	}
	return connect.NewResponse(out), nil
}

// Remove removes a file or a whole tree; a path that is not there is
// removed already (envd's os.RemoveAll).
func (s *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	n, id, err := s.f.node(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := apiserver.Do(ctx, n, &dsecv1.RemoveRequest{SandboxId: id, Path: envdPath(req.Msg.GetPath()), Recursive: true, User: userOf(ctx)}, apiserver.Node.Remove); err != nil {
		// A missing file, not a missing sandbox (sandboxErr tells them
		// apart).
		if err = s.f.sandboxErr(ctx, id, err); !errdefs.Is(err, errdefs.KindNotFound) {
			return nil, errwire.ToConnect(err)
		}
	}
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

var eventTypes = map[string]filesystem.EventType{
	"create": filesystem.EventType_EVENT_TYPE_CREATE,
	"write":  filesystem.EventType_EVENT_TYPE_WRITE,
	"remove": filesystem.EventType_EVENT_TYPE_REMOVE,
	"rename": filesystem.EventType_EVENT_TYPE_RENAME,
	"chmod":  filesystem.EventType_EVENT_TYPE_CHMOD,
}

// WatchDir streams changes under a directory until the client goes away or
// the request's deadline (timeoutMs) passes. includeEntry attaches the
// entry to create, write and chmod events (not to remove and rename
// events, whose entry is gone), as envd does. allowNetworkMounts changes
// nothing: envd refuses to watch NFS, SMB and FUSE mounts without it,
// dsec watches any directory.
func (s *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	n, id, err := s.f.node(ctx)
	if err != nil {
		return err
	}
	sent := false
	err = n.WatchEvents(ctx, &dsecv1.WatchDirRequest{SandboxId: id, Path: envdPath(req.Msg.GetPath()), Recursive: req.Msg.GetRecursive(), User: userOf(ctx), IncludeInfo: req.Msg.GetIncludeEntry()}, func(ev *dsecv1.WatchDirEvent) error {
		var out *filesystem.WatchDirResponse
		switch e := ev.Event.(type) {
		case *dsecv1.WatchDirEvent_Started:
			out = &filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}
		case *dsecv1.WatchDirEvent_Keepalive:
			out = &filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Keepalive{Keepalive: &filesystem.WatchDirResponse_KeepAlive{}}}
		case *dsecv1.WatchDirEvent_Overflow:
			// envd has no way to say "events were lost": end the stream
			// rather than go on silently incomplete.
			return errdefs.Exhausted(0, "the watch lost events (they came faster than they were read); watch again")
		case *dsecv1.WatchDirEvent_Change:
			t, ok := eventTypes[e.Change.Op]
			if !ok {
				return nil
			}
			fe := &filesystem.FilesystemEvent{Name: e.Change.Name, Type: t}
			if e.Change.Info != nil {
				fe.Entry = entry(e.Change.Info)
			}
			out = &filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Filesystem{Filesystem: fe}}
		}
		if out == nil {
			return nil
		}
		sent = true
		return stream.Send(out)
	})
	return s.f.streamErr(ctx, id, sent, err)
}
