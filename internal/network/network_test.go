package network

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

var seq atomic.Int32

// newManager starts a manager with its own bridge, subnet and tables, and
// removes them after the test; or skips.
func newManager(t *testing.T) *Manager {
	t.Helper()
	return newManagerWith(t, func(*Config) {})
}

// newManagerWith is newManager with changes to its configuration.
func newManagerWith(t *testing.T, change func(*Config)) *Manager {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft (apt-get install nftables)")
	}
	n := seq.Add(1)
	cfg := Config{
		Bridge: fmt.Sprintf("dsn%d-%d", os.Getpid()%10000, n),
		Subnet: fmt.Sprintf("10.%d.%d.0/24", 150+os.Getpid()%50, n),
		Table:  fmt.Sprintf("dsnettest_%d_%d", os.Getpid(), n),
		RunDir: t.TempDir(),
		DNS:    []string{"192.0.2.53"},
	}
	change(&cfg)
	m := start(t, cfg)
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", cfg.Bridge).Run()
		exec.Command("nft", "delete", "table", "inet", cfg.Table).Run()
		exec.Command("nft", "delete", "table", "bridge", cfg.Table).Run()
	})
	return m
}

// start starts a manager over cfg (again, for a restart).
func start(t *testing.T, cfg Config) *Manager {
	t.Helper()
	m, err := New(cfg, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if m.EgressUnavailable() != "" {
		t.Fatalf("egress unavailable: %s", m.EgressUnavailable())
	}
	t.Cleanup(m.Close)
	return m
}

func nftList(t *testing.T, what ...string) string {
	t.Helper()
	out, err := exec.Command("nft", append([]string{"list"}, what...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("nft list %v: %v\n%s", what, err, out)
	}
	return string(out)
}

// sources lists the bridge table's source elements as nft prints them.
func sources(t *testing.T, m *Manager) string {
	t.Helper()
	out := nftList(t, "set", "bridge", m.cfg.Table, "sources")
	if i := strings.Index(out, "elements = {"); i >= 0 {
		return out[i:]
	}
	return ""
}

// left lists what an attachment left on the host.
func left(t *testing.T, m *Manager, a *Attachment) []string {
	t.Helper()
	var out []string
	// The element goes in a batch, within forgetBatch.
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		s := sources(t, m)
		if !strings.Contains(s, a.HostVeth) {
			break
		}
		if time.Now().After(deadline) {
			out = append(out, "bridge table element: "+s)
			break
		}
	}
	br, err := netlink.LinkByName(m.cfg.Bridge)
	if err != nil {
		t.Fatal(err)
	}
	neigh, _ := netlink.NeighList(br.Attrs().Index, netlink.FAMILY_V4)
	for _, n := range neigh {
		if n.IP.String() == a.Addr {
			out = append(out, "neighbour entry "+n.String())
		}
	}
	fdb, _ := netlink.NeighList(br.Attrs().Index, unix.AF_BRIDGE)
	for _, n := range fdb {
		if n.HardwareAddr.String() == a.MAC {
			out = append(out, "forwarding entry "+n.HardwareAddr.String())
		}
	}
	for _, name := range []string{a.HostVeth, a.HostVeth + "p"} {
		if _, err := netlink.LinkByName(name); err == nil {
			out = append(out, "interface "+name)
		}
	}
	if _, err := os.Stat(a.NetNS); err == nil {
		out = append(out, "namespace file")
	}
	return out
}

func TestEgressSetup(t *testing.T) {
	m := newManager(t)
	a, err := m.Setup(context.Background(), fmt.Sprintf("sb%d-a", os.Getpid()), Options{Mode: ModeEgress})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release(a)
	host, err := netlink.LinkByName(a.HostVeth)
	if err != nil {
		t.Fatal(err)
	}
	t.Run("the sandbox's port, MAC and address are the bridge's only allowed source for it", func(t *testing.T) {
		want := fmt.Sprintf("%q . %s . %s", a.HostVeth, a.MAC, a.Addr)
		if s := sources(t, m); !strings.Contains(s, want) {
			t.Fatalf("sources %q, want %s", s, want)
		}
	})
	t.Run("the bridge keeps a MAC of its own as ports come and go", func(t *testing.T) {
		br, _ := netlink.LinkByName(m.cfg.Bridge)
		if got, want := br.Attrs().HardwareAddr.String(), macOf(m.gateway).String(); got != want {
			t.Fatalf("bridge MAC %s, want %s", got, want)
		}
	})
	t.Run("the port is in the manager's group", func(t *testing.T) {
		if g := host.Attrs().Group; g != m.group {
			t.Fatalf("group %d, want %d", g, m.group)
		}
	})
	t.Run("the port is isolated, learns nothing and gets no flooded unicast", func(t *testing.T) {
		pi, err := netlink.LinkGetProtinfo(host)
		if err != nil {
			t.Fatal(err)
		}
		if !pi.Isolated || pi.Learning || pi.Flood {
			t.Fatalf("isolated %v, learning %v, flood %v", pi.Isolated, pi.Learning, pi.Flood)
		}
	})
	t.Run("the host's neighbour entry for the sandbox is permanent", func(t *testing.T) {
		br, _ := netlink.LinkByName(m.cfg.Bridge)
		neigh, _ := netlink.NeighList(br.Attrs().Index, netlink.FAMILY_V4)
		for _, n := range neigh {
			if n.IP.String() == a.Addr {
				if n.State != netlink.NUD_PERMANENT || n.HardwareAddr.String() != a.MAC {
					t.Fatalf("entry %v state %#x", n, n.State)
				}
				return
			}
		}
		t.Fatal("no entry")
	})
	t.Run("the bridge forwards the sandbox's MAC to its port only (static entry)", func(t *testing.T) {
		fdb, _ := netlink.NeighList(host.Attrs().Index, unix.AF_BRIDGE)
		for _, n := range fdb {
			if n.HardwareAddr.String() == a.MAC {
				if n.State&netlink.NUD_NOARP == 0 {
					t.Fatalf("entry state %#x, want static", n.State)
				}
				return
			}
		}
		t.Fatalf("no forwarding entry for %s in %v", a.MAC, fdb)
	})
	t.Run("the sandbox has no IPv6 address", func(t *testing.T) {
		ns, err := netns.GetFromPath(a.NetNS)
		if err != nil {
			t.Fatal(err)
		}
		defer ns.Close()
		h, err := netlink.NewHandleAt(ns)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		l, err := h.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		if l.Attrs().HardwareAddr.String() != a.MAC {
			t.Errorf("eth0 MAC %s, want %s", l.Attrs().HardwareAddr, a.MAC)
		}
		addrs, _ := h.AddrList(l, netlink.FAMILY_V6)
		if len(addrs) > 0 {
			t.Errorf("eth0 has IPv6 addresses %v", addrs)
		}
	})
	t.Run("release leaves nothing", func(t *testing.T) {
		m.Release(a)
		m.Release(a) // idempotent
		if l := left(t, m, a); len(l) > 0 {
			t.Fatalf("left behind: %s", strings.Join(l, "; "))
		}
	})
}

func TestRestoreAfterARestart(t *testing.T) {
	m := newManager(t)
	id := fmt.Sprintf("sb%d-r", os.Getpid())
	a, err := m.Setup(context.Background(), id, Options{Mode: ModeEgress})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release(a)
	raw, _ := json.Marshal(a)
	want := fmt.Sprintf("%q . %s . %s", a.HostVeth, a.MAC, a.Addr)

	t.Run("a restart closes the port until the sandbox is restored", func(t *testing.T) {
		m.Close()
		m = start(t, m.cfg)
		if s := sources(t, m); strings.Contains(s, a.HostVeth) {
			t.Fatalf("sources after the restart: %q", s)
		}
		r, err := m.Restore(id, raw)
		if err != nil {
			t.Fatal(err)
		}
		if s := sources(t, m); !strings.Contains(s, want) {
			t.Fatalf("sources %q, want %s", s, want)
		}
		a = r
	})
	t.Run("an attachment made before ports were checked is brought up to date", func(t *testing.T) {
		// As an older node left it: no MAC kept, the port in no group,
		// learning on, no neighbour entry.
		host, _ := netlink.LinkByName(a.HostVeth)
		netlink.LinkSetGroup(host, 0)
		netlink.LinkSetLearning(host, true)
		m.forgetNeighbour(a)
		old := *a
		old.MAC = ""
		raw, _ := json.Marshal(&old)
		m.Close()
		m = start(t, m.cfg)
		r, err := m.Restore(id, raw)
		if err != nil {
			t.Fatal(err)
		}
		if r.MAC != a.MAC {
			t.Errorf("MAC read back %q, want %q", r.MAC, a.MAC)
		}
		if s := sources(t, m); !strings.Contains(s, want) {
			t.Errorf("sources %q, want %s", s, want)
		}
		host, _ = netlink.LinkByName(a.HostVeth)
		pi, _ := netlink.LinkGetProtinfo(host)
		if host.Attrs().Group != m.group || pi.Learning {
			t.Errorf("group %d (want %d), learning %v", host.Attrs().Group, m.group, pi.Learning)
		}
		a = r
	})
	t.Run("a bridge deleted while the node was down gets its ports back", func(t *testing.T) {
		m.Close()
		if out, err := exec.Command("ip", "link", "del", m.cfg.Bridge).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		m = start(t, m.cfg)
		r, err := m.Restore(id, raw)
		if err != nil {
			t.Fatal(err)
		}
		host, _ := netlink.LinkByName(a.HostVeth)
		br, _ := netlink.LinkByName(m.cfg.Bridge)
		if host.Attrs().MasterIndex != br.Attrs().Index {
			t.Fatalf("the port's master is %d, not the bridge (%d)", host.Attrs().MasterIndex, br.Attrs().Index)
		}
		if pi, _ := netlink.LinkGetProtinfo(host); !pi.Isolated {
			t.Fatal("the port is not isolated")
		}
		a = r
	})
	t.Run("release after a restore leaves nothing", func(t *testing.T) {
		m.Release(a)
		if l := left(t, m, a); len(l) > 0 {
			t.Fatalf("left behind: %s", strings.Join(l, "; "))
		}
	})
}

func TestTheHostsNetworksAreFollowed(t *testing.T) {
	m := newManager(t)
	hostNets := func() string { return nftList(t, "set", "inet", m.cfg.Table, "hostnets") }
	// A veth in no namespace: just an interface to hold addresses.
	name := fmt.Sprintf("dsnh%d", os.Getpid()%100000)
	if out, err := exec.Command("ip", "link", "add", name, "type", "veth", "peer", "name", name+"p").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	defer exec.Command("ip", "link", "del", name).Run()
	addr := fmt.Sprintf("198.18.%d.7", 10+os.Getpid()%200)
	network := fmt.Sprintf("198.18.%d.0/24", 10+os.Getpid()%200)
	waitFor := func(what string, cond func(string) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !cond(hostNets()) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: hostnets is %s", what, hostNets())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Run("an address added later is dropped with its network", func(t *testing.T) {
		if out, err := exec.Command("ip", "addr", "add", addr+"/24", "dev", name).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		waitFor("added", func(s string) bool { return strings.Contains(s, network) })
	})
	t.Run("a removed one is not dropped any more", func(t *testing.T) {
		exec.Command("ip", "addr", "del", addr+"/24", "dev", name).Run()
		waitFor("removed", func(s string) bool { return !strings.Contains(s, network) })
	})
	t.Run("the bridge's own network is there from the start", func(t *testing.T) {
		if s := hostNets(); !strings.Contains(s, m.prefix.String()) {
			t.Fatalf("hostnets %s lacks %s", s, m.prefix)
		}
	})
}

func TestOutermost(t *testing.T) {
	p := func(ss ...string) []netip.Prefix {
		var out []netip.Prefix
		for _, s := range ss {
			out = append(out, netip.MustParsePrefix(s))
		}
		return out
	}
	for _, c := range []struct {
		name     string
		in, want []netip.Prefix
	}{
		{"an address inside its network goes", p("198.51.100.7/32", "198.51.100.0/24"), p("198.51.100.0/24")},
		{"disjoint networks stay, sorted", p("203.0.113.0/24", "192.0.2.1/32"), p("192.0.2.1/32", "203.0.113.0/24")},
		{"duplicates go", p("192.0.2.0/24", "192.0.2.0/24"), p("192.0.2.0/24")},
		{"a network inside a larger one goes", p("10.1.2.0/24", "10.0.0.0/8", "11.0.0.1/32"), p("10.0.0.0/8", "11.0.0.1/32")},
		{"nothing is nothing", nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := outermost(c.in)
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
		})
	}
}

func TestMACOfAnAddress(t *testing.T) {
	if got := macOf(netip.MustParseAddr("10.88.1.2")).String(); got != "02:64:0a:58:01:02" {
		t.Fatalf("got %s", got)
	}
}

// BenchmarkSourceElement times adding one sandbox's bridge table element
// through nfnetlink (what Setup does) and through `nft` (what it would do
// otherwise). Removals are batched (see forgetBatch).
func BenchmarkSourceElement(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		b.Skip("needs nft")
	}
	table := fmt.Sprintf("dsnetbench_%d", os.Getpid())
	if out, err := exec.Command("nft", "add table bridge "+table+"; add set bridge "+table+" sources { type ifname . ether_addr . ipv4_addr; }").CombinedOutput(); err != nil {
		b.Fatalf("%v: %s", err, out)
	}
	defer exec.Command("nft", "delete", "table", "bridge", table).Run()
	n := 0
	next := func() *Attachment {
		n++
		return &Attachment{HostVeth: fmt.Sprintf("dsbench%d", n), MAC: "02:64:0a:00:00:01", Addr: "10.0.0.1"}
	}
	b.Run("nfnetlink", func(b *testing.B) {
		for b.Loop() {
			k, err := sourceKey(next())
			if err != nil {
				b.Fatal(err)
			}
			if err := setElements(false, unix.NFPROTO_BRIDGE, table, "sources", k); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("nft", func(b *testing.B) {
		for b.Loop() {
			a := next()
			if err := nft(fmt.Sprintf("add element bridge %s sources { %q . %s . %s }\n", table, a.HostVeth, a.MAC, a.Addr)); err != nil {
				b.Fatal(err)
			}
		}
	})
}
