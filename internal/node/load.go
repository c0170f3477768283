package node

import (
	"sort"

	"github.com/opendsec/dsec/internal/substrate"
)

// Load is the part of a node's state that placement reads: it changes with
// every create and delete, so the cluster agent publishes it rate-bounded
// (see LoadChanged).
type Load struct {
	// Sandboxes counts live sandboxes plus admitted creates still starting;
	// MaxSandboxes is the admission limit.
	Sandboxes, MaxSandboxes int64
	// Admitted counts creates admitted since this process started. A
	// control plane that saw an answer to a create after Admitted reached
	// n knows a load with Admitted >= n includes that create.
	Admitted uint64
	// Projects counts Sandboxes by project.
	Projects map[string]int64
	// Kinds lists the kinds this node can run now, and each kind's other
	// runtimes it can run as "kind/runtime" ("container/gvisor").
	Kinds []string
	// Images lists the names of the node's images and snapshots.
	Images []string
}

// Load reports the node's current load. It is cheap enough to call after
// every change.
func (n *Node) Load() Load {
	// Read Admitted first: counts taken after it include every create it
	// counts.
	l := Load{Admitted: n.admitted.Load(), MaxSandboxes: int64(n.cfg.MaxSandboxes)}
	live, projects := n.sandboxes.projects()
	l.Sandboxes, l.Projects = int64(live)+n.creating.Load(), projects
	for _, k := range substrate.Kinds {
		if d := n.drivers[k]; d != nil && d.Capabilities().Available {
			l.Kinds = append(l.Kinds, string(k))
			// A kind's other runtimes as kind/runtime (placement.KindOf).
			for _, r := range d.Capabilities().Runtimes {
				if r.Available {
					l.Kinds = append(l.Kinds, string(k)+"/"+r.Name)
				}
			}
		}
	}
	for _, img := range n.images.List() {
		if img.BuildCache == nil {
			l.Images = append(l.Images, img.Key())
		}
	}
	sort.Strings(l.Images)
	return l
}

// LoadChanged is signalled (coalesced, never blocking the node) whenever
// the load may have changed.
func (n *Node) LoadChanged() <-chan struct{} { return n.changed }

// ImagesChanged tells the node's load publisher that its images changed
// outside the node's own calls (an image imported from another node).
func (n *Node) ImagesChanged() { n.loadChanged() }

func (n *Node) loadChanged() {
	select {
	case n.changed <- struct{}{}:
	default:
	}
}

// Admitted counts creates admitted since this process started (see Load).
func (n *Node) Admitted() uint64 { return n.admitted.Load() }
