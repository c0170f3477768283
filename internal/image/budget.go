package image

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/errdefs"
)

// The store keeps its layers within a byte budget (SetBudget). What the
// node can load again is a cache: a build's cached steps and the copies
// of other nodes' images it imported on demand (Image.Copy). Before new
// layer data is written (an import, a build step, a commit or snapshot, a
// bootstrap), the least recently used of those go until the layers fit
// the budget; if they still do not, the write is refused with a clear
// error and nothing is written. Images a user made or pulled are never
// removed behind their back. The chunks of layers loaded on demand have
// a budget of their own (SetChunkBudget).

// SetBudget sets the byte budget of the store's layers (0: half of the
// file system the store is on).
func (s *Store) SetBudget(bytes int64) { s.budget = bytes }

// Budget is the byte budget of the store's layers.
func (s *Store) Budget() int64 {
	if s.budget > 0 {
		return s.budget
	}
	var st unix.Statfs_t
	if err := unix.Statfs(s.dir, &st); err != nil {
		return 0
	}
	return int64(st.Blocks) * st.Bsize / 2
}

// LayerBytes is what the store's layers take on disk: the unpacked
// layers' files, the EROFS images and blobs, and for layers loaded on
// demand their metadata (their data is the chunk cache's).
func (s *Store) LayerBytes() int64 {
	var n int64
	for id := range s.storedLayers() {
		n += s.layerBytes(id)
	}
	return n
}

// storedLayers are the hex diff IDs of the layers in the layers
// directory, complete or not.
func (s *Store) storedLayers() map[string]bool {
	ents, _ := os.ReadDir(filepath.Join(s.dir, "layers"))
	out := map[string]bool{}
	for _, e := range ents {
		id := e.Name()
		for _, suf := range append(layerSuffixes, ".size", ".lazy") {
			id = strings.TrimSuffix(id, suf)
		}
		out[id] = true
	}
	return out
}

// layerBytes is what layer id (hex diff ID) takes on disk.
func (s *Store) layerBytes(id string) int64 {
	base := filepath.Join(s.dir, "layers", id)
	if st, err := os.Lstat(base); err == nil && st.IsDir() {
		n, _ := s.haveLayer(id) // its size marker (dirSize)
		return n
	}
	var n int64
	for _, suf := range append(layerSuffixes, ".lazy") {
		var st unix.Stat_t
		if unix.Stat(base+suf, &st) == nil {
			n += st.Blocks * 512
		}
	}
	return n
}

// evictable says whether the node may remove img to make room: a cached
// build step, or a copy of another node's image.
func evictable(img *Image) bool { return img.BuildCache != nil || img.Copy }

// touch marks the image with key used now. s.mu is held.
func (s *Store) touch(key string) { s.used[key] = time.Now() }

// admit makes room for new layer data: past the budget, the least
// recently used cached build steps and image copies go; if the layers
// are still at the budget, the write is refused. After the write, fit
// brings the layers back within the budget the same way.
func (s *Store) admit() error {
	budget := s.Budget()
	if budget <= 0 {
		return nil
	}
	used := s.reclaim(budget - 1)
	if used < budget {
		return nil
	}
	return errdefs.Exhausted(0, "the node's image store is full: its layers take %d MiB of its %d MiB budget, and no cached build step or image copy can go (remove images with `dsec image rm`, or raise --image-store-mb)",
		used>>20, budget>>20)
}

// fit removes the least recently used cached build steps and image
// copies while the layers take more than the budget (see admit).
func (s *Store) fit() {
	if budget := s.Budget(); budget > 0 {
		s.reclaim(budget)
	}
}

// reclaim removes evictable records, least recently used first, while
// the layers take more than limit bytes, only records whose removal frees
// a layer: one no other record names and no sandbox or call holds. It
// returns the bytes the layers take after (at most).
func (s *Store) reclaim(limit int64) int64 {
	removed := false
	defer func() {
		if removed {
			s.GC()
		}
	}()
	// The layers are on the store's file system: while all of it that is
	// in use fits the limit, so do they, and nothing is measured (the
	// common case: every write checks).
	var st unix.Statfs_t
	if unix.Statfs(s.dir, &st) == nil {
		if inUse := int64(st.Blocks-st.Bfree) * st.Bsize; inUse <= limit {
			return inUse
		}
	}
	// Measured without the lock (creates hold layers under it): a layer
	// arriving or going meanwhile is counted at the next write.
	used := int64(0)
	size := map[string]int64{}
	for id := range s.storedLayers() {
		size[id] = s.layerBytes(id)
		used += size[id]
	}
	if used <= limit {
		return used
	}
	s.layerMu.Lock()
	defer s.layerMu.Unlock()
	busy := s.busyLayers()
	s.mu.Lock()
	defer s.mu.Unlock()
	refs := s.layerRefs()
	var candidates []*Image
	for _, img := range s.images {
		if evictable(img) {
			candidates = append(candidates, img)
		}
	}
	sort.Slice(candidates, func(i, j int) bool { return s.used[candidates[i].Key()].Before(s.used[candidates[j].Key()]) })
	for _, img := range candidates {
		if used <= limit {
			break
		}
		free := freed(img, refs, busy)
		if len(free) == 0 {
			continue
		}
		if !s.dropRecord(img, refs) {
			continue
		}
		removed = true
		var frees int64
		for _, l := range free {
			frees += size[l]
		}
		used -= frees
		s.log.Info("image store over its budget: removed the least recently used "+what(img),
			"image", img.Name, "owner", img.Owner, "freed", frees)
	}
	return used
}

// layerRefs counts the records naming each layer (hex diff ID). s.mu is
// held.
func (s *Store) layerRefs() map[string]int {
	refs := map[string]int{}
	for _, img := range s.images {
		for _, l := range recordLayers(img) {
			refs[l]++
		}
	}
	return refs
}

// freed are the layers removing img's record would free: those no other
// record names and no sandbox or call holds (busy).
func freed(img *Image, refs map[string]int, busy map[string]bool) []string {
	var out []string
	for _, l := range recordLayers(img) {
		if refs[l] == 1 && !busy[l] {
			out = append(out, l)
		}
	}
	return out
}

// dropRecord removes img's record, counting its layers out of refs; it
// says whether it did. s.mu is held.
func (s *Store) dropRecord(img *Image, refs map[string]int) bool {
	if err := os.Remove(s.refPath(img.Key())); err != nil && !os.IsNotExist(err) {
		s.log.Warn("remove an image record", "image", img.Key(), "error", err)
		return false
	}
	delete(s.images, img.Key())
	delete(s.used, img.Key())
	for _, l := range recordLayers(img) {
		refs[l]--
	}
	return true
}

func what(img *Image) string {
	if img.BuildCache != nil {
		return "cached build step"
	}
	return "copy of another node's image"
}

// recordLayers are the hex diff IDs of the layers a record names, once
// each.
func recordLayers(img *Image) []string {
	seen := map[string]bool{}
	var out []string
	add := func(ls []string) {
		for _, l := range ls {
			id := strings.TrimPrefix(l, "sha256:")
			if !seen[id] {
				seen[id] = true
				out = append(out, id)
			}
		}
	}
	add(img.Layers)
	for _, sc := range img.GetSnapshot().GetSidecars() {
		add(sc.Layers)
	}
	return out
}

// Pruned is what Prune removed.
type Pruned struct {
	// BuildSteps and Copies are the cached build steps and the copies of
	// other nodes' images removed.
	BuildSteps, Copies int64
	// LayerBytes are the bytes of layers freed; ChunkBytes those of the
	// chunk cache.
	LayerBytes, ChunkBytes int64
}

// Prune removes the cached build steps and the image copies of the
// owners reaches allows, the copies only where that frees a layer (a copy
// a sandbox runs from frees none: it stays), then the layers nothing else
// needs; when chunks is set, also every cached chunk of a layer no running
// sandbox uses.
func (s *Store) Prune(reaches func(owner string) bool, chunks bool) Pruned {
	var out Pruned
	before := s.LayerBytes()
	s.layerMu.Lock()
	busy := s.busyLayers()
	s.mu.Lock()
	refs := s.layerRefs()
	for _, img := range s.images {
		if !evictable(img) || !reaches(img.Owner) {
			continue
		}
		if img.Copy && len(freed(img, refs, busy)) == 0 {
			continue
		}
		if !s.dropRecord(img, refs) {
			continue
		}
		if img.BuildCache != nil {
			out.BuildSteps++
		} else {
			out.Copies++
		}
	}
	s.mu.Unlock()
	s.layerMu.Unlock()
	s.GC()
	out.LayerBytes = max(before-s.LayerBytes(), 0)
	if chunks {
		if c := s.connected(); c != nil {
			if err := c.setPinned(s.pinnedLazy()); err == nil {
				out.ChunkBytes, _ = c.shrink(0)
			}
		}
	}
	return out
}
