package e2b_test

import (
	"testing"

	"github.com/opendsec/dsec/internal/dsectest"
)

// TestSDKFilesLikeEnvd drives the behaviours of envd's files API that E2B's
// own SDK tests check, on every kind: relative paths in the user's home,
// ownership of what a user makes, remove of a missing path, symlinks,
// file metadata (envd 0.6.2), entries in watch events (0.6.3) and the
// error of a sandbox killed under a running command.
func TestSDKFilesLikeEnvd(t *testing.T) {
	needNode(t)
	s := server(t)
	tests := []struct{ scenario, name string }{
		{"relative-paths", "relative paths resolve in the user's home and what a user makes is its own"},
		{"remove-missing", "remove of a missing path succeeds"},
		{"symlink-info", "a symlink is described by what it resolves to"},
		{"file-metadata", "uploads set file metadata that every description of the file reports"},
		{"watch-entry", "watch events carry the entry when asked"},
		{"killed-during-run", "a sandbox killed under a command or a watch is reported as killed"},
	}
	for kind := range kinds(t, s) {
		if kind == "vm" {
			// The facade's files paths, the same for every kind; full
			// VMs run TestSDK's files scenario (see there).
			continue
		}
		t.Run(kind, func(t *testing.T) {
			t.Parallel() // kinds side by side: a machine kind waits on its guests
			if ok, why := dsectest.VMReady(); kind == "vm" && !ok {
				t.Skipf("the server has no VM image to start: %s", why)
			}
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					scenario(t, s, tt.scenario, templates(kind)...)
				})
			}
		})
	}
}
