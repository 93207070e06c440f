-- AGQ schema, version 8: indexes for ListActions (newest first, by plan,
-- by state). Index entries carry the rowid, so `ORDER BY created_at_ms
-- DESC, rowid DESC` walks an index backwards with no sort, and a page
-- token (created_at_ms, rowid) starts the walk where the last page ended.
-- The plan index gains the creation time (it still serves the ON DELETE
-- CASCADE from plans). Open and finished are told by `finished_at_ms`
-- (version 4); "has a dead job" by a partial index that holds only dead
-- jobs, so a job pays for it only when it goes dead or is retried.
DROP INDEX actions_by_plan;
CREATE INDEX actions_by_plan ON actions(plan_id, created_at_ms);
CREATE INDEX actions_by_created ON actions(created_at_ms);
CREATE INDEX jobs_dead_by_action ON jobs(action_id) WHERE status = 5;
