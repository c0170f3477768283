package qemu

import (
	"os"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
)

// NetUnavailable says why VMs cannot have egress on this host ("": they
// can): their NIC's backend is a tap device.
func NetUnavailable() string {
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		return "no /dev/net/tun on this host (the tun module)"
	}
	return ""
}

// PrepareNetwork readies a sandbox's network for a VM's NIC and returns
// the namespace whose tap backs it (VMConfig.TapNS; "" for a sandbox
// without egress, which gets no NIC).
func PrepareNetwork(nw substrate.Network) (string, error) {
	if nw.Mode != network.ModeEgress {
		return "", nil
	}
	if nw.NetNS == "" || !nw.Guest.Addr.IsValid() {
		return "", errdefs.Internal(nil, "an egress network without a namespace or an address")
	}
	if err := network.PrepareTap(nw.NetNS); err != nil {
		return "", errdefs.Internal(err, "prepare the sandbox's tap device")
	}
	return nw.NetNS, nil
}
