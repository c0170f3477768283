package node

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/image"
	"github.com/opendsec/dsec/internal/network"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
)

// The node's unit tests run it over substratetest.Fake, a driver that
// passes the conformance suite every real driver passes and needs no root,
// crun or QEMU: the sandboxes are the real agent in unprivileged
// namespaces, over the busybox image bootstrapped from the host's
// busybox-static.

// rootfsCache keeps the busybox root filesystem built once for every test's
// image store.
var rootfsCache string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "dsec-node-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	rootfsCache = filepath.Join(dir, "cache")
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// testNode is a node over its own data directory with the fake as its
// container driver and busybox as a shared image.
type testNode struct {
	*Node
	t      *testing.T
	fake   *substratetest.Fake
	cfg    Config
	images *image.Store
	net    *network.Manager
}

// newTestNode starts a node; mut adjusts its config (and may set the
// fake's BeforeCreate).
func newTestNode(t *testing.T, mut func(*Config, *substratetest.Fake)) *testNode {
	t.Helper()
	fake := substratetest.NewFake(substrate.KindContainer)
	if c := fake.Capabilities(); !c.Available {
		t.Skip(c.Reason)
	}
	dir := t.TempDir()
	images, err := image.Open(filepath.Join(dir, "images"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := images.Bootstrap(tenant.System(context.Background()), "busybox", "", image.BootstrapOptions{CacheDir: rootfsCache}, nil); err != nil {
		t.Skipf("needs Debian's busybox-static: %v", err)
	}
	nm, err := network.New(network.Config{NoEgress: true}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Name: "test", DataDir: filepath.Join(dir, "data"), ReapInterval: 20 * time.Millisecond, MaxCPU: 4, MaxMemoryMB: 4096}
	if mut != nil {
		mut(&cfg, fake)
	}
	tn := &testNode{t: t, fake: fake, cfg: cfg, images: images, net: nm}
	tn.open()
	return tn
}

func (tn *testNode) open() {
	tn.t.Helper()
	n, err := New(tn.cfg, slog.Default(), tn.images, tn.net, map[substrate.Kind]substrate.Driver{substrate.KindContainer: tn.fake})
	if err != nil {
		tn.t.Fatal(err)
	}
	tn.Node = n
	tn.t.Cleanup(func() {
		if tn.Node != n {
			return // closed by restart
		}
		ctx := tenant.System(context.Background())
		n.Bulk(ctx, "delete", "!nothing", "")
		n.Close()
	})
}

// restart closes the node (its sandboxes keep running) and opens a new one
// over the same data directory with a new fake driver, as after a node
// restart. between runs while no node is up.
func (tn *testNode) restart(between func()) {
	tn.t.Helper()
	old := tn.Node
	tn.Node = nil
	if err := old.Close(); err != nil {
		tn.t.Fatal(err)
	}
	if between != nil {
		between()
	}
	tn.fake = substratetest.NewFake(substrate.KindContainer)
	tn.open()
}

// as returns a context acting for project.
func as(project string) context.Context {
	return tenant.With(context.Background(), tenant.Caller{Project: project})
}

var bg = as(tenant.DefaultProject)

func (tn *testNode) create(ctx context.Context, spec *dsecv1.SandboxSpec) *dsecv1.Sandbox {
	tn.t.Helper()
	if spec == nil {
		spec = &dsecv1.SandboxSpec{}
	}
	if spec.Image == "" && spec.Snapshot == "" {
		spec.Image = "busybox"
	}
	sb, err := tn.Create(ctx, &dsecv1.CreateSandboxRequest{Spec: spec, Project: tenant.Project(ctx)})
	if err != nil {
		tn.t.Fatalf("create: %v", err)
	}
	return sb
}

// sh runs a shell command in a sandbox and returns its stdout.
func (tn *testNode) sh(ctx context.Context, id, cmd string) string {
	tn.t.Helper()
	r, err := tn.Exec(ctx, &dsecv1.ExecRequest{SandboxId: id, Cmd: cmd})
	if err != nil {
		tn.t.Fatalf("exec %q: %v", cmd, err)
	}
	if r.ExitCode != 0 {
		tn.t.Fatalf("exec %q: exit %d: %s", cmd, r.ExitCode, r.Stderr)
	}
	return string(r.Stdout)
}

func (tn *testNode) state(id string) (state, reason string) {
	tn.t.Helper()
	sb, err := tn.Get(tenant.System(context.Background()), id)
	if err != nil {
		tn.t.Fatalf("get %s: %v", id, err)
	}
	return sb.State, sb.Reason
}

// eventually polls cond until it holds or 30 seconds pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func readAll(t *testing.T, tn *testNode, ctx context.Context, id, path string) string {
	t.Helper()
	var b strings.Builder
	err := tn.ReadFile(ctx, &dsecv1.ReadFileRequest{SandboxId: id, Path: path}, func(r *dsecv1.ReadFileResponse) error {
		b.Write(r.GetData())
		return nil
	})
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return b.String()
}

func osReadDir(parts ...string) ([]os.DirEntry, error) { return os.ReadDir(filepath.Join(parts...)) }
