package events

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
)

func TestRegistrationsAreKeptInAFileOnlyTheServerReads(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "webhooks.json")
	f := NewFileHooks(path)
	if hs, err := f.Hooks(ctx); err != nil || len(hs) != 0 {
		t.Fatalf("a new store lists %v (%v)", hs, err)
	}
	a := &Hook{ID: "wh-b", Project: "p", URL: "https://example.test/a", Secret: []byte("s1"), Enabled: true, Types: []string{Created}, Format: FormatDsec, CreatedAt: time.Now().UTC()}
	b := &Hook{ID: "wh-a", Project: "q", URL: "http://example.test/b", Secret: []byte("s2"), Format: FormatE2B, Shown: []string{"sandbox.lifecycle.created"}}
	for _, h := range []*Hook{a, b} {
		if err := f.PutHook(ctx, h); err != nil {
			t.Fatal(err)
		}
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("the file: %v, mode %v; want 0600 (it holds secrets)", err, st.Mode())
	}
	// Another store over the same file (a restarted server) reads them
	// back, ordered by ID, secrets included.
	hs, err := NewFileHooks(path).Hooks(ctx)
	if err != nil || len(hs) != 2 || hs[0].ID != "wh-a" || hs[1].ID != "wh-b" {
		t.Fatalf("reread %v (%v)", hs, err)
	}
	if !hs[1].Same(a) || string(hs[0].Secret) != "s2" || hs[0].Shown[0] != "sandbox.lifecycle.created" {
		t.Errorf("reread %+v %+v", hs[0], hs[1])
	}
	changed := *a
	changed.Enabled = false
	if changed.Same(a) {
		t.Errorf("a disabled registration is the same as the enabled one")
	}
	if err := f.DeleteHook(ctx, "wh-b"); err != nil {
		t.Fatal(err)
	}
	if err := f.DeleteHook(ctx, "wh-b"); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Errorf("deleting it again: %v, want not found", err)
	}
	if hs, _ := f.Hooks(ctx); len(hs) != 1 || hs[0].ID != "wh-a" {
		t.Errorf("after delete: %v", hs)
	}
}

func TestARegistrationThatCannotBeDeliveredIsRefused(t *testing.T) {
	for name, h := range map[string]*Hook{
		"no secret":     {URL: "https://example.test/"},
		"a file URL":    {URL: "file:///etc/shadow", Secret: []byte("s")},
		"no host":       {URL: "http:///path", Secret: []byte("s")},
		"not a URL":     {URL: "::", Secret: []byte("s")},
		"a huge secret": {URL: "https://example.test/", Secret: make([]byte, 2000)},
	} {
		if err := CheckHook(h); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
	if err := CheckHook(&Hook{URL: "http://127.0.0.1:9/x", Secret: []byte("s")}); err != nil {
		t.Errorf("a plain registration: %v", err)
	}
}
