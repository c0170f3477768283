package node

import (
	"context"
	"slices"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
)

// NamedCredential is a brokered credential of the node's configuration,
// which a policy names (BrokeredCredential.name) instead of carrying the
// secret.
type NamedCredential struct {
	network.Credential
	// Projects may name it (empty: every project).
	Projects []string
}

// policyOf turns an API policy into the network's, for project: rules
// parsed, credentials by name resolved. nil is no policy.
func (n *Node) policyOf(project string, p *dsecv1.NetworkPolicy) (*network.Policy, error) {
	if p == nil {
		return nil, nil
	}
	if len(p.Rules) > network.MaxRules {
		return nil, errdefs.Invalid("at most %d network rules", network.MaxRules)
	}
	out := &network.Policy{Rules: []network.Rule{}}
	for _, r := range p.Rules {
		rule, err := network.ParseRule(r.GetAction(), r.GetDestination())
		if err != nil {
			return nil, err
		}
		out.Rules = append(out.Rules, rule)
	}
	for _, c := range p.Credentials {
		if c.GetName() == "" {
			out.Credentials = append(out.Credentials, network.Credential{Host: c.GetHost(), Header: c.GetHeader(), Value: c.GetValue()})
			continue
		}
		nc, ok := n.cfg.Credentials[c.GetName()]
		if !ok || len(nc.Projects) > 0 && !slices.Contains(nc.Projects, project) {
			// The same answer for a name of another project's: no oracle.
			return nil, errdefs.Invalid("no brokered credential named %q", c.GetName())
		}
		if c.GetHost() != "" || c.GetHeader() != "" || c.GetValue() != "" {
			return nil, errdefs.Invalid("brokered credential %q: a named credential takes no host, header or value", c.GetName())
		}
		out.Credentials = append(out.Credentials, nc.Credential)
	}
	if err := out.Validate(); err != nil {
		return nil, err
	}
	return out, nil
}

// normalizeNetwork checks a create's network (its mode already valid)
// and its bandwidth limit.
func (n *Node) normalizeNetwork(project string, spec *dsecv1.SandboxSpec) error {
	if spec.Network.Mode == network.ModeNone && spec.Network.Policy != nil {
		return errdefs.Invalid("network.policy needs network.mode egress")
	}
	if _, err := n.policyOf(project, spec.Network.Policy); err != nil {
		return err
	}
	bw := spec.Resources.GetBandwidthMbps()
	if bw < 0 || bw > network.MaxBandwidthMbps {
		return errdefs.Invalid("resources.bandwidth_mbps %d out of range [0, %d]", bw, network.MaxBandwidthMbps)
	}
	if bw > 0 && spec.Network.Mode != network.ModeEgress {
		return errdefs.Invalid("resources.bandwidth_mbps needs network.mode egress")
	}
	return nil
}

// netOptions are the network a normalized spec asks for.
func (n *Node) netOptions(project string, spec *dsecv1.SandboxSpec) (network.Options, error) {
	p, err := n.policyOf(project, spec.Network.GetPolicy())
	if err != nil {
		return network.Options{}, err
	}
	return network.Options{Mode: spec.Network.GetMode(), Policy: p, BandwidthMbps: spec.Resources.GetBandwidthMbps(), Shared: len(spec.Sidecars) > 0}, nil
}

// redacted is a network as answers show it: credentials without values.
func redacted(nw *dsecv1.Network) *dsecv1.Network {
	if !hasSecrets(nw) {
		return nw
	}
	out := proto.Clone(nw).(*dsecv1.Network)
	for _, c := range out.Policy.Credentials {
		c.Value = ""
	}
	return out
}

func hasSecrets(nw *dsecv1.Network) bool {
	for _, c := range nw.GetPolicy().GetCredentials() {
		if c.GetValue() != "" {
			return true
		}
	}
	return false
}

// networkLocked is the sandbox's network now (values included). s.mu is
// held.
func (s *sandbox) networkLocked() *dsecv1.Network {
	if s.network != nil {
		return s.network
	}
	return s.spec.GetNetwork()
}

// shownSpecLocked is the sandbox's spec as answers show it: the network
// now, without secrets. s.mu is held.
func (s *sandbox) shownSpecLocked() *dsecv1.SandboxSpec {
	if s.network == nil && !hasSecrets(s.spec.GetNetwork()) {
		return s.spec
	}
	spec := proto.Clone(s.spec).(*dsecv1.SandboxSpec)
	spec.Network = redacted(s.networkLocked())
	return spec
}

// currentSpec is a copy of the sandbox's spec with its network now
// (values included), for the sandboxes made from it (forks, replays).
func (s *sandbox) currentSpec() *dsecv1.SandboxSpec {
	s.mu.Lock()
	defer s.mu.Unlock()
	spec := proto.Clone(s.spec).(*dsecv1.SandboxSpec)
	if s.network != nil {
		spec.Network = proto.Clone(s.network).(*dsecv1.Network)
	}
	return spec
}

// SetNetworkPolicy puts a new policy in force for an egress sandbox.
func (n *Node) SetNetworkPolicy(ctx context.Context, req *dsecv1.SetNetworkPolicyRequest) (*dsecv1.Network, error) {
	s, err := n.lookup(ctx, req.GetId())
	if err != nil {
		return nil, err
	}
	p, err := n.policyOf(s.project, req.GetPolicy())
	if err != nil {
		return nil, err
	}
	s.touch()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.endingLocked(); err != nil {
		return nil, err
	}
	if s.net == nil || s.net.Mode != network.ModeEgress {
		return nil, errdefs.Invalid("sandbox %s has no egress (network mode %q): a policy needs egress", s.id, s.spec.GetNetwork().GetMode())
	}
	if err := n.net.SetPolicy(s.net, p); err != nil {
		return nil, err
	}
	s.network = &dsecv1.Network{Mode: network.ModeEgress, Policy: proto.Clone(req.GetPolicy()).(*dsecv1.NetworkPolicy)}
	if req.GetPolicy() == nil {
		s.network.Policy = nil
	}
	if err := n.persistLocked(s); err != nil {
		return nil, err
	}
	return redacted(s.network), nil
}

// GetNetworkPolicy returns a sandbox's network now.
func (n *Node) GetNetworkPolicy(ctx context.Context, id string) (*dsecv1.Network, error) {
	s, err := n.lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return redacted(s.networkLocked()), nil
}

// GetNetworkLog reads a sandbox's connection log.
func (n *Node) GetNetworkLog(ctx context.Context, req *dsecv1.GetNetworkLogRequest) (*dsecv1.GetNetworkLogResponse, error) {
	s, err := n.lookup(ctx, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if req.GetLimit() < 0 {
		return nil, errdefs.Invalid("limit must not be negative")
	}
	recs, dropped := n.net.NetworkLog(s.net, req.GetAfterSeq(), int(req.GetLimit()))
	out := &dsecv1.GetNetworkLogResponse{Dropped: dropped, Records: make([]*dsecv1.ConnectionRecord, 0, len(recs))}
	for _, r := range recs {
		v := "deny"
		if r.Allow {
			v = "allow"
		}
		out.Records = append(out.Records, &dsecv1.ConnectionRecord{
			Seq: r.Seq, At: timestamppb.New(r.At), Protocol: r.Protocol, Address: r.Addr.String(), Port: uint32(r.Port),
			Host: r.Host, Verdict: v, Reason: r.Reason, Brokered: r.Brokered,
		})
	}
	return out, nil
}

// networkRecord is the persisted form of a sandbox's network now, when a
// SetNetworkPolicy changed it.
func networkRecord(nw *dsecv1.Network) []byte {
	if nw == nil {
		return nil
	}
	b, _ := protojson.Marshal(nw)
	return b
}

func networkFromRecord(b []byte) *dsecv1.Network {
	if len(b) == 0 {
		return nil
	}
	nw := &dsecv1.Network{}
	if protojson.Unmarshal(b, nw) != nil {
		return nil
	}
	return nw
}

var _ = time.Now

// attachmentJSON is the persisted form of an egress sandbox's network
// attachment (nil for none).
func attachmentJSON(a *network.Attachment) []byte {
	if a == nil || (a.Mode != network.ModeEgress && a.NetNS == "") {
		return nil
	}
	b, _ := jsonMarshal(a)
	return b
}

// substrateNetwork is attachment a as a driver takes it.
func (n *Node) substrateNetwork(a *network.Attachment) substrate.Network {
	nw := substrate.Network{Mode: a.Mode, NetNS: a.NetNS, ResolvConf: a.ResolvConf}
	nw.Guest, _ = n.net.Guest(a)
	return nw
}
