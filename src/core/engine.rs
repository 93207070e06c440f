//! The engine interface: the one seam between the gRPC services and a
//! store. The services (`crate::service`) call [`Engine`] with AGQ's domain
//! types ([`super::model`]) and receive domain events on the streams they
//! open; each engine (`crate::store::sqlite`, the embedded default) keeps
//! everything store-specific behind it. No transport or database type
//! crosses this interface.
//!
//! Every method validates its input first ([`super::validate`]): bad input
//! is refused with [`Error::InvalidArgument`] and changes nothing. Every
//! state change is committed before the method returns or before any
//! stream message it causes is sent.

use std::{collections::HashMap, net::SocketAddr, sync::Arc};

use tokio::sync::{mpsc, watch};

use super::{
    model::{
        ActionStatus, HeartbeatReply, Job, JobLease, JobReport, JobStatus, Plan, PlanSummary,
        PlanVersion, QueueStats, Registered, Registration, Schedule, SubmittedPlan, Verification,
        VerificationAnswer, Worker, WorkerState, WorkerStats,
    },
    watch::WatchSubscription,
};
use crate::{
    config::EngineConfig,
    error::{Error, Result},
    metrics::SharedMetrics,
};

/// Where an engine pushes the messages of one worker stream. The service
/// that opened the stream holds the receiver and turns each event into a
/// wire message; a closed receiver means the client went away.
pub type EventTx<T> = mpsc::UnboundedSender<T>;

/// One message of a worker's heartbeat stream.
#[derive(Debug)]
pub enum HeartbeatEvent {
    /// An acknowledgement or a command.
    Reply(HeartbeatReply),
    /// The stream ends with this error: from the engine,
    /// `FailedPrecondition` when the worker was declared DEAD,
    /// unregistered, or replaced by another instance.
    End(Error),
}

/// Which stream of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// The bidirectional Heartbeat stream.
    Heartbeat,
    /// The LeaseJobs server stream.
    Lease,
}

/// A new action (the ACTION.SUBMIT command of the specification), as the
/// client sent it; the engine validates it.
#[derive(Debug, Clone, Default)]
pub struct ActionRequest {
    /// Action id; empty: the engine makes one (a UUIDv7).
    pub action_id: String,
    /// Plan to run.
    pub plan_id: String,
    /// One job per input.
    pub inputs: Vec<HashMap<String, String>>,
    /// Scheduled start, ms since the epoch; `None` runs now.
    pub run_at_ms: Option<i64>,
    /// Attempts per job; 0 means the default (3).
    pub max_attempts: u32,
    /// W3C trace context of the submission (a `traceparent` header value,
    /// `00-<trace id>-<span id>-<flags>`), kept with the action and handed
    /// to the worker with each lease so its spans join the submitter's
    /// trace. `None`: not traced. A malformed value is dropped, never an
    /// error.
    pub traceparent: Option<String>,
    /// Priority of its jobs, -1000..=1000; higher leases first.
    pub priority: i32,
    /// Worker selector (see [`super::selector`]); empty: the plan's
    /// default selector, if any.
    pub worker_selector: String,
    /// Concurrency key, `[A-Za-z0-9._:-]{1,128}`; empty: no limit.
    pub concurrency_key: String,
    /// At most this many jobs with the key run at once across the fleet,
    /// 1..=1000000; required with a key, refused without one.
    pub max_running: u32,
}

/// What submitting an action created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmittedAction {
    /// The action's id.
    pub action_id: String,
    /// One job id per input, in input order.
    pub job_ids: Vec<String>,
}

/// One page of a listing and the token of the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// The items of this page.
    pub items: Vec<T>,
    /// Opaque token of the next page; empty on the last one.
    pub next_page_token: String,
}

/// A plan listing (the PLAN.LIST command of the specification).
#[derive(Debug, Clone, Default)]
pub struct PlanQuery {
    /// Glob over plan ids (`*`, `?`, `[...]`); empty matches all.
    pub pattern: String,
    /// Page size; 0 means 100, at most 1000.
    pub page_size: u32,
    /// Token from the previous page; empty for the first.
    pub page_token: String,
}

impl PlanQuery {
    /// The kind of this listing's page tokens ([`crate::core::page`]): it
    /// names the pattern, so a token is refused by a listing with another.
    pub fn page_kind(&self) -> String {
        format!("plan/{}", self.pattern)
    }
}

/// A listing of one plan's versions (ListPlanVersions, an AGQ addition),
/// newest first.
#[derive(Debug, Clone, Default)]
pub struct PlanVersionQuery {
    /// The plan.
    pub plan_id: String,
    /// Page size; 0 means 100, at most 1000.
    pub page_size: u32,
    /// Token from the previous page; empty for the first.
    pub page_token: String,
}

/// A job listing (the JOB.LIST and JOBS.SEARCH commands of the
/// specification); `None` fields match everything.
#[derive(Debug, Clone, Default)]
pub struct JobQuery {
    /// Only this action's jobs (`NotFound` if it does not exist).
    pub action_id: Option<String>,
    /// Only jobs in this status.
    pub status: Option<JobStatus>,
    /// Only this plan's jobs.
    pub plan_id: Option<String>,
    /// Created at or after, ms.
    pub created_after_ms: Option<i64>,
    /// Created before, ms.
    pub created_before_ms: Option<i64>,
    /// Page size; 0 means 100, at most 1000.
    pub page_size: u32,
    /// Token from the previous page; empty for the first.
    pub page_token: String,
}

/// `v` as text, empty for `None`: one field of a page kind.
fn field<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map(ToString::to_string).unwrap_or_default()
}

impl JobQuery {
    /// The kind of this listing's page tokens ([`crate::core::page`]): it
    /// names every filter, so a token is refused by a listing with other
    /// filters (it would skip rows there without a word).
    pub fn page_kind(&self) -> String {
        format!(
            "job/{}/{}/{}/{}/{}",
            field(&self.action_id),
            field(&self.status.map(|s| s as i32)),
            field(&self.plan_id),
            field(&self.created_after_ms),
            field(&self.created_before_ms)
        )
    }
}

/// Which actions an [`ActionQuery`] returns, by their jobs' statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionState {
    /// Some job is pending, running or failed (waiting for its next attempt).
    Open,
    /// Every job is completed, dead or cancelled.
    Finished,
    /// At least one job is dead.
    HasDead,
}

/// An action listing (ListActions, an AGQ addition); `None` fields match
/// everything. Newest first.
#[derive(Debug, Clone, Default)]
pub struct ActionQuery {
    /// Only this plan's actions.
    pub plan_id: Option<String>,
    /// Only actions in this state.
    pub state: Option<ActionState>,
    /// Created at or after, ms since the epoch.
    pub created_after_ms: Option<i64>,
    /// Created before, ms since the epoch.
    pub created_before_ms: Option<i64>,
    /// Page size; 0 means 100, at most 1000.
    pub page_size: u32,
    /// Token from the previous page; empty for the first.
    pub page_token: String,
}

impl ActionQuery {
    /// The kind of this listing's page tokens ([`crate::core::page`]): it
    /// names every filter, so a token is refused by a listing with other
    /// filters.
    pub fn page_kind(&self) -> String {
        format!(
            "action/{}/{}/{}/{}",
            field(&self.plan_id),
            field(&self.state.map(|s| s as i32)),
            field(&self.created_after_ms),
            field(&self.created_before_ms)
        )
    }
}

/// Which queue [`Engine::peek_queue`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueName {
    /// Ready pending jobs, in lease order.
    Ready,
    /// Jobs waiting for a time, soonest first.
    Scheduled,
}

/// The engine: AGQ's state machine, scheduler and store behind one
/// interface. Implemented by [`crate::store::sqlite::SqliteEngine`].
///
/// A trait object (`Arc<dyn Engine>`) rather than a generic parameter: the
/// store is chosen at run time from the command line, the services are
/// built once, and a boxed future per call costs nothing next to a gRPC
/// round trip.
///
/// Errors common to every method: `Unavailable` while the server shuts
/// down or the store cannot commit (a full disk: the message names the
/// cause), `Internal` for what should not happen (logged).
#[async_trait::async_trait]
pub trait Engine: Send + Sync {
    // ---- plans ----

    /// Validates and stores a plan (the PLAN.SUBMIT command): a new id as
    /// version 1; with `replace`, an existing id as its next version, or
    /// nothing when the plan has the same content as the latest version
    /// ([`Plan::same_content`]; `created` is then false). `plan.version` is
    /// ignored. Jobs already created keep running the version they were
    /// created with.
    ///
    /// Errors: `InvalidArgument` (the rule broken), `AlreadyExists` (the id
    /// exists and `replace` is false, whatever the content),
    /// `ResourceExhausted` (the id has `u32::MAX` versions).
    async fn submit_plan(&self, plan: Plan, replace: bool) -> Result<SubmittedPlan>;

    /// One plan (the PLAN.GET command): its latest version, or `version`.
    /// Errors: `InvalidArgument`, `NotFound` (plan or version).
    async fn get_plan(&self, plan_id: String, version: Option<u32>) -> Result<Plan>;

    /// Plans whose ids match a glob, in id order, with their latest
    /// version, paginated (the PLAN.LIST command). Errors:
    /// `InvalidArgument` (pattern, page size or token).
    async fn list_plans(&self, query: PlanQuery) -> Result<Page<PlanSummary>>;

    /// The versions of one plan, newest first, paginated
    /// (ListPlanVersions). Errors: `InvalidArgument` (id, page size or
    /// token), `NotFound`.
    async fn list_plan_versions(&self, query: PlanVersionQuery) -> Result<Page<PlanVersion>>;

    /// Deletes a plan with every version and its finished history (the
    /// PLAN.DELETE command). Errors: `InvalidArgument`, `NotFound`,
    /// `FailedPrecondition` while pending, running or retrying jobs use
    /// any version of it.
    async fn delete_plan(&self, plan_id: String) -> Result<()>;

    // ---- actions ----

    /// Creates an action and one pending job per input, atomically (the
    /// ACTION.SUBMIT command). Its jobs run the plan's latest version.
    ///
    /// Errors: `InvalidArgument` (ids, inputs, limits, max_attempts, run_at
    /// further ahead than `max_run_at_ahead`), `NotFound` (plan),
    /// `AlreadyExists` (action id).
    async fn submit_action(&self, action: ActionRequest) -> Result<SubmittedAction>;

    /// Aggregate status of an action (the ACTION.STATUS command).
    /// Errors: `InvalidArgument`, `NotFound`.
    async fn get_action(&self, action_id: String) -> Result<ActionStatus>;

    /// A subscription that changes whenever a job of the action changes
    /// status, for one WatchAction stream from `connection` (the client's
    /// address). It gives its place back when dropped.
    ///
    /// Errors: `InvalidArgument` (bad id), `ResourceExhausted` (too many
    /// streams open in all or on this connection).
    fn watch_action(
        &self,
        action_id: &str,
        connection: Option<SocketAddr>,
    ) -> Result<WatchSubscription>;

    /// Actions by plan, state and creation time, newest first (creation
    /// time, then submission order), paginated (ListActions).
    ///
    /// Errors: `InvalidArgument` (plan id, page size, token, an empty time
    /// range).
    async fn list_actions(&self, query: ActionQuery) -> Result<Page<ActionStatus>>;

    /// Cancels every pending, running or failed job of an action in one
    /// transaction, each as by [`Engine::cancel_job`] (the holders of
    /// running ones are told over their heartbeat streams). Returns how
    /// many were cancelled and the action's status after it.
    ///
    /// Errors: `InvalidArgument`, `NotFound`.
    async fn cancel_action(&self, action_id: String) -> Result<(u32, ActionStatus)>;

    /// Puts every failed and dead job of an action (only those in `status`
    /// when given) back to pending in one transaction, each as by
    /// [`Engine::retry_job`]. Returns how many and the action's status
    /// after it.
    ///
    /// Errors: `InvalidArgument` (a status other than failed or dead),
    /// `NotFound`, `FailedPrecondition` (the plan was deleted while a job
    /// would be retried; nothing changes).
    async fn retry_action(
        &self,
        action_id: String,
        status: Option<JobStatus>,
    ) -> Result<(u32, ActionStatus)>;

    // ---- jobs ----

    /// One job with its task results and, while it waits, why (the
    /// JOB.STATUS command). Errors: `InvalidArgument`, `NotFound`.
    async fn get_job(&self, job_id: String) -> Result<Job>;

    /// Job ids by filter, in creation order, paginated (the JOB.LIST and
    /// JOBS.SEARCH commands). Errors: `InvalidArgument` (page size, token,
    /// ids), `NotFound` (unknown action when filtering by action).
    async fn search_jobs(&self, query: JobQuery) -> Result<Page<String>>;

    /// Puts a failed or dead job back to pending with a fresh attempt
    /// budget (the JOB.RETRY command). The job keeps its plan version;
    /// `priority`, when given (-1000..=1000), becomes the job's priority.
    /// Errors: `InvalidArgument`,
    /// `NotFound`, `FailedPrecondition` (any other status, plan deleted).
    async fn retry_job(&self, job_id: String, priority: Option<i32>) -> Result<Job>;

    /// Cancels a pending or running job; the holder of a running one is
    /// told over its heartbeat stream. Errors: `InvalidArgument`,
    /// `NotFound`, `FailedPrecondition` (already final).
    async fn cancel_job(&self, job_id: String) -> Result<Job>;

    // ---- workers ----

    /// Registers a worker (the WORKER.REGISTER command). One live process
    /// per worker id: the same instance registering again resumes.
    ///
    /// Errors: `InvalidArgument`, `AlreadyExists` (another live instance
    /// holds the id).
    async fn register_worker(&self, registration: Registration) -> Result<Registered>;

    /// Attaches a heartbeat stream to a live worker, replacing an older
    /// one; commands for the worker go to `tx`. Returns the stream's id,
    /// for [`Engine::close_stream`].
    ///
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition` (DEAD or
    /// UNREGISTERED: register again).
    async fn open_heartbeat(&self, worker_id: String, tx: EventTx<HeartbeatEvent>) -> Result<u64>;

    /// Records one heartbeat (the WORKER.HEARTBEAT command): freshness and
    /// stats; with `held` (the lease ids the worker runs), re-queues every
    /// lease of the worker it no longer runs, and answers with those of
    /// `held` that are no longer the worker's
    /// ([`HeartbeatReply::revoked_leases`]), for it to stop.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED).
    async fn heartbeat(
        &self,
        worker_id: String,
        stats: Option<WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<HeartbeatReply>;

    /// Tells the engine that stream `stream_id` of the worker ended (fire
    /// and forget). A dropped heartbeat stream makes the worker suspect.
    fn close_stream(&self, worker_id: String, kind: StreamKind, stream_id: u64);

    /// Attaches a lease stream (the server stream that replaces polling),
    /// replacing an older one; leases for the worker go to `tx`. Returns
    /// the stream's id.
    ///
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition` (DEAD or
    /// UNREGISTERED).
    async fn open_lease_stream(&self, worker_id: String, tx: EventTx<JobLease>) -> Result<u64>;

    /// Applies a report fenced by its lease (the JOB.UPDATE command): only
    /// the holder, with the current lease id, may report. Returns the
    /// job's status after it. A final report repeated after its outcome
    /// was recorded is acknowledged again and changes nothing.
    ///
    /// Errors: `InvalidArgument`, `NotFound`, `PermissionDenied` (another
    /// worker's lease), `FailedPrecondition` (stale lease id, job not
    /// running), `ResourceExhausted` (results over `max_report_bytes`).
    async fn update_job(&self, report: JobReport) -> Result<JobStatus>;

    /// Applies several reports of worker `worker_id`, each as by
    /// [`Engine::update_job`], independently, sharing commits. A report
    /// with an empty worker id is `worker_id`'s. Returns one outcome per
    /// report, in order.
    ///
    /// Errors (nothing applied): `InvalidArgument` for a bad id, no
    /// reports, too many, or a report naming another worker.
    async fn batch_update_jobs(
        &self,
        worker_id: String,
        reports: Vec<JobReport>,
    ) -> Result<Vec<Result<JobStatus>>>;

    /// Deregisters a worker and re-queues what it holds (the
    /// WORKER.UNREGISTER command). Returns how many jobs were re-queued.
    /// Errors: `InvalidArgument`, `NotFound`.
    async fn unregister_worker(&self, worker_id: String) -> Result<u32>;

    /// Puts a worker in DRAINING and tells it over its heartbeat stream.
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition`.
    async fn drain_worker(&self, worker_id: String) -> Result<Worker>;

    /// Deletes the record of a DEAD or UNREGISTERED worker (ForgetWorker,
    /// an AGQ addition); the id may register again.
    ///
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition` while
    /// the worker is ACTIVE or DRAINING.
    async fn forget_worker(&self, worker_id: String) -> Result<()>;

    /// Ends a worker's quarantine (ReleaseWorker): ACTIVE again when it is
    /// live, its timeout count cleared, its stored reason cleared so a
    /// departed id comes back ACTIVE. Returns the worker.
    ///
    /// Errors: `InvalidArgument`, `NotFound`, `FailedPrecondition` when it
    /// is not quarantined.
    async fn release_worker(&self, worker_id: String) -> Result<Worker>;

    /// Workers, of one state when given, by id (the `KEYS worker:*:alive`
    /// command).
    async fn list_workers(&self, state: Option<WorkerState>) -> Result<Vec<Worker>>;

    /// One worker (the `GET worker:<id>:stats` command).
    /// Errors: `InvalidArgument`, `NotFound`.
    async fn get_worker(&self, worker_id: String) -> Result<Worker>;

    /// Challenges a worker to run one of its tools or agentic units with
    /// `args` (empty: `--describe` for a unit, `--version` for a tool) over
    /// its heartbeat stream (the WORKER.VERIFY command); returns the
    /// pending verification. The answer arrives through
    /// [`Engine::answer_verification`].
    ///
    /// Errors: `InvalidArgument` (id, command name, more than 16 args or
    /// one over 256 bytes), `NotFound`, `FailedPrecondition` (not live,
    /// command not advertised, no heartbeat stream).
    async fn verify_worker(
        &self,
        worker_id: String,
        command: String,
        args: Vec<String>,
    ) -> Result<Verification>;

    /// Records a worker's answer to a challenge (sent on its heartbeat
    /// stream); an answer to no pending challenge is ignored.
    ///
    /// Errors: `InvalidArgument` (worker id).
    async fn answer_verification(
        &self,
        worker_id: String,
        answer: VerificationAnswer,
    ) -> Result<()>;

    // ---- queue and operations ----

    /// Queue depths and worker counts (the QUEUE.STATS command).
    async fn queue_stats(&self) -> Result<QueueStats>;

    /// The next `count` job ids of a queue (the QUEUE.PEEK command); 0
    /// means 10. Errors: `InvalidArgument` for a count over 1000.
    async fn peek_queue(&self, queue: QueueName, count: u32) -> Result<Vec<String>>;

    /// Refreshes the gauges and returns the metrics in the Prometheus text
    /// format (the METRICS command).
    async fn metrics_text(&self) -> Result<String>;

    /// The metrics registry the engine and the services record into.
    fn metrics(&self) -> &SharedMetrics;

    /// The settings the engine runs with.
    fn config(&self) -> &EngineConfig;

    /// A receiver of whether the store can commit: false from a commit
    /// that failed for a cause outside AGQ (disk full, database
    /// unreachable) until a commit succeeds again. Health follows it.
    fn store_health(&self) -> watch::Receiver<bool>;

    /// Open WatchAction subscriptions.
    fn watch_streams(&self) -> usize;

    /// Stops the background loops and closes the store cleanly after the
    /// queued operations. Later calls fail with `Unavailable`.
    async fn close(&self);

    // ---- schedules ----

    /// Validates ([`super::validate::schedule`]) and stores a recurring
    /// schedule (CreateSchedule, an AGQ addition); its first tick is the
    /// first after now. Returns it as stored.
    ///
    /// Errors: `InvalidArgument`, `NotFound` (plan), `AlreadyExists` (id).
    async fn create_schedule(&self, schedule: Schedule) -> Result<Schedule>;

    /// One schedule (GetSchedule). Errors: `InvalidArgument`, `NotFound`.
    async fn get_schedule(&self, schedule_id: String) -> Result<Schedule>;

    /// Schedules by id, paginated (ListSchedules); `page_size` 0 means
    /// 100, at most 1000. Errors: `InvalidArgument` (page size, token).
    async fn list_schedules(&self, page_size: u32, page_token: String) -> Result<Page<Schedule>>;

    /// Pauses (PauseSchedule) or resumes (ResumeSchedule, from the first
    /// tick after now) a schedule; the same state again changes nothing.
    /// Returns it after the change. Errors: `InvalidArgument`, `NotFound`.
    async fn set_schedule_paused(&self, schedule_id: String, paused: bool) -> Result<Schedule>;

    /// Deletes a schedule (DeleteSchedule); its actions stay. Errors:
    /// `InvalidArgument`, `NotFound`.
    async fn delete_schedule(&self, schedule_id: String) -> Result<()>;
}

/// A shared engine, as the services hold it.
pub type SharedEngine = Arc<dyn Engine>;
