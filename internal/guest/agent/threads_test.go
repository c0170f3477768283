package agent

import (
	"os"
	"testing"
)

func threads(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Skip("needs /proc")
	}
	return len(ents)
}

func TestReservedThreadsStayAfterTheirGoroutinesEnd(t *testing.T) {
	before := threads(t)
	if before >= 9 {
		t.Skipf("the test process already has %d threads", before)
	}
	ReserveThreads(8)
	// The 8 reserved, and the one running this test.
	if after := threads(t); after < 9 {
		t.Fatalf("%d threads before, %d after reserving 8 (their goroutines have ended)", before, after)
	}
}
