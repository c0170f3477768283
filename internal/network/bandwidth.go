package network

import (
	"github.com/vishvananda/netlink"

	"github.com/opendsec/dsec/internal/errdefs"
)

// MaxBandwidthMbps bounds a sandbox's bandwidth limit.
const MaxBandwidthMbps = 100000

// SetBandwidth limits an egress sandbox's throughput to mbps megabits a
// second each way (0: no limit): a token bucket (tbf) on the host's end
// of its veth shapes what it receives, one on its own end (eth0, in its
// namespace, which it cannot change: the namespace is the host user
// namespace's) what it sends. Queues hold at most 50 ms at the rate. It is
// idempotent.
func (m *Manager) SetBandwidth(a *Attachment, mbps int64) error {
	if a == nil || a.Mode != ModeEgress {
		return errdefs.Invalid("a bandwidth limit needs network mode egress")
	}
	if mbps < 0 || mbps > MaxBandwidthMbps {
		return errdefs.Invalid("bandwidth_mbps %d out of range [0, %d]", mbps, MaxBandwidthMbps)
	}
	host, err := netlink.LinkByName(a.HostVeth)
	if err != nil {
		return errdefs.Internal(err, "find the sandbox's veth")
	}
	if err := shape(&netlink.Handle{}, host, mbps); err != nil {
		return errdefs.Internal(err, "limit the sandbox's bandwidth")
	}
	h, err := handleIn(a.NetNS)
	if err != nil {
		return errdefs.Internal(err, "open the sandbox's network namespace")
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return errdefs.Internal(err, "find the sandbox's interface")
	}
	if err := shape(h, eth, mbps); err != nil {
		return errdefs.Internal(err, "limit the sandbox's bandwidth")
	}
	a.BandwidthMbps = mbps
	return nil
}

// shape puts a tbf of mbps as link's root qdisc (0: the default qdisc
// back).
func shape(h *netlink.Handle, link netlink.Link, mbps int64) error {
	attrs := netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Handle: netlink.MakeHandle(1, 0), Parent: netlink.HANDLE_ROOT}
	if mbps == 0 {
		err := h.QdiscDel(&netlink.Tbf{QdiscAttrs: attrs})
		if err != nil && !isNotExist(err) && err.Error() != "invalid argument" {
			return err
		}
		return nil
	}
	rate := uint64(mbps) * 1000 * 1000 / 8 // bytes a second
	// Burst: 10 ms at the rate, at least a few full-size frames (a GSO
	// segment is up to 64 KiB) so the bucket never stalls on one.
	burst := uint32(max(rate/100, 3*65536))
	limit := uint32(max(rate/20, uint64(burst))) // queue: 50 ms at the rate
	q := &netlink.Tbf{QdiscAttrs: attrs, Rate: rate, Limit: limit, Buffer: netlink.Xmittime(rate, burst)}
	return h.QdiscReplace(q)
}
