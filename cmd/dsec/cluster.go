package main

import (
	"context"
	"crypto/rand"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/cluster"
	"github.com/opendsec/dsec/internal/clusternode"
	"github.com/opendsec/dsec/internal/config"
	"github.com/opendsec/dsec/internal/dashboard"
	"github.com/opendsec/dsec/internal/session"
)

// clusterFlags are the flags every cluster-mode process shares.
func clusterFlags(f *pflag.FlagSet, c *config.Config) {
	f.StringSliceVar(&c.Cluster.Etcd, "etcd", nil, "etcd endpoints, comma-separated (env DSEC_ETCD)")
	f.StringVar(&c.Cluster.Prefix, "etcd-prefix", "", "etcd key prefix of this cluster (default /dsec/)")
}

func storeOf(cfg config.Config, log *slog.Logger) (*cluster.Store, error) {
	return cluster.Open(cluster.Config{Endpoints: cfg.Cluster.Etcd, Prefix: cfg.Cluster.Prefix}, log)
}

func isLoopback(addr string) bool {
	return apiserver.CheckListen(addr, nil) == nil
}

func apiCmd() *cobra.Command {
	var (
		file    string
		flagCfg config.Config
	)
	cmd := &cobra.Command{
		Use:   "api",
		Short: "Run a control plane replica of a cluster (stateless; run any number)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load(file)
			if err != nil {
				return err
			}
			applyFlags(cmd, &cfg, &flagCfg, "")
			if cmd.Flags().Changed("choices") {
				cfg.Cluster.Choices = flagCfg.Cluster.Choices
			}
			cfg.Defaults()
			return runAPI(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&file, "config", "c", "", "YAML config file")
	f.StringVar(&flagCfg.Listen, "listen", "", "API address (default 127.0.0.1:7070)")
	f.StringArrayVar(&flagCfg.APIKeys, "api-key", nil, "an API key accepted besides those in etcd, KEY or PROJECT=KEY (repeatable; env DSEC_API_KEYS)")
	f.StringArrayVar(&flagCfg.AdminKeys, "admin-key", nil, "an operator's key accepted besides those in etcd: reaches every project (repeatable; env DSEC_ADMIN_KEYS)")
	f.StringVar(&flagCfg.Cluster.Token, "cluster-token", "", "token presented to node agents (env DSEC_CLUSTER_TOKEN)")
	e2bFlags(f, &flagCfg)
	f.IntVar(&flagCfg.Cluster.Choices, "choices", 0, "fitting nodes sampled per placement (default 2)")
	f.StringVar(&flagCfg.LogLevel, "log-level", "", "debug, info, warn or error")
	f.StringVar(&flagCfg.DebugListen, "debug-listen", "", "serve Go profiling (net/http/pprof) on this loopback address")
	f.StringVar(&flagCfg.MetricsListen, "metrics-listen", "", "also serve Prometheus metrics at /metrics on this address, without authentication (they are always at /metrics on --listen for admin keys)")
	f.BoolVar(&flagCfg.NoMetrics, "no-metrics", false, "count nothing and serve no /metrics (to measure what metrics cost)")
	clusterFlags(f, &flagCfg)
	return cmd
}

func runAPI(ctx context.Context, cfg config.Config) error {
	log := newLogger(cfg.LogLevel)
	open := isLoopback(cfg.Listen)
	if cfg.Cluster.Token == "" && !open {
		return fmt.Errorf("a cluster token is required beyond loopback (set --cluster-token or DSEC_CLUSTER_TOKEN)")
	}
	store, err := storeOf(cfg, log)
	if err != nil {
		return err
	}
	defer store.Close()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	state, err := store.NewState(cfg.APIKeys, cfg.AdminKeys, open, log)
	if err != nil {
		return err
	}
	go state.Run(ctx)
	reg, calls := newMetrics(cfg)
	router := cluster.NewRouter(cluster.RouterConfig{
		Token: cfg.Cluster.Token, Choices: cfg.Cluster.Choices, Attempts: cfg.Cluster.Attempts, Metrics: calls,
	}, state, log)
	sessions := session.New(store.Sessions(), apiserver.Actor(router), log)
	sessions.CountExpiries(calls.SessionExpired)
	hooks := apiserver.NewHooks(store.Hooks(), router, log, calls.Webhook)
	api, err := apiserver.New(apiserver.Config{Keys: state, Version: version, Metrics: reg, API: calls, Hooks: hooks}, log, router, sessions)
	if err != nil {
		return err
	}
	secret, err := e2bSecret(cfg.E2B, "", cfg.Cluster.Token, log)
	if err != nil {
		return fmt.Errorf("e2b token secret: %w", err)
	}
	if err := mountE2B(cfg.E2B, secret, "", log, router, api, hooks); err != nil {
		return err
	}
	api.Handle("GET "+dashboard.Prefix, dashboard.Handler())
	if err := serveDebug(cfg.DebugListen, log); err != nil {
		return err
	}
	if err := serveMetrics(ctx, cfg.MetricsListen, reg, log); err != nil {
		return err
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	id := cluster.NewReplicaID()
	go store.RunReplica(ctx, id, l.Addr().String(), state, log)
	go store.RunSessionExpiry(ctx, id, sessions, log)
	// One replica delivers the registered webhooks' events; every replica
	// serves their registrations.
	go store.RunLeader(ctx, id, "webhooks", "webhook deliveries", hooks.Run, log)
	// Serve once writers wait for this replica (it is registered) and its
	// view includes its registration: from then on it reads every write
	// that returned (cluster.Store.Sync).
	select {
	case <-state.Joined():
	case <-time.After(5 * time.Second):
		log.Warn("cluster state not read yet (etcd unreachable?); serving anyway")
	case <-ctx.Done():
		return nil
	}
	if err := serveE2BTLS(ctx, cfg, "", api, log); err != nil {
		return err
	}
	log.Info("dsec api serving", slog.String("listen", l.Addr().String()), slog.String("replica", id))
	return api.Serve(ctx, l)
}

func nodeCmd() *cobra.Command {
	var (
		file    string
		flagCfg config.Config
		v       nodeVars
	)
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Run a node agent of a cluster (one per host)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load(file)
			if err != nil {
				return err
			}
			applyFlags(cmd, &cfg, &flagCfg, v.bootstrap)
			if err := v.apply(&cfg); err != nil {
				return err
			}
			if cmd.Flags().Changed("label") {
				cfg.Cluster.Labels = map[string]string{}
				for _, kv := range flagLabels {
					k, v, ok := strings.Cut(kv, "=")
					if !ok || k == "" {
						return fmt.Errorf("--label %q: want key=value", kv)
					}
					cfg.Cluster.Labels[k] = v
				}
			}
			if cfg.Listen == "" {
				cfg.Listen = "127.0.0.1:7071"
			}
			cfg.Defaults()
			return runNode(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&file, "config", "c", "", "YAML config file")
	f.StringVar(&flagCfg.Listen, "listen", "", "node API address (default 127.0.0.1:7071)")
	f.StringVar(&flagCfg.Node.Name, "name", "", "node name, a DNS label unique in the cluster (required)")
	f.StringVar(&flagCfg.Cluster.Advertise, "advertise", "", "host:port apiservers reach this node at (default: --listen)")
	f.StringVar(&flagCfg.Cluster.Token, "cluster-token", "", "token apiservers present (env DSEC_CLUSTER_TOKEN)")
	f.StringArrayVar(&flagLabels, "label", nil, "node label key=value (repeatable)")
	f.DurationVar((*time.Duration)(&flagCfg.Cluster.NodeTTL), "node-ttl", 0, "membership lease: silent this long, the node is lost (default 10s)")
	f.DurationVar((*time.Duration)(&flagCfg.Cluster.LoadInterval), "load-interval", 0, "least time between load publications (default 1s)")
	nodeFlags(f, &flagCfg, &v)
	clusterFlags(f, &flagCfg)
	return cmd
}

var flagLabels []string

func runNode(ctx context.Context, cfg config.Config) error {
	log := newLogger(cfg.LogLevel)
	if cfg.Node.Name == "" {
		return fmt.Errorf("--name is required (a DNS label unique in the cluster)")
	}
	if cfg.Cluster.Token == "" && !isLoopback(cfg.Listen) {
		return fmt.Errorf("a cluster token is required beyond loopback (set --cluster-token or DSEC_CLUSTER_TOKEN)")
	}
	advertise := cfg.Cluster.Advertise
	if advertise == "" {
		host, _, err := net.SplitHostPort(cfg.Listen)
		if err != nil {
			return fmt.Errorf("--listen %q: %w", cfg.Listen, err)
		}
		if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
			return fmt.Errorf("--listen %s names no host apiservers can reach: set --advertise", cfg.Listen)
		}
		advertise = cfg.Listen
	}
	reg, _ := newMetrics(cfg)
	n, closeNode, err := openNode(cfg, reg, log)
	if err != nil {
		return err
	}
	defer closeNode()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	store, err := storeOf(cfg, log)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := bootstrapImages(ctx, n, cfg.Bootstrap, log); err != nil {
		return err
	}
	sessStore := store.Sessions()
	n.UseModelRegistry(func(ctx context.Context, project, name string) (*dsecv1.ModelUpstreams, error) {
		return session.Models(ctx, sessStore, project, name)
	})
	agent, err := clusternode.New(clusternode.Config{
		Address: advertise, Token: cfg.Cluster.Token, Labels: cfg.Cluster.Labels, Version: version,
		TTL: time.Duration(cfg.Cluster.NodeTTL), Interval: time.Duration(cfg.Cluster.LoadInterval),
		Metrics: reg,
	}, n, store, log)
	if err != nil {
		return err
	}
	if err := serveDebug(cfg.DebugListen, log); err != nil {
		return err
	}
	if err := serveMetrics(ctx, cfg.MetricsListen, reg, log); err != nil {
		return err
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	mctx, mcancel := context.WithCancel(context.WithoutCancel(ctx))
	membership := make(chan struct{})
	go func() { agent.Run(mctx); close(membership) }()
	log.Info("dsec node serving", slog.String("listen", l.Addr().String()), slog.String("advertise", advertise), slog.String("node", n.Name()))
	err = agent.Serve(ctx, l)
	// Leave the cluster (revoke the lease) once the API stopped.
	mcancel()
	<-membership
	return err
}

func clusterCmd(g *globals) *cobra.Command {
	var cfg config.Config
	store := func() (*cluster.Store, error) {
		c, _ := config.Load("")
		if len(cfg.Cluster.Etcd) > 0 {
			c.Cluster.Etcd = cfg.Cluster.Etcd
		}
		if cfg.Cluster.Prefix != "" {
			c.Cluster.Prefix = cfg.Cluster.Prefix
		}
		return storeOf(c, slog.New(slog.DiscardHandler))
	}
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Administer a cluster through its etcd: nodes, drains, projects, quotas, API keys",
	}
	clusterFlags(cmd.PersistentFlags(), &cfg)
	with := func(f func(ctx context.Context, s *cluster.Store, args []string) error) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			s, err := store()
			if err != nil {
				return err
			}
			defer s.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			err = f(ctx, s, args)
			var u *cluster.UnconfirmedError
			if errors.As(err, &u) {
				// The write is done; say who has not seen it yet.
				fmt.Fprintln(os.Stderr, "warning:", err)
				return nil
			}
			return err
		}
	}
	nodes := &cobra.Command{
		Use: "nodes", Short: "List nodes: state, address, load", Args: cobra.NoArgs,
		RunE: with(func(ctx context.Context, s *cluster.Store, _ []string) error {
			list, err := s.Nodes(ctx)
			if err != nil {
				return err
			}
			if g.json() {
				type row struct {
					Name      string            `json:"name"`
					State     string            `json:"state"`
					Address   string            `json:"address"`
					Labels    map[string]string `json:"labels,omitempty"`
					Sandboxes int64             `json:"sandboxes"`
					Max       int64             `json:"max_sandboxes"`
					Kinds     []string          `json:"kinds,omitempty"`
					Images    []string          `json:"images,omitempty"`
					Projects  map[string]int64  `json:"projects,omitempty"`
				}
				rows := []row{}
				for _, n := range list {
					r := row{Name: n.Name, State: n.State(), Address: n.Address, Labels: n.Labels}
					if n.Load != nil {
						r.Sandboxes, r.Max, r.Kinds, r.Images, r.Projects = n.Load.Sandboxes, n.Load.MaxSandboxes, n.Load.Kinds, n.Load.Images, n.Load.Projects
					}
					rows = append(rows, r)
				}
				b, _ := json.MarshalIndent(rows, "", "  ")
				fmt.Println(string(b))
				return nil
			}
			tw := table("NAME", "STATE", "ADDRESS", "SANDBOXES", "KINDS", "LABELS")
			for _, n := range list {
				load, kinds := "-", "-"
				if n.Load != nil {
					load = fmt.Sprintf("%d/%d", n.Load.Sandboxes, n.Load.MaxSandboxes)
					kinds = strings.Join(n.Load.Kinds, ",")
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", n.Name, n.State(), n.Address, load, kinds, formatLabels(n.Labels))
			}
			return tw.Flush()
		}),
	}
	drain := &cobra.Command{
		Use: "drain NODE", Short: "Stop placing sandboxes on a node; its sandboxes run until they end", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error {
			return s.SetDrain(ctx, args[0], true)
		}),
	}
	undrain := &cobra.Command{
		Use: "undrain NODE", Short: "Place sandboxes on a drained node again", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error {
			return s.SetDrain(ctx, args[0], false)
		}),
	}
	forget := &cobra.Command{
		Use: "forget NODE", Short: "Remove a node that left for good (IDs naming it become unknown)", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error { return s.ForgetNode(ctx, args[0]) }),
	}
	cmd.AddCommand(nodes, drain, undrain, forget, projectCmd(g, with), keyCmd(g, with))
	return cmd
}

type storeFunc = func(func(ctx context.Context, s *cluster.Store, args []string) error) func(*cobra.Command, []string) error

func projectCmd(g *globals, with storeFunc) *cobra.Command {
	cmd := &cobra.Command{Use: "project", Short: "Projects and their quotas"}
	var p cluster.Project
	set := &cobra.Command{
		Use: "set NAME", Short: "Create or change a project's quotas (0: unlimited)", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error { return s.PutProject(ctx, args[0], p) }),
	}
	set.Flags().Int64Var(&p.MaxSandboxes, "max-sandboxes", 0, "live and starting sandboxes at most")
	set.Flags().Float64Var(&p.CreatesPerS, "creates-per-s", 0, "creates per second at most")
	set.Flags().IntVar(&p.Burst, "burst", 0, "creates at once (default: creates-per-s rounded up)")
	ls := &cobra.Command{
		Use: "ls", Short: "List projects with quotas", Args: cobra.NoArgs,
		RunE: with(func(ctx context.Context, s *cluster.Store, _ []string) error {
			ps, err := s.Projects(ctx)
			if err != nil {
				return err
			}
			if g.json() {
				b, _ := json.MarshalIndent(ps, "", "  ")
				fmt.Println(string(b))
				return nil
			}
			names := make([]string, 0, len(ps))
			for n := range ps {
				names = append(names, n)
			}
			sort.Strings(names)
			tw := table("PROJECT", "MAX SANDBOXES", "CREATES/S", "BURST")
			for _, n := range names {
				q := ps[n]
				fmt.Fprintf(tw, "%s\t%d\t%g\t%d\n", n, q.MaxSandboxes, q.CreatesPerS, q.Burst)
			}
			return tw.Flush()
		}),
	}
	rm := &cobra.Command{
		Use: "rm NAME", Short: "Remove a project's quotas", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error { return s.DeleteProject(ctx, args[0]) }),
	}
	cmd.AddCommand(set, ls, rm)
	return cmd
}

func keyCmd(g *globals, with storeFunc) *cobra.Command {
	cmd := &cobra.Command{Use: "key", Short: "API keys (only their hashes are stored)"}
	var name, given string
	var admin bool
	add := &cobra.Command{
		Use: "add PROJECT", Short: "Create an API key of a project and print it (once)", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error {
			key := given
			if key == "" {
				var b [20]byte
				rand.Read(b[:])
				key = "dsec_" + strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b[:]))
			}
			err := s.AddKey(ctx, key, args[0], name, admin)
			var u *cluster.UnconfirmedError
			if err != nil && !errors.As(err, &u) {
				return err
			}
			fmt.Println(key)
			return err
		}),
	}
	add.Flags().StringVar(&name, "name", "", "a note to recognize the key by")
	add.Flags().StringVar(&given, "key", "", "store this key instead of generating one")
	add.Flags().BoolVar(&admin, "admin", false, "an operator's key: reaches every project's sandboxes, sessions, snapshots, images and logs")
	ls := &cobra.Command{
		Use: "ls", Short: "List keys by hash", Args: cobra.NoArgs,
		RunE: with(func(ctx context.Context, s *cluster.Store, _ []string) error {
			keys, err := s.Keys(ctx)
			if err != nil {
				return err
			}
			if g.json() {
				b, _ := json.MarshalIndent(keys, "", "  ")
				fmt.Println(string(b))
				return nil
			}
			tw := table("HASH", "PROJECT", "NAME", "CREATED")
			for h, k := range keys {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", h[:16], k.Project, orDash(k.Name), k.Created.Format(time.RFC3339))
			}
			return tw.Flush()
		}),
	}
	rm := &cobra.Command{
		Use: "rm KEY-OR-HASH", Short: "Remove a key", Args: cobra.ExactArgs(1),
		RunE: with(func(ctx context.Context, s *cluster.Store, args []string) error { return s.RemoveKey(ctx, args[0]) }),
	}
	cmd.AddCommand(add, ls, rm)
	return cmd
}
