package vm

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
	"github.com/opendsec/dsec/internal/undo"
)

// The writable disk's name in a sandbox's directory and in a machine
// snapshot's (beside the files qemu.Instance keeps there).
const (
	diskFile = "disk.qcow2" // the copy-on-write disk over the image's base
)

// instance is one full VM: the driver's machine run by a qemu.VM.
type instance struct {
	qemu.Instance[machine]
	d *Driver
}

var (
	_ substrate.Instance           = (*instance)(nil)
	_ substrate.Diagnoser          = (*instance)(nil)
	_ substrate.Pauser             = (*instance)(nil)
	_ substrate.MachineSnapshotter = (*instance)(nil)
	_ substrate.Screen             = (*instance)(nil)
)

// newInstance is the instance of sandbox id run by machine m in dir; its
// QEMU is held to cpu cores (the spec's share, not the machine's whole
// vCPUs).
func (d *Driver) newInstance(id, dir string, m machine, st qemu.VMState, tapNS string, cpu float64) *instance {
	i := &instance{Instance: qemu.Instance[machine]{ID: id, Dir: dir, Machine: m, DiskFile: diskFile, TapNS: tapNS}, d: d}
	var cid uint32
	if m.Vsock {
		cid = m.CID
	}
	i.VM = qemu.NewVM(qemu.VMConfig{
		ID: id, Dir: dir, Binary: d.qemu, AgentSock: d.agentSock(id), QMPSock: d.qmpSock(id),
		VsockCID: cid, VsockPort: vsockPort,
		Args: func() []string {
			return i.Machine.args(id, i.Path(diskFile), d.agentSock(id), d.qmpSock(id), i.Path(qemu.ConsoleFile), d.cfg.VNC, tapNS != "")
		},
		TapNS:  tapNS,
		Cgroup: qemu.CgroupOf(d.cgroupParent, id), Resources: qemu.Resources(cpu, m.MemoryMB, m.Accel),
		BootTimeout: d.cfg.BootTimeout, Kind: "VM",
		HintLine: func(l string) bool {
			return fatalLine(l) || strings.Contains(l, "Boot failed") || strings.Contains(l, "Gave up waiting for root") ||
				strings.Contains(l, "dsec-initramfs:")
		},
		FatalLine: fatalLine,
		Logs:      []string{firmwareLog},
		Redact:    []string{d.cfg.StateDir},
		Persist:   i.Persist,
		Log:       d.log,
	}, st)
	return i
}

// fatalLine reports a guest console line after which a boot cannot
// succeed: a kernel panic (a guest that reboots would loop), or SeaBIOS
// finding nothing to boot.
func fatalLine(l string) bool {
	return strings.Contains(l, "Kernel panic") || strings.Contains(l, "No bootable device")
}

// Create implements substrate.Driver. A sandbox starts from a machine
// snapshot (Spec.Restore), else from its image's boot snapshot, else by
// booting its image; a boot saves the boot snapshot for the next ones.
func (d *Driver) Create(ctx context.Context, s *substrate.Spec) (_ substrate.Instance, err error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("full VMs cannot run on this node: %s", d.caps.Reason)
	}
	if s.MemoryMB < minMemoryMB {
		return nil, errdefs.Invalid("a vm needs at least %d MiB of memory (resources.memory_mb %d)", minMemoryMB, s.MemoryMB)
	}
	if s.DiskMB > d.cfg.MaxDiskMB {
		return nil, errdefs.Invalid("resources.disk_mb %d is more than %d", s.DiskMB, d.cfg.MaxDiskMB)
	}
	tapNS, err := qemu.PrepareNetwork(s.Network)
	if err != nil {
		return nil, err
	}
	var u undo.Stack
	defer u.RunUnless(&err)
	disk := filepath.Join(s.Dir, diskFile)
	u.Push(func() { os.Remove(disk) })
	var m machine
	var incoming *qemu.Restore
	restored := ""
	if s.Restore != "" {
		if m, err = d.restoreMachine(s.Restore); err != nil {
			return nil, err
		}
		if tapNS != "" && !m.NIC {
			return nil, errdefs.Invalid("the snapshot is of a VM without a network interface (network mode none): a sandbox made from it cannot have egress")
		}
		restored = s.Restore
	} else {
		if m, err = d.newMachine(s); err != nil {
			return nil, err
		}
		m.NIC = tapNS != ""
		if !d.cfg.ColdBoot {
			if dir, ok := d.bootSnapshot(m); ok {
				restored = dir
			}
		}
	}
	if restored != "" {
		if incoming, err = qemu.RestoreFiles(restored, diskFile, disk); err != nil {
			return nil, err
		}
		defer incoming.State.Close()
	} else if err := d.createDisk(m, disk); err != nil {
		return nil, err
	}
	if m.Vsock {
		m.CID = qemu.VsockCID(s.ID)
	}
	i := d.newInstance(s.ID, s.Dir, m, qemu.VMState{}, tapNS, s.CPU)
	u.Push(func() { i.Destroy(context.WithoutCancel(ctx)) })
	if err := i.VM.Start(ctx, incoming); err != nil {
		return nil, err
	}
	if restored == "" && !d.cfg.ColdBoot && s.Restore == "" {
		d.saveBootSnapshot(ctx, i)
	}
	if err := i.personalize(ctx, s, restored != ""); err != nil {
		return nil, err
	}
	if restored != "" {
		if err := i.VM.CountOOMKillsFromNow(ctx); err != nil {
			return nil, qemu.Failed(err, "read the restored guest's OOM kills")
		}
	}
	if err := i.Persist(i.VM.State()); err != nil {
		return nil, errdefs.Internal(err, "persist vm state")
	}
	return i, nil
}

// newMachine is the machine for a fresh sandbox of spec's image.
func (d *Driver) newMachine(s *substrate.Spec) (machine, error) {
	img := s.Image.VM
	if img == nil || len(s.Image.Layers) != 1 {
		return machine{}, errdefs.Invalid("the image is not a VM image: build one with `dsec image build-vm` or import a disk with `dsec image import-vm`")
	}
	dir := s.Image.Layers[0].Dir
	m := machine{
		CPUs: cpusFor(s.CPU), MemoryMB: s.MemoryMB, Base: filepath.Join(dir, image.VMDiskFile), Layer: filepath.Base(dir),
		DiskBytes: max(img.VirtualSize, s.DiskMB<<20), AgentDisk: d.agentDisk, Accel: d.accel.Arg(d.cfg.TBSizeMiB),
		Vsock: d.vsock, Hostname: "sandbox", Boot: "firmware",
	}
	switch {
	case d.cfg.Boot == "direct" && !img.DirectBoot:
		return machine{}, errdefs.Invalid("the VM image has no kernel of its own for direct boot (it boots through its bootloader)")
	case d.cfg.Boot != "firmware" && img.DirectBoot:
		m.Boot = "direct"
		m.Kernel, m.Initrd = filepath.Join(dir, image.VMKernelFile), filepath.Join(dir, image.VMInitrdFile)
		args := img.Cmdline
		if !slices.Contains(strings.Fields(args), "panic=-1") {
			args += " panic=-1" // an imported image's own command line may lack it
		}
		m.Cmdline = strings.TrimSpace(args + " " + qemu.TSCArgs() + " " + d.cfg.KernelArgs)
	}
	return m, nil
}

// createDisk creates the sandbox's copy-on-write disk over the image's
// base.
func (d *Driver) createDisk(m machine, disk string) error {
	cmd := exec.Command(d.qemuImg, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", m.Base,
		"-o", "lazy_refcounts=on,cluster_size=65536", disk, fmt.Sprint(m.DiskBytes))
	if out, err := cmd.CombinedOutput(); err != nil {
		return errdefs.Internal(fmt.Errorf("%w: %s", err, bytes.TrimSpace(out)), "create the copy-on-write disk")
	}
	return nil
}

// restoreMachine reads a snapshot's machine and checks it can run here.
func (d *Driver) restoreMachine(dir string) (machine, error) {
	m, err := qemu.ReadMachine[machine](dir)
	if err != nil {
		return m, err
	}
	if strings.HasPrefix(m.Accel, "kvm") && d.accel.Name != "kvm" {
		return m, errdefs.Unavailable("the snapshot was taken under KVM; this node runs VMs under %s", d.accel.Name)
	}
	files := []string{m.Base, m.AgentDisk}
	if m.Boot == "direct" {
		files = append(files, m.Kernel, m.Initrd)
	}
	for _, f := range files {
		if _, err := os.Stat(f); err != nil {
			return m, errdefs.Unavailable("a file the snapshot's machine needs is gone (its image disk, kernel or agent)")
		}
	}
	return m, nil
}

// personalize makes a started VM the spec's sandbox: a VM restored from a
// snapshot gets its own hostname and machine ID (clock and randomness come
// with every channel session), a VM with egress its network (booted or
// restored: the image's own network configuration is not used), then
// every VM gets its deadline and environment.
func (i *instance) personalize(ctx context.Context, s *substrate.Spec, restored bool) error {
	client := i.VM.Client()
	host := s.Hostname
	if host == "" {
		host = "sandbox"
	}
	if restored || host != i.Machine.Hostname || i.TapNS != "" {
		// The agent runs itself (the child of its fork execs
		// /proc/self/exe): where it is installed varies between images.
		argv := []string{"/proc/self/exe", "identity", "-hostname", host}
		if restored {
			argv = append(argv, "-machine-id")
		}
		if i.TapNS != "" {
			argv = append(argv, "-net", s.Network.Guest.String())
		}
		x, err := client.Run(ctx, &guestv1.Exec{Argv: argv, TimeoutMs: 60000})
		if err != nil {
			return qemu.Failed(err, "give the VM its identity")
		}
		if x.ExitCode != 0 {
			return errdefs.Unavailable("give the VM its identity: exit %d: %s", x.ExitCode, bytes.TrimSpace(x.Stderr))
		}
		i.Machine.Hostname = host
	}
	if !s.Deadline.IsZero() {
		if err := client.SetDeadline(ctx, s.Deadline); err != nil {
			return qemu.Failed(err, "set the sandbox's deadline")
		}
	}
	if len(s.Env) > 0 {
		if err := client.SetEnv(ctx, s.Env); err != nil {
			return qemu.Failed(err, "set the sandbox's environment")
		}
	}
	return nil
}

// Attach implements substrate.Driver.
func (d *Driver) Attach(ctx context.Context, s *substrate.Spec, raw []byte) (substrate.Instance, error) {
	st, err := qemu.LoadInstanceState[machine](s.Dir, raw)
	if err != nil {
		return nil, err
	}
	i := d.newInstance(s.ID, s.Dir, st.Machine, st.VMState, st.TapNS, s.CPU)
	return i, i.VM.Adopt(ctx)
}
