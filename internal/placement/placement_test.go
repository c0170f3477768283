package placement

import (
	"fmt"
	"strings"
	"testing"

	"github.com/opendsec/dsec/internal/errdefs"
)

func node(name string, used, max int64, mods ...func(*Node)) *Node {
	n := &Node{
		Name: name, Sandboxes: used, MaxSandboxes: max, Incarnation: "i1",
		Kinds:  map[string]bool{"container": true},
		Images: map[string]bool{"busybox": true},
		Labels: map[string]string{"zone": "a"},
	}
	for _, m := range mods {
		m(n)
	}
	return n
}

func req() Request { return Request{Kind: "container", Image: "busybox", Project: "p"} }

func TestPickRulesNodesOutAndSaysWhy(t *testing.T) {
	cases := []struct {
		name     string
		view     []*Node
		req      func(*Request)
		kind     errdefs.Kind
		contains []string
	}{
		{
			name: "an empty cluster is unavailable",
			kind: errdefs.KindUnavailable, contains: []string{"the cluster has no nodes"},
		},
		{
			name: "full nodes are exhausted, retry later",
			view: []*Node{node("n1", 4, 4), node("n2", 9, 8)},
			kind: errdefs.KindExhausted, contains: []string{"n1, n2: full"},
		},
		{
			name: "lost and draining nodes are unavailable, each named",
			view: []*Node{node("n1", 0, 4, func(n *Node) { n.Lost = true }), node("n2", 0, 4, func(n *Node) { n.Draining = true })},
			kind: errdefs.KindUnavailable, contains: []string{"n1: no lease", "n2: draining"},
		},
		{
			name: "an image no node has is not found",
			view: []*Node{node("n1", 0, 4), node("n2", 0, 4)},
			req:  func(r *Request) { r.Image = "debian" },
			kind: errdefs.KindNotFound, contains: []string{"n1, n2: no image debian", "image debian"},
		},
		{
			name: "a kind no node runs is unavailable",
			view: []*Node{node("n1", 0, 4)},
			req:  func(r *Request) { r.Kind = "microvm" },
			kind: errdefs.KindUnavailable, contains: []string{"n1: no microvm substrate"},
		},
		{
			name: "a selector no node matches is not found",
			view: []*Node{node("n1", 0, 4)},
			req:  func(r *Request) { r.Selector = map[string]string{"zone": "b"} },
			kind: errdefs.KindNotFound, contains: []string{"n1: labels do not match"},
		},
		{
			name: "a node that refused is excluded with its reason",
			view: []*Node{node("n1", 0, 4)},
			req:  func(r *Request) { r.Exclude = map[string]string{"n1": "node n1 is full"} },
			kind: errdefs.KindExhausted, contains: []string{"n1: refused: node n1 is full"},
		},
		{
			name: "mixed reasons list the most common first",
			view: []*Node{node("n1", 4, 4), node("n2", 4, 4), node("n3", 0, 4, func(n *Node) { n.Lost = true })},
			kind: errdefs.KindExhausted, contains: []string{"n1, n2: full; n3: no lease"},
		},
		{
			name: "many nodes with one reason are summarized",
			view: func() []*Node {
				var v []*Node
				for i := range 9 {
					v = append(v, node(fmt.Sprintf("n%d", i), 1, 1))
				}
				return v
			}(),
			kind: errdefs.KindExhausted, contains: []string{"n0, n1, n2, n3, n4: full and 4 more"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := req()
			if c.req != nil {
				c.req(&r)
			}
			res, err := New(Config{}).Pick(c.view, r)
			if err == nil {
				t.Fatalf("placed on %s", res.Node)
			}
			if k := errdefs.KindOf(err); k != c.kind {
				t.Errorf("kind %s, want %s (%v)", k, c.kind, err)
			}
			for _, s := range c.contains {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not say %q", err, s)
				}
			}
		})
	}
}

func TestPickTakesOnlyFittingNodes(t *testing.T) {
	view := []*Node{
		node("full", 4, 4),
		node("lost", 0, 4, func(n *Node) { n.Lost = true }),
		node("other-zone", 0, 4, func(n *Node) { n.Labels = map[string]string{"zone": "b"} }),
		node("no-image", 0, 4, func(n *Node) { n.Images = nil }),
		node("fits", 3, 4),
	}
	p := New(Config{})
	r := req()
	r.Selector = map[string]string{"zone": "a"}
	for range 20 {
		res, err := p.Pick(view, r)
		if err != nil {
			t.Fatal(err)
		}
		if res.Node != "fits" {
			t.Fatalf("placed on %s", res.Node)
		}
		res.Done(false, "", 0)
	}
}

// TestPickLoadsAnImageOnDemandOnlyWhenNoHolderFits: with Fetchable, a
// node that holds the image is chosen however loaded it is, as long as it
// fits; a node lacking the image is chosen only when no holder fits, and
// only for an image Fetchable says another node holds; an image nobody
// holds is still not found.
func TestPickLoadsAnImageOnDemandOnlyWhenNoHolderFits(t *testing.T) {
	holder := func(n *Node) { n.Images = map[string]bool{"busybox": true, "p task": true} }
	lacks := func(n *Node) { n.Images = map[string]bool{"busybox": true} }
	fetchable := func(img string) bool { return img == "task" }
	p := New(Config{})
	r := req()
	r.Image, r.Fetchable = "task", fetchable
	view := []*Node{node("holder", 3, 4, holder), node("empty1", 0, 4, lacks), node("empty2", 0, 4, lacks)}
	for range 20 {
		res, err := p.Pick(view, r)
		if err != nil || res.Node != "holder" {
			t.Fatalf("placed on %v (%v), want the node holding the image", res, err)
		}
		res.Done(false, "", 0)
	}
	// The holder is full: a node that loads it from the holder.
	view[0] = node("holder", 4, 4, holder)
	res, err := p.Pick(view, r)
	if err != nil || (res.Node != "empty1" && res.Node != "empty2") {
		t.Fatalf("with the holder full: %v, %v", res, err)
	}
	res.Done(false, "", 0)
	// Without Fetchable (or for an image it does not know), as before.
	r.Fetchable = nil
	if _, err := p.Pick(view, r); !errdefs.Is(err, errdefs.KindNotFound) && !errdefs.Is(err, errdefs.KindExhausted) {
		t.Fatalf("without Fetchable: %v", err)
	}
	r.Image, r.Fetchable = "nowhere", fetchable
	if _, err := p.Pick(view, r); !errdefs.Is(err, errdefs.KindNotFound) || !strings.Contains(err.Error(), "no image nowhere") {
		t.Fatalf("an image no node holds: %v", err)
	}
	// A sidecar's image counts the same way.
	r.Image, r.Images = "busybox", []string{"task"}
	if res, err := p.Pick(view, r); err != nil || res.Node == "holder" {
		t.Fatalf("a sidecar's image with its holder full: %v, %v", res, err)
	}
}

func TestTheNodeLabelPlacesOnThatNode(t *testing.T) {
	view := []*Node{node("n1", 0, 4), node("n2", 3, 4), node("n3", 0, 4)}
	p := New(Config{})
	r := req()
	r.Selector = map[string]string{NodeLabel: "n2"}
	for range 5 {
		res, err := p.Pick(view, r)
		if err != nil || res.Node != "n2" {
			t.Fatalf("placed on %v, %v", res, err)
		}
		res.Done(false, "", 0)
	}
	r.Selector = map[string]string{NodeLabel: "n9"}
	if _, err := p.Pick(view, r); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Fatalf("a node that is not there: %v", err)
	}
}

func TestPickSpreadsItsOwnPlacements(t *testing.T) {
	// Reports never change here: only the placer's own accounting keeps
	// it from piling onto one node.
	view := []*Node{node("n1", 0, 1000), node("n2", 0, 1000), node("n3", 0, 1000)}
	cases := []struct {
		name    string
		choices int
		spread  int
	}{
		// Sampling every node always takes the least loaded: exact.
		{"sampling every node balances exactly", 3, 0},
		// Two choices keep the spread within a few placements; the bound
		// is loose so that chance never fails the test.
		{"two choices stay close to balanced", 2, 12},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := New(Config{Choices: c.choices})
			count := map[string]int{}
			for range 300 {
				res, err := p.Pick(view, req())
				if err != nil {
					t.Fatal(err)
				}
				count[res.Node]++
			}
			lo, hi := 300, 0
			for _, n := range view {
				lo, hi = min(lo, count[n.Name]), max(hi, count[n.Name])
			}
			if hi-lo > c.spread {
				t.Errorf("placements %v: spread %d, want at most %d", count, hi-lo, c.spread)
			}
		})
	}
}

func TestPickPrefersTheLessLoaded(t *testing.T) {
	view := []*Node{node("busy", 90, 100), node("idle", 10, 100)}
	p := New(Config{})
	for range 50 {
		res, err := p.Pick(view, req())
		if err != nil {
			t.Fatal(err)
		}
		if res.Node != "idle" {
			t.Fatalf("placed on %s while idle had room", res.Node)
		}
		res.Done(false, "", 0)
	}
}

func TestPickNeverOverfillsFromItsOwnPlacements(t *testing.T) {
	view := []*Node{node("n1", 0, 2)}
	p := New(Config{})
	for i := range 2 {
		if _, err := p.Pick(view, req()); err != nil {
			t.Fatalf("pick %d: %v", i, err)
		}
	}
	if _, err := p.Pick(view, req()); !errdefs.Is(err, errdefs.KindExhausted) {
		t.Fatalf("third pick on a 2-slot node: %v", err)
	}
}

func TestPickNReservesARunOnOneNode(t *testing.T) {
	view := []*Node{node("n1", 0, 5), node("n2", 1, 4)}
	p := New(Config{Choices: 2})
	first, err := p.PickN(view, req(), 4)
	if err != nil || len(first) != 4 || first[0].Node != "n1" {
		t.Fatalf("a run of 4 with n1 emptiest: %d on %v, %v", len(first), first[0].Node, err)
	}
	for _, r := range first {
		if r.Node != first[0].Node {
			t.Fatalf("a run split across nodes")
		}
	}
	// n1 has 1 free slot, n2 3: the run goes to n2 and stops at its room.
	second, err := p.PickN(view, req(), 8)
	if err != nil || len(second) != 3 || second[0].Node != "n2" {
		t.Fatalf("a run of 8 with n2 emptiest: %d on %s, %v", len(second), second[0].Node, err)
	}
	if got := p.Local("p"); got != 7 {
		t.Fatalf("Local = %d after 7 reservations", got)
	}
}

func TestLocalCountsUntilAReportIncludesTheCreate(t *testing.T) {
	view := []*Node{node("n1", 0, 10)}
	p := New(Config{})
	a, _ := p.Pick(view, req())
	b, _ := p.Pick(view, req())
	if got := p.Local("p"); got != 2 {
		t.Fatalf("Local after two picks = %d", got)
	}
	a.Done(true, "i1", 7)
	b.Done(false, "i1", 8) // refused: no longer counted
	b.Done(false, "i1", 8) // idempotent
	if got := p.Local("p"); got != 1 {
		t.Fatalf("Local after one create, one refusal = %d", got)
	}
	p.Reported("n1", "i1", 6) // a report older than the answer
	if got := p.Local("p"); got != 1 {
		t.Fatalf("Local after an older report = %d", got)
	}
	p.Reported("n1", "i1", 7)
	if got := p.Local("p"); got != 0 {
		t.Fatalf("Local after a report that counts the create = %d", got)
	}
	// A report can come before the answer of a create it counts.
	d, _ := p.Pick(view, req())
	p.Reported("n1", "i1", 8)
	d.Done(true, "i1", 8)
	if got := p.Local("p"); got != 0 {
		t.Fatalf("Local after a report that came before the answer = %d", got)
	}
	c, _ := p.Pick(view, req())
	c.Done(true, "i1", 9)
	p.Reported("n1", "i2", 1) // the node restarted: it counts its own
	if got := p.Local("p"); got != 0 {
		t.Fatalf("Local after the node restarted = %d", got)
	}
}

func BenchmarkPick160Nodes(b *testing.B) {
	var view []*Node
	for i := range 160 {
		view = append(view, node(fmt.Sprintf("n%d", i), int64(i%50), 4096))
	}
	p := New(Config{})
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		res, err := p.Pick(view, req())
		if err != nil {
			b.Fatal(err)
		}
		res.Done(true, "i1", uint64(i+1))
		if i%1000 == 0 {
			for _, n := range view {
				p.Reported(n.Name, "i1", uint64(i+1))
			}
		}
	}
}
