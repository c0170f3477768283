package node

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/sandboxid"
	"github.com/opendsec/dsec/internal/substrate"
	"github.com/opendsec/dsec/internal/substrate/substratetest"
	"github.com/opendsec/dsec/internal/tenant"
)

// killedCall marks the context of a Fork whose client dies in the test.
type killedCall struct{}

// TestForkResumedAfterItsClientDied replays a GRPO trainer SIGKILLed
// while it forks: the killed Fork's children start slowly and fail when
// its caller goes, its snapshot is released (an image GC), while the
// resumed trainer repeats the Fork with the same idempotency key (while
// the killed call is still in flight, or after it ended). Image GCs run
// all along, as image deletes and fork releases make them on a busy
// node: the layers a snapshot adds and the layers its children start
// from must survive every one of them. The repeat makes every child,
// from the killed call's snapshot while that exists, else from its own.
func TestForkResumedAfterItsClientDied(t *testing.T) {
	t.Parallel()
	entered := make(chan string, 64)
	tn := newTestNode(t, func(_ *Config, f *substratetest.Fake) {
		f.BeforeCreate = func(ctx context.Context, spec *substrate.Spec) error {
			if _, err := sandboxid.SnapshotNode(spec.Image.Name); err != nil || ctx.Value(killedCall{}) == nil {
				return nil
			}
			// A child of the killed call: slow to start, and its start
			// fails once its caller is gone.
			entered <- spec.Image.Name
			<-ctx.Done()
			return errdefs.Unavailable("sandbox agent did not answer: %v", ctx.Err())
		}
	})
	parent := tn.create(bg, nil)

	stop := make(chan struct{})
	var gcs sync.WaitGroup
	gcs.Add(1)
	go func() {
		defer gcs.Done()
		for {
			select {
			case <-stop:
				return
			default:
				tn.images.GC()
				time.Sleep(50 * time.Microsecond)
			}
		}
	}()
	defer func() { close(stop); gcs.Wait() }()

	const count = 2
	for round := 0; round < 6; round++ {
		name := "the resumed fork, after the killed one ended, makes every child from its own snapshot"
		if round%2 == 0 {
			name = "the resumed fork, while the killed one is in flight, makes every child from its snapshot"
		}
		t.Run(fmt.Sprintf("round %d: %s", round, name), func(t *testing.T) {
			want := fmt.Sprintf("round-%d\n", round)
			tn.sh(bg, parent.Id, "echo round-"+fmt.Sprint(round)+" > /tmp/state")
			key := fmt.Sprintf("run/fork/%d", round)

			killed, kill := context.WithCancel(context.WithValue(bg, killedCall{}, true))
			defer kill()
			first := make(chan error, 1)
			go func() {
				_, err := tn.Fork(killed, &dsecv1.ForkRequest{SandboxId: parent.Id, Count: count, IdempotencyKey: key})
				first <- err
			}()
			var earlier string
			for i := 0; i < count; i++ {
				select {
				case earlier = <-entered:
				case err := <-first:
					t.Fatalf("the killed fork ended before its children started: %v", err)
				case <-time.After(time.Minute):
					t.Fatal("the killed fork's children never started")
				}
			}

			type result struct {
				resp *dsecv1.CreateSandboxesResponse
				err  error
			}
			resumed := make(chan result, 1)
			resume := func() {
				go func() {
					resp, err := tn.Fork(bg, &dsecv1.ForkRequest{SandboxId: parent.Id, Count: count, IdempotencyKey: key})
					resumed <- result{resp, err}
				}()
			}
			inFlight := round%2 == 0
			if inFlight {
				// The repeat takes the killed call's snapshot before the
				// killed call ends.
				resume()
				pins := func() int {
					tn.sandboxes.mu.Lock()
					defer tn.sandboxes.mu.Unlock()
					return tn.sandboxes.pinned[tenant.ImageKey(tenant.DefaultProject, earlier)]
				}
				eventually(t, "the repeat pins the killed call's snapshot", func() bool { return pins() == 2 })
			}
			kill() // the trainer is SIGKILLed: its call's context ends
			<-first
			if !inFlight {
				if tn.snapshotByID(earlier) != nil {
					t.Fatal("the snapshot of a killed fork without children is kept")
				}
				resume()
			}

			r := <-resumed
			if r.err != nil {
				t.Fatalf("resumed fork: %v", r.err)
			}
			if inFlight != (r.resp.SnapshotId == earlier) {
				t.Fatalf("resumed fork started from snapshot %s, the killed call's was %s (still there: %v)", r.resp.SnapshotId, earlier, inFlight)
			}
			if r.resp.Created != count {
				t.Fatalf("resumed fork made %d of %d children: %v", r.resp.Created, count, r.resp.Results)
			}
			for _, res := range r.resp.Results {
				if got := tn.sh(bg, res.Sandbox.Id, "cat /tmp/state"); got != want {
					t.Fatalf("child %s sees %q, want %q", res.Sandbox.Id, got, want)
				}
			}
			// A third call with the key answers the same children.
			again, err := tn.Fork(bg, &dsecv1.ForkRequest{SandboxId: parent.Id, Count: count, IdempotencyKey: key})
			if err != nil {
				t.Fatalf("fork repeated again: %v", err)
			}
			for i, res := range again.Results {
				if res.GetSandbox().GetId() != r.resp.Results[i].Sandbox.Id {
					t.Fatalf("child %d: %v, then %v", i, r.resp.Results[i], res)
				}
			}
			for _, res := range r.resp.Results {
				tn.Delete(bg, res.Sandbox.Id)
			}
		})
	}
}
