#!/usr/bin/env bash
# Smoke run of agq-bench (issue 7): tiny sizes, every mode's code path of the
# default mode, exits non-zero unless every job completed. The Redis peer
# runs when redis-server can be had (this script tries Debian's package, as
# root, and goes on without it when that fails: the bench then skips the
# peer). Numbers are printed, never asserted: performance is measured by
# hand (BENCHMARKS.md), not in CI.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "installing redis-server (Debian package) for the Redis peer"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
    || echo "redis-server could not be installed; the smoke run skips the Redis peer"
fi

target="${CARGO_TARGET_DIR:-target}"
cargo build --locked --bin agq-bench --bin agq
"$target/debug/agq-bench" --smoke
# The same bench as `agq bench` (what `cargo run --release -- bench` runs).
"$target/debug/agq" bench --smoke --failover --kill-trials 3 --freeze-trials 1 --heartbeat-ms 200
"$target/debug/agq-bench" --smoke --backlog 2000 --backlog-sample 200 --workers 4
"$target/debug/agq-bench" --smoke --soak-secs 2 --soak-rate 400 --soak-sample-secs 1
echo "bench smoke: ok"
