package container

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/substrate"
)

// gVisor.
//
// A sandbox with Spec.Runtime "gvisor" runs under runsc: its processes
// make their system calls to gVisor's application kernel (the Sentry, one
// unprivileged host process per sandbox, itself under a seccomp filter),
// and its files are served by a gofer process. Everything else is as for
// crun: the same bundle (the overlay root, the user namespace's id range,
// the sandbox's disk, cgroups), the same agent as PID 1, the same guest
// protocol. What differs:
//
//   - The agent channel. runsc passes no descriptors to the container, so
//     the agent cannot inherit its listening socket. It binds one instead
//     at /.dsec/chan/sock, a directory bind-mounted from the sandbox's jail
//     on the host (jailOf; runsc --host-uds=create lets the gofer make the
//     host socket). As soon as the agent listens the node links it under another
//     name outside the sandbox (agent.sock, which the node dials through a
//     symbolic link in its socket directory, as for crun), removes the name
//     inside and the directory itself: nothing in the sandbox can reach the
//     socket or create anything in the dead directory, which stays mounted
//     and empty. (Under runsc a process inside may not connect to a host
//     socket anyway: --host-uds=create does not allow open.) No workload
//     process exists before the node's first call.
//   - The jail. The gofer opens the root file system and the channel
//     directory as the range's root, which may not search the node's data
//     directory: both are in a directory of the run directory that only
//     the range's group may search (jailOf).
//   - No descriptors at all: the agent has no cgroups of its own (gVisor's
//     kernel schedules the agent and the workload in one host process) and
//     no spool directory (output tails stay in its memory, as in VMs).
//   - Limits. gVisor (this release) has no OOM killer and no process limit
//     inside: the host's memory and pids cgroups bound the whole sandbox,
//     kernel included, and a workload that reaches either ends the sandbox
//     (the node reports it as the task's end, not the platform's). The pids
//     limit counts host tasks: gvisorTasksPerProcess per process inside.
//   - Network: gVisor's own network stack, never the host kernel's.
//     Network none is loopback only (runsc --network=none); egress joins
//     the sandbox's network namespace on the node's bridge and takes over
//     its veth (--network=sandbox), so the node's rules, resolver and
//     proxy see the sandbox's traffic as a crun sandbox's. This release
//     refuses a namespace that has /proc/sys/net/core/rmem_default
//     (every one on this kernel: it takes them for the host's), so runsc
//     is started where /proc/sys hides it (sandboxNetwork); the host's
//     stack (--network=host) is not used: in a user namespace it fails to
//     set up its chroot, and it would expose the host kernel's.
//   - User namespace: runsc cannot join one by path, so the spec asks for
//     a new one with the sandbox's range mapping; the node's namespace
//     (from its pool) still id-maps the image's layers. The gofer runs in
//     it, so what the sandbox writes is owned by its range on the host, as
//     with crun. The Sentry runs as nobody in a user namespace of its own.
//   - Seccomp: gVisor applies the sandbox's profile inside its kernel
//     (--oci-seccomp); no precompiled program. Masked /proc paths do not
//     exist in gVisor's /proc.
//   - Pause is `runsc pause` (the Sentry stops its tasks), not the cgroup
//     freezer. Memory snapshots (runsc checkpoint) are not offered.
//   - The agent's reach. gVisor's kernel does not shield a pid namespace's
//     init from its namespace (a TODO in its signal code) and checks no
//     ptrace access on /proc/<pid>/fd, environ or maps. So the agent gives
//     up its stdio once listening (-null-stdio: else /proc/1/fd/1 is the
//     node's log file, writable from inside), catches every signal Linux
//     would drop for an init (no-op handlers), and starts every workload in
//     a pid namespace of the workloads' under a small init
//     (-pid-namespace, agent.IsolatePIDs), so no workload can name it: for
//     that the agent holds CAP_SYS_ADMIN and may unshare a pid namespace,
//     mount and umount2 (pidNamespacesSeccomp); its workloads lose the
//     capability. A runsc exit of 128 + a signal (a SIGKILL of the
//     sandbox's kernel process on the host) still ends the sandbox as the
//     task's end (EndedByTask). A timed-out command's processes are killed
//     by walking its tree (no exec cgroups to kill instead).

const (
	// gvisorTasksPerProcess is what one process inside a gVisor sandbox
	// costs in host tasks on the ptrace platform (the Sentry's thread and
	// the stub that runs it; measured ~6 on this host), so that
	// resources.pids processes fit under the host's pids limit.
	gvisorTasksPerProcess = 8
	// gvisorBaseTasks are the Sentry's and gofer's own host tasks
	// (26 idle here).
	gvisorBaseTasks = 64
	// chanDir is where a gVisor sandbox's agent binds its socket.
	chanDir = "/.dsec/chan"
)

// ociRuntime is an OCI runtime the driver runs sandboxes with.
type ociRuntime struct {
	name    string // "crun", "runc" or "runsc"
	path    string // absolute
	version string
	root    string // its state directory (--root)
	// flags come before every subcommand (runsc's configuration).
	flags []string
	// netMask runs `runsc run` for a sandbox with egress (see
	// sandboxNetwork); "" where it cannot (egressReason says why).
	netMask, egressReason string
	// exe is the runtime's binary as a sealed memfd (sealExe), run in
	// place of path; nil: path is run.
	exe *os.File
}

// gvisor reports whether r is runsc.
func (r *ociRuntime) gvisor() bool { return r.name == "runsc" }

// command runs the runtime with its state root and flags (from its
// sealed copy, if it has one: see withFiles).
func (r *ociRuntime) command(ctx context.Context, args ...string) *exec.Cmd {
	all := append(append([]string{"--root", r.root}, r.flags...), args...)
	var cmd *exec.Cmd
	if ctx == nil {
		cmd = exec.Command(r.path, all...)
	} else {
		cmd = exec.CommandContext(ctx, r.path, all...)
	}
	return r.withFiles(cmd)
}

// withFiles sets cmd's extra files (descriptors 3, 4, ... of the
// runtime) and, for a runtime with a sealed copy, passes the copy after
// them and executes it there.
//
// The copy is executed through the child's own descriptor, at a place
// os/exec assigns: a descriptor number of the node's own, named in the
// path, is not safe. Go's child moves its error pipe (and any extra file
// it must shuffle) to one above the highest descriptor it was given, which
// can be exactly the node's (golang/go#61751): found here as EACCES, about
// one start in 2,000 under 100 concurrent creates, the exec opening the
// pipe. crun closes every descriptor past those --preserve-fds passes on
// before the container's process starts, so the sandbox never holds it.
func (r *ociRuntime) withFiles(cmd *exec.Cmd, files ...*os.File) *exec.Cmd {
	cmd.ExtraFiles = files
	if r.exe == nil {
		return cmd
	}
	cmd.ExtraFiles = append(cmd.ExtraFiles, r.exe)
	cmd.Path = "/proc/self/fd/" + strconv.Itoa(2+len(cmd.ExtraFiles))
	cmd.Args[0] = r.path // what ps shows
	return cmd
}

// sealExe makes the runtime run from a sealed copy of its binary.
//
// crun (as runc) guards the host's runtime binary against a container
// that would overwrite it through /proc/self/exe (CVE-2019-5736): unless
// it already runs from a sealed memfd, every run copies itself (a
// read-only bind mount of itself in a mount namespace of its own) and
// executes itself again, loading its dozen shared libraries twice. Run
// from the node's own sealed memfd (no writes, no size change, no further
// seals: what crun checks for), it executes once, with the same
// guarantee: the binary a container could reach cannot be written (and
// the node holds no writable descriptor of it either).
// Measured: docs/performance.md.
func (r *ociRuntime) sealExe() error {
	src, err := os.Open(r.path)
	if err != nil {
		return err
	}
	defer src.Close()
	// Only a binary: a script run from a close-on-exec descriptor cannot
	// be opened by its interpreter (a wrapper around the runtime stays
	// on its path).
	magic := make([]byte, 4)
	if _, err := io.ReadFull(src, magic); err != nil || string(magic) != "\x7fELF" {
		return nil
	}
	if _, err := src.Seek(0, io.SeekStart); err != nil {
		return err
	}
	fd, err := unix.MemfdCreate(r.name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), r.name)
	if _, err := io.Copy(f, src); err != nil {
		f.Close()
		return err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE); err != nil {
		f.Close()
		return err
	}
	// Held through a read-only descriptor only: the writable one
	// memfd_create returned is closed, so no open of the file for
	// writing exists when a start executes it (ETXTBSY).
	ro, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(fd), os.O_RDONLY, 0)
	f.Close()
	if err != nil {
		return err
	}
	r.exe = ro
	return nil
}

// sandboxNetwork makes `runsc run` with args (in bundle dir) join the
// sandbox's network namespace (the spec's) with gVisor's own network stack
// on its interface (--network=sandbox): the Sentry takes over the veth
// and its address, so the node's rules on the bridge apply to everything
// the sandbox sends, as for crun.
//
// This release refuses that in any namespace where
// /proc/sys/net/core/rmem_default exists, taking it for the host's (every
// namespace has one on this kernel). So runsc runs in a mount namespace of
// its own where /proc/sys is a tmpfs holding only kernel, vm and fs (bound
// from a second procfs): it finds no net/core there. The second procfs
// mount, with nothing over it, is what lets the sandbox's user namespace
// mount a procfs of its own (the kernel allows that only where a procfs
// is fully visible). The mounts live and die with runsc's namespace:
// nothing on the node changes.
func (r *ociRuntime) sandboxNetwork(dir string, args ...string) (*exec.Cmd, error) {
	proc := filepath.Join(dir, "runsc-proc")
	if err := os.MkdirAll(proc, 0o700); err != nil {
		return nil, err
	}
	const script = `set -e
p=$1; shift
mount -t proc proc "$p"
mount -t tmpfs -o mode=0555,nosuid,nodev,noexec dsec-sysctl-mask /proc/sys
for d in kernel vm fs; do mkdir /proc/sys/$d; mount --bind "$p/sys/$d" /proc/sys/$d; done
exec "$@"`
	runsc := r.command(nil, append([]string{"--network=sandbox"}, args...)...).Args
	return exec.Command(r.netMask, append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "dsec-runsc-netns", proc}, runsc...)...), nil
}

// run runs the runtime and turns a failure into an error carrying its
// stderr.
func (r *ociRuntime) run(ctx context.Context, args ...string) error {
	cmd := r.command(ctx, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", r.name, args[0], err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// forceDelete kills and deletes a container; a missing one is fine.
func (r *ociRuntime) forceDelete(id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := r.run(ctx, "delete", "--force", id)
	if err != nil && (strings.Contains(err.Error(), "does not exist") || strings.Contains(err.Error(), "not found") || strings.Contains(err.Error(), "No such file")) {
		return nil
	}
	return err
}

// containers lists the IDs of the containers in the runtime's state
// directory.
func (r *ociRuntime) containers() []string {
	if r.gvisor() {
		// runsc keeps a state file per container, not a directory.
		out, err := r.command(nil, "list", "-quiet").Output()
		if err != nil {
			return nil
		}
		return strings.Fields(string(out))
	}
	ents, err := os.ReadDir(r.root)
	if err != nil {
		return nil
	}
	var ids []string
	for _, e := range ents {
		if e.IsDir() {
			ids = append(ids, e.Name())
		}
	}
	return ids
}

// exists reports whether the runtime still has state for container id.
func (r *ociRuntime) exists(id string) bool {
	if r.gvisor() {
		return r.command(nil, "state", id).Run() == nil
	}
	_, err := os.Stat(filepath.Join(r.root, id))
	return err == nil
}

// paused reports whether runsc holds container id paused.
func (r *ociRuntime) paused(id string) bool {
	out, err := r.command(nil, "state", id).Output()
	return err == nil && bytes.Contains(out, []byte(`"status": "paused"`))
}

// probeGVisor finds runsc (cfg.GVisor: "" for runsc on PATH, a path, or
// "off") and checks that it starts a sandbox here. It returns the runtime,
// or why there is none.
func (d *Driver) probeGVisor() (*ociRuntime, string) {
	bin := d.cfg.GVisor
	switch bin {
	case "off":
		return nil, "turned off (container.gvisor: off)"
	case "":
		bin = "runsc"
	}
	p, err := exec.LookPath(bin)
	if err != nil {
		return nil, "runsc not installed (apt-get install runsc)"
	}
	out, err := exec.Command(p, "--version").Output()
	if err != nil {
		return nil, "runsc does not run: " + err.Error()
	}
	r := &ociRuntime{name: "runsc", path: p, root: filepath.Join(d.cfg.RunDir, "runsc")}
	if f := strings.Fields(string(out)); len(f) >= 3 {
		r.version = f[2]
	}
	platform := d.cfg.GVisorPlatform
	if platform == "" {
		platform = "ptrace"
	}
	r.flags = []string{"--platform=" + platform, "--host-uds=create", "--oci-seccomp", "--overlay2=none"}
	r.netMask, r.egressReason = "", "needs unshare, mount and sh (util-linux, dash) to start runsc with the sandbox's network"
	if p, err := exec.LookPath("unshare"); err == nil {
		if _, err := exec.LookPath("mount"); err == nil {
			if _, err := exec.LookPath("sh"); err == nil {
				r.netMask, r.egressReason = p, ""
			}
		}
	}
	if err := os.MkdirAll(r.root, 0o700); err != nil {
		return nil, err.Error()
	}
	// The gofer, in the sandbox's user namespace, opens the bind mounts'
	// sources (the agent binary, the /etc files) under the files
	// directory, and the sandbox's jail: they must be searchable. The
	// files directory is a tmpfs of the node's mount namespace: no other
	// host process sees it.
	if err := os.MkdirAll(filepath.Join(d.cfg.RunDir, "gvisor"), 0o711); err != nil {
		return nil, err.Error()
	}
	if !d.cfg.HostRoot {
		for _, dir := range []string{d.files, filepath.Join(d.cfg.RunDir, "gvisor")} {
			if err := d.searchable(dir); err != nil {
				return nil, err.Error()
			}
		}
	}
	if why := d.tryGVisor(r); why != "" {
		return nil, why
	}
	return r, ""
}

// tryGVisor starts a sandbox that runs `true` under r, to find out at
// start whether runsc works on this host (platform, kernel, cgroups).
func (d *Driver) tryGVisor(r *ociRuntime) string {
	dir, err := os.MkdirTemp(d.cfg.StateDir, "probe-gvisor-")
	if err != nil {
		return err.Error()
	}
	defer os.RemoveAll(dir)
	root := filepath.Join(dir, "rootfs")
	for _, sub := range []string{"proc", "sys", "dev", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, sub), 0o755); err != nil {
			return err.Error()
		}
	}
	// The agent binary is static: `dsec-guest -version` is the probe.
	if err := copyFile(d.guestBin, filepath.Join(root, "guest"), 0o555); err != nil {
		return err.Error()
	}
	spec := fmt.Sprintf(`{"ociVersion":"1.0.2","process":{"args":["/guest","-version"],"cwd":"/","user":{"uid":0,"gid":0},"env":["PATH=/"]},`+
		`"root":{"path":"rootfs","readonly":true},"linux":{"namespaces":[{"type":"pid"},{"type":"network"},{"type":"ipc"},{"type":"uts"},{"type":"mount"}],`+
		`"cgroupsPath":%q}}`, d.cgroupPath("probe-gvisor-"+strconv.Itoa(os.Getpid())))
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(spec), 0o600); err != nil {
		return err.Error()
	}
	// A sandbox starts in about a second here; a platform that cannot run
	// (kvm without nested virtualisation) hangs instead of failing.
	const limit = 30 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	id := "probe-gvisor-" + strconv.Itoa(os.Getpid())
	cmd := r.command(ctx, "--network=none", "run", "--bundle", dir, id)
	out, err := cmd.CombinedOutput()
	if err != nil {
		r.forceDelete(id)
		if ctx.Err() != nil {
			return fmt.Sprintf("runsc %s (%s) did not start a sandbox within %s here", r.version, r.flags[0], limit)
		}
		msg := strings.TrimSpace(string(out))
		if len(msg) > 300 {
			msg = msg[len(msg)-300:]
		}
		return fmt.Sprintf("runsc %s (%s) cannot start a sandbox here: %v: %s", r.version, r.flags[0], err, msg)
	}
	return ""
}

func copyFile(src, dst string, mode os.FileMode) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, mode)
}

// gvisorCaps is what sandboxes under gVisor can do.
func (d *Driver) gvisorCaps(r *ociRuntime, reason string) substrate.Runtime {
	rt := substrate.Runtime{Name: substrate.RuntimeGVisor, Available: r != nil, Reason: reason}
	if r == nil {
		return rt
	}
	// No memory snapshots; egress where runsc can be started in the
	// sandbox's network namespace (sandboxNetwork).
	rt.Caps = []substrate.Capability{substrate.CapExec, substrate.CapPTY, substrate.CapFiles, substrate.CapPause, substrate.CapSnapshot, substrate.CapFork, substrate.CapVolumes}
	network := "none or egress: gVisor's own network stack, on the sandbox's veth under the node's rules (egress), or loopback only (none)"
	if r.netMask != "" {
		rt.Caps = append(rt.Caps, substrate.CapNetworkEgress)
	} else {
		network = "none only (gVisor's own stack, loopback only): egress " + r.egressReason
	}
	rt.Details = map[string]string{
		"runtime":  "runsc " + r.version + " (" + strings.TrimPrefix(r.flags[0], "--") + ")",
		"kernel":   "gVisor's application kernel: system calls never reach the host's",
		"limits":   "memory and pids bound the whole sandbox, its kernel and agent included: a workload that reaches either ends the sandbox (reported as the task's end)",
		"network":  network,
		"snapshot": "layer snapshots; no memory snapshots",
		"agent":    "weaker than under crun: gVisor's kernel does not shield the sandbox's init (a process can kill or stop the agent: a kill ends the sandbox, reported as the task's end) nor check ptrace access on /proc/1/fd (a process can write into another command's output); see docs/substrates/container.md",
	}
	return rt
}

// searchable lets every user search dir and its parents (o+x), as the
// gofers of gVisor sandboxes, in their user namespaces, must to reach
// their jails. Each change is logged.
func (d *Driver) searchable(dir string) error {
	for p := dir; ; p = filepath.Dir(p) {
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		if st.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(p, st.Mode().Perm()|0o011); err != nil {
				return err
			}
			d.log.Info("made a directory searchable for gVisor's gofers", slog.String("dir", p))
		}
		if p == filepath.Dir(p) {
			return nil
		}
	}
}

// gvisorChannel waits for the agent of a gVisor sandbox to listen on its
// socket in the sandbox's channel directory (jail/chan), then takes it out
// of the sandbox's reach: it links the socket as jail/agent.sock, removes
// its name inside and the directory, and points link (the node's socket
// path) at it. It gives up when done is closed (the runtime exited) or ctx
// ends.
//
// It waits for the listen, not for the socket's file: the gofer makes the
// file during the agent's bind, and gVisor looks the name up again before
// the bind returns, which fails if the name is gone by then.
func gvisorChannel(ctx context.Context, dir, link string, done <-chan struct{}) error {
	chan_ := filepath.Join(dir, "chan")
	inside := filepath.Join(chan_, "sock")
	for {
		if c, err := net.Dial("unix", inside); err == nil {
			c.Close() // the agent reads an end of file and goes on
			break
		}
		select {
		case <-done:
			return errors.New("the runtime exited before the agent listened")
		case <-ctx.Done():
			return fmt.Errorf("the agent did not listen: %w", ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
	sock := filepath.Join(dir, "agent.sock")
	os.Remove(sock)
	if err := os.Link(inside, sock); err != nil {
		return fmt.Errorf("link the agent's socket: %w", err)
	}
	if err := os.Remove(inside); err != nil {
		return fmt.Errorf("remove the agent's socket from the sandbox: %w", err)
	}
	// A removed directory takes no new entries, whoever asks (the gofer
	// may be host root, with host_root): the mount inside stays, dead.
	if err := os.Remove(chan_); err != nil {
		return fmt.Errorf("remove the agent's channel directory: %w", err)
	}
	os.Remove(link)
	if err := os.Symlink(sock, link); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("link the agent's socket: %w", err)
	}
	return nil
}

// prepareGVisor makes what a gVisor sandbox needs on the host besides its
// bundle: its jail (see jailOf) with the root file system bind-mounted in
// and the channel directory, and the sandbox's memory and pids cgroups with
// their limits. The node makes those so that runsc leaves them for
// EndedByLimit: it removes only the cgroups it made, and it configures
// only those too (the node sets these limits itself). undo removes them;
// on error nothing is left.
func (d *Driver) prepareGVisor(s *substrate.Spec, rootfs string, host uint32) (jail string, undo func(), err error) {
	id := s.ID
	jail = d.jailOf(id)
	dir := jail       // an error return sets jail to ""
	var made []string // cgroup directories, in creation order
	remove := func() {
		unmount(filepath.Join(dir, "rootfs"))
		os.RemoveAll(dir)
		removeDirs(made)
	}
	undo = remove
	defer func() {
		// Not undo: an error return has set it to nil.
		if err != nil {
			remove()
		}
	}()
	// Only the sandbox's gofer (its root's group) and the node get in.
	if err := os.Mkdir(jail, 0o710); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", nil, err
	}
	if err := os.Chown(jail, 0, int(host)); err != nil {
		return "", nil, err
	}
	if err := os.Mkdir(filepath.Join(jail, "rootfs"), 0o755); err != nil {
		return "", nil, err
	}
	if err := unix.Mount(rootfs, filepath.Join(jail, "rootfs"), "", unix.MS_BIND, ""); err != nil {
		return "", nil, fmt.Errorf("bind the root file system into the jail: %w", err)
	}
	ch := filepath.Join(jail, "chan")
	if err := os.Mkdir(ch, 0o700); err != nil {
		return "", nil, err
	}
	if err := os.Chown(ch, int(host), int(host)); err != nil {
		return "", nil, err
	}
	dirs, err := d.cgroups.Make(d.cgroupPath(id), d.resources(s, true))
	made = append(made, dirs...)
	if err != nil {
		return "", nil, err
	}
	return jail, undo, nil
}

// jailOf is a gVisor sandbox's jail: a directory of the node's run
// directory holding what runsc's gofer opens in the sandbox's user
// namespace, as the range's root (an unprivileged host user), without
// having to search the node's data directory: the root file system
// (bind-mounted) and the agent's channel directory. Its group is the
// range's and only its group may search it; the run directory and its
// parents are searchable by all (probeGVisor), and hold nothing else a
// host user could open by name.
func (d *Driver) jailOf(id string) string { return filepath.Join(d.cfg.RunDir, "gvisor", id) }

// removeDirs removes empty directories, last first.
func removeDirs(dirs []string) {
	for i := len(dirs) - 1; i >= 0; i-- {
		os.Remove(dirs[i])
	}
}

// sweepJails removes the jails of sandboxes keep is false for.
func (d *Driver) sweepJails(keep func(id string) bool) {
	ents, _ := os.ReadDir(filepath.Join(d.cfg.RunDir, "gvisor"))
	for _, e := range ents {
		if e.IsDir() && !keep(e.Name()) {
			unmount(filepath.Join(d.jailOf(e.Name()), "rootfs"))
			os.RemoveAll(d.jailOf(e.Name()))
		}
	}
}
