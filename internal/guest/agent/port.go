package agent

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"syscall"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// dialPortTimeout bounds the connect to a port of the sandbox: a loopback
// connect answers at once unless the listener's backlog is full.
const dialPortTimeout = 10 * time.Second

// serveDialPort connects to a port of the sandbox's loopback and, once it
// answered Done, relays bytes between the node's connection c and the port
// until both directions ended. r is c's message reader: bytes it buffered
// beyond the call belong to the stream.
func serveDialPort(m *guestv1.DialPort, c net.Conn, r *guest.Reader, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	if m.Port == 0 || m.Port > 65535 {
		fail(invalid("port %d is not a TCP port", m.Port))
		return
	}
	tc, err := dialLoopback(int(m.Port))
	if err != nil {
		fail(err)
		return
	}
	defer tc.Close()
	if err := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Done{Done: &guestv1.Done{}}}); err != nil {
		return
	}
	splice(c, r.Raw(), tc)
}

// dialLoopback connects to port on 127.0.0.1, else on ::1 (a server that
// listens on "localhost" may have only the IPv6 one).
func dialLoopback(port int) (net.Conn, error) {
	var first error
	for _, host := range []string{"127.0.0.1", "::1"} {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(host, strconv.Itoa(port)), dialPortTimeout)
		if err == nil {
			return c, nil
		}
		if first == nil {
			first = err
		}
		if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.EADDRNOTAVAIL) && !errors.Is(err, syscall.ENETUNREACH) {
			break
		}
	}
	if errors.Is(first, syscall.ECONNREFUSED) {
		return nil, notFound("nothing listens on port %d in the sandbox", port)
	}
	return nil, fmt.Errorf("connect to port %d in the sandbox: %v", port, unwrapOp(first))
}

// unwrapOp drops net.OpError's addresses: the message names the port.
func unwrapOp(err error) error {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err
	}
	return err
}

// closeWriter is a connection that can end its sending direction alone.
type closeWriter interface{ CloseWrite() error }

// splice copies from (c's incoming bytes) to tc and tc to c until both
// directions ended: the end of one direction is passed on as a half-close
// where the connection can (TCP, unix sockets), else as the end of c. A
// failed write ends both.
func splice(c net.Conn, from io.Reader, tc net.Conn) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := io.Copy(tc, from); err != nil {
			tc.Close()
			c.Close()
			return
		}
		if cw, ok := tc.(closeWriter); ok {
			cw.CloseWrite()
		}
	}()
	if _, err := io.Copy(c, tc); err != nil {
		tc.Close()
	}
	if cw, ok := c.(closeWriter); ok {
		cw.CloseWrite()
	} else {
		c.Close()
	}
	<-done
}
