package node

import (
	"context"
	"net"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/substrate"
)

// DialPort connects to TCP port of sandbox id, on the sandbox's loopback
// interface, through its agent (so a sandbox without network is reached
// too), and returns the connection. ctx bounds the connect only. A paused
// sandbox is resumed first, as by any call. Nothing listening on the port
// is a not_found error, as is an unknown or deleted sandbox (the message
// says which). Traffic on the connection keeps the sandbox active for its
// idle TTL. Port traffic is not recorded in the trajectory log.
func (n *Node) DialPort(ctx context.Context, id string, port uint32) (net.Conn, error) {
	if port == 0 || port > 65535 {
		return nil, errdefs.Invalid("port %d is not a TCP port", port)
	}
	s, err := n.live(ctx, id)
	if err != nil {
		return nil, err
	}
	main, err := s.ctrOf("")
	if err != nil {
		return nil, err
	}
	// Sidecars share the main container's network namespace: its agent
	// reaches their ports too.
	pg, err := guestCan[substrate.PortGuest](main, "cannot reach its ports")
	if err != nil {
		return nil, err
	}
	c, err := pg.DialPort(ctx, port)
	if err != nil {
		return nil, n.callFailed(s, err)
	}
	return &activeConn{Conn: c, s: s}, nil
}

// activeConn touches its sandbox's idle timer on every read and write.
type activeConn struct {
	net.Conn
	s *sandbox
}

func (c *activeConn) Read(b []byte) (int, error) {
	c.s.touch()
	return c.Conn.Read(b)
}

func (c *activeConn) Write(b []byte) (int, error) {
	c.s.touch()
	return c.Conn.Write(b)
}

// CloseWrite half-closes where the connection can, else closes it.
func (c *activeConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// DialPort is Node.DialPort with the node's errors as Connect errors, as
// the Service's other verbs.
func (s *Service) DialPort(ctx context.Context, id string, port uint32) (net.Conn, error) {
	c, err := s.n.DialPort(ctx, id, port)
	if err != nil {
		return nil, errwire.ToConnect(err)
	}
	return c, nil
}
