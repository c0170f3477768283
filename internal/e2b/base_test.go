package e2b

import (
	"strings"
	"testing"

	"github.com/opendsec/dsec/internal/errdefs"
)

func TestDefaultTemplatesStartTheBaseImage(t *testing.T) {
	f := facade(t, Config{})
	tests := []struct{ template, kind, image string }{
		{"", "container", "base"},
		{"base", "container", "base"},
		{"code-interpreter-v1", "container", "base"},
		{"microvm/base", "microvm", "base"},
		{"microvm/code-interpreter-v1", "microvm", "base"},
		{"vm/base", "vm", "debian-vm"},
		{"vm/code-interpreter-v1", "vm", "debian-vm"},
		{"debian", "container", "debian"},
	}
	for _, tt := range tests {
		t.Run("template "+tt.template+" starts "+tt.image+" as "+tt.kind, func(t *testing.T) {
			spec, err := f.spec(&newSandbox{TemplateID: tt.template}, defaultTimeoutV2)
			if err != nil {
				t.Fatal(err)
			}
			if spec.Kind != tt.kind || spec.Image != tt.image {
				t.Fatalf("kind %q image %q", spec.Kind, spec.Image)
			}
		})
	}
}

func TestAMissingBaseImageSaysHowToBuildIt(t *testing.T) {
	missing := errdefs.NotFound("image %q not found", "base")
	err := withBootstrapHint(missing, "base")
	if !errdefs.Is(err, errdefs.KindNotFound) || !strings.Contains(err.Error(), "dsec image bootstrap base") {
		t.Fatalf("got %v", err)
	}
	if other := withBootstrapHint(errdefs.NotFound("image %q not found", "mine"), "mine"); strings.Contains(other.Error(), "bootstrap") {
		t.Fatalf("another image's error got the hint: %v", other)
	}
}
