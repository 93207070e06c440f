//! Workers table and its capability index.

use std::collections::HashMap;

use prost::Message;
use rusqlite::{params, Connection};

use crate::{
    core::model::{
        AgenticUnit, Verification, Worker, WorkerCapabilities, WorkerState, WorkerStats,
    },
    error::{Error, Result},
    pb,
};

/// A worker row as stored.
#[derive(Debug, Clone)]
pub struct WorkerRow {
    /// Registration metadata and last stats (freshness fields unset).
    pub worker: Worker,
    /// Registration time (ms).
    pub registered_at_ms: i64,
    /// Last flushed heartbeat time (ms).
    pub last_heartbeat_at_ms: Option<i64>,
}

/// Inserts or replaces the worker's registration and its tools.
///
/// Errors: [`Error::Storage`].
pub fn upsert(conn: &Connection, w: &Worker, now_ms: i64) -> Result<()> {
    let caps = &w.capabilities;
    // The units as they described themselves (older rows hold their names).
    let units = serde_json::to_string(&caps.units).map_err(|e| Error::Internal(e.to_string()))?;
    let tags = serde_json::to_string(&w.tags).map_err(|e| Error::Internal(e.to_string()))?;
    conn.prepare_cached(
        "INSERT INTO workers (worker_id, hostname, platform, agw_version, agentic_units, tags,
            max_concurrent_jobs, state, registered_at_ms, last_heartbeat_at_ms, stats, instance_id,
            sandboxed, quarantine_reason)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?9, NULL, ?10, ?11, ?12)
         ON CONFLICT(worker_id) DO UPDATE SET hostname = ?2, platform = ?3, agw_version = ?4,
            agentic_units = ?5, tags = ?6, max_concurrent_jobs = ?7, state = ?8,
            registered_at_ms = ?9, last_heartbeat_at_ms = ?9, stats = NULL, instance_id = ?10,
            sandboxed = ?11, quarantine_reason = ?12",
    )?
    .execute(params![
        w.worker_id,
        w.hostname,
        w.platform,
        w.agw_version,
        units,
        tags,
        w.max_concurrent_jobs,
        w.state as i32,
        now_ms,
        w.instance_id,
        w.sandboxed,
        w.quarantine_reason
    ])?;
    conn.prepare_cached("DELETE FROM worker_tools WHERE worker_id = ?1")?
        .execute([&w.worker_id])?;
    let mut stmt = conn
        .prepare_cached("INSERT OR IGNORE INTO worker_tools (tool, worker_id) VALUES (?1, ?2)")?;
    for tool in &caps.tools {
        stmt.execute(params![tool, w.worker_id])?;
    }
    Ok(())
}

/// Sets the worker's state.
///
/// Errors: [`Error::Storage`].
pub fn set_state(conn: &Connection, worker_id: &str, state: WorkerState) -> Result<()> {
    conn.prepare_cached("UPDATE workers SET state = ?2 WHERE worker_id = ?1")?
        .execute(params![worker_id, state as i32])?;
    Ok(())
}

/// Sets the worker's state and quarantine reason (empty: not quarantined)
/// in one statement.
///
/// Errors: [`Error::Storage`].
pub fn set_quarantine(
    conn: &Connection,
    worker_id: &str,
    state: WorkerState,
    reason: &str,
) -> Result<()> {
    conn.prepare_cached(
        "UPDATE workers SET state = ?2, quarantine_reason = ?3 WHERE worker_id = ?1",
    )?
    .execute(params![worker_id, state as i32, reason])?;
    Ok(())
}

/// Stores the last heartbeat time and stats (flushed in batches, not per heartbeat).
///
/// Errors: [`Error::Storage`].
pub fn flush_heartbeat(
    conn: &Connection,
    worker_id: &str,
    at_ms: i64,
    stats: &WorkerStats,
) -> Result<()> {
    conn.prepare_cached(
        "UPDATE workers SET last_heartbeat_at_ms = ?2, stats = ?3 WHERE worker_id = ?1",
    )?
    .execute(params![
        worker_id,
        at_ms,
        pb::WorkerStats::from(*stats).encode_to_vec()
    ])?;
    Ok(())
}

/// Every worker with its tools.
///
/// Errors: [`Error::Storage`], [`Error::Internal`] for an undecodable row.
pub fn load_all(conn: &Connection) -> Result<Vec<WorkerRow>> {
    let mut tools: HashMap<String, Vec<String>> = HashMap::new();
    {
        let mut stmt =
            conn.prepare("SELECT worker_id, tool FROM worker_tools ORDER BY worker_id, tool")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        for row in rows {
            let (w, t) = row?;
            tools.entry(w).or_default().push(t);
        }
    }
    let mut stmt = conn.prepare(
        "SELECT worker_id, hostname, platform, agw_version, agentic_units, tags, max_concurrent_jobs, state,
                registered_at_ms, last_heartbeat_at_ms, stats, instance_id, sandboxed,
                quarantine_reason
         FROM workers ORDER BY worker_id",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, String>(3)?,
            r.get::<_, String>(4)?,
            r.get::<_, String>(5)?,
            r.get::<_, u32>(6)?,
            r.get::<_, i32>(7)?,
            r.get::<_, i64>(8)?,
            r.get::<_, Option<i64>>(9)?,
            r.get::<_, Option<Vec<u8>>>(10)?,
            r.get::<_, String>(11)?,
            r.get::<_, bool>(12)?,
            r.get::<_, String>(13)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (
            id,
            hostname,
            platform,
            agw_version,
            units,
            tags,
            max,
            state,
            reg,
            hb,
            stats,
            instance,
            sandboxed,
            quarantine_reason,
        ) = row?;
        let bad = |e: serde_json::Error| Error::Internal(format!("worker {id}: {e}"));
        let units: Vec<AgenticUnit> = match serde_json::from_str(&units) {
            Ok(u) => u,
            // Rows of schema 11 and older: the names alone.
            Err(_) => serde_json::from_str::<Vec<String>>(&units)
                .map_err(bad)?
                .into_iter()
                .map(|name| AgenticUnit {
                    name,
                    ..Default::default()
                })
                .collect(),
        };
        let worker = Worker {
            capabilities: WorkerCapabilities {
                tools: tools.remove(&id).unwrap_or_default(),
                agentic_units: units.iter().map(|u| u.name.clone()).collect(),
                units,
            },
            tags: serde_json::from_str(&tags).map_err(bad)?,
            hostname,
            platform,
            agw_version,
            max_concurrent_jobs: max,
            // A state this binary does not know is treated as gone.
            state: WorkerState::from_i32(state).unwrap_or(WorkerState::Dead),
            fresh: false,
            last_heartbeat_at_ms: hb.unwrap_or(reg),
            stats: stats
                .and_then(|b| pb::WorkerStats::decode(b.as_slice()).ok())
                .map(WorkerStats::from)
                .unwrap_or_default(),
            active_leases: 0,
            connected: false,
            registered_at_ms: reg,
            worker_id: id,
            instance_id: instance,
            sandboxed,
            quarantine_reason,
            verifications: Vec::new(),
        };
        out.push(WorkerRow {
            worker,
            registered_at_ms: reg,
            last_heartbeat_at_ms: hb,
        });
    }
    Ok(out)
}

/// Deletes a worker row and its tools.
///
/// Errors: [`Error::Storage`].
pub fn delete(conn: &Connection, worker_id: &str) -> Result<()> {
    conn.prepare_cached("DELETE FROM workers WHERE worker_id = ?1")?
        .execute([worker_id])?;
    Ok(())
}

/// Stores the answered verification `v` of worker `worker_id` (replacing
/// the one of the same tool).
///
/// Errors: [`Error::Storage`], `Internal` if the arguments cannot be written.
pub fn put_verification(conn: &Connection, worker_id: &str, v: &Verification) -> Result<()> {
    let args = serde_json::to_string(&v.args).map_err(|e| Error::Internal(e.to_string()))?;
    conn.prepare_cached(
        "INSERT OR REPLACE INTO worker_verifications (worker_id, tool, args, challenge_id,
            requested_at_ms, answered_at_ms, passed, exit_code, output, error)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )?
    .execute(params![
        worker_id,
        v.tool,
        args,
        v.challenge_id,
        v.requested_at_ms,
        v.answered_at_ms,
        v.passed,
        v.exit_code,
        v.output,
        v.error
    ])?;
    Ok(())
}

/// Deletes every verification of worker `worker_id` (it registered as a
/// new process).
///
/// Errors: [`Error::Storage`].
pub fn clear_verifications(conn: &Connection, worker_id: &str) -> Result<()> {
    conn.prepare_cached("DELETE FROM worker_verifications WHERE worker_id = ?1")?
        .execute([worker_id])?;
    Ok(())
}

/// Every stored verification, by worker id.
///
/// Errors: [`Error::Storage`], `Internal` for undecodable arguments.
pub fn load_verifications(conn: &Connection) -> Result<HashMap<String, Vec<Verification>>> {
    let mut stmt = conn.prepare(
        "SELECT worker_id, tool, args, challenge_id, requested_at_ms, answered_at_ms, passed,
                exit_code, output, error
         FROM worker_verifications ORDER BY worker_id, tool",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(2)?,
            Verification {
                tool: r.get(1)?,
                args: Vec::new(),
                challenge_id: r.get(3)?,
                requested_at_ms: r.get(4)?,
                answered_at_ms: r.get(5)?,
                passed: r.get(6)?,
                exit_code: r.get(7)?,
                output: r.get(8)?,
                error: r.get(9)?,
            },
        ))
    })?;
    let mut out: HashMap<String, Vec<Verification>> = HashMap::new();
    for row in rows {
        let (worker, args, mut v) = row?;
        v.args = serde_json::from_str(&args)
            .map_err(|e| Error::Internal(format!("verification of {worker}: {e}")))?;
        out.entry(worker).or_default().push(v);
    }
    Ok(out)
}
