// Command network times an egress sandbox's network setup and release,
// side by side, for these designs (not a test: numbers, never pass/fail):
//
//   - "bridge, no source checks": what internal/network did before ports
//     were checked (isolated bridge port, nothing per sandbox in nftables);
//   - "bridge + source checks": internal/network.Manager as it is (the
//     port's element in the bridge table over nfnetlink, static forwarding
//     entry, no learning or flooding, permanent neighbour entry);
//   - "routed /32": the alternative without shared L2 (a point-to-point
//     veth per sandbox, a /32 route, the gateway address on each veth,
//     strict rp_filter), which needs nothing per sandbox in nftables;
//   - the first again with the veth's peer moved into the namespace after
//     its creation, as internal/network did before it made the peer there.
//
// Every design makes the same namespace and veth pair and configures the
// sandbox's side the same way; runs alternate between designs so load on
// the host affects them alike. Needs root and nft. (BenchmarkSourceElement
// in internal/network times the bridge table element alone, through
// nfnetlink and through `nft`.) Run it as
//
//	go run ./bench/network [-n 200] [-runs 3]
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/network"
)

var (
	pid    = os.Getpid() % 10000
	runDir string
)

func main() {
	n := flag.Int("n", 200, "setups and releases per design and run")
	runs := flag.Int("runs", 3, "runs; medians of the runs are reported")
	flag.Parse()
	if os.Geteuid() != 0 {
		fatal(fmt.Errorf("needs root"))
	}
	if err := mountns.Enter(); err != nil {
		fatal(err)
	}
	var err error
	if runDir, err = os.MkdirTemp("", "dsec-bench-netns-"); err != nil {
		fatal(err)
	}
	defer os.RemoveAll(runDir)

	table := fmt.Sprintf("dsbench_%d", pid)
	m, err := network.New(network.Config{
		Bridge: fmt.Sprintf("dsbm%d", pid), Subnet: fmt.Sprintf("10.%d.0.0/16", 200+pid%50),
		Table: table, RunDir: filepath.Join(runDir, "manager"), DNS: []string{"192.0.2.53"},
	}, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		fatal(err)
	}
	if why := m.EgressUnavailable(); why != "" {
		fatal(fmt.Errorf("egress unavailable: %s", why))
	}
	defer func() {
		m.Close()
		exec.Command("ip", "link", "del", fmt.Sprintf("dsbm%d", pid)).Run()
		exec.Command("nft", "delete", "table", "inet", table).Run()
		exec.Command("nft", "delete", "table", "bridge", table).Run()
	}()
	plain := newPlainBridge()
	defer plain.close()

	designs := []struct {
		name string
		run  func(i int) (setup, release time.Duration)
	}{
		{"bridge, no source checks", plain.cycle},
		{"bridge + source checks (now)", func(i int) (time.Duration, time.Duration) {
			id := fmt.Sprintf("bm%d-%d", pid, i)
			t0 := time.Now()
			a, err := m.Setup(context.Background(), id, network.Options{Mode: network.ModeEgress})
			if err != nil {
				fatal(err)
			}
			t1 := time.Now()
			m.Release(a)
			return t1.Sub(t0), time.Since(t1)
		}},
		{"routed /32 (alternative)", routedCycle},
		{"bridge, no checks, peer moved in", plain.cycleMoved},
	}
	setups := make([][]time.Duration, len(designs))
	releases := make([][]time.Duration, len(designs))
	for r := 0; r < *runs; r++ {
		for d, ds := range designs {
			var s, rel []time.Duration
			for i := 0; i < *n; i++ {
				a, b := ds.run(i)
				s, rel = append(s, a), append(rel, b)
			}
			setups[d] = append(setups[d], median(s))
			releases[d] = append(releases[d], median(rel))
		}
	}
	fmt.Printf("dsec network benchmark — %d CPUs, load %s, %s\n", runtime.NumCPU(), loadavg(), time.Now().Format(time.RFC3339))
	fmt.Printf("%d setups and releases per design and run, %d runs; p50 per run, median of runs\n\n", *n, *runs)
	fmt.Printf("%-36s %12s %12s %12s\n", "design", "setup", "release", "setup ratio")
	base := median(setups[0])
	for d, ds := range designs {
		s := median(setups[d])
		fmt.Printf("%-36s %12s %12s %11.2fx\n", ds.name, round(s), round(median(releases[d])), float64(s)/float64(base))
	}
}

// plainBridge is the design before source checks, as internal/network
// was: an isolated port on a bridge and nothing else per sandbox.
type plainBridge struct {
	br     netlink.Link
	prefix netip.Prefix
}

func newPlainBridge() *plainBridge {
	attrs := netlink.NewLinkAttrs()
	attrs.Name = fmt.Sprintf("dsbp%d", pid)
	netlink.LinkDel(&netlink.Bridge{LinkAttrs: attrs})
	if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: attrs}); err != nil {
		fatal(err)
	}
	br, err := netlink.LinkByName(attrs.Name)
	if err != nil {
		fatal(err)
	}
	p := netip.MustParsePrefix(fmt.Sprintf("10.%d.0.0/16", 150+pid%50))
	if err := netlink.AddrAdd(br, &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().Next().AsSlice(), Mask: net.CIDRMask(16, 32)}}); err != nil {
		fatal(err)
	}
	netlink.LinkSetUp(br)
	return &plainBridge{br: br, prefix: p}
}

func (b *plainBridge) close() { netlink.LinkDel(b.br) }

func (b *plainBridge) cycle(i int) (time.Duration, time.Duration) { return b.run(i, false) }

func (b *plainBridge) cycleMoved(i int) (time.Duration, time.Duration) { return b.run(i, true) }

func (b *plainBridge) run(i int, move bool) (time.Duration, time.Duration) {
	name := fmt.Sprintf("dsbp%d-%d", pid%1000, i)
	addr := nth(b.prefix, i)
	t0 := time.Now()
	path := newNS(name)
	attrs := netlink.NewLinkAttrs()
	attrs.Name = name
	attrs.MTU = 1500
	must(addVeth(attrs, path, move))
	host, err := netlink.LinkByName(name)
	must(err)
	must(netlink.LinkSetMaster(host, b.br))
	must(netlink.LinkSetIsolated(host, true))
	must(netlink.LinkSetUp(host))
	configure(path, addr, 16, b.prefix.Addr().Next(), false)
	t1 := time.Now()
	netlink.LinkDel(host)
	dropNS(path)
	return t1.Sub(t0), time.Since(t1)
}

// addVeth makes the pair with its peer, eth0, inside the namespace at
// path: made there, or (move) moved there afterwards.
func addVeth(attrs netlink.LinkAttrs, path string, move bool) error {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return err
	}
	defer ns.Close()
	if !move {
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: attrs, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))})
	}
	peer := attrs.Name + "p"
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: attrs, PeerName: peer}); err != nil {
		return err
	}
	l, err := netlink.LinkByName(peer)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetNsFd(l, int(ns)); err != nil {
		return err
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return err
	}
	defer h.Close()
	if l, err = h.LinkByName(peer); err != nil {
		return err
	}
	return h.LinkSetName(l, "eth0")
}

// routedCycle is the routed alternative: no bridge; the host side of the
// veth holds the gateway address as a /32 and a /32 route to the sandbox.
func routedCycle(i int) (time.Duration, time.Duration) {
	name := fmt.Sprintf("dsbr%d-%d", pid%1000, i)
	prefix := netip.MustParsePrefix(fmt.Sprintf("10.%d.0.0/16", 100+pid%50))
	gw, addr := prefix.Addr().Next(), nth(prefix, i)
	t0 := time.Now()
	path := newNS(name)
	attrs := netlink.NewLinkAttrs()
	attrs.Name = name
	attrs.MTU = 1500
	attrs.Group = 7 // what nftables rules would match instead of the bridge
	must(addVeth(attrs, path, false))
	host, err := netlink.LinkByName(name)
	must(err)
	must(netlink.AddrAdd(host, &netlink.Addr{IPNet: &net.IPNet{IP: gw.AsSlice(), Mask: net.CIDRMask(32, 32)}}))
	must(os.WriteFile("/proc/sys/net/ipv4/conf/"+name+"/rp_filter", []byte("1"), 0))
	must(netlink.LinkSetUp(host))
	must(netlink.RouteAdd(&netlink.Route{LinkIndex: host.Attrs().Index, Dst: &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(32, 32)}, Scope: netlink.SCOPE_LINK}))
	configure(path, addr, 32, gw, true)
	t1 := time.Now()
	netlink.LinkDel(host)
	dropNS(path)
	return t1.Sub(t0), time.Since(t1)
}

func nth(p netip.Prefix, i int) netip.Addr {
	a := p.Addr().Next().Next()
	for j := 0; j < i; j++ {
		a = a.Next()
	}
	return a
}

// newNS makes a named network namespace as internal/network does.
func newNS(name string) string {
	path := filepath.Join(runDir, name)
	f, err := os.Create(path)
	must(err)
	f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		errc <- unix.Mount(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), path, "", unix.MS_BIND, "")
	}()
	must(<-errc)
	return path
}

func dropNS(path string) {
	unix.Unmount(path, unix.MNT_DETACH)
	os.Remove(path)
}

// configure gives eth0 in the namespace at path its address and routes.
func configure(path string, addr netip.Addr, bits int, gw netip.Addr, onlink bool) {
	ns, err := netns.GetFromPath(path)
	must(err)
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	must(err)
	defer h.Close()
	l, err := h.LinkByName("eth0")
	must(err)
	must(h.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(bits, 32)}}))
	must(h.LinkSetUp(l))
	if lo, err := h.LinkByName("lo"); err == nil {
		h.LinkSetUp(lo)
	}
	if onlink {
		must(h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: gw.AsSlice(), Mask: net.CIDRMask(32, 32)}, Scope: netlink.SCOPE_LINK}))
	}
	must(h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw.AsSlice()}))
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func round(d time.Duration) time.Duration {
	if d > time.Millisecond {
		return d.Round(10 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func must(err error) {
	if err != nil {
		fatal(err)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench/network:", err)
	os.Exit(1)
}
