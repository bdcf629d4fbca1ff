#!/usr/bin/env bash
# Chaos soak: worker_a SIGKILLed and restarted at random, worker_b's load
# answers broken at the wire at random, sixteen clients at 70% of what the
# fleet serves (tests/e2e/chaos_soak.rs says what and how it attributes
# each failure). Writes bench-results/chaos-soak/soak.md.
#
#   scripts/chaos-soak.sh [minutes]      (default 10; CHAOS_SEED, default 1)
#
# Builds what it needs (the filter, the simulator) and Envoy via make setup.
set -euo pipefail
cd "$(dirname "$0")/.."
export CHAOS_MINUTES="${1:-10}"
export CHAOS_SEED="${CHAOS_SEED:-1}"
mkdir -p bench-results/chaos-soak
export CHAOS_OUT="${CHAOS_OUT:-$PWD/bench-results/chaos-soak/soak.md}"
make --no-print-directory setup wasm tools >/dev/null
cargo test --release --test e2e chaos_soak -- --ignored --nocapture --test-threads 1
