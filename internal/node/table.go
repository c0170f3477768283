package node

import "sync"

// table holds the node's sandboxes before their tombstones: reserved ones
// (starting, or pooled: not listed, their layers in use) and live ones
// (listed and answering calls), and the bookkeeping of creates in flight:
// idempotency keys being claimed, admitted starts by project, and the
// ephemeral snapshots forks hold. It is safe for concurrent use; its mu
// guards only its maps, each sandbox's own mu its state.
type table struct {
	mu       sync.Mutex
	live     map[string]*sandbox
	reserved map[string]*sandbox
	claims   map[string]chan struct{} // idempotency keys of creates in flight
	starting map[string]int           // admitted creates still starting, by project
	pinned   map[string]int           // ephemeral snapshots (image keys) held by forks
}

func newTable() *table {
	return &table{
		live: map[string]*sandbox{}, reserved: map[string]*sandbox{}, claims: map[string]chan struct{}{},
		starting: map[string]int{}, pinned: map[string]int{},
	}
}

// get returns the live sandbox id, or nil.
func (t *table) get(id string) *sandbox {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.live[id]
}

// count is the number of live sandboxes.
func (t *table) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.live)
}

// all returns the live sandboxes match accepts (nil: every one).
func (t *table) all(match func(*sandbox) bool) []*sandbox {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*sandbox, 0, len(t.live))
	for _, s := range t.live {
		if match == nil || match(s) {
			out = append(out, s)
		}
	}
	return out
}

// reserve holds a sandbox that is starting or pooled.
func (t *table) reserve(s *sandbox) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.reserved[s.id] = s
}

// commit makes a sandbox live.
func (t *table) commit(s *sandbox) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.reserved, s.id)
	t.live[s.id] = s
}

// forget drops a sandbox, live or reserved.
func (t *table) forget(s *sandbox) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.reserved, s.id)
	if t.live[s.id] == s {
		delete(t.live, s.id)
	}
}

// layers returns the layers live and reserved sandboxes use.
func (t *table) layers() map[string]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]bool{}
	for _, m := range []map[string]*sandbox{t.live, t.reserved} {
		for _, s := range m {
			for _, l := range s.layers {
				out[l] = true
			}
		}
	}
	return out
}

// claim claims an idempotency key for one create in flight. It returns
// release if the key was free, or else a channel closed when the create
// holding it releases it.
func (t *table) claim(key string) (release func(), busy <-chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if wait, ok := t.claims[key]; ok {
		return nil, wait
	}
	done := make(chan struct{})
	t.claims[key] = done
	return func() {
		t.mu.Lock()
		delete(t.claims, key)
		t.mu.Unlock()
		close(done)
	}, nil
}

// starts counts an admitted create of project as starting (d = 1) or
// done (d = -1).
func (t *table) starts(project string, d int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.starting[project] += d; t.starting[project] <= 0 {
		delete(t.starting, project)
	}
}

// projects counts live sandboxes and creates still starting by project.
func (t *table) projects() (total int, by map[string]int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	by = map[string]int64{}
	for _, s := range t.live {
		by[s.project]++
	}
	for p, c := range t.starting {
		by[p] += int64(c)
	}
	return len(t.live), by
}

// pin holds (d = 1) or lets go of (d = -1) an ephemeral snapshot, by image
// key, while a fork creates its children.
func (t *table) pin(key string, d int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.pinned[key] += d; t.pinned[key] <= 0 {
		delete(t.pinned, key)
	}
}

// holds reports whether a fork pins image key, or (with byLive) a live
// sandbox started from it.
func (t *table) holds(key string, byLive bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.pinned[key] > 0 {
		return true
	}
	if byLive {
		for _, s := range t.live {
			if s.image == key {
				return true
			}
		}
	}
	return false
}
