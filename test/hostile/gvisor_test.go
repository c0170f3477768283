package hostile

import (
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
