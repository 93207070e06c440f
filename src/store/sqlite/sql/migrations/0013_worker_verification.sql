-- AGQ schema, version 13: capability verification (WORKER.VERIFY).
--
-- The latest answered verification of each tool or agentic unit a worker
-- was challenged on. A verification is of one worker process: the rows of
-- a worker are deleted when it registers again as another process, and
-- with the worker. (The `workers.agentic_units` column now holds the units
-- as they described themselves, a JSON array of objects; older rows hold
-- their names, which still load.)
CREATE TABLE worker_verifications (
    worker_id        TEXT NOT NULL REFERENCES workers(worker_id) ON DELETE CASCADE,
    tool             TEXT NOT NULL,
    args             TEXT NOT NULL,            -- JSON array of strings
    challenge_id     TEXT NOT NULL,
    requested_at_ms  INTEGER NOT NULL,
    answered_at_ms   INTEGER,
    passed           INTEGER NOT NULL,
    exit_code        INTEGER NOT NULL,
    output           TEXT NOT NULL,
    error            TEXT NOT NULL,
    PRIMARY KEY (worker_id, tool)
);
