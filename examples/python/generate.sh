#!/usr/bin/env sh
# Generates the Python gRPC client of agq.v1 from ../../proto into agq_pb/
# (importable as `agq.v1.*_pb2` once agq_pb/ is on sys.path; client.py
# does that). Needs: pip install -r requirements.txt
set -eu
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
rm -rf agq_pb
mkdir -p agq_pb
"$PYTHON" -m grpc_tools.protoc -I ../../proto \
    --python_out=agq_pb --grpc_python_out=agq_pb \
    ../../proto/agq/v1/*.proto
echo "generated $(find agq_pb -name '*.py' | wc -l | tr -d ' ') modules in $(pwd)/agq_pb"
