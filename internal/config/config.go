// Package config is the server configuration of `dsec serve`, `dsec api`
// and `dsec node`: one struct whose zero value is a working
// single-host default, loaded from a YAML file, then environment variables,
// then flags, in that order of precedence (flags win).
package config

import (
	"fmt"
	"os"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// Config is the whole server configuration. Every field's default is the
// value used when it is left zero.
type Config struct {
	// Listen is the API address (default 127.0.0.1:7070). A non-loopback
	// address requires APIKeys.
	Listen string `json:"listen,omitempty"`
	// DataDir holds all state: the node store, images, sandboxes
	// (default ./.dsec).
	DataDir string `json:"data_dir,omitempty"`
	// CacheDir keeps bootstrapped root filesystems (default DataDir/cache).
	CacheDir string `json:"cache_dir,omitempty"`
	// ImageLayers is how the image store keeps file system layers: erofs
	// (one read-only EROFS image per layer, mounted from its file), dir
	// (unpacked directories), or auto: erofs where the host can (default).
	// Layers already stored either way keep working under both.
	ImageLayers string `json:"image_layers,omitempty"`
	// ImageCacheMB is the byte budget, in MiB, of the cache of chunks of
	// layers loaded on demand (default: a quarter of the file system
	// DataDir is on). Past it the least recently read chunks go, never a
	// running sandbox's layer's.
	ImageCacheMB int64 `json:"image_cache_mb,omitempty"`
	// ImageStoreMB is the byte budget, in MiB, of the image store's layers
	// (default: half of the file system DataDir is on). Past it the least
	// recently used cached build steps and copies of other nodes' images
	// go; when only images users made remain, imports, builds and commits
	// are refused until some are removed.
	ImageStoreMB int64 `json:"image_store_mb,omitempty"`
	// APIKeys are accepted API keys, "KEY" (project "default") or
	// "PROJECT=KEY" (env DSEC_API_KEYS, comma-separated). A key reaches only
	// its project's sandboxes, snapshots, sessions, images and logs. Empty
	// (and no AdminKeys): no authentication, loopback only.
	APIKeys []string `json:"api_keys,omitempty"`
	// AdminKeys are operators' keys, which reach every project's objects
	// and make shared images (env DSEC_ADMIN_KEYS, comma-separated;
	// default none).
	AdminKeys []string `json:"admin_keys,omitempty"`
	// GuestBinary is the static dsec-guest binary (default: dsec-guest next
	// to the dsec binary, env DSEC_GUEST_BINARY).
	GuestBinary string `json:"guest_binary,omitempty"`
	// Bootstrap lists base images built at start if missing ("busybox",
	// "debian"); empty builds none.
	Bootstrap []string `json:"bootstrap,omitempty"`
	// DebugListen serves Go profiling on a loopback address (default off).
	DebugListen string `json:"debug_listen,omitempty"`
	// MetricsListen also serves /metrics here, without authentication, for
	// a Prometheus on the operators' network (default off: /metrics is on
	// the API listener, for admin keys).
	MetricsListen string `json:"metrics_listen,omitempty"`
	// NoMetrics turns metrics off: nothing is counted and /metrics is not
	// served (for measuring what they cost).
	NoMetrics bool `json:"no_metrics,omitempty"`
	// LogLevel is debug, info (default), warn or error.
	LogLevel string `json:"log_level,omitempty"`

	Node      Node      `json:"node,omitempty"`
	Cluster   Cluster   `json:"cluster,omitempty"`
	Function  Function  `json:"function,omitempty"`
	Network   Network   `json:"network,omitempty"`
	Container Container `json:"container,omitempty"`
	MicroVM   MicroVM   `json:"microvm,omitempty"`
	VM        VM        `json:"vm,omitempty"`
	E2B       E2B       `json:"e2b,omitempty"`
}

// Webhook is a URL that receives the node's sandbox lifecycle events,
// each a signed POST (docs/observability.md).
type Webhook struct {
	URL string `json:"url"`
	// SecretFile holds the key deliveries are signed with (required).
	SecretFile string `json:"secret_file"`
	// LabelSelector and Types choose the events (default: all).
	LabelSelector string   `json:"label_selector,omitempty"`
	Types         []string `json:"types,omitempty"`
}

// Node configures the node agent.
type Node struct {
	// Name is the node's name in sandbox IDs (default "local").
	Name string `json:"name,omitempty"`
	// Webhooks receive the node's lifecycle events.
	Webhooks []Webhook `json:"webhooks,omitempty"`
	// SampleEvery is how often each sandbox's use is sampled into its
	// history (default 5s; a negative duration turns sampling off).
	SampleEvery Duration `json:"sample_every,omitempty"`
	// LogSyncWindow is how long an answered call's trajectory entry may
	// wait for its fsync (default 10ms; negative: synced before each
	// answer). Written before the answer either way: a kill of the node
	// loses none; a crash of the host, at most the last window's.
	LogSyncWindow Duration `json:"log_sync_window,omitempty"`
	// MaxSandboxes is the node's admission limit (default 4096).
	MaxSandboxes int `json:"max_sandboxes,omitempty"`
	// DefaultTTL and MaxTTL bound sandbox lifetimes (default 1h and 168h).
	DefaultTTL Duration `json:"default_ttl,omitempty"`
	MaxTTL     Duration `json:"max_ttl,omitempty"`
	// PausedTTL is how long a sandbox that paused at its TTL (on_timeout
	// "pause") stays paused before it is deleted (default 24h, at most
	// MaxTTL).
	PausedTTL Duration `json:"paused_ttl,omitempty"`
	// DefaultCPU (1) and DefaultMemoryMB (512) apply when a create omits them.
	DefaultCPU      float64 `json:"default_cpu,omitempty"`
	DefaultMemoryMB int64   `json:"default_memory_mb,omitempty"`
	// DefaultExecTimeout applies to exec calls without one (default 10m).
	DefaultExecTimeout Duration `json:"default_exec_timeout,omitempty"`
	// MaxConcurrentStarts bounds starts in flight (default 2 per core);
	// StartQueue bounds creates waiting for one (default 1024).
	MaxConcurrentStarts int `json:"max_concurrent_starts,omitempty"`
	StartQueue          int `json:"start_queue,omitempty"`
	// Pools are warm pools of started sandboxes (default none).
	Pools []Pool `json:"pools,omitempty"`
	// KeepKernelLimits leaves the host's kernel limits as they are
	// (default false: at start the node raises those below what a node
	// packed with sandboxes needs — kernel.pid_max, inotify instances and
	// watches, nf_conntrack_max, ... — and logs each change).
	KeepKernelLimits bool `json:"keep_kernel_limits,omitempty"`
	// DefaultVolumeMB sizes a volume whose create gives no size (default
	// 1024); MaxVolumeMB bounds a volume's size (default 102400).
	DefaultVolumeMB int64 `json:"default_volume_mb,omitempty"`
	MaxVolumeMB     int64 `json:"max_volume_mb,omitempty"`
}

// Cluster configures cluster mode (`dsec api` and `dsec node`); `dsec
// serve` ignores it.
type Cluster struct {
	// Etcd lists the etcd client URLs (env DSEC_ETCD, comma-separated);
	// required in cluster mode.
	Etcd []string `json:"etcd,omitempty"`
	// Prefix is the cluster's etcd key prefix (default "/dsec/").
	Prefix string `json:"prefix,omitempty"`
	// Token authenticates apiservers to nodes (env DSEC_CLUSTER_TOKEN).
	// Required unless the node listens on loopback only.
	Token string `json:"token,omitempty"`
	// Advertise is the host:port apiservers reach a node at (default: its
	// listen address, which must then name a host).
	Advertise string `json:"advertise,omitempty"`
	// Labels are a node's labels, matched by a create's node_selector
	// (default none).
	Labels map[string]string `json:"labels,omitempty"`
	// NodeTTL is a node's membership lease: a node silent this long is
	// lost (default 10s).
	NodeTTL Duration `json:"node_ttl,omitempty"`
	// LoadInterval is the least time between a node's load publications
	// (default 1s).
	LoadInterval Duration `json:"load_interval,omitempty"`
	// Choices is how many fitting nodes placement samples (default 2);
	// Attempts how many nodes a sandbox is tried on (default 3).
	Choices  int `json:"choices,omitempty"`
	Attempts int `json:"attempts,omitempty"`
}

// Pool is a warm pool: Size started sandboxes of one shape. Zero resources
// take the node's defaults, as a create would.
type Pool struct {
	Kind     string  `json:"kind,omitempty"`
	Image    string  `json:"image"`
	CPU      float64 `json:"cpu,omitempty"`
	MemoryMB int64   `json:"memory_mb,omitempty"`
	Pids     int64   `json:"pids,omitempty"`
	Network  string  `json:"network,omitempty"`
	// Runtime is another runtime of the kind ("gvisor"; default: the
	// kind's own).
	Runtime string `json:"runtime,omitempty"`
	Size    int    `json:"size"`
}

// Function configures function calls (kind "function", RunCode, /run_code).
type Function struct {
	// Image is the worker image (default "debian").
	Image string `json:"image,omitempty"`
	// Slots is how many calls one worker runs at once (default 4 per core).
	Slots int `json:"slots,omitempty"`
	// MaxWorkers bounds each image's worker pool (default 4).
	MaxWorkers int `json:"max_workers,omitempty"`
	// WorkerMemoryMB sizes each worker (default 4096).
	WorkerMemoryMB int64 `json:"worker_memory_mb,omitempty"`
	// CallDiskMB bounds one call's storage: its directory, /tmp, /var/tmp
	// and /dev/shm together, memory of its worker's (default 512).
	CallDiskMB int64 `json:"call_disk_mb,omitempty"`
}

// Network configures sandbox networking.
type Network struct {
	// Bridge is the egress bridge (default dsec0).
	Bridge string `json:"bridge,omitempty"`
	// Subnet holds egress sandbox addresses (default 10.88.0.0/16).
	Subnet string `json:"subnet,omitempty"`
	// DNS are the resolvers egress sandboxes use, and the upstream of the
	// node's resolver for sandboxes under a policy (flag --dns; default:
	// the host's).
	DNS []string `json:"dns,omitempty"`
	// Table names the nftables tables, one inet and one bridge (default
	// "dsec").
	Table string `json:"table,omitempty"`
	// TrustedCAs is a PEM file of the CAs the egress proxy trusts when it
	// sends brokered requests on over TLS (flag --egress-ca; default: the
	// host's).
	TrustedCAs string `json:"trusted_cas,omitempty"`
	// Credentials are brokered credentials that a sandbox's network
	// policy names (BrokeredCredential.name): the egress proxy injects the
	// header into the sandbox's requests to the host, and the secret
	// never enters a sandbox (default none).
	Credentials []Credential `json:"credentials,omitempty"`
}

// Credential is a brokered credential held by the server.
type Credential struct {
	// Name is what a policy calls it (required, unique).
	Name string `json:"name"`
	// Host is the host name whose requests carry it (required).
	Host string `json:"host"`
	// Header is the request header set (default Authorization).
	Header string `json:"header,omitempty"`
	// Value is the header's value, the secret (required).
	Value string `json:"value"`
	// Projects may use it (default: every project).
	Projects []string `json:"projects,omitempty"`
}

// Container configures the container substrate.
type Container struct {
	// Runtime is crun, runc or a path (default: crun, else runc).
	Runtime string `json:"runtime,omitempty"`
	// CgroupParent is the cgroup for sandboxes: containers, and each
	// microVM's and VM's QEMU (default /dsec).
	CgroupParent string `json:"cgroup_parent,omitempty"`
	// HostRoot runs container and function sandboxes without a user
	// namespace, root inside being the host's root (flag --host-root;
	// default false: each sandbox maps its ids to an unprivileged host id
	// range of its own). Only for workloads that cannot run otherwise.
	HostRoot bool `json:"host_root,omitempty"`
	// DefaultDiskMB is a sandbox's disk when its spec sets no disk_mb
	// (default 10240); MaxDiskMB the most a spec may ask (default 102400).
	DefaultDiskMB int64 `json:"default_disk_mb,omitempty"`
	MaxDiskMB     int64 `json:"max_disk_mb,omitempty"`
	// NoDiskLimits keeps sandboxes' writable layers in the data directory
	// without limits (default false).
	NoDiskLimits bool `json:"no_disk_limits,omitempty"`
	// GVisor is the runsc binary of runtime gvisor (default: runsc on
	// PATH, offered if it starts a sandbox here); "off" offers no gVisor.
	GVisor string `json:"gvisor,omitempty"`
	// GVisorPlatform is runsc's platform: ptrace (default) or kvm.
	GVisorPlatform string `json:"gvisor_platform,omitempty"`
}

// MicroVM configures the microvm substrate.
type MicroVM struct {
	// Accel is auto (default: KVM if a probe guest boots under it in time,
	// else TCG), kvm or tcg.
	Accel string `json:"accel,omitempty"`
	// KernelDir holds the guest kernel scripts/setup.sh prepares (default
	// CACHE_DIR/guest-kernel).
	KernelDir string `json:"kernel_dir,omitempty"`
	// BootTimeout bounds a boot or restore until the agent answers
	// (default 90s).
	BootTimeout Duration `json:"boot_timeout,omitempty"`
	// TBSizeMiB is the TCG translation buffer per VM (default 128).
	TBSizeMiB int `json:"tb_size_mib,omitempty"`
	// DefaultDiskMB sizes the writable disk when a create gives no
	// disk_mb (default 1024).
	DefaultDiskMB int64 `json:"default_disk_mb,omitempty"`
	// ColdBoot boots every sandbox instead of restoring its image's boot
	// snapshot for its machine shape (default false).
	ColdBoot bool `json:"cold_boot,omitempty"`
}

// VM configures the vm substrate (full VMs, docs/substrates/vm.md).
type VM struct {
	// Accel is auto (default: KVM if a probe guest boots under it in time,
	// else TCG; the probe is shared with microvm), kvm or tcg.
	Accel string `json:"accel,omitempty"`
	// Boot is auto (default: the image's own kernel when it has one, else
	// the firmware and the disk's bootloader), firmware or direct.
	Boot string `json:"boot,omitempty"`
	// ColdBoot boots every sandbox instead of restoring its image's boot
	// snapshot (default false).
	ColdBoot bool `json:"cold_boot,omitempty"`
	// BootTimeout bounds a boot or restore until the agent answers
	// (default 3m).
	BootTimeout Duration `json:"boot_timeout,omitempty"`
	// TBSizeMiB is the TCG translation buffer per VM (default 256).
	TBSizeMiB int `json:"tb_size_mib,omitempty"`
	// VNC gives every VM a VNC server on 127.0.0.1, locked until `dsec vnc`
	// (OpenVNC) sets a password (default false).
	VNC bool `json:"vnc,omitempty"`
}

// E2B configures the E2B-compatible facade (docs/e2b.md).
type E2B struct {
	// Domain is the sandbox domain returned to E2B SDKs; with it, SDKs reach
	// sandboxes (envd, unless they set E2B_SANDBOX_URL, and the servers
	// users start in them) at https://<port>-<sandbox id>.<domain>, through
	// TLSListen or a TLS proxy in front of dsec. It may end in :<port>
	// (default "": clients set E2B_SANDBOX_URL; user ports by header or
	// path only).
	Domain string `json:"domain,omitempty"`
	// TLSListen is an address where dsec also serves its API, the E2B
	// facade and sandbox ports over TLS, for the sandbox domain (default
	// "": none).
	TLSListen string `json:"tls_listen,omitempty"`
	// TLSCertFile and TLSKeyFile are TLSListen's certificate, which should
	// cover <domain> and *.<domain> (default: one issued at start by a CA
	// dsec keeps in DataDir/e2b-ca.pem, created on first use: clients that
	// are to trust it add that file to their roots).
	TLSCertFile string `json:"tls_cert_file,omitempty"`
	TLSKeyFile  string `json:"tls_key_file,omitempty"`
	// Templates maps E2B template IDs to dsec images and kinds (default:
	// "base" and "code-interpreter-v1" start the base image as
	// containers, and the debian-vm image as kind vm). An unlisted template
	// ID names an image; "<kind>/<id>" selects the kind (e.g.
	// "microvm/base").
	Templates map[string]E2BTemplate `json:"templates,omitempty"`
	// DefaultKind is the kind of templates that name none (default
	// "container").
	DefaultKind string `json:"default_kind,omitempty"`
	// DefaultNetwork is the network of sandboxes created without
	// allowInternetAccess: "none" (default) or "egress" (what E2B does).
	DefaultNetwork string `json:"default_network,omitempty"`
	// TokenSecretFile holds the key of envd access tokens (default
	// DataDir/e2b-token.key, created when missing). Every apiserver replica
	// needs the same one.
	TokenSecretFile string `json:"token_secret_file,omitempty"`
}

// E2BTemplate is what one E2B template ID starts.
type E2BTemplate struct {
	// Image is the dsec image (required).
	Image string `json:"image"`
	// Kind is the substrate (default: E2B.DefaultKind).
	Kind string `json:"kind,omitempty"`
	// KindImages are images used instead of Image for some kinds, e.g.
	// {vm: debian-vm} (default none).
	KindImages map[string]string `json:"kind_images,omitempty"`
	// CPU (cores) and MemoryMB size the sandbox (default: the node's).
	CPU      float64 `json:"cpu,omitempty"`
	MemoryMB int64   `json:"memory_mb,omitempty"`
}

// Duration is a time.Duration written as "10m" in files.
type Duration time.Duration

func (d *Duration) UnmarshalJSON(b []byte) error {
	s := strings.Trim(string(b), `"`)
	if s == "" || s == "null" {
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("duration %q: %w", s, err)
	}
	*d = Duration(v)
	return nil
}

func (d Duration) MarshalJSON() ([]byte, error) {
	return []byte(`"` + time.Duration(d).String() + `"`), nil
}

// Load reads a YAML file (if path is not empty) and then the environment.
// Flags are applied by the caller afterwards.
func Load(path string) (Config, error) {
	var c Config
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return c, fmt.Errorf("read config: %w", err)
		}
		if err := yaml.UnmarshalStrict(b, &c); err != nil {
			return c, fmt.Errorf("parse config %s: %w", path, err)
		}
	}
	if v := os.Getenv("DSEC_API_KEYS"); v != "" {
		c.APIKeys = splitList(v)
	}
	if v := os.Getenv("DSEC_ADMIN_KEYS"); v != "" {
		c.AdminKeys = splitList(v)
	}
	if v := os.Getenv("DSEC_DATA_DIR"); v != "" {
		c.DataDir = v
	}
	if v := os.Getenv("DSEC_CACHE_DIR"); v != "" {
		c.CacheDir = v
	}
	if v := os.Getenv("DSEC_GUEST_BINARY"); v != "" {
		c.GuestBinary = v
	}
	if v := os.Getenv("DSEC_LISTEN"); v != "" {
		c.Listen = v
	}
	if v := os.Getenv("DSEC_ETCD"); v != "" {
		c.Cluster.Etcd = splitList(v)
	}
	if v := os.Getenv("DSEC_CLUSTER_TOKEN"); v != "" {
		c.Cluster.Token = v
	}
	return c, nil
}

// splitList splits a comma-separated list, dropping empty entries.
func splitList(v string) []string {
	var out []string
	for _, e := range strings.Split(v, ",") {
		if e = strings.TrimSpace(e); e != "" {
			out = append(out, e)
		}
	}
	return out
}

// Defaults fills the defaults this package owns; components fill theirs.
func (c *Config) Defaults() {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:7070"
	}
	if c.DataDir == "" {
		c.DataDir = ".dsec"
	}
	if c.LogLevel == "" {
		c.LogLevel = "info"
	}
}
