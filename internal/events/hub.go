// Package events carries sandbox lifecycle events from the node that saw
// them to the callers watching: a hub each node publishes into, and
// webhooks that post each event to registered URLs.
//
// Publishing never blocks and never fails: a sandbox's create, pause or
// end does not wait for anyone watching it. Each subscriber has a bounded
// buffer; one that falls behind loses the events that did not fit and is
// told, at the place of the gap, how many (a "dropped" event).
package events

import (
	"context"
	"sync"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Event types.
const (
	Created     = "created"
	Paused      = "paused"
	Resumed     = "resumed"
	Snapshotted = "snapshotted"
	Forked      = "forked"
	Ended       = "ended"
	// Dropped tells a subscriber it lost Event.Dropped events here.
	Dropped = "dropped"
	// Heartbeat is sent on a quiet stream, so idle connections stay open.
	Heartbeat = "heartbeat"
)

// DefaultBuffer is a subscriber's buffer, in events: at 200 creates a
// second (each with its end), a subscriber may stall for ten seconds
// before it loses any.
const DefaultBuffer = 4096

// Hub fans events out to subscribers. The zero value is not usable; a nil
// *Hub publishes nowhere.
type Hub struct {
	mu   sync.Mutex
	subs map[*Sub]struct{}
}

// NewHub returns a hub without subscribers.
func NewHub() *Hub { return &Hub{subs: map[*Sub]struct{}{}} }

// Publish hands ev to every subscriber whose filter accepts it. It does
// not block: a subscriber whose buffer is full loses ev. ev must not be
// changed afterwards (subscribers share it).
func (h *Hub) Publish(ev *dsecv1.Event) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs {
		if s.match == nil || s.match(ev) {
			s.offer(ev)
		}
	}
}

// Subscribe returns a subscription to the events match accepts (nil:
// all), buffering up to buffer of them (0: DefaultBuffer). Close it when
// done.
func (h *Hub) Subscribe(match func(*dsecv1.Event) bool, buffer int) *Sub {
	if buffer <= 0 {
		buffer = DefaultBuffer
	}
	s := &Sub{h: h, match: match, max: buffer, ready: make(chan struct{}, 1)}
	h.mu.Lock()
	h.subs[s] = struct{}{}
	h.mu.Unlock()
	return s
}

// Subscribers counts the open subscriptions.
func (h *Hub) Subscribers() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.subs)
}

// Sub is one subscription.
type Sub struct {
	h     *Hub
	match func(*dsecv1.Event) bool
	max   int
	ready chan struct{} // signalled when queue gains an event

	mu    sync.Mutex
	queue []*dsecv1.Event
	lost  uint64 // events lost since the last one queued
}

// offer queues ev, or counts it lost when the buffer is full. After a
// loss, the next event that fits comes after a dropped event with the
// count, so the subscriber learns where the gap was.
func (s *Sub) offer(ev *dsecv1.Event) {
	s.mu.Lock()
	switch {
	case s.lost > 0 && len(s.queue)+2 <= s.max:
		s.queue = append(s.queue, &dsecv1.Event{Type: Dropped, Dropped: s.lost, At: ev.At, Node: ev.Node}, ev)
		s.lost = 0
	case s.lost == 0 && len(s.queue) < s.max:
		s.queue = append(s.queue, ev)
	default:
		s.lost++
	}
	s.mu.Unlock()
	select {
	case s.ready <- struct{}{}:
	default:
	}
}

// Next returns the next event, waiting for one until ctx ends (then it
// returns ctx's error).
func (s *Sub) Next(ctx context.Context) (*dsecv1.Event, error) {
	for {
		s.mu.Lock()
		if len(s.queue) > 0 {
			ev := s.queue[0]
			s.queue[0] = nil
			s.queue = s.queue[1:]
			s.mu.Unlock()
			return ev, nil
		}
		if s.lost > 0 {
			// Drained after a loss with nothing since: say so now.
			ev := &dsecv1.Event{Type: Dropped, Dropped: s.lost, At: timestamppb.Now()}
			s.lost = 0
			s.mu.Unlock()
			return ev, nil
		}
		s.mu.Unlock()
		select {
		case <-s.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Close ends the subscription.
func (s *Sub) Close() {
	s.h.mu.Lock()
	delete(s.h.subs, s)
	s.h.mu.Unlock()
}
