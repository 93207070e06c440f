-- AGQ schema, version 9: plan versions. SubmitPlan with `replace` stores
-- a new version of an existing plan; jobs keep running the version their
-- action was submitted under.
--
-- `plan_versions` holds every version of every plan, the latest included.
-- The `plans` row stays the head of its id: the latest version's
-- description and body (a copy of its `plan_versions` row), its number
-- and when it was stored, so GetPlan of the latest version, ListPlans and
-- the start-up load read one table as before. Deleting a plan deletes its
-- versions (ON DELETE CASCADE, like its actions and jobs).
--
-- Actions and jobs record the version they run; every plan, action and
-- job of an older database is version 1.
CREATE TABLE plan_versions (
    plan_id        TEXT NOT NULL REFERENCES plans(plan_id) ON DELETE CASCADE,
    version        INTEGER NOT NULL,
    description    TEXT NOT NULL,
    body           BLOB NOT NULL,            -- encoded agq.v1.Plan
    created_at_ms  INTEGER NOT NULL,
    PRIMARY KEY (plan_id, version)
);
ALTER TABLE plans ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
ALTER TABLE plans ADD COLUMN updated_at_ms INTEGER NOT NULL DEFAULT 0;
UPDATE plans SET updated_at_ms = created_at_ms;
INSERT INTO plan_versions (plan_id, version, description, body, created_at_ms)
    SELECT plan_id, 1, description, body, created_at_ms FROM plans;
ALTER TABLE actions ADD COLUMN plan_version INTEGER NOT NULL DEFAULT 1;
ALTER TABLE jobs ADD COLUMN plan_version INTEGER NOT NULL DEFAULT 1;
