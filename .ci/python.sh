#!/usr/bin/env bash
# CI for the Python package clients/python (agq-client): in a fresh
# virtualenv, `pip install ./clients/python[test]` (grpcio, protobuf,
# pytest, mypy and the grpcio/protobuf type stubs from PyPI), check that the
# committed generated code matches proto/ (regen.sh --check), run the pytest
# suite against live `agq serve` processes on loopback (client and worker
# SDK), and `mypy --strict` on the package, its tests and the quickstart
# example. The agq binary: $AGQ_BIN, else target/debug/agq (built here with
# cargo only when missing: CI's `cargo test` has built it by then).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
start=$(date +%s)
# Seconds since the start, for the section lines.
t() { echo "[$(( $(date +%s) - start )) s]"; }

if [ -z "${AGQ_BIN:-}" ]; then
    AGQ_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/agq"
    if [ ! -x "$AGQ_BIN" ]; then
        cargo build --locked --workspace --bins
    fi
fi
export AGQ_BIN
echo "python.sh: agq binary $AGQ_BIN"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
PYTHON="${PYTHON:-python3}"
echo "$(t) == fresh virtualenv, pip install ./clients/python[test]"
"$PYTHON" -m venv "$work/venv"
py="$work/venv/bin/python"
# The package with its test extra, and the pinned generators for regen.sh --check.
"$py" -m pip install --quiet --disable-pip-version-check "$root/clients/python[test]" \
    -r "$root/clients/python/requirements-regen.txt"
"$py" -c 'import agq, sys; print(f"python.sh: agq-client {agq.__version__} installed on Python {sys.version.split()[0]}")'

echo "$(t) == generated code is up to date with proto/"
REGEN_VENV="$work/venv" bash clients/python/regen.sh --check

echo "$(t) == pytest against live agq serve (client and worker SDK)"
# Run from a scratch directory so that `import agq` is the installed package.
set +e
(cd "$work" && "$py" -m pytest "$root/clients/python/tests" -q -rfE -p no:cacheprovider)
rc=$?
set -e
if [ "$rc" = 5 ]; then
    echo "python.sh: pytest collected no tests" >&2
    exit 1
fi
if [ "$rc" != 0 ]; then
    echo "python.sh: pytest failed (exit $rc)" >&2
    exit "$rc"
fi

echo "$(t) == mypy --strict: the installed package, the example and the tests"
(cd "$work" && "$py" -m mypy --strict --cache-dir "$work/mypy-cache" -p agq)
(cd "$root/clients/python" && "$py" -m mypy --strict --cache-dir "$work/mypy-cache" \
    examples/quickstart.py tests)

echo "python.sh: done in $(( $(date +%s) - start )) s"
