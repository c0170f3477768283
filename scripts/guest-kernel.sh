#!/usr/bin/env bash
# Prepares the guest kernel of the microvm substrate in DEST (default
# $DSEC_CACHE_DIR/guest-kernel): Debian's linux-image-cloud-amd64 is
# downloaded with apt (not installed on the host), its bzImage is
# decompressed into a vmlinux with a PVH entry, and the modules the guest's
# initramfs loads (block, console, balloon, rng, file systems, vsock, and
# the NIC's for sandboxes with egress) are copied next to it. Idempotent;
# concurrent runs wait for each other.
set -euo pipefail

dest=${1:-${DSEC_CACHE_DIR:-.dsec/cache}/guest-kernel}
mkdir -p "$(dirname "$dest")"
exec 9>"$dest.lock"
flock 9
# A kernel prepared before a module was added to the list below is
# prepared again.
[[ -s $dest/vmlinux && -s $dest/release && -s $dest/modules/virtio_net.ko ]] && exit 0

meta=${GUEST_KERNEL_PACKAGE:-linux-image-cloud-amd64}
pkg=$(apt-cache depends "$meta" 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
if [[ -z $pkg ]]; then
	apt-get update -q >/dev/null
	pkg=$(apt-cache depends "$meta" | awk '/Depends: linux-image-/{print $2; exit}')
fi
[[ -n $pkg ]] || { echo "guest-kernel: cannot resolve $meta" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
(cd "$work" && apt-get download -q "$pkg" >/dev/null 2>&1 || { chown _apt "$work" 2>/dev/null; apt-get download -q "$pkg"; })
dpkg-deb -x "$work"/*.deb "$work/x"
release=${pkg#linux-image-}
bz="$work/x/boot/vmlinuz-$release"
[[ -f $bz ]] || { echo "guest-kernel: $pkg has no /boot/vmlinuz-$release" >&2; exit 1; }

# Decompress the bzImage's payload (like the kernel's scripts/extract-vmlinux).
extract() { # MAGIC-as-printf DECOMPRESSOR...
	local magic=$1; shift
	local off
	for off in $(LC_ALL=C grep -obUaP "$magic" "$bz" | cut -d: -f1); do
		if tail -c +$((off + 1)) "$bz" | "$@" >"$work/vmlinux" 2>/dev/null || [[ -s $work/vmlinux ]]; then
			if LC_ALL=C readelf -h "$work/vmlinux" >/dev/null 2>&1; then return 0; fi
		fi
	done
	return 1
}
extract '\x02\x21\x4c\x18' lz4 -dc ||
	extract '\x28\xb5\x2f\xfd' zstd -dcq ||
	extract '\xfd\x37\x7a\x58\x5a\x00' xz -dcq ||
	extract '\x1f\x8b\x08' gzip -dcq ||
	{ echo "guest-kernel: cannot decompress $bz (need lz4, zstd, xz or gzip)" >&2; exit 1; }

mods="$work/x/lib/modules/$release/kernel"
out="$dest.new"
rm -rf "$out"
mkdir -p "$out/modules"
for m in drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_mmio \
	drivers/block/virtio_blk drivers/char/virtio_console drivers/virtio/virtio_balloon \
	drivers/char/hw_random/virtio-rng lib/libcrc32c fs/erofs/erofs fs/overlayfs/overlay \
	net/vmw_vsock/vsock net/vmw_vsock/vmw_vsock_virtio_transport_common \
	net/vmw_vsock/vmw_vsock_virtio_transport \
	net/core/failover drivers/net/net_failover drivers/net/virtio_net; do
	[[ -f $mods/$m.ko ]] || { echo "guest-kernel: $pkg lacks $m.ko" >&2; exit 1; }
	cp "$mods/$m.ko" "$out/modules/"
done
mv "$work/vmlinux" "$out/vmlinux"
cp "$work/x/boot/config-$release" "$out/config"
echo "$release" >"$out/release"
rm -rf "$dest"
mv "$out" "$dest"
echo "guest-kernel: $release ready in $dest"
