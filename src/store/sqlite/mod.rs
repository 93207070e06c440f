//! The SQLite engine, AGQ's embedded default: one process, the queues and
//! workers in memory ([`state::State`], rebuilt from the database at
//! start), one writer thread that runs every state change and commits
//! batches of them at once (group commit, [`writer`]), a pool of read
//! connections for listings, and the background loops ([`loops`]).
//! [`SqliteEngine`] implements [`crate::core::Engine`] over them.
//!
//! Where things are: the job state machine in [`jobs`], worker lifecycle
//! and the reaper tick in [`workers`], lease grants in [`scheduler`], the
//! SQL in [`sql`].

mod jobs;
pub(crate) mod loops;
#[cfg(test)]
mod pick_props;
mod scheduler;
mod schedules;
pub(crate) mod sql;
mod state;
#[cfg(test)]
mod tests;
mod verify;
mod workers;
mod writer;

use std::{net::SocketAddr, path::Path, sync::Arc};

use tokio::sync::watch;

use self::{
    jobs::{NewAction, NewJob},
    sql::{jobs as jstore, plans as pstore, schedules as sched_store, ReadPool},
    state::State,
    writer::{StoreHealth, Writer},
};
use crate::{
    config::{EngineConfig, SyncMode},
    core::{
        engine::{
            ActionQuery, ActionRequest, Engine, EventTx, HeartbeatEvent, JobQuery, Page, PlanQuery,
            PlanVersionQuery, QueueName, StreamKind, SubmittedAction,
        },
        model::{
            ActionStatus, HeartbeatReply, Job, JobLease, JobReport, JobStatus, Plan, PlanSummary,
            PlanVersion, QueueStats, Registered, Registration, Schedule, SubmittedPlan,
            Verification, VerificationAnswer, Worker, WorkerState, WorkerStats,
        },
        page, validate,
        watch::{WatchSubscription, Watchers},
    },
    error::{Error, Result},
    metrics::SharedMetrics,
    time::now_ms,
};

/// The SQLite engine. Cheap to share behind an `Arc`.
pub struct SqliteEngine {
    writer: Writer<State>,
    pool: ReadPool,
    cfg: EngineConfig,
    metrics: SharedMetrics,
    watchers: Arc<Watchers>,
    writer_thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    checkpointer: std::sync::Mutex<Option<sql::Checkpointer>>,
    stop_loops: watch::Sender<bool>,
    health: StoreHealth,
    /// Woken when a schedule is created or resumed, so the schedule loop
    /// recomputes its next wake-up.
    schedules_changed: Arc<tokio::sync::Notify>,
    /// The right to write the database, given back once the writer
    /// stopped ([`Engine::close`]) or with the engine.
    db_lock: std::sync::Mutex<Option<sql::DbLock>>,
}

impl SqliteEngine {
    /// Opens (creating if needed) the database at `db` with the given
    /// `synchronous` mode, recovers the state (leases of workers that do
    /// not come back return to pending after the grace), starts the
    /// writer thread, the checkpointer and the background loops.
    ///
    /// Errors: `FailedPrecondition` while another process writes the
    /// database ([`sql::lock`]), `Internal` (directory cannot be created,
    /// schema newer than this binary), storage errors opening or
    /// recovering the database.
    pub async fn open(
        db: &Path,
        synchronous: SyncMode,
        cfg: EngineConfig,
        metrics: SharedMetrics,
    ) -> Result<Arc<SqliteEngine>> {
        let db_lock = sql::lock(db)?;
        let (conn, pool) = sql::open(db, synchronous)?;
        let checkpointer = sql::Checkpointer::start(db, synchronous)?;
        let watchers = Arc::new(Watchers::new(
            cfg.max_watch_streams,
            cfg.max_watch_streams_per_connection,
            metrics.watch_streams.clone(),
        ));
        let state =
            State::new(cfg.clone(), metrics.clone(), watchers.clone()).with_pool(pool.clone());
        let health = StoreHealth::new(metrics.store_write_errors.clone());
        let (writer, thread) = Writer::start(conn, state, checkpointer.signal(), health.clone())?;
        writer.write(|s, c| s.load(c)).await?;
        let (stop_loops, stop_rx) = watch::channel(false);
        let engine = Arc::new(SqliteEngine {
            writer,
            pool,
            cfg,
            metrics,
            watchers,
            writer_thread: std::sync::Mutex::new(Some(thread)),
            checkpointer: std::sync::Mutex::new(Some(checkpointer)),
            stop_loops,
            health,
            schedules_changed: Arc::new(tokio::sync::Notify::new()),
            db_lock: std::sync::Mutex::new(Some(db_lock)),
        });
        loops::start(
            &engine.writer,
            &engine.cfg,
            engine.health.subscribe(),
            engine.metrics.store_up.clone(),
            engine.schedules_changed.clone(),
            stop_rx,
        );
        Ok(engine)
    }

    async fn read<R: Send + 'static>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || {
            let conn = pool.get()?;
            f(&conn)
        })
        .await
        .map_err(|e| Error::Internal(format!("read task failed: {e}")))?
    }

    /// The job at `row` with its task results and, when it waits, why.
    async fn job_by_row(&self, row: i64) -> Result<Job> {
        let mut job = self
            .read(move |c| {
                jstore::get_by_row(c, row, true)?.ok_or_else(|| Error::not_found("job vanished"))
            })
            .await?;
        if matches!(job.status, JobStatus::Pending | JobStatus::Failed) {
            job.waiting_reason = self
                .writer
                .run(move |s, _| Ok(s.waiting_reason(row)))
                .await?;
        }
        Ok(job)
    }
}

/// The cursor in an action page token's value, `created_at_ms:rowid`.
///
/// Errors: `InvalidArgument` for any other value.
fn action_cursor(v: &str) -> Result<jstore::ActionCursor> {
    let bad = page::bad_token;
    let (t, r) = v.split_once(':').ok_or_else(bad)?;
    Ok(jstore::ActionCursor {
        created_at_ms: t.parse().map_err(|_| bad())?,
        rowid: r.parse().map_err(|_| bad())?,
    })
}

#[async_trait::async_trait]
impl Engine for SqliteEngine {
    async fn submit_plan(&self, mut plan: Plan, replace: bool) -> Result<SubmittedPlan> {
        validate::plan(&plan)?;
        validate::task_timeouts(&plan, self.config().job_timeout)?;
        plan.worker_selector = validate::worker_selector(&plan.worker_selector)?;
        self.writer
            .write(move |s, c| s.submit_plan(c, plan, replace))
            .await
    }

    async fn get_plan(&self, plan_id: String, version: Option<u32>) -> Result<Plan> {
        validate::object_id("plan_id", &plan_id)?;
        self.read(move |c| {
            let not_found = || Error::not_found(format!("plan {plan_id} not found"));
            let Some(version) = version else {
                return pstore::get(c, &plan_id)?.ok_or_else(not_found);
            };
            if let Some(plan) = pstore::get_version(c, &plan_id, version)? {
                return Ok(plan);
            }
            let latest = pstore::latest_version(c, &plan_id)?.ok_or_else(not_found)?;
            Err(Error::not_found(format!(
                "plan {plan_id} has no version {version} (versions 1 to {latest})"
            )))
        })
        .await
    }

    async fn list_plans(&self, q: PlanQuery) -> Result<Page<PlanSummary>> {
        let limit = page::page_size(q.page_size)?;
        let pattern = validate::plan_pattern(&q.pattern)?;
        let kind = q.page_kind();
        let after = page::decode_token(&kind, &q.page_token)?.unwrap_or_default();
        let plans = self
            .read(move |c| pstore::list(c, pattern.as_ref(), &after, limit + 1))
            .await?;
        let (items, next_page_token) = page::split_page(plans, limit, &kind, |p| p.plan_id.clone());
        Ok(Page {
            items,
            next_page_token,
        })
    }

    async fn list_plan_versions(&self, q: PlanVersionQuery) -> Result<Page<PlanVersion>> {
        validate::object_id("plan_id", &q.plan_id)?;
        let limit = page::page_size(q.page_size)?;
        let before = page::plan_version_cursor(&q.plan_id, &q.page_token)?;
        let plan_id = q.plan_id;
        let versions = self
            .read(move |c| {
                // One read transaction, so a version stored meanwhile
                // cannot split the answer.
                let tx = c.unchecked_transaction()?;
                if pstore::latest_version(&tx, &plan_id)?.is_none() {
                    return Err(Error::not_found(format!("plan {plan_id} not found")));
                }
                let found = pstore::versions(&tx, &plan_id, before, limit + 1)?;
                let (items, next_page_token) =
                    page::split_page(found, limit, "plan_version", |v| {
                        format!("{}:{plan_id}", v.version)
                    });
                Ok(Page {
                    items,
                    next_page_token,
                })
            })
            .await?;
        Ok(versions)
    }

    async fn delete_plan(&self, plan_id: String) -> Result<()> {
        validate::object_id("plan_id", &plan_id)?;
        self.writer
            .write(move |s, c| s.delete_plan(c, &plan_id))
            .await
    }

    async fn submit_action(&self, req: ActionRequest) -> Result<SubmittedAction> {
        // A client's id in the form of a schedule's tick is checked
        // against the schedules (an id the engine makes never is).
        let chosen = !req.action_id.is_empty();
        let v = validate::action(req, &self.cfg, now_ms())?;
        let reserved = chosen
            .then(|| validate::tick_schedule(&v.action_id).map(str::to_owned))
            .flatten();
        let a = NewAction {
            action_id: v.action_id.clone(),
            plan_id: v.plan_id,
            jobs: v
                .inputs
                .into_iter()
                .map(NewJob::new)
                .collect::<Result<_>>()?,
            run_at_ms: v.run_at_ms,
            max_attempts: v.max_attempts,
            traceparent: v.traceparent,
            scheduling: v.scheduling,
        };
        let rows = a.jobs.len();
        let job_ids = self
            .writer
            .write_direct_rows(rows, move |s, c| {
                if let Some(sid) = &reserved {
                    if sched_store::exists(c, sid)? {
                        return Err(validate::reserved_for_ticks(&a.action_id, sid));
                    }
                }
                s.submit_action(c, a)
            })
            .await?;
        Ok(SubmittedAction {
            action_id: v.action_id,
            job_ids,
        })
    }

    async fn get_action(&self, action_id: String) -> Result<ActionStatus> {
        validate::object_id("action_id", &action_id)?;
        self.read(move |c| {
            jstore::action_status(c, &action_id)?
                .ok_or_else(|| Error::not_found(format!("action {action_id} not found")))
        })
        .await
    }

    async fn list_actions(&self, q: ActionQuery) -> Result<Page<ActionStatus>> {
        let limit = page::page_size(q.page_size)?;
        validate::action_query(&q)?;
        let kind = q.page_kind();
        let after = match page::decode_token(&kind, &q.page_token)? {
            None => None,
            Some(v) => Some(action_cursor(&v)?),
        };
        let items = self
            .read(move |c| {
                let found = jstore::list_actions(c, &q, after, limit + 1)?;
                let (found, next) = page::split_page(found, limit, &kind, |(k, _)| {
                    format!("{}:{}", k.created_at_ms, k.rowid)
                });
                // An action deleted by retention between the two reads is
                // left out.
                let mut items = Vec::with_capacity(found.len());
                for (_, id) in found {
                    items.extend(jstore::action_status(c, &id)?);
                }
                Ok(Page {
                    items,
                    next_page_token: next,
                })
            })
            .await?;
        Ok(items)
    }

    async fn cancel_action(&self, action_id: String) -> Result<(u32, ActionStatus)> {
        validate::object_id("action_id", &action_id)?;
        let id = action_id.clone();
        let n = self
            .writer
            .write(move |s, c| s.cancel_action(c, &id))
            .await?;
        Ok((n, self.get_action(action_id).await?))
    }

    async fn retry_action(
        &self,
        action_id: String,
        status: Option<JobStatus>,
    ) -> Result<(u32, ActionStatus)> {
        validate::object_id("action_id", &action_id)?;
        validate::retry_filter(status)?;
        let id = action_id.clone();
        let n = self
            .writer
            .write(move |s, c| s.retry_action(c, &id, status))
            .await?;
        Ok((n, self.get_action(action_id).await?))
    }

    fn watch_action(
        &self,
        action_id: &str,
        connection: Option<SocketAddr>,
    ) -> Result<WatchSubscription> {
        validate::object_id("action_id", action_id)?;
        self.watchers.subscribe(action_id, connection)
    }

    async fn get_job(&self, job_id: String) -> Result<Job> {
        validate::object_id("job_id", &job_id)?;
        let row = self
            .read(move |c| {
                jstore::key_by_job_id(c, &job_id)?
                    .map(|k| k.row)
                    .ok_or_else(|| Error::not_found(format!("job {job_id} not found")))
            })
            .await?;
        self.job_by_row(row).await
    }

    async fn search_jobs(&self, q: JobQuery) -> Result<Page<String>> {
        let limit = page::page_size(q.page_size)?;
        let kind = q.page_kind();
        let after = page::decode_number(&kind, &q.page_token)?;
        if let Some(a) = &q.action_id {
            validate::object_id("action_id", a)?;
        }
        if let Some(p) = &q.plan_id {
            validate::object_id("plan_id", p)?;
        }
        validate::created_range(q.created_after_ms, q.created_before_ms)?;
        let rows = self
            .read(move |c| {
                if let Some(a) = &q.action_id {
                    if !jstore::action_exists(c, a)? {
                        return Err(Error::not_found(format!("action {a} not found")));
                    }
                }
                jstore::search(c, &q, after, limit + 1)
            })
            .await?;
        let (rows, next_page_token) = page::split_page(rows, limit, &kind, |(r, _)| r.to_string());
        Ok(Page {
            items: rows.into_iter().map(|(_, id)| id).collect(),
            next_page_token,
        })
    }

    async fn retry_job(&self, job_id: String, priority: Option<i32>) -> Result<Job> {
        validate::object_id("job_id", &job_id)?;
        if let Some(p) = priority {
            validate::priority(p)?;
        }
        let row = self
            .writer
            .write(move |s, c| s.retry_job(c, &job_id, priority))
            .await?;
        self.job_by_row(row).await
    }

    async fn cancel_job(&self, job_id: String) -> Result<Job> {
        validate::object_id("job_id", &job_id)?;
        let row = self
            .writer
            .write(move |s, c| s.cancel_job(c, &job_id))
            .await?;
        self.job_by_row(row).await
    }

    async fn register_worker(&self, registration: Registration) -> Result<Registered> {
        let reg = validate::registration(registration)?;
        let resumed = self.writer.write(move |s, c| s.register(c, reg)).await?;
        Ok(Registered {
            heartbeat_interval: self.cfg.heartbeat_interval,
            resumed,
        })
    }

    async fn open_heartbeat(&self, worker_id: String, tx: EventTx<HeartbeatEvent>) -> Result<u64> {
        validate::worker_id(&worker_id)?;
        self.writer
            .run(move |s, _| s.open_heartbeat(&worker_id, tx))
            .await
    }

    async fn heartbeat(
        &self,
        worker_id: String,
        stats: Option<WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<HeartbeatReply> {
        // Only a heartbeat that names its held leases can change the
        // database (it may re-queue lost leases); the rest need no commit.
        if held.is_some() {
            self.writer
                .write(move |s, c| s.heartbeat(c, &worker_id, stats, held))
                .await
        } else {
            // Freshness lives in memory and survives a rollback: a batch
            // that fails to commit (disk full) must not end the worker's
            // heartbeat stream, or the worker could not reconnect until
            // the store commits again and would go stale meanwhile.
            self.writer
                .run_uncommitted(move |s, c| s.heartbeat(c, &worker_id, stats, None))
                .await
        }
    }

    fn close_stream(&self, worker_id: String, kind: StreamKind, stream_id: u64) {
        // Letting the stream go writes no SQL and runs while the store
        // cannot commit too: a dropped close would leave the worker
        // "connected" to a dead stream, its leases sent nowhere.
        let id = worker_id.clone();
        self.writer.submit_run(move |s, _| {
            s.detach_stream(&id, kind, stream_id);
            Ok(())
        });
        if kind == StreamKind::Heartbeat && self.cfg.lease_grace.is_zero() {
            // Refused while the store cannot commit: the reaper tick
            // re-queues them once it can.
            self.writer
                .submit(move |s, c| s.lose_if_suspect(c, &worker_id));
        }
    }

    async fn open_lease_stream(&self, worker_id: String, tx: EventTx<JobLease>) -> Result<u64> {
        validate::worker_id(&worker_id)?;
        self.writer
            .run(move |s, c| s.open_lease_stream(c, &worker_id, tx))
            .await
    }

    async fn update_job(&self, mut report: JobReport) -> Result<JobStatus> {
        validate::report(&mut report, self.cfg.max_report_bytes)?;
        // Encoded here, off the writer thread.
        let results = jstore::encode_task_results(&report.task_results);
        // update_job checks the lease, fencing and request before it
        // writes: no savepoint needed (see `Writer::write_direct`). The
        // report and its encoded results come back to be freed here, off
        // the writer thread.
        let (status, _report, _results) = self
            .writer
            .write_direct(move |s, c| {
                s.update_job(c, &report, results.as_deref())
                    .map(|status| (status, report, results))
            })
            .await?;
        Ok(status)
    }

    async fn batch_update_jobs(
        &self,
        worker_id: String,
        reports: Vec<JobReport>,
    ) -> Result<Vec<Result<JobStatus>>> {
        let reports = validate::batch(&worker_id, reports)?;
        // All are queued to the writer at once, so they share commits.
        Ok(futures_util::future::join_all(reports.into_iter().map(|r| self.update_job(r))).await)
    }

    async fn unregister_worker(&self, worker_id: String) -> Result<u32> {
        validate::worker_id(&worker_id)?;
        self.writer
            .write(move |s, c| s.unregister(c, &worker_id))
            .await
    }

    async fn drain_worker(&self, worker_id: String) -> Result<Worker> {
        validate::worker_id(&worker_id)?;
        self.writer.write(move |s, c| s.drain(c, &worker_id)).await
    }

    async fn forget_worker(&self, worker_id: String) -> Result<()> {
        validate::worker_id(&worker_id)?;
        self.writer.write(move |s, c| s.forget(c, &worker_id)).await
    }

    async fn release_worker(&self, worker_id: String) -> Result<Worker> {
        validate::worker_id(&worker_id)?;
        self.writer
            .write(move |s, c| s.release_quarantine(c, &worker_id))
            .await
    }

    async fn list_workers(&self, state: Option<WorkerState>) -> Result<Vec<Worker>> {
        self.writer.run(move |s, _| Ok(s.worker_views(state))).await
    }

    async fn get_worker(&self, worker_id: String) -> Result<Worker> {
        validate::worker_id(&worker_id)?;
        self.writer.run(move |s, _| s.worker_view(&worker_id)).await
    }

    async fn queue_stats(&self) -> Result<QueueStats> {
        self.writer.run(|s, _| Ok(s.queue_stats())).await
    }

    async fn peek_queue(&self, queue: QueueName, count: u32) -> Result<Vec<String>> {
        let count = validate::peek_count(count)?;
        self.writer
            .run(move |s, c| jstore::job_ids(c, &s.peek(queue, count)))
            .await
    }

    async fn metrics_text(&self) -> Result<String> {
        let (counts, queue, workers) = self
            .writer
            .run(|s, _| Ok((s.job_counts(), s.queue_stats(), s.worker_counts())))
            .await?;
        loops::refresh_gauges(&self.metrics, &counts, &queue, &workers, true);
        Ok(self.metrics.encode())
    }

    fn metrics(&self) -> &SharedMetrics {
        &self.metrics
    }

    fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    fn store_health(&self) -> watch::Receiver<bool> {
        self.health.subscribe()
    }

    fn watch_streams(&self) -> usize {
        self.watchers.count()
    }

    async fn close(&self) {
        let _ = self.stop_loops.send(true);
        let checkpointer = self
            .checkpointer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(c) = checkpointer {
            let _ = tokio::task::spawn_blocking(move || c.stop()).await;
        }
        self.writer.stop();
        let thread = self
            .writer_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(t) = thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        // The writer has stopped: another process may write now.
        drop(
            self.db_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }

    async fn verify_worker(
        &self,
        worker_id: String,
        command: String,
        args: Vec<String>,
    ) -> Result<Verification> {
        validate::worker_id(&worker_id)?;
        validate::challenge(&command, &args)?;
        self.writer
            .write_direct(move |s, _| s.verify_worker(&worker_id, &command, args))
            .await
    }

    async fn answer_verification(
        &self,
        worker_id: String,
        answer: VerificationAnswer,
    ) -> Result<()> {
        validate::worker_id(&worker_id)?;
        let answer = validate::verification_answer(answer)?;
        self.writer
            .write_direct(move |s, c| s.answer_verification(c, &worker_id, answer))
            .await
    }

    async fn create_schedule(&self, schedule: Schedule) -> Result<Schedule> {
        let s = validate::schedule(schedule, &self.cfg, now_ms())?;
        let stored = self
            .writer
            .write_direct(move |st, c| st.create_schedule(c, s))
            .await?;
        self.schedules_changed.notify_one();
        Ok(stored)
    }

    async fn get_schedule(&self, schedule_id: String) -> Result<Schedule> {
        validate::schedule_id(&schedule_id)?;
        self.read(move |c| {
            sql::schedules::get(c, &schedule_id)?
                .ok_or_else(|| Error::not_found(format!("schedule {schedule_id} not found")))
        })
        .await
    }

    async fn list_schedules(&self, page_size: u32, page_token: String) -> Result<Page<Schedule>> {
        let limit = page::page_size(page_size)?;
        let after = page::decode_token("schedule", &page_token)?;
        let found = self
            .read(move |c| sql::schedules::list(c, after.as_deref(), limit + 1))
            .await?;
        let (items, next_page_token) = page::split_page_within(
            found,
            limit,
            "schedule",
            |s| s.schedule_id.clone(),
            |s| validate::input_bytes(&s.inputs),
            page::PAGE_BYTES,
        );
        Ok(Page {
            items,
            next_page_token,
        })
    }

    async fn set_schedule_paused(&self, schedule_id: String, paused: bool) -> Result<Schedule> {
        validate::schedule_id(&schedule_id)?;
        let s = self
            .writer
            .write_direct(move |st, c| st.set_schedule_paused(c, &schedule_id, paused))
            .await?;
        self.schedules_changed.notify_one();
        Ok(s)
    }

    async fn delete_schedule(&self, schedule_id: String) -> Result<()> {
        validate::schedule_id(&schedule_id)?;
        self.writer
            .write_direct(move |st, c| st.delete_schedule(c, &schedule_id))
            .await
    }
}
