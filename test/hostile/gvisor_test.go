package hostile

import (
	"strconv"
	"strings"
	"testing"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestAGVisorSandboxHasNoNetworkButLoopback: runsc on this node cannot
// join the node's network namespaces (docs/substrates/container.md), so a
// sandbox of runtime gvisor has gVisor's own loopback only, and asking for
// egress is refused as unimplemented, never silently granted or dropped.
func TestAGVisorSandboxHasNoNetworkButLoopback(t *testing.T) {
	if why := gvisorMissing(t); why != "" {
		t.Skip("no gvisor runtime: " + why)
	}
	c := client(t)
	_, err := c.Create(ctxFor(t, time.Minute), dsec.CreateOptions{Image: "busybox", Runtime: "gvisor", Network: "egress", TTL: time.Minute})
	if kindOf(err) != "unimplemented" || infraOf(err) {
		t.Fatalf("an egress sandbox of runtime gvisor: %v (kind %q, infra %v); want unimplemented", err, kindOf(err), infraOf(err))
	}
	sb := create(t, c, dsec.CreateOptions{Runtime: "gvisor"})
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("ip -o link | grep -v ' lo:' | grep -c . ; ip -o addr | grep -v ' lo ' | grep -c inet"))
	if err != nil {
		t.Fatal(err)
	}
	if string(r.Stdout) != "0\n0\n" {
		t.Errorf("interfaces or addresses besides loopback: %q %q", r.Stdout, r.Stderr)
	}
}

// TestTheAgentIsNotVisibleInsideAGVisorSandbox: gVisor's /proc makes no
// ptrace access check, so the agent must have no entry in any /proc a
// workload can see: not in the one at /proc, nor below it once unmounted,
// nor in a procfs the workload mounts (it may not: no CAP_SYS_ADMIN).
func TestTheAgentIsNotVisibleInsideAGVisorSandbox(t *testing.T) {
	if why := gvisorMissing(t); why != "" {
		t.Skip("no gvisor runtime: " + why)
	}
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: "gvisor"})
	// Every process's command line, as the sandbox's ps and ls see them.
	const list = `for p in /proc/[0-9]*; do echo "$p: $(tr '\0' ' ' < $p/cmdline 2>/dev/null)"; done; ps -o pid,args`
	for _, step := range []struct{ name, cmd string }{
		{"/proc", list},
		{"/proc's descriptors of PID 1", "ls -l /proc/1/fd/ | grep -v -e '/dev/null' -e '^total' || true"},
		{"/proc after umount", "umount /proc || umount -l /proc; " + list},
		{"a procfs the workload mounts", "mkdir -p /tmp/p && mount -t proc proc /tmp/p && " + `for p in /tmp/p/[0-9]*; do echo "$p: $(tr '\0' ' ' < $p/cmdline 2>/dev/null)"; done`},
		{"the capabilities of root", "grep Cap /proc/self/status"},
	} {
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(step.cmd))
		if err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		t.Logf("%s: %s%s", step.name, r.Stdout, r.Stderr)
		out := string(r.Stdout)
		if strings.Contains(out, "-listen") || strings.Contains(out, "socket:") || strings.Contains(out, "pipe:") || strings.Contains(out, "dsec-forker") {
			t.Errorf("%s shows the agent: %q", step.name, out)
		}
		if i := strings.Index(out, "CapBnd:"); i >= 0 {
			if v, err := strconv.ParseUint(strings.Fields(out[i+len("CapBnd:"):])[0], 16, 64); err != nil || v&(1<<21) != 0 {
				t.Errorf("a workload may gain CAP_SYS_ADMIN: %q", out)
			}
		}
	}
	nb.check(t)
}
