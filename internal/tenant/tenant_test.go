package tenant_test

import (
	"context"
	"testing"

	"github.com/opendsec/dsec/internal/tenant"
)

func TestWhatACallerReaches(t *testing.T) {
	bg := context.Background()
	a := tenant.With(bg, tenant.Caller{Project: "a"})
	ops := tenant.With(bg, tenant.Caller{Project: "ops", Admin: true})
	tests := []struct {
		name    string
		ctx     context.Context
		owner   string
		reaches bool
		sees    bool
	}{
		{"a project reaches its own objects", a, "a", true, true},
		{"a project does not reach another's", a, "b", false, false},
		{"a project sees shared images but does not own them", a, tenant.Shared, false, true},
		{"an operator reaches every project", ops, "b", true, true},
		{"a context without a caller is the default project's", bg, tenant.DefaultProject, true, true},
		{"a context without a caller reaches no other project", bg, "a", false, false},
		{"an object without an owner is the default project's", bg, "", true, true},
		{"the platform itself reaches everything", tenant.System(bg), "a", true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tenant.Reaches(tt.ctx, tt.owner); got != tt.reaches {
				t.Errorf("Reaches(%q) = %v", tt.owner, got)
			}
			if got := tenant.Sees(tt.ctx, tt.owner); got != tt.sees {
				t.Errorf("Sees(%q) = %v", tt.owner, got)
			}
		})
	}
}

func TestImagesMadeByOperatorsAreShared(t *testing.T) {
	bg := context.Background()
	if o := tenant.ImageOwner(tenant.With(bg, tenant.Caller{Project: "a"})); o != "a" {
		t.Errorf("a project's image is owned by %q", o)
	}
	if o := tenant.ImageOwner(tenant.System(bg)); o != tenant.Shared {
		t.Errorf("the platform's image is owned by %q", o)
	}
	if o := tenant.ImageOwner(bg); o != tenant.DefaultProject {
		t.Errorf("an image made without a caller is owned by %q, not the default project", o)
	}
	if k := tenant.ImageKey(tenant.Shared, "busybox"); k != "busybox" {
		t.Errorf("a shared image's key is %q", k)
	}
	if k := tenant.ImageKey("a", "busybox"); k != "a busybox" {
		t.Errorf("a project's image's key is %q", k)
	}
}

func TestProjectNames(t *testing.T) {
	for _, ok := range []string{"default", "proj-a", "Team_1.x", "a"} {
		if err := tenant.ValidProject(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "a b", "a/b", "-a", "a-", "x\x00"} {
		if err := tenant.ValidProject(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
