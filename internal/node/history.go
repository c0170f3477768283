package node

import (
	"context"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Each live sandbox keeps a bounded history of its use: a sample every
// Config.SampleEvery, the last historyLen of them. A node with many sandboxes
// samples at most historyRate a second, so a sandbox's samples come less
// often there (5,000 sandboxes: every 25 s) and sampling costs the node a
// bounded amount of CPU whatever its size.
const (
	historyLen  = 180 // 15 minutes at 5 s
	historyRate = 200 // sandboxes sampled a second, at most
)

// usage is one StatsSample, compact (a sandbox keeps 180).
type usage struct {
	at                          int64 // unix milliseconds
	cpuMs, memory, disk, pids64 int64
}

// history is a sandbox's ring of samples.
type history struct {
	mu   sync.Mutex
	ring []usage
	next int // where the next sample goes once the ring is full
}

func (h *history) add(s usage) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.ring) < historyLen {
		h.ring = append(h.ring, s)
		return
	}
	h.ring[h.next] = s
	h.next = (h.next + 1) % historyLen
}

// samples returns the samples, oldest first.
func (h *history) samples() []*dsecv1.StatsSample {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]*dsecv1.StatsSample, 0, len(h.ring))
	for i := range h.ring {
		s := h.ring[(h.next+i)%len(h.ring)]
		out = append(out, &dsecv1.StatsSample{
			At: timestamppb.New(time.UnixMilli(s.at)), CpuTimeMs: s.cpuMs, MemoryBytes: s.memory, DiskBytes: s.disk, Pids: s.pids64,
		})
	}
	return out
}

// sampler samples every live sandbox's use into its history until the
// node stops: each round visits every sandbox once, spread over the round
// (SampleEvery, or longer where historyRate requires it).
func (n *Node) sampler() {
	defer n.wg.Done()
	if n.cfg.SampleEvery < 0 {
		return // sampling is off
	}
	for {
		live := n.sandboxes.all(nil)
		round := max(n.cfg.SampleEvery, time.Duration(len(live))*time.Second/historyRate)
		gap := round
		if len(live) > 0 {
			gap = round / time.Duration(len(live))
		}
		tick := time.NewTicker(gap)
		for i := 0; i < max(len(live), 1); i++ {
			select {
			case <-n.stop:
				tick.Stop()
				return
			case <-tick.C:
			}
			if i < len(live) {
				n.sampleOne(live[i])
			}
		}
		tick.Stop()
	}
}

// sampleOne adds a sample of s's use now to its history (a sandbox
// ending, or whose stats fail, is skipped).
func (n *Node) sampleOne(s *sandbox) {
	if s.currentState().ending() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	st, err := s.inst.Stats(ctx)
	if err != nil {
		return
	}
	s.history.add(usage{at: time.Now().UnixMilli(), cpuMs: st.CPUTime.Milliseconds(), memory: st.MemoryBytes, disk: st.DiskBytes, pids64: st.Pids})
}
