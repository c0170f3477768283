package hostile

// microVMs (issue 18: "the applicable parts on microVMs"). The workload
// runs on a kernel of its own, as root by default: it may do in the guest
// what no container can — write /proc/sysrq-trigger, power off, reboot —
// and that is the sandbox's business. What must hold is the host's side:
// the machine it ends is its own, the caller learns that the task ended
// it (not the platform: a verdict the trainer would mask), the neighbour
// does not notice, and nothing is left. Before, every one of these ends
// was reported as the platform's failure (unavailable, infra).

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// microVM creates a microVM sandbox of project A on the shared server.
func microVM(t *testing.T) *dsec.Sandbox {
	t.Helper()
	dsectest.NeedMicroVM(t)
	return create(t, client(t), dsec.CreateOptions{Kind: "microvm", MemoryMB: 256})
}

func TestAMicroVMGuestEndingItsMachineIsTheTasksEnd(t *testing.T) {
	srv(t)
	nb := newNeighbour(t)
	for _, a := range []struct{ name, cmd, how string }{
		{"poweroff", "poweroff -f", "powered the machine off"},
		{"reboot", "reboot -f", "rebooted the machine"},
		{"sysrq power off", "echo o > /proc/sysrq-trigger", "powered the machine off"},
		{"sysrq reset", "echo b > /proc/sysrq-trigger", "reset the machine"},
		{"sysrq crash", "echo c > /proc/sysrq-trigger", "crashed its kernel through /proc/sysrq-trigger"},
	} {
		t.Run(a.name, func(t *testing.T) {
			sb := microVM(t)
			answers(t, sb, "the start")
			_, err := sb.Exec(ctxFor(t, 2*time.Minute), dsec.ExecOptions{Cmd: "sync; " + a.cmd + "; sleep 30", Timeout: time.Minute})
			endedByTask(t, sb, a.cmd, err, a.how)
			nb.check(t)
		})
	}
}

func TestAMicroVMsAgentSurvivesSignalsToPID1(t *testing.T) {
	srv(t)
	sb := microVM(t)
	// The guest kernel drops KILL and STOP sent to its init, as a pid
	// namespace's; the agent ignores the rest (see the container rows).
	for _, sig := range []string{"KILL", "STOP", "TERM", "SEGV", "INT", "HUP"} {
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("kill -"+sig+" 1; echo sent"))
		taskFailure(t, "kill -"+sig+" 1", err)
		if !strings.Contains(string(r.Stdout), "sent") {
			t.Fatalf("kill -%s 1: %q %q", sig, r.Stdout, r.Stderr)
		}
		answers(t, sb, "kill -"+sig+" 1")
	}
}

func TestAMicroVMGuestCannotOpenTheAgentsChannel(t *testing.T) {
	srv(t)
	sb := microVM(t)
	// The agent's virtio-serial port has no device node once the agent
	// opened it, and admits one opener: a node made again from sysfs
	// does not open.
	out := sh(t, sb, `for d in /sys/class/virtio-ports/*; do
		[ "$(cat $d/name)" = dsec.agent ] || continue
		echo found $(cat $d/dev)
		mknod /tmp/agentport c $(tr : ' ' < $d/dev) && ( exec 3<>/tmp/agentport && echo OPENED ) 2>&1
	done; ls /dev/vport* 2>&1`)
	if !strings.Contains(out, "found ") || strings.Contains(out, "OPENED") || strings.Contains(out, "/dev/vport") && !strings.Contains(out, "No such file") {
		t.Fatalf("the agent's port: %q", out)
	}
	t.Logf("%s", out)
	answers(t, sb, "opening the agent's port")
}

func TestAMicroVMGuestOverwritingTheAgentBinaryChangesNothingOfTheNodes(t *testing.T) {
	srv(t)
	dsectest.NeedMicroVM(t)
	// With egress, a fork child always gets its identity (its own
	// address) from the agent binary in the guest.
	sb := create(t, client(t), dsec.CreateOptions{Kind: "microvm", MemoryMB: 256, Network: "egress"})
	// The binary is the workload's to overwrite in its own writable
	// layer; what the node runs later in the guest (a fork child's new
	// identity) is the running agent's own image, not the path.
	sh(t, sb, `printf '#!/bin/sh\necho pwned > /pwned\nexit 1\n' > /.dsec/guest && chmod 755 /.dsec/guest; head -c 20 /.dsec/guest`)
	resp, err := client(t).Fork(ctxFor(t, 2*time.Minute), &dsecv1.ForkRequest{SandboxId: sb.ID, Count: 1})
	if err != nil || resp.Created != 1 {
		t.Fatalf("fork after the agent binary was overwritten: %v %v", resp, err)
	}
	child := client(t).Sandbox(resp.Results[0].Sandbox.Id)
	defer child.Close()
	if out := sh(t, child, "cat /pwned 2>&1"); !strings.Contains(out, "No such file") {
		t.Fatalf("the node ran the planted binary in the child: %q", out)
	}
	if a, b := strings.Fields(sh(t, child, "ip -4 -o addr show eth0")), strings.Fields(sh(t, sb, "ip -4 -o addr show eth0")); len(a) < 4 || len(b) < 4 || a[3] == b[3] {
		t.Fatalf("the child's address %v, the parent's %v: the child did not get its identity", a, b)
	}
	answers(t, child, "the fork")
	answers(t, sb, "overwriting the agent binary")
}

func TestAMicroVMsMemoryBombIsReportedAsOOM(t *testing.T) {
	srv(t)
	nb := newNeighbour(t)
	sb := microVM(t)
	// Many processes, each smaller than the agent would be, past the
	// guest's 256 MiB: its kernel's OOM killer picks among them (never
	// init, the agent). Each doubles a string to 16 MiB in a few steps
	// (awk: little work per byte, which under TCG matters: 40 shells
	// filling their 12 MB through tr took up to the whole timeout), so the
	// guest runs out within seconds. The command ends itself (kill 0: the
	// shell and every survivor) once the guest's kernel counted an OOM
	// kill; the survivors hold their memory 12 s only, since a full guest
	// can refuse the check's own forks until they let go; the timeout is
	// the bound if no OOM kill ever comes.
	bomb := `oom() { awk '/^oom_kill /{print $2}' /proc/vmstat; }; n=$(oom); ` +
		`for i in $(seq 40); do awk 'BEGIN { s = "a"; while (length(s) < 12000000) s = s s; system("sleep 12") }' & done; ` +
		`until [ "$(oom)" -gt "$n" ] 2>/dev/null; do sleep 0.5; done; kill 0`
	r, err := attack(t, sb, nb, bomb, 40*time.Second, 5*time.Second)
	taskFailure(t, "memory bomb", err)
	t.Logf("memory bomb: exit %d, signal %q, timed out %v, oom %v", r.ExitCode, r.Signal, r.TimedOut, r.OomKilled)
	if !r.OomKilled {
		t.Errorf("the memory bomb is not reported as OOM")
	}
	answers(t, sb, "the memory bomb")
	// A fork child starts from its parent's memory, OOM count and all:
	// its own first failure is not an OOM kill.
	resp, err := client(t).Fork(ctxFor(t, 2*time.Minute), &dsecv1.ForkRequest{SandboxId: sb.ID, Count: 1})
	if err != nil || resp.Created != 1 {
		t.Fatalf("fork: %v %v", resp, err)
	}
	child := client(t).Sandbox(resp.Results[0].Sandbox.Id)
	defer child.Close()
	x, err := child.Exec(ctxFor(t, time.Minute), dsec.Cmd("exit 3"))
	if err != nil || x.ExitCode != 3 || x.OomKilled {
		t.Fatalf("the child's first failure: %v %v", x, err)
	}
}

func TestAMicroVMsForkBombIsTheTasksFailure(t *testing.T) {
	srv(t)
	nb := newNeighbour(t)
	sb := microVM(t)
	// The guest's kernel holds the bomb: its processes fill the guest's
	// memory and pid space, never the host's; the agent (the guest's
	// init) is not the OOM killer's pick and its timeout ends every
	// process of the command.
	procs := func() int {
		n, _ := strconv.Atoi(strings.TrimSpace(sh(t, sb, "ls -d /proc/[0-9]* | wc -l")))
		return n
	}
	before := procs()
	r, err := attack(t, sb, nb, "b() { b | b & }; b; sleep 30", 10*time.Second, 4*time.Second)
	taskFailure(t, "fork bomb", err)
	t.Logf("fork bomb: exit %d, signal %q, timed out %v, oom %v", r.ExitCode, r.Signal, r.TimedOut, r.OomKilled)
	if r.ExitCode == 0 && !r.TimedOut {
		t.Errorf("the fork bomb succeeded")
	}
	answers(t, sb, "the fork bomb")
	if after := procs(); after > before+2 {
		t.Errorf("%d processes in the guest after the bomb's command ended, %d before", after, before)
	}
}

func TestAMicroVMFillsOnlyItsOwnDisk(t *testing.T) {
	srv(t)
	dsectest.NeedMicroVM(t)
	nb := newNeighbour(t)
	sb := create(t, client(t), dsec.CreateOptions{Kind: "microvm", MemoryMB: 256, DiskMB: fillDiskMB})
	size, _ := dfRoot(t, sb)
	t.Logf("df / in the guest: %d KiB", size)
	if size > fillDiskMB<<10 {
		// Checked before any unbounded write.
		t.Fatalf("df / in the guest says %d KiB, more than the sandbox's %d MiB", size, fillDiskMB)
	}
	use := dataDirUse(t)
	r, err := sb.Exec(ctxFor(t, 3*time.Minute), dsec.ExecOptions{Cmd: fmt.Sprintf("dd if=/dev/zero of=/fill bs=1M count=%d; sync", 2*fillDiskMB), Timeout: 2 * time.Minute})
	taskFailure(t, "dd", err)
	if !strings.Contains(string(r.Stderr), "No space left") {
		t.Errorf("dd of %d MiB into a %d MiB disk: exit %d, stderr %q", 2*fillDiskMB, fillDiskMB, r.ExitCode, r.Stderr)
	}
	if grew := dataDirUse(t) - use; grew > (fillDiskMB+16)<<20 {
		t.Errorf("the node's data directory grew by %d MiB for a %d MiB sandbox", grew>>20, fillDiskMB)
	}
	x, err := nb.sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("dd if=/dev/zero of=/tmp/nb bs=1M count=8 && rm /tmp/nb"))
	if err != nil || x.ExitCode != 0 {
		t.Errorf("the neighbour cannot write: %v %q", err, x.GetStderr())
	}
	answers(t, sb, "filling its disk")
}

func TestAMicroVMReadingThePageTablesOfProcReadsItsOwnKernels(t *testing.T) {
	srv(t)
	nb := newNeighbour(t)
	sb := microVM(t)
	// DSec's field report: an agent crashed a host kernel through
	// /proc/kpagecgroup. A container sees it masked; a microVM's guest is
	// root over a kernel of its own, whose files these are: reading all
	// of them reaches no host page, and the machine goes on.
	r, err := attack(t, sb, nb, "for f in /proc/kpagecgroup /proc/kpageflags /proc/kpagecount; do cat $f > /dev/null; echo $f $?; done", time.Minute, 2*time.Second)
	taskFailure(t, "reading /proc/kpage*", err)
	t.Logf("%s%s", r.Stdout, r.Stderr)
	answers(t, sb, "reading /proc/kpage*")
}
