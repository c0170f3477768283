package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/dockerfile"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestTemplateStepsBecomeADockerfile: a template's steps become the
// Dockerfile dsec's builder runs, which its parser reads back with the
// values the SDK sent (nothing a value holds is expanded or splits a
// word), each instruction named by the step it came from.
func TestTemplateStepsBecomeADockerfile(t *testing.T) {
	hash := strings.Repeat("ab", 32)
	in := &buildStart{
		Steps: []templateStep{
			{Type: "COPY", Args: []string{"folder/*", "dest dir", "user", "0755"}, FilesHash: hash},
			{Type: "RUN", Args: []string{"echo \"$HOME\" && echo 'a b'\nsecond line"}},
			{Type: "RUN", Args: []string{"whoami", "root"}},
			{Type: "ENV", Args: []string{"A", `x $HOME "q" \ y`, "B", ""}},
			{Type: "WORKDIR", Args: []string{"/srv/my app"}},
			{Type: "USER", Args: []string{"nobody"}},
		},
		StartCmd: `python3 -m http.server "8000"`, ReadyCmd: "curl -s localhost:8000",
	}
	p, err := planBuild(in, "base", "user")
	if err != nil {
		t.Fatal(err)
	}
	if len(p.hashes) != 1 || p.hashes[0] != hash {
		t.Errorf("hashes %v", p.hashes)
	}
	f, err := dockerfile.Parse(strings.NewReader(p.dockerfile))
	if err != nil {
		t.Fatalf("%v\n%s", err, p.dockerfile)
	}
	steps := f.Stages[0].Steps
	if f.Stages[0].Base != "base" || len(steps) != len(p.steps) {
		t.Fatalf("FROM %q, %d instructions for %d step names:\n%s", f.Stages[0].Base, len(steps), len(p.steps), p.dockerfile)
	}
	want := []struct{ step, cmd string }{
		{"1", "COPY"}, {"2", "RUN"}, {"3", "USER"}, {"3", "RUN"}, {"3", "USER"}, {"4", "ENV"}, {"5", "WORKDIR"}, {"6", "USER"}, {finalizeStep, "LABEL"},
	}
	for i, w := range want {
		if steps[i].Command != w.cmd || p.steps[i] != w.step {
			t.Errorf("instruction %d: %s from step %s, want %s from step %s", i, steps[i].Command, p.steps[i], w.cmd, w.step)
		}
	}
	if c := steps[0]; c.Flags["chown"] != "user" || c.Flags["chmod"] != "0755" || len(c.Args) != 2 || c.Args[0] != "e2b-files/"+hash+"/folder/" || c.Args[1] != "dest dir/" {
		t.Errorf("COPY: %v %q", c.Flags, c.Args)
	}
	if r := steps[1]; !r.JSON || len(r.Args) != 4 || r.Args[3] != in.Steps[1].Args[0] {
		t.Errorf("RUN: the command is not passed whole: %q", r.Args)
	}
	if steps[2].Args[0] != "root" || steps[4].Args[0] != "user" {
		t.Errorf("a RUN as root is not wrapped in USER root / USER user: %q %q", steps[2].Args, steps[4].Args)
	}
	lookup := func(string) (string, bool) { return "", false }
	kv, err := dockerfile.KeyValues(steps[5], lookup)
	if err != nil || len(kv) != 2 || kv[0][1] != in.Steps[3].Args[1] || kv[1][1] != "" {
		t.Errorf("ENV: %q %v", kv, err)
	}
	if dir, err := dockerfile.Expand(steps[6].Args[0], lookup); err != nil || dir != "/srv/my app" {
		t.Errorf("WORKDIR %q %v", dir, err)
	}
	labels, err := dockerfile.KeyValues(steps[8], lookup)
	if err != nil || len(labels) != 2 || labels[0][1] != in.StartCmd || labels[1][1] != in.ReadyCmd {
		t.Errorf("LABEL: %q %v", labels, err)
	}
}

func TestTemplateStepsThatCannotBuildAreRefused(t *testing.T) {
	hash := strings.Repeat("cd", 32)
	for name, s := range map[string]templateStep{
		"a step type the builder lacks": {Type: "ARG", Args: []string{"A"}},
		"a COPY without its files hash": {Type: "COPY", Args: []string{"a", "b"}},
		"a COPY with a variable":        {Type: "COPY", Args: []string{"$HOME", "b"}, FilesHash: hash},
		"a COPY without a destination":  {Type: "COPY", Args: []string{"a"}, FilesHash: hash},
		"a COPY mode that is not octal": {Type: "COPY", Args: []string{"a", "b", "", "rwx"}, FilesHash: hash},
		"an ENV without its value":      {Type: "ENV", Args: []string{"A"}},
		"an ENV name that is no name":   {Type: "ENV", Args: []string{"A B", "x"}},
		"an ENV value of two lines":     {Type: "ENV", Args: []string{"A", "x\ny"}},
		"a USER with a space":           {Type: "USER", Args: []string{"a b"}},
		"an empty RUN":                  {Type: "RUN", Args: []string{" "}},
		"a WORKDIR of two lines":        {Type: "WORKDIR", Args: []string{"/a\n/b"}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := planBuild(&buildStart{Steps: []templateStep{s}}, "base", "root")
			if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), "step 1") {
				t.Errorf("%v, want an invalid-argument error naming step 1", err)
			}
		})
	}
	if _, err := planBuild(&buildStart{StartCmd: "a\nb"}, "base", "root"); !errdefs.Is(err, errdefs.KindInvalid) {
		t.Errorf("a start command of two lines: %v", err)
	}
}

func TestSplitTag(t *testing.T) {
	for in, want := range map[string][2]string{
		"app": {"app", ""}, "app:v1": {"app", "v1"}, "team/app:v1": {"team/app", "v1"}, "host:5000/app": {"host:5000/app", ""},
	} {
		if n, tag := splitTag(in); n != want[0] || tag != want[1] {
			t.Errorf("%s: %q %q, want %q", in, n, tag, want)
		}
	}
}

// TestTemplateUploadURLsAreSigned: the upload URL of a template's files,
// which carries no API key, takes a body only with its own signature,
// before its expiry, for the template and hash it was made for.
func TestTemplateUploadURLsAreSigned(t *testing.T) {
	f := facade(t, Config{TemplateDir: t.TempDir()})
	mux := http.NewServeMux()
	f.Mount(func(p string, h http.Handler) { mux.Handle(p, h) })
	id, other := f.templateID("a", "app"), f.templateID("b", "app")
	for _, tid := range []string{id, other} {
		rec, _ := json.Marshal(templateRecord{Project: "a", Name: "app"})
		if err := writeFileAtomic(f.tb.recordPath(tid), rec); err != nil {
			t.Fatal(err)
		}
	}
	hash, hash2 := strings.Repeat("ab", 32), strings.Repeat("cd", 32)
	future, past := strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10), strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	put := func(tid, h, exp, sig string) int {
		url := "/templates/" + tid + "/files/" + h + "/upload?expires=" + exp + "&signature=" + sig
		w := httptest.NewRecorder()
		mux.ServeHTTP(w, httptest.NewRequest(http.MethodPut, url, strings.NewReader("tar")))
		return w.Code
	}
	for name, c := range map[string]struct {
		tid, hash, exp, sig string
	}{
		"no signature":                 {id, hash, future, ""},
		"a forged signature":           {id, hash, future, strings.Repeat("0", 40)},
		"another hash's signature":     {id, hash, future, f.uploadSignature(id, hash2, future)},
		"another template's signature": {other, hash, future, f.uploadSignature(id, hash, future)},
		"an expiry moved later":        {id, hash, future, f.uploadSignature(id, hash, past)},
		"an expired URL":               {id, hash, past, f.uploadSignature(id, hash, past)},
	} {
		if code := put(c.tid, c.hash, c.exp, c.sig); code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, code)
		}
	}
	if _, err := os.Stat(f.tb.filesPath("a", hash)); err == nil {
		t.Fatal("a refused upload was stored")
	}
	if code := put(id, hash, future, f.uploadSignature(id, hash, future)); code != http.StatusOK {
		t.Fatalf("the URL as made: %d", code)
	}
	if b, err := os.ReadFile(f.tb.filesPath("a", hash)); err != nil || string(b) != "tar" {
		t.Fatalf("stored %q %v", b, err)
	}
}

// TestAnotherProjectsTemplatesAreNotFound: a template and its builds are
// their project's: another project's caller finds neither (its files, its
// status, its image by ID), an operator finds both.
func TestAnotherProjectsTemplatesAreNotFound(t *testing.T) {
	f := facade(t, Config{TemplateDir: t.TempDir()})
	id := f.templateID("a", "app")
	rec, _ := json.Marshal(templateRecord{Project: "a", Name: "app", Latest: "app:v1"})
	if err := writeFileAtomic(f.tb.recordPath(id), rec); err != nil {
		t.Fatal(err)
	}
	f.tb.add(&templateBuild{project: "a", templateID: id, buildID: "b1", image: "app:v1", status: "waiting"})
	if id == f.templateID("b", "app") {
		t.Fatal("two projects' templates of one name share an ID")
	}
	ctxA := tenant.With(context.Background(), tenant.Caller{Project: "a"})
	ctxB := tenant.With(context.Background(), tenant.Caller{Project: "b"})
	ops := tenant.With(context.Background(), tenant.Caller{Project: "ops", Admin: true})
	for _, ctx := range []context.Context{ctxA, ops} {
		if img, ok := f.templateImage(ctx, id); !ok || img != "app:v1" {
			t.Errorf("%v: the template's image %q %v", tenant.From(ctx), img, ok)
		}
		if _, err := f.templateBuild(ctx, id, "b1"); err != nil {
			t.Errorf("%v: the build: %v", tenant.From(ctx), err)
		}
	}
	if img, ok := f.templateImage(ctxB, id); ok {
		t.Errorf("project b starts project a's template: %q", img)
	}
	if _, err := f.templateRecord(ctxB, id); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Errorf("project b reads project a's template: %v", err)
	}
	if _, err := f.templateBuild(ctxB, id, "b1"); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Errorf("project b reads project a's build: %v", err)
	}
	if _, err := f.templateRecord(ctxA, "tpl-../../etc/passwd"); !errdefs.Is(err, errdefs.KindNotFound) {
		t.Errorf("a path as a template ID: %v", err)
	}
}
