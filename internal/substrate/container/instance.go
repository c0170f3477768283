package container

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/loopfs"
	"github.com/opendsec/dsec/internal/substrate"
)

type instance struct {
	d      *Driver
	id     string
	st     state
	rt     *ociRuntime // nil: its runtime is no longer on this node
	client *guest.Client
	done   chan struct{}
	// endedBy is how its workload ended a gVisor sandbox (EndedByTask),
	// found before done is closed.
	endedBy string

	// runtimeDone is closed when the runtime process exits, if this node
	// started it; adopted instances wait for it with a pidfd. runtimeExit
	// is then its exit code.
	runtimeDone chan struct{}
	runtimeExit *int

	// spec is the sandbox's spec, which a cold resume starts it from.
	spec *substrate.Spec

	mu        sync.Mutex
	watching  bool
	destroyed bool
	paused    bool
	// stopped: its container is stopped, its file system kept (Stop).
	stopped bool
	// boots counts the container's starts by this node since Create or
	// Attach: a watcher of an earlier start's init ignores its end.
	boots int
	// ownsRange: Destroy gives the id range back (this node holds it).
	ownsRange bool
}

var (
	_ substrate.Instance    = (*instance)(nil)
	_ substrate.Diagnoser   = (*instance)(nil)
	_ substrate.TaskEnder   = gvisorInstance{}
	_ substrate.Pauser      = (*instance)(nil)
	_ substrate.Stopper     = (*instance)(nil)
	_ substrate.Snapshotter = (*instance)(nil)
)

// gvisorInstance is a sandbox under gVisor: an instance its workload can
// end (substrate.TaskEnder), which one under crun is not.
type gvisorInstance struct{ *instance }

// outer is i as the driver hands it out.
func (i *instance) outer() substrate.Instance {
	if i.st.Runtime == substrate.RuntimeGVisor {
		return gvisorInstance{i}
	}
	return i
}

// inner is the instance behind inst, as the driver handed it out.
func inner(inst substrate.Instance) *instance {
	if g, ok := inst.(gvisorInstance); ok {
		return g.instance
	}
	return inst.(*instance)
}

// EndedByTask implements substrate.TaskEnder: how its workload ended the
// sandbox.
func (i gvisorInstance) EndedByTask() string {
	select {
	case <-i.done:
		return i.endedBy
	default:
		return ""
	}
}

// readEndedBy finds how its workload ended a gVisor sandbox, once its
// init is gone: by a limit, from the sandbox's cgroups (which the node
// made, so runsc leaves them), an OOM kill in them or a fork the pids limit
// refused; else by killing the agent, from runsc's exit code (128 plus the
// signal that ended the container's init), which only a process inside
// the sandbox can send it (the node stops a sandbox by killing runsc's
// sandbox process, and destroys it before that). Known only to the node
// that started runsc (runtimeExit).
func (i *instance) readEndedBy() {
	if i.rt == nil || !i.rt.gvisor() {
		return
	}
	c := i.d.cgroups
	switch {
	case c.OOMKills(i.st.Cgroup) > 0:
		i.endedBy = substrate.EndedByMemoryLimit
		return
	case c.pidsLimitHits(i.st.Cgroup) > 0:
		i.endedBy = substrate.EndedByPidsLimit
		return
	}
	if i.runtimeDone == nil {
		return
	}
	select {
	case <-i.runtimeDone:
	case <-time.After(5 * time.Second):
		return
	}
	i.mu.Lock()
	destroyed := i.destroyed
	i.mu.Unlock()
	if code := i.runtimeExit; code != nil && *code > 128 && *code <= 128+64 && !destroyed {
		sig := syscall.Signal(*code - 128)
		name := strings.TrimPrefix(unix.SignalName(sig), "SIG")
		if name == "" {
			name = strconv.Itoa(int(sig)) // a real-time signal
		}
		i.endedBy = fmt.Sprintf("killed the sandbox's agent (signal %s)", name)
	}
}

// LastWords implements substrate.Diagnoser: the last line the agent (or the
// runtime, for a container that never started) wrote to the init log.
func (i *instance) LastWords() string {
	b, err := readTail(filepath.Join(filepath.Dir(i.st.Rootfs), "init.log"), 2048)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	last := strings.TrimSpace(lines[len(lines)-1])
	last = strings.ReplaceAll(last, filepath.Dir(i.st.Rootfs), "…")
	if len(last) > 300 {
		last = last[:300]
	}
	return last
}

// readTail reads at most the last n bytes of a file.
func readTail(path string, n int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	off := max(st.Size()-n, 0)
	b := make([]byte, st.Size()-off)
	_, err = f.ReadAt(b, off)
	return b, err
}

func (d *Driver) newInstance(id string, st state) *instance {
	rt, _ := d.runtimeOf(st.Runtime)
	return &instance{d: d, id: id, st: st, rt: rt, client: guest.NewClient(guest.UnixDialer(st.Socket)), done: make(chan struct{})}
}

// runtime is the instance's runtime, or an error if this node has none
// of its kind now (runsc removed while the sandbox ran).
func (i *instance) runtime() (*ociRuntime, error) {
	if i.rt == nil {
		return nil, errdefs.Unavailable("sandbox %s runs under runtime %q, which this node no longer has", i.id, i.st.Runtime)
	}
	return i.rt, nil
}

func (i *instance) Guest() substrate.Guest { return i.client }

func (i *instance) State() []byte {
	i.mu.Lock()
	defer i.mu.Unlock()
	b, _ := json.Marshal(i.st)
	return b
}

func (i *instance) Done() <-chan struct{} { return i.done }

// alive reports whether the container's init still runs (and is the same
// process, not a reused pid).
func (i *instance) alive() bool { return i.st.init().Alive() }

// watch closes done when the init of the container's current start
// exits, unless Stop ended it. Called once per start.
func (i *instance) watch() {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.watching {
		return
	}
	i.watching = true
	if i.d.debt != nil {
		i.d.debt.add(i) // a start's cgroup, sampled afresh
	}
	exited := make(chan struct{})
	i.st.init().NotifyExit(exited)
	gvisor := i.rt != nil && i.rt.gvisor()
	boot := i.boots
	go func() {
		<-exited
		i.mu.Lock()
		ended := !i.stopped && i.boots == boot
		if i.boots == boot {
			i.watching = false
		}
		i.mu.Unlock()
		if !ended {
			return // stopped (Stop), or an earlier start
		}
		if gvisor {
			// Under gVisor, which limit ended the sandbox is read from
			// its cgroups before done says it ended.
			i.readEndedBy()
		}
		close(i.done)
	}()
}

func (i *instance) Check(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.checkLocked()
}

// checkLocked is Check for a caller holding i.mu (Pause and Resume, whose
// runtime call failed: the mutex is not reentrant).
func (i *instance) checkLocked() error {
	select {
	case <-i.done:
		return errdefs.Gone("sandbox %s has stopped", i.id)
	default:
	}
	if !i.stopped && !i.alive() {
		return errdefs.Gone("sandbox %s has stopped", i.id)
	}
	return nil
}

// Stats implements substrate.Instance. Under gVisor, Pids counts the
// sandbox's tasks on the host (its kernel's, gvisorTasksPerProcess or so
// per process inside), and no limit hit is counted: reaching one ends the
// sandbox (EndedByLimit).
func (i *instance) Stats(ctx context.Context) (substrate.Stats, error) {
	c := i.d.cgroups
	st := substrate.Stats{
		MemoryBytes:   c.Memory(i.st.Cgroup),
		CPUTime:       c.CPU(i.st.Cgroup),
		Pids:          c.Pids(i.st.Cgroup),
		OOMKills:      c.OOMKills(i.st.Cgroup),
		PidsLimitHits: c.pidsLimitHits(i.st.Cgroup),
	}
	if i.rt != nil && i.rt.gvisor() {
		st.OOMKills, st.PidsLimitHits = 0, 0
	}
	if i.st.Disk != nil {
		st.DiskLimitBytes = i.st.Disk.SizeMB << 20
		st.DiskBytes, _ = i.st.Disk.usage()
	}
	return st, nil
}

func (i *instance) Pause(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.paused {
		return nil
	}
	rt, err := i.runtime()
	if err != nil {
		return err
	}
	if err := rt.run(ctx, "pause", i.id); err != nil {
		if i.checkLocked() != nil {
			return errdefs.Gone("sandbox %s has stopped", i.id)
		}
		return errdefs.Internal(err, "pause sandbox")
	}
	i.paused = true
	i.d.cgroups.Reclaim(i.st.Cgroup)
	return nil
}

// Stop implements substrate.Stopper: it ends the container (its agent and
// every process), which frees its memory and its cgroups, and keeps its
// file system (the overlay, the disk), its user namespace's id range and
// its network. Resume starts it again.
func (i *instance) Stop(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return nil
	}
	rt, err := i.runtime()
	if err != nil {
		return err
	}
	if rt.gvisor() {
		return errdefs.Invalid("sandboxes of runtime gvisor cannot pause without their memory")
	}
	if i.spec == nil {
		return errdefs.Internal(nil, "sandbox %s has no spec to start it again from", i.id)
	}
	if i.paused {
		// Frozen processes cannot receive the kill.
		rt.run(ctx, "resume", i.id)
		i.paused = false
	}
	// Marked first: the watcher must not take the init's end for the
	// sandbox's.
	i.stopped = true
	i.st.Stopped = true
	i.st.init().Kill()
	if !i.waitRuntime(15 * time.Second) {
		i.d.log.Warn("runtime did not finish after the sandbox's init died", slog.String("sandbox_id", i.id))
	}
	if rt.exists(i.id) {
		if err := rt.forceDelete(i.id); err != nil {
			return errdefs.Internal(err, "delete container")
		}
	}
	if i.d.debt != nil {
		i.d.debt.remove(i) // no cgroup to sample until it starts again
	}
	i.d.removeSandboxCgroups(i.id)
	if err := i.d.removeAgentCgroups(i.id); err != nil {
		i.d.log.Warn("remove the agent's cgroups", slog.String("sandbox_id", i.id), slog.Any("error", err))
	}
	os.Remove(i.st.Socket)
	return nil
}

// start starts a stopped container again on its file system: a new
// agent, new processes, a new boot id.
func (i *instance) start(ctx context.Context) error {
	rt, err := i.runtime()
	if err != nil {
		return err
	}
	var ns *userNS
	if i.st.HostID != 0 {
		// The range's mapping again: the layers are id-mapped to it.
		f, err := newUserNamespace(i.st.HostID)
		if err != nil {
			return errdefs.Unavailable("no user namespace for the sandbox: %v", err).WithCause(err)
		}
		defer f.Close() // crun has joined it once boot returns
		ns = &userNS{index: i.st.IDRange, host: i.st.HostID, f: f}
	}
	// A node restarted in another mount namespace lost the sandbox's
	// mounts (its disk, its root, its /sys): mount them again.
	var nsFile *os.File
	if ns != nil {
		nsFile = ns.f
	}
	diskDir := filepath.Dir(i.st.Rootfs)
	if i.st.Disk != nil {
		if i.d.disk == nil {
			return errdefs.Unavailable("sandbox %s has a disk and this node makes none", i.id)
		}
		if !mountedAs(filepath.Join(i.st.Disk.dir, "upper"), unix.EXT4_SUPER_MAGIC) {
			// Through its loop device, or, if that went with the old
			// namespace's last mount, the image attached anew.
			if i.d.disk.adopt(i.st.Disk) != nil {
				if err := loopfs.AttachMount(i.st.Disk.img, i.st.Disk.dir); err != nil {
					return errdefs.Internal(err, "mount the sandbox's disk")
				}
			}
		}
		diskDir = i.st.Disk.dir
	}
	if !mountedAs(i.st.Rootfs, unix.OVERLAYFS_SUPER_MAGIC) {
		if err := i.d.mountRoot(i.spec, diskDir, i.st.Rootfs, nsFile); err != nil {
			return err
		}
	}
	if i.st.Sys != "" && !mountedAs(i.st.Sys, unix.SYSFS_MAGIC) {
		if err := mountSysfs(i.spec.Network.NetNS, i.st.Sys); err != nil {
			return errdefs.Internal(err, "mount the sandbox's /sys")
		}
	}
	// The node's files of the sandbox (/etc/hosts...) again if a
	// restarted node cleared them (else they keep the sandbox's edits).
	if _, err := os.Stat(filepath.Join(i.d.filesOf(i.id), "hosts")); err != nil {
		if err := writeEtc(i.d.filesOf(i.id), i.spec, i.st.HostID); err != nil {
			return errdefs.Internal(err, "write sandbox /etc files")
		}
	}
	// No deadline from the spec, which may have passed: the caller sets
	// the agent's current one once it runs.
	spec := *i.spec
	spec.Deadline = time.Time{}
	st := i.st
	st.Stopped = false
	b, err := i.d.boot(ctx, &spec, &st, ns, rt)
	if err != nil {
		return err
	}
	i.st = st
	i.runtimeDone, i.runtimeExit = b.done, b.exit
	i.stopped = false
	i.boots++
	i.watching = false
	return nil
}

func (i *instance) Resume(ctx context.Context) error {
	i.mu.Lock()
	if i.stopped {
		err := i.start(ctx)
		i.mu.Unlock()
		if err == nil {
			i.watch()
		}
		return err
	}
	defer i.mu.Unlock()
	if !i.paused {
		return nil
	}
	rt, err := i.runtime()
	if err != nil {
		return err
	}
	if err := rt.run(ctx, "resume", i.id); err != nil {
		if i.checkLocked() != nil {
			return errdefs.Gone("sandbox %s has stopped", i.id)
		}
		return errdefs.Internal(err, "resume sandbox")
	}
	i.paused = false
	return nil
}

func (i *instance) Snapshot(ctx context.Context, w io.Writer) error {
	i.mu.Lock()
	wasPaused := i.paused || i.stopped // a stopped container writes nothing
	i.mu.Unlock()
	if !wasPaused && i.rt != nil && i.rt.gvisor() {
		// gVisor's kernel keeps written file data in its own page cache
		// (its root file system is exclusive to it): write it back first.
		if err := i.client.Sync(ctx); err != nil {
			if i.Check(ctx) != nil {
				return errdefs.Gone("sandbox %s has stopped", i.id)
			}
			return errdefs.Internal(err, "sync the sandbox's files")
		}
	}
	if !wasPaused {
		if err := i.Pause(ctx); err != nil {
			return err
		}
		defer i.Resume(context.WithoutCancel(ctx))
	}
	var ids image.IDShift
	if i.st.HostID != 0 {
		ids = image.IDShift{From: i.st.HostID, Size: idRangeSize}
	}
	if err := image.TarOverlayUpper(i.st.upper(), w, ids); err != nil {
		return errdefs.Internal(err, "capture the writable layer")
	}
	return nil
}

func (i *instance) Destroy(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.destroyed {
		return nil
	}
	i.client.Close()
	if i.paused && i.rt != nil {
		// Frozen processes cannot receive the kill.
		i.rt.run(ctx, "resume", i.id)
		i.paused = false
	}
	if i.d.debt != nil {
		i.d.debt.remove(i)
	}
	// Killing the init ends the container's pid namespace, so every
	// process in it; the runtime then removes the cgroup and its state.
	// Without a CPU limit: killed processes that owe CPU debt (cpudebt.go)
	// would otherwise wait to repay it before they can exit.
	i.d.cgroups.liftCPULimit(i.st.Cgroup)
	i.st.init().Kill()
	if !i.waitRuntime(15 * time.Second) {
		i.d.log.Warn("runtime did not finish after the sandbox's init died", slog.String("sandbox_id", i.id))
	}
	// Whatever the runtime could not clean (it was killed, or never ran).
	if i.rt != nil && i.rt.exists(i.id) {
		if err := i.rt.forceDelete(i.id); err != nil {
			return errdefs.Internal(err, "delete container")
		}
	}
	i.d.removeSandboxCgroups(i.id)
	if err := i.d.removeAgentCgroups(i.id); err != nil {
		i.d.log.Warn("remove the agent's cgroups", slog.String("sandbox_id", i.id), slog.Any("error", err))
	}
	if i.st.Jail != "" {
		unmount(filepath.Join(i.st.Jail, "rootfs"))
		os.RemoveAll(i.st.Jail)
	}
	if err := unmount(i.st.Rootfs); err != nil {
		return errdefs.Internal(err, "unmount sandbox root filesystem")
	}
	if i.st.Sys != "" {
		unmount(i.st.Sys)
	}
	if i.st.Disk != nil {
		if i.d.disk == nil {
			i.d.log.Warn("the sandbox's file system stays: this node makes none", slog.String("sandbox_id", i.id))
		} else {
			i.d.disk.release(i.st.Disk)
		}
	}
	if i.ownsRange {
		i.d.ranges.free(i.st.IDRange)
		i.ownsRange = false
	}
	os.Remove(i.st.Socket)
	os.RemoveAll(i.d.filesOf(i.id))
	i.destroyed = true
	return nil
}

// waitRuntime waits for the runtime process to exit.
func (i *instance) waitRuntime(timeout time.Duration) bool {
	if i.runtimeDone != nil {
		select {
		case <-i.runtimeDone:
			return true
		case <-time.After(timeout):
			return false
		}
	}
	return i.st.runtime().Wait(timeout)
}

// mountedAs reports whether path is on a file system of type magic.
func mountedAs(path string, magic int64) bool {
	var fs unix.Statfs_t
	return unix.Statfs(path, &fs) == nil && int64(fs.Type) == magic
}
