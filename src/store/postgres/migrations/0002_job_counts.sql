-- Job counts by status, kept in the transactions that insert, update or
-- delete jobs, so that a scrape of /metrics reads a few rows instead of
-- counting every job kept (up to the retention's whole history).
--
-- Each database connection adds to rows of its own (`slot` is its
-- backend process id): one connection runs one transaction at a time, so
-- no two transactions ever wait on each other's counts. Slot 0 holds the
-- count taken when this table was made and the rows of connections that
-- have ended, folded into it by the maintenance leader. The count of a
-- status is the sum of its rows.
CREATE TABLE job_counts (
    slot    integer NOT NULL,
    status  smallint NOT NULL,
    n       bigint NOT NULL,
    PRIMARY KEY (slot, status)
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

-- Adds the changes of one statement on `jobs` to the connection's slot:
-- +1 for each row in the new rows, -1 for each in the old rows, by status
-- (an update that leaves a row's status adds nothing). Rows are taken in
-- status order, so that two transactions sharing a slot (a connection
-- whose process id is reused while the leader folds its old rows) lock
-- them in the same order.
CREATE FUNCTION agq_count_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO job_counts AS c (slot, status, n)
        SELECT pg_backend_pid(), status, count(*) FROM new_rows GROUP BY status ORDER BY status
        ON CONFLICT (slot, status) DO UPDATE SET n = c.n + excluded.n;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO job_counts AS c (slot, status, n)
        SELECT pg_backend_pid(), status, -count(*) FROM old_rows GROUP BY status ORDER BY status
        ON CONFLICT (slot, status) DO UPDATE SET n = c.n + excluded.n;
    ELSE
        INSERT INTO job_counts AS c (slot, status, n)
        SELECT pg_backend_pid(), status, sum(d)
        FROM (SELECT status, 1 AS d FROM new_rows
              UNION ALL SELECT status, -1 AS d FROM old_rows) t
        GROUP BY status HAVING sum(d) <> 0 ORDER BY status
        ON CONFLICT (slot, status) DO UPDATE SET n = c.n + excluded.n;
    END IF;
    RETURN NULL;
END
$$;

-- Creating the triggers locks `jobs` against writes until this
-- migration commits, so the count below is exact: no write falls
-- between it and the first counted statement.
CREATE TRIGGER jobs_count_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION agq_count_jobs();
CREATE TRIGGER jobs_count_update AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION agq_count_jobs();
CREATE TRIGGER jobs_count_delete AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION agq_count_jobs();

INSERT INTO job_counts (slot, status, n)
SELECT 0, status, count(*) FROM jobs GROUP BY status;
