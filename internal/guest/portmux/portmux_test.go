package portmux

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// serialPort imitates a virtio-serial port: one device the guest reads,
// fed by whichever host connection is plugged in; reads return io.EOF
// while none is.
type serialPort struct {
	mu   sync.Mutex
	host net.Conn // the guest's end of the current host connection
	data chan []byte
	left []byte
}

func newSerialPort() *serialPort { return &serialPort{data: make(chan []byte, 64)} }

func (p *serialPort) current() net.Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.host
}

func (p *serialPort) Read(b []byte) (int, error) {
	for {
		if len(p.left) > 0 {
			n := copy(b, p.left)
			p.left = p.left[n:]
			return n, nil
		}
		select {
		case d := <-p.data:
			p.left = d
			continue
		case <-time.After(5 * time.Millisecond):
		}
		if p.current() == nil {
			return 0, io.EOF
		}
	}
}

func (p *serialPort) Write(b []byte) (int, error) {
	c := p.current()
	if c == nil {
		return len(b), nil // dropped, as QEMU drops output with no client
	}
	return c.Write(b)
}

// plug makes g the port's host connection and feeds what it sends.
func (p *serialPort) plug(g net.Conn) {
	p.mu.Lock()
	p.host = g
	p.mu.Unlock()
	go func() {
		for {
			buf := make([]byte, 4096)
			n, err := g.Read(buf)
			if err != nil {
				p.mu.Lock()
				if p.host == g {
					p.host = nil
				}
				p.mu.Unlock()
				return
			}
			p.data <- buf[:n]
		}
	}()
}

// connect plugs a new host connection in (closing the old one), after
// writing garbage the guest must skip.
func (p *serialPort) connect(ctx context.Context) (net.Conn, error) {
	h, g := net.Pipe()
	if old := p.current(); old != nil {
		old.Close()
	}
	p.data <- []byte("stale bytes of an earlier session\x00\x01\x02")
	p.plug(g)
	return h, nil
}

func echoServer(t *testing.T, l net.Listener) {
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
}

func roundTrip(t *testing.T, d *Dialer, msg string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, msg); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
		t.Fatalf("echo %q: %q %v", msg, buf, err)
	}
}

func TestStreamsShareOnePortAndSurviveReconnects(t *testing.T) {
	port := newSerialPort()
	l := listen(port, time.Millisecond, nil)
	defer l.Close()
	echoServer(t, l)
	d := NewDialer(port.connect)
	defer d.Close()

	t.Run("concurrent streams each get their own answers", func(t *testing.T) {
		var wg sync.WaitGroup
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				roundTrip(t, d, string(rune('a'+i))+"-hello")
			}(i)
		}
		wg.Wait()
	})

	t.Run("a broken transport is re-established by the next dial", func(t *testing.T) {
		port.current().Close()
		time.Sleep(20 * time.Millisecond)
		roundTrip(t, d, "after the break")
	})

	t.Run("a second dialer (a restarted node) takes over the port", func(t *testing.T) {
		d2 := NewDialer(port.connect)
		defer d2.Close()
		roundTrip(t, d2, "from the new node")
	})
}

func TestTheStartPayloadReachesTheGuestBeforeAnyStream(t *testing.T) {
	port := newSerialPort()
	got := make(chan string, 4)
	l := listen(port, time.Millisecond, func(p []byte) { got <- string(p) })
	defer l.Close()
	echoServer(t, l)
	d := NewDialer(port.connect)
	d.Payload = func() []byte { return []byte("clock and seed") }
	defer d.Close()
	roundTrip(t, d, "x")
	select {
	case p := <-got:
		if p != "clock and seed" {
			t.Fatalf("payload %q", p)
		}
	default:
		t.Fatal("no payload before the first stream")
	}
}

func TestDialEndsWithItsContextWhenNoGuestAnswers(t *testing.T) {
	d := NewDialer(func(ctx context.Context) (net.Conn, error) {
		h, g := net.Pipe()
		go io.Copy(io.Discard, g) // a port nobody serves
		return h, nil
	})
	d.HandshakeTimeout = 50 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := d.Dial(ctx); err == nil {
		t.Fatal("dial succeeded with no guest")
	}
}

func TestFindLineSkipsMalformedLines(t *testing.T) {
	in := []byte("junk" + syncPrefix + "nothex!!nothex!!\n" + startPrefix + "0123456789abcdef 6869\nrest")
	k, n, p, rest, ok := findLine(in)
	if !ok || k != startPrefix || n != "0123456789abcdef" || string(p) != "hi" || string(rest) != "rest" {
		t.Fatalf("%q %q %q %q %v", k, n, p, rest, ok)
	}
}

// TestAStaleSessionInTheGuestIsReplaced is a VM restored from a snapshot:
// its agent still serves the session of the node that took the snapshot,
// and a new node must get through.
func TestAStaleSessionInTheGuestIsReplaced(t *testing.T) {
	port := newSerialPort()
	l := listen(port, time.Millisecond, nil)
	defer l.Close()
	echoServer(t, l)
	old := NewDialer(port.connect)
	roundTrip(t, old, "before the snapshot")
	// The restored VM: same guest state, a new host connection plugged in
	// without the guest seeing the old one go.
	d := NewDialer(func(ctx context.Context) (net.Conn, error) {
		h, g := net.Pipe()
		port.plug(g)
		return h, nil
	})
	defer d.Close()
	start := time.Now()
	roundTrip(t, d, "after the restore")
	if time.Since(start) > 5*time.Second {
		t.Logf("slow: %v", time.Since(start))
	}
}
