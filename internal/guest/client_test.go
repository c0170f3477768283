package guest_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
)

var agentBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "dsec-guest-test")
	if err != nil {
		panic(err)
	}
	agentBin = filepath.Join(dir, "dsec-guest")
	build := exec.Command("go", "build", "-o", agentBin, "github.com/opendsec/dsec/cmd/dsec-guest")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		panic("build dsec-guest: " + err.Error() + "\n" + string(out))
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// startAgent runs the real agent binary on a unix socket.
func startAgent(t *testing.T) *guest.Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "g.sock")
	agentAt(t, sock)
	c := guest.NewClient(guest.UnixDialer(sock))
	t.Cleanup(c.Close)
	return c
}

func run(t *testing.T, c *guest.Client, x *guestv1.Exec) *guestv1.Exit {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	exit, err := c.Run(ctx, x)
	if err != nil {
		t.Fatalf("run %v: %v", x.Argv, err)
	}
	return exit
}

func TestRun(t *testing.T) {
	c := startAgent(t)
	tests := []struct {
		name       string
		exec       *guestv1.Exec
		wantCode   int32
		wantStdout string
		wantStderr string
		wantSignal int32
		timedOut   bool
		truncated  bool
	}{
		{name: "echo prints its argument", exec: &guestv1.Exec{Argv: []string{"echo", "hi"}}, wantStdout: "hi\n"},
		{name: "exit code is returned", exec: &guestv1.Exec{Argv: []string{"sh", "-c", "echo err >&2; exit 3"}}, wantCode: 3, wantStderr: "err\n"},
		{name: "stdin data is delivered then closed", exec: &guestv1.Exec{Argv: []string{"cat"}, StdinData: []byte("abc")}, wantStdout: "abc"},
		{name: "env and cwd apply", exec: &guestv1.Exec{Argv: []string{"sh", "-c", "echo $FOO; pwd"}, Env: []string{"FOO=bar", "PATH=/usr/bin:/bin"}, Cwd: "/tmp"}, wantStdout: "bar\n/tmp\n"},
		{name: "unknown command exits 127", exec: &guestv1.Exec{Argv: []string{"no-such-command-xyz"}}, wantCode: 127, wantStderr: "no-such-command-xyz: command not found\n"},
		{name: "timeout kills the process group", exec: &guestv1.Exec{Argv: []string{"sh", "-c", "sleep 100 & sleep 100"}, TimeoutMs: 200}, wantCode: 137, wantSignal: 9, timedOut: true},
		{name: "signal death is reported", exec: &guestv1.Exec{Argv: []string{"sh", "-c", "kill -TERM $$"}}, wantCode: 143, wantSignal: 15},
		{name: "output over the cap keeps head and tail", exec: &guestv1.Exec{Argv: []string{"sh", "-c", "echo HEAD; yes | head -c 100000; echo; echo TAIL"}, MaxOutput: 1000}, truncated: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			exit := run(t, c, tt.exec)
			if exit.ExitCode != tt.wantCode {
				t.Errorf("exit code %d, want %d (stderr %q)", exit.ExitCode, tt.wantCode, exit.Stderr)
			}
			if exit.Signal != tt.wantSignal {
				t.Errorf("signal %d, want %d", exit.Signal, tt.wantSignal)
			}
			if exit.TimedOut != tt.timedOut {
				t.Errorf("timed out %v, want %v", exit.TimedOut, tt.timedOut)
			}
			if exit.Truncated != tt.truncated {
				t.Errorf("truncated %v, want %v", exit.Truncated, tt.truncated)
			}
			if tt.truncated {
				if len(exit.Stdout) != 1000 || !strings.HasPrefix(string(exit.Stdout), "HEAD\n") || !strings.HasSuffix(string(exit.Stdout), "TAIL\n") {
					t.Errorf("truncated stdout: len %d, head %q, tail %q", len(exit.Stdout), exit.Stdout[:10], exit.Stdout[len(exit.Stdout)-10:])
				}
			} else if string(exit.Stdout) != tt.wantStdout {
				t.Errorf("stdout %q, want %q", exit.Stdout, tt.wantStdout)
			}
			if tt.wantStderr != "" && string(exit.Stderr) != tt.wantStderr {
				t.Errorf("stderr %q, want %q", exit.Stderr, tt.wantStderr)
			}
			if tt.timedOut && time.Since(start) > 5*time.Second {
				t.Errorf("timed-out command took %v to report; the group was not killed", time.Since(start))
			}
		})
	}
}

func TestRunDoesNotWaitForBackgroundChildren(t *testing.T) {
	c := startAgent(t)
	start := time.Now()
	exit := run(t, c, &guestv1.Exec{Argv: []string{"sh", "-c", "sleep 30 & echo started"}})
	if string(exit.Stdout) != "started\n" || exit.ExitCode != 0 {
		t.Fatalf("got %q code %d", exit.Stdout, exit.ExitCode)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("exec waited %v for a background child holding stdout", d)
	}
}

func TestStreamInputAndExit(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := c.Start(ctx, &guestv1.Exec{Argv: []string{"sh", "-c", "read line; echo got:$line; echo e >&2; exit 5"}, StdinOpen: true})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.ID == "" || p.Pid == 0 {
		t.Fatalf("started without id/pid: %q %d", p.ID, p.Pid)
	}
	if err := p.Input([]byte("hello\n"), false); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	for {
		m, err := p.Recv()
		if err != nil {
			t.Fatalf("recv: %v", err)
		}
		if o := m.GetOutput(); o != nil {
			if o.Fd == 1 {
				stdout.Write(o.Data)
			} else {
				stderr.Write(o.Data)
			}
			continue
		}
		if x := m.GetExit(); x != nil {
			if x.ExitCode != 5 {
				t.Errorf("exit %d, want 5", x.ExitCode)
			}
			break
		}
	}
	if stdout.String() != "got:hello\n" || stderr.String() != "e\n" {
		t.Errorf("stdout %q stderr %q", stdout.String(), stderr.String())
	}
}

func TestProcessOutlivesConnectionAndAttachReplays(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := c.Start(ctx, &guestv1.Exec{Argv: []string{"sh", "-c", "echo one; read x; echo two:$x"}, StdinOpen: true, Tag: "bg"})
	if err != nil {
		t.Fatal(err)
	}
	id := p.ID
	p.Close() // disconnect; the process keeps running
	time.Sleep(100 * time.Millisecond)
	procs, err := c.ListProcs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	running := false
	for _, pr := range procs {
		if pr.Id == id && pr.Running && pr.Tag == "bg" {
			running = true
		}
	}
	if !running {
		t.Fatalf("process %s not listed as running after disconnect: %v", id, procs)
	}
	if err := c.InputProcess(ctx, id, []byte("later\n"), true); err != nil {
		t.Fatal(err)
	}
	a, err := c.Attach(ctx, "", "bg", false)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	var out bytes.Buffer
	for {
		m, err := a.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if o := m.GetOutput(); o != nil {
			out.Write(o.Data)
		}
		if m.GetExit() != nil {
			break
		}
	}
	if out.String() != "one\ntwo:later\n" {
		t.Fatalf("attached output %q", out.String())
	}
}

func TestSignalByID(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := c.Start(ctx, &guestv1.Exec{Argv: []string{"sleep", "60"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := c.SignalProcess(ctx, p.ID, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for {
		m, err := p.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if x := m.GetExit(); x != nil {
			if x.Signal != int32(syscall.SIGTERM) {
				t.Fatalf("signal %d, want TERM", x.Signal)
			}
			return
		}
	}
}

func TestPTY(t *testing.T) {
	c := startAgent(t)
	exit := run(t, c, &guestv1.Exec{Argv: []string{"sh", "-c", "test -t 0 && test -t 1 && stty size"}, Pty: true, Rows: 33, Cols: 101})
	if exit.ExitCode != 0 || !strings.Contains(string(exit.Stdout), "33 101") {
		t.Fatalf("pty: code %d, out %q", exit.ExitCode, exit.Stdout)
	}
}

func TestFiles(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()

	t.Run("write then read returns the same bytes", func(t *testing.T) {
		p := filepath.Join(dir, "sub", "a.txt")
		info, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: p, Mode: 0o600, Mkdirs: true}, strings.NewReader("hello"))
		if err != nil {
			t.Fatal(err)
		}
		if info.Size != 5 || info.Mode != 0o600 || info.Type != "file" {
			t.Fatalf("info %+v", info)
		}
		f, err := c.ReadFile(ctx, &guestv1.ReadFile{Path: p})
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(f)
		f.Close()
		if string(b) != "hello" {
			t.Fatalf("read %q", b)
		}
	})
	t.Run("a large file streams intact", func(t *testing.T) {
		p := filepath.Join(dir, "big")
		data := bytes.Repeat([]byte("0123456789abcdef"), 4<<20) // 64 MiB
		if _, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: p}, bytes.NewReader(data)); err != nil {
			t.Fatal(err)
		}
		f, err := c.ReadFile(ctx, &guestv1.ReadFile{Path: p})
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		n, err := io.Copy(h, f)
		f.Close()
		if err != nil || n != int64(len(data)) || !bytes.Equal(h.Sum(nil), sha(data)) {
			t.Fatalf("read back %d bytes, err %v, hash match %v", n, err, bytes.Equal(h.Sum(nil), sha(data)))
		}
	})
	t.Run("offset and limit select a range", func(t *testing.T) {
		p := filepath.Join(dir, "range")
		c.WriteFile(ctx, &guestv1.WriteFile{Path: p}, strings.NewReader("0123456789"))
		f, err := c.ReadFile(ctx, &guestv1.ReadFile{Path: p, Offset: 3, Limit: 4})
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(f)
		f.Close()
		if string(b) != "3456" {
			t.Fatalf("range %q", b)
		}
	})
	t.Run("a write the agent refuses at once answers with the refusal, never as unreachable", func(t *testing.T) {
		// The agent answers and closes before the data and the end mark are
		// sent: whichever send breaks, the caller gets the agent's reason.
		missing := filepath.Join(dir, "no", "such", "dir", "f")
		for i := range 200 {
			_, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: missing}, strings.NewReader("x"))
			if !errdefs.Is(err, errdefs.KindNotFound) {
				t.Fatalf("write %d into a missing directory: %v, want not found", i, err)
			}
		}
	})
	t.Run("list, stat, rename and remove", func(t *testing.T) {
		d := filepath.Join(dir, "tree")
		if _, err := c.MakeDir(ctx, &guestv1.MakeDir{Path: filepath.Join(d, "x", "y")}); err != nil {
			t.Fatal(err)
		}
		c.WriteFile(ctx, &guestv1.WriteFile{Path: filepath.Join(d, "x", "f")}, strings.NewReader("f"))
		ents, err := c.ListDir(ctx, &guestv1.ListDir{Path: d, Depth: 3})
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != 3 {
			t.Fatalf("entries %v", ents)
		}
		if _, err := c.Rename(ctx, &guestv1.Rename{From: filepath.Join(d, "x", "f"), To: filepath.Join(d, "g")}); err != nil {
			t.Fatal(err)
		}
		if st, err := c.Stat(ctx, &guestv1.Path{Path: filepath.Join(d, "g")}); err != nil || st.Size != 1 {
			t.Fatalf("stat after rename: %v %v", st, err)
		}
		if err := c.Remove(ctx, &guestv1.Remove{Path: d}); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("non-recursive remove of a non-empty dir: %v", err)
		}
		if err := c.Remove(ctx, &guestv1.Remove{Path: d, Recursive: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Stat(ctx, &guestv1.Path{Path: d}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("stat after remove: %v", err)
		}
	})
	t.Run("bad paths are rejected with the right class", func(t *testing.T) {
		cases := []struct {
			path string
			kind errdefs.Kind
		}{
			{"relative/path", errdefs.KindInvalid},
			{"", errdefs.KindInvalid},
			{"/no/such/file", errdefs.KindNotFound},
			{dir, errdefs.KindInvalid}, // a directory
		}
		for _, cs := range cases {
			_, err := c.ReadFile(ctx, &guestv1.ReadFile{Path: cs.path})
			if !errdefs.Is(err, cs.kind) {
				t.Errorf("read %q: %v, want %s", cs.path, err, cs.kind)
			}
		}
	})
}

func TestFileCallsActAsTheirUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (acts as nobody)")
	}
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o755)
	}
	open := filepath.Join(dir, "open")
	os.Mkdir(open, 0o777)
	os.Chmod(open, 0o777)
	secret := filepath.Join(dir, "secret")
	os.WriteFile(secret, []byte("root only"), 0o600)
	os.Symlink(secret, filepath.Join(open, "answer.txt"))
	os.Symlink("/proc/self/fd/1", filepath.Join(open, "stdout"))
	os.Mkdir(filepath.Join(dir, "closed"), 0o700)
	const user = "nobody"
	denied := func(t *testing.T, err error) {
		t.Helper()
		if !errdefs.Is(err, errdefs.KindPermissionDenied) || errdefs.IsInfra(err) {
			t.Fatalf("got %v, want permission_denied (not infra)", err)
		}
	}
	t.Run("an upload through the user's link to a root-only file is denied and changes nothing", func(t *testing.T) {
		_, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: filepath.Join(open, "answer.txt"), User: user}, strings.NewReader("pwned"))
		denied(t, err)
		if b, _ := os.ReadFile(secret); string(b) != "root only" {
			t.Fatalf("the root-only file is now %q", b)
		}
	})
	t.Run("a read of a root-only file is denied", func(t *testing.T) {
		_, err := c.ReadFile(ctx, &guestv1.ReadFile{Path: secret, User: user})
		denied(t, err)
	})
	t.Run("links through /proc to the agent's files are refused with a clear message", func(t *testing.T) {
		_, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: filepath.Join(open, "stdout"), User: user}, strings.NewReader("x"))
		denied(t, err)
		if !strings.Contains(err.Error(), "/proc link") {
			t.Fatalf("message %q does not say why", err)
		}
		_, err = c.ReadFile(ctx, &guestv1.ReadFile{Path: "/proc/self/environ", User: user})
		denied(t, err)
		_, err = c.ReadFile(ctx, &guestv1.ReadFile{Path: "/proc/self/environ"})
		denied(t, err) // root too: the agent's own entries are not the sandbox's
	})
	t.Run("stat, list, watch, mkdir, rename and remove apply the user's permissions", func(t *testing.T) {
		_, err := c.Stat(ctx, &guestv1.Path{Path: filepath.Join(dir, "closed", "x"), User: user})
		denied(t, err)
		_, err = c.ListDir(ctx, &guestv1.ListDir{Path: filepath.Join(dir, "closed"), User: user})
		denied(t, err)
		_, err = c.Watch(ctx, &guestv1.Watch{Path: filepath.Join(dir, "closed"), User: user})
		denied(t, err)
		_, err = c.MakeDir(ctx, &guestv1.MakeDir{Path: filepath.Join(dir, "closed", "d"), User: user})
		denied(t, err)
		_, err = c.Rename(ctx, &guestv1.Rename{From: secret, To: filepath.Join(open, "stolen"), User: user})
		denied(t, err)
		err = c.Remove(ctx, &guestv1.Remove{Path: secret, User: user})
		denied(t, err)
		if _, err := os.Stat(secret); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("what the user writes and makes is the user's", func(t *testing.T) {
		info, err := c.WriteFile(ctx, &guestv1.WriteFile{Path: filepath.Join(open, "new", "deep", "f"), User: user, Mkdirs: true, Mode: 0o640}, strings.NewReader("mine"))
		if err != nil {
			t.Fatal(err)
		}
		if info.Owner != "nobody" || info.Mode != 0o640 {
			t.Fatalf("info %+v", info)
		}
		d, err := c.Stat(ctx, &guestv1.Path{Path: filepath.Join(open, "new", "deep")})
		if err != nil || d.Owner != "nobody" {
			t.Fatalf("made directory %+v %v", d, err)
		}
		if err := c.Remove(ctx, &guestv1.Remove{Path: filepath.Join(open, "new"), Recursive: true, User: user}); err != nil {
			t.Fatal(err)
		}
	})
}

func sha(b []byte) []byte { h := sha256.Sum256(b); return h[:] }

func TestStreamDeliversOutputOfFastCommands(t *testing.T) {
	c := startAgent(t)
	for i := 0; i < 50; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		p, err := c.Start(ctx, &guestv1.Exec{Argv: []string{"echo", "fast"}})
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		for {
			m, err := p.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if o := m.GetOutput(); o != nil {
				out.Write(o.Data)
			}
			if m.GetExit() != nil {
				break
			}
		}
		p.Close()
		cancel()
		if out.String() != "fast\n" {
			t.Fatalf("run %d: streamed %q", i, out.String())
		}
	}
}

func TestStartOfAMissingCommandIsAnExit(t *testing.T) {
	c := startAgent(t)
	p, err := c.Start(context.Background(), &guestv1.Exec{Argv: []string{"no-such-cmd-xyz"}})
	if err != nil {
		t.Fatal(err)
	}
	// The reason comes as stderr, as a streaming client shows output.
	m, err := p.Recv()
	if err != nil || m.GetOutput().GetFd() != 2 || !strings.Contains(string(m.GetOutput().GetData()), "no-such-cmd-xyz: command not found") {
		t.Fatalf("got %v, %v; want the reason on stderr", m, err)
	}
	m, err = p.Recv()
	if err != nil || m.GetExit().GetExitCode() != 127 || m.GetExit().GetError() == "" {
		t.Fatalf("got %v, %v", m, err)
	}
	if _, err := p.Recv(); err != io.EOF {
		t.Fatalf("after the exit: %v, want EOF", err)
	}
}

func TestDeadlineEndsTheAgent(t *testing.T) {
	c := startAgent(t)
	if err := c.SetDeadline(context.Background(), time.Now().Add(300*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Hello(ctx)
		cancel()
		if err != nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("the agent still answers after its deadline")
}

func TestAttachLiveOnlySkipsBufferedOutput(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := c.Start(ctx, &guestv1.Exec{Argv: []string{"sh", "-c", "echo before; read x; echo after:$x"}, StdinOpen: true, Tag: "live"})
	if err != nil {
		t.Fatal(err)
	}
	id := p.ID
	// Read "before" so it is surely buffered, then detach.
	for {
		m, err := p.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if o := m.GetOutput(); o != nil && strings.Contains(string(o.Data), "before") {
			break
		}
	}
	p.Close()
	a, err := c.Attach(ctx, id, "", true)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := c.InputProcess(ctx, id, []byte("now\n"), true); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	for {
		m, err := a.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if o := m.GetOutput(); o != nil {
			out.Write(o.Data)
		}
		if m.GetExit() != nil {
			break
		}
	}
	if out.String() != "after:now\n" {
		t.Fatalf("live-only attach got %q, want only the output after the attach", out.String())
	}
}

func TestWatch(t *testing.T) {
	c := startAgent(t)
	dir := t.TempDir()
	os.Mkdir(filepath.Join(dir, "old"), 0o755)
	type ev struct{ name, op string }
	collect := func(t *testing.T, w *guest.Watch, want []ev) {
		t.Helper()
		got := map[ev]bool{}
		done := make(chan error, 1)
		go func() {
			for {
				e, err := w.Recv()
				if err != nil {
					done <- err
					return
				}
				got[ev{e.Name, e.Op}] = true
				all := true
				for _, x := range want {
					all = all && got[x]
				}
				if all {
					done <- nil
					return
				}
			}
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("watch ended: %v (got %v, want %v)", err, got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("timed out; got %v, want %v", got, want)
		}
	}
	tests := []struct {
		name      string
		recursive bool
		do        func()
		want      []ev
	}{
		{"creates, writes, chmods, renames and removes in the directory are reported", false, func() {
			p := filepath.Join(dir, "f.txt")
			os.WriteFile(p, []byte("x"), 0o644)
			f, _ := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
			f.Write([]byte("more"))
			f.Close()
			os.Chmod(p, 0o600)
			os.Rename(p, filepath.Join(dir, "g.txt"))
			os.Remove(filepath.Join(dir, "g.txt"))
		}, []ev{{"f.txt", "create"}, {"f.txt", "write"}, {"f.txt", "chmod"}, {"f.txt", "rename"}, {"g.txt", "create"}, {"g.txt", "remove"}}},
		{"a recursive watch sees existing and new subdirectories", true, func() {
			os.WriteFile(filepath.Join(dir, "old", "a"), []byte("1"), 0o644)
			os.MkdirAll(filepath.Join(dir, "new", "deep"), 0o755)
			time.Sleep(50 * time.Millisecond)
			os.WriteFile(filepath.Join(dir, "new", "deep", "b"), []byte("2"), 0o644)
		}, []ev{{"old/a", "create"}, {"new", "create"}, {"new/deep", "create"}, {"new/deep/b", "create"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			w, err := c.Watch(ctx, &guestv1.Watch{Path: dir, Recursive: tt.recursive})
			if err != nil {
				t.Fatal(err)
			}
			defer w.Close()
			tt.do()
			collect(t, w, tt.want)
		})
	}
	t.Run("a watch of a missing directory is not found", func(t *testing.T) {
		_, err := c.Watch(context.Background(), &guestv1.Watch{Path: filepath.Join(dir, "missing")})
		if !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("got %v, want not_found", err)
		}
	})
	t.Run("removing the watched directory ends the watch with not found", func(t *testing.T) {
		sub := filepath.Join(dir, "gone")
		os.Mkdir(sub, 0o755)
		w, err := c.Watch(context.Background(), &guestv1.Watch{Path: sub})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		os.Remove(sub)
		for {
			_, err := w.Recv()
			if err != nil {
				if !errdefs.Is(err, errdefs.KindNotFound) {
					t.Fatalf("watch ended with %v, want not_found", err)
				}
				return
			}
		}
	})
}

func TestStdinAndOutputLargerThanAFrameGoThroughInChunks(t *testing.T) {
	c := startAgent(t)
	in := bytes.Repeat([]byte("0123456789abcdef"), (guest.MaxMessage+3<<20)/16)
	t.Run("collect mode", func(t *testing.T) {
		x := run(t, c, &guestv1.Exec{Argv: []string{"cat"}, StdinData: in, MaxOutput: 2 * int64(len(in))})
		if x.ExitCode != 0 || !bytes.Equal(x.Stdout, in) {
			t.Fatalf("exit %d, %d bytes back of %d", x.ExitCode, len(x.Stdout), len(in))
		}
	})
	t.Run("collect mode keeps head and tail of the cap", func(t *testing.T) {
		x := run(t, c, &guestv1.Exec{Argv: []string{"cat"}, StdinData: in, MaxOutput: 1 << 20})
		if !x.Truncated || len(x.Stdout) != 1<<20 {
			t.Fatalf("truncated %v, %d bytes", x.Truncated, len(x.Stdout))
		}
		if !bytes.Equal(x.Stdout[:512<<10], in[:512<<10]) || !bytes.Equal(x.Stdout[512<<10:], in[len(in)-512<<10:]) {
			t.Fatal("the output is not the input's head and tail")
		}
	})
	t.Run("stream mode with stdin by id", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		p, err := c.Start(ctx, &guestv1.Exec{Argv: []string{"wc", "-c"}, StdinOpen: true, MaxOutput: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if err := c.InputProcess(ctx, p.ID, in, true); err != nil {
			t.Fatalf("write %d bytes of stdin: %v", len(in), err)
		}
		var out []byte
		for {
			m, err := p.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if o := m.GetOutput(); o != nil {
				out = append(out, o.Data...)
			}
			if m.GetExit() != nil {
				break
			}
		}
		if got := strings.TrimSpace(string(out)); got != strconv.Itoa(len(in)) {
			t.Fatalf("wc -c counted %q, want %d", got, len(in))
		}
	})
}
