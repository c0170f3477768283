package node

import (
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// commitWith commits a busybox sandbox after cmd as image name.
func (tn *testNode) commitWith(name, cmd string) {
	tn.t.Helper()
	sb := tn.create(bg, nil)
	tn.sh(bg, sb.Id, cmd)
	if _, err := tn.CommitSandbox(bg, &dsecv1.CommitSandboxRequest{SandboxId: sb.Id, Name: name}); err != nil {
		tn.t.Fatal(err)
	}
}

func TestLayersComposeASandboxsFilesystemAtCreate(t *testing.T) {
	tn := newTestNode(t, nil)
	tn.commitWith("toolkit", "mkdir -p /opt/tool && printf 'echo tool ran' > /opt/tool/run.sh && echo toolkit > /etc/motd")
	tn.commitWith("workspace", "mkdir -p /work && echo task-42 > /work/task.txt && echo workspace > /etc/motd && echo changed > /etc/hostname.base")

	composed := func(layers ...string) string {
		t.Helper()
		sb := tn.create(bg, &dsecv1.SandboxSpec{Layers: layers})
		return strings.TrimSpace(tn.sh(bg, sb.Id, "cat /work/task.txt; sh /opt/tool/run.sh; cat /etc/motd; cat /etc/hostname.base"))
	}
	// Each image's files over the earlier ones'; the base image's below
	// all (busybox's shell runs them); the toolkit's copy of the base does
	// not undo the workspace's changes.
	if got := composed("workspace", "toolkit"); got != "task-42\ntool ran\ntoolkit\nchanged" {
		t.Fatalf("workspace then toolkit: %q", got)
	}
	if got := composed("toolkit", "workspace"); got != "task-42\ntool ran\nworkspace\nchanged" {
		t.Fatalf("toolkit then workspace: %q", got)
	}

	t.Run("a fork of a composed sandbox has its files", func(t *testing.T) {
		parent := tn.create(bg, &dsecv1.SandboxSpec{Layers: []string{"toolkit"}})
		tn.sh(bg, parent.Id, "echo mine > /tmp/own")
		resp, err := tn.Fork(bg, &dsecv1.ForkRequest{SandboxId: parent.Id, Count: 2})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range resp.Results {
			if r.Error != nil {
				t.Fatalf("child: %v", r.Error)
			}
			if got := tn.sh(bg, r.Sandbox.Id, "sh /opt/tool/run.sh; cat /tmp/own"); got != "tool ran\nmine\n" {
				t.Fatalf("child %s: %q", r.Sandbox.Id, got)
			}
		}
	})

	t.Run("bad layers", func(t *testing.T) {
		if _, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Layers: []string{"nope"}}}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Errorf("an unknown image: %v", err)
		}
		if _, err := tn.Create(as("b"), &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Layers: []string{"toolkit"}}, Project: "b"}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Errorf("another project's image: %v", err)
		}
		many := make([]string, maxComposed+1)
		for i := range many {
			many[i] = "toolkit"
		}
		if _, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Layers: many}}); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("%d images: %v", len(many), err)
		}
	})
}
