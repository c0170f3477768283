package hostile

// Attacks that root inside a container sandbox could make as the host's
// root: taking a per-user kernel limit the host's root shares (finding 7:
// every inotify instance of uid 0), making device nodes, giving files to
// any host user. Each sandbox's root is an unprivileged host uid of a range
// of its own, in a user namespace of its own.

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// startHog starts inotifyhog in the background in sb and returns what it
// printed once it stopped opening instances.
func startHog(t *testing.T, sb *dsec.Sandbox, most int) string {
	t.Helper()
	uploadFile(t, sb, testdataProgram(t, "inotifyhog"), "/tmp/inotifyhog")
	cmd := fmt.Sprintf("/tmp/inotifyhog %d > /tmp/hog.out 2>&1 &", most)
	if r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(cmd)); err != nil || r.ExitCode != 0 {
		t.Fatalf("start inotifyhog: %v %+v", err, r)
	}
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("cat /tmp/hog.out"))
		if err == nil && strings.HasPrefix(string(r.Stdout), "opened") {
			return strings.TrimSpace(string(r.Stdout))
		}
	}
	t.Fatal("inotifyhog did not finish opening instances within a minute")
	return ""
}

func TestSandboxCannotTakeTheHostRootsInotifyInstances(t *testing.T) {
	eachRuntime(t, testSandboxCannotTakeTheHostRootsInotifyInstances)
}

func testSandboxCannotTakeTheHostRootsInotifyInstances(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	out := startHog(t, sb, 1<<20)
	t.Logf("in the sandbox: %s", out)
	// Stop it soon whatever happens: on a host where the sandbox's root is
	// the host's, every root process is out of instances while it runs.
	t.Cleanup(func() { sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("pkill inotifyhog; killall inotifyhog")) })
	t.Run("the host's root still gets inotify instances", func(t *testing.T) {
		fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
		if err != nil {
			t.Fatalf("the host's root cannot make an inotify instance while the sandbox holds %q: %v", out, err)
		}
		unix.Close(fd)
	})
	t.Run("a neighbour sandbox still gets inotify instances", func(t *testing.T) {
		if got := startHog(t, nb.sb, 16); got != "opened 16: asked for no more" {
			t.Errorf("the neighbour: %s", got)
		}
		nb.sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("killall inotifyhog"))
	})
	t.Run("a neighbour's watch still works", func(t *testing.T) {
		api := clientFor(t, keyB).Raw()
		st, err := api.WatchDir(ctxFor(t, time.Minute), connect.NewRequest(&dsecv1.WatchDirRequest{SandboxId: nb.sb.ID, Path: "/tmp"}))
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if !st.Receive() || !st.Msg().GetStarted() {
			t.Fatalf("watch in the neighbour: %v (kind %q, infra %v)", st.Err(), kindOf(st.Err()), infraOf(st.Err()))
		}
	})
	nb.check(t)
}

func TestSandboxRootIsNotTheHostsRoot(t *testing.T) { eachRuntime(t, testSandboxRootIsNotTheHostsRoot) }

func testSandboxRootIsNotTheHostsRoot(t *testing.T, rt string) {
	c := client(t)
	nb := newNeighbour(t)
	sb := create(t, c, dsec.CreateOptions{Runtime: rt})
	run := func(cmd string) *dsecv1.ExecResult {
		t.Helper()
		r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(cmd))
		if err != nil {
			t.Fatalf("%s: %v", cmd, err)
		}
		return r
	}
	// gVisor's kernel keeps user namespaces of its own (its uid_map says
	// nothing of the host): there, what root makes is checked on the host
	// below.
	if rt != "gvisor" {
		t.Run("the sandbox runs in a user namespace of its own", func(t *testing.T) {
			r := run("cat /proc/self/uid_map /proc/self/gid_map")
			f := strings.Fields(string(r.Stdout))
			if len(f) != 6 || f[0] != "0" || f[2] != "65536" || f[3] != "0" || f[1] != f[4] {
				t.Fatalf("uid_map and gid_map inside: %q", r.Stdout)
			}
			if host, _ := strconv.Atoi(f[1]); host < 65536 {
				t.Errorf("root inside is host uid %d, want an unprivileged one", host)
			}
		})
	}
	t.Run("a file root makes is an unprivileged host user's", func(t *testing.T) {
		name := fmt.Sprintf("made-by-root-%d", time.Now().UnixNano())
		run("touch /tmp/" + name)
		p := findUpperFile(t, filepath.Join("tmp", name))
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid < 65536 || st.Gid < 65536 {
			t.Errorf("the file root made inside is host uid %d gid %d on the host", st.Uid, st.Gid)
		}
		if r := run("stat -c '%u %g' /tmp/" + name); strings.TrimSpace(string(r.Stdout)) != "0 0" {
			t.Errorf("inside, the file is %q, want root's", r.Stdout)
		}
	})
	t.Run("root cannot make device nodes", func(t *testing.T) {
		// CAP_MKNOD is checked against the host's user namespace.
		if r := run("mknod /tmp/sda b 8 0 && echo made"); r.ExitCode == 0 {
			t.Errorf("root inside made a block device node: %q", r.Stdout)
		}
	})
	t.Run("root cannot give a file to a host user outside its range", func(t *testing.T) {
		name := fmt.Sprintf("gift-%d", time.Now().UnixNano())
		r := run("touch /tmp/" + name + " && chown 100000:100000 /tmp/" + name + " && echo given; sync")
		if rt != "gvisor" && strings.Contains(string(r.Stdout), "given") {
			// (gVisor's kernel answers success and changes nothing: the
			// gofer, in the sandbox's user namespace, is refused.)
			t.Errorf("root inside gave a file to host uid 100000: %q", r.Stdout)
		}
		var st unix.Stat_t
		if err := unix.Stat(findUpperFile(t, filepath.Join("tmp", name)), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid == 100000 || st.Gid == 100000 || st.Uid < 65536 {
			t.Errorf("the file is host uid %d gid %d on the host", st.Uid, st.Gid)
		}
	})
	t.Run("what the image's root owns is root's inside", func(t *testing.T) {
		if r := run("stat -c '%u %g' /bin /etc/passwd"); strings.TrimSpace(string(r.Stdout)) != "0 0\n0 0" {
			t.Errorf("owners inside: %q", r.Stdout)
		}
		if r := run("echo 10.1.2.3 extra >> /etc/hosts && echo ok >> /etc/motd && echo done"); r.ExitCode != 0 {
			t.Errorf("root cannot write its /etc: %q", r.Stderr)
		}
	})
	nb.check(t)
}

// findUpperFile finds rel in a sandbox's writable layer on the host, as
// the node sees it: in its data directory or on a sandbox file system
// mounted in its mount namespace.
func findUpperFile(t *testing.T, rel string) string {
	t.Helper()
	root := fmt.Sprintf("/proc/%d/root", nodePid(t))
	for _, pattern := range []string{
		filepath.Join(root, "run/dsec/*/disks/*/upper", rel),
		filepath.Join(root, srv(t).DataDir, "*/*/upper", rel),
		filepath.Join(root, srv(t).DataDir, "*/*/*/upper", rel),
	} {
		if m, _ := filepath.Glob(pattern); len(m) == 1 {
			return m[0]
		}
	}
	t.Fatalf("%s is in no writable layer of the node", rel)
	return ""
}
