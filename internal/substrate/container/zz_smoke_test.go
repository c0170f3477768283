package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/substrate"
)

func TestZZSmoke(t *testing.T) {
	d := newDriver(t, t.TempDir())
	needGVisor(t, d)
	for i := 0; i < 12; i++ {
		spec := &substrate.Spec{ID: fmt.Sprintf("smoke%d-%d", os.Getpid(), i), Dir: t.TempDir(), Image: layers, Hostname: "sandbox", MemoryMB: 256, Pids: 256, CPU: 1, Runtime: "gvisor"}
		t0 := time.Now()
		inst, err := d.Create(context.Background(), spec)
		if err != nil {
			b, _ := os.ReadFile(spec.Dir + "/init.log")
			t.Errorf("%d: %v: %v\n%s", i, err, errors.Unwrap(err), b)
			continue
		}
		x, err := inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"echo", "alive"}, TimeoutMs: 20000})
		t.Logf("%d: create %v: %v %v", i, time.Since(t0), x.GetStdout(), err)
		inst.Destroy(context.Background())
	}
}
