package e2e

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/buildctx"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// buildDockerfile is a two-stage build over every kind of step a task
// image uses: global and stage ARGs, WORKDIR, COPY of files and of a
// directory's contents, ADD of a local archive (unpacked), RUN, COPY
// --from an earlier stage, --chown, ENV, USER, LABEL, EXPOSE and CMD.
const buildDockerfile = `# syntax=docker/dockerfile:1
ARG BASE=busybox
FROM ${BASE} AS build
ARG FLAVOUR=plain
WORKDIR /src
COPY a.txt sub ./
RUN echo "built $FLAVOUR from $(cat a.txt)" > out.txt && cat a.txt b.txt
FROM busybox
ENV GREETING=hi
LABEL org.example.task="build test"
EXPOSE 8080
COPY --from=build /src/out.txt /opt/out.txt
COPY --chown=1000:1000 a.txt /home/u/
ADD tools.tar.gz /opt/tools/
WORKDIR /home/u
USER 1000
CMD ["cat", "/opt/out.txt"]
`

// writeBuildContext lays out the context buildDockerfile reads, with a
// .dockerignore'd secret beside it.
func writeBuildContext(t *testing.T, dir string) {
	t.Helper()
	var tgz bytes.Buffer
	zw := gzip.NewWriter(&tgz)
	tw := tar.NewWriter(zw)
	body := "#!/bin/sh\necho tool\n"
	tw.WriteHeader(&tar.Header{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "bin/tool", Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(body))})
	tw.Write([]byte(body))
	tw.Close()
	zw.Close()
	for name, content := range map[string]string{
		"Dockerfile":    buildDockerfile,
		"a.txt":         "hello\n",
		"sub/b.txt":     "nested\n",
		"secret.txt":    "the reference solution\n",
		".dockerignore": "secret.txt\n",
		"tools.tar.gz":  tgz.String(),
	} {
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// steps is what a build's progress said: each step's line, and the
// output of its RUNs.
type steps struct {
	lines  []string
	output strings.Builder
}

func (s *steps) progress(p *dsecv1.ImageProgress) {
	switch p.Phase {
	case "step":
		s.lines = append(s.lines, p.Message)
	case "output":
		s.output.WriteString(p.Message)
	}
}

// cached says whether the step whose text contains what came from the
// build cache.
func (s *steps) cached(t *testing.T, what string) bool {
	t.Helper()
	for _, l := range s.lines {
		if strings.Contains(l, what) {
			return strings.HasSuffix(l, "(cached)")
		}
	}
	t.Fatalf("no step %q among %q", what, s.lines)
	return false
}

// uploadContext sends dir as a build context.
func uploadContext(ctx context.Context, c *dsec.Client, dir string) (*dsecv1.BuildContext, error) {
	pr, pw := io.Pipe()
	go func() {
		_, err := buildctx.Tar(dir, pw)
		pw.CloseWithError(err)
	}()
	defer pr.Close()
	return c.UploadBuildContext(ctx, pr, nil)
}

// TestImageBuild: `dsec image build` builds a Dockerfile's image step by
// step (RUN in sandboxes, files on the node), caches each step, refuses
// bad input clearly without storing anything or leaving sandboxes, keeps
// projects apart, and `dsec commit` turns a running sandbox into an image.
func TestImageBuild(t *testing.T) {
	const keyA, keyB = "build-a=build-key-of-project-a-0123", "build-b=build-key-of-project-b-0123"
	srv := dsectest.Start(shared, dsectest.Options{APIKeys: []string{keyA, keyB}})
	a := srv.Client()
	b := dsec.New(srv.URL, dsec.WithAPIKey(strings.SplitN(keyB, "=", 2)[1]))
	ctx := ctxFor(t, 5*time.Minute)
	dir := t.TempDir()
	writeBuildContext(t, dir)

	build := func(t *testing.T, c *dsec.Client, dockerfile string, req *dsecv1.BuildImageRequest) (*dsecv1.Image, *steps, error) {
		t.Helper()
		bc, err := uploadContext(ctx, c, dir)
		if err != nil {
			t.Fatalf("upload the context: %v", err)
		}
		req.Dockerfile, req.ContextDigest = dockerfile, bc.Digest
		var s steps
		img, err := c.BuildImage(ctx, req, s.progress)
		return img, &s, err
	}
	noBuildSandboxes := func(t *testing.T, c *dsec.Client) {
		t.Helper()
		// A RUN's sandbox is deleted before the build answers.
		if l, err := c.List(ctx, "dsec.io/build"); err != nil || len(l) != 0 {
			t.Fatalf("build sandboxes left: %v %v", l, err)
		}
	}

	var first *dsecv1.Image
	t.Run("a multi-stage Dockerfile builds an image that runs as written", func(t *testing.T) {
		img, s, err := build(t, a, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task", BuildArgs: map[string]string{"FLAVOUR": "spicy"}})
		if err != nil {
			t.Fatalf("build: %v", err)
		}
		first = img
		if !strings.Contains(s.output.String(), "hello\nnested\n") {
			t.Errorf("the RUN's output did not stream: %q", s.output.String())
		}
		if n := len(s.lines); n != 15 || !strings.HasPrefix(s.lines[0], "[1/15] FROM busybox") {
			t.Errorf("steps %q, want 15 numbered from [1/15]", s.lines)
		}
		cfg := img.GetConfig()
		if !slices.Equal(cfg.GetCmd(), []string{"cat", "/opt/out.txt"}) || cfg.GetUser() != "1000" || cfg.GetWorkdir() != "/home/u" ||
			!slices.Contains(cfg.GetEnv(), "GREETING=hi") || cfg.GetLabels()["org.example.task"] != "build test" || !slices.Equal(cfg.GetExposedPorts(), []string{"8080/tcp"}) {
			t.Errorf("image config %v", cfg)
		}
		noBuildSandboxes(t, a)
		sb := create(t, a, dsec.CreateOptions{Image: "task"})
		for _, tc := range []struct{ cmd, want string }{
			{"id -u; pwd; echo $GREETING", "1000\n/home/u\nhi\n"},
			{"cat /opt/out.txt", "built spicy from hello\n"},
			{"stat -c '%u:%g %a' /home/u/a.txt", "1000:1000 644\n"},
			{"/opt/tools/bin/tool", "tool\n"},
			{"ls /src /secret.txt /home/u/secret.txt 2>&1 | wc -l", "3\n"}, // the build stage's files and the ignored file are nowhere
		} {
			r, err := sb.Exec(ctx, dsec.Cmd(tc.cmd))
			if err != nil || string(r.Stdout) != tc.want {
				t.Errorf("%s: %q %q %v, want %q", tc.cmd, r.GetStdout(), r.GetStderr(), err, tc.want)
			}
		}
		out, errOut, code := srv.CLI(ctx, "", "-o", "json", "image", "ls")
		if code != 0 || !strings.Contains(out, `"task"`) || strings.Contains(out, "dsec-build-cache") {
			t.Errorf("image ls shows the image and no cached step: %d %s %s", code, out, errOut)
		}
	})
	if first == nil {
		t.FailNow()
	}

	t.Run("a rebuild takes every step from the cache", func(t *testing.T) {
		img, s, err := build(t, a, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task", BuildArgs: map[string]string{"FLAVOUR": "spicy"}})
		if err != nil {
			t.Fatal(err)
		}
		for _, step := range []string{"WORKDIR /src", "COPY a.txt", "RUN echo", "COPY --from", "COPY --chown", "ADD tools"} {
			if !s.cached(t, step) {
				t.Errorf("%s ran again: %q", step, s.lines)
			}
		}
		if s.output.Len() != 0 || img.GetDigest() != first.GetDigest() || !slices.Equal(img.GetLayers(), first.GetLayers()) {
			t.Errorf("rebuilt %v (output %q), first %v", img, s.output.String(), first)
		}
	})

	t.Run("another build argument reruns the steps that saw it", func(t *testing.T) {
		_, s, err := build(t, a, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task-mild", BuildArgs: map[string]string{"FLAVOUR": "mild"}})
		if err != nil {
			t.Fatal(err)
		}
		if !s.cached(t, "COPY a.txt") || s.cached(t, "RUN echo") || s.cached(t, "COPY --from") {
			t.Errorf("steps %q", s.lines)
		}
	})

	t.Run("a changed context file reruns its COPY and what follows, not what precedes", func(t *testing.T) {
		os.WriteFile(filepath.Join(dir, "a.txt"), []byte("changed\n"), 0o644)
		defer os.WriteFile(filepath.Join(dir, "a.txt"), []byte("hello\n"), 0o644)
		_, s, err := build(t, a, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task-changed", BuildArgs: map[string]string{"FLAVOUR": "spicy"}})
		if err != nil {
			t.Fatal(err)
		}
		if !s.cached(t, "WORKDIR /src") || s.cached(t, "COPY a.txt") || s.cached(t, "RUN echo") || s.cached(t, "COPY --chown") || !strings.Contains(s.output.String(), "changed") {
			t.Errorf("steps %q, output %q", s.lines, s.output.String())
		}
		// A change to an ignored file changes nothing.
		os.WriteFile(filepath.Join(dir, "secret.txt"), []byte("another solution\n"), 0o644)
		_, s, err = build(t, a, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task-changed", BuildArgs: map[string]string{"FLAVOUR": "spicy"}})
		if err != nil || !s.cached(t, "RUN echo") || !s.cached(t, "ADD tools") {
			t.Errorf("after an ignored file changed: %v %q", err, s.lines)
		}
	})

	t.Run("a RUN that writes nothing adds no layer: the platform leaves no residue", func(t *testing.T) {
		img, _, err := build(t, a, "FROM busybox\nRUN true\nRUN ls / >/dev/null\n", &dsecv1.BuildImageRequest{Name: "untouched", NoCache: true})
		if err != nil {
			t.Fatal(err)
		}
		var busybox *dsecv1.Image
		imgs, _ := a.ListImages(ctx)
		for _, i := range imgs {
			if i.Name == "busybox" {
				busybox = i
			}
		}
		if busybox == nil || !slices.Equal(img.GetLayers(), busybox.GetLayers()) {
			t.Fatalf("layers %q, busybox's %v", img.GetLayers(), busybox)
		}
	})

	t.Run("bad input gets a clear error and stores nothing", func(t *testing.T) {
		for _, tc := range []struct {
			name, dockerfile, target string
			kind                     string
			msgs                     []string
		}{
			{"a failing RUN quotes its output's tail", "FROM busybox\nRUN echo to-out; echo to-err >&2; exit 3\n", "", "invalid", []string{"line 2: RUN echo to-out; echo to-err >&2; exit 3: exit code 3; its output ended with:\n", "to-out\n", "to-err\n"}},
			{"a missing context file", "FROM busybox\nCOPY nothere /x\n", "", "invalid", []string{"line 2: COPY: nothere: no such file in the build context"}},
			{"an ignored context file", "FROM busybox\nCOPY secret.txt /x\n", "", "invalid", []string{"secret.txt: no such file in the build context"}},
			{"a path out of the context", "FROM busybox\nCOPY ../../../etc/passwd /x\n", "", "invalid", []string{"no such file in the build context"}},
			{"an unsupported instruction", "FROM busybox\nVOLUME /data\n", "", "unimplemented", []string{"line 2: VOLUME"}},
			{"an unsupported flag", "FROM busybox\nRUN --mount=type=cache,target=/c true\n", "", "unimplemented", []string{"RUN --mount"}},
			{"a base image that is not there", "FROM no-such-image\n", "", "not_found", []string{`FROM no-such-image: no image "no-such-image"`}},
			{"an unknown target", "FROM busybox AS one\n", "two", "invalid", []string{`target stage "two"`}},
			{"a RUN without a shell", "FROM scratch\nRUN true\n", "", "invalid", []string{"FROM scratch"}},
			{"a parse error", "FROM busybox\nRUN\n", "", "invalid", []string{"line 2"}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, _, err := build(t, a, tc.dockerfile, &dsecv1.BuildImageRequest{Name: "broken", Target: tc.target})
				if kind(err) != tc.kind || strings.Contains(err.Error(), srv.DataDir) {
					t.Fatalf("%v, want %s", err, tc.kind)
				}
				for _, m := range tc.msgs {
					if !strings.Contains(err.Error(), m) {
						t.Fatalf("%v, want it to say %q", err, m)
					}
				}
				imgs, _ := a.ListImages(ctx)
				for _, i := range imgs {
					if i.Name == "broken" {
						t.Fatalf("a failed build stored %v", i)
					}
				}
				noBuildSandboxes(t, a)
			})
		}
	})

	t.Run("a build the client abandons leaves no sandbox behind", func(t *testing.T) {
		bc, err := uploadContext(ctx, a, dir)
		if err != nil {
			t.Fatal(err)
		}
		// The step's sandbox is deleted once the build notices the client
		// went: its ended event says when.
		events, err := a.Subscribe(ctx, dsec.EventOptions{Labels: "dsec.io/build=abandoned", Types: []string{"created", "ended"}})
		if err != nil {
			t.Fatal(err)
		}
		defer events.Close()
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		_, err = a.BuildImage(cctx, &dsecv1.BuildImageRequest{Name: "abandoned", ContextDigest: bc.Digest, NoCache: true,
			Dockerfile: "FROM busybox\nRUN echo started; sleep 600\n"}, func(p *dsecv1.ImageProgress) {
			if p.Phase == "output" && strings.Contains(p.Message, "started") {
				cancel()
			}
		})
		if err == nil {
			t.Fatal("an abandoned build succeeded")
		}
		var created, ended string
		for ended == "" {
			ev, err := events.Next()
			if err != nil {
				t.Fatalf("waiting for the abandoned step's sandbox to end: %v", err)
			}
			switch ev.GetType() {
			case "created":
				created = ev.GetSandboxId()
			case "ended":
				if ev.GetSandboxId() != created || ev.GetCause() != "deleted" {
					t.Fatalf("ended %v, want the step's sandbox %s deleted", ev, created)
				}
				ended = created
			}
		}
		noBuildSandboxes(t, a)
	})

	t.Run("another project reaches neither the context, the image nor the cache", func(t *testing.T) {
		bc, err := uploadContext(ctx, a, dir)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.BuildImage(ctx, &dsecv1.BuildImageRequest{Name: "stolen", ContextDigest: bc.Digest, Dockerfile: "FROM busybox\nCOPY secret.txt /\n"}, nil); kind(err) != "not_found" {
			t.Errorf("B used A's context: %v", err)
		}
		if _, err := b.BuildImage(ctx, &dsecv1.BuildImageRequest{Name: "stolen", Dockerfile: "FROM task\n"}, nil); kind(err) != "not_found" {
			t.Errorf("B built on A's image: %v", err)
		}
		if _, err := b.Create(ctx, dsec.CreateOptions{Image: "task"}); kind(err) != "not_found" {
			t.Errorf("B created from A's image: %v", err)
		}
		// B's own build of the same steps runs them: A's cache is A's.
		_, s, err := build(t, b, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task", BuildArgs: map[string]string{"FLAVOUR": "spicy"}})
		if err != nil {
			t.Fatal(err)
		}
		if s.cached(t, "RUN echo") {
			t.Errorf("B's build took A's cached step: %q", s.lines)
		}
		if p, err := b.PruneImages(ctx); err != nil || p.GetRemoved() == 0 || p.GetCopies() != 0 {
			t.Errorf("B's prune: %v %v", p, err)
		}
		if n, err := b.PruneBuildCache(ctx); err != nil || n != 0 {
			t.Errorf("B's second prune: %d %v", n, err)
		}
	})

	t.Run("commit turns a running sandbox into an image", func(t *testing.T) {
		sb := create(t, a, dsec.CreateOptions{Env: map[string]string{"MODE": "committed"}, Workdir: "/tmp"})
		if _, err := sb.Exec(ctx, dsec.Cmd("echo state > /tmp/state && rm /bin/vi")); err != nil {
			t.Fatal(err)
		}
		out, errOut, code := srv.CLI(ctx, "", "commit", sb.ID, "--name", "committed")
		if code != 0 || !strings.HasPrefix(out, "committed ") {
			t.Fatalf("dsec commit: %d %s %s", code, out, errOut)
		}
		// The sandbox runs on.
		if r, err := sb.Exec(ctx, dsec.Cmd("cat /tmp/state")); err != nil || string(r.Stdout) != "state\n" {
			t.Fatalf("after the commit: %v %v", r, err)
		}
		child := create(t, a, dsec.CreateOptions{Image: "committed"})
		r, err := child.Exec(ctx, dsec.Cmd("pwd; echo $MODE; cat state; test -e /bin/vi || echo no-vi"))
		if err != nil || string(r.Stdout) != "/tmp\ncommitted\nstate\nno-vi\n" {
			t.Fatalf("in a sandbox of the committed image: %q %q %v", r.GetStdout(), r.GetStderr(), err)
		}
		if _, err := b.CommitSandbox(ctx, sb.ID, "stolen"); kind(err) != "not_found" {
			t.Errorf("B committed A's sandbox: %v", err)
		}
		if _, err := a.CommitSandbox(ctx, sb.ID, "dsec-build-cache/x"); kind(err) != "invalid" {
			t.Errorf("a commit into the build cache's names: %v", err)
		}
	})

	t.Run("prune empties the build cache", func(t *testing.T) {
		out, errOut, code := srv.CLI(ctx, "", "image", "prune")
		if code != 0 || !strings.HasPrefix(out, "removed ") || strings.HasPrefix(out, "removed 0 ") {
			t.Fatalf("dsec image prune: %d %q %s", code, out, errOut)
		}
		_, s, err := build(t, a, buildDockerfile, &dsecv1.BuildImageRequest{Name: "task", BuildArgs: map[string]string{"FLAVOUR": "spicy"}})
		if err != nil {
			t.Fatal(err)
		}
		if s.cached(t, "COPY a.txt") || s.cached(t, "RUN echo") {
			t.Errorf("steps after the prune %q", s.lines)
		}
		// The images built before the prune still run.
		sb := create(t, a, dsec.CreateOptions{Image: "task-mild"})
		if r, err := sb.Exec(ctx, dsec.Cmd("cat /opt/out.txt")); err != nil || string(r.Stdout) != "built mild from hello\n" {
			t.Errorf("task-mild after the prune: %v %v", r, err)
		}
	})

	t.Run("a command that fails because its image data cannot be loaded is an infra error", func(t *testing.T) {
		// A committed image with a file of random bytes, pushed on
		// demand; another server pulls it through a proxy that can stop
		// serving the blob's ranges.
		sb := create(t, a, dsec.CreateOptions{})
		if r, err := sb.Exec(ctx, dsec.Cmd("mkdir -p /data && head -c 3000000 /dev/urandom > /data/big.bin && md5sum /data/big.bin > /data/big.md5 && head -c 3000000 /dev/urandom > /data/more.bin && md5sum /data/more.bin > /data/more.md5")); err != nil || r.ExitCode != 0 {
			t.Fatalf("write the data: %v %v", r, err)
		}
		if _, err := a.CommitSandbox(ctx, sb.ID, "lazybig"); err != nil {
			t.Fatal(err)
		}
		reg := dsectest.StartRegistry(t, "", "")
		if _, err := a.PushImage(ctx, &dsecv1.PushImageRequest{Name: "lazybig", Ref: reg.Host + "/tasks/lazybig:1", Insecure: true, OnDemand: true}, nil); err != nil {
			t.Fatal(err)
		}
		// broken: the proxy refuses the blob's ranges; gate (when set):
		// it holds them until the channel closes, telling arrived.
		var broken atomic.Bool
		var gate atomic.Pointer[chan struct{}]
		arrived := make(chan struct{}, 1)
		target, _ := url.Parse("http://" + reg.Host)
		rp := httputil.NewSingleHostReverseProxy(target)
		proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if broken.Load() && r.Header.Get("Range") != "" {
				http.Error(w, "the blob store is down", http.StatusServiceUnavailable)
				return
			}
			if g := gate.Load(); g != nil && r.Header.Get("Range") != "" {
				select {
				case arrived <- struct{}{}:
				default:
				}
				select {
				case <-*g:
				case <-r.Context().Done():
					return
				}
			}
			rp.ServeHTTP(w, r)
		}))
		defer proxy.Close()
		other := dsectest.Start(shared, dsectest.Options{})
		c2 := other.Client()
		ref := strings.TrimPrefix(proxy.URL, "http://") + "/tasks/lazybig:1"
		if _, err := c2.PullImage(ctx, &dsecv1.PullImageRequest{Ref: ref, Name: "lazybig", Insecure: true}, nil); err != nil {
			t.Fatal(err)
		}
		lazy := create(t, c2, dsec.CreateOptions{Image: "lazybig"})
		if r, err := lazy.Exec(ctx, dsec.Cmd("head -c 100 /data/big.bin | wc -c")); err != nil || strings.TrimSpace(string(r.Stdout)) != "100" {
			t.Fatalf("the first bytes, loaded on demand: %v %v", r, err)
		}
		broken.Store(true)
		_, err := lazy.Exec(ctx, dsec.Cmd("cat /data/big.bin > /dev/null"))
		var de *dsec.Error
		if !errors.As(err, &de) || !de.Infra || !strings.Contains(de.Message, "image data could not be loaded") {
			t.Fatalf("a read of data its source no longer serves: %v, want an infra error", err)
		}
		// The sandbox is up; a command that succeeds is answered as it
		// is; once the source answers the data reads whole.
		if r, err := lazy.Exec(ctx, dsec.Cmd("echo alive")); err != nil || string(r.Stdout) != "alive\n" {
			t.Fatalf("the sandbox after the failed read: %v %v", r, err)
		}
		broken.Store(false)
		if r, err := lazy.Exec(ctx, dsec.Cmd("md5sum -c /data/big.md5")); err != nil || r.ExitCode != 0 {
			t.Fatalf("the data once its source answers again: %v %v", r, err)
		}
		// Its node killed (kill -9) while a read waits for data not yet
		// here: the caller gets an infra error at once. The image's data
		// is served by the blob server, a process apart from the node's:
		// once the node is back and the source answers, the sandbox,
		// re-adopted, reads the rest whole, and a failed command is the
		// command's.
		g := make(chan struct{})
		gate.Store(&g)
		done := make(chan error, 1)
		go func() {
			_, err := lazy.Exec(ctx, dsec.Cmd("md5sum -c /data/more.md5"))
			done <- err
		}()
		select {
		case <-arrived:
		case err := <-done:
			t.Fatalf("the read of data not yet here did not wait for its source: %v", err)
		case <-time.After(2 * time.Minute):
			t.Fatal("the read of data not yet here never reached its source")
		}
		other.Kill()
		if err := <-done; !errors.As(err, &de) || !de.Infra {
			t.Fatalf("a command whose node was killed under it: %v, want an infra error", err)
		}
		other.Restart()
		gate.Store(nil)
		close(g)
		if r, err := lazy.Exec(ctx, dsec.Cmd("md5sum -c /data/more.md5")); err != nil || r.ExitCode != 0 {
			t.Fatalf("the data loaded on demand after its node was killed and restarted: %v %v", r, err)
		}
		if r, err := lazy.Exec(ctx, dsec.Cmd("exit 3")); err != nil || r.ExitCode != 3 {
			t.Fatalf("a failed command in the re-adopted sandbox: %v %v, want exit 3", r, err)
		}
		fresh := create(t, c2, dsec.CreateOptions{Image: "lazybig"})
		if r, err := fresh.Exec(ctx, dsec.Cmd("md5sum -c /data/big.md5")); err != nil || r.ExitCode != 0 {
			t.Fatalf("a sandbox started after the restart: %v %v", r, err)
		}
	})

	t.Run("a built image pushed to a registry runs on another server", func(t *testing.T) {
		reg := dsectest.StartRegistry(t, "", "")
		ref := reg.Host + "/tasks/task:spicy"
		out, errOut, code := srv.CLI(ctx, "", "image", "push", "task", ref, "--insecure")
		if code != 0 || !strings.HasPrefix(out, reg.Host+"/tasks/task@sha256:") {
			t.Fatalf("dsec image push: %d %q %s", code, out, errOut)
		}
		if _, errOut, code := srv.CLI(ctx, "", "image", "push", "no-such-image", ref, "--insecure"); code == 0 || !strings.Contains(errOut, "not found") {
			t.Errorf("a push of a missing image: %d %s", code, errOut)
		}
		other := dsectest.Start(shared, dsectest.Options{})
		if _, errOut, code := other.CLI(ctx, "", "image", "import", ref, "--name", "pulled", "--insecure"); code != 0 {
			t.Fatalf("dsec image import: %d %s", code, errOut)
		}
		sb := create(t, other.Client(), dsec.CreateOptions{Image: "pulled"})
		r, err := sb.Exec(ctx, dsec.Cmd("id -u; pwd; echo $GREETING; cat /opt/out.txt; /opt/tools/bin/tool"))
		if err != nil || string(r.Stdout) != "1000\n/home/u\nhi\nbuilt spicy from hello\ntool\n" {
			t.Fatalf("in a sandbox of the pulled image: %q %q %v", r.GetStdout(), r.GetStderr(), err)
		}
		imgs, _ := other.Client().ListImages(ctx)
		for _, i := range imgs {
			if i.Name == "pulled" && (i.GetConfig().GetLabels()["org.example.task"] != "build test" || !slices.Equal(i.GetConfig().GetCmd(), []string{"cat", "/opt/out.txt"})) {
				t.Errorf("the pulled image's config %v", i.GetConfig())
			}
		}
	})

	t.Run("an image exported to a plain HTTP server runs on another server, loaded on demand", func(t *testing.T) {
		layoutDir := t.TempDir()
		if _, errOut, code := srv.CLI(ctx, "", "image", "export", "task", "-o", layoutDir); code != 0 {
			t.Fatalf("dsec image export: %d %s", code, errOut)
		}
		files := http.FileServer(http.Dir(layoutDir))
		var blobBytes atomic.Int64
		web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if u, p, ok := r.BasicAuth(); !ok || u != "reader" || p != "pw" {
				http.Error(w, "who are you", http.StatusUnauthorized)
				return
			}
			if r.Header.Get("Range") != "" {
				blobBytes.Add(1)
			}
			files.ServeHTTP(w, r)
		}))
		defer web.Close()
		other := dsectest.Start(shared, dsectest.Options{})
		src := strings.Replace(web.URL, "http://", "http://reader:pw@", 1) + "/"
		if _, errOut, code := other.CLI(ctx, "", "image", "import", src, "--name", "served"); code != 0 {
			t.Fatalf("dsec image import of a URL: %d %s", code, errOut)
		}
		if _, errOut, code := other.CLI(ctx, "", "image", "import", web.URL+"/", "--name", "refused"); code == 0 || !strings.Contains(errOut, "401") {
			t.Errorf("an import without the server's credentials: %d %s", code, errOut)
		}
		sb := create(t, other.Client(), dsec.CreateOptions{Image: "served"})
		r, err := sb.Exec(ctx, dsec.Cmd("id -u; pwd; echo $GREETING; cat /opt/out.txt; /opt/tools/bin/tool"))
		if err != nil || string(r.Stdout) != "1000\n/home/u\nhi\nbuilt spicy from hello\ntool\n" {
			t.Fatalf("in a sandbox of the served image: %q %q %v", r.GetStdout(), r.GetStderr(), err)
		}
		if blobBytes.Load() == 0 {
			t.Error("the sandbox read no range of the served blobs: the image was not loaded on demand")
		}
		imgs, err := other.Client().ListImages(ctx)
		source := "(not listed)"
		for _, i := range imgs {
			if i.Name == "served" {
				source = i.GetSource()
			}
		}
		if err != nil || strings.Contains(source, "pw") || !strings.Contains(source, "on demand") {
			t.Errorf("the served image's source: %q, %v", source, err)
		}
	})

	t.Run("the CLI builds from a context directory and streams the steps", func(t *testing.T) {
		out, errOut, code := srv.CLI(ctx, "", "image", "build", dir, "--name", "from-cli", "--build-arg", "FLAVOUR=cli")
		if code != 0 || !strings.HasPrefix(out, "from-cli ") || !strings.Contains(errOut, "[5/15] RUN echo") || !strings.Contains(errOut, "hello\nnested\n") {
			t.Fatalf("dsec image build: %d %q %q", code, out, errOut)
		}
		out, _, code = srv.CLI(ctx, "", "-o", "json", "image", "ls")
		var list struct {
			Images []*struct {
				Name   string `json:"name"`
				Source string `json:"source"`
			} `json:"images"`
		}
		if code != 0 || json.Unmarshal([]byte(out), &list) != nil {
			t.Fatalf("image ls: %d %s", code, out)
		}
		found := false
		for _, i := range list.Images {
			found = found || i.Name == "from-cli" && i.Source == "build"
		}
		if !found {
			t.Errorf("from-cli not listed as built: %s", out)
		}
	})
}
