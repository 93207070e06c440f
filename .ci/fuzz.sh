#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of AGQ's request decoding
# and validation: plans, actions, worker registrations and job reports,
# the read RPCs' filters/patterns/tokens, and the worker's templating.
# Builds the targets of fuzz/ and runs each for AGQ_FUZZ_SECS seconds
# (default 60) from its committed seed corpus; exits non-zero if any target
# finds a crash, a panic, a failed property, a timeout or an out-of-memory.
#
#   bash .ci/fuzz.sh                          # CI: 60 s per target, fast build
#   AGQ_FUZZ_SECS=600 bash .ci/fuzz.sh        # the long run (RELIABILITY.md)
#   AGQ_FUZZ_TARGETS="template" bash .ci/fuzz.sh
#
# Two builds (AGQ_FUZZ_BUILD): "full" is cargo fuzz's default, a release
# build with debug assertions (overflow checks), codegen-units=1 and
# AddressSanitizer, what the long run uses (the default when
# AGQ_FUZZ_SECS > 60): 11 min from clean on the 2-core machine. "fast" is
# the CI smoke run's (the default at 60 s): unoptimised, debug assertions
# on (fuzz/Cargo.toml's dev profile, line tables only), no sanitizer:
# 2.3 min from clean, and it runs at 0.5-1x the full build's speed (no
# ASan to pay for). Every assertion and the coverage guidance are the same.
# Measured from an empty fuzz/target (cargo-fuzz already installed; its
# install takes about a minute): fast 7 min 25 s in all, full 16 min 13 s.
#
# Toolchain: only stable Rust is needed. cargo fuzz passes nightly-only
# flags (-Zsanitizer=address and friends); RUSTC_BOOTSTRAP=1 makes stable
# rustc accept them. Stable ships the AddressSanitizer runtime
# (librustc-stable_rt.asan.a), so ASan is on by default; set
# AGQ_FUZZ_SANITIZER=none where a toolchain lacks it (coverage guidance
# and every assertion still work, only memory errors in unsafe/C code go
# undetected). Checked with rustc 1.95.0 stable and cargo-fuzz 0.13.2.
#
# New inputs go to fuzz/corpus-run/<target>/ (git-ignored); the committed
# seeds in fuzz/corpus/<target>/ are read, never written. A crash leaves
# its input in fuzz/artifacts/<target>/; reproduce it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run -a <target> fuzz/artifacts/<target>/<file>
# (from fuzz/, with the same sanitizer).
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${AGQ_FUZZ_SECS:-60}
if [ "$SECS" -gt 60 ]; then BUILD=${AGQ_FUZZ_BUILD:-full}; else BUILD=${AGQ_FUZZ_BUILD:-fast}; fi
if [ "$BUILD" = full ]; then
  SANITIZER=${AGQ_FUZZ_SANITIZER:-address}
  # Release build with debug assertions (integer overflow checks on).
  FLAGS=(--release --debug-assertions)
else
  SANITIZER=${AGQ_FUZZ_SANITIZER:-none}
  FLAGS=(--dev)
fi
FLAGS+=(--sanitizer "$SANITIZER")
TARGETS=${AGQ_FUZZ_TARGETS:-submit_plan submit_action worker_reports queries template}
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="$PWD/fuzz/target"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi

cd fuzz
cargo fmt --all -- --check
start=$(date +%s)
cargo fuzz build "${FLAGS[@]}"
# cargo fuzz has no --locked: the committed lock file must not have moved
# (after a dependency change of agq, commit the fuzz/Cargo.lock it wrote).
if ! git diff --quiet -- Cargo.lock; then
  echo "fuzz/Cargo.lock is stale: commit the version this build wrote" >&2
  exit 1
fi
echo "fuzz build ($BUILD: ${FLAGS[*]}): $(($(date +%s) - start)) s"

failed=()
for t in $TARGETS; do
  mkdir -p "corpus-run/$t"
  echo "== fuzz $t for $SECS s"
  if ! cargo fuzz run "${FLAGS[@]}" "$t" "corpus-run/$t" "corpus/$t" -- \
      -max_total_time="$SECS" -max_len=4096 -timeout=20 -rss_limit_mb=2048 \
      -print_final_stats=1; then
    failed+=("$t")
  fi
done
echo "fuzzing done in $(($(date +%s) - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz targets that failed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
