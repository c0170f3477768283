package hostile

// Finding 6: ARP spoofing between egress sandboxes. With CAP_NET_RAW a
// sandbox could craft frames; the bridge checked no source address, so it
// rewrote the host's neighbour entry for another sandbox and received that
// sandbox's traffic, and it could send packets with any source out through
// the NAT. The host's own networks were reachable when they were not
// RFC 1918 ranges.

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/nsthread"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// The tests' own networks are in 198.18.0.0/15 (RFC 2544, benchmarking):
// no host uses it and the e2e tests do not either.
func testOctet() int { return 20 + os.Getpid()%200 }

func run(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", args, err, out)
	}
}

// routedOutside makes a network namespace that stands for the internet:
// the host reaches it through a /32 route over a veth whose own address is
// a /32, so it is none of the host's networks. It returns the outside
// address and the namespace's path.
func routedOutside(t *testing.T) (string, string) {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs iproute2")
	}
	name := fmt.Sprintf("dsecout%d", os.Getpid()%100000)
	hostIf := fmt.Sprintf("dho%d", os.Getpid()%100000)
	hostAddr := fmt.Sprintf("198.19.%d.1", testOctet())
	addr := fmt.Sprintf("198.19.%d.2", testOctet())
	exec.Command("ip", "netns", "del", name).Run()
	exec.Command("ip", "link", "del", hostIf).Run()
	run(t, "ip", "netns", "add", name)
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", hostIf).Run()
		exec.Command("ip", "netns", "del", name).Run()
	})
	run(t, "ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth9", "netns", name)
	run(t, "ip", "addr", "add", hostAddr+"/32", "dev", hostIf)
	run(t, "ip", "link", "set", hostIf, "up")
	run(t, "ip", "route", "add", addr+"/32", "dev", hostIf)
	in := []string{"ip", "netns", "exec", name}
	run(t, append(in, "ip", "addr", "add", addr+"/32", "dev", "eth9")...)
	run(t, append(in, "ip", "link", "set", "eth9", "up")...)
	run(t, append(in, "ip", "link", "set", "lo", "up")...)
	run(t, append(in, "ip", "route", "add", hostAddr+"/32", "dev", "eth9")...)
	run(t, append(in, "ip", "route", "add", "default", "via", hostAddr)...)
	return addr, "/run/netns/" + name
}

// hostLAN gives the host a network of its own outside the RFC 1918 ranges,
// as a host on a public LAN has: the host holds .1/24 on a veth with an
// HTTP server behind it, and a peer at .2 (a namespace) serves HTTP too.
// It returns the host's address, its server's port and the peer's address
// (whose server listens on 8080).
func hostLAN(t *testing.T) (hostAddr string, hostPort int, peer string) {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs iproute2")
	}
	name := fmt.Sprintf("dseclan%d", os.Getpid()%100000)
	hostIf := fmt.Sprintf("dhl%d", os.Getpid()%100000)
	hostAddr = fmt.Sprintf("198.18.%d.1", testOctet())
	peer = fmt.Sprintf("198.18.%d.2", testOctet())
	exec.Command("ip", "netns", "del", name).Run()
	exec.Command("ip", "link", "del", hostIf).Run()
	run(t, "ip", "netns", "add", name)
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", hostIf).Run()
		exec.Command("ip", "netns", "del", name).Run()
	})
	run(t, "ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth9", "netns", name)
	run(t, "ip", "addr", "add", hostAddr+"/24", "dev", hostIf)
	run(t, "ip", "link", "set", hostIf, "up")
	in := []string{"ip", "netns", "exec", name}
	run(t, append(in, "ip", "addr", "add", peer+"/24", "dev", "eth9")...)
	run(t, append(in, "ip", "link", "set", "eth9", "up")...)
	run(t, append(in, "ip", "link", "set", "lo", "up")...)
	run(t, append(in, "ip", "route", "add", "default", "via", hostAddr)...)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "index.html"), []byte("a peer on the host's LAN\n"), 0o644)
	httpd := exec.Command("ip", "netns", "exec", name, "busybox", "httpd", "-f", "-p", "8080", "-h", dir)
	if err := httpd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { httpd.Process.Kill(); httpd.Wait() })
	l, err := net.Listen("tcp", hostAddr+":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("the host\n")) }))
	// The peer must answer before a test counts a sandbox's failure to
	// reach it as the firewall's doing.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", peer+":8080", time.Second)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the LAN peer's httpd does not answer: %v", err)
		}
	}
	return hostAddr, l.Addr().(*net.TCPAddr).Port, peer
}

// fetch GETs http://host:port/ from inside sb with busybox nc and reports
// whether an HTTP 200 came back.
func fetch(t *testing.T, sb *dsec.Sandbox, host string, port int) (string, bool) {
	t.Helper()
	cmd := fmt.Sprintf(`printf 'GET / HTTP/1.0\r\n\r\n' | timeout 3 nc %s %d`, host, port)
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Cmd: cmd, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	out := string(r.Stdout)
	return out, strings.Contains(out, " 200 ")
}

// nodePid is the shared server's node process.
func nodePid(t *testing.T) int {
	t.Helper()
	return srv(t).NodePid()
}

// sandboxNetNS is the path of an egress sandbox's network namespace, seen
// through the node's mount namespace (internal/network keeps it at
// RUN_DIR/netns/<id>, a bind mount only the node's namespace has).
func sandboxNetNS(t *testing.T, id string) string {
	t.Helper()
	m, _ := filepath.Glob(fmt.Sprintf("/proc/%d/root/run/dsec/*/netns/%s", nodePid(t), id))
	if len(m) != 1 {
		t.Fatalf("network namespace of %s: found %v", id, m)
	}
	return m[0]
}

// iface is an interface inside a namespace: its index, MAC and IPv4 address.
type iface struct {
	index int
	mac   net.HardwareAddr
	ip    net.IP
}

func ifaceIn(t *testing.T, nsPath, name string) iface {
	t.Helper()
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l, err := h.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := h.AddrList(l, netlink.FAMILY_V4)
	if err != nil || len(addrs) == 0 {
		t.Fatalf("addresses of %s: %v %v", name, addrs, err)
	}
	return iface{index: l.Attrs().Index, mac: l.Attrs().HardwareAddr, ip: addrs[0].IP.To4()}
}

// packetSocket is an AF_PACKET socket on one interface of a namespace: it
// sends whole Ethernet frames and captures what the interface receives.
type packetSocket struct{ fd int }

func openPacket(t *testing.T, nsPath, ifname string) *packetSocket {
	t.Helper()
	var fd int
	err := nsthread.NetNS(nsPath, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: l.Attrs().Index})
	})
	if err != nil {
		t.Fatalf("packet socket on %s in %s: %v", ifname, nsPath, err)
	}
	tv := unix.Timeval{Usec: 100000}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	t.Cleanup(func() { unix.Close(fd) })
	return &packetSocket{fd: fd}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (p *packetSocket) send(t *testing.T, frame []byte) {
	if _, err := unix.Write(p.fd, frame); err != nil {
		t.Errorf("send frame: %v", err)
	}
}

// capture counts, until stop is closed, the frames the interface receives
// (not those it sends) that contain each marker.
func (p *packetSocket) capture(stop <-chan struct{}, markers ...[]byte) map[string]int {
	seen := map[string]int{}
	buf := make([]byte, 65536)
	for {
		select {
		case <-stop:
			return seen
		default:
		}
		n, from, err := unix.Recvfrom(p.fd, buf, 0)
		if err != nil {
			continue
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		for _, m := range markers {
			if bytes.Contains(buf[:n], m) {
				seen[string(m)]++
			}
		}
	}
}

var broadcast = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// arpFrame builds an Ethernet frame holding an ARP message (op 1 request,
// 2 reply).
func arpFrame(dst, src net.HardwareAddr, op uint16, sha net.HardwareAddr, spa net.IP, tha net.HardwareAddr, tpa net.IP) []byte {
	b := make([]byte, 0, 42)
	b = append(b, dst...)
	b = append(b, src...)
	b = binary.BigEndian.AppendUint16(b, 0x0806)
	b = binary.BigEndian.AppendUint16(b, 1)      // Ethernet
	b = binary.BigEndian.AppendUint16(b, 0x0800) // IPv4
	b = append(b, 6, 4)
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha...)
	b = append(b, spa.To4()...)
	b = append(b, tha...)
	b = append(b, tpa.To4()...)
	return b
}

// udpFrame builds an Ethernet frame holding an IPv4 UDP datagram to port
// 9999 (no UDP checksum).
func udpFrame(dst, src net.HardwareAddr, sip, dip net.IP, payload []byte) []byte {
	ip := make([]byte, 20, 28+len(payload))
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(28+len(payload)))
	ip[8] = 64
	ip[9] = unix.IPPROTO_UDP
	copy(ip[12:], sip.To4())
	copy(ip[16:], dip.To4())
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	ip = binary.BigEndian.AppendUint16(ip, 40000)
	ip = binary.BigEndian.AppendUint16(ip, 9999)
	ip = binary.BigEndian.AppendUint16(ip, uint16(8+len(payload)))
	ip = binary.BigEndian.AppendUint16(ip, 0)
	ip = append(ip, payload...)
	b := append(append(append([]byte(nil), dst...), src...), 0x08, 0x00)
	return append(b, ip...)
}

func frameMarker(what string) []byte {
	r := make([]byte, 6)
	rand.Read(r)
	return []byte("dsec-" + what + "-" + hex.EncodeToString(r))
}

// bridgeOf is the bridge an egress sandbox's host-side veth is a port of.
func bridgeOf(t *testing.T, id string) netlink.Link {
	t.Helper()
	name := "ds" + strings.ReplaceAll(id, "-", "")
	l, err := netlink.LinkByName(name[:min(len(name), 13)])
	if err != nil {
		t.Fatalf("host veth of %s: %v", id, err)
	}
	br, err := netlink.LinkByIndex(l.Attrs().MasterIndex)
	if err != nil {
		t.Fatalf("bridge of %s: %v", id, err)
	}
	return br
}

// hostNeighbour is the host's neighbour entry for ip on link, or nil.
func hostNeighbour(link netlink.Link, ip net.IP) *netlink.Neigh {
	list, _ := netlink.NeighList(link.Attrs().Index, netlink.FAMILY_V4)
	for i := range list {
		if list[i].IP.Equal(ip) {
			return &list[i]
		}
	}
	return nil
}

// sendUDP sends payload from the host to ip:9 (the victim answers with an
// ICMP error, which is fine: only delivery matters).
func sendUDP(t *testing.T, ip net.IP, payload []byte) {
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: ip, Port: 9})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(payload)
}

func TestAnEgressSandboxHasNoRawSocketsAndStillPings(t *testing.T) {
	outside, _ := routedOutside(t)
	nb := newNeighbour(t)
	sb := create(t, client(t), dsec.CreateOptions{Network: "egress"})
	ctx := ctxFor(t, 3*time.Minute)

	bin := filepath.Join(t.TempDir(), "icmpping")
	build := exec.Command("go", "build", "-o", bin, "./testdata/icmpping")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build icmpping: %v\n%s", err, out)
	}
	f, err := os.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := sb.WriteFile(ctx, "/usr/local/bin/icmpping", f, 0o755); err != nil {
		t.Fatal(err)
	}

	t.Run("no process holds CAP_NET_RAW", func(t *testing.T) {
		r, err := sb.Exec(ctx, dsec.Cmd("grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status"))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(r.Stdout)), "\n") {
			f := strings.Fields(line)
			var set uint64
			if len(f) != 2 {
				t.Fatalf("status line %q", line)
			}
			fmt.Sscanf(f[1], "%x", &set)
			if set&(1<<unix.CAP_NET_RAW) != 0 {
				t.Errorf("%s has CAP_NET_RAW (%s)", f[0], f[1])
			}
		}
	})
	t.Run("a raw packet socket is refused", func(t *testing.T) {
		r, err := sb.Exec(ctx, dsec.Cmd("arping -c 1 -w 2 -I eth0 "+outside+" 2>&1"))
		if err != nil {
			t.Fatal(err)
		}
		if r.ExitCode == 0 || !strings.Contains(string(r.Stdout), "not permitted") {
			t.Errorf("arping: exit %d, %q", r.ExitCode, r.Stdout)
		}
	})
	t.Run("a raw IP socket is refused", func(t *testing.T) {
		// busybox's ping opens SOCK_RAW and has no datagram fallback.
		r, err := sb.Exec(ctx, dsec.Cmd("ping -c 1 -W 2 "+outside+" 2>&1"))
		if err != nil {
			t.Fatal(err)
		}
		if r.ExitCode == 0 || !strings.Contains(string(r.Stdout), "permission denied") {
			t.Errorf("busybox ping: exit %d, %q", r.ExitCode, r.Stdout)
		}
	})
	t.Run("ping through an ICMP datagram socket reaches the outside", func(t *testing.T) {
		r, err := sb.Exec(ctx, dsec.Cmd("icmpping "+outside+" 2>&1"))
		if err != nil {
			t.Fatal(err)
		}
		if r.ExitCode != 0 {
			t.Errorf("icmpping: exit %d, %q", r.ExitCode, r.Stdout)
		}
	})
	t.Run("as another user too", func(t *testing.T) {
		r, err := sb.Exec(ctx, dsec.ExecOptions{Cmd: "icmpping " + outside + " 2>&1", User: "nobody"})
		if err != nil {
			t.Fatal(err)
		}
		if r.ExitCode != 0 {
			t.Errorf("icmpping as nobody: exit %d, %q", r.ExitCode, r.Stdout)
		}
	})
	// The attempts again, over and over, while the neighbour is measured.
	inBackground(t, sb, "arping -c 1 -w 1 -I eth0 "+outside+"; ping -c 1 -W 1 "+outside)
	nb.check(t)
}

// inBackground runs cmd in sb every 20 ms for the next 10 s, detached.
func inBackground(t *testing.T, sb *dsec.Sandbox, cmd string) {
	t.Helper()
	loop := fmt.Sprintf("(end=$(($(date +%%s)+10)); while [ $(date +%%s) -lt $end ]; do %s; sleep 0.02; done) >/dev/null 2>&1 &", cmd)
	if _, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(loop)); err != nil {
		t.Fatal(err)
	}
}

// TestASandboxWithRawSocketsCannotSpoofItsNeighbours is defense in depth:
// the attacker has raw sockets anyway (the test sends its frames from the
// attacker sandbox's namespace, from the host) and tries ARP spoofing, MAC
// spoofing and spoofed IPv4 sources.
func TestASandboxWithRawSocketsCannotSpoofItsNeighbours(t *testing.T) {
	outside, outsideNS := routedOutside(t)
	nb := newNeighbour(t)
	victim := create(t, clientFor(t, keyB), dsec.CreateOptions{Network: "egress"})
	attacker := create(t, client(t), dsec.CreateOptions{Network: "egress"})
	victimNS, attackerNS := sandboxNetNS(t, victim.ID), sandboxNetNS(t, attacker.ID)
	v, a := ifaceIn(t, victimNS, "eth0"), ifaceIn(t, attackerNS, "eth0")
	br := bridgeOf(t, victim.ID)
	gwMAC := br.Attrs().HardwareAddr
	gwAddrs, _ := netlink.AddrList(br, netlink.FAMILY_V4)
	if len(gwAddrs) == 0 {
		t.Fatal("the bridge has no address")
	}
	gw := gwAddrs[0].IP.To4()
	ext := net.ParseIP(outside).To4()
	t.Logf("victim %s %s, attacker %s %s, gateway %s %s", v.ip, v.mac, a.ip, a.mac, gw, gwMAC)

	// The host talks to the victim first, so it has a neighbour entry to
	// poison.
	for i := 0; i < 20 && hostNeighbour(br, v.ip) == nil; i++ {
		sendUDP(t, v.ip, []byte("hello"))
		time.Sleep(50 * time.Millisecond)
	}
	if n := hostNeighbour(br, v.ip); n == nil || !bytes.Equal(n.HardwareAddr, v.mac) {
		t.Fatalf("the host's neighbour entry for the victim before the attack: %+v", n)
	}

	raw := openPacket(t, attackerNS, "eth0")
	outCap := openPacket(t, outsideNS, "eth9")
	spoofVictim, spoofForeign, spoofMAC, legit := frameMarker("spoof-victim-ip"), frameMarker("spoof-foreign-ip"), frameMarker("spoof-mac"), frameMarker("legit")
	foreign := net.IPv4(203, 0, 113, 99).To4()
	zero := make(net.HardwareAddr, 6)
	arpSpoofing := [][]byte{
		// Gratuitous ARP: "the victim's address is at my MAC".
		arpFrame(broadcast, a.mac, 2, a.mac, v.ip, broadcast, v.ip),
		arpFrame(broadcast, a.mac, 1, a.mac, v.ip, zero, v.ip),
		// The same, to the host directly, as a reply and as a request.
		arpFrame(gwMAC, a.mac, 2, a.mac, v.ip, gwMAC, gw),
		arpFrame(broadcast, a.mac, 1, a.mac, v.ip, zero, gw),
		// Spoofed IPv4 sources, out through the NAT.
		udpFrame(gwMAC, a.mac, v.ip, ext, spoofVictim),
		udpFrame(gwMAC, a.mac, foreign, ext, spoofForeign),
		udpFrame(gwMAC, v.mac, a.ip, ext, spoofMAC),
		// The attacker's own, honest packet: it must get out (the capture
		// works).
		udpFrame(gwMAC, a.mac, a.ip, ext, legit),
	}
	// Impersonation: the victim's MAC and address, to move the bridge's
	// forwarding entry for the victim's MAC to the attacker's port.
	macSpoofing := [][]byte{
		arpFrame(broadcast, v.mac, 1, v.mac, v.ip, zero, gw),
		udpFrame(gwMAC, v.mac, v.ip, ext, spoofVictim),
	}
	stop := make(chan struct{})
	var outSeen map[string]int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); outSeen = outCap.capture(stop, spoofVictim, spoofForeign, spoofMAC, legit) }()
	// attack sends frames every 50 ms for at least d and until the
	// neighbour's check is over.
	attack := func(frames [][]byte, d time.Duration) {
		checked, done := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			for end := time.Now().Add(d); ; time.Sleep(50 * time.Millisecond) {
				for _, f := range frames {
					raw.send(t, f)
				}
				select {
				case <-checked:
					if time.Now().After(end) {
						return
					}
				default:
				}
			}
		}()
		nb.check(t)
		close(checked)
		<-done
	}
	// The host's traffic to the victim must reach the victim and no one
	// else.
	probeVictim := func(t *testing.T) {
		victimCap := openPacket(t, victimNS, "eth0")
		attackerCap := openPacket(t, attackerNS, "eth0")
		probe := frameMarker("probe")
		stop := make(chan struct{})
		var victimSeen, attackerSeen map[string]int
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); victimSeen = victimCap.capture(stop, probe) }()
		go func() { defer wg.Done(); attackerSeen = attackerCap.capture(stop, probe) }()
		for i := 0; i < 5; i++ {
			sendUDP(t, v.ip, probe)
			time.Sleep(100 * time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond)
		close(stop)
		wg.Wait()
		if n := attackerSeen[string(probe)]; n > 0 {
			t.Errorf("the attacker received %d of the host's 5 packets to the victim", n)
		}
		if victimSeen[string(probe)] == 0 {
			t.Errorf("the victim received none of the host's 5 packets")
		}
	}

	// Longer than the neighbour table's locktime (1 s), which only slows
	// an override down.
	attack(arpSpoofing, 3*time.Second)
	t.Run("after ARP spoofing the host's neighbour entry for the victim keeps the victim's MAC", func(t *testing.T) {
		n := hostNeighbour(br, v.ip)
		if n == nil || !bytes.Equal(n.HardwareAddr, v.mac) {
			t.Errorf("the host's entry for %s: %+v, want %s", v.ip, n, v.mac)
		}
	})
	t.Run("after ARP spoofing the host's traffic to the victim reaches the victim only", probeVictim)
	attack(macSpoofing, time.Second)
	t.Run("after MAC spoofing the host's traffic to the victim reaches the victim only", probeVictim)
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	t.Run("no packet with a spoofed source leaves the host", func(t *testing.T) {
		for _, m := range []struct {
			name   string
			marker []byte
		}{{"the victim's address", spoofVictim}, {"a foreign address", spoofForeign}, {"the victim's MAC", spoofMAC}} {
			if n := outSeen[string(m.marker)]; n > 0 {
				t.Errorf("%d packets from %s reached the outside", n, m.name)
			}
		}
		if outSeen[string(legit)] == 0 {
			t.Errorf("the attacker's own packets did not reach the outside either: the capture does not work")
		}
	})
}

func TestAnEgressSandboxCannotReachTheHostsOwnNetworks(t *testing.T) {
	// The LAN exists before the shared server starts when this test runs
	// alone, and appears while it runs otherwise: both must be covered.
	hostAddr, hostPort, peer := hostLAN(t)
	outside, _ := routedOutside(t)
	nb := newNeighbour(t)
	sb := create(t, client(t), dsec.CreateOptions{Network: "egress"})
	// Changes to the host's addresses take effect within moments: wait
	// for the peer to become unreachable, then check it stays so.
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, ok := fetch(t, sb, peer, 8080)
		if !ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a peer on the host's LAN (%s) is still reachable 10 s after its network appeared: %q", peer, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Run("a peer on the host's LAN is unreachable", func(t *testing.T) {
		for i := 0; i < 3; i++ {
			if out, ok := fetch(t, sb, peer, 8080); ok {
				t.Fatalf("reached %s:8080: %q", peer, out)
			}
		}
	})
	t.Run("the host's own address on that LAN is unreachable", func(t *testing.T) {
		if out, ok := fetch(t, sb, hostAddr, hostPort); ok {
			t.Fatalf("reached %s:%d: %q", hostAddr, hostPort, out)
		}
	})
	t.Run("the outside beyond the host is still reachable", func(t *testing.T) {
		// Not HTTP (nothing listens there): a TCP connection refused by
		// the outside proves the packet got there and back.
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("timeout 3 nc "+outside+" 9 </dev/null 2>&1; echo rc=$?"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(r.Stdout), "refused") {
			t.Fatalf("nc to the outside: %q", r.Stdout)
		}
	})
	inBackground(t, sb, fmt.Sprintf("timeout 1 nc %s 8080 </dev/null; timeout 1 nc %s %d </dev/null", peer, hostAddr, hostPort))
	nb.check(t)
}
