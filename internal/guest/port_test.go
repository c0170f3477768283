package guest_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
)

func TestDialPort(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	t.Run("bytes flow both ways and each side's end reaches the other", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		served := make(chan string, 1)
		go func() {
			s, err := l.Accept()
			if err != nil {
				return
			}
			defer s.Close()
			// A greeting before the client says anything: it may arrive
			// with the agent's answer.
			s.Write([]byte("hello\n"))
			got, _ := io.ReadAll(s) // until the client's half-close
			s.Write([]byte("got " + string(got)))
			served <- string(got)
		}()
		conn, err := c.DialPort(ctx, uint32(l.Addr().(*net.TCPAddr).Port))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		if line, err := r.ReadString('\n'); err != nil || line != "hello\n" {
			t.Fatalf("greeting %q, %v", line, err)
		}
		big := strings.Repeat("x", 1<<20)
		if _, err := conn.Write([]byte(big)); err != nil {
			t.Fatal(err)
		}
		if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		rest, err := io.ReadAll(r)
		if err != nil || string(rest) != "got "+big {
			t.Fatalf("answer of %d bytes, %v", len(rest), err)
		}
		if got := <-served; got != big {
			t.Fatalf("the server got %d bytes", len(got))
		}
	})

	t.Run("a port nobody listens on is not found", func(t *testing.T) {
		l, _ := net.Listen("tcp", "127.0.0.1:0")
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if _, err := c.DialPort(ctx, uint32(port)); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("got %v, want not_found", err)
		}
	})

	t.Run("a server on the IPv6 loopback only is reached", func(t *testing.T) {
		l, err := net.Listen("tcp", "[::1]:0")
		if err != nil {
			t.Skipf("no IPv6 loopback here: %v", err)
		}
		defer l.Close()
		go func() {
			if s, err := l.Accept(); err == nil {
				s.Write([]byte("six"))
				s.Close()
			}
		}()
		conn, err := c.DialPort(ctx, uint32(l.Addr().(*net.TCPAddr).Port))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if b, err := io.ReadAll(conn); err != nil || string(b) != "six" {
			t.Fatalf("%q, %v", b, err)
		}
	})

	t.Run("port 0 is refused", func(t *testing.T) {
		if _, err := c.DialPort(ctx, 0); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("got %v, want invalid", err)
		}
	})
}
