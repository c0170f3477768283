// Package clusternode runs a node in a cluster (`dsec node`): it serves the
// node's public API for its own sandboxes and the dsec.node.v1 NodeService,
// both behind the cluster token, and keeps the node's membership and load
// in etcd (cluster.Member). A node marked to drain refuses new sandboxes
// (creates and forks) and keeps serving the ones it has until they end.
package clusternode

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/api/dsec/node/v1/nodev1connect"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/node"
)

// Config configures an agent. Address and Token are required (Token may be
// empty only on loopback); the rest default as documented.
type Config struct {
	// Address is host:port where apiservers reach this node.
	Address string
	// Token is the cluster token every caller must present.
	Token string
	// Labels are the node's labels (matched by node_selector).
	Labels map[string]string
	// Version is reported in the node's load.
	Version string
	// TTL is the membership lease (default 10s); Interval the least time
	// between load publications (default 1s).
	TTL, Interval time.Duration
	// Metrics, when set, is served at /metrics on the node API (to
	// callers presenting the cluster token).
	Metrics *metrics.Registry
}

// Agent is a node agent in a cluster.
type Agent struct {
	cfg         Config
	n           *node.Node
	store       *cluster.Store
	member      *cluster.Member
	api         *apiserver.Server
	incarnation string
	log         *slog.Logger

	// fetching are the images being imported from other nodes (fetch.go),
	// by tenant.ImageKey.
	fetchMu  sync.Mutex
	fetching map[string]*fetch
}

// New returns the agent of n, a member of the cluster in store. It does
// not fail; the error is for callers that assemble it with others.
func New(cfg Config, n *node.Node, store *cluster.Store, log *slog.Logger) (*Agent, error) {
	var b [8]byte
	rand.Read(b[:])
	a := &Agent{cfg: cfg, n: n, store: store, incarnation: hex.EncodeToString(b[:]), log: log, fetching: map[string]*fetch{}}
	a.member = store.NewMember(cluster.MemberConfig{
		Name: n.Name(), Address: cfg.Address, Labels: cfg.Labels, TTL: cfg.TTL, Interval: cfg.Interval,
	}, log)
	a.api = apiserver.NewNodeAPI(cfg.Token, log, agentService{n.Service(), a}, cfg.Metrics, nil)
	a.api.HandleConnect(nodev1connect.NewNodeServiceHandler(a, a.api.ConnectOptions()...))
	// Images move between nodes (image.ImportFromPeer): this node serves
	// its own to the others and reads theirs with the cluster token.
	peers := image.Peers{Header: http.Header{}}
	if cfg.Token != "" {
		peers.Header.Set("Authorization", "Bearer "+cfg.Token)
	}
	n.Images().SetPeers(peers)
	a.api.HandlePeer(image.PeerPath, n.Images().PeerHandler())
	return a, nil
}

// Run keeps the node's membership until ctx ends (then the node leaves the
// cluster at once).
func (a *Agent) Run(ctx context.Context) { a.member.Run(ctx, a.load, a.n.LoadChanged()) }

// Serve serves the node API on l until ctx ends.
func (a *Agent) Serve(ctx context.Context, l net.Listener) error { return a.api.Serve(ctx, l) }

// Handler is the node API.
func (a *Agent) Handler() http.Handler { return a.api.Handler() }

func (a *Agent) load() *nodev1.Load {
	l := a.n.Load()
	return &nodev1.Load{
		Incarnation: a.incarnation, Version: a.cfg.Version,
		Kinds: l.Kinds, Images: l.Images, Sandboxes: l.Sandboxes, MaxSandboxes: l.MaxSandboxes,
		Admitted: l.Admitted, Projects: l.Projects,
	}
}

func (a *Agent) draining() error {
	if a.member.Draining() {
		return errdefs.Unavailable("node %s is draining: it takes no new sandboxes", a.n.Name())
	}
	return nil
}

var _ nodev1connect.NodeServiceHandler = (*Agent)(nil)

// CreateSandboxes is the control plane's create: the node's admission is
// final, and a draining node refuses every item.
func (a *Agent) CreateSandboxes(ctx context.Context, req *connect.Request[nodev1.CreateSandboxesRequest]) (*connect.Response[nodev1.CreateSandboxesResponse], error) {
	m := req.Msg
	var res *dsecv1.CreateSandboxesResponse
	if err := a.draining(); err != nil {
		res = &dsecv1.CreateSandboxesResponse{Failed: int32(len(m.Specs))}
		for i := range m.Specs {
			res.Results = append(res.Results, &dsecv1.CreateResult{Index: int32(i), Error: node.ItemError(err)})
		}
	} else {
		a.fetchImages(ctx, m.Specs, m.Project)
		res = a.n.CreateMany(ctx, m.Specs, m.IdempotencyKeys, m.Project)
	}
	a.fenceRefused(ctx, m, res)
	return connect.NewResponse(&nodev1.CreateSandboxesResponse{Result: res, Admitted: a.n.Admitted(), Incarnation: a.incarnation}), nil
}

// fenceRefused fences the idempotency key of each item the router will
// place elsewhere (cluster.Refusal) before the node answers, so that a
// create of the key still on its way here cannot complete too. An item
// whose key a create completed meanwhile gets that sandbox; one whose key
// could not be fenced fails with an error the router does not move.
func (a *Agent) fenceRefused(ctx context.Context, m *nodev1.CreateSandboxesRequest, res *dsecv1.CreateSandboxesResponse) {
	for i, r := range res.GetResults() {
		if i >= len(m.IdempotencyKeys) || m.IdempotencyKeys[i] == "" || r.GetError() == nil {
			continue
		}
		if !cluster.Refusal(m.Specs[i], cluster.FromItemError(r.Error)) {
			continue
		}
		sb, err := a.n.Fence(ctx, m.Project, m.IdempotencyKeys[i])
		switch {
		case err != nil:
			e := errdefs.Internal(err, "node %s refused a create and could not fence its idempotency key", a.n.Name())
			e.Retryable = true
			r.Error = node.ItemError(e)
		case sb != nil:
			r.Error, r.Sandbox = nil, sb
			res.Failed--
			res.Created++
		}
	}
}

// GetLoad returns what the node publishes.
func (a *Agent) GetLoad(ctx context.Context, req *connect.Request[nodev1.GetLoadRequest]) (*connect.Response[nodev1.Load], error) {
	l := a.load()
	l.Name, l.Address, l.Labels, l.Draining = a.n.Name(), a.cfg.Address, a.cfg.Labels, a.member.Draining()
	return connect.NewResponse(l), nil
}

// agentService is the node's API as a cluster member serves it: new
// sandboxes are refused while the node drains, its info says where and in
// what state it is, and image operations answer once the node's load in
// etcd shows their result (the control plane then makes every replica's
// view include it before it answers its caller): a create right after an
// import finds the image.
type agentService struct {
	*node.Service
	a *Agent
}

var _ apiserver.NodeHandlers = agentService{}

func (s agentService) CreateSandbox(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	if err := s.a.draining(); err != nil {
		return nil, errwire.ToConnect(err)
	}
	return s.Service.CreateSandbox(ctx, req)
}

func (s agentService) CreateSandboxes(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxesRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	if err := s.a.draining(); err != nil {
		return nil, errwire.ToConnect(err)
	}
	return s.Service.CreateSandboxes(ctx, req)
}

func (s agentService) Fork(ctx context.Context, req *connect.Request[dsecv1.ForkRequest]) (*connect.Response[dsecv1.CreateSandboxesResponse], error) {
	if err := s.a.draining(); err != nil {
		return nil, errwire.ToConnect(err)
	}
	return s.Service.Fork(ctx, req)
}

func (s agentService) PullImage(ctx context.Context, req *connect.Request[dsecv1.PullImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return s.a.published(ctx, s.Service.PullImage(ctx, req, st))
}

func (s agentService) BootstrapImage(ctx context.Context, req *connect.Request[dsecv1.BootstrapImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return s.a.published(ctx, s.Service.BootstrapImage(ctx, req, st))
}

func (s agentService) UploadImage(ctx context.Context, st *connect.ClientStream[dsecv1.UploadImageRequest]) (*connect.Response[dsecv1.Image], error) {
	resp, err := s.Service.UploadImage(ctx, st)
	return resp, s.a.published(ctx, err)
}

func (s agentService) DeleteImage(ctx context.Context, req *connect.Request[dsecv1.DeleteImageRequest]) (*connect.Response[dsecv1.DeleteImageResponse], error) {
	resp, err := s.Service.DeleteImage(ctx, req)
	return resp, s.a.published(ctx, err)
}

func (s agentService) BuildImage(ctx context.Context, req *connect.Request[dsecv1.BuildImageRequest], st *connect.ServerStream[dsecv1.ImageProgress]) error {
	return s.a.published(ctx, s.Service.BuildImage(ctx, req, st))
}

func (s agentService) CommitSandbox(ctx context.Context, req *connect.Request[dsecv1.CommitSandboxRequest]) (*connect.Response[dsecv1.Image], error) {
	resp, err := s.Service.CommitSandbox(ctx, req)
	return resp, s.a.published(ctx, err)
}

// published publishes the node's load after an operation that succeeded
// (err nil) and returns err. A publication that fails (etcd unreachable)
// is logged, not returned: the operation is done, and the next interval
// publishes it.
func (a *Agent) published(ctx context.Context, err error) error {
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if perr := a.member.Publish(pctx); perr != nil {
		a.log.Warn("publish load after an image change", slog.Any("error", perr))
	}
	return nil
}

func (s agentService) GetInfo(ctx context.Context, req *connect.Request[dsecv1.GetInfoRequest]) (*connect.Response[dsecv1.Info], error) {
	resp, err := s.Service.GetInfo(ctx, req)
	if err != nil {
		return nil, err
	}
	for _, info := range resp.Msg.Nodes {
		info.Address = s.a.cfg.Address
		if s.a.member.Draining() {
			info.State = "draining"
		}
	}
	return resp, nil
}
