package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/opendsec/dsec/internal/cpio"
	"github.com/opendsec/dsec/internal/errdefs"
	"github.com/opendsec/dsec/internal/tenant"
)

// VMRecipes are the VM images BuildVM can build offline.
var VMRecipes = []string{"debian"}

// VMDebianPackages are installed in the "debian" VM image on top of the
// "debian" recipe's root filesystem (DebianPackages: what a debian
// container has, so the two kinds run the same programs): a kernel from
// Debian's packages, its initramfs tools, GRUB for BIOS boot, systemd as
// init, and iproute2 for the guest's network.
var VMDebianPackages = []string{
	"linux-image-cloud-amd64", "initramfs-tools", "grub-pc", "systemd", "systemd-sysv", "udev", "kmod", "iproute2",
}

// vmBuildVersion changes whenever the VM image recipe below does, so
// cached disks are rebuilt.
const vmBuildVersion = "7"

// vmRootLabel is the label of a built VM image's root file system.
const vmRootLabel = "dsec-root"

// defaultVMDiskMB is a built VM image's disk size (sparse: only what the
// guest writes takes space).
const defaultVMDiskMB = 4096

// VMCmdline is the kernel command line of a built VM image, both in its
// GRUB configuration and for direct boot (the vm driver appends its own
// arguments). Kernel messages and systemd's go to the serial console (the
// node's console.log); the screen (tty1) shows a root shell; a panic
// reboots, which ends the VM (QEMU runs with -no-reboot). The root file
// system is mounted read-write by the initramfs and has no fstab entry, so
// systemd neither checks nor waits for its device.
const VMCmdline = "root=LABEL=" + vmRootLabel + " rw console=tty1 console=ttyS0 quiet init_on_alloc=0 panic=-1"

// BuildVM builds a bootable VM image offline from the host's packages:
// "debian" is the "debian" recipe's root filesystem (debootstrap from the
// host's apt mirror, shared with Bootstrap) with a kernel from Debian's
// packages, systemd, GRUB in the disk's MBR (it boots through the
// firmware) and a service that runs dsec-guest, the agent, from the
// read-only disk the node attaches to every VM (so the image does not
// depend on the node's dsec version). The kernel and initramfs are kept
// beside the disk for direct boot. The finished disk is cached in
// opts.CacheDir, so one build serves every store on the host.
//
// The kernel's package builds GRUB's initramfs on the host, in the root
// filesystem; the build then runs the image's own kernel once under QEMU
// (software emulation) to install GRUB from inside the guest, so the host
// needs neither loop devices nor GRUB: only debootstrap, mkfs.ext4,
// qemu-img and qemu-system-x86_64.
func (s *Store) BuildVM(ctx context.Context, recipe, as string, opts BootstrapOptions, progress Progress) (*Image, error) {
	if as == "" {
		as = recipe + "-vm"
	}
	if err := ValidName(as); err != nil {
		return nil, err
	}
	if recipe != "debian" {
		return nil, errdefs.Invalid("unknown VM image recipe %q (have %s)", recipe, strings.Join(VMRecipes, ", "))
	}
	if err := s.admit(); err != nil {
		return nil, err
	}
	defer s.fit()
	if opts.CacheDir == "" {
		opts.CacheDir = filepath.Join(s.dir, "cache")
	}
	diskMB := opts.DiskMB
	if diskMB == 0 {
		diskMB = defaultVMDiskMB
	}
	if diskMB < 1024 || diskMB > 1<<20 {
		return nil, errdefs.Invalid("VM image disk size %d MiB out of range [1024, %d]", diskMB, 1<<20)
	}
	tools := map[string]string{"debootstrap": "debootstrap", "mkfs.ext4": "e2fsprogs",
		"qemu-img": "qemu-utils", "qemu-system-x86_64": "qemu-system-x86"}
	for tool, pkg := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, errdefs.Unavailable("%s is not installed on the node (apt-get install %s)", tool, pkg)
		}
	}
	mirror, suite, err := aptSource(opts)
	if err != nil {
		return nil, err
	}
	dkey, dbuild := debianBuild(mirror, suite, DebianPackages)
	lower := &cachedBuild{key: dkey, recipe: "debian", build: dbuild}
	pkgs := append(append([]string(nil), VMDebianPackages...), opts.Packages...)
	sort.Strings(pkgs)
	h := sha256.Sum256([]byte(fmt.Sprintf("%s|%s|%s|%d|%s", mirror, dkey, strings.Join(pkgs, ","), diskMB, vmBuildVersion)))
	key := "debian-" + suite + "-" + hex.EncodeToString(h[:6])
	cache := filepath.Join(opts.CacheDir, "vm", key)
	if err := os.MkdirAll(filepath.Dir(cache), 0o700); err != nil {
		return nil, err
	}
	// Stores on one host share the cache: one builds, the others wait.
	unlock, err := lockFile(cache + ".lock")
	if err != nil {
		return nil, err
	}
	defer unlock()
	if opts.Force {
		os.RemoveAll(cache)
		os.Remove(cache + ".complete")
	}
	if _, err := os.Stat(cache + ".complete"); err != nil {
		start := time.Now()
		progress.report("build", "building the "+recipe+" VM image", 0, 0)
		tmp := cache + ".building"
		os.RemoveAll(tmp)
		if err := os.MkdirAll(tmp, 0o700); err != nil {
			return nil, err
		}
		// The root filesystem under the VM's own packages is built (or
		// found) first.
		if err := lower.ensure(ctx, opts.CacheDir, false, progress); err != nil {
			return nil, err
		}
		if err := buildDebianVM(ctx, tmp, lower.dir, mirror, suite, pkgs, diskMB, progress); err != nil {
			os.RemoveAll(tmp)
			return nil, err
		}
		if err := syncFS(tmp); err != nil {
			return nil, err
		}
		os.RemoveAll(cache)
		if err := os.Rename(tmp, cache); err != nil {
			return nil, err
		}
		if err := os.WriteFile(cache+".complete", []byte(time.Now().UTC().Format(time.RFC3339)), 0o600); err != nil {
			return nil, err
		}
		s.log.Info("built VM image", slog.String("recipe", recipe), slog.String("cache_key", key), slog.Duration("took", time.Since(start).Round(time.Second)))
	}
	var c struct {
		Digest string  `json:"digest"`
		Meta   VMImage `json:"meta"`
	}
	b, err := os.ReadFile(filepath.Join(cache, "build.json"))
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err != nil {
		return nil, errdefs.Internal(err, "read the cached VM image (rebuild with --force)")
	}
	progress.report("unpack", "importing the "+recipe+" VM image", 0, 0)
	img, err := s.addVMLayer(tenant.ImageOwner(ctx), as, "build-vm:"+key, cache, c.Digest, &c.Meta)
	if err != nil {
		return nil, err
	}
	progress.report("done", as, img.Size, img.Size)
	return img, nil
}

// buildDebianVM builds the debian VM image's files into dir: disk.qcow2,
// vmlinuz, initrd.img and build.json (digest and VMImage). Its root file
// system is lower (the "debian" recipe's) with pkgs installed over it in
// an overlay that only lives for the build.
func buildDebianVM(ctx context.Context, dir, lower, mirror, suite string, pkgs []string, diskMB int64, progress Progress) error {
	raw := filepath.Join(dir, "disk.raw")
	var release string
	upper := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(upper, 0o755); err != nil {
		return err
	}
	err := overlayBuild(lower, upper, func(rootfs string) error {
		// The kernel's package builds the initramfs GRUB boots: a small
		// one, with only what a VM boots from.
		if err := writeFiles(rootfs, initramfsConfig); err != nil {
			return err
		}
		if err := aptInstall(ctx, rootfs, mirror, suite, pkgs, progress); err != nil {
			return err
		}
		progress.report("build", "configuring the guest", 0, 0)
		if err := configureVMRootfs(rootfs); err != nil {
			return fmt.Errorf("configure the VM image: %w", err)
		}
		kernels, _ := filepath.Glob(filepath.Join(rootfs, "boot", "vmlinuz-*"))
		if len(kernels) != 1 {
			return fmt.Errorf("the VM image should hold one kernel, found %d", len(kernels))
		}
		release = strings.TrimPrefix(filepath.Base(kernels[0]), "vmlinuz-")
		if _, err := os.Stat(filepath.Join(rootfs, "boot", "initrd.img-"+release)); err != nil {
			return fmt.Errorf("the kernel's package built no initramfs: %w", err)
		}
		if err := copyPlain(kernels[0], filepath.Join(dir, VMKernelFile)); err != nil {
			return err
		}
		// Direct boot takes a small initramfs of our own: busybox and the
		// two modules that reach the disk, no udev (much faster under
		// emulation than the distribution's, which GRUB boots).
		if err := writeVMInitramfs(filepath.Join(dir, VMInitrdFile), rootfs, release); err != nil {
			return fmt.Errorf("build the direct-boot initramfs: %w", err)
		}
		// The disk is the merged tree, written before overlayBuild
		// cleans it: clean it first (overlayBuild's pass then finds
		// nothing).
		cleanInstall(rootfs)
		progress.report("build", "writing the disk", 0, 0)
		return writeVMDisk(ctx, raw, rootfs, diskMB)
	})
	if err != nil {
		return err
	}
	if err := os.RemoveAll(upper); err != nil {
		return err
	}
	progress.report("build", "installing GRUB (in a VM)", 0, 0)
	if err := setupVMDisk(ctx, raw, filepath.Join(dir, VMKernelFile), filepath.Join(dir, VMInitrdFile), filepath.Join(dir, "setup.log")); err != nil {
		return err
	}
	progress.report("build", "converting the disk to qcow2", 0, 0)
	if out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", raw, filepath.Join(dir, VMDiskFile)).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img convert: %v: %s", err, bytes.TrimSpace(out))
	}
	os.Remove(raw)
	meta := VMImage{VirtualSize: diskMB << 20, Firmware: "bios", DirectBoot: true, Cmdline: VMCmdline, Agent: "node"}
	digest, err := vmDigest(dir, &meta)
	if err != nil {
		return err
	}
	b, _ := json.MarshalIndent(map[string]any{"digest": digest, "meta": meta, "kernel": release, "packages": pkgs}, "", "  ")
	return os.WriteFile(filepath.Join(dir, "build.json"), b, 0o600)
}

// vmFile is a file a VM image's root filesystem gets.
type vmFile struct {
	path, body string
	mode       os.FileMode
}

// initramfsConfig makes the distribution's initramfs (the one GRUB boots)
// small: only the drivers that reach a VM's disk.
var initramfsConfig = []vmFile{
	{"etc/initramfs-tools/conf.d/dsec.conf", "MODULES=list\n", 0o644},
	{"etc/initramfs-tools/modules", "virtio_pci\nvirtio_blk\n", 0o644},
}

// writeFiles writes files under root, replacing what is there.
func writeFiles(root string, files []vmFile) error {
	for _, f := range files {
		p := filepath.Join(root, f.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		os.Remove(p)
		if err := os.WriteFile(p, []byte(f.body), f.mode); err != nil {
			return err
		}
	}
	return nil
}

// configureVMRootfs turns a debootstrapped root file system into a VM
// guest: its disk mounted by label, a quiet and quick boot (no timers
// that fetch or scrub, no serial login), a root shell on the screen, a
// transient machine ID (each boot and each restored fork gets its own),
// the agent's service, and the one-time setup script setupVMDisk runs.
func configureVMRootfs(root string) error {
	files := []vmFile{
		// The initramfs mounts the root file system read-write (VMCmdline).
		{"etc/fstab", "# / is LABEL=" + vmRootLabel + ", mounted read-write by the initramfs (see the kernel command line)\n", 0o644},
		{"etc/hosts", "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n", 0o644},
		// Empty: systemd makes a new one at every boot and does not commit it.
		{"etc/machine-id", "", 0o444},
		{"etc/default/grub", "GRUB_DEFAULT=0\nGRUB_TIMEOUT=0\nGRUB_TIMEOUT_STYLE=hidden\nGRUB_DISTRIBUTOR=Debian\n" +
			"GRUB_CMDLINE_LINUX_DEFAULT=\"\"\nGRUB_CMDLINE_LINUX=\"" + strings.TrimPrefix(VMCmdline, "root=LABEL="+vmRootLabel+" ro ") + "\"\n" +
			"GRUB_TERMINAL=console\nGRUB_DISABLE_OS_PROBER=true\nGRUB_DISABLE_RECOVERY=true\n", 0o644},
		{"etc/systemd/system/dsec-agent.service", vmAgentUnit, 0o644},
		{"usr/local/lib/dsec/agent", vmAgentScript, 0o755},
		{"usr/local/lib/dsec/vm-setup", vmSetupScript, 0o755},
		{"etc/systemd/system/getty@tty1.service.d/autologin.conf",
			"[Service]\nExecStart=\nExecStart=-/sbin/agetty --autologin root --noclear %I $TERM\n", 0o644},
		{"etc/systemd/journald.conf.d/dsec.conf", "[Journal]\nStorage=volatile\nRuntimeMaxUse=16M\n", 0o644},
	}
	if err := writeFiles(root, files); err != nil {
		return err
	}
	os.Remove(filepath.Join(root, "var/lib/dbus/machine-id"))
	links := map[string]string{
		"etc/systemd/system/multi-user.target.wants/dsec-agent.service": "/etc/systemd/system/dsec-agent.service",
	}
	// The serial console is the node's log, not a terminal, and the screen
	// has one login (tty1); nothing fetches, scrubs or trims in the
	// background of a sandbox. A boot under emulation runs on one slow
	// CPU, so what a sandbox VM does not need is not started at all: binfmt
	// handlers, hugetlbfs, debugfs, tracefs, configfs and fusectl mounts,
	// EFI and device-mapper modules, the random seed file (the node seeds
	// the guest at every channel session).
	for _, unit := range []string{"serial-getty@ttyS0.service", "apt-daily.timer", "apt-daily-upgrade.timer",
		"e2scrub_all.timer", "e2scrub_reap.service", "fstrim.timer", "systemd-machine-id-commit.service",
		"systemd-firstboot.service", "dpkg-db-backup.timer", "getty-static.service",
		"systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount", "proc-sys-fs-binfmt_misc.mount",
		"dev-hugepages.mount", "sys-kernel-debug.mount", "sys-kernel-tracing.mount", "sys-kernel-config.mount",
		"sys-fs-fuse-connections.mount", "modprobe@efi_pstore.service", "modprobe@dm_mod.service",
		"systemd-random-seed.service"} {
		links["etc/systemd/system/"+unit] = "/dev/null"
	}
	for p, target := range links {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return err
		}
		os.Remove(full)
		if err := os.Symlink(target, full); err != nil {
			return err
		}
	}
	return nil
}

// vmAgentUnit runs the agent as a service, once the system has booted. It
// restarts if it dies, and the OOM killer spares it.
const vmAgentUnit = `[Unit]
Description=dsec agent (dsec-guest)
Documentation=https://github.com/opendsec/dsec/blob/main/docs/substrates/vm.md
# Answer once the system is up: the node takes an image's boot snapshot
# when the agent first answers, and that should be an idle, booted system.
After=multi-user.target

[Service]
ExecStart=/usr/local/lib/dsec/agent
Restart=always
RestartSec=1
OOMScoreAdjust=-1000
Environment=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8

[Install]
WantedBy=multi-user.target
`

// vmAgentScript starts the agent: the node's own, from the read-only disk
// with serial number dsec-agent the vm driver attaches (an uncompressed tar
// archive holding dsec-guest; unpacked on the root file system, as /run is
// noexec), else one installed in the image. Its flags
// serve the virtio-serial port named dsec.agent and power the machine off
// at the sandbox's deadline.
const vmAgentScript = `#!/bin/sh
# Starts dsec-guest, the dsec agent (see docs/substrates/vm.md).
flags="-listen-port dsec.agent -vm"
for b in /sys/block/*; do
	if [ "$(cat "$b/serial" 2>/dev/null)" = dsec-agent ]; then
		mkdir -p /var/lib/dsec
		tar -xf "/dev/${b##*/}" -C /var/lib/dsec dsec-guest && exec /var/lib/dsec/dsec-guest $flags
	fi
done
exec /usr/local/bin/dsec-guest $flags
`

// vmSetupScript runs once, as init, in a VM the build starts: it installs
// GRUB into the disk's MBR, writes GRUB's configuration (for the kernel
// and the initramfs its package built) and powers off.
const vmSetupScript = `#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
[ -e /proc/self ] || mount -t proc proc /proc
[ -e /sys/block ] || mount -t sysfs sys /sys
mount -o remount,rw /
ok=1
grub-install --target=i386-pc /dev/vda || ok=0
update-grub || ok=0
sync
mount -o remount,ro / || echo u >/proc/sysrq-trigger
sync
if [ $ok = 1 ]; then echo DSEC-SETUP-OK >/dev/ttyS0; else echo DSEC-SETUP-FAILED >/dev/ttyS0; fi
echo o >/proc/sysrq-trigger
sleep 60
`

// writeVMDisk writes a raw disk of sizeMB: an MBR with one bootable
// Linux partition from 1 MiB to the end, holding an ext4 file system
// made from root (mkfs.ext4 -d, no mount).
func writeVMDisk(ctx context.Context, path, root string, sizeMB int64) error {
	size := sizeMB << 20
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	f.Close()
	const start = 1 << 20
	// Features GRUB 2.06 and the 6.1 kernel both read.
	cmd := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-L", vmRootLabel, "-E", fmt.Sprintf("offset=%d", start),
		"-d", root, path, fmt.Sprintf("%dk", (size-start)>>10))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4: %v: %s", err, bytes.TrimSpace(out))
	}
	return writeMBR(path, start/512, (size-start)/512)
}

// writeMBR writes a DOS partition table with one bootable Linux
// partition (LBA addressing) into the first sector of path.
func writeMBR(path string, first, sectors int64) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	var e [16]byte
	e[0] = 0x80                            // bootable
	copy(e[1:4], []byte{0xfe, 0xff, 0xff}) // CHS: beyond 8 GiB, use LBA
	e[4] = 0x83                            // Linux
	copy(e[5:8], []byte{0xfe, 0xff, 0xff})
	binary.LittleEndian.PutUint32(e[8:], uint32(first))
	binary.LittleEndian.PutUint32(e[12:], uint32(sectors))
	if _, err := f.WriteAt(e[:], 446); err != nil {
		return err
	}
	if _, err := f.WriteAt([]byte{0x55, 0xaa}, 510); err != nil {
		return err
	}
	return f.Sync()
}

// setupVMDisk boots the disk's own kernel once, from the direct-boot
// initramfs, with the setup script as init (TCG: it runs anywhere) and
// checks that it finished.
func setupVMDisk(ctx context.Context, raw, kernel, initrd, logPath string) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64",
		"-M", "q35", "-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "1",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-serial", "file:"+logPath,
		"-kernel", kernel, "-initrd", initrd,
		"-append", "root=LABEL="+vmRootLabel+" rw console=ttyS0 panic=-1 init=/usr/local/lib/dsec/vm-setup",
		"-drive", "file="+raw+",format=raw,if=virtio,cache=unsafe")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("the setup VM failed: %v: %s", err, bytes.TrimSpace(out))
	}
	b, _ := os.ReadFile(logPath)
	if !bytes.Contains(b, []byte("DSEC-SETUP-OK")) {
		tail := string(b)
		if len(tail) > 2000 {
			tail = tail[len(tail)-2000:]
		}
		return fmt.Errorf("the setup VM did not install GRUB and the initramfs:\n%s", tail)
	}
	return nil
}

// initModules are the modules a VM's direct-boot initramfs loads to reach
// its disk (with what they depend on).
var initModules = []string{"virtio_pci", "virtio_blk"}

// vmInit is the direct-boot initramfs's init: it loads the disk's
// drivers, mounts the root file system named by root=LABEL= (read-write
// with rw), and hands over to the image's init (systemd). Failures are
// printed on the console (the node reports them) and panic the kernel.
const vmInit = `#!/bin/busybox sh
export PATH=/bin
busybox mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "dsec-initramfs: $*" >/dev/console; exit 1; }
for m in $(cat /modules.list); do insmod /lib/modules/$m.ko || fail "load $m"; done
root= mode=ro init=/sbin/init
for a in $(cat /proc/cmdline); do
	case $a in
	root=*) root=${a#root=} ;;
	rw) mode=rw ;;
	ro) mode=ro ;;
	init=*) init=${a#init=} ;;
	esac
done
i=0
while ! dev=$(findfs "$root" 2>/dev/null); do
	i=$((i+1)); [ $i -gt 3000 ] && fail "no disk $root"
	usleep 10000
done
mkdir -p /root
mount -t ext4 -o $mode "$dev" /root || fail "mount $root"
mount --move /dev /root/dev
umount /sys
# Applets run by bare name need /proc/self/exe: switch_root is called by
# its file.
umount /proc
exec /bin/busybox switch_root /root "$init"
`

// writeVMInitramfs writes the direct-boot initramfs: the host's static
// busybox, the image's own modules that reach a virtio disk (in
// dependency order, from its modules.dep) and vmInit.
func writeVMInitramfs(path, rootfs, release string) error {
	bb, err := findBusybox()
	if err != nil {
		return err
	}
	moddir := filepath.Join(rootfs, "lib/modules", release)
	dep, err := os.ReadFile(filepath.Join(moddir, "modules.dep"))
	if err != nil {
		return err
	}
	deps := map[string][]string{} // module name -> its file, then its dependencies' files
	for _, line := range strings.Split(string(dep), "\n") {
		mod, rest, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		deps[modName(mod)] = append([]string{mod}, strings.Fields(rest)...)
	}
	var order []string
	seen := map[string]bool{}
	var visit func(name string) error
	visit = func(name string) error {
		if seen[name] {
			return nil
		}
		seen[name] = true
		files, ok := deps[name]
		if !ok {
			return nil // built into the kernel
		}
		for _, d := range files[1:] {
			if err := visit(modName(d)); err != nil {
				return err
			}
		}
		order = append(order, files[0])
		return nil
	}
	for _, m := range initModules {
		if _, ok := deps[m]; !ok {
			return fmt.Errorf("kernel %s has no module %s", release, m)
		}
		if err := visit(m); err != nil {
			return err
		}
	}
	var buf bytes.Buffer
	c := cpio.NewWriter(&buf)
	c.FileFrom("bin/busybox", 0o755, bb)
	for _, d := range []string{"dev", "proc", "sys", "root", "lib/modules"} {
		c.Dir(d, 0o755)
	}
	c.CharDev("dev/console", 0o600, 5, 1)
	var list []string
	for _, f := range order {
		if !strings.HasSuffix(f, ".ko") {
			return fmt.Errorf("module %s is compressed; the initramfs loads plain .ko files", f)
		}
		name := modName(f)
		c.FileFrom("lib/modules/"+name+".ko", 0o644, filepath.Join(moddir, f))
		list = append(list, name)
	}
	c.File("modules.list", 0o644, []byte(strings.Join(list, "\n")+"\n"))
	c.File("init", 0o755, []byte(vmInit))
	if err := c.Close(); err != nil {
		return err
	}
	return os.WriteFile(path, buf.Bytes(), 0o644)
}

// modName is a module's name from its path in modules.dep.
func modName(p string) string {
	return strings.TrimSuffix(filepath.Base(p), ".ko")
}

func copyPlain(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o644)
}
