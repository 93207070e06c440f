//! The actions, job rows and job completions tables, and the `jobs` view
//! that reads a job from its row and its completion (migration 0017).
//!
//! Fencing: the writer checks a report's lease against its table of
//! leases in memory before it runs any statement (that table changes only
//! with the writer's own commits and is reloaded from the database after
//! a failed one), and the database checks it again: [`set_progress`] and
//! [`fail_attempt`] change the row only while the job runs, uncompleted,
//! under the given lease and worker, and return whether they did;
//! [`complete`] records the attempt with the completion (the attempt
//! number is the job's fencing token: each grant makes it one larger),
//! and the `jobs` view counts a completion only in the attempt the job
//! row runs, so a completion of a stale attempt changes nothing any
//! reader sees (checking the row in the completion's own statement would
//! cost the writer a read of the row per job; see docs/architecture.md).

use std::collections::HashMap;

use rusqlite::{params, types::Type, Connection, OptionalExtension, Row, ToSql};

use crate::{
    core::{
        engine::{ActionQuery, ActionState, JobQuery},
        model::{ActionStatus, Job, JobStatus, Scheduling, TaskResult},
    },
    error::{Error, Result},
    store::sqlite::writer::BatchConn,
    time::now_ms,
};

const PENDING: i32 = JobStatus::Pending as i32;
const RUNNING: i32 = JobStatus::Running as i32;
const COMPLETED: i32 = JobStatus::Completed as i32;
const FAILED: i32 = JobStatus::Failed as i32;
const DEAD: i32 = JobStatus::Dead as i32;
const CANCELLED: i32 = JobStatus::Cancelled as i32;

/// The fields of a job the state machine decides on when it finds the job
/// by its public id.
#[derive(Debug, Clone)]
pub struct JobKey {
    /// Internal row id (FIFO order).
    pub row: i64,
    /// Owning action.
    pub action_id: String,
    /// Plan it runs.
    pub plan_id: String,
    /// Version of the plan it runs.
    pub plan_version: u32,
    /// Current status.
    pub status: JobStatus,
    /// Current or last lease holder.
    pub worker_id: Option<String>,
    /// The current lease while running; after the worker's own report
    /// ended the attempt, the lease that report carried (so a repeat of
    /// the report, its first reply lost, is recognised); else `None`.
    pub lease_id: Option<String>,
    /// Scheduling priority.
    pub priority: i32,
}

/// The status stored in column `idx` of `r`.
pub(super) fn status_at(r: &Row<'_>, idx: usize) -> rusqlite::Result<JobStatus> {
    let v: i32 = r.get(idx)?;
    JobStatus::from_i32(v).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            idx,
            Type::Integer,
            format!("unknown job status {v}").into(),
        )
    })
}

/// The lease an outcome is recorded under: a fenced statement changes the
/// job only while it is running under exactly this lease and worker.
#[derive(Debug, Clone, Copy)]
pub struct Fence<'a> {
    /// The lease id (fencing token) of the attempt.
    pub lease_id: &'a str,
    /// Its holder.
    pub worker_id: &'a str,
}

fn key_from_row(r: &Row<'_>) -> rusqlite::Result<JobKey> {
    Ok(JobKey {
        row: r.get(0)?,
        action_id: r.get(1)?,
        plan_id: r.get(2)?,
        status: status_at(r, 3)?,
        worker_id: r.get(4)?,
        lease_id: r.get(5)?,
        plan_version: r.get(6)?,
        priority: r.get(7)?,
    })
}

/// Bits of a job row id below its millisecond timestamp: up to 4,096 jobs
/// a millisecond before the sequence runs ahead of the clock.
const ROW_COUNTER_BITS: u32 = 12;

/// The rows of `count` new jobs inserted after row `last` at `now_ms`:
/// `(first, last)` of a contiguous range, every row above `last` and at
/// least `now_ms << 12`, so rows follow insertion order (FIFO) and carry
/// their creation time for the public id ([`public_job_id`]).
pub fn next_rows(last: i64, now_ms: i64, count: u32) -> (i64, i64) {
    let first = last
        .saturating_add(1)
        .max(now_ms.max(0) << ROW_COUNTER_BITS);
    (first, first + i64::from(count.max(1)) - 1)
}

/// A new job's `job_key`: 64 random bits with the RFC 9562 variant, the
/// low half of its public id.
pub fn new_job_key() -> i64 {
    ((rand::random::<u64>() & !(0b11 << 62)) | (0b10 << 62)) as i64
}

/// The public id of the job at `row` with key `key`: the UUIDv7 whose 48
/// timestamp bits and 12 `rand_a` bits are the row's (unix ms, counter)
/// and whose low 64 bits are the key.
pub fn public_job_id(row: i64, key: i64) -> String {
    let row = row as u64;
    let high =
        ((row >> ROW_COUNTER_BITS) << 16) | (0x7 << 12) | (row & ((1 << ROW_COUNTER_BITS) - 1));
    uuid::Uuid::from_u64_pair(high, key as u64)
        .hyphenated()
        .to_string()
}

/// The (row, key) a public id made by [`public_job_id`] names; `None` for
/// any other string (such as the id of a job created before schema 16).
pub fn parse_job_id(job_id: &str) -> Option<(i64, i64)> {
    let uuid = uuid::Uuid::try_parse(job_id).ok()?;
    let (high, low) = uuid.as_u64_pair();
    if (high >> 12) & 0xf != 7 || low >> 62 != 0b10 {
        return None;
    }
    let row = ((high >> 16) << ROW_COUNTER_BITS) | (high & ((1 << ROW_COUNTER_BITS) - 1));
    let (row, key) = (row as i64, low as i64);
    // Only the canonical spelling names the job, as for older ids.
    (public_job_id(row, key) == job_id).then_some((row, key))
}

/// The public id of the job at `row` whose columns `job_key` and `job_id`
/// are at `idx` and `idx + 1` of `r`: made from the row and key, or the
/// stored id of a job created before schema 16.
fn job_id_of(r: &Row<'_>, row: i64, idx: usize) -> rusqlite::Result<String> {
    match r.get::<_, Option<i64>>(idx)? {
        Some(key) => Ok(public_job_id(row, key)),
        None => r.get(idx + 1),
    }
}

/// The public id of a job read from columns `id`, `job_key` and `job_id`
/// at `idx`, `idx + 1` and `idx + 2` of `r`.
pub(super) fn job_id_at(r: &Row<'_>, idx: usize) -> rusqlite::Result<String> {
    job_id_of(r, r.get(idx)?, idx + 1)
}

/// The job with public id `job_id`: a look-up by row id (checking the
/// key), or by the index of the ids of jobs created before schema 16.
///
/// Errors: [`Error::Storage`].
pub fn key_by_job_id(conn: &Connection, job_id: &str) -> Result<Option<JobKey>> {
    if let Some((row, key)) = parse_job_id(job_id) {
        let found = conn
            .prepare_cached(
                "SELECT id, action_id, plan_id, status, worker_id, lease_id, plan_version, priority
                 FROM jobs WHERE id = ?1 AND job_key = ?2",
            )?
            .query_row([row, key], key_from_row)
            .optional()?;
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(conn
        .prepare_cached(
            "SELECT id, action_id, plan_id, status, worker_id, lease_id, plan_version, priority FROM jobs WHERE job_id = ?1",
        )?
        .query_row([job_id], key_from_row)
        .optional()?)
}

/// Inserts an action row of version `plan_version` of plan `plan_id`
/// with its fleet-scheduling settings (the selector in effect, already
/// resolved) and the range of rows its jobs will be inserted at
/// (`job_rows`, first and last, from [`next_rows`]). Returns false when
/// the id is taken.
///
/// Errors: [`Error::Storage`].
#[allow(clippy::too_many_arguments)]
pub fn insert_action(
    conn: &Connection,
    action_id: &str,
    plan_id: &str,
    plan_version: u32,
    total_jobs: u32,
    max_attempts: u32,
    run_at_ms: Option<i64>,
    traceparent: Option<&str>,
    scheduling: &Scheduling,
    now_ms: i64,
    job_rows: (i64, i64),
) -> Result<bool> {
    let n = conn
        .prepare_cached(
            "INSERT OR IGNORE INTO actions (action_id, plan_id, total_jobs, max_attempts, run_at_ms, traceparent, created_at_ms, plan_version,
                                            priority, worker_selector, concurrency_key, max_running, first_job_row, last_job_row)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        )?
        .execute(params![
            action_id,
            plan_id,
            total_jobs,
            max_attempts,
            run_at_ms,
            traceparent,
            now_ms,
            plan_version,
            scheduling.priority,
            scheduling.worker_selector,
            scheduling.concurrency_key,
            scheduling.max_running,
            job_rows.0,
            job_rows.1
        ])?;
    Ok(n == 1)
}

/// The W3C `traceparent` the action was submitted with; `None` when it
/// was not traced (or is gone).
///
/// Errors: [`Error::Storage`].
pub fn action_traceparent(conn: &Connection, action_id: &str) -> Result<Option<String>> {
    Ok(conn
        .prepare_cached("SELECT traceparent FROM actions WHERE action_id = ?1")?
        .query_row(params![action_id], |r| r.get::<_, Option<String>>(0))
        .optional()?
        .flatten())
}

/// The lease a new job is inserted with when it is granted in the
/// transaction that creates it (its first attempt, which expires at
/// [`ActionColumns::lease_expires_at_ms`]).
#[derive(Debug, Clone, Copy)]
pub struct FirstLease<'a> {
    /// Holder.
    pub worker_id: &'a str,
    /// Fencing token.
    pub lease_id: &'a str,
}

/// The columns every job of one action shares, bound once for all of
/// them.
#[derive(Debug, Clone, Copy)]
pub struct ActionColumns<'a> {
    /// Owning action.
    pub action_id: &'a str,
    /// Plan the jobs run.
    pub plan_id: &'a str,
    /// Version of that plan.
    pub plan_version: u32,
    /// Attempts each job may take.
    pub max_attempts: u32,
    /// Scheduling priority.
    pub priority: i32,
    /// Creation time, unix ms.
    pub now_ms: i64,
    /// When a pending job becomes eligible, unix ms.
    pub ready_at_ms: i64,
    /// When the first lease of a job inserted leased expires (the job
    /// timeout from now), unix ms.
    pub lease_expires_at_ms: i64,
}

/// The job inserts of one action, each statement prepared at its first
/// use and kept for all the action's jobs. SQLite keeps a statement's
/// bindings across executions, so the columns the jobs share
/// ([`ActionColumns`]) are bound once per statement and a job binds only
/// its own: row, key and input (and its lease). A pending job binds no
/// lease column.
pub struct JobInserter<'c> {
    conn: &'c Connection,
    cols: ActionColumns<'c>,
    pending: Option<rusqlite::CachedStatement<'c>>,
    leased: Option<rusqlite::CachedStatement<'c>>,
}

/// Parameters of a job's own columns, the first of both inserts.
const JOB_ROW: usize = 1;
const JOB_KEY: usize = 2;
const JOB_INPUT: usize = 3;
/// The lease parameters of the leased insert.
const JOB_WORKER: usize = 4;
const JOB_LEASE: usize = 5;

impl<'c> JobInserter<'c> {
    /// An inserter of jobs with the columns `cols` on `conn`; it prepares
    /// its statements at their first use.
    pub fn new(conn: &'c Connection, cols: ActionColumns<'c>) -> Self {
        JobInserter {
            conn,
            cols,
            pending: None,
            leased: None,
        }
    }

    /// The columns the jobs of this inserter share.
    pub fn columns(&self) -> &ActionColumns<'c> {
        &self.cols
    }

    /// Inserts one job at `row` (from [`next_rows`]) with key `key` (its
    /// public id is [`public_job_id`]`(row, key)`) and input `input_json`:
    /// pending, eligible from [`ActionColumns::ready_at_ms`], or, with
    /// `lease`, already running its first attempt (started now: the row
    /// an insert and a [`LeaseGranter::grant`] would leave, in one
    /// statement).
    ///
    /// Errors: [`Error::Storage`] (also for a row in use).
    pub fn insert(
        &mut self,
        row: i64,
        key: i64,
        input_json: &str,
        lease: Option<FirstLease<'_>>,
    ) -> Result<()> {
        let c = self.cols;
        let stmt = match (lease, &mut self.pending, &mut self.leased) {
            (None, Some(stmt), _) | (Some(_), _, Some(stmt)) => stmt,
            (None, slot, _) => slot.insert(prepared_with(
                self.conn,
                "INSERT INTO job_rows (id, job_key, input, action_id, plan_id, status, max_attempts,
                                       created_at_ms, ready_at_ms, plan_version, priority)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                &[
                    (4, &c.action_id),
                    (5, &c.plan_id),
                    (6, &PENDING),
                    (7, &c.max_attempts),
                    (8, &c.now_ms),
                    (9, &c.ready_at_ms),
                    (10, &c.plan_version),
                    (11, &c.priority),
                ],
            )?),
            (Some(_), _, slot) => slot.insert(prepared_with(
                self.conn,
                "INSERT INTO job_rows (id, job_key, input, worker_id, lease_id, action_id, plan_id, status,
                                       max_attempts, created_at_ms, ready_at_ms, attempt, started_at_ms,
                                       lease_expires_at_ms, plan_version, priority)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, 1, ?10, ?11, ?12, ?13)",
                &[
                    (6, &c.action_id),
                    (7, &c.plan_id),
                    (8, &RUNNING),
                    (9, &c.max_attempts),
                    (10, &c.now_ms),
                    (11, &c.lease_expires_at_ms),
                    (12, &c.plan_version),
                    (13, &c.priority),
                ],
            )?),
        };
        stmt.raw_bind_parameter(JOB_ROW, row)?;
        stmt.raw_bind_parameter(JOB_KEY, key)?;
        stmt.raw_bind_parameter(JOB_INPUT, input_json)?;
        if let Some(lease) = lease {
            stmt.raw_bind_parameter(JOB_WORKER, lease.worker_id)?;
            stmt.raw_bind_parameter(JOB_LEASE, lease.lease_id)?;
        }
        stmt.raw_execute()?;
        Ok(())
    }
}

/// The statement of `sql` from `conn`'s cache, with the parameters
/// `shared` (1-based index, value) bound; they stay bound across its
/// executions until it goes back to the cache.
///
/// Errors: [`Error::Storage`].
fn prepared_with<'c>(
    conn: &'c Connection,
    sql: &str,
    shared: &[(usize, &dyn ToSql)],
) -> Result<rusqlite::CachedStatement<'c>> {
    let mut stmt = conn.prepare_cached(sql)?;
    for (i, v) in shared {
        stmt.raw_bind_parameter(*i, v)?;
    }
    Ok(stmt)
}

/// The lease grants of a dispatch, its statement taken from the
/// connection's cache at the first grant and kept for the others. The
/// grants of one dispatch share their start and expiry times: those stay
/// bound (SQLite keeps a statement's bindings across executions) until a
/// grant brings others.
pub struct LeaseGranter<'c> {
    conn: &'c Connection,
    stmt: Option<rusqlite::CachedStatement<'c>>,
    /// The (start, expiry) bound now.
    times: Option<(i64, i64)>,
}

impl<'c> LeaseGranter<'c> {
    /// A granter that has not prepared its statement yet.
    pub fn new(conn: &'c Connection) -> Self {
        LeaseGranter {
            conn,
            stmt: None,
            times: None,
        }
    }

    /// Marks the job running under a new lease.
    ///
    /// Errors: [`Error::Storage`].
    #[allow(clippy::too_many_arguments)]
    pub fn grant(
        &mut self,
        row: i64,
        worker_id: &str,
        lease_id: &str,
        attempt: u32,
        now_ms: i64,
        expires_at_ms: i64,
    ) -> Result<()> {
        let stmt = match &mut self.stmt {
            Some(stmt) => stmt,
            None => self.stmt.insert(prepared_with(
                self.conn,
                "UPDATE job_rows SET worker_id = ?2, lease_id = ?3, attempt = ?4, status = ?5,
                        started_at_ms = ?6, lease_expires_at_ms = ?7, current_task = 0, progress_percent = 0
                 WHERE id = ?1",
                &[(5, &RUNNING)],
            )?),
        };
        if self.times != Some((now_ms, expires_at_ms)) {
            stmt.raw_bind_parameter(6, now_ms)?;
            stmt.raw_bind_parameter(7, expires_at_ms)?;
            self.times = Some((now_ms, expires_at_ms));
        }
        stmt.raw_bind_parameter(1, row)?;
        stmt.raw_bind_parameter(2, worker_id)?;
        stmt.raw_bind_parameter(3, lease_id)?;
        stmt.raw_bind_parameter(4, attempt)?;
        stmt.raw_execute()?;
        Ok(())
    }
}

/// Stores a progress report of the job running under `fence`, with its
/// task results when `results` is `Some` (encoded by
/// [`encode_task_results`]; `None` keeps those stored). Returns false
/// (nothing changed) when it does not run under that lease. Its
/// statement is kept for the rest of the batch.
///
/// Errors: [`Error::Storage`]; [`Error::Internal`] when a kept statement
/// is held already (see [`BatchConn::kept`]).
pub fn set_progress(
    conn: &BatchConn<'_>,
    row: i64,
    fence: Fence<'_>,
    current_task: u32,
    progress: u32,
    results: Option<&str>,
) -> Result<bool> {
    let n = conn
        .kept(
            "UPDATE job_rows SET current_task = ?2, progress_percent = ?3,
                    task_results = coalesce(?7, task_results)
             WHERE id = ?1 AND status = ?4 AND lease_id = ?5 AND worker_id = ?6
               AND NOT EXISTS (SELECT 1 FROM job_completions c
                               WHERE c.job_row = ?1 AND c.attempt = job_rows.attempt)",
        )?
        .execute(params![
            row,
            current_task,
            progress,
            RUNNING,
            fence.lease_id,
            fence.worker_id,
            results
        ])?;
    Ok(n == 1)
}

/// Encodes task results for the job row's `task_results` column: a JSON
/// array in task order, `None` for no results. Done before the writer
/// thread, so the writer only binds the text.
pub fn encode_task_results(results: &[TaskResult]) -> Option<String> {
    if results.is_empty() {
        return None;
    }
    // Serializing plain structs of strings and numbers cannot fail.
    serde_json::to_string(results).ok()
}

/// Decodes the `task_results` column (see [`encode_task_results`]).
///
/// Errors: [`Error::Internal`] when the stored text is not such an array.
pub fn decode_task_results(text: Option<String>) -> Result<Vec<TaskResult>> {
    let Some(text) = text else {
        return Ok(Vec::new());
    };
    let mut results: Vec<TaskResult> = serde_json::from_str(&text)
        .map_err(|e| Error::Internal(format!("stored task results are not valid: {e}")))?;
    results.sort_by_key(|r| r.task_number);
    Ok(results)
}

/// Replaces the task results of the job at `row` with `results` (encoded
/// by [`encode_task_results`]; `None` clears them). Not fenced: the caller
/// runs it after the fenced statement of the same report changed the row.
///
/// Errors: [`Error::Storage`].
pub fn set_task_results(conn: &Connection, row: i64, results: Option<&str>) -> Result<()> {
    conn.prepare_cached("UPDATE job_rows SET task_results = ?2 WHERE id = ?1")?
        .execute(params![row, results])?;
    Ok(())
}

/// Records the completion of attempt `attempt` of the job at `row`,
/// reported at `now_ms` (the caller checked the report's lease, see the
/// module docs), with the task results `results` (encoded by
/// [`encode_task_results`]; `None`: none): inserts its row of
/// `job_completions`, one short row, and leaves the job row as it is, so
/// the lease id stays as the one that recorded the outcome (see
/// [`JobKey::lease_id`]). The job reads as completed while its row runs
/// that attempt. A completion stored already is replaced only by one of
/// the attempt the row runs now, so a stale one never hides a valid one
/// and a valid one is never lost to a stale one. Its statement is kept
/// for the rest of the batch (completions are the writer's most frequent
/// operation).
///
/// Errors: [`Error::Storage`]; [`Error::Internal`] when a kept statement
/// is held already (see [`BatchConn::kept`]).
pub fn complete(
    conn: &BatchConn<'_>,
    row: i64,
    attempt: u32,
    now_ms: i64,
    results: Option<&str>,
) -> Result<()> {
    conn.kept(
        "INSERT INTO job_completions (job_row, attempt, completed_at_ms, task_results)
         VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (job_row) DO UPDATE
         SET attempt = excluded.attempt, completed_at_ms = excluded.completed_at_ms,
             task_results = excluded.task_results
         WHERE excluded.attempt = (SELECT attempt FROM job_rows WHERE id = excluded.job_row)
           AND job_completions.attempt IS NOT excluded.attempt",
    )?
    .execute(params![row, attempt, now_ms, results])?;
    Ok(())
}

/// Ends the attempt running under `fence` as failed: `Failed` with the
/// next attempt due at `ready_at_ms`, or `Dead` when no attempt is left.
/// The lease id stays when the worker reported the failure (`reported`,
/// see [`JobKey::lease_id`]); it is cleared when the server ended the
/// attempt. Returns false (nothing changed) when the job does not run
/// under that lease.
///
/// Errors: [`Error::Storage`].
#[allow(clippy::too_many_arguments)]
pub fn fail_attempt(
    conn: &Connection,
    row: i64,
    fence: Fence<'_>,
    dead: bool,
    error: &str,
    ready_at_ms: i64,
    now_ms: i64,
    reported: bool,
) -> Result<bool> {
    let status = if dead { DEAD } else { FAILED };
    let completed = if dead { Some(now_ms) } else { None };
    let n = conn
        .prepare_cached(
            "UPDATE job_rows SET status = ?2, error = ?3, ready_at_ms = ?4, completed_at_ms = ?5,
                    lease_id = CASE WHEN ?6 THEN lease_id END, lease_expires_at_ms = NULL
             WHERE id = ?1 AND status = ?7 AND lease_id = ?8 AND worker_id = ?9
               AND NOT EXISTS (SELECT 1 FROM job_completions c
                               WHERE c.job_row = ?1 AND c.attempt = job_rows.attempt)",
        )?
        .execute(params![
            row,
            status,
            error,
            ready_at_ms,
            completed,
            reported,
            RUNNING,
            fence.lease_id,
            fence.worker_id
        ])?;
    Ok(n == 1)
}

/// Marks the job cancelled and clears its lease.
///
/// Errors: [`Error::Storage`].
pub fn cancel(conn: &Connection, row: i64, now_ms: i64) -> Result<()> {
    conn.prepare_cached(
        "UPDATE job_rows SET status = ?2, completed_at_ms = ?3, lease_id = NULL, lease_expires_at_ms = NULL,
                error = 'cancelled' WHERE id = ?1",
    )?
    .execute(params![row, CANCELLED, now_ms])?;
    Ok(())
}

/// Puts a failed or dead job back to pending with a fresh attempt budget.
/// The attempt count starts again from 0, so a completion row the job
/// may have (of an attempt that did not count, see [`complete`]) is
/// deleted: it would otherwise match a later attempt of the same number.
/// Lowers the stored [`open_floor`] to the job's row when it is above it:
/// the only statement that reopens a finished job.
///
/// Errors: [`Error::Storage`].
pub fn retry(conn: &Connection, row: i64, now_ms: i64, priority: i32) -> Result<()> {
    conn.prepare_cached(
        "UPDATE job_rows SET status = ?2, attempt = 0, ready_at_ms = ?3, completed_at_ms = NULL,
                lease_id = NULL, error = '', current_task = 0, progress_percent = 0, priority = ?4 WHERE id = ?1",
    )?
    .execute(params![row, PENDING, now_ms, priority])?;
    conn.prepare_cached("DELETE FROM job_completions WHERE job_row = ?1")?
        .execute([row])?;
    // The job is open again: the start-up load must read its row.
    conn.prepare_cached(
        "UPDATE job_floor SET first_open_row = min(first_open_row, ?1) WHERE one = 1",
    )?
    .execute([row])?;
    Ok(())
}

/// The first job row that may be open (`job_floor.first_open_row`):
/// every job row below it is completed, dead or cancelled. 0 when the
/// database has no floor stored.
///
/// Errors: [`Error::Storage`].
pub fn open_floor(conn: &Connection) -> Result<i64> {
    Ok(conn
        .prepare_cached("SELECT first_open_row FROM job_floor WHERE one = 1")?
        .query_row([], |r| r.get(0))
        .optional()?
        .unwrap_or(0))
}

/// Stores `row` as the first job row that may be open (see
/// [`open_floor`]). The caller holds every open job and passes the lowest
/// of their rows (or, with none open, the next row it would hand out).
///
/// Errors: [`Error::Storage`].
pub fn set_open_floor(conn: &Connection, row: i64) -> Result<()> {
    conn.prepare_cached("UPDATE job_floor SET first_open_row = ?1 WHERE one = 1")?
        .execute([row])?;
    Ok(())
}

/// Moves a failed job whose backoff has elapsed back to pending.
///
/// Errors: [`Error::Storage`].
pub fn promote(conn: &Connection, row: i64) -> Result<()> {
    conn.prepare_cached("UPDATE job_rows SET status = ?2 WHERE id = ?1 AND status = ?3")?
        .execute(params![row, PENDING, FAILED])?;
    Ok(())
}

/// A job that is not terminal, as loaded at startup.
#[derive(Debug, Clone)]
pub struct OpenJob {
    /// Row id.
    pub row: i64,
    /// Public id.
    pub job_id: String,
    /// Owning action.
    pub action_id: String,
    /// Plan it runs.
    pub plan_id: String,
    /// Version of the plan it runs.
    pub plan_version: u32,
    /// Pending, running or failed.
    pub status: JobStatus,
    /// Eligible from (pending/failed).
    pub ready_at_ms: i64,
    /// Lease holder (running).
    pub worker_id: Option<String>,
    /// Lease id (running).
    pub lease_id: Option<String>,
    /// Lease expiry (running).
    pub lease_expires_at_ms: Option<i64>,
    /// Attempts started.
    pub attempt: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Scheduling priority.
    pub priority: i32,
}

/// The statement of [`load_open`].
pub(super) const LOAD_OPEN: &str =
    "SELECT action_id, plan_id, status, ready_at_ms, worker_id, lease_id, lease_expires_at_ms,
            attempt, max_attempts, plan_version, priority, id, job_key, job_id
     FROM jobs WHERE id >= ?4 AND status IN (?1, ?2, ?3) ORDER BY id";

/// Every pending, running and failed job from row `floor` on (the stored
/// [`open_floor`]: every row below it is finished), in FIFO order. Reads
/// the rows from `floor` on, not the whole table.
///
/// Errors: [`Error::Storage`].
pub fn load_open(conn: &Connection, floor: i64) -> Result<Vec<OpenJob>> {
    let mut stmt = conn.prepare(LOAD_OPEN)?;
    let rows = stmt.query_map(params![PENDING, RUNNING, FAILED, floor], |r| {
        Ok(OpenJob {
            row: r.get(11)?,
            job_id: job_id_at(r, 11)?,
            action_id: r.get(0)?,
            plan_id: r.get(1)?,
            status: status_at(r, 2)?,
            ready_at_ms: r.get(3)?,
            worker_id: r.get(4)?,
            lease_id: r.get(5)?,
            lease_expires_at_ms: r.get(6)?,
            attempt: r.get(7)?,
            max_attempts: r.get(8)?,
            plan_version: r.get(9)?,
            priority: r.get(10)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

fn scheduling_at(r: &Row<'_>, idx: usize) -> rusqlite::Result<Scheduling> {
    Ok(Scheduling {
        priority: r.get(idx)?,
        worker_selector: r.get(idx + 1)?,
        concurrency_key: r.get(idx + 2)?,
        max_running: r.get(idx + 3)?,
    })
}

/// The statement of [`open_action_scheduling`]: it walks the partial
/// index of unfinished actions (`actions_open`, migration 0018).
pub(super) const OPEN_ACTION_SCHEDULING: &str =
    "SELECT action_id, priority, worker_selector, concurrency_key, max_running FROM actions
     WHERE finished_at_ms IS NULL AND (worker_selector != '' OR concurrency_key != '')";

/// The fleet-scheduling settings of every unfinished action that has a
/// worker selector or a concurrency key, by action id (every other
/// action schedules by its jobs' priorities alone): what the start-up
/// load needs besides [`load_open`].
///
/// Errors: [`Error::Storage`].
pub fn open_action_scheduling(conn: &Connection) -> Result<HashMap<String, Scheduling>> {
    let mut stmt = conn.prepare(OPEN_ACTION_SCHEDULING)?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, scheduling_at(r, 1)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// The fleet-scheduling settings of action `action_id`; `None` when
/// there is no such action.
///
/// Errors: [`Error::Storage`].
pub fn action_scheduling(conn: &Connection, action_id: &str) -> Result<Option<Scheduling>> {
    Ok(conn
        .prepare_cached(
            "SELECT priority, worker_selector, concurrency_key, max_running FROM actions WHERE action_id = ?1",
        )?
        .query_row([action_id], |r| scheduling_at(r, 0))
        .optional()?)
}

fn parse_input(json: &str) -> Result<HashMap<String, String>> {
    serde_json::from_str(json)
        .map_err(|e| Error::Internal(format!("stored input does not parse: {e}")))
}

/// The job exactly as [`get_by_row`] (without results) reads it right
/// after [`JobInserter::insert`] stored it with these values and a `ready_at_ms` not
/// in the future: what the scheduler uses instead of reading a new job back.
#[allow(clippy::too_many_arguments)]
pub fn inserted_view(
    job_id: String,
    action_id: &str,
    plan_id: &str,
    plan_version: u32,
    input: HashMap<String, String>,
    max_attempts: u32,
    created_at_ms: i64,
    priority: i32,
) -> Job {
    Job {
        job_id,
        action_id: action_id.to_string(),
        plan_id: plan_id.to_string(),
        plan_version,
        status: JobStatus::Pending,
        input,
        attempt: 0,
        max_attempts,
        created_at_ms,
        started_at_ms: None,
        completed_at_ms: None,
        worker_id: String::new(),
        task_results: Vec::new(),
        error: String::new(),
        waiting_reason: String::new(),
        current_task: 0,
        progress_percent: 0,
        ready_at_ms: None,
        priority,
    }
}

/// The job at `row`, with task results when `with_results`.
///
/// Errors: [`Error::Storage`], [`Error::Internal`] for an undecodable row.
pub fn get_by_row(conn: &Connection, row: i64, with_results: bool) -> Result<Option<Job>> {
    let found = conn
        .prepare_cached(
            "SELECT id, action_id, plan_id, status, input, attempt, max_attempts, created_at_ms,
                    started_at_ms, completed_at_ms, worker_id, error, current_task, progress_percent, ready_at_ms,
                    plan_version, priority, CASE WHEN ?2 THEN task_results END, job_key, job_id
             FROM jobs WHERE id = ?1",
        )?
        .query_row(params![row, with_results], |r| {
            Ok((
                Job {
                    job_id: job_id_of(r, row, 18)?,
                    action_id: r.get(1)?,
                    plan_id: r.get(2)?,
                    plan_version: r.get(15)?,
                    status: status_at(r, 3)?,
                    input: HashMap::new(),
                    attempt: r.get(5)?,
                    max_attempts: r.get(6)?,
                    created_at_ms: r.get(7)?,
                    started_at_ms: r.get(8)?,
                    completed_at_ms: r.get(9)?,
                    worker_id: r.get::<_, Option<String>>(10)?.unwrap_or_default(),
                    task_results: Vec::new(),
                    error: r.get(11)?,
                    waiting_reason: String::new(),
                    current_task: r.get(12)?,
                    progress_percent: r.get(13)?,
                    ready_at_ms: None,
                    priority: r.get(16)?,
                },
                r.get::<_, String>(4)?,
                r.get::<_, i64>(14)?,
                r.get::<_, Option<String>>(17)?,
            ))
        })
        .optional()?;
    let Some((mut job, input, ready_at_ms, results)) = found else {
        return Ok(None);
    };
    job.input = parse_input(&input)?;
    let waiting = matches!(job.status, JobStatus::Pending | JobStatus::Failed);
    if waiting && ready_at_ms > now_ms() {
        job.ready_at_ms = Some(ready_at_ms);
    }
    job.task_results = decode_task_results(results)?;
    Ok(Some(job))
}

/// Aggregate counts of the action `action_id`.
///
/// Errors: [`Error::Storage`].
pub fn action_status(conn: &Connection, action_id: &str) -> Result<Option<ActionStatus>> {
    let head = conn
        .prepare_cached(
            "SELECT plan_id, total_jobs, created_at_ms, plan_version,
                    priority, worker_selector, concurrency_key, max_running
             FROM actions WHERE action_id = ?1",
        )?
        .query_row([action_id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, u32>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, u32>(3)?,
                scheduling_at(r, 4)?,
            ))
        })
        .optional()?;
    let Some((plan_id, total_jobs, created_at_ms, plan_version, scheduling)) = head else {
        return Ok(None);
    };
    let mut status = ActionStatus {
        action_id: action_id.to_string(),
        plan_id,
        plan_version,
        total_jobs,
        created_at_ms,
        scheduling,
        ..Default::default()
    };
    // One pass over the action's jobs (no GROUP BY sort).
    let (counts, last_done) = conn
        .prepare_cached(concat!(
            "SELECT count(*) FILTER (WHERE status = ?2), count(*) FILTER (WHERE status = ?3),
                    count(*) FILTER (WHERE status = ?4), count(*) FILTER (WHERE status = ?5),
                    count(*) FILTER (WHERE status = ?6), count(*) FILTER (WHERE status = ?7),
                    max(completed_at_ms) FILTER (WHERE status IN (?4, ?6, ?7))
             FROM jobs WHERE ",
            of_action!()
        ))?
        .query_row(
            params![action_id, PENDING, RUNNING, COMPLETED, FAILED, DEAD, CANCELLED],
            |r| {
                Ok((
                    [
                        r.get::<_, u32>(0)?,
                        r.get::<_, u32>(1)?,
                        r.get::<_, u32>(2)?,
                        r.get::<_, u32>(3)?,
                        r.get::<_, u32>(4)?,
                        r.get::<_, u32>(5)?,
                    ],
                    r.get::<_, Option<i64>>(6)?,
                ))
            },
        )?;
    [
        status.pending,
        status.running,
        status.completed,
        status.failed,
        status.dead,
        status.cancelled,
    ] = counts;
    if status.completed + status.dead + status.cancelled == status.total_jobs {
        status.completed_jobs_at_ms = last_done;
    }
    Ok(Some(status))
}

/// Where a page of an action listing starts: after the action created at
/// `created_at_ms` with row id `rowid` (newest first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActionCursor {
    /// Creation time of the last action of the previous page, ms.
    pub created_at_ms: i64,
    /// Its row id (submission order among equal times).
    pub rowid: i64,
}

/// Up to `limit` actions matching `q`, newest first, after `after` when
/// given: each with its cursor. The statement holds only the filters in
/// use, so SQLite walks `actions_by_plan` or `actions_by_created`
/// backwards with no sort (see migration 0008).
///
/// Errors: [`Error::Storage`].
pub fn list_actions(
    conn: &Connection,
    q: &ActionQuery,
    after: Option<ActionCursor>,
    limit: usize,
) -> Result<Vec<(ActionCursor, String)>> {
    let mut sql =
        String::from("SELECT a.rowid, a.created_at_ms, a.action_id FROM actions a WHERE 1");
    let mut args: Vec<rusqlite::types::Value> = Vec::new();
    let mut arg = |sql: &mut String, clause: &str, v: rusqlite::types::Value| {
        args.push(v);
        sql.push_str(&clause.replace('?', &format!("?{}", args.len())));
    };
    if let Some(p) = &q.plan_id {
        arg(&mut sql, " AND a.plan_id = ?", p.clone().into());
    }
    if let Some(t) = q.created_after_ms {
        arg(&mut sql, " AND a.created_at_ms >= ?", t.into());
    }
    if let Some(t) = q.created_before_ms {
        arg(&mut sql, " AND a.created_at_ms < ?", t.into());
    }
    if let Some(c) = after {
        arg(
            &mut sql,
            " AND (a.created_at_ms < ?",
            c.created_at_ms.into(),
        );
        arg(&mut sql, " OR (a.created_at_ms = ?", c.created_at_ms.into());
        arg(&mut sql, " AND a.rowid < ?))", c.rowid.into());
    }
    match q.state {
        None => {}
        Some(ActionState::Open) => sql.push_str(" AND a.finished_at_ms IS NULL"),
        Some(ActionState::Finished) => sql.push_str(" AND a.finished_at_ms IS NOT NULL"),
        // The literal status lets SQLite use the partial index of dead
        // jobs; it reads the job rows, not the `jobs` view: a dead row's
        // status is what the view reads (a completion counts only for a
        // running row).
        Some(ActionState::HasDead) => sql.push_str(&format!(
            " AND EXISTS (SELECT 1 FROM job_rows j WHERE j.action_id = a.action_id AND j.status = {DEAD})"
        )),
    }
    arg(
        &mut sql,
        " ORDER BY a.created_at_ms DESC, a.rowid DESC LIMIT ?",
        (limit as i64).into(),
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(rusqlite::params_from_iter(args), |r| {
        Ok((
            ActionCursor {
                rowid: r.get(0)?,
                created_at_ms: r.get(1)?,
            },
            r.get(2)?,
        ))
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// (row, job_id, priority) of the jobs of `action_id` in one of
/// `statuses`, in row order.
///
/// Errors: [`Error::Storage`].
pub fn jobs_of_action(
    conn: &Connection,
    action_id: &str,
    statuses: &[JobStatus],
) -> Result<Vec<(i64, String, i32)>> {
    let list = statuses
        .iter()
        .map(|s| (*s as i32).to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT id, job_key, job_id, priority FROM jobs WHERE {} AND status IN ({list}) ORDER BY id",
        of_action!()
    ))?;
    let rows = stmt.query_map([action_id], |r| {
        Ok((r.get(0)?, job_id_at(r, 0)?, r.get(3)?))
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// The plan of action `action_id` and the version its jobs run; `None`
/// when there is no such action.
///
/// Errors: [`Error::Storage`].
pub fn action_plan(conn: &Connection, action_id: &str) -> Result<Option<(String, u32)>> {
    Ok(conn
        .prepare_cached("SELECT plan_id, plan_version FROM actions WHERE action_id = ?1")?
        .query_row([action_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?)
}

/// True when the action exists.
///
/// Errors: [`Error::Storage`].
pub fn action_exists(conn: &Connection, action_id: &str) -> Result<bool> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM actions WHERE action_id = ?1")?
        .query_row([action_id], |_| Ok(()))
        .optional()?
        .is_some())
}

/// The statement of [`search`] for the jobs of one finished status of
/// any action, read through `$index`, a partial index that holds only
/// rows whose stored status is `$status` (a literal: SQLite uses a
/// partial index only where the query's terms imply its condition).
/// The parameters are those of [`search`]'s other statements.
macro_rules! search_by_index {
    ($index:literal, $status:literal) => {
        concat!(
            "SELECT id, job_key, job_id FROM job_rows INDEXED BY ",
            $index,
            " WHERE status = ",
            $status,
            " AND id > ?1 AND ?2 IS NULL AND ?3 = ",
            $status,
            " AND (?4 IS NULL OR plan_id = ?4) AND (?5 IS NULL OR created_at_ms >= ?5)
              AND (?6 IS NULL OR created_at_ms < ?6)
             ORDER BY id LIMIT ?7"
        )
    };
}

/// The statement of [`search`] for dead jobs of any action: the index of
/// dead jobs by action (migration 0008), sorted.
pub(super) const SEARCH_DEAD: &str = search_by_index!("jobs_dead_by_action", "5");

/// The statement of [`search`] for cancelled jobs of any action: a page
/// of the index of cancelled rows (migration 0019), in row order.
pub(super) const SEARCH_CANCELLED: &str = search_by_index!("jobs_cancelled", "6");

/// Up to `limit` (row, job_id) pairs matching `filter` with row > `after_row`, in row order.
/// Without an action, an open status (pending, running, failed) is
/// looked for from the stored [`open_floor`] on, and dead and cancelled
/// jobs through the partial indexes that hold only them.
///
/// Errors: [`Error::Storage`].
pub fn search(
    conn: &Connection,
    filter: &JobQuery,
    after_row: i64,
    limit: usize,
) -> Result<Vec<(i64, String)>> {
    macro_rules! rest {
        () => {
            " AND (?3 IS NULL OR status = ?3)
              AND (?4 IS NULL OR plan_id = ?4) AND (?5 IS NULL OR created_at_ms >= ?5)
              AND (?6 IS NULL OR created_at_ms < ?6)
            ORDER BY id LIMIT ?7"
        };
    }
    // The jobs of one action: only the range of its rows is read.
    let mut stmt = conn.prepare_cached(if filter.action_id.is_some() {
        concat!(
            "SELECT id, job_key, job_id FROM jobs WHERE id > ?1
               AND id BETWEEN (SELECT first_job_row FROM actions WHERE action_id = ?2)
                          AND (SELECT last_job_row FROM actions WHERE action_id = ?2)
               AND action_id = ?2",
            rest!()
        )
    } else if filter.status == Some(JobStatus::Dead) {
        // Dead jobs of any action: read from the partial index that holds
        // only them, then sorted (a walk of the rows would read every
        // finished job to find the few dead ones). A dead job's row keeps
        // its status (the `jobs` view changes only running ones).
        SEARCH_DEAD
    } else if filter.status == Some(JobStatus::Cancelled) {
        SEARCH_CANCELLED
    } else {
        // `?2` (no action: NULL) keeps the parameters of both statements
        // the same. An open status (pending, running, failed) is looked
        // for from the open floor on: every row below it is finished.
        concat!(
            "SELECT id, job_key, job_id FROM jobs
             WHERE id > max(?1, CASE WHEN ?3 IN (1, 2, 4)
                                THEN coalesce((SELECT first_open_row FROM job_floor), 0) - 1
                                ELSE ?1 END)
               AND ?2 IS NULL",
            rest!()
        )
    })?;
    let rows = stmt.query_map(
        params![
            after_row,
            filter.action_id,
            filter.status.map(|s| s as i32),
            filter.plan_id,
            filter.created_after_ms,
            filter.created_before_ms,
            limit as i64
        ],
        |r| Ok((r.get(0)?, job_id_at(r, 0)?)),
    )?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// The public ids of `rows`, in the same order (missing rows skipped).
///
/// Errors: [`Error::Storage`].
pub fn job_ids(conn: &Connection, rows: &[i64]) -> Result<Vec<String>> {
    let mut stmt = conn.prepare_cached("SELECT id, job_key, job_id FROM jobs WHERE id = ?1")?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(id) = stmt.query_row([row], |r| job_id_at(r, 0)).optional()? {
            out.push(id);
        }
    }
    Ok(out)
}

/// The largest job row stored (0 when there is none).
///
/// Errors: [`Error::Storage`].
pub fn last_row(conn: &Connection) -> Result<i64> {
    Ok(
        conn.query_row("SELECT coalesce(max(id), 0) FROM job_rows", [], |r| {
            r.get(0)
        })?,
    )
}

/// Number of jobs in each status (keyed by the `JobStatus` value), by one
/// scan of the table (no index holds the status): for loading the
/// engine's counts, not for each request.
///
/// Errors: [`Error::Storage`].
pub fn count_by_status(conn: &Connection) -> Result<HashMap<i32, i64>> {
    let mut stmt = conn.prepare_cached("SELECT status, count(*) FROM jobs GROUP BY status")?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, i32>(0)?, r.get::<_, i64>(1)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Number of jobs of plan `plan_id` in each status (keyed by the
/// `JobStatus` value): the jobs a deletion of the plan takes with it.
///
/// Errors: [`Error::Storage`].
pub fn count_by_status_of_plan(
    conn: &Connection,
    plan_id: &str,
) -> Result<HashMap<JobStatus, i64>> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT j.status, count(*) FROM actions a CROSS JOIN jobs j ON ",
        job_of_action!(),
        " WHERE a.plan_id = ?1 GROUP BY j.status"
    ))?;
    let rows = stmt.query_map([plan_id], |r| Ok((status_at(r, 0)?, r.get::<_, i64>(1)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SyncMode;

    /// Task results are stored without their default fields, and read
    /// back whole; results stored with every field (as before this
    /// encoding) read the same.
    #[test]
    fn task_results_are_stored_without_default_fields() {
        let ok = TaskResult {
            task_number: 1,
            command: "true".into(),
            stdout: "ok\n".into(),
            ..Default::default()
        };
        let text = encode_task_results(std::slice::from_ref(&ok)).unwrap();
        assert_eq!(
            text,
            r#"[{"task_number":1,"command":"true","stdout":"ok\n"}]"#
        );
        let full = r#"[{"task_number":1,"command":"true","exit_code":0,"stdout":"ok\n","stderr":"","duration_ms":0,"stdout_truncated":false,"stderr_truncated":false}]"#;
        assert_eq!(
            decode_task_results(Some(full.into())).unwrap(),
            vec![ok.clone()]
        );
        let failed = TaskResult {
            task_number: 2,
            command: "grep x".into(),
            exit_code: -9,
            stdout: String::new(),
            stderr: "killed".into(),
            duration_ms: 1500,
            stdout_truncated: true,
            stderr_truncated: true,
        };
        let both = vec![ok, failed];
        assert_eq!(
            decode_task_results(encode_task_results(&both)).unwrap(),
            both
        );
    }

    /// A job inserted running its first attempt under lease `L1` of `w1`.
    fn leased_job() -> (tempfile::TempDir, Connection, i64) {
        let dir = tempfile::tempdir().unwrap();
        let (conn, _pool) =
            super::super::open(&dir.path().join("agq.db"), SyncMode::Normal).unwrap();
        conn.execute(
            "INSERT INTO plans (plan_id, description, body, created_at_ms) VALUES ('p', '', x'', 0)",
            [],
        )
        .unwrap();
        assert!(insert_action(
            &conn,
            "a",
            "p",
            1,
            1,
            3,
            None,
            None,
            &Scheduling::default(),
            0,
            (1, 1)
        )
        .unwrap());
        let lease = FirstLease {
            worker_id: "w1",
            lease_id: "L1",
        };
        JobInserter::new(&conn, columns(i64::MAX))
            .insert(1, new_job_key(), "{}", Some(lease))
            .unwrap();
        (dir, conn, 1)
    }

    /// The columns of the jobs of action `a` of plan `p`, created at 0,
    /// whose first leases expire at `expires_at_ms`.
    fn columns(expires_at_ms: i64) -> ActionColumns<'static> {
        ActionColumns {
            action_id: "a",
            plan_id: "p",
            plan_version: 1,
            max_attempts: 3,
            priority: 0,
            now_ms: 0,
            ready_at_ms: 0,
            lease_expires_at_ms: expires_at_ms,
        }
    }

    /// The columns a test reads back from a job row.
    #[derive(Debug, PartialEq)]
    struct RowColumns {
        key: i64,
        input: String,
        action_id: String,
        plan_id: String,
        status: i32,
        attempt: u32,
        max_attempts: u32,
        created_at_ms: i64,
        ready_at_ms: i64,
        started_at_ms: Option<i64>,
        worker_id: Option<String>,
        lease_id: Option<String>,
        lease_expires_at_ms: Option<i64>,
        priority: i32,
    }

    fn row_columns(conn: &Connection, row: i64) -> RowColumns {
        conn.query_row(
            "SELECT job_key, input, action_id, plan_id, status, attempt, max_attempts, created_at_ms,
                    ready_at_ms, started_at_ms, worker_id, lease_id, lease_expires_at_ms, priority
             FROM job_rows WHERE id = ?1",
            [row],
            |r| {
                Ok(RowColumns {
                    key: r.get(0)?,
                    input: r.get(1)?,
                    action_id: r.get(2)?,
                    plan_id: r.get(3)?,
                    status: r.get(4)?,
                    attempt: r.get(5)?,
                    max_attempts: r.get(6)?,
                    created_at_ms: r.get(7)?,
                    ready_at_ms: r.get(8)?,
                    started_at_ms: r.get(9)?,
                    worker_id: r.get(10)?,
                    lease_id: r.get(11)?,
                    lease_expires_at_ms: r.get(12)?,
                    priority: r.get(13)?,
                })
            },
        )
        .unwrap()
    }

    /// One inserter binds the columns its jobs share once and each job's
    /// own for every insert: pending and leased inserts in any order give
    /// every row its own key, input and lease, the action's columns, and
    /// a pending row no lease column of a leased one inserted before it.
    /// The granter keeps its times bound only while they stay the same.
    #[test]
    fn shared_bindings_give_every_row_its_own_columns() {
        let (_dir, conn, _) = leased_job();
        let cols = ActionColumns {
            action_id: "b",
            plan_id: "p",
            plan_version: 1,
            max_attempts: 5,
            priority: 7,
            now_ms: 1_000,
            ready_at_ms: 3_000,
            lease_expires_at_ms: 61_000,
        };
        conn.execute(
            "INSERT INTO actions (action_id, plan_id, created_at_ms, total_jobs, max_attempts)
             VALUES ('b', 'p', 1000, 4, 5)",
            [],
        )
        .unwrap();
        let mut inserter = JobInserter::new(&conn, cols);
        let lease = |l| FirstLease {
            worker_id: "w2",
            lease_id: l,
        };
        let jobs = [
            (10, 110, r#"{"n":"0"}"#, None),
            (11, 111, r#"{"n":"1"}"#, Some(lease("L11"))),
            (12, 112, r#"{"n":"2"}"#, None),
            (13, 113, r#"{"n":"3"}"#, Some(lease("L13"))),
        ];
        for (row, key, input, lease) in jobs {
            inserter.insert(row, key, input, lease).unwrap();
        }
        for (row, key, input, lease) in jobs {
            let pending = RowColumns {
                key,
                input: input.into(),
                action_id: "b".into(),
                plan_id: "p".into(),
                status: PENDING,
                attempt: 0,
                max_attempts: 5,
                created_at_ms: 1_000,
                ready_at_ms: 3_000,
                started_at_ms: None,
                worker_id: None,
                lease_id: None,
                lease_expires_at_ms: None,
                priority: 7,
            };
            let expected = match lease {
                None => pending,
                Some(l) => RowColumns {
                    status: RUNNING,
                    attempt: 1,
                    ready_at_ms: 1_000,
                    started_at_ms: Some(1_000),
                    worker_id: Some("w2".into()),
                    lease_id: Some(l.lease_id.into()),
                    lease_expires_at_ms: Some(61_000),
                    ..pending
                },
            };
            assert_eq!(row_columns(&conn, row), expected, "row {row}");
        }
        let mut granter = LeaseGranter::new(&conn);
        for (row, lease, now, expires) in [
            (10, "G10", 5_000, 65_000),
            (12, "G12", 5_000, 65_000),
            (1, "G1", 6_000, 66_000),
        ] {
            granter.grant(row, "w3", lease, 2, now, expires).unwrap();
            let c = row_columns(&conn, row);
            assert_eq!(
                (
                    c.status,
                    c.attempt,
                    c.started_at_ms,
                    c.worker_id,
                    c.lease_id,
                    c.lease_expires_at_ms
                ),
                (
                    RUNNING,
                    2,
                    Some(now),
                    Some("w3".into()),
                    Some(lease.into()),
                    Some(expires)
                ),
                "row {row}"
            );
        }
    }

    /// A public id names its row and key and nothing else: it is a
    /// canonical UUIDv7 carrying the row's millisecond timestamp, it
    /// parses back to (row, key), and another spelling, another version
    /// or variant, or a string that is not a UUID names no row.
    #[test]
    fn public_ids_carry_their_row() {
        let now_ms = 1_764_000_000_000;
        let (first, last) = next_rows(0, now_ms, 3);
        assert_eq!((first, last), (now_ms << 12, (now_ms << 12) + 2));
        for row in [first, last, (now_ms << 12) + 4095, (now_ms << 12) + 4096] {
            let key = new_job_key();
            let id = public_job_id(row, key);
            let uuid = uuid::Uuid::parse_str(&id).unwrap();
            assert_eq!(uuid.get_version_num(), 7, "{id}");
            assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
            let (secs, _) = uuid.get_timestamp().unwrap().to_unix();
            assert_eq!(secs, (row >> 12) as u64 / 1000, "{id}");
            assert_eq!(parse_job_id(&id), Some((row, key)));
            assert_eq!(parse_job_id(&id.to_uppercase()), None);
            assert_eq!(parse_job_id(&id.replace('-', "")), None);
        }
        assert_eq!(parse_job_id("j"), None);
        assert_eq!(parse_job_id(&uuid::Uuid::new_v4().to_string()), None);
        // Rows only grow: after a later row, or with the clock behind.
        assert_eq!(next_rows(last, now_ms - 10, 1), (last + 1, last + 1));
        assert_eq!(next_rows(5, now_ms, 2).0, now_ms << 12);
    }

    /// A look-up by public id finds the job by its row only with its own
    /// key; a job stored with a text id (created before schema 16) is
    /// found by that id.
    #[test]
    fn a_job_is_found_by_its_public_id() {
        let (_dir, conn, row) = leased_job();
        let key: i64 = conn
            .query_row("SELECT job_key FROM jobs WHERE id = ?1", [row], |r| {
                r.get(0)
            })
            .unwrap();
        let id = public_job_id(row, key);
        assert_eq!(key_by_job_id(&conn, &id).unwrap().unwrap().row, row);
        assert_eq!(get_by_row(&conn, row, false).unwrap().unwrap().job_id, id);
        let other = public_job_id(row, new_job_key());
        assert!(key_by_job_id(&conn, &other).unwrap().is_none());
        conn.execute(
            "INSERT INTO job_rows (id, job_id, action_id, plan_id, status, input, max_attempts, created_at_ms, ready_at_ms)
             VALUES (7, 'old-id', 'a', 'p', 3, '{}', 1, 0, 0)",
            [],
        )
        .unwrap();
        assert_eq!(key_by_job_id(&conn, "old-id").unwrap().unwrap().row, 7);
        assert_eq!(
            job_ids(&conn, &[row, 7, 8]).unwrap(),
            [id, "old-id".to_string()]
        );
    }

    fn status(conn: &Connection, row: i64) -> JobStatus {
        get_by_row(conn, row, false).unwrap().unwrap().status
    }

    /// The fencing in the database, on its own: a progress report or a
    /// failure recorded with a stale lease id, or by another worker with
    /// the right one, and a completion of another attempt, change nothing
    /// a reader sees, and the job keeps running; the holder's outcome
    /// counts, once; a completed job takes no other outcome.
    #[test]
    fn outcomes_under_a_stale_lease_change_no_row() {
        let (_dir, conn, row) = leased_job();
        let stale = Fence {
            lease_id: "L0",
            worker_id: "w1",
        };
        let thief = Fence {
            lease_id: "L1",
            worker_id: "w2",
        };
        let result = |n: u32| TaskResult {
            task_number: n,
            command: "wc".into(),
            stdout: format!("{n}\n"),
            ..Default::default()
        };
        let one = encode_task_results(&[result(1)]);
        let two = encode_task_results(&[result(1), result(2)]);
        for fence in [stale, thief] {
            assert!(!fail_attempt(&conn, row, fence, true, "x", 1, 1, true).unwrap());
            assert!(
                !set_progress(&BatchConn::new(&conn), row, fence, 1, 50, one.as_deref()).unwrap()
            );
            assert_eq!(status(&conn, row), JobStatus::Running, "{fence:?}");
        }
        complete(&BatchConn::new(&conn), row, 0, 1, two.as_deref()).unwrap();
        assert_eq!(status(&conn, row), JobStatus::Running);
        let job = get_by_row(&conn, row, true).unwrap().unwrap();
        assert_eq!(
            (
                job.progress_percent,
                job.error.as_str(),
                job.completed_at_ms
            ),
            (0, "", None)
        );
        assert!(job.task_results.is_empty());
        let holder = Fence {
            lease_id: "L1",
            worker_id: "w1",
        };
        // The stale completion does not stop the holder's reports.
        assert!(set_progress(&BatchConn::new(&conn), row, holder, 1, 50, one.as_deref()).unwrap());
        assert_eq!(
            get_by_row(&conn, row, true).unwrap().unwrap().task_results,
            [result(1)]
        );
        // A progress report without results keeps the stored ones.
        assert!(set_progress(&BatchConn::new(&conn), row, holder, 2, 60, None).unwrap());
        assert_eq!(
            get_by_row(&conn, row, true).unwrap().unwrap().task_results,
            [result(1)]
        );
        assert!(get_by_row(&conn, row, false)
            .unwrap()
            .unwrap()
            .task_results
            .is_empty());
        complete(&BatchConn::new(&conn), row, 1, 5, two.as_deref()).unwrap();
        assert_eq!(status(&conn, row), JobStatus::Completed);
        let job = get_by_row(&conn, row, true).unwrap().unwrap();
        assert_eq!(job.task_results, [result(1), result(2)]);
        assert_eq!(
            (
                job.progress_percent,
                job.completed_at_ms,
                job.error.as_str()
            ),
            (100, Some(5), "")
        );
        // The lease that recorded the outcome stays (a repeated report is
        // recognised by it).
        let key = key_by_job_id(&conn, &job.job_id).unwrap().unwrap();
        assert_eq!(
            (key.status, key.lease_id.as_deref()),
            (JobStatus::Completed, Some("L1"))
        );
        // The attempt has ended: even its own lease records nothing more,
        // and a stale completion does not undo it.
        complete(&BatchConn::new(&conn), row, 1, 9, None).unwrap();
        complete(&BatchConn::new(&conn), row, 0, 9, None).unwrap();
        assert!(!fail_attempt(&conn, row, holder, true, "late", 2, 2, true).unwrap());
        assert!(!set_progress(&BatchConn::new(&conn), row, holder, 3, 70, one.as_deref()).unwrap());
        let job = get_by_row(&conn, row, true).unwrap().unwrap();
        assert_eq!(job.status, JobStatus::Completed);
        assert_eq!(job.task_results, [result(1), result(2)]);
        assert_eq!((job.progress_percent, job.completed_at_ms), (100, Some(5)));
    }

    /// A completion of an attempt the job does not run (recorded before
    /// that attempt failed) counts for nothing, not for the next attempt
    /// either: RetryJob, which numbers the attempts from 0 again, deletes
    /// it, and the completion of the attempt the job runs counts.
    #[test]
    fn a_completion_counts_only_in_the_attempt_the_job_runs() {
        let (_dir, conn, row) = leased_job();
        let completions = || -> i64 {
            conn.query_row(
                "SELECT count(*) FROM job_completions WHERE job_row = ?1",
                [row],
                |r| r.get(0),
            )
            .unwrap()
        };
        complete(&BatchConn::new(&conn), row, 0, 1, None).unwrap();
        assert_eq!(status(&conn, row), JobStatus::Running);
        let holder = Fence {
            lease_id: "L1",
            worker_id: "w1",
        };
        assert!(fail_attempt(&conn, row, holder, true, "exit 1", 2, 2, true).unwrap());
        assert_eq!(status(&conn, row), JobStatus::Dead);
        // Of the attempt that failed: counts for nothing now.
        complete(&BatchConn::new(&conn), row, 1, 3, None).unwrap();
        assert_eq!(status(&conn, row), JobStatus::Dead);
        assert_eq!(completions(), 1);
        retry(&conn, row, 4, 0).unwrap();
        assert_eq!(completions(), 0);
        assert_eq!(status(&conn, row), JobStatus::Pending);
        LeaseGranter::new(&conn)
            .grant(row, "w2", "L2", 1, 5, i64::MAX)
            .unwrap();
        assert_eq!(status(&conn, row), JobStatus::Running);
        let results = encode_task_results(&[TaskResult {
            task_number: 1,
            command: "wc".into(),
            ..Default::default()
        }]);
        complete(&BatchConn::new(&conn), row, 1, 6, results.as_deref()).unwrap();
        let job = get_by_row(&conn, row, true).unwrap().unwrap();
        assert_eq!(
            (job.status, job.completed_at_ms, job.task_results.len()),
            (JobStatus::Completed, Some(6), 1)
        );
    }
}
