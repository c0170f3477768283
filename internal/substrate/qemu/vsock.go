package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
)

// VsockCID derives a guest CID (3 and up) from a sandbox ID.
func VsockCID(id string) uint32 {
	h := sha256.Sum256([]byte(id))
	return 3 + binary.BigEndian.Uint32(h[:4])%(1<<30)
}

// vsockDialer dials the agent over vhost-vsock: every call is its own
// vsock connection, no multiplexer. Designed for hosts with
// /dev/vhost-vsock; not exercised on hosts without it.
func vsockDialer(cid, port uint32) guest.DialFunc {
	return func(ctx context.Context) (net.Conn, error) {
		fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("vsock socket: %w", err)
		}
		err = unix.Connect(fd, &unix.SockaddrVM{CID: cid, Port: port})
		if err != nil && err != unix.EINPROGRESS {
			unix.Close(fd)
			return nil, fmt.Errorf("vsock connect: %w", err)
		}
		f := os.NewFile(uintptr(fd), "vsock")
		if err == unix.EINPROGRESS {
			rc, _ := f.SyscallConn()
			if dl, ok := ctx.Deadline(); ok {
				f.SetWriteDeadline(dl)
			}
			var serr error
			werr := rc.Write(func(fd uintptr) bool {
				v, e := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
				if e != nil {
					serr = e
				} else if v != 0 {
					serr = unix.Errno(v)
				}
				return true
			})
			f.SetWriteDeadline(time.Time{})
			if werr != nil || serr != nil {
				f.Close()
				return nil, fmt.Errorf("vsock connect: %v %v", werr, serr)
			}
		}
		return &vsockConn{File: f}, nil
	}
}

type vsockConn struct{ *os.File }

func (c *vsockConn) LocalAddr() net.Addr  { return vsockAddr{} }
func (c *vsockConn) RemoteAddr() net.Addr { return vsockAddr{} }

type vsockAddr struct{}

func (vsockAddr) Network() string { return "vsock" }
func (vsockAddr) String() string  { return "vsock" }
