package image

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/mountns"
	"github.com/opendsec/dsec/internal/tenant"
)

// TestMain runs the package's tests in a private mount namespace when
// root: debootstrap mounts /proc and /sys in the root file systems it
// builds, and a test killed midway must not leave them in the host's.
func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if err := mountns.Enter(); err != nil {
			fmt.Fprintln(os.Stderr, "mount namespace:", err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

func needVMTools(t *testing.T, tools ...string) {
	t.Helper()
	needRoot(t)
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (scripts/setup.sh installs it)", tool)
		}
	}
}

func qemuImgInfoOf(t *testing.T, p string) qemuImgInfo {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "--output=json", p).Output()
	if err != nil {
		t.Fatalf("qemu-img info: %v", err)
	}
	var info qemuImgInfo
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatal(err)
	}
	return info
}

// TestBuildVM builds (or takes from DSEC_CACHE_DIR) the debian VM image:
// a qcow2 disk with no backing file, the image's kernel and initramfs for
// direct boot, GRUB in the disk's MBR. The vm driver's tests boot it.
func TestBuildVM(t *testing.T) {
	needVMTools(t, "debootstrap", "qemu-img", "qemu-system-x86_64", "mkfs.ext4")
	if testing.Short() {
		t.Skip("builds a Debian VM image")
	}
	cache := os.Getenv("DSEC_CACHE_DIR")
	if cache == "" {
		cache = t.TempDir()
	}
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(tenant.System(context.Background()), 20*time.Minute)
	defer cancel()
	img, err := s.BuildVM(ctx, "debian", "", BootstrapOptions{CacheDir: cache}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if img.Name != "debian-vm" || img.VM == nil || len(img.Layers) != 1 {
		t.Fatalf("image record: %+v", img)
	}
	dir := s.LayerDir(img.Layers[0])
	t.Run("the disk is a standalone qcow2 of the image's size", func(t *testing.T) {
		info := qemuImgInfoOf(t, filepath.Join(dir, VMDiskFile))
		if info.Format != "qcow2" || info.BackingFilename != "" || info.VirtualSize != img.VM.VirtualSize {
			t.Fatalf("disk: %+v, image says %d bytes", info, img.VM.VirtualSize)
		}
	})
	t.Run("the MBR holds GRUB and one bootable partition", func(t *testing.T) {
		raw := filepath.Join(t.TempDir(), "mbr")
		if out, err := exec.Command("qemu-img", "dd", "-f", "qcow2", "-O", "raw", "bs=512", "count=1",
			"if="+filepath.Join(dir, VMDiskFile), "of="+raw).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img dd: %v %s", err, out)
		}
		mbr, _ := os.ReadFile(raw)
		if len(mbr) != 512 || !bytes.Contains(mbr, []byte("GRUB")) || mbr[446] != 0x80 || mbr[450] != 0x83 || mbr[510] != 0x55 {
			t.Fatalf("MBR: %x", mbr)
		}
	})
	t.Run("direct boot has the image's own kernel and initramfs", func(t *testing.T) {
		m, err := ReadVMLayer(dir)
		if err != nil || !m.DirectBoot || !strings.Contains(m.Cmdline, "root=LABEL=") || m.Agent != "node" {
			t.Fatalf("layer metadata: %+v %v", m, err)
		}
		for _, f := range []string{VMKernelFile, VMInitrdFile} {
			if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() < 1<<20 {
				t.Fatalf("%s: %v", f, err)
			}
		}
	})
	t.Run("another store imports the cached build", func(t *testing.T) {
		s2, _ := Open(t.TempDir(), slog.Default())
		start := time.Now()
		again, err := s2.BuildVM(ctx, "debian", "other-vm", BootstrapOptions{CacheDir: cache}, nil)
		if err != nil || again.Layers[0] != img.Layers[0] {
			t.Fatalf("second import: %v %v", again, err)
		}
		t.Logf("imported from the cache in %v", time.Since(start))
	})
	t.Run("a VM image is not a file system layer", func(t *testing.T) {
		if _, err := ReadVMLayer(t.TempDir()); !errdefs.Is(err, errdefs.KindInvalid) {
			t.Fatalf("ReadVMLayer of a plain directory: %v", err)
		}
	})
}

func TestImportVM(t *testing.T) {
	needVMTools(t, "qemu-img")
	s, err := Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	mk := func(name string, args ...string) string {
		p := filepath.Join(dir, name)
		args = append(append([]string{"create", "-q"}, args...), p, "64M")
		if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img create: %v %s", err, out)
		}
		return p
	}
	raw := mk("raw.img", "-f", "raw")
	os.WriteFile(filepath.Join(dir, "secret"), []byte("host secret"), 0o600)
	backed := mk("backed.qcow2", "-f", "qcow2", "-F", "raw", "-b", filepath.Join(dir, "secret"))
	open := func(p string) *os.File {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	t.Run("a raw disk is stored as qcow2", func(t *testing.T) {
		img, err := s.ImportVM(tenant.System(context.Background()), open(raw), "mine", nil)
		if err != nil {
			t.Fatal(err)
		}
		info := qemuImgInfoOf(t, filepath.Join(s.LayerDir(img.Layers[0]), VMDiskFile))
		if info.Format != "qcow2" || info.VirtualSize != 64<<20 || img.VM.DirectBoot || img.VM.Agent != "installed" {
			t.Fatalf("imported %+v as %+v", img.VM, info)
		}
	})
	cases := []struct {
		name string
		data func() *os.File
		want string
	}{
		{"a disk with a backing file is refused (it would read host files)", func() *os.File { return open(backed) }, "backing file"},
		{"a file too small to be a disk is refused", func() *os.File { return open(filepath.Join(dir, "secret")) }, "too small"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := s.ImportVM(tenant.System(context.Background()), c.data(), "bad", nil)
			if !errdefs.Is(err, errdefs.KindInvalid) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want invalid mentioning %q", err, c.want)
			}
			if _, err := s.Get("bad"); err == nil {
				t.Fatal("the refused image was stored")
			}
			if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "tmp")); len(ents) != 0 {
				t.Fatalf("left in tmp: %v", ents)
			}
		})
	}
}
