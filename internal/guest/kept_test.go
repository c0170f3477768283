package guest_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
)

// dials counts the connections a client opens and how many are open.
type dials struct {
	path  string
	made  atomic.Int32
	open  atomic.Int32
	older bool // make the agent answer as one that keeps no connection
}

// countedConn is a unix connection whose Close is counted (its descriptor
// stays reachable: the client checks a kept connection through it).
type countedConn struct {
	*net.UnixConn
	d      *dials
	closed atomic.Bool
}

func (c *countedConn) Close() error {
	if !c.closed.Swap(true) {
		c.d.open.Add(-1)
	}
	return c.UnixConn.Close()
}

func (d *dials) dial(ctx context.Context) (net.Conn, error) {
	var nd net.Dialer
	nc, err := nd.DialContext(ctx, "unix", d.path)
	if err != nil {
		return nil, err
	}
	d.made.Add(1)
	d.open.Add(1)
	c := &countedConn{UnixConn: nc.(*net.UnixConn), d: d}
	if d.older {
		return &olderAgent{countedConn: c}, nil
	}
	return c, nil
}

// olderAgent makes the real agent behave as one of the protocol before
// kept connections: the keep of a Hello is dropped on its way, so the
// agent answers it on a connection of its own and closes.
type olderAgent struct{ *countedConn }

func (o *olderAgent) Write(b []byte) (int, error) {
	m := new(guestv1.ClientMsg)
	if guest.NewReader(bytesReader(b)).Read(m) == nil && m.GetHello().GetKeep() {
		m.GetHello().Keep = false
		return len(b), guest.NewWriter(o.countedConn).Write(m)
	}
	return o.countedConn.Write(b)
}

type byteSlice struct{ b []byte }

func (s *byteSlice) Read(p []byte) (int, error) {
	if len(s.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, s.b)
	s.b = s.b[n:]
	return n, nil
}

func bytesReader(b []byte) io.Reader { return &byteSlice{b} }

// agentAt runs the real agent binary on sock until the test ends (or the
// returned process is killed).
func agentAt(t testing.TB, sock string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(agentBin, "-listen", sock)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	d := &dials{path: sock}
	c := guest.NewClient(d.dial)
	defer c.Close()
	for deadline := time.Now().Add(10 * time.Second); ; {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Hello(ctx)
		cancel()
		if err == nil {
			return cmd
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestCallsShareAKeptConnection(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "g.sock")
	agent := agentAt(t, sock)
	outer := t
	d := &dials{path: sock}
	c := guest.NewClient(d.dial)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	t.Run("calls one after another use one connection", func(t *testing.T) {
		for i := range 50 {
			x := run(t, c, &guestv1.Exec{Argv: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
			if string(x.Stdout) != "out\n" || string(x.Stderr) != "err\n" || x.ExitCode != 3 {
				t.Fatalf("call %d: %q %q %d", i, x.Stdout, x.Stderr, x.ExitCode)
			}
			if _, err := c.Stat(ctx, &guestv1.Path{Path: "/"}); err != nil {
				t.Fatal(err)
			}
			// An answer that is an error leaves the connection usable.
			if _, err := c.Stat(ctx, &guestv1.Path{Path: "/no/such/file"}); !errdefs.Is(err, errdefs.KindNotFound) {
				t.Fatalf("stat of a missing file: %v", err)
			}
		}
		if n := d.made.Load(); n != 1 {
			t.Fatalf("150 calls one after another opened %d connections, want 1", n)
		}
	})

	t.Run("a call does not wait for another", func(t *testing.T) {
		fifo := filepath.Join(t.TempDir(), "fifo")
		if err := syscall.Mkfifo(fifo, 0o600); err != nil {
			t.Fatal(err)
		}
		blocked := make(chan *guestv1.Exit, 1)
		go func() {
			x, err := c.Run(ctx, &guestv1.Exec{Argv: []string{"cat", fifo}})
			if err != nil {
				t.Error(err)
			}
			blocked <- x
		}()
		if x := run(t, c, &guestv1.Exec{Argv: []string{"echo", "beside"}}); string(x.Stdout) != "beside\n" {
			t.Fatalf("got %q", x.Stdout)
		}
		if err := os.WriteFile(fifo, []byte("through\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if x := <-blocked; x == nil || string(x.Stdout) != "through\n" {
			t.Fatalf("the blocked call ended with %v", x)
		}
	})

	t.Run("a caller gone mid-exec does not leave its connection for the next call", func(t *testing.T) {
		dir := t.TempDir()
		up, hold := filepath.Join(dir, "up"), filepath.Join(dir, "hold")
		for _, f := range []string{up, hold} {
			if err := syscall.Mkfifo(f, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		before := d.open.Load() // both kept by the previous subtest
		cctx, ccancel := context.WithCancel(ctx)
		errc := make(chan error, 1)
		go func() {
			_, err := c.Run(cctx, &guestv1.Exec{Argv: []string{"sh", "-c", "echo up > $1; read x < $2", "sh", up, hold}})
			errc <- err
		}()
		if b, err := os.ReadFile(up); err != nil || string(b) != "up\n" {
			t.Fatalf("the command's start: %q %v", b, err)
		}
		ccancel()
		if err := <-errc; !errdefs.Is(err, errdefs.KindCanceled) {
			t.Fatalf("the cancelled call returned %v", err)
		}
		for i := range 3 {
			if x := run(t, c, &guestv1.Exec{Argv: []string{"echo", "next"}}); string(x.Stdout) != "next\n" {
				t.Fatalf("call %d after the cancelled one: %q", i, x.Stdout)
			}
		}
		if n := d.open.Load(); n != before-1 {
			t.Fatalf("%d connections open after a cancelled call on one of %d, want %d", n, before, before-1)
		}
		if err := os.WriteFile(hold, nil, 0o600); err != nil { // ends the command
			t.Fatal(err)
		}
	})

	t.Run("a new agent on the same socket is reached", func(t *testing.T) {
		agent.Process.Kill()
		agent.Wait()
		os.Remove(sock)
		agentAt(outer, sock)
		for i := range 3 {
			if x := run(t, c, &guestv1.Exec{Argv: []string{"echo", "again"}}); string(x.Stdout) != "again\n" {
				t.Fatalf("call %d: %q", i, x.Stdout)
			}
		}
	})

	t.Run("close closes the kept connections", func(t *testing.T) {
		c.Close()
		if n := d.open.Load(); n != 0 {
			t.Fatalf("%d connections open after Close", n)
		}
		if x := run(t, c, &guestv1.Exec{Argv: []string{"true"}}); x.ExitCode != 0 {
			t.Fatalf("a call after Close: exit %d", x.ExitCode)
		}
		if n := d.open.Load(); n != 0 {
			t.Fatalf("a call after Close left %d connections open", n)
		}
	})
}

func TestAnOlderAgentGetsAConnectionPerCall(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "g.sock")
	agentAt(t, sock)
	d := &dials{path: sock, older: true}
	c := guest.NewClient(d.dial)
	defer c.Close()
	for i := range 20 {
		if x := run(t, c, &guestv1.Exec{Argv: []string{"echo", "old"}}); string(x.Stdout) != "old\n" {
			t.Fatalf("call %d: %q", i, x.Stdout)
		}
	}
	if n := d.made.Load(); n != 21 {
		t.Fatalf("20 calls opened %d connections, want 21 (the first asks to keep it)", n)
	}
	if n := d.open.Load(); n != 0 {
		t.Fatalf("%d connections left open", n)
	}
}

// The agent refuses, on a kept connection, the calls whose client sends
// more after them, and goes on serving the connection.
func TestAKeptConnectionRefusesCallsThatNeedTheirOwn(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "g.sock")
	agentAt(t, sock)
	nc, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(30 * time.Second))
	r, w := guest.NewReader(nc), guest.NewWriter(nc)
	ask := func(m *guestv1.ClientMsg) *guestv1.ServerMsg {
		t.Helper()
		if err := w.Write(m); err != nil {
			t.Fatal(err)
		}
		a := new(guestv1.ServerMsg)
		if err := r.Read(a); err != nil {
			t.Fatal(err)
		}
		return a
	}
	if h := ask(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Hello{Hello: &guestv1.Hello{Keep: true}}}).GetHello(); !h.GetKeep() {
		t.Fatalf("the agent did not keep the connection: %v", h)
	}
	for _, m := range []*guestv1.ClientMsg{
		{Msg: &guestv1.ClientMsg_ReadFile{ReadFile: &guestv1.ReadFile{Path: "/etc/hostname"}}},
		{Msg: &guestv1.ClientMsg_WriteFile{WriteFile: &guestv1.WriteFile{Path: filepath.Join(t.TempDir(), "f")}}},
		{Msg: &guestv1.ClientMsg_Exec{Exec: &guestv1.Exec{Argv: []string{"cat"}, Collect: true, StdinOpen: true}}},
		{Msg: &guestv1.ClientMsg_Exec{Exec: &guestv1.Exec{Argv: []string{"true"}}}},
		{Msg: &guestv1.ClientMsg_Watch{Watch: &guestv1.Watch{Path: "/"}}},
		{Msg: &guestv1.ClientMsg_DialPort{DialPort: &guestv1.DialPort{Port: 1}}},
	} {
		e := ask(m).GetError()
		if e == nil || e.Code != guest.CodeInvalid {
			t.Fatalf("%T on a kept connection: answered %v", m.Msg, e)
		}
	}
	x := ask(&guestv1.ClientMsg{Msg: &guestv1.ClientMsg_Exec{Exec: &guestv1.Exec{Argv: []string{"echo", "still"}, Collect: true}}})
	for x.GetExit() == nil {
		if x.GetOutput() == nil {
			t.Fatalf("exec answered %v", x)
		}
		a := new(guestv1.ServerMsg)
		if err := r.Read(a); err != nil {
			t.Fatal(err)
		}
		x = a
	}
	if x.GetExit().ExitCode != 0 {
		t.Fatalf("exit %v", x.GetExit())
	}
	// The client's end of the connection ends the agent's side of it.
	nc.(*net.UnixConn).CloseWrite()
	if err := r.Read(new(guestv1.ServerMsg)); !errors.Is(err, io.EOF) {
		t.Fatalf("after the client's end: %v", err)
	}
}

// BenchmarkRunTrue times the agent's own exec(true) round trip (the node's
// share of an exec is measured by bench/container).
func BenchmarkRunTrue(b *testing.B) {
	sock := filepath.Join(b.TempDir(), "g.sock")
	agentAt(b, sock)
	c := guest.NewClient(guest.UnixDialer(sock))
	defer c.Close()
	ctx := context.Background()
	for b.Loop() {
		if _, err := c.Run(ctx, &guestv1.Exec{Argv: []string{"/bin/true"}}); err != nil {
			b.Fatal(err)
		}
	}
}

// The process keeps no more idle connections than its budget, whatever the
// number of clients: the others get a connection per call.
func TestKeptConnectionsStayWithinTheProcesssBudget(t *testing.T) {
	defer guest.SetIdleBudget(1)()
	sock := filepath.Join(t.TempDir(), "g.sock")
	agentAt(t, sock)
	var ds [3]*dials
	for i := range ds {
		ds[i] = &dials{path: sock}
		c := guest.NewClient(ds[i].dial)
		defer c.Close()
		for range 5 {
			if x := run(t, c, &guestv1.Exec{Argv: []string{"true"}}); x.ExitCode != 0 {
				t.Fatalf("exit %d", x.ExitCode)
			}
		}
	}
	if n := ds[0].open.Load(); n != 1 {
		t.Fatalf("the first client keeps %d connections, want 1", n)
	}
	for _, d := range ds[1:] {
		if n := d.open.Load(); n != 0 {
			t.Fatalf("a client beyond the budget keeps %d connections", n)
		}
		if n := d.made.Load(); n != 5 {
			t.Fatalf("a client beyond the budget opened %d connections for 5 calls, want one per call", n)
		}
	}
}
