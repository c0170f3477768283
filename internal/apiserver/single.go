package apiserver

import (
	"context"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

// Single routes everything to one node (`dsec serve`).
type Single struct{ N Node }

var _ Router = Single{}

func (s Single) ForSandbox(ctx context.Context, id string) (Node, error) {
	_, node, ok := strings.Cut(id, "-")
	if !ok || node == "" {
		return nil, errdefs.Invalid("malformed sandbox id %q", clip(id))
	}
	if node != s.N.Name() {
		return nil, errdefs.NotFound("sandbox %s: no node %q in this deployment", clip(id), clip(node))
	}
	return s.N, nil
}

func (s Single) ForSnapshot(ctx context.Context, id string) (Node, error) {
	rest, ok := strings.CutPrefix(id, "snap-")
	if !ok {
		return nil, errdefs.Invalid("malformed snapshot id %q", clip(id))
	}
	return s.ForSandbox(ctx, rest)
}

func (s Single) ForFunction(ctx context.Context) (Node, error) { return s.N, nil }

func (s Single) Create(ctx context.Context, req *dsecv1.CreateSandboxRequest) (*dsecv1.Sandbox, error) {
	resp, err := s.N.CreateSandbox(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, errwire.FromConnect(err)
	}
	return resp.Msg, nil
}

func (s Single) CreateMany(ctx context.Context, specs []*dsecv1.SandboxSpec, keys []string, project string) *dsecv1.CreateSandboxesResponse {
	return s.N.CreateMany(ctx, specs, keys, project)
}

func (s Single) Nodes(ctx context.Context) []Node { return []Node{s.N} }

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
