package agent

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/guest/portmux"
)

// ListenVirtioPort serves the protocol over the virtio-serial port named
// name (a VM's channel to the node), multiplexed by portmux. It waits up to
// wait for the port to appear. The port's device node is removed once
// open: the port admits one opener, and nothing else in the guest can find
// or open it while the agent lives.
func ListenVirtioPort(name string, wait time.Duration) (net.Listener, error) {
	deadline := time.Now().Add(wait)
	for {
		dev, err := findVirtioPort(name)
		if err == nil {
			f, err := os.OpenFile(dev, os.O_RDWR, 0)
			if err != nil {
				return nil, fmt.Errorf("open %s: %w", dev, err)
			}
			os.Remove(dev)
			return portmux.Listen(f, applyStartPayload), nil
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func findVirtioPort(name string) (string, error) {
	ents, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
	for _, p := range ents {
		b, err := os.ReadFile(p)
		if err == nil && strings.TrimSpace(string(b)) == name {
			return "/dev/" + filepath.Base(filepath.Dir(p)), nil
		}
	}
	return "", fmt.Errorf("no virtio-serial port named %q", name)
}

// applyStartPayload takes the node's clock and seed (guest.StartPayload).
func applyStartPayload(p []byte) {
	now, seed, ok := guest.ParseStartPayload(p)
	if !ok {
		return
	}
	if err := ApplyIdentity("", now, seed); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest: apply the node's clock and seed:", err)
	}
}

// ListenVsock serves the protocol on AF_VSOCK port (a VM's channel where
// the host has vhost-vsock); every call is its own vsock connection. Only
// the host (CID 2) may connect.
func ListenVsock(port uint32) (net.Listener, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock bind: %w", err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock listen: %w", err)
	}
	return &vsockListener{fd: fd}, nil
}

type vsockListener struct{ fd int }

func (l *vsockListener) Accept() (net.Conn, error) {
	for {
		nfd, sa, err := unix.Accept4(l.fd, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return nil, err
		}
		if vm, ok := sa.(*unix.SockaddrVM); !ok || vm.CID != unix.VMADDR_CID_HOST {
			unix.Close(nfd)
			continue
		}
		return &vsockConn{File: os.NewFile(uintptr(nfd), "vsock")}, nil
	}
}

func (l *vsockListener) Close() error   { return unix.Close(l.fd) }
func (l *vsockListener) Addr() net.Addr { return vsockAddr{} }

// vsockConn is a vsock connection; os.File gives it the poller and
// deadlines.
type vsockConn struct{ *os.File }

func (c *vsockConn) LocalAddr() net.Addr  { return vsockAddr{} }
func (c *vsockConn) RemoteAddr() net.Addr { return vsockAddr{} }

type vsockAddr struct{}

func (vsockAddr) Network() string { return "vsock" }
func (vsockAddr) String() string  { return "vsock" }

// ApplyIdentity gives a VM restored from a memory snapshot its own
// identity: hostname, the wall clock (a snapshot's clock stopped when it
// was taken) and fresh randomness mixed into the kernel's pool and
// credited, so forks of one snapshot do not share random streams.
func ApplyIdentity(hostname string, now time.Time, seed []byte) error {
	var errs []error
	if hostname != "" {
		if err := unix.Sethostname([]byte(hostname)); err != nil {
			errs = append(errs, fmt.Errorf("set hostname: %w", err))
		}
	}
	if !now.IsZero() {
		tv := unix.NsecToTimeval(now.UnixNano())
		if err := unix.Settimeofday(&tv); err != nil {
			errs = append(errs, fmt.Errorf("set clock: %w", err))
		}
	}
	if len(seed) > 0 {
		if err := addEntropy(seed); err != nil {
			errs = append(errs, fmt.Errorf("seed randomness: %w", err))
		}
	}
	return errors.Join(errs...)
}

// NewMachineID gives the machine a new random machine ID, so VMs restored
// from one snapshot do not share it. A transient ID (systemd keeps it in
// /run/machine-id and bind-mounts that read-only on /etc/machine-id) is
// rewritten in place; a committed one in /etc/machine-id.
func NewMachineID() error {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	// A version 4 UUID, as systemd makes them.
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	path := "/etc/machine-id"
	if _, err := os.Stat("/run/machine-id"); err == nil {
		path = "/run/machine-id"
	}
	if err := os.WriteFile(path, []byte(hex.EncodeToString(b[:])+"\n"), 0o444); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// ioctls of random(4).
const (
	rndAddEntropy = 0x40085203 // _IOW('R', 0x03, int[2])
	rndReseedCRNG = 0x5207     // _IO('R', 0x07)
)

// addEntropy credits seed to the kernel's pool (RNDADDENTROPY) and forces
// a reseed of its generator (RNDRESEEDCRNG).
func addEntropy(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	b := make([]byte, 8+len(seed))
	*(*int32)(unsafe.Pointer(&b[0])) = int32(len(seed) * 8)
	*(*int32)(unsafe.Pointer(&b[4])) = int32(len(seed))
	copy(b[8:], seed)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndAddEntropy, uintptr(unsafe.Pointer(&b[0]))); e != 0 {
		return e
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndReseedCRNG, 0); e != 0 && e != unix.EINVAL {
		return e
	}
	return nil
}
