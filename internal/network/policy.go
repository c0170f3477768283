package network

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/opendsec/dsec/internal/errdefs"
)

// Policy is an egress sandbox's policy, as the node enforces it (the
// public API's NetworkPolicy documents what it means). A nil *Policy is
// unrestricted egress; an empty one denies everything.
type Policy struct {
	Rules []Rule `json:"rules,omitempty"`
	// Credentials are injected by the egress proxy (values included: this
	// is the node's own copy, persisted in its store).
	Credentials []Credential `json:"credentials,omitempty"`
}

// Rule allows or denies one destination: an address prefix (Prefix
// valid) or a name ("pypi.org", "*.pypi.org" or "*").
type Rule struct {
	Allow  bool         `json:"allow"`
	Prefix netip.Prefix `json:"prefix,omitzero"`
	Name   string       `json:"name,omitempty"`
}

// String is the rule as a user writes it: "allow *.pypi.org".
func (r Rule) String() string {
	a := "deny"
	if r.Allow {
		a = "allow"
	}
	if r.Prefix.IsValid() {
		return a + " " + r.Prefix.String()
	}
	return a + " " + r.Name
}

// Credential is a header the egress proxy sets on the sandbox's HTTP
// requests to Host (see proxy.go).
type Credential struct {
	Host   string `json:"host"`
	Header string `json:"header"`
	Value  string `json:"value"`
}

// Limits of a policy.
const (
	MaxRules       = 256
	MaxCredentials = 16
	maxHeaderValue = 8 << 10
)

// ParseRule reads a rule: action "allow" or "deny", destination an IPv4
// address or CIDR, a host name, "*.name" or "*". A bad one is invalid.
func ParseRule(action, destination string) (Rule, error) {
	var r Rule
	switch strings.ToLower(strings.TrimSpace(action)) {
	case "allow":
		r.Allow = true
	case "deny":
	default:
		return r, errdefs.Invalid("network rule action %q: use allow or deny", action)
	}
	d := strings.TrimSpace(destination)
	if p, err := netip.ParsePrefix(d); err == nil {
		if !p.Addr().Is4() {
			return r, errdefs.Invalid("network rule %q: sandboxes have IPv4 only", d)
		}
		r.Prefix = p.Masked()
		return r, nil
	}
	if a, err := netip.ParseAddr(d); err == nil {
		if !a.Is4() {
			return r, errdefs.Invalid("network rule %q: sandboxes have IPv4 only", d)
		}
		r.Prefix = netip.PrefixFrom(a, 32)
		return r, nil
	}
	name := strings.TrimSuffix(strings.ToLower(d), ".")
	if name == "*" {
		r.Name = name
		return r, nil
	}
	if !validName(strings.TrimPrefix(name, "*.")) {
		return r, errdefs.Invalid("network rule destination %q: want an IPv4 address or CIDR, a host name, *.name or *", destination)
	}
	r.Name = name
	return r, nil
}

// validName reports whether s is a host name: dot-separated labels of
// letters, digits, '-' and '_', each 1–63 bytes, 253 bytes at most.
func validName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, l := range strings.Split(s, ".") {
		if l == "" || len(l) > 63 {
			return false
		}
		for _, c := range []byte(l) {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// normalName lowers a name and drops a trailing dot.
func normalName(s string) string { return strings.TrimSuffix(strings.ToLower(s), ".") }

// Validate checks a policy's bounds and credentials and normalizes its
// credentials (lower-case host, canonical header, default Authorization).
func (p *Policy) Validate() error {
	if p == nil {
		return nil
	}
	if len(p.Rules) > MaxRules {
		return errdefs.Invalid("at most %d network rules", MaxRules)
	}
	if len(p.Credentials) > MaxCredentials {
		return errdefs.Invalid("at most %d brokered credentials", MaxCredentials)
	}
	seen := map[string]bool{}
	for i := range p.Credentials {
		c := &p.Credentials[i]
		c.Host = normalName(c.Host)
		if !validName(c.Host) {
			return errdefs.Invalid("brokered credential host %q is not a host name", c.Host)
		}
		if seen[c.Host] {
			return errdefs.Invalid("two brokered credentials for host %s", c.Host)
		}
		seen[c.Host] = true
		if c.Header == "" {
			c.Header = "Authorization"
		}
		if !validHeaderName(c.Header) {
			return errdefs.Invalid("brokered credential header %q is not a header name", c.Header)
		}
		if c.Value == "" || len(c.Value) > maxHeaderValue || strings.ContainsAny(c.Value, "\r\n\x00") {
			return errdefs.Invalid("brokered credential for %s: the value must be 1 to %d bytes without line breaks", c.Host, maxHeaderValue)
		}
	}
	return nil
}

func validHeaderName(h string) bool {
	if h == "" || len(h) > 256 {
		return false
	}
	for _, c := range []byte(h) {
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`()<>@,;:\"/[]?={}`, c) >= 0 {
			return false
		}
	}
	return true
}

// The destinations no policy opens, and those only an address rule inside
// them opens.
var (
	// neverRanges are never reachable: "this" network, loopback,
	// link-local (cloud metadata), multicast and reserved, broadcast.
	neverRanges = []namedPrefix{
		{netip.MustParsePrefix("0.0.0.0/8"), "\"this\" network"},
		{netip.MustParsePrefix("127.0.0.0/8"), "loopback"},
		{netip.MustParsePrefix("169.254.0.0/16"), "link-local"},
		{netip.MustParsePrefix("224.0.0.0/3"), "multicast and reserved"},
	}
	// privateRanges (RFC 1918, shared address space) are reachable only
	// through an allow rule inside them; an unrestricted sandbox never
	// reaches them.
	privateRanges = []namedPrefix{
		{netip.MustParsePrefix("10.0.0.0/8"), "private"},
		{netip.MustParsePrefix("100.64.0.0/10"), "private"},
		{netip.MustParsePrefix("172.16.0.0/12"), "private"},
		{netip.MustParsePrefix("192.168.0.0/16"), "private"},
	}
)

type namedPrefix struct {
	p    netip.Prefix
	name string
}

func joinPrefixes(nps []namedPrefix) string {
	var s []string
	for _, np := range nps {
		s = append(s, np.p.String())
	}
	return strings.Join(s, ", ")
}

// compiled is a policy ready for checks: its address rules flattened into
// the ranges they allow, its name rules by kind.
type compiled struct {
	Policy
	allow  []addrRange  // what the address rules allow, sorted, merged
	deny32 []netip.Addr // /32 deny rules: the only ones that beat a pin
	exact  map[string]Rule
	wild   map[string]Rule // by suffix: "*.pypi.org" → "pypi.org"
	star   *Rule
	creds  map[string]Credential
}

// addrRange is an inclusive range of IPv4 addresses.
type addrRange struct{ first, last netip.Addr }

func compile(p *Policy) *compiled {
	c := &compiled{Policy: *p, exact: map[string]Rule{}, wild: map[string]Rule{}, creds: map[string]Credential{}}
	var cidr []Rule
	for _, r := range p.Rules {
		switch {
		case r.Prefix.IsValid():
			cidr = append(cidr, r)
			if r.Prefix.Bits() == 32 && !r.Allow {
				c.deny32 = append(c.deny32, r.Prefix.Addr())
			}
		case r.Name == "*":
			if c.star == nil || !r.Allow {
				c.star = &r
			}
		case strings.HasPrefix(r.Name, "*."):
			k := r.Name[2:]
			if old, ok := c.wild[k]; !ok || old.Allow {
				c.wild[k] = r
			}
		default:
			if old, ok := c.exact[r.Name]; !ok || old.Allow {
				c.exact[r.Name] = r
			}
		}
	}
	for _, cr := range p.Credentials {
		c.creds[cr.Host] = cr
	}
	c.allow = flatten(cidr)
	return c
}

// nameRule is the rule that decides a name: the exact one, else the
// longest wildcard, else "*"; ok is false when none matches.
func (c *compiled) nameRule(name string) (Rule, bool) {
	name = normalName(name)
	if r, ok := c.exact[name]; ok {
		return r, true
	}
	for rest := name; ; {
		i := strings.IndexByte(rest, '.')
		if i < 0 {
			break
		}
		rest = rest[i+1:]
		if r, ok := c.wild[rest]; ok {
			return r, true
		}
	}
	if c.star != nil {
		return *c.star, true
	}
	return Rule{}, false
}

// weakPin says whether an answer for name, address a, stays unpinned: a
// name that only "*" allows is the least specific rule of all, so an
// address rule that denies a (of any size) beats it. A name rule of its
// own ("pypi.org", "*.pypi.org") is more specific than any address rule
// but a /32 deny.
func (c *compiled) weakPin(name string, a netip.Addr) bool {
	r, ok := c.nameRule(name)
	if !ok || r.Name != "*" {
		return false
	}
	ar, ok := addrRule(c.Rules, a)
	return ok && !ar.Allow
}

// addrRule is the address rule that decides a, most specific first (deny
// wins a tie), and whether one matches at all.
func addrRule(rules []Rule, a netip.Addr) (Rule, bool) {
	best, found := Rule{}, false
	for _, r := range rules {
		if !r.Prefix.IsValid() || !r.Prefix.Contains(a) {
			continue
		}
		if !found || r.Prefix.Bits() > best.Prefix.Bits() || r.Prefix.Bits() == best.Prefix.Bits() && !r.Allow {
			best, found = r, true
		}
	}
	return best, found
}

// addrAllowed says whether the address rules allow a (pins aside), and
// why. Private ranges need a rule inside them: the private range acts as
// a deny rule of its own size that a user's rule of the same size beats.
func (c *compiled) addrAllowed(a netip.Addr) (bool, string) {
	r, ok := addrRule(c.Rules, a)
	for _, np := range privateRanges {
		if np.p.Contains(a) && (!ok || r.Prefix.Bits() < np.p.Bits()) {
			return false, np.name
		}
	}
	if !ok {
		return false, "no rule"
	}
	return r.Allow, r.String()
}

// flatten turns address rules into the ranges they allow (private ranges
// included as rules a user's rule of the same size beats), merged and
// sorted.
func flatten(rules []Rule) []addrRange {
	bounds := []uint32{0}
	add := func(p netip.Prefix) {
		first, last := prefixRange(p)
		bounds = append(bounds, u32(first))
		if l := u32(last); l != ^uint32(0) {
			bounds = append(bounds, l+1)
		}
	}
	for _, r := range rules {
		add(r.Prefix)
	}
	for _, np := range privateRanges {
		add(np.p)
	}
	slices.Sort(bounds)
	bounds = slices.Compact(bounds)
	c := &compiled{Policy: Policy{Rules: rules}}
	var out []addrRange
	for i, b := range bounds {
		last := ^uint32(0)
		if i+1 < len(bounds) {
			last = bounds[i+1] - 1
		}
		if ok, _ := c.addrAllowed(addrOf(b)); !ok {
			continue
		}
		if n := len(out); n > 0 && u32(out[n-1].last)+1 == b {
			out[n-1].last = addrOf(last)
			continue
		}
		out = append(out, addrRange{addrOf(b), addrOf(last)})
	}
	return out
}

func prefixRange(p netip.Prefix) (netip.Addr, netip.Addr) {
	first := u32(p.Masked().Addr())
	size := uint32(1)<<(32-p.Bits()) - 1
	if p.Bits() == 0 {
		size = ^uint32(0)
	}
	return addrOf(first), addrOf(first | size)
}

func u32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.BigEndian.Uint32(b[:])
}

func addrOf(v uint32) netip.Addr {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// String is the range as nftables writes it.
func (r addrRange) String() string {
	if r.first == r.last {
		return r.first.String()
	}
	return fmt.Sprintf("%s-%s", r.first, r.last)
}
