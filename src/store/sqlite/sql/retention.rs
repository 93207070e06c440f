//! Job retention: finished actions are deleted, with their jobs and task
//! results, once they have been finished for longer than the retention
//! period; freed pages go back to the file system by incremental vacuum.
//!
//! An action is the unit: it is deleted whole, so GetAction never reports
//! counts of a half-deleted action. `actions.finished_at_ms` (schema
//! version 4) is when its last open job ended; it is kept up to date by
//! [`mark_finished`] and [`mark_open`] in the transaction that changed the
//! action's jobs.

use rusqlite::{params, Connection, OptionalExtension};

use crate::{core::model::JobStatus, error::Result};

/// Statuses of an open job: one that may still run.
const OPEN: [i32; 3] = [
    JobStatus::Pending as i32,
    JobStatus::Running as i32,
    JobStatus::Failed as i32,
];

/// Records that `action_id` finished at `now_ms`: sets its finish time
/// unless it has one. The writer calls it once its in-memory state, which
/// holds every open job (queued, delayed or leased), holds none of the
/// action's, so the statement reads no job row; [`oldest_expired`] checks
/// the job rows again before retention deletes anything.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn mark_finished(conn: &Connection, action_id: &str, now_ms: i64) -> Result<()> {
    conn.prepare_cached(
        "UPDATE actions SET finished_at_ms = ?2 WHERE action_id = ?1 AND finished_at_ms IS NULL",
    )?
    .execute(params![action_id, now_ms])?;
    Ok(())
}

/// Records that `action_id` is open again (RetryJob or RetryAction put
/// one of its jobs back): clears its finish time.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn mark_open(conn: &Connection, action_id: &str) -> Result<()> {
    conn.prepare_cached(
        "UPDATE actions SET finished_at_ms = NULL WHERE action_id = ?1 AND finished_at_ms IS NOT NULL",
    )?
    .execute(params![action_id])?;
    Ok(())
}

/// The action finished longest ago, if it finished before `cutoff_ms` and
/// none of its jobs is open.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn oldest_expired(conn: &Connection, cutoff_ms: i64) -> Result<Option<String>> {
    Ok(conn
        .prepare_cached(concat!(
            "SELECT a.action_id FROM actions a
             WHERE a.finished_at_ms IS NOT NULL AND a.finished_at_ms < ?1
               AND NOT EXISTS (
                   SELECT 1 FROM jobs j WHERE ",
            job_of_action!(),
            " AND j.status IN (?2, ?3, ?4))
             ORDER BY a.finished_at_ms LIMIT 1"
        ))?
        .query_row(params![cutoff_ms, OPEN[0], OPEN[1], OPEN[2]], |r| r.get(0))
        .optional()?)
}

/// True when retention has deleted some of the jobs of `action_id` and
/// not yet the rest ([`delete_some`] goes through a large action over
/// several batches): such an action must not be reopened.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn partly_deleted(conn: &Connection, action_id: &str) -> Result<bool> {
    Ok(conn
        .prepare_cached(concat!(
            "SELECT total_jobs > (SELECT count(*) FROM jobs WHERE ",
            of_action!(),
            ") FROM actions WHERE action_id = ?1"
        ))?
        .query_row(params![action_id], |r| r.get(0))
        .optional()?
        .unwrap_or(false))
}

/// What one [`delete_some`] call removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deleted {
    /// Jobs deleted (their task results with them).
    pub jobs: usize,
    /// The status of each job deleted.
    pub statuses: Vec<JobStatus>,
    /// True when the action row itself is gone: it has no job left.
    pub action: bool,
}

/// Deletes at most `limit` jobs of `action_id` and, once none is left,
/// the action row. The caller checked that the action is finished
/// ([`oldest_expired`]).
///
/// Errors: [`crate::error::Error::Storage`].
pub fn delete_some(conn: &Connection, action_id: &str, limit: usize) -> Result<Deleted> {
    // The statuses as the `jobs` view reads them (a completed job's row
    // alone does not say it is completed), then the completions and rows.
    let found = conn
        .prepare_cached(concat!(
            "SELECT id, status FROM jobs WHERE ",
            of_action!(),
            " ORDER BY id LIMIT ?2"
        ))?
        .query_map(params![action_id, limit as i64], |r| {
            Ok((r.get::<_, i64>(0)?, super::jobs::status_at(r, 1)?))
        })?
        .collect::<rusqlite::Result<Vec<(i64, JobStatus)>>>()?;
    let mut completion = conn.prepare_cached("DELETE FROM job_completions WHERE job_row = ?1")?;
    let mut row = conn.prepare_cached("DELETE FROM job_rows WHERE id = ?1")?;
    for (id, _) in &found {
        completion.execute([id])?;
        row.execute([id])?;
    }
    let statuses: Vec<JobStatus> = found.into_iter().map(|(_, status)| status).collect();
    let jobs = statuses.len();
    let action = jobs < limit
        && conn
            .prepare_cached("DELETE FROM actions WHERE action_id = ?1")?
            .execute([action_id])?
            == 1;
    Ok(Deleted {
        jobs,
        statuses,
        action,
    })
}

/// Sets `auto_vacuum = INCREMENTAL` on a database that has no table yet
/// (SQLite can switch it only then, or with a full VACUUM); on an existing
/// database it changes nothing (its freed pages are reused, the file does
/// not shrink).
///
/// Errors: [`crate::error::Error::Storage`].
pub fn enable_incremental_vacuum(conn: &Connection) -> Result<()> {
    let tables: i64 = conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))?;
    if tables == 0 {
        conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
    }
    Ok(())
}

/// Free pages kept for reuse before [`vacuum_some`] gives any back: a
/// quarter of the file, at least this many pages (4 MiB at 4 KiB pages).
const VACUUM_SLACK_MIN_PAGES: i64 = 1024;

/// Most pages one [`vacuum_some`] call gives back (16 MiB at 4 KiB pages),
/// so one call holds the writer for a few milliseconds, not seconds.
pub const VACUUM_MAX_PAGES: i64 = 4096;

/// Gives free pages back to the file system (incremental vacuum) when more
/// than a quarter of the file (and more than 1,024 pages) is free, keeping
/// free an eighth of the pages in use, for the inserts to come; at most
/// [`VACUUM_MAX_PAGES`] per call. Returns the number of pages released.
/// A no-op on a database without `auto_vacuum = INCREMENTAL`.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn vacuum_some(conn: &Connection) -> Result<i64> {
    let mode: i64 = conn.pragma_query_value(None, "auto_vacuum", |r| r.get(0))?;
    if mode != 2 {
        return Ok(0);
    }
    let pages: i64 = conn.pragma_query_value(None, "page_count", |r| r.get(0))?;
    let free: i64 = conn.pragma_query_value(None, "freelist_count", |r| r.get(0))?;
    if free <= VACUUM_SLACK_MIN_PAGES.max(pages / 4) {
        return Ok(0);
    }
    let n = (free - (pages - free) / 8).clamp(0, VACUUM_MAX_PAGES);
    // Each step of the pragma frees one page: step it to the end.
    let mut stmt = conn.prepare(&format!("PRAGMA incremental_vacuum({n})"))?;
    let mut rows = stmt.raw_query();
    while rows.next()?.is_some() {}
    let after: i64 = conn.pragma_query_value(None, "freelist_count", |r| r.get(0))?;
    Ok(free - after)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> Connection {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.pragma_update(None, "foreign_keys", "ON").unwrap();
        enable_incremental_vacuum(&conn).unwrap();
        super::super::migrate(&mut conn).unwrap();
        conn.execute_batch("INSERT INTO plans (plan_id, description, body, created_at_ms) VALUES ('p', '', x'', 0);")
            .unwrap();
        conn
    }

    fn action(conn: &Connection, id: &str, statuses: &[JobStatus], done_ms: i64) {
        conn.execute(
            "INSERT INTO actions (action_id, plan_id, total_jobs, max_attempts, created_at_ms)
             VALUES (?1, 'p', ?2, 1, 0)",
            params![id, statuses.len() as i64],
        )
        .unwrap();
        // A completed job is stored as the engine stores it: its row as it
        // was while running, and its completion.
        for (i, s) in statuses.iter().enumerate() {
            let open = OPEN.contains(&(*s as i32));
            let completed = *s == JobStatus::Completed;
            conn.execute(
                "INSERT INTO job_rows (job_id, action_id, plan_id, status, input, max_attempts,
                                       created_at_ms, ready_at_ms, completed_at_ms, worker_id, lease_id, attempt)
                 VALUES (?1, ?2, 'p', ?3, '{}', 1, 0, 0, ?4, 'w', 'L', 1)",
                params![
                    format!("{id}-{i}"),
                    id,
                    if completed { JobStatus::Running } else { *s } as i32,
                    (!open && !completed).then_some(done_ms)
                ],
            )
            .unwrap();
            if completed {
                conn.execute(
                    "INSERT INTO job_completions (job_row, attempt, completed_at_ms) VALUES (?1, 1, ?2)",
                    params![conn.last_insert_rowid(), done_ms],
                )
                .unwrap();
            }
        }
        conn.execute(
            "UPDATE actions SET (first_job_row, last_job_row) =
                 (SELECT min(id), max(id) FROM job_rows WHERE action_id = ?1)
             WHERE action_id = ?1",
            [id],
        )
        .unwrap();
        // As the writer does: only an action with no open job is marked.
        if !statuses.iter().any(|s| OPEN.contains(&(*s as i32))) {
            mark_finished(conn, id, done_ms).unwrap();
        }
    }

    fn finished_at(conn: &Connection, id: &str) -> Option<i64> {
        conn.query_row(
            "SELECT finished_at_ms FROM actions WHERE action_id = ?1",
            [id],
            |r| r.get(0),
        )
        .unwrap()
    }

    fn count(conn: &Connection, sql: &str) -> i64 {
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    /// The finish time is set at the first mark, kept when the action is
    /// marked again, and cleared when the action is open again.
    #[test]
    fn an_action_is_finished_once_no_job_is_open() {
        let conn = db();
        use JobStatus::*;
        action(&conn, "open", &[Completed, Running], 100);
        assert_eq!(finished_at(&conn, "open"), None);
        action(&conn, "done", &[Completed, Dead, Cancelled], 100);
        assert_eq!(finished_at(&conn, "done"), Some(100));
        mark_finished(&conn, "done", 200).unwrap();
        assert_eq!(
            finished_at(&conn, "done"),
            Some(100),
            "a later mark moved it"
        );
        conn.execute("UPDATE job_rows SET status = 1 WHERE job_id = 'done-1'", [])
            .unwrap();
        mark_open(&conn, "done").unwrap();
        assert_eq!(
            finished_at(&conn, "done"),
            None,
            "a retried job left it finished"
        );
        mark_open(&conn, "done").unwrap();
        assert_eq!(finished_at(&conn, "done"), None);
        conn.execute("UPDATE job_rows SET status = 3 WHERE job_id = 'done-1'", [])
            .unwrap();
        mark_finished(&conn, "done", 400).unwrap();
        assert_eq!(finished_at(&conn, "done"), Some(400));
        assert_eq!(finished_at(&conn, "open"), None, "another action changed");
    }

    /// Only actions finished before the cutoff expire, oldest first; an
    /// action whose finish time is stale (a job open again in the same
    /// batch, before its mark) is not picked.
    #[test]
    fn expiry_picks_the_oldest_finished_action_before_the_cutoff() {
        let conn = db();
        use JobStatus::*;
        action(&conn, "new", &[Completed], 500);
        action(&conn, "old", &[Completed], 100);
        action(&conn, "mid", &[Cancelled], 200);
        action(&conn, "open", &[Pending], 0);
        assert_eq!(oldest_expired(&conn, 100).unwrap(), None);
        assert_eq!(oldest_expired(&conn, 101).unwrap().as_deref(), Some("old"));
        conn.execute_batch(
            "DELETE FROM job_completions WHERE job_row = (SELECT id FROM job_rows WHERE job_id = 'old-0');
             UPDATE job_rows SET status = 1 WHERE job_id = 'old-0';",
        )
        .unwrap();
        assert_eq!(oldest_expired(&conn, 1000).unwrap().as_deref(), Some("mid"));
    }

    /// A large action goes in chunks: its jobs (with their completions)
    /// first, the action row with the last chunk; nothing of other actions.
    #[test]
    fn deletion_goes_in_chunks() {
        let conn = db();
        use JobStatus::*;
        action(&conn, "big", &[Completed; 600], 100);
        action(&conn, "other", &[Completed], 100);
        let d = delete_some(&conn, "big", 256).unwrap();
        assert_eq!(
            d,
            Deleted {
                jobs: 256,
                statuses: vec![Completed; 256],
                action: false
            }
        );
        assert_eq!(delete_some(&conn, "big", 256).unwrap().jobs, 256);
        let d = delete_some(&conn, "big", 256).unwrap();
        assert_eq!(
            d,
            Deleted {
                jobs: 88,
                statuses: vec![Completed; 88],
                action: true
            }
        );
        assert_eq!(count(&conn, "SELECT count(*) FROM jobs"), 1);
        assert_eq!(count(&conn, "SELECT count(*) FROM job_rows"), 1);
        assert_eq!(count(&conn, "SELECT count(*) FROM job_completions"), 1);
        assert_eq!(count(&conn, "SELECT count(*) FROM actions"), 1);
        assert_eq!(
            oldest_expired(&conn, 1000).unwrap().as_deref(),
            Some("other")
        );
    }

    /// A new database gives freed pages back once a quarter of it is free,
    /// keeping some for reuse; small free lists are left alone.
    #[test]
    fn incremental_vacuum_gives_back_the_free_pages_beyond_the_slack() {
        let dir = tempfile::tempdir().unwrap();
        let conn = Connection::open(dir.path().join("v.db")).unwrap();
        enable_incremental_vacuum(&conn).unwrap();
        let mode: i64 = conn
            .pragma_query_value(None, "auto_vacuum", |r| r.get(0))
            .unwrap();
        assert_eq!(mode, 2);
        conn.execute_batch("CREATE TABLE t (x BLOB)").unwrap();
        assert_eq!(vacuum_some(&conn).unwrap(), 0);
        for _ in 0..3000 {
            conn.execute("INSERT INTO t VALUES (zeroblob(4000))", [])
                .unwrap();
        }
        conn.execute("DELETE FROM t WHERE rowid > 500", []).unwrap();
        let pages = |c: &Connection| -> i64 {
            c.pragma_query_value(None, "page_count", |r| r.get(0))
                .unwrap()
        };
        let before = pages(&conn);
        // Inside a transaction, as the writer runs it.
        conn.execute_batch("BEGIN").unwrap();
        let released = vacuum_some(&conn).unwrap();
        conn.execute_batch("COMMIT").unwrap();
        assert!(released > 1000, "released {released}");
        // The file shrinks by the pages released (and the pointer-map pages
        // that tracked them).
        assert!(pages(&conn) <= before - released);
        let free: i64 = conn
            .pragma_query_value(None, "freelist_count", |r| r.get(0))
            .unwrap();
        assert!(free <= pages(&conn) / 4, "{free} free of {}", pages(&conn));
        // An old database (auto_vacuum off) is left as it is.
        let old = Connection::open(dir.path().join("old.db")).unwrap();
        old.execute_batch("CREATE TABLE t (x BLOB)").unwrap();
        enable_incremental_vacuum(&old).unwrap();
        let mode: i64 = old
            .pragma_query_value(None, "auto_vacuum", |r| r.get(0))
            .unwrap();
        assert_eq!(mode, 0);
        assert_eq!(vacuum_some(&old).unwrap(), 0);
    }
}
