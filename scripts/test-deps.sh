#!/usr/bin/env bash
# Installs what the test suite needs beyond crates.io; the README's test
# command runs it before `cargo test --locked --workspace`:
#
#   bash scripts/test-deps.sh && cargo test --locked --workspace
#
# What it installs when missing (Debian packages):
# - chromium and chromium-driver, for the web console's browser test
#   (tests/console_browser.rs). AGQ_CHROMIUM and AGQ_CHROMEDRIVER name other
#   binaries (then nothing is installed).
# - postgresql, whose server binaries (initdb, postgres) the PostgreSQL
#   store's tests start a throwaway cluster from (crates/testpg): looked
#   for in /usr/lib/postgresql/<version>/bin and `pg_config --bindir`.
#   AGQ_PG_BIN names another directory, and AGQ_TEST_DATABASE_URL a running
#   server to use instead (then nothing is installed).
# As root it runs apt-get; otherwise it says what to install and stops,
# because those tests fail without them rather than skip.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
if [ -z "${AGQ_CHROMEDRIVER:-}" ] && ! command -v chromedriver >/dev/null 2>&1; then
  need+=(chromium-driver)
fi
if [ -z "${AGQ_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
  need+=(chromium)
fi
why=()
if [ "${#need[@]}" -gt 0 ]; then
  why+=("the console's browser test needs ${need[*]} (or set AGQ_CHROMIUM / AGQ_CHROMEDRIVER)")
fi

# PostgreSQL server binaries: a directory with both initdb and postgres.
pg_bin_ok() { [ -x "$1/initdb" ] && [ -x "$1/postgres" ]; }
have_pg() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if pg_bin_ok "$d"; then return 0; fi
  done
  if command -v pg_config >/dev/null 2>&1; then
    d="$(pg_config --bindir 2>/dev/null || true)"
    if [ -n "$d" ] && pg_bin_ok "$d"; then return 0; fi
  fi
  return 1
}
if [ -z "${AGQ_TEST_DATABASE_URL:-}" ] && [ -z "${AGQ_PG_BIN:-}" ] && ! have_pg; then
  need+=(postgresql)
  why+=("the PostgreSQL store's tests need postgresql (or set AGQ_PG_BIN / AGQ_TEST_DATABASE_URL)")
fi

if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test-deps.sh: installing ${need[*]} (Debian packages) for the tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    for w in "${why[@]}"; do
      echo "scripts/test-deps.sh: $w" >&2
    done
    echo "  sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi
