-- Ids compare byte by byte (collation "C"), whatever the database's
-- default collation, as they do in SQLite (BINARY) and in Rust.
--
-- ListPlans and ListSchedules page by id (`id > cursor ORDER BY id`), and
-- ListPlans bounds a glob's scan by its literal prefix (`id >= prefix`,
-- stopping at the first id without it): both are right only in byte
-- order. Under a linguistic collation (e.g. ICU en-US: a-1, a-2, A-3,
-- a-4) the scan for `a-*` stopped at A-3 and never reached a-4.
--
-- The collation is the columns', not the queries' (`COLLATE "C"` on each
-- comparison): every query on them, now and later, orders by bytes, and
-- the primary key indexes, rebuilt in that collation, still serve the
-- ranges and the order (an index in the default collation serves no
-- `COLLATE "C"` comparison, even on a database whose default is C).
-- Every column compared with a plan id changes too, so that joins and
-- foreign keys compare two columns of one collation. The rows are not
-- rewritten (the type stays text); indexes on the columns are rebuilt.
ALTER TABLE plans ALTER COLUMN plan_id TYPE text COLLATE "C";
ALTER TABLE plan_versions ALTER COLUMN plan_id TYPE text COLLATE "C";
ALTER TABLE actions ALTER COLUMN plan_id TYPE text COLLATE "C";
ALTER TABLE jobs ALTER COLUMN plan_id TYPE text COLLATE "C";
ALTER TABLE schedules ALTER COLUMN plan_id TYPE text COLLATE "C",
                      ALTER COLUMN schedule_id TYPE text COLLATE "C";
