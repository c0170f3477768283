package e2b

import (
	"encoding/base64"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/sandboxid"
)

// E2B's snapshots are dsec's: createSnapshot takes a native snapshot
// (containers: the writable layer; microVMs and VMs: the whole machine),
// whose ID is the snapshotID, accepted as a templateID at create.

// snapshotJSON is E2B's SnapshotInfo.
type snapshotJSON struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func snapshotOf(s *dsecv1.SnapshotInfo) snapshotJSON {
	out := snapshotJSON{SnapshotID: s.Id, Names: []string{}}
	if s.Name != "" {
		out.Names = append(out.Names, s.Name)
	}
	return out
}

// isSnapshotID reports whether a template ID is a dsec snapshot ID.
func isSnapshotID(id string) bool {
	_, err := sandboxid.SnapshotNode(id)
	return err == nil
}

func (f *Facade) mountSnapshots(h func(string, func(http.ResponseWriter, *http.Request, string))) {
	h("POST /sandboxes/{id}/snapshots", f.createSnapshot)
	h("GET /snapshots", f.listSnapshots)
	h("DELETE /templates/{id}", f.deleteTemplate)
}

// createSnapshot is POST /sandboxes/{id}/snapshots: a snapshot of a
// running or paused sandbox, which keeps its state.
func (f *Facade) createSnapshot(w http.ResponseWriter, r *http.Request, _ string) {
	ctx := r.Context()
	id := r.PathValue("id")
	var in struct {
		Name string `json:"name"`
	}
	if err := decode(r, &in); err != nil {
		apiError(w, err)
		return
	}
	n, _, err := f.live(ctx, id)
	if err != nil {
		apiError(w, err)
		return
	}
	snap, err := apiserver.Do(ctx, n, &dsecv1.SnapshotRequest{SandboxId: id, Name: in.Name}, apiserver.Node.Snapshot)
	if err != nil {
		apiError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, snapshotOf(snap))
}

// listSnapshots is GET /snapshots: the caller's snapshots on every node,
// newest first, filtered by sandboxID and name (a snapshot's name or ID),
// paged with limit and X-Next-Token.
func (f *Facade) listSnapshots(w http.ResponseWriter, r *http.Request, _ string) {
	ctx := r.Context()
	q := r.URL.Query()
	limit, after, err := parsePage(q.Get("limit"), q.Get("nextToken"))
	if err != nil {
		apiError(w, err)
		return
	}
	var all []*dsecv1.SnapshotInfo
	for _, n := range f.r.Nodes(ctx) {
		list, err := apiserver.Do(ctx, n, &dsecv1.ListSnapshotsRequest{}, apiserver.Node.ListSnapshots)
		if err != nil {
			apiError(w, err)
			return
		}
		for _, s := range list.Snapshots {
			if sb := q.Get("sandboxID"); sb != "" && s.SandboxId != sb {
				continue
			}
			if name := q.Get("name"); name != "" && s.Name != name && s.Id != name {
				continue
			}
			all = append(all, s)
		}
	}
	keys := make([]cursor, len(all))
	for i, s := range all {
		keys[i] = cursor{s.GetCreatedAt().AsTime(), s.Id}
	}
	order, next := pageOf(keys, true, after, limit)
	out := make([]snapshotJSON, 0, len(order))
	for _, i := range order {
		out = append(out, snapshotOf(all[i]))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteTemplate is DELETE /templates/{id}, which the SDKs' deleteSnapshot
// calls: a snapshot is deleted (204); an ID that names no snapshot,
// template or image is not found (404: deleteSnapshot answers false).
// Templates themselves cannot be deleted here.
func (f *Facade) deleteTemplate(w http.ResponseWriter, r *http.Request, _ string) {
	ctx := r.Context()
	id := r.PathValue("id")
	if isSnapshotID(id) {
		n, err := f.r.ForSnapshot(ctx, id)
		if err == nil {
			_, err = apiserver.Do(ctx, n, &dsecv1.DeleteSnapshotRequest{Id: id}, apiserver.Node.DeleteSnapshot)
		}
		if err != nil {
			if errdefs.Is(err, errdefs.KindInvalid) {
				err = errdefs.NotFound("snapshot %s not found", clip(id))
			}
			apiError(w, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	name := id
	if k, rest, ok := strings.Cut(id, "/"); ok && kinds[k] {
		name = rest
	}
	if _, ok := f.cfg.Templates[name]; ok || f.isImage(r, name) {
		apiError(w, errdefs.Unimplemented("template %s cannot be deleted through dsec's E2B facade (only snapshots can)", clip(id)))
		return
	}
	apiError(w, errdefs.NotFound("template %s not found", clip(id)))
}

// isImage reports whether some node has an image the caller sees named
// name.
func (f *Facade) isImage(r *http.Request, name string) bool {
	for _, n := range f.r.Nodes(r.Context()) {
		if _, err := n.Image(r.Context(), name); err == nil {
			return true
		}
	}
	return false
}

// Listings (sandboxes and snapshots) are ordered by creation time, then
// ID, and paged with an opaque token naming the last item sent: the next
// page starts after that position, so items created or deleted between
// pages neither shift nor repeat the others.

// cursor is an item's position in a listing.
type cursor struct {
	created time.Time
	id      string
}

func (c cursor) before(d cursor) bool {
	if !c.created.Equal(d.created) {
		return c.created.Before(d.created)
	}
	return c.id < d.id
}

func (c cursor) token() string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(c.created.UnixNano(), 10) + "/" + c.id))
}

func parseCursor(t string) (*cursor, error) {
	bad := errdefs.Invalid("nextToken is not a token this server issued")
	b, err := base64.RawURLEncoding.DecodeString(t)
	if err != nil {
		return nil, bad
	}
	ns, id, ok := strings.Cut(string(b), "/")
	n, err := strconv.ParseInt(ns, 10, 64)
	if !ok || err != nil || id == "" {
		return nil, bad
	}
	return &cursor{time.Unix(0, n), id}, nil
}

// parsePage reads a listing's limit (default 100, at most 1000) and token.
func parsePage(limit, token string) (int, *cursor, error) {
	n := defaultListLimit
	if limit != "" {
		var err error
		if n, err = strconv.Atoi(limit); err != nil || n < 1 || n > maxListLimit {
			return 0, nil, errdefs.Invalid("limit must be between 1 and %d", maxListLimit)
		}
	}
	if token == "" {
		return n, nil, nil
	}
	c, err := parseCursor(token)
	return n, c, err
}

// pageOrder is the indexes of keys in listing order: newest first with
// desc, else oldest first.
func pageOrder(keys []cursor, desc bool) []int {
	idx := make([]int, len(keys))
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool {
		if desc {
			return keys[idx[b]].before(keys[idx[a]])
		}
		return keys[idx[a]].before(keys[idx[b]])
	})
	return idx
}

// pageOf is the page of a listing after cursor after, at most limit
// items, as indexes of keys in listing order, and the token of the next
// page ("" for the last page).
func pageOf(keys []cursor, desc bool, after *cursor, limit int) (page []int, next string) {
	order := pageOrder(keys, desc)
	start := 0
	if after != nil {
		start = sort.Search(len(order), func(i int) bool {
			k := keys[order[i]]
			if desc {
				return k.before(*after)
			}
			return after.before(k)
		})
	}
	end := min(start+limit, len(order))
	if end < len(order) {
		next = keys[order[end-1]].token()
	}
	return order[start:end], next
}
