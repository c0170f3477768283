package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestFilesystemPause: a container sandbox paused filesystem-only (the Go
// SDK's PauseFilesystem, and Bulk "pause_filesystem" for a preempted
// job's sandboxes) stops, stays stopped across a restart of its node, and
// the next call cold-boots it with its files, a new boot id, no process
// from before, and a "boot" entry in its trajectory log. A microVM
// refuses it (invalid_argument, naming its kind).
func TestFilesystemPause(t *testing.T) {
	dsectest.Need(t)
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	sh := func(sb *dsec.Sandbox, cmd string) string {
		t.Helper()
		x, err := sb.Exec(ctx, dsec.Cmd(cmd))
		if err != nil || x.ExitCode != 0 {
			t.Fatalf("%s: %v %v", cmd, x, err)
		}
		return string(x.Stdout)
	}
	sb := create(t, c, dsec.CreateOptions{Labels: map[string]string{"job": "fspause"}})
	sh(sb, "echo kept > /root/state")
	if _, err := sb.Start(ctx, dsec.Cmd("sleep 1000"), false); err != nil {
		t.Fatal(err)
	}
	if out := sh(sb, "sleep 0.5; cat /proc/[0-9]*/comm | grep -c -x sleep || true"); out != "1\n" {
		t.Fatalf("the background sleep: %q", out)
	}
	boot := sh(sb, "cat /proc/sys/kernel/random/boot_id")

	info, err := c.PauseFilesystem(ctx, sb.ID)
	if err != nil || info.State != "paused" {
		t.Fatalf("pause filesystem-only: %v %v", info, err)
	}
	srv.Restart()
	if info, err := c.Get(ctx, sb.ID); err != nil || info.State != "paused" {
		t.Fatalf("after the node's restart: %v %v", info, err)
	}
	if out := sh(sb, "cat /root/state; cat /proc/[0-9]*/comm | grep -c -x sleep || true"); out != "kept\n0\n" {
		t.Fatalf("after the cold boot: %q", out)
	}
	now := sh(sb, "cat /proc/sys/kernel/random/boot_id")
	if now == boot {
		t.Fatalf("the boot id stayed %q across the cold boot", boot)
	}
	log, err := c.Log(ctx, sb.ID, 0)
	if err != nil || len(log) == 0 {
		t.Fatalf("log: %v %v", log, err)
	}
	booted := false
	for _, e := range log {
		booted = booted || e.Op == "boot"
	}
	if !booted {
		t.Fatalf("the trajectory log does not record the cold boot: %v", log)
	}

	resp, err := c.Bulk(ctx, "pause_filesystem", "job=fspause")
	if err != nil || len(resp.Ids) != 1 || len(resp.Failures) != 0 {
		t.Fatalf("bulk filesystem-only pause: %v %v", resp, err)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if again := sh(sb, "cat /proc/sys/kernel/random/boot_id; cat /root/state"); again == now+"kept\n" || !strings.HasSuffix(again, "kept\n") {
		t.Fatalf("after the bulk pause and resume: %q (boot id was %q)", again, now)
	}
}
