package qemu

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestQMPAndProcessAgainstQEMU(t *testing.T) {
	bin, err := FindBinary("")
	if err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "qmp")
	p, err := Start(bin, []string{"-M", "none", "-nodefaults", "-display", "none", "-qmp", "unix:" + sock + ",server=on,wait=off"}, filepath.Join(dir, "log"), nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill(5 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, err := DialQMP(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	t.Run("a command answers", func(t *testing.T) {
		st, err := q.Status(ctx)
		if err != nil || st == "" {
			t.Fatalf("status %q %v", st, err)
		}
	})
	t.Run("an unknown command is a QMP error", func(t *testing.T) {
		var qe *QMPError
		if err := q.Execute(ctx, "no-such-command", nil, nil); !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("an adopted process is the same process", func(t *testing.T) {
		a, err := Adopt(p.Pid, p.StartTime)
		if err != nil || !a.Alive() {
			t.Fatalf("adopt: %v", err)
		}
		if _, err := Adopt(p.Pid, p.StartTime+1); err == nil {
			t.Fatal("adopted with a wrong start time (a reused pid)")
		}
	})
	t.Run("quit ends QEMU and Done closes", func(t *testing.T) {
		q.Execute(ctx, "quit", nil, nil)
		if !p.Wait(30 * time.Second) {
			t.Fatal("QEMU still runs after quit")
		}
		if p.Alive() {
			t.Fatal("Alive after exit")
		}
	})
}

func TestProbeAccelHonoursForcedModesAndMissingKVM(t *testing.T) {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	for _, mode := range []string{"tcg", "kvm"} {
		if a := ProbeAccel(context.Background(), ProbeConfig{Mode: mode}, log); a.Name != mode || !strings.Contains(a.Reason, "forced") {
			t.Fatalf("mode %s: %+v", mode, a)
		}
	}
	if _, err := os.Stat("/dev/kvm"); err != nil {
		a := ProbeAccel(context.Background(), ProbeConfig{}, log)
		if a.Name != "tcg" || !strings.Contains(a.Reason, "/dev/kvm") {
			t.Fatalf("without /dev/kvm: %+v", a)
		}
	}
	if got := (Accel{Name: "tcg"}).Arg(16); got != "tcg,tb-size=16" {
		t.Fatalf("tcg arg %q", got)
	}
}

func TestControlArgs(t *testing.T) {
	serial := strings.Join(ControlArgs("pci", false, 0, "/r/a.agent", "/r/a.qmp"), " ")
	for _, want := range []string{"-device virtio-serial-pci,max_ports=2", "socket,id=agent,path=/r/a.agent,server=on,wait=off", "-qmp unix:/r/a.qmp,server=on,wait=off", "spawn=deny"} {
		if !strings.Contains(serial, want) {
			t.Errorf("serial channel args %q lack %q", serial, want)
		}
	}
	vsock := strings.Join(ControlArgs("device", true, 7, "/r/a.agent", "/r/a.qmp"), " ")
	if !strings.Contains(vsock, "-device vhost-vsock-device,guest-cid=7") || strings.Contains(vsock, "virtio-serial") {
		t.Errorf("vsock channel args %q", vsock)
	}
}

func TestAStateOfANewerNodeIsNotLoaded(t *testing.T) {
	_, err := LoadInstanceState[struct{}](t.TempDir(), []byte(`{"version": 99, "pid": 1}`))
	if err == nil || !strings.Contains(err.Error(), "version 99") {
		t.Fatalf("loading a state of version 99: %v; want a refusal naming the version", err)
	}
	st, err := LoadInstanceState[struct{}](t.TempDir(), []byte(`{"pid": 7, "start_time": 9}`))
	if err != nil || st.Pid != 7 {
		t.Fatalf("a state from before versions: %+v, %v", st, err)
	}
}
