package e2e

import (
	"context"
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
