// Package microvm is the microvm substrate: every sandbox is a minimal VM
// with its own Linux kernel, started by QEMU with the microvm machine type
// (virtio-mmio devices, no firmware, direct PVH kernel boot). The guest's
// root file system is the image's layers as a shared read-only EROFS disk
// under an overlay whose upper layer is the sandbox's own ext4 disk; its
// init is dsec-guest, reached over a virtio-serial port (multiplexed by
// guest/portmux) or, where the host has vhost-vsock, over vsock.
//
// Memory snapshots are QEMU migration streams written to a file: pause
// saves one and stops QEMU (its memory is freed), resume restores it; a
// machine snapshot adds a copy of the writable disk and starts any number
// of new sandboxes. QEMU runs KVM when a probe boot proves it works, else
// TCG. QEMU processes outlive the node, which re-adopts them.
package microvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// Config configures the driver. The zero value works given GuestBinary,
// StateDir and KernelDir.
type Config struct {
	// QEMU is the qemu-system-x86_64 binary (default: from PATH).
	QEMU string
	// KernelDir holds the guest kernel prepared by scripts/guest-kernel.sh
	// (required; `dsec serve` uses CACHE_DIR/guest-kernel).
	KernelDir string
	// GuestBinary is the static dsec-guest binary put into every image
	// disk (required).
	GuestBinary string
	// Busybox is the static busybox of the initramfs (default /bin/busybox).
	Busybox string
	// StateDir keeps image disks, disk templates, initramfs files and the
	// acceleration probe's result (required).
	StateDir string
	// RunDir holds the agent and monitor sockets; it must be short (socket
	// paths are limited to 108 bytes). Default /run/dsec/<hash of
	// StateDir>/vm.
	RunDir string
	// Accel is "auto" (default: KVM if a probe guest boots in time, else
	// TCG), "kvm" or "tcg".
	Accel string
	// ProbeTimeout bounds the KVM probe boot (default 20s).
	ProbeTimeout time.Duration
	// ProbeCache keeps the probe's result for the current host boot, for
	// every node and test on the host (default /run/dsec/kvm-probe.json).
	ProbeCache string
	// BootTimeout bounds a boot or restore until the agent answers
	// (default 90s: TCG on a loaded host is slow).
	BootTimeout time.Duration
	// TBSizeMiB is TCG's translation buffer per VM (default 128: with 32,
	// retranslation cost a quarter more QEMU CPU for the same work).
	TBSizeMiB int
	// CgroupParent is the cgroup under which each VM's QEMU gets its own
	// (default /dsec, the containers' parent), limited to the sandbox's
	// CPU share and to its guest's memory plus QEMU's own
	// (qemu.Resources). NoCgroups runs QEMU in the node's cgroup, without
	// limits.
	CgroupParent string
	NoCgroups    bool
	// ColdBoot boots every sandbox instead of restoring its image's boot
	// snapshot for its machine shape (default false: see bootsnap.go).
	ColdBoot bool
	// DefaultDiskMB sizes a sandbox's writable disk when the spec gives no
	// disk_mb (default 1024). MaxDiskMB caps it (default 65536).
	DefaultDiskMB, MaxDiskMB int64
	// KernelArgs are appended to the guest kernel's command line (default
	// none; "dsec.init=hold" stops the boot before the agent starts).
	KernelArgs string
	// Channel is "auto" (default: vsock where /dev/vhost-vsock exists,
	// else virtio-serial), "vsock" or "serial".
	Channel string
}

// minDiskMB is the smallest writable disk (ext4 and the overlay's work
// directory need room).
const minDiskMB = 64

// Driver is the microvm driver.
type Driver struct {
	log         *slog.Logger
	cfg         Config
	qemu        string
	kernel      *qemu.Kernel
	initrd      string
	accel       qemu.Accel
	vsock       bool
	mkfsErofs   string
	mkfsExt4    string
	guestDigest string
	version     string // QEMU's
	boots       qemu.BootSnapshots
	// cgroupParent is the parent of its QEMUs' cgroups ("": none).
	cgroupParent string
	// noNet is why sandboxes cannot have egress here ("": they can).
	noNet string
	caps  substrate.Capabilities
}

var _ substrate.Driver = (*Driver)(nil)

// New probes the host and returns a driver. If microVMs cannot run here
// the driver still returns, reporting why in its capabilities; Create then
// fails with an Unavailable error. The KVM probe may take up to
// ProbeTimeout once per host boot (the result is cached in StateDir).
func New(cfg Config, log *slog.Logger) (*Driver, error) {
	if cfg.GuestBinary == "" || cfg.StateDir == "" {
		return nil, errors.New("microvm driver needs GuestBinary and StateDir")
	}
	if cfg.Busybox == "" {
		cfg.Busybox = "/bin/busybox"
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 90 * time.Second
	}
	if cfg.ProbeCache == "" {
		cfg.ProbeCache = "/run/dsec/kvm-probe.json"
	}
	if cfg.TBSizeMiB == 0 {
		cfg.TBSizeMiB = 128
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "/dsec"
	}
	if cfg.DefaultDiskMB == 0 {
		cfg.DefaultDiskMB = 1024
	}
	if cfg.MaxDiskMB == 0 {
		cfg.MaxDiskMB = 64 << 10
	}
	if cfg.RunDir == "" {
		cfg.RunDir = qemu.RunDir(cfg.StateDir, "vm")
	}
	d := &Driver{log: log, cfg: cfg, boots: qemu.BootSnapshots{Dir: filepath.Join(cfg.StateDir, "boot"), Log: log}}
	d.caps = substrate.Capabilities{
		Kind: substrate.KindMicroVM,
		Caps: []substrate.Capability{substrate.CapExec, substrate.CapPTY, substrate.CapFiles,
			substrate.CapPause, substrate.CapMemorySnapshot, substrate.CapFork},
		Details: map[string]string{},
	}
	if reason := d.probe(); reason != "" {
		d.caps.Reason = reason
		log.Warn("microvm substrate unavailable", slog.String("reason", reason))
		return d, nil
	}
	d.caps.Available = true
	d.cgroupParent = qemu.CgroupParent(d.cfg.CgroupParent, d.cfg.NoCgroups, "microVMs", d.caps.Details, log)
	if d.noNet == "" {
		d.caps.Caps = append(d.caps.Caps, substrate.CapNetworkEgress)
	} else {
		d.caps.Details["network"] = d.noNet
	}
	log.Info("microvm substrate ready", slog.String("accel", d.accel.Name), slog.String("accel_reason", d.accel.Reason),
		slog.String("kernel", d.kernel.Release), slog.String("channel", d.caps.Details["channel"]))
	if d.accel.Name == "tcg" {
		log.Warn("microVMs run under software emulation (TCG): correct but slow", slog.String("reason", d.accel.Reason))
	}
	return d, nil
}

// probe finds what microVMs need; it returns why they cannot run, or "".
func (d *Driver) probe() string {
	if os.Geteuid() != 0 {
		return "the microvm substrate needs root"
	}
	var err error
	if d.qemu, err = qemu.FindBinary(d.cfg.QEMU); err != nil {
		return err.Error()
	}
	if v, err := qemu.Version(d.qemu); err == nil {
		d.caps.Details["qemu"], d.version = v, v
	}
	if d.cfg.KernelDir == "" {
		return "no guest kernel directory configured"
	}
	d.caps.Details["guest_kernel_dir"] = d.cfg.KernelDir // where `dsec info` says it looked
	if d.kernel, err = qemu.FindKernel(d.cfg.KernelDir); err != nil {
		return err.Error()
	}
	d.caps.Details["kernel"] = d.kernel.Release
	for _, t := range []struct {
		dst  *string
		name string
		pkg  string
	}{{&d.mkfsErofs, "mkfs.erofs", "erofs-utils"}, {&d.mkfsExt4, "mkfs.ext4", "e2fsprogs"}} {
		p, err := exec.LookPath(t.name)
		if err != nil {
			return fmt.Sprintf("%s not installed (apt-get install %s)", t.name, t.pkg)
		}
		*t.dst = p
	}
	if st, err := os.Stat(d.cfg.Busybox); err != nil || !st.Mode().IsRegular() {
		return fmt.Sprintf("static busybox not found at %s (apt-get install busybox-static)", d.cfg.Busybox)
	}
	if d.guestDigest, err = qemu.FileDigest(d.cfg.GuestBinary); err != nil {
		return fmt.Sprintf("dsec-guest binary not found at %s", d.cfg.GuestBinary)
	}
	switch d.cfg.Channel {
	case "vsock":
		d.vsock = true
	case "serial":
	default:
		_, err := os.Stat("/dev/vhost-vsock")
		d.vsock = err == nil
	}
	d.caps.Details["channel"] = "virtio-serial"
	if d.vsock {
		d.caps.Details["channel"] = "vsock"
	}
	var withNet bool
	if d.initrd, withNet, err = buildInitramfs(filepath.Join(d.cfg.StateDir, "initramfs"), d.kernel, d.cfg.Busybox, d.vsock); err != nil {
		return fmt.Sprintf("build the initramfs: %v", err)
	}
	d.noNet = qemu.NetUnavailable()
	if !withNet {
		d.noNet = fmt.Sprintf("the guest kernel in %s has no NIC driver (prepared before dsec networked microVMs: `dsec setup` prepares it again)", d.cfg.KernelDir)
	}
	if err := os.MkdirAll(d.cfg.RunDir, 0o700); err != nil {
		return fmt.Sprintf("create %s: %v", d.cfg.RunDir, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d.accel = qemu.ProbeAccel(ctx, qemu.ProbeConfig{
		Binary: d.qemu, Kernel: d.kernel, Busybox: d.cfg.Busybox, Mode: d.cfg.Accel,
		Timeout: d.cfg.ProbeTimeout, CacheFile: d.cfg.ProbeCache,
	}, d.log)
	d.caps.Details["accel"] = d.accel.Name
	d.caps.Details["accel_reason"] = d.accel.Reason
	d.pruneBootSnapshots()
	return ""
}

// Capabilities implements substrate.Driver.
func (d *Driver) Capabilities() substrate.Capabilities { return d.caps }

// Accel is how this driver's guests run.
func (d *Driver) Accel() qemu.Accel { return d.accel }

func (d *Driver) agentSock(id string) string { return qemu.AgentSock(d.cfg.RunDir, id) }
func (d *Driver) qmpSock(id string) string   { return qemu.QMPSock(d.cfg.RunDir, id) }

// Sweep kills the QEMU processes of this driver's run directory whose
// sandbox keep is false for (leftovers the node no longer knows) and
// removes their sockets. It returns how many it ended.
func (d *Driver) Sweep(keep func(id string) bool) int {
	if !d.caps.Available {
		return 0
	}
	return qemu.SweepVMs(d.cfg.RunDir, d.cgroupParent, keep)
}
