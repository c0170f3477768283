package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
)

// Files of an instance's directory (beside ConsoleFile, LogFile and
// PauseFile) and of a machine snapshot's directory.
const (
	StateFile   = "vm.json"      // the instance's state, for Attach
	MachineFile = "machine.json" // a snapshot's machine
	MemoryFile  = "state"        // a snapshot's memory and devices
)

// Instance is the part of a substrate.Instance that every QEMU driver
// shares: a VM run from a directory that holds its state file and its
// writable disk, described by the driver's machine M. Drivers embed it and
// add creation, the rest of substrate.Instance and their own devices.
type Instance[M any] struct {
	ID, Dir string
	Machine M
	VM      *VM
	// DiskFile is the writable disk's name in Dir; snapshots copy it.
	DiskFile string
	// TapNS is the network namespace whose tap (network.TapName) backs
	// the machine's NIC ("": none). It is the sandbox's, not the
	// machine's: a snapshot does not keep it.
	TapNS string
}

// InstanceState is what an Instance persists (in its directory and
// through the node) to be re-adopted.
type InstanceState[M any] struct {
	// Version is the format's version (StateVersion when written; 0 for
	// states written before versions).
	Version int `json:"version,omitempty"`
	VMState
	Machine M      `json:"machine"`
	Dir     string `json:"dir"`
	TapNS   string `json:"tap_ns,omitempty"`
}

// StateVersion is the version of InstanceState this node writes. A node
// refuses to adopt an instance whose state is of a later version (written
// by a newer node) rather than misread it.
const StateVersion = 1

// LoadInstanceState decodes the state Attach gets: the instance's own
// state file when there is one (it is newer than the node's record after
// a pause or resume), else raw.
func LoadInstanceState[M any](dir string, raw []byte) (InstanceState[M], error) {
	var st InstanceState[M]
	if b, err := os.ReadFile(filepath.Join(dir, StateFile)); err == nil {
		raw = b
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return st, errdefs.Internal(err, "decode the instance's state")
	}
	if st.Version > StateVersion {
		return st, errdefs.Internal(nil, "the instance's state is of version %d, written by a newer node; this node knows up to %d", st.Version, StateVersion)
	}
	return st, nil
}

// ReadMachine reads the machine of the snapshot in dir.
func ReadMachine[M any](dir string) (M, error) {
	var m M
	b, err := os.ReadFile(filepath.Join(dir, MachineFile))
	if err != nil {
		return m, errdefs.NotFound("machine snapshot not found")
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, errdefs.Unavailable("the machine snapshot is corrupt: %v", err)
	}
	return m, nil
}

// Path is name's path in the instance's directory.
func (i *Instance[M]) Path(name string) string { return filepath.Join(i.Dir, name) }

// Persist writes the instance's state for Attach (StateFile; the node
// keeps a copy in its record). It is the VM's VMConfig.Persist.
func (i *Instance[M]) Persist(st VMState) error {
	b, err := json.Marshal(InstanceState[M]{Version: StateVersion, VMState: st, Machine: i.Machine, Dir: i.Dir, TapNS: i.TapNS})
	if err != nil {
		return err
	}
	tmp := i.Path(StateFile + ".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, i.Path(StateFile))
}

func (i *Instance[M]) Guest() substrate.Guest { return i.VM.Client() }

// LastWords implements substrate.Diagnoser: the end of the guest console
// or QEMU's log that explains a stop.
func (i *Instance[M]) LastWords() string { return strings.TrimPrefix(i.VM.Hint(), ": ") }

func (i *Instance[M]) State() []byte {
	b, _ := json.Marshal(InstanceState[M]{Version: StateVersion, VMState: i.VM.State(), Machine: i.Machine, Dir: i.Dir, TapNS: i.TapNS})
	return b
}

func (i *Instance[M]) Done() <-chan struct{} { return i.VM.Done() }

// EndedByTask implements substrate.TaskEnder: the guest, root over its
// own kernel, may end its machine (VM.EndedByGuest).
func (i *Instance[M]) EndedByTask() string { return i.VM.EndedByGuest() }

func (i *Instance[M]) Check(ctx context.Context) error { return i.VM.Check() }

// Stats reports the guest's own use (VM.Stats).
func (i *Instance[M]) Stats(ctx context.Context) (substrate.Stats, error) {
	return i.VM.Stats(ctx), nil
}

// Pause saves the VM's memory and devices and ends QEMU, so a paused VM
// holds no memory. It is idempotent.
func (i *Instance[M]) Pause(ctx context.Context) error { return i.VM.Pause(ctx) }

// Resume restores a paused VM from its saved memory. It is idempotent.
func (i *Instance[M]) Resume(ctx context.Context) error { return i.VM.Resume(ctx) }

// SnapshotMachine writes memory, devices, the writable disk and the
// machine into dir. A running VM is stopped for the capture (so disk and
// memory agree) and continued; a paused one is copied as it is.
func (i *Instance[M]) SnapshotMachine(ctx context.Context, dir string) error {
	mb, err := json.Marshal(i.Machine)
	if err != nil {
		return errdefs.Internal(err, "encode the machine")
	}
	err = i.VM.SaveMachine(ctx, filepath.Join(dir, MemoryFile), filepath.Join(dir, RAMFile), func() error {
		return CopySparse(i.Path(i.DiskFile), filepath.Join(dir, i.DiskFile))
	})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, MachineFile), mb, 0o600); err != nil {
		return errdefs.Internal(err, "write the machine snapshot")
	}
	return nil
}

// Destroy kills QEMU and removes the instance's sockets, disk and saved
// memory. It is idempotent.
func (i *Instance[M]) Destroy(ctx context.Context) error {
	i.VM.Destroy()
	if err := os.Remove(i.Path(i.DiskFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return errdefs.Internal(err, "remove the VM's disk")
	}
	return nil
}
