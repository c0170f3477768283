package container

import (
	"context"
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
	for i, tc := range []struct {
		mem, pids int64
		cmd       string
	}{{64, 256, "awk 'BEGIN{s=\"xxxxxxxxxxxxxxxx\"; while (1) s = s s}'"}, {256, 16, "b() { b | b & }; b; sleep 30"}} {
		spec := &substrate.Spec{ID: fmt.Sprintf("smoke%d-%d", os.Getpid(), i), Dir: t.TempDir(), Layers: layers, Hostname: "sandbox", MemoryMB: tc.mem, Pids: tc.pids, CPU: 1, Runtime: "gvisor"}
		inst, err := d.Create(context.Background(), spec)
		if err != nil {
			b, _ := os.ReadFile(spec.Dir + "/init.log")
			t.Fatalf("%v\n%s", err, b)
		}
		defer inst.Destroy(context.Background())
		pm, _ := os.ReadFile(d.cgroups.dir(d.cgroupPath(spec.ID), "pids") + "/pids.max")
		mm, _ := os.ReadFile(d.cgroups.dir(d.cgroupPath(spec.ID), "memory") + "/memory.limit_in_bytes")
		t.Logf("limits: pids %s mem %s", pm, mm)
		if len(pm) == 0 || string(pm) == "max\n" || len(mm) == 0 || len(mm) > 12 {
			t.Fatal("limits not set")
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		x, err := inst.Guest().Run(ctx, &guestv1.Exec{Argv: []string{"sh", "-c", tc.cmd}, TimeoutMs: 20000})
		cancel()
		st, _ := inst.Stats(context.Background())
		t.Logf("%s: %v %v check %v stats %+v", tc.cmd, x, err, inst.Check(context.Background()), st)
		x, err = inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"echo", "alive"}, TimeoutMs: 20000})
		t.Logf("after: %v %v", x, err)
		b, _ := os.ReadFile(spec.Dir + "/init.log")
		t.Logf("log: %s", b)
		t.Logf("oom %d pids %d", d.cgroups.oomKills(d.cgroupPath(spec.ID)), d.cgroups.pidsLimitHits(d.cgroupPath(spec.ID)))
	}
}
