#!/usr/bin/env bash
# The no-Docker demo: one seeded trace through Envoy round robin, then
# through Envoy + dprank (the shipped envoy/dprank.yaml with free ports and
# the simulated workers filled in), each in front of a fresh fleet of two
# simulated SGLang workers with 4 DP ranks. Prints both side by side and
# writes .dprank/demo/demo.png; logs go to target/bench-logs/.
# Arguments are passed on (dprank-bench demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH=target/release/dprank-bench
for bin in "${ENVOY_BIN:-.venv/bin/envoy}" target/release/dprank-sim "$BENCH" target/wasm32-wasip1/release/dprank.wasm; do
  [ -e "$bin" ] || { echo "missing $bin: run 'make demo' (it builds everything first)" >&2; exit 1; }
done
exec "$BENCH" demo "$@"
