#!/usr/bin/env bash
# Writes the seed corpus of every fuzz target under fuzz/corpus/<target>/
# from the text-format messages below, encoded by protoc (the copy the
# protoc-bin-vendored build dependency unpacks into the cargo registry, or
# $PROTOC). Targets whose first byte picks the message get that byte
# prepended. Re-run after changing a seed; the files are committed.
#
# The min-<sha1> files next to the seeds are not written here: they are the
# long run's corpus minimized to coverage edges (RELIABILITY.md, Fuzzing):
#   <fuzz binary> -merge=1 -use_counters=0 -max_len=4096 NEW corpus/T corpus-run/T
set -euo pipefail
cd "$(dirname "$0")/../.."

PROTOC=${PROTOC:-$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/protoc-bin-vendored-linux-x86_64-*/bin/protoc 2>/dev/null | tail -1)}
INCLUDE=$(dirname "$(dirname "$PROTOC")")/include
[ -x "$PROTOC" ] || { echo "no protoc; set PROTOC" >&2; exit 1; }

# seed TARGET NAME MESSAGE [SELECTOR_BYTE] < textproto
seed() {
  local target=$1 name=$2 msg=$3 sel=${4:-}
  mkdir -p "fuzz/corpus/$target"
  local out="fuzz/corpus/$target/seed-$name"
  {
    if [ -n "$sel" ]; then printf "\\x$(printf %02x "$sel")"; fi
    "$PROTOC" -Iproto -I"$INCLUDE" --encode="agq.v1.$msg" proto/agq/v1/*.proto
  } > "$out"
}

# ---- submit_plan: SubmitPlanRequest ----
P=SubmitPlanRequest
seed submit_plan valid-one-task $P <<'T'
plan { plan_id: "p1" tasks { task_number: 1 command: "cat" args: "{{file}}" timeout_secs: 10 } }
T
seed submit_plan valid-pipeline $P <<'T'
plan { plan_id: "wc.pipe-2_x" plan_description: "count words"
  tasks { task_number: 1 command: "cat" args: "{{file}}" timeout_secs: 60 }
  tasks { task_number: 2 command: "tr" args: "-s" args: " " args: "\\n" timeout_secs: 60 input_from_task: 1 }
  tasks { task_number: 3 command: "sort" timeout_secs: 86400 input_from_task: 2 }
  tasks { task_number: 4 command: "uniq" args: "-c" timeout_secs: 1 input_from_task: 3 } }
T
seed submit_plan existing-id $P <<'T'
plan { plan_id: "fuzz-plan" tasks { task_number: 1 command: "cat" timeout_secs: 10 } }
T
seed submit_plan no-plan $P <<'T'
T
seed submit_plan no-tasks $P <<'T'
plan { plan_id: "empty" }
T
seed submit_plan path-command $P <<'T'
plan { plan_id: "p2" tasks { task_number: 1 command: "/bin/sh" args: "-c" args: "rm -rf /" timeout_secs: 10 } }
T
seed submit_plan dot-ids $P <<'T'
plan { plan_id: ".." tasks { task_number: 1 command: "g++" timeout_secs: 10 } }
T
seed submit_plan bad-numbering $P <<'T'
plan { plan_id: "p3" tasks { task_number: 2 command: "cat" timeout_secs: 10 } tasks { task_number: 1 command: "cat" timeout_secs: 10 } }
T
seed submit_plan forward-input $P <<'T'
plan { plan_id: "p4" tasks { task_number: 1 command: "cat" timeout_secs: 10 input_from_task: 1 } }
T
seed submit_plan nul-arg $P <<'T'
plan { plan_id: "p5" tasks { task_number: 1 command: "echo" args: "a\000b" timeout_secs: 10 } }
T
seed submit_plan zero-timeout $P <<'T'
plan { plan_id: "p6" tasks { task_number: 1 command: "sleep" args: "1" timeout_secs: 0 } }
T
seed submit_plan unicode $P <<'T'
plan { plan_id: "p7" plan_description: "\303\251t\303\251" tasks { task_number: 1 command: "python3.11" args: "\360\237\246\200 {{ x }}" timeout_secs: 10 } }
T

# ---- submit_action: SubmitActionRequest (plan "fuzz-plan" exists) ----
A=SubmitActionRequest
seed submit_action valid-two-inputs $A <<'T'
plan_id: "fuzz-plan"
inputs { values { key: "file" value: "/tmp/a.txt" } values { key: "key" value: "2" } }
inputs { values { key: "file" value: "/tmp/b.txt" } values { key: "key" value: "1" } }
T
seed submit_action named-action $A <<'T'
plan_id: "fuzz-plan" action_id: "act-1" max_attempts: 5
inputs { values { key: "file" value: "{{key}}" } values { key: "key" value: "{{file}}" } }
T
seed submit_action missing-variable $A <<'T'
plan_id: "fuzz-plan" inputs { values { key: "file" value: "x" } }
T
seed submit_action empty-input $A <<'T'
plan_id: "fuzz-plan" inputs { }
T
seed submit_action scheduled $A <<'T'
plan_id: "fuzz-plan" run_at { seconds: 4102444800 } inputs { values { key: "file" value: "f" } values { key: "key" value: "k" } }
T
seed submit_action bad-run-at $A <<'T'
plan_id: "fuzz-plan" run_at { seconds: 1 nanos: -1 } inputs { values { key: "file" value: "f" } }
T
seed submit_action unknown-plan $A <<'T'
plan_id: "nope" inputs { values { key: "file" value: "f" } }
T
seed submit_action no-inputs $A <<'T'
plan_id: "fuzz-plan"
T
seed submit_action bad-key $A <<'T'
plan_id: "fuzz-plan" inputs { values { key: "a b" value: "f" } }
T
seed submit_action too-many-attempts $A <<'T'
plan_id: "fuzz-plan" max_attempts: 101 inputs { values { key: "file" value: "f" } }
T

# ---- template: JobLease (the worker renders plan args with job.input) ----
L=JobLease
seed template fixture $L <<'T'
lease_id: "l" plan { plan_id: "p" tasks { task_number: 1 command: "cat" args: "{{file}}" args: "-k{{ key }}" args: "{{}}" args: "{{unclosed" args: "}}{{file}}}}" } }
job { input { key: "file" value: "/tmp/x" } input { key: "key" value: "2" } }
T
seed template nested-values $L <<'T'
plan { tasks { args: "{{a}}{{b}}" args: "{{{{a}}}}" args: "{{ a }}x{{b" } }
job { input { key: "a" value: "{{b}}" } input { key: "b" value: "}}" } }
T
seed template missing $L <<'T'
plan { tasks { args: "--in={{file}}" args: "{{ }}" } }
T
seed template unicode $L <<'T'
plan { tasks { args: "\303\251{{\303\251}}\360\237\246\200{{n}}" } }
job { input { key: "\303\251" value: "\342\202\254" } input { key: "n" value: "" } }
T

# ---- queries: selector byte, then the request ----
seed queries list-all ListPlansRequest 0 <<'T'
T
seed queries list-glob ListPlansRequest 0 <<'T'
pattern: "a*" page_size: 2
T
seed queries list-class ListPlansRequest 0 <<'T'
pattern: "[a-c]?"
T
seed queries list-negated ListPlansRequest 0 <<'T'
pattern: "[!a]*"
T
seed queries list-caret ListPlansRequest 0 <<'T'
pattern: "[^a]*"
T
seed queries list-stars ListPlansRequest 0 <<'T'
pattern: "**********a"
T
# Found by the fuzzer (issue 14 item 4: ListPlans matched with another engine than it validated with; fixed):
seed queries list-reversed-range ListPlansRequest 0 <<'T'
pattern: "[a-!]?"
T
seed queries list-recursive ListPlansRequest 0 <<'T'
pattern: "**/**/**/*a"
T
seed queries list-token ListPlansRequest 0 <<'T'
page_size: 1 page_token: "706c616e3a61"
T
seed queries search SearchJobsRequest 1 <<'T'
status: JOB_STATUS_PENDING plan_id: "fuzz-plan" created_after { seconds: 0 } page_size: 10
T
seed queries search-bad-token SearchJobsRequest 1 <<'T'
page_token: "zz" status: 99
T
seed queries list-jobs ListJobsRequest 2 <<'T'
action_id: "act-1" page_size: 1001
T
seed queries peek PeekQueueRequest 3 <<'T'
queue: "scheduled" count: 1000
T
seed queries peek-bad PeekQueueRequest 3 <<'T'
queue: "other"
T
seed queries get-ids GetJobRequest 4 <<'T'
job_id: "fuzz-plan"
T
seed queries get-bad-id GetJobRequest 4 <<'T'
job_id: "../etc/passwd"
T

# A protobuf varint (a length prefix).
varint() {
  local n=$1
  while [ "$n" -ge 128 ]; do
    printf "\\x$(printf %02x $(((n & 127) | 128)))"
    n=$((n >> 7))
  done
  printf "\\x$(printf %02x "$n")"
}

# stream_seed NAME IDENTITY_BYTE < ReportJobsRequests in text format, one
# after another, separated by lines of "---": the worker_reports target's
# ReportJobs input (selector 0xC0, the identity byte, then each request
# length-delimited).
stream_seed() {
  local name=$1 who=$2 tmp f
  tmp=$(mktemp -d)
  awk -v d="$tmp" 'BEGIN { n = 0 } /^---$/ { n++; next } { print > (d "/" n) }'
  {
    printf '\xc0'
    printf "\\x$(printf %02x "$who")"
    for f in $(ls "$tmp" | sort -n); do
      "$PROTOC" -Iproto -I"$INCLUDE" --encode=agq.v1.ReportJobsRequest proto/agq/v1/*.proto \
        < "$tmp/$f" > "$tmp/$f.bin"
      varint "$(stat -c %s "$tmp/$f.bin")"
      cat "$tmp/$f.bin"
    done
  } > "fuzz/corpus/worker_reports/seed-$name"
  rm -rf "$tmp"
}

# ---- worker_reports: selector byte, then the request ----
seed worker_reports register RegisterWorkerRequest 0 <<'T'
worker_id: "w-1" hostname: "host" platform: "linux-x86_64" agw_version: "0.1.0"
capabilities { tools: "sort" tools: "cat" tools: "cat" agentic_units: "claude" } max_concurrent_jobs: 4 tags { key: "zone" value: "a" }
T
seed worker_reports register-bad RegisterWorkerRequest 0 <<'T'
worker_id: "w 1" hostname: "" agw_version: "x" max_concurrent_jobs: 5000 capabilities { tools: "/bin/sh" }
T
seed worker_reports register-taken RegisterWorkerRequest 0 <<'T'
worker_id: "fuzz-w" hostname: "h" agw_version: "1"
T
seed worker_reports update-running UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "fuzz-w" lease_id: "LEASE" status: JOB_STATUS_RUNNING current_task: 1 progress_percent: 50
task_results { task_number: 1 command: "cat" exit_code: 0 stdout: "out" duration_ms: 5 }
T
seed worker_reports update-completed UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "fuzz-w" lease_id: "LEASE" status: JOB_STATUS_COMPLETED
task_results { task_number: 1 command: "cat" stdout: "a" } task_results { task_number: 2 command: "sort" stdout: "a" stdout_truncated: true }
T
seed worker_reports update-failed UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "fuzz-w" lease_id: "LEASE" status: JOB_STATUS_FAILED error: "exit 1"
task_results { task_number: 1 command: "cat" exit_code: 1 stderr: "no such file" }
T
seed worker_reports update-stale-lease UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "fuzz-w" lease_id: "not-the-lease" status: JOB_STATUS_COMPLETED
T
seed worker_reports update-other-worker UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "intruder" lease_id: "LEASE" status: JOB_STATUS_COMPLETED
T
seed worker_reports update-bad-progress UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "fuzz-w" lease_id: "LEASE" status: JOB_STATUS_RUNNING progress_percent: 101
T
seed worker_reports update-bad-status UpdateJobRequest 1 <<'T'
job_id: "JOB" worker_id: "fuzz-w" lease_id: "LEASE" status: JOB_STATUS_DEAD
T
seed worker_reports update-unknown-job UpdateJobRequest 1 <<'T'
job_id: "0190e0e0-0000-7000-8000-000000000000" worker_id: "fuzz-w" lease_id: "x" status: JOB_STATUS_COMPLETED
T
seed worker_reports batch BatchUpdateJobsRequest 2 <<'T'
worker_id: "fuzz-w"
requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_RUNNING progress_percent: 10 }
requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_COMPLETED }
requests { job_id: "JOB" worker_id: "fuzz-w" lease_id: "LEASE" status: JOB_STATUS_FAILED }
T
seed worker_reports batch-mixed-worker BatchUpdateJobsRequest 2 <<'T'
worker_id: "fuzz-w" requests { job_id: "JOB" worker_id: "other" lease_id: "LEASE" status: JOB_STATUS_COMPLETED }
T
seed worker_reports batch-empty BatchUpdateJobsRequest 2 <<'T'
worker_id: "fuzz-w"
T
# ReportJobs; identity byte: 0 none (auth off), 1 fuzz-w's token,
# 2 another worker's, 3 the pool "fuzz-", 4 a client's.
stream_seed stream-progress-then-complete 1 <<'T'
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_RUNNING progress_percent: 40 }
---
worker_id: "fuzz-w"
requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_COMPLETED task_results { task_number: 1 command: "cat" stdout: "a" } }
T
stream_seed stream-worker-changes 0 <<'T'
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_RUNNING current_task: 1 }
---
worker_id: "other" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_COMPLETED }
---
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_FAILED error: "not applied" }
T
stream_seed stream-other-workers-token 2 <<'T'
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_COMPLETED }
T
stream_seed stream-pool-empty-request 3 <<'T'
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_RUNNING progress_percent: 5 }
---
worker_id: "fuzz-w"
---
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_COMPLETED }
T
stream_seed stream-client-token 4 <<'T'
worker_id: "fuzz-w" requests { job_id: "JOB" lease_id: "LEASE" status: JOB_STATUS_COMPLETED }
T

echo "seeds: $(find fuzz/corpus -name 'seed-*' | wc -l) files, $(du -sh fuzz/corpus | cut -f1)"
