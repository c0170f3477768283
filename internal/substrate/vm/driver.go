// Package vm is the full-VM substrate (kind vm): every sandbox is a QEMU
// q35 machine booting a complete OS disk image — through SeaBIOS and the
// disk's own bootloader, or directly into the image's own kernel and
// initramfs — with a copy-on-write qcow2 disk over the image's shared
// read-only base, a screen (VGA) with keyboard and pointer for
// computer-use agents, and dsec-guest running inside as a service,
// reached over a virtio-serial port (multiplexed by guest/portmux) or
// vsock.
//
// The VM lifecycle (start, restore, pause to a file, resume, machine
// snapshots, re-adoption, the agent channel) is internal/substrate/qemu's VM, shared
// with the microvm driver. New sandboxes of an image normally start from
// the image's boot snapshot: the first boot of each image and machine
// shape is saved right after its agent answers, and later creates restore
// it with a fresh identity (Config.ColdBoot turns this off).
package vm

import (
	"archive/tar"
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

// Config configures the driver. The zero value works given GuestBinary
// and StateDir.
type Config struct {
	// QEMU is the qemu-system-x86_64 binary and QEMUImg qemu-img (default:
	// from PATH).
	QEMU, QEMUImg string
	// GuestBinary is the static dsec-guest binary the node attaches to
	// every VM (required).
	GuestBinary string
	// StateDir keeps agent disks and boot snapshots (required).
	StateDir string
	// RunDir holds the agent and monitor sockets; it must be short (socket
	// paths are limited to 108 bytes). Default /run/dsec/<hash of
	// StateDir>/fvm.
	RunDir string
	// KernelDir holds the guest kernel the KVM probe boots (the microvm
	// driver's, from scripts/guest-kernel.sh; default none: with /dev/kvm
	// present but no kernel to probe it with, VMs run under TCG).
	KernelDir string
	// Busybox is the static busybox of the probe guest (default
	// /bin/busybox).
	Busybox string
	// Accel is "auto" (default: KVM if a probe guest boots in time, else
	// TCG), "kvm" or "tcg".
	Accel string
	// ProbeTimeout bounds the KVM probe boot (default 20s); ProbeCache
	// keeps its result for the host boot (default /run/dsec/kvm-probe.json,
	// shared with the microvm driver).
	ProbeTimeout time.Duration
	ProbeCache   string
	// BootTimeout bounds a boot or restore until the agent answers
	// (default 3m: a full OS under TCG on a loaded host is slow).
	BootTimeout time.Duration
	// TBSizeMiB is TCG's translation buffer per VM (default 256: a full
	// OS's boot retranslated a sixth more with 64).
	TBSizeMiB int
	// CgroupParent is the cgroup under which each VM's QEMU gets its own
	// (default /dsec, the containers' parent), limited to the sandbox's
	// CPU share and to its guest's memory plus QEMU's own
	// (qemu.Resources). NoCgroups runs QEMU in the node's cgroup, without
	// limits.
	CgroupParent string
	NoCgroups    bool
	// Boot is how VMs boot: "auto" (default: the image's own kernel and
	// initramfs when it has them, else the firmware), "firmware" (SeaBIOS
	// and the disk's bootloader) or "direct".
	Boot string
	// ColdBoot boots every sandbox from its disk instead of restoring the
	// image's boot snapshot (default false).
	ColdBoot bool
	// MaxDiskMB caps resources.disk_mb (default 262144).
	MaxDiskMB int64
	// KernelArgs are appended to the kernel command line of direct boots
	// (default none).
	KernelArgs string
	// Channel is "auto" (default: vsock where /dev/vhost-vsock exists,
	// else virtio-serial), "vsock" or "serial".
	Channel string
	// VNC gives every VM a VNC server on 127.0.0.1 (ports from 5900),
	// locked until OpenVNC sets a password (default false).
	VNC bool
}

// minMemoryMB is the least memory a full VM gets (systemd and a Debian
// userland).
const minMemoryMB = 256

// vsockPort is the agent's AF_VSOCK port in the guest.
const vsockPort = 1024

// Driver is the vm driver.
type Driver struct {
	log       *slog.Logger
	cfg       Config
	qemu      string
	qemuImg   string
	version   string
	accel     qemu.Accel
	vsock     bool
	agentDisk string
	boots     qemu.BootSnapshots
	// cgroupParent is the parent of its QEMUs' cgroups ("": none).
	cgroupParent string
	caps         substrate.Capabilities
}

var _ substrate.Driver = (*Driver)(nil)

// New probes the host and returns a driver. If full VMs cannot run here
// the driver still returns, reporting why in its capabilities; Create then
// fails with an Unavailable error. The KVM probe may take up to
// ProbeTimeout once per host boot.
func New(cfg Config, log *slog.Logger) (*Driver, error) {
	if cfg.GuestBinary == "" || cfg.StateDir == "" {
		return nil, errors.New("vm driver needs GuestBinary and StateDir")
	}
	if cfg.Busybox == "" {
		cfg.Busybox = "/bin/busybox"
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 3 * time.Minute
	}
	if cfg.ProbeCache == "" {
		cfg.ProbeCache = "/run/dsec/kvm-probe.json"
	}
	if cfg.TBSizeMiB == 0 {
		cfg.TBSizeMiB = 256
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "/dsec"
	}
	if cfg.MaxDiskMB == 0 {
		cfg.MaxDiskMB = 256 << 10
	}
	if cfg.Boot == "" {
		cfg.Boot = "auto"
	}
	if cfg.RunDir == "" {
		cfg.RunDir = qemu.RunDir(cfg.StateDir, "fvm")
	}
	d := &Driver{log: log, cfg: cfg, boots: qemu.BootSnapshots{Dir: filepath.Join(cfg.StateDir, "boot"), Log: log}}
	d.caps = substrate.Capabilities{
		Kind: substrate.KindVM,
		Caps: []substrate.Capability{substrate.CapExec, substrate.CapPTY, substrate.CapFiles,
			substrate.CapPause, substrate.CapMemorySnapshot, substrate.CapFork, substrate.CapScreen},
		Details: map[string]string{},
	}
	if reason := d.probe(); reason != "" {
		d.caps.Reason = reason
		log.Warn("vm substrate unavailable", slog.String("reason", reason))
		return d, nil
	}
	d.caps.Available = true
	d.cgroupParent = qemu.CgroupParent(d.cfg.CgroupParent, d.cfg.NoCgroups, "full VMs", d.caps.Details, log)
	if why := qemu.NetUnavailable(); why == "" {
		d.caps.Caps = append(d.caps.Caps, substrate.CapNetworkEgress)
	} else {
		d.caps.Details["network"] = why
	}
	log.Info("vm substrate ready", slog.String("accel", d.accel.Name), slog.String("accel_reason", d.accel.Reason),
		slog.String("boot", cfg.Boot), slog.String("channel", d.caps.Details["channel"]))
	if d.accel.Name == "tcg" {
		log.Warn("full VMs run under software emulation (TCG): correct but slow", slog.String("reason", d.accel.Reason))
	}
	return d, nil
}

// probe finds what full VMs need; it returns why they cannot run, or "".
func (d *Driver) probe() string {
	if os.Geteuid() != 0 {
		return "the vm substrate needs root"
	}
	switch d.cfg.Boot {
	case "auto", "firmware", "direct":
	default:
		return fmt.Sprintf("vm boot mode %q (use auto, firmware or direct)", d.cfg.Boot)
	}
	var err error
	if d.qemu, err = qemu.FindBinary(d.cfg.QEMU); err != nil {
		return err.Error()
	}
	if d.version, err = qemu.Version(d.qemu); err == nil {
		d.caps.Details["qemu"] = d.version
	}
	name := d.cfg.QEMUImg
	if name == "" {
		name = "qemu-img"
	}
	if d.qemuImg, err = exec.LookPath(name); err != nil {
		return "qemu-img not installed (apt-get install qemu-utils)"
	}
	for _, f := range []string{"bios-256k.bin", "vgabios-stdvga.bin"} {
		if !firmwareExists(f) {
			return fmt.Sprintf("QEMU's firmware %s is missing (apt-get install seabios)", f)
		}
	}
	if _, err := os.Stat(d.cfg.GuestBinary); err != nil {
		return fmt.Sprintf("dsec-guest binary not found at %s", d.cfg.GuestBinary)
	}
	if d.agentDisk, err = buildAgentDisk(filepath.Join(d.cfg.StateDir, "agent"), d.cfg.GuestBinary); err != nil {
		return fmt.Sprintf("build the agent disk: %v", err)
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
	if err := os.MkdirAll(d.cfg.RunDir, 0o700); err != nil {
		return fmt.Sprintf("create %s: %v", d.cfg.RunDir, err)
	}
	d.pruneBootSnapshots()
	pc := qemu.ProbeConfig{Binary: d.qemu, Busybox: d.cfg.Busybox, Mode: d.cfg.Accel, Timeout: d.cfg.ProbeTimeout, CacheFile: d.cfg.ProbeCache}
	if d.cfg.KernelDir != "" {
		if k, err := qemu.FindKernel(d.cfg.KernelDir); err == nil {
			pc.Kernel = k
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d.accel = qemu.ProbeAccel(ctx, pc, d.log)
	d.caps.Details["accel"] = d.accel.Name
	d.caps.Details["accel_reason"] = d.accel.Reason
	d.caps.Details["boot"] = d.cfg.Boot
	d.caps.Details["boot_snapshots"] = fmt.Sprint(!d.cfg.ColdBoot)
	d.caps.Details["screen"] = "VGA (PNG screenshots), virtio and PS/2 keyboards, virtio tablet"
	if d.cfg.VNC {
		d.caps.Details["screen"] += ", VNC on loopback"
	}
	return ""
}

// firmwareExists reports whether QEMU's data directory has a firmware
// file (Debian installs SeaBIOS's to /usr/share/seabios, linked from
// /usr/share/qemu).
func firmwareExists(name string) bool {
	for _, dir := range []string{"/usr/share/qemu", "/usr/share/seabios", "/usr/local/share/qemu"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			return true
		}
	}
	return false
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

// buildAgentDisk writes the agent disk every VM gets: an uncompressed tar
// archive holding dsec-guest, attached read-only with serial number
// dsec-agent, which the image's service unpacks and runs. It is named by
// the binary's content, so snapshots taken with an older agent still
// restore.
func buildAgentDisk(dir, guestBin string) (string, error) {
	digest, err := qemu.FileDigest(guestBin)
	if err != nil {
		return "", err
	}
	p := filepath.Join(dir, "agent-"+digest+".tar")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	b, err := os.ReadFile(guestBin)
	if err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(dir, "agent-*.tmp")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	tw := tar.NewWriter(tmp)
	if err := tw.WriteHeader(&tar.Header{Name: "dsec-guest", Mode: 0o755, Size: int64(len(b)), Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0)}); err != nil {
		tmp.Close()
		return "", err
	}
	tw.Write(b)
	if err := tw.Close(); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	os.Chmod(tmp.Name(), 0o644)
	return p, os.Rename(tmp.Name(), p)
}
