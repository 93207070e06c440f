-- Pending jobs scheduled for later (an action's `run_at`) leave the
-- claim's index until they are due.
--
-- A job submitted with a `run_at` ahead is pending (status 1) from its
-- submission, so it sat in `jobs_claim` with the jobs ready now, and every
-- claim (and every dispatcher round's readiness check) walked past all of
-- them, filtering on `ready_at_ms`, before it reached a job ready now:
-- with 100,000 jobs scheduled an hour ahead, 100,000 index entries and
-- their rows per claim.
--
-- `delayed` is true for such a job from its submission until a dispatcher
-- sees it due and clears it (src/store/postgres/dispatch.rs, walking
-- `jobs_delayed` from its earliest `ready_at_ms`); every other write that
-- makes a job pending (a retry, a backoff ended or not needed) makes it
-- ready now and clears it. The claim's index holds the pending jobs that
-- are not delayed, in the same order as before. The column only decides
-- which index a pending job is in: the job's status, its `ready_at_ms`
-- and everything the API reports of it stay as they were, and the claim
-- still checks `ready_at_ms`.
--
-- Applying it again changes nothing (the forms with IF [NOT] EXISTS):
-- tests re-run the migrations after the second on a migrated database.
DROP INDEX IF EXISTS jobs_claim;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS delayed boolean NOT NULL DEFAULT false;
UPDATE jobs SET delayed = true WHERE status = 1 AND ready_at_ms > agq_now_ms() AND NOT delayed;
CREATE INDEX jobs_claim ON jobs (priority DESC, id) WHERE status = 1 AND NOT delayed;
CREATE INDEX IF NOT EXISTS jobs_delayed ON jobs (ready_at_ms) WHERE status = 1 AND delayed;
