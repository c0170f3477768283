package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/qemu"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/undo"
)

// Files in a sandbox's directory (beside qemu.ConsoleFile, qemu.LogFile
// and qemu.PauseFile) and in a machine snapshot directory.
const (
	stateFile   = "vm.json"      // the instance's state, for Attach
	diskFile    = "disk.img"     // the writable ext4 disk
	machineFile = "machine.json" // a snapshot's machine
	memFile     = "state"        // a snapshot's memory and devices
)

// vsockPort is the agent's AF_VSOCK port in the guest.
const vsockPort = 1024

// state is what an instance persists (in its directory and through the
// node) to be re-adopted.
type state struct {
	qemu.VMState
	Machine machine `json:"machine"`
	Dir     string  `json:"dir"`
}

// instance is one microVM: the driver's machine run by a qemu.VM.
type instance struct {
	d       *Driver
	id      string
	dir     string
	machine machine
	vm      *qemu.VM
}

var (
	_ substrate.Instance  = (*instance)(nil)
	_ substrate.Diagnoser = (*instance)(nil)
)

func (d *Driver) newInstance(id, dir string, m machine, st qemu.VMState) *instance {
	i := &instance{d: d, id: id, dir: dir, machine: m}
	var cid uint32
	if m.Vsock {
		cid = m.CID
	}
	i.vm = qemu.NewVM(qemu.VMConfig{
		ID: id, Dir: dir, Binary: d.qemu, AgentSock: d.agentSock(id), QMPSock: d.qmpSock(id),
		VsockCID: cid, VsockPort: vsockPort,
		Args: func() []string {
			return i.machine.args(id, i.path(diskFile), d.agentSock(id), d.qmpSock(id), i.path(qemu.ConsoleFile))
		},
		BootTimeout: d.cfg.BootTimeout, Kind: "microVM",
		HintLine: func(l string) bool { return strings.Contains(l, "dsec-init:") || strings.Contains(l, "Kernel panic") },
		Redact:   []string{d.cfg.StateDir},
		Persist:  i.persist,
		Log:      d.log,
	}, st)
	return i
}

func (i *instance) path(name string) string { return filepath.Join(i.dir, name) }

// persist writes the instance's state for Attach (vm.json; the node keeps
// a copy in its record).
func (i *instance) persist(st qemu.VMState) error {
	b, err := json.Marshal(state{VMState: st, Machine: i.machine, Dir: i.dir})
	if err != nil {
		return err
	}
	tmp := i.path(stateFile + ".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, i.path(stateFile))
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
	var u undo.Stack
	defer u.RunUnless(&err)
	disk := filepath.Join(s.Dir, diskFile)
	u.Push(func() { os.Remove(disk) })
	var m machine
	var incoming *os.File
	if s.Restore != "" {
		m, err = d.restoreMachine(s.Restore)
		if err != nil {
			return nil, err
		}
		if st, err := os.Stat(filepath.Join(s.Restore, diskFile)); err == nil && s.DiskMB > 0 && st.Size() > s.DiskMB<<20 {
			return nil, errdefs.Invalid("the snapshot's disk (%d MiB) is larger than resources.disk_mb %d", st.Size()>>20, s.DiskMB)
		}
		if err := qemu.CopySparse(filepath.Join(s.Restore, diskFile), disk); err != nil {
			return nil, errdefs.Internal(err, "copy the snapshot's disk")
		}
		incoming, err = os.Open(filepath.Join(s.Restore, memFile))
		if err != nil {
			return nil, errdefs.NotFound("the machine snapshot has no memory state")
		}
		defer incoming.Close()
	} else {
		img, err := d.imageDisk(s.Layers)
		if err != nil {
			return nil, err
		}
		tmpl, err := d.diskTemplate(diskMB)
		if err != nil {
			return nil, errdefs.Internal(err, "create the writable disk template")
		}
		if err := qemu.CopySparse(tmpl, disk); err != nil {
			return nil, errdefs.Internal(err, "create the writable disk")
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
	}
	if d.vsock {
		m.CID = qemu.VsockCID(s.ID)
	}
	i := d.newInstance(s.ID, s.Dir, m, qemu.VMState{})
	u.Push(func() { i.Destroy(context.WithoutCancel(ctx)) })
	if err := i.vm.Start(ctx, incoming); err != nil {
		return nil, err
	}
	client := i.vm.Client()
	if incoming != nil {
		// Clock and randomness came with the channel's session; a
		// hostname other than the snapshot's takes an exec.
		if s.Hostname != "" && s.Hostname != m.Hostname {
			if err := i.freshIdentity(ctx, s.Hostname); err != nil {
				return nil, err
			}
		}
		if !s.Deadline.IsZero() {
			if err := client.SetDeadline(ctx, s.Deadline); err != nil {
				return nil, qemu.Failed(err, "set the restored sandbox's deadline")
			}
		}
	}
	if len(s.Env) > 0 {
		if err := client.SetEnv(ctx, s.Env); err != nil {
			return nil, qemu.Failed(err, "set the sandbox's environment")
		}
	}
	if err := i.persist(i.vm.State()); err != nil {
		return nil, errdefs.Internal(err, "persist microvm state")
	}
	return i, nil
}

// restoreMachine reads a snapshot's machine and checks it can run here.
func (d *Driver) restoreMachine(dir string) (machine, error) {
	var m machine
	b, err := os.ReadFile(filepath.Join(dir, machineFile))
	if err != nil {
		return m, errdefs.NotFound("machine snapshot not found")
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, errdefs.Internal(err, "decode the machine snapshot")
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

// freshIdentity gives a restored VM its own hostname (clock and
// randomness come with every channel session).
func (i *instance) freshIdentity(ctx context.Context, hostname string) error {
	argv := []string{"/.dsec/guest", "identity", "-hostname", hostname}
	x, err := i.vm.Client().Run(ctx, &guestv1.Exec{Argv: argv, TimeoutMs: 30000})
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
	var st state
	// The instance's own file is newer than the node's record after a
	// pause or resume.
	if b, err := os.ReadFile(filepath.Join(s.Dir, stateFile)); err == nil {
		raw = b
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return nil, errdefs.Internal(err, "decode microvm state")
	}
	i := d.newInstance(s.ID, s.Dir, st.Machine, st.VMState)
	return i, i.vm.Adopt(ctx)
}

func (i *instance) Guest() substrate.Guest { return i.vm.Client() }

// LastWords implements substrate.Diagnoser: the end of the guest console
// or QEMU's log that explains a stop.
func (i *instance) LastWords() string { return strings.TrimPrefix(i.vm.Hint(), ": ") }

func (i *instance) State() []byte {
	b, _ := json.Marshal(state{VMState: i.vm.State(), Machine: i.machine, Dir: i.dir})
	return b
}

func (i *instance) Done() <-chan struct{} { return i.vm.Done() }

func (i *instance) Check(ctx context.Context) error { return i.vm.Check() }

// Stats reports the guest's own use (qemu.VM.Stats).
func (i *instance) Stats(ctx context.Context) (substrate.Stats, error) {
	return i.vm.Stats(ctx), nil
}

// Pause saves the VM's memory and devices and stops QEMU, so a paused
// microVM holds no memory. It is idempotent.
func (i *instance) Pause(ctx context.Context) error { return i.vm.Pause(ctx) }

// Resume restores a paused VM from its saved memory. It is idempotent.
func (i *instance) Resume(ctx context.Context) error { return i.vm.Resume(ctx) }

// Snapshot implements substrate.Instance: microVM snapshots are machine
// snapshots (SnapshotMachine), not filesystem layers.
func (i *instance) Snapshot(context.Context, io.Writer) error {
	return errdefs.Unimplemented("microvm snapshots hold memory and disk: use a machine snapshot")
}

// SnapshotMachine writes memory, devices and the writable disk into dir.
// A running VM is stopped for the capture (so disk and memory agree) and
// continued; a paused one is copied as it is.
func (i *instance) SnapshotMachine(ctx context.Context, dir string) error {
	mb, err := json.Marshal(i.machine)
	if err != nil {
		return errdefs.Internal(err, "encode the machine")
	}
	err = i.vm.SaveMachine(ctx, filepath.Join(dir, memFile), func() error {
		return qemu.CopySparse(i.path(diskFile), filepath.Join(dir, diskFile))
	})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, machineFile), mb, 0o600); err != nil {
		return errdefs.Internal(err, "write the machine snapshot")
	}
	return nil
}

// Screenshot implements substrate.Instance: microVMs have no screen.
func (i *instance) Screenshot(context.Context) (*substrate.Screenshot, error) {
	return nil, errdefs.Unimplemented("microVMs have no screen (use kind vm)")
}

// SendInput implements substrate.Instance: microVMs have no screen.
func (i *instance) SendInput(context.Context, []substrate.InputAction) error {
	return errdefs.Unimplemented("microVMs have no screen (use kind vm)")
}

func (i *instance) OpenVNC(context.Context) (*substrate.VNC, error) {
	return nil, errdefs.Unimplemented("microVMs have no screen (use kind vm)")
}

// Destroy kills QEMU and removes the instance's sockets, disk and saved
// memory. It is idempotent.
func (i *instance) Destroy(ctx context.Context) error {
	i.vm.Destroy()
	if err := os.Remove(i.path(diskFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return errdefs.Internal(err, "remove the microVM's disk")
	}
	return nil
}
