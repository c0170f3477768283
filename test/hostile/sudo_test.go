package hostile

// Privilege escalation inside a sandbox: the "base" image (E2B's base
// template) gives its user passwordless sudo, so its sandboxes run without
// no_new_privs. Root reached through sudo must be the sandbox's root and
// nothing more: an unprivileged host user in the sandbox's user namespace,
// with the capabilities a command run as root through the API has. Every
// other image keeps no_new_privs: a setuid binary does not elevate.

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

var (
	escalationImagesOnce sync.Once
	escalationImagesErr  error
)

// escalationImages bootstraps the base and debian images (project A's)
// into the shared server, once.
func escalationImages(t *testing.T) {
	t.Helper()
	escalationImagesOnce.Do(func() {
		for _, recipe := range []string{"debian", "base"} {
			if _, err := client(t).BootstrapImage(ctxFor(t, 20*time.Minute), &dsecv1.BootstrapImageRequest{Recipe: recipe}, nil); err != nil {
				escalationImagesErr = fmt.Errorf("bootstrap %s: %w", recipe, err)
				return
			}
		}
	})
	if escalationImagesErr != nil {
		t.Fatal(escalationImagesErr)
	}
}

// hostLevelProbe tries, as whoever runs it, what root on the host could do
// and a sandbox's root must not: it prints each attempt's result ("ok" or
// the errno's name) as JSON.
const hostLevelProbe = `
import ctypes, errno, json, os, stat
libc = ctypes.CDLL(None, use_errno=True)
def c(r):
    if r == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r
def wopen(p):
    os.close(os.open(p, os.O_WRONLY))
class timespec(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
def settime():
    ts = timespec()
    c(libc.clock_gettime(0, ctypes.byref(ts)))
    c(libc.clock_settime(0, ctypes.byref(ts)))
def finit():
    fd = os.open("/etc/hostname", os.O_RDONLY)
    try:
        c(libc.syscall(313, fd, b"", 0))
    finally:
        os.close(fd)
def gift():
    p = "/tmp/gift-%d" % os.getpid()
    open(p, "w").close()
    os.chown(p, 100000, 100000)
attempts = {
    "mount a file system": lambda: c(libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)),
    "unmount the agent binary": lambda: c(libc.umount2(b"/.dsec/guest", 2)),
    "remount the agent binary writable": lambda: c(libc.mount(None, b"/.dsec/guest", None, 32 | 4096, None)),
    "write the agent binary": lambda: wopen("/.dsec/guest"),
    "load a kernel module": lambda: c(libc.syscall(175, b"\0" * 64, 64, b"")),
    "load a kernel module from a file": finit,
    "make a user namespace": lambda: c(libc.unshare(0x10000000)),
    "make a mount namespace": lambda: c(libc.unshare(0x00020000)),
    "write a kernel parameter": lambda: wopen("/proc/sys/kernel/sysrq"),
    "write the host's sysfs": lambda: wopen("/sys/kernel/mm/transparent_hugepage/enabled"),
    "read the agent's memory": lambda: os.close(os.open("/proc/1/mem", os.O_RDONLY)),
    "trace the agent": lambda: c(libc.ptrace(16, 1, 0, 0)),
    "make a block device node": lambda: os.mknod("/tmp/sda-%d" % os.getpid(), 0o600 | stat.S_IFBLK, os.makedev(8, 0)),
    "set the clock": settime,
    "reach I/O ports": lambda: c(libc.syscall(172, 3)),
    "reboot": lambda: c(libc.reboot(0)),
    "give a file to a host user outside the sandbox's range": gift,
}
out = {}
for name, fn in attempts.items():
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out, sort_keys=True))
`

func TestSudoRootIsTheSandboxsRootAndNoMore(t *testing.T) {
	eachRuntime(t, testSudoRootIsTheSandboxsRootAndNoMore)
}

func testSudoRootIsTheSandboxsRootAndNoMore(t *testing.T, rt string) {
	escalationImages(t)
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Image: "base", Runtime: rt})
	// run runs argv as the image's user ("user"), or as user.
	run := func(t *testing.T, user string, argv ...string) *dsecv1.ExecResult {
		t.Helper()
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Argv: argv, User: user})
		if err != nil {
			t.Fatalf("%v: %v", argv, err)
		}
		return r
	}
	r := run(t, "", "sudo", "-n", "id", "-u")
	if rt == "gvisor" {
		// gVisor's kernel ignores setuid bits (google/gvisor#212): sudo
		// does not elevate there, whatever the image allows.
		t.Logf("sudo under gVisor: exit %d, %q", r.ExitCode, r.Stderr)
		if strings.TrimSpace(string(r.Stdout)) == "0" {
			t.Errorf("sudo under gVisor became root")
		}
		nb.check(t)
		return
	}
	if r.ExitCode != 0 || strings.TrimSpace(string(r.Stdout)) != "0" {
		t.Fatalf("sudo as the image's user: exit %d, %q %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	t.Run("root through sudo holds what root through the API holds and no more", func(t *testing.T) {
		status := func(t *testing.T, user string, argv ...string) string {
			t.Helper()
			r := run(t, user, append(argv, "grep", "-E", "^(Cap(Prm|Eff|Bnd|Amb)|NoNewPrivs):", "/proc/self/status")...)
			if r.ExitCode != 0 {
				t.Fatalf("read /proc/self/status: %q", r.Stderr)
			}
			return string(r.Stdout)
		}
		viaSudo, viaAPI := status(t, "", "sudo", "-n"), status(t, "root")
		t.Logf("root through sudo:\n%s", viaSudo)
		if viaSudo != viaAPI {
			t.Errorf("root through sudo:\n%sroot through the API:\n%s", viaSudo, viaAPI)
		}
		for _, line := range strings.Split(strings.TrimSpace(viaSudo), "\n") {
			name, hex, _ := strings.Cut(line, ":")
			if !strings.HasPrefix(name, "Cap") {
				continue
			}
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			for _, bad := range []struct {
				bit  uint
				name string
			}{{unix.CAP_SYS_ADMIN, "CAP_SYS_ADMIN"}, {unix.CAP_SYS_MODULE, "CAP_SYS_MODULE"}, {unix.CAP_NET_RAW, "CAP_NET_RAW"},
				{unix.CAP_NET_ADMIN, "CAP_NET_ADMIN"}, {unix.CAP_SYS_PTRACE, "CAP_SYS_PTRACE"}, {unix.CAP_SYS_TIME, "CAP_SYS_TIME"},
				{unix.CAP_SYS_RAWIO, "CAP_SYS_RAWIO"}, {unix.CAP_SYS_BOOT, "CAP_SYS_BOOT"}, {unix.CAP_DAC_READ_SEARCH, "CAP_DAC_READ_SEARCH"}} {
				if caps&(1<<bad.bit) != 0 {
					t.Errorf("%s holds %s", name, bad.name)
				}
			}
		}
	})
	t.Run("root through sudo is an unprivileged host user", func(t *testing.T) {
		r := run(t, "", "sudo", "-n", "cat", "/proc/self/uid_map")
		f := strings.Fields(string(r.Stdout))
		if len(f) != 3 || f[0] != "0" || f[2] != "65536" {
			t.Fatalf("uid_map as root through sudo: %q", r.Stdout)
		}
		if host, _ := strconv.Atoi(f[1]); host < 65536 {
			t.Errorf("root through sudo is host uid %d", host)
		}
	})
	t.Run("a file root makes through sudo is an unprivileged host user's", func(t *testing.T) {
		name := fmt.Sprintf("made-by-sudo-%d", time.Now().UnixNano())
		if r := run(t, "", "sudo", "-n", "touch", "/tmp/"+name); r.ExitCode != 0 {
			t.Fatalf("sudo touch: %q", r.Stderr)
		}
		var st unix.Stat_t
		if err := unix.Stat(findUpperFile(t, filepath.Join("tmp", name)), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid < 65536 || st.Gid < 65536 {
			t.Errorf("the file root made through sudo is host uid %d gid %d", st.Uid, st.Gid)
		}
	})
	t.Run("root through sudo reaches nothing of the host", func(t *testing.T) {
		probe := func(t *testing.T, user string, argv ...string) map[string]string {
			t.Helper()
			r := run(t, user, append(argv, "python3", "-c", hostLevelProbe)...)
			var out map[string]string
			if err := json.Unmarshal(r.Stdout, &out); err != nil || r.ExitCode != 0 {
				t.Fatalf("probe: exit %d, %q %q", r.ExitCode, r.Stdout, r.Stderr)
			}
			return out
		}
		viaSudo, viaAPI := probe(t, "", "sudo", "-n"), probe(t, "root")
		for name, res := range viaSudo {
			t.Logf("%s: %s", name, res)
			if res == "ok" {
				t.Errorf("root through sudo could %s", name)
			}
		}
		for name, res := range viaAPI {
			if res == "ok" {
				t.Errorf("root through the API could %s", name)
			}
		}
	})
	nb.check(t)
}

func TestOnlyImagesThatAllowItEscalateThroughSetuid(t *testing.T) {
	eachRuntime(t, testOnlyImagesThatAllowItEscalateThroughSetuid)
}

func testOnlyImagesThatAllowItEscalateThroughSetuid(t *testing.T, rt string) {
	escalationImages(t)
	c := client(t)
	nb := newNeighbour(t)
	// A setuid-root copy of python that nobody runs: it says whom it runs
	// as, and whether no_new_privs is set.
	// (prctl PR_GET_NO_NEW_PRIVS: gVisor's /proc/self/status does not
	// show it.)
	const who = `import ctypes, os; print(os.getuid(), os.geteuid(), ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))`
	base := "65534 0 0" // the image allows escalation, to the sandbox's root
	if rt == "gvisor" {
		// gVisor's kernel ignores setuid bits (google/gvisor#212) and
		// reports no_new_privs set, whatever the image allows.
		base = "65534 65534 1"
	}
	for _, tt := range []struct {
		image, want string
	}{
		{"debian", "65534 65534 1"}, // no_new_privs: the setuid bit is ignored
		{"base", base},
	} {
		t.Run(tt.image, func(t *testing.T) {
			sb := create(t, c, dsec.CreateOptions{Image: tt.image, Runtime: rt})
			ctx := ctxFor(t, time.Minute)
			r, err := sb.Exec(ctx, dsec.ExecOptions{User: "root", Cmd: "cp /usr/bin/python3 /usr/local/bin/suid-python && chmod 4755 /usr/local/bin/suid-python"})
			if err != nil || r.ExitCode != 0 {
				t.Fatalf("make the setuid binary: %v %q", err, r.GetStderr())
			}
			r, err = sb.Exec(ctx, dsec.ExecOptions{User: "nobody", Argv: []string{"/usr/local/bin/suid-python", "-c", who}})
			if err != nil || r.ExitCode != 0 {
				t.Fatalf("run it as nobody: %v %q", err, r.GetStderr())
			}
			if got := strings.TrimSpace(string(r.Stdout)); got != tt.want {
				t.Errorf("a setuid-root binary run by nobody in a %s sandbox: uid euid no_new_privs = %q, want %q", tt.image, got, tt.want)
			}
		})
	}
	nb.check(t)
}
