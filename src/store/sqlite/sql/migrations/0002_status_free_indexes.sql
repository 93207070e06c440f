-- AGQ schema, version 2: the action and plan indexes of jobs no longer
-- carry the status. A job changes status at least twice (leased, finished)
-- and every index holding the status is rewritten each time; these two
-- served no query that needed it (per-action counts read the rows anyway,
-- and whether a plan is in use is known from the scheduler's memory).
DROP INDEX jobs_by_action;
CREATE INDEX jobs_by_action ON jobs(action_id);
DROP INDEX jobs_by_plan;
CREATE INDEX jobs_by_plan ON jobs(plan_id);
