-- AGQ schema, version 16: a new job is one B-tree insert, not three.
--
-- Until now each job insert also wrote an entry of the `job_id` UNIQUE
-- index and of `jobs_by_action`, and checked its action row for the
-- foreign key. Now:
--
-- * A job's public id is made from its row: `id` is a sequence of unix
--   milliseconds << 12 plus a 12-bit counter, and the public id is the
--   UUIDv7 whose timestamp and counter are those bits and whose low 64
--   bits are the random `job_key`. A look-up by public id is a look-up
--   by row id that also checks the key. `job_id` keeps the public id of
--   the jobs created before this version (NULL for every later job),
--   found by a partial index that later jobs never enter.
-- * An action's jobs are inserted in one transaction by the one writer,
--   so their rows are one contiguous range: `actions.first_job_row` and
--   `last_job_row` bound it, and the queries of one action's jobs scan
--   that range of the table (and still match `action_id`).
-- * The jobs of an action or plan that is deleted are deleted by the
--   statements that delete it (retention, DeletePlan), not by a foreign
--   key cascade, which would need an index on `jobs.action_id`.
ALTER TABLE actions ADD COLUMN first_job_row INTEGER;
ALTER TABLE actions ADD COLUMN last_job_row INTEGER;
UPDATE actions SET (first_job_row, last_job_row) =
    (SELECT min(id), max(id) FROM jobs WHERE jobs.action_id = actions.action_id);

CREATE TABLE jobs_v16 (
    id                   INTEGER PRIMARY KEY, -- FIFO order; the high part of the public id
    job_key              INTEGER,             -- low 64 bits of the public id (NULL: `job_id` holds it)
    job_id               TEXT,                -- public id of a job created before version 16
    action_id            TEXT NOT NULL,
    plan_id              TEXT NOT NULL,
    status               INTEGER NOT NULL,    -- agq.v1.JobStatus
    input                TEXT NOT NULL,       -- JSON object of strings
    attempt              INTEGER NOT NULL DEFAULT 0,
    max_attempts         INTEGER NOT NULL,
    created_at_ms        INTEGER NOT NULL,
    ready_at_ms          INTEGER NOT NULL,    -- pending/failed: eligible from
    started_at_ms        INTEGER,
    completed_at_ms      INTEGER,
    worker_id            TEXT,                -- current or last lease holder
    lease_id             TEXT,                -- current lease (fencing token) while running
    lease_expires_at_ms  INTEGER,
    error                TEXT NOT NULL DEFAULT '',
    current_task         INTEGER NOT NULL DEFAULT 0,
    progress_percent     INTEGER NOT NULL DEFAULT 0,
    plan_version         INTEGER NOT NULL DEFAULT 1,
    priority             INTEGER NOT NULL DEFAULT 0,
    task_results         TEXT                 -- JSON array (NULL: none reported)
);
INSERT INTO jobs_v16 (id, job_key, job_id, action_id, plan_id, status, input, attempt, max_attempts,
                      created_at_ms, ready_at_ms, started_at_ms, completed_at_ms, worker_id, lease_id,
                      lease_expires_at_ms, error, current_task, progress_percent, plan_version, priority,
                      task_results)
    SELECT id, NULL, job_id, action_id, plan_id, status, input, attempt, max_attempts,
           created_at_ms, ready_at_ms, started_at_ms, completed_at_ms, worker_id, lease_id,
           lease_expires_at_ms, error, current_task, progress_percent, plan_version, priority,
           task_results
    FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_v16 RENAME TO jobs;
CREATE UNIQUE INDEX jobs_by_legacy_id ON jobs(job_id) WHERE job_id IS NOT NULL;
CREATE INDEX jobs_dead_by_action ON jobs(action_id) WHERE status = 5;
