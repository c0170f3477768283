package agent

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// takeWithin is how long an accepted connection waits for the node's
// TakeConn before it is closed.
const takeWithin = 10 * time.Second

// maxPending bounds the accepted connections of one listener the node has
// not taken: a process that opens connections faster than the node takes
// them finds the rest closed, and the agent holds no more descriptors.
const maxPending = 256

// portListeners are the agent's ListenPort listeners and the connections
// they accepted that the node has not taken yet.
type portListeners struct {
	mu      sync.Mutex
	byPort  map[uint32]*portListener
	pending map[string]*pendingConn
}

type portListener struct {
	l       net.Listener
	pending int
}

type pendingConn struct {
	c     net.Conn
	from  *portListener
	timer *time.Timer
}

// serveListenPort listens on m.Port of the sandbox's loopback and
// announces each connection on w until the node's connection c ends.
func (a *Agent) serveListenPort(m *guestv1.ListenPort, c net.Conn, r *guest.Reader, w *guest.Writer) {
	fail := func(err error) { w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(err)}}) }
	if m.Port == 0 || m.Port > 65535 {
		fail(invalid("port %d is not a TCP port", m.Port))
		return
	}
	pl, err := a.ports.listen(m.Port)
	if err != nil {
		fail(err)
		return
	}
	defer a.ports.close(m.Port, pl)
	if err := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Done{Done: &guestv1.Done{}}}); err != nil {
		return
	}
	// The node sends nothing more: its connection's end (a read that
	// fails) ends the listener.
	go func() {
		var discard guestv1.ClientMsg
		for r.Read(&discard) == nil {
		}
		pl.l.Close()
	}()
	for {
		tc, err := pl.l.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			return
		}
		id, ok := a.ports.hold(pl, tc)
		if !ok {
			tc.Close()
			continue
		}
		if err := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Accepted{Accepted: &guestv1.Accepted{Id: id}}}); err != nil {
			return
		}
	}
}

// serveTakeConn relays an accepted connection over the node's connection
// c once it answered Done.
func (a *Agent) serveTakeConn(m *guestv1.TakeConn, c net.Conn, r *guest.Reader, w *guest.Writer) {
	tc := a.ports.take(m.Id)
	if tc == nil {
		w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Error{Error: guest.ToWire(notFound("no accepted connection %q waits", m.Id))}})
		return
	}
	defer tc.Close()
	if err := w.Write(&guestv1.ServerMsg{Msg: &guestv1.ServerMsg_Done{Done: &guestv1.Done{}}}); err != nil {
		return
	}
	splice(c, r.Raw(), tc)
}

// listen opens port's listener on 127.0.0.1, replacing the one of an
// earlier call.
func (p *portListeners) listen(port uint32) (*portListener, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byPort == nil {
		p.byPort = map[uint32]*portListener{}
		p.pending = map[string]*pendingConn{}
	}
	if old := p.byPort[port]; old != nil {
		old.l.Close()
		p.dropLocked(old)
		delete(p.byPort, port)
	}
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
	if err != nil {
		// Taken by a process of the sandbox, most likely: its own doing.
		return nil, &codedError{guest.CodeExists, fmt.Sprintf("listen on port %d in the sandbox: %v", port, unwrapOp(err))}
	}
	pl := &portListener{l: l}
	p.byPort[port] = pl
	return pl, nil
}

// close ends pl and the connections it accepted that wait.
func (p *portListeners) close(port uint32, pl *portListener) {
	pl.l.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byPort[port] == pl {
		delete(p.byPort, port)
	}
	p.dropLocked(pl)
}

func (p *portListeners) dropLocked(pl *portListener) {
	for id, pc := range p.pending {
		if pc.from == pl {
			pc.timer.Stop()
			pc.c.Close()
			delete(p.pending, id)
		}
	}
	pl.pending = 0
}

// hold keeps c for the node to take, under a fresh ID, for takeWithin.
func (p *portListeners) hold(pl *portListener, c net.Conn) (string, bool) {
	var b [12]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl.pending >= maxPending {
		return "", false
	}
	pl.pending++
	pc := &pendingConn{c: c, from: pl}
	pc.timer = time.AfterFunc(takeWithin, func() {
		if c := p.take(id); c != nil {
			c.Close()
		}
	})
	p.pending[id] = pc
	return id, true
}

// take removes and returns the connection held under id (nil if none).
func (p *portListeners) take(id string) net.Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	pc := p.pending[id]
	if pc == nil {
		return nil
	}
	delete(p.pending, id)
	pc.timer.Stop()
	pc.from.pending--
	return pc.c
}
