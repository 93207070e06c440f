//! Rows of the PostgreSQL schema to AGQ's domain types and back.

use std::collections::HashMap;

use deadpool_postgres::GenericClient;
use prost::Message;
use tokio_postgres::Row;

use super::db_err;
use crate::{
    core::{
        model::{
            ActionStatus, AgenticUnit, Job, JobStatus, Plan, Scheduling, Verification, Worker,
            WorkerCapabilities, WorkerState, WorkerStats,
        },
        validate,
    },
    error::{Error, Result},
    pb,
    store::sqlite::sql::jobs::decode_task_results,
};

/// The columns [`job`] reads, in its order (table alias `j`).
pub const JOB_COLS: &str = "j.job_id, j.action_id, j.plan_id, j.plan_version, j.status, j.input,
    j.attempt, j.max_attempts, j.created_at_ms, j.started_at_ms, j.completed_at_ms, j.worker_id,
    j.error, j.current_task, j.progress_percent, j.ready_at_ms, j.priority, j.task_results,
    j.id, agq_now_ms()";

/// A job status as stored.
pub fn status(v: i16) -> Result<JobStatus> {
    JobStatus::from_i32(i32::from(v))
        .ok_or_else(|| Error::Internal(format!("unknown job status {v} in the database")))
}

/// Reads a count or small number column stored as integer into `u32`.
fn u32_at(r: &Row, i: usize) -> u32 {
    u32::try_from(r.get::<_, i32>(i)).unwrap_or(0)
}

/// The job in a row selected with [`JOB_COLS`] (task results decoded).
///
/// Errors: `Internal` for an undecodable row.
pub fn job(r: &Row) -> Result<Job> {
    let status = status(r.get(4))?;
    let input: String = r.get(5);
    let input: HashMap<String, String> = serde_json::from_str(&input)
        .map_err(|e| Error::Internal(format!("stored input is not valid: {e}")))?;
    let ready_at: i64 = r.get(15);
    let now: i64 = r.get(19);
    let waiting = matches!(status, JobStatus::Pending | JobStatus::Failed);
    Ok(Job {
        job_id: r.get(0),
        action_id: r.get(1),
        plan_id: r.get(2),
        plan_version: u32_at(r, 3),
        status,
        input,
        attempt: u32_at(r, 6),
        max_attempts: u32_at(r, 7),
        created_at_ms: r.get(8),
        started_at_ms: r.get(9),
        completed_at_ms: r.get(10),
        worker_id: r.get::<_, Option<String>>(11).unwrap_or_default(),
        task_results: decode_task_results(r.get(17))?,
        error: r.get(12),
        waiting_reason: String::new(),
        current_task: u32_at(r, 13),
        progress_percent: u32_at(r, 14),
        ready_at_ms: (waiting && ready_at > now).then_some(ready_at),
        priority: r.get(16),
    })
}

/// A plan as stored in `plan_versions.body`.
pub fn encode_plan(plan: &Plan) -> Vec<u8> {
    pb::Plan::from(plan).encode_to_vec()
}

/// The plan in a stored body, with its version from the row.
///
/// Errors: `Internal` when the body does not decode.
pub fn decode_plan(body: &[u8], version: i32) -> Result<Plan> {
    pb::Plan::decode(body)
        .map(|p| Plan {
            version: u32::try_from(version).unwrap_or(0),
            ..Plan::from(p)
        })
        .map_err(|e| Error::Internal(format!("stored plan does not decode: {e}")))
}

/// Inserts version `plan.version` of a plan into `plan_versions`.
///
/// Errors: storage errors.
pub async fn insert_plan_version(c: &impl GenericClient, plan: &Plan, now_ms: i64) -> Result<()> {
    let tools = validate::plan_tools(plan);
    c.execute(
        "INSERT INTO plan_versions (plan_id, version, description, body, task_count, tools,
             require_sandbox, require_verified, created_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &[
            &plan.plan_id,
            &(plan.version as i32),
            &plan.plan_description,
            &encode_plan(plan),
            &(plan.tasks.len() as i32),
            &tools,
            &plan.require_sandbox,
            &plan.require_verified_tools,
            &now_ms,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

/// Version `version` of plan `plan_id`, if stored.
///
/// Errors: storage errors, `Internal` for an undecodable body.
pub async fn get_plan_version(
    c: &impl GenericClient,
    plan_id: &str,
    version: u32,
) -> Result<Option<Plan>> {
    let row = c
        .query_opt(
            "SELECT body FROM plan_versions WHERE plan_id = $1 AND version = $2",
            &[&plan_id, &(version as i32)],
        )
        .await
        .map_err(db_err)?;
    row.map(|r| decode_plan(r.get(0), version as i32))
        .transpose()
}

/// SQL of a stored plan version's stamp, for a row `pv` of
/// `plan_versions`: the id of the transaction that inserted it. Rows are
/// never updated, so a different stamp means the version was deleted and
/// stored again (a plan id used again after DeletePlan starts at version 1).
pub const PLAN_STAMP: &str = "pv.xmin::text";

/// [`get_plan_version`] with the row's [`PLAN_STAMP`].
///
/// Errors: storage errors, `Internal` for an undecodable body.
pub async fn get_plan_version_stamped(
    c: &impl GenericClient,
    plan_id: &str,
    version: u32,
) -> Result<Option<(Plan, String)>> {
    let row = c
        .query_opt(
            &format!(
                "SELECT pv.body, {PLAN_STAMP} FROM plan_versions pv
                 WHERE pv.plan_id = $1 AND pv.version = $2"
            ),
            &[&plan_id, &(version as i32)],
        )
        .await
        .map_err(db_err)?;
    row.map(|r| Ok((decode_plan(r.get(0), version as i32)?, r.get(1))))
        .transpose()
}

/// The latest version of plan `plan_id`, if it exists.
///
/// Errors: storage errors, `Internal` for an undecodable body.
pub async fn get_latest_plan(c: &impl GenericClient, plan_id: &str) -> Result<Option<Plan>> {
    let row = c
        .query_opt(
            "SELECT v.body, v.version FROM plans p
             JOIN plan_versions v ON v.plan_id = p.plan_id AND v.version = p.version
             WHERE p.plan_id = $1",
            &[&plan_id],
        )
        .await
        .map_err(db_err)?;
    row.map(|r| decode_plan(r.get(0), r.get(1))).transpose()
}

/// The aggregate status of action `action_id`, if it exists.
///
/// Errors: storage errors.
pub async fn action_status(
    c: &impl GenericClient,
    action_id: &str,
) -> Result<Option<ActionStatus>> {
    let Some(r) = c
        .query_opt(
            "SELECT a.plan_id, a.plan_version, a.total_jobs, a.created_at_ms, a.priority,
                    a.worker_selector, a.concurrency_key, a.max_running,
                    count(*) FILTER (WHERE j.status = 1), count(*) FILTER (WHERE j.status = 2),
                    count(*) FILTER (WHERE j.status = 3), count(*) FILTER (WHERE j.status = 4),
                    count(*) FILTER (WHERE j.status = 5), count(*) FILTER (WHERE j.status = 6),
                    max(j.completed_at_ms) FILTER (WHERE j.status IN (3, 5, 6))
             FROM actions a LEFT JOIN jobs j ON j.action_id = a.action_id
             WHERE a.action_id = $1
             GROUP BY a.action_id",
            &[&action_id],
        )
        .await
        .map_err(db_err)?
    else {
        return Ok(None);
    };
    let n = |i: usize| u32::try_from(r.get::<_, i64>(i)).unwrap_or(u32::MAX);
    let total = u32_at(&r, 2);
    let (pending, running, completed, failed, dead, cancelled) =
        (n(8), n(9), n(10), n(11), n(12), n(13));
    let finished = completed + dead + cancelled;
    Ok(Some(ActionStatus {
        action_id: action_id.to_string(),
        plan_id: r.get(0),
        plan_version: u32_at(&r, 1),
        total_jobs: total,
        pending,
        running,
        completed,
        failed,
        dead,
        cancelled,
        created_at_ms: r.get(3),
        completed_jobs_at_ms: if total > 0 && finished == total {
            r.get(14)
        } else {
            None
        },
        scheduling: Scheduling {
            priority: r.get(4),
            worker_selector: r.get(5),
            concurrency_key: r.get(6),
            max_running: u32_at(&r, 7),
        },
    }))
}

/// The columns [`worker`] reads, in its order (table alias `w`).
pub const WORKER_COLS: &str =
    "w.worker_id, w.hostname, w.platform, w.agw_version, w.units, w.tools,
    w.tags, w.max_concurrent_jobs, w.state, w.registered_at_ms, w.last_heartbeat_at_ms, w.stats,
    w.instance_id, w.sandboxed, w.quarantine_reason, w.heartbeat_open, w.lease_stream_open,
    (SELECT count(*) FROM jobs r WHERE r.status = 2 AND r.worker_id = w.worker_id),
    agq_now_ms()";

/// The worker in a row selected with [`WORKER_COLS`]; `stale_ms` is the
/// heartbeat age past which it is not fresh.
///
/// Errors: `Internal` for an undecodable row.
pub fn worker(r: &Row, stale_ms: i64) -> Result<Worker> {
    let id: String = r.get(0);
    let bad = |e: serde_json::Error| Error::Internal(format!("worker {id}: {e}"));
    let units: Vec<AgenticUnit> = serde_json::from_str(r.get(4)).map_err(bad)?;
    let tags: HashMap<String, String> = serde_json::from_str(r.get(6)).map_err(bad)?;
    let state = WorkerState::from_i32(i32::from(r.get::<_, i16>(8))).unwrap_or(WorkerState::Dead);
    let last: i64 = r.get(10);
    let now: i64 = r.get(18);
    let stats: Option<Vec<u8>> = r.get(11);
    let mut tools: Vec<String> = r.get(5);
    // The tools column holds every command; the advertised tools are those
    // that are not agentic units.
    tools.retain(|t| !units.iter().any(|u| &u.name == t));
    Ok(Worker {
        hostname: r.get(1),
        platform: r.get(2),
        agw_version: r.get(3),
        capabilities: WorkerCapabilities {
            tools,
            agentic_units: units.iter().map(|u| u.name.clone()).collect(),
            units,
        },
        max_concurrent_jobs: u32_at(r, 7),
        tags,
        state,
        fresh: state.is_live() && now - last < stale_ms,
        last_heartbeat_at_ms: last,
        stats: stats
            .and_then(|b| pb::WorkerStats::decode(b.as_slice()).ok())
            .map(WorkerStats::from)
            .unwrap_or_default(),
        active_leases: u32::try_from(r.get::<_, i64>(17)).unwrap_or(u32::MAX),
        connected: r.get::<_, bool>(15) && r.get::<_, bool>(16),
        registered_at_ms: r.get(9),
        instance_id: r.get(12),
        sandboxed: r.get(13),
        quarantine_reason: r.get(14),
        verifications: Vec::new(),
        worker_id: id,
    })
}

/// The verifications of workers `ids`, by worker.
///
/// Errors: storage errors, `Internal` for undecodable arguments.
pub async fn verifications(
    c: &impl GenericClient,
    ids: &[String],
) -> Result<HashMap<String, Vec<Verification>>> {
    let rows = c
        .query(
            "SELECT worker_id, tool, args, challenge_id, requested_at_ms, answered_at_ms, passed,
                    exit_code, output, error
             FROM worker_verifications WHERE worker_id = ANY($1) ORDER BY worker_id, tool",
            &[&ids],
        )
        .await
        .map_err(db_err)?;
    let pending = c
        .query(
            "SELECT worker_id, tool, args, challenge_id, requested_at_ms, NULL::bigint, false, -1,
                    '', ''
             FROM worker_challenges WHERE worker_id = ANY($1) ORDER BY worker_id, tool",
            &[&ids],
        )
        .await
        .map_err(db_err)?;
    let mut out: HashMap<String, Vec<Verification>> = HashMap::new();
    for r in rows.into_iter().chain(pending) {
        let args: Vec<String> = serde_json::from_str(r.get(2))
            .map_err(|e| Error::Internal(format!("stored verification arguments: {e}")))?;
        out.entry(r.get(0)).or_default().push(Verification {
            tool: r.get(1),
            args,
            challenge_id: r.get(3),
            requested_at_ms: r.get(4),
            answered_at_ms: r.get(5),
            passed: r.get(6),
            exit_code: r.get(7),
            output: r.get(8),
            error: r.get(9),
        });
    }
    for v in out.values_mut() {
        v.sort_by(|a, b| a.tool.cmp(&b.tool));
    }
    Ok(out)
}

/// Encodes worker stats for the `stats` column.
pub fn encode_stats(stats: &WorkerStats) -> Vec<u8> {
    pb::WorkerStats::from(*stats).encode_to_vec()
}
