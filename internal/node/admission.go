package node

import (
	"context"
	"math"
	"sync"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
)

// admission bounds sandbox starts in flight. Creates beyond the bound wait
// in a bounded queue, one FIFO per project served round-robin (fair share);
// beyond the queue they are refused with a retry-after derived from the
// recent start rate. A burst therefore meets a queue, not an error storm.
type admission struct {
	slots int
	limit int
	// refused is told why a create was refused: queue_full or
	// queue_timeout (metrics).
	refused func(reason string)

	mu      sync.Mutex
	busy    int
	queued  int
	queues  map[string][]*waiter
	order   []string // projects with waiters, in service order
	rate    float64  // starts per second (EWMA)
	lastEnd time.Time
}

type waiter struct {
	ready chan struct{}
	gone  bool
}

func newAdmission(slots, limit int) *admission {
	return &admission{slots: slots, limit: limit, queues: map[string][]*waiter{}, refused: func(string) {}}
}

// acquire takes a start slot for project, waiting in its queue if needed.
func (a *admission) acquire(ctx context.Context, project string) (release func(), err error) {
	a.mu.Lock()
	if a.busy < a.slots && a.queued == 0 {
		a.busy++
		a.mu.Unlock()
		return a.releaser(), nil
	}
	if a.queued >= a.limit {
		wait := a.retryAfterLocked()
		a.mu.Unlock()
		a.refused("queue_full")
		return nil, errdefs.Exhausted(wait, "start queue full (%d waiting); retry later", a.limit)
	}
	w := &waiter{ready: make(chan struct{})}
	if len(a.queues[project]) == 0 {
		a.order = append(a.order, project)
	}
	a.queues[project] = append(a.queues[project], w)
	a.queued++
	a.mu.Unlock()
	select {
	case <-w.ready:
		return a.releaser(), nil
	case <-ctx.Done():
		a.mu.Lock()
		select {
		case <-w.ready:
			// Handed a slot as we gave up: pass it on.
			a.mu.Unlock()
			a.releaser()()
		default:
			w.gone = true
			a.mu.Unlock()
		}
		a.refused("queue_timeout")
		return nil, errdefs.Exhausted(a.retryAfter(), "waited for a start slot until the request's deadline")
	}
}

func (a *admission) releaser() func() {
	var once sync.Once
	return func() { once.Do(a.release) }
}

// release finishes a start and hands the slot to the next project in turn.
func (a *admission) release() {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	if !a.lastEnd.IsZero() {
		if dt := now.Sub(a.lastEnd).Seconds(); dt > 0 {
			inst := 1 / dt
			a.rate = 0.9*a.rate + 0.1*math.Min(inst, 10000)
		}
	} else {
		a.rate = 1
	}
	a.lastEnd = now
	for len(a.order) > 0 {
		p := a.order[0]
		a.order = a.order[1:]
		q := a.queues[p]
		for len(q) > 0 && q[0].gone {
			q = q[1:]
			a.queued--
		}
		if len(q) == 0 {
			delete(a.queues, p)
			continue
		}
		w := q[0]
		a.queues[p] = q[1:]
		a.queued--
		if len(a.queues[p]) > 0 {
			a.order = append(a.order, p) // back of the line: round-robin
		} else {
			delete(a.queues, p)
		}
		close(w.ready) // the slot passes to w; busy stays the same
		return
	}
	a.busy--
}

func (a *admission) retryAfter() time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.retryAfterLocked()
}

// retryAfterLocked is how long the current queue takes to drain.
func (a *admission) retryAfterLocked() time.Duration {
	r := a.rate
	if r < 1 {
		r = 1
	}
	d := time.Duration(float64(a.queued+a.busy) / r * float64(time.Second))
	return min(max(d, time.Second), time.Minute)
}

func (a *admission) stats() (busy, queued int, rate float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.rate
	if time.Since(a.lastEnd) > 10*time.Second {
		r = 0
	}
	return a.busy, a.queued, r
}
