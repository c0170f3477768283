package dsectest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/opendsec/dsec/internal/nsthread"
)

// Internet is a network namespace that plays the internet for egress
// sandboxes (there is none on a test machine): the host reaches its
// addresses through /32 routes over a veth whose host end is a /32 too,
// so none of it is one of the host's networks (which sandboxes never
// reach). It runs an authoritative DNS server for a zone the test sets
// (every name it is asked is recorded), and on each web address HTTP (80,
// 8080) and HTTPS (443, with a certificate for any name, signed by a CA
// whose PEM is in CAFile), and a UDP echo on 9999 that records what it
// gets. Every web server answers "<address> <host> <path>"; /headers
// answers the request's headers as "Name: value" lines, /bytes?n=N N
// bytes, /sink the number of bytes of the request's body.
type Internet struct {
	// NS is the namespace's path.
	NS string
	// DNS is the DNS server's address (port 53).
	DNS netip.Addr
	// Web are the web servers' addresses.
	Web []netip.Addr
	// CAFile holds the PEM of the CA of the HTTPS servers.
	CAFile string
	// HostAddr is the host's own address on the veth to the namespace (a
	// /32: one of the host's addresses, not one of its networks' peers).
	HostAddr netip.Addr

	ca    *x509.Certificate
	caKey *ecdsa.PrivateKey

	mu      sync.Mutex
	zone    map[string][]netip.Addr
	queries []string
	headers []http.Header
	udp     []string
	certs   map[string]*tls.Certificate
}

// StartInternet makes an internet with web web servers (at least one).
// Its addresses are in 198.19.<n>.64/26 (RFC 2544 space, which no host
// uses), n derived from the test process, so concurrent test processes
// do not meet.
func StartInternet(t TB, web int) *Internet {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs iproute2")
	}
	octet := 20 + os.Getpid()%200
	name := fmt.Sprintf("dsecinet%d", os.Getpid()%100000)
	hostIf := fmt.Sprintf("dhi%d", os.Getpid()%100000)
	hostAddr := fmt.Sprintf("198.19.%d.64", octet)
	in := &Internet{NS: "/run/netns/" + name, zone: map[string][]netip.Addr{}, certs: map[string]*tls.Certificate{}}
	in.HostAddr = netip.MustParseAddr(hostAddr)
	in.DNS = netip.MustParseAddr(fmt.Sprintf("198.19.%d.65", octet))
	for i := 0; i < max(web, 1); i++ {
		in.Web = append(in.Web, netip.MustParseAddr(fmt.Sprintf("198.19.%d.%d", octet, 66+i)))
	}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	exec.Command("ip", "netns", "del", name).Run()
	exec.Command("ip", "link", "del", hostIf).Run()
	run("ip", "netns", "add", name)
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", hostIf).Run()
		exec.Command("ip", "netns", "del", name).Run()
	})
	run("ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth9", "netns", name)
	run("ip", "addr", "add", hostAddr+"/32", "dev", hostIf)
	run("ip", "link", "set", hostIf, "up")
	inside := []string{"ip", "netns", "exec", name}
	run(append(inside, "ip", "link", "set", "eth9", "up")...)
	run(append(inside, "ip", "link", "set", "lo", "up")...)
	run(append(inside, "ip", "route", "add", hostAddr+"/32", "dev", "eth9")...)
	run(append(inside, "ip", "route", "add", "default", "via", hostAddr)...)
	for _, a := range append([]netip.Addr{in.DNS}, in.Web...) {
		run(append(inside, "ip", "addr", "add", a.String()+"/32", "dev", "eth9")...)
		run("ip", "route", "add", a.String()+"/32", "dev", hostIf)
	}
	in.makeCA(t)

	var udp *net.UDPConn
	var echoes []*net.UDPConn
	var listeners []net.Listener
	err := nsthread.NetNS(in.NS, func() error {
		var err error
		if udp, err = net.ListenUDP("udp4", &net.UDPAddr{IP: in.DNS.AsSlice(), Port: 53}); err != nil {
			return err
		}
		l, err := net.Listen("tcp4", netip.AddrPortFrom(in.DNS, 53).String())
		if err != nil {
			return err
		}
		listeners = append(listeners, l)
		for _, a := range in.Web {
			e, err := net.ListenUDP("udp4", &net.UDPAddr{IP: a.AsSlice(), Port: 9999})
			if err != nil {
				return err
			}
			echoes = append(echoes, e)
			for _, port := range []uint16{80, 8080, 443} {
				l, err := net.Listen("tcp4", netip.AddrPortFrom(a, port).String())
				if err != nil {
					return err
				}
				listeners = append(listeners, l)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the internet's servers: %v", err)
	}
	t.Cleanup(func() {
		udp.Close()
		for _, e := range echoes {
			e.Close()
		}
		for _, l := range listeners {
			l.Close()
		}
	})
	go in.serveDNSUDP(udp)
	for _, e := range echoes {
		go in.echo(e)
	}
	go in.serveDNSTCP(listeners[0])
	handler := http.HandlerFunc(in.serveWeb)
	for _, l := range listeners[1:] {
		if strings.HasSuffix(l.Addr().String(), ":443") {
			tl := tls.NewListener(l, &tls.Config{GetCertificate: in.certificate})
			go (&http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}).Serve(tl)
			continue
		}
		go (&http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}).Serve(l)
	}
	return in
}

// Set makes name (an exact name, or "*.suffix") resolve to addrs; no
// addresses removes it.
func (in *Internet) Set(name string, addrs ...netip.Addr) {
	in.mu.Lock()
	defer in.mu.Unlock()
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	if len(addrs) == 0 {
		delete(in.zone, name)
		return
	}
	in.zone[name] = addrs
}

// Queries are the names the DNS server was asked, in order.
func (in *Internet) Queries() []string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]string(nil), in.queries...)
}

// UDP are the datagrams the echo servers got, as "<address> <payload>".
func (in *Internet) UDP() []string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]string(nil), in.udp...)
}

func (in *Internet) echo(c *net.UDPConn) {
	buf := make([]byte, 65535)
	local := c.LocalAddr().(*net.UDPAddr).IP.String()
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		in.mu.Lock()
		in.udp = append(in.udp, local+" "+string(buf[:n]))
		in.mu.Unlock()
		c.WriteToUDPAddrPort(buf[:n], from)
	}
}

// Headers are the headers of every request to /headers, in order.
func (in *Internet) Headers() []http.Header {
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]http.Header(nil), in.headers...)
}

func (in *Internet) lookup(name string) []netip.Addr {
	in.mu.Lock()
	defer in.mu.Unlock()
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	in.queries = append(in.queries, name)
	if a, ok := in.zone[name]; ok {
		return a
	}
	for rest := name; strings.Contains(rest, "."); {
		rest = rest[strings.IndexByte(rest, '.')+1:]
		if a, ok := in.zone["*."+rest]; ok {
			return a
		}
	}
	return nil
}

func (in *Internet) answer(q []byte) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(q)
	if err != nil {
		return nil
	}
	qs, err := p.AllQuestions()
	if err != nil || len(qs) != 1 {
		return nil
	}
	addrs := in.lookup(qs[0].Name.String())
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired, RecursionAvailable: true}
	if addrs == nil {
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.StartQuestions()
	b.Question(qs[0])
	b.StartAnswers()
	if qs[0].Type == dnsmessage.TypeA {
		for _, a := range addrs {
			b.AResource(dnsmessage.ResourceHeader{Name: qs[0].Name, Class: dnsmessage.ClassINET, TTL: 30}, dnsmessage.AResource{A: a.As4()})
		}
	}
	out, _ := b.Finish()
	return out
}

func (in *Internet) serveDNSUDP(c *net.UDPConn) {
	buf := make([]byte, 65535)
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		if a := in.answer(buf[:n]); a != nil {
			c.WriteToUDPAddrPort(a, from)
		}
	}
}

func (in *Internet) serveDNSTCP(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			for {
				c.SetDeadline(time.Now().Add(10 * time.Second))
				var lb [2]byte
				if _, err := io.ReadFull(c, lb[:]); err != nil {
					return
				}
				q := make([]byte, binary.BigEndian.Uint16(lb[:]))
				if _, err := io.ReadFull(c, q); err != nil {
					return
				}
				a := in.answer(q)
				if a == nil {
					return
				}
				c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(a))), a...))
			}
		}()
	}
}

func (in *Internet) serveWeb(w http.ResponseWriter, r *http.Request) {
	local := r.Context().Value(http.LocalAddrContextKey).(net.Addr).String()
	host, _, _ := net.SplitHostPort(local)
	if r.URL.Path == "/headers" {
		in.mu.Lock()
		in.headers = append(in.headers, r.Header.Clone())
		in.mu.Unlock()
		var keys []string
		for k := range r.Header {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(w, "%s: %s\n", k, strings.Join(r.Header[k], ", "))
		}
		return
	}
	if r.URL.Path == "/sink" {
		n, _ := io.Copy(io.Discard, r.Body)
		fmt.Fprintf(w, "%d\n", n)
		return
	}
	if r.URL.Path == "/bytes" {
		var n int64
		fmt.Sscan(r.URL.Query().Get("n"), &n)
		w.Header().Set("Content-Length", fmt.Sprint(n))
		chunk := make([]byte, 32<<10)
		for n > 0 {
			k := min(n, int64(len(chunk)))
			if _, err := w.Write(chunk[:k]); err != nil {
				return
			}
			n -= k
		}
		return
	}
	fmt.Fprintf(w, "%s %s %s\n", host, r.Host, r.URL.Path)
}

func (in *Internet) makeCA(t TB) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "dsectest internet CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	in.ca, _ = x509.ParseCertificate(der)
	in.caKey = key
	in.CAFile = filepath.Join(t.TempDir(), "internet-ca.pem")
	if err := os.WriteFile(in.CAFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
}

// certificate issues (once per name) a certificate for the ClientHello's
// server name.
func (in *Internet) certificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	name := hello.ServerName
	if name == "" {
		name = "no-sni.invalid"
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if c, ok := in.certs[name]; ok {
		return c, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, in.ca, &key.PublicKey, in.caKey)
	if err != nil {
		return nil, err
	}
	c := &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	in.certs[name] = c
	return c, nil
}
