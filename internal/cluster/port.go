package cluster

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// DialPort opens a ConnectPort stream to the node and returns it as a
// connection once the node answers that the port is connected. ctx bounds
// that much; the stream then lives until the connection is closed or the
// node is lost.
func (r *remote) DialPort(ctx context.Context, id string, port uint32) (net.Conn, error) {
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	st := r.nd.ConnectPort(sctx)
	fail := func(err error) (net.Conn, error) {
		stop()
		cancel()
		st.CloseRequest()
		st.CloseResponse()
		if ctx.Err() != nil {
			return nil, errdefs.Classify(ctx.Err())
		}
		return nil, err
	}
	if err := st.Send(&nodev1.PortData{SandboxId: id, Port: port}); err != nil && !errors.Is(err, io.EOF) {
		return fail(err)
	}
	// io.EOF from Send: the node answered already; Receive says how.
	if _, err := st.Receive(); err != nil {
		if errors.Is(err, io.EOF) {
			err = errdefs.Unavailable("node %s ended the port connection before answering", r.name)
		}
		return fail(err)
	}
	if !stop() {
		return fail(ctx.Err())
	}
	return &streamConn{st: st, cancel: cancel}, nil
}

// streamConn is a ConnectPort stream as a net.Conn. Read and Write may be
// called concurrently with each other; deadlines are not supported (their
// setters do nothing), as the port proxy does not use them.
type streamConn struct {
	st     *connect.BidiStreamForClient[nodev1.PortData, nodev1.PortData]
	cancel context.CancelFunc

	rmu     sync.Mutex
	pending []byte

	wmu    sync.Mutex
	closed bool
}

func (c *streamConn) Read(b []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	for len(c.pending) == 0 {
		m, err := c.st.Receive()
		if err != nil {
			return 0, err // io.EOF: the sandbox side ended
		}
		c.pending = m.Data
	}
	n := copy(b, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

func (c *streamConn) Write(b []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.closed {
		return 0, net.ErrClosed
	}
	n := 0
	for len(b) > 0 {
		k := min(len(b), chunk)
		if err := c.st.Send(&nodev1.PortData{Data: b[:k]}); err != nil {
			return n, err
		}
		n += k
		b = b[k:]
	}
	return n, nil
}

// CloseWrite ends the request stream: the port's connection is
// half-closed on the sandbox side.
func (c *streamConn) CloseWrite() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	return c.st.CloseRequest()
}

func (c *streamConn) Close() error {
	c.CloseWrite()
	c.cancel()
	return c.st.CloseResponse()
}

type portAddr struct{}

func (portAddr) Network() string { return "dsec-port" }
func (portAddr) String() string  { return "dsec-port" }

func (c *streamConn) LocalAddr() net.Addr                { return portAddr{} }
func (c *streamConn) RemoteAddr() net.Addr               { return portAddr{} }
func (c *streamConn) SetDeadline(t time.Time) error      { return nil }
func (c *streamConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *streamConn) SetWriteDeadline(t time.Time) error { return nil }
