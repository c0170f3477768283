package container

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	guestv1 "github.com/opendsec/dsec/api/dsec/guest/v1"
	"github.com/opendsec/dsec/internal/loopfs"
	"github.com/opendsec/dsec/internal/substrate"
)

// newVolume makes a volume file system as the node does (internal/volume):
// ext4 on a loop device, root 0:0 mode 0777, mounted in the test's mount
// namespace.
func newVolume(t *testing.T, sizeMB int64) string {
	t.Helper()
	if why := loopfs.Available(); why != "" {
		t.Skip(why)
	}
	dir := t.TempDir()
	img, mnt := filepath.Join(dir, "vol.img"), filepath.Join(dir, "mnt")
	if err := loopfs.Make(img, sizeMB, loopfs.Options{Journal: true}); err != nil {
		t.Fatal(err)
	}
	if err := loopfs.AttachMount(img, mnt); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	os.Remove(filepath.Join(mnt, "lost+found"))
	os.Chmod(mnt, 0o777)
	return mnt
}

func TestVolumesAreSharedAcrossSandboxesAsTheirRootsOwn(t *testing.T) {
	for _, rt := range []string{"", substrate.RuntimeGVisor} {
		name := "crun"
		if rt != "" {
			name = rt
		}
		t.Run(name, func(t *testing.T) {
			d := newDriver(t, t.TempDir())
			if rt != "" {
				needGVisor(t, d)
			}
			vol := newVolume(t, 16)
			n := 0
			start := func(t *testing.T, readOnly bool) (substrate.Instance, func(string) *guestv1.Exit) {
				t.Helper()
				n++
				spec := &substrate.Spec{ID: fmt.Sprintf("vol%d-%s-%d", os.Getpid(), name, n), Dir: t.TempDir(), Image: layers, Hostname: "sandbox",
					MemoryMB: 256, Pids: 256, CPU: 1, Network: substrate.Network{Mode: "none"}, Runtime: rt,
					Volumes: []substrate.VolumeMount{{Source: vol, Path: "/data", ReadOnly: readOnly}}}
				inst, err := d.Create(context.Background(), spec)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { inst.Destroy(context.Background()) })
				if mi, _ := os.ReadFile("/proc/self/mountinfo"); bytes.Contains(mi, []byte(filepath.Join(spec.Dir, "vol"))) || (inner(inst).st.Jail != "" && bytes.Contains(mi, []byte(filepath.Join(inner(inst).st.Jail, "vol")))) {
					t.Errorf("the volume's attachment for the runtime is still mounted on the host after the start")
				}
				return inst, func(script string) *guestv1.Exit {
					t.Helper()
					x, err := inst.Guest().Run(context.Background(), &guestv1.Exec{Argv: []string{"/bin/sh", "-c", script}, TimeoutMs: 30000})
					if err != nil {
						t.Fatal(err)
					}
					return x
				}
			}
			first, run := start(t, false)
			t.Run("root and another user write the volume", func(t *testing.T) {
				x := run("echo from-first > /data/f && mkdir /data/d && chown 1000:1000 /data/d && su -s /bin/sh nobody -c 'echo nobody > /tmp/n' ; ls -ln /data")
				if x.ExitCode != 0 {
					t.Fatalf("write: %s %s", x.Stdout, x.Stderr)
				}
				var st syscall.Stat_t
				if err := syscall.Stat(filepath.Join(vol, "f"), &st); err != nil {
					t.Fatal(err)
				}
				if st.Uid != 0 || st.Gid != 0 {
					t.Errorf("a file the sandbox's root wrote is owned by %d:%d on the volume, want 0:0 (as sandboxes see it)", st.Uid, st.Gid)
				}
				if err := syscall.Stat(filepath.Join(vol, "d"), &st); err != nil || st.Uid != 1000 {
					t.Errorf("a directory chowned to 1000 inside is owned by %d on the volume (%v)", st.Uid, err)
				}
			})
			t.Run("a write past the volume's size gets ENOSPC inside", func(t *testing.T) {
				x := run("dd if=/dev/zero of=/data/fill bs=1M count=64 2>&1; echo rc=$?; rm -f /data/fill")
				if !strings.Contains(string(x.Stdout), "No space left") {
					t.Errorf("filling the volume: %q", x.Stdout)
				}
			})
			first.Destroy(context.Background())
			t.Run("the next sandbox, in another range, reads and writes it as its root's", func(t *testing.T) {
				_, run := start(t, false)
				x := run("cat /data/f; stat -c %u:%g /data/f /data/d; echo again >> /data/f")
				if x.ExitCode != 0 || string(x.Stdout) != "from-first\n0:0\n1000:1000\n" {
					t.Fatalf("second sandbox: %q %s", x.Stdout, x.Stderr)
				}
			})
			t.Run("a read-only mount reads but refuses writes", func(t *testing.T) {
				_, run := start(t, true)
				x := run("cat /data/f; touch /data/g 2>&1; echo rc=$?")
				if !strings.HasPrefix(string(x.Stdout), "from-first\nagain\n") || !strings.Contains(string(x.Stdout), "Read-only file system") {
					t.Fatalf("read-only sandbox: %q %s", x.Stdout, x.Stderr)
				}
			})
		})
	}
}

// BenchmarkCreateWithVolumes times a sandbox's create with no volume, one
// read-write volume and four read-only ones, side by side (each iteration
// creates one of each in turn, so the host's load weighs on all alike),
// and reports each create's p50:
//
//	go test -run '^$' -bench CreateWithVolumes -benchtime 100x ./internal/substrate/container/
func BenchmarkCreateWithVolumes(b *testing.B) {
	if setupErr != "" {
		b.Skip(setupErr)
	}
	d, err := New(Config{GuestBinary: guestBin, StateDir: b.TempDir()}, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	vols := make([]string, 4)
	for i := range vols {
		dir := b.TempDir()
		img, mnt := filepath.Join(dir, "vol.img"), filepath.Join(dir, "mnt")
		if err := loopfs.Make(img, 64, loopfs.Options{Journal: true}); err != nil {
			b.Fatal(err)
		}
		if err := loopfs.AttachMount(img, mnt); err != nil {
			b.Fatal(err)
		}
		defer syscall.Unmount(mnt, syscall.MNT_DETACH)
		vols[i] = mnt
	}
	cases := []struct {
		name   string
		mounts []substrate.VolumeMount
		took   []time.Duration
	}{
		{name: "none"},
		{name: "one-rw", mounts: []substrate.VolumeMount{{Source: vols[0], Path: "/v0"}}},
		{name: "four-ro", mounts: []substrate.VolumeMount{{Source: vols[0], Path: "/v0", ReadOnly: true}, {Source: vols[1], Path: "/v1", ReadOnly: true}, {Source: vols[2], Path: "/v2", ReadOnly: true}, {Source: vols[3], Path: "/v3", ReadOnly: true}}},
	}
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		for c := range cases {
			bc := &cases[c]
			spec := &substrate.Spec{ID: fmt.Sprintf("bvol%d-%d-%d", os.Getpid(), c, i), Dir: b.TempDir(), Image: layers, Hostname: "sandbox",
				CPU: 1, MemoryMB: 256, Pids: 256, Network: substrate.Network{Mode: "none"}, Volumes: bc.mounts}
			t0 := time.Now()
			inst, err := d.Create(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			bc.took = append(bc.took, time.Since(t0))
			if err := inst.Destroy(ctx); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, bc := range cases {
		sort.Slice(bc.took, func(i, j int) bool { return bc.took[i] < bc.took[j] })
		b.ReportMetric(float64(bc.took[len(bc.took)/2].Microseconds()), bc.name+"-create-p50-µs")
	}
}
