package guest_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
)

// listenFree has the agent listen on a port no one holds (the agent runs
// on the host here, as a sandbox's agent runs in the sandbox).
func listenFree(t *testing.T, ctx context.Context, c *guest.Client) (net.Listener, int) {
	t.Helper()
	for i := 0; ; i++ {
		probe, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := probe.Addr().(*net.TCPAddr).Port
		probe.Close()
		l, err := c.Listen(ctx, uint32(port))
		if err == nil {
			return l, port
		}
		if !errdefs.Is(err, errdefs.KindConflict) || i == 10 {
			t.Fatal(err)
		}
	}
}

func TestListen(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	t.Run("connections to the port reach the node, both ways", func(t *testing.T) {
		l, port := listenFree(t, ctx, c)
		defer l.Close()
		go func() {
			for {
				s, err := l.Accept()
				if err != nil {
					return
				}
				go func() { defer s.Close(); io.Copy(s, s) }()
			}
		}()
		for i := 0; i < 3; i++ {
			conn, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
			if err != nil {
				t.Fatal(err)
			}
			msg := "ping " + strconv.Itoa(i)
			conn.Write([]byte(msg))
			conn.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(conn)
			conn.Close()
			if err != nil || string(got) != msg {
				t.Fatalf("echo %q, %v", got, err)
			}
		}
	})

	t.Run("a second listener on the port replaces the first", func(t *testing.T) {
		first, port := listenFree(t, ctx, c)
		done := make(chan error, 1)
		go func() { _, err := first.Accept(); done <- err }()
		second, err := c.Listen(ctx, uint32(port))
		if err != nil {
			t.Fatal(err)
		}
		defer second.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Fatalf("the first listener's Accept: %v", err)
		}
	})

	t.Run("once Close returns the port in the sandbox is free", func(t *testing.T) {
		l, port := listenFree(t, ctx, c)
		l.Close()
		if conn, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
			conn.Close()
			t.Fatal("the port still accepts connections")
		}
		// And a process of the sandbox may take it.
		held, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			t.Fatalf("the port is not free: %v", err)
		}
		held.Close()
	})

	t.Run("a port a process holds is a conflict", func(t *testing.T) {
		held, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer held.Close()
		_, err = c.Listen(ctx, uint32(held.Addr().(*net.TCPAddr).Port))
		if !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("listen on a held port: %v", err)
		}
	})
}
