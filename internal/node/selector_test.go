package node

import "testing"

func TestSelectors(t *testing.T) {
	labels := map[string]string{"job": "run42", "step": "7"}
	tests := []struct {
		sel   string
		match bool
	}{
		{"", true},
		{"job=run42", true},
		{"job==run42", true},
		{"job=run43", false},
		{"job=run42,step=7", true},
		{"job=run42,step=8", false},
		{"step!=8", true},
		{"step!=7", false},
		{"job", true},
		{"group", false},
		{"!group", true},
		{"!job", false},
		{" job = run42 , step != 3 ", true},
	}
	for _, tt := range tests {
		t.Run("selector "+tt.sel, func(t *testing.T) {
			s, err := ParseSelector(tt.sel)
			if err != nil {
				t.Fatal(err)
			}
			if got := s.Matches(labels); got != tt.match {
				t.Fatalf("matches %v, want %v", got, tt.match)
			}
		})
	}
	for _, bad := range []string{"=v", "bad key=1", "a=b,,"} {
		if _, err := ParseSelector(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestSandboxIDsEncodeTheirNode(t *testing.T) {
	n := &Node{cfg: Config{Name: "node-7"}}
	id := n.newID()
	got, err := NodeOf(id)
	if err != nil || got != "node-7" {
		t.Fatalf("NodeOf(%q) = %q, %v", id, got, err)
	}
	for _, bad := range []string{"", "x", "short-local", "AAAAAAAAAAAAAAAA-local", "aaaaaaaaaaaaaaaa-", "aaaaaaaaaaaaaaaa-Bad_Node", "aaaaaaaaaaaaaaa1-local"} {
		if _, err := NodeOf(bad); err == nil {
			t.Errorf("NodeOf(%q) accepted", bad)
		}
	}
}
