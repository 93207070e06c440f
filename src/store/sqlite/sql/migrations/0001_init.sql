-- AGQ schema, version 1. Times are milliseconds since the Unix epoch.

CREATE TABLE plans (
    plan_id        TEXT PRIMARY KEY,
    description    TEXT NOT NULL,
    body           BLOB NOT NULL,            -- encoded agq.v1.Plan
    created_at_ms  INTEGER NOT NULL
);

CREATE TABLE actions (
    action_id      TEXT PRIMARY KEY,
    plan_id        TEXT NOT NULL REFERENCES plans(plan_id) ON DELETE CASCADE,
    total_jobs     INTEGER NOT NULL,
    max_attempts   INTEGER NOT NULL,
    run_at_ms      INTEGER,
    created_at_ms  INTEGER NOT NULL
);
CREATE INDEX actions_by_plan ON actions(plan_id);

-- One row per job. `id` gives the FIFO order; `job_id` is the public id.
CREATE TABLE jobs (
    id                   INTEGER PRIMARY KEY,
    job_id               TEXT NOT NULL UNIQUE,
    action_id            TEXT NOT NULL REFERENCES actions(action_id) ON DELETE CASCADE,
    plan_id              TEXT NOT NULL,
    status               INTEGER NOT NULL,   -- agq.v1.JobStatus
    input                TEXT NOT NULL,      -- JSON object of strings
    attempt              INTEGER NOT NULL DEFAULT 0,
    max_attempts         INTEGER NOT NULL,
    created_at_ms        INTEGER NOT NULL,
    ready_at_ms          INTEGER NOT NULL,   -- pending/failed: eligible from
    started_at_ms        INTEGER,
    completed_at_ms      INTEGER,
    worker_id            TEXT,               -- current or last lease holder
    lease_id             TEXT,               -- current lease (fencing token) while running
    lease_expires_at_ms  INTEGER,
    error                TEXT NOT NULL DEFAULT '',
    current_task         INTEGER NOT NULL DEFAULT 0,
    progress_percent     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX jobs_by_action ON jobs(action_id, status);
CREATE INDEX jobs_by_status ON jobs(status, id);
CREATE INDEX jobs_by_plan ON jobs(plan_id, status);
CREATE INDEX jobs_by_created ON jobs(created_at_ms);

CREATE TABLE task_results (
    job_row           INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    task_number       INTEGER NOT NULL,
    command           TEXT NOT NULL,
    exit_code         INTEGER NOT NULL,
    stdout            TEXT NOT NULL,
    stderr            TEXT NOT NULL,
    duration_ms       INTEGER NOT NULL,
    stdout_truncated  INTEGER NOT NULL,
    stderr_truncated  INTEGER NOT NULL,
    PRIMARY KEY (job_row, task_number)
) WITHOUT ROWID;

CREATE TABLE workers (
    worker_id             TEXT PRIMARY KEY,
    hostname              TEXT NOT NULL,
    platform              TEXT NOT NULL,
    agw_version           TEXT NOT NULL,
    agentic_units         TEXT NOT NULL,     -- JSON array
    tags                  TEXT NOT NULL,     -- JSON object
    max_concurrent_jobs   INTEGER NOT NULL,
    state                 INTEGER NOT NULL,  -- agq.v1.WorkerState
    registered_at_ms      INTEGER NOT NULL,
    last_heartbeat_at_ms  INTEGER,
    stats                 BLOB               -- encoded agq.v1.WorkerStats
);

-- Capability index: which worker advertises which tool.
CREATE TABLE worker_tools (
    tool       TEXT NOT NULL,
    worker_id  TEXT NOT NULL REFERENCES workers(worker_id) ON DELETE CASCADE,
    PRIMARY KEY (tool, worker_id)
) WITHOUT ROWID;
CREATE INDEX worker_tools_by_worker ON worker_tools(worker_id);
