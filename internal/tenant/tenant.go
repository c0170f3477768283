// Package tenant says whom a call acts for — the caller's project and
// whether it is an operator — and holds the one rule that decides which
// objects a caller reaches.
//
// Authentication puts a Caller in the request's context (the apiserver, the
// E2B facade, a node agent behind the control plane); the node, which owns
// every sandbox, snapshot, image and trajectory log, checks each object it
// hands out against the context's caller with Reaches. An object of another
// project answers exactly as an object that does not exist (no existence
// oracle). A context without a caller reaches only project "default"'s
// objects: code that acts for the platform itself (expiry, re-adoption)
// says so with System.
package tenant

import (
	"context"
	"regexp"

	"github.com/opendsec/dsec/internal/errdefs"
)

// DefaultProject is the project of callers without a key (an open,
// loopback-only server) and of keys given without one.
const DefaultProject = "default"

// Caller is who a call acts for.
type Caller struct {
	// Project owns what the caller creates.
	Project string
	// Admin callers (operators) reach every project's objects and create
	// shared images.
	Admin bool
}

type callerKey struct{}

// With returns ctx carrying c.
func With(ctx context.Context, c Caller) context.Context {
	if c.Project == "" {
		c.Project = DefaultProject
	}
	return context.WithValue(ctx, callerKey{}, c)
}

// From returns the caller ctx carries: without one, a non-admin caller of
// the default project.
func From(ctx context.Context) Caller {
	if c, ok := ctx.Value(callerKey{}).(Caller); ok {
		return c
	}
	return Caller{Project: DefaultProject}
}

// System returns ctx acting for the platform itself: an admin caller.
func System(ctx context.Context) context.Context {
	return With(ctx, Caller{Project: DefaultProject, Admin: true})
}

// Project is the project of ctx's caller.
func Project(ctx context.Context) string { return From(ctx).Project }

// Reaches reports whether ctx's caller may see and act on an object owned
// by project ("" is the default project).
func Reaches(ctx context.Context, project string) bool {
	c := From(ctx)
	return c.Admin || c.Project == OrDefault(project)
}

// Shared is the owner of shared objects (images an operator or the server
// itself made), which every caller sees and only operators change.
const Shared = ""

// Sees reports whether ctx's caller may see an image or other shareable
// object owned by owner (Shared or a project).
func Sees(ctx context.Context, owner string) bool {
	return owner == Shared || Reaches(ctx, owner)
}

// ImageOwner is the owner of an image ctx's caller creates: the caller's
// project, or Shared when an operator (or the server itself, System)
// creates it.
func ImageOwner(ctx context.Context) string {
	c := From(ctx)
	if c.Admin {
		return Shared
	}
	return c.Project
}

// ImageKey names an image of owner in a node's load report, where shared
// images appear by name and a project's own images as "<project> <name>"
// (neither image names nor project names hold a space).
func ImageKey(owner, name string) string {
	if owner == Shared {
		return name
	}
	return owner + " " + name
}

// OrDefault is project p, "" being the default project.
func OrDefault(p string) string {
	if p == "" {
		return DefaultProject
	}
	return p
}

var projectRe = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)

// ValidProject reports whether name can name a project: 1 to 63 letters,
// digits, '.', '_' or '-', starting and ending with a letter or digit.
func ValidProject(name string) error {
	if !projectRe.MatchString(name) {
		return errdefs.Invalid("project name %q must be 1 to 63 letters, digits, '.', '_' or '-'", name)
	}
	return nil
}
