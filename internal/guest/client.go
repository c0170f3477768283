package guest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// DialFunc opens a new stream connection to one sandbox's agent.
type DialFunc func(ctx context.Context) (net.Conn, error)

// UnixDialer dials the agent's listening unix socket at path.
func UnixDialer(path string) DialFunc {
	var d net.Dialer
	return func(ctx context.Context) (net.Conn, error) {
		return d.DialContext(ctx, "unix", path)
	}
}

// Client calls one sandbox's agent. It is safe for concurrent use, and
// calls never wait on each other: a call that sends nothing after its
// first message (Run, and the calls with one answer) takes an idle kept
// connection or opens one (see the protocol's top comment), and gives it
// back once answered; every other call, and every call to an agent that
// keeps no connection (an older one), opens a connection of its own.
// Close the client when its sandbox ends.
type Client struct {
	dial DialFunc

	// single: the agent keeps no connection, or its connections cannot be
	// checked for life before reuse (see alive).
	single atomic.Bool
	idle   *idleConns
}

// idleConns are a client's kept connections between calls.
type idleConns struct {
	mu     sync.Mutex
	conns  []*conn
	closed bool
}

// maxIdle bounds one client's kept connections held between calls:
// concurrent calls beyond it open connections they close after.
const maxIdle = 4

// The process's idle kept connections, across its clients, stay within
// idleBudget (a quarter of its open-file limit): on a node with thousands
// of sandboxes the rest go back to a connection per call rather than
// spend the limit.
var (
	idleKept   atomic.Int64
	idleBudget = sync.OnceValue(func() int64 {
		var rl unix.Rlimit
		if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) != nil {
			return 256
		}
		return int64(rl.Cur / 4)
	})
)

// NewClient returns a client that connects with dial.
func NewClient(dial DialFunc) *Client {
	c := &Client{dial: dial, idle: &idleConns{}}
	// A client dropped without Close gives its kept connections, and their
	// share of the budget, back once it is collected.
	runtime.AddCleanup(c, (*idleConns).close, c.idle)
	return c
}

// Close closes the kept connections; calls after it open their own.
func (c *Client) Close() { c.idle.close() }

func (p *idleConns) close() {
	p.mu.Lock()
	conns := p.conns
	p.conns, p.closed = nil, true
	p.mu.Unlock()
	idleKept.Add(-int64(len(conns)))
	for _, cn := range conns {
		cn.c.Close()
	}
}

// take returns an idle connection, or nil.
func (p *idleConns) take() *conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.conns)
	if n == 0 {
		return nil
	}
	cn := p.conns[n-1]
	p.conns = p.conns[:n-1]
	idleKept.Add(-1)
	return cn
}

// put keeps cn for the next call if the client is open and the client's
// and the process's bounds allow; it reports whether it did.
func (p *idleConns) put(cn *conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || len(p.conns) >= maxIdle {
		return false
	}
	if idleKept.Add(1) > idleBudget() {
		idleKept.Add(-1)
		return false
	}
	p.conns = append(p.conns, cn)
	return true
}

func (p *idleConns) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// conn is one call's connection.
type conn struct {
	c      net.Conn
	r      *Reader
	w      *Writer
	stop   func() bool
	kept   bool // a kept connection: given back after its call
	broken bool // a read or write failed: never given back
}

// open dials and sends the call. The connection closes when ctx ends.
func (c *Client) open(ctx context.Context, call *guestv1.ClientMsg) (*conn, error) {
	nc, err := c.dial(ctx)
	if err != nil {
		return nil, unreachable(err)
	}
	cn := &conn{c: nc, r: NewReader(nc), w: NewWriter(nc)}
	return cn, cn.send(ctx, call)
}

// send arms the connection for ctx (a deadline in the past when it ends)
// and sends the call; on failure the connection is closed.
func (cn *conn) send(ctx context.Context, call *guestv1.ClientMsg) error {
	nc := cn.c
	cn.stop = context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	if err := cn.w.Write(call); err != nil {
		cn.broken = true
		cn.close()
		return cn.wrapSend(ctx, err)
	}
	return nil
}

// begin sends a call that sends nothing after its first message: over a
// kept connection when the agent keeps them, else over its own. End it
// with finish.
func (c *Client) begin(ctx context.Context, call *guestv1.ClientMsg) (*conn, error) {
	cn, err := c.kept(ctx)
	if err != nil {
		return nil, err
	}
	if cn == nil {
		return c.open(ctx, call)
	}
	return cn, cn.send(ctx, call)
}

// kept returns an idle kept connection, or a new one; nil (and no error)
// when the agent keeps none.
func (c *Client) kept(ctx context.Context) (*conn, error) {
	for cn := c.idle.take(); cn != nil; cn = c.idle.take() {
		if alive(cn.c) {
			return cn, nil
		}
		cn.c.Close() // the agent is gone (or restarted): a new one is dialled
	}
	if c.single.Load() || c.idle.isClosed() || idleKept.Load() >= idleBudget() {
		return nil, nil
	}
	nc, err := c.dial(ctx)
	if err != nil {
		return nil, unreachable(err)
	}
	if _, ok := nc.(syscall.Conn); !ok {
		c.single.Store(true)
		nc.Close()
		return nil, nil
	}
	cn := &conn{c: nc, r: NewReader(nc), w: NewWriter(nc), kept: true}
	if err := cn.send(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Hello{Hello: &guestv1.Hello{Keep: true}}}); err != nil {
		return nil, err
	}
	m, err := cn.recv(ctx)
	stopped := cn.stop()
	switch {
	case err != nil:
		cn.c.Close()
		return nil, err
	case !stopped:
		cn.c.Close()
		return nil, errdefs.Classify(ctx.Err())
	case !m.GetHello().GetKeep():
		// An agent of an older protocol: it answered and closed.
		c.single.Store(true)
		cn.c.Close()
		return nil, nil
	}
	return cn, nil
}

// finish ends a call begun with begin: a kept connection whose answer was
// read whole goes back to the idle ones, any other is closed.
func (c *Client) finish(cn *conn) {
	if !cn.kept || cn.broken || !cn.stop() || !c.idle.put(cn) {
		cn.close()
	}
}

// alive reports whether a kept connection's agent is still there: nothing
// is waiting to be read on it between calls, so a peek that finds no data
// and no end of stream means it is open. A connection whose descriptor
// cannot be reached is taken for gone.
func alive(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	open := false
	var b [1]byte
	rc.Control(func(fd uintptr) {
		_, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		open = err == unix.EAGAIN
	})
	return open
}

// wrapSend classifies a failure to send: a message too large for a frame
// is the caller's (deterministic: not retryable, not infra).
func (cn *conn) wrapSend(ctx context.Context, err error) error {
	if errors.Is(err, errTooLarge) {
		return errdefs.Invalid("request larger than the sandbox agent accepts (%d bytes in one message)", MaxMessage)
	}
	return cn.wrap(ctx, err)
}

// inlineStdin is the most stdin sent inside an Exec message; more follows
// it as Input messages of at most inputChunk bytes, so no stdin is too
// large for a frame.
const (
	inlineStdin = 1 << 20
	inputChunk  = 1 << 20
)

// splitStdin moves stdin larger than inlineStdin out of x (a copy when it
// does): the agent keeps stdin open for it, and closes it after when eof.
func splitStdin(x *guestv1.Exec) (out *guestv1.Exec, rest []byte, eof bool) {
	if len(x.StdinData) <= inlineStdin {
		return x, nil, false
	}
	out = proto.Clone(x).(*guestv1.Exec)
	rest, eof = out.StdinData, !out.StdinOpen
	out.StdinData, out.StdinOpen = nil, true
	return out, rest, eof
}

// feed sends data as Input messages, then end of input when eof. It stops
// at the first failure (the process ended, the call is over).
func (cn *conn) feed(data []byte, eof bool) error {
	for first := true; first || len(data) > 0; first = false {
		k := min(len(data), inputChunk)
		last := k == len(data)
		if k == 0 && !eof {
			return nil
		}
		in := &guestv1.Input{Data: data[:k], Eof: eof && last}
		if err := cn.w.Write(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Input{Input: in}}); err != nil {
			return err
		}
		data = data[k:]
	}
	return nil
}

func (cn *conn) close() {
	cn.stop()
	cn.c.Close()
}

// recv reads the next message, turning an Error message into an error.
func (cn *conn) recv(ctx context.Context) (*guestv1.ServerMsg, error) {
	m := new(guestv1.ServerMsg)
	if err := cn.r.Read(m); err != nil {
		cn.broken = true
		if errors.Is(err, errTooLarge) {
			return nil, errdefs.Internal(err, "the sandbox agent sent a message larger than %d bytes", MaxMessage)
		}
		return nil, cn.wrap(ctx, err)
	}
	if e := m.GetError(); e != nil {
		return nil, FromWire(e)
	}
	return m, nil
}

// wrap classifies a transport error, preferring the context's reason.
func (cn *conn) wrap(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return errdefs.Classify(ctx.Err())
	}
	return unreachable(err)
}

// ErrUnreachable is the cause of every transport failure: the agent's
// connection could not be made or broke mid-call.
var ErrUnreachable = errors.New("sandbox agent unreachable")

func unreachable(err error) error {
	return errdefs.Unavailable("sandbox agent unreachable").WithCause(fmt.Errorf("%w: %w", ErrUnreachable, err))
}

// call runs a call with a single answer.
func (c *Client) call(ctx context.Context, call *guestv1.ClientMsg) (*guestv1.ServerMsg, error) {
	cn, err := c.begin(ctx, call)
	if err != nil {
		return nil, err
	}
	defer c.finish(cn)
	return cn.recv(ctx)
}

// Hello checks that the agent answers and returns what it reports.
func (c *Client) Hello(ctx context.Context) (*guestv1.HelloReply, error) {
	m, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Hello{Hello: &guestv1.Hello{}}})
	if err != nil {
		return nil, err
	}
	return m.GetHello(), nil
}

// Run runs a command to completion in collect mode and returns its exit,
// with the head and tail of its output. The agent streams both (the head
// as it comes, the tail at the end) and stdin larger than inlineStdin goes
// in chunks: no size fits a frame or not.
func (c *Client) Run(ctx context.Context, x *guestv1.Exec) (*guestv1.Exit, error) {
	x.Collect = true
	x, stdin, eof := splitStdin(x)
	call := &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Exec{Exec: x}}
	if stdin != nil || x.StdinOpen {
		// Input follows the call: a connection of its own.
		cn, err := c.open(ctx, call)
		if err != nil {
			return nil, err
		}
		defer cn.close()
		go cn.feed(stdin, eof)
		return cn.collect(ctx)
	}
	cn, err := c.begin(ctx, call)
	if err != nil {
		return nil, err
	}
	defer c.finish(cn)
	return cn.collect(ctx)
}

// collect reads an exec's output and exit in collect mode.
func (cn *conn) collect(ctx context.Context) (*guestv1.Exit, error) {
	var out [3][]byte
	for {
		m, err := cn.recv(ctx)
		if err != nil {
			return nil, err
		}
		switch v := m.Msg.(type) {
		case *guestv1.ServerMsg_Output:
			if fd := v.Output.Fd; fd == 1 || fd == 2 {
				out[fd] = append(out[fd], v.Output.Data...)
			}
		case *guestv1.ServerMsg_Exit:
			// An agent of an older protocol sends the output in the exit.
			v.Exit.Stdout = append(out[1], v.Exit.Stdout...)
			v.Exit.Stderr = append(out[2], v.Exit.Stderr...)
			return v.Exit, nil
		default:
			cn.broken = true
			return nil, errdefs.Internal(nil, "agent answered exec with %T", m.Msg)
		}
	}
}

// Process is a streaming connection to one process in the sandbox.
type Process struct {
	ID    string
	Pid   int32
	cn    *conn
	ctx   context.Context
	early []*guestv1.ServerMsg // what an exit received instead of "started" stands for
	done  bool
}

// Start starts a command in stream mode and returns once it runs.
func (c *Client) Start(ctx context.Context, x *guestv1.Exec) (*Process, error) {
	x.Collect = false
	x, stdin, eof := splitStdin(x)
	p, err := c.startLike(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Exec{Exec: x}})
	if err == nil && stdin != nil && p.early == nil {
		go p.cn.feed(stdin, eof)
	}
	return p, err
}

// Attach connects to a process started earlier, by id or tag. Buffered
// output is replayed first unless liveOnly.
func (c *Client) Attach(ctx context.Context, id, tag string, liveOnly bool) (*Process, error) {
	return c.startLike(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Attach{Attach: &guestv1.Attach{Id: id, Tag: tag, LiveOnly: liveOnly}}})
}

func (c *Client) startLike(ctx context.Context, call *guestv1.ClientMsg) (*Process, error) {
	cn, err := c.open(ctx, call)
	if err != nil {
		return nil, err
	}
	m, err := cn.recv(ctx)
	if err != nil {
		cn.close()
		return nil, err
	}
	if x := m.GetExit(); x != nil {
		// The command could not start (not found, bad user): the exit
		// says why. A stream carries output as events, not in its exit, so
		// the reason comes as stderr output, then the exit.
		cn.close()
		p := &Process{cn: cn, ctx: ctx}
		if len(x.Stderr) > 0 {
			p.early = append(p.early, &guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Output{Output: &guestv1.Output{Fd: 2, Data: x.Stderr}}})
			x.Stderr = nil
		}
		p.early = append(p.early, m)
		return p, nil
	}
	st := m.GetStarted()
	if st == nil {
		cn.close()
		return nil, errdefs.Internal(nil, "agent answered exec with %T", m.Msg)
	}
	return &Process{ID: st.Id, Pid: st.Pid, cn: cn, ctx: ctx}, nil
}

// Recv returns the next Output or Exit message.
func (p *Process) Recv() (*guestv1.ServerMsg, error) {
	if len(p.early) > 0 {
		m := p.early[0]
		p.early = p.early[1:]
		p.done = len(p.early) == 0
		return m, nil
	}
	if p.done {
		return nil, io.EOF
	}
	return p.cn.recv(p.ctx)
}

// Input writes to the process's stdin, in chunks a frame holds.
func (p *Process) Input(data []byte, eof bool) error {
	if err := p.cn.feed(data, eof); err != nil {
		return p.cn.wrapSend(p.ctx, err)
	}
	return nil
}

// Signal signals the process group.
func (p *Process) Signal(sig syscall.Signal) error {
	return p.send(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Signal{Signal: &guestv1.Signal{Signal: int32(sig)}}})
}

// Resize changes the PTY size.
func (p *Process) Resize(rows, cols uint32) error {
	return p.send(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Resize{Resize: &guestv1.Resize{Rows: rows, Cols: cols}}})
}

func (p *Process) send(m *guestv1.ClientMsg) error {
	if err := p.cn.w.Write(m); err != nil {
		return p.cn.wrapSend(p.ctx, err)
	}
	return nil
}

// Close detaches from the process; the process keeps running.
func (p *Process) Close() { p.cn.close() }

// SignalProcess signals a process by id without attaching to it.
func (c *Client) SignalProcess(ctx context.Context, id string, sig syscall.Signal) error {
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Signal{Signal: &guestv1.Signal{Id: id, Signal: int32(sig)}}})
	return err
}

// ResizeProcess resizes a process's PTY by id.
func (c *Client) ResizeProcess(ctx context.Context, id string, rows, cols uint32) error {
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Resize{Resize: &guestv1.Resize{Id: id, Rows: rows, Cols: cols}}})
	return err
}

// InputProcess writes to a process's stdin by id: one call per chunk a
// frame holds, in order.
func (c *Client) InputProcess(ctx context.Context, id string, data []byte, eof bool) error {
	for first := true; first || len(data) > 0; first = false {
		k := min(len(data), inputChunk)
		in := &guestv1.Input{Id: id, Data: data[:k], Eof: eof && k == len(data)}
		if _, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Input{Input: in}}); err != nil {
			return err
		}
		data = data[k:]
	}
	return nil
}

// ListProcs lists running and recently finished processes.
func (c *Client) ListProcs(ctx context.Context) ([]*guestv1.Proc, error) {
	m, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_ListProcs{ListProcs: &guestv1.ListProcs{}}})
	if err != nil {
		return nil, err
	}
	return m.GetProcs().GetProcs(), nil
}

// File calls act as the message's user inside the sandbox (empty: root);
// see guestv1.ReadFile. A path that user may not touch is a
// permission_denied error.

// Stat returns a file's info (of a symlink itself, not its target).
func (c *Client) Stat(ctx context.Context, p *guestv1.Path) (*guestv1.FileInfo, error) {
	return c.infoCall(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Stat{Stat: p}})
}

// MakeDir creates a directory and its parents.
func (c *Client) MakeDir(ctx context.Context, m *guestv1.MakeDir) (*guestv1.FileInfo, error) {
	return c.infoCall(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_MakeDir{MakeDir: m}})
}

// Rename moves a file or directory.
func (c *Client) Rename(ctx context.Context, m *guestv1.Rename) (*guestv1.FileInfo, error) {
	return c.infoCall(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Rename{Rename: m}})
}

// ChangeMode sets a path's permission bits.
func (c *Client) ChangeMode(ctx context.Context, m *guestv1.ChangeMode) (*guestv1.FileInfo, error) {
	return c.infoCall(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_ChangeMode{ChangeMode: m}})
}

func (c *Client) infoCall(ctx context.Context, call *guestv1.ClientMsg) (*guestv1.FileInfo, error) {
	m, err := c.call(ctx, call)
	if err != nil {
		return nil, err
	}
	if m.GetInfo() == nil {
		return nil, errdefs.Internal(nil, "agent answered with %T", m.Msg)
	}
	return m.GetInfo(), nil
}

// Remove removes a file, or a directory tree when recursive.
func (c *Client) Remove(ctx context.Context, m *guestv1.Remove) error {
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Remove{Remove: m}})
	return err
}

// ListDir lists a directory to the given depth.
func (c *Client) ListDir(ctx context.Context, l *guestv1.ListDir) ([]*guestv1.FileInfo, error) {
	m, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_ListDir{ListDir: l}})
	if err != nil {
		return nil, err
	}
	return m.GetEntries().GetEntries(), nil
}

// SetDeadline sets when the agent ends the sandbox by itself.
func (c *Client) SetDeadline(ctx context.Context, t time.Time) error {
	ms := int64(0)
	if !t.IsZero() {
		ms = t.UnixMilli()
	}
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_SetDeadline{SetDeadline: &guestv1.SetDeadline{UnixMs: ms}}})
	return err
}

// SetEnv adds variables to the sandbox's environment for later processes.
func (c *Client) SetEnv(ctx context.Context, env []string) error {
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_SetEnv{SetEnv: &guestv1.SetEnv{Env: env}}})
	return err
}

// StartRunner starts (or replaces) the function runner.
func (c *Client) StartRunner(ctx context.Context, argv, env []string) error {
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_StartRunner{StartRunner: &guestv1.StartRunner{Argv: argv, Env: env}}})
	return err
}

// Call runs one function call.
func (c *Client) Call(ctx context.Context, call *guestv1.Call) (*guestv1.CallResult, error) {
	m, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Call{Call: call}})
	if err != nil {
		return nil, err
	}
	if m.GetCallResult() == nil {
		return nil, errdefs.Internal(nil, "agent answered a call with %T", m.Msg)
	}
	return m.GetCallResult(), nil
}

// Watch is a directory watch in the sandbox.
type Watch struct {
	cn  *conn
	ctx context.Context
}

// Watch watches a directory (and, when recursive, the tree below it) and
// returns once the watch is in place. The watch ends with Close or ctx.
func (c *Client) Watch(ctx context.Context, w *guestv1.Watch) (*Watch, error) {
	cn, err := c.open(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Watch{Watch: w}})
	if err != nil {
		return nil, err
	}
	m, err := cn.recv(ctx)
	if err != nil {
		cn.close()
		return nil, err
	}
	if m.GetDone() == nil {
		cn.close()
		return nil, errdefs.Internal(nil, "agent answered watch with %T", m.Msg)
	}
	return &Watch{cn: cn, ctx: ctx}, nil
}

// Recv returns the next change.
func (w *Watch) Recv() (*guestv1.FsEvent, error) {
	m, err := w.cn.recv(w.ctx)
	if err != nil {
		return nil, err
	}
	if e := m.GetFsEvent(); e != nil {
		return e, nil
	}
	return nil, errdefs.Internal(nil, "agent sent %T in a watch", m.Msg)
}

// Close ends the watch.
func (w *Watch) Close() { w.cn.close() }

// Sync flushes the sandbox's filesystems.
func (c *Client) Sync(ctx context.Context) error {
	_, err := c.call(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Sync{Sync: &guestv1.Sync{}}})
	return err
}

// FileReader streams a file's content.
type FileReader struct {
	Info *guestv1.FileInfo
	cn   *conn
	ctx  context.Context
	buf  []byte
	done bool
}

// ReadFile opens a file for streaming. Limit 0 reads to the end.
func (c *Client) ReadFile(ctx context.Context, r *guestv1.ReadFile) (*FileReader, error) {
	cn, err := c.open(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_ReadFile{ReadFile: r}})
	if err != nil {
		return nil, err
	}
	m, err := cn.recv(ctx)
	if err != nil {
		cn.close()
		return nil, err
	}
	if m.GetInfo() == nil {
		cn.close()
		return nil, errdefs.Internal(nil, "agent answered read with %T", m.Msg)
	}
	return &FileReader{Info: m.GetInfo(), cn: cn, ctx: ctx}, nil
}

// Chunk returns the next data chunk, or io.EOF at the end of the file.
func (f *FileReader) Chunk() ([]byte, error) {
	if f.done {
		return nil, io.EOF
	}
	m, err := f.cn.recv(f.ctx)
	if err != nil {
		return nil, err
	}
	switch v := m.Msg.(type) {
	case *guestv1.ServerMsg_Data:
		return v.Data, nil
	case *guestv1.ServerMsg_End:
		f.done = true
		return nil, io.EOF
	}
	return nil, errdefs.Internal(nil, "agent sent %T in a file stream", m.Msg)
}

// Read implements io.Reader.
func (f *FileReader) Read(p []byte) (int, error) {
	for len(f.buf) == 0 {
		b, err := f.Chunk()
		if err != nil {
			return 0, err
		}
		f.buf = b
	}
	n := copy(p, f.buf)
	f.buf = f.buf[n:]
	return n, nil
}

// Close ends the stream.
func (f *FileReader) Close() error { f.cn.close(); return nil }

// WriteFile streams r into a file and returns the file's info.
func (c *Client) WriteFile(ctx context.Context, w *guestv1.WriteFile, r io.Reader) (*guestv1.FileInfo, error) {
	cn, err := c.open(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_WriteFile{WriteFile: w}})
	if err != nil {
		return nil, err
	}
	defer cn.close()
	// The agent may refuse the write (bad path) before reading the data; a
	// reader goroutine sees that answer while we are still sending.
	answer := make(chan *guestv1.ServerMsg, 1)
	answerErr := make(chan error, 1)
	go func() {
		m, err := cn.recv(ctx)
		if err != nil {
			answerErr <- err
			return
		}
		answer <- m
	}()
	// sendFailed prefers the agent's answer to a failed send: an agent that
	// refused the write answers, then closes, and the next send (data or
	// the end mark) breaks on the closed connection.
	sendFailed := func(err error) error {
		select {
		case err := <-answerErr:
			return err
		case m := <-answer:
			return errdefs.Internal(nil, "agent answered early with %T", m.Msg)
		case <-time.After(5 * time.Second):
		}
		return cn.wrap(ctx, err)
	}
	buf := make([]byte, ChunkSize)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := cn.w.Write(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Data{Data: buf[:n]}}); err != nil {
				return nil, sendFailed(err)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return nil, errdefs.Invalid("read upload: %v", rerr)
		}
		select {
		case err := <-answerErr:
			return nil, err
		default:
		}
	}
	if err := cn.w.Write(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_End{End: &guestv1.End{}}}); err != nil {
		return nil, sendFailed(err)
	}
	select {
	case err := <-answerErr:
		return nil, err
	case m := <-answer:
		if m.GetInfo() == nil {
			return nil, errdefs.Internal(nil, "agent answered write with %T", m.Msg)
		}
		return m.GetInfo(), nil
	}
}

// Error codes the agent sends.
const (
	CodeNotFound   = "not_found"
	CodeInvalid    = "invalid"
	CodeExists     = "exists"
	CodePermission = "permission"
	CodeNotDir     = "not_dir"
	CodeIsDir      = "is_dir"
	CodeNotEmpty   = "not_empty"
	CodeNoSpace    = "no_space"
	CodeIO         = "io"
	CodeInternal   = "internal"
)

// FromWire turns an agent's Error message into a classified error.
func FromWire(e *guestv1.Error) error {
	switch e.Code {
	case CodeNotFound:
		return errdefs.NotFound("%s", e.Message)
	case CodeInvalid, CodeNotDir, CodeIsDir, CodeNotEmpty:
		return errdefs.Invalid("%s", e.Message)
	case CodeExists:
		return errdefs.Conflict("%s", e.Message)
	case CodePermission:
		return errdefs.PermissionDenied("%s", e.Message)
	case CodeNoSpace:
		e := errdefs.Exhausted(0, "%s", e.Message)
		e.Infra, e.Retryable = false, false
		return e
	}
	return errdefs.Internal(nil, "%s", e.Message)
}

// ToWire turns an error from a file or process operation in the agent into
// an Error message, naming the path as the sandbox sees it.
func ToWire(err error) *guestv1.Error {
	code := CodeInternal
	var errno syscall.Errno
	var coded interface{ WireCode() string }
	switch {
	case errors.As(err, &coded):
		code = coded.WireCode()
	case errors.As(err, &errno):
		code = errnoCode(errno)
	case errors.Is(err, os.ErrNotExist):
		code = CodeNotFound
	case errors.Is(err, os.ErrExist):
		code = CodeExists
	case errors.Is(err, os.ErrPermission):
		code = CodePermission
	}
	return &guestv1.Error{Code: code, Message: err.Error()}
}

func errnoCode(e syscall.Errno) string {
	switch e {
	case syscall.ENOENT:
		return CodeNotFound
	case syscall.EEXIST:
		return CodeExists
	case syscall.EACCES, syscall.EPERM, syscall.EROFS:
		return CodePermission
	case syscall.ENOTDIR:
		return CodeNotDir
	case syscall.EISDIR:
		return CodeIsDir
	case syscall.ENOTEMPTY:
		return CodeNotEmpty
	case syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG:
		return CodeNoSpace
	case syscall.EINVAL, syscall.ENAMETOOLONG, syscall.ELOOP, syscall.EXDEV:
		return CodeInvalid
	case syscall.EIO:
		return CodeIO
	}
	return CodeInternal
}

// DialPort connects to a TCP port on the sandbox's own loopback interface
// (see guestv1.DialPort) and returns the connection, whose bytes are the
// port's. ctx bounds the connect only; the connection lives until closed.
// Nothing listening on the port is a not_found error.
func (c *Client) DialPort(ctx context.Context, port uint32) (net.Conn, error) {
	cn, err := c.open(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_DialPort{DialPort: &guestv1.DialPort{Port: port}}})
	if err != nil {
		return nil, err
	}
	m, err := cn.recv(ctx)
	if err == nil && m.GetDone() == nil {
		err = errdefs.Internal(nil, "agent answered dial_port with %T", m.Msg)
	}
	if err != nil {
		cn.close()
		return nil, err
	}
	if !cn.stop() {
		// ctx ended as the answer came: the deadline is set already.
		cn.c.Close()
		return nil, errdefs.Classify(ctx.Err())
	}
	return &portConn{Conn: cn.c, r: cn.r.Raw()}, nil
}

// portConn is a dial_port connection after the agent's answer: its first
// bytes may sit in the message reader's buffer.
type portConn struct {
	net.Conn
	r io.Reader
}

func (p *portConn) Read(b []byte) (int, error) { return p.r.Read(b) }

// CloseWrite ends the sending direction where the transport can (a unix
// socket), else the whole connection.
func (p *portConn) CloseWrite() error {
	if cw, ok := p.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return p.Conn.Close()
}

// Listen listens on a TCP port of the sandbox's loopback (127.0.0.1) and
// returns a listener whose Accept yields the connections processes in the
// sandbox open to it, each carried over a call of its own. The listener
// ends with Close (which returns once the agent closed the port, or after
// listenCloseWait), ctx, or the agent's connection (Accept then fails).
func (c *Client) Listen(ctx context.Context, port uint32) (net.Listener, error) {
	cn, err := c.open(ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_ListenPort{ListenPort: &guestv1.ListenPort{Port: port}}})
	if err != nil {
		return nil, err
	}
	m, err := cn.recv(ctx)
	if err == nil && m.GetDone() == nil {
		err = errdefs.Internal(nil, "agent answered listen_port with %T", m.Msg)
	}
	if err != nil {
		cn.close()
		return nil, err
	}
	l := &portListener{c: c, cn: cn, ctx: ctx, port: port, ids: make(chan string), ended: make(chan struct{}), closing: make(chan struct{})}
	go l.read()
	return l, nil
}

// listenCloseWait bounds how long Close waits for the agent to close the
// port.
const listenCloseWait = 5 * time.Second

// portListener is a Listen call. One goroutine reads its connection:
// the agent's Accepted messages, then its end.
type portListener struct {
	c       *Client
	cn      *conn
	ctx     context.Context
	port    uint32
	ids     chan string   // accepted connections' IDs
	ended   chan struct{} // closed when the agent's side ended
	closing chan struct{} // closed by Close
	once    sync.Once
}

func (l *portListener) read() {
	defer close(l.ended)
	for {
		m, err := l.cn.recv(l.ctx)
		if err != nil {
			return
		}
		a := m.GetAccepted()
		if a == nil {
			return // not the protocol: end the listener
		}
		select {
		case l.ids <- a.Id:
		case <-l.closing:
		}
	}
}

// Accept waits for the next connection and takes it. A connection the
// agent no longer holds (it waited too long) is skipped.
func (l *portListener) Accept() (net.Conn, error) {
	for {
		var id string
		select {
		case id = <-l.ids:
		case <-l.ended:
			return nil, net.ErrClosed
		case <-l.closing:
			return nil, net.ErrClosed
		}
		tc, err := l.c.open(l.ctx, &guestv1.ClientMsg{Msg: &guestv1.ClientMsg_TakeConn{TakeConn: &guestv1.TakeConn{Id: id}}})
		if err != nil {
			return nil, err
		}
		ans, err := tc.recv(l.ctx)
		if err == nil && ans.GetDone() == nil {
			err = errdefs.Internal(nil, "agent answered take_conn with %T", ans.Msg)
		}
		if err != nil {
			tc.close()
			if errdefs.Is(err, errdefs.KindNotFound) {
				continue
			}
			return nil, err
		}
		tc.stop()
		return &portConn{Conn: tc.c, r: tc.r.Raw()}, nil
	}
}

// Close ends the listener in the sandbox: it ends its sending side, which
// has the agent close the port and then its side, and returns once that
// came (so the port is free), or after listenCloseWait.
func (l *portListener) Close() error {
	l.once.Do(func() {
		close(l.closing)
		if cw, ok := l.cn.c.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
			t := time.NewTimer(listenCloseWait)
			select {
			case <-l.ended:
			case <-t.C:
			}
			t.Stop()
		}
		l.cn.close()
	})
	return nil
}

// Addr is the sandbox's side: 127.0.0.1 and the port.
func (l *portListener) Addr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(l.port)}
}
