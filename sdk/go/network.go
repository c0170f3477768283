package dsec

import (
	"context"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Policy is an egress sandbox's network policy: what no rule allows is
// denied, and the most specific rule decides (api/dsec/v1/sandbox.proto,
// NetworkPolicy, says exactly how). A zero Policy denies everything.
type Policy struct {
	// Allow and Deny list destinations: IPv4 addresses or CIDRs
	// ("203.0.113.7", "151.101.0.0/16"), host names ("pypi.org"),
	// wildcards ("*.pypi.org": every name below; "*": every name).
	Allow, Deny []string
	// Credentials are injected by the node's egress proxy into the
	// sandbox's plain-HTTP requests to their hosts; the sandbox never
	// sees them.
	Credentials []Credential
}

// Credential is a brokered credential: Name (one of the server's
// configured credentials) or Host, Header (default Authorization) and
// Value.
type Credential struct {
	Name, Host, Header, Value string
}

func (p *Policy) proto() *dsecv1.NetworkPolicy {
	if p == nil {
		return nil
	}
	out := &dsecv1.NetworkPolicy{}
	for _, d := range p.Allow {
		out.Rules = append(out.Rules, &dsecv1.NetworkRule{Action: "allow", Destination: d})
	}
	for _, d := range p.Deny {
		out.Rules = append(out.Rules, &dsecv1.NetworkRule{Action: "deny", Destination: d})
	}
	for _, c := range p.Credentials {
		out.Credentials = append(out.Credentials, &dsecv1.BrokeredCredential{Name: c.Name, Host: c.Host, Header: c.Header, Value: c.Value})
	}
	return out
}

// SetNetworkPolicy puts p in force for the sandbox's new connections
// (open ones it denies are cut); nil lifts every restriction. It returns
// the network now, credentials without values.
func (s *Sandbox) SetNetworkPolicy(ctx context.Context, p *Policy) (*dsecv1.Network, error) {
	r, err := s.c.raw.SetNetworkPolicy(ctx, connect.NewRequest(&dsecv1.SetNetworkPolicyRequest{Id: s.ID, Policy: p.proto()}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// NetworkPolicy returns the sandbox's network now: its mode and policy
// (credentials without values).
func (s *Sandbox) NetworkPolicy(ctx context.Context) (*dsecv1.Network, error) {
	r, err := s.c.raw.GetNetworkPolicy(ctx, connect.NewRequest(&dsecv1.GetNetworkPolicyRequest{Id: s.ID}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// NetworkLog returns the sandbox's connection log after record afterSeq:
// every connection it opened, allowed or denied, oldest first.
func (s *Sandbox) NetworkLog(ctx context.Context, afterSeq uint64) (*dsecv1.GetNetworkLogResponse, error) {
	r, err := s.c.raw.GetNetworkLog(ctx, connect.NewRequest(&dsecv1.GetNetworkLogRequest{SandboxId: s.ID, AfterSeq: afterSeq}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}
