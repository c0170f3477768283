// Package apiserver is the control plane's front door: it authenticates
// callers, routes each call to the node that owns the sandbox (the node is
// encoded in the sandbox ID) and translates between the wire (Connect:
// JSON or binary, HTTP/1.1 or h2, and gRPC) and the nodes. It holds no
// per-sandbox state and no business logic.
package apiserver

import (
	"context"
	"io"
	"net"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
)

// Node is one node as the control plane sees it: in `dsec serve` the node
// agent's own Service (internal/node), in cluster mode a client of a remote
// node agent's API. Its sandbox verbs are the generated Connect handler
// methods of the public services — the proto documents each one — so a
// unary verb needs no code here or in the cluster's client: route.go
// names it (a line in its service's verbs) and routes it to the owning
// node (one line), and a remote node is its generated client. Streams have a callback form
// (Connect's stream types cannot be made in process). Every error is a
// Connect error carrying the node's classification (errwire.FromConnect
// reads it back).
type Node interface {
	Name() string

	dsecv1connect.FunctionServiceHandler
	dsecv1connect.SystemServiceHandler

	// LifecycleService, for this node's sandboxes.
	CreateSandbox(context.Context, *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error)
	// CreateMany creates one sandbox per spec on this node for project,
	// with each item's idempotency key (or none), as placement decided.
	CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse
	GetSandbox(context.Context, *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error)
	ListSandboxes(context.Context, *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error)
	DeleteSandbox(context.Context, *connect.Request[dsecv1.DeleteSandboxRequest]) (*connect.Response[dsecv1.DeleteSandboxResponse], error)
	Keepalive(context.Context, *connect.Request[dsecv1.KeepaliveRequest]) (*connect.Response[dsecv1.Sandbox], error)
	PauseSandbox(context.Context, *connect.Request[dsecv1.PauseSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error)
	ResumeSandbox(context.Context, *connect.Request[dsecv1.ResumeSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error)
	PauseSandboxes(context.Context, *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error)
	ResumeSandboxes(context.Context, *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error)
	DeleteSandboxes(context.Context, *connect.Request[dsecv1.BulkRequest]) (*connect.Response[dsecv1.BulkResponse], error)
	GetSandboxStats(context.Context, *connect.Request[dsecv1.GetSandboxStatsRequest]) (*connect.Response[dsecv1.SandboxStats], error)
	SetNetworkPolicy(context.Context, *connect.Request[dsecv1.SetNetworkPolicyRequest]) (*connect.Response[dsecv1.Network], error)
	GetNetworkPolicy(context.Context, *connect.Request[dsecv1.GetNetworkPolicyRequest]) (*connect.Response[dsecv1.Network], error)

	// ProcessService: its streams, with callbacks, and its unary verbs
	// (route.go).
	ExecEvents(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error
	ProcessEvents(ctx context.Context, req *dsecv1.ConnectProcessRequest, send func(*dsecv1.ExecEvent) error) error
	processVerbs

	// FilesystemService: its streams, with callbacks, and its unary verbs
	// (route.go).
	ReadFileChunks(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) error
	WriteFileFrom(ctx context.Context, hdr *dsecv1.WriteFileHeader, r io.Reader) (*connect.Response[dsecv1.FileInfo], error)
	WatchEvents(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error
	filesystemVerbs

	// DialPort connects to a TCP port of a sandbox (its loopback
	// interface, through its agent) and returns the connection; ctx bounds
	// the connect only. Nothing listening there is a not_found error, as
	// is a sandbox of a project ctx does not reach.
	DialPort(ctx context.Context, sandboxID string, port uint32) (net.Conn, error)

	// Events streams the node's lifecycle events the caller may see (the
	// EventService, with a callback): first a heartbeat once the
	// subscription is in place, then the events; later heartbeats only
	// when heartbeats is set.
	Events(ctx context.Context, req *dsecv1.SubscribeRequest, send func(*dsecv1.Event) error, heartbeats bool) error

	// SnapshotService, LogService and ScreenService.
	dsecv1connect.SnapshotServiceHandler
	dsecv1connect.LogServiceHandler
	dsecv1connect.ScreenServiceHandler

	// VolumeService, for this node's volumes: its unary verbs, and its
	// streams with callbacks (volume.go).
	volumeVerbs
	ReadVolumeFileChunks(ctx context.Context, req *dsecv1.ReadVolumeFileRequest, send func(*dsecv1.ReadVolumeFileResponse) error) error
	WriteVolumeFileFrom(ctx context.Context, hdr *dsecv1.WriteVolumeFileHeader, r io.Reader) (*connect.Response[dsecv1.VolumeFileInfo], error)

	// Images live on each node; the control plane fans image operations
	// out to every node and their progress in (ImageService's verbs, with
	// callbacks).
	Images(ctx context.Context) []*dsecv1.Image
	Image(ctx context.Context, name string) (*dsecv1.Image, error)
	RemoveImage(ctx context.Context, name string) error
	Pull(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)
	Push(ctx context.Context, req *dsecv1.PushImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)
	Export(ctx context.Context, req *dsecv1.ExportImageRequest, send func(*dsecv1.ExportImageChunk) error) error
	Upload(ctx context.Context, hdr *dsecv1.UploadImageHeader, r io.Reader) (*dsecv1.Image, error)
	Bootstrap(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)
	// Builds run on one node, from a context uploaded to it; a commit on
	// the sandbox's node; a prune on every node.
	UploadContext(ctx context.Context, hdr *dsecv1.UploadBuildContextHeader, r io.Reader) (*dsecv1.BuildContext, error)
	Build(ctx context.Context, req *dsecv1.BuildImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)
	Commit(ctx context.Context, req *dsecv1.CommitSandboxRequest) (*dsecv1.Image, error)
	PruneCache(ctx context.Context) (*dsecv1.PruneBuildCacheResponse, error)
}

// NodeHandlers are a node's public services for its own sandboxes, as a
// node agent serves them to the control plane (NewNodeAPI).
type NodeHandlers interface {
	dsecv1connect.LifecycleServiceHandler
	dsecv1connect.ProcessServiceHandler
	dsecv1connect.FilesystemServiceHandler
	dsecv1connect.SnapshotServiceHandler
	dsecv1connect.LogServiceHandler
	dsecv1connect.ScreenServiceHandler
	dsecv1connect.FunctionServiceHandler
	dsecv1connect.SystemServiceHandler
	dsecv1connect.ImageServiceHandler
	dsecv1connect.VolumeServiceHandler
	dsecv1connect.EventServiceHandler
}

// Router finds nodes (the owner of a sandbox) and places new sandboxes.
// Single is the router of `dsec serve`; a cluster's router (package
// cluster) places over many nodes.
type Router interface {
	// ForSandbox returns the node that owns sandbox id: a malformed id is
	// invalid, an id of a node the deployment never had is not_found, and
	// an unreachable node is unavailable (infra).
	ForSandbox(ctx context.Context, id string) (Node, error)
	// ForSnapshot returns the node that holds snapshot id.
	ForSnapshot(ctx context.Context, id string) (Node, error)
	// ForFunction chooses the node for function calls.
	ForFunction(ctx context.Context) (Node, error)
	// Create places and creates a sandbox for req.Project: in `dsec serve`
	// on the one node; in a cluster on the node placement picks, elsewhere
	// when that node refuses. A failed placement says why.
	Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error)
	// CreateMany places and creates one sandbox per spec for project; keys
	// holds each item's idempotency key (or is nil). Items succeed or fail
	// on their own.
	CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse
	// Nodes lists every reachable node (for listing, bulk and image
	// operations).
	Nodes(ctx context.Context) []Node
}

// fanOut calls f on every node concurrently (at most 32 calls at once: a
// cluster has many nodes) and returns the results in node order. The
// first error in node order wins.
func fanOut[T any](nodes []Node, f func(Node) (T, error)) ([]T, error) {
	out := make([]T, len(nodes))
	errs := make([]error, len(nodes))
	if len(nodes) == 1 {
		out[0], errs[0] = f(nodes[0])
		return out, errs[0]
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for i, n := range nodes {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			out[i], errs[i] = f(n)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return out, err
		}
	}
	return out, nil
}
