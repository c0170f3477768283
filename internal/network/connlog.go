package network

import (
	"net/netip"
	"sync"
	"time"
)

// ConnRecord is one connection a sandbox opened, as its log keeps it.
type ConnRecord struct {
	Seq uint64
	At  time.Time
	// Protocol is "tcp", "udp", "icmp", "dns", "http" or "tls".
	Protocol string
	Addr     netip.Addr
	Port     uint16
	// Host is the name: the DNS query's, the TLS SNI, the HTTP Host.
	Host     string
	Allow    bool
	Reason   string
	Brokered bool
}

// Bounds of a sandbox's connection log.
const (
	connLogSize = 4096
	// connLogRate is how many records of each verdict a second a
	// sandbox's log takes (the kernel's log rules have the same rate).
	connLogRate = 200
)

// connLog is a sandbox's bounded connection log. It is safe for
// concurrent use.
type connLog struct {
	mu      sync.Mutex
	ring    []ConnRecord // the last connLogSize records, oldest first from start
	start   int
	seq     uint64
	dropped uint64
	buckets [2]tokenBucket // deny, allow
}

// add appends r (its Seq and, if zero, At are set here) unless the
// verdict's rate is spent; user-space records (DNS, proxy) go through the
// rate, kernel records (rated by the kernel) do not.
func (l *connLog) add(r ConnRecord, rated bool) {
	if r.At.IsZero() {
		r.At = time.Now()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if rated {
		b := &l.buckets[0]
		if r.Allow {
			b = &l.buckets[1]
		}
		if !b.take(r.At, connLogRate) {
			l.dropped++
			return
		}
	}
	l.seq++
	r.Seq = l.seq
	if len(l.ring) < connLogSize {
		l.ring = append(l.ring, r)
		return
	}
	l.ring[l.start] = r
	l.start = (l.start + 1) % connLogSize
	l.dropped++
}

// read returns up to limit records after seq after, oldest first, and
// how many records the log did not keep.
func (l *connLog) read(after uint64, limit int) ([]ConnRecord, uint64) {
	if limit <= 0 || limit > connLogSize {
		limit = connLogSize
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []ConnRecord
	for i := range l.ring {
		r := l.ring[(l.start+i)%len(l.ring)]
		if r.Seq <= after {
			continue
		}
		out = append(out, r)
		if len(out) == limit {
			break
		}
	}
	return out, l.dropped
}

// tokenBucket refills rate tokens a second up to rate.
type tokenBucket struct {
	tokens float64
	last   time.Time
}

func (b *tokenBucket) take(now time.Time, rate float64) bool {
	if b.last.IsZero() {
		b.tokens = rate
	} else if d := now.Sub(b.last).Seconds(); d > 0 {
		b.tokens = min(rate, b.tokens+d*rate)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
