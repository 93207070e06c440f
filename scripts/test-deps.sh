#!/usr/bin/env bash
# Installs what the test suite needs beyond crates.io; the README's test
# command runs it before `cargo test --locked --workspace`:
#
#   bash scripts/test-deps.sh && cargo test --locked --workspace
#
# What it installs when missing: Debian's chromium and chromium-driver, for
# the web console's browser test (tests/console_browser.rs). As root it runs
# apt-get; otherwise it says what to install and stops, because that test
# fails without a browser rather than skip. AGQ_CHROMIUM and
# AGQ_CHROMEDRIVER name other binaries (then nothing is installed).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
if [ -z "${AGQ_CHROMEDRIVER:-}" ] && ! command -v chromedriver >/dev/null 2>&1; then
  need+=(chromium-driver)
fi
if [ -z "${AGQ_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
  need+=(chromium)
fi
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test-deps.sh: installing ${need[*]} (Debian packages) for the console's browser test"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "scripts/test-deps.sh: the console's browser test needs ${need[*]}:" >&2
    echo "  sudo apt-get install ${need[*]}   (or set AGQ_CHROMIUM / AGQ_CHROMEDRIVER)" >&2
    exit 1
  fi
fi
