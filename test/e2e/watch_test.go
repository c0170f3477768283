package e2e

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestWatchStatsAndLiveAttach covers the native API's directory watches,
// sandbox stats and live-only attach (which the E2B facade is built on).
func TestWatchStatsAndLiveAttach(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	api := c.Raw()
	ctx := ctxFor(t, 2*time.Minute)
	sb := create(t, c, dsec.CreateOptions{})

	t.Run("WatchDir reports started, then each change", func(t *testing.T) {
		if _, err := sb.Exec(ctx, dsec.Cmd("mkdir -p /tmp/w")); err != nil {
			t.Fatal(err)
		}
		st, err := api.WatchDir(ctx, connect.NewRequest(&dsecv1.WatchDirRequest{SandboxId: sb.ID, Path: "/tmp/w", Recursive: true}))
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if !st.Receive() || !st.Msg().GetStarted() {
			t.Fatalf("first event %v %v, want started", st.Msg(), st.Err())
		}
		if _, err := sb.Exec(ctx, dsec.Cmd("echo x > /tmp/w/a; mkdir /tmp/w/d; echo y > /tmp/w/d/b; rm /tmp/w/a")); err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{"create a": true, "write a": true, "create d": true, "create d/b": true, "remove a": true}
		var got []string
		for len(want) > 0 && st.Receive() {
			if ch := st.Msg().GetChange(); ch != nil {
				got = append(got, ch.Op+" "+ch.Name)
				delete(want, ch.Op+" "+ch.Name)
			}
		}
		if len(want) > 0 {
			t.Fatalf("changes %q miss %v (%v)", got, want, st.Err())
		}
	})
	t.Run("WatchDir of a missing directory is not found", func(t *testing.T) {
		st, err := api.WatchDir(ctx, connect.NewRequest(&dsecv1.WatchDirRequest{SandboxId: sb.ID, Path: "/nope"}))
		if err == nil {
			for st.Receive() {
			}
			err = st.Err()
		}
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("got %v, want not_found", err)
		}
	})
	t.Run("GetSandboxStats reports use and limits without resuming a paused sandbox", func(t *testing.T) {
		if _, err := c.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		st, err := api.GetSandboxStats(ctx, connect.NewRequest(&dsecv1.GetSandboxStatsRequest{Id: sb.ID}))
		if err != nil {
			t.Fatal(err)
		}
		if st.Msg.MemoryBytes <= 0 || st.Msg.MemoryLimitMb != 512 || st.Msg.CpuLimit != 1 || st.Msg.Pids < 1 {
			t.Fatalf("stats %v", st.Msg)
		}
		if info, err := c.Get(ctx, sb.ID); err != nil || info.State != "paused" {
			t.Fatalf("after stats the sandbox is %v %v, want still paused", info.GetState(), err)
		}
	})
	t.Run("a live-only attach streams only new output", func(t *testing.T) {
		s, err := sb.Start(ctx, dsec.Cmd("echo before; read x; echo after:$x"), true)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		pid := s.ProcessID
		time.Sleep(200 * time.Millisecond) // "before" is written and buffered
		st, err := api.ConnectProcess(ctx, connect.NewRequest(&dsecv1.ConnectProcessRequest{SandboxId: sb.ID, ProcessId: pid, LiveOnly: true}))
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if !st.Receive() || st.Msg().GetStarted() == nil {
			t.Fatalf("first event %v %v, want started", st.Msg(), st.Err())
		}
		if _, err := s.Write([]byte("now\n")); err != nil {
			t.Fatal(err)
		}
		if err := s.CloseStdin(); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		for st.Receive() {
			out.Write(st.Msg().GetStdout())
			if st.Msg().GetExit() != nil {
				break
			}
		}
		if out.String() != "after:now\n" {
			t.Fatalf("live-only attach streamed %q", out.String())
		}
	})
}
