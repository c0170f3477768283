package node

import (
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
)

// on_timeout "pause": a sandbox that reaches its TTL or idle TTL pauses
// instead of ending, and a call resumes it.

func TestOnTimeoutPause(t *testing.T) {
	t.Parallel()
	// The reaper runs at chosen times (tn.reap); the agent's own deadline
	// comes 1 s after the TTL, so a sandbox kept paused past it shows
	// whether its agent would end it on resume.
	tn := newTestNode(t, func(c *Config, _ *substratetest.Fake) {
		c.ReapInterval, c.PausedTTL, c.deadlineGrace = time.Hour, 10*time.Minute, time.Second
	})
	pausing := &dsecv1.SandboxSpec{TtlS: 2, OnTimeout: OnTimeoutPause}

	sb := tn.create(bg, pausing)
	t.Run("a sandbox past its TTL pauses and is kept for paused_ttl", func(t *testing.T) {
		tn.sh(bg, sb.Id, "echo kept > /tmp/f")
		at := time.Now().Add(3 * time.Second)
		tn.reap(at)
		got, err := tn.Get(bg, sb.Id)
		if err != nil || got.State != "paused" {
			t.Fatalf("after the TTL: %v %v", got, err)
		}
		if want := at.Add(10 * time.Minute); !got.ExpiresAt.AsTime().Equal(want) {
			t.Fatalf("expires at %v, want the paused_ttl's end %v", got.ExpiresAt.AsTime(), want)
		}
		if !strings.Contains(got.Reason, "on_timeout pause") {
			t.Fatalf("reason %q", got.Reason)
		}
		tn.reap(at.Add(time.Minute))
		if st, why := tn.state(sb.Id); st != "paused" {
			t.Fatalf("within its paused_ttl: %s (%s)", st, why)
		}
	})
	t.Run("a call resumes it with its state and a fresh TTL, after its agent's deadline", func(t *testing.T) {
		// Past the original TTL plus the agent's grace: an agent that kept
		// its deadline would end the sandbox as it resumes.
		time.Sleep(time.Until(sb.CreatedAt.AsTime().Add(3500 * time.Millisecond)))
		if out := tn.sh(bg, sb.Id, "cat /tmp/f"); out != "kept\n" {
			t.Fatalf("after the resume: %q", out)
		}
		now, err := tn.Get(bg, sb.Id)
		if err != nil || now.State != "running" || now.Reason != "" {
			t.Fatalf("after a call: %v %v", now, err)
		}
		if left := time.Until(now.ExpiresAt.AsTime()); left <= 0 || left > 2*time.Second {
			t.Fatalf("the resumed sandbox ends in %v, want its TTL of 2 s", left)
		}
		time.Sleep(1500 * time.Millisecond) // the old deadline, had it stayed, has passed
		if out := tn.sh(bg, sb.Id, "echo alive"); out != "alive\n" {
			t.Fatalf("later: %q", out)
		}
	})

	t.Run("a sandbox kept past its paused_ttl is deleted as gone", func(t *testing.T) {
		sb := tn.create(bg, pausing)
		at := time.Now().Add(3 * time.Second)
		tn.reap(at)
		tn.reap(at.Add(10*time.Minute + time.Second))
		if st, why := tn.state(sb.Id); st != "failed" || why != "paused ttl expired" {
			t.Fatalf("state %s (%s)", st, why)
		}
		if _, err := tn.Exec(bg, &dsecv1.ExecRequest{SandboxId: sb.Id, Cmd: "true"}); !errdefs.Is(err, errdefs.KindGone) {
			t.Fatalf("exec after the paused_ttl: %v", err)
		}
	})

	t.Run("a sandbox its user paused reaches its TTL paused and is kept the same way", func(t *testing.T) {
		sb := tn.create(bg, pausing)
		if _, err := tn.Pause(bg, sb.Id); err != nil {
			t.Fatal(err)
		}
		tn.reap(time.Now().Add(3 * time.Second))
		got, _ := tn.Get(bg, sb.Id)
		if got.State != "paused" || time.Until(got.ExpiresAt.AsTime()) < 9*time.Minute {
			t.Fatalf("after the TTL: %s until %v", got.State, got.ExpiresAt.AsTime())
		}
		if v, err := tn.Resume(bg, sb.Id); err != nil || v.State != "running" || time.Until(v.ExpiresAt.AsTime()) > 2*time.Second {
			t.Fatalf("resume: %v %v", v, err)
		}
	})

	t.Run("a sandbox idle past its idle TTL pauses and keeps its absolute expiry", func(t *testing.T) {
		sb := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 600, IdleTtlS: 1, OnTimeout: OnTimeoutPause})
		tn.reap(time.Now().Add(2 * time.Second))
		got, _ := tn.Get(bg, sb.Id)
		if got.State != "paused" || got.Reason != "" || !got.ExpiresAt.AsTime().Equal(sb.ExpiresAt.AsTime()) {
			t.Fatalf("after the idle TTL: %v", got)
		}
		if out := tn.sh(bg, sb.Id, "echo back"); out != "back\n" {
			t.Fatalf("after the resume: %q", out)
		}
		tn.reap(time.Now().Add(500 * time.Millisecond))
		if st, _ := tn.state(sb.Id); st != "running" {
			t.Fatalf("a call restarts the idle timer, but the sandbox is %s", st)
		}
	})

	t.Run("a session's delete still ends a sandbox paused at its TTL", func(t *testing.T) {
		sb := tn.create(bg, &dsecv1.SandboxSpec{TtlS: 2, OnTimeout: OnTimeoutPause, Labels: map[string]string{"job": "ended-by-session"}})
		tn.reap(time.Now().Add(3 * time.Second))
		// A session's expiry (on_expire delete) and its close delete by
		// its label (internal/session).
		resp, err := tn.Bulk(bg, "delete", "job=ended-by-session", "session_expired")
		if err != nil || len(resp.Ids) != 1 {
			t.Fatalf("bulk delete: %v %v", resp, err)
		}
		if st, _ := tn.state(sb.Id); st != "deleted" {
			t.Fatalf("state %s", st)
		}
		// The expiry's delete says so in the sandbox's end.
		if got, err := tn.Get(bg, sb.Id); err != nil || got.GetEndCause() != "session_expired" || got.GetInfra() {
			t.Fatalf("get after the session's delete: %v (%v); want end cause session_expired, not infra", got, err)
		}
		if _, err := tn.Bulk(bg, "delete", "job=ended-by-session", "made_up"); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("a made-up end cause: %v, want invalid", err)
		}
	})

	t.Run("the pause and its mark survive a node restart", func(t *testing.T) {
		sb := tn.create(bg, pausing)
		at := time.Now().Add(3 * time.Second)
		tn.reap(at)
		tn.restart(nil)
		got, err := tn.Get(bg, sb.Id)
		if err != nil || got.State != "paused" || got.Reason == "" || !got.ExpiresAt.AsTime().Equal(at.Add(10*time.Minute)) {
			t.Fatalf("after a restart: %v %v", got, err)
		}
		tn.reap(at.Add(10*time.Minute + time.Second))
		if st, why := tn.state(sb.Id); st != "failed" || why != "paused ttl expired" {
			t.Fatalf("state %s (%s)", st, why)
		}
	})
}

func TestOnTimeoutIsValidated(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, func(_ *Config, f *substratetest.Fake) {
		f.Runtimes = []substrate.Runtime{{Name: "nopause", Available: true, Caps: []substrate.Capability{substrate.CapExec, substrate.CapFiles}}}
	})
	tests := []struct {
		name string
		spec *dsecv1.SandboxSpec
		want string
	}{
		{"an unknown policy is refused", &dsecv1.SandboxSpec{Image: "busybox", OnTimeout: "hibernate"}, "on_timeout"},
		{"a runtime that cannot pause refuses the pause policy", &dsecv1.SandboxSpec{Image: "busybox", Runtime: "nopause", OnTimeout: OnTimeoutPause}, "cannot pause"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: tt.spec})
			if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("create: %v", err)
			}
		})
	}
	t.Run("delete is the default's explicit name", func(t *testing.T) {
		if sb := tn.create(bg, &dsecv1.SandboxSpec{OnTimeout: OnTimeoutDelete}); sb.Spec.OnTimeout != OnTimeoutDelete {
			t.Fatalf("spec %v", sb.Spec)
		}
	})
}
