package network

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
)

// This file holds what the node knows of each egress sandbox beyond its
// port: its policy, the addresses its allowed names resolved to (pins),
// its connection log and the connections the egress proxy carries for it.
// The kernel enforces the policy on every connection by address (the inet
// table's sandbox_policy chain and its sets: policed, allow, deny, pins);
// the node's resolver (dns.go) and egress proxy (proxy.go) enforce it by
// name.

// Pin lifetimes: an allowed name's address stays reachable for its DNS
// answer's TTL, within these bounds.
const (
	minPin = time.Minute
	maxPin = time.Hour
	// maxPins bounds a sandbox's pinned (address, name) pairs; a sandbox
	// resolving more names gets answers whose addresses are not pinned.
	maxPins = 4096
)

// sandboxNet is one egress sandbox as the node's network sees it.
type sandboxNet struct {
	id   string
	addr netip.Addr
	log  connLog

	mu  sync.Mutex
	pol *compiled // nil: unrestricted
	// pins are the (address, name) pairs its resolver answered, with
	// their expiry; kernel holds each pinned address's expiry in the pins
	// set.
	pins   map[pinKey]time.Time
	kernel map[netip.Addr]time.Time
	// conns are the connections the egress proxy carries for it.
	conns map[*proxied]struct{}
	// applied is what the allow and deny sets hold for it.
	applied []setElem
	denied  []setElem
}

type pinKey struct {
	addr netip.Addr
	name string
}

// sandboxAt returns the sandbox with address a, or nil.
func (m *Manager) sandboxAt(a netip.Addr) *sandboxNet {
	m.sbMu.RLock()
	defer m.sbMu.RUnlock()
	return m.byAddr[a]
}

// track registers an egress sandbox (at Setup or Restore).
func (m *Manager) track(id string, a netip.Addr) *sandboxNet {
	m.sbMu.Lock()
	defer m.sbMu.Unlock()
	if sb := m.byAddr[a]; sb != nil && sb.id == id {
		return sb
	}
	sb := &sandboxNet{id: id, addr: a, pins: map[pinKey]time.Time{}, kernel: map[netip.Addr]time.Time{}, conns: map[*proxied]struct{}{}}
	m.byAddr[a] = sb
	return sb
}

// untrack forgets a released sandbox: its set elements go, its proxied
// connections end.
func (m *Manager) untrack(a netip.Addr) {
	m.sbMu.Lock()
	sb := m.byAddr[a]
	delete(m.byAddr, a)
	m.sbMu.Unlock()
	if sb == nil {
		return
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if m.egress == "" {
		if err := m.replaceSetsLocked(sb, nil); err != nil {
			m.log.Warn("remove a released sandbox's policy", slog.String("sandbox_id", sb.id), slog.Any("error", err))
		}
		m.unpinAllLocked(sb)
	}
	for c := range sb.conns {
		c.close()
	}
}

// SetPolicy puts policy p (nil: unrestricted) in force for an egress
// sandbox and records it in a. New connections follow it at once;
// connections it denies that are open (proxied, or tracked by the kernel)
// are cut. Pins of the previous policy are dropped. It is idempotent.
func (m *Manager) SetPolicy(a *Attachment, p *Policy) error {
	if a == nil || a.Mode != ModeEgress {
		return errdefs.Invalid("a network policy needs network mode egress")
	}
	if m.egress != "" {
		return errdefs.Unavailable("egress networking is unavailable on this node: %s", m.egress)
	}
	if err := p.Validate(); err != nil {
		return err
	}
	addr, err := netip.ParseAddr(a.Addr)
	if err != nil {
		return errdefs.Internal(err, "sandbox address")
	}
	sb := m.sandboxAt(addr)
	if sb == nil {
		sb = m.track(a.ID, addr)
	}
	var c *compiled
	if p != nil {
		c = compile(p)
	}
	sb.mu.Lock()
	if err := m.replaceSetsLocked(sb, c); err != nil {
		sb.mu.Unlock()
		return errdefs.Internal(err, "install the network policy")
	}
	m.unpinAllLocked(sb)
	sb.pol = c
	var cut []*proxied
	for pc := range sb.conns {
		if ok, _ := m.proxyVerdictLocked(sb, pc.name, pc.dst); !ok && !pc.brokered {
			cut = append(cut, pc)
		}
	}
	sb.mu.Unlock()
	for _, pc := range cut {
		pc.close()
	}
	if c != nil {
		m.cutFlows(sb)
	}
	a.Policy = p
	return nil
}

// replaceSetsLocked makes the kernel's sets say c for sb (nil: not
// policed), in one transaction.
func (m *Manager) replaceSetsLocked(sb *sandboxNet, c *compiled) error {
	src := sb.addr.As4()
	var allow, deny []setElem
	if c != nil {
		for _, r := range c.allow {
			f, l := r.first.As4(), r.last.As4()
			allow = append(allow, setElem{key: concat(src, f), keyEnd: concat(src, l)})
		}
		for _, d := range c.deny32 {
			deny = append(deny, setElem{key: concat(src, d.As4())})
		}
	}
	wasPoliced, policed := sb.pol != nil, c != nil
	ops := []setOp{
		{del: true, set: "allow", elems: sb.applied},
		{del: true, set: "deny", elems: sb.denied},
		{set: "allow", elems: allow},
		{set: "deny", elems: deny},
	}
	switch {
	case policed && !wasPoliced:
		ops = append(ops, setOp{set: "policed", elems: []setElem{{key: src[:]}}})
	case !policed && wasPoliced:
		ops = append(ops, setOp{del: true, set: "policed", elems: []setElem{{key: src[:]}}})
	}
	if err := nftBatch(unix.NFPROTO_INET, m.cfg.Table, ops...); err != nil {
		return err
	}
	sb.applied, sb.denied = allow, deny
	return nil
}

// concat is the key of a (sandbox, destination) element.
func concat(src, dst [4]byte) []byte {
	return append(append(make([]byte, 0, 8), src[:]...), dst[:]...)
}

// unpinAllLocked drops every pin of sb, in the kernel (elements that
// expired meanwhile are skipped) and here.
func (m *Manager) unpinAllLocked(sb *sandboxNet) {
	if len(sb.kernel) > 0 {
		src := sb.addr.As4()
		var elems []setElem
		for a := range sb.kernel {
			elems = append(elems, setElem{key: concat(src, a.As4())})
		}
		err := nftBatch(unix.NFPROTO_INET, m.cfg.Table, setOp{del: true, set: "pins", elems: elems})
		if isNotExist(err) {
			err = nil
			for _, e := range elems {
				if e := nftBatch(unix.NFPROTO_INET, m.cfg.Table, setOp{del: true, set: "pins", elems: []setElem{e}}); e != nil && !isNotExist(e) {
					err = e
				}
			}
		}
		if err != nil {
			m.log.Warn("remove a sandbox's pinned addresses", slog.String("sandbox_id", sb.id), slog.Any("error", err))
		}
	}
	clear(sb.kernel)
	clear(sb.pins)
}

// pin makes addrs reachable for sb as answers for name, for ttl (within
// minPin and maxPin). Pins made under an older policy than gen's are
// not made, nor those of pol.weakPin.
func (m *Manager) pin(sb *sandboxNet, pol *compiled, name string, addrs []netip.Addr, ttl time.Duration) {
	addrs = slices.DeleteFunc(slices.Clone(addrs), func(a netip.Addr) bool { return pol.weakPin(name, a) })
	if len(addrs) == 0 {
		return
	}
	ttl = min(max(ttl, minPin), maxPin)
	now := time.Now()
	until := now.Add(ttl)
	src := sb.addr.As4()
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.pol != pol {
		return // the policy changed while the query was out
	}
	var add, del []setElem
	for _, a := range addrs {
		if !a.Is4() {
			continue
		}
		k := pinKey{a, name}
		if _, ok := sb.pins[k]; !ok && len(sb.pins) >= maxPins {
			m.log.Warn("too many pinned addresses: an answer is not pinned", slog.String("sandbox_id", sb.id), slog.String("name", name))
			continue
		}
		sb.pins[k] = until
		// The kernel's element needs renewing only when it would expire
		// before this answer does; a renewal replaces it in the same
		// transaction (an element's timeout cannot change in place).
		if exp, ok := sb.kernel[a]; ok {
			if !exp.Before(until.Add(-ttl / 2)) {
				continue
			}
			del = append(del, setElem{key: concat(src, a.As4())})
		}
		add = append(add, setElem{key: concat(src, a.As4()), timeout: ttl})
		sb.kernel[a] = until
	}
	err := nftBatch(unix.NFPROTO_INET, m.cfg.Table, setOp{del: true, set: "pins", elems: del}, setOp{set: "pins", elems: add})
	if isNotExist(err) {
		// A renewed element expired meanwhile: add afresh.
		err = nftBatch(unix.NFPROTO_INET, m.cfg.Table, setOp{set: "pins", elems: add})
	}
	if err != nil {
		m.log.Warn("pin a sandbox's resolved addresses", slog.String("sandbox_id", sb.id), slog.Any("error", err))
	}
	// Forget what expired (the kernel did already).
	if len(sb.pins) > maxPins/2 {
		for k, t := range sb.pins {
			if t.Before(now) {
				delete(sb.pins, k)
			}
		}
		for a, t := range sb.kernel {
			if t.Before(now) {
				delete(sb.kernel, a)
			}
		}
	}
}

// pinnedLocked says whether a is pinned for sb (for name, or any name
// when name is ""), and the name.
func (sb *sandboxNet) pinnedLocked(a netip.Addr, name string) (string, bool) {
	now := time.Now()
	if name != "" {
		t, ok := sb.pins[pinKey{a, normalName(name)}]
		return name, ok && t.After(now)
	}
	if t, ok := sb.kernel[a]; !ok || t.Before(now) {
		return "", false
	}
	for k, t := range sb.pins {
		if k.addr == a && t.After(now) {
			return k.name, true
		}
	}
	return "", false
}

// never says whether a is out of every sandbox's reach, and what it is.
func (m *Manager) never(a netip.Addr) (bool, string) {
	if !a.Is4() {
		return true, "IPv6"
	}
	for _, np := range neverRanges {
		if np.p.Contains(a) {
			return true, np.name
		}
	}
	if m.prefix.Contains(a) {
		return true, "the sandbox network"
	}
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	for _, p := range m.hostNets {
		if p.Contains(a) {
			return true, "the host's networks"
		}
	}
	return false, ""
}

// addrVerdictLocked is what the kernel decides for a new connection from
// sb to dst, with pins of name only (name "": of any name; noPins: none).
func (m *Manager) addrVerdictLocked(sb *sandboxNet, dst netip.Addr, name string, noPins bool) (bool, string) {
	if never, what := m.never(dst); never {
		return false, what
	}
	if sb.pol == nil {
		for _, np := range privateRanges {
			if np.p.Contains(dst) {
				return false, np.name
			}
		}
		return true, "unrestricted"
	}
	ok, why := sb.pol.addrAllowed(dst)
	if !ok && why == "private" {
		return false, why
	}
	if !noPins {
		denied := false
		for _, d := range sb.pol.deny32 {
			denied = denied || d == dst
		}
		if n, pinned := sb.pinnedLocked(dst, name); pinned && !denied {
			return true, "pinned: " + n
		}
	}
	return ok, why
}

// proxyVerdictLocked decides a connection through the egress proxy from
// sb to dst for host name (or "" when the connection named none), as the
// public API's NetworkPolicy says.
func (m *Manager) proxyVerdictLocked(sb *sandboxNet, name string, dst netip.Addr) (bool, string) {
	if sb.pol == nil {
		return m.addrVerdictLocked(sb, dst, "", false)
	}
	if name == "" {
		return m.addrVerdictLocked(sb, dst, "", false)
	}
	r, ok := sb.pol.nameRule(name)
	switch {
	case ok && !r.Allow:
		return false, r.String()
	case ok:
		allowed, why := m.addrVerdictLocked(sb, dst, name, false)
		if !allowed && why == "no rule" {
			why = r.String() + ", but " + dst.String() + " is not an address it resolves to"
		}
		return allowed, why
	default:
		allowed, why := m.addrVerdictLocked(sb, dst, "", true)
		if !allowed && why == "no rule" {
			why = "no rule for " + name + " or " + dst.String()
		}
		return allowed, why
	}
}

// nameVerdict decides a DNS query from sb for name.
func (sb *sandboxNet) nameVerdict(name string) (bool, string, *compiled) {
	sb.mu.Lock()
	pol := sb.pol
	sb.mu.Unlock()
	if pol == nil {
		return true, "unrestricted", nil
	}
	if _, ok := pol.creds[normalName(name)]; ok {
		return true, "brokered credential", pol
	}
	r, ok := pol.nameRule(name)
	if !ok {
		return false, "no rule", pol
	}
	return r.Allow, r.String(), pol
}

// cutFlows ends the kernel-tracked connections of sb that its policy no
// longer allows: their conntrack entries go, so their next packet is a
// new connection the policy decides. Connections through the node's
// resolver and proxy (redirected to the gateway) are the proxy's to cut.
func (m *Manager) cutFlows(sb *sandboxNet) {
	src := net.IP(sb.addr.AsSlice())
	gw := net.IP(m.gateway.AsSlice())
	n, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, flowFilter(func(f *netlink.ConntrackFlow) bool {
		if !f.Forward.SrcIP.Equal(src) || f.Reverse.SrcIP.Equal(gw) {
			return false
		}
		dst, ok := netip.AddrFromSlice(f.Forward.DstIP.To4())
		if !ok {
			return false
		}
		sb.mu.Lock()
		defer sb.mu.Unlock()
		allowed, _ := m.addrVerdictLocked(sb, dst, "", false)
		return !allowed
	}))
	if err != nil {
		m.log.Warn("cut a sandbox's connections its new policy denies", slog.String("sandbox_id", sb.id), slog.Any("error", err))
	} else if n > 0 {
		m.log.Debug("cut connections a new policy denies", slog.String("sandbox_id", sb.id), slog.Int("flows", int(n)))
	}
}

type flowFilter func(*netlink.ConntrackFlow) bool

func (f flowFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool { return f(flow) }

// NetworkLog reads the connection log of the egress sandbox with
// attachment a: up to limit records after seq after, and how many records
// were not kept. A sandbox without egress has an empty log.
func (m *Manager) NetworkLog(a *Attachment, after uint64, limit int) ([]ConnRecord, uint64) {
	if a == nil || a.Mode != ModeEgress {
		return nil, 0
	}
	addr, err := netip.ParseAddr(a.Addr)
	if err != nil {
		return nil, 0
	}
	sb := m.sandboxAt(addr)
	if sb == nil {
		return nil, 0
	}
	return sb.log.read(after, limit)
}

// record logs a connection of the sandbox at src (user-space records,
// rated).
func (m *Manager) record(sb *sandboxNet, r ConnRecord) {
	sb.log.add(r, true)
	if m.log.Enabled(context.Background(), slog.LevelDebug) {
		m.log.Debug("sandbox connection", slog.String("sandbox_id", sb.id), slog.String("protocol", r.Protocol),
			slog.String("address", r.Addr.String()), slog.Int("port", int(r.Port)), slog.String("host", r.Host),
			slog.Bool("allow", r.Allow), slog.String("reason", r.Reason))
	}
}

var _ = fmt.Sprintf
