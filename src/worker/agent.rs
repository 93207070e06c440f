//! The worker's life: register, keep the heartbeat and lease streams open,
//! run every lease on its own task, report results, reconnect after any
//! loss, and drain on a signal or a server command.
//!
//! Three kinds of tasks cooperate through [`Shared`]:
//! - the **session loop** ([`session_loop`]) registers with this process's
//!   random instance id (the same instance resumes; `ALREADY_EXISTS` means
//!   another live process runs this worker id: agw stops), opens the heartbeat stream (its first message lists
//!   the leases still running), waits for the first acknowledgement, opens
//!   the lease stream, then heartbeats every interval and starts a job task
//!   per lease. When either stream ends or fails it reconnects with
//!   exponential backoff (1 s, 2 s, 4 s … 60 s, jittered);
//! - one **job task** per lease ([`run_job`]) runs the plan through the
//!   [`Executor`], reports `RUNNING` as each task starts and the final
//!   result (through the [`Reporter`], which sends the reports on one
//!   `ReportJobs` stream), retried with backoff while the
//!   server is unreachable or its store cannot commit, until the server
//!   acknowledges it or fences it (the job is held until then, so
//!   reconnects list it in `held_leases`). Jobs outlive reconnects;
//! - the **supervisor** ([`run`]) handles signals and drain: first signal →
//!   DRAINING (no new leases), wait for the jobs up to the drain timeout,
//!   kill the rest, unregister, exit; second signal → kill every task's
//!   process group and exit at once.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, SystemTime},
};

use tokio::{
    sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore},
    time::{timeout, Instant, MissedTickBehavior},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};
use tracing::{debug, error, info, warn, Instrument};

use super::{
    backoff::Backoff,
    client::{self, WorkerClient},
    config::{platform, WorkerConfig},
    error::WorkerError,
    executor::{
        abort_channel, fit_to_budget, AbortReason, AbortReceiver, AbortSender, Executor, TaskStart,
    },
    reporter::Reporter,
    stats::{JobCounters, StatsCollector},
};
use crate::pb::{
    heartbeat_response::Command, DrainWorkerRequest, HeartbeatRequest, HeartbeatResponse,
    HeldLeases, JobLease, JobStatus, LeaseJobsRequest, Plan, RegisterWorkerRequest, Task,
    UnregisterWorkerRequest, UpdateJobRequest, VerificationAnswer, VerifyCommand,
    WorkerCapabilities,
};
use crate::telemetry;

/// Largest total of captured output sent in one final report, in bytes:
/// stays under the 4 MiB gRPC message limit servers use by default.
pub const REPORT_BUDGET_BYTES: usize = 3 * 1024 * 1024;

/// Heartbeat interval assumed until the server has told us one.
const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);

/// Limit on one unary call or on opening a stream.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// How long jobs killed at the drain timeout get to report before the
/// worker unregisters anyway.
const KILLED_REPORT_GRACE: Duration = Duration::from_secs(10);

/// How long the worker keeps trying to unregister before it exits anyway.
const UNREGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an exiting `agw` keeps killing what its tasks left among its
/// children ([`ProcessGroups::kill_everything`](super::executor::ProcessGroups::kill_everything))
/// before it exits anyway.
const EXIT_SWEEP: Duration = Duration::from_secs(2);

/// How [`run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Drained: running jobs finished (or were killed at the drain timeout)
    /// and the worker unregistered (or tried to). Exit code 0.
    Drained,
    /// A second signal: every task was killed and the worker left without
    /// unregistering; the server re-queues its leases. Exit code 130.
    Forced,
}

/// Why the worker drains.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Drain {
    /// Not draining.
    No,
    /// The server pushed a drain command (with its reason): finish the jobs,
    /// however long they take.
    Server(String),
    /// SIGTERM/SIGINT: finish the jobs within the drain timeout.
    Signal,
}

/// A job running now, or whose final report is not yet acknowledged.
struct RunningJob {
    lease_id: String,
    abort: AbortSender,
    /// Its final report is being sent: the server may already have freed
    /// its slot (and sent a new lease before our reply arrived).
    reporting: bool,
    /// Becomes true once this attempt's processes are gone (killed or
    /// exited, reaped, their output closed): a newer lease of the same job
    /// starts only then.
    exited: watch::Receiver<bool>,
}

/// Marks an attempt's processes as gone when dropped (also when its task
/// ends early), so that a newer attempt of the same job may start.
struct Exited(watch::Sender<bool>);

impl Drop for Exited {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

impl RunningJob {
    /// Asks the job to stop for `reason`, unless it was asked already (the
    /// first reason stands).
    fn stop(&self, reason: AbortReason) {
        self.abort.send_if_modified(|r| {
            if r.is_none() {
                *r = Some(reason);
                true
            } else {
                false
            }
        });
    }
}

/// State shared by the supervisor, the session loop and the job tasks.
struct Shared {
    cfg: WorkerConfig,
    client: WorkerClient,
    /// Sends final reports, batching those that queue up.
    reporter: Reporter,
    executor: Executor,
    stats: StatsCollector,
    /// Running jobs by job id.
    jobs: Mutex<HashMap<String, RunningJob>>,
    /// One permit per slot (`max_concurrent_jobs`): an attempt holds one
    /// while its processes run, so the worker never runs more jobs at once
    /// than it declared, whatever the server sends.
    slots: Arc<Semaphore>,
    /// Number of running jobs, watched by the supervisor.
    job_count: watch::Sender<usize>,
    drain: watch::Sender<Drain>,
    /// Last heartbeat interval the server gave.
    interval: Mutex<Option<Duration>>,
    /// Set once the worker unregisters: the session loop stops reconnecting.
    leaving: AtomicBool,
    /// Set once a session got both streams open.
    registered: AtomicBool,
    /// Answers to capability challenges, sent on the heartbeat stream.
    answers_tx: mpsc::UnboundedSender<VerificationAnswer>,
    /// Their receiver, taken by the session that has the stream open.
    answers_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<VerificationAnswer>>,
}

/// Longest a capability challenge may run.
const CHALLENGE_TIMEOUT_SECS: u32 = 10;
/// Most bytes of a challenge's stdout (and error) sent back.
const CHALLENGE_OUTPUT_BYTES: usize = 4096;

/// How a session ended.
#[derive(Debug)]
enum SessionEnd {
    /// The connection or a stream was lost: reconnect after a backoff.
    Lost(String),
    /// Retrying cannot help: stop the worker.
    Fatal(WorkerError),
}

/// True for codes that mean the server no longer gives us this lease.
fn lease_gone(code: Code) -> bool {
    matches!(
        code,
        Code::FailedPrecondition | Code::PermissionDenied | Code::NotFound
    )
}

/// True for codes worth retrying an update for: the server (or the path to
/// it) is down, or its store cannot commit now, not refusing. INTERNAL and
/// ABORTED too: the server rolls back a batch that failed (every report in
/// it answered INTERNAL) and expects the reports again, and fencing makes
/// a repeat harmless.
fn transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
            | Code::Aborted
    )
}

/// Cuts `text` to at most `max` bytes, on a character boundary.
fn cut_at(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// The wait the server asked for before the same request is sent again
/// (the `grpc-retry-pushback-ms` trailer), when it refused the request for
/// now only (its request buffer was full), not for what it holds.
fn pushback(st: &Status) -> Option<Duration> {
    st.metadata()
        .get(crate::request_budget::RETRY_PUSHBACK_HEADER)?
        .to_str()
        .ok()?
        .parse::<u64>()
        .ok()
        .map(Duration::from_millis)
}

/// `CODE: message` of a status, for logs.
fn describe(s: &Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

impl Shared {
    /// Builds the client and executor for `cfg`.
    ///
    /// # Errors
    ///
    /// [`WorkerError::Config`] for a bad server URL, TLS files or token.
    pub async fn new(cfg: WorkerConfig) -> Result<Arc<Self>, WorkerError> {
        let channel = client::channel(&cfg.server, &cfg.tls).await?;
        let client = client::worker_client(channel, cfg.token.as_deref())?;
        let executor = Executor::new(Arc::clone(&cfg.tools), cfg.output_cap_bytes)
            .with_sandbox(Arc::clone(&cfg.sandbox));
        let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
        let stats = StatsCollector::new(Arc::new(JobCounters::default()), cwd);
        let reporter = Reporter::start(client.clone(), cfg.worker_id.clone(), CALL_TIMEOUT);
        let (answers_tx, answers_rx) = mpsc::unbounded_channel();
        let slots = Arc::new(Semaphore::new(cfg.max_concurrent_jobs.max(1) as usize));
        Ok(Arc::new(Shared {
            cfg,
            client,
            reporter,
            executor,
            stats,
            jobs: Mutex::new(HashMap::new()),
            slots,
            job_count: watch::channel(0).0,
            drain: watch::channel(Drain::No).0,
            interval: Mutex::new(None),
            leaving: AtomicBool::new(false),
            registered: AtomicBool::new(false),
            answers_tx,
            answers_rx: tokio::sync::Mutex::new(answers_rx),
        }))
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<String, RunningJob>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn draining(&self) -> bool {
        *self.drain.borrow() != Drain::No
    }

    /// Lease ids of the jobs running now.
    fn held_leases(&self) -> Vec<String> {
        self.jobs().values().map(|j| j.lease_id.clone()).collect()
    }

    /// The heartbeat interval the server last gave (30 s, the server's
    /// default, before it gave one).
    fn heartbeat_interval(&self) -> Duration {
        self.interval
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or(Duration::from_secs(30))
            .max(Duration::from_millis(100))
    }

    fn active_jobs(&self) -> u32 {
        u32::try_from(self.jobs().len()).unwrap_or(u32::MAX)
    }

    /// Stops the job `job_id` (any lease when `lease_id` is `None`).
    /// Returns false when no such job runs.
    fn abort_job(&self, job_id: &str, lease_id: Option<&str>, reason: AbortReason) -> bool {
        match self.jobs().get(job_id) {
            Some(j) if lease_id.is_none_or(|l| l == j.lease_id) => {
                j.stop(reason);
                true
            }
            _ => false,
        }
    }

    /// Stops the jobs still running, not those whose final report is on
    /// its way (their result stands); returns the ids of those stopped.
    fn abort_running(&self, reason: &AbortReason) -> HashSet<String> {
        let mut stopped = HashSet::new();
        for (id, j) in self.jobs().iter().filter(|(_, j)| !j.reporting) {
            j.stop(reason.clone());
            stopped.insert(id.clone());
        }
        stopped
    }

    /// True while a job not in `stopped` still waits for its final report
    /// to be acknowledged: a result that must not be thrown away.
    fn results_pending_besides(&self, stopped: &HashSet<String>) -> bool {
        self.jobs().keys().any(|id| !stopped.contains(id))
    }

    /// Enters DRAINING for `cause` (a signal takes over a server drain).
    fn request_drain(&self, cause: Drain) {
        self.drain.send_if_modified(|d| {
            let change = matches!(
                (&*d, &cause),
                (Drain::No, _) | (Drain::Server(_), Drain::Signal)
            );
            if change {
                *d = cause;
            }
            change
        });
    }

    /// A heartbeat message with current stats; with `held_leases` on the
    /// first message of a stream.
    async fn heartbeat(&self, first: bool) -> HeartbeatRequest {
        let stats = self.stats.collect(self.active_jobs()).await;
        HeartbeatRequest {
            worker_id: self.cfg.worker_id.clone(),
            stats: Some(stats),
            held_leases: first.then(|| HeldLeases {
                lease_ids: self.held_leases(),
            }),
            verification: None,
        }
    }

    /// Runs a capability challenge: the command with its arguments, as a
    /// one-task plan in the task sandbox (at most
    /// [`CHALLENGE_TIMEOUT_SECS`]), and the answer to send back.
    async fn run_challenge(&self, v: VerifyCommand) -> VerificationAnswer {
        let cut = |mut s: String| {
            if s.len() > CHALLENGE_OUTPUT_BYTES {
                let mut end = CHALLENGE_OUTPUT_BYTES;
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                s.truncate(end);
            }
            s
        };
        if !self.cfg.tools.contains(&v.command) {
            return VerificationAnswer {
                challenge_id: v.challenge_id,
                exit_code: -1,
                output: String::new(),
                error: format!(
                    "{:?} is not a tool or agentic unit of this worker",
                    v.command
                ),
            };
        }
        let plan = Plan {
            plan_id: "capability-challenge".into(),
            tasks: vec![Task {
                task_number: 1,
                command: v.command.clone(),
                args: v.args.clone(),
                timeout_secs: CHALLENGE_TIMEOUT_SECS,
                ..Default::default()
            }],
            ..Default::default()
        };
        let (_abort, abort_rx) = abort_channel();
        let out = self
            .executor
            .run(&plan, &HashMap::new(), abort_rx, |_| {})
            .await;
        let result = out.task_results.into_iter().next();
        VerificationAnswer {
            challenge_id: v.challenge_id,
            exit_code: result.as_ref().map_or(-1, |r| r.exit_code),
            output: cut(result.map(|r| r.stdout).unwrap_or_default()),
            error: cut(out.error),
        }
    }

    /// Acts on a server message of the heartbeat stream.
    fn on_heartbeat_response(self: &Arc<Self>, r: HeartbeatResponse) {
        // Leases named on reconnecting that the server took back meanwhile
        // (the job was cancelled, or went to another worker).
        for lease_id in &r.revoked_lease_ids {
            let job_id = self
                .jobs()
                .iter()
                .find(|(_, j)| j.lease_id == *lease_id)
                .map(|(id, _)| id.clone());
            let reason =
                AbortReason::LeaseLost("the server revoked it while this worker was away".into());
            match job_id {
                Some(job_id) if self.abort_job(&job_id, Some(lease_id), reason) => {
                    warn!(%job_id, %lease_id, "lease revoked while disconnected: killing the job");
                }
                _ => debug!(%lease_id, "revoked lease not running here"),
            }
        }
        match r.command {
            Some(Command::Drain(d)) => {
                if self.draining() {
                    debug!(reason = %d.reason, "server confirms the drain");
                } else {
                    info!(reason = %d.reason, "server asked us to drain: taking no new leases");
                }
                self.request_drain(Drain::Server(d.reason));
            }
            Some(Command::CancelJobId(job_id)) => {
                // Only the attempt named: a newer lease of the same job,
                // which may have arrived first on the lease stream, runs on.
                let lease = Some(r.cancel_lease_id.as_str()).filter(|l| !l.is_empty());
                if self.abort_job(&job_id, lease, AbortReason::Cancelled) {
                    info!(%job_id, "job cancelled by the server: killing it");
                } else {
                    debug!(%job_id, "cancel for a job that is not running here");
                }
            }
            Some(Command::Verify(v)) => {
                info!(command = %v.command, challenge_id = %v.challenge_id, "capability challenge");
                let me = Arc::clone(self);
                tokio::spawn(async move {
                    let answer = me.run_challenge(v).await;
                    let _ = me.answers_tx.send(answer);
                });
            }
            None => {}
        }
    }

    /// Starts a job task for `lease`.
    fn start_job(self: &Arc<Self>, lease: JobLease) {
        let Some(job) = lease.job.as_ref() else {
            warn!(lease_id = %lease.lease_id, "lease without a job: ignored");
            return;
        };
        let job_id = job.job_id.clone();
        let (abort_tx, abort_rx) = abort_channel();
        let (exited_tx, exited_rx) = watch::channel(false);
        let mut previous = None;
        {
            let mut jobs = self.jobs();
            if let Some(old) = jobs.get(&job_id) {
                if old.lease_id == lease.lease_id {
                    debug!(%job_id, lease_id = %lease.lease_id, "lease delivered again: already running");
                    return;
                }
                // A new lease for a job we run under an old one: the old
                // attempt is no longer ours. The new one starts once the
                // old one's processes are gone, never beside them.
                warn!(%job_id, old = %old.lease_id, new = %lease.lease_id, "job leased again: restarting it under the new lease once the old attempt has stopped");
                old.stop(AbortReason::LeaseLost("superseded by a newer lease".into()));
                previous = Some(old.exited.clone());
            }
            jobs.insert(
                job_id.clone(),
                RunningJob {
                    lease_id: lease.lease_id.clone(),
                    abort: abort_tx,
                    reporting: false,
                    exited: exited_rx,
                },
            );
            self.job_count.send_replace(jobs.len());
        }
        info!(%job_id, lease_id = %lease.lease_id, attempt = lease.attempt, "lease received");
        let shared = Arc::clone(self);
        tokio::spawn(
            async move { run_job(shared, lease, abort_rx, previous, Exited(exited_tx)).await },
        );
    }

    /// Waits until attempt `previous` of the same job (if any) has stopped
    /// and a slot is free; `None` when the attempt is aborted meanwhile.
    /// A server that sends more leases than the worker has slots gets its
    /// extra leases run one by one as slots free up, within their own
    /// lease time.
    async fn wait_turn(
        self: &Arc<Self>,
        previous: Option<watch::Receiver<bool>>,
        abort: &AbortReceiver,
    ) -> Option<OwnedSemaphorePermit> {
        let aborted = || {
            let mut abort = abort.clone();
            async move {
                let _ = abort.wait_for(Option::is_some).await;
            }
        };
        if let Some(mut previous) = previous {
            tokio::select! {
                // A dropped sender (its task is gone) counts as stopped.
                _ = previous.wait_for(|gone| *gone) => {}
                () = aborted() => return None,
            }
        }
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Some(permit);
        }
        warn!(
            max = self.cfg.max_concurrent_jobs,
            "more leases than slots: the server sent a lease while every slot runs a job; it waits for a free slot"
        );
        tokio::select! {
            permit = Arc::clone(&self.slots).acquire_owned() => permit.ok(),
            () = aborted() => None,
        }
    }

    /// Marks the job's final report as being sent (see [`RunningJob::reporting`]).
    fn reporting(&self, job_id: &str, lease_id: &str) {
        if let Some(j) = self.jobs().get_mut(job_id) {
            if j.lease_id == lease_id {
                j.reporting = true;
            }
        }
    }

    /// Forgets a finished job (unless a newer lease replaced it).
    fn finish_job(&self, job_id: &str, lease_id: &str) {
        let mut jobs = self.jobs();
        if jobs.get(job_id).is_some_and(|j| j.lease_id == lease_id) {
            jobs.remove(job_id);
        }
        self.job_count.send_replace(jobs.len());
    }

    fn update(&self, lease: &LeaseIds, status: JobStatus) -> UpdateJobRequest {
        UpdateJobRequest {
            job_id: lease.job_id.clone(),
            worker_id: self.cfg.worker_id.clone(),
            lease_id: lease.lease_id.clone(),
            status: status as i32,
            ..Default::default()
        }
    }
}

/// Identity of one job attempt.
#[derive(Debug, Clone)]
struct LeaseIds {
    job_id: String,
    lease_id: String,
    /// W3C `traceparent` sent as metadata with this attempt's reports: the
    /// job span's when spans are exported, else the lease's; `None`: not
    /// traced.
    traceparent: Option<String>,
}

/// Runs one leased job and reports it.
async fn run_job(
    shared: Arc<Shared>,
    lease: JobLease,
    abort: AbortReceiver,
    previous: Option<watch::Receiver<bool>>,
    exited: Exited,
) {
    let job = lease.job.unwrap_or_default();
    // The job's span: a child of the lease's trace context when it has one.
    let span = tracing::info_span!(
        "job",
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        job_id = %job.job_id,
        lease_id = %lease.lease_id,
        attempt = lease.attempt,
        plan_id = %job.plan_id,
        plan_version = job.plan_version,
        tasks = lease.plan.as_ref().map_or(0, |p| p.tasks.len()),
        error = tracing::field::Empty,
    );
    let leased = Some(lease.traceparent).filter(|t| !t.is_empty());
    if let Some(tp) = &leased {
        telemetry::set_parent(&span, telemetry::context_of(tp));
    }
    let ids = LeaseIds {
        job_id: job.job_id.clone(),
        lease_id: lease.lease_id.clone(),
        traceparent: telemetry::span_traceparent(&span).or(leased),
    };
    let expires_at = lease.expires_at.and_then(|t| SystemTime::try_from(t).ok());
    // An attempt aborted while it waits runs nothing: the executor sees
    // the abort before its first task.
    let slot = shared.wait_turn(previous, &abort).await;
    let outcome = match lease.plan {
        Some(plan) => {
            let (progress_tx, progress_rx) = watch::channel(None::<TaskStart>);
            let reporter = tokio::spawn(report_progress(
                Arc::clone(&shared),
                ids.clone(),
                progress_rx,
            ));
            let outcome = shared
                .executor
                .run(&plan, &job.input, abort, |s| {
                    progress_tx.send_replace(Some(s));
                })
                .instrument(span.clone())
                .await;
            drop(progress_tx);
            // Let an in-flight progress report land before the final one,
            // but do not hold the result back for a server that is down.
            let mut reporter = reporter;
            if timeout(Duration::from_secs(2), &mut reporter)
                .await
                .is_err()
            {
                reporter.abort();
            }
            outcome
        }
        None => super::executor::JobOutcome {
            success: false,
            error: "the lease carries no plan".into(),
            task_results: Vec::new(),
            aborted: None,
            permanent: false,
            duration: Duration::ZERO,
        },
    };
    // The attempt's processes are gone: its slot is free and a newer
    // attempt of the job may start.
    drop(slot);
    drop(exited);
    shared
        .stats
        .counters()
        .record(outcome.success, outcome.duration);
    if outcome.success {
        info!(job_id = %ids.job_id, ms = outcome.duration.as_millis() as u64, "job completed");
    } else {
        span.record("otel.status_code", "ERROR");
        span.record("error", outcome.error.as_str());
        info!(job_id = %ids.job_id, error = %outcome.error, "job failed");
    }
    let mut req = shared.update(
        &ids,
        if outcome.success {
            JobStatus::Completed
        } else {
            JobStatus::Failed
        },
    );
    req.current_task = outcome
        .task_results
        .last()
        .map(|r| r.task_number)
        .unwrap_or(0);
    req.progress_percent = if outcome.success { 100 } else { 0 };
    req.error = outcome.error;
    req.permanent = outcome.permanent;
    req.task_results = outcome.task_results;
    fit_to_budget(&mut req.task_results, REPORT_BUDGET_BYTES);
    shared.reporting(&ids.job_id, &ids.lease_id);
    report_final(&shared, &ids, req, expires_at, outcome.aborted.is_some())
        .instrument(span.clone())
        .await;
    shared.finish_job(&ids.job_id, &ids.lease_id);
    // The job span ends once the server has the result.
    drop(span);
}

/// Sends `RUNNING` with the current task each time one starts. Progress is
/// best effort (one try per report); a reply saying the lease is no longer
/// ours stops the job.
async fn report_progress(
    shared: Arc<Shared>,
    ids: LeaseIds,
    mut progress: watch::Receiver<Option<TaskStart>>,
) {
    let mut client = shared.client.clone();
    while progress.changed().await.is_ok() {
        let Some(s) = *progress.borrow_and_update() else {
            continue;
        };
        let mut req = shared.update(&ids, JobStatus::Running);
        req.current_task = s.task_number;
        req.progress_percent = s.progress_percent;
        let mut req = tonic::Request::new(req);
        telemetry::inject(&mut req, ids.traceparent.as_deref());
        match timeout(CALL_TIMEOUT, client.update_job(req)).await {
            Ok(Ok(_)) => debug!(job_id = %ids.job_id, task = s.task_number, "progress reported"),
            Ok(Err(st)) if lease_gone(st.code()) => {
                warn!(job_id = %ids.job_id, status = %describe(&st), "server refused progress: the lease is no longer ours; stopping the job");
                shared.abort_job(
                    &ids.job_id,
                    Some(&ids.lease_id),
                    AbortReason::LeaseLost(st.message().to_owned()),
                );
                return;
            }
            Ok(Err(st)) => {
                debug!(job_id = %ids.job_id, status = %describe(&st), "progress not reported");
            }
            Err(_) => debug!(job_id = %ids.job_id, "progress report timed out"),
        }
    }
}

/// Sends the final result until the server acknowledges it (stored, or
/// already stored by an earlier try whose reply was lost) or fences it
/// (the lease is no longer ours). While the server is unreachable, its
/// store cannot commit (`UNAVAILABLE`, and `RESOURCE_EXHAUSTED` once the
/// outputs are stripped) or it is too busy to take the report now (a
/// refusal with a retry pushback: sent again as it is, outputs included,
/// no sooner than the pushback), it retries with backoff, past the lease's expiry
/// too: only the server can say the attempt is over, and the job stays
/// held (listed in `held_leases`) meanwhile. `aborted` jobs (cancelled,
/// lease lost) are expected to be fenced: logged at debug.
async fn report_final(
    shared: &Shared,
    ids: &LeaseIds,
    mut req: UpdateJobRequest,
    expires_at: Option<SystemTime>,
    aborted: bool,
) {
    // At most a heartbeat interval apart (see `session_loop`).
    let mut backoff = Backoff::new(
        Duration::from_millis(500),
        Duration::from_secs(30).min(shared.heartbeat_interval()),
    );
    // How much of the report was cut to fit the server's limit: 0 none,
    // 1 the outputs (and the error past 4 KiB), 2 everything but the
    // outcome and 256 bytes of the error, which fits any limit the server
    // may set (`--max-report-bytes` is at least 1 KiB).
    let mut stripped = 0u8;
    let mut told_expired = false;
    loop {
        let st = match shared
            .reporter
            .send(req.clone(), ids.traceparent.clone())
            .await
        {
            Ok(()) => {
                debug!(job_id = %ids.job_id, "result reported");
                return;
            }
            Err(st) => st,
        };
        let pushed = pushback(&st);
        if transient(st.code())
            || pushed.is_some()
            || (stripped == 2 && st.code() == Code::ResourceExhausted)
        {
            if !told_expired && expires_at.is_some_and(|t| SystemTime::now() > t) {
                told_expired = true;
                info!(job_id = %ids.job_id, "the lease expired before the server acknowledged the result; reporting until it acknowledges or fences it");
            }
            let d = backoff.next_delay().max(pushed.unwrap_or_default());
            warn!(job_id = %ids.job_id, status = %describe(&st), retry_in_ms = d.as_millis() as u64, "result not acknowledged yet; retrying");
            tokio::time::sleep(d).await;
            continue;
        }
        if lease_gone(st.code()) {
            if aborted {
                debug!(job_id = %ids.job_id, status = %describe(&st), "result of a stopped job refused, as expected");
            } else {
                warn!(job_id = %ids.job_id, status = %describe(&st), "result dropped: the lease is no longer ours");
            }
            return;
        }
        if stripped < 2
            && matches!(
                st.code(),
                Code::InvalidArgument | Code::ResourceExhausted | Code::OutOfRange
            )
        {
            // Perhaps the report is too big for the server: report the
            // outcome with less rather than strand the lease (a refusal of
            // the smallest report for RESOURCE_EXHAUSTED is the store's,
            // retried above).
            stripped += 1;
            if stripped == 1 {
                warn!(job_id = %ids.job_id, status = %describe(&st), "result refused; reporting it again without outputs");
                for r in &mut req.task_results {
                    r.stdout_truncated |= !r.stdout.is_empty();
                    r.stderr_truncated |= !r.stderr.is_empty();
                    r.stdout.clear();
                    r.stderr.clear();
                }
                cut_at(&mut req.error, 4096);
            } else {
                warn!(job_id = %ids.job_id, status = %describe(&st), "result refused again; reporting only its outcome");
                req.task_results.clear();
                cut_at(&mut req.error, 256);
            }
            continue;
        }
        error!(job_id = %ids.job_id, status = %describe(&st), "result refused by the server");
        return;
    }
}

/// Registers (or resumes), opens both streams and serves them until one
/// ends. `registered_once` tells whether an earlier session got this far;
/// `established` is set once both streams are open.
async fn session(
    shared: &Arc<Shared>,
    registered_once: bool,
    established: &mut bool,
) -> Result<(), SessionEnd> {
    let cfg = &shared.cfg;
    let mut client = shared.client.clone();

    // 1. Register with our instance id: the same instance resumes;
    //    ALREADY_EXISTS means another live process runs this worker id.
    let req = RegisterWorkerRequest {
        instance_id: cfg.instance_id.clone(),
        worker_id: cfg.worker_id.clone(),
        hostname: cfg.hostname.clone(),
        platform: platform(),
        agw_version: env!("CARGO_PKG_VERSION").to_owned(),
        capabilities: Some(WorkerCapabilities {
            // The units are advertised as units, not as tools.
            tools: cfg
                .tools
                .names()
                .iter()
                .filter(|n| !cfg.units.iter().any(|u| &u.name == *n))
                .cloned()
                .collect(),
            agentic_units: cfg.units.iter().map(|u| u.name.clone()).collect(),
            units: cfg
                .units
                .iter()
                .cloned()
                .map(crate::pb::AgenticUnit::from)
                .collect(),
        }),
        max_concurrent_jobs: cfg.max_concurrent_jobs,
        tags: cfg.tags.clone(),
        sandboxed: cfg.sandbox.enabled(),
    };
    match timeout(CALL_TIMEOUT, client.register_worker(req)).await {
        Err(_) => return Err(SessionEnd::Lost("RegisterWorker timed out".into())),
        Ok(Ok(resp)) => {
            let r = resp.into_inner();
            let interval = if r.heartbeat_interval_ms > 0 {
                Some(Duration::from_millis(u64::from(r.heartbeat_interval_ms)))
            } else if r.heartbeat_interval_secs > 0 {
                Some(Duration::from_secs(u64::from(r.heartbeat_interval_secs)))
            } else {
                None
            };
            if interval.is_some() {
                *shared.interval.lock().unwrap_or_else(|e| e.into_inner()) = interval;
            }
            if r.resumed {
                info!("server still has this worker registered: resuming");
            } else if registered_once {
                info!("registered again (the server had let this worker go)");
            }
            debug!(?interval, "registered");
        }
        Ok(Err(st)) if st.code() == Code::AlreadyExists => {
            return Err(SessionEnd::Fatal(WorkerError::Duplicate {
                worker_id: cfg.worker_id.clone(),
                detail: st.message().to_owned(),
            }));
        }
        Ok(Err(st))
            if !registered_once
                && matches!(
                    st.code(),
                    Code::InvalidArgument | Code::Unauthenticated | Code::PermissionDenied
                ) =>
        {
            return Err(SessionEnd::Fatal(WorkerError::Registration(describe(&st))));
        }
        Ok(Err(st)) => {
            return Err(SessionEnd::Lost(format!(
                "RegisterWorker: {}",
                describe(&st)
            )))
        }
    }

    // 2. A worker draining locally stays DRAINING on the server too.
    if shared.draining() {
        let req = DrainWorkerRequest {
            worker_id: cfg.worker_id.clone(),
        };
        if let Ok(Err(st)) = timeout(CALL_TIMEOUT, client.drain_worker(req)).await {
            debug!(status = %describe(&st), "DrainWorker after reconnect");
        }
    }

    // 3. Heartbeat stream: the first message (queued before the call, as the
    //    server may wait for it) lists the leases we still run.
    let (hb_tx, hb_rx) = mpsc::channel::<HeartbeatRequest>(4);
    let first = shared.heartbeat(true).await;
    let _ = hb_tx.send(first).await;
    let mut inbound =
        match timeout(CALL_TIMEOUT, client.heartbeat(ReceiverStream::new(hb_rx))).await {
            Err(_) => return Err(SessionEnd::Lost("opening Heartbeat timed out".into())),
            Ok(Err(st)) => return Err(SessionEnd::Lost(format!("Heartbeat: {}", describe(&st)))),
            Ok(Ok(r)) => r.into_inner(),
        };
    // Wait for the first answer so held_leases is applied before any lease.
    match timeout(CALL_TIMEOUT, inbound.message()).await {
        Err(_) => return Err(SessionEnd::Lost("no answer to the first heartbeat".into())),
        Ok(Err(st)) => return Err(SessionEnd::Lost(format!("Heartbeat: {}", describe(&st)))),
        Ok(Ok(None)) => {
            return Err(SessionEnd::Lost(
                "server closed the heartbeat stream".into(),
            ))
        }
        Ok(Ok(Some(r))) => {
            let known = *shared.interval.lock().unwrap_or_else(|e| e.into_inner());
            if known.is_none() {
                // Resumed without an interval: take half the time to the
                // deadline the server gave (robust to modest clock skew).
                let learned = r
                    .next_deadline
                    .and_then(|t| SystemTime::try_from(t).ok())
                    .and_then(|t| t.duration_since(SystemTime::now()).ok())
                    .map(|d| (d / 2).clamp(Duration::from_millis(100), Duration::from_secs(60)));
                *shared.interval.lock().unwrap_or_else(|e| e.into_inner()) = learned;
            }
            shared.on_heartbeat_response(r);
        }
    }
    let interval = shared
        .interval
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or(DEFAULT_HEARTBEAT_INTERVAL);

    // 4. Lease stream.
    let lease_req = LeaseJobsRequest {
        worker_id: cfg.worker_id.clone(),
    };
    let mut leases = match timeout(CALL_TIMEOUT, client.lease_jobs(lease_req)).await {
        Err(_) => return Err(SessionEnd::Lost("opening LeaseJobs timed out".into())),
        Ok(Err(st)) => return Err(SessionEnd::Lost(format!("LeaseJobs: {}", describe(&st)))),
        Ok(Ok(r)) => r.into_inner(),
    };
    *established = true;
    shared.registered.store(true, Ordering::SeqCst);
    info!(
        interval_ms = interval.as_millis() as u64,
        "connected: heartbeat and lease streams open"
    );
    println!(
        "agw: registered {} with {} tools: {}",
        cfg.worker_id,
        cfg.tools.len(),
        cfg.tools.names().join(",")
    );

    // 5. Serve both streams.
    let mut tick = tokio::time::interval_at(Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut answers = shared.answers_rx.lock().await;
    loop {
        tokio::select! {
            Some(answer) = answers.recv() => {
                let mut hb = shared.heartbeat(false).await;
                hb.verification = Some(answer);
                if hb_tx.send(hb).await.is_err() {
                    return Err(SessionEnd::Lost("heartbeat stream closed".into()));
                }
            }
            _ = tick.tick() => {
                let hb = shared.heartbeat(false).await;
                match hb_tx.try_send(hb) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        debug!("heartbeat not sent: the stream is backed up");
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        return Err(SessionEnd::Lost("heartbeat stream closed".into()));
                    }
                }
            }
            m = inbound.message() => match m {
                Ok(Some(r)) => shared.on_heartbeat_response(r),
                Ok(None) => return Err(SessionEnd::Lost("server closed the heartbeat stream".into())),
                Err(st) => return Err(SessionEnd::Lost(format!("Heartbeat: {}", describe(&st)))),
            },
            l = leases.message() => match l {
                Ok(Some(lease)) => shared.start_job(lease),
                Ok(None) => return Err(SessionEnd::Lost("server closed the lease stream".into())),
                Err(st) => return Err(SessionEnd::Lost(format!("LeaseJobs: {}", describe(&st)))),
            },
        }
    }
}

/// Runs sessions forever, reconnecting with backoff. Returns only on a fatal
/// error.
async fn session_loop(shared: Arc<Shared>) -> WorkerError {
    let mut backoff = Backoff::reconnect();
    let mut registered_once = false;
    loop {
        let mut established = false;
        let end = session(&shared, registered_once, &mut established).await;
        if established {
            registered_once = true;
            backoff.reset();
        }
        let why = match end {
            Ok(()) => "session ended".to_owned(),
            Err(SessionEnd::Lost(why)) => why,
            Err(SessionEnd::Fatal(e)) => return e,
        };
        if shared.leaving.load(Ordering::SeqCst) {
            // Unregistered: the server hung up on purpose; the supervisor
            // stops this task.
            debug!(reason = %why, "streams closed after unregistering");
            return std::future::pending().await;
        }
        let mut d = backoff.next_delay();
        if shared.active_jobs() > 0 {
            // Jobs held (running, or results not yet acknowledged): try at
            // least once per heartbeat interval, so that a server back from
            // an outage hears from this worker well within the stale
            // window it waits for its workers.
            d = d.min(shared.heartbeat_interval());
        }
        warn!(reason = %why, retry_in_ms = d.as_millis() as u64, running_jobs = shared.active_jobs(), "connection lost; reconnecting");
        tokio::time::sleep(d).await;
    }
}

/// Tells the server we drain (best effort: a reconnect repeats it).
async fn drain_self(shared: Arc<Shared>) {
    let mut client = shared.client.clone();
    let req = DrainWorkerRequest {
        worker_id: shared.cfg.worker_id.clone(),
    };
    match timeout(CALL_TIMEOUT, client.drain_worker(req)).await {
        Ok(Ok(_)) => info!("server set this worker DRAINING"),
        Ok(Err(st)) => warn!(status = %describe(&st), "DrainWorker failed"),
        Err(_) => warn!("DrainWorker timed out"),
    }
}

/// Unregisters, retrying while the server is unreachable, for at most
/// [`UNREGISTER_TIMEOUT`].
async fn unregister(shared: &Shared) {
    let mut client = shared.client.clone();
    let deadline = Instant::now() + UNREGISTER_TIMEOUT;
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(2));
    loop {
        let req = UnregisterWorkerRequest {
            worker_id: shared.cfg.worker_id.clone(),
        };
        match tokio::time::timeout_at(deadline, client.unregister_worker(req)).await {
            Ok(Ok(r)) => {
                info!(requeued_jobs = r.into_inner().requeued_jobs, "unregistered");
                return;
            }
            Ok(Err(st)) if transient(st.code()) && Instant::now() < deadline => {
                debug!(status = %describe(&st), "UnregisterWorker failed; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Ok(Err(st)) => {
                warn!(status = %describe(&st), "UnregisterWorker failed");
                return;
            }
            Err(_) => {
                warn!("UnregisterWorker timed out; the server will notice we are gone");
                return;
            }
        }
    }
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the worker until it drains or is stopped.
///
/// Each message on `signals` is one SIGTERM/SIGINT: the first starts a
/// drain (DRAINING on the server, no new leases, running jobs get
/// `drain_timeout` before they are killed, then UnregisterWorker), the second
/// kills every task's process group and returns [`Exit::Forced`] at once.
/// Before it returns, however it ends, it kills every process its tasks
/// left among its children and their descendants (for up to 2 s), so
/// nothing a task started outlives the worker. A
/// `drain` command from the server drains the same way but without a time
/// limit. Prints `agw: registered <id> with <n> tools: <list>` on stdout each
/// time a connection is (re-)established.
///
/// # Errors
///
/// [`WorkerError::Config`] for a bad URL, TLS file or token;
/// [`WorkerError::Registration`] when the server refuses the first
/// registration for good (bad id, bad or missing token).
pub async fn run(cfg: WorkerConfig, mut signals: mpsc::Receiver<()>) -> Result<Exit, WorkerError> {
    let shared = Shared::new(cfg).await?;
    let groups = shared.executor.process_groups().clone();
    info!(
        worker_id = %shared.cfg.worker_id,
        server = %shared.cfg.server,
        tools = %shared.cfg.tools.names().join(","),
        max_concurrent_jobs = shared.cfg.max_concurrent_jobs,
        "agw starting"
    );
    // Processes that escaped their task's group and outlived their parent
    // come to agw (the subreaper) and are killed here.
    let reaper = {
        let groups = groups.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(super::executor::REAP_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                // It may wait for processes to stop: off the runtime's threads.
                let groups = groups.clone();
                let killed = tokio::task::spawn_blocking(move || groups.reap_escaped())
                    .await
                    .unwrap_or(0);
                if killed > 0 {
                    warn!(killed, "killed processes that outlived their task");
                }
            }
        })
    };
    let _reaper = AbortOnDrop(reaper);
    let mut sessions = tokio::spawn(session_loop(Arc::clone(&shared)));
    let mut drain_rx = shared.drain.subscribe();
    let mut count_rx = shared.job_count.subscribe();
    let mut signals_open = true;
    let mut signal_count = 0u32;
    let mut drain_deadline: Option<Instant> = None;
    let mut report_deadline: Option<Instant> = None;
    // Jobs the drain timeout stopped (their reports get KILLED_REPORT_GRACE).
    let mut stopped: HashSet<String> = HashSet::new();
    let forced = |sessions: &tokio::task::JoinHandle<WorkerError>| {
        warn!("second signal: killing running jobs and exiting now");
        sessions.abort();
        let groups = groups.clone();
        async move {
            groups.kill_everything(EXIT_SWEEP).await;
            Ok(Exit::Forced)
        }
    };
    loop {
        if shared.draining() && *count_rx.borrow_and_update() == 0 {
            break;
        }
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        tokio::select! {
            s = signals.recv(), if signals_open => match s {
                None => signals_open = false,
                Some(()) => {
                    signal_count += 1;
                    if signal_count >= 2 {
                        return forced(&sessions).await;
                    }
                    let running = shared.active_jobs();
                    info!(running_jobs = running, drain_timeout_secs = shared.cfg.drain_timeout.as_secs(), "signal: draining (send another to exit at once)");
                    shared.request_drain(Drain::Signal);
                    drain_deadline = Some(Instant::now() + shared.cfg.drain_timeout);
                    tokio::spawn(drain_self(Arc::clone(&shared)));
                }
            },
            r = &mut sessions => {
                groups.kill_everything(EXIT_SWEEP).await;
                return Err(r.unwrap_or_else(|e| WorkerError::Config(format!("session task failed: {e}"))));
            }
            _ = drain_rx.changed() => {}
            _ = count_rx.changed() => {}
            () = tokio::time::sleep_until(drain_deadline.unwrap_or(far)), if drain_deadline.is_some() && report_deadline.is_none() => {
                warn!(running_jobs = shared.active_jobs(), "drain timeout: killing the jobs still running");
                stopped = shared.abort_running(&AbortReason::DrainTimeout(shared.cfg.drain_timeout));
                report_deadline = Some(Instant::now() + KILLED_REPORT_GRACE);
            }
            () = tokio::time::sleep_until(report_deadline.unwrap_or(far)), if report_deadline.is_some() => {
                if shared.results_pending_besides(&stopped) {
                    // A finished job's result is never given up: it is
                    // sent until the server takes it (or a second signal).
                    warn!("results of finished jobs still wait for the server; waiting for it (send another signal to exit at once)");
                    report_deadline = Some(far);
                } else {
                    warn!("killed jobs did not report in time; unregistering anyway");
                    break;
                }
            }
        }
    }
    shared.leaving.store(true, Ordering::SeqCst);
    if shared.registered.load(Ordering::SeqCst) {
        info!("drained: unregistering");
        tokio::select! {
            () = unregister(&shared) => {}
            Some(()) = signals.recv(), if signals_open => return forced(&sessions).await,
        }
    } else {
        info!("stopping before the first registration");
    }
    sessions.abort();
    groups.kill_everything(EXIT_SWEEP).await;
    Ok(Exit::Drained)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::worker::{config::AgwArgs, executor::AbortReceiver};

    /// The shared state of a worker whose server is never reached.
    async fn shared() -> Arc<Shared> {
        shared_with(&["--tools", "sort"]).await
    }

    /// The same, with more agw arguments.
    async fn shared_with(args: &[&str]) -> Arc<Shared> {
        let mut argv = vec![
            "agw",
            "--server",
            "http://127.0.0.1:9",
            "--worker-id",
            "w",
            "--insecure-no-sandbox",
        ];
        argv.extend_from_slice(args);
        let cfg = AgwArgs::try_parse_from(argv)
            .unwrap()
            .into_config()
            .unwrap();
        Shared::new(cfg).await.unwrap()
    }

    /// A lease of `job_id` under `lease_id` whose one task runs `sh -c script`.
    fn sh_lease(job_id: &str, lease_id: &str, script: &str) -> JobLease {
        JobLease {
            lease_id: lease_id.into(),
            job: Some(crate::pb::Job {
                job_id: job_id.into(),
                ..Default::default()
            }),
            plan: Some(Plan {
                plan_id: "p".into(),
                tasks: vec![Task {
                    task_number: 1,
                    command: "sh".into(),
                    args: vec!["-c".into(), script.into()],
                    timeout_secs: 60,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            attempt: 1,
            ..Default::default()
        }
    }

    /// A temporary directory the tasks may write in (agw as root runs them
    /// as another user).
    fn shared_dir() -> tempfile::TempDir {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        dir
    }

    /// Waits (at most 15 s) until `path` exists; the time it took.
    async fn appears(path: &std::path::Path) -> Duration {
        let start = std::time::Instant::now();
        for _ in 0..300 {
            if path.exists() {
                return start.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} did not appear within 15 s", path.display());
    }

    /// A job leased again while its old attempt still runs starts under
    /// the new lease only once the old attempt's processes are gone and
    /// its output is closed, never beside them. The old attempt leaves a
    /// process outside its group holding its stdout, so its end takes the
    /// executor's 2 s pipe grace after the kill.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_leased_again_starts_after_the_old_attempt_has_stopped() {
        let dir = shared_dir();
        let d = dir.path().display();
        let s = shared_with(&["--tools", "sh,setsid,sleep"]).await;
        s.start_job(sh_lease(
            "j",
            "lease-1",
            &format!("echo $$ > {d}/old; setsid sleep 4 & exec sleep 30"),
        ));
        appears(&dir.path().join("old")).await;
        let started = std::time::Instant::now();
        s.start_job(sh_lease(
            "j",
            "lease-2",
            &format!("kill -0 $(cat {d}/old) 2>/dev/null && touch {d}/overlap; touch {d}/new"),
        ));
        appears(&dir.path().join("new")).await;
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(1500),
            "the new attempt started {waited:?} after the old one was superseded, before the old one had stopped"
        );
        assert!(
            !dir.path().join("overlap").exists(),
            "the new attempt ran while the old attempt's process was alive"
        );
        assert_eq!(
            s.jobs().get("j").map(|j| j.lease_id.clone()).as_deref(),
            Some("lease-2")
        );
    }

    /// The server sends a lease again on a worker's new lease stream when
    /// the worker has not named it in `held_leases` since it went out on
    /// an earlier stream: a lease id already running here is not run a
    /// second time, and its attempt goes on undisturbed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_delivered_again_does_not_run_its_job_twice() {
        let dir = shared_dir();
        let d = dir.path().display();
        let s = shared_with(&["--tools", "sh,sleep"]).await;
        let script = format!("echo run >> {d}/runs; exec sleep 30");
        s.start_job(sh_lease("j", "lease-1", &script));
        appears(&dir.path().join("runs")).await;
        s.start_job(sh_lease("j", "lease-1", &script));
        // A second run, had it started, would have stopped the first
        // (about 0.1 s) and appended its line by now.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let runs = std::fs::read_to_string(dir.path().join("runs")).unwrap();
        assert_eq!(
            runs, "run\n",
            "the job ran again for a lease it already ran"
        );
        assert_eq!(s.active_jobs(), 1);
        let stopped = s.jobs().get("j").map(|j| j.abort.borrow().is_some());
        assert_eq!(stopped, Some(false), "the running attempt was stopped");
        s.on_heartbeat_response(cancel("j", "lease-1"));
    }

    /// A worker with one slot runs a second lease only once the first job
    /// is over, however many leases the server sends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leases_beyond_the_slots_wait_for_a_free_slot() {
        let dir = shared_dir();
        let d = dir.path().display();
        let s = shared_with(&["--tools", "sh,sleep", "--max-concurrent-jobs", "1"]).await;
        s.start_job(sh_lease(
            "a",
            "lease-a",
            &format!("touch {d}/a; exec sleep 30"),
        ));
        appears(&dir.path().join("a")).await;
        s.start_job(sh_lease("b", "lease-b", &format!("touch {d}/b")));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !dir.path().join("b").exists(),
            "a second job ran while the only slot was taken"
        );
        assert_eq!(
            s.active_jobs(),
            2,
            "the waiting lease is held (heartbeats report it)"
        );
        s.on_heartbeat_response(cancel("a", "lease-a"));
        appears(&dir.path().join("b")).await;
    }

    /// Puts job `job_id` in the running table under `lease_id`.
    fn running(s: &Shared, job_id: &str, lease_id: &str) -> AbortReceiver {
        let (abort, rx) = abort_channel();
        s.jobs().insert(
            job_id.into(),
            RunningJob {
                lease_id: lease_id.into(),
                abort,
                reporting: false,
                exited: watch::channel(false).1,
            },
        );
        rx
    }

    fn cancel(job_id: &str, lease_id: &str) -> HeartbeatResponse {
        HeartbeatResponse {
            command: Some(Command::CancelJobId(job_id.into())),
            cancel_lease_id: lease_id.into(),
            ..Default::default()
        }
    }

    /// A cancel of an attempt the worker no longer runs (the job was
    /// leased to it again, and the new lease came first) leaves the new
    /// attempt running; a cancel naming the running lease, or naming no
    /// lease (an older server), stops it.
    #[tokio::test]
    async fn a_cancel_stops_only_the_attempt_it_names() {
        let s = shared().await;
        let rx = running(&s, "j", "lease-2");
        s.on_heartbeat_response(cancel("j", "lease-1"));
        assert_eq!(*rx.borrow(), None);
        s.on_heartbeat_response(cancel("j", "lease-2"));
        assert_eq!(*rx.borrow(), Some(AbortReason::Cancelled));
        let rx = running(&s, "k", "lease-3");
        s.on_heartbeat_response(cancel("k", ""));
        assert_eq!(*rx.borrow(), Some(AbortReason::Cancelled));
    }
}
