#!/usr/bin/env bash
# Counts the instructions the SQLite engine's writer thread executes per
# job, with valgrind's callgrind (repeatable whatever else the machine
# does, unlike CPU time on a shared VM). Runs the bench's engine-only mode
# (no gRPC) on a small workload under callgrind, one profile per thread,
# and prints the writer thread's instructions divided by the job count.
#
#   bash scripts/writer-instructions.sh [BENCH_BINARY] [JOBS]
#
# Defaults: target/release/agq-bench (build it first with
# `cargo build --release -p agq-bench`), 5000 jobs, 16 workers x 4 slots.
# Takes about a minute and a half on two cores. Needs valgrind
# (`apt-get install valgrind`).
set -euo pipefail
bench="${1:-target/release/agq-bench}"
jobs="${2:-5000}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg.%p" \
  "$bench" --engine-only --no-redis --jobs "$jobs" --workers 16 >"$out/log" 2>&1 \
  || { cat "$out/log" >&2; exit 1; }
grep -q "$jobs of $jobs completed" "$out/log" || { cat "$out/log" >&2; echo "not every job completed" >&2; exit 1; }
for f in "$out"/cg.*-*; do
  if grep -q 'writer..exec' "$f"; then
    total="$(grep -m1 '^totals:' "$f" | awk '{print $2}')"
    echo "writer thread: $total instructions for $jobs jobs = $((total / jobs)) per job"
    exit 0
  fi
done
echo "no writer thread profile found" >&2
exit 1
