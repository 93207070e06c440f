-- One live process per worker id: the instance (process) that registered
-- the worker, so that after a restart of the server the same process
-- resumes and another one is told the id is taken while the first lives.
ALTER TABLE workers ADD COLUMN instance_id TEXT NOT NULL DEFAULT '';

-- (No change to jobs, only to what a column means: jobs.lease_id now also
-- stays set on a job whose attempt the worker itself reported completed or
-- failed, naming the lease of that report, so that a repeat of the report
-- whose first reply was lost is acknowledged instead of refused.)
