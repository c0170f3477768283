package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/compose"
	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

// webSidecar serves /www on port 8080 (busybox httpd) once its init
// sidecar has seeded the page: the page says who wrote it.
func webSidecars() []*dsecv1.Sidecar {
	return []*dsecv1.Sidecar{
		{
			Name:    "web",
			Image:   "busybox",
			Command: []string{"sh", "-c", "mkdir -p /www && echo hello-from-web > /www/index.html && exec httpd -f -p 8080 -h /www"},
			Healthcheck: &dsecv1.HealthCheck{
				Command: []string{"wget", "-qO-", "http://127.0.0.1:8080/"}, StartIntervalMs: 100, Retries: 50,
			},
			DependsOn: []*dsecv1.SidecarDependency{{Name: "init", Condition: "completed"}},
			Aliases:   []string{"web.internal"},
		},
		{Name: "init", Image: "busybox", Command: []string{"sh", "-c", "echo seeded; echo to-stderr >&2"}},
	}
}

func stdout(t *testing.T, ctx context.Context, sb *dsec.Sandbox, cmd string) (string, int32) {
	t.Helper()
	r, err := sb.Exec(ctx, dsec.Cmd(cmd))
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	return strings.TrimSpace(string(r.Stdout)), r.ExitCode
}

func sidecarState(info *dsecv1.Sandbox, name string) *dsecv1.SidecarStatus {
	for _, s := range info.GetSidecars() {
		if s.Name == name {
			return s
		}
	}
	return nil
}

// TestSidecars: a sandbox of several containers (a service under test, a
// one-shot init) sharing one network namespace, each reached by name, each
// with its own file system and processes, started in dependency order and
// ended together.
func TestSidecars(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)

	sb, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Sidecars: webSidecars()})
	if err != nil {
		t.Fatal(err)
	}
	// Create returned once web was healthy, and web started only after
	// init completed.
	if st := sidecarState(sb.Info, "web"); st.GetState() != "healthy" {
		t.Fatalf("web after create: %v", st)
	}
	if st := sidecarState(sb.Info, "init"); st.GetState() != "exited" || st.GetExitCode() != 0 {
		t.Fatalf("init after create: %v", st)
	}

	t.Run("the main container reaches the sidecar by name and alias on localhost", func(t *testing.T) {
		for _, host := range []string{"web", "web.internal", "localhost", "127.0.0.1"} {
			if out, code := stdout(t, ctx, sb, "wget -qO- http://"+host+":8080/"); code != 0 || out != "hello-from-web" {
				t.Fatalf("GET %s: %q (exit %d)", host, out, code)
			}
		}
		// From the sidecar, "main" is the main container.
		if out, _ := stdout(t, ctx, sb.Container("web"), "grep -w main /etc/hosts"); !strings.HasPrefix(out, "127.0.0.1") {
			t.Fatalf("the sidecar's /etc/hosts lacks main: %q", out)
		}
	})

	t.Run("each container has its own root file system and processes", func(t *testing.T) {
		web := sb.Container("web")
		if out, _ := stdout(t, ctx, web, "hostname; cat /www/index.html"); out != "web\nhello-from-web" {
			t.Fatalf("in web: %q", out)
		}
		if _, code := stdout(t, ctx, sb, "test -e /www/index.html"); code == 0 {
			t.Fatal("the main container sees the sidecar's files")
		}
		if out, _ := stdout(t, ctx, sb, "ps -o args"); strings.Contains(out, "httpd") {
			t.Fatalf("the main container sees the sidecar's processes:\n%s", out)
		}
		if _, code := stdout(t, ctx, sb, "kill -0 $(pidof httpd)"); code == 0 {
			t.Fatal("the main container can signal the sidecar's server")
		}
		// The files API acts in the sidecar: a page written there is served.
		if _, err := web.WriteFile(ctx, "/www/page.html", strings.NewReader("written-by-api\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, code := stdout(t, ctx, sb, "wget -qO- http://web:8080/page.html"); code != 0 || out != "written-by-api" {
			t.Fatalf("page written through the files API: %q (exit %d)", out, code)
		}
		var buf bytes.Buffer
		if _, err := sb.ReadFile(ctx, "/www/page.html", &buf); err == nil {
			t.Fatal("the main container's files API read the sidecar's file")
		}
		procs, err := web.Processes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, p := range procs {
			found = found || (p.Tag == "service" && p.Running)
		}
		if !found {
			t.Fatalf("the sidecar's service is not among its processes: %v", procs)
		}
	})

	t.Run("a sidecar's output is its log", func(t *testing.T) {
		var out, errOut bytes.Buffer
		res, err := sb.Container("init").Logs(ctx, &out, &errOut)
		if err != nil {
			t.Fatal(err)
		}
		if out.String() != "seeded\n" || errOut.String() != "to-stderr\n" || res.ExitCode != 0 {
			t.Fatalf("init's log: stdout %q stderr %q exit %d", out.String(), errOut.String(), res.ExitCode)
		}
	})

	t.Run("an unknown container is not found", func(t *testing.T) {
		_, err := sb.Container("nope").Exec(ctx, dsec.Cmd("true"))
		if !dsec.IsNotFound(err) {
			t.Fatalf("exec in an unknown container: %v", err)
		}
	})

	t.Run("pause and resume act on every container", func(t *testing.T) {
		// A ticker in the sidecar: a pause freezes it too, so its ticks
		// stop for as long as the sandbox is paused.
		web := sb.Container("web")
		if _, code := stdout(t, ctx, web, "(while :; do cut -d' ' -f1 /proc/uptime >> /tmp/tick; usleep 50000; done) >/dev/null 2>&1 &"); code != 0 {
			t.Fatal("start the ticker")
		}
		// ticks waits until the ticker has written more than n ticks, and
		// returns them.
		ticks := func(n int) []float64 {
			t.Helper()
			out, code := stdout(t, ctx, web, fmt.Sprintf("for i in $(seq 200); do [ $(wc -l < /tmp/tick) -gt %d ] && break; usleep 20000; done; cat /tmp/tick", n))
			var vs []float64
			for _, l := range strings.Fields(out) {
				v, err := strconv.ParseFloat(l, 64)
				if err != nil {
					t.Fatalf("tick %q: %v", l, err)
				}
				vs = append(vs, v)
			}
			if code != 0 || len(vs) <= n {
				t.Fatalf("the ticker wrote %d ticks, want more than %d (exit %d)", len(vs), n, code)
			}
			return vs
		}
		before := len(ticks(2))
		if _, err := c.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		paused := time.Now()
		if info, _ := c.Get(ctx, sb.ID); info.GetState() != "paused" {
			t.Fatalf("state while paused: %s", info.GetState())
		}
		// The experiment: the sandbox stays paused this long (nothing to
		// wait for; any call would resume it).
		time.Sleep(1500 * time.Millisecond)
		pausedFor := time.Since(paused).Seconds()
		if _, err := c.Resume(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		vs := ticks(before + 2) // ticking again
		var gap float64
		for i := 1; i < len(vs); i++ {
			gap = max(gap, vs[i]-vs[i-1])
		}
		if gap < pausedFor-0.3 {
			t.Fatalf("the sidecar ran on while the sandbox was paused for %.2f s: the longest gap between its ticks is %.2f s", pausedFor, gap)
		}
		if out, code := stdout(t, ctx, sb, "wget -qO- http://web:8080/"); code != 0 || out != "hello-from-web" {
			t.Fatalf("GET after resume: %q (exit %d)", out, code)
		}
	})

	t.Run("a snapshot and a fork carry every container", func(t *testing.T) {
		web := sb.Container("web")
		if _, err := web.WriteFile(ctx, "/www/state.html", strings.NewReader("state-1\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, code := stdout(t, ctx, sb, "echo main-state > /root/m"); code != 0 {
			t.Fatal("write in main")
		}
		snap, err := c.Snapshot(ctx, sb.ID, "group")
		if err != nil {
			t.Fatal(err)
		}
		defer c.DeleteSnapshot(ctx, snap.Id)
		child, err := c.Create(ctx, dsec.CreateOptions{Snapshot: snap.Id})
		if err != nil {
			t.Fatal(err)
		}
		defer child.Close()
		if st := sidecarState(child.Info, "web"); st.GetState() != "healthy" || len(child.Info.Spec.Sidecars) != 2 {
			t.Fatalf("the child's sidecars: %v", child.Info.GetSidecars())
		}
		if out, code := stdout(t, ctx, child, "cat /root/m; wget -qO- http://web.internal:8080/state.html"); code != 0 || out != "main-state\nstate-1" {
			t.Fatalf("in the snapshot's child: %q (exit %d)", out, code)
		}
		res, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: sb.ID, Count: 2})
		if err != nil || res.Created != 2 {
			t.Fatalf("fork: %v, %v", res, err)
		}
		var kids []*dsec.Sandbox
		for _, r := range res.Results {
			k := c.Sandbox(r.GetSandbox().GetId())
			defer k.Close()
			kids = append(kids, k)
		}
		// Each child's sidecar has the parent's files, and its own from then on.
		if _, err := kids[0].Container("web").WriteFile(ctx, "/www/state.html", strings.NewReader("child-0\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		for i, want := range []string{"child-0", "state-1"} {
			if out, code := stdout(t, ctx, kids[i], "wget -qO- http://web:8080/state.html"); code != 0 || out != want {
				t.Fatalf("fork child %d: %q (exit %d), want %q", i, out, code, want)
			}
		}
		if out, _ := stdout(t, ctx, sb, "wget -qO- http://web:8080/state.html"); out != "state-1" {
			t.Fatalf("the parent after its children wrote: %q", out)
		}
	})

	t.Run("delete ends every container and leaves nothing", func(t *testing.T) {
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
		left := func() (out []string) {
			for _, p := range []string{
				"/sys/fs/cgroup/pids/dsec/" + sb.ID + "_1", "/sys/fs/cgroup/pids/dsec/" + sb.ID + "_2",
				filepath.Join(srv.RunDir(), "runtime", sb.ID+"_1"), filepath.Join(srv.RunDir(), "netns", sb.ID),
			} {
				if _, err := os.Stat(p); err == nil {
					out = append(out, p)
				}
			}
			return out
		}
		deadline := time.Now().Add(30 * time.Second)
		for len(left()) > 0 && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if l := left(); len(l) > 0 {
			t.Fatalf("left after delete: %v", l)
		}
	})
}

// TestSidecarFailures: a sidecar that never becomes ready fails the create
// with what it said, and nothing of the sandbox is left.
func TestSidecarFailures(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	for _, tc := range []struct {
		name    string
		sidecar *dsecv1.Sidecar
		want    []string
	}{
		{"exits", &dsecv1.Sidecar{Name: "db", Image: "busybox", Command: []string{"sh", "-c", "echo no config found >&2; exit 3"}},
			[]string{`sidecar "db"`, "status 3", "no config found"}},
		{"unhealthy", &dsecv1.Sidecar{Name: "api", Image: "busybox", Command: []string{"sleep", "600"},
			Healthcheck: &dsecv1.HealthCheck{Command: []string{"sh", "-c", "echo not listening; exit 1"}, StartIntervalMs: 100, IntervalMs: 100, Retries: 3}},
			[]string{`sidecar "api"`, "unhealthy", "not listening"}},
		// The root cause is reported: db's exit, not app's wait for it.
		{"dependency never completes", &dsecv1.Sidecar{Name: "app", Image: "busybox", Command: []string{"sleep", "600"},
			DependsOn: []*dsecv1.SidecarDependency{{Name: "db", Condition: "completed"}}}, []string{`sidecar "db"`, "status 7"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			scs := []*dsecv1.Sidecar{tc.sidecar}
			if tc.name == "dependency never completes" {
				scs = append(scs, &dsecv1.Sidecar{Name: "db", Image: "busybox", Command: []string{"sh", "-c", "exit 7"}})
			}
			_, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", Sidecars: scs})
			if err == nil {
				t.Fatal("created")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("error %q lacks %q", err, w)
				}
			}
			if dsec.IsInfra(err) {
				t.Fatalf("the sidecar's own failure is marked infra: %v", err)
			}
			if list, _ := c.List(ctx, ""); len(list) > 0 {
				t.Fatalf("listed after a failed create: %v", list)
			}
		})
	}
	// Nothing of any of them is left: no sidecar cgroup, no network
	// namespace.
	matches, _ := filepath.Glob("/sys/fs/cgroup/pids/dsec/*_1")
	for _, m := range matches {
		if _, err := c.Get(ctx, strings.TrimSuffix(filepath.Base(m), "_1")); err == nil {
			continue // another test's live sandbox
		}
		t.Errorf("left: %s", m)
	}
	if ents, _ := os.ReadDir(filepath.Join(srv.RunDir(), "netns")); len(ents) > 0 {
		t.Errorf("network namespaces left: %d", len(ents))
	}

	t.Run("invalid specs are refused before anything starts", func(t *testing.T) {
		for _, tc := range []struct {
			sidecars []*dsecv1.Sidecar
			kind     string
			want     string
		}{
			{[]*dsecv1.Sidecar{{Name: "main", Image: "busybox", Command: []string{"true"}}}, "", "is invalid"},
			{[]*dsecv1.Sidecar{{Name: "a", Image: "busybox", Command: []string{"true"}, DependsOn: []*dsecv1.SidecarDependency{{Name: "b"}}},
				{Name: "b", Image: "busybox", Command: []string{"true"}, DependsOn: []*dsecv1.SidecarDependency{{Name: "a"}}}}, "", "cycle"},
			{[]*dsecv1.Sidecar{{Name: "a", Image: "busybox", Command: []string{"true"}, DependsOn: []*dsecv1.SidecarDependency{{Name: "b", Condition: "healthy"}}},
				{Name: "b", Image: "busybox", Command: []string{"true"}}}, "", "no healthcheck"},
			{[]*dsecv1.Sidecar{{Name: "a", Image: "no-such-image", Command: []string{"true"}}}, "", "no-such-image"},
			{[]*dsecv1.Sidecar{{Name: "a", Image: "busybox", Command: []string{"true"}}}, "function", "kind container"},
		} {
			_, err := c.Create(ctx, dsec.CreateOptions{Kind: tc.kind, Image: "busybox", Sidecars: tc.sidecars})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v: got %v, want an error with %q", tc.sidecars, err, tc.want)
			}
		}
	})
}

// TestSidecarsFromCompose: the same group from a Compose file, with egress
// networking (the sidecars share the sandbox's network and policy), kept
// across a node restart.
func TestSidecarsFromCompose(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	const file = `
services:
  main:
    image: busybox
    command: sleep infinity
    environment: {ROLE: agent}
    depends_on:
      api: {condition: service_healthy}
  api:
    image: busybox
    command: sh -c 'mkdir -p /www && echo "$$GREETING" > /www/index.html && exec httpd -f -p 9000 -h /www'
    environment:
      GREETING: hi-${WHO:-there}
    healthcheck:
      test: ["CMD", "wget", "-qO-", "http://localhost:9000/"]
      start_interval: 100ms
      retries: 50
    container_name: api-server
    expose: ["9000"]
`
	// As the CLI does: variables from the caller's environment (none
	// here), $$ for a $ the sidecar's shell expands.
	text, err := compose.Interpolate(file, func(string) (string, bool) { return "", false })
	if err != nil {
		t.Fatal(err)
	}
	sb, err := c.Create(ctx, dsec.CreateOptions{Compose: text, Network: "egress"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	check := func() {
		t.Helper()
		if out, code := stdout(t, ctx, sb, "echo $ROLE; wget -qO- http://api-server:9000/"); code != 0 || out != "agent\nhi-there" {
			t.Fatalf("main: %q (exit %d)", out, code)
		}
	}
	check()
	if info, err := c.Get(ctx, sb.ID); err != nil || sidecarState(info, "api").GetState() != "healthy" || len(info.Spec.Sidecars) != 1 {
		t.Fatalf("get: %v %v", info, err)
	}

	srv.Restart()
	check()
	info, err := c.Get(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	// Re-adopted: its service watched again (running, then healthy once
	// its check passes again).
	deadline := time.Now().Add(30 * time.Second)
	for sidecarState(info, "api").GetState() != "healthy" && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		info, _ = c.Get(ctx, sb.ID)
	}
	if st := sidecarState(info, "api"); st.GetState() != "healthy" {
		t.Fatalf("after restart: %v", st)
	}
	if _, err := sb.Container("api").Exec(ctx, dsec.Cmd("true")); err != nil {
		t.Fatalf("exec in the re-adopted sidecar: %v", err)
	}
	// A fork of the re-adopted sandbox: its sidecars' layers were kept
	// across the restart.
	res, err := c.Fork(ctx, &dsecv1.ForkRequest{SandboxId: sb.ID, Count: 1})
	if err != nil || res.Created != 1 {
		t.Fatalf("fork after the restart: %v, %v", res, err)
	}
	kid := c.Sandbox(res.Results[0].GetSandbox().GetId())
	if out, code := stdout(t, ctx, kid, "echo $ROLE; wget -qO- http://api-server:9000/"); code != 0 || out != "agent\nhi-there" {
		t.Fatalf("the fork child: %q (exit %d)", out, code)
	}
	kid.Close()

	// Paused across a restart: re-adopted frozen (its agents answer
	// nothing until the resume), then resumed whole.
	if _, err := c.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	srv.Restart()
	if info, err := c.Get(ctx, sb.ID); err != nil || info.State != "paused" {
		t.Fatalf("after a restart while paused: %v, %v", info, err)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	check()
	if out, code := stdout(t, ctx, sb.Container("api"), "wget -qO- http://main:9000/"); code != 0 || out != "hi-there" {
		t.Fatalf("the sidecar after resume: %q (exit %d)", out, code)
	}
}

// TestSharedVolumes: Compose's named volumes between services are file
// systems of the sandbox alone: every container sees the same files, owned
// as it sees them, limited in size, and nothing is left after the delete.
func TestSharedVolumes(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 5*time.Minute)
	const file = `
services:
  main:
    image: busybox
    volumes: ["data:/data"]
  writer:
    image: busybox
    command: ["sh", "-c", "echo from-writer > /out/note && touch /out/owned && chown 1000:1000 /out/owned && exec sleep 600"]
    volumes:
      - {type: volume, source: data, target: /out}
volumes:
  data: {}
`
	sb, err := c.Create(ctx, dsec.CreateOptions{Compose: file})
	if err != nil {
		t.Fatal(err)
	}
	if len(sb.Info.Spec.SharedVolumes) != 1 || sb.Info.Spec.SharedVolumes[0].SizeMb != 1024 {
		t.Fatalf("shared volumes: %v", sb.Info.Spec.SharedVolumes)
	}
	// The writer may still be writing when create returns (it is ready once
	// running): wait for its file.
	if out, code := stdout(t, ctx, sb, "for i in $(seq 100); do [ \"$(stat -c %u /data/owned 2>/dev/null)\" = 1000 ] && break; sleep 0.05; done; cat /data/note; stat -c %u:%g /data/owned"); code != 0 || out != "from-writer\n1000:1000" {
		t.Fatalf("main reads the writer's files: %q (exit %d)", out, code)
	}
	if _, code := stdout(t, ctx, sb, "echo from-main > /data/back"); code != 0 {
		t.Fatal("main writes")
	}
	if out, code := stdout(t, ctx, sb.Container("writer"), "cat /out/back; stat -c %u /out/back"); code != 0 || out != "from-main\n0" {
		t.Fatalf("the writer reads main's file, root's in its own view: %q (exit %d)", out, code)
	}
	// Its size is the volume's own (1024 MiB), not the node's disk.
	if out, _ := stdout(t, ctx, sb, "df -m /data | awk 'NR==2 {print $2}'"); out == "" || len(out) > 4 {
		t.Fatalf("df /data: %q MiB, want about 1000", out)
	}
	node := srv.NodePid()
	mounted := func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", node))
		return strings.Contains(string(b), filepath.Join("sandboxes", sb.ID, "shared"))
	}
	if !mounted() {
		t.Fatal("the check below would not see the shared volume's mount in the node")
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for mounted() && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if mounted() {
		t.Fatal("the shared volume is still mounted in the node after the delete")
	}
}
