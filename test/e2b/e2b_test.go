// Package e2b_test drives dsec with the unmodified `e2b` and
// `@e2b/code-interpreter` npm packages, pinned in package-lock.json and
// installed with `npm ci`: the SDKs are the acceptance test, run for every
// sandbox kind the server reports available.
package e2b_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
)

// shared owns the server the tests use; it is closed after all tests.
var shared = dsectest.Program()

func TestMain(m *testing.M) {
	code := m.Run()
	shared.CloseWith(code)
	os.Exit(code)
}

var (
	srvOnce sync.Once
	srv     *dsectest.Server
	apiKey  string

	npmOnce sync.Once
	npmErr  error
)

// server starts (once) a dsec with the debian images (as layers, and as a
// VM image where the host can build one), the base image (the SDKs'
// default templates) and an API key in E2B's form.
func server(t *testing.T) *dsectest.Server {
	t.Helper()
	dsectest.Need(t)
	srvOnce.Do(func() {
		b := make([]byte, 20)
		rand.Read(b)
		apiKey = "e2b_" + hex.EncodeToString(b)
		images := []string{"busybox", "debian", "base"}
		if ok, _ := dsectest.VMReady(); ok {
			images = append(images, "debian-vm")
		}
		srv = dsectest.Start(shared, dsectest.Options{Images: images, APIKeys: []string{apiKey}, Args: domainArgs()})
	})
	if srv == nil {
		t.Fatal("the shared server did not start")
	}
	return srv
}

// needNode skips unless Node.js 20.18+ and npm are installed, and installs
// the pinned SDKs (once) from the committed lockfile.
func needNode(t *testing.T) {
	t.Helper()
	var why string
	var ok bool
	if nodeBin, nodeEnv, why, ok = dsectest.NodeJS(); !ok {
		t.Skip(why)
	}
	if _, err := exec.LookPath("npm"); err != nil {
		t.Skip("needs npm (scripts/setup.sh installs it)")
	}
	npmOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
		cmd.Dir, cmd.Env = testDir(), nodeEnv
		if out, err := cmd.CombinedOutput(); err != nil {
			npmErr = fmt.Errorf("npm ci (needs the npm registry): %v\n%s", err, out)
		}
	})
	if npmErr != nil {
		t.Fatal(npmErr)
	}
}

// nodeBin is the Node.js dsectest.NodeJS found; nodeEnv runs it and npm
// (it first on PATH).
var (
	nodeBin string
	nodeEnv []string
)

func testDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(file)
}

// scenario runs one scenario of scenarios.mjs against the server with
// template (and ciTemplate) as the sandbox templates.
func scenario(t *testing.T, s *dsectest.Server, name string, env ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, nodeBin, "scenarios.mjs", name)
	cmd.Dir = testDir()
	cmd.Env = append(append([]string(nil), nodeEnv...),
		"E2B_API_KEY="+apiKey, "E2B_API_URL="+s.URL, "E2B_SANDBOX_URL="+s.URL, "E2B_DEBUG=false",
	)
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("scenario %s: %v\n%s\nthe host when it failed:\n%s", name, err, out, s.Diagnose())
	}
	if !strings.HasSuffix(strings.TrimSpace(string(out)), "ok") {
		t.Fatalf("scenario %s did not finish:\n%s", name, out)
	}
}

// kinds lists the sandbox kinds the server can create, with their
// capabilities, except function (stateless calls: no files, processes or
// PTYs for the facade to serve).
func kinds(t *testing.T, s *dsectest.Server) map[string]map[string]bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	info, err := s.Client().Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]bool{}
	for _, n := range info.Nodes {
		for _, k := range n.Kinds {
			if k.Available && k.Kind != "function" {
				caps := map[string]bool{}
				for _, c := range k.Capabilities {
					caps[c] = true
				}
				out[k.Kind] = caps
			}
		}
	}
	if len(out) == 0 {
		t.Fatal("the server reports no sandbox kind available")
	}
	return out
}

// templates are the templates a kind's sandboxes are created from: the
// SDKs' defaults for the default kind, "<kind>/<template>" for others.
func templates(kind string) []string {
	if kind == "container" {
		return []string{"TEMPLATE=base", "CI_TEMPLATE=code-interpreter-v1"}
	}
	return []string{"TEMPLATE=" + kind + "/base", "CI_TEMPLATE=" + kind + "/code-interpreter-v1"}
}

func TestSDK(t *testing.T) {
	needNode(t)
	s := server(t)
	// needs names the capability (as KindInfo reports it) a scenario
	// depends on beyond exec and files. vm marks the scenarios full VMs
	// (TCG's costliest kind) run too: one for each path the vm driver
	// takes on its own (pause, fork, a PTY, the files of its disk, the
	// metrics of its guest; snapshots and ports in the other groups).
	// Every scenario runs on container and microvm: E2B's own sandboxes
	// are microVMs, and the microVM shares the guest agent and QEMU's code
	// with the full VM, whose driver internal/substrate/vm's conformance
	// suite covers besides.
	tests := []struct {
		scenario, name, needs string
		vm                    bool
	}{
		{"create", "create answers with a token and getInfo reports metadata and envVars", "", false},
		{"commands-run-streams", "commands.run streams stdout and stderr to the callbacks as they happen", "", false},
		{"commands-run-fails", "a failing command throws CommandExitError with its exit code and stderr", "", false},
		{"commands-run-timeout", "timeoutMs ends a command with TimeoutError and kills it", "", false},
		{"background-and-connect", "a background command outlives its client and connect reattaches", "", false},
		{"commands-stdin-and-kill", "stdin reaches a command and kill ends one", "", false},
		{"pty", "a PTY takes input, resizes and echoes", "pty", true},
		{"files", "files write, read, list, exist, rename and remove like envd", "", true},
		{"signed-urls", "signed upload and download URLs work and forged ones are refused", "", false},
		{"watch-dir", "watchDir reports changes under a directory", "", false},
		{"list-filters", "Sandbox.list filters by metadata and state and pages", "pause", false},
		{"set-timeout", "setTimeout moves the end of a sandbox, which then ends", "", false},
		{"pause-and-connect", "pause then connect resumes the sandbox with its state", "pause", true},
		{"kill-twice", "kill answers true then false, and the dead sandbox is reported as such", "", false},
		{"metrics", "getMetrics reports memory and CPU use", "", true},
		{"fork", "fork starts children with the parent's files", "fork", true},
		{"code-interpreter", "runCode keeps interpreter state per context", "", false},
		{"bad-input", "wrong keys, tokens, IDs and unsupported options raise the SDK's typed errors", "", false},
	}
	for kind, caps := range kinds(t, s) {
		t.Run(kind, func(t *testing.T) {
			t.Parallel() // kinds side by side: a machine kind waits on its guests
			if ok, why := dsectest.VMReady(); kind == "vm" && !ok {
				t.Skipf("the server has no VM image to start: %s", why)
			}
			for _, tt := range tests {
				if kind == "vm" && !tt.vm {
					continue
				}
				t.Run(tt.name, func(t *testing.T) {
					if tt.needs != "" && !caps[tt.needs] {
						t.Skipf("kind %s does not report the %q capability", kind, tt.needs)
					}
					scenario(t, s, tt.scenario, templates(kind)...)
				})
			}
		})
	}
}

func TestHundredConcurrentCreates(t *testing.T) {
	if testing.Short() {
		t.Skip("creates 100 sandboxes")
	}
	needNode(t)
	s := server(t)
	scenario(t, s, "concurrent-creates", "COUNT=100", "TEMPLATE=base")
}

// TestBaseTemplate checks E2B's base template (its user, home, HOME, sudo
// and tools) on every kind whose "base" is the base image: kind vm boots
// the debian-vm image, whose user is root.
func TestBaseTemplate(t *testing.T) {
	needNode(t)
	s := server(t)
	for kind := range kinds(t, s) {
		if kind == "vm" {
			continue
		}
		t.Run(kind, func(t *testing.T) {
			scenario(t, s, "base-template", templates(kind)...)
		})
	}
}
