package agent_test

import (
	"os/exec"
	"strings"
	"testing"
)

// The in-sandbox agent runs in every sandbox: it links no HTTP server or
// Connect code (its memory counts against every sandbox on a node).
func TestTheAgentLinksNoHTTPOrConnect(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command (go list)")
	}
	out, err := exec.Command(goBin, "list", "-deps", "github.com/opendsec/dsec/cmd/dsec-guest").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, d := range strings.Fields(string(out)) {
		if d == "net/http" || strings.HasPrefix(d, "connectrpc.com/") || d == "github.com/opendsec/dsec/internal/errwire" {
			t.Errorf("dsec-guest depends on %s", d)
		}
	}
}
