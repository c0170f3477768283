package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// TestOnTimeoutPauseOnEveryKind: a sandbox created with `dsec create
// --on-timeout pause` pauses at its TTL (here one a keepalive set) on
// every kind that can pause,
// stays paused past the moment its agent would have ended it by itself
// (TTL + 1 min), and the next native call resumes it with its files and a
// fresh TTL.
func TestOnTimeoutPauseOnEveryKind(t *testing.T) {
	rows := []struct {
		kind, image string
		args        []string
		need        func(t *testing.T)
		images      []string
	}{
		{kind: "container", image: "busybox", need: func(t *testing.T) { dsectest.Need(t) }},
		{kind: "microvm", image: "busybox", args: []string{"--memory", "256M"}, need: func(t *testing.T) { dsectest.NeedMicroVM(t) }},
		{kind: "vm", image: "debian-vm", need: func(t *testing.T) { dsectest.NeedVM(t) }, images: []string{"busybox", "debian-vm"}},
	}
	for _, row := range rows {
		t.Run(row.kind, func(t *testing.T) {
			row.need(t)
			t.Parallel()
			srv := dsectest.Start(t, dsectest.Options{Images: row.images})
			c := srv.Client()
			ctx := ctxFor(t, 15*time.Minute)
			// The sandbox starts with a long TTL, and its short one is set
			// once it has its state: a machine kind can take longer than
			// the short TTL to boot on a loaded host without KVM, and a
			// TTL counts from the create.
			const specTTL = 10 * time.Minute
			const ttl = 20 * time.Second
			args := append([]string{"create", "--kind", row.kind, "--image", row.image, "--ttl", specTTL.String(), "--on-timeout", "pause"}, row.args...)
			out, errOut, code := srv.CLI(ctx, "", args...)
			if code != 0 {
				t.Fatalf("create: %d %s", code, errOut)
			}
			id := strings.TrimSpace(out)
			sb := c.Sandbox(id)
			t.Cleanup(func() { c.Delete(ctxFor(t, time.Minute), id) })
			if x, err := sb.Exec(ctx, dsec.Cmd("echo kept > /tmp/state")); err != nil || x.ExitCode != 0 {
				t.Fatalf("exec: %v %v", x, err)
			}
			if _, err := sb.Keepalive(ctx, ttl); err != nil {
				t.Fatalf("keepalive: %v", err)
			}
			armed := time.Now()
			info, err := c.Get(ctx, id)
			if err != nil || info.Spec.OnTimeout != "pause" {
				t.Fatalf("get: %v %v", info, err)
			}

			for info.GetState() != "paused" {
				if time.Since(armed) > ttl+time.Minute {
					t.Fatalf("the TTL did not pause the sandbox: %v", info)
				}
				time.Sleep(500 * time.Millisecond)
				if info, err = c.Get(ctx, id); err != nil {
					t.Fatal(err)
				}
			}
			if !strings.Contains(info.Reason, "on_timeout pause") || time.Until(info.ExpiresAt.AsTime()) < time.Hour {
				t.Fatalf("paused at its TTL: reason %q, kept until %v", info.Reason, info.ExpiresAt.AsTime())
			}
			// Past the agent's own deadline (TTL + 1 min), which a sandbox
			// paused at its TTL must not meet when it resumes.
			time.Sleep(time.Until(armed.Add(ttl + time.Minute + 5*time.Second)))
			if info, _ = c.Get(ctx, id); info.GetState() != "paused" {
				t.Fatalf("a sandbox paused at its TTL is %s (%s)", info.GetState(), info.GetReason())
			}
			x, err := sb.Exec(ctx, dsec.Cmd("cat /tmp/state"))
			if err != nil || string(x.Stdout) != "kept\n" {
				t.Fatalf("the call that resumes it: %v %v", x, err)
			}
			info, err = c.Get(ctx, id)
			if left := time.Until(info.GetExpiresAt().AsTime()); err != nil || info.State != "running" || left > specTTL || left < specTTL-time.Minute {
				t.Fatalf("after the resume: %v %v", info, err)
			}
			time.Sleep(2 * time.Second)
			if x, err := sb.Exec(ctx, dsec.Cmd("echo alive")); err != nil || string(x.Stdout) != "alive\n" {
				t.Fatalf("a moment later: %v %v", x, err)
			}
		})
	}
}
