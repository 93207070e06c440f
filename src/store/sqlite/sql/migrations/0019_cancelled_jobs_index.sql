-- AGQ schema, version 19: cancelled jobs found without reading the history.
--
-- SearchJobs for cancelled jobs of any action walked every job row from
-- the first to find the few cancelled ones among the finished jobs kept
-- for the retention. Cancelled is final and a cancelled job's row keeps
-- its status (the `jobs` view changes only running ones), so a partial
-- index of their rows, in row order, holds exactly them: the search
-- reads a page of it. Cancels are rare next to the other writes;
-- each adds one entry.
CREATE INDEX jobs_cancelled ON job_rows(id) WHERE status = 6;
