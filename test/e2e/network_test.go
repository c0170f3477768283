package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// outside makes a network namespace that stands for the internet: a veth to
// the host with a web server behind it, reached through a /32 route (the
// host's address on the veth is a /32 too), so it is beyond the host and
// none of the host's own networks, which sandboxes cannot reach.
func outside(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("dsecext%d", os.Getpid()%100000)
	hostIf := fmt.Sprintf("dxh%d", os.Getpid()%100000)
	sub := fmt.Sprintf("198.51.%d", 100+os.Getpid()%100)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	run("ip", "netns", "add", name)
	t.Cleanup(func() {
		exec.Command("ip", "netns", "del", name).Run()
		exec.Command("ip", "link", "del", hostIf).Run()
	})
	run("ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth9", "netns", name)
	run("ip", "addr", "add", sub+".1/32", "dev", hostIf)
	run("ip", "link", "set", hostIf, "up")
	run("ip", "route", "add", sub+".2/32", "dev", hostIf)
	run("ip", "netns", "exec", name, "ip", "addr", "add", sub+".2/32", "dev", "eth9")
	run("ip", "netns", "exec", name, "ip", "link", "set", "eth9", "up")
	run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
	run("ip", "netns", "exec", name, "ip", "route", "add", sub+".1/32", "dev", "eth9")
	run("ip", "netns", "exec", name, "ip", "route", "add", "default", "via", sub+".1")
	dir := t.TempDir()
	os.WriteFile(dir+"/index.html", []byte("hello from outside\n"), 0o644)
	srv := exec.Command("ip", "netns", "exec", name, "busybox", "httpd", "-f", "-p", "8080", "-h", dir)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	time.Sleep(200 * time.Millisecond)
	return sub + ".2"
}

// fetchFrom GETs an http://ADDR[:PORT]/ URL from inside sb with nc (the
// static busybox's wget crashes in its resolver even for literal
// addresses) and returns the body, and whether the answer was a 200.
func fetchFrom(t *testing.T, sb *dsec.Sandbox, url string) (string, bool) {
	t.Helper()
	hostPort := strings.TrimSuffix(strings.TrimPrefix(url, "http://"), "/")
	host, port, _ := net.SplitHostPort(hostPort)
	if port == "" {
		host, port = hostPort, "80"
	}
	cmd := fmt.Sprintf(`printf 'GET / HTTP/1.0\r\n\r\n' | timeout 3 nc %s %s`, host, port)
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Cmd: cmd, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	out := string(r.Stdout)
	if i := strings.Index(out, "\r\n\r\n"); i >= 0 && strings.Contains(out[:i], " 200 ") {
		return out[i+4:], true
	}
	return out, false
}

// addrOf is the IPv4 address of sb's eth0.
func addrOf(t *testing.T, sb *dsec.Sandbox) string {
	t.Helper()
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd("ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(r.Stdout))
}

func TestEgressNetwork(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs iproute2")
	}
	ext := outside(t)
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)

	// A host service on every address: sandboxes must not reach it.
	l, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("host service\n")) }))
	hostPort := l.Addr().(*net.TCPAddr).Port

	a := create(t, c, dsec.CreateOptions{Network: "egress"})
	b := create(t, c, dsec.CreateOptions{Network: "egress"})
	none := create(t, c, dsec.CreateOptions{})
	if _, err := b.Exec(ctx, dsec.Cmd("mkdir -p /srv && echo b > /srv/index.html && httpd -p 8000 -h /srv")); err != nil {
		t.Fatal(err)
	}
	// b's server answers locally, so a failure from a is the network's doing.
	if r, err := b.Exec(ctx, dsec.Cmd(`printf 'GET / HTTP/1.0\r\n\r\n' | nc 127.0.0.1 8000`)); err != nil || !strings.Contains(string(r.Stdout), " 200 ") {
		t.Fatal(err)
	}
	bAddr := addrOf(t, b)
	gateway := strings.Join(append(strings.Split(addrOf(t, a), ".")[:3], "1"), ".")
	fetch := func(sb *dsec.Sandbox, url string) (string, bool) { return fetchFrom(t, sb, url) }
	t.Run("an egress sandbox reaches the outside through NAT", func(t *testing.T) {
		if out, ok := fetch(a, "http://"+ext+":8080/"); !ok || out != "hello from outside\n" {
			t.Fatalf("got %q ok=%v", out, ok)
		}
	})
	blocked := []struct{ name, url string }{
		{"the host's services via the bridge address", fmt.Sprintf("http://%s:%d/", gateway, hostPort)},
		{"another sandbox", "http://" + bAddr + ":8000/"},
		{"cloud metadata", "http://169.254.169.254/"},
	}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, ad := range addrs {
			if ipn, ok := ad.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && !strings.HasPrefix(ipn.IP.String(), "10.") && !strings.HasPrefix(ipn.IP.String(), "198.51.") {
				blocked = append(blocked, struct{ name, url string }{"the host's own address " + ipn.IP.String(), fmt.Sprintf("http://%s:%d/", ipn.IP, hostPort)})
				break
			}
		}
	}
	for _, bl := range blocked {
		t.Run("an egress sandbox cannot reach "+bl.name, func(t *testing.T) {
			if out, ok := fetch(a, bl.url); ok {
				t.Fatalf("reached %s: %q", bl.url, out)
			}
		})
	}
	t.Run("an egress sandbox's /sys shows its own network devices, not the host's", func(t *testing.T) {
		// In a user namespace the runtime cannot mount a sysfs for a
		// namespace the node made; it would bind the host's /sys instead.
		r, err := a.Exec(ctx, dsec.Cmd("ls /sys/class/net"))
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(strings.Fields(string(r.Stdout)), " "); got != "eth0 lo" {
			t.Errorf("/sys/class/net in an egress sandbox: %q, want eth0 and lo", got)
		}
	})
	t.Run("a sandbox without network reaches nothing", func(t *testing.T) {
		if out, ok := fetch(none, "http://"+ext+":8080/"); ok {
			t.Fatalf("reached the outside: %q", out)
		}
		r, _ := none.Exec(ctx, dsec.Cmd("ls /sys/class/net"))
		if strings.TrimSpace(string(r.Stdout)) != "lo" {
			t.Fatalf("interfaces: %q", r.Stdout)
		}
	})
	t.Run("after a node restart an egress sandbox's network is re-adopted", func(t *testing.T) {
		// The restart reinstalls the rules with every port closed;
		// re-adoption opens the sandbox's port for its own addresses.
		srv.Restart()
		_, table := srv.Network()
		out, err := exec.Command("nft", "list", "set", "bridge", table, "sources").CombinedOutput()
		if err != nil || !strings.Contains(string(out), vethOf(a.ID)) {
			t.Fatalf("the bridge table after the restart (%v): %s", err, out)
		}
		if out, ok := fetch(a, "http://"+ext+":8080/"); !ok || out != "hello from outside\n" {
			t.Fatalf("got %q ok=%v", out, ok)
		}
	})
}
