-- AGQ schema, version 4: job retention. `finished_at_ms` is when the last
-- open job (pending, running or failed-and-waiting) of an action ended; it
-- is NULL while any job of the action is open (a retried dead job opens it
-- again). The retention sweep deletes actions, with their jobs and task
-- results, once this time is older than the retention period, oldest
-- first, through the partial index below.
ALTER TABLE actions ADD COLUMN finished_at_ms INTEGER;

UPDATE actions
SET finished_at_ms = (
    SELECT coalesce(max(jobs.completed_at_ms), actions.created_at_ms)
    FROM jobs WHERE jobs.action_id = actions.action_id
)
WHERE NOT EXISTS (
    SELECT 1 FROM jobs
    WHERE jobs.action_id = actions.action_id AND jobs.status IN (1, 2, 4)
);

CREATE INDEX actions_by_finished ON actions(finished_at_ms)
    WHERE finished_at_ms IS NOT NULL;
