package e2b

import (
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

func rulesOf(p *dsecv1.NetworkPolicy) string {
	if p == nil {
		return "unrestricted"
	}
	var out []string
	for _, r := range p.Rules {
		out = append(out, r.Action+" "+r.Destination)
	}
	return strings.Join(out, ", ")
}

func TestE2BNetworkRulesBecomeAPolicy(t *testing.T) {
	f := facade(t, Config{})
	for _, c := range []struct {
		name     string
		internet *bool
		nw       *networkJSON
		mode     string
		rules    string
		wantErr  string
	}{
		{name: "no rules and no switch is the default network", mode: "none", rules: "unrestricted"},
		{name: "internet access without rules is unrestricted egress", internet: ptr(true), mode: "egress", rules: "unrestricted"},
		{name: "no internet access without rules is no network", internet: ptr(false), nw: &networkJSON{}, mode: "none", rules: "unrestricted"},
		{name: "denying everything but a list is an allow-list",
			nw:   &networkJSON{DenyOut: []string{"0.0.0.0/0"}, AllowOut: []string{"1.1.1.1", "8.8.8.0/24", "pypi.org", "*.pythonhosted.org"}},
			mode: "egress", rules: "deny 0.0.0.0/0, allow 1.1.1.1, allow 8.8.8.0/24, allow pypi.org, allow *.pythonhosted.org"},
		{name: "no internet access with an allow list is an allow-list", internet: ptr(false), nw: &networkJSON{AllowOut: []string{"pypi.org"}},
			mode: "egress", rules: "deny 0.0.0.0/0, allow pypi.org"},
		{name: "denying a block allows the rest",
			nw:   &networkJSON{DenyOut: []string{"203.0.113.0/24", "198.51.100.7"}},
			mode: "egress", rules: "allow *, allow 0.0.0.0/0, deny 203.0.113.0/24, deny 198.51.100.7/32"},
		{name: "an allowed block wins over a denied block inside it",
			nw:   &networkJSON{AllowOut: []string{"8.8.0.0/16"}, DenyOut: []string{"8.8.8.8", "9.9.9.0/24"}},
			mode: "egress", rules: "allow *, allow 0.0.0.0/0, deny 9.9.9.0/24, allow 8.8.0.0/16"},
		{name: "allowing everything wins over denying everything",
			nw:   &networkJSON{AllowOut: []string{"0.0.0.0/0"}, DenyOut: []string{"0.0.0.0/0"}},
			mode: "egress", rules: "allow *, allow 0.0.0.0/0, allow 0.0.0.0/0"},
		{name: "a domain name is not a deny rule", nw: &networkJSON{DenyOut: []string{"evil.test"}}, wantErr: "denyOut"},
		{name: "a masked request host must be a host", nw: &networkJSON{MaskRequestHost: ptr("evil.test/${PORT}")}, wantErr: "maskRequestHost"},
	} {
		t.Run(c.name, func(t *testing.T) {
			spec, err := f.spec(&newSandbox{AllowInternetAccess: c.internet, Network: c.nw}, defaultTimeoutV2)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("got %v, want an error about %s", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if spec.Network.Mode != c.mode || rulesOf(spec.Network.Policy) != c.rules {
				t.Fatalf("mode %q, rules %q; want %q, %q", spec.Network.Mode, rulesOf(spec.Network.Policy), c.mode, c.rules)
			}
		})
	}
}

func TestAnE2BNetworkUpdateClearsWhatItOmits(t *testing.T) {
	for _, c := range []struct {
		name  string
		in    networkJSON
		rules string
	}{
		{"nothing is unrestricted", networkJSON{}, "unrestricted"},
		{"no internet access is nothing", networkJSON{AllowInternetAccess: ptr(false)}, "deny 0.0.0.0/0"},
		{"an allow list", networkJSON{AllowInternetAccess: ptr(false), AllowOut: []string{"pypi.org"}}, "deny 0.0.0.0/0, allow pypi.org"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := e2bPolicy(c.in.AllowOut, c.in.DenyOut, c.in.AllowInternetAccess == nil || *c.in.AllowInternetAccess)
			if err != nil || rulesOf(p) != c.rules {
				t.Fatalf("%q %v, want %q", rulesOf(p), err, c.rules)
			}
		})
	}
}
