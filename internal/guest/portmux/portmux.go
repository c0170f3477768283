// Package portmux carries the guest protocol's many connections over one
// byte stream, such as a virtio-serial port between a VM's agent and the
// node. The node side is a Dialer (each Dial is one new stream, as
// guest.DialFunc expects); the guest side is a net.Listener the agent
// serves.
//
// Streams are multiplexed with yamux. Because a serial port outlives the
// connections over it (the node restarts; a restored VM has bytes of an
// older session in flight), every session starts with a handshake: the
// node sends a sync line with a fresh nonce, the guest discards whatever
// precedes it and answers with an ack line carrying the nonce, and the node
// discards whatever precedes that ack. Only then does yamux start.
package portmux

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

const (
	syncPrefix = "\nDSEC-PORTMUX-SYNC "
	ackPrefix  = "\nDSEC-PORTMUX-ACK "
	// maxGarbage bounds what either side skips while looking for the
	// handshake line.
	maxGarbage = 16 << 20
)

func config() *yamux.Config {
	c := yamux.DefaultConfig()
	// No keepalives: an idle or stopped VM costs no CPU and does not lose
	// its session; a broken transport is found by the next call.
	c.EnableKeepAlive = false
	c.ConnectionWriteTimeout = 2 * time.Minute
	// Callers bound stream opens with their context.
	c.StreamOpenTimeout = 0
	c.StreamCloseTimeout = time.Minute
	c.MaxStreamWindowSize = 1 << 20
	c.LogOutput = io.Discard
	return c
}

// ConnectFunc opens the raw byte stream to the guest's port (for QEMU, the
// unix socket of the port's chardev).
type ConnectFunc func(ctx context.Context) (net.Conn, error)

// Dialer is the node side. It keeps one session and re-establishes it when
// it breaks. It is safe for concurrent use.
type Dialer struct {
	connect ConnectFunc
	// HandshakeTimeout bounds one handshake attempt (default 5s); Dial
	// retries with new connections until its context ends.
	HandshakeTimeout time.Duration

	mu     sync.Mutex
	sess   *yamux.Session
	closed bool
}

// NewDialer returns a Dialer that reaches the port with connect.
func NewDialer(connect ConnectFunc) *Dialer {
	return &Dialer{connect: connect, HandshakeTimeout: 5 * time.Second}
}

// ErrClosed is returned by Dial after Close.
var ErrClosed = errors.New("portmux: dialer closed")

// Dial opens a new stream to the guest's listener.
func (d *Dialer) Dial(ctx context.Context) (net.Conn, error) {
	for {
		sess, err := d.session(ctx)
		if err != nil {
			return nil, err
		}
		type res struct {
			c   net.Conn
			err error
		}
		ch := make(chan res, 1)
		go func() {
			c, err := sess.OpenStream()
			ch <- res{c, err}
		}()
		select {
		case r := <-ch:
			if r.err == nil {
				return r.c, nil
			}
			d.drop(sess)
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
		case <-ctx.Done():
			go func() {
				if r := <-ch; r.c != nil {
					r.c.Close()
				}
			}()
			return nil, ctx.Err()
		}
	}
}

// session returns the live session, establishing one if needed.
func (d *Dialer) session(ctx context.Context) (*yamux.Session, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	if d.sess != nil && !d.sess.IsClosed() {
		return d.sess, nil
	}
	d.sess = nil
	var last error
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			if last != nil {
				return nil, fmt.Errorf("%w (last attempt: %v)", err, last)
			}
			return nil, err
		}
		if attempt > 0 {
			select {
			case <-time.After(min(time.Duration(attempt)*20*time.Millisecond, 500*time.Millisecond)):
			case <-ctx.Done():
				continue
			}
		}
		c, err := d.connect(ctx)
		if err != nil {
			last = err
			continue
		}
		br, err := handshake(ctx, c, d.HandshakeTimeout)
		if err != nil {
			c.Close()
			last = err
			continue
		}
		sess, err := yamux.Client(&bufConn{Conn: c, r: br}, config())
		if err != nil {
			c.Close()
			return nil, err
		}
		d.sess = sess
		return sess, nil
	}
}

func (d *Dialer) drop(sess *yamux.Session) {
	d.mu.Lock()
	if d.sess == sess {
		d.sess = nil
	}
	d.mu.Unlock()
	sess.Close()
}

// Close ends the session; streams open on it fail.
func (d *Dialer) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	if d.sess != nil {
		d.sess.Close()
		d.sess = nil
	}
	return nil
}

// handshake sends a sync line and waits for its ack; it returns a reader
// positioned after the ack.
func handshake(ctx context.Context, c net.Conn, timeout time.Duration) (*bufio.Reader, error) {
	var b [8]byte
	rand.Read(b[:])
	nonce := hex.EncodeToString(b[:])
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	c.SetDeadline(deadline)
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, syncPrefix+nonce+"\n"); err != nil {
		return nil, fmt.Errorf("portmux: send sync: %w", err)
	}
	br := bufio.NewReaderSize(c, 64<<10)
	if err := scanFor(br, []byte(ackPrefix+nonce+"\n")); err != nil {
		return nil, fmt.Errorf("portmux: wait for ack: %w", err)
	}
	return br, nil
}

// scanFor consumes r up to and including the first occurrence of line.
func scanFor(r io.ByteReader, line []byte) error {
	matched, skipped := 0, 0
	for {
		c, err := r.ReadByte()
		if err != nil {
			return err
		}
		switch {
		case c == line[matched]:
			matched++
			if matched == len(line) {
				return nil
			}
		case c == line[0]:
			matched = 1
		default:
			matched = 0
		}
		if skipped++; skipped > maxGarbage {
			return errors.New("no handshake line in the stream")
		}
	}
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil
}

// bufConn is a conn whose reads drain a bufio.Reader first.
type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// Port is the guest's end of the byte stream: a virtio-serial port device.
// A read returning io.EOF means the node is not connected (yet).
type Port interface {
	io.ReadWriter
}

// Listener is the guest side: it serves sessions on a port one after the
// other, for the life of the agent, and hands their streams to Accept.
type Listener struct {
	port  Port
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	// idle is how long the listener waits after the node went away
	// before it reads the port again.
	idle time.Duration
}

// Listen starts serving sessions on port.
func Listen(port Port) *Listener { return listen(port, 100*time.Millisecond) }

func listen(port Port, idle time.Duration) *Listener {
	l := &Listener{port: port, conns: make(chan net.Conn), done: make(chan struct{}), idle: idle}
	go l.run()
	return l
}

// Accept returns the next stream the node opened.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting. The port stays open (it belongs to the caller).
func (l *Listener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

// Addr implements net.Listener.
func (l *Listener) Addr() net.Addr { return portAddr{} }

type portAddr struct{}

func (portAddr) Network() string { return "portmux" }
func (portAddr) String() string  { return "virtio-serial" }

// run is the one reader of the port: it finds a sync line, answers it,
// and feeds the port into a yamux session until the session or the node
// goes away; then it looks for the next sync line.
func (l *Listener) run() {
	pending := []byte(nil) // bytes read but not consumed
	buf := make([]byte, 64<<10)
	read := func() ([]byte, error) {
		if len(pending) > 0 {
			p := pending
			pending = nil
			return p, nil
		}
		n, err := l.port.Read(buf)
		if n > 0 {
			return buf[:n], nil
		}
		if err == nil {
			err = io.ErrNoProgress
		}
		return nil, err
	}
	for {
		select {
		case <-l.done:
			return
		default:
		}
		// Scan for a sync line.
		var scan bytes.Buffer
		nonce := ""
		for nonce == "" {
			p, err := read()
			if err != nil {
				// The node is not connected: a serial port reads EOF.
				time.Sleep(l.idle)
				scan.Reset()
				continue
			}
			scan.Write(p)
			n, rest, ok := findSync(scan.Bytes())
			if ok {
				nonce = n
				pending = append([]byte(nil), rest...)
			} else if scan.Len() > 1<<20 {
				// Keep only a tail that could start a sync line.
				tail := append([]byte(nil), scan.Bytes()[scan.Len()-64:]...)
				scan.Reset()
				scan.Write(tail)
			}
		}
		if _, err := io.WriteString(l.port, ackPrefix+nonce+"\n"); err != nil {
			time.Sleep(l.idle)
			continue
		}
		pr, pw := io.Pipe()
		sess, err := yamux.Server(&portConn{r: pr, w: l.port}, config())
		if err != nil {
			continue
		}
		go l.accept(sess)
		// Pump the port into the session until either ends.
		for {
			p, err := read()
			if err != nil {
				pw.CloseWithError(io.EOF)
				break
			}
			if n, err := pw.Write(p); err != nil {
				// The session ended (protocol error or closed): what is
				// left of this chunk may hold the next sync line.
				pending = append([]byte(nil), p[n:]...)
				break
			}
		}
		sess.Close()
	}
}

func (l *Listener) accept(sess *yamux.Session) {
	for {
		c, err := sess.Accept()
		if err != nil {
			return
		}
		select {
		case l.conns <- c:
		case <-l.done:
			c.Close()
			return
		}
	}
}

// findSync finds a complete sync line in b and returns its nonce and the
// bytes after it.
func findSync(b []byte) (nonce string, rest []byte, ok bool) {
	for {
		i := bytes.Index(b, []byte(syncPrefix))
		if i < 0 {
			return "", nil, false
		}
		after := b[i+len(syncPrefix):]
		j := bytes.IndexByte(after, '\n')
		if j < 0 {
			return "", nil, false
		}
		if n := string(after[:j]); len(n) == 16 && isHex(n) {
			return n, after[j+1:], true
		}
		b = after
	}
}

// portConn is one session's view of the port: reads come from the pump,
// writes go to the port. Closing it does not close the port.
type portConn struct {
	r *io.PipeReader
	w io.Writer
}

func (c *portConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c *portConn) Write(p []byte) (int, error) { return c.w.Write(p) }
func (c *portConn) Close() error                { return c.r.Close() }
