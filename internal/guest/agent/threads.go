package agent

import (
	"runtime"
	"sync"
)

// ReserveThreads makes the Go runtime start n more OS threads now and keep
// them idle for later. The runtime starts a thread whenever every existing
// one is blocked in a system call, and it cannot survive failing to: the
// process dies. Inside a sandbox whose workload has taken every pid of its
// cgroup (a fork bomb), the agent — the sandbox's init — would die with it.
// Threads made at start are never given back, so the agent has them when
// no new one can be made.
func ReserveThreads(n int) {
	var locked sync.WaitGroup
	release := make(chan struct{})
	var done sync.WaitGroup
	for i := 0; i < n; i++ {
		locked.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			// A goroutine wired to its thread that blocks keeps that thread
			// busy, so the next one needs a thread of its own.
			runtime.LockOSThread()
			locked.Done()
			<-release
			// Unlocked before it ends, the thread goes back to the
			// runtime's idle list instead of exiting.
			runtime.UnlockOSThread()
		}()
	}
	locked.Wait()
	close(release)
	done.Wait()
}
