#!/usr/bin/env bash
# What one load poll costs a worker: serves /v1/loads from a simulated worker
# (8 ranks) as fast as wrk can ask for 5 s and prints requests/s and the
# worker's CPU time per request. Needs wrk (apt-get install wrk) and
# `make tools`. The figure is the simulator's, not SGLang's: see
# docs/gateways.md, "Running at scale".
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { echo "needs wrk: apt-get install -y wrk" >&2; exit 1; }
port=30199
target/release/dprank-sim --listen 127.0.0.1:$port --dp-size 8 >/dev/null 2>&1 &
sim=$!
trap 'kill $sim 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do curl -fs 127.0.0.1:$port/health >/dev/null 2>&1 && break; sleep 0.1; done
bytes=$(curl -fs "127.0.0.1:$port/v1/loads?include=core" | wc -c)
ticks_per_s=$(getconf CLK_TCK)
before=$(awk '{print $14+$15}' /proc/$sim/stat)
out=$(wrk -t1 -c4 -d5s "http://127.0.0.1:$port/v1/loads?include=core")
after=$(awk '{print $14+$15}' /proc/$sim/stat)
rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
total=$(echo "$out" | awk '/requests in/ {print $1}')
echo "response: $bytes bytes; served: $rps req/s"
awk -v t=$((after - before)) -v hz="$ticks_per_s" -v n="$total" \
  'BEGIN { printf "worker CPU per poll: %.1f us (%d requests, %.2f CPU-s)\n", t / hz / n * 1e6, n, t / hz }'
