package container

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/substrate"
)

// A create tells the recorder in its context each step of the start, in
// order, once each, and the steps add up to no more than the create took:
// the node's dsec_sandbox_start_step_duration_seconds is where the
// instance phase goes (docs/performance.md).
func TestACreateReportsItsSteps(t *testing.T) {
	d := newDriver(t, t.TempDir())
	var mu sync.Mutex
	var steps []string
	var sum time.Duration
	ctx := substrate.WithSteps(context.Background(), func(step string, took time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		if took < 0 {
			t.Errorf("step %s took %v", step, took)
		}
		steps = append(steps, step)
		sum += took
	})
	spec := &substrate.Spec{ID: fmt.Sprintf("steps%d", os.Getpid()), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
		MemoryMB: 256, Pids: 256, CPU: 1, Network: substrate.Network{Mode: "none"}}
	start := time.Now()
	inst, err := d.Create(ctx, spec)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Destroy(context.Background())
	mu.Lock()
	defer mu.Unlock()
	want := []string{"prepare", "mount", "files", "cgroups", "spec", "runtime", "init"}
	if !slices.Equal(steps, want) {
		t.Fatalf("steps %s, want %s", strings.Join(steps, ","), strings.Join(want, ","))
	}
	if sum > took {
		t.Fatalf("the steps add up to %v, the create took %v", sum, took)
	}
	// crun runs from the node's sealed copy of itself (sealExe), so it
	// does not copy itself again.
	if d.oci.name == "crun" {
		exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", inner(inst).st.RuntimePid))
		if err != nil || !strings.HasPrefix(exe, "/memfd:crun") {
			t.Fatalf("the sandbox's crun runs %q (%v), not the node's sealed copy", exe, err)
		}
		// The sandbox's own process (the agent) holds no descriptor of
		// it: crun passes on only the descriptors --preserve-fds names.
		agentFds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", inner(inst).st.Pid))
		if len(agentFds) == 0 {
			t.Fatal("the agent's descriptors cannot be read")
		}
		for _, e := range agentFds {
			if l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", inner(inst).st.Pid, e.Name())); strings.HasPrefix(l, "/memfd:crun") {
				t.Fatalf("the sandbox's agent holds the runtime's copy at descriptor %s", e.Name())
			}
		}
		// The node holds the copy read-only: no descriptor of it is
		// open for writing when a start executes it.
		fds, _ := os.ReadDir("/proc/self/fd")
		for _, e := range fds {
			if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); !strings.HasPrefix(l, "/memfd:crun") {
				continue
			}
			fd, _ := strconv.Atoi(e.Name())
			if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0); err != nil || fl&unix.O_ACCMODE != unix.O_RDONLY {
				t.Fatalf("descriptor %d of the sealed runtime is open with flags %#o (%v), want read-only", fd, fl, err)
			}
		}
	}
}
