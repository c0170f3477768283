package container

import (
	"crypto/rand"
	"fmt"
	"github.com/opendsec/dsec/internal/cgroup"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/substrate"
)

// guestPath is where the agent binary appears inside every container.
const guestPath = "/.dsec/guest"

// sandboxCaps are the capabilities of a sandbox's processes: Docker's
// default set without CAP_NET_RAW. Without it nothing in a sandbox opens a
// raw or packet socket, so nothing forges frames (ARP, MAC or source
// address spoofing on the node's bridge, which also filters them: see
// internal/network). Ping uses ICMP datagram sockets instead, which
// sandboxSysctls open to every group.
var sandboxCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
	"CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// boundingCaps are sandboxCaps and CAP_NET_RAW, in the bounding set only.
// The kernel refuses to execute a file whose capabilities (xattr) are not
// all in the bounding set, and Debian's iputils-ping is installed with
// cap_net_raw+ep: without it there, `ping` would not even start (EPERM).
// It grants nothing: with no_new_privs, which every sandbox but those that
// allow privilege escalation has, an execve never raises the permitted set
// above the caller's, so ping runs without the capability and falls back
// to a datagram socket. Sandboxes without no_new_privs have sandboxCaps
// as their bounding set (see ociSpec).
var boundingCaps = append(append([]string(nil), sandboxCaps...), "CAP_NET_RAW")

// sandboxSysctls are set in the network namespace the runtime makes for
// a sandbox (network none; the node sets the same in egress namespaces).
func sandboxSysctls(userns bool) map[string]string {
	// ICMP echo sockets (SOCK_DGRAM, IPPROTO_ICMP) for every group: ping
	// without CAP_NET_RAW. They send echo requests only; the kernel sets
	// the headers. The range is read in the writer's user namespace, which
	// maps only its range's ids.
	groups := "0 2147483647"
	if userns {
		groups = fmt.Sprintf("0 %d", idRangeSize-1)
	}
	return map[string]string{"net.ipv4.ping_group_range": groups}
}

// maskedPaths hide host information; kpage* are there because reading them
// from a sandbox has crashed hosts (DSec paper §6.4).
var maskedPaths = []string{
	"/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
	"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
	"/proc/kpagecgroup", "/proc/kpagecount", "/proc/kpageflags", "/proc/sysrq-trigger",
	"/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug",
}

// emptyDir is the node's empty, read-only directory (in its files tmpfs)
// that masks directories.
const emptyDir = "empty"

// masks splits maskedPaths for crun and runc: the directories the host's
// kernel has are masked by binding the node's empty directory over them
// read-only; the rest (files, and what this kernel lacks, which the
// runtime skips) go to the runtime, which binds /dev/null over files. The
// runtime would mount a tmpfs over each directory: a file system per
// masked directory per sandbox, and the kernel keeps, for every memory
// cgroup, a slot for every file system's shrinker, so each one costs
// memory in proportion to the number of sandboxes
// (TestASandboxMakesOnlyTheFileSystemsAndMemoryCgroupsItNeeds).
func masks(files string) (mounts []specs.Mount, paths []string) {
	for _, p := range maskedPaths {
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			mounts = append(mounts, specs.Mount{Destination: p, Type: "bind", Source: filepath.Join(files, emptyDir),
				Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
			continue
		}
		paths = append(paths, p)
	}
	return mounts, paths
}

var readonlyPaths = []string{
	"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
}

// ociSpec builds the runtime spec for a sandbox whose init is the agent,
// in user namespace ns (nil: none), for crun or runc, or runsc (gvisor).
func (d *Driver) ociSpec(s *substrate.Spec, st state, ns *userNS, gvisor bool) (*specs.Spec, error) {
	rootfs := st.Rootfs
	caps, bounding, noNewPrivs := privileges(s, ns)
	if gvisor {
		// The agent makes the workloads' pid namespaces (-pid-namespace);
		// they lose CAP_SYS_ADMIN at exec (agent.IsolatePIDs).
		caps, bounding = withCap(caps, "CAP_SYS_ADMIN"), withCap(bounding, "CAP_SYS_ADMIN")
	}
	env := s.Env
	if !hasVar(env, "PATH") {
		env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, env...)
	}
	var oomAdj *int
	if d.sysResource && ns == nil && !gvisor { // in a user namespace the node sets it after the start
		// Shield the agent: a memory bomb kills the bomb, not the sandbox.
		v := -998
		oomAdj = &v
	}
	spec := &specs.Spec{
		Version:  "1.0.2", // the newest version crun 1.8 and runc 1.1 accept
		Hostname: s.Hostname,
		// Relative to the bundle (the sandbox's directory): the runtime
		// resolves it in the sandbox's user namespace, whose root may not
		// search the node's directories.
		Root: &specs.Root{Path: filepath.Base(rootfs), Readonly: s.ReadOnlyRootfs},
		Process: &specs.Process{
			Args: guestArgs(s, gvisor),
			Env:  env,
			Cwd:  "/",
			User: specs.User{UID: 0, GID: 0},
			Capabilities: &specs.LinuxCapabilities{
				Bounding: bounding, Effective: caps, Permitted: caps,
			},
			Rlimits:         []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: d.nofile, Soft: d.nofile}},
			NoNewPrivileges: noNewPrivs,
			OOMScoreAdj:     oomAdj,
		},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: guestPath, Type: "bind", Source: filepath.Join(d.files, "dsec-guest"), Options: []string{"bind", "ro", "nosuid", "nodev"}},
			{Destination: "/etc/hosts", Type: "bind", Source: filepath.Join(d.filesOf(s.ID), "hosts"), Options: []string{"bind", "nosuid", "nodev"}},
			{Destination: "/etc/hostname", Type: "bind", Source: filepath.Join(d.filesOf(s.ID), "hostname"), Options: []string{"bind", "nosuid", "nodev"}},
			{Destination: "/etc/resolv.conf", Type: "bind", Source: filepath.Join(d.filesOf(s.ID), "resolv.conf"), Options: []string{"bind", "nosuid", "nodev"}},
		},
		Linux: &specs.Linux{
			CgroupsPath:   d.cgroupPath(s.ID),
			MaskedPaths:   maskedPaths,
			ReadonlyPaths: readonlyPaths,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
				{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace, Path: s.Network.NetNS},
			},
			Resources: d.resources(s, gvisor),
		},
	}
	if s.Network.NetNS == "" && !gvisor {
		// (gVisor's own stack opens ICMP datagram sockets to every group.)
		spec.Linux.Sysctl = sandboxSysctls(ns != nil)
	}
	switch {
	case ns != nil && gvisor:
		// runsc cannot join a namespace by path: it makes one with the
		// sandbox's range, the same mapping as the node's (which id-maps
		// the layers).
		spec.Linux.Namespaces = append(spec.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
		m := []specs.LinuxIDMapping{{ContainerID: 0, HostID: ns.host, Size: idRangeSize}}
		spec.Linux.UIDMappings, spec.Linux.GIDMappings = m, m
	case ns != nil:
		spec.Linux.Namespaces = append(spec.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace, Path: ns.path()})
	}
	if gvisor {
		// The gofer opens the root file system in the jail, where it may.
		spec.Root.Path = filepath.Join(st.Jail, "rootfs")
		// The agent binds its socket here; the node takes it out (gvisor.go).
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: chanDir, Type: "bind", Source: filepath.Join(st.Jail, "chan"), Options: []string{"bind", "rw", "nosuid", "nodev", "noexec"}})
		// runsc mounts a tmpfs of its kernel's memory over an empty /tmp
		// unless the spec mounts one: /tmp stays on the sandbox's disk,
		// as under crun (counted against disk_mb, in snapshots). Only a
		// directory is bound: a symbolic link there (an image's, or a
		// snapshot's) would be followed on the host.
		if tmp := filepath.Join(st.Jail, "rootfs", "tmp"); isDir(tmp) && !hasMount(s.Tmpfs, "/tmp") {
			spec.Mounts = append(spec.Mounts, specs.Mount{Destination: "/tmp", Type: "bind", Source: tmp, Options: []string{"bind", "rw", "nosuid", "nodev"}})
		}
	}
	if !gvisor {
		// Each start's own boot id (writeBootID): the kernel's is the
		// host's, the same for every sandbox and across their restarts.
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: bootIDPath, Type: "bind", Source: filepath.Join(d.filesOf(s.ID), "boot_id"), Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	if st.Sys != "" {
		for j, m := range spec.Mounts {
			if m.Destination == "/sys" {
				spec.Mounts[j] = specs.Mount{Destination: "/sys", Type: "bind", Source: st.Sys, Options: []string{"bind", "ro", "nosuid", "noexec", "nodev"}}
			}
		}
	}
	if !gvisor { // runsc masks in its own kernel
		spec.Linux.MaskedPaths = d.maskPaths
		spec.Mounts = append(spec.Mounts, d.maskMounts...)
	}
	spec.Mounts = append(spec.Mounts, volumeMounts(volumeDir(s, st), s.Volumes)...)
	for _, t := range s.Tmpfs {
		opts := []string{"nosuid", "nodev"}
		if t.Options != "" {
			opts = append(opts, strings.Split(t.Options, ",")...)
		}
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: t.Path, Type: "tmpfs", Source: "tmpfs", Options: opts})
	}
	if d.cgroups.Mode == cgroup.V2 && !gvisor {
		spec.Linux.Namespaces = append(spec.Linux.Namespaces, specs.LinuxNamespace{Type: specs.CgroupNamespace})
	}
	sc := d.seccompFor(s)
	if bpf := sc.bpf(); bpf != "" && !gvisor {
		// crun loads this precompiled filter instead of compiling the
		// profile, which costs ~25 ms of CPU per sandbox.
		spec.Annotations = map[string]string{"run.oci.seccomp_bpf_data": bpf}
	} else if gvisor {
		spec.Linux.Seccomp = pidNamespacesSeccomp(sc.profile)
	} else {
		spec.Linux.Seccomp = sc.profile
	}
	return spec, nil
}

// privileges are the capabilities of the sandbox's root (caps: effective
// and permitted), its bounding set, and whether no_new_privs is set, for
// s's sandbox in user namespace ns (nil: none).
//
// A sandbox runs without no_new_privs, so that its processes may gain
// privileges at exec (sudo, setuid binaries, file capabilities), only when
// its spec allows privilege escalation and it has a user namespace (none
// with HostRoot), whose root holds capabilities over the sandbox's own
// namespaces only: a process that gains root gains that and nothing more.
// Its bounding set is then root's capabilities exactly, since an exec as
// root (a setuid binary's too) gets the whole bounding set: CAP_NET_RAW
// leaves it (a file that needs it, such as a ping installed with
// cap_net_raw+ep, then does not execute). Function workers
// (MountNamespaces), whose root holds CAP_SYS_ADMIN, always keep
// no_new_privs.
func privileges(s *substrate.Spec, ns *userNS) (caps, bounding []string, noNewPrivs bool) {
	caps = append([]string(nil), sandboxCaps...)
	bounding = append([]string(nil), boundingCaps...)
	if s.MountNamespaces {
		// Function workers' root processes make calls' private mounts.
		caps = append(caps, "CAP_SYS_ADMIN")
		bounding = append(bounding, "CAP_SYS_ADMIN")
		return caps, bounding, true
	}
	if s.PrivilegeEscalation && ns != nil {
		return caps, append([]string(nil), caps...), false
	}
	return caps, bounding, true
}

// seccompFor is the profile of s's sandbox.
func (d *Driver) seccompFor(s *substrate.Spec) *seccompCache {
	if s.MountNamespaces {
		return d.seccompMounts
	}
	return d.seccomp
}

// defaultSeccomp is Docker's default profile for the sandbox's
// capabilities (those its processes can use).
func defaultSeccomp() (*specs.LinuxSeccomp, error) {
	return seccomp.GetDefaultProfile(&specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{
		Bounding: sandboxCaps, Effective: sandboxCaps, Permitted: sandboxCaps,
	}}})
}

// mountsSeccomp is the default profile (of the default capabilities, not of
// CAP_SYS_ADMIN, which would also open user namespaces, bpf and more) plus
// what MountNamespaces needs: unshare and setns of a mount namespace alone,
// mount and umount2. Each still needs CAP_SYS_ADMIN, which only the
// sandbox's root processes hold.
func mountsSeccomp() (*specs.LinuxSeccomp, error) {
	p, err := defaultSeccomp()
	if err != nil {
		return nil, err
	}
	p.Syscalls = append(p.Syscalls,
		specs.LinuxSyscall{Names: []string{"mount", "umount2"}, Action: specs.ActAllow},
		specs.LinuxSyscall{Names: []string{"unshare"}, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: unix.CLONE_NEWNS, Op: specs.OpEqualTo}}},
		specs.LinuxSyscall{Names: []string{"setns"}, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 1, Value: unix.CLONE_NEWNS, Op: specs.OpEqualTo}}},
	)
	return p, nil
}

// pidNamespacesSeccomp is p plus what the agent needs under gVisor to make
// the workloads' pid namespaces (agent.IsolatePIDs): unshare of a pid
// namespace alone (its forker), mount and umount2 (the namespace's init,
// for its /proc). Each needs CAP_SYS_ADMIN, which the agent holds and the
// workloads do not: the forker drops it from their bounding set.
func pidNamespacesSeccomp(p *specs.LinuxSeccomp) *specs.LinuxSeccomp {
	q := *p
	q.Syscalls = append(append([]specs.LinuxSyscall(nil), p.Syscalls...),
		specs.LinuxSyscall{Names: []string{"mount", "umount2"}, Action: specs.ActAllow},
		specs.LinuxSyscall{Names: []string{"unshare"}, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: unix.CLONE_NEWPID, Op: specs.OpEqualTo}}},
	)
	return &q
}

// withCap is caps with c.
func withCap(caps []string, c string) []string {
	for _, x := range caps {
		if x == c {
			return caps
		}
	}
	return append(append([]string(nil), caps...), c)
}

// resources are a sandbox's cgroup limits. Under gVisor the pids limit
// counts the host tasks of the sandbox's kernel: gvisorTasksPerProcess per
// process inside.
func (d *Driver) resources(s *substrate.Spec, gvisor bool) *specs.LinuxResources {
	r := &specs.LinuxResources{
		Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
	}
	for _, dev := range []struct {
		major, minor int64
	}{{1, 3}, {1, 5}, {1, 7}, {1, 8}, {1, 9}, {5, 0}, {5, 1}, {5, 2}, {136, -1}} {
		dev := dev
		major := dev.major
		var minor *int64
		if dev.minor >= 0 {
			minor = &dev.minor
		}
		r.Devices = append(r.Devices, specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &major, Minor: minor, Access: "rwm"})
	}
	if s.MemoryMB > 0 {
		limit := s.MemoryMB << 20
		r.Memory = &specs.LinuxMemory{Limit: &limit}
		if d.cgroups.SwapAccounting {
			r.Memory.Swap = &limit // no swap beyond the limit
		}
	}
	if s.CPU > 0 {
		period := uint64(100000)
		quota := int64(s.CPU * float64(period))
		shares := uint64(s.CPU * 1024)
		r.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota, Shares: &shares}
	}
	if s.Pids > 0 {
		r.Pids = &specs.LinuxPids{Limit: s.Pids}
		if gvisor {
			r.Pids.Limit = s.Pids*gvisorTasksPerProcess + gvisorBaseTasks
		}
	}
	return r
}

// writeEtc writes the files bind-mounted over /etc/hosts, /etc/hostname and
// /etc/resolv.conf into dir, owned by host id host (root inside).
func writeEtc(dir string, s *substrate.Spec, owner uint32) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	host := s.Hostname
	hosts := "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t" + host + "\n"
	if len(s.Hosts) > 0 {
		hosts += "127.0.0.1\t" + strings.Join(s.Hosts, " ") + "\n"
	}
	files := map[string]string{
		"hosts":       hosts,
		"hostname":    host + "\n",
		"resolv.conf": s.Network.ResolvConf,
	}
	for name, content := range files {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return err
		}
		if owner != 0 {
			if err := os.Chown(p, int(owner), int(owner)); err != nil {
				return err
			}
		}
	}
	return nil
}

func itoa(n int) string { return strconv.Itoa(n) }

// hasVar reports whether env sets name.
func hasVar(env []string, name string) bool {
	for _, e := range env {
		if strings.HasPrefix(e, name+"=") {
			return true
		}
	}
	return false
}

// guestArgs is the agent's command line: it serves on its inherited
// socket, or under gVisor on one it binds in the channel directory, and
// there gives up its stdio once listening (gVisor's /proc lets any process
// of the sandbox open /proc/1/fd/1, which would be the node's log file)
// and starts every process in a pid namespace of the workloads', where no
// process can name it (agent.IsolatePIDs).
func guestArgs(s *substrate.Spec, gvisor bool) []string {
	args := []string{guestPath, "-listen-fd", "3"}
	if gvisor {
		args = []string{guestPath, "-listen", chanDir + "/sock", "-null-stdio", "-pid-namespace"}
	}
	if !s.Deadline.IsZero() {
		args = append(args, "-deadline", strconv.FormatInt(s.Deadline.Unix(), 10))
	}
	return args
}

// isDir reports whether p is a directory, not following a final symbolic
// link.
func isDir(p string) bool {
	st, err := os.Lstat(p)
	return err == nil && st.IsDir()
}

func hasMount(t []substrate.Tmpfs, path string) bool {
	for _, m := range t {
		if filepath.Clean(m.Path) == path {
			return true
		}
	}
	return false
}

// bootIDPath is the kernel's boot id as a sandbox reads it.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// writeBootID writes a fresh random boot id (a UUID, as the kernel's) to
// dir/boot_id, which the container's start binds over bootIDPath: the
// sandbox's boot identity, new at every start of its container (its
// create and every cold resume), the same across a pause that keeps
// memory.
func writeBootID(dir string) error {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	id := fmt.Sprintf("%x-%x-%x-%x-%x\n", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
	tmp := filepath.Join(dir, "boot_id.tmp")
	if err := os.WriteFile(tmp, []byte(id), 0o444); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, "boot_id"))
}
