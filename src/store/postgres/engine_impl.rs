//! [`Engine`] for [`PgEngine`]: validation first (shared with every
//! engine, [`crate::core::validate`]), then the PostgreSQL operation.

use std::{net::SocketAddr, sync::atomic::Ordering};

use tokio::sync::watch;

use super::PgEngine;
use crate::{
    config::EngineConfig,
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
        watch::WatchSubscription,
    },
    error::{Error, Result},
    metrics::SharedMetrics,
    time::now_ms,
};

#[async_trait::async_trait]
impl Engine for PgEngine {
    async fn submit_plan(&self, mut plan: Plan, replace: bool) -> Result<SubmittedPlan> {
        validate::plan(&plan)?;
        validate::task_timeouts(&plan, self.cfg.job_timeout)?;
        plan.worker_selector = validate::worker_selector(&plan.worker_selector)?;
        let r = self.pg_submit_plan(plan, replace).await;
        self.observe(r)
    }

    async fn get_plan(&self, plan_id: String, version: Option<u32>) -> Result<Plan> {
        validate::object_id("plan_id", &plan_id)?;
        let r = self.pg_get_plan(plan_id, version).await;
        self.observe(r)
    }

    async fn list_plans(&self, query: PlanQuery) -> Result<Page<PlanSummary>> {
        let r = self.pg_list_plans(query).await;
        self.observe(r)
    }

    async fn list_plan_versions(&self, query: PlanVersionQuery) -> Result<Page<PlanVersion>> {
        validate::object_id("plan_id", &query.plan_id)?;
        page::page_size(query.page_size)?;
        let before = page::plan_version_cursor(&query.plan_id, &query.page_token)?;
        let r = self.pg_list_plan_versions(query, before).await;
        self.observe(r)
    }

    async fn delete_plan(&self, plan_id: String) -> Result<()> {
        validate::object_id("plan_id", &plan_id)?;
        let r = self.pg_delete_plan(plan_id).await;
        self.observe(r)
    }

    async fn submit_action(&self, action: ActionRequest) -> Result<SubmittedAction> {
        // A client's id in the form of a schedule's tick is checked
        // against the schedules (an id the engine makes never is).
        let chosen = !action.action_id.is_empty();
        let v = validate::action(action, &self.cfg, now_ms())?;
        let action_id = v.action_id.clone();
        let reserved = chosen
            .then(|| validate::tick_schedule(&action_id).map(str::to_owned))
            .flatten();
        let r = self.pg_submit_action(v, reserved).await;
        let job_ids = self.observe(r)?;
        Ok(SubmittedAction { action_id, job_ids })
    }

    async fn get_action(&self, action_id: String) -> Result<ActionStatus> {
        validate::object_id("action_id", &action_id)?;
        let r = self.pg_get_action(&action_id).await;
        self.observe(r)
    }

    fn watch_action(
        &self,
        action_id: &str,
        connection: Option<SocketAddr>,
    ) -> Result<WatchSubscription> {
        validate::object_id("action_id", action_id)?;
        self.watchers.subscribe(action_id, connection)
    }

    async fn list_actions(&self, query: ActionQuery) -> Result<Page<ActionStatus>> {
        page::page_size(query.page_size)?;
        validate::action_query(&query)?;
        let after = match page::decode_token(&query.page_kind(), &query.page_token)? {
            None => None,
            Some(v) => {
                let bad = page::bad_token;
                let (t, s) = v.split_once(':').ok_or_else(bad)?;
                Some((
                    t.parse::<i64>().map_err(|_| bad())?,
                    s.parse::<i64>().map_err(|_| bad())?,
                ))
            }
        };
        let r = self.pg_list_actions(query, after).await;
        self.observe(r)
    }

    async fn cancel_action(&self, action_id: String) -> Result<(u32, ActionStatus)> {
        validate::object_id("action_id", &action_id)?;
        let r = self.pg_cancel_action(&action_id).await;
        let n = self.observe(r)?;
        Ok((n, self.get_action(action_id).await?))
    }

    async fn retry_action(
        &self,
        action_id: String,
        status: Option<JobStatus>,
    ) -> Result<(u32, ActionStatus)> {
        validate::object_id("action_id", &action_id)?;
        validate::retry_filter(status)?;
        let r = self.pg_retry_action(&action_id, status).await;
        let n = self.observe(r)?;
        Ok((n, self.get_action(action_id).await?))
    }

    async fn get_job(&self, job_id: String) -> Result<Job> {
        validate::object_id("job_id", &job_id)?;
        let r = self.pg_get_job(&job_id).await;
        self.observe(r)
    }

    async fn search_jobs(&self, query: JobQuery) -> Result<Page<String>> {
        page::page_size(query.page_size)?;
        page::decode_number(&query.page_kind(), &query.page_token)?;
        if let Some(a) = &query.action_id {
            validate::object_id("action_id", a)?;
        }
        if let Some(p) = &query.plan_id {
            validate::object_id("plan_id", p)?;
        }
        validate::created_range(query.created_after_ms, query.created_before_ms)?;
        let r = self.pg_search_jobs(query).await;
        self.observe(r)
    }

    async fn retry_job(&self, job_id: String, priority: Option<i32>) -> Result<Job> {
        validate::object_id("job_id", &job_id)?;
        if let Some(p) = priority {
            validate::priority(p)?;
        }
        let r = self.pg_retry_job(&job_id, priority).await;
        self.observe(r)?;
        self.get_job(job_id).await
    }

    async fn cancel_job(&self, job_id: String) -> Result<Job> {
        validate::object_id("job_id", &job_id)?;
        let r = self.pg_cancel_job(&job_id).await;
        self.observe(r)?;
        self.get_job(job_id).await
    }

    async fn register_worker(&self, registration: Registration) -> Result<Registered> {
        let reg = validate::registration(registration)?;
        let r = self.pg_register(reg).await;
        let resumed = self.observe(r)?;
        Ok(Registered {
            heartbeat_interval: self.cfg.heartbeat_interval,
            resumed,
        })
    }

    async fn open_heartbeat(&self, worker_id: String, tx: EventTx<HeartbeatEvent>) -> Result<u64> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_open_heartbeat(worker_id, tx).await;
        self.observe(r)
    }

    async fn heartbeat(
        &self,
        worker_id: String,
        stats: Option<WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<HeartbeatReply> {
        let r = self.pg_heartbeat(worker_id, stats, held).await;
        self.observe(r)
    }

    fn close_stream(&self, worker_id: String, kind: StreamKind, stream_id: u64) {
        let Some(engine) = self.me() else { return };
        tokio::spawn(async move {
            let r = engine.pg_close_stream(worker_id, kind, stream_id).await;
            if let Err(e) = engine.observe(r) {
                tracing::warn!(error = %e, "closing a worker stream was not recorded");
            }
        });
    }

    async fn open_lease_stream(&self, worker_id: String, tx: EventTx<JobLease>) -> Result<u64> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_open_lease_stream(worker_id, tx).await;
        self.observe(r)
    }

    async fn update_job(&self, mut report: JobReport) -> Result<JobStatus> {
        validate::report(&mut report, self.cfg.max_report_bytes)?;
        let r = self.pg_update_job(report).await;
        self.observe(r)
    }

    async fn batch_update_jobs(
        &self,
        worker_id: String,
        reports: Vec<JobReport>,
    ) -> Result<Vec<Result<JobStatus>>> {
        let mut reports = validate::batch(&worker_id, reports)?;
        // Valid completions of the worker's current leases in one
        // statement; the rest (and any completion it did not apply: a
        // rejection, a repeat) each as by update_job.
        let mut out: Vec<Option<Result<JobStatus>>> = Vec::with_capacity(reports.len());
        let mut completions = Vec::new();
        for (i, r) in reports.iter_mut().enumerate() {
            let valid = validate::report(r, self.cfg.max_report_bytes);
            let batched = valid.is_ok()
                && r.status == Some(JobStatus::Completed)
                && super::jobs::groupable(r)
                && r.worker_id == worker_id;
            out.push(match valid {
                Err(e) => Some(Err(e)),
                Ok(()) => None,
            });
            if batched {
                completions.push(i);
            }
        }
        if completions.len() > 1 {
            let done = self
                .pg_complete_batch(&worker_id, &reports, &completions)
                .await;
            for i in self.observe(done)? {
                out[i] = Some(Ok(JobStatus::Completed));
            }
        }
        let rest = out
            .iter()
            .enumerate()
            .filter(|(_, o)| o.is_none())
            .map(|(i, _)| i)
            .collect::<Vec<_>>();
        // Validated (and normalised) above: applied as by update_job, not
        // validated twice.
        let results = futures_util::future::join_all(rest.iter().map(|i| {
            let report = reports[*i].clone();
            async move {
                let r = self.pg_update_job(report).await;
                self.observe(r)
            }
        }))
        .await;
        for (i, r) in rest.into_iter().zip(results) {
            out[i] = Some(r);
        }
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Error::Internal("report not applied".into()))))
            .collect())
    }

    async fn unregister_worker(&self, worker_id: String) -> Result<u32> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_unregister(&worker_id).await;
        self.observe(r)
    }

    async fn drain_worker(&self, worker_id: String) -> Result<Worker> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_drain(&worker_id).await;
        self.observe(r)?;
        self.get_worker(worker_id).await
    }

    async fn forget_worker(&self, worker_id: String) -> Result<()> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_forget(&worker_id).await;
        self.observe(r)
    }

    async fn release_worker(&self, worker_id: String) -> Result<Worker> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_release(&worker_id).await;
        self.observe(r)?;
        self.get_worker(worker_id).await
    }

    async fn list_workers(&self, state: Option<WorkerState>) -> Result<Vec<Worker>> {
        let r = self.pg_workers(state, None).await;
        self.observe(r)
    }

    async fn get_worker(&self, worker_id: String) -> Result<Worker> {
        validate::worker_id(&worker_id)?;
        let r = self.pg_workers(None, Some(&worker_id)).await;
        self.observe(r)?
            .pop()
            .ok_or_else(|| Error::not_found(format!("worker {worker_id} is not registered")))
    }

    async fn verify_worker(
        &self,
        worker_id: String,
        command: String,
        args: Vec<String>,
    ) -> Result<Verification> {
        validate::worker_id(&worker_id)?;
        validate::challenge(&command, &args)?;
        let r = self.pg_verify_worker(&worker_id, &command, args).await;
        self.observe(r)
    }

    async fn answer_verification(
        &self,
        worker_id: String,
        answer: VerificationAnswer,
    ) -> Result<()> {
        validate::worker_id(&worker_id)?;
        let answer = validate::verification_answer(answer)?;
        let r = self.pg_answer(&worker_id, answer).await;
        self.observe(r)
    }

    async fn queue_stats(&self) -> Result<QueueStats> {
        let r = self.pg_queue_stats().await;
        self.observe(r)
    }

    async fn peek_queue(&self, queue: QueueName, count: u32) -> Result<Vec<String>> {
        let count = validate::peek_count(count)?;
        let r = self.pg_peek(queue, count).await;
        self.observe(r)
    }

    async fn metrics_text(&self) -> Result<String> {
        let r = self.refresh_gauges().await;
        self.observe(r)?;
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
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = self.stop.send(true);
        let tasks: Vec<_> = std::mem::take(&mut *super::lock(&self.tasks));
        for t in tasks {
            let _ = t.await;
        }
        // This replica's workers lose their streams here; their leases
        // stay until they reconnect elsewhere or the grace ends.
        let ended: Vec<(String, i64)> = super::lock(&self.local)
            .workers
            .drain()
            .map(|(id, w)| (id, w.epoch))
            .collect();
        if let Ok(c) = self.pool.get().await {
            let _ = super::workers::clear_stream_flags(&c, &self.replica_id, &ended).await;
            let _ = c
                .execute(
                    "DELETE FROM leader WHERE name = 'maintenance' AND holder = $1",
                    &[&self.replica_id],
                )
                .await;
            let _ = c
                .execute(
                    "DELETE FROM replicas WHERE replica_id = $1",
                    &[&self.replica_id],
                )
                .await;
        }
        self.pool.close();
    }

    async fn create_schedule(&self, schedule: Schedule) -> Result<Schedule> {
        let s = validate::schedule(schedule, &self.cfg, now_ms())?;
        let r = self.pg_create_schedule(s).await;
        let s = self.observe(r)?;
        self.schedules_wake.notify_one();
        Ok(s)
    }

    async fn get_schedule(&self, schedule_id: String) -> Result<Schedule> {
        validate::schedule_id(&schedule_id)?;
        let r = self.pg_get_schedule(&schedule_id).await;
        self.observe(r)
    }

    async fn list_schedules(&self, page_size: u32, page_token: String) -> Result<Page<Schedule>> {
        let r = self.pg_list_schedules(page_size, page_token).await;
        self.observe(r)
    }

    async fn set_schedule_paused(&self, schedule_id: String, paused: bool) -> Result<Schedule> {
        validate::schedule_id(&schedule_id)?;
        let r = self.pg_set_schedule_paused(&schedule_id, paused).await;
        self.observe(r)
    }

    async fn delete_schedule(&self, schedule_id: String) -> Result<()> {
        validate::schedule_id(&schedule_id)?;
        let r = self.pg_delete_schedule(&schedule_id).await;
        self.observe(r)
    }
}
