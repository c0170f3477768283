package node

import (
	"strings"
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
)

// Mounting volumes into real sandboxes is tested over the container
// driver (internal/substrate/container) and a real server (test/e2e); the
// fake driver mounts none.

func TestVolumeMountsAreCheckedBeforeAnythingStarts(t *testing.T) {
	tn := newTestNode(t, nil)
	tests := []struct {
		name   string
		mounts []*dsecv1.VolumeMount
		want   string
	}{
		{"a relative path is refused", []*dsecv1.VolumeMount{{Name: "v", Path: "data"}}, "absolute and clean"},
		{"an unclean path is refused", []*dsecv1.VolumeMount{{Name: "v", Path: "/a/../b"}}, "absolute and clean"},
		{"the root is refused", []*dsecv1.VolumeMount{{Name: "v", Path: "/"}}, "cannot be mounted at /"},
		{"the runtime's paths are refused", []*dsecv1.VolumeMount{{Name: "v", Path: "/proc/x"}}, "the runtime's"},
		{"the agent's path is refused", []*dsecv1.VolumeMount{{Name: "v", Path: "/.dsec"}}, "the runtime's"},
		{"a name is required", []*dsecv1.VolumeMount{{Path: "/data"}}, "name is required"},
		{"two volumes at one path are refused", []*dsecv1.VolumeMount{{Name: "a", Path: "/d"}, {Name: "b", Path: "/d"}}, "overlap"},
		{"nested volumes are refused", []*dsecv1.VolumeMount{{Name: "a", Path: "/d"}, {Name: "b", Path: "/d/e"}}, "overlap"},
		{"a kind without the volumes capability refuses them, naming the kind", []*dsecv1.VolumeMount{{Name: "v", Path: "/data"}}, `kind "container" cannot mount volumes`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tn.Create(bg, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox", Volumes: tt.mounts}})
			if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want invalid: ...%s...", err, tt.want)
			}
		})
	}
	if n := len(tn.sandboxes.all(nil)); n != 0 {
		t.Fatalf("%d sandboxes started", n)
	}
}

func TestAnotherProjectsVolumeIsNotFound(t *testing.T) {
	tn := newTestNode(t, nil)
	if why := tn.volumes.Unavailable(); why != "" {
		t.Skip("volumes are unavailable here: " + why)
	}
	v, err := tn.CreateVolume(as("p"), &dsecv1.CreateVolumeRequest{Name: "mine", SizeMb: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tn.DeleteVolume(as("p"), v.Id) })
	ghost := "vol-aaaaaaaaaaaaaaaa-test"
	for _, ref := range []string{v.Name, v.Id} {
		_, errVictim := tn.GetVolume(as("q"), ref)
		unknown := ghost
		if ref == v.Name {
			unknown = "not-a-volume"
		}
		_, errGhost := tn.GetVolume(as("q"), unknown)
		if !errdefs.Is(errVictim, errdefs.KindNotFound) || strings.ReplaceAll(errVictim.Error(), ref, "X") != strings.ReplaceAll(errGhost.Error(), unknown, "X") {
			t.Errorf("another project's volume by %q: %v; an unknown one: %v", ref, errVictim, errGhost)
		}
		if err := tn.DeleteVolume(as("q"), ref); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Errorf("delete of another project's volume by %q: %v", ref, err)
		}
		if _, err := tn.StatVolumePath(as("q"), &dsecv1.VolumePathRequest{Volume: ref, Path: "/"}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Errorf("stat in another project's volume by %q: %v", ref, err)
		}
	}
	if got := tn.ListVolumes(as("q")); len(got) != 0 {
		t.Errorf("project q lists %d volumes", len(got))
	}
	if got := tn.ListVolumes(as("p")); len(got) != 1 || got[0].Id != v.Id {
		t.Errorf("project p lists %v", got)
	}
	if _, err := tn.CreateVolume(as("q"), &dsecv1.CreateVolumeRequest{Name: "mine", SizeMb: 16}); err != nil {
		t.Errorf("project q cannot have a volume of p's volume's name: %v", err)
	} else {
		tn.DeleteVolume(as("q"), "mine")
	}
}
