package microvm

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/qemu"
	"github.com/opendsec/dsec/internal/undo"
)

// The writable disk's name in a sandbox's directory and in a machine
// snapshot's (beside the files qemu.Instance keeps there).
const (
	diskFile = "disk.img" // the writable ext4 disk
)

// vsockPort is the agent's AF_VSOCK port in the guest.
const vsockPort = 1024

// instance is one microVM: the driver's machine run by a qemu.VM.
type instance struct {
	qemu.Instance[machine]
	d *Driver
}

var (
	_ substrate.Instance           = (*instance)(nil)
	_ substrate.Diagnoser          = (*instance)(nil)
	_ substrate.Pauser             = (*instance)(nil)
	_ substrate.MachineSnapshotter = (*instance)(nil)
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
			return i.Machine.args(id, i.Path(diskFile), d.agentSock(id), d.qmpSock(id), i.Path(qemu.ConsoleFile), tapNS != "")
		},
		TapNS:  tapNS,
		Cgroup: qemu.CgroupOf(d.cgroupParent, id), Resources: qemu.Resources(cpu, m.MemoryMB, m.Accel),
		BootTimeout: d.cfg.BootTimeout, Kind: "microVM",
		HintLine: func(l string) bool { return strings.Contains(l, "dsec-init:") || strings.Contains(l, "Kernel panic") },
		Redact:   []string{d.cfg.StateDir},
		Persist:  i.Persist,
		Log:      d.log,
	}, st)
	return i
}

// Create implements substrate.Driver.
func (d *Driver) Create(ctx context.Context, s *substrate.Spec) (_ substrate.Instance, err error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("microVMs cannot run on this node: %s", d.caps.Reason)
	}
	if s.MemoryMB < 64 {
		return nil, errdefs.Invalid("a microvm needs at least 64 MiB of memory (resources.memory_mb %d)", s.MemoryMB)
	}
	diskMB := s.DiskMB
	if diskMB == 0 {
		diskMB = d.cfg.DefaultDiskMB
	}
	if diskMB < minDiskMB || diskMB > d.cfg.MaxDiskMB {
		return nil, errdefs.Invalid("resources.disk_mb %d out of range [%d, %d] for a microvm", diskMB, minDiskMB, d.cfg.MaxDiskMB)
	}
	if s.Network.Mode == network.ModeEgress && d.noNet != "" {
		return nil, errdefs.Unavailable("microVMs cannot have egress on this node: %s", d.noNet)
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
	// restored is the snapshot the sandbox starts from: the spec's, else
	// its image's boot snapshot for this machine shape (bootKey), if any.
	restored, bootKey := "", ""
	if s.Restore != "" {
		m, err = d.restoreMachine(s.Restore)
		if err != nil {
			return nil, err
		}
		if tapNS != "" && m.Net == "" {
			return nil, errdefs.Invalid("the snapshot is of a microVM without a network interface (network mode none): a sandbox made from it cannot have egress")
		}
		if st, err := os.Stat(filepath.Join(s.Restore, diskFile)); err == nil && s.DiskMB > 0 && st.Size() > s.DiskMB<<20 {
			return nil, errdefs.Invalid("the snapshot's disk (%d MiB) is larger than resources.disk_mb %d", st.Size()>>20, s.DiskMB)
		}
		restored = s.Restore
	} else {
		img, err := d.imageDisk(s.Image.Layers)
		if err != nil {
			return nil, err
		}
		host := s.Hostname
		if host == "" {
			host = "sandbox"
		}
		var deadline int64
		if !s.Deadline.IsZero() {
			deadline = s.Deadline.Unix()
		}
		m = machine{
			CPUs: cpusFor(s.CPU), MemoryMB: s.MemoryMB, Kernel: d.kernel.Vmlinux, Release: d.kernel.Release,
			Initrd: d.initrd, Image: img, Accel: d.accel.Arg(d.cfg.TBSizeMiB), Vsock: d.vsock,
			Hostname: host, Deadline: deadline, ExtraArgs: d.cfg.KernelArgs,
		}
		if tapNS != "" {
			m.Net = s.Network.Guest.String()
		}
		if !d.cfg.ColdBoot {
			bootKey = d.bootKey(m, diskMB)
			if dir, ok := d.boots.Find(bootKey); ok {
				if bm, err := d.restoreMachine(dir); err == nil {
					m, restored = bm, dir
				}
			}
		}
		if restored == "" {
			tmpl, err := d.diskTemplate(diskMB)
			if err != nil {
				return nil, errdefs.Internal(err, "create the writable disk template")
			}
			if err := qemu.CopySparse(tmpl, disk); err != nil {
				return nil, errdefs.Internal(err, "create the writable disk")
			}
		}
	}
	if restored != "" {
		if incoming, err = qemu.RestoreFiles(restored, diskFile, disk); err != nil {
			return nil, err
		}
		defer incoming.State.Close()
	}
	if d.vsock {
		m.CID = qemu.VsockCID(s.ID)
	}
	i := d.newInstance(s.ID, s.Dir, m, qemu.VMState{}, tapNS, s.CPU)
	u.Push(func() { i.Destroy(context.WithoutCancel(ctx)) })
	if err := i.VM.Start(ctx, incoming); err != nil {
		return nil, err
	}
	if restored == "" && bootKey != "" {
		d.boots.Save(ctx, bootKey, s.ID, i.SnapshotMachine)
	}
	client := i.VM.Client()
	if incoming != nil {
		// Clock and randomness came with the channel's session; a
		// hostname other than the snapshot's (a boot snapshot's is its
		// first sandbox's; a fork keeps its parent's unless told), or
		// the sandbox's own address, takes an exec.
		host := s.Hostname
		if host == "" && s.Restore == "" {
			host = "sandbox"
		}
		var args []string
		if host != "" && host != m.Hostname {
			args = append(args, "-hostname", host)
		}
		if tapNS != "" {
			args = append(args, "-net", s.Network.Guest.String())
		}
		if len(args) > 0 {
			if err := i.freshIdentity(ctx, args); err != nil {
				return nil, err
			}
		}
		if host != "" {
			i.Machine.Hostname = host // what the guest's is now (its snapshots record it)
		}
		// The snapshot's deadline is another sandbox's: set this one's
		// (none clears it).
		if err := client.SetDeadline(ctx, s.Deadline); err != nil {
			return nil, qemu.Failed(err, "set the restored sandbox's deadline")
		}
		if err := i.VM.CountOOMKillsFromNow(ctx); err != nil {
			return nil, qemu.Failed(err, "read the restored guest's OOM kills")
		}
	}
	if len(s.Env) > 0 {
		if err := client.SetEnv(ctx, s.Env); err != nil {
			return nil, qemu.Failed(err, "set the sandbox's environment")
		}
	}
	if err := i.Persist(i.VM.State()); err != nil {
		return nil, errdefs.Internal(err, "persist microvm state")
	}
	return i, nil
}

// restoreMachine reads a snapshot's machine and checks it can run here.
func (d *Driver) restoreMachine(dir string) (machine, error) {
	m, err := qemu.ReadMachine[machine](dir)
	if err != nil {
		return m, err
	}
	if m.Release != d.kernel.Release {
		return m, errdefs.Unavailable("the snapshot was taken with guest kernel %s; this node has %s", m.Release, d.kernel.Release)
	}
	for _, f := range []string{m.Kernel, m.Initrd, m.Image} {
		if _, err := os.Stat(f); err != nil {
			return m, errdefs.Unavailable("a file the snapshot's machine needs is gone (kernel, initramfs or image disk)")
		}
	}
	return m, nil
}

// freshIdentity gives a restored VM its own hostname and network (clock
// and randomness come with every channel session): args are
// `dsec-guest identity`'s.
func (i *instance) freshIdentity(ctx context.Context, args []string) error {
	// The agent runs itself (the child of its fork execs /proc/self/exe):
	// /.dsec/guest is the workload's to overwrite in its writable layer.
	argv := append([]string{"/proc/self/exe", "identity"}, args...)
	x, err := i.VM.Client().Run(ctx, &guestv1.Exec{Argv: argv, TimeoutMs: 30000})
	if err != nil {
		return qemu.Failed(err, "give the restored VM its identity")
	}
	if x.ExitCode != 0 {
		return errdefs.Internal(fmt.Errorf("exit %d: %s", x.ExitCode, bytes.TrimSpace(x.Stderr)), "give the restored VM its identity")
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
