-- The open jobs by worker selector, for the leader's drop of unused
-- selectors (src/store/postgres/maintenance.rs, `drop_unused_selectors`).
--
-- Every 50 maintenance ticks the leader drops the selectors no open job
-- uses. Its check, "no job with this selector is pending, running or in
-- backoff", had no index on `worker_selector`: each pass read every open
-- job for each selector it kept, so a backlog of a million jobs cost a
-- million rows read per pass. With this index the check is one index
-- probe per selector. Jobs without a selector (the empty one, never
-- dropped) are left out, so they cost no index write.
--
-- Applying it again changes nothing (IF NOT EXISTS): tests re-run the
-- migrations on a migrated database.
CREATE INDEX IF NOT EXISTS jobs_open_by_selector ON jobs (worker_selector)
    WHERE status IN (1, 2, 4) AND worker_selector <> '';
