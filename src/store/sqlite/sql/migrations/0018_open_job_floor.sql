-- AGQ schema, version 18: start-up reads the open work, not the history.
--
-- Every job row below `first_open_row` is finished (completed, dead or
-- cancelled), so the start-up load of the open jobs (pending, running,
-- failed awaiting retry) reads the rows from it on instead of the whole
-- table. The writer raises it, in the transaction of a batch, to the
-- lowest row of an open job it holds in memory (every open job is); the
-- only statement that reopens a finished job (RetryJob and RetryAction)
-- lowers it to that job's row in its own transaction. New jobs get rows
-- above it. 0, as a database upgraded to this version starts: the first
-- load reads every row once, and a batch a second later raises it.
CREATE TABLE job_floor (
    one             INTEGER PRIMARY KEY CHECK (one = 1),
    first_open_row  INTEGER NOT NULL
);
INSERT INTO job_floor (one, first_open_row) VALUES (1, 0);

-- The unfinished actions, whose scheduling settings the same load reads:
-- proportional to them, not to every action kept.
CREATE INDEX actions_open ON actions(action_id) WHERE finished_at_ms IS NULL;
