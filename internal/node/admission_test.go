package node

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
)

func TestAdmissionQueuesThenRefuses(t *testing.T) {
	a := newAdmission(2, 3)
	var held []func()
	for i := 0; i < 2; i++ {
		r, err := a.acquire(context.Background(), "p")
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, r)
	}
	got := make(chan string, 8)
	var wg sync.WaitGroup
	for i, p := range []string{"a", "a", "b"} {
		wg.Add(1)
		go func(p string) {
			defer wg.Done()
			r, err := a.acquire(context.Background(), p)
			if err != nil {
				t.Error(err)
				return
			}
			got <- p
			r()
		}(p)
		for _, queued, _ := a.stats(); queued <= i; _, queued, _ = a.stats() {
			time.Sleep(time.Millisecond) // queue in this order
		}
	}
	if _, err := a.acquire(context.Background(), "c"); !errdefs.Is(err, errdefs.KindExhausted) {
		t.Fatalf("beyond the queue: %v", err)
	}
	if e := errdefs.Classify(func() error { _, err := a.acquire(context.Background(), "c"); return err }()); e.RetryAfter <= 0 {
		t.Fatal("no retry-after")
	}
	// One slot serves the queue, each waiter handing it on as it ends:
	// releasing the second slot meanwhile would serve two waiters at once,
	// which then report in either order.
	held[0]()
	wg.Wait()
	held[1]()
	first, second := <-got, <-got
	if first != "a" || second != "b" {
		t.Fatalf("served %s then %s; want a then b (round-robin between projects)", first, second)
	}
	if busy, queued, _ := a.stats(); busy != 0 || queued != 0 {
		t.Fatalf("busy %d queued %d after all released", busy, queued)
	}
}

func TestAdmissionWaiterThatGivesUpLosesNothing(t *testing.T) {
	a := newAdmission(1, 10)
	r, _ := a.acquire(context.Background(), "p")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := a.acquire(ctx, "p"); !errdefs.Is(err, errdefs.KindExhausted) {
		t.Fatalf("deadline while queued: %v", err)
	}
	r()
	r2, err := a.acquire(context.Background(), "p")
	if err != nil {
		t.Fatalf("slot lost: %v", err)
	}
	r2()
}
