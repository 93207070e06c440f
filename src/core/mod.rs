//! The AGQ core: validation, the job state machine, the scheduler and the
//! reaper, behind [`Engine`]. It knows nothing of gRPC transport; the
//! services in `crate::service` decode requests, call it and encode replies.

pub mod jobs;
pub mod scheduler;
pub mod state;
pub mod validate;
pub mod workers;

use std::{sync::Arc, time::Duration};

use tokio::sync::watch;

use self::{
    jobs::{NewAction, NewJob},
    state::{State, StreamTx, WatchSubscription, Watchers},
    workers::StreamKind,
};
use crate::{
    config::EngineConfig,
    error::{Error, Result},
    metrics::{status_name, SharedMetrics, StatusLabel, WorkerLabel},
    pb::{self, JobStatus, WorkerState},
    store::{
        self, jobs as jstore, plans as pstore,
        writer::{StoreHealth, Writer},
        ReadPool,
    },
    time::ms_of,
};

/// Default and largest page sizes of list RPCs.
const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

/// Handle to the core. Cheap to share behind an `Arc`.
pub struct Engine {
    writer: Writer<State>,
    pool: ReadPool,
    cfg: EngineConfig,
    metrics: SharedMetrics,
    watchers: Arc<Watchers>,
    writer_thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    checkpointer: std::sync::Mutex<Option<store::Checkpointer>>,
    stop_reaper: watch::Sender<bool>,
    health: StoreHealth,
}

fn page_size(n: u32) -> Result<usize> {
    match n {
        0 => Ok(DEFAULT_PAGE as usize),
        n if n <= MAX_PAGE => Ok(n as usize),
        n => Err(Error::invalid(format!(
            "page_size must be at most {MAX_PAGE}, got {n}"
        ))),
    }
}

fn encode_token(kind: &str, value: &str) -> String {
    hex::encode(format!("{kind}:{value}"))
}

fn decode_token(kind: &str, token: &str) -> Result<Option<String>> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || Error::invalid("page_token is not a token this server issued");
    let raw = hex::decode(token).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let value = text
        .strip_prefix(kind)
        .and_then(|r| r.strip_prefix(':'))
        .ok_or_else(bad)?;
    Ok(Some(value.to_string()))
}

fn row_token(token: &str) -> Result<i64> {
    match decode_token("job", token)? {
        None => Ok(0),
        Some(v) => v
            .parse()
            .map_err(|_| Error::invalid("page_token is not a token this server issued")),
    }
}

impl Engine {
    /// Opens the store at `db`, recovers the state (leases of workers that
    /// do not come back return to pending after the grace), starts the
    /// writer thread and the reaper.
    ///
    /// Errors: storage errors opening or recovering the database.
    pub async fn open(
        db: &std::path::Path,
        cfg: EngineConfig,
        metrics: SharedMetrics,
    ) -> Result<Arc<Engine>> {
        let (conn, pool) = store::open(db, cfg.synchronous)?;
        let checkpointer = store::Checkpointer::start(db, cfg.synchronous)?;
        let watchers = Arc::new(Watchers::new(
            cfg.max_watch_streams,
            cfg.max_watch_streams_per_connection,
            metrics.watch_streams.clone(),
        ));
        let state = State::new(cfg.clone(), metrics.clone(), watchers.clone());
        let health = StoreHealth::new(metrics.store_write_errors.clone());
        let (writer, thread) = Writer::start(conn, state, checkpointer.signal(), health.clone())?;
        writer.write(|s, c| s.load(c)).await?;
        let (stop_reaper, stop_rx) = watch::channel(false);
        let engine = Arc::new(Engine {
            writer,
            pool,
            cfg,
            metrics,
            watchers,
            writer_thread: std::sync::Mutex::new(Some(thread)),
            checkpointer: std::sync::Mutex::new(Some(checkpointer)),
            stop_reaper,
            health,
        });
        {
            let mut up = engine.health.subscribe();
            let gauge = engine.metrics.store_up.clone();
            let mut stop = stop_rx.clone();
            tokio::spawn(async move {
                loop {
                    gauge.set(i64::from(*up.borrow_and_update()));
                    tokio::select! {
                        r = up.changed() => if r.is_err() { return },
                        _ = stop.changed() => return,
                    }
                }
            });
        }
        if let Some(retention) = engine.cfg.job_retention {
            tokio::spawn(retention_sweeper(
                engine.writer.clone(),
                retention,
                stop_rx.clone(),
            ));
        }
        tokio::spawn(reaper(engine.writer.clone(), engine.tick_period(), stop_rx));
        Ok(engine)
    }

    /// How often the reaper runs: a tenth of the heartbeat interval or of
    /// the grace, between 10 ms and 1 s.
    fn tick_period(&self) -> Duration {
        let base = self
            .cfg
            .heartbeat_interval
            .min(if self.cfg.lease_grace.is_zero() {
                self.cfg.heartbeat_interval
            } else {
                self.cfg.lease_grace
            });
        (base / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }

    /// The settings the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// A receiver of whether the store can commit: false from a commit
    /// that failed for a cause outside AGQ (disk full, I/O error) until a
    /// commit succeeds again. The server turns gRPC health NOT_SERVING
    /// while it is false.
    pub fn store_health(&self) -> watch::Receiver<bool> {
        self.health.subscribe()
    }

    /// The metrics.
    pub fn metrics(&self) -> &SharedMetrics {
        &self.metrics
    }

    /// Stops the reaper, the checkpoint thread and the writer (after the
    /// queued operations), and closes the database cleanly. Later calls fail with `Unavailable`.
    pub async fn close(&self) {
        let _ = self.stop_reaper.send(true);
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

    // ---- plans ----

    /// Validates and stores a plan (seed: PLAN.SUBMIT).
    ///
    /// Errors: `InvalidArgument` (the rule broken), `AlreadyExists`.
    pub async fn submit_plan(&self, plan: Option<pb::Plan>) -> Result<String> {
        let plan = plan.ok_or_else(|| Error::invalid("plan is required"))?;
        validate::plan(&plan)?;
        self.writer.write(move |s, c| s.submit_plan(c, plan)).await
    }

    /// One plan (seed: PLAN.GET). Errors: `InvalidArgument`, `NotFound`.
    pub async fn get_plan(&self, plan_id: String) -> Result<pb::Plan> {
        validate::object_id("plan_id", &plan_id)?;
        self.read(move |c| {
            pstore::get(c, &plan_id)?
                .ok_or_else(|| Error::not_found(format!("plan {plan_id} not found")))
        })
        .await
    }

    /// Plan ids matching a glob, paginated (seed: PLAN.LIST).
    /// Errors: `InvalidArgument` (pattern, page size or token).
    pub async fn list_plans(&self, req: pb::ListPlansRequest) -> Result<pb::ListPlansResponse> {
        let limit = page_size(req.page_size)?;
        if req.pattern.len() > 256 || req.pattern.contains('\0') {
            return Err(Error::invalid(
                "pattern must be at most 256 bytes without NUL",
            ));
        }
        // One dialect: the pattern that validates here is the one that
        // matches in the store.
        let pattern = if req.pattern.is_empty() {
            None
        } else {
            Some(
                glob::Pattern::new(&req.pattern)
                    .map_err(|e| Error::invalid(format!("bad glob pattern: {e}")))?,
            )
        };
        let after = decode_token("plan", &req.page_token)?.unwrap_or_default();
        let mut ids = self
            .read(move |c| pstore::list(c, pattern.as_ref(), &after, limit + 1))
            .await?;
        let next = if ids.len() > limit {
            ids.truncate(limit);
            ids.last()
                .map(|l| encode_token("plan", l))
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok(pb::ListPlansResponse {
            plan_ids: ids,
            next_page_token: next,
        })
    }

    /// Deletes a plan (seed: PLAN.DELETE).
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition` while in use.
    pub async fn delete_plan(&self, plan_id: String) -> Result<()> {
        validate::object_id("plan_id", &plan_id)?;
        self.writer
            .write(move |s, c| s.delete_plan(c, &plan_id))
            .await
    }

    // ---- actions ----

    /// Validates and creates an action with one job per input, atomically
    /// (seed: ACTION.SUBMIT). Returns (action_id, job_ids).
    ///
    /// Errors: `InvalidArgument` (ids, inputs, limits, max_attempts, run_at
    /// not a valid time or further ahead than `max_run_at_ahead`),
    /// `NotFound` (plan), `AlreadyExists` (action id).
    pub async fn submit_action(
        &self,
        req: pb::SubmitActionRequest,
    ) -> Result<(String, Vec<String>)> {
        validate::object_id("plan_id", &req.plan_id)?;
        let action_id = if req.action_id.is_empty() {
            uuid::Uuid::now_v7().to_string()
        } else {
            validate::object_id("action_id", &req.action_id)?;
            req.action_id
        };
        if req.inputs.is_empty() {
            return Err(Error::invalid("an action needs at least one input"));
        }
        let max = self.cfg.max_inputs_per_action;
        if req.inputs.len() > max {
            return Err(Error::invalid(format!(
                "an action has at most {max} inputs (max_inputs_per_action), got {}",
                req.inputs.len()
            )));
        }
        for (i, input) in req.inputs.iter().enumerate() {
            validate::action_input(i, &input.values)?;
        }
        let max_attempts = match req.max_attempts {
            0 => 3,
            n if n <= validate::MAX_ATTEMPTS => n,
            n => {
                return Err(Error::invalid(format!(
                    "max_attempts must be in 1..={}, got {n}",
                    validate::MAX_ATTEMPTS
                )))
            }
        };
        let run_at_ms = match &req.run_at {
            None => None,
            Some(t) => {
                let ms =
                    ms_of(t).ok_or_else(|| Error::invalid("run_at is not a valid timestamp"))?;
                let ahead =
                    i64::try_from(self.cfg.max_run_at_ahead.as_millis()).unwrap_or(i64::MAX);
                if ms > store::now_ms().saturating_add(ahead) {
                    return Err(Error::invalid(format!(
                        "run_at is more than {} s ahead (--max-run-at-ahead-secs); schedule it nearer",
                        self.cfg.max_run_at_ahead.as_secs()
                    )));
                }
                Some(ms)
            }
        };
        let a = NewAction {
            action_id: action_id.clone(),
            plan_id: req.plan_id,
            jobs: req
                .inputs
                .into_iter()
                .map(|i| NewJob::new(i.values))
                .collect::<Result<_>>()?,
            run_at_ms,
            max_attempts,
        };
        let ids = self
            .writer
            .write_direct(move |s, c| s.submit_action(c, a))
            .await?;
        Ok((action_id, ids))
    }

    /// Aggregate status of an action (seed: ACTION.STATUS).
    /// Errors: `InvalidArgument`, `NotFound`.
    pub async fn get_action(&self, action_id: String) -> Result<pb::ActionStatus> {
        validate::object_id("action_id", &action_id)?;
        self.read(move |c| {
            jstore::action_status(c, &action_id)?
                .ok_or_else(|| Error::not_found(format!("action {action_id} not found")))
        })
        .await
    }

    /// A subscription that changes whenever a job of the action changes
    /// status, for one WatchAction stream from `connection` (the client's
    /// address). The id is checked before anything is registered; the
    /// subscription gives its place back when dropped.
    ///
    /// Errors: `InvalidArgument` (bad id), `ResourceExhausted` (too many
    /// streams open in all or on this connection).
    pub fn watch_action(
        &self,
        action_id: &str,
        connection: Option<std::net::SocketAddr>,
    ) -> Result<WatchSubscription> {
        validate::object_id("action_id", action_id)?;
        self.watchers.subscribe(action_id, connection)
    }

    /// Open WatchAction subscriptions (the `agq_watch_streams` gauge).
    pub fn watch_streams(&self) -> usize {
        self.watchers.count()
    }

    // ---- jobs ----

    /// One job with task results and, when waiting, why (seed: JOB.STATUS).
    /// Errors: `InvalidArgument`, `NotFound`.
    pub async fn get_job(&self, job_id: String) -> Result<pb::Job> {
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

    /// The job at `row` with its task results and, when it waits, why.
    async fn job_by_row(&self, row: i64) -> Result<pb::Job> {
        let mut job = self
            .read(move |c| {
                jstore::get_by_row(c, row, true)?.ok_or_else(|| Error::not_found("job vanished"))
            })
            .await?;
        if job.status == JobStatus::Pending as i32 || job.status == JobStatus::Failed as i32 {
            job.waiting_reason = self
                .writer
                .run(move |s, _| Ok(s.waiting_reason(row)))
                .await?;
        }
        Ok(job)
    }

    /// Job ids by filter, paginated (seed: JOB.LIST and JOBS.SEARCH).
    /// Errors: `InvalidArgument` (page size, token, status), `NotFound`
    /// (unknown action when filtering by action).
    pub async fn search_jobs(
        &self,
        filter: jstore::JobFilter,
        page: u32,
        token: String,
    ) -> Result<(Vec<String>, String)> {
        let limit = page_size(page)?;
        let after = row_token(&token)?;
        if let Some(s) = filter.status {
            if JobStatus::try_from(s).is_err() {
                return Err(Error::invalid(format!("unknown job status {s}")));
            }
        }
        if let Some(a) = &filter.action_id {
            validate::object_id("action_id", a)?;
        }
        if let Some(p) = &filter.plan_id {
            validate::object_id("plan_id", p)?;
        }
        let rows = self
            .read(move |c| {
                if let Some(a) = &filter.action_id {
                    if !jstore::action_exists(c, a)? {
                        return Err(Error::not_found(format!("action {a} not found")));
                    }
                }
                jstore::search(c, &filter, after, limit + 1)
            })
            .await?;
        let mut rows = rows;
        let next = if rows.len() > limit {
            rows.truncate(limit);
            rows.last()
                .map(|(r, _)| encode_token("job", &r.to_string()))
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok((rows.into_iter().map(|(_, id)| id).collect(), next))
    }

    /// Retries a failed or dead job (seed: JOB.RETRY).
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition`.
    pub async fn retry_job(&self, job_id: String) -> Result<pb::Job> {
        validate::object_id("job_id", &job_id)?;
        let row = self
            .writer
            .write(move |s, c| s.retry_job(c, &job_id))
            .await?;
        self.job_by_row(row).await
    }

    /// Cancels a pending or running job.
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition`.
    pub async fn cancel_job(&self, job_id: String) -> Result<pb::Job> {
        validate::object_id("job_id", &job_id)?;
        let row = self
            .writer
            .write(move |s, c| s.cancel_job(c, &job_id))
            .await?;
        self.job_by_row(row).await
    }

    // ---- workers ----

    /// Registers a worker (seed: WORKER.REGISTER); returns the heartbeat
    /// interval and whether the same instance resumed (see
    /// [`State::register`]).
    /// Errors: `InvalidArgument`, `AlreadyExists` (another live instance
    /// holds the id), `Unavailable` (the store cannot commit).
    pub async fn register_worker(
        &self,
        req: pb::RegisterWorkerRequest,
    ) -> Result<(Duration, bool)> {
        let req = validate::registration(&req)?;
        let resumed = self.writer.write(move |s, c| s.register(c, req)).await?;
        Ok((self.cfg.heartbeat_interval, resumed))
    }

    /// Attaches a heartbeat stream. Errors: `NotFound`, `FailedPrecondition`.
    pub async fn open_heartbeat(
        &self,
        worker_id: String,
        tx: StreamTx<pb::HeartbeatResponse>,
    ) -> Result<u64> {
        validate::worker_id(&worker_id)?;
        self.writer
            .run(move |s, _| s.open_heartbeat(&worker_id, tx))
            .await
    }

    /// Records one heartbeat. Errors: `NotFound`, `FailedPrecondition`.
    pub async fn heartbeat(
        &self,
        worker_id: String,
        stats: Option<pb::WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<pb::HeartbeatResponse> {
        if held.is_some() {
            self.writer
                .write(move |s, c| s.heartbeat(c, &worker_id, stats, held))
                .await
        } else {
            self.writer
                .run(move |s, c| s.heartbeat(c, &worker_id, stats, None))
                .await
        }
    }

    /// Reports that a stream ended (fire and forget).
    pub fn close_stream(&self, worker_id: String, kind: StreamKind, sid: u64) {
        self.writer
            .submit(move |s, c| s.close_stream(c, &worker_id, kind, sid));
    }

    /// Attaches a lease stream. Errors: `NotFound`, `FailedPrecondition`.
    pub async fn open_lease_stream(
        &self,
        worker_id: String,
        tx: StreamTx<pb::JobLease>,
    ) -> Result<u64> {
        validate::worker_id(&worker_id)?;
        self.writer
            .run(move |s, _| s.open_lease_stream(&worker_id, tx))
            .await
    }

    /// Applies several fenced reports of one worker (BatchUpdateJobs; seed:
    /// JOB.UPDATE, batched). A report with an empty worker_id is `worker_id`'s.
    /// Each report is applied as by [`Engine::update_job`], independently;
    /// all are queued to the writer at once, so they share group commits.
    /// Returns one outcome per report, in order, each committed.
    ///
    /// Errors (nothing applied): `InvalidArgument` for a bad `worker_id`,
    /// no reports, more than [`validate::MAX_BATCH_REPORTS`], or a report
    /// naming another worker.
    pub async fn batch_update_jobs(
        &self,
        worker_id: &str,
        mut reqs: Vec<pb::UpdateJobRequest>,
    ) -> Result<Vec<Result<JobStatus>>> {
        validate::worker_id(worker_id)?;
        if reqs.is_empty() || reqs.len() > validate::MAX_BATCH_REPORTS {
            return Err(Error::invalid(format!(
                "a batch carries 1..={} reports, got {}",
                validate::MAX_BATCH_REPORTS,
                reqs.len()
            )));
        }
        for (i, r) in reqs.iter_mut().enumerate() {
            if r.worker_id.is_empty() {
                r.worker_id = worker_id.to_string();
            } else if r.worker_id != worker_id {
                return Err(Error::invalid(format!(
                    "report {i} names worker {:?}, not the batch's worker {worker_id}",
                    r.worker_id
                )));
            }
        }
        Ok(futures_util::future::join_all(reqs.into_iter().map(|r| self.update_job(r))).await)
    }

    /// Applies a fenced job report (seed: JOB.UPDATE).
    /// Errors: `InvalidArgument`, `NotFound`, `PermissionDenied`,
    /// `FailedPrecondition`, `ResourceExhausted` (task results and error
    /// over `max_report_bytes`), `Unavailable` (the store cannot commit).
    pub async fn update_job(&self, req: pb::UpdateJobRequest) -> Result<JobStatus> {
        validate::object_id("job_id", &req.job_id)?;
        validate::worker_id(&req.worker_id)?;
        if req.lease_id.is_empty() || req.lease_id.len() > 64 {
            return Err(Error::invalid("lease_id is required (at most 64 bytes)"));
        }
        if req.task_results.len() > validate::MAX_TASKS {
            return Err(Error::invalid(format!(
                "at most {} task results",
                validate::MAX_TASKS
            )));
        }
        validate::report_size(&req, self.cfg.max_report_bytes)?;
        // update_job checks the lease, fencing and request before it
        // writes: no savepoint needed (see `Writer::write_direct`).
        self.writer
            .write_direct(move |s, c| s.update_job(c, req))
            .await
    }

    /// Deregisters a worker (seed: WORKER.UNREGISTER); returns re-queued jobs.
    /// Errors: `InvalidArgument`, `NotFound`.
    pub async fn unregister_worker(&self, worker_id: String) -> Result<u32> {
        validate::worker_id(&worker_id)?;
        self.writer
            .write(move |s, c| s.unregister(c, &worker_id))
            .await
    }

    /// Drains a worker. Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition`.
    pub async fn drain_worker(&self, worker_id: String) -> Result<pb::Worker> {
        validate::worker_id(&worker_id)?;
        self.writer.write(move |s, c| s.drain(c, &worker_id)).await
    }

    /// Workers, optionally of one state (seed: KEYS worker:*:alive).
    pub async fn list_workers(&self, state: Option<WorkerState>) -> Result<Vec<pb::Worker>> {
        self.writer.run(move |s, _| Ok(s.worker_views(state))).await
    }

    /// One worker (seed: GET worker:<id>:stats). Errors: `InvalidArgument`, `NotFound`.
    pub async fn get_worker(&self, worker_id: String) -> Result<pb::Worker> {
        validate::worker_id(&worker_id)?;
        self.writer.run(move |s, _| s.worker_view(&worker_id)).await
    }

    // ---- queue ----

    /// Queue depths and worker counts (seed: QUEUE.STATS).
    pub async fn queue_stats(&self) -> Result<pb::GetQueueStatsResponse> {
        self.writer.run(|s, _| Ok(s.queue_stats())).await
    }

    /// Next job ids of the ready or scheduled queue (seed: QUEUE.PEEK).
    /// Errors: `InvalidArgument` for an unknown queue or count over 1000.
    pub async fn peek_queue(&self, queue: String, count: u32) -> Result<Vec<String>> {
        let count = match count {
            0 => 10,
            n if n <= MAX_PAGE => n as usize,
            n => {
                return Err(Error::invalid(format!(
                    "count must be at most {MAX_PAGE}, got {n}"
                )))
            }
        };
        let scheduled = match queue.as_str() {
            "" | "ready" => false,
            "scheduled" => true,
            q => {
                return Err(Error::invalid(format!(
                    "queue must be \"ready\" or \"scheduled\", got {q:?}"
                )))
            }
        };
        self.writer
            .run(move |s, c| {
                let rows: Vec<i64> = if scheduled {
                    s.delayed.iter().take(count).map(|(_, r)| *r).collect()
                } else {
                    s.ready.keys().take(count).copied().collect()
                };
                jstore::job_ids(c, &rows)
            })
            .await
    }

    /// Refreshes the gauges from the current state and returns the metrics
    /// in Prometheus text format (seed: METRICS).
    pub async fn metrics_text(&self) -> Result<String> {
        let counts = self.read(jstore::count_by_status).await?;
        let (depth, workers) = self
            .writer
            .run(|s, _| {
                let q = s.queue_stats();
                let now = std::time::Instant::now();
                let mut w = std::collections::HashMap::<(String, bool), i64>::new();
                for e in s.workers.values() {
                    *w.entry((
                        workers::state_name(e.state).to_lowercase(),
                        s.is_fresh(e, now),
                    ))
                    .or_default() += 1;
                }
                Ok(((q.ready_length, q.scheduled_length, q.running_length), w))
            })
            .await?;
        let m = &self.metrics;
        for status in [
            JobStatus::Pending,
            JobStatus::Running,
            JobStatus::Completed,
            JobStatus::Failed,
            JobStatus::Dead,
            JobStatus::Cancelled,
        ] {
            let n = counts.get(&(status as i32)).copied().unwrap_or(0);
            m.jobs
                .get_or_create(&StatusLabel {
                    status: status_name(status).into(),
                })
                .set(n);
        }
        let q = |name: &str| crate::metrics::QueueLabel { queue: name.into() };
        m.queue_depth.get_or_create(&q("ready")).set(depth.0 as i64);
        m.queue_depth
            .get_or_create(&q("scheduled"))
            .set(depth.1 as i64);
        m.queue_depth
            .get_or_create(&q("running"))
            .set(depth.2 as i64);
        m.workers.clear();
        for state in ["active", "draining", "dead", "unregistered"] {
            for fresh in [true, false] {
                let n = workers
                    .get(&(state.to_string(), fresh))
                    .copied()
                    .unwrap_or(0);
                m.workers
                    .get_or_create(&WorkerLabel {
                        state: state.into(),
                        fresh: fresh.to_string(),
                    })
                    .set(n);
            }
        }
        Ok(m.encode())
    }
}

/// Most jobs one retention operation deletes: it holds the single writer
/// for a few milliseconds; the sweeper queues the next one after it.
const EXPIRE_CHUNK: usize = 100;

/// The retention loop: every tenth of `retention` (between 100 ms and
/// 1 minute) deletes the actions finished longer than `retention` ago, in
/// operations of at most [`EXPIRE_CHUNK`] jobs, each queued once the one
/// before it committed so other work runs in between; then gives free
/// pages beyond the slack back to the file system
/// ([`store::retention::vacuum_some`]).
async fn retention_sweeper(
    writer: Writer<State>,
    retention: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let period = (retention / 10).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.changed() => return,
        }
        let cutoff_ms = store::now_ms().saturating_sub(retention_ms);
        let mut expired = 0;
        loop {
            if *stop.borrow() {
                return;
            }
            match writer
                .write_direct(move |s, c| s.expire_finished(c, cutoff_ms, EXPIRE_CHUNK))
                .await
            {
                Ok(0) => break,
                Ok(n) => expired += n,
                Err(Error::Unavailable) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "retention sweep failed");
                    break;
                }
            }
        }
        if expired > 0 {
            tracing::debug!(expired, "retention sweep deleted finished jobs and actions");
            loop {
                match writer
                    .write_direct(|_, c| store::retention::vacuum_some(c))
                    .await
                {
                    Ok(n) if n >= store::retention::VACUUM_MAX_PAGES => {}
                    Ok(_) | Err(Error::Unavailable) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "incremental vacuum failed");
                        break;
                    }
                }
            }
        }
    }
}

/// The reaper loop: runs [`State::tick`] every `period` until stopped.
async fn reaper(writer: Writer<State>, period: Duration, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {
                if !writer.submit(|s, c| s.tick(c)) {
                    return;
                }
            }
            _ = stop.changed() => return,
        }
    }
}
