//! Plans table: store, fetch, list, delete.

use prost::Message;
use rusqlite::{params, Connection, OptionalExtension};

use crate::{core::model::Plan, error::Result, pb};

/// Inserts `plan`. Returns false (and changes nothing) when the id exists.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn insert(conn: &Connection, plan: &Plan, now_ms: i64) -> Result<bool> {
    let n = conn
        .prepare_cached(
            "INSERT OR IGNORE INTO plans (plan_id, description, body, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
        )?
        .execute(params![plan.plan_id, plan.plan_description, pb::Plan::from(plan).encode_to_vec(), now_ms])?;
    Ok(n == 1)
}

/// The plan `plan_id`, if stored.
///
/// Errors: [`crate::error::Error::Storage`], also for an undecodable row.
pub fn get(conn: &Connection, plan_id: &str) -> Result<Option<Plan>> {
    let body: Option<Vec<u8>> = conn
        .prepare_cached("SELECT body FROM plans WHERE plan_id = ?1")?
        .query_row([plan_id], |r| r.get(0))
        .optional()?;
    body.map(|b| decode(&b)).transpose()
}

fn decode(body: &[u8]) -> Result<Plan> {
    pb::Plan::decode(body)
        .map(Plan::from)
        .map_err(|e| crate::error::Error::Internal(format!("stored plan does not decode: {e}")))
}

/// Every stored plan, for rebuilding the in-memory plan cache.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn load_all(conn: &Connection) -> Result<Vec<Plan>> {
    let mut stmt = conn.prepare("SELECT body FROM plans")?;
    let rows = stmt.query_map([], |r| r.get::<_, Vec<u8>>(0))?;
    let mut out = Vec::new();
    for body in rows {
        out.push(decode(&body?)?);
    }
    Ok(out)
}

/// Plan ids after `after` (exclusive) in id order, at most `limit`,
/// matching `pattern` when given. The pattern is matched by the `glob`
/// crate, the same engine that validated it, so there is one dialect (see
/// `ListPlansRequest.pattern`). Rows are read in id order from the literal
/// prefix of the pattern (the text before its first `*`, `?` or `[`) and
/// stop once past it.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn list(
    conn: &Connection,
    pattern: Option<&glob::Pattern>,
    after: &str,
    limit: usize,
) -> Result<Vec<String>> {
    let prefix: String = pattern
        .map(|p| {
            p.as_str()
                .chars()
                .take_while(|c| !matches!(c, '*' | '?' | '['))
                .collect()
        })
        .unwrap_or_default();
    let start = if prefix.as_str() > after {
        prefix.as_str()
    } else {
        after
    };
    let inclusive = prefix.as_str() > after;
    let mut stmt = conn.prepare_cached(
        "SELECT plan_id FROM plans WHERE plan_id > ?1 OR (?2 AND plan_id = ?1) ORDER BY plan_id",
    )?;
    let mut rows = stmt.query(params![start, inclusive])?;
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(row) = rows.next()? else { break };
        let id: String = row.get(0)?;
        if !id.starts_with(&prefix) {
            break;
        }
        if pattern.is_none_or(|p| p.matches(&id)) {
            out.push(id);
        }
    }
    Ok(out)
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
