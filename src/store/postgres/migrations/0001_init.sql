-- AGQ's PostgreSQL schema, version 1. Times are milliseconds since the
-- epoch, always taken from the database's clock (agq_now_ms()), never a
-- replica's. Status and state numbers are those of agq.v1.JobStatus and
-- agq.v1.WorkerState.

CREATE FUNCTION agq_now_ms() RETURNS bigint LANGUAGE sql VOLATILE AS
$$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

CREATE TABLE plans (
    plan_id        text PRIMARY KEY,
    description    text NOT NULL,
    version        integer NOT NULL,
    created_at_ms  bigint NOT NULL,
    updated_at_ms  bigint NOT NULL
);

-- Every version of every plan, the latest included; immutable rows.
CREATE TABLE plan_versions (
    plan_id           text NOT NULL REFERENCES plans (plan_id) ON DELETE CASCADE,
    version           integer NOT NULL,
    description       text NOT NULL,
    body              bytea NOT NULL,          -- encoded agq.v1.Plan
    task_count        integer NOT NULL,
    tools             text[] NOT NULL,         -- the executables its tasks run
    require_sandbox   boolean NOT NULL,
    require_verified  boolean NOT NULL,
    created_at_ms     bigint NOT NULL,
    PRIMARY KEY (plan_id, version)
);

CREATE TABLE actions (
    seq              bigserial NOT NULL UNIQUE,
    action_id        text PRIMARY KEY,
    plan_id          text NOT NULL REFERENCES plans (plan_id) ON DELETE CASCADE,
    plan_version     integer NOT NULL,
    total_jobs       integer NOT NULL,
    max_attempts     integer NOT NULL,
    run_at_ms        bigint,
    created_at_ms    bigint NOT NULL,
    finished_at_ms   bigint,                   -- set once no job is pending, running or failed
    traceparent      text,
    priority         integer NOT NULL,
    worker_selector  text NOT NULL,
    concurrency_key  text NOT NULL,
    max_running      integer NOT NULL
);
CREATE INDEX actions_by_created ON actions (created_at_ms, seq);
CREATE INDEX actions_by_plan ON actions (plan_id, created_at_ms, seq);
CREATE INDEX actions_by_finished ON actions (finished_at_ms) WHERE finished_at_ms IS NOT NULL;
CREATE INDEX actions_open ON actions (seq) WHERE finished_at_ms IS NULL;

CREATE TABLE jobs (
    id                   bigserial PRIMARY KEY,
    job_id               text NOT NULL UNIQUE,
    action_id            text NOT NULL REFERENCES actions (action_id) ON DELETE CASCADE,
    plan_id              text NOT NULL,
    plan_version         integer NOT NULL,
    status               smallint NOT NULL,
    input                text NOT NULL,        -- JSON object of strings
    attempt              integer NOT NULL DEFAULT 0,
    max_attempts         integer NOT NULL,
    created_at_ms        bigint NOT NULL,
    ready_at_ms          bigint NOT NULL,      -- pending/failed: eligible from
    started_at_ms        bigint,
    completed_at_ms      bigint,
    worker_id            text,                 -- current or last lease holder
    lease_id             text,                 -- the fencing token while running
    lease_expires_at_ms  bigint,
    error                text NOT NULL DEFAULT '',
    current_task         integer NOT NULL DEFAULT 0,
    progress_percent     integer NOT NULL DEFAULT 0,
    priority             integer NOT NULL,
    task_results         text,                 -- JSON array of task results
    worker_selector      text NOT NULL,        -- the action's, copied for the claim
    concurrency_key      text NOT NULL,
    max_running          integer NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 1,
        autovacuum_analyze_scale_factor = 0.05);
-- The claim's order (priority, then submission) over ready rows only:
-- claimed rows leave the index, so a claim never walks past them.
CREATE INDEX jobs_claim ON jobs (priority DESC, id) WHERE status = 1;
CREATE INDEX jobs_by_action ON jobs (action_id, id);
-- Whether an action still has work (pending, running, failed).
CREATE INDEX jobs_open_by_action ON jobs (action_id) WHERE status IN (1, 2, 4);
CREATE INDEX jobs_by_status ON jobs (status, id);
CREATE INDEX jobs_running_by_worker ON jobs (worker_id) WHERE status = 2;
CREATE INDEX jobs_lease_expiry ON jobs (lease_expires_at_ms) WHERE status = 2;
CREATE INDEX jobs_running_by_key ON jobs (concurrency_key) WHERE status = 2 AND concurrency_key <> '';
CREATE INDEX jobs_backoff ON jobs (ready_at_ms) WHERE status = 4;

-- Worker selectors of submitted actions, so a replica can tell which of
-- them its workers match without reading the jobs.
CREATE TABLE selectors (
    selector  text PRIMARY KEY
);
INSERT INTO selectors VALUES ('');

CREATE TABLE workers (
    worker_id             text PRIMARY KEY,
    hostname              text NOT NULL,
    platform              text NOT NULL,
    agw_version           text NOT NULL,
    units                 text NOT NULL,       -- JSON array of agentic units
    tools                 text[] NOT NULL,     -- every command it advertises
    tags                  text NOT NULL,       -- JSON object
    max_concurrent_jobs   integer NOT NULL,
    state                 smallint NOT NULL,
    registered_at_ms      bigint NOT NULL,
    last_heartbeat_at_ms  bigint NOT NULL,
    stats                 bytea,               -- encoded agq.v1.WorkerStats
    instance_id           text NOT NULL,
    sandboxed             boolean NOT NULL,
    quarantine_reason     text NOT NULL DEFAULT '',
    timeouts_ms           bigint[] NOT NULL DEFAULT '{}',  -- recent lease timeouts
    replica_id            text,                -- the replica holding its heartbeat stream
    conn_epoch            bigint NOT NULL DEFAULT 0,  -- bumped on every stream (re)connect
    heartbeat_open        boolean NOT NULL DEFAULT false,
    lease_stream_open     boolean NOT NULL DEFAULT false,
    suspect_since_ms      bigint               -- heartbeat stream dropped at
);

CREATE TABLE worker_verifications (
    worker_id        text NOT NULL REFERENCES workers (worker_id) ON DELETE CASCADE,
    tool             text NOT NULL,
    args             text NOT NULL,            -- JSON array of strings
    challenge_id     text NOT NULL,
    requested_at_ms  bigint NOT NULL,
    answered_at_ms   bigint,
    passed           boolean NOT NULL,
    exit_code        integer NOT NULL,
    output           text NOT NULL,
    error            text NOT NULL,
    PRIMARY KEY (worker_id, tool)
);

-- Commands for workers (cancel a job, drain, verify, hang up), delivered
-- by the replica that holds the worker's heartbeat stream.
CREATE TABLE worker_commands (
    id             bigserial PRIMARY KEY,
    worker_id      text NOT NULL,
    command        text NOT NULL,              -- JSON
    created_at_ms  bigint NOT NULL
);
CREATE INDEX worker_commands_by_worker ON worker_commands (worker_id, id);

CREATE TABLE schedules (
    schedule_id      text PRIMARY KEY,
    plan_id          text NOT NULL,
    cron             text NOT NULL,
    time_zone        text NOT NULL,
    inputs           text NOT NULL,            -- JSON array of objects of strings
    max_attempts     integer NOT NULL,
    priority         integer NOT NULL,
    worker_selector  text NOT NULL,
    concurrency_key  text NOT NULL,
    max_running      integer NOT NULL,
    catch_up         integer NOT NULL,
    next_run_ms      bigint,
    last_run_ms      bigint,
    last_action_id   text NOT NULL DEFAULT '',
    runs             bigint NOT NULL DEFAULT 0,
    last_error       text NOT NULL DEFAULT '',
    created_at_ms    bigint NOT NULL
);
CREATE INDEX schedules_by_next_run ON schedules (next_run_ms) WHERE next_run_ms IS NOT NULL;

-- Replicas alive, refreshed by each every second.
CREATE TABLE replicas (
    replica_id     text PRIMARY KEY,
    hostname       text NOT NULL,
    started_at_ms  bigint NOT NULL,
    last_seen_ms   bigint NOT NULL
);

-- The maintenance leader: one row, held for a TTL and renewed.
CREATE TABLE leader (
    name           text PRIMARY KEY,
    holder         text NOT NULL,
    term           bigint NOT NULL,
    expires_at_ms  bigint NOT NULL
);

-- Capability challenges sent and not answered yet.
CREATE TABLE worker_challenges (
    challenge_id     text PRIMARY KEY,
    worker_id        text NOT NULL REFERENCES workers (worker_id) ON DELETE CASCADE,
    tool             text NOT NULL,
    args             text NOT NULL,            -- JSON array of strings
    requested_at_ms  bigint NOT NULL
);
CREATE INDEX worker_challenges_by_worker ON worker_challenges (worker_id);
