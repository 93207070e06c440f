#!/usr/bin/env bash
# Parses a live `agq serve`'s GET /metrics with the reference Python
# parsers (PyPI's prometheus-client): the classic text format 0.0.4 that a
# plain request gets, and the OpenMetrics 1.0.0 that a request accepting it
# gets (as Prometheus sends). Checks each body's content type and that the
# families a dashboard relies on are there, after one job ran.
#
#   bash .ci/metrics_check.sh        # prints "metrics-check: N passed, 0 failed"
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --locked --workspace --bins
deps="${AGQ_METRICS_CI_DEPS:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/agq-metrics-ci/deps}"
if ! PYTHONPATH="$deps" python3 -c 'import prometheus_client' 2>/dev/null; then
  mkdir -p "$deps"
  python3 -m pip install --quiet --disable-pip-version-check --no-input \
    --root-user-action=ignore --target "$deps" "prometheus-client==0.21.1"
fi

tmp=$(mktemp -d)
./target/debug/agq serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --console-listen 127.0.0.1:0 --db "$tmp/agq.db" \
  >"$tmp/agq.out" 2>"$tmp/agq.err" &
agq_pid=$!
cleanup() { kill "$agq_pid" 2>/dev/null || true; wait "$agq_pid" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
for _ in $(seq 100); do grep -q "^metrics on " "$tmp/agq.out" && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$tmp/agq.out")
murl=$(sed -n 's/^metrics on //p' "$tmp/agq.out")
[ -n "$addr" ] && [ -n "$murl" ] || { echo "metrics-check: agq did not start" >&2; cat "$tmp/agq.err" >&2; exit 1; }

# Some traffic, so that labelled families have samples.
echo '{"plan_id":"m","tasks":[{"task_number":1,"command":"cat","args":["{{file}}"],"timeout_secs":10}]}' \
  | ./target/debug/agq --server "http://$addr" plan submit - >/dev/null
./target/debug/agq --server "http://$addr" action submit --plan m --input file=/etc/hostname >/dev/null
./target/debug/agq --server "http://$addr" plan get m >/dev/null

PYTHONPATH="$deps" python3 - "$murl" <<'PY'
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

url = sys.argv[1]
passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name} {detail}")


def fetch(accept):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


WANT = {
    "agq_jobs": "counter",
    "agq_jobs_current": "gauge",
    "agq_queue_length": "gauge",
    "agq_enqueue_to_lease_seconds": "histogram",
    "agq_rpc_requests": "counter",
    "agq_rpc_duration_seconds": "histogram",
    "agq_build": "info",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
}

ctype, body = fetch(None)
check("plain request: Content-Type text/plain; version=0.0.4",
      ctype.startswith("text/plain; version=0.0.4"), ctype)
try:
    fams = {f.name: f for f in parse_text(body)}
    check("plain request: the 0.0.4 parser reads the body", True)
except Exception as e:  # noqa: BLE001
    fams = {}
    check("plain request: the 0.0.4 parser reads the body", False, repr(e))
for name, kind in WANT.items():
    # The 0.0.4 parser strips _total from counter names; info is a gauge there.
    text_kind = "gauge" if kind == "info" else kind
    text_name = f"{name}_info" if kind == "info" else name
    f = fams.get(text_name)
    check(f"text: {text_name} is a {text_kind} with samples",
          f is not None and f.type == text_kind and len(f.samples) > 0,
          f and (f.type, len(f.samples)))

ctype, body = fetch("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
check("OpenMetrics request: Content-Type application/openmetrics-text; version=1.0.0",
      ctype.startswith("application/openmetrics-text; version=1.0.0"), ctype)
try:
    fams = {f.name: f for f in parse_om(body)}
    check("OpenMetrics request: the strict OpenMetrics parser reads the body", True)
except Exception as e:  # noqa: BLE001
    fams = {}
    check("OpenMetrics request: the strict OpenMetrics parser reads the body", False, repr(e))
for name, kind in WANT.items():
    f = fams.get(name)
    check(f"openmetrics: {name} is a {kind} with samples",
          f is not None and f.type == kind and len(f.samples) > 0,
          f and (f.type, len(f.samples)))
tr = fams.get("agq_rpc_requests")
check("openmetrics: RPC counts carry method and code labels",
      tr is not None and any(s.labels.get("method") == "PlanService/SubmitPlan"
                             and s.labels.get("code") == "Ok" for s in tr.samples))

print(f"metrics-check: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
