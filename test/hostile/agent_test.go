package hostile

// Attacks on dsec-guest, the agent that is PID 1 of every container
// sandbox: a process inside must not be able to end it (which the caller
// would see as the platform's failure), to make it buffer without bound, or
// to outlive the exec that started it.

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// upload copies a host file into the sandbox as an executable.
func uploadFile(t *testing.T, sb *dsec.Sandbox, host, path string) {
	t.Helper()
	f, err := os.Open(host)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := sb.WriteFile(ctxFor(t, time.Minute), path, f, 0o755); err != nil {
		t.Fatalf("upload %s: %v", path, err)
	}
}

// answers fails t unless the sandbox still runs commands.
func answers(t *testing.T, sb *dsec.Sandbox, what string) {
	t.Helper()
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("echo alive"))
	if err != nil {
		t.Fatalf("after %s the sandbox does not answer: %v (kind %q, infra %v)", what, err, kindOf(err), infraOf(err))
	}
	if r.ExitCode != 0 || string(r.Stdout) != "alive\n" {
		t.Fatalf("after %s: exit %d, stdout %q, stderr %q", what, r.ExitCode, r.Stdout, r.Stderr)
	}
}

// taskFailure fails t if err is not nil: whatever the workload did, the
// caller must get a result (the task's failure), never an error.
func taskFailure(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: the call failed with %v (kind %q, infra %v); want a result", what, err, kindOf(err), infraOf(err))
	}
}

// attack runs cmd in sb for up to timeout while, after settle, the
// neighbour is measured, and returns the call's answer.
func attack(t *testing.T, sb *dsec.Sandbox, nb *neighbour, cmd string, timeout, settle time.Duration) (*dsecv1.ExecResult, error) {
	t.Helper()
	done := make(chan struct{})
	var r *dsecv1.ExecResult
	var err error
	go func() {
		defer close(done)
		// Minutes, not seconds: on a host busy with other tests a bomb's
		// thousands of processes take long to kill.
		r, err = sb.Exec(ctxFor(t, 5*time.Minute), dsec.ExecOptions{Cmd: cmd, Timeout: timeout})
	}()
	time.Sleep(settle)
	nb.check(t)
	<-done
	return r, err
}

// endedByTask checks the end of a gVisor sandbox that its workload ended,
// as it can there: by reaching its memory or pids limit (gVisor's kernel
// has no OOM killer or process limit of its own; the host's cgroup stops
// it whole) or by killing the agent (its kernel does not shield a pid
// namespace's init). The call that was running answers gone, the task's
// doing (not infra), saying how (how), and the sandbox is deleted with
// that reason.
func endedByTask(t *testing.T, sb *dsec.Sandbox, what string, err error, how string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: the call returned a result; want the sandbox ended: its workload %s", what, how)
	}
	if kindOf(err) != "gone" || infraOf(err) || !strings.Contains(err.Error(), how) {
		t.Fatalf("%s: %v (kind %q, infra %v); want gone, not infra, saying its workload %s", what, err, kindOf(err), infraOf(err), how)
	}
	t.Logf("%s: %v", what, err)
	_, err = sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("true"))
	if kindOf(err) != "not_found" || !strings.Contains(err.Error(), how) {
		t.Fatalf("a call after the end: %v (kind %q); want not found, saying its workload %s", err, kindOf(err), how)
	}
	// Its get says so too, with the end's class: an OOM kill is "oom".
	want := "workload_exit"
	if strings.Contains(how, "memory limit") {
		want = "oom"
	}
	got, err := client(t).Get(ctxFor(t, time.Minute), sb.ID)
	if err != nil {
		t.Fatalf("get after the end: %v", err)
	}
	if got.GetEndCause() != want || got.GetInfra() || got.GetEndedAt() == nil || !strings.Contains(got.GetReason(), how) {
		t.Fatalf("get after the end: cause %q, infra %v, ended at %v, reason %q; want cause %q, not infra, a time, saying its workload %s",
			got.GetEndCause(), got.GetInfra(), got.GetEndedAt(), got.GetReason(), want, how)
	}
}

func TestAgentSurvivesEverySignalSentToPID1(t *testing.T) {
	eachRuntime(t, testAgentSurvivesEverySignalSentToPID1)
}

func testAgentSurvivesEverySignalSentToPID1(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	// Every signal a process can send (KILL and STOP are refused by the
	// kernel for a pid namespace's init), by kill(2), by rt_sigqueueinfo
	// with a forged si_code and by F_SETOWN/F_SETSIG.
	ways := []struct{ name, cmd string }{
		{"kill", "kill -%d 1"},
		{"rt_sigqueueinfo with SI_QUEUE", "/tmp/sigsend queue %d"},
		{"F_SETSIG on a pipe owned by PID 1", "/tmp/sigsend sigio %d"},
	}
	var sigs []int
	for sig := 1; sig <= 64; sig++ {
		if sig != int(unix.SIGKILL) && sig != int(unix.SIGSTOP) {
			sigs = append(sigs, sig)
		}
	}
	// send runs cmd for each of sigs in one exec, 50 ms apart (measuring
	// the neighbour a second in, with nb), then checks that the agent
	// answers: one exec per way, not two per signal (744 execs were 49 s
	// of this suite).
	send := func(sb *dsec.Sandbox, cmd string, sigs []int, nb *neighbour) error {
		var b strings.Builder
		for _, sig := range sigs {
			fmt.Fprintf(&b, "%s || { echo 'signal %d: not sent' >&2; exit 1; }; sleep 0.05; ", fmt.Sprintf(cmd, sig), sig)
		}
		b.WriteString("echo sent")
		var r *dsecv1.ExecResult
		var err error
		if nb != nil {
			r, err = attack(t, sb, nb, b.String(), time.Minute, time.Second)
		} else {
			r, err = sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(b.String()))
		}
		if err != nil {
			return fmt.Errorf("the exec failed: %v (kind %q, infra %v)", err, kindOf(err), infraOf(err))
		}
		if r.ExitCode != 0 || string(r.Stdout) != "sent\n" {
			return fmt.Errorf("exit %d, stdout %q, stderr %q", r.ExitCode, r.Stdout, r.Stderr)
		}
		r, err = sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("echo alive"))
		if err != nil || string(r.Stdout) != "alive\n" {
			return fmt.Errorf("the sandbox does not answer after them: %v %v (kind %q, infra %v)", r, err, kindOf(err), infraOf(err))
		}
		return nil
	}
	for _, w := range ways {
		t.Run("sent by "+w.name, func(t *testing.T) {
			sb := create(t, c, dsec.CreateOptions{Runtime: rt})
			uploadFile(t, sb, testdataProgram(t, "sigsend"), "/tmp/sigsend")
			err := send(sb, w.cmd, sigs, nb)
			if err == nil {
				return
			}
			t.Errorf("signals 1 to 64 but KILL and STOP: %v", err)
			// Name the signal: each alone, in a new sandbox.
			sb = create(t, c, dsec.CreateOptions{Runtime: rt})
			uploadFile(t, sb, testdataProgram(t, "sigsend"), "/tmp/sigsend")
			for _, sig := range sigs {
				if err := send(sb, w.cmd, []int{sig}, nil); err != nil {
					t.Fatalf("signal %d (%s): %v", sig, unix.SignalName(unix.Signal(sig)), err)
				}
			}
		})
	}
	t.Run("children still get default dispositions", func(t *testing.T) {
		sb := create(t, c, dsec.CreateOptions{Runtime: rt})
		if rt == "gvisor" {
			// gVisor's /proc/self/status has no signal masks: each signal
			// whose default ends a process must end a shell that sends it
			// to itself, 32 (which the agent handles) among them.
			for _, sig := range []int{1, 2, 10, 12, 13, 14, 15, 32, 34, 64} {
				r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(fmt.Sprintf("kill -%d $$; echo survived", sig)))
				if err != nil {
					t.Fatal(err)
				}
				if len(r.Stdout) > 0 {
					t.Errorf("signal %d: a child survived it (exit %d, %q): it is not at its default", sig, r.ExitCode, r.Stdout)
				}
			}
			return
		}
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Argv("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"))
		if err != nil {
			t.Fatal(err)
		}
		if want := "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"; string(r.Stdout) != want {
			t.Errorf("a child's signal state is %q, want %q", r.Stdout, want)
		}
	})
}

func TestForkBombIsTheTasksFailureNotTheSandboxs(t *testing.T) {
	eachRuntime(t, testForkBombIsTheTasksFailureNotTheSandboxs)
}

func testForkBombIsTheTasksFailureNotTheSandboxs(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	for _, tc := range []struct {
		name              string
		opts              dsec.CreateOptions
		wantOOM, wantPids bool
	}{
		// Enough pids that the bomb's kernel memory fills the memory limit
		// before it runs out of pids.
		{"filling the memory limit", dsec.CreateOptions{MemoryMB: 64, Pids: 4096}, true, false},
		{"filling the pids limit", dsec.CreateOptions{MemoryMB: 512, Pids: 64}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opts.Runtime = rt
			sb := create(t, c, tc.opts)
			// The bomb reaches either limit within a second here; the
			// timeout ends it (and the neighbour is measured at 3 s).
			r, err := attack(t, sb, nb, "b() { b | b & }; b; sleep 30", 8*time.Second, 3*time.Second)
			if rt == "gvisor" {
				limit := "pids"
				if tc.wantOOM {
					limit = "memory"
				}
				endedByTask(t, sb, "fork bomb", err, "reached its "+limit+" limit")
				return
			}
			taskFailure(t, "fork bomb", err)
			t.Logf("fork bomb: exit %d, signal %q, timed out %v, oom %v, pids limited %v", r.ExitCode, r.Signal, r.TimedOut, r.OomKilled, r.PidsLimited)
			if tc.wantOOM && !r.OomKilled {
				t.Errorf("the result does not name the memory limit")
			}
			if tc.wantPids && !r.PidsLimited {
				t.Errorf("the result does not name the pids limit")
			}
			answers(t, sb, "the fork bomb")
		})
	}
}

func TestMemoryBombOfSmallProcessesIsReportedAsOOM(t *testing.T) {
	eachRuntime(t, testMemoryBombOfSmallProcessesIsReportedAsOOM)
}

func testMemoryBombOfSmallProcessesIsReportedAsOOM(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{MemoryMB: 64, Runtime: rt})
	// Many processes, each smaller than the agent: the OOM killer's
	// biggest candidate would be the agent if it were one. They allocate
	// at once (120 MB, past the 64 MB limit, within a second or two), the
	// survivors hold it a while, and the command fails: a failed command's
	// result names the OOM kills since the last one (the timeout is a
	// bound, not the way it ends: that was 20 s of this suite).
	bomb := `for i in $(seq 40); do (x=$(head -c 3000000 /dev/zero | tr '\0' a); sleep 6) & done; wait; exit 1`
	r, err := attack(t, sb, nb, bomb, 20*time.Second, 2*time.Second)
	if rt == "gvisor" {
		endedByTask(t, sb, "memory bomb", err, "reached its memory limit")
		return
	}
	taskFailure(t, "memory bomb", err)
	t.Logf("memory bomb: exit %d, signal %q, timed out %v, oom %v", r.ExitCode, r.Signal, r.TimedOut, r.OomKilled)
	if !r.OomKilled {
		t.Errorf("the memory bomb is not reported as OOM")
	}
	answers(t, sb, "the memory bomb")
}

func TestEndlessOutputAtTheLargestCapIsCappedNotBuffered(t *testing.T) {
	eachRuntime(t, testEndlessOutputAtTheLargestCapIsCappedNotBuffered)
}

func testEndlessOutputAtTheLargestCapIsCappedNotBuffered(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	// The cap is larger than the sandbox's memory: buffering it in the
	// sandbox would OOM. (Under gVisor the agent keeps the tail in its
	// memory, which is the sandbox's: there the sandbox has room for it.)
	memory := int64(64)
	if rt == "gvisor" {
		memory = 512
	}
	sb := create(t, c, dsec.CreateOptions{MemoryMB: memory, Runtime: rt})
	const capBytes = 64 << 20
	done := make(chan struct{})
	var r *dsecv1.ExecResult
	var err error
	go func() {
		defer close(done)
		r, err = sb.Exec(ctxFor(t, 3*time.Minute), dsec.ExecOptions{Cmd: "yes dsec", MaxOutputBytes: capBytes, Timeout: 10 * time.Second})
	}()
	time.Sleep(3 * time.Second)
	nb.check(t)
	<-done
	taskFailure(t, "endless output", err)
	if !r.TimedOut || !r.Truncated {
		t.Errorf("timed out %v, truncated %v; want both", r.TimedOut, r.Truncated)
	}
	if len(r.Stdout) != capBytes {
		t.Errorf("stdout has %d bytes, want the cap, %d", len(r.Stdout), capBytes)
	}
	if !bytes.HasPrefix(r.Stdout, []byte("dsec\ndsec\n")) {
		t.Errorf("stdout starts %q", r.Stdout[:min(len(r.Stdout), 20)])
	}
	answers(t, sb, "endless output")
}

func TestStdinAndResultLargerThanAGuestFrameWork(t *testing.T) {
	eachRuntime(t, testStdinAndResultLargerThanAGuestFrameWork)
}

func testStdinAndResultLargerThanAGuestFrameWork(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	in := bytes.Repeat([]byte("0123456789abcdef"), 12<<20/16) // 12 MiB
	// The neighbour is measured while large execs run back to back.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	ctx := ctxFor(t, 5*time.Minute)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			sb.Exec(ctx, dsec.ExecOptions{Argv: []string{"cat"}, Stdin: in, MaxOutputBytes: 16 << 20})
		}
	}()
	nb.check(t)
	close(stop)
	wg.Wait()
	r, err := sb.Exec(ctxFor(t, 2*time.Minute), dsec.ExecOptions{Argv: []string{"cat"}, Stdin: in, MaxOutputBytes: 16 << 20})
	if err != nil {
		t.Fatalf("12 MiB through cat: %v (kind %q, infra %v)", err, kindOf(err), infraOf(err))
	}
	if r.ExitCode != 0 || r.Truncated || !bytes.Equal(r.Stdout, in) {
		t.Fatalf("exit %d, truncated %v, %d bytes back (equal %v), stderr %q", r.ExitCode, r.Truncated, len(r.Stdout), bytes.Equal(r.Stdout, in), r.Stderr)
	}
	t.Run("streamed stdin", func(t *testing.T) {
		st, err := sb.Start(ctxFor(t, 2*time.Minute), dsec.ExecOptions{Cmd: "wc -c", MaxOutputBytes: 1 << 20}, true)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if _, err := st.Write(in); err != nil {
			t.Fatalf("write 12 MiB of stdin: %v (kind %q, infra %v)", err, kindOf(err), infraOf(err))
		}
		if err := st.CloseStdin(); err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		res, err := st.Wait(&out, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(out.String()); res.ExitCode != 0 || got != fmt.Sprint(len(in)) {
			t.Errorf("wc -c says %q (exit %d), want %d", got, res.ExitCode, len(in))
		}
	})
}

func TestTimedOutExecLeavesNoProcessBehind(t *testing.T) {
	eachRuntime(t, testTimedOutExecLeavesNoProcessBehind)
}

func testTimedOutExecLeavesNoProcessBehind(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	// A child in its own session (out of the exec's process group) and a
	// grandchild re-parented to PID 1 by a double fork.
	cmd := `setsid sleep 4242 >/dev/null 2>&1 & (sh -c 'sleep 4343 >/dev/null 2>&1 &') ; sleep 600`
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Cmd: cmd, Timeout: 2 * time.Second})
	taskFailure(t, "the exec", err)
	if !r.TimedOut {
		t.Fatalf("the exec did not time out: exit %d, signal %q", r.ExitCode, r.Signal)
	}
	nb.check(t)
	var left string
	for range 20 {
		ps, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("ps -o pid,args | grep -E 'sleep (4242|4343|600)' | grep -v grep"))
		if err != nil {
			t.Fatal(err)
		}
		if left = string(ps.Stdout); left == "" {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Errorf("processes of the timed-out exec still run:\n%s", left)
}
