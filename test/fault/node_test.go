// Package fault breaks a running dsec with real faults — processes killed
// at the worst moment, a full disk, a host that loses every process at
// once, etcd gone — and checks that callers get clear, typed errors, that
// nothing a user had is silently lost, and that the service comes back.
package fault

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/dsectest"
	dsec "github.com/opendsec/dsec/sdk/go"
)

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func errOf(err error) *dsec.Error {
	var e *dsec.Error
	if errors.As(err, &e) {
		return e
	}
	return &dsec.Error{Message: fmt.Sprint(err)}
}

func create(t *testing.T, c *dsec.Client, o dsec.CreateOptions) *dsec.Sandbox {
	t.Helper()
	if o.Image == "" {
		o.Image = "busybox"
	}
	if o.TTL == 0 {
		o.TTL = 10 * time.Minute
	}
	sb, err := c.Create(ctxFor(t, 2*time.Minute), o)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

// TestNodeKilledMidExec: a node agent killed -9 while a command runs gives
// its caller an infra error at once; the sandbox lives on and is re-adopted
// by the restarted node.
func TestNodeKilledMidExec(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	sb := create(t, c, dsec.CreateOptions{})
	if _, err := sb.Exec(ctx, dsec.Cmd("echo kept > /tmp/state")); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := sb.Exec(ctx, dsec.Cmd("touch /tmp/running; exec sleep 60"))
		errc <- err
	}()
	// The exec is running once its command made the marker.
	for {
		if _, err := sb.Stat(ctx, "/tmp/running"); err == nil {
			break
		} else if ctx.Err() != nil {
			t.Fatalf("the exec did not start: %v", err)
		}
	}
	killed := time.Now()
	srv.Kill()
	select {
	case err := <-errc:
		e := errOf(err)
		t.Logf("the caller's answer %v after the kill: %v", time.Since(killed), err)
		if err == nil || !e.Infra {
			t.Fatalf("exec across a node crash: %v, want an infra error", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the caller of an exec still waits 10 s after its node was killed")
	}
	srv.Restart()
	r, err := sb.Exec(ctx, dsec.Cmd("cat /tmp/state"))
	if err != nil || string(r.Stdout) != "kept\n" {
		t.Fatalf("the sandbox after its node came back: %v, %v", r, err)
	}
}

// TestEveryProcessOfANodeKilledAtOnce: as in a host reboot, the node and
// every sandbox process die together. The restarted node accounts for
// every sandbox — re-adopted, or failed with a reason — and none is
// silently lost.
func TestEveryProcessOfANodeKilledAtOnce(t *testing.T) {
	srv := dsectest.Start(t, dsectest.Options{})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	var ids []string
	for i := range 3 {
		sb := create(t, c, dsec.CreateOptions{Labels: map[string]string{"fault": "reboot", "i": strconv.Itoa(i)}})
		if _, err := sb.Exec(ctx, dsec.Cmd("sleep 1000 >/dev/null 2>&1 &")); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.ID)
	}
	srv.Kill()
	for _, id := range ids {
		killCgroup(t, id)
	}
	srv.Restart()
	for _, id := range ids {
		got, err := c.Get(ctx, id)
		if err != nil {
			t.Fatalf("sandbox %s after the reboot: %v (lost)", id, err)
		}
		if got.State != "failed" || got.Reason == "" {
			t.Errorf("sandbox %s after the reboot: state %q reason %q, want failed with a reason", id, got.State, got.Reason)
		}
		if _, err := c.Sandbox(id).Exec(ctx, dsec.Cmd("true")); !errOf(err).Infra || errOf(err).Kind != "gone" {
			t.Errorf("exec in %s after the reboot: %v, want gone (infra)", id, err)
		}
	}
	if list, err := c.List(ctx, "fault=reboot"); err != nil || len(list) != 0 {
		t.Errorf("dead sandboxes still listed as live: %v, %v", list, err)
	}
	sb := create(t, c, dsec.CreateOptions{})
	if r, err := sb.Exec(ctx, dsec.Cmd("true")); err != nil || r.ExitCode != 0 {
		t.Fatalf("a new sandbox after the reboot: %v, %v", r, err)
	}
}

// killCgroup kills every process of a sandbox's cgroup, in every hierarchy
// this host has (hybrid or pure cgroup v2).
func killCgroup(t *testing.T, id string) {
	t.Helper()
	var procFiles []string
	for _, d := range []string{"/sys/fs/cgroup/pids/dsec", "/sys/fs/cgroup/memory/dsec", "/sys/fs/cgroup/dsec", "/sys/fs/cgroup/unified/dsec"} {
		procFiles = append(procFiles, filepath.Join(d, id, "cgroup.procs"))
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		alive := 0
		for _, f := range procFiles {
			b, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			for _, p := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(p); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
					alive++
				}
			}
		}
		if alive == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes of sandbox %s survive SIGKILL", id)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestDataDirectoryFull: the node's disk fills up (here a small tmpfs under
// its data directory). Calls that need to write fail with a clear infra
// error, the store and the trajectory logs stay intact, and the service
// resumes when space returns.
func TestDataDirectoryFull(t *testing.T) {
	dsectest.Need(t)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=256m"); err != nil {
		t.Fatalf("mount a tmpfs for the data directory: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	srv := dsectest.Start(t, dsectest.Options{DataDir: dir})
	c := srv.Client()
	ctx := ctxFor(t, 3*time.Minute)
	sb := create(t, c, dsec.CreateOptions{})
	for i := range 3 {
		if _, err := sb.Exec(ctx, dsec.Cmd(fmt.Sprintf("echo step %d", i))); err != nil {
			t.Fatal(err)
		}
	}
	before, err := c.Log(ctx, sb.ID, 0)
	if err != nil {
		t.Fatal(err)
	}

	filler := filepath.Join(dir, "filler")
	f, err := os.Create(filler)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(f, io.LimitReader(zeros{}, 512<<20)) // until ENOSPC
	f.Close()
	t.Cleanup(func() { os.Remove(filler) })

	_, err = c.Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: time.Minute})
	t.Logf("create on a full disk: %v", err)
	if err == nil || !errOf(err).Infra || !strings.Contains(errOf(err).Message, "space") {
		t.Errorf("create on a full disk: %v, want an infra error that says the node is out of space", err)
	}
	_, err = sb.Exec(ctx, dsec.Cmd("echo on a full disk"))
	t.Logf("exec on a full disk: %v", err)
	if err != nil && (!errOf(err).Infra || !strings.Contains(errOf(err).Message, "space")) {
		t.Errorf("exec on a full disk: %v, want success or an infra error that says the node is out of space", err)
	}

	os.Remove(filler)
	after, err := c.Log(ctx, sb.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) < len(before) {
		t.Fatalf("the trajectory log lost entries: %d, had %d", len(after), len(before))
	}
	for i, e := range before {
		if after[i].Seq != e.Seq || string(after[i].GetResult().GetStdout()) != string(e.GetResult().GetStdout()) {
			t.Fatalf("log entry %d changed: %v, was %v", i, after[i], e)
		}
	}
	srv.Restart() // the store reopens: node.db intact
	if got, err := c.Get(ctx, sb.ID); err != nil || got.State != "running" {
		t.Fatalf("the sandbox after the disk filled and the node restarted: %v, %v", got.GetState(), err)
	}
	r, err := sb.Exec(ctx, dsec.Cmd("echo space again"))
	if err != nil || string(r.Stdout) != "space again\n" {
		t.Fatalf("exec once space returned: %v, %v", r, err)
	}
	if _, err := c.Create(ctx, dsec.CreateOptions{Image: "busybox", TTL: time.Minute}); err != nil {
		t.Fatalf("create once space returned: %v", err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
