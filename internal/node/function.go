package node

import (
	"context"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/function"
)

func (n *Node) functions() (*function.Driver, error) {
	f, ok := n.drivers[substrate.KindFunction].(*function.Driver)
	if !ok {
		return nil, errdefs.Unimplemented("node %s runs no function calls", n.cfg.Name)
	}
	return f, nil
}

// RunCode runs one function call.
func (n *Node) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (_ *dsecv1.RunCodeResult, err error) {
	defer n.m.Observe(ctx, metrics.OpRunCode, "function", time.Now(), &err)
	f, err := n.functions()
	if err != nil {
		return nil, err
	}
	return f.RunCode(ctx, req)
}

// RunCodeBatch runs function calls concurrently, results in order.
func (n *Node) RunCodeBatch(ctx context.Context, reqs []*dsecv1.RunCodeRequest) (_ []*dsecv1.RunCodeResult, err error) {
	defer n.m.Observe(ctx, metrics.OpRunCodeBatch, "function", time.Now(), &err)
	f, err := n.functions()
	if err != nil {
		return nil, err
	}
	return f.RunCodeBatch(ctx, reqs)
}

// Languages lists the function languages of an image.
func (n *Node) Languages(ctx context.Context, img string) ([]*dsecv1.LanguageInfo, error) {
	f, err := n.functions()
	if err != nil {
		return nil, err
	}
	return f.Languages(ctx, img)
}
