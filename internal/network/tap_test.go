package network

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// vnetHdrLen is the virtio-net header a tap with IFF_VNET_HDR puts before
// every frame (struct virtio_net_hdr).
const vnetHdrLen = 10

// arpFrame is an ARP request from (mac, ip) for target, broadcast.
func arpFrame(mac net.HardwareAddr, ip, target netip.Addr) []byte {
	f := make([]byte, 0, 42)
	f = append(f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
	f = append(f, mac...)
	f = binary.BigEndian.AppendUint16(f, unix.ETH_P_ARP)
	f = binary.BigEndian.AppendUint16(f, 1)      // Ethernet
	f = binary.BigEndian.AppendUint16(f, 0x0800) // IPv4
	f = append(f, 6, 4)
	f = binary.BigEndian.AppendUint16(f, 1) // request
	f = append(f, mac...)
	f = append(f, ip.AsSlice()...)
	f = append(f, make([]byte, 6)...)
	return append(f, target.AsSlice()...)
}

// arpAsk writes the ARP request frame into the tap every 200 ms for up
// to wait (the bridge port may still be coming up: the kernel enables it
// from its link-watch work, which runs late on a busy host) and returns
// the MAC of the first reply telling where target is (nil: none came).
func arpAsk(t *testing.T, tap *os.File, frame []byte, target netip.Addr, wait time.Duration) net.HardwareAddr {
	t.Helper()
	fd := int(tap.Fd())
	buf := make([]byte, 65536)
	var next time.Time
	for end := time.Now().Add(wait); time.Now().Before(end); {
		if time.Now().After(next) {
			if _, err := unix.Write(fd, append(make([]byte, vnetHdrLen), frame...)); err != nil {
				t.Fatal(err)
			}
			next = time.Now().Add(200 * time.Millisecond)
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(pfd, 50)
		if err != nil && err != unix.EINTR {
			t.Fatal(err)
		}
		if n <= 0 {
			continue
		}
		n, err = unix.Read(fd, buf)
		if err != nil {
			t.Fatal(err)
		}
		f := buf[vnetHdrLen:n]
		if len(f) >= 42 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_ARP && binary.BigEndian.Uint16(f[20:]) == 2 && bytes.Equal(f[28:32], target.AsSlice()) {
			return net.HardwareAddr(f[22:28])
		}
	}
	return nil
}

// TestATapCarriesTheGuestsFramesThroughTheSandboxsPort writes frames into
// a sandbox's tap as a VM's NIC would: the guest, with the sandbox's MAC
// and address, is answered by the gateway; the same frame with another
// sender address is dropped at the bridge port, as a container's would be.
func TestATapCarriesTheGuestsFramesThroughTheSandboxsPort(t *testing.T) {
	m := newManager(t)
	a, err := m.Setup(context.Background(), fmt.Sprintf("sb%d-tap", os.Getpid()), Options{Mode: ModeEgress})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release(a)
	for i := 0; i < 2; i++ { // idempotent
		if err := PrepareTap(a.NetNS); err != nil {
			t.Fatalf("PrepareTap (%d): %v", i, err)
		}
	}
	h, err := handleIn(a.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, name := range []string{"eth0", TapName} {
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		filters, err := h.FilterList(l, netlink.MakeHandle(0xffff, 0))
		if err != nil || len(filters) != 1 {
			t.Fatalf("%s's ingress filters after two PrepareTaps: %v %v", name, filters, err)
		}
	}

	tap, err := OpenTap(a.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	defer tap.Close()
	g, ok := m.Guest(a)
	if !ok {
		t.Fatal("no guest configuration for an egress attachment")
	}
	mac := g.MAC
	if got := arpAsk(t, tap, arpFrame(mac, g.Addr.Addr(), g.Gateway), g.Gateway, 10*time.Second); got == nil {
		t.Fatal("the gateway did not answer the guest's ARP requests")
	}
	// The port forwards now: what it drops, its checks drop.
	forged := g.Addr.Addr().Next()
	if got := arpAsk(t, tap, arpFrame(mac, forged, g.Gateway), g.Gateway, time.Second); got != nil {
		t.Fatalf("a request with a forged sender address (%s) was answered by %s", forged, got)
	}

	tap.Close()
	m.Release(a)
	if rest := left(t, m, a); len(rest) > 0 {
		t.Fatalf("left behind: %v", rest)
	}
}
