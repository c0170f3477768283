package e2b

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/errwire"
)

func TestLifecycleAtCreate(t *testing.T) {
	f := facade(t, Config{})
	on := func(enabled bool) *struct {
		Enabled bool `json:"enabled"`
	} {
		return &struct {
			Enabled bool `json:"enabled"`
		}{enabled}
	}
	tests := []struct {
		name       string
		in         newSandbox
		onTimeout  string
		autoResume bool
		wantErr    string
	}{
		{name: "no lifecycle ends the sandbox at its timeout", in: newSandbox{}},
		{name: "onTimeout kill is the default", in: newSandbox{AutoPause: ptr(false)}},
		{name: "onTimeout pause pauses it", in: newSandbox{AutoPause: ptr(true)}, onTimeout: "pause"},
		{name: "autoResume is kept with the pause", in: newSandbox{AutoPause: ptr(true), AutoResume: on(true)}, onTimeout: "pause", autoResume: true},
		{name: "autoResume false is the default", in: newSandbox{AutoPause: ptr(true), AutoResume: on(false)}, onTimeout: "pause"},
		{name: "a full-memory auto-pause is dsec's pause", in: newSandbox{AutoPause: ptr(true), AutoPauseMemory: ptr(true)}, onTimeout: "pause"},
		{name: "autoResume without the pause is refused", in: newSandbox{AutoResume: on(true)}, wantErr: "autoResume"},
		{name: "a filesystem-only auto-pause is the node's pause_filesystem", in: newSandbox{AutoPause: ptr(true), AutoPauseMemory: ptr(false)}, onTimeout: "pause_filesystem"},
		{name: "a filesystem-only auto-pause with autoResume is refused", in: newSandbox{AutoPause: ptr(true), AutoPauseMemory: ptr(false), AutoResume: on(true)}, wantErr: "filesystem-only"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec, err := f.spec(&tt.in, defaultTimeoutV2)
			if tt.wantErr != "" {
				if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want invalid about %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if spec.OnTimeout != tt.onTimeout || (spec.Labels[autoResumeLabel] == "true") != tt.autoResume {
				t.Fatalf("on_timeout %q, labels %v", spec.OnTimeout, spec.Labels)
			}
			want := &lifecycleJSON{OnTimeout: "kill"}
			if tt.onTimeout != "" {
				want = &lifecycleJSON{OnTimeout: "pause", AutoResume: tt.autoResume}
			}
			if got := lifecycleOf(&dsecv1.Sandbox{Spec: spec}); *got != *want {
				t.Fatalf("getInfo's lifecycle %+v, want %+v", got, want)
			}
			if _, ok := metadata(spec.Labels)[autoResumeLabel]; ok {
				t.Fatal("the autoResume mark shows in the metadata")
			}
		})
	}
}

func TestSnapshotIDsAreTemplates(t *testing.T) {
	f := facade(t, Config{DefaultKind: "microvm"})
	const snap = "snap-abcdefghijklmnop-local"
	tests := []struct {
		name, template               string
		kind, image, snapshot, label string
	}{
		{"a snapshot ID starts from the snapshot, of its own kind", snap, "", "", snap, snap},
		{"a kind prefix still selects the kind", "container/" + snap, "container", "", snap, "container/" + snap},
		{"a name that only looks like one is an image", "snap-shot", "microvm", "snap-shot", "", "snap-shot"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec, err := f.spec(&newSandbox{TemplateID: tt.template}, defaultTimeoutV2)
			if err != nil {
				t.Fatal(err)
			}
			if spec.Kind != tt.kind || spec.Image != tt.image || spec.Snapshot != tt.snapshot || spec.Labels[templateLabel] != tt.label {
				t.Fatalf("kind %q image %q snapshot %q template %q", spec.Kind, spec.Image, spec.Snapshot, spec.Labels[templateLabel])
			}
		})
	}
}

func TestAPausedSandboxAnswersE2BsBody(t *testing.T) {
	err := error(&sandboxPaused{id: "abcdefghijklmnop-local"})
	t.Run("the envd routes answer 502 with the proxy's body", func(t *testing.T) {
		w := httptest.NewRecorder()
		envdError(w, fmt.Errorf("health: %w", err))
		var body pausedBody
		if w.Code != 502 || json.Unmarshal(w.Body.Bytes(), &body) != nil || body != (pausedBody{SandboxID: "abcdefghijklmnop-local", Message: "The sandbox is paused", Code: 502}) {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
	})
	t.Run("RPCs answer unavailable, as for a sandbox that is gone", func(t *testing.T) {
		if !errdefs.Is(err, errdefs.KindUnavailable) || errwire.EnvdHTTPStatus(err) != 502 {
			t.Fatalf("classified as %v", errdefs.Classify(err))
		}
	})
	t.Run("other errors keep their body", func(t *testing.T) {
		w := httptest.NewRecorder()
		envdError(w, notRunning("x"))
		if w.Code != 502 || strings.Contains(w.Body.String(), "paused") {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
	})
}

func TestListOrderAndPaging(t *testing.T) {
	base := time.Unix(1_700_000_000, 0)
	// Five items; two share a creation time and are ordered by ID.
	keys := []cursor{{base.Add(2), "c"}, {base, "a"}, {base.Add(4), "e"}, {base.Add(2), "b"}, {base.Add(3), "d"}}
	ids := func(page []int) string {
		var s []string
		for _, i := range page {
			s = append(s, keys[i].id)
		}
		return strings.Join(s, "")
	}
	walk := func(desc bool, limit int, between func(page int)) string {
		var pages []string
		var after *cursor
		for n := 0; ; n++ {
			page, next := pageOf(keys, desc, after, limit)
			pages = append(pages, ids(page))
			if next == "" {
				return strings.Join(pages, "|")
			}
			c, err := parseCursor(next)
			if err != nil {
				t.Fatal(err)
			}
			after = c
			if between != nil {
				between(n)
			}
		}
	}
	t.Run("newest first pages through every item once", func(t *testing.T) {
		if got := walk(true, 2, nil); got != "ed|cb|a" {
			t.Fatalf("pages %s", got)
		}
	})
	t.Run("oldest first pages through every item once", func(t *testing.T) {
		if got := walk(false, 2, nil); got != "ab|cd|e" {
			t.Fatalf("pages %s", got)
		}
	})
	t.Run("an item deleted between pages shifts nothing", func(t *testing.T) {
		got := walk(true, 2, func(page int) {
			if page == 0 {
				keys = append(keys[:0:0], keys[0], keys[1], keys[3]) // e and d are gone
			}
		})
		if got != "ed|cb|a" {
			t.Fatalf("pages %s", got)
		}
	})
	t.Run("the default order is newest first", func(t *testing.T) {
		lq, err := parseListQuery(url.Values{})
		if err != nil || !lq.desc || lq.limit != defaultListLimit {
			t.Fatalf("%+v %v", lq, err)
		}
		if lq, _ := parseListQuery(url.Values{"order": {"asc"}}); lq.desc {
			t.Fatal("asc is newest first")
		}
	})
	t.Run("a token this server did not issue is refused", func(t *testing.T) {
		for _, tok := range []string{"!!", "bm90LWEtdG9rZW4", cursor{base, ""}.token()} {
			if _, err := parseCursor(tok); !errdefs.Is(err, errdefs.KindInvalid) {
				t.Fatalf("%q: %v", tok, err)
			}
		}
	})
}
