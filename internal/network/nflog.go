package network

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The kernel logs each new connection of a sandbox that the inet table's
// rules decide (forwarded ones, and those to the host itself) to an NFLOG
// group of the manager's own, with a prefix naming the verdict and what
// decided it ("a pin", "d private", ...); the node reads the group and
// files each record in its sandbox's log.

// nflog constants (linux/netfilter/nfnetlink_log.h), which x/sys/unix
// lacks.
const (
	nfulnlMsgPacket    = 0
	nfulnlMsgConfig    = 1
	nfulaCfgCmd        = 1
	nfulaCfgMode       = 2
	nfulaCfgQthresh    = 5
	nfulnlCfgCmdBind   = 1
	nfulnlCopyPacket   = 2
	nfulaPayload       = 9
	nfulaPrefix        = 10
	nfulaTimestamp     = 3
	nflogCopyRange     = 64 // the IPv4 header and the ports
	nflogSocketBufSize = 1 << 20
)

// logGroup is a manager's NFLOG group, derived from its table name like
// its port group: stable, distinct between the managers of one host.
func logGroup(table string) uint16 {
	return uint16(portGroup(table)%65000) + 500
}

// openNFLOG binds group and returns the socket.
func openNFLOG(group uint16) (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return -1, err
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, nflogSocketBufSize)
	cmd := attr(nfulaCfgCmd, []byte{nfulnlCfgCmdBind, 0, 0, 0}[:1])
	mode := make([]byte, 6)
	binary.BigEndian.PutUint32(mode, nflogCopyRange)
	mode[4] = nfulnlCopyPacket
	// Each record is sent at once: the kernel's default batches up to 100
	// of them for up to a second, so a connection would show in the log
	// only a second after it was refused.
	qthresh := binary.BigEndian.AppendUint32(nil, 1)
	var b []byte
	b = nfMessage(b, unix.NFNL_SUBSYS_ULOG<<8|nfulnlMsgConfig, unix.NLM_F_REQUEST|unix.NLM_F_ACK, 1, unix.AF_UNSPEC, group, cmd)
	b = nfMessage(b, unix.NFNL_SUBSYS_ULOG<<8|nfulnlMsgConfig, unix.NLM_F_REQUEST|unix.NLM_F_ACK, 2, unix.AF_UNSPEC, group, append(attr(nfulaCfgMode, mode), attr(nfulaCfgQthresh, qthresh)...))
	if err := unix.Sendto(fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	tv := unix.Timeval{Sec: 5}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	buf := make([]byte, 4096)
	for acked := 0; acked < 2; {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("configure NFLOG group %d: %w", group, err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			unix.Close(fd)
			return -1, err
		}
		for _, m := range msgs {
			if m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
				continue
			}
			if errno := -int32(binary.NativeEndian.Uint32(m.Data[:4])); errno != 0 {
				unix.Close(fd)
				return -1, fmt.Errorf("configure NFLOG group %d: %w", group, syscall.Errno(errno))
			}
			acked++
		}
	}
	tv = unix.Timeval{}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return fd, nil
}

// readNFLOG files every logged packet in its sandbox's log until the
// socket is closed.
func (m *Manager) readNFLOG(fd int) {
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			if err == unix.EINTR || err == unix.ENOBUFS {
				// ENOBUFS: the kernel dropped records (a burst beyond the
				// socket's buffer); the rest keep coming.
				continue
			}
			select {
			case <-m.stop:
			default:
				m.log.Warn("connection log: reading the kernel's records stopped", slog.Any("error", err))
			}
			return
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			continue
		}
		for _, msg := range msgs {
			if msg.Header.Type != unix.NFNL_SUBSYS_ULOG<<8|nfulnlMsgPacket || len(msg.Data) < 4 {
				continue
			}
			m.nflogPacket(msg.Data[4:])
		}
	}
}

// nflogPacket files one packet's record.
func (m *Manager) nflogPacket(attrs []byte) {
	var prefix string
	var payload []byte
	at := time.Time{}
	for len(attrs) >= 4 {
		l := int(binary.NativeEndian.Uint16(attrs[0:2]))
		typ := binary.NativeEndian.Uint16(attrs[2:4]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
		if l < 4 || l > len(attrs) {
			break
		}
		data := attrs[4:l]
		switch typ {
		case nfulaPrefix:
			prefix = strings.TrimRight(string(data), "\x00")
		case nfulaPayload:
			payload = data
		case nfulaTimestamp:
			if len(data) >= 16 {
				at = time.Unix(int64(binary.BigEndian.Uint64(data[0:8])), int64(binary.BigEndian.Uint64(data[8:16]))*1000)
			}
		}
		attrs = attrs[min((l+3)&^3, len(attrs)):]
	}
	verdict, what, ok := strings.Cut(prefix, " ")
	if !ok || len(payload) < 20 || payload[0]>>4 != 4 {
		return
	}
	src := netip.AddrFrom4([4]byte(payload[12:16]))
	dst := netip.AddrFrom4([4]byte(payload[16:20]))
	sb := m.sandboxAt(src)
	if sb == nil {
		return
	}
	r := ConnRecord{At: at, Addr: dst, Allow: verdict == "a"}
	ihl := int(payload[0]&0x0f) * 4
	switch payload[9] {
	case unix.IPPROTO_TCP:
		r.Protocol = "tcp"
	case unix.IPPROTO_UDP:
		r.Protocol = "udp"
	case unix.IPPROTO_ICMP:
		r.Protocol = "icmp"
	default:
		r.Protocol = fmt.Sprintf("ip proto %d", payload[9])
	}
	if (r.Protocol == "tcp" || r.Protocol == "udp") && len(payload) >= ihl+4 {
		r.Port = binary.BigEndian.Uint16(payload[ihl+2 : ihl+4])
	}
	sb.mu.Lock()
	switch what {
	case "open":
		r.Reason = "unrestricted"
	case "host":
		r.Reason = "the host"
	case "pin":
		r.Reason = "pinned"
		if name, ok := sb.pinnedLocked(dst, ""); ok {
			r.Reason = "pinned: " + name
		}
	default:
		_, r.Reason = m.addrVerdictLocked(sb, dst, "", what != "pin")
		if what == "dns" {
			r.Reason = "the node's resolvers"
		}
	}
	sb.mu.Unlock()
	sb.log.add(r, false)
}
