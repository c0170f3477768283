package clusternode

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Pull on demand in a cluster: placement prefers the nodes that hold a
// sandbox's images, and when none of those can take it, places it on one
// that does not (placement.Request.Fetchable). That node, before it
// creates, imports each image it lacks from a node that has it: the
// image's record and its layers' metadata, the data then read on demand
// from that node as the sandbox touches it (image.ImportFromPeer). No
// create fails for want of a local copy while some live node holds the
// image; an import that fails leaves the create to fail as "not found",
// which the control plane places elsewhere.

// fetch is one import in flight, which concurrent creates of the same
// image wait for.
type fetch struct {
	done chan struct{}
	err  error
}

// fetchImages imports the images specs need and this node lacks, as
// project sees them, each once however many specs name it.
func (a *Agent) fetchImages(ctx context.Context, specs []*dsecv1.SandboxSpec, project string) {
	seen := map[string]bool{}
	for _, spec := range specs {
		for _, name := range cluster.SpecImages(spec) {
			if seen[name] {
				continue
			}
			seen[name] = true
			if _, err := a.n.Images().Lookup(project, name); err == nil {
				continue
			}
			if err := a.fetchImage(ctx, project, name); err != nil {
				a.log.Warn("image not imported from another node", slog.String("image", name), slog.String("project", project), slog.Any("error", err))
			}
		}
	}
}

// fetchImage imports image name from a node that holds it, waiting for
// an import of it already in flight.
func (a *Agent) fetchImage(ctx context.Context, project, name string) error {
	key := tenant.ImageKey(project, name)
	a.fetchMu.Lock()
	f, ok := a.fetching[key]
	if !ok {
		f = &fetch{done: make(chan struct{})}
		a.fetching[key] = f
		go func() {
			// Not bound to the first caller's context: the callers
			// waiting behind it need the import whether or not it gives
			// up.
			fctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			f.err = a.importImage(fctx, project, name)
			cancel()
			a.fetchMu.Lock()
			delete(a.fetching, key)
			a.fetchMu.Unlock()
			close(f.done)
		}()
	}
	a.fetchMu.Unlock()
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// importImage imports image name from one of the live nodes whose load
// lists it, in random order, the first that serves it.
func (a *Agent) importImage(ctx context.Context, project, name string) error {
	nodes, err := a.store.Nodes(ctx)
	if err != nil {
		return err
	}
	rand.Shuffle(len(nodes), func(i, j int) { nodes[i], nodes[j] = nodes[j], nodes[i] })
	var last error = errdefs.NotFound("no live node holds image %q", name)
	for _, n := range nodes {
		if n.Name == a.n.Name() || n.Load == nil || n.Address == "" || !holds(n.Load.Images, project, name) {
			continue
		}
		img, err := a.n.Images().ImportFromPeer(ctx, n.Name, "http://"+n.Address, project, name)
		if err != nil {
			last = err
			continue
		}
		a.log.Info("image imported from another node, its data on demand", slog.String("image", img.Name), slog.String("from", n.Name), slog.Int("layers", len(img.Layers)))
		a.n.ImagesChanged()
		return nil
	}
	return last
}

// holds says whether a node's published images include name as project
// sees it (its own, or the shared one).
func holds(images []string, project, name string) bool {
	for _, img := range images {
		if img == name || img == tenant.ImageKey(project, name) {
			return true
		}
	}
	return false
}
