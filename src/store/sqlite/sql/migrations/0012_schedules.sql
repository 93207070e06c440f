-- AGQ schema, version 12: recurring schedules (ScheduleService).
--
-- A schedule submits an action of `plan_id` with `inputs` at every tick of
-- `cron` read in `time_zone`. `next_run_ms` is the first tick not yet
-- fired (NULL while paused): firing a tick submits its action and moves
-- `next_run_ms` past it in one transaction, so a tick fires exactly once.
-- No foreign key to `plans`: a schedule outlives its plan, and a tick of a
-- missing plan records `last_error` instead of an action.
CREATE TABLE schedules (
    schedule_id      TEXT PRIMARY KEY,
    plan_id          TEXT NOT NULL,
    cron             TEXT NOT NULL,
    time_zone        TEXT NOT NULL,
    inputs           TEXT NOT NULL,            -- JSON array of objects of strings
    max_attempts     INTEGER NOT NULL,
    priority         INTEGER NOT NULL,
    worker_selector  TEXT NOT NULL,
    concurrency_key  TEXT NOT NULL,
    max_running      INTEGER NOT NULL,
    catch_up         INTEGER NOT NULL,         -- agq.v1.CatchUp
    next_run_ms      INTEGER,
    last_run_ms      INTEGER,
    last_action_id   TEXT NOT NULL DEFAULT '',
    runs             INTEGER NOT NULL DEFAULT 0,
    last_error       TEXT NOT NULL DEFAULT '',
    created_at_ms    INTEGER NOT NULL
);
CREATE INDEX schedules_by_next_run ON schedules(next_run_ms) WHERE next_run_ms IS NOT NULL;
