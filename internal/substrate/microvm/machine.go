package microvm

import (
	"fmt"
	"math"
	"strconv"

	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// machine is everything that defines a VM's hardware. A snapshot restores
// only into an identical machine, so it is saved with the snapshot and
// reused, not recomputed from the new spec.
type machine struct {
	CPUs     int    `json:"cpus"`
	MemoryMB int64  `json:"memory_mb"`
	Kernel   string `json:"kernel"`         // vmlinux path
	Release  string `json:"kernel_release"` // checked on restore
	Initrd   string `json:"initrd"`
	Image    string `json:"image"` // the read-only EROFS disk
	Accel    string `json:"accel"` // -accel value
	Vsock    bool   `json:"vsock"`
	CID      uint32 `json:"cid,omitempty"`
	Hostname string `json:"hostname"`
	Deadline int64  `json:"deadline"`
	// ExtraArgs are extra kernel arguments (Config.KernelArgs).
	ExtraArgs string `json:"extra_args,omitempty"`
	// Net is the network the machine booted with (a guest.NetConfig, ""
	// for none): it has a NIC with Net's MAC, and its agent configured
	// the interface before it answered. A VM restored from a snapshot of
	// the machine keeps the NIC and is given its own address.
	Net string `json:"net,omitempty"`
}

// cpusFor maps a CPU share to whole vCPUs.
func cpusFor(cpu float64) int {
	return max(1, int(math.Ceil(cpu)))
}

// args is QEMU's command line for m, with the sandbox's disk, sockets and
// log files. The device order is part of the machine: a restore uses the
// same order. With tap, the NIC's backend is the netdev net0 (the VM adds
// it); without, a machine's NIC is there but connected to nothing.
func (m *machine) args(id, disk, agentSock, qmpSock, console string, tap bool) []string {
	append_ := "console=ttyS0 quiet loglevel=4 panic=-1 " + qemu.TSCArgs() +
		" init_on_alloc=0 init_on_free=0 random.trust_cpu=on" +
		" dsec.hostname=" + m.Hostname + " dsec.deadline=" + strconv.FormatInt(m.Deadline, 10)
	if m.Vsock {
		append_ += " dsec.chan=vsock"
	}
	if m.Net != "" {
		append_ += " dsec.net=" + m.Net
	}
	if m.ExtraArgs != "" {
		append_ += " " + m.ExtraArgs
	}
	args := []string{
		"-name", "dsec-" + id,
		"-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on,pic=on,acpi=on,memory-backend=mem",
		"-accel", m.Accel,
		"-cpu", "max",
		"-smp", strconv.Itoa(m.CPUs),
		"-m", fmt.Sprintf("%dM", m.MemoryMB),
		// Guest RAM in a memfd: shared memory gets no transparent huge
		// pages (with them, every 4 KiB the guest touches holds 2 MiB of
		// host memory), and pages the guest reports free are punched out.
		"-object", fmt.Sprintf("memory-backend-memfd,id=mem,size=%dM", m.MemoryMB),
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-serial", "file:" + console,
		"-kernel", m.Kernel, "-initrd", m.Initrd, "-append", append_,
		"-drive", "id=image,file=" + m.Image + ",format=raw,if=none,readonly=on,cache=writeback,aio=threads",
		"-device", "virtio-blk-device,drive=image,serial=dsec-image",
		"-drive", "id=disk,file=" + disk + ",format=raw,if=none,cache=writeback,discard=unmap,detect-zeroes=unmap",
		"-device", "virtio-blk-device,drive=disk,serial=dsec-disk",
		"-object", "rng-random,id=rng,filename=/dev/urandom",
		"-device", "virtio-rng-device,rng=rng",
		// Free pages go back to the host as the guest frees them.
		"-device", "virtio-balloon-device,free-page-reporting=on",
	}
	if m.Net != "" {
		nic := "virtio-net-device,id=nic,mac=" + m.mac()
		if tap {
			nic += ",netdev=net0"
		}
		args = append(args, "-device", nic)
	}
	return append(args, qemu.ControlArgs("device", m.Vsock, m.CID, agentSock, qmpSock)...)
}

// SnapshotArgs returns the QEMU command line that restores the machine
// snapshot in dir from fd 3, for a VM named id with the given disk,
// sockets and console file, and whether the stream is loaded through the
// monitor (qemu.RestoreArgs). The driver restores this way; benchmarks
// run it raw as the baseline of a restore.
func SnapshotArgs(dir, id, disk, agentSock, qmpSock, console string) ([]string, bool, error) {
	m, err := qemu.ReadMachine[machine](dir)
	if err != nil {
		return nil, false, err
	}
	return qemu.RestoreArgs(m.args(id, disk, agentSock, qmpSock, console, false), dir)
}

// mac is the MAC of the machine's NIC.
func (m *machine) mac() string {
	c, err := guest.ParseNetConfig(m.Net)
	if err != nil {
		return ""
	}
	return c.MAC.String()
}
