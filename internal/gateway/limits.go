package gateway

import (
	"context"
	"sync"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// sessionLimits holds a session's model calls to its ModelLimits on this
// node: calls in flight, tokens per minute (a sliding window of the
// tokens of the calls that ended in the last minute) and tokens in all.
type sessionLimits struct {
	mu       sync.Mutex
	limits   *dsecv1.ModelLimits
	inflight int
	spent    int64
	window   []spend
	changed  chan struct{} // closed and replaced when a slot or tokens free up
}

type spend struct {
	at     time.Time
	tokens int64
}

// limits returns the state of sb's session, with its current limits.
func (g *Gateway) limits(sb *Sandbox, l *dsecv1.ModelLimits) *sessionLimits {
	key := sb.Project + "/" + sb.Session
	g.mu.Lock()
	defer g.mu.Unlock()
	s := g.sessions[key]
	if s == nil {
		s = &sessionLimits{changed: make(chan struct{})}
		g.sessions[key] = s
	}
	s.mu.Lock()
	s.limits = l
	s.mu.Unlock()
	return s
}

// acquire waits until the session may make a call: a slot free and the
// minute's tokens under the limit. It fails at once when the budget is
// spent, and when ctx ends. release takes the call's tokens.
func (s *sessionLimits) acquire(ctx context.Context) (release func(tokens int64), err error) {
	for {
		s.mu.Lock()
		l := s.limits
		if b := l.GetTokenBudget(); b > 0 && s.spent >= b {
			s.mu.Unlock()
			// The trainer's own bound, not the platform failing.
			e := errdefs.Exhausted(0, "the session's token budget (%d) is spent", b)
			e.Infra, e.Retryable = false, false
			return nil, e
		}
		now := time.Now()
		s.trimLocked(now)
		var wake time.Duration
		slot := l.GetMaxConcurrent() <= 0 || s.inflight < int(l.GetMaxConcurrent())
		tpm := l.GetTokensPerMinute()
		if tpm > 0 && s.minuteLocked() >= tpm && len(s.window) > 0 {
			wake = s.window[0].at.Add(time.Minute).Sub(now)
		}
		if slot && wake <= 0 {
			s.inflight++
			s.mu.Unlock()
			var once sync.Once
			return func(tokens int64) { once.Do(func() { s.release(tokens) }) }, nil
		}
		ch := s.changed
		s.mu.Unlock()
		var timer <-chan time.Time
		if wake > 0 {
			t := time.NewTimer(wake)
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-ch:
		case <-timer:
		case <-ctx.Done():
			return nil, errdefs.New(errdefs.KindCanceled, "the agent gave up waiting for the session's model call limits")
		}
	}
}

func (s *sessionLimits) release(tokens int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inflight--
	s.spent += tokens
	if tokens > 0 {
		s.window = append(s.window, spend{time.Now(), tokens})
	}
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *sessionLimits) trimLocked(now time.Time) {
	i := 0
	for i < len(s.window) && now.Sub(s.window[i].at) >= time.Minute {
		i++
	}
	s.window = s.window[i:]
}

func (s *sessionLimits) minuteLocked() int64 {
	var n int64
	for _, w := range s.window {
		n += w.tokens
	}
	return n
}
