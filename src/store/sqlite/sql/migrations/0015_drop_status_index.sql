-- AGQ schema, version 15: no index on the job status. Every job changes
-- status at least twice (leased, finished), and each change rewrote an
-- entry of `jobs_by_status` in the middle of its B-tree: 20 % of the
-- writer's instructions per job. The open jobs are in the scheduler's
-- memory, loaded by one scan at startup; the number of jobs in each
-- status (the `agq_jobs` gauge) is counted once at startup and kept up to
-- date by the writer.
DROP INDEX jobs_by_status;
