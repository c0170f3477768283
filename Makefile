# dsec — two commands for a fresh machine:
#   make run    set up, build, and start `dsec serve` on 127.0.0.1:7070 (state in ./.dsec)
#   make test   set up, build, and run every test

SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
export GOFLAGS ?= -mod=mod

DATA_DIR  ?= $(CURDIR)/.dsec
CACHE_DIR ?= $(DATA_DIR)/cache
export DSEC_CACHE_DIR := $(CACHE_DIR)
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LISTEN    ?= 127.0.0.1:7070

.PHONY: all setup build run test test-go test-rootless test-python proto bench bench-microvm bench-vm bench-cluster bench-gateway bench-burst bench-image bench-report clean

all: build

setup:
	@bash scripts/setup.sh

build:
	@mkdir -p bin
	go build -trimpath -ldflags "-X main.version=$(VERSION)" -o bin/dsec ./cmd/dsec
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o bin/dsec-guest ./cmd/dsec-guest

run: setup build
	bin/dsec serve --listen $(LISTEN) --data-dir $(DATA_DIR) --cache-dir $(CACHE_DIR) --bootstrap busybox,debian,base

# After every test, nothing the tests made may be left on the host
# (servers, agents, QEMU, cgroups, mounts, loop devices, links, nftables
# tables, temporary files): scripts/leftovers compares with before. Every
# part runs even if one before it failed (-k), and the leftovers are
# checked whatever the outcome; the run fails if any of it did.
test: setup build
	@mkdir -p $(DATA_DIR)
	go run ./scripts/leftovers save $(DATA_DIR)/leftovers.before
	$(MAKE) -k test-go test-rootless test-python; rc=$$?; \
		go run ./scripts/leftovers check $(DATA_DIR)/leftovers.before && exit $$rc

# The tests' servers run the binaries just built (internal/dsectest).
test-go test-python: export DSEC_TEST_BIN := $(CURDIR)/bin

# Every test runs: testreport fails the run when a test skipped for any
# reason but hardware this host lacks (a KVM that boots, a GPU), and keeps
# the full record in $(DATA_DIR)/go-test.json. The hostile suite runs alone,
# after the rest: it measures a neighbour sandbox's latency during each
# attack, which another package's load beside it would disturb.
HOSTILE := ./test/hostile
# The slowest packages start first (go test runs them in the order given),
# so they run side by side to the end instead of one long package running
# alone after the short ones. Three packages run at a time on a 2-core
# machine: much of a package's time is spent waiting (timeouts, TTLs,
# outages, guests), which a third package fills. The minute-long ones
# (container, the fault and cluster suites) come next: alphabetically,
# the fault suite started last and ran alone for its last minute.
SLOWEST := ./test/e2b ./test/verdicts ./test/e2e ./internal/image ./internal/substrate/vm ./internal/substrate/microvm \
	./internal/substrate/container ./test/fault ./test/cluster ./internal/cluster
test-go:
	go vet ./...
	@mkdir -p $(DATA_DIR)
	set -o pipefail; { go test -p 3 -count=1 -timeout 30m -json $$({ go list $(SLOWEST); go list ./... | grep -v '/test/hostile$$'; } | awk '!seen[$$0]++'); \
		go test -count=1 -timeout 25m -json $(HOSTILE); } | tee $(DATA_DIR)/go-test.json | go run ./scripts/testreport

# The node's unit tests need no root (they run over the rootless fake
# driver): run them once as nobody too, so that stays true.
test-rootless:
	set -e; d=$$(mktemp -d); trap 'rm -rf $$d' EXIT; chmod 1777 $$d; \
		go test -c -o $$d/node.test ./internal/node; \
		cd $$d && setpriv --reuid=65534 --regid=65534 --clear-groups env HOME=$$d TMPDIR=$$d ./node.test -test.count=1 -test.timeout 5m

# Three workers side by side (pytest-xdist), each with a server of its own
# and whole files (a file's tests may build on each other): the tests mostly
# wait on their sandboxes.
test-python:
	cd sdk/python && /usr/bin/python3 -m pytest -q -n 3 --dist loadfile tests

proto:
	protoc -I api --go_out=. --go_opt=module=github.com/opendsec/dsec \
		--connect-go_out=. --connect-go_opt=module=github.com/opendsec/dsec \
		api/dsec/v1/*.proto api/dsec/node/v1/*.proto api/dsec/guest/v1/*.proto \
		api/e2b/process/process.proto api/e2b/filesystem/filesystem.proto

bench: build
	go run ./bench/container

bench-microvm: build
	go run ./bench/microvm

bench-vm: build
	go run ./bench/vm

bench-cluster: setup
	go run ./bench/cluster

bench-burst: build
	go run ./bench/burst

bench-image: build
	go run ./bench/image

bench-report: build
	mkdir -p .dsec && go run ./bench/report -json .dsec/bench-report.json

bench-gateway: build
	go run ./bench/gateway

clean:
	rm -rf bin
