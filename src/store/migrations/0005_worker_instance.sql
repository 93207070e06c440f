-- One live process per worker id: the instance (process) that registered
-- the worker, so that after a restart of the server the same process
-- resumes and another one is told the id is taken while the first lives.
ALTER TABLE workers ADD COLUMN instance_id TEXT NOT NULL DEFAULT '';
