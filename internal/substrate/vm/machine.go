package vm

import (
	"fmt"
	"math"
	"path/filepath"
	"strconv"

	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// firmwareLog is SeaBIOS's debug output, in the sandbox's directory.
const firmwareLog = "firmware.log"

// machine is everything that defines a VM's hardware. A snapshot restores
// only into an identical machine, so it is saved with the snapshot (and
// the boot snapshots) and reused, not recomputed from the new spec.
type machine struct {
	CPUs     int   `json:"cpus"`
	MemoryMB int64 `json:"memory_mb"`
	// Base is the image's read-only disk (the backing file of every
	// sandbox's copy-on-write disk); Layer names its image layer.
	Base  string `json:"base"`
	Layer string `json:"layer"`
	// DiskBytes is the size of the sandbox's disk as the guest sees it.
	DiskBytes int64 `json:"disk_bytes"`
	// Boot is "firmware" (SeaBIOS and the disk's bootloader) or "direct"
	// (Kernel and Initrd with Cmdline).
	Boot    string `json:"boot"`
	Kernel  string `json:"kernel,omitempty"`
	Initrd  string `json:"initrd,omitempty"`
	Cmdline string `json:"cmdline,omitempty"`
	// AgentDisk is the read-only disk holding the node's dsec-guest.
	AgentDisk string `json:"agent_disk"`
	Accel     string `json:"accel"` // -accel value
	Vsock     bool   `json:"vsock"`
	CID       uint32 `json:"cid,omitempty"`
	// Hostname is the guest's hostname when the machine was started.
	Hostname string `json:"hostname"`
	// NIC gives the machine a network interface (a sandbox with egress).
	// Its hardware MAC is the same in every machine, so sandboxes share
	// boot snapshots; the agent gives it the sandbox's own.
	NIC bool `json:"nic,omitempty"`
}

// nicMAC is the hardware address of every VM's NIC (locally
// administered; never seen on the wire: the guest's interface takes the
// sandbox's MAC before it is up).
const nicMAC = "02:64:00:00:00:01"

// cpusFor maps a CPU share to whole vCPUs.
func cpusFor(cpu float64) int {
	return max(1, int(math.Ceil(cpu)))
}

// args is QEMU's command line for m, with the sandbox's disk, sockets and
// console file, and with vnc a VNC server on loopback. The device order is
// part of the machine: a restore uses the same order (a VNC server is not
// a device: it may differ). With tap, the NIC's backend is the netdev
// net0 (the VM adds it); without, a machine's NIC is connected to nothing.
func (m *machine) args(id, disk, agentSock, qmpSock, console string, vnc, tap bool) []string {
	// The firmware boots the disk and nothing else; a direct boot's kernel
	// is the first boot entry itself.
	bootIndex := ",bootindex=1"
	if m.Boot == "direct" {
		bootIndex = ""
	}
	args := []string{
		"-name", "dsec-" + id,
		// No SMM: SeaBIOS boots faster and nothing here needs it.
		"-M", "q35,smm=off,vmport=off,memory-backend=mem",
		"-accel", m.Accel,
		"-cpu", "max",
		"-smp", strconv.Itoa(m.CPUs),
		"-m", fmt.Sprintf("%dM", m.MemoryMB),
		// Guest RAM in a memfd: no transparent huge pages (with them every
		// 4 KiB the guest touches holds 2 MiB of host memory), and pages
		// the guest reports free are punched out.
		"-object", fmt.Sprintf("memory-backend-memfd,id=mem,size=%dM", m.MemoryMB),
		"-nodefaults", "-no-user-config",
		// A guest reboot or panic (panic=-1) ends QEMU, and so the sandbox:
		// its node sees it gone rather than a VM that boots again behind
		// its back.
		"-no-reboot",
		// The screen: standard VGA (text mode, or a framebuffer the guest
		// sets up). Keys go to a virtio keyboard once the guest drives it
		// (it buffers more than the machine's PS/2 one, which the firmware
		// and bootloader use); a tablet gives absolute pointer positions.
		"-device", "VGA",
		"-device", "virtio-keyboard-pci",
		"-device", "virtio-tablet-pci",
		"-serial", "file:" + console,
		// SeaBIOS's own log (which disk it boots, or that none boots).
		"-chardev", "file,id=firmware,path=" + filepath.Join(filepath.Dir(console), firmwareLog),
		"-device", "isa-debugcon,iobase=0x402,chardev=firmware",
		"-drive", "id=disk,file=" + disk + ",format=qcow2,if=none,cache=writeback,discard=unmap,detect-zeroes=unmap",
		"-device", "virtio-blk-pci,drive=disk,serial=dsec-disk" + bootIndex,
		"-drive", "id=agent,file=" + m.AgentDisk + ",format=raw,if=none,readonly=on",
		"-device", "virtio-blk-pci,drive=agent,serial=dsec-agent",
		"-object", "rng-random,id=rng,filename=/dev/urandom",
		"-device", "virtio-rng-pci,rng=rng",
		// Free pages go back to the host as the guest frees them.
		"-device", "virtio-balloon-pci,free-page-reporting=on",
	}
	if m.NIC {
		nic := "virtio-net-pci,id=nic,mac=" + nicMAC
		if tap {
			nic += ",netdev=net0"
		}
		args = append(args, "-device", nic)
	}
	if m.Boot == "direct" {
		args = append(args, "-kernel", m.Kernel, "-initrd", m.Initrd, "-append", m.Cmdline)
	}
	if vnc {
		// The first free port from 5900 on the loopback interface; no
		// client gets in before OpenVNC sets a password.
		args = append(args, "-vnc", "127.0.0.1:0,to=59000,password=on")
	} else {
		args = append(args, "-display", "none")
	}
	return append(args, qemu.ControlArgs("pci", m.Vsock, m.CID, agentSock, qmpSock)...)
}
