#!/usr/bin/env bash
# Regenerates the committed gRPC/protobuf code of agq.v1 in src/agq/v1 from
# ../../proto: grpcio-tools writes *_pb2.py and *_pb2_grpc.py, mypy-protobuf
# writes their type stubs (*_pb2.pyi, *_pb2_grpc.pyi). The generator
# versions are pinned in requirements-regen.txt: the generated code requires
# protobuf and grpcio at least as new as the generator (see pyproject.toml).
# Run it after changing proto/agq/v1/*.proto and commit the result;
# `regen.sh --check` fails when the committed code is out of date (CI runs it).
# Needs only PyPI: a private virtualenv is made in .venv-regen ($REGEN_VENV
# names another virtualenv that already has requirements-regen.txt).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${REGEN_VENV:-$here/.venv-regen}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$venv/bin/protoc-gen-mypy" ]; then
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -r "$here/requirements-regen.txt"
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
(cd "$root/proto" && "$venv/bin/python" -m grpc_tools.protoc -I . \
    --python_out="$out" --grpc_python_out="$out" \
    --plugin=protoc-gen-mypy="$venv/bin/protoc-gen-mypy" \
    --plugin=protoc-gen-mypy_grpc="$venv/bin/protoc-gen-mypy_grpc" \
    --mypy_out=quiet:"$out" --mypy_grpc_out=quiet:"$out" \
    agq/v1/*.proto)
# common.proto has no service: its empty *_pb2_grpc modules are not kept.
rm -f "$out"/agq/v1/common_pb2_grpc.py "$out"/agq/v1/common_pb2_grpc.pyi
dest="$here/src/agq/v1"
if [ "${1:-}" = "--check" ]; then
    stale=0
    for f in "$out"/agq/v1/*; do
        if ! cmp -s "$f" "$dest/$(basename "$f")"; then
            echo "regen.sh: src/agq/v1/$(basename "$f") is out of date with proto/" >&2
            stale=1
        fi
    done
    for f in "$dest"/*_pb2*; do
        [ -e "$out/agq/v1/$(basename "$f")" ] || { echo "regen.sh: src/agq/v1/$(basename "$f") has no .proto" >&2; stale=1; }
    done
    if [ "$stale" = 0 ]; then
        echo "regen.sh: src/agq/v1 is up to date with proto/agq/v1"
    else
        echo "regen.sh: the protos changed: run 'bash clients/python/regen.sh' and commit clients/python/src/agq/v1" >&2
    fi
    exit "$stale"
fi
rm -f "$dest"/*_pb2*.py "$dest"/*_pb2*.pyi
cp "$out"/agq/v1/* "$dest"/
echo "regen.sh: wrote $(ls "$dest" | grep -c _pb2) modules and stubs to src/agq/v1"
