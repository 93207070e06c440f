-- AGQ schema, version 17: a job's completion is a row of its own.
--
-- Completing a job rewrote its whole row (22 columns) to change five of
-- them; the completion, the most frequent write of all, now inserts one
-- short row into `job_completions`, keyed by the job's row, in the same
-- transaction that acknowledges the report. The table of job rows is
-- `job_rows`; `jobs` is the view that reads a job as the API sees it: a
-- job is completed when it runs and has a completion row recorded in the
-- attempt it runs (the attempt number is the fencing token: every lease
-- grant makes it one larger, and RetryJob, which starts again from 0,
-- deletes the job's completion row): then it has its completion time
-- and task results, no lease expiry, no error and progress 100. This
-- checks again, for every reader, what the writer checked against its
-- leases before it inserted the row: a completion of another attempt,
-- or of a job that does not run, changes nothing a reader sees. Jobs
-- completed before this version keep their status in `job_rows` and have
-- no completion row.
--
-- Every change of a job other than its completion (grant, progress,
-- failure, cancel, retry) writes `job_rows`; none of them applies to a
-- completed job, which is final. Retention and DeletePlan delete a job's
-- completion row with its job row.
ALTER TABLE jobs RENAME TO job_rows;

CREATE TABLE job_completions (
    job_row          INTEGER PRIMARY KEY, -- job_rows.id of the completed job
    attempt          INTEGER NOT NULL,    -- the attempt (job_rows.attempt) it completed
    completed_at_ms  INTEGER NOT NULL,
    task_results     TEXT                 -- JSON array (NULL: none reported)
);

CREATE VIEW jobs AS
SELECT j.id, j.job_key, j.job_id, j.action_id, j.plan_id,
       CASE WHEN c.job_row IS NULL THEN j.status ELSE 3 END AS status, -- 3: JOB_STATUS_COMPLETED
       j.input, j.attempt, j.max_attempts, j.created_at_ms, j.ready_at_ms, j.started_at_ms,
       CASE WHEN c.job_row IS NULL THEN j.completed_at_ms ELSE c.completed_at_ms END AS completed_at_ms,
       j.worker_id, j.lease_id,
       CASE WHEN c.job_row IS NULL THEN j.lease_expires_at_ms END AS lease_expires_at_ms,
       CASE WHEN c.job_row IS NULL THEN j.error ELSE '' END AS error,
       j.current_task,
       CASE WHEN c.job_row IS NULL THEN j.progress_percent ELSE 100 END AS progress_percent,
       j.plan_version, j.priority,
       CASE WHEN c.job_row IS NULL THEN j.task_results ELSE c.task_results END AS task_results
FROM job_rows j LEFT JOIN job_completions c
    ON c.job_row = j.id AND c.attempt = j.attempt AND j.status = 2; -- 2: JOB_STATUS_RUNNING
