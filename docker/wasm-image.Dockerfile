# syntax=docker/dockerfile:1
# dprank.wasm as an OCI image, in the layout Istio (WasmPlugin, or an ECDS
# EnvoyFilter with an oci:// URL) and Envoy Gateway (EnvoyExtensionPolicy,
# code type Image) accept: one layer holding one file, /plugin.wasm.
#
# Build the filter first, then package and push it (see envoy/README.md):
#   cargo build --release --target wasm32-wasip1 -p dprank
#   docker build -f docker/wasm-image.Dockerfile -t REGISTRY/dprank-wasm:0.1.0 .
#   docker push REGISTRY/dprank-wasm:0.1.0
#
# Keep exactly one COPY: the fetchers read the image's last layer only, and it
# must be gzip-compressed (the default; not zstd).
FROM scratch
COPY target/wasm32-wasip1/release/dprank.wasm /plugin.wasm
