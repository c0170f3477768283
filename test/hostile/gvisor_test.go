package hostile

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestAGVisorSandboxesNetworkIsGVisorsOwn: under gVisor the sandbox's
// network stack is gVisor's, never the host kernel's. Network none is its
// loopback only; egress puts it on the sandbox's veth (runsc
// --network=sandbox, started where this runsc accepts the namespace: see
// docs/substrates/container.md), with the address and default route the
// node gave the namespace. (What an egress sandbox under gVisor can and
// cannot reach is in the egress tests, as for crun.)
func TestAGVisorSandboxesNetworkIsGVisorsOwn(t *testing.T) {
	needGVisor(t)
	const links = "ip -o link | grep -v ' lo:' | grep -c . ; ip -o -4 addr | grep -v ' lo ' | grep -c inet; ip route | grep -c '^default'"
	t.Run("network none: loopback only", func(t *testing.T) {
		sb := create(t, client(t), dsec.CreateOptions{Runtime: "gvisor"})
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(links))
		if err != nil {
			t.Fatal(err)
		}
		if string(r.Stdout) != "0\n0\n0\n" {
			t.Errorf("interfaces, addresses or routes besides loopback: %q %q", r.Stdout, r.Stderr)
		}
	})
	t.Run("egress: the sandbox's veth, its address and route, in gVisor's stack", func(t *testing.T) {
		egressSrv(t)
		sb := create(t, egressClient(t, keyA), dsec.CreateOptions{Runtime: "gvisor", Network: "egress"})
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(links+"; uname -r; cat /proc/version"))
		if err != nil {
			t.Fatal(err)
		}
		out := string(r.Stdout)
		if !strings.HasPrefix(out, "1\n1\n1\n") {
			t.Errorf("want one interface besides loopback, with an address and the default route: %q %q", out, r.Stderr)
		}
		// gVisor's kernel answers uname, not the host's.
		var host unix.Utsname
		unix.Uname(&host)
		if release := unix.ByteSliceToString(host.Release[:]); strings.Contains(out, release) {
			t.Errorf("the sandbox runs on the host's kernel %s: %q", release, out)
		}
	})
}

// TestTheAgentIsNotVisibleInsideAGVisorSandbox: gVisor's /proc makes no
// ptrace access check, so the agent must have no entry in any /proc a
// workload can see: not in the one at /proc, nor below it once unmounted,
// nor in a procfs the workload mounts (it may not: no CAP_SYS_ADMIN).
func TestTheAgentIsNotVisibleInsideAGVisorSandbox(t *testing.T) {
	needGVisor(t)
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
