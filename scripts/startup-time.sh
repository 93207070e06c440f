#!/usr/bin/env bash
# Times `agq serve` from its start to its `listening` line on a database
# with a long history of finished jobs, made here with sqlite3 in the
# schema of that agq: FINISHED completed jobs (actions of 100, 128-byte
# inputs) and 1,000 pending ones after them. Runs the server three times:
# the first start (which may migrate the database), then a start with the
# page cache dropped (when run as root) and one with it warm, which also
# times the first page of `agq job search --status pending`, of
# `--status dead` and of `--status cancelled` (there are none: the search
# finds that out).
#
#   bash scripts/startup-time.sh [AGQ_BINARY] [FINISHED]
#
# Defaults: target/release/agq (`cargo build --release`), 5,000,000 jobs
# (a 1.4 GB database, about 40 s to make). Needs sqlite3
# (`apt-get install sqlite3`).
set -euo pipefail
agq="${1:-target/release/agq}"
finished="${2:-5000000}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
db="$dir/agq.db"

# Starts the server, prints the seconds until it listens, stops it.
serve() {
  local start end pid
  start="$(date +%s.%N)"
  "$agq" serve --db "$db" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --no-console --job-retention-secs 0 >"$dir/log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do
    grep -q listening "$dir/log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$dir/log" >&2; exit 1; }
    sleep 0.05
  done
  end="$(date +%s.%N)"
  grep -q listening "$dir/log" || { cat "$dir/log" >&2; echo "no listening line" >&2; exit 1; }
  echo "$1: listening after $(echo "$end - $start" | bc) s"
  if [ -n "${3:-}" ]; then
    # The first page of SearchJobs by an open and by a finished status.
    local addr
    addr="$(sed -n 's/.*listening on \([0-9.:]*\).*/\1/p' "$dir/log" | head -1)"
    for status in pending dead cancelled; do
      start="$(date +%s.%N)"
      "$agq" job search --server "http://$addr" --status "$status" >/dev/null 2>&1
      end="$(date +%s.%N)"
      echo "  agq job search --status $status: $(echo "$end - $start" | bc) s"
    done
  fi
  # Long enough for a batch to store the open floor (at most once a second).
  sleep "${2:-0}"
  kill -INT "$pid"
  wait "$pid" || true
}

serve "schema only" 0 >/dev/null
base=$(( $(date +%s) * 1000 * 4096 ))
actions=$(( finished / 100 ))
sqlite3 "$db" >/dev/null <<SQL
PRAGMA synchronous=OFF;
BEGIN;
INSERT INTO plans(plan_id, description, body, created_at_ms, version, updated_at_ms)
  VALUES ('p', '', x'0a0170', 0, 1, 0);
INSERT INTO plan_versions(plan_id, version, description, body, created_at_ms)
  VALUES ('p', 1, '', x'0a0170', 0);
WITH RECURSIVE a(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM a WHERE n < $actions - 1)
INSERT INTO actions(action_id, plan_id, total_jobs, max_attempts, created_at_ms, finished_at_ms,
                    plan_version, first_job_row, last_job_row)
  SELECT 'a' || n, 'p', 100, 1, 0, 0, 1, $base + n * 100, $base + n * 100 + 99 FROM a;
WITH RECURSIVE j(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM j WHERE i < $actions * 100 - 1)
INSERT INTO job_rows(id, job_key, action_id, plan_id, status, input, attempt, max_attempts,
                     created_at_ms, ready_at_ms, started_at_ms, worker_id, lease_id,
                     lease_expires_at_ms, plan_version)
  SELECT $base + i, random(), 'a' || (i / 100), 'p', 2,
         '{"payload":"' || hex(randomblob(64)) || '"}', 1, 1, 0, 0, 0, 'w' || (i % 64),
         hex(randomblob(16)), 0, 1 FROM j;
INSERT INTO job_completions(job_row, attempt, completed_at_ms) SELECT id, 1, 1 FROM job_rows;
INSERT INTO actions(action_id, plan_id, total_jobs, max_attempts, created_at_ms, plan_version,
                    first_job_row, last_job_row)
  VALUES ('open', 'p', 1000, 1, 0, 1, $base + $actions * 100, $base + $actions * 100 + 999);
WITH RECURSIVE j(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM j WHERE i < 999)
INSERT INTO job_rows(id, job_key, action_id, plan_id, status, input, attempt, max_attempts,
                     created_at_ms, ready_at_ms, plan_version)
  SELECT $base + $actions * 100 + i, random(), 'open', 'p', 1,
         '{"payload":"' || hex(randomblob(64)) || '"}', 0, 1, 0, 0, 1 FROM j;
COMMIT;
PRAGMA wal_checkpoint(TRUNCATE);
SQL
echo "database: $(du -h "$db" | cut -f1), $((actions * 100)) finished jobs and 1000 pending"
serve "first start" 3
if [ "$(id -u)" = 0 ]; then
  sync
  echo 3 >/proc/sys/vm/drop_caches
  serve "cold page cache"
fi
serve "warm page cache" 0 search
