-- Job counts by status, kept in the transactions that insert, update or
-- delete jobs, so that a scrape of /metrics reads a few rows instead of
-- counting every job kept (up to the retention's whole history).
--
-- The rows are changes: each statement on `jobs` appends one row per
-- status it moved (+n or -n), and the count of a status is the sum of
-- its rows. Appending takes no row lock and updates no row, so writers
-- never wait on each other's counts and no row collects dead versions
-- under heavy writes (a row updated at every statement would). The
-- maintenance leader folds the rows into one per status every few
-- seconds.
CREATE TABLE job_counts (
    status  smallint NOT NULL,
    n       bigint NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
        autovacuum_vacuum_insert_threshold = 5000);

-- Appends the changes of one statement on `jobs`: +1 for each row in
-- its new rows, -1 for each in its old rows, summed by status (an update
-- that leaves every row's status appends nothing).
CREATE FUNCTION agq_count_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO job_counts (status, n)
        SELECT status, count(*) FROM new_rows GROUP BY status;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO job_counts (status, n)
        SELECT status, -count(*) FROM old_rows GROUP BY status;
    ELSE
        INSERT INTO job_counts (status, n)
        SELECT status, sum(d)
        FROM (SELECT status, 1 AS d FROM new_rows
              UNION ALL SELECT status, -1 AS d FROM old_rows) t
        GROUP BY status HAVING sum(d) <> 0;
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

INSERT INTO job_counts (status, n)
SELECT status, count(*) FROM jobs GROUP BY status;
