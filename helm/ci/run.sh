#!/usr/bin/env bash
# Lint, render and check the agq Helm chart (helm/agq).
#
# Needs only Python >= 3.11 with pip and PyPI: Helm itself comes from the
# PyPI package helm-sdkpy (Helm's Go library as a shared object, called via
# cffi; it declares Python >= 3.12 but runs on 3.11, hence
# --ignore-requires-python). The packages go into a private --target
# directory (no venv, no system site-packages, fine under PEP 668), reused
# by later runs while the pinned versions match.
#
#   bash helm/ci/run.sh            # prints one line per check, then
#                                  # "helm-chart: N passed, M failed"
# One check starts the debug build's `agq serve` and `agw` on loopback and
# compares the metrics the dashboard, alerts and autoscalers query with the
# live /metrics: build them first (`cargo build`; .ci/run's `cargo test`
# does).
# Env: PYTHON (default python3), AGQ_HELM_CI_DEPS (package directory),
#      AGQ_CHART_DUMP=<dir> (write the rendered objects there),
#      AGQ_BIN / AGW_BIN (the binaries; default $CARGO_TARGET_DIR or
#      target/, then debug/agq and debug/agw).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
helm_sdkpy_version="0.1.32"
pyyaml_version="6.0.3"
deps="${AGQ_HELM_CI_DEPS:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/agq-helm-ci/deps-${helm_sdkpy_version}}"

"$python" - <<'PY' || { echo "helm/ci/run.sh: Python >= 3.11 is required" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

have_deps() {
  PYTHONPATH="$deps" "$python" - "$helm_sdkpy_version" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
import helm_sdkpy, yaml  # noqa: F401
sys.exit(0 if version("helm-sdkpy") == sys.argv[1] else 1)
PY
}

if ! have_deps; then
  echo "helm/ci/run.sh: installing helm-sdkpy ${helm_sdkpy_version} and PyYAML into ${deps}"
  rm -rf "$deps"
  mkdir -p "$deps"
  "$python" -m pip install --quiet --disable-pip-version-check --no-input \
    --root-user-action=ignore --ignore-requires-python --target "$deps" \
    "helm-sdkpy==${helm_sdkpy_version}" "pyyaml==${pyyaml_version}"
  have_deps || { echo "helm/ci/run.sh: helm-sdkpy did not import from ${deps}" >&2; exit 1; }
fi

PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}" exec "$python" "$here/check_chart.py"
