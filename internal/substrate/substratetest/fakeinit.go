package substratetest

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/guest/agent"
)

// fakeEnv carries a fake instance's configuration to the test binary
// started as its init.
const fakeEnv = "DSEC_SUBSTRATETEST_FAKE"

// fakeConfig is what a fake instance's init needs.
type fakeConfig struct {
	Probe    bool      `json:"probe,omitempty"` // only check that the namespaces can be made
	Dir      string    `json:"dir"`
	Layers   []string  `json:"layers"`
	Env      []string  `json:"env"`
	Workdir  string    `json:"workdir"`
	Hostname string    `json:"hostname"`
	Deadline time.Time `json:"deadline"`
}

// A test binary started by the fake as an instance's init becomes that
// init here, before any test runs: it never returns to the tests.
func init() {
	if c := os.Getenv(fakeEnv); c != "" {
		os.Exit(fakeInit(c))
	}
}

// fakeCommand is the test binary as the init of a fake instance, in new
// user, mount, PID, UTS, IPC and network namespaces, root inside mapped to
// the test's user outside.
func fakeCommand(c fakeConfig) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Args = []string{"dsec-fake-init"}
	cmd.Env = []string{fakeEnv + "=" + string(b)}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS | syscall.CLONE_NEWPID |
			syscall.CLONE_NEWUTS | syscall.CLONE_NEWIPC | syscall.CLONE_NEWNET,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
		GidMappingsEnableSetgroups: false,
	}
	return cmd, nil
}

// lifeline is the read end of a pipe whose write end only this process
// holds: an instance's init reads it and ends the instance when the test
// process is gone (a parent-death signal would follow the thread that
// forked, not the process).
var lifeline = sync.OnceValues(func() (*os.File, error) {
	r, w, err := os.Pipe()
	lifelineW = w
	return r, err
})

var lifelineW *os.File // never closed: it closes when the process ends

// fakeInit is the init of a fake instance: fd 3 is the agent's listening
// socket, fd 4 the lifeline.
func fakeInit(raw string) int {
	var c fakeConfig
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		fmt.Fprintln(os.Stderr, "fake init:", err)
		return 2
	}
	if c.Probe {
		return 0
	}
	if err := fakeRoot(c); err != nil {
		fmt.Fprintln(os.Stderr, "fake init:", err)
		return 2
	}
	if err := loopbackUp(); err != nil {
		fmt.Fprintln(os.Stderr, "fake init: loopback:", err)
		return 2
	}
	os.Clearenv()
	for _, e := range c.Env {
		if k, v, ok := strings.Cut(e, "="); ok {
			os.Setenv(k, v)
		}
	}
	if c.Workdir != "" {
		os.Chdir(c.Workdir)
	}
	// As cmd/dsec-guest runs the agent, without the cgroups the fake has
	// none of.
	debug.SetGCPercent(50)
	runtime.GOMAXPROCS(1)
	l, err := agent.ListenFD(3)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake init:", err)
		return 2
	}
	syscall.CloseOnExec(4)
	go func() {
		var b [1]byte
		os.NewFile(4, "lifeline").Read(b[:]) // returns when the test process is gone
		syscall.Kill(-1, syscall.SIGKILL)
		os.Exit(0)
	}()
	agent.Harden()
	agent.ReserveThreads(4)
	a := agent.New(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if !c.Deadline.IsZero() {
		a.SetDeadline(c.Deadline)
	}
	if err := a.Serve(l); err != nil {
		fmt.Fprintln(os.Stderr, "fake init:", err)
		return 1
	}
	return 0
}

// fakeRoot makes the instance's root: an overlay of the layers with
// upper and work directories in c.Dir, its own /proc, a /dev of the host's
// harmless devices and a devpts instance, then pivots into it.
func fakeRoot(c fakeConfig) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	root := filepath.Join(c.Dir, "rootfs")
	// overlayfs splits its options at commas and lowerdir at colons,
	// unless escaped.
	esc := strings.NewReplacer(`\`, `\\`, ",", `\,`, ":", `\:`).Replace
	lower := make([]string, len(c.Layers))
	for k, l := range c.Layers {
		lower[k] = esc(l)
	}
	opts := "lowerdir=" + strings.Join(lower, ":") + ",upperdir=" + esc(filepath.Join(c.Dir, "upper")) + ",workdir=" + esc(filepath.Join(c.Dir, "work"))
	if err := unix.Mount("overlay", root, "overlay", 0, opts); err != nil {
		if err2 := unix.Mount("overlay", root, "overlay", 0, opts+",userxattr"); err2 != nil {
			return fmt.Errorf("mount the root overlay: %w", err)
		}
	}
	at := func(p string) string { return filepath.Join(root, p) }
	for _, d := range []string{"proc", "dev", "tmp"} {
		os.MkdirAll(at(d), 0o755)
	}
	if err := unix.Mount("proc", at("proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if err := unix.Mount("tmpfs", at("dev"), "tmpfs", unix.MS_NOSUID, "mode=755,size=1m"); err != nil {
		return fmt.Errorf("mount /dev: %w", err)
	}
	for _, d := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		if f, err := os.Create(at("dev/" + d)); err == nil {
			f.Close()
		}
		if err := unix.Mount("/dev/"+d, at("dev/"+d), "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", d, err)
		}
	}
	os.MkdirAll(at("dev/pts"), 0o755)
	if err := unix.Mount("devpts", at("dev/pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"); err != nil {
		return fmt.Errorf("mount /dev/pts: %w", err)
	}
	os.Symlink("pts/ptmx", at("dev/ptmx"))
	os.MkdirAll(at("dev/shm"), 0o1777)
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		os.Symlink(target, at("dev/"+name))
	}
	if c.Hostname != "" {
		if err := unix.Sethostname([]byte(c.Hostname)); err != nil {
			return fmt.Errorf("set the hostname: %w", err)
		}
	}
	if err := os.Chdir(root); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the old root: %w", err)
	}
	return os.Chdir("/")
}

// loopbackUp brings up the loopback interface of the instance's network
// namespace, as the container substrate does for a sandbox without
// network: its processes reach each other (and the agent's listeners) on
// 127.0.0.1.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}
