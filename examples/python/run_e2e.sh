#!/usr/bin/env bash
# End to end: starts `agq serve` (temporary database, 127.0.0.1 on a port
# the OS picks) and one `agw`, runs client.py against them, stops both and
# exits with client.py's exit code.
#
# Binaries: $AGQ_BIN_DIR, else target/release, else target/debug (under
# $CARGO_TARGET_DIR when set); build them first with `cargo build [--release]`.
# Python: $PYTHON (default python3). When grpcio, grpcio-tools or protobuf
# is missing, a virtualenv is made in .venv and requirements.txt installed.
# Extra arguments go to client.py (e.g. files to count words in).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"

bin="${AGQ_BIN_DIR:-}"
if [ -z "$bin" ]; then
    for dir in "$target/release" "$target/debug"; do
        if [ -x "$dir/agq" ] && [ -x "$dir/agw" ]; then
            bin="$dir"
            break
        fi
    done
fi
if [ -z "$bin" ] || [ ! -x "$bin/agq" ] || [ ! -x "$bin/agw" ]; then
    echo "run_e2e.sh: agq and agw not found under $target/{release,debug}: run cargo build --release" >&2
    exit 2
fi

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import grpc, grpc_tools, google.protobuf' 2>/dev/null; then
    if [ ! -x "$here/.venv/bin/python" ]; then
        echo "run_e2e.sh: installing requirements.txt into $here/.venv" >&2
        "$PYTHON" -m venv "$here/.venv"
        "$here/.venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            -r "$here/requirements.txt"
    fi
    PYTHON="$here/.venv/bin/python"
fi
export PYTHON
"$here/generate.sh"

work="$(mktemp -d)"
agq_pid=""
agw_pid=""
cleanup() {
    # Workers first (SIGTERM: drain, unregister, exit 0), then the server.
    for pid in $agw_pid $agq_pid; do
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 100); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

# Waits until file $1 has a line starting with $2 (or process $3 died).
wait_line() {
    for _ in $(seq 300); do
        if grep -q "^$2" "$1" 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$3" 2>/dev/null; then
            break
        fi
        sleep 0.1
    done
    echo "run_e2e.sh: no \"$2\" from pid $3; its output:" >&2
    cat "$1" "$1.err" >&2 2>/dev/null || true
    return 1
}

"$bin/agq" serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --console-listen 127.0.0.1:0 \
    --db "$work/agq.db" >"$work/agq.out" 2>"$work/agq.out.err" &
agq_pid=$!
wait_line "$work/agq.out" "listening on " "$agq_pid"
addr="$(sed -n 's/^listening on //p' "$work/agq.out" | head -n 1)"
echo "agq serving on $addr (pid $agq_pid)"

"$bin/agw" --server "http://$addr" --worker-id python-e2e --max-concurrent-jobs 4 \
    >"$work/agw.out" 2>"$work/agw.out.err" &
agw_pid=$!
wait_line "$work/agw.out" "agw: registered" "$agw_pid"
echo "agw registered (pid $agw_pid)"

set +e
"$PYTHON" "$here/client.py" --server "$addr" "$@"
rc=$?
set -e
echo "client.py exited $rc"
exit "$rc"
