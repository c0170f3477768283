package network

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/nsthread"
)

// TapName is the tap device a virtual machine's NIC is attached to, in
// the sandbox's network namespace, beside its eth0.
const TapName = "tap0"

// tapFlags are the tap's flags, the same at creation and at every open: a
// vnet header lets the guest's NIC hand the host whole TCP segments.
const tapFlags = unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR

// PrepareTap readies an egress sandbox's namespace for a virtual machine:
// a persistent tap device (TapName, kept until the namespace goes, so every
// QEMU of the sandbox — boot, resume, restore — opens the same one) and
// a tc redirect each way between it and eth0 (an ingress u32 match-all
// with a mirred action): every frame the guest sends leaves by eth0 and
// every frame eth0 receives goes to the guest, so the guest's NIC (with
// the sandbox's MAC and address) is, on the wire, the sandbox's interface.
// The host sees what it sees of a container: the same bridge port checks,
// nftables rules, policy, resolver, proxy, bandwidth limit (eth0's root
// qdisc shapes what it sends) and connection log. The namespace's own
// stack sees nothing. It is idempotent.
func PrepareTap(nsPath string) error {
	if err := nsthread.NetNS(nsPath, func() error {
		if _, err := netlink.LinkByName(TapName); err == nil {
			return nil
		}
		f, err := openTap()
		if err != nil {
			return err
		}
		defer f.Close()
		if err := unix.IoctlSetInt(int(f.Fd()), unix.TUNSETPERSIST, 1); err != nil {
			return fmt.Errorf("make %s persistent: %w", TapName, err)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("create the tap device: %w", err)
	}
	h, err := handleIn(nsPath)
	if err != nil {
		return err
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return err
	}
	tap, err := h.LinkByName(TapName)
	if err != nil {
		return err
	}
	if err := h.LinkSetMTU(tap, eth.Attrs().MTU); err != nil {
		return fmt.Errorf("set the tap's MTU: %w", err)
	}
	for _, p := range [][2]netlink.Link{{eth, tap}, {tap, eth}} {
		if err := redirect(h, p[0], p[1]); err != nil {
			return fmt.Errorf("redirect %s to %s: %w", p[0].Attrs().Name, p[1].Attrs().Name, err)
		}
	}
	return h.LinkSetUp(tap)
}

// redirect sends every frame from arrives on to out's egress (once: a
// link that has its filter is left as it is).
func redirect(h *netlink.Handle, from, out netlink.Link) error {
	q := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: from.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
	if err := h.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add the ingress qdisc: %w", err)
	}
	if fs, err := h.FilterList(from, netlink.MakeHandle(0xffff, 0)); err == nil && len(fs) > 0 {
		return nil
	}
	// No selector is u32's match-all (one key matching anything).
	f := &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: from.Attrs().Index, Parent: netlink.MakeHandle(0xffff, 0), Priority: 1, Protocol: unix.ETH_P_ALL},
		Actions:     []netlink.Action{netlink.NewMirredAction(out.Attrs().Index)},
	}
	return h.FilterAdd(f)
}

// OpenTap opens a queue of the sandbox's tap (made by PrepareTap), for
// QEMU's -netdev tap,fd=N. The descriptor is close-on-exec; pass it as an
// extra file.
func OpenTap(nsPath string) (*os.File, error) {
	var f *os.File
	err := nsthread.NetNS(nsPath, func() error {
		if _, err := netlink.LinkByName(TapName); err != nil {
			return fmt.Errorf("the sandbox's namespace has no %s: %w", TapName, err)
		}
		var err error
		f, err = openTap()
		return err
	})
	return f, err
}

// openTap opens (creating if absent) TapName in the calling thread's
// network namespace.
func openTap() (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(TapName)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(tapFlags)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("attach %s: %w", TapName, err)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun"), nil
}

// Guest is the configuration of attachment a's guest, what a virtual
// machine's own stack is given (ok false: a has no egress).
func (m *Manager) Guest(a *Attachment) (guest.NetConfig, bool) {
	if a == nil || a.Mode != ModeEgress {
		return guest.NetConfig{}, false
	}
	addr, err1 := netip.ParseAddr(a.Addr)
	mac, err2 := net.ParseMAC(a.MAC)
	if err1 != nil || err2 != nil {
		return guest.NetConfig{}, false
	}
	return guest.NetConfig{Addr: netip.PrefixFrom(addr, m.prefix.Bits()), Gateway: m.gateway, MAC: mac, MTU: m.bridgeMTU(), DNS: m.dns}, true
}
