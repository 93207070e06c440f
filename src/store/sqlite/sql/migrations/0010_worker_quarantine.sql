-- Quarantine: why a worker was flagged for investigation after too many
-- job timeouts (empty when it is not). Kept while the worker is away, so
-- the id comes back quarantined, until ReleaseWorker clears it.
ALTER TABLE workers ADD COLUMN quarantine_reason TEXT NOT NULL DEFAULT '';
