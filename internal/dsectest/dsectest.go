// Package dsectest runs a real `dsec serve` for tests and benchmarks — or a
// real cluster: Debian's etcd, `dsec node` and `dsec api` processes
// (cluster.go). The binaries are built once per process, each server or
// node gets its own data directory, port, bridge, subnet and nftables
// table, and everything is torn down at the end.
package dsectest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	dsec "github.com/opendsec/dsec/sdk/go"
)

var (
	buildOnce sync.Once
	binDir    string
	binBuilt  bool // binDir is this process's own build (removeBuiltBinaries)
	buildErr  error
	seq       atomic.Int32
)

// TB is the part of testing.TB the harness uses, so benchmarks (which are
// programs, not tests) can run servers too.
type TB interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Skip(args ...any)
	Skipf(format string, args ...any)
	Cleanup(func())
	TempDir() string
	Logf(format string, args ...any)
	Failed() bool
}

var _ TB = (testing.TB)(nil)

// Binaries builds dsec and dsec-guest once and returns their directory:
// $DSEC_TEST_BIN when it holds both (make test builds them into bin/), else
// a directory of this process's own. The first call also removes what
// earlier test processes that died left behind (sweep).
func Binaries(t TB) string {
	t.Helper()
	buildOnce.Do(func() {
		sweep()
		if dir := os.Getenv("DSEC_TEST_BIN"); dir != "" {
			if haveBinaries(dir) {
				binDir = dir
				return
			}
		}
		binDir, buildErr = os.MkdirTemp("", fmt.Sprintf("dsec-bin-%d-", os.Getpid()))
		if buildErr != nil {
			return
		}
		binBuilt = true
		for _, b := range []struct{ out, pkg string }{
			{"dsec", "github.com/opendsec/dsec/cmd/dsec"},
			{"dsec-guest", "github.com/opendsec/dsec/cmd/dsec-guest"},
		} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(binDir, b.out), b.pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("build %s: %v\n%s", b.pkg, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

// removeBuiltBinaries removes the binaries Binaries built for this
// process (none when it used $DSEC_TEST_BIN). A process that dies first
// leaves them to the next one's sweep.
func removeBuiltBinaries() {
	if binBuilt {
		os.RemoveAll(binDir)
		binBuilt = false
	}
}

// Need skips t unless the host can run container sandboxes.
func Need(t TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (container sandboxes)")
	}
	for _, c := range []string{"crun", "nft"} {
		if _, err := exec.LookPath(c); err != nil {
			t.Skipf("needs %s (apt-get install %s)", c, map[string]string{"crun": "crun", "nft": "nftables"}[c])
		}
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("needs Debian's busybox-static")
	}
}

// Options configure a server.
type Options struct {
	// Images to bootstrap before serving (default busybox).
	Images []string
	// APIKeys enables authentication.
	APIKeys []string
	// Args are extra `dsec serve` flags.
	Args []string
	// DataDir reuses a data directory (for restart tests).
	DataDir string
	// Env is the server's environment (default: the test's own).
	Env []string
}

// Server is a running `dsec serve`.
type Server struct {
	URL     string
	DataDir string
	Bin     string
	Addr    string
	t       TB
	opts    Options
	cmd     *exec.Cmd
	log     *os.File
	n       int32
	done    chan struct{}
}

// Start starts a server and waits until it answers.
func Start(t TB, opts Options) *Server {
	t.Helper()
	Need(t)
	bin := Binaries(t)
	if len(opts.Images) == 0 {
		opts.Images = []string{"busybox"}
	}
	s := &Server{t: t, opts: opts, Bin: filepath.Join(bin, "dsec"), n: seq.Add(1)}
	s.DataDir = opts.DataDir
	if s.DataDir == "" {
		s.DataDir = t.TempDir()
	}
	s.start()
	t.Cleanup(s.cleanup)
	return s
}

func (s *Server) netArgs() []string {
	// Unique per test process and server: concurrent test packages must not
	// share a bridge, a subnet or a firewall table.
	return []string{
		"--bridge", fmt.Sprintf("dst%d-%d", os.Getpid(), s.n),
		"--subnet", fmt.Sprintf("10.%d.%d.0/24", 100+os.Getpid()%100, s.n%256),
		"--nft-table", fmt.Sprintf("dsectest_%d_%d", os.Getpid(), s.n),
	}
}

// Network names the server's bridge and nftables tables (one inet, one
// bridge).
func (s *Server) Network() (bridge, table string) {
	args := s.netArgs()
	return args[1], args[5]
}

func freePort(t TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func (s *Server) start() {
	t := s.t
	t.Helper()
	if s.Addr == "" {
		s.Addr = freePort(t)
	}
	s.URL = "http://" + s.Addr
	args := []string{"serve", "--listen", s.Addr, "--data-dir", s.DataDir, "--log-level", "warn",
		"--bootstrap", strings.Join(s.opts.Images, ",")}
	args = append(args, s.netArgs()...)
	for _, k := range s.opts.APIKeys {
		args = append(args, "--api-key", k)
	}
	if len(s.opts.APIKeys) > 0 {
		// The harness's own operator key, to clean up every project's
		// sandboxes.
		args = append(args, "--admin-key", s.adminKey())
	}
	args = append(args, s.opts.Args...)
	cmd := exec.Command(s.Bin, args...)
	cmd.Env = os.Environ()
	if s.opts.Env != nil {
		cmd.Env = s.opts.Env
	}
	if s.log == nil { // a restarted server goes on writing its one log (cleanup removes it)
		logf, err := os.CreateTemp("", fmt.Sprintf("dsec-serve-%d-*.log", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		s.log = logf
	}
	cmd.Stdout, cmd.Stderr = s.log, s.log
	cmd.SysProcAttr = procAttr()
	if err := start(cmd); err != nil {
		t.Fatal(err)
	}
	s.cmd = cmd
	s.done = make(chan struct{})
	go func() { cmd.Wait(); close(s.done) }()
	// The debian bootstrap may take minutes on a cold cache.
	deadline := time.Now().Add(15 * time.Minute)
	for {
		resp, err := http.Get(s.URL + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-s.done:
			t.Fatalf("dsec serve exited during start:\n%s", s.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("dsec serve did not start:\n%s", s.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Log returns what the server printed.
func (s *Server) Log() string {
	b, _ := os.ReadFile(s.log.Name())
	return string(b)
}

// Pid is the server's process (the re-executed child runs the node).
func (s *Server) Pid() int { return s.cmd.Process.Pid }

// RunDir is the server's directory under /run (runtime state, sandbox file
// system mount points, network namespaces): serve names it by an FNV-1a
// hash of the absolute data directory (cmd/dsec runDirOf). Tests that look
// for leftovers there check first that they see a live sandbox's entry.
func (s *Server) RunDir() string {
	abs, _ := filepath.Abs(s.DataDir)
	h := uint32(2166136261)
	for i := 0; i < len(abs); i++ {
		h = (h ^ uint32(abs[i])) * 16777619
	}
	return filepath.Join("/run/dsec", fmt.Sprintf("%08x", h))
}

// NodePid is the server's node process: `dsec serve` re-executes itself in
// a private mount namespace, and that child (the server's only one) holds
// the node's mounts, sandboxes and memory. Any of the server's threads may
// have started it, so every thread's children are read (reading only the
// main thread's finds none when another thread forked). The test fails if
// there is none: a check made on the server's own (the host's) mount
// namespace instead would pass whatever the node leaves.
func (s *Server) NodePid() int {
	s.t.Helper()
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", s.Pid()))
	for _, task := range tasks {
		b, _ := os.ReadFile(task)
		if f := strings.Fields(string(b)); len(f) > 0 {
			var child int
			if _, err := fmt.Sscan(f[0], &child); err == nil {
				return child
			}
		}
	}
	s.t.Fatalf("dsec serve (pid %d) has no node process", s.Pid())
	return 0
}

// adminKey is the operator key the harness gives a server with keys.
func (s *Server) adminKey() string { return fmt.Sprintf("dsectest-operator-%d-%d", os.Getpid(), s.n) }

// Key is the key of the server's first API key entry ("KEY" or
// "PROJECT=KEY"), or "" without keys.
func (s *Server) Key() string {
	if len(s.opts.APIKeys) == 0 {
		return ""
	}
	e := s.opts.APIKeys[0]
	if _, k, ok := strings.Cut(e, "="); ok {
		return k
	}
	return e
}

// Client returns an SDK client for the server.
func (s *Server) Client() *dsec.Client {
	return dsec.New(s.URL, dsec.WithAPIKey(s.Key()))
}

// CLI runs the dsec CLI against the server.
func (s *Server) CLI(ctx context.Context, stdin string, args ...string) (stdout, stderr string, code int) {
	cmd := exec.CommandContext(ctx, s.Bin, args...)
	cmd.Env = append(os.Environ(), "DSEC_URL="+s.URL)
	if k := s.Key(); k != "" {
		cmd.Env = append(cmd.Env, "DSEC_API_KEY="+k)
	}
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code = 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		code = -1
	}
	return out.String(), errb.String(), code
}

// Stop stops the server gracefully; sandboxes keep running.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	syscall.Kill(s.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
	}
	s.cmd = nil
}

// Kill kills the server at once, as a crash would.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.done
	s.cmd = nil
}

// Restart stops and starts the server over the same data directory and
// address.
func (s *Server) Restart() {
	s.Stop()
	s.start()
}

func (s *Server) cleanup() {
	if s.cmd != nil {
		// Delete what the test left, of every project, then stop.
		c := s.Client()
		if len(s.opts.APIKeys) > 0 {
			c = dsec.New(s.URL, dsec.WithAPIKey(s.adminKey()))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		if list, err := c.List(ctx, ""); err == nil {
			var wg sync.WaitGroup
			for _, sb := range list {
				wg.Add(1)
				go func(id string) { defer wg.Done(); c.Delete(ctx, id) }(sb.Id)
			}
			wg.Wait()
		}
		cancel()
		s.Stop()
	}
	args := s.netArgs()
	exec.Command("ip", "link", "del", args[1]).Run()
	exec.Command("nft", "delete", "table", "inet", args[5]).Run()
	exec.Command("nft", "delete", "table", "bridge", args[5]).Run()
	if s.t.Failed() {
		s.t.Logf("dsec serve log:\n%s", s.Log())
	}
	os.Remove(s.log.Name())
}

// Spec is a convenience for a busybox sandbox spec.
func Spec(image string) *dsecv1.SandboxSpec {
	return &dsecv1.SandboxSpec{Image: image, TtlS: 600}
}

// NeedMicroVM skips t unless the host can run microvm sandboxes: QEMU and
// the guest kernel scripts/setup.sh extracts into $DSEC_CACHE_DIR.
func NeedMicroVM(t TB) string {
	t.Helper()
	Need(t)
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("needs qemu-system-x86_64 (apt-get install qemu-system-x86)")
	}
	dir := filepath.Join(os.Getenv("DSEC_CACHE_DIR"), "guest-kernel")
	b, err := os.ReadFile(filepath.Join(dir, "release"))
	if os.Getenv("DSEC_CACHE_DIR") == "" || err != nil {
		t.Skip("needs the microvm guest kernel in $DSEC_CACHE_DIR/guest-kernel (make test sets DSEC_CACHE_DIR; scripts/setup.sh extracts it)")
	}
	return strings.TrimSpace(string(b))
}

// VMReady reports whether the host can run full VMs (kind vm) and build
// the debian VM image (`--bootstrap debian-vm`), which is cached in
// $DSEC_CACHE_DIR so a host builds it once; if not, it says what is
// missing. Container sandboxes (Need) are assumed.
func VMReady() (bool, string) {
	for _, t := range []struct{ tool, pkg string }{
		{"qemu-system-x86_64", "qemu-system-x86"}, {"qemu-img", "qemu-utils"}, {"debootstrap", "debootstrap"}, {"mkfs.ext4", "e2fsprogs"},
	} {
		if _, err := exec.LookPath(t.tool); err != nil {
			return false, fmt.Sprintf("needs %s (apt-get install %s; scripts/setup.sh installs it)", t.tool, t.pkg)
		}
	}
	if os.Getenv("DSEC_CACHE_DIR") == "" {
		return false, "needs DSEC_CACHE_DIR, where the debian VM image is built once per host (make test sets it)"
	}
	return true, ""
}

// NeedVM skips t unless the host can run full VMs and build their image
// (see VMReady).
func NeedVM(t TB) {
	t.Helper()
	Need(t)
	if ok, why := VMReady(); !ok {
		t.Skip(why)
	}
}
