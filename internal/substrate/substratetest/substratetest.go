// Package substratetest is the conformance suite every substrate driver
// must pass, and Fake, a driver that passes it without root, crun or QEMU
// for tests of the node above the drivers. A driver's test builds a Harness
// and calls Run. A case for a capability the driver does not declare
// checks that the driver refuses it as unimplemented, or does not run;
// nothing is skipped but for a driver unavailable on the host.
//
// The package is for tests only: its init turns a test binary started by
// the Fake into an instance's init, and no binary links it
// (test/structure).
package substratetest

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/substrate"
)

// Harness adapts a driver to the suite.
type Harness struct {
	// Driver is the driver under test.
	Driver substrate.Driver
	// NewSpec returns a spec for a fresh instance of a busybox-like image
	// (sh, echo, cat, awk, sleep, and wget or python3) with its own Dir.
	NewSpec func(t *testing.T) *substrate.Spec
	// Restart returns a new driver over the same state, as after a node
	// restart. Nil skips the re-adoption case.
	Restart func(t *testing.T) substrate.Driver
	// Leaks returns what an instance left behind after Destroy (mounts,
	// processes, cgroups, files), or nothing.
	Leaks func(t *testing.T, spec *substrate.Spec) []string
	// Kill ends an instance from outside, as a crash would. Nil skips the
	// case.
	Kill func(t *testing.T, inst substrate.Instance)
	// SkipLimits skips the resource limit cases (for kinds whose limits are
	// a VM's size rather than a cgroup).
	SkipLimits bool
	// Runtime is the runtime NewSpec's specs ask for ("" for the kind's
	// default): the suite reads that runtime's capabilities.
	Runtime string
	// LimitsEndInstance: a workload reaching the memory or pids limit
	// ends the whole instance, which says so (substrate.TaskEnder),
	// instead of losing a process or a fork (gVisor).
	LimitsEndInstance bool
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func (h Harness) create(t *testing.T, mut func(*substrate.Spec)) (substrate.Instance, *substrate.Spec) {
	t.Helper()
	spec := h.NewSpec(t)
	if mut != nil {
		mut(spec)
	}
	inst, err := h.Driver.Create(ctxT(t, 2*time.Minute), spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { inst.Destroy(context.Background()) })
	return inst, spec
}

// as is inst as the optional interface T, which its driver's capabilities
// promise.
func as[T any](t *testing.T, inst substrate.Instance) T {
	t.Helper()
	v, ok := inst.(T)
	if !ok {
		var zero T
		t.Fatalf("%T is not a %T", inst, &zero)
	}
	return v
}

// guestAs is inst's guest as the optional interface T, which its
// driver's capabilities promise.
func guestAs[T any](t *testing.T, inst substrate.Instance) T {
	t.Helper()
	v, ok := inst.Guest().(T)
	if !ok {
		var zero T
		t.Fatalf("%T is not a %T", inst.Guest(), &zero)
	}
	return v
}

func run(t *testing.T, g substrate.Guest, argv ...string) *guestv1.Exit {
	t.Helper()
	x, err := g.Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: argv, TimeoutMs: 60000})
	if err != nil {
		t.Fatalf("run %v: %v", argv, err)
	}
	return x
}

// Run runs the suite.
func Run(t *testing.T, h Harness) {
	caps, ok := h.Driver.Capabilities().For(h.Runtime)
	if !ok {
		t.Fatalf("the driver has no runtime %q", h.Runtime)
	}
	if !caps.Available {
		t.Skipf("%s substrate (runtime %q) unavailable on this host: %s", caps.Kind, h.Runtime, caps.Reason)
	}

	t.Run("a created instance runs commands", func(t *testing.T) {
		inst, _ := h.create(t, nil)
		x := run(t, inst.Guest(), "sh", "-c", "echo out; echo err >&2; exit 7")
		if x.ExitCode != 7 || string(x.Stdout) != "out\n" || string(x.Stderr) != "err\n" {
			t.Fatalf("exit %d stdout %q stderr %q", x.ExitCode, x.Stdout, x.Stderr)
		}
		if err := inst.Check(context.Background()); err != nil {
			t.Fatalf("check: %v", err)
		}
	})

	t.Run("each optional interface is implemented exactly when its capability is declared", func(t *testing.T) {
		inst, _ := h.create(t, nil)
		for c, implements := range substrate.Optional {
			if caps.Has(c) != implements(inst) {
				t.Errorf("capability %s declared %v, its interface implemented %v", c, caps.Has(c), implements(inst))
			}
		}
	})

	// Every kind with dsec-guest (all but function) serves ports.
	if caps.Kind != substrate.KindFunction {
		t.Run("a listener on the instance's loopback takes the connections its processes open", func(t *testing.T) {
			// How the node serves its model gateway inside every sandbox.
			inst, _ := h.create(t, nil)
			pg := guestAs[substrate.PortGuest](t, inst)
			ctx := ctxT(t, time.Minute)
			l, err := pg.Listen(ctx, 4319)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, "hello from the node, "+r.URL.Path)
			}))
			// busybox has wget, the debian VM image python3.
			x := run(t, inst.Guest(), "sh", "-c", `wget -q -O - http://127.0.0.1:4319/x 2>/dev/null || python3 -c 'import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:4319/x").read().decode())'`)
			if x.ExitCode != 0 || string(x.Stdout) != "hello from the node, /x" {
				t.Fatalf("exit %d stdout %q stderr %q", x.ExitCode, x.Stdout, x.Stderr)
			}
		})
	}

	t.Run("the environment and working directory of the spec apply", func(t *testing.T) {
		inst, _ := h.create(t, func(s *substrate.Spec) { s.Env = append(s.Env, "DSEC_TEST=42") })
		x := run(t, inst.Guest(), "sh", "-c", "echo $DSEC_TEST; hostname")
		if !strings.HasPrefix(string(x.Stdout), "42\n") {
			t.Fatalf("stdout %q", x.Stdout)
		}
	})

	t.Run("files written are read back and listed", func(t *testing.T) {
		if !caps.Has(substrate.CapFiles) {
			return // no FileGuest (checked above)
		}
		inst, _ := h.create(t, nil)
		g := inst.Guest()
		fg := guestAs[substrate.FileGuest](t, inst)
		ctx := ctxT(t, time.Minute)
		data := bytes.Repeat([]byte("dsec"), 1<<18) // 1 MiB
		if _, err := fg.WriteFile(ctx, &guestv1.WriteFile{Path: "/work/data.bin", Mkdirs: true}, bytes.NewReader(data)); err != nil {
			t.Fatal(err)
		}
		f, err := fg.ReadFile(ctx, &guestv1.ReadFile{Path: "/work/data.bin"})
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(f)
		f.Close()
		if !bytes.Equal(got, data) {
			t.Fatalf("read %d bytes, want %d", len(got), len(data))
		}
		ents, err := fg.ListDir(ctx, &guestv1.ListDir{Path: "/work", Depth: 1})
		if err != nil || len(ents) != 1 || ents[0].Name != "data.bin" {
			t.Fatalf("list: %v %v", ents, err)
		}
		x := run(t, g, "cat", "/work/data.bin")
		if len(x.Stdout) != len(data) {
			t.Fatalf("cat saw %d bytes", len(x.Stdout))
		}
	})

	t.Run("instances are isolated from each other", func(t *testing.T) {
		if !caps.Has(substrate.CapFiles) {
			return // stateless instances: nothing of one outlives its call
		}
		a, _ := h.create(t, nil)
		b, _ := h.create(t, nil)
		ctx := ctxT(t, time.Minute)
		if _, err := guestAs[substrate.FileGuest](t, a).WriteFile(ctx, &guestv1.WriteFile{Path: "/tmp/only-in-a"}, strings.NewReader("a")); err != nil {
			t.Fatal(err)
		}
		if _, err := guestAs[substrate.FileGuest](t, b).Stat(ctx, &guestv1.Path{Path: "/tmp/only-in-a"}); !errdefs.Is(err, errdefs.KindNotFound) {
			t.Fatalf("b sees a's file: %v", err)
		}
		run(t, a.Guest(), "sh", "-c", "sleep 1234 & echo started")
		x := run(t, b.Guest(), "ps", "-o", "args")
		if strings.Contains(string(x.Stdout), "sleep 1234") {
			t.Fatalf("b sees a's processes:\n%s", x.Stdout)
		}
	})

	t.Run("many commands run concurrently", func(t *testing.T) {
		inst, _ := h.create(t, nil)
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for i := 0; i < 16; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				x, err := inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"echo", fmt.Sprint(i)}})
				if err != nil {
					errs <- err
					return
				}
				if string(x.Stdout) != fmt.Sprintf("%d\n", i) {
					errs <- fmt.Errorf("call %d got %q", i, x.Stdout)
				}
			}(i)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})

	t.Run("destroy releases everything and is idempotent", func(t *testing.T) {
		spec := h.NewSpec(t)
		inst, err := h.Driver.Create(ctxT(t, 2*time.Minute), spec)
		if err != nil {
			t.Fatal(err)
		}
		run(t, inst.Guest(), "sh", "-c", "(sleep 1000 &) ; echo started")
		if err := inst.Destroy(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := inst.Destroy(context.Background()); err != nil {
			t.Fatalf("second destroy: %v", err)
		}
		if err := inst.Check(context.Background()); !errdefs.Is(err, errdefs.KindGone) {
			t.Fatalf("check after destroy: %v", err)
		}
		select {
		case <-inst.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("done not closed after destroy")
		}
		if h.Leaks != nil {
			if left := h.Leaks(t, spec); len(left) > 0 {
				t.Fatalf("left behind: %v", left)
			}
		}
	})

	if h.Kill != nil {
		t.Run("an instance that dies is reported gone", func(t *testing.T) {
			inst, _ := h.create(t, nil)
			h.Kill(t, inst)
			select {
			case <-inst.Done():
			case <-time.After(30 * time.Second):
				t.Fatal("done not closed after the instance died")
			}
			if err := inst.Check(context.Background()); !errdefs.Is(err, errdefs.KindGone) || !errdefs.IsInfra(err) {
				t.Fatalf("check: %v", err)
			}
			if te, ok := inst.(substrate.TaskEnder); ok && te.EndedByTask() != "" {
				t.Fatalf("an instance killed from outside says its workload %s", te.EndedByTask())
			}
		})
	}

	if h.Restart != nil {
		t.Run("a restarted driver re-adopts a running instance", func(t *testing.T) {
			inst, spec := h.create(t, nil)
			run(t, inst.Guest(), "sh", "-c", "echo kept > /tmp/state")
			d2 := h.Restart(t)
			again, err := d2.Attach(ctxT(t, time.Minute), spec, inst.State())
			if err != nil {
				t.Fatal(err)
			}
			x := run(t, again.Guest(), "cat", "/tmp/state")
			if string(x.Stdout) != "kept\n" {
				t.Fatalf("state after re-adoption: %q", x.Stdout)
			}
			if err := again.Destroy(context.Background()); err != nil {
				t.Fatal(err)
			}
		})
	}

	if caps.Has(substrate.CapPause) {
		t.Run("pause freezes and resume thaws", func(t *testing.T) {
			inst, _ := h.create(t, nil)
			p := as[substrate.Pauser](t, inst)
			ctx := ctxT(t, time.Minute)
			if err := p.Pause(ctx); err != nil {
				t.Fatal(err)
			}
			if err := p.Pause(ctx); err != nil {
				t.Fatalf("second pause: %v", err)
			}
			short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			_, err := inst.Guest().Run(short, &guestv1.Exec{Argv: []string{"true"}})
			cancel()
			if err == nil {
				t.Fatal("a command ran while paused")
			}
			if err := p.Resume(ctx); err != nil {
				t.Fatal(err)
			}
			if x := run(t, inst.Guest(), "echo", "back"); string(x.Stdout) != "back\n" {
				t.Fatalf("after resume: %q", x.Stdout)
			}
		})
	}

	if caps.Has(substrate.CapSnapshot) {
		t.Run("a snapshot holds the writable layer with deletions as whiteouts", func(t *testing.T) {
			inst, _ := h.create(t, nil)
			run(t, inst.Guest(), "sh", "-c", "mkdir -p /work && echo new > /work/f && rm /bin/vi")
			var buf bytes.Buffer
			if err := as[substrate.Snapshotter](t, inst).Snapshot(ctxT(t, time.Minute), &buf); err != nil {
				t.Fatal(err)
			}
			names := map[string]bool{}
			tr := tar.NewReader(&buf)
			for {
				hdr, err := tr.Next()
				if err != nil {
					break
				}
				names[strings.TrimPrefix(hdr.Name, "./")] = true
			}
			for _, want := range []string{"work/f", "bin/.wh.vi"} {
				if !names[want] {
					t.Errorf("snapshot lacks %s: %v", want, names)
				}
			}
			if x := run(t, inst.Guest(), "cat", "/work/f"); string(x.Stdout) != "new\n" {
				t.Fatalf("instance after snapshot: %q", x.Stdout)
			}
		})
	}

	if caps.Has(substrate.CapMemorySnapshot) {
		t.Run("a machine snapshot starts instances where the original was", func(t *testing.T) {
			inst, _ := h.create(t, nil)
			run(t, inst.Guest(), "sh", "-c", "echo on-disk > /tmp/disk-state; (sleep 1234 &) ; echo started")
			dir := t.TempDir()
			if err := as[substrate.MachineSnapshotter](t, inst).SnapshotMachine(ctxT(t, 2*time.Minute), dir); err != nil {
				t.Fatal(err)
			}
			run(t, inst.Guest(), "sh", "-c", "echo changed > /tmp/disk-state")
			var children []substrate.Instance
			for k := 0; k < 2; k++ {
				c, _ := h.create(t, func(s *substrate.Spec) { s.Restore = dir })
				children = append(children, c)
			}
			for k, c := range children {
				x := run(t, c.Guest(), "sh", "-c", "cat /tmp/disk-state; ps -o args | grep -c '^sleep 1234'")
				if string(x.Stdout) != "on-disk\n1\n" {
					t.Fatalf("child %d: %q", k, x.Stdout)
				}
			}
			run(t, children[0].Guest(), "sh", "-c", "echo child0 > /tmp/disk-state")
			if x := run(t, children[1].Guest(), "cat", "/tmp/disk-state"); string(x.Stdout) != "on-disk\n" {
				t.Fatalf("children share a disk: %q", x.Stdout)
			}
			if x := run(t, inst.Guest(), "cat", "/tmp/disk-state"); string(x.Stdout) != "changed\n" {
				t.Fatalf("the original after the snapshot: %q", x.Stdout)
			}
		})

		t.Run("a paused instance can be snapshotted and resumes unchanged", func(t *testing.T) {
			inst, _ := h.create(t, nil)
			run(t, inst.Guest(), "sh", "-c", "echo before > /tmp/p")
			ctx := ctxT(t, 2*time.Minute)
			p := as[substrate.Pauser](t, inst)
			if err := p.Pause(ctx); err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			if err := as[substrate.MachineSnapshotter](t, inst).SnapshotMachine(ctx, dir); err != nil {
				t.Fatal(err)
			}
			if err := p.Resume(ctx); err != nil {
				t.Fatal(err)
			}
			if x := run(t, inst.Guest(), "cat", "/tmp/p"); string(x.Stdout) != "before\n" {
				t.Fatalf("after resume: %q", x.Stdout)
			}
			c, _ := h.create(t, func(s *substrate.Spec) { s.Restore = dir })
			if x := run(t, c.Guest(), "cat", "/tmp/p"); string(x.Stdout) != "before\n" {
				t.Fatalf("child of the paused snapshot: %q", x.Stdout)
			}
		})
	}

	// endedBy waits for inst to end and checks that it says its
	// workload ended it, as want says.
	endedBy := func(t *testing.T, inst substrate.Instance, want string) {
		t.Helper()
		select {
		case <-inst.Done():
		case <-time.After(time.Minute):
			t.Fatalf("the instance still runs after its workload %s", want)
		}
		te, ok := inst.(substrate.TaskEnder)
		if !ok {
			t.Fatal("the instance does not say how its workload ended it (substrate.TaskEnder)")
		}
		if got := te.EndedByTask(); !strings.Contains(got, want) {
			t.Fatalf("ended: its workload %q, want %q", got, want)
		}
	}
	if !h.SkipLimits && h.LimitsEndInstance {
		t.Run("reaching the memory limit ends the instance, which says so", func(t *testing.T) {
			inst, _ := h.create(t, func(s *substrate.Spec) { s.MemoryMB = 64 })
			run(t, inst.Guest(), "echo", "started")
			inst.Guest().Run(ctxT(t, 2*time.Minute), &guestv1.Exec{Argv: []string{"awk", "BEGIN{s=\"xxxxxxxxxxxxxxxx\"; while (1) s = s s}"}, TimeoutMs: 60000})
			endedBy(t, inst, "reached its memory limit")
		})
		t.Run("reaching the pids limit ends the instance, which says so", func(t *testing.T) {
			inst, _ := h.create(t, func(s *substrate.Spec) { s.Pids = 16 })
			run(t, inst.Guest(), "echo", "started")
			inst.Guest().Run(ctxT(t, 2*time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", "b() { b | b & }; b; sleep 30"}, TimeoutMs: 60000})
			endedBy(t, inst, "reached its pids limit")
		})
	}

	if !h.SkipLimits && !h.LimitsEndInstance {
		t.Run("the memory limit kills the allocating process and the instance survives", func(t *testing.T) {
			inst, _ := h.create(t, func(s *substrate.Spec) { s.MemoryMB = 64 })
			x, err := inst.Guest().Run(ctxT(t, 2*time.Minute), &guestv1.Exec{Argv: []string{"awk", "BEGIN{s=\"xxxxxxxxxxxxxxxx\"; while (1) s = s s}"}, TimeoutMs: 60000})
			if err != nil {
				t.Fatal(err)
			}
			if x.Signal != 9 || x.TimedOut {
				t.Fatalf("memory bomb: exit %d signal %d timed out %v", x.ExitCode, x.Signal, x.TimedOut)
			}
			st, _ := inst.Stats(context.Background())
			if st.OOMKills < 1 {
				t.Fatalf("no OOM kill counted: %+v", st)
			}
			if y := run(t, inst.Guest(), "echo", "alive"); string(y.Stdout) != "alive\n" {
				t.Fatalf("instance unusable after OOM: %q", y.Stdout)
			}
		})

		t.Run("the pids limit contains a fork bomb", func(t *testing.T) {
			inst, _ := h.create(t, func(s *substrate.Spec) { s.Pids = 64 })
			x, err := inst.Guest().Run(ctxT(t, 2*time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", "b() { b | b & }; b; sleep 5"}, TimeoutMs: 3000})
			if err != nil {
				t.Fatal(err)
			}
			if !x.TimedOut {
				t.Logf("fork bomb ended by itself: exit %d", x.ExitCode)
			}
			st, _ := inst.Stats(context.Background())
			if st.Pids > 64 {
				t.Fatalf("pids %d over the limit", st.Pids)
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				y, err := inst.Guest().Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"echo", "alive"}})
				if err == nil && string(y.Stdout) == "alive\n" {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("instance unusable after a fork bomb: %v %v", y, err)
				}
				// Leftover bomb processes are killed by the next call's timeout.
				inst.Guest().Run(ctxT(t, time.Minute), &guestv1.Exec{Argv: []string{"sh", "-c", "kill -9 -1"}, TimeoutMs: 2000})
				time.Sleep(200 * time.Millisecond)
			}
		})

	}

	if !h.SkipLimits {
		t.Run("the CPU limit caps CPU time", func(t *testing.T) {
			inst, _ := h.create(t, func(s *substrate.Spec) { s.CPU = 0.25 })
			before, _ := inst.Stats(context.Background())
			start := time.Now()
			run(t, inst.Guest(), "sh", "-c", "(timeout 2 sh -c 'while :; do :; done') & (timeout 2 sh -c 'while :; do :; done'); wait")
			wall := time.Since(start)
			after, _ := inst.Stats(context.Background())
			used := after.CPUTime - before.CPUTime
			// Two busy loops would use up to 2 cores; the quota allows 0.25.
			if limit := time.Duration(float64(wall)*0.25*1.5) + 200*time.Millisecond; used > limit {
				t.Fatalf("used %v CPU in %v wall with a 0.25-core limit (allowed %v)", used, wall, limit)
			}
			if used < 50*time.Millisecond {
				t.Fatalf("used only %v CPU: is CPU time accounted?", used)
			}
		})
	}
}
