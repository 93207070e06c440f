//! The job state machine of the PostgreSQL engine: plans (with versions),
//! actions fanned out into jobs, fenced reports, cancel and retry. Every
//! operation is one transaction whose statements re-check the state they
//! change (a report is fenced by `lease_id`, `worker_id` and
//! `status = running`), so replicas need no coordination beyond row locks.
//!
//! # Lock order of job rows
//!
//! A transaction that locks (`FOR UPDATE`, or by updating) more than one
//! row of `jobs` and may wait for them locks them in one global order: row
//! id (`jobs.id`) ascending. Two transactions that both follow it never
//! wait on each other in a circle; one that locked in another order (the
//! order its reports arrived, or a join's scan order) could deadlock with
//! one that did not, and PostgreSQL would abort one of them (40P01, which
//! the client sees as UNAVAILABLE). So:
//! - a statement over several jobs locks them first with a locking
//!   `SELECT … ORDER BY id FOR UPDATE` (in a CTE; the `UPDATE` after it
//!   then takes only locks its transaction holds): cancels
//!   (`cancel_open`), retries (`retry_rows`, RetryAction's listing) and the
//!   group commit of completions (`completions.rs`). An
//!   `UPDATE … WHERE id = ANY($1)` or `UPDATE … FROM unnest(…)` alone
//!   locks in scan or join order, not by id, whatever the array's order;
//! - a loop that ends several attempts one statement each (a worker's
//!   leases lost at a takeover, a dropped stream or staleness) takes them
//!   in id order (`running_on` lists them by id);
//! - a single report or cancel locks one job row;
//! - `FOR UPDATE SKIP LOCKED` claims (the dispatcher, backoff promotion,
//!   lease expiry) never wait for a job row, so they may lock in any
//!   order; what they update next is only what they locked. The
//!   dispatcher and lease expiry first lock the workers concerned, in
//!   worker id order, and wait for those rows only.
//!
//! Rows of other tables are locked before job rows (plan, action, then
//! jobs; a worker's row before its jobs), never after, with one exception:
//! a retry share-locks the worker selectors of the jobs it made pending
//! ([`keep_selectors`]) after locking them. No transaction waits for a job
//! row while it holds a selector's row (a submit locks its selector and
//! then inserts new jobs; the leader's drop of unused selectors reads the
//! jobs without locking them), so this cannot close a circle.

use deadpool_postgres::{GenericClient, Transaction};

use super::{cached, db_err, notify_names, rows, PgEngine, COMMAND_CHANNEL, READY_CHANNEL};
use crate::{
    core::{
        engine::{ActionQuery, ActionState, JobQuery, Page, PlanQuery, PlanVersionQuery},
        model::{
            ActionStatus, Job, JobReport, JobStatus, Plan, PlanSummary, PlanVersion, SubmittedPlan,
            WorkerCommand,
        },
        page,
        validate::{self, ValidAction},
    },
    error::{Error, Result},
    store::sqlite::sql::jobs::encode_task_results,
};

/// Stores the worker selectors `selectors` for the dispatchers (the
/// empty one is always there) and share-locks their rows (`FOR KEY
/// SHARE`) to the commit of `tx`, which makes jobs with them open: the
/// leader drops the selectors no open job uses
/// (`maintenance::drop_unused_selectors`), locking each before it checks
/// again, so it skips one locked here, and one it holds is locked here only
/// once it is dropped or kept, and stored again when dropped. Concurrent
/// transactions with the same selector do not wait for each other.
///
/// Errors: storage errors; `StoreBusy` when the rows keep being dropped
/// under it (never, short of a leader dropping them in a loop).
async fn keep_selectors(tx: &Transaction<'_>, selectors: &[String]) -> Result<()> {
    let mut wanted: Vec<&str> = selectors
        .iter()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    if wanted.is_empty() {
        return Ok(());
    }
    let insert = cached(
        tx,
        "INSERT INTO selectors (selector) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING",
    )
    .await?;
    let hold = cached(
        tx,
        "SELECT count(*) FROM (SELECT 1 FROM selectors WHERE selector = ANY($1)
                               ORDER BY selector FOR KEY SHARE) t",
    )
    .await?;
    for _ in 0..10 {
        tx.execute(&insert, &[&wanted]).await.map_err(db_err)?;
        let held: i64 = tx
            .query_one(&hold, &[&wanted])
            .await
            .map_err(db_err)?
            .get(0);
        // Fewer: one was dropped between the two statements; stored again.
        if held == wanted.len() as i64 {
            return Ok(());
        }
    }
    Err(Error::StoreBusy(
        "the worker selectors of this change kept being dropped; retry".into(),
    ))
}

/// Job status numbers as stored.
pub(super) const RUNNING: i16 = JobStatus::Running as i16;
pub(super) const FAILED: i16 = JobStatus::Failed as i16;
pub(super) const DEAD: i16 = JobStatus::Dead as i16;

/// Queues `command` for worker `worker_id` (delivered by the replica that
/// holds its heartbeat stream, after the commit).
///
/// Errors: storage errors.
pub(super) async fn queue_command(
    c: &impl GenericClient,
    worker_id: &str,
    command: &WorkerCommand,
) -> Result<()> {
    c.execute(
        "INSERT INTO worker_commands (worker_id, command, created_at_ms) VALUES ($1, $2, agq_now_ms())",
        &[&worker_id, &super::workers::encode_command(command)],
    )
    .await
    .map_err(db_err)?;
    notify_names(c, COMMAND_CHANNEL, &[worker_id.to_string()]).await
}

/// The running jobs of worker `worker_id`: (row id, lease id), by row id.
///
/// Errors: storage errors.
pub(super) async fn running_on(
    c: &impl GenericClient,
    worker_id: &str,
) -> Result<Vec<(i64, String)>> {
    Ok(c.query(
        "SELECT id, lease_id FROM jobs
             WHERE status = 2 AND worker_id = $1 AND lease_id IS NOT NULL ORDER BY id",
        &[&worker_id],
    )
    .await
    .map_err(db_err)?
    .into_iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect())
}

/// Whether a report may take the one-statement paths (a grouped
/// completion, a progress update): numbers in range on their own (the
/// plan's task count is checked in the statement) and not permanent. Any
/// other report takes the transaction that says precisely why it is
/// refused.
pub(super) fn groupable(r: &JobReport) -> bool {
    validate::progress(r.current_task, r.progress_percent).is_ok()
        && r.task_results.iter().all(|t| t.task_number >= 1)
        && !r.permanent
}

/// What ending a running attempt did.
pub(super) struct Ended {
    /// The job's status after it: failed (backing off), pending (no
    /// backoff) or dead.
    pub status: JobStatus,
    /// Its action.
    pub action_id: String,
    /// The holder whose slot was freed.
    pub worker_id: String,
}

impl PgEngine {
    /// Ends the running attempt of the job at `id` as failed: it backs off
    /// (or is pending at once with no backoff) while attempts remain, else
    /// it is dead. `fence` re-checks the lease; `reported` keeps the lease
    /// id so a repeated report is recognised; otherwise the holder is told
    /// to stop the job. Returns `None` when the job is not running (under
    /// that lease).
    ///
    /// Errors: storage errors.
    pub(super) async fn end_attempt(
        &self,
        tx: &Transaction<'_>,
        id: i64,
        fence: Option<(&str, &str)>,
        error: &str,
        permanent: bool,
        reported: bool,
    ) -> Result<Option<Ended>> {
        let (lease, worker) = fence.unzip();
        let Some(r) = tx
            .query_opt(
                "SELECT attempt, max_attempts, action_id, worker_id, started_at_ms, job_id, lease_id FROM jobs
                 WHERE id = $1 AND status = 2
                   AND ($2::text IS NULL OR lease_id = $2) AND ($3::text IS NULL OR worker_id = $3)
                 FOR UPDATE",
                &[&id, &lease, &worker],
            )
            .await
            .map_err(db_err)?
        else {
            return Ok(None);
        };
        let attempt: i32 = r.get(0);
        let max_attempts: i32 = r.get(1);
        let action_id: String = r.get(2);
        let worker_id: String = r.get::<_, Option<String>>(3).unwrap_or_default();
        let job_id: String = r.get(5);
        let lease_id: String = r.get::<_, Option<String>>(6).unwrap_or_default();
        let dead = permanent || attempt >= max_attempts;
        let backoff = if dead {
            0
        } else {
            self.cfg
                .retry_backoff_ms(u32::try_from(attempt).unwrap_or(0))
        };
        let status = if dead {
            JobStatus::Dead
        } else if backoff == 0 {
            JobStatus::Pending
        } else {
            JobStatus::Failed
        };
        let error = if permanent {
            format!("attempt {attempt} of {max_attempts}: permanent failure, not retried: {error}")
        } else {
            format!("attempt {attempt} of {max_attempts}: {error}")
        };
        tx.execute(
            "UPDATE jobs SET status = $2::smallint, error = $3, ready_at_ms = agq_now_ms() + $4,
                    delayed = false, completed_at_ms = CASE WHEN $2::smallint = 5 THEN agq_now_ms() END,
                    lease_id = CASE WHEN $5 THEN lease_id END, lease_expires_at_ms = NULL
             WHERE id = $1",
            &[&id, &(status as i16), &error, &backoff, &reported],
        )
        .await
        .map_err(db_err)?;
        if !reported && !worker_id.is_empty() {
            queue_command(
                tx,
                &worker_id,
                &WorkerCommand::CancelJob { job_id, lease_id },
            )
            .await?;
        }
        if status == JobStatus::Pending {
            notify_names(tx, READY_CHANNEL, &[String::new()]).await?;
        }
        if status != JobStatus::Dead {
            self.metrics.transition(JobStatus::Failed);
        }
        self.metrics.transition(status);
        Ok(Some(Ended {
            status,
            action_id,
            worker_id,
        }))
    }

    /// Loses lease `lease.0` of worker `lease.1` on running job `id` (its
    /// holder died, dropped it, or it timed out): the attempt counts as
    /// failed with `reason`. The lease and worker the caller listed are
    /// re-checked under the row lock, so a statement that runs late (its
    /// replica paused, or waiting on the row) leaves a job that was
    /// reported and leased again meanwhile alone. Returns `None` when the
    /// job no longer runs under that lease.
    ///
    /// Errors: storage errors.
    pub(super) async fn lose_lease(
        &self,
        tx: &Transaction<'_>,
        id: i64,
        lease: (&str, &str),
        reason: &str,
        label: &str,
    ) -> Result<Option<Ended>> {
        let ended = self
            .end_attempt(tx, id, Some(lease), reason, false, false)
            .await?;
        if let Some(e) = &ended {
            self.metrics.requeue(label);
            tracing::info!(worker_id = %e.worker_id, reason, "lease lost");
        }
        Ok(ended)
    }

    pub(super) async fn pg_submit_plan(&self, plan: Plan, replace: bool) -> Result<SubmittedPlan> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let now: i64 = tx
            .query_one("SELECT agq_now_ms()", &[])
            .await
            .map_err(db_err)?
            .get(0);
        // The plan's row, created here or locked as it stands. A DeletePlan
        // that holds the row when the insert finds it makes the lock find
        // nothing once it commits: the insert then runs again and creates
        // version 1, as if the submit had come after the delete.
        let mut existing = None;
        for _ in 0..3 {
            let inserted = tx
                .execute(
                    "INSERT INTO plans (plan_id, description, version, created_at_ms, updated_at_ms)
                     VALUES ($1, $2, 1, $3, $3) ON CONFLICT (plan_id) DO NOTHING",
                    &[&plan.plan_id, &plan.plan_description, &now],
                )
                .await
                .map_err(db_err)?;
            if inserted == 1 {
                existing = Some(None);
                break;
            }
            if let Some(r) = tx
                .query_opt(
                    "SELECT version FROM plans WHERE plan_id = $1 FOR UPDATE",
                    &[&plan.plan_id],
                )
                .await
                .map_err(db_err)?
            {
                existing = Some(Some(r.get::<_, i32>(0)));
                break;
            }
        }
        let Some(existing) = existing else {
            return Err(Error::StoreBusy(format!(
                "plan {} was deleted and stored again by other calls while this one ran; retry",
                plan.plan_id
            )));
        };
        let mut plan = plan;
        if let Some(version) = existing {
            if !replace {
                return Err(Error::AlreadyExists(format!(
                    "plan {} already exists (version {version}); submit it with replace to store a new version",
                    plan.plan_id
                )));
            }
            let latest = rows::get_plan_version(&tx, &plan.plan_id, version as u32)
                .await?
                .ok_or_else(|| {
                    Error::Internal(format!("plan {} has no latest version", plan.plan_id))
                })?;
            if latest.same_content(&plan) {
                return Ok(SubmittedPlan {
                    plan_id: plan.plan_id,
                    version: version as u32,
                    created: false,
                });
            }
            plan.version = u32::try_from(version)
                .ok()
                .and_then(|v| v.checked_add(1))
                .filter(|v| *v <= i32::MAX as u32)
                .ok_or_else(|| {
                    Error::ResourceExhausted(format!(
                        "plan {} has the most versions a plan can have; delete it or use another id",
                        plan.plan_id
                    ))
                })?;
            rows::insert_plan_version(&tx, &plan, now).await?;
            tx.execute(
                "UPDATE plans SET version = $2, description = $3, updated_at_ms = $4 WHERE plan_id = $1",
                &[&plan.plan_id, &(plan.version as i32), &plan.plan_description, &now],
            )
            .await
            .map_err(db_err)?;
        } else {
            plan.version = 1;
            rows::insert_plan_version(&tx, &plan, now).await?;
        }
        if plan.require_verified_tools {
            // Sent at the commit: every replica, this one included,
            // challenges its connected workers for the plan's tools.
            notify_names(&tx, super::VERIFY_CHANNEL, &[plan.plan_id.clone()]).await?;
        }
        tx.commit().await.map_err(db_err)?;
        if plan.require_verified_tools {
            // At once here, even while this replica's listener is down.
            self.verify_wake.notify_one();
        }
        Ok(SubmittedPlan {
            plan_id: plan.plan_id,
            version: plan.version,
            created: true,
        })
    }

    pub(super) async fn pg_get_plan(&self, plan_id: String, version: Option<u32>) -> Result<Plan> {
        let c = self.client().await?;
        let not_found = || Error::not_found(format!("plan {plan_id} not found"));
        let Some(version) = version else {
            return rows::get_latest_plan(&c, &plan_id)
                .await?
                .ok_or_else(not_found);
        };
        if let Some(p) = rows::get_plan_version(&c, &plan_id, version).await? {
            return Ok(p);
        }
        let latest: Option<i32> = c
            .query_opt("SELECT version FROM plans WHERE plan_id = $1", &[&plan_id])
            .await
            .map_err(db_err)?
            .map(|r| r.get(0));
        let latest = latest.ok_or_else(not_found)?;
        Err(Error::not_found(format!(
            "plan {plan_id} has no version {version} (versions 1 to {latest})"
        )))
    }

    pub(super) async fn pg_list_plans(&self, q: PlanQuery) -> Result<Page<PlanSummary>> {
        let limit = page::page_size(q.page_size)?;
        let pattern = crate::core::validate::plan_pattern(&q.pattern)?;
        let kind = q.page_kind();
        let after = page::decode_token(&kind, &q.page_token)?.unwrap_or_default();
        let prefix: String = pattern
            .as_ref()
            .map(|p| {
                p.as_str()
                    .chars()
                    .take_while(|c| !matches!(c, '*' | '?' | '['))
                    .collect()
            })
            .unwrap_or_default();
        let c = self.client().await?;
        let mut out = Vec::new();
        let mut cursor = after;
        // Pages of the id range the pattern's literal prefix allows,
        // filtered by the glob here; bounded by the plans that exist.
        'outer: loop {
            let found = c
                .query(
                    "SELECT plan_id, version, description, created_at_ms, updated_at_ms FROM plans
                     WHERE plan_id > $1 AND plan_id >= $2 ORDER BY plan_id LIMIT 500",
                    &[&cursor, &prefix],
                )
                .await
                .map_err(db_err)?;
            if found.is_empty() {
                break;
            }
            for r in &found {
                let id: String = r.get(0);
                if !id.starts_with(&prefix) {
                    break 'outer;
                }
                cursor.clone_from(&id);
                if pattern.as_ref().is_none_or(|p| p.matches(&id)) {
                    out.push(PlanSummary {
                        plan_id: id,
                        version: r.get::<_, i32>(1) as u32,
                        plan_description: r.get(2),
                        created_at_ms: r.get(3),
                        updated_at_ms: r.get(4),
                    });
                    if out.len() > limit {
                        break 'outer;
                    }
                }
            }
        }
        let (items, next_page_token) = page::split_page(out, limit, &kind, |p| p.plan_id.clone());
        Ok(Page {
            items,
            next_page_token,
        })
    }

    pub(super) async fn pg_list_plan_versions(
        &self,
        q: PlanVersionQuery,
        before: i64,
    ) -> Result<Page<PlanVersion>> {
        let limit = page::page_size(q.page_size)?;
        let c = self.client().await?;
        let exists = c
            .query_opt("SELECT 1 FROM plans WHERE plan_id = $1", &[&q.plan_id])
            .await
            .map_err(db_err)?;
        if exists.is_none() {
            return Err(Error::not_found(format!("plan {} not found", q.plan_id)));
        }
        let found = c
            .query(
                "SELECT version, description, task_count, created_at_ms FROM plan_versions
                 WHERE plan_id = $1 AND version < $2::bigint ORDER BY version DESC LIMIT $3",
                &[&q.plan_id, &before, &((limit + 1) as i64)],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| PlanVersion {
                version: r.get::<_, i32>(0) as u32,
                plan_description: r.get(1),
                task_count: r.get::<_, i32>(2) as u32,
                created_at_ms: r.get(3),
            })
            .collect();
        let plan_id = q.plan_id;
        let (items, next_page_token) = page::split_page(found, limit, "plan_version", |v| {
            format!("{}:{plan_id}", v.version)
        });
        Ok(Page {
            items,
            next_page_token,
        })
    }

    pub(super) async fn pg_delete_plan(&self, plan_id: String) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let found = tx
            .query_opt(
                "SELECT 1 FROM plans WHERE plan_id = $1 FOR UPDATE",
                &[&plan_id],
            )
            .await
            .map_err(db_err)?;
        if found.is_none() {
            return Err(Error::not_found(format!("plan {plan_id} not found")));
        }
        let in_use = tx
            .query_opt(
                "SELECT 1 FROM jobs WHERE plan_id = $1 AND status IN (1, 2, 4) LIMIT 1",
                &[&plan_id],
            )
            .await
            .map_err(db_err)?;
        if in_use.is_some() {
            return Err(Error::precondition(format!(
                "plan {plan_id} is used by pending or running jobs; cancel them or wait until they finish"
            )));
        }
        let actions: Vec<String> = tx
            .query(
                "SELECT action_id FROM actions WHERE plan_id = $1",
                &[&plan_id],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        tx.execute("DELETE FROM plans WHERE plan_id = $1", &[&plan_id])
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        super::lock(&self.plans).retain(|(id, _), _| *id != plan_id);
        self.touch(actions.iter().map(String::as_str));
        Ok(())
    }

    /// Submits a client's validated action (the ACTION.SUBMIT command);
    /// `reserved`: the schedule whose tick its id has the form of
    /// ([`validate::tick_schedule`]), refused while that schedule exists.
    /// Returns the job ids.
    ///
    /// Errors: `InvalidArgument` (an id reserved for a schedule's ticks),
    /// those of [`Self::insert_action`].
    pub(super) async fn pg_submit_action(
        &self,
        v: ValidAction,
        reserved: Option<String>,
    ) -> Result<Vec<String>> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        if let Some(sid) = &reserved {
            super::schedules::lock_tick_ids(&tx, sid).await?;
            let found = tx
                .query_opt("SELECT 1 FROM schedules WHERE schedule_id = $1", &[sid])
                .await
                .map_err(db_err)?;
            if found.is_some() {
                return Err(validate::reserved_for_ticks(&v.action_id, sid));
            }
        }
        let ids = self.insert_action(&tx, &v).await?;
        tx.commit().await.map_err(db_err)?;
        for _ in 0..ids.len() {
            self.metrics.transition(JobStatus::Pending);
        }
        self.touch([v.action_id.as_str()]);
        Ok(ids)
    }

    /// Inserts a validated action and its jobs in `tx` (the ACTION.SUBMIT
    /// command), with a ready notification sent at commit when they run
    /// now. Returns the job ids.
    ///
    /// Errors: `NotFound` (plan), `AlreadyExists` (action id), storage
    /// errors.
    pub(super) async fn insert_action(
        &self,
        tx: &Transaction<'_>,
        v: &ValidAction,
    ) -> Result<Vec<String>> {
        // FOR SHARE: a concurrent DeletePlan waits for this commit.
        let Some(p) = tx
            .query_opt(
                &cached(
                    tx,
                    "SELECT p.version, pv.body, agq_now_ms() FROM plans p
                 JOIN plan_versions pv ON pv.plan_id = p.plan_id AND pv.version = p.version
                 WHERE p.plan_id = $1 FOR SHARE OF p",
                )
                .await?,
                &[&v.plan_id],
            )
            .await
            .map_err(db_err)?
        else {
            return Err(Error::not_found(format!("plan {} not found", v.plan_id)));
        };
        let version: i32 = p.get(0);
        let plan = rows::decode_plan(p.get(1), version)?;
        let now: i64 = p.get(2);
        let mut sched = v.scheduling.clone();
        if sched.worker_selector.is_empty() {
            sched.worker_selector.clone_from(&plan.worker_selector);
        }
        let total = v.inputs.len() as i32;
        let ready_at = v.run_at_ms.unwrap_or(now).max(now);
        let inserted = tx
            .execute(
                &cached(tx, "INSERT INTO actions (action_id, plan_id, plan_version, total_jobs, max_attempts,
                     run_at_ms, created_at_ms, traceparent, priority, worker_selector,
                     concurrency_key, max_running)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
                 ON CONFLICT (action_id) DO NOTHING").await?,
                &[
                    &v.action_id,
                    &v.plan_id,
                    &version,
                    &total,
                    &(v.max_attempts as i32),
                    &v.run_at_ms,
                    &now,
                    &v.traceparent,
                    &sched.priority,
                    &sched.worker_selector,
                    &sched.concurrency_key,
                    &(sched.max_running as i32),
                ],
            )
            .await
            .map_err(db_err)?;
        if inserted == 0 {
            return Err(Error::AlreadyExists(format!(
                "action {} already exists",
                v.action_id
            )));
        }
        // Locked to the commit: the leader's drop of unused selectors
        // cannot drop it before these jobs are visible.
        keep_selectors(tx, std::slice::from_ref(&sched.worker_selector)).await?;
        let mut ids = Vec::with_capacity(v.inputs.len());
        let mut inputs = Vec::with_capacity(v.inputs.len());
        for input in &v.inputs {
            ids.push(uuid::Uuid::now_v7().to_string());
            inputs.push(serde_json::to_string(input).map_err(|e| Error::Internal(e.to_string()))?);
        }
        tx.execute(
            &cached(tx, "INSERT INTO jobs (job_id, action_id, plan_id, plan_version, status, input, max_attempts,
                 created_at_ms, ready_at_ms, priority, worker_selector, concurrency_key, max_running,
                 delayed)
             SELECT g.job_id, $3, $4, $5, 1, g.input, $6, $7, $8, $9, $10, $11, $12, $8::bigint > $7::bigint
             FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS g(job_id, input, n)
             ORDER BY g.n").await?,
            &[
                &ids,
                &inputs,
                &v.action_id,
                &v.plan_id,
                &version,
                &(v.max_attempts as i32),
                &now,
                &ready_at,
                &sched.priority,
                &sched.worker_selector,
                &sched.concurrency_key,
                &(sched.max_running as i32),
            ],
        )
        .await
        .map_err(db_err)?;
        if ready_at <= now {
            notify_names(tx, READY_CHANNEL, &[String::new()]).await?;
        }
        Ok(ids)
    }

    pub(super) async fn pg_get_action(&self, action_id: &str) -> Result<ActionStatus> {
        let c = self.client().await?;
        rows::action_status(&c, action_id)
            .await?
            .ok_or_else(|| Error::not_found(format!("action {action_id} not found")))
    }

    pub(super) async fn pg_list_actions(
        &self,
        q: ActionQuery,
        after: Option<(i64, i64)>,
    ) -> Result<Page<ActionStatus>> {
        let limit = page::page_size(q.page_size)?;
        let state: i32 = match q.state {
            None => 0,
            Some(ActionState::Open) => 1,
            Some(ActionState::Finished) => 2,
            Some(ActionState::HasDead) => 3,
        };
        let (after_t, after_seq) = after.unzip();
        let c = self.client().await?;
        let found: Vec<(i64, i64, String)> = c
            .query(
                "SELECT a.created_at_ms, a.seq, a.action_id FROM actions a
                 WHERE ($1::text IS NULL OR a.plan_id = $1)
                   AND ($2::bigint IS NULL OR a.created_at_ms >= $2)
                   AND ($3::bigint IS NULL OR a.created_at_ms < $3)
                   AND ($4::bigint IS NULL OR a.created_at_ms < $4
                        OR (a.created_at_ms = $4 AND a.seq < $5))
                   AND ($6 = 0
                        OR ($6 = 1 AND EXISTS (SELECT 1 FROM jobs o WHERE o.action_id = a.action_id
                                               AND o.status IN (1, 2, 4)))
                        OR ($6 = 2 AND NOT EXISTS (SELECT 1 FROM jobs o WHERE o.action_id = a.action_id
                                                   AND o.status IN (1, 2, 4)))
                        OR ($6 = 3 AND EXISTS (SELECT 1 FROM jobs j
                                               WHERE j.action_id = a.action_id AND j.status = 5)))
                 ORDER BY a.created_at_ms DESC, a.seq DESC LIMIT $7",
                &[
                    &q.plan_id,
                    &q.created_after_ms,
                    &q.created_before_ms,
                    &after_t,
                    &after_seq,
                    &state,
                    &((limit + 1) as i64),
                ],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let (found, next_page_token) =
            page::split_page(found, limit, &q.page_kind(), |(t, s, _)| format!("{t}:{s}"));
        let mut items = Vec::with_capacity(found.len());
        for (_, _, id) in found {
            // An action deleted by retention meanwhile is left out.
            items.extend(rows::action_status(&c, &id).await?);
        }
        Ok(Page {
            items,
            next_page_token,
        })
    }

    /// Cancels the open jobs of `action_id` (all of them: `job` None) or
    /// the one job `job`; tells the holders of running ones. Returns how
    /// many were cancelled.
    async fn cancel_open(
        &self,
        tx: &Transaction<'_>,
        action_id: &str,
        job: Option<i64>,
    ) -> Result<u32> {
        let rows = tx
            .query(
                "WITH old AS (
                     SELECT id, status, worker_id, lease_id FROM jobs
                     WHERE action_id = $1 AND status IN (1, 2, 4) AND ($2::bigint IS NULL OR id = $2)
                     ORDER BY id FOR UPDATE)
                 UPDATE jobs j SET status = 6, completed_at_ms = agq_now_ms(), lease_id = NULL,
                        lease_expires_at_ms = NULL, error = 'cancelled'
                 FROM old WHERE j.id = old.id
                 RETURNING old.status, old.worker_id, j.job_id, old.lease_id",
                &[&action_id, &job],
            )
            .await
            .map_err(db_err)?;
        for r in &rows {
            self.metrics.transition(JobStatus::Cancelled);
            if r.get::<_, i16>(0) == RUNNING {
                if let Some(w) = r.get::<_, Option<String>>(1) {
                    let cancel = WorkerCommand::CancelJob {
                        job_id: r.get(2),
                        lease_id: r.get::<_, Option<String>>(3).unwrap_or_default(),
                    };
                    queue_command(tx, &w, &cancel).await?;
                }
            }
        }
        Ok(rows.len() as u32)
    }

    pub(super) async fn pg_cancel_action(&self, action_id: &str) -> Result<u32> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let found = tx
            .query_opt("SELECT 1 FROM actions WHERE action_id = $1", &[&action_id])
            .await
            .map_err(db_err)?;
        if found.is_none() {
            return Err(Error::not_found(format!("action {action_id} not found")));
        }
        let n = self.cancel_open(&tx, action_id, None).await?;
        tx.commit().await.map_err(db_err)?;
        self.touch([action_id]);
        self.dispatch_wake.notify_one();
        Ok(n)
    }

    /// Puts the jobs `ids` of `action_id` that are still failed or dead
    /// back to pending with a fresh attempt budget, at `priority` when
    /// given; returns how many. A job another transaction moved meanwhile
    /// (cancelled, promoted and leased) is left as it is.
    async fn retry_rows(
        &self,
        tx: &Transaction<'_>,
        action_id: &str,
        ids: &[i64],
        priority: Option<i32>,
    ) -> Result<usize> {
        let rows = tx
            .query(
                "WITH old AS (SELECT id, status FROM jobs
                              WHERE id = ANY($1) AND status IN (4, 5) ORDER BY id FOR UPDATE)
                 UPDATE jobs j SET status = 1, attempt = 0, ready_at_ms = agq_now_ms(), delayed = false,
                        completed_at_ms = NULL, lease_id = NULL, error = '', current_task = 0,
                        progress_percent = 0, priority = coalesce($2, j.priority)
                 FROM old WHERE j.id = old.id RETURNING old.status, j.worker_selector",
                &[&ids, &priority],
            )
            .await
            .map_err(db_err)?;
        // Pending again: their selectors, dropped maybe since they ended,
        // are needed by the dispatchers again.
        let selectors: Vec<String> = rows.iter().map(|r| r.get(1)).collect();
        keep_selectors(tx, &selectors).await?;
        tx.execute(
            "UPDATE actions SET finished_at_ms = NULL WHERE action_id = $1",
            &[&action_id],
        )
        .await
        .map_err(db_err)?;
        for _ in &rows {
            self.metrics.transition(JobStatus::Pending);
        }
        notify_names(tx, READY_CHANNEL, &[String::new()]).await?;
        Ok(rows.len())
    }

    /// Fails with `FailedPrecondition` when the plan version the action's
    /// jobs run was deleted.
    async fn check_retry_plan(
        &self,
        tx: &Transaction<'_>,
        plan_id: &str,
        version: i32,
    ) -> Result<()> {
        // Held to the commit: a DeletePlan (which locks the plan row for
        // update before it looks for open jobs) waits for this retry and
        // then sees its jobs, or has deleted the plan already.
        let plan = tx
            .query_opt(
                "SELECT 1 FROM plans WHERE plan_id = $1 FOR SHARE",
                &[&plan_id],
            )
            .await
            .map_err(db_err)?;
        if plan.is_none()
            || self
                .plan_version(tx, plan_id, version as u32, None)
                .await?
                .is_none()
        {
            return Err(Error::precondition(format!(
                "plan {plan_id} (version {version}) no longer exists"
            )));
        }
        Ok(())
    }

    pub(super) async fn pg_retry_action(
        &self,
        action_id: &str,
        status: Option<JobStatus>,
    ) -> Result<u32> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let not_found = || Error::not_found(format!("action {action_id} not found"));
        let a = tx
            .query_opt(
                "SELECT plan_id, plan_version FROM actions WHERE action_id = $1",
                &[&action_id],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(not_found)?;
        // Locks in DeletePlan's order (plan, action, jobs), so the two
        // never wait on each other in a circle. A missing plan version
        // matters only when there is something to retry (as on SQLite).
        let plan = match self.check_retry_plan(&tx, a.get(0), a.get(1)).await {
            Err(e @ Error::FailedPrecondition(_)) => Err(e),
            Err(e) => return Err(e),
            Ok(()) => Ok(()),
        };
        tx.query_opt(
            "SELECT 1 FROM actions WHERE action_id = $1 FOR UPDATE",
            &[&action_id],
        )
        .await
        .map_err(db_err)?
        .ok_or_else(not_found)?;
        let statuses: Vec<i16> = match status {
            Some(s) => vec![s as i16],
            None => vec![FAILED, DEAD],
        };
        // Locked as read (a row that moved meanwhile is read again and
        // left out), so nothing changes them before the retry below.
        let ids: Vec<i64> = tx
            .query(
                "SELECT id FROM jobs WHERE action_id = $1 AND status = ANY($2) ORDER BY id
                 FOR UPDATE",
                &[&action_id, &statuses],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        if ids.is_empty() {
            return Ok(0);
        }
        plan?;
        let retried = self.retry_rows(&tx, action_id, &ids, None).await?;
        tx.commit().await.map_err(db_err)?;
        self.touch([action_id]);
        Ok(retried as u32)
    }

    /// The job with public id `job_id`, with why it waits.
    pub(super) async fn pg_get_job(&self, job_id: &str) -> Result<Job> {
        let c = self.client().await?;
        let r = c
            .query_opt(
                &format!("SELECT {} FROM jobs j WHERE j.job_id = $1", rows::JOB_COLS),
                &[&job_id],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(|| Error::not_found(format!("job {job_id} not found")))?;
        let row_id: i64 = r.get(18);
        let mut job = rows::job(&r)?;
        if matches!(job.status, JobStatus::Pending | JobStatus::Failed) {
            job.waiting_reason = self.waiting_reason(&c, row_id).await?;
        }
        Ok(job)
    }

    pub(super) async fn pg_search_jobs(&self, q: JobQuery) -> Result<Page<String>> {
        let limit = page::page_size(q.page_size)?;
        let kind = q.page_kind();
        let after = page::decode_number(&kind, &q.page_token)?;
        let c = self.client().await?;
        if let Some(a) = &q.action_id {
            let found = c
                .query_opt("SELECT 1 FROM actions WHERE action_id = $1", &[a])
                .await
                .map_err(db_err)?;
            if found.is_none() {
                return Err(Error::not_found(format!("action {a} not found")));
            }
        }
        let found: Vec<(i64, String)> = c
            .query(
                "SELECT id, job_id FROM jobs WHERE id > $1
                   AND ($2::text IS NULL OR action_id = $2)
                   AND ($3::smallint IS NULL OR status = $3)
                   AND ($4::text IS NULL OR plan_id = $4)
                   AND ($5::bigint IS NULL OR created_at_ms >= $5)
                   AND ($6::bigint IS NULL OR created_at_ms < $6)
                 ORDER BY id LIMIT $7",
                &[
                    &after,
                    &q.action_id,
                    &q.status.map(|s| s as i16),
                    &q.plan_id,
                    &q.created_after_ms,
                    &q.created_before_ms,
                    &((limit + 1) as i64),
                ],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let (found, next_page_token) =
            page::split_page(found, limit, &kind, |(r, _)| r.to_string());
        Ok(Page {
            items: found.into_iter().map(|(_, id)| id).collect(),
            next_page_token,
        })
    }

    pub(super) async fn pg_retry_job(&self, job_id: &str, priority: Option<i32>) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let not_found = || Error::not_found(format!("job {job_id} not found"));
        let plan = tx
            .query_opt(
                "SELECT plan_id, plan_version, action_id FROM jobs WHERE job_id = $1",
                &[&job_id],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(not_found)?;
        // Locks in the order of DeletePlan, RetryAction and retention
        // (plan, action, jobs), so none of them waits on another in a
        // circle (PostgreSQL would abort one with a deadlock).
        self.check_retry_plan(&tx, plan.get(0), plan.get(1)).await?;
        let action: &str = plan.get(2);
        tx.query_opt(
            "SELECT 1 FROM actions WHERE action_id = $1 FOR UPDATE",
            &[&action],
        )
        .await
        .map_err(db_err)?
        .ok_or_else(not_found)?;
        let r = tx
            .query_opt(
                "SELECT id, status, action_id FROM jobs WHERE job_id = $1 FOR UPDATE",
                &[&job_id],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(not_found)?;
        let status = rows::status(r.get(1))?;
        if !matches!(status, JobStatus::Failed | JobStatus::Dead) {
            return Err(Error::precondition(format!(
                "job {job_id} is {}; only failed or dead jobs can be retried",
                status.name()
            )));
        }
        let action_id: String = r.get(2);
        self.retry_rows(&tx, &action_id, &[r.get(0)], priority)
            .await?;
        tx.commit().await.map_err(db_err)?;
        self.touch([action_id.as_str()]);
        Ok(())
    }

    pub(super) async fn pg_cancel_job(&self, job_id: &str) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let r = tx
            .query_opt(
                "SELECT id, status, action_id FROM jobs WHERE job_id = $1 FOR UPDATE",
                &[&job_id],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(|| Error::not_found(format!("job {job_id} not found")))?;
        let status = rows::status(r.get(1))?;
        if !matches!(
            status,
            JobStatus::Pending | JobStatus::Failed | JobStatus::Running
        ) {
            return Err(Error::precondition(format!(
                "job {job_id} is {} and cannot be cancelled",
                status.name()
            )));
        }
        let action_id: String = r.get(2);
        self.cancel_open(&tx, &action_id, Some(r.get(0))).await?;
        tx.commit().await.map_err(db_err)?;
        self.touch([action_id.as_str()]);
        self.dispatch_wake.notify_one();
        Ok(())
    }

    /// Completes the reports at `which` of worker `worker_id` in one
    /// statement fenced per job like a single report; each must be
    /// [`groupable`]. Returns the indexes
    /// it applied; the others are left to the caller.
    ///
    /// Errors: storage errors.
    pub(super) async fn pg_complete_batch(
        &self,
        worker_id: &str,
        reports: &[JobReport],
        which: &[usize],
    ) -> Result<Vec<usize>> {
        let pending = which.iter().map(|i| {
            let r = &reports[*i];
            self.complete_grouped(
                &r.job_id,
                &r.lease_id,
                worker_id,
                encode_task_results(&r.task_results),
                validate::reported_tasks(r),
            )
        });
        let applied = futures_util::future::join_all(pending).await;
        let mut out = Vec::with_capacity(which.len());
        for (i, done) in which.iter().zip(applied) {
            if done? {
                out.push(*i);
            }
        }
        Ok(out)
    }

    /// Applies a validated report (the JOB.UPDATE command): one
    /// transaction whose first statement locks the job row and whose
    /// writes happen only when the report holds the current lease.
    pub(super) async fn pg_update_job(&self, req: JobReport) -> Result<JobStatus> {
        let results = encode_task_results(&req.task_results);
        // The common reports in one fenced statement: a completion in the
        // group commit of this replica's completions, a progress report on
        // its own (one round trip, no explicit transaction); any other
        // case, a rejection included, takes the path below, which says
        // precisely why.
        // Its task numbers are checked against the plan's task count in
        // the statement (a report past it takes the path below).
        let common = groupable(&req);
        let tasks = i32::try_from(validate::reported_tasks(&req)).unwrap_or(i32::MAX);
        if common
            && req.status == Some(JobStatus::Completed)
            && self
                .complete_grouped(
                    &req.job_id,
                    &req.lease_id,
                    &req.worker_id,
                    results.clone(),
                    validate::reported_tasks(&req),
                )
                .await?
        {
            return Ok(JobStatus::Completed);
        }
        let mut client = self.client().await?;
        if common && req.status == Some(JobStatus::Running) {
            let task = req.current_task as i32;
            let percent = req.progress_percent as i32;
            let done = client
                .query_opt(
                    &cached(
                        &client,
                        "UPDATE jobs j SET current_task = $5, progress_percent = $6,
                                task_results = coalesce($4, task_results)
                         WHERE job_id = $1 AND status = 2 AND lease_id = $2 AND worker_id = $3
                           AND $7 <= (SELECT pv.task_count FROM plan_versions pv
                                      WHERE pv.plan_id = j.plan_id
                                        AND pv.version = j.plan_version)
                         RETURNING 1",
                    )
                    .await?,
                    &[
                        &req.job_id,
                        &req.lease_id,
                        &req.worker_id,
                        &results,
                        &task,
                        &percent,
                        &tasks,
                    ],
                )
                .await
                .map_err(db_err)?;
            if done.is_some() {
                return Ok(JobStatus::Running);
            }
        }
        let tx = client.transaction().await.map_err(db_err)?;
        let r = tx
            .query_opt(
                "SELECT j.id, j.status, j.lease_id, j.worker_id, j.action_id, j.started_at_ms,
                        agq_now_ms(),
                        (SELECT pv.task_count FROM plan_versions pv
                         WHERE pv.plan_id = j.plan_id AND pv.version = j.plan_version)
                 FROM jobs j WHERE j.job_id = $1 FOR UPDATE OF j",
                &[&req.job_id],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(|| Error::not_found(format!("job {} not found", req.job_id)))?;
        let id: i64 = r.get(0);
        let status = rows::status(r.get(1))?;
        let lease_id: Option<String> = r.get(2);
        let worker_id: Option<String> = r.get(3);
        let action_id: String = r.get(4);
        let started: Option<i64> = r.get(5);
        let now: i64 = r.get(6);
        let task_count: Option<i32> = r.get(7);
        let same_worker = worker_id.as_deref() == Some(req.worker_id.as_str());
        let same_lease = lease_id.as_deref() == Some(req.lease_id.as_str());
        if status != JobStatus::Running || !same_worker || !same_lease {
            if status != JobStatus::Running && same_worker && same_lease {
                // A repeat of the report that ended this attempt (its
                // reply was lost): acknowledged again, nothing changes.
                let repeated = match req.status {
                    Some(JobStatus::Completed) => status == JobStatus::Completed,
                    Some(JobStatus::Failed) => matches!(
                        status,
                        JobStatus::Failed | JobStatus::Dead | JobStatus::Pending
                    ),
                    _ => false,
                };
                if repeated {
                    return Ok(status);
                }
            }
            self.metrics.fencing_rejections.inc();
            if status == JobStatus::Running && !same_worker {
                return Err(Error::PermissionDenied(format!(
                    "job {} is leased to another worker, not {}",
                    req.job_id, req.worker_id
                )));
            }
            if status == JobStatus::Running {
                return Err(Error::precondition(format!(
                    "stale lease {} for job {}: the current lease is newer (fencing)",
                    req.lease_id, req.job_id
                )));
            }
            let msg = format!(
                "job {} is {} and holds no lease of worker {}; the report is rejected",
                req.job_id,
                status.name(),
                req.worker_id
            );
            return Err(if same_worker {
                Error::FailedPrecondition(msg)
            } else {
                Error::PermissionDenied(msg)
            });
        }
        validate::progress(req.current_task, req.progress_percent)?;
        if let Some(n) = task_count {
            validate::report_in_plan(&req, usize::try_from(n).unwrap_or(0))?;
        }
        if req.permanent && req.status != Some(JobStatus::Failed) {
            return Err(Error::invalid(
                "permanent is for JOB_STATUS_FAILED reports only",
            ));
        }
        let after =
            match req.status {
                Some(JobStatus::Running) => {
                    tx.execute(
                        "UPDATE jobs SET current_task = $2, progress_percent = $3,
                            task_results = coalesce($4, task_results) WHERE id = $1",
                        &[
                            &id,
                            &(req.current_task as i32),
                            &(req.progress_percent as i32),
                            &results,
                        ],
                    )
                    .await
                    .map_err(db_err)?;
                    JobStatus::Running
                }
                Some(JobStatus::Completed) => {
                    tx.execute(
                        "UPDATE jobs SET status = 3, completed_at_ms = agq_now_ms(),
                            lease_expires_at_ms = NULL, task_results = coalesce($2, task_results)
                     WHERE id = $1",
                        &[&id, &results],
                    )
                    .await
                    .map_err(db_err)?;
                    self.metrics.transition(JobStatus::Completed);
                    JobStatus::Completed
                }
                Some(JobStatus::Failed) => {
                    let error = if req.error.is_empty() {
                        "the worker reported failure".to_string()
                    } else {
                        req.error.clone()
                    };
                    let ended = self
                        .end_attempt(
                            &tx,
                            id,
                            Some((&req.lease_id, &req.worker_id)),
                            &error,
                            req.permanent,
                            true,
                        )
                        .await?
                        .ok_or_else(|| Error::Internal("the locked job changed".into()))?;
                    tx.execute(
                        "UPDATE jobs SET task_results = $2 WHERE id = $1",
                        &[&id, &results],
                    )
                    .await
                    .map_err(db_err)?;
                    self.metrics.requeue("job_failed");
                    ended.status
                }
                _ => return Err(Error::invalid(
                    "status must be JOB_STATUS_RUNNING, JOB_STATUS_COMPLETED or JOB_STATUS_FAILED",
                )),
            };
        tx.commit().await.map_err(db_err)?;
        if after != JobStatus::Running {
            if let Some(s) = started {
                self.metrics
                    .job_duration
                    .observe((now - s).max(0) as f64 / 1000.0);
            }
            self.touch([action_id.as_str()]);
            self.slot_freed(&req.worker_id);
        }
        Ok(after)
    }
}
