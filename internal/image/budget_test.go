package image

import (
	"bytes"
	"crypto/rand"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestTheStoreKeepsItsLayersWithinItsBudget: past its byte budget the
// store makes room for new layers by removing the least recently used
// cached build steps and copies of other nodes' images, only those whose
// removal frees a layer and none a sandbox uses; when only images users
// made remain, a new layer is refused with a clear error and nothing is
// written; prune removes what a project reaches of what is left.
func TestTheStoreKeepsItsLayersWithinItsBudget(t *testing.T) {
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	running := map[string]bool{}
	s.SetInUse(func() map[string]bool {
		mu.Lock()
		defer mu.Unlock()
		out := map[string]bool{}
		for l := range running {
			out[l] = true
		}
		return out
	})
	// layer adds a layer of 1 MiB of random bytes.
	layer := func() string {
		t.Helper()
		body := make([]byte, 1<<20)
		rand.Read(body)
		diff, _, release, err := s.AddLayer(bytes.NewReader(tarOf(t, []entry{{name: "data", body: string(body)}})))
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		return diff
	}
	const project = "p1"
	put := func(img *Image) {
		t.Helper()
		img.Owner, img.Created, img.Digest = project, time.Now().UTC(), img.Layers[len(img.Layers)-1]
		if err := s.Put(img); err != nil {
			t.Fatal(err)
		}
	}
	user, shared := layer(), layer()
	put(&Image{Name: "task", Layers: []string{user, shared}})
	steps := func(name string) *BuildCacheMeta { return &BuildCacheMeta{Key: name, Step: "RUN " + name} }
	// Oldest first: a step whose layers the task image also names (its
	// removal frees nothing), a copy a sandbox runs from, a step, a copy,
	// a step.
	put(&Image{Name: "build-cache/0", Layers: []string{user}, BuildCache: steps("0")})
	busy := layer()
	put(&Image{Name: "copy-busy", Layers: []string{busy}, Copy: true})
	mu.Lock()
	running[busy] = true
	mu.Unlock()
	old, copied, recent := layer(), layer(), layer()
	put(&Image{Name: "build-cache/old", Layers: []string{old}, BuildCache: steps("old")})
	put(&Image{Name: "copy", Layers: []string{copied}, Copy: true})
	put(&Image{Name: "build-cache/recent", Layers: []string{recent}, BuildCache: steps("recent")})
	// grow adds a layer an image of the project names.
	grow := func(name string) {
		t.Helper()
		put(&Image{Name: name, Layers: []string{layer()}})
	}
	key := func(name string) string { return tenant.ImageKey(project, name) }
	have := func(name string) bool {
		_, err := s.Get(key(name))
		return err == nil
	}

	used := s.LayerBytes()
	if used < 6<<20 {
		t.Fatalf("six layers of 1 MiB take %d bytes", used)
	}
	s.SetBudget(used + 512<<10) // room for half a layer
	if got := s.Budget(); got != used+512<<10 {
		t.Fatalf("budget %d, set %d", got, used+512<<10)
	}

	t.Run("a new layer makes room by removing the least recently used step", func(t *testing.T) {
		grow("kept-1")
		for name, want := range map[string]bool{"kept-1": true, "task": true, "build-cache/0": true, "copy-busy": true, "build-cache/old": false, "copy": true, "build-cache/recent": true} {
			if have(name) != want {
				t.Errorf("%s kept: %v, want %v", name, !want, want)
			}
		}
		if _, ok := s.haveLayer(old); ok {
			t.Error("the removed step's layer is still stored")
		}
		if got := s.LayerBytes(); got > s.Budget() {
			t.Errorf("layers take %d bytes past the budget %d", got, s.Budget())
		}
	})

	t.Run("a lookup makes an image recently used", func(t *testing.T) {
		if _, err := s.Lookup(project, "copy"); err != nil {
			t.Fatal(err)
		}
		grow("kept-2") // the next least recently used that frees: the recent step
		if have("build-cache/recent") || !have("copy") {
			t.Errorf("after a lookup of the copy: step kept %v, copy kept %v", have("build-cache/recent"), have("copy"))
		}
	})

	t.Run("what cannot go is never removed, and a new layer is refused", func(t *testing.T) {
		s.SetBudget(2 << 20)
		before := s.storedLayers()
		_, _, _, err := s.AddLayer(bytes.NewReader(tarOf(t, []entry{{name: "more", body: "x"}})))
		if !errdefs.Is(err, errdefs.KindExhausted) || !strings.Contains(err.Error(), "budget") {
			t.Fatalf("a layer past the budget: %v, want exhausted naming the budget", err)
		}
		for _, name := range []string{"task", "kept-1", "kept-2", "build-cache/0", "copy-busy"} {
			if !have(name) {
				t.Errorf("%s was removed to make room", name)
			}
		}
		if have("copy") {
			t.Error("the unused copy was kept while a layer was refused")
		}
		after := s.storedLayers()
		for id := range after {
			if !before[id] {
				t.Errorf("layer %s written although refused", shortID(id))
			}
		}
		if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "tmp")); len(ents) != 0 {
			t.Errorf("a refused layer left %d entries in tmp", len(ents))
		}
	})

	t.Run("prune removes what the project reaches and no sandbox uses", func(t *testing.T) {
		s.SetBudget(0)
		put(&Image{Name: "copy-2", Layers: []string{layer()}, Copy: true})
		// A copy over a layer a sandbox uses (a running sandbox of its
		// base) whose own layer none does.
		put(&Image{Name: "copy-3", Layers: []string{busy, layer()}, Copy: true})
		other := layer()
		if err := s.Put(&Image{Name: "build-cache/x", Owner: "p2", Layers: []string{other}, BuildCache: steps("x"), Digest: other}); err != nil {
			t.Fatal(err)
		}
		p := s.Prune(func(owner string) bool { return owner == project }, false)
		if p.BuildSteps != 1 || p.Copies != 2 || p.LayerBytes < 2<<20 {
			t.Errorf("prune: %+v, want one step, two copies, at least 2 MiB", p)
		}
		if have("build-cache/0") || have("copy-2") || have("copy-3") {
			t.Error("prune kept a step or an unused copy")
		}
		if !have("task") || !have("copy-busy") {
			t.Error("prune removed an image or a copy a sandbox uses")
		}
		if _, err := s.Get(tenant.ImageKey("p2", "build-cache/x")); err != nil {
			t.Errorf("prune removed another project's step: %v", err)
		}
		if _, ok := s.haveLayer(user); !ok {
			t.Error("prune removed a layer an image names")
		}
	})
}
