package e2b

import (
	"net/http"
	"net/netip"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
)

// networkJSON is E2B's SandboxNetworkConfig (a create's "network") and
// the body of PUT /sandboxes/{id}/network (with allowInternetAccess).
type networkJSON struct {
	// AllowOut are destinations allowed: IP addresses, CIDR blocks, host
	// names and "*.name" wildcards. They take precedence over DenyOut.
	AllowOut []string `json:"allowOut"`
	// DenyOut are IP addresses and CIDR blocks denied.
	DenyOut []string `json:"denyOut"`
	// AllowPublicTraffic false makes the sandbox's ports need its traffic
	// access token; MaskRequestHost is the Host header requests to them
	// carry (ports.go).
	AllowPublicTraffic *bool   `json:"allowPublicTraffic"`
	MaskRequestHost    *string `json:"maskRequestHost"`
	// AllowInternetAccess is the PUT body's switch (a create has it at
	// the top level): false denies what AllowOut does not allow.
	AllowInternetAccess *bool `json:"allowInternetAccess"`
}

func (n *networkJSON) hasRules() bool { return n != nil && len(n.AllowOut)+len(n.DenyOut) > 0 }

// e2bPolicy is the dsec policy of E2B's rules (nil: unrestricted egress).
//
// E2B allows what no rule denies, lets AllowOut win over DenyOut whatever
// their sizes, and treats internet access off as DenyOut 0.0.0.0/0. In
// dsec's terms (what no rule allows is denied; the most specific rule
// wins): "allow *" and "allow 0.0.0.0/0" unless everything is denied
// (then "deny 0.0.0.0/0": names no rule allows do not even resolve), each
// DenyOut block not inside an AllowOut block, and each AllowOut entry as
// an allow rule, more specific than what it opens.
func e2bPolicy(allowOut, denyOut []string, internet bool) (*dsecv1.NetworkPolicy, error) {
	if internet && len(allowOut) == 0 && len(denyOut) == 0 {
		return nil, nil
	}
	var allowed []netip.Prefix
	for _, a := range allowOut {
		if p, ok := prefixOf(a); ok {
			allowed = append(allowed, p)
		}
	}
	denyAll := !internet
	var denies []string
	for _, d := range denyOut {
		p, ok := prefixOf(d)
		if !ok {
			return nil, errdefs.Invalid("network.denyOut %q: want an IP address or CIDR block (domain names are for allowOut only)", clip(d))
		}
		covered := false
		for _, a := range allowed {
			covered = covered || a.Bits() <= p.Bits() && a.Contains(p.Addr())
		}
		switch {
		case covered:
		case p.Bits() == 0:
			denyAll = true
		default:
			denies = append(denies, p.String())
		}
	}
	pol := &dsecv1.NetworkPolicy{}
	rule := func(action, dest string) {
		pol.Rules = append(pol.Rules, &dsecv1.NetworkRule{Action: action, Destination: dest})
	}
	if denyAll {
		rule("deny", "0.0.0.0/0")
	} else {
		rule("allow", "*")
		rule("allow", "0.0.0.0/0")
	}
	for _, d := range denies {
		rule("deny", d)
	}
	for _, a := range allowOut {
		rule("allow", a)
	}
	return pol, nil
}

// prefixOf reads an IPv4 address or CIDR block.
func prefixOf(s string) (netip.Prefix, bool) {
	if p, err := netip.ParsePrefix(s); err == nil && p.Addr().Is4() {
		return p.Masked(), true
	}
	if a, err := netip.ParseAddr(s); err == nil && a.Is4() {
		return netip.PrefixFrom(a, 32), true
	}
	return netip.Prefix{}, false
}

// createNetwork is the network of a create: allowInternetAccess (nil:
// absent) and E2B's network config.
func (f *Facade) createNetwork(internet *bool, nw *networkJSON) (*dsecv1.Network, error) {
	if !nw.hasRules() {
		out := &dsecv1.Network{Mode: f.cfg.DefaultNetwork}
		if internet != nil {
			out.Mode = "none"
			if *internet {
				out.Mode = "egress"
			}
		}
		return out, nil
	}
	pol, err := e2bPolicy(nw.AllowOut, nw.DenyOut, internet == nil || *internet)
	if err != nil {
		return nil, err
	}
	return &dsecv1.Network{Mode: "egress", Policy: pol}, nil
}

// updateNetwork is PUT /sandboxes/{id}/network: the rules replace the
// sandbox's (absent ones are cleared). The sandbox must have been created
// with internet access or rules.
func (f *Facade) updateNetwork(w http.ResponseWriter, r *http.Request, _ string) {
	var in networkJSON
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	pol, err := e2bPolicy(in.AllowOut, in.DenyOut, in.AllowInternetAccess == nil || *in.AllowInternetAccess)
	if err != nil {
		apiError(w, err)
		return
	}
	id := r.PathValue("id")
	n, _, err := f.live(r.Context(), id)
	if err != nil {
		apiError(w, err)
		return
	}
	if _, err := apiserver.Do(r.Context(), n, &dsecv1.SetNetworkPolicyRequest{Id: id, Policy: pol}, apiserver.Node.SetNetworkPolicy); err != nil {
		apiError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
