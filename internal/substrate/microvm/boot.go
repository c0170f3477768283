package microvm

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"

	"github.com/opendsec/dsec/internal/cpio"
	"github.com/opendsec/dsec/internal/substrate/qemu"
)

// initModules are loaded by the initramfs, in order (virtio_ring before
// virtio). The vsock ones are loaded only when the channel is vsock.
var initModules = []string{
	"virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console",
	"virtio_balloon", "virtio-rng", "libcrc32c", "erofs", "overlay",
}

var vsockModules = []string{"vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport"}

// netModules drive the NIC of a sandbox with egress; the initramfs loads
// them only when the kernel command line carries dsec.net.
var netModules = []string{"failover", "net_failover", "virtio_net"}

// initScript is the initramfs's /init. It loads the virtio and filesystem
// modules, finds the two disks by their serial numbers, mounts the image
// (EROFS, read-only, shared by every VM of the image) under an overlay
// whose upper layer is on the sandbox's own ext4 disk, mounts the API
// file systems, and hands PID 1 to dsec-guest. Any failure prints a line
// starting with "dsec-init:" and powers off, so the node sees QEMU exit.
// The kernel argument dsec.init=hold stops the boot before the agent
// starts (to debug a guest from its console, and to test boot timeouts).
// With dsec.net (a guest.NetConfig), the NIC's modules are loaded and the
// agent configures the interface before it answers.
const initScript = `#!/bin/busybox sh
B=/bin/busybox
fail() { echo "dsec-init: $*" >/dev/ttyS0; $B sync; $B poweroff -f; }
$B mount -t proc -o nosuid,nodev,noexec proc /proc || fail "mount /proc"
# With /proc/self/exe there, Debian's static busybox runs applets called
# by bare name in the shell itself or in a fork without exec: much cheaper
# than an exec per step under emulation.
export PATH=/bin
mount -t devtmpfs -o nosuid,mode=0755 dev /dev || fail "mount /dev"
mount -t sysfs -o nosuid,nodev,noexec sys /sys
for m in $(cat /modules.list); do
	insmod /lib/modules/$m.ko || fail "load module $m"
done
# Report free memory to the host in 128 KiB blocks, not only whole 2 MiB
# page blocks, so an idle guest gives back what it freed.
[ -w /sys/module/page_reporting/parameters/page_reporting_order ] &&
	echo 5 >/sys/module/page_reporting/parameters/page_reporting_order
host=sandbox; deadline=0; chan=port; net=
for a in $(cat /proc/cmdline); do
	case $a in
	dsec.hostname=*) host=${a#dsec.hostname=} ;;
	dsec.deadline=*) deadline=${a#dsec.deadline=} ;;
	dsec.chan=*) chan=${a#dsec.chan=} ;;
	dsec.net=*) net=${a#dsec.net=} ;;
	dsec.init=hold) echo "dsec-init: holding before the agent (dsec.init=hold)" >/dev/ttyS0; while :; do sleep 3600; done ;;
	esac
done
if [ -n "$net" ]; then
	[ -e /net-modules.list ] || fail "dsec.net given but the initramfs has no NIC driver"
	for m in $(cat /net-modules.list); do
		insmod /lib/modules/$m.ko || fail "load module $m"
	done
fi
img=; disk=
i=0
while [ $i -lt 500 ]; do
	for b in /sys/block/vd*; do
		[ -e $b/serial ] || continue
		case $(cat $b/serial) in
		dsec-image) img=/dev/${b##*/} ;;
		dsec-disk) disk=/dev/${b##*/} ;;
		esac
	done
	[ -n "$img" ] && [ -n "$disk" ] && break
	usleep 10000; i=$((i+1))
done
[ -n "$img" ] || fail "no image disk"
[ -n "$disk" ] || fail "no writable disk"
mkdir -p /lower /rw /newroot
mount -t erofs -o ro $img /lower || fail "mount the image"
mount -t ext4 -o noatime,nodev $disk /rw || fail "mount the writable disk"
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work,nodev overlay /newroot || fail "mount the root overlay"
R=/newroot
mount -t proc -o nosuid,nodev,noexec proc $R/proc
mount -t sysfs -o nosuid,nodev,noexec sys $R/sys
mount --move /dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620,gid=5 devpts $R/dev/pts
ln -sf pts/ptmx $R/dev/ptmx 2>/dev/null
mount -t tmpfs -o nosuid,nodev,mode=1777 shm $R/dev/shm
mount -t tmpfs -o nosuid,nodev,mode=0755 run $R/run
mount -t tmpfs -o nosuid,nodev,mode=0755,size=1m etc $R/.dsec/etc
echo "$host" >$R/.dsec/etc/hostname
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n' "$host" >$R/.dsec/etc/hosts
: >$R/.dsec/etc/resolv.conf
for f in hostname hosts resolv.conf; do mount --bind $R/.dsec/etc/$f $R/etc/$f; done
hostname "$host"
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
listen="-listen-port dsec.agent"
[ "$chan" = vsock ] && listen="-listen-vsock 1024"
[ -n "$net" ] && listen="$listen -net $net"
exec $B env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
	$B switch_root $R /.dsec/guest $listen -deadline $deadline
`

// buildInitramfs writes the initramfs for kernel k into dir (named by its
// content, so restores of old snapshots find theirs) and returns its
// path. The NIC's modules go in when k has them (netModules reports
// whether it did).
func buildInitramfs(dir string, k *qemu.Kernel, busybox string, vsock bool) (path string, withNet bool, err error) {
	var buf bytes.Buffer
	c := cpio.NewWriter(&buf)
	c.FileFrom("bin/busybox", 0o755, busybox)
	for _, d := range []string{"dev", "proc", "sys", "lib/modules"} {
		c.Dir(d, 0o755)
	}
	c.CharDev("dev/console", 0o600, 5, 1)
	c.CharDev("dev/ttyS0", 0o600, 4, 64)
	mods := append([]string(nil), initModules...)
	if vsock {
		mods = append(mods, vsockModules...)
	}
	var list bytes.Buffer
	for _, m := range mods {
		if !k.HasModule(m) {
			return "", false, fmt.Errorf("the guest kernel lacks module %s", m)
		}
		c.FileFrom("lib/modules/"+m+".ko", 0o644, k.Module(m))
		fmt.Fprintln(&list, m)
	}
	c.File("modules.list", 0o644, list.Bytes())
	withNet = true
	for _, m := range netModules {
		withNet = withNet && k.HasModule(m)
	}
	if withNet {
		list.Reset()
		for _, m := range netModules {
			c.FileFrom("lib/modules/"+m+".ko", 0o644, k.Module(m))
			fmt.Fprintln(&list, m)
		}
		c.File("net-modules.list", 0o644, list.Bytes())
	}
	c.File("init", 0o755, []byte(initScript))
	if err := c.Close(); err != nil {
		return "", false, err
	}
	sum := sha256.Sum256(buf.Bytes())
	p := filepath.Join(dir, "initramfs-"+hex.EncodeToString(sum[:8])+".cpio")
	if _, err := os.Stat(p); err == nil {
		return p, withNet, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", false, err
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, buf.Bytes(), 0o644); err != nil {
		return "", false, err
	}
	return p, withNet, os.Rename(tmp, p)
}
