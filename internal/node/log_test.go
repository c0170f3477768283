package node

import (
	"bytes"
	"context"
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// TestTrajectoryLog: every exec and file mutation is logged in order with
// its result; a request ID makes a call exactly-once.
func TestTrajectoryLog(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	sb := tn.create(bg, nil)
	id := sb.Id
	count := "echo x >> /tmp/count; wc -l < /tmp/count"

	t.Run("an exec with a request ID runs once and its repeat is replayed", func(t *testing.T) {
		req := &dsecv1.ExecRequest{SandboxId: id, Cmd: count, RequestId: "exec-1"}
		first, err := tn.Exec(bg, req)
		if err != nil || strings.TrimSpace(string(first.Stdout)) != "1" || first.Replayed || first.Seq == 0 {
			t.Fatalf("first: %v %v", first, err)
		}
		again, err := tn.Exec(bg, req)
		if err != nil || !again.Replayed || again.Seq != first.Seq || !bytes.Equal(again.Stdout, first.Stdout) {
			t.Fatalf("repeat: %v %v", again, err)
		}
		if out := tn.sh(bg, id, "wc -l < /tmp/count"); strings.TrimSpace(out) != "1" {
			t.Fatalf("the repeat ran: %q lines", out)
		}
	})

	t.Run("a streamed exec's repeat is replayed as events", func(t *testing.T) {
		req := &dsecv1.ExecRequest{SandboxId: id, Cmd: count + "; echo err >&2", RequestId: "stream-1"}
		run := func() (stdout, stderr string, exit *dsecv1.ExecResult) {
			err := tn.ExecStream(bg, req, func(ev *dsecv1.ExecEvent) error {
				stdout += string(ev.GetStdout())
				stderr += string(ev.GetStderr())
				if x := ev.GetExit(); x != nil {
					exit = x
				}
				return nil
			})
			if err != nil || exit == nil {
				t.Fatalf("stream: %v", err)
			}
			return
		}
		out1, err1, x1 := run()
		out2, err2, x2 := run()
		if out1 != "2\n" || err1 != "err\n" || x1.Replayed || x1.Seq == 0 {
			t.Fatalf("first: %q %q %v", out1, err1, x1)
		}
		if out2 != out1 || err2 != err1 || !x2.Replayed || x2.Seq != x1.Seq {
			t.Fatalf("repeat: %q %q %v", out2, err2, x2)
		}
	})

	t.Run("a request ID reused for another call is refused", func(t *testing.T) {
		_, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: id, Cmd: "echo other", RequestId: "exec-1"})
		if !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("reuse: %v", err)
		}
	})

	t.Run("a write with a request ID is replayed for the same content only", func(t *testing.T) {
		hdr := &dsecv1.WriteFileHeader{SandboxId: id, Path: "/tmp/w", RequestId: "write-1"}
		info, err := tn.WriteFile(bg, hdr, strings.NewReader("one"))
		if err != nil || info.Replayed || info.Size != 3 {
			t.Fatalf("first: %v %v", info, err)
		}
		info, err = tn.WriteFile(bg, hdr, strings.NewReader("one"))
		if err != nil || !info.Replayed || info.Size != 3 {
			t.Fatalf("repeat: %v %v", info, err)
		}
		if _, err := tn.WriteFile(bg, hdr, strings.NewReader("two")); !errdefs.Is(err, errdefs.KindConflict) {
			t.Fatalf("other content: %v", err)
		}
		if got := readAll(t, tn, bg, id, "/tmp/w"); got != "one" {
			t.Fatalf("file holds %q", got)
		}
	})

	t.Run("a call that fails is logged with its error and leaves its request ID free", func(t *testing.T) {
		hdr := &dsecv1.WriteFileHeader{SandboxId: id, Path: "/proc/nope/x", RequestId: "write-2"}
		if _, err := tn.WriteFile(bg, hdr, strings.NewReader("x")); err == nil {
			t.Fatal("a write under /proc succeeded")
		}
		log, _ := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: id})
		last := log.Entries[len(log.Entries)-1]
		if last.Op != "write_file" || last.Error == nil || last.RequestId != "" {
			t.Fatalf("last entry %v", last)
		}
		hdr.Path = "/tmp/retried"
		if info, err := tn.WriteFile(bg, hdr, strings.NewReader("x")); err != nil || info.Replayed {
			t.Fatalf("retry under the same ID: %v %v", info, err)
		}
	})

	t.Run("file mutations are logged in order with what they did", func(t *testing.T) {
		if _, err := tn.MakeDir(bg, &dsecv1.MakeDirRequest{SandboxId: id, Path: "/tmp/d/e"}); err != nil {
			t.Fatal(err)
		}
		if _, err := tn.Rename(bg, &dsecv1.RenameRequest{SandboxId: id, From: "/tmp/d/e", To: "/tmp/d/f"}); err != nil {
			t.Fatal(err)
		}
		if err := tn.Remove(bg, &dsecv1.RemoveRequest{SandboxId: id, Path: "/tmp/d", Recursive: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := tn.Stat(bg, &dsecv1.StatRequest{SandboxId: id, Path: "/tmp"}); err != nil {
			t.Fatal(err) // reads are not logged
		}
		log, err := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: id})
		if err != nil {
			t.Fatal(err)
		}
		var ops []string
		for k, e := range log.Entries {
			if e.Seq != uint64(k+1) {
				t.Fatalf("entry %d has seq %d", k, e.Seq)
			}
			ops = append(ops, e.Op)
		}
		want := "exec exec exec write_file write_file write_file make_dir rename remove"
		if strings.Join(ops, " ") != want {
			t.Fatalf("logged %v\nwant   %s", ops, want)
		}
		n := len(log.Entries)
		if e := log.Entries[n-2]; e.Path != "/tmp/d/e" || e.To != "/tmp/d/f" || e.Error != nil {
			t.Fatalf("rename logged as %v", e)
		}
		if e := log.Entries[n-1]; e.Path != "/tmp/d" || !e.Recursive {
			t.Fatalf("remove logged as %v", e)
		}
	})

	t.Run("the log outlives its sandbox", func(t *testing.T) {
		tn.Delete(bg, id)
		log, err := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: id})
		if err != nil || len(log.Entries) == 0 {
			t.Fatalf("log after delete: %v %v", log, err)
		}
	})
}

// TestReplay re-executes a sandbox's logged calls in a new sandbox.
func TestReplay(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	sb := tn.create(bg, nil)
	tn.WriteFile(bg, &dsecv1.WriteFileHeader{SandboxId: sb.Id, Path: "/tmp/in"}, strings.NewReader("input"))
	tn.sh(bg, sb.Id, "cat /tmp/in")
	tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "cat /proc/sys/kernel/random/uuid"})
	resp, err := tn.Replay(bg, &dsecv1.ReplayRequest{SandboxId: sb.Id})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Replayed != 3 || resp.Diverged != 1 || !resp.Steps[2].Diverged || resp.Steps[1].Diverged {
		t.Fatalf("replay %v", resp)
	}
	if _, err := tn.Get(bg, resp.SandboxId); err != nil {
		t.Fatal(err)
	}
	if st, _ := tn.state(resp.SandboxId); st != "deleted" {
		t.Fatalf("the replay sandbox is %s, want deleted", st)
	}
}

// TestProcesses: streamed execs and attaching to a process that outlived
// its caller.
func TestProcesses(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	sb := tn.create(bg, nil)

	t.Run("a PTY exec runs on a terminal", func(t *testing.T) {
		var out strings.Builder
		err := tn.ExecStream(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "tty", Pty: true}, func(ev *dsecv1.ExecEvent) error {
			out.Write(ev.GetStdout())
			return nil
		})
		if err != nil || !strings.HasPrefix(out.String(), "/dev/pts/") {
			t.Fatalf("tty: %q %v", out.String(), err)
		}
	})

	t.Run("a process keeps running when its caller goes away, and a later call attaches to it", func(t *testing.T) {
		ctx, cancel := context.WithCancel(bg)
		err := tn.ExecStream(ctx, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "sleep 0.5; echo late", Tag: "bg"}, func(ev *dsecv1.ExecEvent) error {
			if ev.GetStarted() != nil {
				cancel()
			}
			return nil
		})
		if !errdefs.Is(err, errdefs.KindCanceled) {
			t.Fatalf("the caller went away: %v", err)
		}
		var out strings.Builder
		var exit *dsecv1.ExecResult
		err = tn.ConnectProcess(bg, &dsecv1.ConnectProcessRequest{SandboxId: sb.Id, Tag: "bg"}, func(ev *dsecv1.ExecEvent) error {
			out.Write(ev.GetStdout())
			if x := ev.GetExit(); x != nil {
				exit = x
			}
			return nil
		})
		if err != nil || exit == nil || exit.ExitCode != 0 || out.String() != "late\n" {
			t.Fatalf("attach: %q %v %v", out.String(), exit, err)
		}
		log, _ := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: sb.Id})
		if last := log.Entries[len(log.Entries)-1]; last.Error == nil || last.Error.Kind != string(errdefs.KindCanceled) {
			t.Fatalf("the abandoned call is logged as %v", last)
		}
	})
}
