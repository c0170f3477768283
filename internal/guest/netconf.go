package guest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// NetConfig is a virtual machine's network as the node gives it to the
// guest (the agent's -net flag, the microVM's dsec.net kernel argument and
// `dsec-guest identity -net`): the sandbox's address with its subnet's
// length, the gateway, the NIC's MAC (the sandbox's, which the node's
// bridge admits), the link's MTU and the resolvers.
type NetConfig struct {
	Addr    netip.Prefix
	Gateway netip.Addr
	MAC     net.HardwareAddr
	MTU     int
	DNS     []netip.Addr
}

// String is c as ParseNetConfig reads it: ADDR/BITS,GATEWAY,MAC,MTU[,DNS...]
// (no spaces: it travels as one kernel argument).
func (c NetConfig) String() string {
	parts := []string{c.Addr.String(), c.Gateway.String(), c.MAC.String(), strconv.Itoa(c.MTU)}
	for _, d := range c.DNS {
		parts = append(parts, d.String())
	}
	return strings.Join(parts, ",")
}

// ParseNetConfig parses NetConfig.String's form.
func ParseNetConfig(s string) (NetConfig, error) {
	f := strings.Split(s, ",")
	if len(f) < 4 {
		return NetConfig{}, errors.New("want ADDR/BITS,GATEWAY,MAC,MTU[,DNS...]")
	}
	var c NetConfig
	var err error
	if c.Addr, err = netip.ParsePrefix(f[0]); err != nil || !c.Addr.Addr().Is4() {
		return c, fmt.Errorf("address %q: want IPv4/BITS", f[0])
	}
	if c.Gateway, err = netip.ParseAddr(f[1]); err != nil || !c.Gateway.Is4() {
		return c, fmt.Errorf("gateway %q: want IPv4", f[1])
	}
	if c.MAC, err = net.ParseMAC(f[2]); err != nil || len(c.MAC) != 6 {
		return c, fmt.Errorf("MAC %q", f[2])
	}
	if c.MTU, err = strconv.Atoi(f[3]); err != nil || c.MTU < 576 || c.MTU > 65535 {
		return c, fmt.Errorf("MTU %q", f[3])
	}
	for _, d := range f[4:] {
		a, err := netip.ParseAddr(d)
		if err != nil {
			return c, fmt.Errorf("resolver %q", d)
		}
		c.DNS = append(c.DNS, a)
	}
	return c, nil
}

// ResolvConf is the resolv.conf naming c's resolvers.
func (c NetConfig) ResolvConf() string {
	var b strings.Builder
	for _, d := range c.DNS {
		fmt.Fprintf(&b, "nameserver %s\n", d)
	}
	return b.String()
}
