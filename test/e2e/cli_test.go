package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
)

// TestExecAsAnotherUserFromTheCLI: in a sandbox whose user is nobody,
// `dsec exec -u root` runs as root wherever the flag is written, and a
// command that cannot start says why.
func TestExecAsAnotherUserFromTheCLI(t *testing.T) {
	srv := dsectest.Start(shared, dsectest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, errOut, code := srv.CLI(ctx, "", "create", "--image", "busybox", "--user", "nobody", "--ttl", "10m")
	if code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	id := strings.TrimSpace(out)
	defer srv.CLI(context.Background(), "", "rm", id)
	cases := []struct {
		name   string
		args   []string
		code   int
		stdout string
		stderr string
	}{
		{"the default user is the sandbox's", []string{"exec", id, "id", "-u"}, 0, "65534\n", ""},
		{"-u root before the ID runs as root", []string{"exec", "-u", "root", id, "id", "-u"}, 0, "0\n", ""},
		{"-u 0 before the ID runs as root", []string{"exec", "-u", "0", id, "id", "-u"}, 0, "0\n", ""},
		{"-u root after the ID runs as root", []string{"exec", id, "-u", "root", "id", "-u"}, 0, "0\n", ""},
		{"-u root after the ID and before -- runs as root", []string{"exec", id, "-u", "0", "--", "id", "-u"}, 0, "0\n", ""},
		{"the command's own flags stay the command's", []string{"exec", id, "ls", "-d", "/"}, 0, "/\n", ""},
		{"a command that cannot start says why", []string{"exec", id, "no-such-command"}, 127, "", "no-such-command: command not found"},
		{"after -- a dash starts the command", []string{"exec", id, "--", "-u"}, 127, "", "-u: command not found"},
		{"an unknown user says so", []string{"exec", "-u", "nosuchuser", id, "id"}, 127, "", `unknown user "nosuchuser"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, errOut, code := srv.CLI(ctx, "", tc.args...)
			if code != tc.code || out != tc.stdout || !strings.Contains(errOut, tc.stderr) {
				t.Fatalf("dsec %v: code %d stdout %q stderr %q; want %d %q and stderr with %q", tc.args, code, out, errOut, tc.code, tc.stdout, tc.stderr)
			}
		})
	}
}

// TestComposeFromTheCLI: `dsec create --compose` substitutes the file's
// variables from the shell, and exec, cp, ps and logs name a sidecar with
// -c (logs: its output, followed until it exits).
func TestComposeFromTheCLI(t *testing.T) {
	srv := dsectest.Start(shared, dsectest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t.Setenv("DSEC_TEST_GREETING", "from-the-shell")
	file := filepath.Join(t.TempDir(), "docker-compose.yaml")
	if err := os.WriteFile(file, []byte(`
services:
  main:
    image: busybox
  web:
    image: busybox
    command: sh -c 'mkdir -p /www && echo "$${MSG}" > /www/index.html && exec httpd -f -p 8080 -h /www'
    environment:
      MSG: ${DSEC_TEST_GREETING}
    healthcheck:
      test: ["CMD", "wget", "-qO-", "http://localhost:8080/"]
      start_interval: 100ms
  seed:
    image: busybox
    command: ["echo", "seeded ${DSEC_TEST_UNSET:-by default}"]
`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := srv.CLI(ctx, "", "create", "--compose", file, "--ttl", "10m")
	if code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	id := strings.TrimSpace(out)
	defer srv.CLI(context.Background(), "", "rm", id)
	for _, tc := range []struct {
		args           []string
		stdout, stderr string
	}{
		{[]string{"exec", id, "wget", "-qO-", "http://web:8080/"}, "from-the-shell\n", ""},
		{[]string{"exec", "-c", "web", id, "hostname"}, "web\n", ""},
		{[]string{"exec", id, "-c", "web", "cat", "/www/index.html"}, "from-the-shell\n", ""},
		{[]string{"cp", "-c", "web", id + ":/www/index.html", "-"}, "from-the-shell\n", ""},
		{[]string{"logs", id, "seed"}, "seeded by default\n", "exited with status 0"},
	} {
		out, errOut, code := srv.CLI(ctx, "", tc.args...)
		if code != 0 || out != tc.stdout || !strings.Contains(errOut, tc.stderr) {
			t.Fatalf("dsec %v: code %d stdout %q stderr %q", tc.args, code, out, errOut)
		}
	}
	if out, _, _ := srv.CLI(ctx, "", "ps", "-c", "web", id); !strings.Contains(out, "service") || !strings.Contains(out, "httpd") {
		t.Fatalf("dsec ps -c web: %s", out)
	}
	// A key dsec cannot honour is refused, naming it.
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("services:\n  main:\n    image: busybox\n    privileged: true\n"), 0o644)
	if _, errOut, code := srv.CLI(ctx, "", "create", "--compose", bad); code == 0 || !strings.Contains(errOut, "services.main.privileged") {
		t.Fatalf("a privileged service: code %d, %s", code, errOut)
	}
}
