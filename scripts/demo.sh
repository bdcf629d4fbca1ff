#!/usr/bin/env bash
# The no-Docker demo: two simulated SGLang workers (4 DP ranks each) behind a
# real Envoy running dprank with the shipped config envoy/dprank.yaml, a
# seeded trace of varied prompt lengths, then what dprank did.
# Uses ports 10000 (Envoy), 9901 (admin), 30001-30002 (workers) on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY="${ENVOY_BIN:-.venv/bin/envoy}"
SIM=target/release/dprank-sim
BENCH=target/release/dprank-bench
TIME_SCALE="${DEMO_TIME_SCALE:-10}"
LOGS=.dprank/demo
mkdir -p "$LOGS"
for bin in "$ENVOY" "$SIM" "$BENCH" target/wasm32-wasip1/release/dprank.wasm; do
  [ -e "$bin" ] || { echo "missing $bin: run 'make demo' (it builds everything first)" >&2; exit 1; }
done

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

"$SIM" --listen 127.0.0.1:30001 --listen 127.0.0.1:30002 --dp-size 4 --time-scale "$TIME_SCALE" \
  > "$LOGS/sim.log" 2>&1 &
pids+=($!)
"$ENVOY" -c envoy/dprank.yaml --concurrency 2 --disable-hot-restart --log-path "$LOGS/envoy.log" &
pids+=($!)

echo "waiting for Envoy and the first load poll..."
for _ in $(seq 1 100); do
  if curl -fs 127.0.0.1:9901/stats 2>/dev/null | grep -q 'wasmcustom.dprank.poll_ok.worker_b: [1-9]'; then break; fi
  sleep 0.1
done
curl -fs 127.0.0.1:9901/stats | grep -q 'wasmcustom.dprank.poll_ok' \
  || { echo "dprank did not poll the workers; see $LOGS/envoy.log" >&2; tail -n 20 "$LOGS/envoy.log" >&2; exit 1; }

echo
echo "== Sending a seeded trace (Poisson arrivals, lognormal prompt/output lengths) through Envoy + dprank"
"$BENCH" load --target http://127.0.0.1:10000 --worker 127.0.0.1:30001 --worker 127.0.0.1:30002 \
  --time-scale "$TIME_SCALE" --rate 8 --duration 120

echo
echo "== Requests dprank routed, per worker and rank (Envoy stats)"
curl -fs 127.0.0.1:9901/stats | grep -E '^wasmcustom\.dprank\.routed\.' | sed 's/^wasmcustom\.dprank\.routed\./  /'
echo
echo "== Other dprank stats"
curl -fs 127.0.0.1:9901/stats | grep -E '^wasmcustom\.dprank\.(poll_ok|poll_failed|passthrough|rejected)' | sed 's/^wasmcustom\.dprank\./  /'
echo
echo "Logs: $LOGS/ ; config: envoy/dprank.yaml ; full comparison: make bench"
