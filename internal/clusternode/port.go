package clusternode

import (
	"context"
	"errors"
	"io"

	"connectrpc.com/connect"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// portChunk is the most data one PortData message carries.
const portChunk = 64 << 10

// ConnectPort relays a TCP connection to a port of one of the node's
// sandboxes (see the proto): the request stream's data goes to the port,
// the port's to the response stream, until the port's side ends.
func (a *Agent) ConnectPort(ctx context.Context, st *connect.BidiStream[nodev1.PortData, nodev1.PortData]) error {
	first, err := st.Receive()
	if err != nil {
		return errwire.ToConnect(errdefs.Invalid("ConnectPort needs a first message naming the sandbox and port"))
	}
	c, err := a.n.DialPort(ctx, first.SandboxId, first.Port)
	if err != nil {
		return errwire.ToConnect(err)
	}
	defer c.Close()
	if err := st.Send(&nodev1.PortData{}); err != nil {
		return nil
	}
	go func() {
		for {
			m, err := st.Receive()
			if errors.Is(err, io.EOF) {
				if cw, ok := c.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite()
				}
				return
			}
			if err != nil {
				c.Close()
				return
			}
			if _, err := c.Write(m.Data); err != nil {
				c.Close()
				return
			}
		}
	}()
	buf := make([]byte, portChunk)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if serr := st.Send(&nodev1.PortData{Data: buf[:n]}); serr != nil {
				return nil
			}
		}
		if err != nil {
			return nil // the port's side ended: so does the response stream
		}
	}
}
