package e2b_test

import "testing"

// TestVolumes drives E2B's Volume class and volumeMounts (scenarios.mjs:
// volumes) on every kind that mounts volumes, and checks that the others
// refuse volumeMounts with a 400 naming the kind (volumes-refused). The
// SDK sends the content API to E2B_VOLUME_API_URL.
func TestVolumes(t *testing.T) {
	needNode(t)
	s := server(t)
	for kind, caps := range kinds(t, s) {
		t.Run(kind, func(t *testing.T) {
			env := append(templates(kind), "E2B_VOLUME_API_URL="+s.URL)
			if caps["volumes"] {
				t.Run("the Volume class and volumeMounts work as E2B's", func(t *testing.T) { scenario(t, s, "volumes", env...) })
				return
			}
			t.Run("volumeMounts are refused with a 400 naming the kind", func(t *testing.T) { scenario(t, s, "volumes-refused", env...) })
		})
	}
}
