// Package e2e drives a real `dsec serve` through its CLI, SDKs and wire
// protocols, the way users do.
package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
)

// TestQuickStart runs the README's quick start against a server with the
// bootstrapped debian image.
func TestQuickStart(t *testing.T) {
	if testing.Short() {
		t.Skip("bootstraps debian")
	}
	srv := dsectest.Start(t, dsectest.Options{Images: []string{"busybox", "debian"}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	run := func(stdin string, args ...string) (string, string, int) {
		t.Helper()
		return srv.CLI(ctx, stdin, args...)
	}

	out, errOut, code := run("", "create", "--kind", "container", "--image", "debian", "--cpu", "1", "--memory", "512M", "--ttl", "10m", "--label", "job=demo")
	if code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	id := strings.TrimSpace(out)
	if !strings.HasSuffix(id, "-local") {
		t.Fatalf("create printed %q, want a sandbox ID", out)
	}

	t.Run("exec streams output and exits with the command's code", func(t *testing.T) {
		out, _, code := run("", "exec", id, "--", "python3", "-c", "print(6*7)")
		if code != 0 || out != "42\n" {
			t.Fatalf("got %q code %d", out, code)
		}
		_, _, code = run("", "exec", id, "--", "python3", "-c", "import sys; sys.exit(4)")
		if code != 4 {
			t.Fatalf("exit code %d, want 4", code)
		}
	})
	t.Run("exec -i passes stdin", func(t *testing.T) {
		out, _, code := run("hi\n", "exec", "-i", id, "--", "cat")
		if code != 0 || out != "hi\n" {
			t.Fatalf("got %q code %d", out, code)
		}
	})
	t.Run("cp copies in and out", func(t *testing.T) {
		dir := t.TempDir()
		local := filepath.Join(dir, "local.txt")
		os.WriteFile(local, []byte("round trip\n"), 0o644)
		if _, e, code := run("", "cp", local, id+":/work/a.txt"); code != 0 {
			t.Fatalf("cp in: %s", e)
		}
		back := filepath.Join(dir, "back.txt")
		if _, e, code := run("", "cp", id+":/work/a.txt", back); code != 0 {
			t.Fatalf("cp out: %s", e)
		}
		if b, _ := os.ReadFile(back); string(b) != "round trip\n" {
			t.Fatalf("copied back %q", b)
		}
	})
	t.Run("ls selects by label", func(t *testing.T) {
		out, _, _ := run("", "ls", "--label", "job=demo")
		if !strings.Contains(out, id) {
			t.Fatalf("ls --label job=demo:\n%s", out)
		}
		out, _, _ = run("", "ls", "--label", "job=other")
		if strings.Contains(out, id) {
			t.Fatalf("ls --label job=other lists it:\n%s", out)
		}
	})
	t.Run("get -o json shows the sandbox and its node", func(t *testing.T) {
		out, _, code := run("", "get", id, "-o", "json")
		var v struct {
			ID    string `json:"id"`
			Node  string `json:"node"`
			State string `json:"state"`
			Spec  struct {
				Image  string            `json:"image"`
				Labels map[string]string `json:"labels"`
			} `json:"spec"`
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil || code != 0 {
			t.Fatalf("get -o json: %v\n%s", err, out)
		}
		if v.ID != id || v.Node != "local" || v.State != "running" || v.Spec.Image != "debian" || v.Spec.Labels["job"] != "demo" {
			t.Fatalf("get: %+v", v)
		}
	})
	t.Run("every verb has -o json", func(t *testing.T) {
		for _, args := range [][]string{{"ls"}, {"image", "ls"}, {"info"}, {"ps", id}, {"keepalive", id}} {
			out, e, code := run("", append(args, "-o", "json")...)
			if code != 0 || !json.Valid([]byte(out)) {
				t.Errorf("%v -o json: code %d, %q %s", args, code, out, e)
			}
		}
	})
	t.Run("rm deletes, and deleting again succeeds", func(t *testing.T) {
		if _, e, code := run("", "rm", id); code != 0 {
			t.Fatalf("rm: %s", e)
		}
		if _, e, code := run("", "rm", id); code != 0 {
			t.Fatalf("second rm: %s", e)
		}
		out, _, _ := run("", "get", id, "-o", "json")
		if !strings.Contains(out, `"deleted"`) {
			t.Fatalf("get after rm: %s", out)
		}
		_, e, code := run("", "exec", id, "--", "true")
		if code == 0 || !strings.Contains(e, "deleted") {
			t.Fatalf("exec after rm: code %d %s", code, e)
		}
	})
}
