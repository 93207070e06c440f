//! Plans table: store, fetch, list, delete.

use prost::Message;
use rusqlite::{params, Connection, OptionalExtension};

use crate::{error::Result, pb};

/// Inserts `plan`. Returns false (and changes nothing) when the id exists.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn insert(conn: &Connection, plan: &pb::Plan, now_ms: i64) -> Result<bool> {
    let n = conn
        .prepare_cached(
            "INSERT OR IGNORE INTO plans (plan_id, description, body, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
        )?
        .execute(params![plan.plan_id, plan.plan_description, plan.encode_to_vec(), now_ms])?;
    Ok(n == 1)
}

/// The plan `plan_id`, if stored.
///
/// Errors: [`crate::error::Error::Storage`], also for an undecodable row.
pub fn get(conn: &Connection, plan_id: &str) -> Result<Option<pb::Plan>> {
    let body: Option<Vec<u8>> = conn
        .prepare_cached("SELECT body FROM plans WHERE plan_id = ?1")?
        .query_row([plan_id], |r| r.get(0))
        .optional()?;
    body.map(|b| decode(&b)).transpose()
}

fn decode(body: &[u8]) -> Result<pb::Plan> {
    pb::Plan::decode(body)
        .map_err(|e| crate::error::Error::Internal(format!("stored plan does not decode: {e}")))
}

/// Every stored plan, for rebuilding the in-memory plan cache.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn load_all(conn: &Connection) -> Result<Vec<pb::Plan>> {
    let mut stmt = conn.prepare("SELECT body FROM plans")?;
    let rows = stmt.query_map([], |r| r.get::<_, Vec<u8>>(0))?;
    let mut out = Vec::new();
    for body in rows {
        out.push(decode(&body?)?);
    }
    Ok(out)
}

/// Up to `limit` plan ids after `after` (exclusive) in ascending order,
/// matching the SQLite GLOB `pattern` when given.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn list(
    conn: &Connection,
    pattern: Option<&str>,
    after: &str,
    limit: usize,
) -> Result<Vec<String>> {
    let mut stmt = conn.prepare_cached(
        "SELECT plan_id FROM plans WHERE plan_id > ?1 AND (?2 IS NULL OR plan_id GLOB ?2)
         ORDER BY plan_id LIMIT ?3",
    )?;
    let rows = stmt.query_map(params![after, pattern, limit as i64], |r| r.get(0))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Deletes the plan with its actions, jobs and task results. Returns false
/// when no such plan exists.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn delete(conn: &Connection, plan_id: &str) -> Result<bool> {
    let n = conn
        .prepare_cached("DELETE FROM plans WHERE plan_id = ?1")?
        .execute([plan_id])?;
    Ok(n == 1)
}
