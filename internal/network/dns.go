package network

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// The node's resolver for sandboxes under a policy: the inet table
// redirects every DNS query (UDP and TCP port 53, to any address) such a
// sandbox sends to it. It answers a name the policy does not allow with
// NXDOMAIN, so the query never leaves the node (no tunnelling through the
// names of a denied domain), forwards an allowed one to the node's
// upstream resolvers, and pins the addresses of the answer for the
// sandbox (egress.go).

const (
	dnsTimeout    = 2 * time.Second
	maxDNSMessage = 65535
	// dnsInFlight bounds the queries the resolver works on at once.
	dnsInFlight = 256
)

// serveDNSUDP answers queries on conn until it is closed.
func (m *Manager) serveDNSUDP(conn *net.UDPConn) {
	sem := make(chan struct{}, dnsInFlight)
	buf := make([]byte, maxDNSMessage)
	for {
		n, from, err := conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		q := append([]byte(nil), buf[:n]...)
		select {
		case sem <- struct{}{}:
		default:
			continue // overloaded: the client retries
		}
		go func() {
			defer func() { <-sem }()
			if a := m.resolve(from.Addr().Unmap(), q, false); a != nil {
				conn.WriteToUDPAddrPort(a, from)
			}
		}()
	}
}

// serveDNSTCP answers queries over TCP on l until it is closed.
func (m *Manager) serveDNSTCP(l *net.TCPListener) {
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go func() {
			defer c.Close()
			from := netip.MustParseAddrPort(c.RemoteAddr().String()).Addr().Unmap()
			for {
				c.SetDeadline(time.Now().Add(10 * time.Second))
				q, err := readTCPMessage(c)
				if err != nil {
					return
				}
				a := m.resolve(from, q, true)
				if a == nil || writeTCPMessage(c, a) != nil {
					return
				}
			}
		}()
	}
}

func readTCPMessage(r io.Reader) ([]byte, error) {
	var l [2]byte
	if _, err := io.ReadFull(r, l[:]); err != nil {
		return nil, err
	}
	b := make([]byte, binary.BigEndian.Uint16(l[:]))
	_, err := io.ReadFull(r, b)
	return b, err
}

func writeTCPMessage(w io.Writer, b []byte) error {
	_, err := w.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(b))), b...))
	return err
}

// resolve answers query q from the sandbox at src: nil drops it.
func (m *Manager) resolve(src netip.Addr, q []byte, tcp bool) []byte {
	sb := m.sandboxAt(src)
	var p dnsmessage.Parser
	h, err := p.Start(q)
	if err != nil || h.Response {
		return nil
	}
	questions, err := p.AllQuestions()
	if err != nil || len(questions) != 1 {
		return answerCode(h, questions, dnsmessage.RCodeFormatError)
	}
	if sb == nil {
		return answerCode(h, questions, dnsmessage.RCodeRefused)
	}
	name := normalName(questions[0].Name.String())
	rec := ConnRecord{Protocol: "dns", Addr: m.gateway, Port: 53, Host: name}
	allow, why, pol := sb.nameVerdict(name)
	if !allow {
		rec.Reason = why
		m.record(sb, rec)
		return answerCode(h, questions, dnsmessage.RCodeNameError)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*dnsTimeout)
	defer cancel()
	a, err := m.forward(ctx, q, tcp)
	if err != nil {
		rec.Allow, rec.Reason = true, why+" (upstream failed: "+err.Error()+")"
		m.record(sb, rec)
		return answerCode(h, questions, dnsmessage.RCodeServerFailure)
	}
	rec.Allow, rec.Reason = true, why
	m.record(sb, rec)
	if pol != nil {
		if addrs, ttl := answerAddrs(a); len(addrs) > 0 && pinsName(pol, name) {
			m.pin(sb, pol, name, addrs, ttl)
		}
	}
	return a
}

// pinsName says whether the answers for name are pinned under pol: those
// a name rule allows (a credential's host alone is reachable through the
// proxy only).
func pinsName(pol *compiled, name string) bool {
	r, ok := pol.nameRule(name)
	return ok && r.Allow
}

// answerCode is an empty answer to h's query with rcode.
func answerCode(h dnsmessage.Header, qs []dnsmessage.Question, rcode dnsmessage.RCode) []byte {
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{
		ID: h.ID, Response: true, OpCode: h.OpCode, RecursionDesired: h.RecursionDesired,
		RecursionAvailable: true, RCode: rcode,
	})
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil
	}
	for _, q := range qs {
		if b.Question(q) != nil {
			return nil
		}
	}
	out, err := b.Finish()
	if err != nil {
		return nil
	}
	return out
}

// answerAddrs are the IPv4 addresses in an answer and the least TTL among
// its answer records.
func answerAddrs(a []byte) ([]netip.Addr, time.Duration) {
	var p dnsmessage.Parser
	if _, err := p.Start(a); err != nil {
		return nil, 0
	}
	if err := p.SkipAllQuestions(); err != nil {
		return nil, 0
	}
	var out []netip.Addr
	ttl := maxPin
	for {
		h, err := p.AnswerHeader()
		if err != nil {
			break
		}
		ttl = min(ttl, time.Duration(h.TTL)*time.Second)
		if h.Type != dnsmessage.TypeA {
			p.SkipAnswer()
			continue
		}
		r, err := p.AResource()
		if err != nil {
			break
		}
		out = append(out, netip.AddrFrom4(r.A))
	}
	return out, ttl
}

// forward asks the upstream resolvers q (its ID replaced by a random one
// and restored in the answer), in turn until one answers.
func (m *Manager) forward(ctx context.Context, q []byte, tcp bool) ([]byte, error) {
	if len(m.dns) == 0 {
		return nil, fmt.Errorf("the node has no resolvers")
	}
	if len(q) < 12 {
		return nil, fmt.Errorf("short query")
	}
	id := binary.BigEndian.Uint16(q)
	out := append([]byte(nil), q...)
	var rid [2]byte
	rand.Read(rid[:])
	copy(out, rid[:])
	var last error
	for _, server := range m.dns {
		a, err := exchange(ctx, netip.AddrPortFrom(server, 53), out, tcp)
		if err != nil {
			last = err
			continue
		}
		if len(a) < 12 || a[0] != rid[0] || a[1] != rid[1] || a[2]&0x80 == 0 {
			last = fmt.Errorf("a mismatched answer")
			continue
		}
		binary.BigEndian.PutUint16(a, id)
		return a, nil
	}
	return nil, last
}

// exchange sends one query to server and reads its answer.
func exchange(ctx context.Context, server netip.AddrPort, q []byte, tcp bool) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, dnsTimeout)
	defer cancel()
	var d net.Dialer
	network := "udp"
	if tcp {
		network = "tcp"
	}
	c, err := d.DialContext(ctx, network, server.String())
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if tcp {
		if err := writeTCPMessage(c, q); err != nil {
			return nil, err
		}
		return readTCPMessage(c)
	}
	if _, err := c.Write(q); err != nil {
		return nil, err
	}
	buf := make([]byte, maxDNSMessage)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return nil, err
		}
		// Answers to other queries (late ones) are skipped.
		if n >= 2 && buf[0] == q[0] && buf[1] == q[1] {
			return buf[:n], nil
		}
	}
}

// lookup resolves name's IPv4 addresses through the upstream resolvers,
// as the egress proxy needs to check a connection's address against its
// name.
func (m *Manager) lookup(ctx context.Context, name string) ([]netip.Addr, time.Duration, error) {
	n, err := dnsmessage.NewName(normalName(name) + ".")
	if err != nil {
		return nil, 0, err
	}
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{RecursionDesired: true})
	b.StartQuestions()
	b.Question(dnsmessage.Question{Name: n, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET})
	q, err := b.Finish()
	if err != nil {
		return nil, 0, err
	}
	a, err := m.forward(ctx, q, false)
	if err != nil {
		return nil, 0, err
	}
	addrs, ttl := answerAddrs(a)
	if len(addrs) == 0 {
		return nil, 0, fmt.Errorf("%s has no IPv4 address", name)
	}
	return addrs, ttl, nil
}

var _ = slog.Any
