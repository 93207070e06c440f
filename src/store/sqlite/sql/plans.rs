//! Plans and their versions: store, fetch, list, delete. The `plans` row
//! is the head of an id (its latest version, see migration 0009);
//! `plan_versions` holds every version, the latest included.

use prost::Message;
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::{
    core::model::{Plan, PlanSummary, PlanVersion},
    error::Result,
    pb,
};

/// Stores `plan` as version 1 of a new id (its `version` must be 1).
/// Returns false (and changes nothing) when the id exists.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn insert(conn: &Connection, plan: &Plan, now_ms: i64) -> Result<bool> {
    let body = pb::Plan::from(plan).encode_to_vec();
    let n = conn
        .prepare_cached(
            "INSERT OR IGNORE INTO plans (plan_id, description, body, created_at_ms, version, updated_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?4)",
        )?
        .execute(params![plan.plan_id, plan.plan_description, body, now_ms, plan.version])?;
    if n == 1 {
        insert_version(conn, plan, &body, now_ms)?;
    }
    Ok(n == 1)
}

/// Stores `plan` as the new latest version of its existing id
/// (`plan.version`, one more than the latest). Returns false (and changes
/// nothing) when the id does not exist.
///
/// Errors: [`crate::error::Error::Storage`] (also when the version is
/// already stored).
pub fn add_version(conn: &Connection, plan: &Plan, now_ms: i64) -> Result<bool> {
    let body = pb::Plan::from(plan).encode_to_vec();
    let n = conn
        .prepare_cached(
            "UPDATE plans SET description = ?2, body = ?3, version = ?4, updated_at_ms = ?5
             WHERE plan_id = ?1",
        )?
        .execute(params![
            plan.plan_id,
            plan.plan_description,
            body,
            plan.version,
            now_ms
        ])?;
    if n == 1 {
        insert_version(conn, plan, &body, now_ms)?;
    }
    Ok(n == 1)
}

fn insert_version(conn: &Connection, plan: &Plan, body: &[u8], now_ms: i64) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO plan_versions (plan_id, version, description, body, created_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![
        plan.plan_id,
        plan.version,
        plan.plan_description,
        body,
        now_ms
    ])?;
    Ok(())
}

/// The latest version of plan `plan_id`, if stored.
///
/// Errors: [`crate::error::Error::Storage`], also for an undecodable row.
pub fn get(conn: &Connection, plan_id: &str) -> Result<Option<Plan>> {
    let found: Option<(Vec<u8>, u32)> = conn
        .prepare_cached("SELECT body, version FROM plans WHERE plan_id = ?1")?
        .query_row([plan_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    found.map(|(b, v)| decode(&b, v)).transpose()
}

/// Version `version` of plan `plan_id`, if stored.
///
/// Errors: [`crate::error::Error::Storage`], also for an undecodable row.
pub fn get_version(conn: &Connection, plan_id: &str, version: u32) -> Result<Option<Plan>> {
    let body: Option<Vec<u8>> = conn
        .prepare_cached("SELECT body FROM plan_versions WHERE plan_id = ?1 AND version = ?2")?
        .query_row(params![plan_id, version], |r| r.get(0))
        .optional()?;
    body.map(|b| decode(&b, version)).transpose()
}

/// The latest version number of plan `plan_id`; `None` when there is no
/// such plan.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn latest_version(conn: &Connection, plan_id: &str) -> Result<Option<u32>> {
    Ok(conn
        .prepare_cached("SELECT version FROM plans WHERE plan_id = ?1")?
        .query_row([plan_id], |r| r.get(0))
        .optional()?)
}

/// The plan in a stored body, with its version from the row (bodies
/// stored before version 9 of the schema carry none).
fn decode(body: &[u8], version: u32) -> Result<Plan> {
    pb::Plan::decode(body)
        .map(|p| Plan {
            version,
            ..Plan::from(p)
        })
        .map_err(|e| crate::error::Error::Internal(format!("stored plan does not decode: {e}")))
}

/// The latest version of every stored plan, for rebuilding the in-memory
/// plan cache.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn load_all(conn: &Connection) -> Result<Vec<Plan>> {
    let mut stmt = conn.prepare("SELECT body, version FROM plans")?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, u32>(1)?)))?;
    let mut out = Vec::new();
    for row in rows {
        let (body, version) = row?;
        out.push(decode(&body, version)?);
    }
    Ok(out)
}

/// Up to `limit` versions of plan `plan_id` older than `before`, newest
/// first.
///
/// Errors: [`crate::error::Error::Storage`], also for an undecodable row.
pub fn versions(
    conn: &Connection,
    plan_id: &str,
    before: i64,
    limit: usize,
) -> Result<Vec<PlanVersion>> {
    let mut stmt = conn.prepare_cached(
        "SELECT version, description, body, created_at_ms FROM plan_versions
         WHERE plan_id = ?1 AND version < ?2 ORDER BY version DESC LIMIT ?3",
    )?;
    let rows = stmt.query_map(params![plan_id, before, limit as i64], |r| {
        Ok((
            r.get::<_, u32>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, Vec<u8>>(2)?,
            r.get::<_, i64>(3)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (version, plan_description, body, created_at_ms) = row?;
        let task_count = decode(&body, version)?.tasks.len() as u32;
        out.push(PlanVersion {
            version,
            plan_description,
            task_count,
            created_at_ms,
        });
    }
    Ok(out)
}

fn summary(r: &Row<'_>) -> rusqlite::Result<PlanSummary> {
    Ok(PlanSummary {
        plan_id: r.get(0)?,
        version: r.get(1)?,
        plan_description: r.get(2)?,
        created_at_ms: r.get(3)?,
        updated_at_ms: r.get(4)?,
    })
}

/// Plans with ids after `after` (exclusive) in id order, at most `limit`,
/// matching `pattern` when given, each with its latest version. The pattern is matched by the `glob`
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
) -> Result<Vec<PlanSummary>> {
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
        "SELECT plan_id, version, description, created_at_ms, updated_at_ms FROM plans
         WHERE plan_id > ?1 OR (?2 AND plan_id = ?1) ORDER BY plan_id",
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
            out.push(summary(row)?);
        }
    }
    Ok(out)
}

/// Deletes the plan with its versions, actions and their jobs (the jobs'
/// completions and rows first, by the rows of each action; the rest by
/// `ON DELETE CASCADE`). Returns false when no such plan exists.
///
/// Errors: [`crate::error::Error::Storage`].
pub fn delete(conn: &Connection, plan_id: &str) -> Result<bool> {
    conn.prepare_cached(concat!(
        "DELETE FROM job_completions WHERE job_row IN (SELECT j.id FROM actions a CROSS JOIN job_rows j ON ",
        job_of_action!(),
        " WHERE a.plan_id = ?1)"
    ))?
    .execute([plan_id])?;
    conn.prepare_cached(concat!(
        "DELETE FROM job_rows WHERE id IN (SELECT j.id FROM actions a CROSS JOIN job_rows j ON ",
        job_of_action!(),
        " WHERE a.plan_id = ?1)"
    ))?
    .execute([plan_id])?;
    let n = conn
        .prepare_cached("DELETE FROM plans WHERE plan_id = ?1")?
        .execute([plan_id])?;
    Ok(n == 1)
}
