// Command icmpping sends ICMP echo requests to an IPv4 address through an
// unprivileged ICMP datagram socket — what iputils' ping uses without
// CAP_NET_RAW, allowed by net.ipv4.ping_group_range — and exits 0 at the
// first reply. The hostile tests copy it into sandboxes (busybox's ping
// needs a raw socket).
package main

import (
	"fmt"
	"net"
	"os"
	"syscall"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: icmpping ADDRESS")
		os.Exit(2)
	}
	ip := net.ParseIP(os.Args[1]).To4()
	if ip == nil {
		fmt.Fprintln(os.Stderr, "not an IPv4 address:", os.Args[1])
		os.Exit(2)
	}
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM, syscall.IPPROTO_ICMP)
	if err != nil {
		fmt.Fprintln(os.Stderr, "icmp datagram socket:", err)
		os.Exit(2)
	}
	tv := syscall.Timeval{Sec: 1}
	syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
	to := &syscall.SockaddrInet4{Addr: [4]byte(ip)}
	for seq := 1; seq <= 3; seq++ {
		// Type 8 (echo request); the kernel sets the identifier and checksum.
		msg := []byte{8, 0, 0, 0, 0, 0, 0, byte(seq), 'd', 's', 'e', 'c'}
		if err := syscall.Sendto(fd, msg, 0, to); err != nil {
			fmt.Fprintln(os.Stderr, "send:", err)
			os.Exit(1)
		}
		buf := make([]byte, 1500)
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err == nil && n >= 8 && buf[0] == 0 {
			fmt.Printf("echo reply from %s seq %d\n", ip, buf[7])
			return
		}
	}
	fmt.Fprintln(os.Stderr, "no echo reply from", ip)
	os.Exit(1)
}
