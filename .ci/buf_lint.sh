#!/usr/bin/env bash
# `buf lint` of proto/agq/v1 with the STANDARD rules (configuration and its
# documented exceptions: buf.yaml at the repository root). buf comes from
# npm's @bufbuild/buf (the buf binary for this platform, no install script
# needed), at a pinned version, installed once under the cargo target
# directory ($BUF_DIR names another place).
set -euo pipefail
cd "$(dirname "$0")/.."
BUF_VERSION=1.75.0
dir="${BUF_DIR:-${CARGO_TARGET_DIR:-target}/buf-$BUF_VERSION}"
buf="$dir/node_modules/.bin/buf"
if [ ! -x "$buf" ] || [ "$("$buf" --version)" != "$BUF_VERSION" ]; then
    mkdir -p "$dir"
    npm install --prefix "$dir" --no-audit --no-fund --silent "@bufbuild/buf@$BUF_VERSION"
fi
echo "buf_lint.sh: buf $("$buf" --version)"
"$buf" lint
echo "buf_lint.sh: proto/agq/v1 passes buf lint (STANDARD)"
