package e2b_test

import "testing"

// TestFilesystemPause checks E2B's filesystem-only pause (keepMemory:
// false): a container cold-boots on its kept files; a microVM, which
// cannot pause without its memory, refuses it (400, naming the kind).
func TestFilesystemPause(t *testing.T) {
	needNode(t)
	s := server(t)
	for kind := range kinds(t, s) {
		if kind == "vm" {
			// The refusal is the node's, for any instance that cannot
			// stop (substrate.Stopper), and the microVM shows it; a full
			// VM would cost a boot under TCG for the same answer.
			continue
		}
		t.Run(kind, func(t *testing.T) {
			if kind == "container" {
				scenario(t, s, "filesystem-pause", templates(kind)...)
				return
			}
			scenario(t, s, "filesystem-pause-refused", templates(kind)...)
		})
	}
}
