// Package container is the container substrate: sandboxes run by an OCI
// runtime (crun, or runc as fallback) from runtime specs generated with the
// runtime-spec types. The root filesystem is an overlay of the image's
// shared read-only layers under a per-sandbox writable upper directory; the
// sandbox's init is dsec-guest, reached over a listening socket it inherits.
package container

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/proc"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/undo"
)

// Config configures the driver. The zero value works given GuestBinary and
// StateDir.
type Config struct {
	// Runtime is "crun", "runc" or a path (default: crun if usable here,
	// else runc).
	Runtime string
	// RunDir holds runtime state and the agents' sockets; it must be short
	// (socket paths are limited to 108 bytes). Default /run/dsec/<hash of
	// StateDir>.
	RunDir string
	// CgroupParent is the cgroup under which sandboxes are created
	// (default "/dsec").
	CgroupParent string
	// GuestBinary is the static dsec-guest binary bind-mounted into every
	// sandbox (required).
	GuestBinary string
	// StateDir is where the driver keeps files it shares across sandboxes
	// (required).
	StateDir string
	// StartTimeout bounds how long Create waits for the agent (default 30s).
	StartTimeout time.Duration
	// HostRoot runs sandboxes without a user namespace: root inside is the
	// host's root (as in Docker without userns-remap), and per-user kernel
	// limits are shared with the host's root. For workloads that need it:
	// images whose files belong to ids above 65535, files shared with host
	// users by uid, device nodes. Default false: every sandbox maps its ids
	// 0..65535 to a range of unprivileged host ids of its own (idmap.go).
	HostRoot bool
	// DefaultDiskMB is a sandbox's disk size (its writable layer's file
	// system) when its spec gives none (default 10240); MaxDiskMB is the
	// largest a spec may ask for (default 102400). The images are sparse:
	// a sandbox takes from the host's disk what it writes, and sandboxes'
	// sizes may add up to more than the host has.
	DefaultDiskMB, MaxDiskMB int64
	// NoDiskLimits keeps writable layers on StateDir's own file system
	// without limits (default false; the node falls back to it by itself,
	// with a warning, where it cannot make file systems: no loop devices
	// or no mkfs.ext4).
	NoDiskLimits bool
	// GVisor is the runsc binary sandboxes with runtime "gvisor" run
	// under (default: runsc on PATH, offered if it starts a sandbox here);
	// "off" offers no gVisor. GVisorPlatform is its platform: ptrace
	// (default: runs anywhere) or kvm (needs a usable /dev/kvm).
	GVisor, GVisorPlatform string
}

// Driver is the container driver.
type Driver struct {
	log *slog.Logger
	cfg Config
	// oci is the default runtime (crun or runc); gvisor is runsc, nil where
	// it cannot run (gvisorReason says why).
	oci          *ociRuntime
	gvisor       *ociRuntime
	gvisorReason string
	runRoot      string // the default runtime's state directory
	sockDir      string
	// files holds what is bind-mounted into sandboxes (the agent binary,
	// each sandbox's /etc files): a tmpfs of its own, so a sandbox's
	// /proc/self/mountinfo names no host path.
	files string
	// maskMounts and maskPaths mask the host's information (spec.go's
	// masks).
	maskMounts []specs.Mount
	maskPaths  []string
	skel       string // the top lower layer with mountpoints
	guestBin   string
	cgroups    cgroups
	seccomp    *seccompCache
	// seccompMounts is the profile of instances with MountNamespaces.
	seccompMounts *seccompCache
	caps          substrate.Capabilities
	// nofile is the open-file limit sandboxes get: 2^20, or the node's own
	// hard limit when it may not raise it.
	nofile uint64
	// sysResource is whether the node holds CAP_SYS_RESOURCE (needed to
	// lower the agent's OOM score).
	sysResource bool
	// ranges and userns give sandboxes their user namespaces (nil with
	// HostRoot).
	ranges *idRanges
	userns *usernsPool
	// disk holds the sandboxes' writable layers (nil without limits).
	disk *diskPool
	// debt forgives the CPU debt of sandboxes stalled repaying it.
	debt *debtWatch
}

var _ substrate.Driver = (*Driver)(nil)

// New probes the host and returns a driver. If containers cannot run here
// the driver still returns, reporting why in its capabilities; Create then
// fails with an Unavailable error.
func New(cfg Config, log *slog.Logger) (*Driver, error) {
	if cfg.GuestBinary == "" || cfg.StateDir == "" {
		return nil, errors.New("container driver needs GuestBinary and StateDir")
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "/dsec"
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = 30 * time.Second
	}
	if cfg.DefaultDiskMB == 0 {
		cfg.DefaultDiskMB = 10240
	}
	if cfg.MaxDiskMB == 0 {
		cfg.MaxDiskMB = 100 << 10
	}
	if cfg.RunDir == "" {
		abs, _ := filepath.Abs(cfg.StateDir)
		cfg.RunDir = filepath.Join("/run/dsec", shortHash(abs))
	}
	d := &Driver{log: log, cfg: cfg, guestBin: cfg.GuestBinary, cgroups: probeCgroups()}
	d.runRoot = filepath.Join(cfg.RunDir, "runtime")
	d.oci = &ociRuntime{root: d.runRoot}
	d.sockDir = filepath.Join(cfg.RunDir, "sock")
	d.files = filepath.Join(cfg.RunDir, "files")
	d.skel = filepath.Join(cfg.StateDir, "skel")
	d.caps = substrate.Capabilities{
		Kind: substrate.KindContainer,
		Caps: []substrate.Capability{substrate.CapExec, substrate.CapPTY, substrate.CapFiles, substrate.CapPause, substrate.CapSnapshot, substrate.CapFork, substrate.CapNetworkEgress, substrate.CapVolumes},
		Details: map[string]string{
			"cgroup": d.cgroups.Mode.String(),
		},
	}
	if reason := d.probe(); reason != "" {
		d.caps.Reason = reason
		log.Warn("container substrate unavailable", slog.String("reason", reason))
		return d, nil
	}
	sc, err := newSeccompCache(cfg.StateDir, d.oci.name+" "+d.oci.version, defaultSeccomp)
	if err != nil {
		return nil, fmt.Errorf("seccomp profile: %w", err)
	}
	d.seccomp = sc
	if d.seccompMounts, err = newSeccompCache(cfg.StateDir, d.oci.name+" "+d.oci.version, mountsSeccomp); err != nil {
		return nil, fmt.Errorf("seccomp profile: %w", err)
	}
	d.caps.Available = true
	d.debt = newDebtWatch(d.cgroups, log)
	d.caps.Details["runtime"] = d.oci.name + " " + d.oci.version
	d.gvisor, d.gvisorReason = d.probeGVisor()
	if d.gvisor == nil {
		log.Info("no gvisor runtime", slog.String("reason", d.gvisorReason))
	}
	d.caps.Runtimes = []substrate.Runtime{d.gvisorCaps(d.gvisor, d.gvisorReason)}
	if d.cfg.HostRoot {
		d.caps.Details["user_namespace"] = "off (host_root: root inside is the host's root)"
	} else {
		d.caps.Details["user_namespace"] = fmt.Sprintf("per sandbox, %d ids each from host id %d", idRangeSize, d.ranges.base)
	}
	if d.disk != nil {
		d.caps.Details["disk_limit"] = fmt.Sprintf("a file system per sandbox (ext4 on a loop device), default %d MiB, max %d MiB", d.cfg.DefaultDiskMB, d.cfg.MaxDiskMB)
	} else if d.caps.Details["disk_limit"] == "" {
		d.caps.Details["disk_limit"] = "off"
	}
	log.Info("container substrate ready", slog.String("runtime", d.oci.name+" "+d.oci.version), slog.String("cgroup", d.cgroups.Mode.String()))
	return d, nil
}

// probe finds a usable runtime and prepares shared state; it returns why
// containers cannot run, or "".
func (d *Driver) probe() string {
	if os.Geteuid() != 0 {
		return "the container substrate needs root"
	}
	d.sysResource = hasCapability(unix.CAP_SYS_RESOURCE)
	var rl unix.Rlimit
	d.nofile = 1 << 20
	// In a user namespace the runtime sets the limit without
	// CAP_SYS_RESOURCE over the host: never above the node's own.
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) == nil && (!d.sysResource || !d.cfg.HostRoot) && rl.Max < d.nofile {
		d.nofile = rl.Max
	}
	switch {
	case d.shieldable():
		if err := d.prepareAgentsCgroups(); err != nil {
			return fmt.Sprintf("cannot prepare the agents' cgroups: %v", err)
		}
		d.caps.Details["agent_shield"] = "cgroups (the agent's own memory, cpu and pids cgroups)"
	case d.sysResource:
		d.caps.Details["agent_shield"] = "oom_score_adj only (cgroup v2)"
	default:
		d.log.Warn("cgroup v2 and no CAP_SYS_RESOURCE: sandbox agents are not shielded from the OOM killer")
		d.caps.Details["agent_shield"] = "off (cgroup v2 and no CAP_SYS_RESOURCE)"
	}
	if b, err := os.ReadFile("/proc/filesystems"); err != nil || !bytes.Contains(b, []byte("overlay")) {
		return "the kernel has no overlayfs"
	}
	if st, err := os.Stat(d.guestBin); err != nil || !st.Mode().IsRegular() {
		return fmt.Sprintf("dsec-guest binary not found at %s", d.guestBin)
	}
	_, unifiedVisible := mountns.HybridCgroups()
	candidates := []string{"crun", "runc"}
	if d.cfg.Runtime != "" {
		candidates = []string{d.cfg.Runtime}
	}
	var skipped []string
	for _, c := range candidates {
		p, err := exec.LookPath(c)
		if err != nil {
			skipped = append(skipped, c+" not installed")
			continue
		}
		name := filepath.Base(p)
		if strings.Contains(name, "crun") && unifiedVisible {
			skipped = append(skipped, "crun refuses hybrid cgroups unless the node runs in its own mount namespace")
			continue
		}
		out, err := exec.Command(p, "--version").Output()
		if err != nil {
			skipped = append(skipped, c+" does not run")
			continue
		}
		d.oci.path, d.oci.name = p, "runc"
		if strings.Contains(name, "crun") {
			d.oci.name = "crun"
		}
		if f := strings.Fields(string(out)); len(f) >= 3 {
			d.oci.version = f[2]
		}
		break
	}
	if d.oci.path == "" {
		return "no usable OCI runtime: " + strings.Join(skipped, "; ") + " (apt-get install crun)"
	}
	if d.oci.name == "crun" {
		if err := d.oci.sealExe(); err != nil {
			d.log.Warn("crun runs from its file, copying itself at every start", slog.Any("error", err))
		}
	}
	for _, dir := range []string{d.runRoot, d.sockDir} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Sprintf("create %s: %v", dir, err)
		}
	}
	if err := d.prepareFiles(); err != nil {
		return fmt.Sprintf("prepare the sandboxes' bind-mounted files: %v", err)
	}
	if err := writeSkeleton(d.skel); err != nil {
		return fmt.Sprintf("create skeleton layer: %v", err)
	}
	if !d.cfg.HostRoot {
		r, err := newIDRanges(idRangesDir, d.runRoot, d.log)
		if err != nil {
			return fmt.Sprintf("id ranges: %v", err)
		}
		d.ranges = r
		if reason := d.probeUserns(); reason != "" {
			return reason + " (set container.host_root to run sandboxes as the host's root)"
		}
		d.userns = newUsernsPool(r, d.log)
	}
	if !d.cfg.NoDiskLimits {
		p, err := openDiskPool(filepath.Join(d.cfg.StateDir, "disks"), filepath.Join(d.cfg.RunDir, "disks"), d.cfg.DefaultDiskMB, d.log)
		if err != nil {
			d.log.Warn("sandbox disks are not limited", slog.Any("error", err))
			d.caps.Details["disk_limit"] = "off: " + err.Error()
		} else {
			d.disk = p
		}
	}
	return ""
}

// probeUserns checks that this kernel gives a user namespace made for a
// range and id-mapped mounts of the layers' file system.
func (d *Driver) probeUserns() string {
	f, err := newUserNamespace(d.ranges.hostID(d.ranges.count - 1))
	if err != nil {
		return fmt.Sprintf("user namespaces: %v", err)
	}
	defer f.Close()
	dir, err := os.MkdirTemp(d.cfg.StateDir, "probe-")
	if err != nil {
		return fmt.Sprintf("user namespaces: %v", err)
	}
	defer os.RemoveAll(dir)
	detach, err := attachLayers(dir, []string{d.skel}, f)
	if err != nil {
		return fmt.Sprintf("id-mapped mounts of the image layers: %v", err)
	}
	detach()
	return ""
}

// prepareFiles mounts the tmpfs sandboxes' bind mounts come from (in the
// node's private mount namespace; elsewhere, as in some tests, a plain
// directory) and copies the agent binary into it.
func (d *Driver) prepareFiles() error {
	if err := os.MkdirAll(d.files, 0o700); err != nil {
		return err
	}
	if mountns.Entered() {
		if err := unix.Mount("tmpfs", d.files, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0700,size=256m"); err != nil {
			return err
		}
	}
	if err := os.Mkdir(filepath.Join(d.files, emptyDir), 0o555); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	d.maskMounts, d.maskPaths = masks(d.files)
	src, err := os.Open(d.guestBin)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(filepath.Join(d.files, "dsec-guest"), os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o555)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return err
	}
	return dst.Close()
}

// filesOf is the directory of a sandbox's bind-mounted /etc files.
func (d *Driver) filesOf(id string) string { return filepath.Join(d.files, id) }

// writeSkeleton makes the top read-only layer that holds the mountpoints
// the runtime needs, so it never writes them into a sandbox's upper layer
// (and so into its snapshots).
func writeSkeleton(dir string) error {
	for _, d := range []string{"proc", "sys", "dev", ".dsec", "etc"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	for _, f := range []string{guestPath, "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"} {
		p := filepath.Join(dir, f)
		if _, err := os.Stat(p); err == nil {
			continue
		}
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Close gives back what the driver made ahead for creates (user
// namespaces and their id ranges, file systems); running sandboxes are
// left alone. Call it when the node stops.
func (d *Driver) Close() {
	if d.debt != nil {
		d.debt.close()
	}
	if d.userns != nil {
		d.userns.close()
	}
	if d.disk != nil {
		d.disk.close()
	}
	if d.shieldable() {
		// The agents' shared cgroups go with this node's last agent (its
		// sandboxes outlive it: then they are not empty and stay, for
		// the node that comes back with the same run directory).
		for _, c := range []string{"memory", "cpu"} {
			os.Remove(d.cgroups.Dir(d.agentsCgroup(), c))
		}
	}
}

// Capabilities implements substrate.Driver.
func (d *Driver) Capabilities() substrate.Capabilities { return d.caps }

func (d *Driver) cgroupPath(id string) string { return filepath.Join(d.cfg.CgroupParent, id) }

func (d *Driver) sockPath(id string) string { return filepath.Join(d.sockDir, id) }

// runtimeOf returns the runtime a sandbox runs under (name: its
// Spec.Runtime), or an error for one this node cannot run.
func (d *Driver) runtimeOf(name string) (*ociRuntime, error) {
	switch name {
	case "":
		return d.oci, nil
	case substrate.RuntimeGVisor:
		if d.gvisor == nil {
			return nil, errdefs.Unavailable("the gvisor runtime is unavailable on this node: %s", d.gvisorReason)
		}
		return d.gvisor, nil
	}
	return nil, errdefs.Invalid("unknown runtime %q (use gvisor, or none for the default)", name)
}

// state is what an instance persists.
type state struct {
	// Version is the format's version (stateVersion when written; 0 for
	// states written before versions).
	Version   int    `json:"version,omitempty"`
	Pid       int    `json:"pid"`        // the agent (the container's init)
	StartTime uint64 `json:"start_time"` // of Pid, against pid reuse
	// RuntimePid is the `crun run` process that waits for the container
	// and removes its cgroup and state when it exits.
	RuntimePid       int    `json:"runtime_pid"`
	RuntimeStartTime uint64 `json:"runtime_start_time"`
	Cgroup           string `json:"cgroup"`
	Socket           string `json:"socket"`
	Rootfs           string `json:"rootfs"`
	// IDRange is the sandbox's range of host ids, and HostID its first
	// id (root inside); HostID 0: no user namespace (host root).
	IDRange int    `json:"id_range,omitempty"`
	HostID  uint32 `json:"host_id,omitempty"`
	// Disk is the sandbox's file system (its upper and work
	// directories); nil: they are in the sandbox's directory, unlimited.
	Disk *sandboxDisk `json:"disk,omitempty"`
	// Sys is the node's mount of the sandbox's /sys ("": the runtime's).
	Sys string `json:"sys,omitempty"`
	// Runtime is the sandbox's Spec.Runtime ("": the default), and Jail
	// a gVisor sandbox's jail (jailOf).
	Runtime string `json:"runtime,omitempty"`
	Jail    string `json:"jail,omitempty"`
	// Stopped: the container is stopped with its file system kept
	// (Stop); Resume starts it again.
	Stopped bool `json:"stopped,omitempty"`
}

// stateVersion is the version of state this driver writes. A node
// refuses to adopt a sandbox whose state is of a later version than it
// knows (written by a newer node) rather than misread it.
const stateVersion = 1

// init is the container's init (the agent); runtime is the runtime
// process that waits for it.
func (st *state) init() proc.ID { return proc.ID{Pid: st.Pid, StartTime: st.StartTime} }
func (st *state) runtime() proc.ID {
	return proc.ID{Pid: st.RuntimePid, StartTime: st.RuntimeStartTime}
}

// upper is the sandbox's upper directory.
func (st *state) upper() string {
	if st.Disk != nil {
		return filepath.Join(st.Disk.dir, "upper")
	}
	return filepath.Join(filepath.Dir(st.Rootfs), "upper")
}

// refill has the pools make what creates took, in the background.
func (d *Driver) refill() {
	if d.userns != nil {
		d.userns.refill()
	}
	if d.disk != nil {
		d.disk.refill()
	}
}

// diskMB is the disk size of s's sandbox (0: unlimited).
func (d *Driver) diskMB(s *substrate.Spec) (int64, error) {
	if d.disk == nil {
		return 0, nil
	}
	mb := s.DiskMB
	if mb == 0 {
		mb = d.cfg.DefaultDiskMB
	}
	if mb < minDiskMB || mb > d.cfg.MaxDiskMB {
		return 0, errdefs.Invalid("resources.disk_mb %d out of range [%d, %d]", mb, minDiskMB, d.cfg.MaxDiskMB)
	}
	return mb, nil
}

// prepareLayers makes a sandbox's upper, work and lower mountpoint
// directories in dir. The upper directory is the root directory the
// sandbox sees: its root's (host, the user namespace's root).
func (d *Driver) prepareLayers(dir string, host uint32) error {
	for _, sub := range []string{"upper", "work", "l"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return err
		}
	}
	if host != 0 {
		return os.Chown(filepath.Join(dir, "upper"), int(host), int(host))
	}
	return nil
}

// Create implements substrate.Driver.
//
// The runtime runs in the foreground for the sandbox's whole life: one
// runtime process creates the container, waits for its init and cleans up
// after it, so a sandbox costs one runtime execution, not two, and its
// cgroup and state are removed even if the node is down when it ends.
func (d *Driver) Create(ctx context.Context, s *substrate.Spec) (_ substrate.Instance, err error) {
	if !d.caps.Available {
		return nil, errdefs.Unavailable("containers cannot run on this node: %s", d.caps.Reason)
	}
	rt, err := d.runtimeOf(s.Runtime)
	if err != nil {
		return nil, err
	}
	gvisor := rt.gvisor()
	if gvisor && s.Network.NetNS != "" && rt.netMask == "" {
		return nil, errdefs.Unimplemented("sandboxes of runtime gvisor have no egress networking on this node: %s", rt.egressReason)
	}
	var undo undo.Stack
	defer undo.RunUnless(&err)
	defer d.refill() // after the create: the pools' work would compete with it
	diskMB, err := d.diskMB(s)
	if err != nil {
		return nil, err
	}
	t := time.Now()
	st := state{Version: stateVersion, Cgroup: d.cgroupPath(s.ID), Rootfs: filepath.Join(s.Dir, "rootfs"), Runtime: s.Runtime}
	if err := os.MkdirAll(st.Rootfs, 0o755); err != nil {
		return nil, errdefs.Internal(err, "prepare sandbox directory")
	}
	var ns *userNS
	if d.userns != nil {
		if ns, err = d.userns.take(s.ID); err != nil {
			return nil, errdefs.Unavailable("no user namespace for the sandbox: %v", err).WithCause(err)
		}
		undo.Push(func() { d.ranges.free(ns.index) })
		defer ns.close() // crun has joined it once Create returns
		st.IDRange, st.HostID = ns.index, ns.host
		// The runtime finds the root file system from the bundle (the
		// sandbox's directory) in the sandbox's user namespace.
		if err := os.Chmod(s.Dir, 0o711); err != nil {
			return nil, errdefs.Internal(err, "prepare sandbox directory")
		}
	}
	// The writable layer: upper and work on the sandbox's own file
	// system, beside the mountpoints of the lower layers.
	diskDir := s.Dir
	if d.disk != nil {
		sd, err := d.disk.take(diskMB)
		if err != nil {
			return nil, errdefs.Internal(err, "prepare the sandbox's disk")
		}
		// Released once the overlay is gone (pushed before its unmount).
		undo.Push(func() { d.disk.release(sd) })
		diskDir, st.Disk = sd.dir, sd
	}
	if err := d.prepareLayers(diskDir, st.HostID); err != nil {
		return nil, errdefs.Internal(err, "prepare sandbox directory")
	}
	var nsFile *os.File
	if ns != nil {
		nsFile = ns.f
	}
	t = substrate.Step(ctx, "prepare", t)
	if err := d.mountRoot(s, diskDir, st.Rootfs, nsFile); err != nil {
		return nil, err
	}
	t = substrate.Step(ctx, "mount", t)
	rootfs := st.Rootfs
	undo.Push(func() { unmount(rootfs) })
	if err := writeEtc(d.filesOf(s.ID), s, st.HostID); err != nil {
		return nil, errdefs.Internal(err, "write sandbox /etc files")
	}
	undo.Push(func() { os.RemoveAll(d.filesOf(s.ID)) })
	if ns != nil && s.Network.NetNS != "" && !gvisor {
		// The runtime cannot mount a sysfs for a network namespace its
		// user namespace does not own (it would bind the host's /sys):
		// the node mounts the namespace's own for it. (gVisor's kernel
		// has a sysfs of its own.)
		st.Sys = filepath.Join(s.Dir, "sys")
		if err := mountSysfs(s.Network.NetNS, st.Sys); err != nil {
			return nil, errdefs.Internal(err, "mount the sandbox's /sys")
		}
		sys := st.Sys
		undo.Push(func() { unmount(sys) })
	}
	if gvisor {
		// No descriptors pass into gVisor: the agent binds its socket in
		// a directory of the sandbox's jail (see gvisor.go).
		jail, undoJail, err := d.prepareGVisor(s, st.Rootfs, st.HostID)
		if err != nil {
			return nil, errdefs.Internal(err, "prepare the sandbox's jail")
		}
		undo.Push(undoJail)
		st.Jail = jail
	}
	substrate.Step(ctx, "files", t)
	b, err := d.boot(ctx, s, &st, ns, rt)
	if err != nil {
		return nil, err
	}
	inst := d.newInstance(s.ID, st)
	inst.spec = s
	inst.runtimeDone, inst.runtimeExit = b.done, b.exit
	inst.ownsRange = ns != nil
	inst.watch()
	return inst.outer(), nil
}

// mountRoot mounts sandbox s's root file system at rootfs: the image's
// layers (id-mapped to user namespace nsFile, nil: none) under the upper
// and work directories of diskDir.
func (d *Driver) mountRoot(s *substrate.Spec, diskDir, rootfs string, nsFile *os.File) error {
	lowers := append([]string{d.skel}, s.Image.Links()...)
	detach, err := attachLayers(filepath.Join(diskDir, "l"), lowers, nsFile)
	if err != nil {
		return errdefs.Internal(err, "mount the image's layers")
	}
	names := make([]string, len(lowers))
	for i := range lowers {
		names[i] = "l/" + strconv.Itoa(i)
	}
	err = mountOverlay(diskDir, names, "upper", "work", rootfs)
	detach() // the overlay holds its own clones
	return err
}

// booted is a started container's runtime: done is closed when the
// runtime process exits, with its exit code in exit.
type booted struct {
	done chan struct{}
	exit *int
}

// boot starts sandbox s's container on its prepared root file system
// (st.Rootfs, mounted) in user namespace ns (nil: none), and returns once
// its agent answers, with st's init, runtime and socket set. On error
// nothing of the start is left behind (the file system stays). Create and
// a cold resume (Resume after Stop) call it.
func (d *Driver) boot(ctx context.Context, s *substrate.Spec, st *state, ns *userNS, rt *ociRuntime) (_ *booted, err error) {
	gvisor := rt.gvisor()
	var undo undo.Stack
	defer undo.RunUnless(&err)
	var nsFile *os.File
	if ns != nil {
		nsFile = ns.f
	}
	t := time.Now()
	// The sandbox's boot identity: a fresh random boot id per start,
	// bound read-only over /proc/sys/kernel/random/boot_id (ociSpec)
	// from the node's tmpfs of sandbox files, as /etc/hosts is: a file of
	// the host's file system would name its path in the sandbox's
	// /proc/self/mountinfo.
	if err := writeBootID(d.filesOf(s.ID)); err != nil {
		return nil, errdefs.Internal(err, "write the sandbox's boot id")
	}
	agentFiles := &agentFiles{}
	if !gvisor {
		files, undoAgent, err := d.prepareAgent(s.ID, s.Dir, st.HostID)
		if err != nil {
			return nil, errdefs.Internal(err, "prepare the agent's cgroups")
		}
		undo.Push(undoAgent)
		agentFiles = files
	}
	t = substrate.Step(ctx, "cgroups", t)
	detachVolumes, err := attachVolumes(volumeDir(s, *st), s.Volumes, nsFile)
	if err != nil {
		return nil, errdefs.Internal(err, "mount the sandbox's volumes")
	}
	undo.Push(detachVolumes)
	spec, err := d.ociSpec(s, *st, ns, gvisor)
	if err != nil {
		return nil, errdefs.Internal(err, "build runtime spec")
	}
	if s.PrivilegeEscalation && spec.Process.NoNewPrivileges {
		d.log.Debug("the image allows privilege escalation, but not without a user namespace: the sandbox keeps no_new_privs", slog.String("sandbox_id", s.ID))
	}
	spec.Process.Args = append(spec.Process.Args, agentFiles.args...)
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, errdefs.Internal(err, "encode runtime spec")
	}
	if err := os.WriteFile(filepath.Join(s.Dir, "config.json"), b, 0o600); err != nil {
		return nil, errdefs.Internal(err, "write runtime spec")
	}
	sock := d.sockPath(s.ID)
	// A pid file of an earlier start (a cold boot after a filesystem-only
	// pause) names a process that is gone, or by now a stranger's: read
	// before the runtime writes this start's (the agent may answer
	// first), it made the node take its init for dead at once (and never
	// kill the real one).
	pidFile := filepath.Join(s.Dir, "pid")
	if err := os.Remove(pidFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.Internal(err, "remove an earlier start's pid file")
	}
	var cmd *exec.Cmd
	var lf *os.File
	if gvisor {
		// gVisor's own network stack: on the sandbox's veth (egress), or
		// loopback only (see gvisorCaps).
		runArgs := []string{"run", "--pid-file", pidFile, "--bundle", s.Dir, s.ID}
		if s.Network.NetNS != "" {
			if cmd, err = rt.sandboxNetwork(s.Dir, runArgs...); err != nil {
				return nil, errdefs.Internal(err, "prepare gVisor's network")
			}
		} else {
			cmd = rt.command(nil, append([]string{"--network=none"}, runArgs...)...)
		}
		undo.Push(func() { os.Remove(sock) })
	} else {
		if lf, err = listenSocket(sock); err != nil {
			return nil, errdefs.Internal(err, "create agent socket")
		}
		undo.Push(func() { os.Remove(sock) })
		// The runtime outlives this call (and the node): no ctx on the command.
		cmd = rt.command(nil, "run", "--pid-file", pidFile, "--bundle", s.Dir, "--preserve-fds", strconv.Itoa(1+len(agentFiles.files)), s.ID)
		rt.withFiles(cmd, append([]*os.File{lf}, agentFiles.files...)...)
	}
	// The container inherits the runtime's stdio: a file on the host,
	// outside the sandbox's view.
	logPath := filepath.Join(s.Dir, "init.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		if lf != nil {
			lf.Close()
		}
		return nil, errdefs.Internal(err, "create sandbox log")
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // not killed by the node's terminal signals
	t = substrate.Step(ctx, "spec", t)
	startErr := cmd.Start()
	logFile.Close()
	if lf != nil {
		lf.Close() // the agent holds the only copy now
	}
	agentFiles.close()
	if startErr != nil {
		d.log.Warn("start the OCI runtime", slog.String("sandbox_id", s.ID), slog.String("runtime", cmd.Path), slog.Any("error", startErr))
		return nil, errdefs.Internal(startErr, "start the OCI runtime")
	}
	// The runtime lives as long as the sandbox. Waiting for it with
	// cmd.Wait would park an OS thread in waitid per sandbox (5,000
	// sandboxes: 5,000 threads; Go gives up at 10,000) and keep a pidfd
	// open in os.Process besides: the process handle is released (its
	// Pid becomes -1: never use cmd.Process again) and the exit is waited
	// for by one pidfd in Go's poller, then reaped.
	rtProc := proc.Of(cmd.Process.Pid)
	cmd.Process.Release()
	runtimeDone := make(chan struct{})
	var runtimeExit int
	awaitChild(rtProc, runtimeDone, &runtimeExit)
	undo.Push(func() { rt.abandon(s.ID, rtProc, runtimeDone, d.log) })
	failed := func(what string, cause error) error {
		msg, _ := os.ReadFile(logPath)
		if m := runtimeMessage(string(msg)); m != "" {
			return errdefs.Unavailable("%s: %s", what, m).WithCause(cause)
		}
		if outOfSpace(s.Dir) {
			// A runtime that cannot write says nothing either.
			return errdefs.Internal(syscall.ENOSPC, "%s", what)
		}
		return errdefs.Unavailable("%s: the runtime ended without saying why", what).WithCause(cause)
	}
	hctx, cancel := context.WithTimeout(ctx, d.cfg.StartTimeout)
	defer cancel()
	if gvisor {
		if err := gvisorChannel(hctx, st.Jail, sock, runtimeDone); err != nil {
			select {
			case <-runtimeDone:
				return nil, failed("start container", err)
			default:
			}
			if hctx.Err() == nil {
				return nil, errdefs.Internal(err, "open the sandbox's agent channel")
			}
			if err := ctx.Err(); err != nil {
				return nil, errdefs.Classify(err) // the caller went away, not the agent
			}
			return nil, errdefs.Unavailable("sandbox agent did not answer within %s", d.cfg.StartTimeout).WithCause(err)
		}
	}
	helloErr := make(chan error, 1)
	client := guest.NewClient(guest.UnixDialer(sock))
	defer client.Close() // the instance has a client of its own
	go func() { _, err := client.Hello(hctx); helloErr <- err }()
	select {
	case err := <-helloErr:
		if err != nil {
			select {
			case <-runtimeDone:
				return nil, failed("start container", err)
			case <-time.After(100 * time.Millisecond):
			}
			if err := ctx.Err(); err != nil {
				return nil, errdefs.Classify(err) // the caller went away, not the agent
			}
			return nil, errdefs.Unavailable("sandbox agent did not answer within %s", d.cfg.StartTimeout).WithCause(err)
		}
	case <-runtimeDone:
		cancel()
		return nil, failed("start container", fmt.Errorf("runtime exited with status %d", runtimeExit))
	}
	t = substrate.Step(ctx, "runtime", t)
	// The runtime writes the pid file around the time the agent starts;
	// the agent can answer first, by seconds on a loaded host (5,000
	// sandboxes: the runtime copies the node's mount table).
	// The pid file is written by the runtime, not atomically: a pid is
	// taken once it names the runtime's child (gVisor's names its
	// sandbox process, further down its tree).
	isInit := func(pid int) bool { return gvisor || proc.Parent(pid) == rtProc.Pid }
	pid, err := waitPidFile(hctx, pidFile, runtimeDone, isInit)
	if err != nil {
		if err := ctx.Err(); err != nil {
			return nil, errdefs.Classify(err) // the caller went away
		}
		return nil, errdefs.Internal(err, "read container pid")
	}
	st.Pid, st.StartTime = pid, proc.StartTime(pid)
	if st.StartTime == 0 {
		return nil, failed("start container", fmt.Errorf("the container's init (pid %d) is gone", pid))
	}
	detachVolumes() // the sandbox's mount namespace holds its own
	if ns != nil && d.sysResource && !gvisor {
		// Shield the agent (see ociSpec): lowering a score takes
		// CAP_SYS_RESOURCE over the host, which the runtime in the
		// sandbox's user namespace lacks; the node has it. (Under gVisor
		// the pid is the sandbox's kernel, agent and workload at once.)
		os.WriteFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", []byte("-998"), 0)
	}
	st.RuntimePid, st.RuntimeStartTime = rtProc.Pid, rtProc.StartTime
	st.Socket = sock
	if sc := d.seccompFor(s); rt.name == "crun" && sc.bpf() == "" {
		sc.learn(filepath.Join(d.runRoot, s.ID))
	}
	substrate.Step(ctx, "init", t)
	return &booted{done: runtimeDone, exit: &runtimeExit}, nil
}

// Attach implements substrate.Driver.
func (d *Driver) Attach(ctx context.Context, s *substrate.Spec, raw []byte) (substrate.Instance, error) {
	inst, err := d.attach(ctx, s, raw)
	if inst == nil {
		return nil, err
	}
	return inst.outer(), err
}

func (d *Driver) attach(ctx context.Context, s *substrate.Spec, raw []byte) (*instance, error) {
	var st state
	if err := json.Unmarshal(raw, &st); err != nil {
		return nil, errdefs.Internal(err, "decode container state")
	}
	if st.Version > stateVersion {
		return nil, errdefs.Internal(nil, "the sandbox's state is of version %d, written by a newer node; this node knows up to %d", st.Version, stateVersion)
	}
	inst := d.newInstance(s.ID, st)
	if st.HostID != 0 && d.ranges != nil {
		if inst.ownsRange = d.ranges.adopt(st.IDRange, s.ID); !inst.ownsRange {
			d.log.Error("a re-adopted sandbox's id range is another's", slog.String("sandbox_id", s.ID), slog.Int("range", st.IDRange))
		}
	}
	if st.Disk != nil && d.disk != nil {
		d.disk.own(st.Disk)
	}
	inst.spec = s
	if st.Stopped {
		// Stopped before the restart (a filesystem-only pause): it stays
		// stopped until resumed.
		inst.stopped = true
		return inst, nil
	}
	if !inst.alive() {
		return inst, errdefs.Gone("sandbox %s stopped while the node was down", s.ID)
	}
	if st.Disk != nil && d.disk != nil {
		if err := d.disk.adopt(st.Disk); err != nil {
			d.log.Warn("a re-adopted sandbox's file system cannot be mounted again (snapshots of it will fail)", slog.String("sandbox_id", s.ID), slog.Any("error", err))
		}
	}
	if inst.rt == nil {
		return inst, errdefs.Gone("sandbox %s runs under runtime %q, which this node no longer has", s.ID, st.Runtime)
	}
	if inst.rt.gvisor() && inst.rt.paused(s.ID) || !inst.rt.gvisor() && d.cgroups.Frozen(st.Cgroup) {
		// Paused before the restart: its agent cannot answer until resumed.
		inst.paused = true
		inst.watch()
		return inst, nil
	}
	if _, err := inst.client.Hello(ctx); err != nil {
		return inst, errdefs.Gone("sandbox %s agent does not answer after the node restarted", s.ID).WithCause(err)
	}
	inst.watch()
	return inst, nil
}

// Sweep deletes runtime containers in this driver's state root that keep
// is false for: leftovers of sandboxes the node no longer knows.
func (d *Driver) Sweep(keep func(id string) bool) int {
	if !d.caps.Available {
		return 0
	}
	n := 0
	for _, r := range []*ociRuntime{d.oci, d.gvisor} {
		if r == nil {
			continue
		}
		for _, id := range r.containers() {
			if keep(id) {
				continue
			}
			if err := r.forceDelete(id); err != nil {
				d.log.Warn("sweep leftover container", slog.String("sandbox_id", id), slog.Any("error", err))
				continue
			}
			os.Remove(d.sockPath(id))
			n++
		}
	}
	d.sweepJails(keep)
	d.sweepAgentCgroups(keep)
	if d.disk != nil {
		d.disk.sweep()
	}
	if d.ranges != nil {
		d.ranges.sweep(d.userns.pooled)
	}
	return n
}

// hasCapability reports whether the process holds capability c.
func hasCapability(c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && n&(1<<uint(c)) != 0
		}
	}
	return false
}

func runtimeMessage(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > 500 {
		s = s[:500]
	}
	return s
}

// awaitChild reaps child, a child process of the node whose os.Process
// was released, once it exits: its exit status goes to *status (-1 when a
// signal ended it), then done is closed. No thread waits meanwhile: the
// exit is noticed through a pidfd in Go's poller (proc.NotifyExit).
func awaitChild(child proc.ID, done chan struct{}, status *int) {
	exited := make(chan struct{})
	child.NotifyExit(exited)
	go func() {
		<-exited
		var ws unix.WaitStatus
		for {
			_, err := unix.Wait4(child.Pid, &ws, 0, nil)
			if err != unix.EINTR {
				break
			}
		}
		*status = -1
		if ws.Exited() {
			*status = ws.ExitStatus()
		}
		close(done)
	}()
}

// abandon ends the container of a start given up part way, and returns
// once its runtime has exited. The runtime may not have recorded the
// container yet (a loaded host, a caller gone within milliseconds): a
// delete then finds nothing and the runtime goes on to start the
// container, whose agent would hold it (and the create waiting on it) for
// ever. So the delete is repeated until the runtime exits; a runtime that
// has not recorded the container within a minute is killed.
func (r *ociRuntime) abandon(id string, runtime proc.ID, runtimeDone <-chan struct{}, log *slog.Logger) {
	start := time.Now()
	for pause := 20 * time.Millisecond; ; pause = min(2*pause, time.Second) {
		r.forceDelete(id)
		select {
		case <-runtimeDone:
			return
		case <-time.After(pause):
		}
		if time.Since(start) > time.Minute {
			log.Warn("the runtime of an abandoned start did not end: killed", slog.String("sandbox_id", id))
			runtime.Kill()
			<-runtimeDone
			r.forceDelete(id) // what it recorded before it died
			return
		}
	}
}

// waitPidFile reads the runtime's pid file once it is written: until ctx
// (the start deadline) ends or the runtime exits.
func waitPidFile(ctx context.Context, p string, runtimeDone <-chan struct{}, valid func(int) bool) (int, error) {
	pause := time.Millisecond
	for {
		pid, err := readPidFile(p)
		if err == nil && !valid(pid) {
			err = fmt.Errorf("pid file names pid %d, not the container's init", pid)
		}
		if err == nil {
			return pid, nil
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("%w (no pid by the start deadline)", err)
		case <-runtimeDone:
			return 0, fmt.Errorf("%w (the runtime exited)", err)
		case <-time.After(pause):
		}
		pause = min(2*pause, 50*time.Millisecond)
	}
}

func readPidFile(p string) (int, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// outOfSpace reports whether the file system holding dir has (almost) no
// free blocks or inodes left.
func outOfSpace(dir string) bool {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return false
	}
	return st.Bavail*uint64(st.Bsize) < 1<<20 || st.Files > 0 && st.Ffree == 0
}
