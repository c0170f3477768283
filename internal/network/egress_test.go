package network

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/opendsec/dsec/internal/dsectest"
	"github.com/opendsec/dsec/internal/nsthread"
)

// egressSetup starts an internet (two web servers: allowed.test and
// denied.test) and a manager whose resolvers and trusted CAs are the
// internet's.
func egressSetup(t *testing.T) (*Manager, *dsectest.Internet) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	in := dsectest.StartInternet(t, 2)
	in.Set("allowed.test", in.Web[0])
	in.Set("*.allowed.test", in.Web[0])
	in.Set("denied.test", in.Web[1])
	in.Set("*.denied.test", in.Web[1])
	in.Set("api.broker.test", in.Web[1])
	m := newManagerWith(t, func(c *Config) {
		c.DNS = []string{in.DNS.String()}
		c.TrustedCAs = in.CAFile
	})
	return m, in
}

// someResolver is where the sandbox sends its queries: any address will
// do, the node's resolver answers them all.
var someResolver = netip.MustParseAddrPort("203.0.113.53:53")

// query asks name's A records from inside a.
func query(t *testing.T, a *Attachment, name string) (dnsmessage.RCode, []netip.Addr) {
	t.Helper()
	var rcode dnsmessage.RCode
	var addrs []netip.Addr
	err := nsthread.NetNS(a.NetNS, func() error {
		c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(someResolver))
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		n, _ := dnsmessage.NewName(name + ".")
		b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: 4242, RecursionDesired: true})
		b.StartQuestions()
		b.Question(dnsmessage.Question{Name: n, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET})
		q, _ := b.Finish()
		if _, err := c.Write(q); err != nil {
			return err
		}
		buf := make([]byte, 4096)
		l, err := c.Read(buf)
		if err != nil {
			return err
		}
		var p dnsmessage.Parser
		h, err := p.Start(buf[:l])
		if err != nil {
			return err
		}
		if h.ID != 4242 {
			return fmt.Errorf("answer ID %d", h.ID)
		}
		rcode = h.RCode
		addrs, _ = answerAddrs(buf[:l])
		return nil
	})
	if err != nil {
		t.Fatalf("query %s: %v", name, err)
	}
	return rcode, addrs
}

// get sends an HTTP GET for host to addr from inside a and returns the
// answer's first line and body, or the error.
func get(t *testing.T, a *Attachment, addr netip.AddrPort, host, path string) (string, error) {
	t.Helper()
	var out string
	err := nsthread.NetNS(a.NetNS, func() error {
		c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, host)
		b, err := io.ReadAll(c)
		out = string(b)
		if len(b) == 0 && err == nil {
			err = io.ErrUnexpectedEOF
		}
		return err
	})
	if i := strings.Index(out, "\r\n\r\n"); i >= 0 {
		out = strings.SplitN(out, "\r\n", 2)[0] + " | " + out[i+4:]
	}
	return out, err
}

// handshake makes a TLS connection with sni to addr from inside a and
// GETs /, verifying the server against the internet's CA.
func handshake(t *testing.T, a *Attachment, in *dsectest.Internet, addr netip.AddrPort, sni string) (string, error) {
	t.Helper()
	pem, err := os.ReadFile(in.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	var out string
	err = nsthread.NetNS(a.NetNS, func() error {
		d := net.Dialer{Timeout: 3 * time.Second}
		c, err := tls.DialWithDialer(&d, "tcp4", addr.String(), &tls.Config{ServerName: sni, RootCAs: roots})
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", sni)
		b, _ := io.ReadAll(c)
		out = string(b[strings.Index(string(b), "\r\n\r\n")+4:])
		return nil
	})
	return out, err
}

// dial opens a TCP connection to addr from inside a.
func dial(t *testing.T, a *Attachment, addr netip.AddrPort) error {
	t.Helper()
	return nsthread.NetNS(a.NetNS, func() error {
		c, err := net.DialTimeout("tcp4", addr.String(), 2*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
}

func parsePolicy(t *testing.T, rules ...string) *Policy {
	t.Helper()
	return &mustPolicy(t, rules...).Policy
}

func TestAnEgressPolicyIsEnforced(t *testing.T) {
	m, in := egressSetup(t)
	allowedWeb, deniedWeb := in.Web[0], in.Web[1]
	a, err := m.Setup(context.Background(), fmt.Sprintf("sb%d-p", os.Getpid()), Options{
		Mode: ModeEgress, Policy: parsePolicy(t, "allow *.allowed.test", "allow allowed.test", "deny *.denied.test"),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release(a)
	at := func(addr netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(addr, port) }

	t.Run("an allowed name resolves", func(t *testing.T) {
		rcode, addrs := query(t, a, "www.allowed.test")
		if rcode != dnsmessage.RCodeSuccess || len(addrs) != 1 || addrs[0] != allowedWeb {
			t.Fatalf("rcode %v, addresses %v", rcode, addrs)
		}
	})
	t.Run("its address is reachable on any port once resolved", func(t *testing.T) {
		if out, err := get(t, a, at(allowedWeb, 8080), "www.allowed.test", "/"); err != nil || !strings.Contains(out, " 200 ") {
			t.Fatalf("%q %v", out, err)
		}
	})
	t.Run("a denied name's query never leaves the node", func(t *testing.T) {
		rcode, addrs := query(t, a, "exfiltrated-data.denied.test")
		if rcode != dnsmessage.RCodeNameError || len(addrs) > 0 {
			t.Fatalf("rcode %v, addresses %v", rcode, addrs)
		}
		for _, q := range in.Queries() {
			if strings.Contains(q, "exfiltrated-data") {
				t.Fatalf("the internet's DNS server was asked %s", q)
			}
		}
	})
	t.Run("a name no rule matches does not resolve either", func(t *testing.T) {
		if rcode, _ := query(t, a, "elsewhere.test"); rcode != dnsmessage.RCodeNameError {
			t.Fatalf("rcode %v", rcode)
		}
	})
	t.Run("an address no rule allows is unreachable", func(t *testing.T) {
		if err := dial(t, a, at(deniedWeb, 8080)); err == nil {
			t.Fatal("connected")
		}
	})
	t.Run("HTTP to a denied name is refused even at an allowed address", func(t *testing.T) {
		out, err := get(t, a, at(allowedWeb, 80), "x.denied.test", "/")
		if err != nil || !strings.Contains(out, " 403 ") {
			t.Fatalf("%q %v", out, err)
		}
	})
	t.Run("HTTP to an allowed name passes the proxy", func(t *testing.T) {
		out, err := get(t, a, at(allowedWeb, 80), "www.allowed.test", "/hello")
		if err != nil || !strings.Contains(out, allowedWeb.String()+" www.allowed.test /hello") {
			t.Fatalf("%q %v", out, err)
		}
	})
	t.Run("HTTP naming an allowed host at another address is refused", func(t *testing.T) {
		out, err := get(t, a, at(deniedWeb, 80), "www.allowed.test", "/")
		if err != nil || !strings.Contains(out, " 403 ") {
			t.Fatalf("%q %v", out, err)
		}
	})
	t.Run("TLS to an allowed name passes the proxy untouched", func(t *testing.T) {
		out, err := handshake(t, a, in, at(allowedWeb, 443), "www.allowed.test")
		if err != nil || !strings.Contains(out, "www.allowed.test") {
			t.Fatalf("%q %v", out, err)
		}
	})
	t.Run("TLS to a denied name is cut", func(t *testing.T) {
		if _, err := handshake(t, a, in, at(allowedWeb, 443), "x.denied.test"); err == nil {
			t.Fatal("handshake succeeded")
		}
	})
	t.Run("the host itself is unreachable", func(t *testing.T) {
		// Port 53 is DNS, whatever the address: the node's resolver answers.
		for _, port := range []uint16{22, 7070, uint16(m.proxyPort), uint16(m.dnsPort)} {
			if err := dial(t, a, at(m.gateway, port)); err == nil {
				t.Errorf("reached the gateway's port %d", port)
			}
		}
	})
	t.Run("every connection is logged with its verdict", func(t *testing.T) {
		recs, _ := m.NetworkLog(a, 0, 0)
		var got []string
		for _, r := range recs {
			v := "deny"
			if r.Allow {
				v = "allow"
			}
			got = append(got, fmt.Sprintf("%s %s %s:%d %s (%s)", v, r.Protocol, r.Addr, r.Port, r.Host, r.Reason))
		}
		log := strings.Join(got, "\n")
		for _, want := range []string{
			"allow dns 10.", "www.allowed.test (allow *.allowed.test)",
			"deny dns", "exfiltrated-data.denied.test (deny *.denied.test)",
			"elsewhere.test (no rule)",
			fmt.Sprintf("allow tcp %s:8080  (pinned: www.allowed.test)", allowedWeb),
			fmt.Sprintf("deny tcp %s:8080  (no rule)", deniedWeb),
			fmt.Sprintf("deny http %s:80 x.denied.test (deny *.denied.test)", allowedWeb),
			fmt.Sprintf("allow http %s:80 www.allowed.test", allowedWeb),
			fmt.Sprintf("allow tls %s:443 www.allowed.test", allowedWeb),
			fmt.Sprintf("deny tls %s:443 x.denied.test", allowedWeb),
			":22  (the host)",
		} {
			if !strings.Contains(log, want) {
				t.Errorf("the log lacks %q:\n%s", want, log)
			}
		}
	})
	t.Run("a new policy applies to the next connection", func(t *testing.T) {
		if err := m.SetPolicy(a, parsePolicy(t, "allow "+deniedWeb.String())); err != nil {
			t.Fatal(err)
		}
		if err := dial(t, a, at(deniedWeb, 8080)); err != nil {
			t.Errorf("the newly allowed address: %v", err)
		}
		if err := dial(t, a, at(allowedWeb, 8080)); err == nil {
			t.Errorf("an address pinned under the old policy is still reachable")
		}
		if rcode, _ := query(t, a, "www.allowed.test"); rcode != dnsmessage.RCodeNameError {
			t.Errorf("a name allowed by the old policy resolves: %v", rcode)
		}
	})
	t.Run("an empty policy denies everything", func(t *testing.T) {
		if err := m.SetPolicy(a, &Policy{}); err != nil {
			t.Fatal(err)
		}
		if err := dial(t, a, at(deniedWeb, 8080)); err == nil {
			t.Errorf("connected")
		}
	})
	t.Run("no policy is unrestricted egress again", func(t *testing.T) {
		if err := m.SetPolicy(a, nil); err != nil {
			t.Fatal(err)
		}
		for _, w := range in.Web {
			if err := dial(t, a, at(w, 8080)); err != nil {
				t.Errorf("%s: %v", w, err)
			}
		}
		if err := dial(t, a, at(m.gateway, 22)); err == nil {
			t.Errorf("reached the host")
		}
	})
}

func TestABandwidthLimitHoldsEachWay(t *testing.T) {
	m, in := egressSetup(t)
	const mbps = 40
	a, err := m.Setup(context.Background(), fmt.Sprintf("sb%d-bw", os.Getpid()), Options{Mode: ModeEgress, BandwidthMbps: mbps})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release(a)
	const size = 8 << 20 // 1.6 s at the limit
	web := netip.AddrPortFrom(in.Web[0], 8080).String()
	rate := func(t *testing.T, what string, fn func(c net.Conn) (int64, error)) float64 {
		t.Helper()
		var mbit float64
		err := nsthread.NetNS(a.NetNS, func() error {
			c, err := net.DialTimeout("tcp4", web, 3*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(30 * time.Second))
			t0 := time.Now()
			n, err := fn(c)
			if err != nil {
				return err
			}
			if n < size {
				return fmt.Errorf("%d bytes", n)
			}
			mbit = float64(n) * 8 / 1e6 / time.Since(t0).Seconds()
			return nil
		})
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Logf("%s: %.1f Mbit/s (limit %d)", what, mbit, mbps)
		return mbit
	}
	t.Run("a download is held to the limit", func(t *testing.T) {
		got := rate(t, "download", func(c net.Conn) (int64, error) {
			fmt.Fprintf(c, "GET /bytes?n=%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", size)
			return io.Copy(io.Discard, c)
		})
		if got > mbps*1.25 || got < mbps*0.5 {
			t.Errorf("%.1f Mbit/s, limit %d", got, mbps)
		}
	})
	t.Run("an upload is held to the limit", func(t *testing.T) {
		got := rate(t, "upload", func(c net.Conn) (int64, error) {
			fmt.Fprintf(c, "POST /sink HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", size)
			if _, err := io.CopyN(c, zeros{}, size); err != nil {
				return 0, err
			}
			b, err := io.ReadAll(c) // the answer: after the whole body arrived
			if !strings.Contains(string(b), fmt.Sprint(size)) {
				return 0, fmt.Errorf("answer %q: %v", b, err)
			}
			return size, nil
		})
		if got > mbps*1.25 || got < mbps*0.5 {
			t.Errorf("%.1f Mbit/s, limit %d", got, mbps)
		}
	})
	t.Run("no limit is the default qdisc again", func(t *testing.T) {
		if err := m.SetBandwidth(a, 0); err != nil {
			t.Fatal(err)
		}
		if got := rate(t, "unlimited download", func(c net.Conn) (int64, error) {
			fmt.Fprintf(c, "GET /bytes?n=%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", size)
			return io.Copy(io.Discard, c)
		}); got < mbps*2 {
			t.Errorf("%.1f Mbit/s without a limit", got)
		}
	})
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
