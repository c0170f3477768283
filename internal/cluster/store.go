// Package cluster is dsec's cluster mode on etcd: the layout of the
// cluster state (node membership with leases, drain marks, projects and
// their quotas, API keys, sessions, idempotency claims), a node agent's
// membership (Member), the control plane's live view of it (State), and the
// Router that places sandboxes and forwards every call to the node a
// sandbox ID names, through a Connect client of that node (remote).
//
// Nothing per sandbox is written on the path of a create or an exec: a
// node publishes its load at most once per interval, and an idempotency
// claim is written only for creates that carry a key (one per batch).
//
// The package is control plane: it never imports node-side packages (node,
// substrates, images, network); a test enforces it.
package cluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/opendsec/dsec/api/dsec/node/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/sandboxid"
)

// Config says where the cluster state lives. Endpoints is required; the
// other fields' zero values are the documented defaults.
type Config struct {
	// Endpoints are etcd client URLs (env DSEC_ETCD, comma-separated).
	Endpoints []string
	// Prefix is the key prefix of this cluster (default "/dsec/"), so
	// several clusters can share an etcd.
	Prefix string
	// Timeout bounds each etcd request (default 5s).
	Timeout time.Duration
}

// The layout under Prefix. Everything under "cluster/" is watched by every
// apiserver replica; sessions and idempotency claims are read on demand.
const (
	dirCluster  = "cluster/"
	dirNodes    = dirCluster + "nodes/"    // <name> → Registration (JSON), permanent
	dirAlive    = dirCluster + "alive/"    // <name> → nodev1.Load (protobuf), bound to the node's lease
	dirDrain    = dirCluster + "drain/"    // <name> → "", present while the node drains
	dirProjects = dirCluster + "projects/" // <name> → Project (JSON)
	dirKeys     = dirCluster + "keys/"     // <sha256 of key> → KeyRecord (JSON)
	dirReplicas = dirCluster + "replicas/" // <id> → Replica (JSON), bound to the replica's lease
	dirSessions = "sessions/"              // <name> → session.Record (JSON)
	dirModels   = "models/"                // <session key> → dsec.v1.ModelUpstreams (protojson)
	dirIdem     = "idem/"                  // <project>/<key> → claim (JSON), bound to an hourly lease
	dirElection = "election/"
)

// Store is a connection to the cluster state. It is safe for concurrent
// use; every method is bounded by the configured timeout and fails with an
// unavailable (infra, retryable) error when etcd does not answer.
type Store struct {
	cli     *clientv3.Client
	prefix  string
	timeout time.Duration
	log     *slog.Logger
}

// Open connects to etcd. It does not wait for etcd to answer: a control
// plane starts (and keeps routing) while etcd is down.
func Open(cfg Config, log *slog.Logger) (*Store, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("no etcd endpoints (set --etcd or DSEC_ETCD)")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/dsec/"
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            cfg.Endpoints,
		Logger:               zap.NewNop(),
		DialKeepAliveTime:    5 * time.Second,
		DialKeepAliveTimeout: 3 * time.Second,
		PermitWithoutStream:  true,
		// gRPC's default reconnect backoff grows to 2 minutes: after an
		// outage of 30 s a client would find etcd back ~15 s late. Retry
		// at least every second instead (a refused dial costs nothing).
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 3 * time.Second,
		})},
	})
	if err != nil {
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	return &Store{cli: cli, prefix: cfg.Prefix, timeout: cfg.Timeout, log: log}, nil
}

// Close closes the connection.
func (s *Store) Close() error { return s.cli.Close() }

// Client is the etcd client (for elections and tests).
func (s *Store) Client() *clientv3.Client { return s.cli }

func (s *Store) key(dir, name string) string { return s.prefix + dir + name }

func (s *Store) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.timeout)
}

// unavailable classifies an etcd failure.
func unavailable(err error, what string) error {
	if err == nil {
		return nil
	}
	var e *errdefs.Error
	if errors.As(err, &e) {
		return err
	}
	if errors.Is(err, context.Canceled) {
		return errdefs.Classify(err)
	}
	return errdefs.Unavailable("cluster store (etcd) unreachable: %s", what).WithCause(err)
}

// Registration is a node's permanent entry: the cluster knew it, so IDs
// naming it are "lost" rather than "unknown" while it is away.
type Registration struct {
	Name       string            `json:"name"`
	Address    string            `json:"address"`
	Labels     map[string]string `json:"labels,omitempty"`
	Registered time.Time         `json:"registered"`
}

// Project is a project's quotas. Zero fields are unlimited.
type Project struct {
	// MaxSandboxes bounds the project's live and starting sandboxes.
	MaxSandboxes int64 `json:"max_sandboxes,omitempty"`
	// CreatesPerS bounds its create rate; Burst is how many creates may
	// come at once (default: CreatesPerS rounded up, at least 1).
	CreatesPerS float64 `json:"creates_per_s,omitempty"`
	Burst       int     `json:"burst,omitempty"`
}

// KeyRecord is a stored API key: only its SHA-256 is kept.
type KeyRecord struct {
	Project string `json:"project"`
	// Admin keys are operators': they reach every project's objects.
	Admin   bool      `json:"admin,omitempty"`
	Name    string    `json:"name,omitempty"`
	Created time.Time `json:"created"`
}

// Replica is an apiserver replica's entry.
type Replica struct {
	ID      string    `json:"id"`
	Address string    `json:"address,omitempty"`
	Started time.Time `json:"started"`
}

// HashKey is how a key is stored.
func HashKey(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

func validName(what, name string) error {
	if err := sandboxid.ValidNode(name); err != nil {
		return errdefs.Invalid("%s name %q must be a lowercase DNS label of at most 40 characters", what, name)
	}
	return nil
}

// Every write to the cluster state below returns once every replica sees
// it (Sync): the next call through any replica reads it. A write etcd took
// that some replica did not confirm returns an *UnconfirmedError.

// PutProject creates or replaces a project's quotas.
func (s *Store) PutProject(ctx context.Context, name string, p Project) error {
	if err := validName("project", name); err != nil {
		return err
	}
	if p.MaxSandboxes < 0 || p.CreatesPerS < 0 || p.Burst < 0 {
		return errdefs.Invalid("quotas must not be negative")
	}
	b, _ := json.Marshal(p)
	wctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.cli.Put(wctx, s.key(dirProjects, name), string(b)); err != nil {
		return unavailable(err, "put project")
	}
	return s.Sync(ctx)
}

// DeleteProject removes a project's quotas (its keys stay).
func (s *Store) DeleteProject(ctx context.Context, name string) error {
	wctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.cli.Delete(wctx, s.key(dirProjects, name)); err != nil {
		return unavailable(err, "delete project")
	}
	return s.Sync(ctx)
}

// Projects lists projects with quotas.
func (s *Store) Projects(ctx context.Context) (map[string]Project, error) {
	out := map[string]Project{}
	err := s.list(ctx, dirProjects, func(name string, v []byte) {
		var p Project
		if json.Unmarshal(v, &p) == nil {
			out[name] = p
		}
	})
	return out, err
}

// AddKey stores an API key of project, an operator's with admin (keys are
// generated by the caller and shown once; only a hash is kept).
func (s *Store) AddKey(ctx context.Context, key, project, name string, admin bool) error {
	if len(key) < 16 {
		return errdefs.Invalid("an API key must have at least 16 characters")
	}
	if err := validName("project", project); err != nil {
		return err
	}
	b, _ := json.Marshal(KeyRecord{Project: project, Admin: admin, Name: name, Created: time.Now().UTC()})
	wctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.cli.Put(wctx, s.key(dirKeys, HashKey(key)), string(b)); err != nil {
		return unavailable(err, "put key")
	}
	return s.Sync(ctx)
}

// RemoveKey removes an API key, given the key or its hash (or a unique
// prefix of the hash of at least 8 characters).
func (s *Store) RemoveKey(ctx context.Context, keyOrHash string) error {
	keys, err := s.Keys(ctx)
	if err != nil {
		return err
	}
	var match []string
	for h := range keys {
		if h == HashKey(keyOrHash) || (len(keyOrHash) >= 8 && strings.HasPrefix(h, keyOrHash)) {
			match = append(match, h)
		}
	}
	switch len(match) {
	case 0:
		return errdefs.NotFound("no such key")
	case 1:
	default:
		return errdefs.Invalid("%q matches %d keys; give more of the hash", keyOrHash, len(match))
	}
	wctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.cli.Delete(wctx, s.key(dirKeys, match[0])); err != nil {
		return unavailable(err, "delete key")
	}
	return s.Sync(ctx)
}

// Keys lists stored keys by hash.
func (s *Store) Keys(ctx context.Context) (map[string]KeyRecord, error) {
	out := map[string]KeyRecord{}
	err := s.list(ctx, dirKeys, func(h string, v []byte) {
		var k KeyRecord
		if json.Unmarshal(v, &k) == nil {
			out[h] = k
		}
	})
	return out, err
}

// SetDrain marks a node as draining (no new sandboxes; its sandboxes run
// on until they end) or clears the mark. It returns once the node (if it
// is a member) and every replica have seen the change: a create through
// any replica then neither lands on a drained node nor is refused by an
// undrained one.
func (s *Store) SetDrain(ctx context.Context, node string, drain bool) error {
	if err := validName("node", node); err != nil {
		return err
	}
	wctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.cli.Get(wctx, s.key(dirNodes, node), clientv3.WithCountOnly())
	if err != nil {
		return unavailable(err, "set drain")
	}
	if resp.Count == 0 {
		return errdefs.NotFound("no node %q in this cluster", node)
	}
	if drain {
		_, err = s.cli.Put(wctx, s.key(dirDrain, node), "")
	} else {
		_, err = s.cli.Delete(wctx, s.key(dirDrain, node))
	}
	if err != nil {
		return unavailable(err, "set drain")
	}
	// The node publishes its drain state as soon as it sees the mark.
	nodeErr := s.waitNode(ctx, node, func(l *nodev1.Load) bool { return l.Draining == drain })
	if _, ok := nodeErr.(*UnconfirmedError); !ok && nodeErr != nil {
		return nodeErr
	}
	err = s.Sync(ctx)
	if nodeErr != nil {
		if u, ok := err.(*UnconfirmedError); ok {
			u.Node = node
			return u
		}
		if err == nil {
			return nodeErr
		}
	}
	return err
}

// ForgetNode removes a node that left for good: IDs naming it become
// unknown (not_found) instead of lost.
func (s *Store) ForgetNode(ctx context.Context, node string) error {
	wctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.cli.Get(wctx, s.key(dirAlive, node))
	if err != nil {
		return unavailable(err, "forget node")
	}
	if len(resp.Kvs) > 0 {
		return errdefs.Conflict("node %s is alive; stop it first", node)
	}
	if _, err = s.cli.Txn(wctx).Then(
		clientv3.OpDelete(s.key(dirNodes, node)),
		clientv3.OpDelete(s.key(dirDrain, node)),
	).Commit(); err != nil {
		return unavailable(err, "forget node")
	}
	return s.Sync(ctx)
}

// NodeStatus is a node as the cluster state has it.
type NodeStatus struct {
	Registration
	// Load is the node's last published load; nil when the node is lost.
	Load     *nodev1.Load
	Draining bool
}

// State is "ready", "draining" or "lost".
func (n *NodeStatus) State() string {
	switch {
	case n.Load == nil:
		return "lost"
	case n.Draining || n.Load.Draining:
		return "draining"
	}
	return "ready"
}

// Nodes lists every registered node with its load and drain mark.
func (s *Store) Nodes(ctx context.Context) ([]*NodeStatus, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.prefix+dirCluster, clientv3.WithPrefix())
	if err != nil {
		return nil, unavailable(err, "list nodes")
	}
	byName := map[string]*NodeStatus{}
	get := func(name string) *NodeStatus {
		n := byName[name]
		if n == nil {
			n = &NodeStatus{Registration: Registration{Name: name}}
			byName[name] = n
		}
		return n
	}
	for _, kv := range resp.Kvs {
		k := strings.TrimPrefix(string(kv.Key), s.prefix)
		switch {
		case strings.HasPrefix(k, dirNodes):
			n := get(strings.TrimPrefix(k, dirNodes))
			json.Unmarshal(kv.Value, &n.Registration)
		case strings.HasPrefix(k, dirAlive):
			l := &nodev1.Load{}
			if proto.Unmarshal(kv.Value, l) == nil {
				get(strings.TrimPrefix(k, dirAlive)).Load = l
			}
		case strings.HasPrefix(k, dirDrain):
			get(strings.TrimPrefix(k, dirDrain)).Draining = true
		}
	}
	out := make([]*NodeStatus, 0, len(byName))
	for _, n := range byName {
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// list calls f for every key under dir.
func (s *Store) list(ctx context.Context, dir string, f func(name string, v []byte)) error {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.key(dir, ""), clientv3.WithPrefix())
	if err != nil {
		return unavailable(err, "list "+strings.TrimSuffix(dir, "/"))
	}
	for _, kv := range resp.Kvs {
		f(strings.TrimPrefix(string(kv.Key), s.key(dir, "")), kv.Value)
	}
	return nil
}
