package node

import (
	"os"
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// TestChangeMode: the file verb added to show the layers a verb touches
// (docs/ARCHITECTURE.md). That only the owner may is checked in a nobody
// sandbox, which the fake cannot run (test/hostile).
func TestChangeMode(t *testing.T) {
	t.Parallel()
	tn := newTestNode(t, nil)
	id := tn.create(bg, nil).Id
	if _, err := tn.WriteFile(bg, &dsecv1.WriteFileHeader{SandboxId: id, Path: "/tmp/run.sh", Mode: 0o644}, strings.NewReader("#!/bin/sh\necho ran\n")); err != nil {
		t.Fatal(err)
	}

	t.Run("sets the bits and answers the file's info", func(t *testing.T) {
		info, err := tn.ChangeMode(bg, &dsecv1.ChangeModeRequest{SandboxId: id, Path: "/tmp/run.sh", Mode: 0o750})
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode != 0o750 || info.Type != "file" {
			t.Fatalf("info %v, want a file of mode 0750", info)
		}
		if got := tn.sh(bg, id, "stat -c %a /tmp/run.sh && /tmp/run.sh"); got != "750\nran\n" {
			t.Fatalf("inside: %q", got)
		}
	})

	t.Run("bits beyond 07777 are invalid", func(t *testing.T) {
		_, err := tn.ChangeMode(bg, &dsecv1.ChangeModeRequest{SandboxId: id, Path: "/tmp/run.sh", Mode: 0o170755})
		if !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("got %v, want invalid", err)
		}
	})

	t.Run("a missing path is not found", func(t *testing.T) {
		_, err := tn.ChangeMode(bg, &dsecv1.ChangeModeRequest{SandboxId: id, Path: "/tmp/none", Mode: 0o600})
		if !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("got %v, want not found", err)
		}
	})

	t.Run("a link out of the sandbox changes the sandbox's file, not the host's", func(t *testing.T) {
		before, err := os.Stat("/etc/passwd")
		if err != nil {
			t.Fatal(err)
		}
		tn.sh(bg, id, "ln -s /../../../../../etc/passwd /tmp/up")
		if _, err := tn.ChangeMode(bg, &dsecv1.ChangeModeRequest{SandboxId: id, Path: "/tmp/up", Mode: 0o600}); err != nil {
			t.Fatal(err)
		}
		if got := tn.sh(bg, id, "stat -c %a /etc/passwd"); got != "600\n" {
			t.Fatalf("the sandbox's /etc/passwd is %q, want 600", got)
		}
		if after, _ := os.Stat("/etc/passwd"); after.Mode() != before.Mode() {
			t.Fatalf("the host's /etc/passwd went from %v to %v", before.Mode(), after.Mode())
		}
	})

	t.Run("it is logged and replayed like every change", func(t *testing.T) {
		log, err := tn.GetLog(bg, &dsecv1.GetLogRequest{SandboxId: id})
		if err != nil {
			t.Fatal(err)
		}
		var logged []*dsecv1.LogEntry
		for _, e := range log.Entries {
			if e.Op == "change_mode" && e.Error == nil {
				logged = append(logged, e)
			}
		}
		if len(logged) != 2 || logged[0].Path != "/tmp/run.sh" || logged[0].Mode != 0o750 {
			t.Fatalf("logged %v", logged)
		}
		r, err := tn.Replay(bg, &dsecv1.ReplayRequest{SandboxId: id, Keep: true})
		if err != nil {
			t.Fatal(err)
		}
		if r.Diverged != 0 {
			t.Fatalf("replay diverged: %v", r.Steps)
		}
		if got := tn.sh(bg, r.SandboxId, "stat -c %a /tmp/run.sh /etc/passwd"); got != "750\n600\n" {
			t.Fatalf("after the replay: %q", got)
		}
	})
}
