// Package network gives sandboxes their network. Mode "none" is a private
// namespace with loopback only, made by the substrate itself. Mode
// "egress" is a namespace on the node's bridge with NAT to the outside and
// nothing else: bridge ports are isolated (sandboxes cannot reach each
// other), traffic from sandboxes to the host is dropped (no host services,
// no node API), private and link-local destinations are dropped (no cloud
// metadata, no LAN) except the DNS resolvers, and nothing comes in.
//
// The rules live in one nftables table, "inet dsec". Per-sandbox policies
// (allowlists by destination) will attach to the per-sandbox address this
// package already assigns.
package network

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

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
	// Table is the nftables table name (default "dsec").
	Table string
}

// Manager sets up sandbox networks. It is safe for concurrent use.
type Manager struct {
	log     *slog.Logger
	cfg     Config
	prefix  netip.Prefix
	gateway netip.Addr
	dns     []netip.Addr
	egress  string // why egress is unavailable, or ""

	mu   sync.Mutex
	used map[netip.Addr]string // address → sandbox
	next netip.Addr
}

// Attachment is one sandbox's network, as persisted by the node.
type Attachment struct {
	Mode       string `json:"mode"`
	NetNS      string `json:"netns,omitempty"`
	Addr       string `json:"addr,omitempty"`
	HostVeth   string `json:"host_veth,omitempty"`
	ResolvConf string `json:"-"`
}

// New prepares the manager. Egress needs root, nftables and bridges; when
// they are missing, egress is reported unavailable and "none" still works.
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
	m := &Manager{log: log, cfg: cfg, prefix: prefix, used: map[netip.Addr]string{}}
	m.gateway = prefix.Addr().Next()
	m.next = m.gateway.Next()
	m.dns = parseDNS(cfg.DNS)
	if reason := m.setup(); reason != "" {
		m.egress = reason
		log.Warn("egress networking unavailable", slog.String("reason", reason))
	}
	return m, nil
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

// setup creates the bridge and the firewall table; it returns why egress
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
	if err := m.applyRules(); err != nil {
		return err.Error()
	}
	return ""
}

// applyRules (re)installs the nftables table atomically.
func (m *Manager) applyRules() error {
	var dns []string
	for _, a := range m.dns {
		dns = append(dns, a.String())
	}
	dnsRule := ""
	if len(dns) > 0 {
		dnsRule = fmt.Sprintf("\t\tiifname %q ip daddr { %s } meta l4proto { tcp, udp } th dport 53 accept\n", m.cfg.Bridge, strings.Join(dns, ", "))
	}
	rules := fmt.Sprintf(`table inet %[1]s
delete table inet %[1]s
table inet %[1]s {
	chain input {
		type filter hook input priority -10; policy accept;
		iifname %[2]q ct state established,related accept
		iifname %[2]q drop
	}
	chain forward {
		type filter hook forward priority -10; policy accept;
		oifname %[2]q ct state established,related accept
		oifname %[2]q drop
%[4]s		iifname %[2]q ip daddr { 0.0.0.0/8, 10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, 192.168.0.0/16, 224.0.0.0/3 } drop
		iifname %[2]q meta nfproto ipv6 drop
		iifname %[2]q accept
	}
	chain postrouting {
		type nat hook postrouting priority 100; policy accept;
		ip saddr %[3]s oifname != %[2]q masquerade
	}
}
`, m.cfg.Table, m.cfg.Bridge, m.prefix, dnsRule)
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("install nftables rules: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// Setup prepares a sandbox's network. For "none" it returns an empty
// namespace path (the substrate makes a loopback-only namespace).
func (m *Manager) Setup(ctx context.Context, id, mode string) (_ *Attachment, err error) {
	switch mode {
	case "", ModeNone:
		return &Attachment{Mode: ModeNone}, nil
	case ModeEgress:
	default:
		return nil, errdefs.Invalid("unknown network mode %q (use none or egress)", mode)
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
	hostName := vethName(id)
	attrs := netlink.NewLinkAttrs()
	attrs.Name = hostName
	attrs.MTU = m.bridgeMTU()
	veth := &netlink.Veth{LinkAttrs: attrs, PeerName: hostName + "p"}
	if err := netlink.LinkAdd(veth); err != nil {
		return nil, errdefs.Internal(err, "create veth")
	}
	u.Push(func() { netlink.LinkDel(veth) })
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
	if err := netlink.LinkSetIsolated(host, true); err != nil {
		return nil, errdefs.Internal(err, "isolate bridge port")
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return nil, errdefs.Internal(err, "bring veth up")
	}
	peer, err := netlink.LinkByName(hostName + "p")
	if err != nil {
		return nil, errdefs.Internal(err, "find veth peer")
	}
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, errdefs.Internal(err, "open network namespace")
	}
	defer ns.Close()
	if err := netlink.LinkSetNsFd(peer, int(ns)); err != nil {
		return nil, errdefs.Internal(err, "move veth into namespace")
	}
	if err := m.configureInside(ns, hostName+"p", addr); err != nil {
		return nil, errdefs.Internal(err, "configure sandbox interface")
	}
	return &Attachment{Mode: ModeEgress, NetNS: nsPath, Addr: addr.String(), HostVeth: hostName, ResolvConf: m.resolvConf()}, nil
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
	if err := h.LinkSetName(link, "eth0"); err != nil {
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

// Release tears a sandbox's network down. It is idempotent.
func (m *Manager) Release(a *Attachment) {
	if a == nil || a.Mode != ModeEgress {
		return
	}
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
		m.free(addr)
	}
}

// Restore re-registers an attachment persisted before a restart.
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
	return &a, nil
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
		src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		errc <- unix.Mount(src, path, "", unix.MS_BIND, "")
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}
