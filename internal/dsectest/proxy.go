package dsectest

import (
	"io"
	"net"
	"sync"
)

// Proxy is a TCP proxy on a free loopback port that a test can cut, to
// take one process off a server (a node off etcd) while the server keeps
// running for everyone else.
type Proxy struct {
	// Addr is host:port of the proxy.
	Addr   string
	target string
	l      net.Listener

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]bool
}

// StartProxy proxies a free loopback port to target (host:port) until t
// ends.
func StartProxy(t TB, target string) *Proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Addr: l.Addr().String(), target: target, l: l, conns: map[net.Conn]bool{}}
	t.Cleanup(func() {
		l.Close()
		p.Cut()
	})
	go p.serve()
	return p
}

// Etcd is etcd as seen through the proxy (for StartNode and StartAPI),
// when the proxy's target is e's client port.
func (p *Proxy) Etcd() *Etcd { return &Etcd{URL: "http://" + p.Addr} }

func (p *Proxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		go p.relay(c)
	}
}

func (p *Proxy) relay(c net.Conn) {
	p.mu.Lock()
	if p.cut {
		p.mu.Unlock()
		c.Close()
		return
	}
	p.conns[c] = true
	p.mu.Unlock()
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		p.drop(c)
		return
	}
	p.mu.Lock()
	if p.cut {
		p.mu.Unlock()
		u.Close()
		p.drop(c)
		return
	}
	p.conns[u] = true
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { io.Copy(u, c); done <- struct{}{} }()
	go func() { io.Copy(c, u); done <- struct{}{} }()
	<-done
	p.drop(c)
	p.drop(u)
}

func (p *Proxy) drop(c net.Conn) {
	c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// Cut closes every connection through the proxy and refuses new ones
// until Restore.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut = true
	conns := p.conns
	p.conns = map[net.Conn]bool{}
	p.mu.Unlock()
	for c := range conns {
		c.Close()
	}
}

// Restore lets connections through again.
func (p *Proxy) Restore() {
	p.mu.Lock()
	p.cut = false
	p.mu.Unlock()
}
