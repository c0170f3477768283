// Package placement chooses the node for each new sandbox in a cluster.
//
// A Placer filters the live load view (the nodes' last load reports) by
// kind, image, free capacity and labels, then takes the least loaded of k
// nodes sampled at random from those that fit (power of k choices: near
// the balance of a full scan at the cost of k looks, and replicas that
// sample independently do not all pile onto the one emptiest node).
//
// Load reports lag: a node publishes its load at most about once a second.
// Each Placer therefore accounts for its own placements the reports do not
// show yet — in flight, or answered after the node's last report — and
// adds them to what the reports say, per node and per project. A node
// still refuses what it cannot take (its admission is final); the caller
// then places again excluding it.
//
// When nothing fits, the error says why, node by node (grouped by reason),
// never an opaque "failed to place".
package placement

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Node is one node as placement sees it: its last load report. A Node is
// not modified once it is in a view.
type Node struct {
	Name string
	// Lost is a registered node without a lease (it stopped renewing it,
	// or etcd expired it while the node was cut off): placement skips it,
	// whether or not it still answers calls.
	Lost     bool
	Draining bool
	Kinds    map[string]bool
	Images   map[string]bool
	Labels   map[string]string
	// Sandboxes counts the node's sandboxes (live and starting) as of its
	// report; MaxSandboxes is its admission limit.
	Sandboxes, MaxSandboxes int64
	// Incarnation and Admitted identify the report (see Placer.Reported).
	Incarnation string
	Admitted    uint64
}

// Request is what a new sandbox needs.
type Request struct {
	// Kind is the sandbox's kind, or "kind/runtime" for another of its
	// runtimes ("container/gvisor"), as nodes list them in Kinds.
	Kind string
	// Image must be present on the node ("" for none): shared, or Project's
	// own (its load report lists tenant.ImageKey(Project, Image)).
	Image string
	// Images must be present too (a sandbox's sidecars' images).
	Images []string
	// Fetchable, when set, says whether a node can load an image it
	// lacks from another node (some live node holds it): when no node
	// that holds every image fits, a node lacking only fetchable images
	// is chosen. Nodes that hold the images are always preferred.
	Fetchable func(image string) bool
	// fetching is set on the second pass, which takes nodes lacking
	// fetchable images.
	fetching bool
	// Selector must be a subset of the node's labels, where every node
	// has NodeLabel: its name.
	Selector map[string]string
	// Exclude rules nodes out with a reason (nodes that refused this
	// sandbox already).
	Exclude map[string]string
	// Project is charged for the reservation.
	Project string
}

// Config configures a Placer. The zero value works.
type Config struct {
	// Choices is k, how many fitting nodes are sampled per placement
	// (default 2).
	Choices int
}

// Placer places sandboxes on a view and accounts for its own placements.
// It is safe for concurrent use.
type Placer struct {
	k int

	mu       sync.Mutex
	nodes    map[string]*local
	projects map[string]int64 // this placer's creates no report counts yet
}

// local is this placer's share of a node's load that the node's reports do
// not show yet.
type local struct {
	pending     int64 // reserved, not answered
	incarnation string
	reported    uint64    // the admission counter of the last report
	unreported  []created // answered creates newer than the last report
}

type created struct {
	admitted uint64
	project  string
}

// New returns a Placer.
func New(cfg Config) *Placer {
	if cfg.Choices <= 0 {
		cfg.Choices = 2
	}
	return &Placer{k: cfg.Choices, nodes: map[string]*local{}, projects: map[string]int64{}}
}

// Reservation holds a slot on a node for one sandbox until Done.
type Reservation struct {
	Node    string
	p       *Placer
	project string
	done    bool
}

// Pick chooses a node for req among view and reserves a slot on it. view
// is not modified. When no node fits, the error is exhausted (capacity:
// retry later), unavailable (nodes without a lease or draining, kinds missing) or
// not_found (no node has the image or labels), with per-node reasons.
func (p *Placer) Pick(view []*Node, req Request) (*Reservation, error) {
	res, err := p.PickN(view, req, 1)
	if err != nil {
		return nil, err
	}
	return res[0], nil
}

// PickN is Pick for up to n sandboxes of one request: it reserves as many
// of them as fit (at least one) on the node Pick would choose. Batches are
// placed in such runs, so a batch costs a call per run, not per sandbox.
func (p *Placer) PickN(view []*Node, req Request, count int) ([]*Reservation, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pickLocked(view, req, count)
}

func (p *Placer) pickLocked(view []*Node, req Request, count int) ([]*Reservation, error) {
	var (
		sample [8]*Node
		used   [8]float64
		seen   int
		why    reasons
	)
	k := min(p.k, len(sample))
	// In a large view most nodes usually fit: probing random nodes finds k
	// in about k looks. The full scan below runs only when probing fails,
	// and it also collects the reasons.
	if len(view) > 4*k {
	probe:
		for range 4 * k {
			n := view[rand.IntN(len(view))]
			for _, s := range sample[:seen] {
				if s == n {
					continue probe
				}
			}
			if p.unfitLocked(n, &req) != "" {
				continue
			}
			sample[seen], used[seen] = n, float64(n.Sandboxes+p.extraLocked(n))/float64(n.MaxSandboxes)
			if seen++; seen == k {
				return p.reserveLocked(sample[:k], used[:k], &req, count), nil
			}
		}
		seen = 0
	}
	for _, n := range view {
		if r := p.unfitLocked(n, &req); r != "" {
			why.add(r, n.Name)
			continue
		}
		// Reservoir sampling keeps k fitting nodes uniformly at random.
		u := float64(n.Sandboxes+p.extraLocked(n)) / float64(n.MaxSandboxes)
		if seen < k {
			sample[seen], used[seen] = n, u
		} else if j := rand.IntN(seen + 1); j < k {
			sample[j], used[j] = n, u
		}
		seen++
	}
	if seen == 0 && req.Fetchable != nil && !req.fetching && why.has(noImage) {
		// No node that holds the images fits: one that can load them
		// from another node will do.
		req.fetching = true
		return p.pickLocked(view, req, count)
	}
	if seen == 0 {
		return nil, why.err(len(view), &req)
	}
	m := min(seen, k)
	return p.reserveLocked(sample[:m], used[:m], &req, count), nil
}

// reserveLocked reserves up to n slots on the least used of the sampled
// nodes.
func (p *Placer) reserveLocked(sample []*Node, used []float64, req *Request, n int) []*Reservation {
	best, ties := 0, 1
	for i := 1; i < len(sample); i++ {
		switch {
		case used[i] < used[best]:
			best, ties = i, 1
		case used[i] == used[best]:
			// Break ties at random, so no node is favoured by its place
			// in the view.
			if ties++; rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	node := sample[best]
	k := int(min(int64(n), max(1, node.MaxSandboxes-node.Sandboxes-p.extraLocked(node))))
	p.localLocked(node.Name).pending += int64(k)
	p.projects[req.Project] += int64(k)
	out := make([]*Reservation, k)
	for i := range out {
		out[i] = &Reservation{Node: node.Name, p: p, project: req.Project}
	}
	return out
}

// unfitLocked says why n cannot take req ("" if it can).
func (p *Placer) unfitLocked(n *Node, req *Request) string {
	switch {
	case n.Lost:
		return "no lease"
	case n.Draining:
		return "draining"
	}
	if r, ok := req.Exclude[n.Name]; ok {
		return "refused: " + r
	}
	if !n.Kinds[req.Kind] {
		return "no " + req.Kind + " substrate"
	}
	for _, img := range append([]string{req.Image}, req.Images...) {
		if img != "" && !n.Images[img] && !n.Images[tenant.ImageKey(req.Project, img)] && !(req.fetching && req.Fetchable(img)) {
			return noImage + img
		}
	}
	for k, v := range req.Selector {
		lv, ok := n.Labels[k]
		if k == NodeLabel {
			lv, ok = n.Name, true
		}
		if !ok || lv != v {
			return "labels do not match"
		}
	}
	if n.Sandboxes+p.extraLocked(n) >= n.MaxSandboxes {
		return "full"
	}
	return ""
}

// noImage begins the reason of a node that lacks an image.
const noImage = "no image "

// NodeLabel is the label every node has, whose value is its name: a
// selector with it places a sandbox beside another (a rollout's agent on
// its workers' node).
const NodeLabel = "dsec.io/node"

// extraLocked is this placer's load on n that n's report does not show.
func (p *Placer) extraLocked(n *Node) int64 {
	l := p.nodes[n.Name]
	if l == nil {
		return 0
	}
	return l.pending + int64(len(l.unreported))
}

func (p *Placer) localLocked(name string) *local {
	l := p.nodes[name]
	if l == nil {
		l = &local{}
		p.nodes[name] = l
	}
	return l
}

// Done ends a reservation. ok says whether the node created the
// sandbox; incarnation and admitted are from the node's answer (see
// Reported). Done is idempotent.
func (r *Reservation) Done(ok bool, incarnation string, admitted uint64) {
	p := r.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if r.done {
		return
	}
	r.done = true
	l := p.localLocked(r.Node)
	l.pending--
	if l.incarnation == "" {
		l.incarnation = incarnation
	}
	if !ok || incarnation != l.incarnation || (admitted != 0 && admitted <= l.reported) {
		// Not created; or by a node process that restarted since, or
		// counted by a report that came before the answer: the node's
		// reports count it.
		p.chargeLocked(r.project, -1)
		return
	}
	l.unreported = append(l.unreported, created{admitted: admitted, project: r.project})
}

func (p *Placer) chargeLocked(project string, d int64) {
	if p.projects[project] += d; p.projects[project] <= 0 {
		delete(p.projects, project)
	}
}

// Reported reconciles with a node's new load report: creates the report
// counts (the node's admission counter had reached their answer's value)
// stop counting locally. A new incarnation (the node restarted) counts
// everything itself.
func (p *Placer) Reported(node, incarnation string, admitted uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.localLocked(node)
	if l.incarnation != incarnation {
		for _, c := range l.unreported {
			p.chargeLocked(c.project, -1)
		}
		l.unreported, l.incarnation, l.reported = nil, incarnation, admitted
		return
	}
	l.reported = max(l.reported, admitted)
	keep := l.unreported[:0]
	for _, c := range l.unreported {
		if c.admitted <= admitted { // 0 (unknown): the next report counts it
			p.chargeLocked(c.project, -1)
			continue
		}
		keep = append(keep, c)
	}
	l.unreported = keep
}

// Forget drops what this placer counted on a node that left the cluster.
func (p *Placer) Forget(node string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if l := p.nodes[node]; l != nil {
		for _, c := range l.unreported {
			p.chargeLocked(c.project, -1)
		}
		l.unreported = nil
	}
}

// Local returns this placer's sandboxes of project that no load report
// counts yet (reserved, or created after the node's last report).
func (p *Placer) Local(project string) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.projects[project]
}

// reasons groups the nodes ruled out by why.
type reasons struct {
	order []string
	nodes map[string][]string
}

func (r *reasons) add(why, node string) {
	if r.nodes == nil {
		r.nodes = map[string][]string{}
	}
	if _, ok := r.nodes[why]; !ok {
		r.order = append(r.order, why)
	}
	r.nodes[why] = append(r.nodes[why], node)
}

// err is the error for a placement nothing fits.
func (r *reasons) err(total int, req *Request) error {
	what := "kind " + req.Kind
	if req.Image != "" {
		what += ", image " + req.Image
	}
	if total == 0 {
		return errdefs.Unavailable("no node can take this sandbox (%s): the cluster has no nodes", what)
	}
	// Most common reason first, then by name, for a stable message.
	sort.SliceStable(r.order, func(i, j int) bool {
		a, b := len(r.nodes[r.order[i]]), len(r.nodes[r.order[j]])
		if a != b {
			return a > b
		}
		return r.order[i] < r.order[j]
	})
	var parts []string
	transient, capacity := false, false
	for _, why := range r.order {
		ns := r.nodes[why]
		sort.Strings(ns)
		names := ns
		more := ""
		if len(names) > 5 {
			names, more = names[:5], fmt.Sprintf(" and %d more", len(ns)-5)
		}
		parts = append(parts, fmt.Sprintf("%s: %s%s", strings.Join(names, ", "), why, more))
		switch {
		case why == "full" || strings.HasPrefix(why, "refused: "):
			transient, capacity = true, true
		case why == "no lease" || why == "draining":
			transient = true
		}
	}
	msg := fmt.Sprintf("no node can take this sandbox (%s): %s", what, strings.Join(parts, "; "))
	switch {
	case capacity:
		return errdefs.Exhausted(time.Second, "%s", msg)
	case transient:
		return errdefs.Unavailable("%s", msg)
	case r.has(noImage):
		return errdefs.NotFound("%s", msg)
	case r.has("labels"):
		return errdefs.NotFound("%s", msg)
	default:
		e := errdefs.Unavailable("%s", msg)
		e.Retryable = false
		return e
	}
}

func (r *reasons) has(prefix string) bool {
	for _, why := range r.order {
		if strings.HasPrefix(why, prefix) {
			return true
		}
	}
	return false
}
