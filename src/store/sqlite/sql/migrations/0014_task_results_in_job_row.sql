-- A job's task results live in its own row, as one JSON array (NULL: none
-- reported), written by the statement that records the report: one row
-- write per report instead of a row plus one row per task in a second
-- table. Existing results are carried over in task order.
ALTER TABLE jobs ADD COLUMN task_results TEXT;

UPDATE jobs SET task_results = (
    SELECT json_group_array(json_object(
               'task_number', t.task_number,
               'command', t.command,
               'exit_code', t.exit_code,
               'stdout', t.stdout,
               'stderr', t.stderr,
               'duration_ms', t.duration_ms,
               'stdout_truncated', json(CASE WHEN t.stdout_truncated THEN 'true' ELSE 'false' END),
               'stderr_truncated', json(CASE WHEN t.stderr_truncated THEN 'true' ELSE 'false' END))
               ORDER BY t.task_number)
    FROM task_results t WHERE t.job_row = jobs.id
)
WHERE id IN (SELECT job_row FROM task_results);

DROP TABLE task_results;
