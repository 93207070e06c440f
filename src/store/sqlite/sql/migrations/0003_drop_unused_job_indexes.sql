-- AGQ schema, version 3: drop the two job indexes no query uses. Job
-- listings page through the rows in id order and filter plan and creation
-- time on the way (EXPLAIN QUERY PLAN: rowid range), and whether a plan is
-- in use is known from the scheduler's memory; yet every new job paid an
-- entry in each of them.
DROP INDEX jobs_by_plan;
DROP INDEX jobs_by_created;
