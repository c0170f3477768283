package hostile

// Attacks on PID 1, the agent, by its pid: a signal no handler can catch,
// and its descriptors and log through /proc/1. Under crun the kernel
// shields a pid namespace's init from its namespace and the agent is not
// dumpable, so its /proc entries are closed to every process of the
// sandbox. gVisor's kernel does neither (docs/substrates/container.md):
// there every workload runs in a pid namespace of its own, with its own
// /proc, under a small init, so PID 1 is that init, the agent has no pid a
// workload can name, and killing or stopping PID 1 harms the workloads
// alone.

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

func TestKillingPID1(t *testing.T) { eachRuntime(t, testKillingPID1) }

func testKillingPID1(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("kill -9 1; kill -STOP 1; sleep 1; kill -CONT 1; echo sent"))
	nb.check(t)
	taskFailure(t, "kill -9 1", err)
	if rt == "gvisor" {
		// PID 1 is the small init of the workloads' pid namespace: killing
		// it kills every process of that namespace, the shell that sent
		// the signal among them (the workload harming itself). The next
		// command runs in a new namespace.
		if r.Signal != "KILL" || strings.Contains(string(r.Stdout), "sent") {
			t.Errorf("kill -9 1 under gVisor: exit %d, signal %q, %q, %q; want the shell killed with its namespace", r.ExitCode, r.Signal, r.Stdout, r.Stderr)
		}
		answers(t, sb, "kill -9 1")
		// What ran in the killed namespace is gone with it.
		_, err = sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("(sleep 1000 &); sleep 0.2; kill -9 1; sleep 5; echo survived"))
		taskFailure(t, "kill -9 1 with a background process", err)
		r, err = sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("ps -o comm | grep -c '^sleep' || true"))
		taskFailure(t, "ps", err)
		if strings.TrimSpace(string(r.Stdout)) != "0" {
			t.Errorf("after kill -9 1, %s sleep processes of the killed namespace are left", strings.TrimSpace(string(r.Stdout)))
		}
		return
	}
	if !strings.Contains(string(r.Stdout), "sent") {
		t.Errorf("kill -9 1: exit %d, %q, %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	answers(t, sb, "kill -9 1")
}

// TestStoppingPID1 stops PID 1 (SIGSTOP, which no handler catches). Under
// crun the kernel drops it (the agent is its namespace's init). Under
// gVisor it stops the workloads' small init, not the agent: the command
// that sent it ends, later ones run, and the agent resumes the init, so
// orphans are reaped again.
func TestStoppingPID1(t *testing.T) { eachRuntime(t, testStoppingPID1) }

func testStoppingPID1(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	r, err := sb.Exec(ctxFor(t, 20*time.Second), dsec.Cmd("kill -STOP 1; sleep 0.5; echo sent"))
	nb.check(t)
	taskFailure(t, "kill -STOP 1", err)
	if string(r.Stdout) != "sent\n" {
		t.Errorf("kill -STOP 1: exit %d, %q, %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	for i := 0; i < 3; i++ {
		r, err := sb.Exec(ctxFor(t, 20*time.Second), dsec.Cmd("echo alive"))
		if err != nil || string(r.Stdout) != "alive\n" {
			t.Fatalf("after kill -STOP 1, call %d: %v, %v", i, r, err)
		}
	}
	// Orphans are reaped again: PID 1 is not left stopped.
	r, err = sb.Exec(ctxFor(t, 20*time.Second), dsec.Cmd("(true &); sleep 0.5; ps -o stat,comm | grep -c '^ *Z' || true"))
	taskFailure(t, "ps", err)
	if strings.TrimSpace(string(r.Stdout)) != "0" {
		t.Errorf("after kill -STOP 1, zombies are left unreaped: %q", r.Stdout)
	}
}

func TestWritesToPID1sOutputDoNotReachTheNode(t *testing.T) {
	eachRuntime(t, testWritesToPID1sOutputDoNotReachTheNode)
}

func testWritesToPID1sOutputDoNotReachTheNode(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	// The agent's stdout and stderr would be the sandbox's log on the
	// node (its last words, when it stops): a file on the node's disk,
	// outside the sandbox's.
	marker := fmt.Sprintf("forged-last-words-%d", time.Now().UnixNano())
	if _, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(fmt.Sprintf("echo %s >> /proc/1/fd/1; echo %s >> /proc/1/fd/2; true", marker, marker))); err != nil {
		t.Fatal(err)
	}
	nb.check(t)
	logs, _ := filepath.Glob(filepath.Join(srv(t).DataDir, "sandboxes", sb.ID, "*.log"))
	if len(logs) == 0 {
		t.Fatalf("no log of sandbox %s in the node's data directory", sb.ID)
	}
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(b, []byte(marker)) {
			t.Errorf("a process in the sandbox wrote to %s on the node", l)
		}
	}
	answers(t, sb, "writes to PID 1's stdout and stderr")
}

// TestAnotherCommandsOutputCannotBeForgedThroughPID1: gVisor's /proc lets
// any process open /proc/<pid>/fd/N without the ptrace access check Linux
// makes, so under gVisor a process can write into the pipe that carries
// another command's output: there this holds because PID 1 of a
// workload's /proc is the small init of the workloads' pid namespace
// (descriptors /dev/null), not the agent, which holds every command's
// pipes.
func TestAnotherCommandsOutputCannotBeForgedThroughPID1(t *testing.T) {
	eachRuntime(t, testAnotherCommandsOutputCannotBeForgedThroughPID1)
}

func testAnotherCommandsOutputCannotBeForgedThroughPID1(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	// The grader: a command whose output the caller trusts.
	done := make(chan struct{})
	var out []byte
	var gerr error
	go func() {
		defer close(done)
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("echo start; touch /tmp/started; until [ -e /tmp/attacked ]; do sleep 0.1; done; echo end"))
		if r != nil {
			out = r.Stdout
		}
		gerr = err
	}()
	// The attacker, once the grader runs and until it ends: every
	// descriptor of PID 1, written to and read.
	if _, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("until [ -e /tmp/started ]; do sleep 0.05; done; "+
		"for f in /proc/1/fd/*; do echo FORGED >> $f; timeout 1 cat $f; done >/dev/null 2>&1; touch /tmp/attacked")); err != nil {
		t.Fatal(err)
	}
	nb.check(t)
	<-done
	if gerr != nil {
		t.Fatal(gerr)
	}
	if string(out) != "start\nend\n" {
		t.Errorf("the grader's output is %q, want %q", out, "start\nend\n")
	}
}
