package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/apiserver"
	"github.com/opendsec/dsec/internal/config"
	"github.com/opendsec/dsec/internal/dashboard"
	"github.com/opendsec/dsec/internal/e2b"
	"github.com/opendsec/dsec/internal/events"
	"github.com/opendsec/dsec/internal/hostlimits"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/metrics"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/node"
	"github.com/opendsec/dsec/internal/session"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/container"
	"github.com/opendsec/dsec/internal/substrate/function"
	"github.com/opendsec/dsec/internal/substrate/microvm"
	"github.com/opendsec/dsec/internal/substrate/vm"
	"github.com/opendsec/dsec/internal/tenant"
)

func serveCmd() *cobra.Command {
	var (
		file    string
		flagCfg config.Config
		v       nodeVars
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the all-in-one server (API and node agent) on this host",
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
			cfg.Defaults()
			return serve(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&file, "config", "c", "", "YAML config file")
	f.StringVar(&flagCfg.Listen, "listen", "", "API address (default 127.0.0.1:7070)")
	f.StringArrayVar(&flagCfg.APIKeys, "api-key", nil, "accepted API key, KEY (project default) or PROJECT=KEY (repeatable; env DSEC_API_KEYS)")
	f.StringArrayVar(&flagCfg.AdminKeys, "admin-key", nil, "an operator's key: reaches every project (repeatable; env DSEC_ADMIN_KEYS)")
	e2bFlags(f, &flagCfg)
	nodeFlags(f, &flagCfg, &v)
	f.StringVar(&flagCfg.Node.Name, "name", "", "node name (default local)")
	return cmd
}

// e2bFlags are the flags of the E2B facade, shared by serve and api.
func e2bFlags(f *pflag.FlagSet, flagCfg *config.Config) {
	f.StringVar(&flagCfg.E2B.Domain, "e2b-domain", "", "sandbox domain E2B SDKs are told to use, host[:port] (default none: clients set E2B_SANDBOX_URL)")
	f.StringVar(&flagCfg.E2B.TLSListen, "e2b-tls-listen", "", "also serve the API, the E2B facade and sandbox ports over TLS here, for the sandbox domain")
	f.StringVar(&flagCfg.E2B.TLSCertFile, "e2b-tls-cert", "", "certificate of --e2b-tls-listen for <domain> and *.<domain> (default: issued by a CA kept in DATA_DIR/e2b-ca.pem)")
	f.StringVar(&flagCfg.E2B.TLSKeyFile, "e2b-tls-key", "", "key of --e2b-tls-cert")
}

// nodeFlags are the flags of a node agent, shared by serve and node.
func nodeFlags(f *pflag.FlagSet, flagCfg *config.Config, v *nodeVars) {
	bootstrap, pools := &v.bootstrap, &v.pools
	f.StringVar(&flagCfg.DataDir, "data-dir", "", "state directory (default ./.dsec)")
	f.StringVar(&flagCfg.CacheDir, "cache-dir", "", "cache for bootstrapped images (default DATA_DIR/cache)")
	f.StringVar(&flagCfg.GuestBinary, "guest-binary", "", "dsec-guest binary (default: next to dsec)")
	f.Int64Var(&flagCfg.ImageCacheMB, "image-cache-mb", 0, "byte budget in MiB of the cache of chunks of images loaded on demand (default: a quarter of the data directory's file system)")
	f.Int64Var(&flagCfg.ImageStoreMB, "image-store-mb", 0, "byte budget in MiB of the image store's layers (default: half of the data directory's file system); past it cached build steps and image copies go, then imports and builds are refused")
	f.StringVar(&flagCfg.ImageLayers, "image-layers", "", "how image layers are kept: erofs (an EROFS image each), dir (directories) or auto (default: erofs where the host can)")
	f.StringVar(bootstrap, "bootstrap", "", "base images to build at start if missing, e.g. busybox,debian,base,debian-vm (a VM image); the E2B facade's default templates start base")
	f.StringVar(&flagCfg.LogLevel, "log-level", "", "debug, info, warn or error")
	f.IntVar(&flagCfg.Node.MaxSandboxes, "max-sandboxes", 0, "admission limit (default 4096)")
	f.IntVar(&flagCfg.Node.MaxConcurrentStarts, "max-starts", 0, "sandbox starts in flight (default 2 per core)")
	f.IntVar(&flagCfg.Node.StartQueue, "start-queue", 0, "creates that may wait for a start (default 1024)")
	f.BoolVar(&flagCfg.Node.KeepKernelLimits, "keep-kernel-limits", false, "leave the host's kernel limits (pid_max, inotify, conntrack, ...) as they are instead of raising those a dense node needs")
	f.StringVar(&flagCfg.Network.Bridge, "bridge", "", "egress bridge name (default dsec0)")
	f.StringVar(&flagCfg.Network.Subnet, "subnet", "", "egress subnet (default 10.88.0.0/16)")
	f.StringVar(&flagCfg.Network.Table, "nft-table", "", "nftables tables, inet and bridge (default dsec)")
	f.StringArrayVar(&flagCfg.Network.DNS, "dns", nil, "resolver of egress sandboxes and upstream of the node's resolver for sandboxes under a policy (repeatable; default: the host's)")
	f.StringVar(&flagCfg.Network.TrustedCAs, "egress-ca", "", "PEM file of the CAs the egress proxy trusts for brokered requests (default: the host's)")
	f.StringVar(&flagCfg.Container.Runtime, "runtime", "", "OCI runtime: crun or runc (default crun)")
	f.BoolVar(&flagCfg.Container.HostRoot, "host-root", false, "run container sandboxes without a user namespace: root inside is the host's root")
	f.StringVar(&flagCfg.MicroVM.Accel, "microvm-accel", "", "microvm acceleration: auto, kvm or tcg (default auto)")
	f.StringVar(&flagCfg.MicroVM.KernelDir, "guest-kernel", "", "microvm guest kernel directory (default CACHE_DIR/guest-kernel)")
	f.BoolVar(&flagCfg.MicroVM.ColdBoot, "microvm-cold-boot", false, "boot every microVM instead of restoring its image's boot snapshot")
	f.StringVar(&flagCfg.VM.Accel, "vm-accel", "", "vm acceleration: auto, kvm or tcg (default auto)")
	f.StringVar(&flagCfg.VM.Boot, "vm-boot", "", "how full VMs boot: auto, firmware or direct (default auto)")
	f.BoolVar(&flagCfg.VM.ColdBoot, "vm-cold-boot", false, "boot every full VM instead of restoring its image's boot snapshot")
	f.BoolVar(&flagCfg.VM.VNC, "vm-vnc", false, "give every full VM a password-locked VNC server on 127.0.0.1 (see dsec vnc)")
	f.StringArrayVar(pools, "pool", nil, "warm pool IMAGE:SIZE with default resources (repeatable; see the config file for shapes)")
	f.StringVar(&flagCfg.DebugListen, "debug-listen", "", "serve Go profiling (net/http/pprof) on this loopback address")
	f.StringVar(&flagCfg.MetricsListen, "metrics-listen", "", "also serve Prometheus metrics at /metrics on this address, without authentication (they are always at /metrics on --listen for admin keys)")
	f.BoolVar(&flagCfg.NoMetrics, "no-metrics", false, "count nothing and serve no /metrics (to measure what metrics cost)")
	f.DurationVar((*time.Duration)(&flagCfg.Node.SampleEvery), "sample-every", 0, "how often each sandbox's use is sampled into its history (default 5s; negative: never)")
	f.DurationVar((*time.Duration)(&flagCfg.Node.LogSyncWindow), "log-sync-window", 0, "how long an answered call's trajectory entry may wait for its fsync; written before the answer either way (default 10ms; negative: synced before each answer)")
	f.StringArrayVar(&v.webhooks, "webhook", nil, "POST every sandbox lifecycle event to this URL, signed with --webhook-secret-file's key (repeatable; the config file's node.webhooks also filter)")
	f.StringVar(&v.webhookSecret, "webhook-secret-file", "", "file holding the key --webhook deliveries are signed with")
}

// nodeVars are the node flags that are not config fields as they are.
type nodeVars struct {
	bootstrap     string
	pools         []string
	webhooks      []string
	webhookSecret string
}

// apply adds the --pool and --webhook flags to cfg.
func (v *nodeVars) apply(cfg *config.Config) error {
	if len(v.webhooks) > 0 && v.webhookSecret == "" {
		return fmt.Errorf("--webhook needs --webhook-secret-file (deliveries are signed)")
	}
	for _, u := range v.webhooks {
		cfg.Node.Webhooks = append(cfg.Node.Webhooks, config.Webhook{URL: u, SecretFile: v.webhookSecret})
	}
	for _, p := range v.pools {
		img, size, _ := strings.Cut(p, ":")
		n, err := strconv.Atoi(size)
		if err != nil || img == "" {
			return fmt.Errorf("--pool %q: want IMAGE:SIZE", p)
		}
		cfg.Node.Pools = append(cfg.Node.Pools, config.Pool{Image: img, Size: n})
	}
	return nil
}

// applyFlags overlays the flags that were set on cfg.
func applyFlags(cmd *cobra.Command, cfg, fl *config.Config, bootstrap string) {
	set := func(name string) bool { return cmd.Flags().Changed(name) }
	if set("listen") {
		cfg.Listen = fl.Listen
	}
	if set("data-dir") {
		cfg.DataDir = fl.DataDir
	}
	if set("cache-dir") {
		cfg.CacheDir = fl.CacheDir
	}
	if set("image-layers") {
		cfg.ImageLayers = fl.ImageLayers
	}
	if set("image-cache-mb") {
		cfg.ImageCacheMB = fl.ImageCacheMB
	}
	if set("image-store-mb") {
		cfg.ImageStoreMB = fl.ImageStoreMB
	}
	if set("api-key") {
		cfg.APIKeys = fl.APIKeys
	}
	if set("admin-key") {
		cfg.AdminKeys = fl.AdminKeys
	}
	if set("guest-binary") {
		cfg.GuestBinary = fl.GuestBinary
	}
	if set("bootstrap") {
		cfg.Bootstrap = nil
		for _, b := range strings.Split(bootstrap, ",") {
			if b = strings.TrimSpace(b); b != "" {
				cfg.Bootstrap = append(cfg.Bootstrap, b)
			}
		}
	}
	if set("log-level") {
		cfg.LogLevel = fl.LogLevel
	}
	if set("name") {
		cfg.Node.Name = fl.Node.Name
	}
	if set("max-sandboxes") {
		cfg.Node.MaxSandboxes = fl.Node.MaxSandboxes
	}
	if set("max-starts") {
		cfg.Node.MaxConcurrentStarts = fl.Node.MaxConcurrentStarts
	}
	if set("start-queue") {
		cfg.Node.StartQueue = fl.Node.StartQueue
	}
	if set("keep-kernel-limits") {
		cfg.Node.KeepKernelLimits = fl.Node.KeepKernelLimits
	}
	if set("bridge") {
		cfg.Network.Bridge = fl.Network.Bridge
	}
	if set("subnet") {
		cfg.Network.Subnet = fl.Network.Subnet
	}
	if set("nft-table") {
		cfg.Network.Table = fl.Network.Table
	}
	if set("dns") {
		cfg.Network.DNS = fl.Network.DNS
	}
	if set("egress-ca") {
		cfg.Network.TrustedCAs = fl.Network.TrustedCAs
	}
	if set("debug-listen") {
		cfg.DebugListen = fl.DebugListen
	}
	if set("metrics-listen") {
		cfg.MetricsListen = fl.MetricsListen
	}
	if set("no-metrics") {
		cfg.NoMetrics = fl.NoMetrics
	}
	if set("sample-every") {
		cfg.Node.SampleEvery = fl.Node.SampleEvery
	}
	if set("log-sync-window") {
		cfg.Node.LogSyncWindow = fl.Node.LogSyncWindow
	}
	if set("runtime") {
		cfg.Container.Runtime = fl.Container.Runtime
	}
	if set("host-root") {
		cfg.Container.HostRoot = fl.Container.HostRoot
	}
	if set("microvm-accel") {
		cfg.MicroVM.Accel = fl.MicroVM.Accel
	}
	if set("guest-kernel") {
		cfg.MicroVM.KernelDir = fl.MicroVM.KernelDir
	}
	if set("vm-accel") {
		cfg.VM.Accel = fl.VM.Accel
	}
	if set("vm-boot") {
		cfg.VM.Boot = fl.VM.Boot
	}
	if set("microvm-cold-boot") {
		cfg.MicroVM.ColdBoot = fl.MicroVM.ColdBoot
	}
	if set("vm-cold-boot") {
		cfg.VM.ColdBoot = fl.VM.ColdBoot
	}
	if set("vm-vnc") {
		cfg.VM.VNC = fl.VM.VNC
	}
	if set("e2b-domain") {
		cfg.E2B.Domain = fl.E2B.Domain
	}
	if set("e2b-tls-listen") {
		cfg.E2B.TLSListen = fl.E2B.TLSListen
	}
	if set("e2b-tls-cert") {
		cfg.E2B.TLSCertFile = fl.E2B.TLSCertFile
	}
	if set("e2b-tls-key") {
		cfg.E2B.TLSKeyFile = fl.E2B.TLSKeyFile
	}
	if set("etcd") {
		cfg.Cluster.Etcd = fl.Cluster.Etcd
	}
	if set("etcd-prefix") {
		cfg.Cluster.Prefix = fl.Cluster.Prefix
	}
	if set("cluster-token") {
		cfg.Cluster.Token = fl.Cluster.Token
	}
	if set("advertise") {
		cfg.Cluster.Advertise = fl.Cluster.Advertise
	}
	if set("node-ttl") {
		cfg.Cluster.NodeTTL = fl.Cluster.NodeTTL
	}
	if set("load-interval") {
		cfg.Cluster.LoadInterval = fl.Cluster.LoadInterval
	}
}

func newLogger(level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}

func serve(ctx context.Context, cfg config.Config) error {
	log := newLogger(cfg.LogLevel)
	if err := apiserver.CheckListen(cfg.Listen, append(cfg.APIKeys, cfg.AdminKeys...)); err != nil {
		return err
	}
	reg, calls := newMetrics(cfg)
	n, closeNode, err := openNode(cfg, reg, log)
	if err != nil {
		return err
	}
	defer closeNode()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	router := apiserver.Single{N: n.Service()}
	sessStore, err := session.OpenBolt(filepath.Join(n.DataDir(), "control.db"))
	if err != nil {
		return err
	}
	defer sessStore.Close()
	sessions := session.New(sessStore, apiserver.Actor(router), log)
	sessions.CountExpiries(calls.SessionExpired)
	n.UseModelRegistry(func(ctx context.Context, project, name string) (*dsecv1.ModelUpstreams, error) {
		return session.Models(ctx, sessStore, project, name)
	})
	hooks := apiserver.NewHooks(events.NewFileHooks(filepath.Join(n.DataDir(), "webhooks.json")), router, log, calls.Webhook)
	api, err := apiserver.New(apiserver.Config{APIKeys: cfg.APIKeys, AdminKeys: cfg.AdminKeys, Version: version, Metrics: reg, API: calls, Hooks: hooks}, log, router, sessions)
	if err != nil {
		return err
	}
	secret, err := e2bSecret(cfg.E2B, n.DataDir(), "", log)
	if err != nil {
		return fmt.Errorf("e2b token secret: %w", err)
	}
	if err := mountE2B(cfg.E2B, secret, filepath.Join(cfg.DataDir, "e2b-templates"), log, router, api, hooks); err != nil {
		return err
	}
	go hooks.Run(ctx)
	api.Handle("GET "+dashboard.Prefix, dashboard.Handler())
	go sessions.Run(ctx)
	if err := bootstrapImages(ctx, n, cfg.Bootstrap, log); err != nil {
		return err
	}
	if err := serveDebug(cfg.DebugListen, log); err != nil {
		return err
	}
	if err := serveMetrics(ctx, cfg.MetricsListen, reg, log); err != nil {
		return err
	}
	// The webhooks registered before a restart follow events before the
	// first call is served (bounded: Hooks.Ready).
	select {
	case <-hooks.Ready():
	case <-ctx.Done():
		return nil
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	if cfg.E2B.TLSListen != "" {
		if err := apiserver.CheckListen(cfg.E2B.TLSListen, append(cfg.APIKeys, cfg.AdminKeys...)); err != nil {
			return fmt.Errorf("e2b TLS listener: %w", err)
		}
	}
	if err := serveE2BTLS(ctx, cfg, n.DataDir(), api, log); err != nil {
		return err
	}
	log.Info("dsec serving", slog.String("listen", l.Addr().String()), slog.String("data_dir", n.DataDir()), slog.Bool("auth", len(cfg.APIKeys)+len(cfg.AdminKeys) > 0))
	return api.Serve(ctx, l)
}

// blobdCmd is the blob server a node starts for the data of layers it
// loads on demand (internal/image/blobd.go); an operator runs it by hand
// only to look at it.
func blobdCmd() *cobra.Command {
	return &cobra.Command{
		Use:                "blobd --dir DATA_DIR/images",
		Short:              "Serve the data of image layers loaded on demand (started by the node)",
		Hidden:             true,
		DisableFlagParsing: true,
		RunE: func(_ *cobra.Command, args []string) error {
			if code := image.RunBlobd(args); code != 0 {
				return exitError(code)
			}
			return nil
		},
	}
}

// openNode starts a node agent over cfg's data directory, with every
// substrate this host runs. close stops it (sandboxes keep running).
func openNode(cfg config.Config, reg *metrics.Registry, log *slog.Logger) (_ *node.Node, close func(), _ error) {
	// Before anything starts threads: all sandbox mounts live in a private
	// mount namespace, which also lets crun work on hybrid cgroup hosts.
	if os.Geteuid() == 0 {
		if err := mountns.Enter(); err != nil {
			return nil, nil, fmt.Errorf("enter a private mount namespace: %w", err)
		}
	} else {
		log.Warn("not running as root: sandboxes cannot start (the container substrate needs root)")
	}
	if os.Geteuid() == 0 && !cfg.Node.KeepKernelLimits {
		if err := hostlimits.Apply(log); err != nil {
			log.Warn("kernel limits not checked", slog.Any("error", err))
		}
	}
	dataDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, nil, err
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, nil, err
	}
	n, err := buildNode(cfg, dataDir, reg, log)
	if err != nil {
		return nil, nil, err
	}
	return n, func() {
		n.Close()
		n.Images().Close() // the layers' mounts and the blob file system of layers loaded on demand
		removeEmptyRunDir(runDirOf(dataDir))
	}, nil
}

// bootstrapImages builds the base images a node lacks: a recipe name
// ("busybox", "debian") builds layers, "<recipe>-vm" ("debian-vm") a VM
// image.
func bootstrapImages(ctx context.Context, n *node.Node, recipes []string, log *slog.Logger) error {
	// The server's own images are shared by every project.
	ctx = tenant.System(ctx)
	for _, recipe := range recipes {
		if _, err := n.GetImage(ctx, recipe); err == nil {
			continue
		}
		req := &dsecv1.BootstrapImageRequest{Recipe: recipe}
		if base, ok := strings.CutSuffix(recipe, "-vm"); ok {
			req = &dsecv1.BootstrapImageRequest{Recipe: base, Name: recipe, Vm: true}
		}
		log.Info("bootstrapping base image (first run only)", slog.String("image", recipe))
		last := time.Now()
		_, err := n.BootstrapImage(ctx, req, func(p *dsecv1.ImageProgress) {
			if time.Since(last) > 5*time.Second {
				last = time.Now()
				log.Info("bootstrap", slog.String("image", recipe), slog.String("phase", p.Phase), slog.String("step", p.Message))
			}
		})
		if err != nil {
			return fmt.Errorf("bootstrap image %s: %w", recipe, err)
		}
		log.Info("base image ready", slog.String("image", recipe))
	}
	return nil
}

// serveDebug serves Go profiling on a loopback address, if one is set.
func serveDebug(addr string, log *slog.Logger) error {
	if addr == "" {
		return nil
	}
	if err := apiserver.CheckListen(addr, nil); err != nil {
		return fmt.Errorf("debug listener: %w", err)
	}
	go func() {
		err := http.ListenAndServe(addr, debugMux())
		log.Warn("debug listener stopped", slog.Any("error", err))
	}()
	return nil
}

// newMetrics is the process's registry and API metrics, both nil when
// cfg turns metrics off.
func newMetrics(cfg config.Config) (*metrics.Registry, *metrics.API) {
	if cfg.NoMetrics {
		return nil, nil
	}
	reg := metrics.NewRegistry(version)
	return reg, metrics.NewAPI(reg)
}

// registerer is reg as the node takes it (nil: no metrics).
func registerer(reg *metrics.Registry) prometheus.Registerer {
	if reg == nil {
		return nil // not a nil *Registry in an interface
	}
	return reg
}

// serveMetrics serves reg at /metrics on addr (if set), without
// authentication, until ctx ends.
func serveMetrics(ctx context.Context, addr string, reg *metrics.Registry, log *slog.Logger) error {
	if addr == "" {
		return nil
	}
	if reg == nil {
		return fmt.Errorf("--metrics-listen with metrics turned off (--no-metrics)")
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	m := http.NewServeMux()
	m.Handle("GET /metrics", reg.Handler())
	srv := &http.Server{Handler: m, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("metrics listener stopped", slog.Any("error", err))
		}
	}()
	log.Info("serving metrics", slog.String("listen", l.Addr().String()))
	return nil
}

// e2bSecret is the key of E2B access tokens: a configured file, else a
// file in the data directory (serve), else one derived from the cluster
// token, so every replica of a cluster checks the tokens of the others.
func e2bSecret(c config.E2B, dataDir, clusterToken string, log *slog.Logger) ([]byte, error) {
	path := c.TokenSecretFile
	if path == "" && dataDir != "" {
		path = filepath.Join(dataDir, "e2b-token.key")
	}
	if path != "" {
		return loadOrCreateSecret(path)
	}
	if clusterToken != "" {
		sum := sha256.Sum256([]byte("dsec e2b access tokens\x00" + clusterToken))
		return sum[:], nil
	}
	log.Warn("e2b access tokens are valid on this replica only: set e2b.token_secret_file or a cluster token")
	b := make([]byte, 32)
	_, err := rand.Read(b)
	return b, err
}

// mountE2B serves the E2B-compatible facade on the API's listener, with
// template builds kept in templateDir (none: "", as on a cluster's API
// replicas, which hold no data).
func mountE2B(c config.E2B, secret []byte, templateDir string, log *slog.Logger, router apiserver.Router, api *apiserver.Server, hooks *apiserver.Hooks) error {
	var templates map[string]e2b.Template
	if len(c.Templates) > 0 {
		templates = map[string]e2b.Template{}
		for name, t := range c.Templates {
			templates[name] = e2b.Template{Image: t.Image, Kind: t.Kind, KindImages: t.KindImages, CPU: t.CPU, MemoryMB: t.MemoryMB}
		}
	}
	fac, err := e2b.New(e2b.Config{
		Domain: c.Domain, Templates: templates, DefaultKind: c.DefaultKind, DefaultNetwork: c.DefaultNetwork, TokenSecret: secret, Hooks: hooks,
		TemplateDir: templateDir,
	}, log, router, api.Authenticate)
	if err != nil {
		return err
	}
	fac.Mount(api.Handle)
	api.Intercept(fac.Route)
	return nil
}

// serveE2BTLS serves api over TLS on e2b.tls_listen, if set, until ctx
// ends (see e2b.TLSConfig for the certificate; without a certificate file
// the CA is kept in dataDir, which an API replica of a cluster has not:
// every replica would issue its own).
func serveE2BTLS(ctx context.Context, cfg config.Config, dataDir string, api *apiserver.Server, log *slog.Logger) error {
	c := cfg.E2B
	if c.TLSListen == "" {
		return nil
	}
	if dataDir == "" && c.TLSCertFile == "" {
		return fmt.Errorf("e2b TLS listener: an API replica needs e2b.tls_cert_file and e2b.tls_key_file")
	}
	tc, err := e2b.TLSConfig(c.Domain, c.TLSCertFile, c.TLSKeyFile, dataDir)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", c.TLSListen)
	if err != nil {
		return err
	}
	log.Info("dsec serving TLS for the E2B domain", slog.String("listen", l.Addr().String()), slog.String("domain", c.Domain))
	go func() {
		if err := api.Serve(ctx, tls.NewListener(l, tc)); err != nil {
			log.Error("e2b TLS listener stopped", slog.Any("error", err))
		}
	}()
	return nil
}

// loadOrCreateSecret reads a secret file, creating it with 32 random bytes
// when it does not exist.
func loadOrCreateSecret(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		if len(b) < 16 {
			return nil, fmt.Errorf("%s holds fewer than 16 bytes", path)
		}
		return b, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	b = make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	// Written aside and linked into place: the file appears whole or not
	// at all, and a concurrent creator's file wins.
	tmp, err := os.CreateTemp(filepath.Dir(path), ".e2b-token-*")
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return loadOrCreateSecret(path)
		}
		return nil, err
	}
	return b, nil
}

func debugMux() *http.ServeMux {
	m := http.NewServeMux()
	m.HandleFunc("/debug/pprof/", pprof.Index)
	m.HandleFunc("/debug/pprof/profile", pprof.Profile)
	m.HandleFunc("/debug/pprof/trace", pprof.Trace)
	m.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	return m
}

// buildNode assembles a node agent with every substrate this host runs.
func buildNode(cfg config.Config, dataDir string, reg *metrics.Registry, log *slog.Logger) (*node.Node, error) {
	guestBin, err := findGuest(cfg.GuestBinary)
	if err != nil {
		return nil, err
	}
	images, err := image.Open(filepath.Join(dataDir, "images"), log)
	if err != nil {
		return nil, err
	}
	if err := images.UseLayers(cfg.ImageLayers); err != nil {
		return nil, err
	}
	images.SetChunkBudget(cfg.ImageCacheMB << 20)
	images.SetBudget(cfg.ImageStoreMB << 20)
	runDir := runDirOf(dataDir)
	images.SetSandboxDirs(dataDir, runDir)
	creds := map[string]node.NamedCredential{}
	for _, c := range cfg.Network.Credentials {
		if c.Name == "" || c.Host == "" || c.Value == "" {
			return nil, fmt.Errorf("network.credentials: each needs a name, a host and a value")
		}
		if _, dup := creds[c.Name]; dup {
			return nil, fmt.Errorf("network.credentials: two named %q", c.Name)
		}
		nc := node.NamedCredential{Credential: network.Credential{Host: c.Host, Header: c.Header, Value: c.Value}, Projects: c.Projects}
		p := &network.Policy{Credentials: []network.Credential{nc.Credential}}
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("network.credentials %s: %w", c.Name, err)
		}
		nc.Credential = p.Credentials[0] // normalized
		creds[c.Name] = nc
	}
	nm, err := network.New(network.Config{Bridge: cfg.Network.Bridge, Subnet: cfg.Network.Subnet, DNS: cfg.Network.DNS, Table: cfg.Network.Table, TrustedCAs: cfg.Network.TrustedCAs, RunDir: filepath.Join(runDir, "netns")}, log)
	if err != nil {
		return nil, err
	}
	ct, err := container.New(container.Config{
		Runtime: cfg.Container.Runtime, CgroupParent: cfg.Container.CgroupParent,
		GuestBinary: guestBin, StateDir: filepath.Join(dataDir, "container"), RunDir: runDir,
		HostRoot: cfg.Container.HostRoot, DefaultDiskMB: cfg.Container.DefaultDiskMB, MaxDiskMB: cfg.Container.MaxDiskMB,
		NoDiskLimits: cfg.Container.NoDiskLimits,
		GVisor:       cfg.Container.GVisor, GVisorPlatform: cfg.Container.GVisorPlatform,
	}, log)
	if err != nil {
		return nil, err
	}
	fn := function.New(function.Config{Image: cfg.Function.Image, StateDir: filepath.Join(dataDir, "function"),
		Slots: cfg.Function.Slots, MaxWorkers: cfg.Function.MaxWorkers, WorkerMemoryMB: cfg.Function.WorkerMemoryMB,
		CallDiskMB: cfg.Function.CallDiskMB}, ct, images, log, runtime.NumCPU())
	cacheDir := cfg.CacheDir
	if cacheDir == "" {
		cacheDir = filepath.Join(dataDir, "cache")
	}
	kernelDir := cfg.MicroVM.KernelDir
	if kernelDir == "" {
		kernelDir = filepath.Join(cacheDir, "guest-kernel")
	}
	mvm, err := microvm.New(microvm.Config{
		KernelDir: kernelDir, GuestBinary: guestBin, StateDir: filepath.Join(dataDir, "microvm"),
		RunDir: filepath.Join(runDir, "vm"), Accel: cfg.MicroVM.Accel, BootTimeout: time.Duration(cfg.MicroVM.BootTimeout),
		TBSizeMiB: cfg.MicroVM.TBSizeMiB, DefaultDiskMB: cfg.MicroVM.DefaultDiskMB, CgroupParent: cfg.Container.CgroupParent,
		ColdBoot: cfg.MicroVM.ColdBoot,
	}, log)
	if err != nil {
		return nil, err
	}
	fvm, err := vm.New(vm.Config{
		GuestBinary: guestBin, StateDir: filepath.Join(dataDir, "vm"), RunDir: filepath.Join(runDir, "fvm"),
		KernelDir: kernelDir, Accel: cfg.VM.Accel, Boot: cfg.VM.Boot, ColdBoot: cfg.VM.ColdBoot,
		BootTimeout: time.Duration(cfg.VM.BootTimeout), TBSizeMiB: cfg.VM.TBSizeMiB, VNC: cfg.VM.VNC,
		CgroupParent: cfg.Container.CgroupParent,
	}, log)
	if err != nil {
		return nil, err
	}
	drivers := map[substrate.Kind]substrate.Driver{substrate.KindContainer: ct, substrate.KindFunction: fn, substrate.KindMicroVM: mvm, substrate.KindVM: fvm}
	var hooks []node.Webhook
	for _, h := range cfg.Node.Webhooks {
		if h.SecretFile == "" {
			return nil, fmt.Errorf("webhook %s: secret_file is required (deliveries are signed)", h.URL)
		}
		secret, err := os.ReadFile(h.SecretFile)
		if err != nil {
			return nil, fmt.Errorf("webhook %s: %w", h.URL, err)
		}
		hooks = append(hooks, node.Webhook{URL: h.URL, Secret: bytes.TrimSpace(secret), Selector: h.LabelSelector, Types: h.Types})
	}
	var pools []node.PoolConfig
	for _, p := range cfg.Node.Pools {
		pools = append(pools, node.PoolConfig{Kind: p.Kind, Image: p.Image, CPU: p.CPU, MemoryMB: p.MemoryMB, Pids: p.Pids, Network: p.Network, Runtime: p.Runtime, Size: p.Size})
	}
	return node.New(node.Config{
		MaxConcurrentStarts: cfg.Node.MaxConcurrentStarts, StartQueue: cfg.Node.StartQueue, Pools: pools,
		Name: cfg.Node.Name, DataDir: dataDir, CacheDir: cfg.CacheDir, MaxSandboxes: cfg.Node.MaxSandboxes,
		DefaultTTL: time.Duration(cfg.Node.DefaultTTL), MaxTTL: time.Duration(cfg.Node.MaxTTL),
		PausedTTL:  time.Duration(cfg.Node.PausedTTL),
		DefaultCPU: cfg.Node.DefaultCPU, DefaultMemoryMB: cfg.Node.DefaultMemoryMB,
		DefaultExecTimeout: time.Duration(cfg.Node.DefaultExecTimeout),
		Credentials:        creds,
		DefaultVolumeMB:    cfg.Node.DefaultVolumeMB, MaxVolumeMB: cfg.Node.MaxVolumeMB,
		Metrics: registerer(reg), Webhooks: hooks, SampleEvery: time.Duration(cfg.Node.SampleEvery),
		LogSyncWindow: time.Duration(cfg.Node.LogSyncWindow),
	}, log, images, nm, drivers)
}

// runDirOf is the data directory's directory under /run: runtime state,
// agent sockets and network namespaces, short enough for socket paths.
func runDirOf(dataDir string) string {
	h := uint32(2166136261)
	for i := 0; i < len(dataDir); i++ {
		h = (h ^ uint32(dataDir[i])) * 16777619
	}
	return filepath.Join("/run/dsec", fmt.Sprintf("%08x", h))
}

// removeEmptyRunDir removes the run directory if nothing is left in it
// (live sandboxes keep their state there across a restart): each of its
// subdirectories the drivers made, if empty, then the directory. It does
// not descend further (a subdirectory's entries may be live sandboxes'
// mounts).
func removeEmptyRunDir(runDir string) {
	// The container driver's files directory holds a tmpfs of this
	// process's mount namespace (sandboxes that outlive the process hold
	// their own bind mounts of what they use): detached, it is the empty
	// directory the host sees.
	syscall.Unmount(filepath.Join(runDir, "files"), syscall.MNT_DETACH)
	ents, _ := os.ReadDir(runDir)
	for _, e := range ents {
		if e.IsDir() {
			os.Remove(filepath.Join(runDir, e.Name()))
		}
	}
	os.Remove(runDir)
}

// findGuest locates the static dsec-guest binary.
func findGuest(p string) (string, error) {
	if p == "" {
		exe, err := os.Executable()
		if err != nil {
			return "", err
		}
		p = filepath.Join(filepath.Dir(exe), "dsec-guest")
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	f, err := elf.Open(abs)
	if err != nil {
		return "", fmt.Errorf("dsec-guest not found at %s (build it with `make build` or pass --guest-binary): %w", abs, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return "", fmt.Errorf("%s is dynamically linked; build it with CGO_ENABLED=0", abs)
		}
	}
	return abs, nil
}
