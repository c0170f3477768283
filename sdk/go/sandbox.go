package dsec

import (
	"context"
	"errors"
	"io"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// CreateOptions describe a sandbox. Zero fields take the server's defaults.
type CreateOptions struct {
	Kind     string // "container" (default), "function", "microvm", "vm"
	Image    string
	CPU      float64
	MemoryMB int64
	DiskMB   int64
	Pids     int64
	TTL      time.Duration
	IdleTTL  time.Duration
	Labels   map[string]string
	Env      map[string]string
	Network  string // "none" (default) or "egress"
	// Policy restricts egress (implies Network "egress"): what no rule
	// allows is denied. nil: unrestricted egress.
	Policy *Policy
	// BandwidthMbps limits egress throughput each way (0: none).
	BandwidthMbps int64
	User          string
	Workdir       string
	// IdempotencyKey makes the create safe to retry.
	IdempotencyKey string
	// Snapshot starts the sandbox from a snapshot instead of Image.
	Snapshot string
	// Layers are images whose layers are stacked over Image's (or the
	// snapshot's), in order, at create: a workspace, a toolkit.
	Layers []string
	// Session binds the sandbox to a trainer session.
	Session string
	// NodeSelector places the sandbox on a node with all these labels
	// (cluster mode).
	NodeSelector map[string]string
	// Runtime is another of the kind's runtimes: "gvisor" for kind
	// container ("" is the kind's default; Info lists each node's).
	Runtime string
	// OnTimeout is what reaching TTL or IdleTTL does: "delete" (default)
	// or "pause" (a call resumes the sandbox; one paused at its TTL is
	// kept for the node's paused_ttl and resumes with a fresh TTL), or
	// "pause_filesystem" (so, but filesystem-only: see PauseFilesystem).
	OnTimeout string
	// Volumes mounts volumes of the caller's project (CreateVolume); kind
	// container only.
	Volumes []VolumeMount
	// Compose is a Compose file (YAML, variables substituted: see
	// docs/sidecars.md): its main service makes the main container, the
	// others sidecars. Image and Sidecars are then left empty.
	Compose string
	// ComposeOverrides are Compose files laid over Compose, in order, as
	// `docker compose -f base -f override` merges them.
	ComposeOverrides []string
	// Sidecars are further containers sharing the sandbox's network
	// (database, service under test, MCP server); reach one with
	// Sandbox.Container.
	Sidecars []*dsecv1.Sidecar
	// ModelGateway gives an agent in the sandbox the model gateway
	// (dsecv1.ModelGateway: http://127.0.0.1:4319/v1 inside, the
	// session's and the project's upstreams behind it).
	ModelGateway bool
	// FastForwardFrom answers the sandbox's first model calls from those
	// another sandbox recorded, while they are the same (ModelGateway).
	FastForwardFrom string
}

func (o CreateOptions) spec() *dsecv1.SandboxSpec {
	if o.Policy != nil && o.Network == "" {
		o.Network = "egress"
	}
	var mg *dsecv1.ModelGateway
	if o.ModelGateway || o.FastForwardFrom != "" {
		mg = &dsecv1.ModelGateway{Enabled: o.ModelGateway, FastForwardFrom: o.FastForwardFrom}
	}
	return &dsecv1.SandboxSpec{
		ModelGateway: mg,
		Kind:         o.Kind, Image: o.Image,
		Resources: &dsecv1.Resources{Cpu: o.CPU, MemoryMb: o.MemoryMB, DiskMb: o.DiskMB, Pids: o.Pids, BandwidthMbps: o.BandwidthMbps},
		TtlS:      int64(o.TTL / time.Second), IdleTtlS: int64(o.IdleTTL / time.Second),
		Labels: o.Labels, Env: o.Env, Network: &dsecv1.Network{Mode: o.Network, Policy: o.Policy.proto()},
		User: o.User, Workdir: o.Workdir, Snapshot: o.Snapshot, Session: o.Session,
		NodeSelector: o.NodeSelector, Layers: o.Layers, Runtime: o.Runtime, OnTimeout: o.OnTimeout, Volumes: volumeMounts(o.Volumes),
		Sidecars: o.Sidecars,
	}
}

// Sandbox is a handle to one sandbox.
type Sandbox struct {
	ID   string
	Info *dsecv1.Sandbox
	c    *Client
	// container is the sidecar the handle's exec, process and file calls
	// act in ("": the main container).
	container string
}

// Container is a handle whose exec, process and file calls act in the
// sandbox's sidecar name ("" or "main": the main container); its other
// calls act on the whole sandbox, as s's do.
func (s *Sandbox) Container(name string) *Sandbox {
	c := *s
	c.container = name
	return &c
}

// Create starts a sandbox.
func (c *Client) Create(ctx context.Context, o CreateOptions) (*Sandbox, error) {
	r, err := c.raw.CreateSandbox(ctx, connect.NewRequest(&dsecv1.CreateSandboxRequest{Spec: o.spec(), IdempotencyKey: o.IdempotencyKey, Compose: o.Compose, ComposeOverrides: o.ComposeOverrides}))
	if err != nil {
		return nil, err
	}
	return &Sandbox{ID: r.Msg.Id, Info: r.Msg, c: c}, nil
}

// Sandbox returns a handle for an existing sandbox without a call.
func (c *Client) Sandbox(id string) *Sandbox { return &Sandbox{ID: id, c: c} }

// Get returns a sandbox's status.
func (c *Client) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	r, err := c.raw.GetSandbox(ctx, connect.NewRequest(&dsecv1.GetSandboxRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// List lists sandboxes matching a label selector ("k=v,k2!=v").
func (c *Client) List(ctx context.Context, selector string) ([]*dsecv1.Sandbox, error) {
	var out []*dsecv1.Sandbox
	token := ""
	for {
		r, err := c.raw.ListSandboxes(ctx, connect.NewRequest(&dsecv1.ListSandboxesRequest{LabelSelector: selector, PageToken: token}))
		if err != nil {
			return nil, err
		}
		out = append(out, r.Msg.Sandboxes...)
		if token = r.Msg.NextPageToken; token == "" {
			return out, nil
		}
	}
}

// Delete deletes a sandbox. It is idempotent.
func (c *Client) Delete(ctx context.Context, id string) error {
	_, err := c.raw.DeleteSandbox(ctx, connect.NewRequest(&dsecv1.DeleteSandboxRequest{Id: id}))
	return err
}

// Close deletes the sandbox. It is idempotent.
func (s *Sandbox) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return s.c.Delete(ctx, s.ID)
}

// Keepalive resets the idle timer; extend > 0 also moves the expiry to
// now + extend.
func (s *Sandbox) Keepalive(ctx context.Context, extend time.Duration) (*dsecv1.Sandbox, error) {
	r, err := s.c.raw.Keepalive(ctx, connect.NewRequest(&dsecv1.KeepaliveRequest{Id: s.ID, ExtendTtlS: int64(extend / time.Second)}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// ExecOptions describe a command.
type ExecOptions struct {
	Argv           []string
	Cmd            string // run with /bin/sh -c
	Env            map[string]string
	Cwd            string
	User           string
	Stdin          []byte
	Timeout        time.Duration
	MaxOutputBytes int64
	PTY            bool
	Rows, Cols     uint32
	Tag            string
	// RequestID makes the exec exactly-once (see the trajectory log).
	RequestID string
}

// Cmd is ExecOptions for a shell command.
func Cmd(cmd string) ExecOptions { return ExecOptions{Cmd: cmd} }

// Argv is ExecOptions for a command and its arguments.
func Argv(argv ...string) ExecOptions { return ExecOptions{Argv: argv} }

func (o ExecOptions) request(id, container string) *dsecv1.ExecRequest {
	return &dsecv1.ExecRequest{
		SandboxId: id, Container: container, Argv: o.Argv, Cmd: o.Cmd, Env: o.Env, Cwd: o.Cwd, User: o.User, Stdin: o.Stdin,
		TimeoutS: o.Timeout.Seconds(), MaxOutputBytes: o.MaxOutputBytes, Pty: o.PTY, PtyRows: o.Rows, PtyCols: o.Cols, Tag: o.Tag, RequestId: o.RequestID,
	}
}

// Exec runs a command to completion.
func (s *Sandbox) Exec(ctx context.Context, o ExecOptions) (*dsecv1.ExecResult, error) {
	r, err := s.c.raw.Exec(ctx, connect.NewRequest(o.request(s.ID, s.container)))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// Stream is a running command's output stream.
type Stream struct {
	ProcessID string
	s         *Sandbox
	st        *connect.ServerStreamForClient[dsecv1.ExecEvent]
}

// Start starts a command and returns once it runs. With stdinOpen, write
// its stdin with Stream.Write and Stream.CloseStdin.
func (s *Sandbox) Start(ctx context.Context, o ExecOptions, stdinOpen bool) (*Stream, error) {
	req := o.request(s.ID, s.container)
	req.StdinOpen = stdinOpen
	st, err := s.c.raw.ExecStream(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	if !st.Receive() {
		err := st.Err()
		st.Close()
		if err == nil {
			err = errors.New("stream ended before the process started")
		}
		return nil, asError(err)
	}
	started := st.Msg().GetStarted()
	if started == nil {
		st.Close()
		return nil, errors.New("first stream event is not 'started'")
	}
	return &Stream{ProcessID: started.ProcessId, s: s, st: st}, nil
}

// Next returns the next event; after the exit event it returns io.EOF.
func (x *Stream) Next() (*dsecv1.ExecEvent, error) {
	for x.st.Receive() {
		ev := x.st.Msg()
		if ev.GetKeepalive() {
			continue
		}
		return ev, nil
	}
	if err := x.st.Err(); err != nil {
		return nil, asError(err)
	}
	return nil, io.EOF
}

// Write sends data to the process's stdin.
func (x *Stream) Write(p []byte) (int, error) {
	_, err := x.s.c.raw.WriteStdin(context.Background(), connect.NewRequest(&dsecv1.WriteStdinRequest{SandboxId: x.s.ID, Container: x.s.container, ProcessId: x.ProcessID, Data: p}))
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// CloseStdin closes the process's stdin.
func (x *Stream) CloseStdin() error {
	_, err := x.s.c.raw.WriteStdin(context.Background(), connect.NewRequest(&dsecv1.WriteStdinRequest{SandboxId: x.s.ID, Container: x.s.container, ProcessId: x.ProcessID, Close: true}))
	return err
}

// Signal signals the process group ("INT", "TERM", "KILL", ...).
func (x *Stream) Signal(ctx context.Context, sig string) error {
	_, err := x.s.c.raw.SignalProcess(ctx, connect.NewRequest(&dsecv1.SignalProcessRequest{SandboxId: x.s.ID, Container: x.s.container, ProcessId: x.ProcessID, Signal: sig}))
	return err
}

// Resize resizes the process's PTY.
func (x *Stream) Resize(ctx context.Context, rows, cols uint32) error {
	_, err := x.s.c.raw.ResizePTY(ctx, connect.NewRequest(&dsecv1.ResizePTYRequest{SandboxId: x.s.ID, Container: x.s.container, ProcessId: x.ProcessID, Rows: rows, Cols: cols}))
	return err
}

// Close stops receiving; the process keeps running.
func (x *Stream) Close() error { return x.st.Close() }

// Wait copies the process's output to stdout and stderr until it exits.
func (x *Stream) Wait(stdout, stderr io.Writer) (*dsecv1.ExecResult, error) {
	for {
		ev, err := x.Next()
		if err == io.EOF {
			return nil, errors.New("stream ended without an exit event")
		}
		if err != nil {
			return nil, err
		}
		switch e := ev.Event.(type) {
		case *dsecv1.ExecEvent_Stdout:
			if stdout != nil {
				stdout.Write(e.Stdout)
			}
		case *dsecv1.ExecEvent_Stderr:
			if stderr != nil {
				stderr.Write(e.Stderr)
			}
		case *dsecv1.ExecEvent_Exit:
			return e.Exit, nil
		}
	}
}

// Logs writes a sidecar's output (its service process; call it on
// Sandbox.Container) kept so far, then follows it until the sidecar's
// process exits or ctx ends, and returns its exit.
func (s *Sandbox) Logs(ctx context.Context, stdout, stderr io.Writer) (*dsecv1.ExecResult, error) {
	st, err := s.c.raw.ConnectProcess(ctx, connect.NewRequest(&dsecv1.ConnectProcessRequest{SandboxId: s.ID, Container: s.container, Tag: "service"}))
	if err != nil {
		return nil, err
	}
	x := &Stream{s: s, st: st}
	defer x.Close()
	return x.Wait(stdout, stderr)
}

// WriteFile streams r into path (mode 0 means 0644).
func (s *Sandbox) WriteFile(ctx context.Context, path string, r io.Reader, mode uint32) (*dsecv1.FileInfo, error) {
	hdr := &dsecv1.WriteFileHeader{SandboxId: s.ID, Container: s.container, Path: path, Mode: mode}
	return sendStream(s.c.raw.WriteFile(ctx), &dsecv1.WriteFileRequest{Msg: &dsecv1.WriteFileRequest_Header{Header: hdr}},
		func(b []byte) *dsecv1.WriteFileRequest {
			return &dsecv1.WriteFileRequest{Msg: &dsecv1.WriteFileRequest_Data{Data: b}}
		},
		r, 256<<10, nil)
}

// ReadFile streams path into w.
func (s *Sandbox) ReadFile(ctx context.Context, path string, w io.Writer) (*dsecv1.FileInfo, error) {
	st, err := s.c.raw.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: s.ID, Container: s.container, Path: path}))
	if err != nil {
		return nil, err
	}
	return readChunks(st, w, func(m *dsecv1.ReadFileResponse) (*dsecv1.FileInfo, []byte) { return m.GetInfo(), m.GetData() })
}

// readChunks copies a file's stream into w: each message carries either
// the file's description (part's info, not nil) or a chunk of its data.
// It returns the description.
func readChunks[R any, I comparable](st *connect.ServerStreamForClient[R], w io.Writer, part func(*R) (I, []byte)) (I, error) {
	defer st.Close()
	var info, none I
	for st.Receive() {
		i, data := part(st.Msg())
		if i != none {
			info = i
			continue
		}
		if _, err := w.Write(data); err != nil {
			return none, err
		}
	}
	if err := st.Err(); err != nil {
		return none, asError(err)
	}
	return info, nil
}

// Stat returns a file's info.
func (s *Sandbox) Stat(ctx context.Context, path string) (*dsecv1.FileInfo, error) {
	r, err := s.c.raw.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{SandboxId: s.ID, Container: s.container, Path: path}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}

// ChangeMode sets a path's permission bits (chmod), as the sandbox's user.
func (s *Sandbox) ChangeMode(ctx context.Context, path string, mode uint32) (*dsecv1.FileInfo, error) {
	r, err := s.c.raw.ChangeMode(ctx, connect.NewRequest(&dsecv1.ChangeModeRequest{SandboxId: s.ID, Container: s.container, Path: path, Mode: mode}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}

// ListDir lists a directory.
func (s *Sandbox) ListDir(ctx context.Context, path string, depth int32) ([]*dsecv1.FileInfo, error) {
	r, err := s.c.raw.ListDir(ctx, connect.NewRequest(&dsecv1.ListDirRequest{SandboxId: s.ID, Container: s.container, Path: path, Depth: depth}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg.Entries, nil
}

// Processes lists the sandbox's processes.
func (s *Sandbox) Processes(ctx context.Context) ([]*dsecv1.ProcessInfo, error) {
	r, err := s.c.raw.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: s.ID, Container: s.container}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Processes, nil
}

// Stats reports the sandbox's resource use (CPU time, memory, processes,
// OOM kills). It neither resumes a paused sandbox nor counts as activity.
func (s *Sandbox) Stats(ctx context.Context) (*dsecv1.SandboxStats, error) {
	r, err := s.c.raw.GetSandboxStats(ctx, connect.NewRequest(&dsecv1.GetSandboxStatsRequest{Id: s.ID}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// StatsHistory is Stats with the samples the node kept of the sandbox's
// use (History: every 5 s, the last 15 minutes, oldest first).
func (s *Sandbox) StatsHistory(ctx context.Context) (*dsecv1.SandboxStats, error) {
	r, err := s.c.raw.GetSandboxStats(ctx, connect.NewRequest(&dsecv1.GetSandboxStatsRequest{Id: s.ID, History: true}))
	if err != nil {
		return nil, asError(err)
	}
	return r.Msg, nil
}
