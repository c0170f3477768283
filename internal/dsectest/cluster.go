package dsectest

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	dsec "github.com/opendsec/dsec/sdk/go"
)

// EtcdBinary is Debian's etcd server (package etcd-server).
const EtcdBinary = "/usr/bin/etcd"

// Etcd is a real etcd server on free loopback ports, for one test.
type Etcd struct {
	URL      string
	t        TB
	dir      string
	peer     string
	cmd      *exec.Cmd
	done     chan struct{}
	log      *os.File
	stopOnce sync.Once
}

// StartEtcd starts etcd, or skips t when it is not installed.
func StartEtcd(t TB) *Etcd {
	t.Helper()
	if _, err := os.Stat(EtcdBinary); err != nil {
		t.Skipf("needs etcd at %s (apt-get install etcd-server)", EtcdBinary)
	}
	// Memory-backed when the host has /dev/shm: a test's etcd fsyncs
	// every write, and the disk is shared with builds.
	dir, err := os.MkdirTemp("/dev/shm", fmt.Sprintf("dsec-etcd-%d-", os.Getpid()))
	if err != nil {
		dir = t.TempDir()
	}
	e := &Etcd{t: t, dir: dir}
	ports := freePorts(t, 2)
	e.URL, e.peer = "http://"+ports[0], "http://"+ports[1]
	t.Cleanup(func() {
		e.Kill()
		if t.Failed() {
			t.Logf("etcd log:\n%s", e.Log())
		}
		if e.log != nil {
			os.Remove(e.log.Name())
		}
		os.RemoveAll(dir)
	})
	e.Start()
	return e
}

// Start starts (or restarts, over the same data and ports) the server and
// waits until it answers.
func (e *Etcd) Start() {
	t := e.t
	t.Helper()
	cmd := exec.Command(EtcdBinary,
		"--name", "dsectest", "--data-dir", filepath.Join(e.dir, "data"),
		"--listen-client-urls", e.URL, "--advertise-client-urls", e.URL,
		"--listen-peer-urls", e.peer, "--initial-advertise-peer-urls", e.peer,
		"--initial-cluster", "dsectest="+e.peer, "--log-level", "warn")
	if e.log == nil {
		f, err := os.CreateTemp("", fmt.Sprintf("dsec-etcd-%d-*.log", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		e.log = f
	}
	cmd.Stdout, cmd.Stderr = e.log, e.log
	cmd.SysProcAttr = procAttr()
	if err := start(cmd); err != nil {
		t.Fatal(err)
	}
	e.cmd, e.done = cmd, make(chan struct{})
	go func(done chan struct{}) { cmd.Wait(); close(done) }(e.done)
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(e.URL + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-e.done:
			t.Fatalf("etcd exited during start:\n%s", e.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd did not start:\n%s", e.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// freePorts returns n distinct free loopback ports.
func freePorts(t TB, n int) []string {
	var out []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		out = append(out, l.Addr().String())
	}
	return out
}

// Kill kills the server at once.
func (e *Etcd) Kill() {
	if e.cmd == nil {
		return
	}
	syscall.Kill(-e.cmd.Process.Pid, syscall.SIGKILL)
	<-e.done
	e.cmd = nil
}

// Log returns what etcd printed.
func (e *Etcd) Log() string {
	if e.log == nil {
		return ""
	}
	b, _ := os.ReadFile(e.log.Name())
	return string(b)
}

// Proc is a `dsec api` or `dsec node` process of a test cluster.
type Proc struct {
	// Name is the node's name ("" for an apiserver).
	Name string
	// Addr is host:port and URL the process's API.
	Addr, URL string
	// DataDir is a node's data directory.
	DataDir string
	// debug serves the process's Go profiles (its goroutines when a test
	// finds it stuck).
	debug   string
	t       TB
	bin     string
	args    []string
	netArgs []string
	cmd     *exec.Cmd
	done    chan struct{}
	log     *os.File
	token   string
}

// NodeOptions configure a node of a test cluster.
type NodeOptions struct {
	// Token is the cluster token.
	Token string
	// Images to bootstrap (default busybox).
	Images []string
	// Args are extra `dsec node` flags.
	Args []string
}

// StartNode starts `dsec node --name name` against etcd and waits until its
// API answers. Each node has its own data directory, bridge, subnet and
// nftables table; on cleanup its sandboxes are deleted.
func StartNode(t TB, etcd *Etcd, name string, opts NodeOptions) *Proc {
	t.Helper()
	Need(t)
	if len(opts.Images) == 0 {
		opts.Images = []string{"busybox"}
	}
	n := seq.Add(1)
	p := &Proc{Name: name, t: t, bin: filepath.Join(Binaries(t), "dsec"), token: opts.Token, DataDir: t.TempDir()}
	p.Addr = freePort(t)
	p.URL = "http://" + p.Addr
	p.netArgs = []string{
		"--bridge", fmt.Sprintf("dsc%d-%d", os.Getpid(), n),
		"--subnet", fmt.Sprintf("10.%d.%d.0/24", 100+os.Getpid()%100, n%256),
		"--nft-table", fmt.Sprintf("dsectest_%d_%d", os.Getpid(), n),
	}
	p.args = append([]string{"node", "--name", name, "--listen", p.Addr, "--data-dir", p.DataDir,
		"--etcd", etcd.URL, "--cluster-token", opts.Token, "--log-level", "info",
		"--bootstrap", strings.Join(opts.Images, ",")}, p.netArgs...)
	p.debug = freePort(t)
	p.args = append(p.args, "--debug-listen", p.debug)
	p.args = append(p.args, opts.Args...)
	p.Start()
	t.Cleanup(p.cleanupNode)
	return p
}

// APIOptions configure an apiserver of a test cluster.
type APIOptions struct {
	Token   string
	APIKeys []string
	Args    []string
}

// StartAPI starts `dsec api` against etcd and waits until it answers.
func StartAPI(t TB, etcd *Etcd, opts APIOptions) *Proc {
	t.Helper()
	p := &Proc{t: t, bin: filepath.Join(Binaries(t), "dsec"), token: opts.Token}
	p.Addr = freePort(t)
	p.URL = "http://" + p.Addr
	p.debug = freePort(t)
	p.args = []string{"api", "--listen", p.Addr, "--etcd", etcd.URL, "--cluster-token", opts.Token, "--log-level", "info", "--debug-listen", p.debug}
	for _, k := range opts.APIKeys {
		p.args = append(p.args, "--api-key", k)
	}
	p.args = append(p.args, opts.Args...)
	p.Start()
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("dsec api %s log:\n%s", p.Addr, p.Log())
		}
		os.Remove(p.log.Name())
	})
	return p
}

// Start starts (or restarts, with the same flags) the process and waits
// until its API answers.
func (p *Proc) Start() {
	t := p.t
	t.Helper()
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = os.Environ()
	if p.log == nil {
		f, err := os.CreateTemp("", fmt.Sprintf("dsec-cluster-%d-*.log", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		p.log = f
	}
	cmd.Stdout, cmd.Stderr = p.log, p.log
	cmd.SysProcAttr = procAttr()
	if err := start(cmd); err != nil {
		t.Fatal(err)
	}
	p.cmd, p.done = cmd, make(chan struct{})
	go func(done chan struct{}) { cmd.Wait(); close(done) }(p.done)
	deadline := time.Now().Add(5 * time.Minute)
	for {
		resp, err := http.Get(p.URL + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited during start:\n%s", p, p.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not start:\n%s", p, p.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (p *Proc) String() string {
	if p.Name != "" {
		return "dsec node " + p.Name
	}
	return "dsec api " + p.Addr
}

// Pid is the process's id (a node re-executes itself: this is the parent,
// which the node dies with).
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Running reports whether the process runs.
func (p *Proc) Running() bool { return p.cmd != nil }

// Kill kills the process (and a node's re-executed child) at once, as a
// crash would; a node's sandboxes keep running.
func (p *Proc) Kill() {
	if p.cmd == nil {
		return
	}
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
	p.cmd = nil
}

// Stop stops the process gracefully.
func (p *Proc) Stop() {
	if p.cmd == nil {
		return
	}
	syscall.Kill(p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
	p.cmd = nil
}

// Goroutines returns the stacks of the running process's goroutines (Go's
// debug=2 form), or why it cannot.
func (p *Proc) Goroutines() string {
	if p.cmd == nil {
		return "(not running)"
	}
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + p.debug + "/debug/pprof/goroutine?debug=2")
	if err != nil {
		return fmt.Sprintf("(no goroutines: %v)", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Sprintf("(goroutines cut short: %v)\n%s", err, b)
	}
	return string(b)
}

// Log returns what the process printed.
func (p *Proc) Log() string {
	b, _ := os.ReadFile(p.log.Name())
	return string(b)
}

// Client is an SDK client of the process's API, authenticated with key (a
// node takes the cluster token).
func (p *Proc) Client(key string) *dsec.Client { return dsec.New(p.URL, dsec.WithAPIKey(key)) }

// cleanupNode deletes the node's sandboxes (starting it again if it was
// killed), stops it and removes its network.
func (p *Proc) cleanupNode() {
	if p.cmd == nil {
		p.Start()
	}
	// The node API behind the cluster token, as an operator: every
	// project's sandboxes.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	c := dsec.New(p.URL, dsec.WithAPIKey(p.token), dsec.WithHTTPClient(&http.Client{Transport: roundTripper(func(r *http.Request) (*http.Response, error) {
		r.Header.Set("Dsec-Role", "admin")
		return tr.RoundTrip(r)
	})}))
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
	p.Stop()
	exec.Command("ip", "link", "del", p.netArgs[1]).Run()
	exec.Command("nft", "delete", "table", "inet", p.netArgs[5]).Run()
	exec.Command("nft", "delete", "table", "bridge", p.netArgs[5]).Run()
	if p.t.Failed() {
		p.t.Logf("%s log:\n%s", p, p.Log())
	}
	os.Remove(p.log.Name())
}

// roundTripper is a function as an http.RoundTripper.
type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
