// Package substrate is the contract between the node and the drivers that
// run sandboxes: function, container, microvm and vm. Every driver
// implements Driver and passes the conformance suite in substratetest; what
// differs between kinds is declared in Capabilities, which placement and
// the API read as data.
package substrate

import (
	"context"
	"io"
	"net"
	"syscall"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/image"
)

// Kind names a substrate.
type Kind string

const (
	KindFunction  Kind = "function"
	KindContainer Kind = "container"
	KindMicroVM   Kind = "microvm"
	KindVM        Kind = "vm"
)

// Kinds lists every kind in a stable order.
var Kinds = []Kind{KindFunction, KindContainer, KindMicroVM, KindVM}

// Capability is one verb or feature a driver may support.
type Capability string

const (
	CapExec           Capability = "exec"
	CapPTY            Capability = "pty" // processes that outlive their call, PTYs among them
	CapFiles          Capability = "files"
	CapPause          Capability = "pause"
	CapSnapshot       Capability = "snapshot"        // writable layer (disk) snapshots
	CapMemorySnapshot Capability = "memory_snapshot" // memory + device state
	CapFork           Capability = "fork"
	CapNetworkEgress  Capability = "network_egress"
	CapScreen         Capability = "screen"
	CapGPU            Capability = "gpu"
	CapVolumes        Capability = "volumes" // mounts volumes (Spec.Volumes)
)

// Capabilities is what a driver can do on this host, found by probing at
// start. A driver that cannot run here reports Available false and why.
type Capabilities struct {
	Kind      Kind
	Available bool
	Reason    string
	Caps      []Capability
	// Details are facts for operators: runtime and version, cgroup mode,
	// acceleration.
	Details map[string]string
	// Runtimes are the runtimes a sandbox of this kind may ask for besides
	// its default (Spec.Runtime), each probed on this host: available or
	// not and why, and what it can do (Available, Reason, Caps and Details
	// above describe the default).
	Runtimes []Runtime
}

// Runtime is one of a kind's runtimes: another way to run its instances,
// with capabilities of its own.
type Runtime struct {
	Name      string
	Available bool
	Reason    string
	Caps      []Capability
	Details   map[string]string
}

// RuntimeGVisor runs a container sandbox under gVisor (runsc): its
// processes talk to an application kernel of gVisor's, not to the host's
// (see docs/substrates/container.md).
const RuntimeGVisor = "gvisor"

// For returns the capabilities of the kind's runtime name ("" is the
// default): the kind's own, or the runtime's in their place. ok is false
// when the kind has no such runtime (available or not).
func (c Capabilities) For(name string) (_ Capabilities, ok bool) {
	if name == "" {
		return c, true
	}
	for _, r := range c.Runtimes {
		if r.Name == name {
			reason := r.Reason
			if !c.Available {
				reason = c.Reason
			}
			return Capabilities{Kind: c.Kind, Available: c.Available && r.Available, Reason: reason, Caps: r.Caps, Details: r.Details}, true
		}
	}
	return Capabilities{}, false
}

// Has reports whether c includes capability x.
func (c Capabilities) Has(x Capability) bool {
	for _, y := range c.Caps {
		if y == x {
			return true
		}
	}
	return false
}

// Network is the network a sandbox is attached to, prepared by the node's
// network component before Create.
type Network struct {
	// Mode is "none" (a private namespace with loopback only, created by the
	// driver) or "egress".
	Mode string
	// NetNS is the path of a prepared network namespace (egress).
	NetNS string
	// ResolvConf is the resolv.conf content for the sandbox.
	ResolvConf string
	// Guest is what a virtual machine's own network stack is given
	// (egress): the VM drivers attach its NIC to the namespace's tap
	// (network.PrepareTap) and the guest takes the sandbox's address.
	Guest guest.NetConfig
}

// Spec is what a driver needs to start an instance.
type Spec struct {
	ID string
	// Dir is a directory the driver owns for this instance's state; the node
	// removes it after Destroy.
	Dir string
	// Image is what the root filesystem is made of.
	Image Image
	// Env is the environment for every process (image env, then spec env).
	Env      []string
	User     string
	Workdir  string
	Hostname string
	// Hosts are further names that resolve to 127.0.0.1 inside (the
	// names of a sandbox's containers, which share one network
	// namespace). Drivers that write no hosts file ignore them.
	Hosts []string

	CPU      float64
	MemoryMB int64
	DiskMB   int64
	Pids     int64

	Network Network
	// Deadline is when the instance ends itself if the node has not
	// deleted it: the TTL backstop for times the node is down.
	Deadline time.Time
	// ReadOnlyRootfs mounts the root filesystem read-only; Tmpfs adds
	// writable memory file systems (function workers use both).
	ReadOnlyRootfs bool
	Tmpfs          []Tmpfs
	// MountNamespaces lets the instance's root processes make mount
	// namespaces and mounts (function workers give each call its own /tmp
	// this way): CAP_SYS_ADMIN, and a seccomp profile that allows
	// unshare and setns of mount namespaces, mount and umount2 beyond the
	// default and nothing else that capability would open (no user
	// namespaces). Processes of other users gain nothing: they hold no
	// capabilities. Drivers without it ignore it.
	MountNamespaces bool
	// PrivilegeEscalation lets the instance's processes gain privileges
	// when they execute a file (setuid binaries such as sudo, file
	// capabilities), up to what the instance's root holds and no further
	// (the image's Config.PrivilegeEscalation). The container driver then
	// runs the sandbox without no_new_privs, and only where it has a user
	// namespace (not with HostRoot, and not with MountNamespaces): its
	// root is an unprivileged host user. Kinds whose boundary is a
	// virtual machine never set no_new_privs and ignore it.
	PrivilegeEscalation bool
	// Runtime selects one of the driver's runtimes (Capabilities.Runtimes;
	// "" is its default), fixed for the instance's life.
	Runtime string
	// Volumes are volumes to mount into the instance, for drivers with
	// CapVolumes (others are never given any).
	Volumes []VolumeMount
	// Restore, if set, is a machine snapshot directory written by
	// Instance.SnapshotMachine of the same kind: the instance starts from
	// it (memory, devices and disk as they were) instead of booting, with
	// its own writable disk and a fresh identity (hostname, clock,
	// randomness). Image must be the snapshotted instance's.
	Restore string
}

// VolumeMount is a volume mounted into an instance. Ownership on the
// volume is as sandboxes see it (0 is their root): a driver whose instances
// have a user namespace of their own maps it through that namespace.
type VolumeMount struct {
	// Source is the directory the node mounted the volume's file system
	// at (its root).
	Source string
	// Path is where the volume appears inside: absolute and clean.
	Path     string
	ReadOnly bool
}

// Image is the image an instance starts from, as the node's image store
// holds it.
type Image struct {
	// Name is the image's name in the store (a snapshot's ID for a
	// snapshot's children); Digest is its content digest.
	Name, Digest string
	// Layers are the read-only root filesystem layers, top first.
	Layers []Layer
	// VM is set for a VM image: its one layer holds the disk (and, for
	// direct boot, the kernel and initrd) that VMImage describes.
	VM *image.VMImage
}

// Layer is one unpacked image layer on the host.
type Layer struct {
	// DiffID is the digest of the layer's uncompressed tar
	// ("sha256:<hex>"); layers are stored and cached by it.
	DiffID string
	// Dir is the layer's directory. Link is a short path to it, for
	// overlay mount options (the kernel limits them to one page).
	Dir, Link string
}

// ImageOf is img of store as a Spec's Image.
func ImageOf(store *image.Store, img *image.Image) Image {
	out := Image{Name: img.Name, Digest: img.Digest, VM: img.VM}
	for i := len(img.Layers) - 1; i >= 0; i-- {
		d := img.Layers[i]
		out.Layers = append(out.Layers, Layer{DiffID: d, Dir: store.LayerDir(d), Link: store.ShortLayerPath(d)})
	}
	return out
}

// Links are the image's layers' short paths, top first: the lower
// directories of an overlay mount.
func (im Image) Links() []string {
	out := make([]string, len(im.Layers))
	for i, l := range im.Layers {
		out[i] = l.Link
	}
	return out
}

// Tmpfs is a tmpfs mount: Options as for mount(8), e.g. "mode=1777,size=512m".
type Tmpfs struct {
	Path    string
	Options string
}

// Guest is the in-sandbox agent as the node drives it: what the agent of
// every kind does. *guest.Client implements it and the optional guest
// interfaces (ProcessGuest, FileGuest); a driver that dispatches calls
// differently (function) implements what its capabilities declare.
type Guest interface {
	Hello(ctx context.Context) (*guestv1.HelloReply, error)
	// Run runs a command to completion.
	Run(ctx context.Context, x *guestv1.Exec) (*guestv1.Exit, error)
	Sync(ctx context.Context) error
	SetDeadline(ctx context.Context, t time.Time) error
	SetEnv(ctx context.Context, env []string) error
}

// ProcessGuest is an agent whose processes outlive their call (CapPTY):
// started, streamed, attached to again, written to, signalled, resized
// and listed.
type ProcessGuest interface {
	Start(ctx context.Context, x *guestv1.Exec) (*guest.Process, error)
	Attach(ctx context.Context, id, tag string, liveOnly bool) (*guest.Process, error)
	InputProcess(ctx context.Context, id string, data []byte, eof bool) error
	SignalProcess(ctx context.Context, id string, sig syscall.Signal) error
	ResizeProcess(ctx context.Context, id string, rows, cols uint32) error
	ListProcs(ctx context.Context) ([]*guestv1.Proc, error)
}

// FileGuest is an agent with a file system the caller reaches (CapFiles).
// File calls act as the message's user inside the sandbox (see
// guestv1.ReadFile).
type FileGuest interface {
	ReadFile(ctx context.Context, r *guestv1.ReadFile) (*guest.FileReader, error)
	WriteFile(ctx context.Context, w *guestv1.WriteFile, r io.Reader) (*guestv1.FileInfo, error)
	Stat(ctx context.Context, p *guestv1.Path) (*guestv1.FileInfo, error)
	ListDir(ctx context.Context, l *guestv1.ListDir) ([]*guestv1.FileInfo, error)
	MakeDir(ctx context.Context, m *guestv1.MakeDir) (*guestv1.FileInfo, error)
	Remove(ctx context.Context, r *guestv1.Remove) error
	Rename(ctx context.Context, r *guestv1.Rename) (*guestv1.FileInfo, error)
	ChangeMode(ctx context.Context, m *guestv1.ChangeMode) (*guestv1.FileInfo, error)
	Watch(ctx context.Context, w *guestv1.Watch) (*guest.Watch, error)
}

// PortGuest is an agent that connects to TCP ports of its own sandbox:
// DialPort returns a connection to a port on the sandbox's loopback
// interface (from inside the sandbox's network namespace, so a sandbox
// without network is reached too). ctx bounds the connect only. Nothing
// listening is a not_found error. Every kind with dsec-guest has it.
type PortGuest interface {
	DialPort(ctx context.Context, port uint32) (net.Conn, error)
	// Listen listens on a port of the sandbox's loopback (127.0.0.1) and
	// yields the connections processes in the sandbox open to it; ctx
	// bounds the listener's life. A port a process of the sandbox holds
	// already is an exists error.
	Listen(ctx context.Context, port uint32) (net.Listener, error)
}

var (
	_ Guest        = (*guest.Client)(nil)
	_ ProcessGuest = (*guest.Client)(nil)
	_ FileGuest    = (*guest.Client)(nil)
	_ PortGuest    = (*guest.Client)(nil)
)

// Diagnoser is implemented by instances that keep what their init (or the
// guest console) printed last. When an instance stops by itself the node
// records it with the sandbox's end, so a crash says why.
type Diagnoser interface {
	// LastWords returns the end of that output, short and free of host
	// paths, or "".
	LastWords() string
}

// TaskEnder is implemented by instances that their own workload can end
// as a whole: containers under gVisor, whose application kernel has no OOM
// killer and no process limit of its own (the host's cgroup limits stop
// the whole sandbox, kernel and all) and lets a process of the sandbox
// kill its init, the agent; and VMs, whose guest (root over its own
// kernel) can power its machine off, reboot it or crash its kernel. The
// node reports such an end as the task's, not the platform's.
type TaskEnder interface {
	// EndedByTask says, once the instance has stopped by itself, how its
	// workload ended it, as a clause: "reached its memory limit", "reached
	// its pids limit", "killed the sandbox's agent (signal KILL)" or
	// "powered the machine off"; ""
	// if it did not (it crashed, or was killed from outside).
	EndedByTask() string
}

// How a workload ends a TaskEnder by one of its limits (EndedByTask).
const (
	EndedByMemoryLimit = "reached its memory limit"
	EndedByPidsLimit   = "reached its pids limit"
)

// Stats is an instance's resource use.
type Stats struct {
	MemoryBytes int64
	CPUTime     time.Duration
	Pids        int64
	// OOMKills counts processes the memory limit killed since the start.
	OOMKills int64
	// PidsLimitHits counts forks the process limit refused since the
	// start (0 where the substrate cannot tell).
	PidsLimitHits int64
	// DiskBytes is what the writable layer holds, and DiskLimitBytes its
	// limit (0 where the substrate does not limit or measure it).
	DiskBytes, DiskLimitBytes int64
}

// Driver runs instances of one kind.
type Driver interface {
	// Capabilities reports what the driver can do on this host.
	Capabilities() Capabilities
	// Create starts an instance and returns once its guest answers. On error
	// nothing of the instance is left behind. ctx bounds the start only.
	Create(ctx context.Context, spec *Spec) (Instance, error)
	// Attach re-adopts an instance started by an earlier process of the
	// node, from the state it persisted. It returns a Gone error if the
	// instance no longer runs.
	Attach(ctx context.Context, spec *Spec, state []byte) (Instance, error)
}

// Starter is a driver with background work of its own (a warm pool of
// workers, a janitor): its node starts it once assembled, after it has
// re-adopted its sandboxes.
type Starter interface {
	Start()
}

// Closer is a driver holding host resources (workers, ID allocators,
// mounts) that its node releases when it closes, after its own pools.
// Sandboxes keep running across a close.
type Closer interface {
	Close()
}

// BuiltOn is a driver whose instances are another kind's (function
// workers are containers): its node closes it before the driver it is
// built on.
type BuiltOn interface {
	BuiltOn() Kind
}

// Instance is one running sandbox of a driver. Methods are safe for
// concurrent use. What only some kinds can do is an optional interface
// (Pauser, Snapshotter, MachineSnapshotter, Screen), implemented exactly
// by the instances of drivers that declare its capability (Optional; the
// conformance suite checks it): the node asks with one type assertion.
type Instance interface {
	// Guest is the instance's agent.
	Guest() Guest
	// State is what the node persists to Attach after a restart.
	State() []byte
	// Done is closed when the instance stops by itself (its init died).
	Done() <-chan struct{}
	// Check returns nil while the instance runs, else a Gone error.
	Check(ctx context.Context) error
	// Stats reports resource use.
	Stats(ctx context.Context) (Stats, error)
	// Destroy releases every resource of the instance. It is idempotent.
	Destroy(ctx context.Context) error
}

// Pauser is an instance that can pause (CapPause): Pause freezes every
// process and releases what memory it can; Resume thaws. Both are
// idempotent.
type Pauser interface {
	Pause(ctx context.Context) error
	Resume(ctx context.Context) error
}

// Stopper is an instance that can pause without its memory (a
// filesystem-only pause, CapPause's kinds that implement it): Stop ends
// every process of the instance, agent and all, and releases its memory
// and CPU, keeping its file system (and its network identity); the
// Pauser's Resume then starts it again on that file system, a fresh boot:
// a new agent, no process from before, a new boot id. The instance's Done
// is not closed by a Stop; Check answers nil while it is stopped. Stop is
// idempotent.
type Stopper interface {
	Stop(ctx context.Context) error
}

// Snapshotter is an instance whose writable filesystem layer can be
// captured (CapSnapshot): Snapshot writes it, captured consistently
// (processes frozen), as an uncompressed OCI layer tar.
type Snapshotter interface {
	Snapshot(ctx context.Context, w io.Writer) error
}

// MachineSnapshotter is an instance whose whole machine can be captured
// (CapMemorySnapshot): SnapshotMachine writes memory, device state and
// writable disk, captured consistently, into the empty directory dir,
// which the node keeps as long as the snapshot exists. The instance keeps
// running (or stays paused). Any number of instances start from dir
// through Spec.Restore.
type MachineSnapshotter interface {
	SnapshotMachine(ctx context.Context, dir string) error
}

// Screen is an instance with a screen (CapScreen). Screenshot captures it
// as PNG. SendInput types, presses keys and moves, clicks and scrolls the
// mouse on it, in order. OpenVNC gives the screen's VNC server a new
// password and returns it with the server's loopback address (an
// Unimplemented error where the node runs its VMs without VNC).
type Screen interface {
	Screenshot(ctx context.Context) (*Screenshot, error)
	SendInput(ctx context.Context, actions []InputAction) error
	OpenVNC(ctx context.Context) (*VNC, error)
}

// Optional pairs each capability that promises an optional interface
// with the check that an instance (or its guest) implements it.
var Optional = map[Capability]func(Instance) bool{
	CapPause:          implements[Pauser],
	CapSnapshot:       implements[Snapshotter],
	CapMemorySnapshot: implements[MachineSnapshotter],
	CapScreen:         implements[Screen],
	CapPTY:            guestImplements[ProcessGuest],
	CapFiles:          guestImplements[FileGuest],
}

func implements[T any](i Instance) bool {
	_, ok := i.(T)
	return ok
}

func guestImplements[T any](i Instance) bool {
	_, ok := i.Guest().(T)
	return ok
}

// Screenshot is an instance's screen as a PNG image of Width x Height
// pixels (the guest's display mode).
type Screenshot struct {
	PNG           []byte
	Width, Height int
}

// VNC is a screen's VNC server: its address on the node's loopback and a
// password valid until Expires.
type VNC struct {
	Address, Password string
	Expires           time.Time
}

// InputAction is one keyboard or mouse action on an instance's screen.
// Exactly one field is set.
type InputAction struct {
	// Text types characters (US keyboard layout; "\n" is Return).
	Text string
	// Keys presses a key combination such as "ctrl+c", "Return" or
	// "alt+F4": each key down in order, then up in reverse.
	Keys string
	// Move moves the pointer to a screen position (pixels).
	Move *Point
	// Click moves to a position and clicks Button Count times.
	Click *Click
	// Button presses (Down) or releases a button where the pointer is
	// (a drag is a move, a press, moves and a release).
	Button *Button
	// Scroll turns the wheel: DY clicks down (negative: up), DX right.
	Scroll *Scroll
}

// Point is a screen position in pixels from the top left corner.
type Point struct{ X, Y int }

// Click is a mouse click at a position. Button is "left" (default),
// "middle" or "right"; Count is 1 (default) or more (a double click).
type Click struct {
	Point
	Button string
	Count  int
}

// Button is a mouse button press or release.
type Button struct {
	Button string
	Down   bool
}

// Scroll is a turn of the mouse wheel.
type Scroll struct{ DX, DY int }
