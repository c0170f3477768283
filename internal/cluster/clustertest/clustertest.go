// Package clustertest simulates node agents, to test and benchmark the
// control plane alone: a Node joins a real etcd through the real
// membership code (cluster.Member: lease, rate-bounded load) and serves the
// node API over Connect, but its sandboxes are records in memory that
// start at once. Only tests and benchmarks import it; a test keeps it out
// of the product binary.
package clustertest

import (
	"context"
	"crypto/subtle"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/api/dsec/node/v1/nodev1connect"
	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/api/dsec/v1/dsecv1connect"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
	"github.com/opendsec/dsec/internal/sandboxid"
)

// Config configures a simulated node. Name is required.
type Config struct {
	Name  string
	Token string
	// MaxSandboxes is the node's admission limit (default 4096).
	MaxSandboxes int
	// Kinds (default container) and Images (default busybox) it has.
	Kinds, Images []string
	Labels        map[string]string
	// TTL and Interval are the membership's (cluster.MemberConfig).
	TTL, Interval time.Duration
}

// Node is a simulated node agent.
type Node struct {
	cfg         Config
	Addr        string
	member      *cluster.Member
	srv         *http.Server
	cancel      context.CancelFunc
	done        chan struct{}
	incarnation string
	admitted    atomic.Uint64
	refuse      atomic.Pointer[error]
	hang        atomic.Bool
	changed     chan struct{}

	mu        sync.Mutex
	sandboxes map[string]*dsecv1.Sandbox
	projects  map[string]int64
	owner     map[string]string // sandbox → project
	idem      map[string]string
}

// Start starts a node on a loopback port and joins it to the cluster.
func Start(store *cluster.Store, cfg Config, log *slog.Logger) (*Node, error) {
	if cfg.MaxSandboxes == 0 {
		cfg.MaxSandboxes = 4096
	}
	if len(cfg.Kinds) == 0 {
		cfg.Kinds = []string{"container"}
	}
	if len(cfg.Images) == 0 {
		cfg.Images = []string{"busybox"}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	n := &Node{
		cfg: cfg, Addr: l.Addr().String(), incarnation: cluster.NewReplicaID(), changed: make(chan struct{}, 1),
		sandboxes: map[string]*dsecv1.Sandbox{}, projects: map[string]int64{}, owner: map[string]string{}, idem: map[string]string{}, done: make(chan struct{}),
	}
	n.member = store.NewMember(cluster.MemberConfig{Name: cfg.Name, Address: n.Addr, Labels: cfg.Labels, TTL: cfg.TTL, Interval: cfg.Interval}, log)
	mux := http.NewServeMux()
	opts := connect.WithInterceptors(tokenCheck(cfg.Token))
	mux.Handle(nodev1connect.NewNodeServiceHandler(n, opts))
	mux.Handle(dsecv1connect.NewLifecycleServiceHandler(&sandboxes{n: n}, opts))
	mux.Handle(dsecv1connect.NewProcessServiceHandler(&processes{n: n}, opts))
	mux.Handle(dsecv1connect.NewSystemServiceHandler(&system{n: n}, opts))
	n.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for n.hang.Load() { // a host that vanished: no answer at all
			select {
			case <-r.Context().Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
		mux.ServeHTTP(w, r)
	})}
	n.srv.Protocols = new(http.Protocols)
	n.srv.Protocols.SetHTTP1(true)
	n.srv.Protocols.SetUnencryptedHTTP2(true)
	go n.srv.Serve(l)
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	go func() { n.member.Run(ctx, n.load, n.changed); close(n.done) }()
	return n, nil
}

// Name is the node's name.
func (n *Node) Name() string { return n.cfg.Name }

// Close makes the node leave the cluster (its lease is revoked: to the
// control plane it is lost) and stops serving.
func (n *Node) Close() {
	n.cancel()
	<-n.done
	n.srv.Close()
}

// Refuse makes the node refuse every create with err (nil: accept again),
// as a node's own admission would.
func (n *Node) Refuse(err error) {
	if err == nil {
		n.refuse.Store(nil)
		return
	}
	n.refuse.Store(&err)
}

// Hang makes every call to the node wait without an answer (as to a host
// that vanished) until Hang(false) or the caller gives up.
func (n *Node) Hang(v bool) { n.hang.Store(v) }

// Writes counts the node's etcd writes.
func (n *Node) Writes() int64 { return n.member.Writes() }

// Count is how many sandboxes the node holds.
func (n *Node) Count() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.sandboxes)
}

func (n *Node) load() *nodev1.Load {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := make(map[string]int64, len(n.projects))
	for k, v := range n.projects {
		p[k] = v
	}
	return &nodev1.Load{
		Incarnation: n.incarnation, Kinds: n.cfg.Kinds, Images: n.cfg.Images,
		Sandboxes: int64(len(n.sandboxes)), MaxSandboxes: int64(n.cfg.MaxSandboxes),
		Admitted: n.admitted.Load(), Projects: p,
	}
}

func (n *Node) signal() {
	select {
	case n.changed <- struct{}{}:
	default:
	}
}

// CreateSandboxes creates each item at once, or refuses it.
func (n *Node) CreateSandboxes(ctx context.Context, req *connect.Request[nodev1.CreateSandboxesRequest]) (*connect.Response[nodev1.CreateSandboxesResponse], error) {
	m := req.Msg
	out := &dsecv1.CreateSandboxesResponse{}
	refuse := n.refuse.Load()
	now := timestamppb.Now()
	n.mu.Lock()
	for i, spec := range m.Specs {
		r := &dsecv1.CreateResult{Index: int32(i)}
		out.Results = append(out.Results, r)
		key := ""
		if i < len(m.IdempotencyKeys) {
			key = m.IdempotencyKeys[i]
		}
		if id, ok := n.idem[key]; ok && key != "" {
			r.Sandbox = n.sandboxes[id]
			out.Created++
			continue
		}
		var err error
		switch {
		case refuse != nil:
			err = *refuse
		case len(n.sandboxes) >= n.cfg.MaxSandboxes:
			err = errdefs.Exhausted(time.Second, "node %s is full (%d sandboxes)", n.cfg.Name, n.cfg.MaxSandboxes)
		case !contains(n.cfg.Images, spec.GetImage()):
			err = errdefs.NotFound("image %q not found", spec.GetImage())
		}
		if err != nil {
			r.Error = itemError(err)
			out.Failed++
			continue
		}
		n.admitted.Add(1)
		sb := &dsecv1.Sandbox{Id: sandboxid.New(n.cfg.Name), Node: n.cfg.Name, State: "running", Spec: spec, CreatedAt: now}
		n.sandboxes[sb.Id] = sb
		n.projects[m.Project]++
		n.owner[sb.Id] = m.Project
		if key != "" {
			n.idem[key] = sb.Id
		}
		r.Sandbox = sb
		out.Created++
	}
	n.mu.Unlock()
	n.signal()
	return connect.NewResponse(&nodev1.CreateSandboxesResponse{Result: out, Admitted: n.admitted.Load(), Incarnation: n.incarnation}), nil
}

func (n *Node) GetLoad(ctx context.Context, req *connect.Request[nodev1.GetLoadRequest]) (*connect.Response[nodev1.Load], error) {
	l := n.load()
	l.Name, l.Address, l.Labels = n.cfg.Name, n.Addr, n.cfg.Labels
	return connect.NewResponse(l), nil
}

// ConnectPort is not faked: the fake node's sandboxes have no ports.
func (n *Node) ConnectPort(ctx context.Context, st *connect.BidiStream[nodev1.PortData, nodev1.PortData]) error {
	return connect.NewError(connect.CodeUnimplemented, errors.New("the fake node's sandboxes have no ports"))
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func itemError(err error) *dsecv1.ItemError {
	e := errdefs.Classify(err)
	return &dsecv1.ItemError{Kind: string(e.Kind), Message: e.Msg, Infra: e.Infra, Retryable: e.Retryable, RetryAfterMs: e.RetryAfter.Milliseconds()}
}

// sandboxes serves the lifecycle calls the control plane forwards to a
// node; processes, the process calls.
type sandboxes struct {
	dsecv1connect.UnimplementedLifecycleServiceHandler
	n *Node
}

type processes struct {
	dsecv1connect.UnimplementedProcessServiceHandler
	n *Node
}

func (n *Node) get(id string) (*dsecv1.Sandbox, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb := n.sandboxes[id]
	if sb == nil {
		return nil, errwire.ToConnect(errdefs.NotFound("sandbox %s not found", id))
	}
	return sb, nil
}

func (s *sandboxes) GetSandbox(ctx context.Context, req *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	sb, err := s.n.get(req.Msg.Id)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sb), nil
}

func (s *sandboxes) DeleteSandbox(ctx context.Context, req *connect.Request[dsecv1.DeleteSandboxRequest]) (*connect.Response[dsecv1.DeleteSandboxResponse], error) {
	s.n.mu.Lock()
	if _, ok := s.n.sandboxes[req.Msg.Id]; ok {
		p := s.n.owner[req.Msg.Id]
		delete(s.n.sandboxes, req.Msg.Id)
		delete(s.n.owner, req.Msg.Id)
		if s.n.projects[p]--; s.n.projects[p] <= 0 {
			delete(s.n.projects, p)
		}
	}
	s.n.mu.Unlock()
	s.n.signal()
	return connect.NewResponse(&dsecv1.DeleteSandboxResponse{}), nil
}

// Exec answers at once with the node's name.
func (s *processes) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResult], error) {
	if _, err := s.n.get(req.Msg.SandboxId); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ExecResult{Stdout: []byte(s.n.cfg.Name + "\n")}), nil
}

func (s *sandboxes) ListSandboxes(ctx context.Context, req *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	s.n.mu.Lock()
	defer s.n.mu.Unlock()
	out := &dsecv1.ListSandboxesResponse{}
	for _, sb := range s.n.sandboxes {
		out.Sandboxes = append(out.Sandboxes, sb)
	}
	return connect.NewResponse(out), nil
}

type system struct {
	dsecv1connect.UnimplementedSystemServiceHandler
	n *Node
}

func (s *system) GetInfo(ctx context.Context, req *connect.Request[dsecv1.GetInfoRequest]) (*connect.Response[dsecv1.Info], error) {
	return connect.NewResponse(&dsecv1.Info{Nodes: []*dsecv1.NodeInfo{{Name: s.n.cfg.Name, State: "ready", MaxSandboxes: int64(s.n.cfg.MaxSandboxes)}}}), nil
}

// tokenCheck accepts only callers with the cluster token.
func tokenCheck(token string) connect.Interceptor {
	check := func(h http.Header) error {
		got, _ := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
		if subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
			return errwire.ToConnect(errdefs.Unauthenticated("missing or wrong cluster token"))
		}
		return nil
	}
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if err := check(req.Header()); err != nil {
				return nil, err
			}
			return next(ctx, req)
		}
	})
}
