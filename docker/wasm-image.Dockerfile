# syntax=docker/dockerfile:1
# dprank.wasm, built from source in a Rust stage, then delivered two ways:
#
# - the default target: the filter as an OCI image, in the layout Istio
#   (WasmPlugin, or an ECDS EnvoyFilter with an oci:// URL) and Envoy Gateway
#   (EnvoyExtensionPolicy, code type Image) accept: one layer holding one
#   file, /plugin.wasm (see envoy/README.md):
#     docker build -f docker/wasm-image.Dockerfile -t REGISTRY/dprank-wasm:0.1.0 .
#     docker push REGISTRY/dprank-wasm:0.1.0
# - target `envoy`: the official Envoy image with the filter at
#   /etc/dprank/dprank.wasm, which docker-compose.yml runs (so the compose
#   demo needs Docker only, no Rust on the host).
#
# The build context is the repository root (the Cargo workspace needs every
# member's manifest and sources: the filter, sim/ and bench/);
# docker/wasm-image.Dockerfile.dockerignore keeps target/, .venv/ and .git/
# out of it.

FROM rust:1.95-slim-trixie AS build
RUN rustup target add wasm32-wasip1
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY sim ./sim
COPY bench ./bench
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --target wasm32-wasip1 -p dprank \
 && install -D -m 0644 target/wasm32-wasip1/release/dprank.wasm /out/dprank.wasm

# The compose demo's Envoy (docker-compose.yml builds this target).
FROM envoyproxy/envoy:v1.40.0 AS envoy
COPY --from=build /out/dprank.wasm /etc/dprank/dprank.wasm

# The OCI image (the default, last target). Keep exactly one COPY here: the
# fetchers read the image's last layer only, and it must be gzip-compressed
# (the default; not zstd).
FROM scratch AS plugin
COPY --from=build /out/dprank.wasm /plugin.wasm
