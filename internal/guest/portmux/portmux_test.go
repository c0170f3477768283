package portmux

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// serialPort imitates a virtio-serial port: one host connection at a time;
// reads return io.EOF while no host is connected.
type serialPort struct {
	mu   sync.Mutex
	host net.Conn // the guest's end of the current host connection
}

func (p *serialPort) current() net.Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.host
}

func (p *serialPort) Read(b []byte) (int, error) {
	c := p.current()
	if c == nil {
		return 0, io.EOF
	}
	n, err := c.Read(b)
	if err != nil {
		p.mu.Lock()
		if p.host == c {
			p.host = nil
		}
		p.mu.Unlock()
		return n, io.EOF
	}
	return n, nil
}

func (p *serialPort) Write(b []byte) (int, error) {
	c := p.current()
	if c == nil {
		return len(b), nil // dropped, as QEMU drops output with no client
	}
	return c.Write(b)
}

// connect plugs a new host connection in, after writing garbage the guest
// must skip.
func (p *serialPort) connect(ctx context.Context) (net.Conn, error) {
	h, g := net.Pipe()
	p.mu.Lock()
	if p.host != nil {
		p.host.Close()
	}
	p.host = g
	p.mu.Unlock()
	go g.Write([]byte("stale bytes of an earlier session\x00\x01\x02"))
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
	port := &serialPort{}
	l := listen(port, time.Millisecond)
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
		time.Sleep(10 * time.Millisecond)
		roundTrip(t, d, "after the break")
	})

	t.Run("a second dialer (a restarted node) takes over the port", func(t *testing.T) {
		d2 := NewDialer(port.connect)
		defer d2.Close()
		roundTrip(t, d2, "from the new node")
	})
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

func TestFindSyncSkipsMalformedLines(t *testing.T) {
	in := []byte("junk" + syncPrefix + "nothex!!nothex!!\n" + syncPrefix + "0123456789abcdef\nrest")
	n, rest, ok := findSync(in)
	if !ok || n != "0123456789abcdef" || string(rest) != "rest" {
		t.Fatalf("%q %q %v", n, rest, ok)
	}
}
