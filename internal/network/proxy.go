package network

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The egress proxy: the inet table redirects every TCP connection to port
// 80 or 443 of a sandbox under a policy to it. It reads the connection's
// first bytes for a host name (a TLS ClientHello's SNI, an HTTP request's
// Host), decides the connection (Manager.proxyVerdictLocked), logs it,
// and then either refuses it or dials the original destination from the
// host and splices the two connections. Plain HTTP to the host of a
// brokered credential is not spliced but served (broker): each request
// goes on over TLS with the credential's header set.

const (
	sniffTimeout   = 10 * time.Second
	dialTimeout    = 5 * time.Second
	maxSniff       = 64 << 10
	maxProxiedConn = 1024 // per sandbox
)

// proxied is one connection the proxy carries.
type proxied struct {
	name     string
	dst      netip.Addr
	brokered bool

	mu       sync.Mutex
	closed   bool
	client   net.Conn
	upstream net.Conn
}

// close ends the connection both ways. It is idempotent.
func (p *proxied) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.client != nil {
		p.client.Close()
	}
	if p.upstream != nil {
		p.upstream.Close()
	}
}

// setUpstream records the upstream connection, unless the connection was
// cut meanwhile.
func (p *proxied) setUpstream(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.upstream = c
	return true
}

// serveProxy accepts connections on l until it is closed.
func (m *Manager) serveProxy(l *net.TCPListener) {
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go m.proxy(c)
	}
}

// originalDst is where a redirected connection was going.
func originalDst(c *net.TCPConn) (netip.AddrPort, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var out netip.AddrPort
	var gerr error
	err = raw.Control(func(fd uintptr) {
		mreq, err := unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
		if err != nil {
			gerr = err
			return
		}
		b := mreq.Multiaddr // a struct sockaddr_in
		out = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:4]))
	})
	if err == nil {
		err = gerr
	}
	return out, err
}

// proxy carries one connection.
func (m *Manager) proxy(c *net.TCPConn) {
	defer c.Close()
	from, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return
	}
	sb := m.sandboxAt(from.Addr().Unmap())
	if sb == nil {
		return
	}
	dst, err := originalDst(c)
	if err != nil {
		return
	}
	pc := &proxied{dst: dst.Addr(), client: c}
	sb.mu.Lock()
	if len(sb.conns) >= maxProxiedConn {
		sb.mu.Unlock()
		m.record(sb, ConnRecord{Protocol: "tcp", Addr: dst.Addr(), Port: dst.Port(), Reason: fmt.Sprintf("more than %d connections through the proxy", maxProxiedConn)})
		return
	}
	sb.conns[pc] = struct{}{}
	sb.mu.Unlock()
	defer func() {
		sb.mu.Lock()
		delete(sb.conns, pc)
		sb.mu.Unlock()
		pc.close()
	}()

	br := bufio.NewReaderSize(c, maxSniff)
	c.SetReadDeadline(time.Now().Add(sniffTimeout))
	proto, name, isHTTP := sniff(br)
	c.SetReadDeadline(time.Time{})
	pc.name = name
	rec := ConnRecord{Protocol: proto, Addr: dst.Addr(), Port: dst.Port(), Host: name}

	sb.mu.Lock()
	var cred *Credential
	if sb.pol != nil && isHTTP {
		if cr, ok := sb.pol.creds[name]; ok {
			cred = &cr
		}
	}
	pol := sb.pol
	allow, why := m.proxyVerdictLocked(sb, name, dst.Addr())
	sb.mu.Unlock()
	if cred != nil {
		pc.brokered = true
		m.broker(sb, pc, br, *cred)
		return
	}
	if !allow && pol != nil && name != "" {
		// An allowed name at an address not (or no longer) pinned: the
		// name's addresses now decide.
		if r, ok := pol.nameRule(name); ok && r.Allow {
			ctx, cancel := context.WithTimeout(context.Background(), 2*dnsTimeout)
			addrs, ttl, err := m.lookup(ctx, name)
			cancel()
			if err == nil {
				for _, a := range addrs {
					if a == dst.Addr() {
						m.pin(sb, pol, name, addrs, ttl)
						sb.mu.Lock()
						allow, why = m.proxyVerdictLocked(sb, name, dst.Addr())
						sb.mu.Unlock()
						break
					}
				}
			}
		}
	}
	rec.Allow, rec.Reason = allow, why
	m.record(sb, rec)
	if !allow {
		if isHTTP {
			refuse(c, http.StatusForbidden, fmt.Sprintf("dsec: egress to %s (%s) denied: %s\n", name, dst.Addr(), why))
		}
		return
	}
	d := net.Dialer{Timeout: dialTimeout}
	up, err := d.Dial("tcp4", dst.String())
	if err != nil {
		if isHTTP {
			refuse(c, http.StatusBadGateway, fmt.Sprintf("dsec: %s: %v\n", dst, err))
		}
		return
	}
	if !pc.setUpstream(up) {
		return
	}
	// What the sniff read goes first, then both ways are spliced.
	if n := br.Buffered(); n > 0 {
		b, _ := br.Peek(n)
		if _, err := up.Write(b); err != nil {
			return
		}
		br.Discard(n)
	}
	splice(c, up.(*net.TCPConn))
}

// splice copies both ways until both are done, passing on half-closes.
func splice(a, b *net.TCPConn) {
	var wg sync.WaitGroup
	wg.Add(2)
	cp := func(dst, src *net.TCPConn) {
		defer wg.Done()
		io.Copy(dst, src)
		dst.CloseWrite()
	}
	go cp(a, b)
	go cp(b, a)
	wg.Wait()
}

// refuse answers an HTTP client with status and a one-line body.
func refuse(c net.Conn, status int, body string) {
	c.SetWriteDeadline(time.Now().Add(time.Second))
	fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", status, http.StatusText(status), len(body), body)
}

// sniff reads (without consuming) the start of a connection and returns
// its protocol ("tls", "http" or "tcp") and host name (lower case, no
// port; "" if none was found). A client that sends nothing within the
// sniff timeout is "tcp" without a name.
func sniff(br *bufio.Reader) (proto, name string, isHTTP bool) {
	first, err := br.Peek(1)
	if err != nil {
		return "tcp", "", false
	}
	if first[0] == 0x16 {
		return "tls", clientHelloSNI(br), false
	}
	// HTTP: the request line and headers, up to the empty line.
	for {
		b, _ := br.Peek(br.Buffered())
		if i := bytes.Index(b, []byte("\r\n\r\n")); i >= 0 {
			if host, ok := httpHost(b[:i+2]); ok {
				return "http", host, true
			}
			return "tcp", "", false
		}
		if br.Buffered() >= maxSniff || !looksLikeHTTP(b) {
			return "tcp", "", false
		}
		if _, err := br.Peek(br.Buffered() + 1); err != nil {
			return "tcp", "", false
		}
	}
}

// looksLikeHTTP says whether b can start an HTTP/1 request.
func looksLikeHTTP(b []byte) bool {
	for _, c := range b {
		if c == ' ' {
			return true
		}
		if c < 'A' || c > 'Z' {
			return false
		}
	}
	return true
}

// httpHost finds the Host of a request head.
func httpHost(head []byte) (string, bool) {
	lines := strings.Split(string(head), "\r\n")
	if len(lines) == 0 || !strings.Contains(lines[0], " HTTP/1.") {
		return "", false
	}
	for _, l := range lines[1:] {
		k, v, ok := strings.Cut(l, ":")
		if ok && strings.EqualFold(strings.TrimSpace(k), "host") {
			return hostOnly(strings.TrimSpace(v)), true
		}
	}
	return "", true
}

// hostOnly drops a port and a trailing dot, and lowers case. An address
// is no name: "".
func hostOnly(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	h = strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
	if _, err := netip.ParseAddr(h); err == nil {
		return ""
	}
	return normalName(h)
}

// clientHelloSNI reads the server name of a TLS ClientHello, which may
// span several records, or "".
func clientHelloSNI(br *bufio.Reader) string {
	var hs []byte // handshake bytes across records
	hsLen := func() int { return int(hs[1])<<16 | int(hs[2])<<8 | int(hs[3]) }
	off := 0
	for len(hs) < 4 || len(hs) < 4+hsLen() {
		hdr, err := br.Peek(off + 5)
		if err != nil || hdr[off] != 0x16 {
			return ""
		}
		l := int(binary.BigEndian.Uint16(hdr[off+3 : off+5]))
		if off+5+l > maxSniff {
			return ""
		}
		rec, err := br.Peek(off + 5 + l)
		if err != nil {
			return ""
		}
		hs = append(hs, rec[off+5:]...)
		off += 5 + l
		if len(hs) >= 1 && hs[0] != 1 {
			return ""
		}
	}
	return sniFromClientHello(hs[4 : 4+hsLen()])
}

// sniFromClientHello parses a ClientHello's body for its server_name.
func sniFromClientHello(b []byte) string {
	skip := func(n int) bool {
		if len(b) < n {
			return false
		}
		b = b[n:]
		return true
	}
	vec := func(lenBytes int) ([]byte, bool) {
		if len(b) < lenBytes {
			return nil, false
		}
		n := 0
		for i := 0; i < lenBytes; i++ {
			n = n<<8 | int(b[i])
		}
		if len(b) < lenBytes+n {
			return nil, false
		}
		v := b[lenBytes : lenBytes+n]
		b = b[lenBytes+n:]
		return v, true
	}
	if !skip(2 + 32) { // version, random
		return ""
	}
	for _, l := range []int{1, 2, 1} { // session id, cipher suites, compression
		if _, ok := vec(l); !ok {
			return ""
		}
	}
	exts, ok := vec(2)
	if !ok {
		return ""
	}
	for len(exts) >= 4 {
		typ := binary.BigEndian.Uint16(exts)
		l := int(binary.BigEndian.Uint16(exts[2:]))
		if len(exts) < 4+l {
			return ""
		}
		data := exts[4 : 4+l]
		exts = exts[4+l:]
		if typ != 0 || len(data) < 2 {
			continue
		}
		list := data[2:]
		for len(list) >= 3 {
			nt, nl := list[0], int(binary.BigEndian.Uint16(list[1:]))
			if len(list) < 3+nl {
				return ""
			}
			if nt == 0 {
				return normalName(string(list[3 : 3+nl]))
			}
			list = list[3+nl:]
		}
	}
	return ""
}

// hopHeaders are the hop-by-hop headers the broker does not pass on.
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// broker serves the sandbox's plain HTTP requests to cred's host: each
// goes on over TLS to the host (resolved and checked like any
// destination) with the credential's header set, and its answer comes
// back with the credential's value masked wherever it appears.
func (m *Manager) broker(sb *sandboxNet, pc *proxied, br *bufio.Reader, cred Credential) {
	c := pc.client
	for {
		c.SetReadDeadline(time.Now().Add(2 * time.Minute))
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		c.SetReadDeadline(time.Time{})
		rec := ConnRecord{Protocol: "http", Port: 443, Host: cred.Host, Brokered: true}
		if host := hostOnly(req.Host); host != cred.Host {
			rec.Host, rec.Reason = host, "a brokered connection to "+cred.Host+" asked for another host"
			m.record(sb, rec)
			refuse(c, http.StatusForbidden, "dsec: one connection, one brokered host\n")
			return
		}
		for _, h := range hopHeaders {
			req.Header.Del(h)
		}
		req.Header.Del("Accept-Encoding") // the transport decompresses, so masking sees plain bytes
		req.Header.Set(cred.Header, cred.Value)
		req.URL.Scheme, req.URL.Host, req.RequestURI = "https", cred.Host, ""
		req.Host = cred.Host
		ctx, cancel := context.WithCancel(context.Background())
		resp, err := m.brokerTransport.RoundTrip(req.WithContext(withBrokerCtx(ctx, sb, &rec)))
		if err != nil {
			cancel()
			rec.Reason = "brokered credential (upstream failed)"
			m.record(sb, rec)
			refuse(c, http.StatusBadGateway, fmt.Sprintf("dsec: %s: %v\n", cred.Host, maskString(err.Error(), cred.Value)))
			return
		}
		rec.Allow, rec.Reason = true, "brokered credential"
		m.record(sb, rec)
		for k, vs := range resp.Header {
			for i, v := range vs {
				resp.Header[k][i] = maskString(v, cred.Value)
			}
		}
		resp.Body = &maskReader{r: resp.Body, secret: []byte(cred.Value)}
		resp.Close = req.Close
		err = resp.Write(c)
		resp.Body.Close()
		cancel()
		if err != nil || req.Close {
			return
		}
	}
}

type brokerCtxKey struct{}

type brokerDial struct {
	sb  *sandboxNet
	rec *ConnRecord
}

func withBrokerCtx(ctx context.Context, sb *sandboxNet, rec *ConnRecord) context.Context {
	return context.WithValue(ctx, brokerCtxKey{}, brokerDial{sb, rec})
}

// newBrokerTransport is the broker's HTTP client side: TLS verified
// against roots (nil: the host's), connections by name resolved through
// the node's upstream resolvers and refused to what no sandbox reaches.
func (m *Manager) newBrokerTransport(roots *x509.CertPool) *http.Transport {
	return &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, port, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			addrs, _, err := m.lookup(ctx, host)
			if err != nil {
				return nil, err
			}
			var last error = fmt.Errorf("no address")
			for _, a := range addrs {
				if never, what := m.never(a); never {
					last = fmt.Errorf("%s resolves to %s (%s)", host, a, what)
					continue
				}
				if bd, ok := ctx.Value(brokerCtxKey{}).(brokerDial); ok {
					bd.rec.Addr = a
				}
				d := net.Dialer{Timeout: dialTimeout}
				c, err := d.DialContext(ctx, "tcp4", net.JoinHostPort(a.String(), port))
				if err == nil {
					return c, nil
				}
				last = err
			}
			return nil, last
		},
		TLSClientConfig:       &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:     true,
		MaxIdleConnsPerHost:   16,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 5 * time.Minute,
	}
}

// maskString replaces every occurrence of secret in s with as many '*'.
func maskString(s, secret string) string {
	if secret == "" {
		return s
	}
	return strings.ReplaceAll(s, secret, strings.Repeat("*", len(secret)))
}

// maskReader passes r on with every occurrence of secret replaced by as
// many '*' (the length stays), holding back the bytes that may start one.
type maskReader struct {
	r      io.ReadCloser
	secret []byte
	out    []byte // masked, ready
	carry  []byte // read, not yet safe to pass on
	eof    error
}

func (m *maskReader) Read(p []byte) (int, error) {
	for len(m.out) == 0 {
		if m.eof != nil {
			return 0, m.eof
		}
		buf := make([]byte, 32<<10)
		n, err := m.r.Read(buf)
		data := append(m.carry, buf[:n]...)
		for i := bytes.Index(data, m.secret); i >= 0; {
			copy(data[i:], bytes.Repeat([]byte("*"), len(m.secret)))
			j := bytes.Index(data[i+len(m.secret):], m.secret)
			if j < 0 {
				break
			}
			i += len(m.secret) + j
		}
		if err != nil {
			m.out, m.carry, m.eof = data, nil, err
			continue
		}
		keep := min(len(m.secret)-1, len(data))
		m.out = data[:len(data)-keep]
		m.carry = append([]byte(nil), data[len(data)-keep:]...)
	}
	n := copy(p, m.out)
	m.out = m.out[n:]
	return n, nil
}

func (m *maskReader) Close() error { return m.r.Close() }

var _ = slog.Any
