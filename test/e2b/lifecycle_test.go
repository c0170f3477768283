package e2b_test

import (
	"testing"

	"github.com/opendsec/dsec/internal/dsectest"
)

// TestSDKLifecycle runs the pause, lifecycle, snapshot and listing
// scenarios for every kind that can pause (and snapshot).
func TestSDKLifecycle(t *testing.T) {
	needNode(t)
	s := server(t)
	// vm: as in TestSDK (full VMs run the snapshots, their own path; a
	// pause at the timeout is the node's, on the driver's pause that
	// TestSDK's pause-and-connect runs on them).
	tests := []struct {
		scenario, name string
		needs          func(caps map[string]bool) bool
		vm             bool
	}{
		{"pause-stays-paused", "a paused sandbox answers 502 until connect resumes it with its state", pauses, false},
		{"auto-pause", "lifecycle onTimeout pause pauses the sandbox at its timeout and only connect resumes it", pauses, false},
		{"auto-resume", "with autoResume the next request resumes a sandbox paused at its timeout", pauses, false},
		{"snapshots", "snapshots are created, listed, started from as templates and deleted", snapshots, true},
		{"list-order", "Sandbox.list is newest first and its pages hold when a sandbox goes", nil, false},
	}
	for kind, caps := range kinds(t, s) {
		t.Run(kind, func(t *testing.T) {
			t.Parallel() // kinds side by side: a machine kind waits on its guests
			if ok, why := dsectest.VMReady(); kind == "vm" && !ok {
				t.Skipf("the server has no VM image to start: %s", why)
			}
			env := templates(kind)
			// Sandboxes of the machine kinds start and pause slowly
			// without KVM: give them time before their timeout.
			if kind == "container" {
				env = append(env, "PAUSE_TIMEOUT_MS=3000")
			} else {
				env = append(env, "PAUSE_TIMEOUT_MS=20000")
			}
			for _, tt := range tests {
				if kind == "vm" && !tt.vm {
					continue
				}
				t.Run(tt.name, func(t *testing.T) {
					if tt.needs != nil && !tt.needs(caps) {
						t.Skipf("kind %s cannot do what %s needs", kind, tt.scenario)
					}
					scenario(t, s, tt.scenario, env...)
				})
			}
		})
	}
}

func pauses(caps map[string]bool) bool    { return caps["pause"] }
func snapshots(caps map[string]bool) bool { return caps["snapshot"] || caps["memory_snapshot"] }
