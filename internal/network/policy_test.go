package network

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
)

func mustPolicy(t *testing.T, rules ...string) *compiled {
	t.Helper()
	p := &Policy{}
	for _, r := range rules {
		action, dest, _ := strings.Cut(r, " ")
		rule, err := ParseRule(action, dest)
		if err != nil {
			t.Fatalf("rule %q: %v", r, err)
		}
		p.Rules = append(p.Rules, rule)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	return compile(p)
}

func TestParseRule(t *testing.T) {
	for _, c := range []struct {
		action, dest string
		want         string // the rule's String, or "" for an error
	}{
		{"allow", "203.0.113.7", "allow 203.0.113.7/32"},
		{"deny", "151.101.7.9/16", "deny 151.101.0.0/16"},
		{"Allow", "PyPI.org.", "allow pypi.org"},
		{"allow", "*.pypi.org", "allow *.pypi.org"},
		{"allow", "*", "allow *"},
		{"permit", "pypi.org", ""},
		{"allow", "2001:db8::1", ""},
		{"allow", "fe80::/10", ""},
		{"allow", "py*.org", ""},
		{"allow", "*.*.org", ""},
		{"allow", "a..b", ""},
		{"allow", "", ""},
		{"allow", strings.Repeat("a", 64) + ".com", ""},
	} {
		r, err := ParseRule(c.action, c.dest)
		switch {
		case c.want == "" && err == nil:
			t.Errorf("%s %q: parsed as %q, want an error", c.action, c.dest, r)
		case c.want != "" && err != nil:
			t.Errorf("%s %q: %v", c.action, c.dest, err)
		case c.want != "" && r.String() != c.want:
			t.Errorf("%s %q: %q, want %q", c.action, c.dest, r, c.want)
		}
	}
}

func TestTheMostSpecificNameRuleDecides(t *testing.T) {
	p := mustPolicy(t, "allow *.pypi.org", "deny *.evil.pypi.org", "allow ok.evil.pypi.org", "deny pypi.org",
		"allow example.com", "deny example.com", "allow *.files.test", "deny *")
	for _, c := range []struct {
		name  string
		allow bool
		rule  string
	}{
		{"files.pypi.org", true, "allow *.pypi.org"},
		{"a.b.c.pypi.org", true, "allow *.pypi.org"},
		{"x.evil.pypi.org", false, "deny *.evil.pypi.org"},
		{"ok.evil.pypi.org", true, "allow ok.evil.pypi.org"},
		{"OK.Evil.PyPI.org.", true, "allow ok.evil.pypi.org"},
		{"pypi.org", false, "deny pypi.org"},
		{"example.com", false, "deny example.com"}, // a tie: deny wins
		{"files.test", false, "deny *"},            // *.files.test is below, not at
		{"notpypi.org", false, "deny *"},
	} {
		r, ok := p.nameRule(c.name)
		if !ok || r.Allow != c.allow || r.String() != c.rule {
			t.Errorf("%s: %v %q, want %v %q", c.name, r.Allow, r, c.allow, c.rule)
		}
	}
	if _, ok := mustPolicy(t, "allow pypi.org").nameRule("files.pypi.org"); ok {
		t.Errorf("an exact rule matched a name below it")
	}
}

func TestAStarPinNeverBeatsAnAddressDenyRule(t *testing.T) {
	p := mustPolicy(t, "allow *", "allow 0.0.0.0/0", "deny 203.0.113.0/24", "allow pypi.org", "allow *.files.test")
	in, out := netip.MustParseAddr("203.0.113.9"), netip.MustParseAddr("198.51.100.1")
	for _, c := range []struct {
		name string
		addr netip.Addr
		weak bool
	}{
		{"anything.test", in, true},   // only "*" allows it, a deny rule covers the address
		{"anything.test", out, false}, // no deny rule covers it
		{"pypi.org", in, false},       // a name rule of its own beats the /24
		{"a.files.test", in, false},
	} {
		if got := p.weakPin(c.name, c.addr); got != c.weak {
			t.Errorf("%s at %s: weak %v, want %v", c.name, c.addr, got, c.weak)
		}
	}
}

func TestTheMostSpecificAddressRuleDecides(t *testing.T) {
	p := mustPolicy(t, "allow 0.0.0.0/0", "deny 203.0.113.0/24", "allow 203.0.113.128/25", "deny 203.0.113.200",
		"allow 198.51.100.7", "deny 198.51.100.7", "allow 10.20.0.0/16", "deny 10.20.30.0/24", "allow 172.16.0.0/12")
	for _, c := range []struct {
		addr  string
		allow bool
	}{
		{"8.8.8.8", true},
		{"203.0.113.5", false},
		{"203.0.113.130", true},
		{"203.0.113.200", false},
		{"198.51.100.7", false}, // a tie: deny wins
		{"10.20.1.1", true},     // a private range, opened by a rule inside it
		{"10.20.30.1", false},
		{"10.21.0.1", false}, // 0.0.0.0/0 does not open private ranges
		{"192.168.1.1", false},
		{"172.20.0.1", true}, // a rule the private range's size opens it
	} {
		a := netip.MustParseAddr(c.addr)
		if ok, why := p.addrAllowed(a); ok != c.allow {
			t.Errorf("%s: allowed %v (%s), want %v", c.addr, ok, why, c.allow)
		}
		inRanges := false
		for _, r := range p.allow {
			if u32(r.first) <= u32(a) && u32(a) <= u32(r.last) {
				inRanges = true
			}
		}
		if inRanges != c.allow {
			t.Errorf("%s: in the flattened ranges %v, want %v (ranges %v)", c.addr, inRanges, c.allow, p.allow)
		}
	}
	if len(p.deny32) != 2 {
		t.Errorf("/32 deny rules: %v", p.deny32)
	}
}

func TestFlattenedRangesAreMergedAndSorted(t *testing.T) {
	p := mustPolicy(t, "allow 198.51.100.0/25", "allow 198.51.100.128/25", "allow 203.0.113.9")
	want := "198.51.100.0-198.51.100.255 203.0.113.9"
	var got []string
	for _, r := range p.allow {
		got = append(got, r.String())
	}
	if strings.Join(got, " ") != want {
		t.Errorf("ranges %v, want %s", got, want)
	}
	if all := mustPolicy(t, "allow 0.0.0.0/0").allow; len(all) != 5 {
		// 0.0.0.0/0 minus the four private ranges.
		t.Errorf("0.0.0.0/0 flattened to %v", all)
	}
	if none := mustPolicy(t).allow; len(none) != 0 {
		t.Errorf("an empty policy allows %v", none)
	}
}

func TestCredentialsAreValidated(t *testing.T) {
	for _, c := range []struct {
		name string
		cred Credential
		ok   bool
	}{
		{"a credential with the default header", Credential{Host: "API.example.com", Value: "Bearer x"}, true},
		{"a value with a line break", Credential{Host: "api.example.com", Value: "x\r\nEvil: 1"}, false},
		{"an empty value", Credential{Host: "api.example.com"}, false},
		{"a host that is no name", Credential{Host: "http://api", Value: "x"}, false},
		{"a header that is no name", Credential{Host: "api.example.com", Header: "X Key", Value: "x"}, false},
	} {
		p := &Policy{Credentials: []Credential{c.cred}}
		err := p.Validate()
		if (err == nil) != c.ok {
			t.Errorf("%s: %v", c.name, err)
		}
		if err == nil && (p.Credentials[0].Header != "Authorization" || p.Credentials[0].Host != "api.example.com") {
			t.Errorf("%s: normalized to %+v", c.name, p.Credentials[0])
		}
	}
}

func TestMaskReaderMasksAcrossReads(t *testing.T) {
	secret := "sk-0123456789"
	body := "a" + secret + "b" + secret[:5] + "|" + secret[5:] + secret + secret
	for _, chunk := range []int{1, 2, 3, 5, 7, 100} {
		r := &maskReader{r: &chunked{s: body, n: chunk}, secret: []byte(secret)}
		var out strings.Builder
		buf := make([]byte, 4)
		for {
			n, err := r.Read(buf)
			out.WriteString(string(buf[:n]))
			if err != nil {
				break
			}
		}
		want := strings.ReplaceAll(body, secret, strings.Repeat("*", len(secret)))
		if out.String() != want {
			t.Errorf("chunks of %d: %q, want %q", chunk, out.String(), want)
		}
	}
}

type chunked struct {
	s string
	n int
}

func (c *chunked) Read(p []byte) (int, error) {
	if c.s == "" {
		return 0, io.EOF
	}
	n := copy(p, c.s[:min(c.n, len(c.s))])
	c.s = c.s[n:]
	return n, nil
}

func (c *chunked) Close() error { return nil }

func TestTheProxyReadsTheHostName(t *testing.T) {
	hello := func(sni string) []byte {
		a, b := net.Pipe()
		go func() {
			c := tls.Client(a, &tls.Config{ServerName: sni, InsecureSkipVerify: sni == ""})
			c.Handshake()
		}()
		buf := make([]byte, 64<<10)
		n, _ := io.ReadAtLeast(b, buf, 5)
		for n < 5+int(buf[3])<<8|int(buf[4]) {
			m, err := b.Read(buf[n:])
			if err != nil {
				break
			}
			n += m
		}
		a.Close()
		b.Close()
		return buf[:n]
	}
	for _, c := range []struct {
		name, data, proto, host string
	}{
		{"a TLS ClientHello", string(hello("files.pypi.org")), "tls", "files.pypi.org"},
		{"a TLS ClientHello without SNI", string(hello("")), "tls", ""},
		{"an HTTP request", "GET /simple/ HTTP/1.1\r\nUser-Agent: pip\r\nHost: PyPI.org:80\r\n\r\n", "http", "pypi.org"},
		{"an HTTP request without Host", "GET / HTTP/1.0\r\n\r\n", "http", ""},
		{"another protocol", "SSH-2.0-OpenSSH_9.2\r\n", "tcp", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := net.Pipe()
			go func() { a.Write([]byte(c.data)); a.Close() }()
			proto, host, _ := sniff(bufio.NewReaderSize(b, maxSniff))
			if proto != c.proto || host != c.host {
				t.Errorf("%s %q, want %s %q", proto, host, c.proto, c.host)
			}
		})
	}
	// A ClientHello split over many records.
	h := hello("split.example.com")
	body := h[5:]
	var split []byte
	for len(body) > 0 {
		n := min(len(body), 50)
		split = append(split, 0x16, 3, 1, 0, byte(n))
		split = append(split, body[:n]...)
		body = body[n:]
	}
	a, b := net.Pipe()
	go func() { a.Write(split); a.Close() }()
	if _, host, _ := sniff(bufio.NewReaderSize(b, maxSniff)); host != "split.example.com" {
		t.Errorf("a ClientHello in records of 50 bytes: %q", host)
	}
}

// BenchmarkPolicyCheck times what the egress proxy decides per connection
// by name and address, under a policy of MaxRules rules.
func BenchmarkPolicyCheck(b *testing.B) {
	var rules []string
	for i := 0; len(rules) < MaxRules-2; i++ {
		rules = append(rules, fmt.Sprintf("allow 203.%d.%d.0/24", i/256, i%256), fmt.Sprintf("deny *.blocked%d.test", i))
	}
	rules = append(rules, "allow *.pypi.org", "deny 198.51.100.7")
	p := mustPolicy(&testing.T{}, rules...)
	addr := netip.MustParseAddr("203.0.77.9")
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if r, ok := p.nameRule("files.a.b.pypi.org"); !ok || !r.Allow {
			b.Fatal("name denied")
		}
		if ok, _ := p.addrAllowed(addr); !ok {
			b.Fatal("address denied")
		}
	}
}
