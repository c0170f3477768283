package qemu

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/dsec/internal/cpio"
)

// Accel is how guests run: "kvm" (hardware virtualization) or "tcg"
// (QEMU's software emulation), and why that one was chosen.
type Accel struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
	// Key identifies the host boot and inputs the result holds for.
	Key string `json:"key"`
}

// Arg is the -accel option for a machine: TCG gets a translation buffer
// of tbMiB (QEMU's default is up to 1 GiB of reserved, and often tens of
// MiB touched, per VM).
func (a Accel) Arg(tbMiB int) string {
	if a.Name == "kvm" {
		return "kvm"
	}
	if tbMiB > 0 {
		return fmt.Sprintf("tcg,tb-size=%d", tbMiB)
	}
	return "tcg"
}

// ProbeConfig configures ProbeAccel.
type ProbeConfig struct {
	// Binary is qemu-system-x86_64.
	Binary string
	// Kernel boots the probe guest; without one KVM is not probed (TCG).
	Kernel *Kernel
	// Busybox is a static busybox for the probe's initramfs.
	Busybox string
	// Mode is "auto" (default: KVM if a probe guest boots in time), "kvm"
	// or "tcg" (forced).
	Mode string
	// Timeout bounds the probe boot (default 20s): a KVM that emulates
	// guest code (nested "PVM" here) crawls and must not hang the node.
	Timeout time.Duration
	// CacheFile keeps the result for the current host boot (optional).
	CacheFile string
}

// ProbeAccel decides how guests run on this host. With Mode "auto" it
// boots a tiny guest under KVM and takes KVM only if the guest prints its
// marker within the timeout; otherwise TCG, with the reason.
func ProbeAccel(ctx context.Context, cfg ProbeConfig, log *slog.Logger) Accel {
	switch cfg.Mode {
	case "tcg":
		return Accel{Name: "tcg", Reason: "forced by configuration"}
	case "kvm":
		return Accel{Name: "kvm", Reason: "forced by configuration"}
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 20 * time.Second
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return Accel{Name: "tcg", Reason: fmt.Sprintf("no usable /dev/kvm (%v)", errShort(err))}
	}
	f.Close()
	if cfg.Kernel == nil {
		return Accel{Name: "tcg", Reason: "/dev/kvm exists but there is no guest kernel to probe it with (run scripts/setup.sh)"}
	}
	key := probeKey(cfg)
	if cfg.CacheFile != "" {
		// One probe per host boot: concurrent nodes (and tests) wait for it.
		os.MkdirAll(filepath.Dir(cfg.CacheFile), 0o700)
		if lf, err := os.OpenFile(cfg.CacheFile+".lock", os.O_CREATE|os.O_RDWR, 0o600); err == nil {
			defer lf.Close()
			unix.Flock(int(lf.Fd()), unix.LOCK_EX)
		}
		if b, err := os.ReadFile(cfg.CacheFile); err == nil {
			var a Accel
			if json.Unmarshal(b, &a) == nil && a.Key == key {
				return a
			}
		}
	}
	log.Info("probing KVM with a test boot", slog.Duration("timeout", cfg.Timeout))
	start := time.Now()
	a := Accel{Name: "kvm", Key: key}
	if err := probeBoot(ctx, cfg); err != nil {
		a = Accel{Name: "tcg", Key: key, Reason: "/dev/kvm exists but a test guest did not boot under it: " + err.Error()}
	} else {
		a.Reason = fmt.Sprintf("a test guest booted under KVM in %s", time.Since(start).Round(time.Millisecond))
	}
	if cfg.CacheFile != "" {
		if b, err := json.Marshal(a); err == nil {
			os.MkdirAll(filepath.Dir(cfg.CacheFile), 0o700)
			os.WriteFile(cfg.CacheFile, b, 0o600)
		}
	}
	return a
}

func errShort(err error) string {
	if pe, ok := err.(*os.PathError); ok {
		return pe.Err.Error()
	}
	return err.Error()
}

// probeKey ties a cached probe to this host boot, QEMU and kernel.
func probeKey(cfg ProbeConfig) string {
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	st, _ := os.Stat(cfg.Binary)
	var mt int64
	if st != nil {
		mt = st.ModTime().UnixNano()
	}
	return fmt.Sprintf("%s|%s|%d|%s", strings.TrimSpace(string(boot)), cfg.Binary, mt, cfg.Kernel.Release)
}

// ProbeMarker is what the probe guest prints when it has booted.
const ProbeMarker = "DSEC-PROBE-BOOTED"

// MarkerInitramfs is an initramfs whose init prints marker on the serial
// console and powers off: the probe guest, and the raw-boot baseline of
// the benchmarks.
func MarkerInitramfs(busybox, marker string) ([]byte, error) {
	var buf bytes.Buffer
	c := cpio.NewWriter(&buf)
	c.FileFrom("bin/busybox", 0o755, busybox)
	c.Dir("dev", 0o755)
	c.CharDev("dev/console", 0o600, 5, 1)
	c.CharDev("dev/ttyS0", 0o600, 4, 64)
	c.File("init", 0o755, []byte("#!/bin/busybox sh\necho "+marker+" > /dev/ttyS0\n/bin/busybox poweroff -f\n"))
	if err := c.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// MarkerArgs is the command line of a guest booting the marker initramfs
// at initrd with accel.
func MarkerArgs(k *Kernel, initrd, accel string, memMiB int) []string {
	return []string{
		"-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on,pic=on",
		"-accel", accel, "-cpu", "max", "-m", fmt.Sprint(memMiB), "-smp", "1",
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-serial", "stdio",
		"-kernel", k.Vmlinux, "-initrd", initrd,
		"-append", "console=ttyS0 quiet panic=-1 " + TSCArgs(),
	}
}

// TSCArgs are the kernel arguments that keep TCG guests from calibrating
// the TSC.
func TSCArgs() string {
	if khz := TSCKHz(); khz > 0 {
		return fmt.Sprintf("tsc_early_khz=%d tsc=reliable", khz)
	}
	return "tsc=reliable"
}

func probeBoot(ctx context.Context, cfg ProbeConfig) error {
	dir, err := os.MkdirTemp("", "dsec-kvm-probe-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	img, err := MarkerInitramfs(cfg.Busybox, ProbeMarker)
	if err != nil {
		return err
	}
	initrd := filepath.Join(dir, "initrd")
	if err := os.WriteFile(initrd, img, 0o600); err != nil {
		return err
	}
	logPath := filepath.Join(dir, "log")
	p, err := Start(cfg.Binary, MarkerArgs(cfg.Kernel, initrd, "kvm", 64), logPath, nil, "")
	if err != nil {
		return err
	}
	defer p.Kill(5 * time.Second)
	deadline := time.NewTimer(cfg.Timeout)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		b, _ := os.ReadFile(logPath)
		if bytes.Contains(b, []byte(ProbeMarker)) {
			return nil
		}
		select {
		case <-p.Done():
			b, _ := os.ReadFile(logPath)
			if bytes.Contains(b, []byte(ProbeMarker)) {
				return nil
			}
			return fmt.Errorf("QEMU exited: %s", lastLine(string(b)))
		case <-deadline.C:
			return fmt.Errorf("no boot within %s", cfg.Timeout)
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	if len(s) > 200 {
		s = s[:200]
	}
	return s
}
