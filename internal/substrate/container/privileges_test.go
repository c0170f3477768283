package container

import (
	"slices"
	"testing"

	"github.com/opendsec/dsec/internal/substrate"
)

func TestPrivileges(t *testing.T) {
	ns := &userNS{host: 1 << 30}
	tests := []struct {
		name       string
		spec       substrate.Spec
		ns         *userNS
		noNewPrivs bool
		netRaw     bool // CAP_NET_RAW in the bounding set
		sysAdmin   bool // CAP_SYS_ADMIN held
	}{
		{name: "a sandbox keeps no_new_privs by default", ns: ns, noNewPrivs: true, netRaw: true},
		{name: "an image that allows escalation runs without no_new_privs in a user namespace", spec: substrate.Spec{PrivilegeEscalation: true}, ns: ns},
		{name: "without a user namespace (host root) escalation is not allowed", spec: substrate.Spec{PrivilegeEscalation: true}, noNewPrivs: true, netRaw: true},
		{name: "function workers never escalate", spec: substrate.Spec{PrivilegeEscalation: true, MountNamespaces: true}, ns: ns, noNewPrivs: true, netRaw: true, sysAdmin: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			caps, bounding, nnp := privileges(&tt.spec, tt.ns)
			if nnp != tt.noNewPrivs {
				t.Fatalf("no_new_privs %v, want %v", nnp, tt.noNewPrivs)
			}
			if got := slices.Contains(bounding, "CAP_NET_RAW"); got != tt.netRaw {
				t.Errorf("CAP_NET_RAW in the bounding set: %v, want %v", got, tt.netRaw)
			}
			if got := slices.Contains(caps, "CAP_SYS_ADMIN"); got != tt.sysAdmin {
				t.Errorf("CAP_SYS_ADMIN held: %v, want %v", got, tt.sysAdmin)
			}
			for _, c := range caps {
				if !slices.Contains(bounding, c) {
					t.Errorf("%s is held but not in the bounding set", c)
				}
			}
			if !nnp && !slices.Equal(caps, bounding) {
				// An exec as root gets the bounding set: without
				// no_new_privs it must be exactly root's capabilities.
				t.Errorf("without no_new_privs the bounding set %v is not root's capabilities %v", bounding, caps)
			}
		})
	}
}
