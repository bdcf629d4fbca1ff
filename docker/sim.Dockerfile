# syntax=docker/dockerfile:1
# The simulated SGLang worker (`dprank-sim`) as a container: a Rust image
# builds it, a slim Debian image runs it.
#
#   docker build -f docker/sim.Dockerfile -t dprank-sim:local .
#   docker run --rm -p 30000:30000 dprank-sim:local
#
# The build context is the repository root (the Cargo workspace needs every
# member's manifest); docker/sim.Dockerfile.dockerignore keeps target/, .venv/
# and .git/ out of it.

FROM rust:1.95-slim-trixie AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY sim ./sim
COPY bench ./bench
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p dprank-sim \
 && install -m 0755 target/release/dprank-sim /usr/local/bin/dprank-sim

FROM debian:trixie-slim
COPY --from=build /usr/local/bin/dprank-sim /usr/local/bin/dprank-sim
# Any unprivileged user; the simulator needs no files.
USER 65534:65534
EXPOSE 30000
ENTRYPOINT ["/usr/local/bin/dprank-sim"]
# Four ranks, ten times faster than real time. Compose passes its own
# --listen (the container's fixed IP, so x-sim-worker names the worker).
CMD ["--listen", "0.0.0.0:30000", "--dp-size", "4", "--time-scale", "10"]
