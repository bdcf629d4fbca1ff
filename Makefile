# dprank: build, test, demo, bench. `make help` lists the targets.
CARGO ?= cargo
WASM := target/wasm32-wasip1/release/dprank.wasm
export ENVOY_BIN ?= $(CURDIR)/.venv/bin/envoy
RUFF ?= $(CURDIR)/.venv/bin/ruff
PY_SOURCES := scripts docker tests

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
IMAGE ?= dprank-wasm:$(VERSION)

.PHONY: help setup build wasm noop-wasm tools test demo bench smg-sweep traces bench-pd bench-quick bench-full gateways-figure image lint clean

help:
	@echo "make demo   - one seeded trace through Envoy round robin, then Envoy + dprank, side by side"
	@echo "make test   - every test: unit, simulator, end-to-end in a real Envoy, doc links, deployment files, fuzz smoke"
	@echo "make bench  - the headline (<= 2 h, --dry-run prints it) at both ends of the lockstep bracket: capacities, capacity check, virtual time; three harness cells and agreement on the first; bench-results/headline/<preset>/"
	@echo "make smg-sweep   - smg's best setting per workload on tuning seeds (run before make bench; hours)"
	@echo "make traces - fetch the Mooncake FAST'25 traces (network) into target/traces/mooncake, checked"
	@echo "make bench-pd    - PD fleet: dprank vs the old rule vs smg, equal freshness and defaults (~9 min)"
	@echo "make bench-quick - a quick look (~6 min)"
	@echo "make bench-full  - everything for the committed results (~6 h; dprank-bench full --resume continues one)"
	@echo "make gateways-figure - redraw bench-results/legacy-model/gateways-ttft-p99.png from the stored several-gateways runs (seconds)"
	@echo "make build  - build the filter ($(WASM)), the simulator and the bench tool"
	@echo "make image  - build the filter in Docker and package it as an OCI image $(IMAGE) (needs a Docker engine; IMAGE=registry/name:tag)"
	@echo "make wasm   - build $(WASM)"
	@echo "make lint   - rustfmt, clippy (unwrap/expect/panic denied outside tests), ruff for the Python"

setup:
	./scripts/setup.sh

build: wasm tools

wasm:
	$(CARGO) build --release --target wasm32-wasip1 -p dprank

# The overhead benchmark's floor: a no-op wasm filter (bench/noop-filter), built on its own.
noop-wasm:
	$(CARGO) build --release --target wasm32-wasip1 --manifest-path bench/noop-filter/Cargo.toml --target-dir target

tools:
	$(CARGO) build --release -p dprank-sim -p dprank-bench

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --target wasm32-wasip1 -p dprank -- -D warnings
	$(CARGO) fmt --manifest-path bench/noop-filter/Cargo.toml -- --check
	$(CARGO) clippy --target wasm32-wasip1 --manifest-path bench/noop-filter/Cargo.toml --target-dir target -- -D warnings
	$(RUFF) check $(PY_SOURCES)
	$(RUFF) format --check $(PY_SOURCES)

# Rust, the scripts' Python, doc links, deployment files, fuzz smoke; ends with a summary.
test: setup wasm tools lint
	./scripts/test.sh 15

demo: setup wasm tools
	./scripts/demo.sh

bench: setup wasm tools
	DPRANK_WITH_SMG=1 ./scripts/setup.sh
	./target/release/dprank-bench bench

smg-sweep: setup wasm tools
	DPRANK_WITH_SMG=1 ./scripts/setup.sh
	./target/release/dprank-bench smg-sweep --out bench-results/headline/smg-sweep --sim-preset deepseek-v3-ep-low --capacity-dir bench-results/headline/deepseek-v3-ep-low/capacity

# The public traces the bench replays, from their pinned upstream commit
# (DPRANK_TRACE_DIR or --trace-dir point at copies elsewhere).
traces:
	python3 scripts/fetch_traces.py

bench-pd: setup wasm tools
	DPRANK_WITH_SMG=1 ./scripts/setup.sh
	./target/release/dprank-bench pd

bench-quick: setup wasm noop-wasm tools
	DPRANK_WITH_SMG=1 ./scripts/setup.sh
	./target/release/dprank-bench quick

bench-full: setup wasm noop-wasm tools
	DPRANK_WITH_SMG=1 ./scripts/setup.sh
	./target/release/dprank-bench full

# The several-gateways figure of bench-results/legacy-model/results.md, from runs already in bench-results/.
gateways-figure: tools
	./target/release/dprank-bench gateways-figure --out bench-results/legacy-model/gateways-ttft-p99.png \
	  --target 4=1.15 --target 8=1.3 \
	  --series "no shared prefixes, today's rule (1000 ms polls);bench-results/legacy-model/gateways;dprank,dprank:gw=2,dprank:gw=4,dprank:gw=8" \
	  --series "no shared prefixes, gateways: N, 200 ms polls;bench-results/legacy-model/gateways;dprank:set.gateways=4:poll=200:gw=4,dprank:set.gateways=8:poll=200:gw=8" \
	  --series "tenants (shared prefixes), gateways: N, 200 ms polls;bench-results/legacy-model/gateways-tenants;dprank:poll=200,dprank:set.gateways=4:poll=200:gw=4,dprank:set.gateways=8:poll=200:gw=8" \
	  --series "tenants, smg cache_aware replicas (÷ one smg);bench-results/legacy-model/gateways-tenants-smg;smg-cache-aware,smg-cache-aware:gw=4,smg-cache-aware:gw=8;smg-cache-aware" \
	  --series "tenants, today's rule (1000 ms polls);bench-results/legacy-model/gateways-tenants-plain;dprank:gw=1,dprank:gw=4,dprank:gw=8;dprank:gw=1" \
	  --series "tenants, each tenant kept on one gateway, today's rule;bench-results/legacy-model/gateways-tenants-affine;dprank:gw=1,dprank:gw=4:spread=tenant,dprank:gw=8:spread=tenant;dprank:gw=1"

# Builds the filter from source inside Docker (docker/wasm-image.Dockerfile).
image:
	docker build -f docker/wasm-image.Dockerfile -t $(IMAGE) .

clean:
	$(CARGO) clean
