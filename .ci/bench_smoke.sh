#!/usr/bin/env bash
# Smoke run of the bench (agq-bench, the workspace's bench/ crate): tiny
# sizes, every phase of the default mode and the other modes, exits non-zero
# unless every job completed. The Redis peer
# runs when redis-server can be had (this script tries Debian's package, as
# root, and goes on without it when that fails: the bench then skips the
# peer). The BullMQ peer runs when redis-server and node are there and its
# harness installs (`npm ci --prefix bench/bullmq`, tried when npm is on
# PATH; without it the bench skips the peer). Numbers are printed, never
# asserted: performance is measured by hand (BENCHMARKS.md), not in CI.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "installing redis-server (Debian package) for the Redis peer"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
    || echo "redis-server could not be installed; the smoke run skips the Redis peer"
fi

bullmq=0
if command -v node >/dev/null && command -v npm >/dev/null; then
  echo "installing the BullMQ harness (npm ci --prefix bench/bullmq) for the BullMQ peer"
  if npm ci --prefix bench/bullmq --no-audit --no-fund >/dev/null; then
    bullmq=1
  else
    echo "the BullMQ harness could not be installed; the smoke run skips the BullMQ peer"
  fi
fi

target="${CARGO_TARGET_DIR:-target}"
# agq-bench, and agq next to it: the soak runs `agq serve` as a child
# process when it finds that binary beside its own.
cargo build --locked --workspace --bins
# The default mode, what `cargo run -p agq-bench --release` runs: with
# redis-server present, the report must carry both systems' figures and
# the AGQ/Redis ratios.
out="$(mktemp)"
"$target/debug/agq-bench" --smoke | tee "$out"
if command -v redis-server >/dev/null; then
  grep -Eq 'end-to-end throughput \(jobs/s\) +[0-9]+ +[0-9]+ +[0-9.]+x' "$out" \
    || { echo "bench smoke: no AGQ vs Redis end-to-end figures and ratio in the report" >&2; exit 1; }
  # With the harness installed, the BullMQ columns follow: its figure and
  # the AGQ/BullMQ ratio.
  if [ "$bullmq" = 1 ]; then
    grep -Eq 'end-to-end throughput \(jobs/s\) +[0-9]+ +[0-9]+ +[0-9.]+x +[0-9]+ +[0-9.]+x' "$out" \
      || { echo "bench smoke: no BullMQ end-to-end figure and AGQ/BullMQ ratio in the report" >&2; exit 1; }
  fi
fi
rm -f "$out"
"$target/debug/agq-bench" --smoke --failover --kill-trials 3 --freeze-trials 1 --heartbeat-ms 200
"$target/debug/agq-bench" --smoke --backlog 2000 --backlog-sample 200 --workers 4
"$target/debug/agq-bench" --smoke --soak-secs 2 --soak-rate 400 --soak-sample-secs 1
# The clustered mode: three `agq serve --store postgres` replicas beside one
# SQLite node, and one replica kill (PostgreSQL from scripts/test-deps.sh).
"$target/debug/agq-bench" --smoke --store postgres --replica-kill-trials 1 --heartbeat-ms 200
echo "bench smoke: ok"
