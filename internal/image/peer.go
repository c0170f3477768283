package image

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/image/blobfs"
	"github.com/opendsec/dsec/internal/tenant"
)

// Images moved between nodes.
//
// A node of a cluster serves its images to the other nodes (PeerHandler,
// behind the cluster token): an image's record, and each layer's EROFS
// files, the blob by HTTP range. A node asked to start a sandbox from an
// image it does not hold imports it from a node that does
// (ImportFromPeer) as it imports an image pushed on demand: the records
// and metadata images are copied, the data stays on the peer and is read
// in chunks, checked against the layer's chunk digests and cached, as
// the sandbox touches it. A layer the peer itself loads on demand is
// served through its own chunk cache, so a registry's blob is fetched
// once per cluster's first reader, not once per node.
//
// A layer imported from a peer is read from that peer for as long as the
// node holds it: if the peer goes away, a read of a chunk not cached here
// fails with EIO (the sandbox and node stay up); the cached chunks keep
// serving.

// PeerPath is where a node serves its images to other nodes.
const PeerPath = "/dsec.node.v1/images/"

// Peers is how a store reaches other nodes' stores: the headers its
// requests carry (the cluster token) and its client.
type Peers struct {
	Header http.Header
	Client *http.Client
}

// SetPeers sets how the store reaches other nodes (see ImportFromPeer).
func (s *Store) SetPeers(p Peers) {
	s.peersMu.Lock()
	s.peers = p
	s.peersMu.Unlock()
	if c := s.connected(); c != nil {
		if err := c.setPeers(p.Header); err != nil {
			s.log.Warn("tell the blob server how to reach other nodes", slog.Any("error", err))
		}
	}
}

func (s *Store) peerAccess() Peers {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	return s.peers.withClient()
}

// withClient is p with defaultPeerClient if it names no client.
func (p Peers) withClient() Peers {
	if p.Client == nil {
		p.Client = defaultPeerClient
	}
	return p
}

// defaultPeerClient reaches peers when SetPeers gave no client: chunk
// reads of one layer go to one node, concurrently.
var defaultPeerClient = &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{
	MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second,
}}

// peerSource reads a blob another node serves, with the store's peer
// access as it is at each read: a layer mounted before the node's cluster
// agent set it (a restart re-adopting sandboxes) reads with it once set.
type peerSource struct {
	access func() Peers
	url    string
}

func (p peerSource) ReadAt(ctx context.Context, b []byte, off int64) (int, error) {
	pa := p.access()
	return blobfs.HTTPSource{URL: p.url, Header: pa.Header, Client: pa.Client}.ReadAt(ctx, b, off)
}

// peerParts are the layer files a node serves, by the name in the URL.
var peerParts = map[string]string{"erofs": ".erofs", "chunks": ".chunks", "blob": ".blob"}

// PeerHandler serves the store's images to other nodes, under PeerPath:
//
//	GET <PeerPath>record?project=P&name=N   the image N as project P sees it (JSON)
//	GET <PeerPath>layer/<diff>/<part>       a layer's erofs, chunks or blob (ranges)
//
// The caller is another node of the cluster (the server mounts the handler
// behind the cluster token).
func (s *Store) PeerHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+PeerPath+"record", func(w http.ResponseWriter, r *http.Request) {
		img, err := s.Lookup(r.URL.Query().Get("project"), r.URL.Query().Get("name"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(img)
	})
	mux.HandleFunc("GET "+PeerPath+"layer/{diff}/{part}", func(w http.ResponseWriter, r *http.Request) {
		diff, part := r.PathValue("diff"), r.PathValue("part")
		suffix, ok := peerParts[part]
		if !ok || !validDiff(diff) {
			http.Error(w, "no such layer file", http.StatusNotFound)
			return
		}
		release, err := s.Hold([]string{diff})
		if err != nil {
			http.Error(w, err.Error(), http.StatusNotFound)
			return
		}
		defer release()
		id := strings.TrimPrefix(diff, "sha256:")
		path := s.layerPath(diff) + suffix
		if part == "blob" && !exists(path) && exists(s.layerPath(diff)+".lazy") {
			// Loaded on demand here too: served through this node's
			// chunk cache, by its blob server.
			if path, _, err = s.lazyDevice(id); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		f, err := os.Open(path)
		if err != nil {
			if os.IsNotExist(err) {
				http.Error(w, fmt.Sprintf("layer %s is not stored as EROFS files here", shortID(diff)), http.StatusConflict)
				return
			}
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		http.ServeContent(w, r, "", st.ModTime(), f)
	})
	return mux
}

// validDiff says whether diff is a layer's diff ID as the store names
// them ("sha256:" and 64 hex digits): nothing else reaches a path.
func validDiff(diff string) bool {
	h, ok := strings.CutPrefix(diff, "sha256:")
	if !ok || len(h) != 64 {
		return false
	}
	for _, c := range h {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// ImportFromPeer imports image name, as project sees it, from the node
// serving its images at base ("http://host:port"): its record as is (name,
// owner, digest, configuration), each layer the store lacks as metadata,
// its data read on demand from the peer (see above). The record names
// peer, a node, as its source. Images that are not file system layers (a
// VM disk, a snapshot) are not moved: unimplemented.
func (s *Store) ImportFromPeer(ctx context.Context, peer, base, project, name string) (*Image, error) {
	if _, why := erofsSupportIn(filepath.Join(s.dir, "tmp")); why != "" {
		return nil, errdefs.Unimplemented("image %s is on node %s only, and this node cannot load layers on demand: %s", name, peer, why)
	}
	p := s.peerAccess()
	q := url.Values{"project": {project}, "name": {name}}
	var rec Image
	if err := peerGet(ctx, p, base+PeerPath+"record?"+q.Encode(), func(r io.Reader) error {
		return json.NewDecoder(io.LimitReader(r, 16<<20)).Decode(&rec)
	}); err != nil {
		return nil, fmt.Errorf("image %s from node %s: %w", name, peer, err)
	}
	switch {
	case rec.VM != nil:
		return nil, errdefs.Unimplemented("image %s is a VM disk on node %s: VM images are not moved between nodes (pull it on every node)", name, peer)
	case rec.Snapshot != nil:
		return nil, errdefs.Unimplemented("%s is a snapshot on node %s: snapshots stay on their node", name, peer)
	case rec.BuildCache != nil:
		return nil, errdefs.NotFound("image %q not found", name)
	case rec.Owner != tenant.Shared && rec.Owner != project:
		return nil, errdefs.NotFound("image %q not found", name)
	}
	if err := ValidName(rec.Name); err != nil {
		return nil, errdefs.Invalid("node %s answered an image named %q: %v", peer, rec.Name, err)
	}
	var holds []func()
	defer func() {
		for _, release := range holds {
			release()
		}
	}()
	for _, diff := range rec.Layers {
		if !validDiff(diff) {
			return nil, errdefs.Invalid("node %s answered a layer %q", peer, diff)
		}
		release, err := s.fetchPeerLayer(ctx, p, peer, base, diff)
		if err != nil {
			return nil, fmt.Errorf("image %s, layer %s from node %s: %w", name, shortID(diff), peer, err)
		}
		holds = append(holds, release)
	}
	out := &Image{Name: rec.Name, Owner: rec.Owner, Digest: rec.Digest, Layers: rec.Layers, Size: rec.Size,
		Created: time.Now().UTC(), Source: "node " + peer + " (on demand)", Config: rec.Config, Copy: true}
	if err := s.put(out); err != nil {
		return nil, err
	}
	return out, nil
}

// fetchPeerLayer stores layer diff unless the store has it: the peer's
// metadata image and blob description copied, its blob read from the
// peer on demand. It holds the layer.
func (s *Store) fetchPeerLayer(ctx context.Context, p Peers, peer, base, diff string) (func(), error) {
	if release, ok := s.holdIfPresent(diff); ok {
		return release, nil
	}
	out, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "peer-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(out)
	layerURL := base + PeerPath + "layer/" + diff + "/"
	for _, part := range []string{"erofs", "chunks"} {
		if err := peerGet(ctx, p, layerURL+part, func(r io.Reader) error {
			return writeFrom(setFile(out, peerParts[part]), r)
		}); err != nil {
			return nil, err
		}
	}
	var desc blobfs.Blob
	b, err := os.ReadFile(setFile(out, ".chunks"))
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, &desc); err != nil || desc.Size <= 0 {
		return nil, errdefs.Invalid("the blob's description from node %s is unreadable: %v", peer, err)
	}
	size := desc.Size
	if st, err := os.Stat(setFile(out, ".erofs")); err == nil {
		size += st.Size()
	}
	rb, _ := json.Marshal(lazySource{Peer: peer, URL: layerURL + "blob"})
	if err := os.WriteFile(setFile(out, ".lazy"), rb, 0o600); err != nil {
		return nil, err
	}
	return s.placeLayer(diff, out, []string{".chunks", ".lazy", ".erofs"}, size)
}

// peerGet reads url from a peer into read; a refusal is an error of the
// kind the peer's status says.
func peerGet(ctx context.Context, p Peers, url string, read func(io.Reader) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	for k, v := range p.Header {
		req.Header[k] = v
	}
	resp, err := p.Client.Do(req)
	if err != nil {
		return errdefs.Unavailable("%v", err).WithCause(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		why := strings.TrimSpace(string(msg))
		switch resp.StatusCode {
		case http.StatusNotFound:
			return errdefs.NotFound("%s", why)
		case http.StatusConflict:
			return errdefs.Unimplemented("%s", why)
		}
		return errdefs.Unavailable("%s: %s", resp.Status, why)
	}
	if err := read(resp.Body); err != nil {
		return errdefs.Unavailable("read from the peer: %v", err).WithCause(err)
	}
	return nil
}
