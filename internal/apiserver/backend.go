// Package apiserver is the control plane's front door: it authenticates
// callers, routes each call to the node that owns the sandbox (the node is
// encoded in the sandbox ID) and translates between the wire (Connect:
// JSON or binary, HTTP/1.1 or h2, and gRPC) and the nodes. It holds no
// per-sandbox state and no business logic.
package apiserver

import (
	"context"
	"io"
	"sync"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

// Node is one node as the apiserver sees it: in `dsec serve` the node agent
// itself, in cluster mode a client of a remote node agent.
type Node interface {
	Name() string
	Info(ctx context.Context) *dsecv1.NodeInfo

	Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error)
	Get(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	List(ctx context.Context, req *dsecv1.ListSandboxesRequest) (*dsecv1.ListSandboxesResponse, error)
	Delete(ctx context.Context, id string) error
	Keepalive(ctx context.Context, req *dsecv1.KeepaliveRequest) (*dsecv1.Sandbox, error)

	Exec(ctx context.Context, req *dsecv1.ExecRequest) (*dsecv1.ExecResult, error)
	ExecStream(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error
	ConnectProcess(ctx context.Context, req *dsecv1.ConnectProcessRequest, send func(*dsecv1.ExecEvent) error) error
	WriteStdin(ctx context.Context, req *dsecv1.WriteStdinRequest) error
	SignalProcess(ctx context.Context, req *dsecv1.SignalProcessRequest) error
	ResizePTY(ctx context.Context, req *dsecv1.ResizePTYRequest) error
	ListProcesses(ctx context.Context, req *dsecv1.ListProcessesRequest) (*dsecv1.ListProcessesResponse, error)

	ReadFile(ctx context.Context, req *dsecv1.ReadFileRequest, send func(*dsecv1.ReadFileResponse) error) error
	WriteFile(ctx context.Context, hdr *dsecv1.WriteFileHeader, r io.Reader) (*dsecv1.FileInfo, error)
	Stat(ctx context.Context, req *dsecv1.StatRequest) (*dsecv1.FileInfo, error)
	ListDir(ctx context.Context, req *dsecv1.ListDirRequest) (*dsecv1.ListDirResponse, error)
	MakeDir(ctx context.Context, req *dsecv1.MakeDirRequest) (*dsecv1.FileInfo, error)
	Remove(ctx context.Context, req *dsecv1.RemoveRequest) error
	Rename(ctx context.Context, req *dsecv1.RenameRequest) (*dsecv1.FileInfo, error)
	WatchDir(ctx context.Context, req *dsecv1.WatchDirRequest, send func(*dsecv1.WatchDirEvent) error) error
	Stats(ctx context.Context, id string) (*dsecv1.SandboxStats, error)
	Screenshot(ctx context.Context, req *dsecv1.ScreenshotRequest) (*dsecv1.ScreenshotResponse, error)
	SendInput(ctx context.Context, req *dsecv1.SendInputRequest) error
	OpenVNC(ctx context.Context, req *dsecv1.OpenVNCRequest) (*dsecv1.OpenVNCResponse, error)

	CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse
	Pause(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	Resume(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	Bulk(ctx context.Context, op, selector string) (*dsecv1.BulkResponse, error)
	Snapshot(ctx context.Context, req *dsecv1.SnapshotRequest) (*dsecv1.SnapshotInfo, error)
	ListSnapshots(ctx context.Context) []*dsecv1.SnapshotInfo
	DeleteSnapshot(ctx context.Context, id string) error
	Fork(ctx context.Context, req *dsecv1.ForkRequest) (*dsecv1.CreateSandboxesResponse, error)
	GetLog(ctx context.Context, req *dsecv1.GetLogRequest) (*dsecv1.GetLogResponse, error)
	Replay(ctx context.Context, req *dsecv1.ReplayRequest) (*dsecv1.ReplayResponse, error)
	Capacity(ctx context.Context) *dsecv1.Capacity

	RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResult, error)
	RunCodeBatch(ctx context.Context, reqs []*dsecv1.RunCodeRequest) ([]*dsecv1.RunCodeResult, error)
	Languages(ctx context.Context, image string) ([]*dsecv1.LanguageInfo, error)

	ListImages(ctx context.Context) []*dsecv1.Image
	GetImage(ctx context.Context, name string) (*dsecv1.Image, error)
	DeleteImage(ctx context.Context, name string) error
	PullImage(ctx context.Context, req *dsecv1.PullImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)
	UploadImage(ctx context.Context, hdr *dsecv1.UploadImageHeader, r io.Reader) (*dsecv1.Image, error)
	BootstrapImage(ctx context.Context, req *dsecv1.BootstrapImageRequest, progress func(*dsecv1.ImageProgress)) (*dsecv1.Image, error)
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
