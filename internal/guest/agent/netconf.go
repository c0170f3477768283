package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
)

// ConfigureNetwork gives a virtual machine's NIC the node's configuration
// c, at boot and again in a VM restored from another's memory (a fork
// child, which wakes with its parent's address): the link down, named
// eth0 (as a container's interface is), its MAC and MTU set, every IPv4
// address it had removed, c's address added, the link up, a default route
// through c's gateway, and /etc/resolv.conf naming c's resolvers. It
// waits up to wait for the NIC to appear (its driver probes as its module
// loads).
func ConfigureNetwork(c guest.NetConfig, wait time.Duration) error {
	ifc, err := findNIC(wait)
	if err != nil {
		return err
	}
	nl, err := openRtnl()
	if err != nil {
		return err
	}
	defer unix.Close(nl.fd)
	idx := int32(ifc.Index)
	attrs := [][]byte{rtattr(unix.IFLA_ADDRESS, c.MAC), rtattr(unix.IFLA_MTU, u32(uint32(c.MTU)))}
	if ifc.Name != nicName {
		// A full VM's udev names it after its slot (enp0s3): the
		// sandbox's interface is eth0 on every kind.
		attrs = append(attrs, rtattr(unix.IFLA_IFNAME, append([]byte(nicName), 0)))
	}
	if err := nl.do(unix.RTM_NEWLINK, 0, linkMsg(idx, 0, unix.IFF_UP, attrs...)); err != nil {
		return fmt.Errorf("set %s's name, MAC and MTU: %w", ifc.Name, err)
	}
	ifc.Name = nicName
	old, err := ifc.Addrs()
	if err != nil {
		return fmt.Errorf("list %s's addresses: %w", ifc.Name, err)
	}
	for _, a := range old {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.To4() == nil {
			continue
		}
		ones, _ := ipn.Mask.Size()
		if err := nl.do(unix.RTM_DELADDR, 0, addrMsg(idx, ones, ipn.IP.To4())); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			return fmt.Errorf("remove %s from %s: %w", ipn, ifc.Name, err)
		}
	}
	ip := c.Addr.Addr().AsSlice()
	if err := nl.do(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, addrMsg(idx, c.Addr.Bits(), ip)); err != nil {
		return fmt.Errorf("add %s to %s: %w", c.Addr, ifc.Name, err)
	}
	if err := nl.do(unix.RTM_NEWLINK, 0, linkMsg(idx, unix.IFF_UP, unix.IFF_UP)); err != nil {
		return fmt.Errorf("bring %s up: %w", ifc.Name, err)
	}
	if err := nl.do(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, defaultRoute(idx, c.Gateway.AsSlice())); err != nil {
		return fmt.Errorf("route through %s: %w", c.Gateway, err)
	}
	if err := os.WriteFile(resolvConf, []byte(c.ResolvConf()), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", resolvConf, err)
	}
	return nil
}

// resolvConf is where ConfigureNetwork writes the resolvers (a variable
// for tests, which configure an interface in a namespace of the host's).
var resolvConf = "/etc/resolv.conf"

// nicName is the name the VM's interface gets, as a container's has.
const nicName = "eth0"

// findNIC is the VM's Ethernet interface (it has one).
func findNIC(wait time.Duration) (*net.Interface, error) {
	deadline := time.Now().Add(wait)
	for {
		ifs, err := net.Interfaces()
		if err != nil {
			return nil, err
		}
		for i := range ifs {
			if ifs[i].Flags&net.FlagLoopback == 0 && len(ifs[i].HardwareAddr) == 6 {
				return &ifs[i], nil
			}
		}
		if time.Now().After(deadline) {
			return nil, errors.New("the VM has no network interface")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// rtnl is a route netlink socket.
type rtnl struct {
	fd  int
	seq uint32
}

func openRtnl() (*rtnl, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink bind: %w", err)
	}
	return &rtnl{fd: fd}, nil
}

// do sends one request and waits for its acknowledgement.
func (s *rtnl) do(typ, flags int, body []byte) error {
	s.seq++
	msg := make([]byte, unix.SizeofNlMsghdr, unix.SizeofNlMsghdr+len(body))
	binary.NativeEndian.PutUint32(msg[0:], uint32(unix.SizeofNlMsghdr+len(body)))
	binary.NativeEndian.PutUint16(msg[4:], uint16(typ))
	binary.NativeEndian.PutUint16(msg[6:], uint16(flags|unix.NLM_F_REQUEST|unix.NLM_F_ACK))
	binary.NativeEndian.PutUint32(msg[8:], s.seq)
	msg = append(msg, body...)
	if err := unix.Sendto(s.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(s.fd, buf, 0)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Seq != s.seq || m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
				continue
			}
			if errno := int32(binary.NativeEndian.Uint32(m.Data)); errno != 0 {
				return unix.Errno(-errno)
			}
			return nil
		}
	}
}

func u32(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }

// rtattr is one route attribute, padded to 4 bytes.
func rtattr(typ int, data []byte) []byte {
	b := make([]byte, 4, 4+len(data)+3)
	binary.NativeEndian.PutUint16(b[0:], uint16(4+len(data)))
	binary.NativeEndian.PutUint16(b[2:], uint16(typ))
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// linkMsg is an ifinfomsg for interface idx setting the flags in change
// to flags, with attributes.
func linkMsg(idx int32, flags, change uint32, attrs ...[]byte) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	b[0] = unix.AF_UNSPEC
	binary.NativeEndian.PutUint32(b[4:], uint32(idx))
	binary.NativeEndian.PutUint32(b[8:], flags)
	binary.NativeEndian.PutUint32(b[12:], change)
	for _, a := range attrs {
		b = append(b, a...)
	}
	return b
}

// addrMsg is an ifaddrmsg for IPv4 address ip/bits on interface idx.
func addrMsg(idx int32, bits int, ip []byte) []byte {
	b := make([]byte, unix.SizeofIfAddrmsg)
	b[0] = unix.AF_INET
	b[1] = byte(bits)
	b[3] = unix.RT_SCOPE_UNIVERSE
	binary.NativeEndian.PutUint32(b[4:], uint32(idx))
	b = append(b, rtattr(unix.IFA_LOCAL, ip)...)
	return append(b, rtattr(unix.IFA_ADDRESS, ip)...)
}

// defaultRoute is an rtmsg for the default route through gw on idx.
func defaultRoute(idx int32, gw []byte) []byte {
	b := make([]byte, unix.SizeofRtMsg)
	b[0] = unix.AF_INET
	b[4] = unix.RT_TABLE_MAIN
	b[5] = unix.RTPROT_BOOT
	b[6] = unix.RT_SCOPE_UNIVERSE
	b[7] = unix.RTN_UNICAST
	b = append(b, rtattr(unix.RTA_GATEWAY, gw)...)
	return append(b, rtattr(unix.RTA_OIF, u32(uint32(idx)))...)
}
