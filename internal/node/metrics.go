package node

import (
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/substrate"
)

// kindOf is the kind of live sandbox id, for the metrics of a call naming
// it ("" when it is not live: the call fails and counts as "unknown").
func (n *Node) kindOf(id string) string {
	if s := n.sandboxes.get(id); s != nil {
		return s.spec.GetKind()
	}
	return ""
}

// metricsState is what a scrape reads: live sandboxes by kind and state
// (every kind the node runs and every live state, zeros included, so a
// series does not vanish when its count drops to zero), starts in flight
// and queued, warm pools, and the node's capacity.
func (n *Node) metricsState() metrics.NodeState {
	st := metrics.NodeState{Sandboxes: map[[2]string]int{}}
	for _, k := range substrate.Kinds {
		if d := n.drivers[k]; d != nil && d.Capabilities().Available {
			for _, s := range []state{stateRunning, statePaused} {
				st.Sandboxes[[2]string{string(k), s.String()}] = 0
			}
		}
	}
	for _, s := range n.sandboxes.all(nil) {
		s.mu.Lock()
		at := s.state
		s.mu.Unlock()
		st.Sandboxes[[2]string{s.spec.GetKind(), at.String()}]++
	}
	_, queued, _ := n.starts.stats()
	st.Starting, st.Queued, st.StartSlots = int(n.creating.Load()), queued, n.cfg.MaxConcurrentStarts
	st.MaxSandboxes, st.Pooled = n.cfg.MaxSandboxes, n.pools.readyByKind()
	st.CPUs, st.MemoryBytes = n.cfg.MaxCPU, n.cfg.MaxMemoryMB<<20
	return st
}
