#!/bin/bash
# Runs E2B's own JavaScript SDK tests, unmodified, against a dsec on loopback and reports how
# many of the tests that reach a server pass. CI cannot reach E2B's repository, so this is a
# developer's measurement, not part of `make test`; our own tests (test/e2b) port the behaviours.
#
#   test/e2b/upstream/run.sh E2B_CHECKOUT [TAG] [TEST PATHS...]
#
# E2B_CHECKOUT is a git clone of github.com/e2b-dev/E2B; TAG defaults to e2b@2.45.0; TEST PATHS
# (relative to packages/js-sdk) default to `tests/sandbox tests/api`. The work directory
# (WORK, default /tmp/dsec-e2b-upstream) receives the exported SDK, its npm dependencies, the
# server's data and log, and the vitest JSON reports. The server is `bin/dsec serve` of this
# repository (run `make build` first) with an API key in E2B's form and the base image (the
# tests' template); extra serve flags come from DSEC_SERVE_ARGS, extra images from
# DSEC_EXTRA_IMAGES. E2B_PORTS_DOMAIN=1 also serves the
# E2B domain e2b.localhost:PORT over TLS on 127.0.0.2:PORT, so the tests that fetch
# sandbox.getHost(port) reach it: the SDK trusts the server's CA (NODE_EXTRA_CA_CERTS) and
# resolves *.e2b.localhost with test/e2b/resolve.mjs (docs/e2b.md, "TLS and host names").
# With E2B_PORTS_DOMAIN, E2B_HOST_NAMES=1 leaves E2B_SANDBOX_URL empty, so the SDK reaches every
# sandbox by host name (https://<port>-<id>.<domain>) as it does on E2B's cloud.
#
# A test counts as client-only when its file mocks the network (msw) or when it passes against
# an address where nothing listens; every other test is a server test.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
src=${1:?usage: run.sh E2B_CHECKOUT [TAG] [TEST PATHS...]}
tag=${2:-e2b@2.45.0}
shift $(( $# >= 2 ? 2 : 1 ))
paths=${*:-tests/sandbox tests/api}
work=${WORK:-/tmp/dsec-e2b-upstream}
port=${PORT:-7799}
domain_args= domain_env=
key=e2b_$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')

sdk=$work/${tag//[@\/]/-}
if [ ! -d "$sdk/node_modules" ]; then
	rm -rf "$sdk" && mkdir -p "$sdk"
	git -C "$src" archive "$tag" packages/js-sdk | tar -x -C "$sdk" --strip-components=2
	# Keep the SDK's own dependencies and what its Node tests import; drop the browser,
	# Cloudflare and build tooling the Node tests do not use.
	python3 "$here/trim.py" "$sdk/package.json"
	cp "$here/vitest.config.mts" "$sdk/vitest.config.mts"
	(cd "$sdk" && npm install --no-audit --no-fund --loglevel=error)
fi

vitest() { # out.json api-url [sandbox-url]
	(cd "$sdk" && E2B_API_KEY=$key E2B_API_URL=$2 E2B_SANDBOX_URL=${3-$2} env $domain_env \
		npx vitest run --project unit --maxWorkers 2 --reporter=json --outputFile="$1" $paths \
		>"${1%.json}.log" 2>&1) || true
}

# Which tests pass with no server at all.
[ -f "$sdk/noserver.json" ] || vitest "$sdk/noserver.json" http://127.0.0.1:1

data=$work/data
rm -rf "$data" && mkdir -p "$data"
if [ -n "${E2B_PORTS_DOMAIN:-}" ]; then
	domain_args="--e2b-domain e2b.localhost:$port --e2b-tls-listen 127.0.0.2:$port"
	domain_env="NODE_EXTRA_CA_CERTS=$data/e2b-ca.pem DSEC_TEST_RESOLVE=e2b.localhost=127.0.0.2 NODE_OPTIONS=--import=$here/../resolve.mjs"
fi
"$repo/bin/dsec" serve --listen 127.0.0.1:$port --data-dir "$data" --log-level warn \
	--bootstrap busybox,debian,base${DSEC_EXTRA_IMAGES:+,$DSEC_EXTRA_IMAGES} --api-key "$key" \
	$domain_args ${DSEC_SERVE_ARGS:-} >"$work/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 1200); do
	curl -sf 127.0.0.1:$port/healthz >/dev/null && break
	kill -0 $pid 2>/dev/null || { cat "$work/serve.log"; exit 1; }
	sleep 0.5
done
if [ -n "${E2B_HOST_NAMES:-}" ]; then
	# As on E2B's cloud: sandboxes by host name only (E2B_SANDBOX_URL empty).
	vitest "$sdk/dsec.json" http://127.0.0.1:$port ""
else
	vitest "$sdk/dsec.json" http://127.0.0.1:$port
fi
python3 "$here/report.py" "$sdk" "$sdk/noserver.json" "$sdk/dsec.json"
