//! The `schedules` table (migration 0012): recurring schedules, their
//! next tick and the record of their last firing.

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::{
    core::model::{CatchUp, Schedule, Scheduling},
    error::{Error, Result},
};

const COLUMNS: &str = "schedule_id, plan_id, cron, time_zone, inputs, max_attempts, priority,
    worker_selector, concurrency_key, max_running, catch_up, next_run_ms, last_run_ms,
    last_action_id, runs, last_error, created_at_ms";

/// The stored value of a catch-up policy (`agq.v1.CatchUp`).
pub fn catch_up_code(c: CatchUp) -> i32 {
    match c {
        CatchUp::All => 1,
        CatchUp::Latest => 2,
        CatchUp::Skip => 3,
    }
}

pub fn catch_up_of(code: i32) -> CatchUp {
    match code {
        2 => CatchUp::Latest,
        3 => CatchUp::Skip,
        _ => CatchUp::All,
    }
}

/// A row and its undecoded inputs (decoded off the row closure, where a
/// JSON error can be an [`Error`]).
fn from_row(r: &Row<'_>) -> rusqlite::Result<(Schedule, String)> {
    let next: Option<i64> = r.get(11)?;
    Ok((
        Schedule {
            schedule_id: r.get(0)?,
            plan_id: r.get(1)?,
            cron: r.get(2)?,
            time_zone: r.get(3)?,
            inputs: Vec::new(),
            max_attempts: r.get(5)?,
            scheduling: Scheduling {
                priority: r.get(6)?,
                worker_selector: r.get(7)?,
                concurrency_key: r.get(8)?,
                max_running: r.get(9)?,
            },
            catch_up: catch_up_of(r.get(10)?),
            paused: next.is_none(),
            next_run_at_ms: next,
            last_run_at_ms: r.get(12)?,
            last_action_id: r.get(13)?,
            runs: r.get::<_, i64>(14)?.max(0) as u64,
            last_error: r.get(15)?,
            created_at_ms: r.get(16)?,
        },
        r.get(4)?,
    ))
}

fn decode((mut s, inputs): (Schedule, String)) -> Result<Schedule> {
    s.inputs = serde_json::from_str(&inputs).map_err(|e| {
        Error::Internal(format!(
            "schedule {}: stored inputs do not parse: {e}",
            s.schedule_id
        ))
    })?;
    Ok(s)
}

/// [`decode`] for reading a schedule back (get, list): stored inputs that
/// do not parse leave `inputs` empty and say why in `last_error` (unless
/// it already says, as the firing that paused it does), so one damaged
/// row neither hides itself nor fails a listing of the others.
fn decode_view(row: (Schedule, String)) -> Schedule {
    let s = row.0.clone();
    decode(row).unwrap_or_else(|e| Schedule {
        inputs: Vec::new(),
        last_error: if s.last_error.is_empty() {
            e.to_string()
        } else {
            s.last_error.clone()
        },
        ..s
    })
}

/// Stores a validated schedule with its first tick `next_run_ms`.
/// Returns false (and changes nothing) when the id is taken.
///
/// Errors: [`Error::Storage`], `Internal` if the inputs cannot be written.
pub fn insert(conn: &Connection, s: &Schedule, next_run_ms: i64) -> Result<bool> {
    let inputs = serde_json::to_string(&s.inputs).map_err(|e| Error::Internal(e.to_string()))?;
    let n = conn
        .prepare_cached(&format!(
            "INSERT OR IGNORE INTO schedules ({COLUMNS})
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, NULL, '', 0, '', ?13)"
        ))?
        .execute(params![
            s.schedule_id,
            s.plan_id,
            s.cron,
            s.time_zone,
            inputs,
            s.max_attempts,
            s.scheduling.priority,
            s.scheduling.worker_selector,
            s.scheduling.concurrency_key,
            s.scheduling.max_running,
            catch_up_code(s.catch_up),
            next_run_ms,
            s.created_at_ms,
        ])?;
    Ok(n == 1)
}

/// The schedule `id`, if stored (with empty inputs when the stored ones
/// do not parse: see [`decode_view`]).
///
/// Errors: [`Error::Storage`], including a row whose values do not read.
pub fn get(conn: &Connection, id: &str) -> Result<Option<Schedule>> {
    Ok(conn
        .prepare_cached(&format!(
            "SELECT {COLUMNS} FROM schedules WHERE schedule_id = ?1"
        ))?
        .query_row([id], from_row)
        .optional()?
        .map(decode_view))
}

/// Whether schedule `id` exists.
///
/// Errors: storage errors.
pub fn exists(conn: &Connection, id: &str) -> Result<bool> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM schedules WHERE schedule_id = ?1")?
        .exists([id])?)
}

/// Up to `limit` schedules with ids after `after` (all when `None`), by id
/// (with empty inputs where the stored ones do not parse: see
/// [`decode_view`]).
///
/// Errors: [`Error::Storage`], including a row whose values do not read.
pub fn list(conn: &Connection, after: Option<&str>, limit: usize) -> Result<Vec<Schedule>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM schedules WHERE schedule_id > ?1 ORDER BY schedule_id LIMIT ?2"
    ))?;
    let rows = stmt.query_map(params![after.unwrap_or(""), limit as i64], from_row)?;
    rows.map(|r| Ok(decode_view(r?))).collect()
}

/// Schedules whose next tick is at or before `now_ms`, soonest first.
/// Each is the schedule, or its row's `rowid` and why the row cannot be
/// used (a value the current code cannot read), so one unusable row does
/// not hide the others ([`pause_unusable`] pauses it).
///
/// Errors: [`Error::Storage`].
pub fn due(
    conn: &Connection,
    now_ms: i64,
) -> Result<Vec<std::result::Result<Schedule, (i64, Error)>>> {
    let rowids = conn
        .prepare_cached(
            "SELECT rowid FROM schedules WHERE next_run_ms IS NOT NULL AND next_run_ms <= ?1
             ORDER BY next_run_ms",
        )?
        .query_map([now_ms], |r| r.get::<_, i64>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut stmt =
        conn.prepare_cached(&format!("SELECT {COLUMNS} FROM schedules WHERE rowid = ?1"))?;
    let mut due = Vec::with_capacity(rowids.len());
    for rowid in rowids {
        let mut rows = stmt.query([rowid])?;
        // Errors reading the row are storage errors; errors converting its
        // values are the row's own.
        let Some(row) = rows.next()? else {
            continue;
        };
        let s = from_row(row)
            .map_err(|e| {
                Error::Internal(format!(
                    "schedule row {rowid}: stored values do not read: {e}"
                ))
            })
            .and_then(decode);
        due.push(s.map_err(|e| (rowid, e)));
    }
    Ok(due)
}

/// Pauses the schedule stored at `rowid`, whose row cannot be used, with
/// `error` as its `last_error`.
///
/// Errors: [`Error::Storage`].
pub fn pause_unusable(conn: &Connection, rowid: i64, error: &str) -> Result<()> {
    conn.prepare_cached(
        "UPDATE schedules SET next_run_ms = NULL, last_error = ?2 WHERE rowid = ?1",
    )?
    .execute(params![rowid, error])?;
    Ok(())
}

/// The soonest next tick of any active schedule, ms.
///
/// Errors: [`Error::Storage`].
pub fn next_due(conn: &Connection) -> Result<Option<i64>> {
    Ok(conn
        .prepare_cached("SELECT min(next_run_ms) FROM schedules WHERE next_run_ms IS NOT NULL")?
        .query_row([], |r| r.get(0))?)
}

/// What one firing of a schedule records.
#[derive(Debug, Clone)]
pub struct Fired<'a> {
    /// The next tick after the ones fired.
    pub next_run_ms: Option<i64>,
    /// The tick of the last action submitted, when one was.
    pub last_run_ms: Option<i64>,
    /// Its action id, when one was submitted.
    pub last_action_id: Option<&'a str>,
    /// Actions submitted by this firing.
    pub runs: u64,
    /// Why ticks submitted nothing or were dropped; empty when all fired.
    pub error: &'a str,
}

/// Records a firing of schedule `id`.
///
/// Errors: [`Error::Storage`].
pub fn record_firing(conn: &Connection, id: &str, f: &Fired<'_>) -> Result<()> {
    conn.prepare_cached(
        "UPDATE schedules SET next_run_ms = ?2, last_run_ms = coalesce(?3, last_run_ms),
                last_action_id = coalesce(?4, last_action_id), runs = runs + ?5, last_error = ?6
         WHERE schedule_id = ?1",
    )?
    .execute(params![
        id,
        f.next_run_ms,
        f.last_run_ms,
        f.last_action_id,
        f.runs as i64,
        f.error
    ])?;
    Ok(())
}

/// Sets the next tick of schedule `id` (`None`: paused). Returns false
/// when there is no such schedule.
///
/// Errors: [`Error::Storage`].
pub fn set_next_run(conn: &Connection, id: &str, next_run_ms: Option<i64>) -> Result<bool> {
    let n = conn
        .prepare_cached("UPDATE schedules SET next_run_ms = ?2 WHERE schedule_id = ?1")?
        .execute(params![id, next_run_ms])?;
    Ok(n == 1)
}

/// Deletes schedule `id`. Returns false when there is none.
///
/// Errors: [`Error::Storage`].
pub fn delete(conn: &Connection, id: &str) -> Result<bool> {
    let n = conn
        .prepare_cached("DELETE FROM schedules WHERE schedule_id = ?1")?
        .execute([id])?;
    Ok(n == 1)
}
