// Package network gives sandboxes their network. Mode "none" is a private
// namespace with loopback only, made by the substrate itself. Mode
// "egress" is a namespace on the node's bridge with NAT to the outside and
// nothing else: bridge ports are isolated (sandboxes cannot reach each
// other), traffic from sandboxes to the host is dropped (no host services,
// no node API), private, link-local and multicast destinations and the
// host's own networks are dropped (no cloud metadata, no LAN) except the
// DNS resolvers, and nothing comes in.
//
// Sandboxes cannot forge their sources: each bridge port accepts only
// frames carrying its sandbox's MAC and IPv4 address (Ethernet source, ARP
// sender, IPv4 source) and nothing else (no IPv6, no other ethertype); the
// host's neighbour entry for each sandbox is permanent and the bridge's
// forwarding entry static; a reverse-path check drops what the routes
// would not send back through the bridge.
//
// The rules live in two nftables tables named Config.Table: "inet" (the
// host's side: input, forwarding, NAT, reverse path, the host's networks)
// and "bridge" (the per-port source checks).
//
// A sandbox under a policy (egress.go) is checked by address in the
// kernel, on every new connection, and by name in user space: the node
// runs a resolver (dns.go) and an egress proxy (proxy.go) on the bridge's
// address, to which the inet table redirects the sandbox's DNS and its
// TCP to ports 80 and 443. Every connection an egress sandbox opens is
// logged (nflog.go, connlog.go). Bandwidth limits are token buckets on
// both ends of its veth (bandwidth.go).
package network

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/undo"
)

// Modes.
const (
	ModeNone   = "none"
	ModeEgress = "egress"
)

// Config configures the manager. The zero value works.
type Config struct {
	// Bridge is the bridge interface name (default "dsec0").
	Bridge string
	// Subnet holds sandbox addresses; the first address is the bridge's
	// (default 10.88.0.0/16).
	Subnet string
	// DNS are resolvers sandboxes use (default: the host's non-loopback
	// resolvers).
	DNS []string
	// RunDir holds the namespace files (default /run/dsec/netns).
	RunDir string
	// Table names the nftables tables, one "inet" and one "bridge"
	// (default "dsec").
	Table string
	// TrustedCAs is a PEM file of the CAs the egress proxy trusts when it
	// sends brokered requests on over TLS (default: the host's).
	TrustedCAs string
	// NoEgress serves mode "none" only and touches nothing of the host (no
	// bridge, rules or sysctls): egress is reported unavailable. For tests
	// of the components above the network (default false).
	NoEgress bool
}

// Manager sets up sandbox networks. It is safe for concurrent use.
type Manager struct {
	log     *slog.Logger
	cfg     Config
	prefix  netip.Prefix
	gateway netip.Addr
	dns     []netip.Addr
	egress  string // why egress is unavailable, or ""
	// group marks the host side of this manager's veths (the interface
	// group, IFLA_GROUP): the bridge table checks every frame entering
	// the bridge through a port of this group, and only those, so other
	// bridges and other managers' ports are left alone.
	group    uint32
	stop     chan struct{}
	stopOnce sync.Once

	mu   sync.Mutex
	used map[netip.Addr]string // address → sandbox
	next netip.Addr

	hostMu   sync.Mutex
	hostNets []netip.Prefix // in the inet table's hostnets set

	forgetMu  sync.Mutex
	forgotten [][]byte // bridge table elements to remove, batched
	flushing  *time.Timer

	// The node's resolver and egress proxy for sandboxes under a policy,
	// on the gateway's address, and the NFLOG group of the connection
	// log (egress.go, dns.go, proxy.go, nflog.go).
	dnsPort, proxyPort int
	logGroup           uint16
	closers            []func()
	brokerTransport    *http.Transport

	sbMu   sync.RWMutex
	byAddr map[netip.Addr]*sandboxNet
}

// forgetBatch is how long removals of bridge table elements gather before
// one transaction removes them all: the kernel holds every change to the
// tables (creates' elements too) for an RCU grace period per removal
// transaction, ~15 ms on a busy host.
const forgetBatch = 250 * time.Millisecond

// Attachment is one sandbox's network, as persisted by the node.
type Attachment struct {
	ID       string `json:"id,omitempty"`
	Mode     string `json:"mode"`
	NetNS    string `json:"netns,omitempty"`
	Addr     string `json:"addr,omitempty"`
	HostVeth string `json:"host_veth,omitempty"`
	// MAC is the sandbox's interface address (empty in attachments made
	// before it was kept: Restore reads it from the namespace).
	MAC string `json:"mac,omitempty"`
	// Policy is the policy in force (nil: unrestricted), credentials'
	// values included.
	Policy *Policy `json:"policy,omitempty"`
	// BandwidthMbps limits the sandbox's throughput each way (0: none).
	BandwidthMbps int64  `json:"bandwidth_mbps,omitempty"`
	ResolvConf    string `json:"-"`
}

// Options are what a sandbox's network is made of.
type Options struct {
	// Mode is ModeNone (or "") or ModeEgress.
	Mode string
	// Policy restricts egress (nil: unrestricted).
	Policy *Policy
	// BandwidthMbps limits throughput each way (0: none).
	BandwidthMbps int64
	// Shared gives a sandbox of mode none a network namespace of its own
	// that further containers join (a sandbox's sidecars): loopback only,
	// kept at a path like an egress sandbox's. Egress sandboxes have one
	// anyway.
	Shared bool
}

// New prepares the manager. Egress needs root, nftables and bridges; when
// they are missing, egress is reported unavailable and "none" still works.
// The host's own networks are read now and followed as they change, until
// Close.
func New(cfg Config, log *slog.Logger) (*Manager, error) {
	if cfg.Bridge == "" {
		cfg.Bridge = "dsec0"
	}
	if cfg.Subnet == "" {
		cfg.Subnet = "10.88.0.0/16"
	}
	if cfg.RunDir == "" {
		cfg.RunDir = "/run/dsec/netns"
	}
	if cfg.Table == "" {
		cfg.Table = "dsec"
	}
	prefix, err := netip.ParsePrefix(cfg.Subnet)
	if err != nil || !prefix.Addr().Is4() || prefix.Bits() > 24 {
		return nil, fmt.Errorf("network subnet %q: need an IPv4 prefix of /24 or larger", cfg.Subnet)
	}
	prefix = prefix.Masked()
	m := &Manager{log: log, cfg: cfg, prefix: prefix, used: map[netip.Addr]string{}, stop: make(chan struct{}), byAddr: map[netip.Addr]*sandboxNet{}}
	m.gateway = prefix.Addr().Next()
	m.next = m.gateway.Next()
	m.dns = parseDNS(cfg.DNS)
	m.group = portGroup(cfg.Table)
	m.logGroup = logGroup(cfg.Table)
	var roots *x509.CertPool
	if cfg.TrustedCAs != "" {
		pem, err := os.ReadFile(cfg.TrustedCAs)
		if err != nil {
			return nil, fmt.Errorf("network trusted CAs: %w", err)
		}
		if roots, err = x509.SystemCertPool(); err != nil {
			roots = x509.NewCertPool()
		}
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("network trusted CAs %s: no certificate", cfg.TrustedCAs)
		}
	}
	m.brokerTransport = m.newBrokerTransport(roots)
	if cfg.NoEgress {
		m.egress = "egress is disabled on this node"
	} else if reason := m.setup(); reason != "" {
		m.egress = reason
		log.Warn("egress networking unavailable", slog.String("reason", reason))
	} else {
		go m.followHostNetworks()
	}
	return m, nil
}

// Close stops following the host's networks and removes the bridge table
// elements of released sandboxes still waiting for their batch. Sandbox
// networks, rules and the bridge stay. It is idempotent.
func (m *Manager) Close() {
	m.stopOnce.Do(func() {
		close(m.stop)
		for _, c := range m.closers {
			c()
		}
	})
	m.flushForgotten()
}

// portGroup is the interface group of a manager's ports, derived from its
// table name: stable across restarts, distinct between the managers of one
// host (tests run several), never 0 (every interface's default group).
func portGroup(table string) uint32 {
	h := uint32(2166136261)
	for _, c := range []byte("dsec-ports/" + table) {
		h = (h ^ uint32(c)) * 16777619
	}
	return h | 1<<31
}

// EgressUnavailable says why egress cannot be used here, or "".
func (m *Manager) EgressUnavailable() string { return m.egress }

func parseDNS(list []string) []netip.Addr {
	var out []netip.Addr
	if len(list) == 0 {
		list = hostResolvers()
	}
	for _, s := range list {
		if a, err := netip.ParseAddr(s); err == nil && a.Is4() && !a.IsLoopback() {
			out = append(out, a)
		}
	}
	return out
}

// hostResolvers reads the host's resolvers, preferring systemd-resolved's
// upstream list over its loopback stub.
func hostResolvers() []string {
	var out []string
	for _, f := range []string{"/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			fields := strings.Fields(line)
			if len(fields) >= 2 && fields[0] == "nameserver" {
				if a, err := netip.ParseAddr(fields[1]); err == nil && !a.IsLoopback() {
					out = append(out, fields[1])
				}
			}
		}
		if len(out) > 0 {
			return out
		}
	}
	return out
}

func (m *Manager) resolvConf() string {
	var b strings.Builder
	for _, a := range m.dns {
		fmt.Fprintf(&b, "nameserver %s\n", a)
	}
	return b.String()
}

// setup creates the bridge and the firewall tables; it returns why egress
// cannot work, or "".
func (m *Manager) setup() string {
	if os.Geteuid() != 0 {
		return "egress networking needs root"
	}
	if _, err := exec.LookPath("nft"); err != nil {
		return "nft is not installed (apt-get install nftables)"
	}
	if err := os.MkdirAll(m.cfg.RunDir, 0o700); err != nil {
		return err.Error()
	}
	br, err := netlink.LinkByName(m.cfg.Bridge)
	if err != nil {
		attrs := netlink.NewLinkAttrs()
		attrs.Name = m.cfg.Bridge
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: attrs}); err != nil && !os.IsExist(err) {
			return fmt.Sprintf("create bridge %s: %v", m.cfg.Bridge, err)
		}
		if br, err = netlink.LinkByName(m.cfg.Bridge); err != nil {
			return fmt.Sprintf("find bridge %s: %v", m.cfg.Bridge, err)
		}
	}
	// A MAC of its own: otherwise a bridge takes its ports' smallest, which
	// changes as sandboxes come and go and leaves the others' neighbour
	// entries for the gateway pointing at an address no port has.
	if mac := macOf(m.gateway); !bytes.Equal(br.Attrs().HardwareAddr, mac) {
		if err := netlink.LinkSetHardwareAddr(br, mac); err != nil {
			return fmt.Sprintf("set the bridge's MAC: %v", err)
		}
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: m.gateway.AsSlice(), Mask: net.CIDRMask(m.prefix.Bits(), 32)}}
	if err := netlink.AddrReplace(br, addr); err != nil {
		return fmt.Sprintf("address bridge: %v", err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return fmt.Sprintf("bring bridge up: %v", err)
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0); err != nil {
		return fmt.Sprintf("enable forwarding: %v", err)
	}
	// Strict reverse path on the bridge, as the inet table's prerouting
	// chain also checks (the sysctl alone is weakened by a looser
	// net.ipv4.conf.all.rp_filter).
	if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+m.cfg.Bridge+"/rp_filter", []byte("1"), 0); err != nil {
		return fmt.Sprintf("reverse-path filter on the bridge: %v", err)
	}
	nets, err := hostNetworks()
	if err != nil {
		return fmt.Sprintf("read the host's addresses: %v", err)
	}
	if err := m.startServices(); err != nil {
		m.log.Warn("egress policies unavailable", slog.Any("error", err))
	}
	if err := m.applyRules(nets); err != nil {
		return err.Error()
	}
	return ""
}

// startServices starts the resolver and the egress proxy for sandboxes
// under a policy, on the gateway's address, and the reader of the
// connection log, until Close. Without them policies are refused
// (SetPolicy) and the rest works.
func (m *Manager) startServices() error {
	gw := m.gateway.String()
	udp, err := net.ListenUDP("udp4", &net.UDPAddr{IP: m.gateway.AsSlice()})
	if err != nil {
		return fmt.Errorf("resolver: %w", err)
	}
	port := udp.LocalAddr().(*net.UDPAddr).Port
	tcp, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: m.gateway.AsSlice(), Port: port})
	if err != nil {
		udp.Close()
		return fmt.Errorf("resolver on %s:%d/tcp: %w", gw, port, err)
	}
	proxy, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: m.gateway.AsSlice()})
	if err != nil {
		udp.Close()
		tcp.Close()
		return fmt.Errorf("egress proxy: %w", err)
	}
	fd, err := openNFLOG(m.logGroup)
	if err != nil {
		udp.Close()
		tcp.Close()
		proxy.Close()
		return fmt.Errorf("connection log: %w", err)
	}
	m.dnsPort, m.proxyPort = port, proxy.Addr().(*net.TCPAddr).Port
	m.closers = append(m.closers, func() { udp.Close() }, func() { tcp.Close() }, func() { proxy.Close() }, func() { unix.Close(fd) })
	go m.serveDNSUDP(udp)
	go m.serveDNSTCP(tcp)
	go m.serveProxy(proxy)
	go m.readNFLOG(fd)
	return nil
}

// applyRules (re)installs both nftables tables atomically, with nets as
// the host's networks. The bridge table's sources start empty: until Setup
// or Restore adds a sandbox's element, its port drops everything; the
// inet table's policy sets start empty too, so Restore puts each
// sandbox's policy back before its port opens.
//
// The inet table's forward chain decides each new connection of a
// sandbox: never other sandboxes, the host's networks, loopback,
// link-local, multicast (deny_never, deny_hostnet); for a sandbox under a
// policy (the policed set) the sandbox_policy chain (private ranges only
// through an allow rule, /32 deny rules, pins, the allow rules, else
// deny); for the others the host's resolvers, then anything but private
// ranges. The allow_* and deny_* chains log each decision to the
// manager's NFLOG group (at most connLogRate a second per sandbox and
// verdict), then accept, or reject at once. DNS queries and TCP to ports
// 80 and 443 of policed sandboxes are redirected to the node's resolver
// and egress proxy before any of it (prerouting_nat).
func (m *Manager) applyRules(nets []netip.Prefix) error {
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	var dns []string
	for _, a := range m.dns {
		dns = append(dns, a.String())
	}
	dnsRule := ""
	if len(dns) > 0 {
		dnsRule = fmt.Sprintf("\t\tiifname %q ip daddr { %s } meta l4proto { tcp, udp } th dport 53 goto allow_dns\n", m.cfg.Bridge, strings.Join(dns, ", "))
	}
	redirect := ""
	if m.dnsPort != 0 {
		redirect = fmt.Sprintf(`	chain prerouting_nat {
		type nat hook prerouting priority dstnat; policy accept;
		iifname %[1]q ip saddr @policed meta l4proto { tcp, udp } th dport 53 redirect to :%[2]d
		iifname %[1]q ip saddr @policed tcp dport { 80, 443 } redirect to :%[3]d
	}
`, m.cfg.Bridge, m.dnsPort, m.proxyPort)
		redirect += fmt.Sprintf("\tchain input_redirected {\n\t\tip saddr @policed meta l4proto . th dport { udp . %[1]d, tcp . %[1]d, tcp . %[2]d } accept\n\t}\n", m.dnsPort, m.proxyPort)
	}
	inputRedirected := ""
	if m.dnsPort != 0 {
		inputRedirected = fmt.Sprintf("\t\tiifname %q ct status dnat jump input_redirected\n", m.cfg.Bridge)
	}
	var verdicts strings.Builder
	for _, v := range []struct{ chain, prefix, act string }{
		{"allow_open", "a open", "accept"}, {"allow_dns", "a dns", "accept"}, {"allow_pin", "a pin", "accept"}, {"allow_rule", "a rule", "accept"},
		{"deny_never", "d never", "reject with icmpx admin-prohibited"}, {"deny_hostnet", "d hostnet", "reject with icmpx admin-prohibited"},
		{"deny_private", "d private", "reject with icmpx admin-prohibited"}, {"deny_rule", "d rule", "reject with icmpx admin-prohibited"},
		{"deny_host", "d host", "drop"},
	} {
		rate := "lograte_allow"
		if v.prefix[0] == 'd' {
			rate = "lograte_deny"
		}
		fmt.Fprintf(&verdicts, "\tchain %s {\n\t\tct state new add @%s { ip saddr limit rate %d/second burst %d packets } log prefix %q group %d\n\t\t%s\n\t}\n",
			v.chain, rate, connLogRate, connLogRate, v.prefix, m.logGroup, v.act)
	}
	rules := fmt.Sprintf(`table inet %[1]s
delete table inet %[1]s
table inet %[1]s {
	set hostnets {
		type ipv4_addr
		flags interval
%[5]s	}
	set policed {
		type ipv4_addr
	}
	set allow {
		type ipv4_addr . ipv4_addr
		flags interval
	}
	set deny {
		type ipv4_addr . ipv4_addr
	}
	set pins {
		type ipv4_addr . ipv4_addr
		flags timeout
	}
	set lograte_allow {
		type ipv4_addr
		size 65535
		flags dynamic,timeout
		timeout 1m
	}
	set lograte_deny {
		type ipv4_addr
		size 65535
		flags dynamic,timeout
		timeout 1m
	}
	chain prerouting {
		type filter hook prerouting priority raw; policy accept;
		iifname %[2]q fib saddr . iif oif missing drop
	}
%[9]s	chain input {
		type filter hook input priority -10; policy accept;
		iifname %[2]q ct state established,related accept
%[10]s		iifname %[2]q goto deny_host
	}
	chain forward {
		type filter hook forward priority -10; policy accept;
		oifname %[2]q ct state established,related accept
		oifname %[2]q drop
		iifname %[2]q meta nfproto ipv6 drop
%[4]s		iifname %[2]q ip daddr { %[6]s } goto deny_never
		iifname %[2]q ip daddr @hostnets goto deny_hostnet
		iifname %[2]q ip saddr @policed goto sandbox_policy
		iifname %[2]q ip daddr { %[7]s } goto deny_private
		iifname %[2]q goto allow_open
	}
	chain sandbox_policy {
		ct state established,related accept
		ip daddr { %[7]s } ip saddr . ip daddr != @allow goto deny_private
		ip saddr . ip daddr @deny goto deny_rule
		ip saddr . ip daddr @pins goto allow_pin
		ip saddr . ip daddr @allow goto allow_rule
		goto deny_rule
	}
%[11]s	chain postrouting {
		type nat hook postrouting priority 100; policy accept;
		ip saddr %[3]s oifname != %[2]q masquerade
	}
}
table bridge %[1]s
delete table bridge %[1]s
table bridge %[1]s {
	set sources {
		type ifname . ether_addr . ipv4_addr
	}
	chain prerouting {
		type filter hook prerouting priority -300; policy accept;
		meta iifgroup != %[8]d accept
		arp htype 1 arp ptype ip arp hlen 6 arp plen 4 iifname . ether saddr . arp saddr ip @sources iifname . arp saddr ether . arp saddr ip @sources accept
		iifname . ether saddr . ip saddr @sources accept
		counter drop
	}
}
`, m.cfg.Table, m.cfg.Bridge, m.prefix, dnsRule, hostNetsElements(nets), joinPrefixes(neverRanges), joinPrefixes(privateRanges), m.group,
		redirect, inputRedirected, verdicts.String())
	if err := nft(rules); err != nil {
		return fmt.Errorf("install nftables rules: %w", err)
	}
	m.hostNets = nets
	return nil
}

func hostNetsElements(nets []netip.Prefix) string {
	if len(nets) == 0 {
		return ""
	}
	var s []string
	for _, p := range nets {
		s = append(s, p.String())
	}
	return "\t\telements = { " + strings.Join(s, ", ") + " }\n"
}

// nft runs an nft script (one atomic transaction).
func nft(script string) error {
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// hostNetworks are the host's IPv4 networks: every address on its
// interfaces as a /32 and the prefix it is on (a point-to-point peer's
// too), loopback aside, reduced to the prefixes no other one contains.
func hostNetworks() ([]netip.Prefix, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, err
	}
	var all []netip.Prefix
	for _, a := range addrs {
		for _, ipn := range []*net.IPNet{a.IPNet, a.Peer} {
			if ipn == nil {
				continue
			}
			ip, ok := netip.AddrFromSlice(ipn.IP.To4())
			if !ok || ip.IsLoopback() {
				continue
			}
			all = append(all, netip.PrefixFrom(ip, 32))
			// A default-sized prefix (/0) would drop the internet; the
			// address alone is kept.
			if bits, _ := ipn.Mask.Size(); bits > 0 {
				all = append(all, netip.PrefixFrom(ip, bits).Masked())
			}
		}
	}
	return outermost(all), nil
}

// outermost sorts prefixes and drops those another one contains, so none
// overlap (an nftables interval set refuses overlapping elements).
func outermost(ps []netip.Prefix) []netip.Prefix {
	sort.Slice(ps, func(i, j int) bool {
		if c := ps[i].Addr().Compare(ps[j].Addr()); c != 0 {
			return c < 0
		}
		return ps[i].Bits() < ps[j].Bits()
	})
	var out []netip.Prefix
	for _, p := range ps {
		if n := len(out); n > 0 && out[n-1].Bits() <= p.Bits() && out[n-1].Contains(p.Addr()) {
			continue
		}
		out = append(out, p)
	}
	return out
}

// followHostNetworks keeps the hostnets set equal to the host's networks:
// addresses added or removed on any interface, later, count as much as
// those the node started with. Changes are applied 100 ms after the last
// of a burst; a lost subscription is renewed and the set re-read.
func (m *Manager) followHostNetworks() {
	for {
		updates := make(chan netlink.AddrUpdate, 256)
		done := make(chan struct{})
		err := netlink.AddrSubscribeWithOptions(updates, done, netlink.AddrSubscribeOptions{
			ErrorCallback: func(err error) {
				select {
				case <-done: // closed here: the subscription's end
				default:
					m.log.Warn("following the host's addresses", slog.Any("error", err))
				}
			},
		})
		if err != nil {
			m.log.Error("cannot follow the host's addresses", slog.Any("error", err))
			close(done)
			select {
			case <-m.stop:
				return
			case <-time.After(5 * time.Second):
			}
			continue
		}
		// Changes between the start (or a lost subscription) and now.
		m.refreshHostNetworks()
		var debounce <-chan time.Time
	loop:
		for {
			select {
			case <-m.stop:
				close(done)
				return
			case _, ok := <-updates:
				if !ok {
					break loop
				}
				debounce = time.After(100 * time.Millisecond)
			case <-debounce:
				debounce = nil
				m.refreshHostNetworks()
			}
		}
		close(done)
		select {
		case <-m.stop:
			return
		case <-time.After(time.Second):
		}
	}
}

// refreshHostNetworks rewrites the hostnets set if the host's networks
// changed, atomically (no moment without the set).
func (m *Manager) refreshHostNetworks() {
	nets, err := hostNetworks()
	if err != nil {
		m.log.Error("read the host's addresses", slog.Any("error", err))
		return
	}
	m.hostMu.Lock()
	defer m.hostMu.Unlock()
	if slices.Equal(nets, m.hostNets) {
		return
	}
	script := fmt.Sprintf("flush set inet %s hostnets\n", m.cfg.Table)
	if len(nets) > 0 {
		var s []string
		for _, p := range nets {
			s = append(s, p.String())
		}
		script += fmt.Sprintf("add element inet %s hostnets { %s }\n", m.cfg.Table, strings.Join(s, ", "))
	}
	if err := nft(script); err != nil {
		m.log.Error("update the host's networks in the firewall", slog.Any("error", err))
		return
	}
	m.hostNets = nets
	m.log.Info("host networks dropped for sandboxes", slog.Any("networks", nets))
}

// Setup prepares a sandbox's network. For "none" it returns an empty
// namespace path (the substrate makes a loopback-only namespace). An
// egress sandbox's policy and bandwidth limit are in force before it can
// send anything.
func (m *Manager) Setup(ctx context.Context, id string, o Options) (_ *Attachment, err error) {
	switch o.Mode {
	case "", ModeNone:
		if o.Policy != nil || o.BandwidthMbps != 0 {
			return nil, errdefs.Invalid("a network policy or bandwidth limit needs network mode egress")
		}
		if !o.Shared {
			return &Attachment{Mode: ModeNone}, nil
		}
		nsPath := filepath.Join(m.cfg.RunDir, id)
		if err := loopbackNetNS(nsPath); err != nil {
			return nil, errdefs.Internal(err, "create network namespace")
		}
		return &Attachment{ID: id, Mode: ModeNone, NetNS: nsPath}, nil
	case ModeEgress:
	default:
		return nil, errdefs.Invalid("unknown network mode %q (use none or egress)", o.Mode)
	}
	if m.egress != "" {
		return nil, errdefs.Unavailable("egress networking is unavailable on this node: %s", m.egress)
	}
	var u undo.Stack
	defer u.RunUnless(&err)
	addr, err := m.allocate(id)
	if err != nil {
		return nil, err
	}
	u.Push(func() { m.free(addr) })
	nsPath := filepath.Join(m.cfg.RunDir, id)
	if err := newNamedNetNS(nsPath); err != nil {
		return nil, errdefs.Internal(err, "create network namespace")
	}
	u.Push(func() { unix.Unmount(nsPath, unix.MNT_DETACH); os.Remove(nsPath) })
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, errdefs.Internal(err, "open network namespace")
	}
	defer ns.Close()
	hostName := vethName(id)
	mac := macOf(addr)
	attrs := netlink.NewLinkAttrs()
	attrs.Name = hostName
	attrs.MTU = m.bridgeMTU()
	attrs.Group = m.group // from now on the bridge table filters the port
	// The peer is made inside the namespace: moving it there afterwards
	// costs the kernel an RCU grace period (~30 ms here).
	veth := &netlink.Veth{LinkAttrs: attrs, PeerName: "eth0", PeerHardwareAddr: mac, PeerNamespace: netlink.NsFd(int(ns))}
	if err := netlink.LinkAdd(veth); err != nil {
		return nil, errdefs.Internal(err, "create veth")
	}
	u.Push(func() { netlink.LinkDel(veth) })
	a := &Attachment{ID: id, Mode: ModeEgress, NetNS: nsPath, Addr: addr.String(), HostVeth: hostName, MAC: mac.String(), ResolvConf: m.resolvConf()}
	m.track(id, addr)
	u.Push(func() { m.untrack(addr) })
	if o.Policy != nil {
		if err := m.SetPolicy(a, o.Policy); err != nil {
			return nil, err
		}
	}
	if err := m.allowSource(a); err != nil {
		return nil, errdefs.Internal(err, "allow the sandbox's addresses on the bridge")
	}
	u.Push(func() { m.forgetSource(a) })
	br, err := netlink.LinkByName(m.cfg.Bridge)
	if err != nil {
		return nil, errdefs.Internal(err, "find bridge")
	}
	host, err := netlink.LinkByName(hostName)
	if err != nil {
		return nil, errdefs.Internal(err, "find veth")
	}
	if err := netlink.LinkSetMaster(host, br); err != nil {
		return nil, errdefs.Internal(err, "attach veth to bridge")
	}
	u.Push(func() { m.forgetNeighbour(a) })
	if err := m.hardenPort(host, br, a); err != nil {
		return nil, errdefs.Internal(err, "harden bridge port")
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return nil, errdefs.Internal(err, "bring veth up")
	}
	if err := m.configureInside(ns, "eth0", addr); err != nil {
		return nil, errdefs.Internal(err, "configure sandbox interface")
	}
	if o.BandwidthMbps != 0 {
		if err := m.SetBandwidth(a, o.BandwidthMbps); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// macOf is a sandbox's MAC: locally administered, unicast, its IPv4
// address in the last four bytes (unique on the bridge, as addresses are).
func macOf(a netip.Addr) net.HardwareAddr {
	b := a.As4()
	return net.HardwareAddr{0x02, 0x64, b[0], b[1], b[2], b[3]}
}

// sourceKey is a sandbox's element of the bridge table's sources set
// (ifname . ether_addr . ipv4_addr, each field padded to 4 bytes).
func sourceKey(a *Attachment) ([]byte, error) {
	mac, err := net.ParseMAC(a.MAC)
	if err != nil || len(mac) != 6 {
		return nil, fmt.Errorf("sandbox MAC %q: %v", a.MAC, err)
	}
	ip, err := netip.ParseAddr(a.Addr)
	if err != nil || !ip.Is4() {
		return nil, fmt.Errorf("sandbox address %q: %v", a.Addr, err)
	}
	if len(a.HostVeth) == 0 || len(a.HostVeth) >= unix.IFNAMSIZ {
		return nil, fmt.Errorf("bridge port %q", a.HostVeth)
	}
	k := make([]byte, unix.IFNAMSIZ+8+4)
	copy(k, a.HostVeth)
	copy(k[unix.IFNAMSIZ:], mac)
	b := ip.As4()
	copy(k[unix.IFNAMSIZ+8:], b[:])
	return k, nil
}

// allowSource lets the sandbox's port carry its MAC and address. Adding
// it again is harmless.
func (m *Manager) allowSource(a *Attachment) error {
	k, err := sourceKey(a)
	if err != nil {
		return err
	}
	m.forgetMu.Lock()
	m.forgotten = slices.DeleteFunc(m.forgotten, func(f []byte) bool { return bytes.Equal(f, k) })
	m.forgetMu.Unlock()
	return setElements(false, unix.NFPROTO_BRIDGE, m.cfg.Table, "sources", k)
}

// forgetSource removes what allowSource added, within forgetBatch. The
// element is inert meanwhile: its port is gone or going, and port names
// are never reused.
func (m *Manager) forgetSource(a *Attachment) {
	k, err := sourceKey(a)
	if err != nil {
		return
	}
	m.forgetMu.Lock()
	defer m.forgetMu.Unlock()
	m.forgotten = append(m.forgotten, k)
	if m.flushing == nil {
		m.flushing = time.AfterFunc(forgetBatch, m.flushForgotten)
	}
}

// flushForgotten removes the queued elements in one transaction (one by
// one if some are gone already, which fails the whole transaction).
func (m *Manager) flushForgotten() {
	m.forgetMu.Lock()
	keys := m.forgotten
	m.forgotten = nil
	if m.flushing != nil {
		m.flushing.Stop()
		m.flushing = nil
	}
	m.forgetMu.Unlock()
	if len(keys) == 0 {
		return
	}
	err := setElements(true, unix.NFPROTO_BRIDGE, m.cfg.Table, "sources", keys...)
	if isNotExist(err) && len(keys) > 1 {
		err = nil
		for _, k := range keys {
			if e := setElements(true, unix.NFPROTO_BRIDGE, m.cfg.Table, "sources", k); e != nil && !isNotExist(e) {
				err = e
			}
		}
	}
	if err != nil && !isNotExist(err) {
		m.log.Warn("remove released sandboxes' addresses from the bridge table", slog.Int("elements", len(keys)), slog.Any("error", err))
	}
}

// hardenPort fixes what the bridge and the host believe about the port:
// isolated (no frames to other ports), no learning and a static
// forwarding entry for the sandbox's MAC (frames to it go to this port
// only, whatever others send), no flooding of unknown unicast to it, and
// a permanent neighbour entry on the host (ARP cannot rewrite it). All of
// it is idempotent, so Restore repeats it.
func (m *Manager) hardenPort(host, br netlink.Link, a *Attachment) error {
	mac, err := net.ParseMAC(a.MAC)
	if err != nil {
		return err
	}
	ip, err := netip.ParseAddr(a.Addr)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetIsolated(host, true); err != nil {
		return fmt.Errorf("isolate: %w", err)
	}
	if err := netlink.LinkSetLearning(host, false); err != nil {
		return fmt.Errorf("learning off: %w", err)
	}
	if err := netlink.LinkSetFlood(host, false); err != nil {
		return fmt.Errorf("flooding off: %w", err)
	}
	if err := netlink.NeighSet(&netlink.Neigh{
		LinkIndex: host.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_MASTER,
		State: netlink.NUD_NOARP, HardwareAddr: mac,
	}); err != nil {
		return fmt.Errorf("static forwarding entry: %w", err)
	}
	if err := netlink.NeighSet(&netlink.Neigh{
		LinkIndex: br.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
		IP: ip.AsSlice(), HardwareAddr: mac,
	}); err != nil {
		return fmt.Errorf("permanent neighbour entry: %w", err)
	}
	return nil
}

// forgetNeighbour removes the host's neighbour entry for the sandbox, if
// there is one.
func (m *Manager) forgetNeighbour(a *Attachment) {
	ip, err := netip.ParseAddr(a.Addr)
	if err != nil {
		return
	}
	if br, err := netlink.LinkByName(m.cfg.Bridge); err == nil {
		netlink.NeighDel(&netlink.Neigh{LinkIndex: br.Attrs().Index, Family: unix.AF_INET, IP: ip.AsSlice()})
	}
}

func (m *Manager) bridgeMTU() int {
	// Match the default route's interface, so tunnels and clouds with
	// small MTUs do not black-hole large packets.
	routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
	if err == nil {
		for _, r := range routes {
			if r.Dst == nil || r.Dst.String() == "0.0.0.0/0" {
				if l, err := netlink.LinkByIndex(r.LinkIndex); err == nil && l.Attrs().MTU > 0 {
					return l.Attrs().MTU
				}
			}
		}
	}
	return 1500
}

func (m *Manager) configureInside(ns netns.NsHandle, ifname string, addr netip.Addr) error {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return err
	}
	defer h.Close()
	link, err := h.LinkByName(ifname)
	if err != nil {
		return err
	}
	ipnet := &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(m.prefix.Bits(), 32)}
	if err := h.AddrAdd(link, &netlink.Addr{IPNet: ipnet}); err != nil {
		return err
	}
	if err := h.LinkSetUp(link); err != nil {
		return err
	}
	if lo, err := h.LinkByName("lo"); err == nil {
		h.LinkSetUp(lo)
	}
	return h.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Gw: m.gateway.AsSlice()})
}

// Release tears a sandbox's network down: the host's neighbour entry, the
// veth (with the port's forwarding entry), the namespace, and, batched
// within forgetBatch, its bridge table element. It is idempotent.
func (m *Manager) Release(a *Attachment) {
	if a == nil {
		return
	}
	if a.Mode != ModeEgress {
		if a.NetNS != "" { // Options.Shared
			unix.Unmount(a.NetNS, unix.MNT_DETACH)
			os.Remove(a.NetNS)
		}
		return
	}
	if a.MAC != "" && m.egress == "" {
		m.forgetSource(a)
	}
	m.forgetNeighbour(a)
	if a.HostVeth != "" {
		if l, err := netlink.LinkByName(a.HostVeth); err == nil {
			netlink.LinkDel(l)
		}
	}
	if a.NetNS != "" {
		unix.Unmount(a.NetNS, unix.MNT_DETACH)
		os.Remove(a.NetNS)
	}
	if addr, err := netip.ParseAddr(a.Addr); err == nil {
		m.untrack(addr)
		m.free(addr)
	}
}

// Restore re-registers an attachment persisted before a restart and puts
// back what the restart's fresh rules lack: the port's element in the
// bridge table (until then the port drops everything), and the port's
// group and hardening for attachments made before them. An error leaves
// the port closed; Release still cleans up.
func (m *Manager) Restore(id string, raw []byte) (*Attachment, error) {
	if len(raw) == 0 {
		return &Attachment{Mode: ModeNone}, nil
	}
	var a Attachment
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	if addr, err := netip.ParseAddr(a.Addr); err == nil {
		m.mu.Lock()
		m.used[addr] = id
		m.mu.Unlock()
	}
	a.ResolvConf = m.resolvConf()
	a.ID = id
	if a.Mode != ModeEgress || m.egress != "" {
		return &a, nil
	}
	if addr, err := netip.ParseAddr(a.Addr); err == nil {
		m.track(id, addr)
	}
	// The policy first: the port opens in readopt.
	if a.Policy != nil {
		if err := m.SetPolicy(&a, a.Policy); err != nil {
			m.log.Warn("re-adopt a sandbox's network policy: its port stays closed", slog.String("sandbox_id", id), slog.Any("error", err))
			return &a, err
		}
	}
	if a.BandwidthMbps != 0 {
		if err := m.SetBandwidth(&a, a.BandwidthMbps); err != nil {
			m.log.Warn("re-adopt a sandbox's bandwidth limit", slog.String("sandbox_id", id), slog.Any("error", err))
		}
	}
	if err := m.readopt(&a); err != nil {
		m.log.Warn("re-adopt a sandbox's network: its port stays closed", slog.String("sandbox_id", id), slog.Any("error", err))
		return &a, err
	}
	return &a, nil
}

func (m *Manager) readopt(a *Attachment) error {
	host, err := netlink.LinkByName(a.HostVeth)
	if err != nil {
		return fmt.Errorf("find veth: %w", err)
	}
	if a.MAC == "" {
		mac, err := macInside(a.NetNS)
		if err != nil {
			return fmt.Errorf("read the sandbox's MAC: %w", err)
		}
		a.MAC = mac.String()
	}
	if err := m.allowSource(a); err != nil {
		return err
	}
	if host.Attrs().Group != m.group {
		if err := netlink.LinkSetGroup(host, int(m.group)); err != nil {
			return fmt.Errorf("set the port's group: %w", err)
		}
	}
	br, err := netlink.LinkByName(m.cfg.Bridge)
	if err != nil {
		return fmt.Errorf("find bridge: %w", err)
	}
	// A bridge deleted while the node was down was made anew at start,
	// without ports.
	if host.Attrs().MasterIndex != br.Attrs().Index {
		if err := netlink.LinkSetMaster(host, br); err != nil {
			return fmt.Errorf("attach veth to bridge: %w", err)
		}
	}
	return m.hardenPort(host, br, a)
}

// handleIn opens a netlink handle in the network namespace at path.
func handleIn(path string) (*netlink.Handle, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	return netlink.NewHandleAt(ns)
}

// macInside reads eth0's MAC in the namespace at path.
func macInside(path string) (net.HardwareAddr, error) {
	h, err := handleIn(path)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	l, err := h.LinkByName("eth0")
	if err != nil {
		return nil, err
	}
	return l.Attrs().HardwareAddr, nil
}

func (m *Manager) allocate(id string) (netip.Addr, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	start := m.next
	for {
		a := m.next
		m.next = m.next.Next()
		if !m.prefix.Contains(m.next) || isBroadcast(m.prefix, m.next) {
			m.next = m.gateway.Next()
		}
		if _, taken := m.used[a]; !taken && m.prefix.Contains(a) && !isBroadcast(m.prefix, a) {
			m.used[a] = id
			return a, nil
		}
		if m.next == start {
			return netip.Addr{}, errdefs.Exhausted(0, "no free sandbox addresses in %s", m.prefix)
		}
	}
}

func (m *Manager) free(a netip.Addr) {
	m.mu.Lock()
	delete(m.used, a)
	m.mu.Unlock()
}

func isBroadcast(p netip.Prefix, a netip.Addr) bool {
	b := a.As4()
	n := binary.BigEndian.Uint32(b[:])
	hostBits := uint32(1)<<(32-p.Bits()) - 1
	return n&hostBits == hostBits
}

// vethName derives a stable interface name (at most 15 bytes) from an ID.
func vethName(id string) string {
	n := "ds" + strings.ReplaceAll(id, "-", "")
	if len(n) > 13 {
		n = n[:13]
	}
	return n
}

// loopbackNetNS creates a named network namespace (newNamedNetNS) with
// only its loopback interface, up.
func loopbackNetNS(path string) (err error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	if err := newNamedNetNS(path); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			unix.Unmount(path, unix.MNT_DETACH)
			os.Remove(path)
		}
	}()
	h, err := handleIn(path)
	if err != nil {
		return err
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return err
	}
	return h.LinkSetUp(lo)
}

// newNamedNetNS creates a network namespace kept alive by a bind mount at
// path. The namespace is made on a thread that is thrown away afterwards,
// so no goroutine ever runs in it by accident.
func newNamedNetNS(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o600)
	if err != nil {
		return err
	}
	f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Never unlocked: the thread exits with this goroutine.
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		// Sandboxes have no IPv6: interfaces made or moved into the
		// namespace from now on (eth0) get none; loopback keeps ::1.
		// Without IPv6 in the kernel there is nothing to turn off.
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/default/disable_ipv6", []byte("1"), 0); err != nil && !os.IsNotExist(err) {
			errc <- fmt.Errorf("disable IPv6: %w", err)
			return
		}
		// ICMP echo (datagram) sockets for every group: ping without
		// CAP_NET_RAW. The node writes it: a sandbox in a user namespace
		// cannot write its network namespace's sysctls (the namespace is
		// the host's user namespace's), and the range is read in the
		// writer's user namespace (the host's maps every sandbox's ids).
		if err := os.WriteFile("/proc/sys/net/ipv4/ping_group_range", []byte("0 2147483647"), 0); err != nil {
			errc <- fmt.Errorf("open ICMP echo sockets: %w", err)
			return
		}
		// Every port for every user, as Docker does: the root of a
		// sandbox in a user namespace has no CAP_NET_BIND_SERVICE over
		// this namespace (its user namespace does not own it), so a web
		// server on port 80 inside would fail otherwise. The namespace
		// is the sandbox's alone.
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_unprivileged_port_start", []byte("0"), 0); err != nil {
			errc <- fmt.Errorf("open low ports: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		errc <- unix.Mount(src, path, "", unix.MS_BIND, "")
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}
