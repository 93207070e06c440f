# syntax=docker/dockerfile:1
# AGQ image: the `agq` server and the `agw` worker in one slim Debian image
# with the Unix tools the default worker advertises.
#
#   docker build -t agq:0.1.0 .
#   docker run -p 6380:6380 -p 6381:6381 -v agq-data:/data \
#     -v "$PWD/auth.toml:/etc/agq/auth.toml:ro" -e AGQ_AUTH_FILE=/etc/agq/auth.toml agq:0.1.0
#
# Secure by default: the default command listens on 0.0.0.0, which agq
# refuses without authentication. Provide an auth file (AGQ_AUTH_FILE, see
# docs/deployment.md) or, on a trusted network only, AGQ_INSECURE=true.
# A worker: docker run agq:0.1.0 agw (configured through AGW_* variables).
#
# The web console (docs/console.md) listens on 127.0.0.1:6382 by default,
# inside the container, where `-p` cannot reach it. agq serves it on a
# public address only with an auth file (its pages then need a client or
# admin token), so to reach it add to the command above:
#   -e AGQ_CONSOLE_LISTEN=0.0.0.0:6382 -p 6382:6382
# Without an auth file it stays on the container's loopback; AGQ_NO_CONSOLE=true
# turns it off.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# protoc comes vendored through build.rs; the caches only speed up rebuilds.
# Only the agq package (agq, agw) is built: the workspace's other crates,
# bench/ (agq-bench) and crates/testpg (the tests' throwaway PostgreSQL),
# are read for their manifests, never compiled.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p agq --bin agq --bin agw \
 && install -m 0755 target/release/agq target/release/agw /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      coreutils grep sed gawk jq ca-certificates tini tzdata \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 agq \
 && useradd --uid 10001 --gid 10001 --home-dir /data --no-create-home \
      --shell /usr/sbin/nologin agq \
 && mkdir -p /data \
 && chown agq:agq /data
COPY --from=build /usr/local/bin/agq /usr/local/bin/agw /usr/local/bin/
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
# gRPC, metrics, and the web console (with AGQ_CONSOLE_LISTEN, see above).
EXPOSE 6380 6381 6382
# tini reaps the worker's child processes and forwards SIGTERM, so agq
# and agw can shut down (and drain) cleanly.
ENTRYPOINT ["tini", "--"]
CMD ["agq", "serve", "--listen", "0.0.0.0:6380", "--metrics-listen", "0.0.0.0:6381", "--db", "/data/agq.db"]
