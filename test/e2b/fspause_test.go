package e2b_test

import (
	"testing"

	"github.com/opendsec/dsec/internal/dsectest"
)

// TestFilesystemPause checks E2B's filesystem-only pause (keepMemory:
// false) on every kind: a container cold-boots on its kept files; kinds
// that cannot pause without their memory refuse it (400, naming the kind).
func TestFilesystemPause(t *testing.T) {
	needNode(t)
	s := server(t)
	for kind := range kinds(t, s) {
		t.Run(kind, func(t *testing.T) {
			if ok, why := dsectest.VMReady(); kind == "vm" && !ok {
				t.Skipf("the server has no VM image to start: %s", why)
			}
			if kind == "container" {
				scenario(t, s, "filesystem-pause", templates(kind)...)
				return
			}
			scenario(t, s, "filesystem-pause-refused", templates(kind)...)
		})
	}
}
