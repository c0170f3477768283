// Command dsec-guest is the agent inside every dsec sandbox. The node starts
// it as the sandbox's init with a listening socket (containers) or a
// virtio-serial port or vsock port (VMs); see internal/guest/agent.
//
// `dsec-guest identity` is run by the node inside a VM restored from a
// memory snapshot, to give it its own hostname, clock, randomness and (in
// a full VM) machine ID.
package main

import (
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest"
	"github.com/opendsec/dsec/internal/guest/agent"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "identity" {
		identity(os.Args[2:])
		return
	}
	if len(os.Args) > 1 && os.Args[1] == agent.PIDNamespaceInitArg {
		agent.PIDNamespaceInit()
		return
	}
	listenFD := flag.Int("listen-fd", -1, "serve on this inherited listening socket")
	listen := flag.String("listen", "", "serve on this unix socket path (gVisor sandboxes, tests and debugging)")
	port := flag.String("listen-port", "", "serve on the virtio-serial port with this name (VMs)")
	vsock := flag.Uint("listen-vsock", 0, "serve on this AF_VSOCK port (VMs on hosts with vhost-vsock)")
	version := flag.Bool("version", false, "print the protocol version and exit")
	deadline := flag.Int64("deadline", 0, "unix time (seconds) at which to end the sandbox if the node has not")
	vm := flag.Bool("vm", false, "run as a service of a full VM's own init: end the sandbox by powering the machine off")
	joinFDs := flag.String("join-fds", "", "inherited cgroup.procs files of the agent's own cgroups, comma-separated: the agent moves into them (see agent.Shield)")
	homeFDs := flag.String("home-fds", "", "inherited tasks files of the sandbox's cgroups: the thread that starts processes moves back into them")
	pidsDirFD := flag.Int("pids-dir-fd", -1, "inherited directory of the sandbox's pids cgroup, for per-exec cgroups; its tasks file is the last of -home-fds")
	spoolFD := flag.Int("spool-fd", -1, "inherited directory to spool collected output in, outside the sandbox")
	pidNS := flag.Bool("pid-namespace", false, "start every process in a pid namespace of the workloads', under a small init, where no process can name the agent (gVisor, whose kernel does not shield a namespace's init nor check ptrace access in /proc; see agent.IsolatePIDs)")
	netConfig := flag.String("net", "", "configure the VM's network interface first: ADDR/BITS,GATEWAY,MAC,MTU[,DNS...] (microVMs with egress)")
	nullStdioFlag := flag.Bool("null-stdio", false, "once listening, replace stdin, stdout and stderr with /dev/null (under gVisor, whose /proc/1/fd lets any process of the sandbox open them, they are the node's files)")
	flag.Parse()
	if *version {
		fmt.Println(agent.Version)
		return
	}
	// The agent is small and mostly idle; keep its heap small in every one
	// of thousands of sandboxes.
	debug.SetGCPercent(50)
	if os.Getenv("GOMAXPROCS") == "" {
		// Calls are I/O-bound; one P keeps per-sandbox memory and threads down.
		runtime.GOMAXPROCS(1)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	if *netConfig != "" {
		// Before the agent answers: a create returns with the network up.
		// A failure ends the boot, its reason on the console.
		if err := configureNetwork(*netConfig); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-init: configure the network:", err)
			os.Exit(2)
		}
	}
	var l net.Listener
	var err error
	switch {
	case *listenFD >= 0:
		l, err = agent.ListenFD(*listenFD)
	case *port != "":
		l, err = agent.ListenVirtioPort(*port, 30*time.Second)
	case *vsock != 0:
		l, err = agent.ListenVsock(uint32(*vsock))
	case *listen != "":
		os.Remove(*listen)
		l, err = net.Listen("unix", *listen)
	default:
		err = fmt.Errorf("one of -listen-fd, -listen-port, -listen-vsock and -listen is required")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest:", err)
		os.Exit(2)
	}
	if *nullStdioFlag {
		// What could fail has been said; later warnings are lost.
		if err := nullStdio(); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-guest:", err)
			os.Exit(2)
		}
	}
	agent.Harden()
	// Before anything locks a thread (ReserveThreads): see agent.Shield.
	var spawner *agent.Spawner
	if *joinFDs != "" || *homeFDs != "" {
		join, err1 := inherited(*joinFDs)
		home, err2 := inherited(*homeFDs)
		if err := errors.Join(err1, err2); err != nil || len(home) == 0 {
			fmt.Fprintln(os.Stderr, "dsec-guest: bad -join-fds or -home-fds:", err)
			os.Exit(2)
		}
		var pidsDir *os.File
		if *pidsDirFD >= 0 {
			pidsDir = inheritedFD(*pidsDirFD)
		}
		// A failure here is fatal: the agent could be half-moved, and its
		// children must never be born outside the sandbox's cgroups.
		spawner, err = agent.Shield(join, home, pidsDir, home[len(home)-1])
		if err != nil {
			fmt.Fprintln(os.Stderr, "dsec-guest:", err)
			os.Exit(2)
		}
	}
	if *pidNS {
		if spawner != nil {
			fmt.Fprintln(os.Stderr, "dsec-guest: -pid-namespace does not go with cgroup shielding (-join-fds, -home-fds)")
			os.Exit(2)
		}
		if spawner, err = agent.IsolatePIDs(); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-guest:", err)
			os.Exit(2)
		}
	}
	// Spare threads for when the sandbox's pids are all taken: the runtime
	// starts one whenever a system call stalls (the scheduler hands the P
	// to another thread), and under a fork bomb on a busy host they stall.
	// An idle agent otherwise runs 5; the spares add no measurable PSS
	// (their stacks stay untouched).
	agent.ReserveThreads(4)
	a := agent.New(log)
	a.UseSpawner(spawner)
	if *spoolFD >= 0 {
		a.SpoolIn(inheritedFD(*spoolFD))
	}
	if *vm {
		a.PowerOffAtDeadline()
	}
	if *deadline > 0 {
		a.SetDeadline(time.Unix(*deadline, 0))
	}
	if err := a.Serve(l); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest:", err)
		os.Exit(1)
	}
}

// inheritedFD adopts an inherited descriptor, closed on exec: no process
// the agent starts inherits it.
func inheritedFD(fd int) *os.File {
	syscall.CloseOnExec(fd)
	return os.NewFile(uintptr(fd), "fd"+strconv.Itoa(fd))
}

func inherited(list string) ([]*os.File, error) {
	var out []*os.File
	for _, f := range strings.Split(list, ",") {
		if f == "" {
			continue
		}
		fd, err := strconv.Atoi(f)
		if err != nil || fd < 3 {
			return nil, fmt.Errorf("bad descriptor %q", f)
		}
		out = append(out, inheritedFD(fd))
	}
	return out, nil
}

func identity(args []string) {
	fs := flag.NewFlagSet("identity", flag.ExitOnError)
	host := fs.String("hostname", "", "hostname to set")
	unixMs := fs.Int64("unix-ms", 0, "wall clock to set, unix milliseconds")
	seed := fs.String("seed", "", "hex bytes to credit to the kernel's random pool")
	machineID := fs.Bool("machine-id", false, "give the machine a new random /etc/machine-id")
	netConfig := fs.String("net", "", "give the network interface this configuration (see the agent's -net)")
	fs.Parse(args)
	var t time.Time
	if *unixMs > 0 {
		t = time.UnixMilli(*unixMs)
	}
	b, err := hex.DecodeString(*seed)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest identity: bad seed:", err)
		os.Exit(2)
	}
	if err := agent.ApplyIdentity(*host, t, b); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-guest identity:", err)
		os.Exit(1)
	}
	if *machineID {
		if err := agent.NewMachineID(); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-guest identity:", err)
			os.Exit(1)
		}
	}
	if *netConfig != "" {
		if err := configureNetwork(*netConfig); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-guest identity: configure the network:", err)
			os.Exit(1)
		}
	}
}

func configureNetwork(s string) error {
	c, err := guest.ParseNetConfig(s)
	if err != nil {
		return err
	}
	return agent.ConfigureNetwork(c, 5*time.Second)
}

// nullStdio makes descriptors 0, 1 and 2 /dev/null.
func nullStdio() error {
	fd, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /dev/null: %w", err)
	}
	defer unix.Close(fd)
	for target := 0; target <= 2; target++ {
		if err := unix.Dup3(fd, target, 0); err != nil {
			return fmt.Errorf("replace descriptor %d with /dev/null: %w", target, err)
		}
	}
	return nil
}
