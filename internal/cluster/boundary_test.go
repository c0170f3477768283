package cluster_test

import (
	"os/exec"
	"strings"
	"testing"
)

// The control plane never depends on node-side code (drivers, images,
// network, the node agent itself), and the product binary never carries
// the simulated nodes of tests and benchmarks.
func TestImportBoundaries(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command (go list)")
	}
	const mod = "github.com/opendsec/dsec/"
	nodeSide := []string{"internal/node", "internal/clusternode", "internal/substrate", "internal/image", "internal/network", "internal/mountns", "internal/guest", "internal/trajectory", "internal/gateway"}
	cases := []struct {
		pkg       string
		forbidden []string
	}{
		{"internal/apiserver", nodeSide},
		{"internal/cluster", nodeSide},
		{"internal/placement", nodeSide},
		{"internal/session", nodeSide},
		{"internal/sandboxid", nodeSide},
		{"internal/e2b", nodeSide},
		{"cmd/dsec", []string{"internal/cluster/clustertest", "internal/dsectest"}},
	}
	for _, c := range cases {
		t.Run(c.pkg+" keeps its boundary", func(t *testing.T) {
			out, err := exec.Command(goBin, "list", "-deps", mod+c.pkg).CombinedOutput()
			if err != nil {
				t.Fatalf("go list: %v\n%s", err, out)
			}
			deps := strings.Fields(string(out))
			if len(deps) < 2 {
				t.Fatalf("go list found no dependencies of %s", c.pkg)
			}
			for _, d := range deps {
				for _, f := range c.forbidden {
					if d == mod+f || strings.HasPrefix(d, mod+f+"/") {
						t.Errorf("%s depends on %s", c.pkg, d)
					}
				}
			}
		})
	}
}
