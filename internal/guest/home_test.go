package guest_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/guest"
)

// TestProcessesGetTheirUsersHome starts the agent as the runtimes do (as
// root with HOME=/root): each process gets its own user's home as HOME,
// unless the call sets one.
func TestProcessesGetTheirUsersHome(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runs processes as nobody)")
	}
	sock := filepath.Join(t.TempDir(), "g.sock")
	cmd := exec.Command(agentBin, "-listen", sock)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "FROM_IMAGE=1"}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	c := guest.NewClient(guest.UnixDialer(sock))
	t.Cleanup(c.Close)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Hello(ctx)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer: %v", err)
		}
	}
	tests := []struct {
		name, user string
		env        []string
		want       string
	}{
		{name: "root's processes get root's home", user: "", want: "/root 1\n"},
		{name: "another user's processes get that user's home", user: "nobody", want: "/nonexistent 1\n"},
		{name: "a user given by uid gets that user's home", user: "65534", want: "/nonexistent 1\n"},
		{name: "a HOME the call sets wins", user: "nobody", env: []string{"HOME=/tmp"}, want: "/tmp 1\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			exit := run(t, c, &guestv1.Exec{Argv: []string{"sh", "-c", `echo "$HOME $FROM_IMAGE"`}, User: tt.user, Env: tt.env, Cwd: "/"})
			if got := string(exit.Stdout); got != tt.want {
				t.Fatalf("HOME and the agent's own variable: %q, want %q (stderr %q)", got, tt.want, exit.Stderr)
			}
		})
	}
}
