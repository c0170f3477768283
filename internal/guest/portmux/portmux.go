// Package portmux carries the guest protocol's many connections over one
// byte stream, such as a virtio-serial port between a VM's agent and the
// node. The node side is a Dialer (each Dial is one new stream, as
// guest.DialFunc expects); the guest side is a net.Listener the agent
// serves.
//
// Streams are multiplexed with yamux. Because a serial port outlives the
// connections over it (the node restarts; a VM restored from a snapshot
// still runs the session of the node that snapshotted it), every session
// starts with a handshake, each line carrying the node's fresh nonce:
//
//	node:  SYNC n (repeated every 20 ms until answered)
//	guest: ACK n                (to the first SYNC n it sees)
//	node:  START n [payload]    (yamux follows)
//	guest: READY n              (yamux follows)
//
// Each side discards whatever precedes the line it waits for, so stale
// bytes of an older session in either direction are skipped. A stale
// session in the guest eats the first SYNC (it is not a yamux frame, so
// that session fails and the guest looks for a handshake again); the
// repetition makes the next one land. The start line may carry a small
// payload from the node (Dialer.Payload), which the guest takes before it
// answers (Listener's onStart): a VM uses it to set its clock and seed its
// randomness from the node at every new session, restores included.
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
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

const (
	syncPrefix  = "\nDSEC-PORTMUX-SYNC "
	ackPrefix   = "\nDSEC-PORTMUX-ACK "
	startPrefix = "\nDSEC-PORTMUX-START "
	readyPrefix = "\nDSEC-PORTMUX-READY "
	// syncEvery is how often the node repeats its sync line.
	syncEvery = 20 * time.Millisecond
	// maxPayload bounds the start line's payload.
	maxPayload = 1024
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
	// HandshakeTimeout bounds the first handshake attempt (default
	// 250ms); each retry, on a new connection, doubles it up to 5s. A sync
	// line that lands in a guest still serving an older session (a VM
	// just restored from a snapshot) is eaten by that session, which
	// fails and makes the guest look for the next one: the first attempt
	// is kept short so that costs little.
	HandshakeTimeout time.Duration
	// Payload, if set, is called at each handshake for the bytes the
	// start line carries (at most 1 KiB).
	Payload func() []byte

	mu     sync.Mutex
	sess   *yamux.Session
	closed bool
}

// NewDialer returns a Dialer that reaches the port with connect.
func NewDialer(connect ConnectFunc) *Dialer {
	return &Dialer{connect: connect, HandshakeTimeout: 250 * time.Millisecond}
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
		timeout := d.HandshakeTimeout << min(attempt, 5)
		var payload []byte
		if d.Payload != nil {
			payload = d.Payload()
		}
		br, err := handshake(ctx, c, min(timeout, max(d.HandshakeTimeout, 5*time.Second)), payload)
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

// handshake runs the node's side of the handshake on c and returns a
// reader positioned where the guest's yamux stream starts.
func handshake(ctx context.Context, c net.Conn, timeout time.Duration, payload []byte) (*bufio.Reader, error) {
	if len(payload) > maxPayload {
		return nil, errors.New("portmux: payload too large")
	}
	var b [8]byte
	rand.Read(b[:])
	nonce := hex.EncodeToString(b[:])
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	c.SetDeadline(deadline)
	defer c.SetDeadline(time.Time{})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(syncEvery)
		defer t.Stop()
		for {
			if _, err := io.WriteString(c, syncPrefix+nonce+"\n"); err != nil {
				return
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	br := bufio.NewReaderSize(c, 64<<10)
	err := scanFor(br, []byte(ackPrefix+nonce+"\n"))
	close(stop)
	wg.Wait()
	if err != nil {
		return nil, fmt.Errorf("portmux: wait for ack: %w", err)
	}
	start := startPrefix + nonce
	if len(payload) > 0 {
		start += " " + hex.EncodeToString(payload)
	}
	if _, err := io.WriteString(c, start+"\n"); err != nil {
		return nil, fmt.Errorf("portmux: send start: %w", err)
	}
	if err := scanFor(br, []byte(readyPrefix+nonce+"\n")); err != nil {
		return nil, fmt.Errorf("portmux: wait for ready: %w", err)
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
	port    Port
	onStart func(payload []byte)
	conns   chan net.Conn
	done    chan struct{}
	once    sync.Once
	// idle is the longest the listener waits, once the node has gone
	// away, before it reads the port again (it starts at a hundredth of
	// it and doubles, so a node that reconnects at once is answered at
	// once and an absent node costs a wakeup per idle).
	idle time.Duration
}

// Listen starts serving sessions on port. onStart, if not nil, receives
// each session's start payload before the session serves any stream.
func Listen(port Port, onStart func(payload []byte)) *Listener {
	return listen(port, 500*time.Millisecond, onStart)
}

func listen(port Port, idle time.Duration, onStart func([]byte)) *Listener {
	l := &Listener{port: port, onStart: onStart, conns: make(chan net.Conn), done: make(chan struct{}), idle: idle}
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
		// Find a sync line, answer it, and wait for its start line
		// (answering a newer sync instead, should the node start over).
		var scan bytes.Buffer
		nonce := ""
		started := false
		var payload []byte
		wait := l.idle / 100
		for !started {
			p, err := read()
			if err != nil {
				// The node is not connected: a serial port reads EOF.
				time.Sleep(wait)
				wait = min(wait*2, l.idle)
				scan.Reset()
				nonce = ""
				continue
			}
			wait = l.idle / 100
			scan.Write(p)
			for {
				kind, n, p, rest, ok := findLine(scan.Bytes())
				if !ok {
					break
				}
				switch {
				case kind == syncPrefix && n != nonce:
					nonce = n
					io.WriteString(l.port, ackPrefix+nonce+"\n")
				case kind == startPrefix && n == nonce:
					started, payload = true, p
				}
				rest = append([]byte(nil), rest...)
				scan.Reset()
				scan.Write(rest)
				if started {
					break
				}
			}
			if !started && scan.Len() > 1<<20 {
				// Keep only a tail that could start a line.
				tail := append([]byte(nil), scan.Bytes()[scan.Len()-64:]...)
				scan.Reset()
				scan.Write(tail)
			}
		}
		pending = append([]byte(nil), scan.Bytes()...)
		if l.onStart != nil {
			l.onStart(payload)
		}
		if _, err := io.WriteString(l.port, readyPrefix+nonce+"\n"); err != nil {
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

// findLine finds the first complete sync or start line in b and returns
// its kind (prefix), nonce, payload (start lines) and the bytes after it.
func findLine(b []byte) (kind, nonce string, payload, rest []byte, ok bool) {
	for {
		i, k := bytes.Index(b, []byte(syncPrefix)), syncPrefix
		if j := bytes.Index(b, []byte(startPrefix)); j >= 0 && (i < 0 || j < i) {
			i, k = j, startPrefix
		}
		if i < 0 {
			return "", "", nil, nil, false
		}
		after := b[i+len(k):]
		j := bytes.IndexByte(after, '\n')
		if j < 0 {
			if len(after) > 2*maxPayload+64 {
				b = after // a line that long is not ours
				continue
			}
			return "", "", nil, nil, false
		}
		n, p, _ := strings.Cut(string(after[:j]), " ")
		if len(n) == 16 && isHex(n) {
			if pb, err := hex.DecodeString(p); err == nil && len(pb) <= maxPayload {
				return k, n, pb, after[j+1:], true
			}
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
