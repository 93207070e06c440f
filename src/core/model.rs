//! AGQ's domain types: what the engine interface ([`super::Engine`]) takes
//! and returns. They mirror the `agq.v1` messages but carry no wire
//! detail: times are milliseconds since the Unix epoch (`*_ms`), enums are
//! Rust enums without an "unspecified" value, optional parts are `Option`.
//! The service layer (`crate::service`) converts them to and from the
//! generated protobuf types.

use std::{collections::HashMap, sync::Arc};

/// Status of a job. The discriminants are the values stored by the
/// engines and sent on the wire (`agq.v1.JobStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JobStatus {
    /// Waiting to be leased (ready or scheduled).
    Pending = 1,
    /// Leased to a worker.
    Running = 2,
    /// Finished successfully.
    Completed = 3,
    /// The last attempt failed; it waits out its backoff before the next.
    Failed = 4,
    /// Every attempt failed.
    Dead = 5,
    /// Cancelled by a client.
    Cancelled = 6,
}

impl JobStatus {
    /// Every status, in wire order.
    pub const ALL: [JobStatus; 6] = [
        JobStatus::Pending,
        JobStatus::Running,
        JobStatus::Completed,
        JobStatus::Failed,
        JobStatus::Dead,
        JobStatus::Cancelled,
    ];

    /// The status with wire/storage value `v`; `None` for 0 (unspecified)
    /// and unknown values.
    pub fn from_i32(v: i32) -> Option<JobStatus> {
        JobStatus::ALL.into_iter().find(|s| *s as i32 == v)
    }

    /// Lower-case name (`pending`, `running`, ...), as in metric labels
    /// and messages.
    pub fn name(self) -> &'static str {
        match self {
            JobStatus::Pending => "pending",
            JobStatus::Running => "running",
            JobStatus::Completed => "completed",
            JobStatus::Failed => "failed",
            JobStatus::Dead => "dead",
            JobStatus::Cancelled => "cancelled",
        }
    }
}

/// Lifecycle state of a worker. The discriminants are the stored and wire
/// values (`agq.v1.WorkerState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerState {
    /// Registered and taking leases.
    Active = 1,
    /// Finishing what it holds; takes no new leases.
    Draining = 2,
    /// Its heartbeat went stale (3 x the interval).
    Dead = 3,
    /// It unregistered.
    Unregistered = 4,
    /// Flagged for investigation after too many job timeouts: takes no
    /// new leases until released.
    Quarantined = 5,
}

impl WorkerState {
    /// Every state, in wire order.
    pub const ALL: [WorkerState; 5] = [
        WorkerState::Active,
        WorkerState::Draining,
        WorkerState::Dead,
        WorkerState::Unregistered,
        WorkerState::Quarantined,
    ];

    /// The state with wire/storage value `v`; `None` for 0 and unknown values.
    pub fn from_i32(v: i32) -> Option<WorkerState> {
        WorkerState::ALL.into_iter().find(|s| *s as i32 == v)
    }

    /// Upper-case name (`ACTIVE`, `DRAINING`, `DEAD`, `UNREGISTERED`), as
    /// in messages to people.
    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Active => "ACTIVE",
            WorkerState::Draining => "DRAINING",
            WorkerState::Dead => "DEAD",
            WorkerState::Unregistered => "UNREGISTERED",
            WorkerState::Quarantined => "QUARANTINED",
        }
    }

    /// True for ACTIVE, DRAINING and QUARANTINED: the worker process is
    /// expected to be alive and may hold leases.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            WorkerState::Active | WorkerState::Draining | WorkerState::Quarantined
        )
    }
}

/// One step of a plan: a direct `exec` of one advertised tool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Task {
    /// 1-based position in the plan.
    pub task_number: u32,
    /// The executable's name (never a shell string).
    pub command: String,
    /// Arguments; `{{name}}` is replaced by the job input's value.
    pub args: Vec<String>,
    /// Kill the task after this many seconds.
    pub timeout_secs: u32,
    /// Stdin is the stdout of this earlier task.
    pub input_from_task: Option<u32>,
    /// Whether a substituted value may start with `-`.
    pub allow_option_values: bool,
    /// Exit codes (1..=255) after which the job is not retried: the worker
    /// reports the failure as permanent ([`JobReport::permanent`]).
    pub permanent_exit_codes: Vec<i32>,
}

/// A reusable pipeline of tasks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Id (`[A-Za-z0-9_.-]`, see [`super::validate::object_id`]).
    pub plan_id: String,
    /// Free text for people.
    pub plan_description: String,
    /// 1..=100 tasks, numbered 1..=n.
    pub tasks: Vec<Task>,
    /// Only workers that run tasks in the kernel sandbox may run it.
    pub require_sandbox: bool,
    /// Version under its id: 1 for the first submission, one more per
    /// replacement that changed it. Set by the engine; ignored by
    /// [`super::Engine::submit_plan`].
    pub version: u32,
    /// Default worker selector of the plan's actions (see
    /// [`super::selector`]): an action submitted without its own selector
    /// runs only on workers whose tags match this one. Empty: any worker.
    pub worker_selector: String,
    /// Only workers that passed a verification of every command of its
    /// tasks run it.
    pub require_verified_tools: bool,
}

impl Plan {
    /// True when `other` has the same content: description, tasks and
    /// `require_sandbox` and the worker selector (the id and the version
    /// are not compared). A
    /// replacement with the same content stores no new version.
    pub fn same_content(&self, other: &Plan) -> bool {
        self.plan_description == other.plan_description
            && self.tasks == other.tasks
            && self.require_sandbox == other.require_sandbox
            && self.worker_selector == other.worker_selector
            && self.require_verified_tools == other.require_verified_tools
    }
}

/// What storing a plan did ([`super::Engine::submit_plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmittedPlan {
    /// The plan's id.
    pub plan_id: String,
    /// The version it is stored as (the latest, unchanged, when `created`
    /// is false).
    pub version: u32,
    /// True when a new version was stored; false when a replacement was
    /// identical to the latest version and nothing was written.
    pub created: bool,
}

/// A plan in a listing: its latest version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanSummary {
    /// Id.
    pub plan_id: String,
    /// Latest version.
    pub version: u32,
    /// The latest version's description.
    pub plan_description: String,
    /// When version 1 was stored, ms since the epoch.
    pub created_at_ms: i64,
    /// When the latest version was stored, ms since the epoch.
    pub updated_at_ms: i64,
}

/// One stored version of a plan, without its tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanVersion {
    /// The version.
    pub version: u32,
    /// Its description.
    pub plan_description: String,
    /// Number of its tasks.
    pub task_count: u32,
    /// When it was stored, ms since the epoch.
    pub created_at_ms: i64,
}

/// Outcome of one task of a job attempt. Serialized (JSON) as the stores
/// keep it: a field that holds its default (0, empty, false) is left out,
/// and one that is missing reads as its default, so a completion row
/// stays short (the bench's one-task result, `true` printing `ok`: 52 bytes
/// instead of 144).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TaskResult {
    /// Which task.
    #[serde(skip_serializing_if = "is_default")]
    pub task_number: u32,
    /// Its command.
    #[serde(skip_serializing_if = "is_default")]
    pub command: String,
    /// Exit code (negative: killed by a signal).
    #[serde(skip_serializing_if = "is_default")]
    pub exit_code: i32,
    /// Captured stdout (up to the worker's cap).
    #[serde(skip_serializing_if = "is_default")]
    pub stdout: String,
    /// Captured stderr (up to the worker's cap).
    #[serde(skip_serializing_if = "is_default")]
    pub stderr: String,
    /// Run time, ms.
    #[serde(skip_serializing_if = "is_default")]
    pub duration_ms: u64,
    /// Stdout was cut at the cap.
    #[serde(skip_serializing_if = "is_default")]
    pub stdout_truncated: bool,
    /// Stderr was cut at the cap.
    #[serde(skip_serializing_if = "is_default")]
    pub stderr_truncated: bool,
}

/// Whether `v` is its type's default (serde leaves such fields out).
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// One plan run on one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// Public id (a UUIDv7).
    pub job_id: String,
    /// Owning action.
    pub action_id: String,
    /// Plan it runs.
    pub plan_id: String,
    /// Version of the plan it runs: the latest when its action was
    /// submitted, for the job's whole life.
    pub plan_version: u32,
    /// Current status.
    pub status: JobStatus,
    /// Input values.
    pub input: HashMap<String, String>,
    /// Attempts made so far (the current one included while running).
    pub attempt: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Creation time, ms.
    pub created_at_ms: i64,
    /// Start of the current or last attempt, ms.
    pub started_at_ms: Option<i64>,
    /// When it reached a final status, ms.
    pub completed_at_ms: Option<i64>,
    /// Holder of the current or last lease; empty if never leased.
    pub worker_id: String,
    /// Task results of the current or last attempt.
    pub task_results: Vec<TaskResult>,
    /// Error of the last failed attempt.
    pub error: String,
    /// Why a pending job is not running yet, for people; empty otherwise.
    pub waiting_reason: String,
    /// Task running now (progress report), 0 when unknown.
    pub current_task: u32,
    /// Progress of the attempt, 0..=100.
    pub progress_percent: u32,
    /// When it becomes (or became) eligible to run, ms.
    pub ready_at_ms: Option<i64>,
    /// Scheduling priority: its action's, unless a RetryJob changed it.
    /// Higher leases first.
    pub priority: i32,
}

/// Aggregate progress of an action.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActionStatus {
    /// The action.
    pub action_id: String,
    /// Its plan.
    pub plan_id: String,
    /// Version of the plan its jobs run.
    pub plan_version: u32,
    /// Jobs it created.
    pub total_jobs: u32,
    /// Jobs pending.
    pub pending: u32,
    /// Jobs running.
    pub running: u32,
    /// Jobs completed.
    pub completed: u32,
    /// Jobs failed (backing off before a retry).
    pub failed: u32,
    /// Jobs dead.
    pub dead: u32,
    /// Jobs cancelled.
    pub cancelled: u32,
    /// Submission time, ms.
    pub created_at_ms: i64,
    /// When its last open job ended, ms; `None` while any is open.
    pub completed_jobs_at_ms: Option<i64>,
    /// How its jobs are scheduled.
    pub scheduling: Scheduling,
}

/// How an action's jobs are scheduled among each other and onto workers:
/// fleet scheduling settings given at submission.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scheduling {
    /// Higher leases first, in -1000..=1000 (0 by default); within one
    /// priority, actions take turns and each action's jobs go in
    /// submission order.
    pub priority: i32,
    /// Worker selector in effect (the action's own, else its plan's
    /// default), in canonical form; empty: any worker.
    pub worker_selector: String,
    /// Jobs of every action with this key run at most `max_running` at a
    /// time across the fleet; empty: no limit.
    pub concurrency_key: String,
    /// The limit of `concurrency_key`; 0 when there is no key.
    pub max_running: u32,
}

/// What a worker can run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerCapabilities {
    /// Executables it advertises.
    pub tools: Vec<String>,
    /// Names of the agentic units it advertises (those of `units`).
    pub agentic_units: Vec<String>,
    /// The agentic units, as each described itself.
    pub units: Vec<AgenticUnit>,
}

impl WorkerCapabilities {
    /// Every command name a task may use on the worker: its tools and its
    /// agentic units.
    pub fn commands(&self) -> impl Iterator<Item = &String> {
        self.tools.iter().chain(self.units.iter().map(|u| &u.name))
    }
}

/// An agentic unit a worker offers: an executable that describes itself
/// (`UNIT --describe`) and that a task runs by naming it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgenticUnit {
    /// The command name tasks use.
    pub name: String,
    /// Its version, free text.
    #[serde(default)]
    pub version: String,
    /// What it does.
    #[serde(default)]
    pub description: String,
    /// The inputs it reads.
    #[serde(default)]
    pub inputs: Vec<AgenticUnitInput>,
}

/// One input of an [`AgenticUnit`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgenticUnitInput {
    /// The input's name.
    pub name: String,
    /// What it is.
    #[serde(default)]
    pub description: String,
}

/// A capability verification: a challenge to run a tool or unit with
/// fixed arguments and the worker's answer (WORKER.VERIFY).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verification {
    /// The tool or unit.
    pub tool: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Id of the challenge.
    pub challenge_id: String,
    /// When it was sent, ms.
    pub requested_at_ms: i64,
    /// When the answer arrived, ms; `None` while pending.
    pub answered_at_ms: Option<i64>,
    /// The command exited 0.
    pub passed: bool,
    /// Its exit code; -1 when it did not run.
    pub exit_code: i32,
    /// The start of its stdout (at most [`MAX_VERIFY_OUTPUT`] bytes).
    pub output: String,
    /// Why it did not pass.
    pub error: String,
}

/// Most bytes of a verification answer's output (and error) kept.
pub const MAX_VERIFY_OUTPUT: usize = 4096;

/// A worker's answer to a verification challenge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerificationAnswer {
    /// The challenge answered.
    pub challenge_id: String,
    /// Exit code; -1 when the command did not run.
    pub exit_code: i32,
    /// Start of its stdout.
    pub output: String,
    /// Why it failed; empty on exit 0.
    pub error: String,
}

/// Figures a worker reports with each heartbeat.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerStats {
    /// Jobs it runs now.
    pub active_jobs: u32,
    /// Jobs completed since it started.
    pub completed_jobs_total: u64,
    /// Jobs failed since it started.
    pub failed_jobs_total: u64,
    /// Seconds since it started.
    pub uptime_secs: u64,
    /// Host CPU use, percent.
    pub cpu_usage_percent: f64,
    /// Host memory in use, MiB.
    pub memory_mb: u64,
    /// Free disk, GiB.
    pub disk_available_gb: u64,
    /// Mean job duration, ms.
    pub avg_job_duration_ms: u64,
}

/// A worker as clients see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    /// Id.
    pub worker_id: String,
    /// Host name it reported.
    pub hostname: String,
    /// Platform it reported (`linux/x86_64`).
    pub platform: String,
    /// Its agw version.
    pub agw_version: String,
    /// Advertised tools and units.
    pub capabilities: WorkerCapabilities,
    /// Leases it may hold at once.
    pub max_concurrent_jobs: u32,
    /// Free-form labels.
    pub tags: HashMap<String, String>,
    /// Lifecycle state.
    pub state: WorkerState,
    /// Live and its last heartbeat younger than 3 x the interval.
    pub fresh: bool,
    /// Last heartbeat (or registration), ms.
    pub last_heartbeat_at_ms: i64,
    /// Stats of the last heartbeat.
    pub stats: WorkerStats,
    /// Leases it holds now.
    pub active_leases: u32,
    /// Both its heartbeat and lease streams are open.
    pub connected: bool,
    /// Registration time, ms.
    pub registered_at_ms: i64,
    /// It runs tasks in the kernel sandbox.
    pub sandboxed: bool,
    /// Random id of the agw process holding the worker id.
    pub instance_id: String,
    /// Why it is quarantined; empty when it is not.
    pub quarantine_reason: String,
    /// The latest verification of each tool or unit it was challenged on.
    pub verifications: Vec<Verification>,
}

/// A worker's registration, validated (see
/// [`super::validate::registration`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registration {
    /// Id.
    pub worker_id: String,
    /// Host name.
    pub hostname: String,
    /// Platform.
    pub platform: String,
    /// agw version.
    pub agw_version: String,
    /// Advertised capabilities (tools deduplicated).
    pub capabilities: WorkerCapabilities,
    /// Leases it may hold at once (at least 1).
    pub max_concurrent_jobs: u32,
    /// Labels.
    pub tags: HashMap<String, String>,
    /// Random id of this agw process; empty from clients that send none.
    pub instance_id: String,
    /// It runs tasks in the kernel sandbox.
    pub sandboxed: bool,
}

/// What registering returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    /// How often the worker must heartbeat.
    pub heartbeat_interval: std::time::Duration,
    /// The same instance registered again and kept its leases.
    pub resumed: bool,
}

/// A worker's report on a leased job (the UpdateJob call).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobReport {
    /// The job.
    pub job_id: String,
    /// The reporting worker.
    pub worker_id: String,
    /// The lease it holds (the fencing token).
    pub lease_id: String,
    /// RUNNING (progress), COMPLETED or FAILED; `None` when the request
    /// named no status or one this server does not know (refused with
    /// `InvalidArgument` once the lease is checked).
    pub status: Option<JobStatus>,
    /// Task running now.
    pub current_task: u32,
    /// Progress, 0..=100.
    pub progress_percent: u32,
    /// Results so far (all of them on a final report).
    pub task_results: Vec<TaskResult>,
    /// Why the attempt failed.
    pub error: String,
    /// With FAILED: retrying cannot help; the job goes to DEAD at once.
    pub permanent: bool,
}

/// A lease pushed to a worker's lease stream.
#[derive(Debug, Clone, PartialEq)]
pub struct JobLease {
    /// The fencing token of this attempt.
    pub lease_id: String,
    /// The job, as granted (status RUNNING).
    pub job: Job,
    /// Its plan, at the job's version ([`Job::plan_version`]).
    pub plan: Arc<Plan>,
    /// Attempt number (1-based).
    pub attempt: u32,
    /// When the lease expires (the job timeout), ms.
    pub expires_at_ms: i64,
    /// W3C `traceparent` of the submission that created the job (see
    /// [`crate::core::engine::ActionRequest::traceparent`]); `None`: not
    /// traced.
    pub traceparent: Option<std::sync::Arc<str>>,
}

/// A command for a worker, sent over its heartbeat stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerCommand {
    /// Stop taking leases, finish what it runs.
    Drain {
        /// Why, for the worker's log.
        reason: String,
    },
    /// Stop running this job (cancelled, or its lease was lost), if it
    /// still runs under this lease.
    CancelJob {
        /// The job's public id.
        job_id: String,
        /// The lease of the attempt to stop (a newer attempt of the same
        /// job on the same worker keeps running).
        lease_id: String,
    },
    /// Run `command` with `args` and answer (a capability verification).
    Verify {
        /// Id to answer with.
        challenge_id: String,
        /// Tool or agentic unit.
        command: String,
        /// Its arguments.
        args: Vec<String>,
    },
}

impl WorkerCommand {
    /// The Drain command of DrainWorker, sent again on every heartbeat
    /// stream a DRAINING worker opens (the first copy may have been lost
    /// with the stream it was sent on, or found none open).
    pub fn drain_requested() -> WorkerCommand {
        WorkerCommand::Drain {
            reason: "drain requested".into(),
        }
    }
}

/// One message of a worker's heartbeat stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatReply {
    /// The next heartbeat is due before this time, ms.
    pub next_deadline_ms: i64,
    /// A command, if the server has one.
    pub command: Option<WorkerCommand>,
    /// Of the leases a reconnecting worker named as held, those that are
    /// no longer its own (HeartbeatResponse.revoked_lease_ids).
    pub revoked_leases: Vec<String>,
}

/// The leases of `held` (named by a reconnecting worker) that are not
/// among `current` (its leases as the store has them), sorted: those the
/// server took back while the worker was away
/// ([`HeartbeatReply::revoked_leases`]).
pub fn revoked_leases<'a>(
    held: &std::collections::HashSet<String>,
    current: impl IntoIterator<Item = &'a str>,
) -> Vec<String> {
    let current: std::collections::HashSet<&str> = current.into_iter().collect();
    let mut revoked: Vec<String> = held
        .iter()
        .filter(|l| !current.contains(l.as_str()))
        .cloned()
        .collect();
    revoked.sort();
    revoked
}

/// Queue depths and worker counts (the QUEUE.STATS command of the
/// specification).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Ready pending jobs.
    pub ready_length: u64,
    /// Jobs waiting for a time (scheduled or backing off).
    pub scheduled_length: u64,
    /// Leased jobs.
    pub running_length: u64,
    /// Age of the oldest ready job, s.
    pub oldest_ready_age_secs: u64,
    /// Until the next scheduled job is due, s.
    pub next_scheduled_due_in_secs: u64,
    /// Age of the newest ready job, s.
    pub newest_job_age_secs: u64,
    /// Live workers: the sum of the five counts below.
    pub workers_total: u32,
    /// Fresh ACTIVE workers running at least one job.
    pub workers_active: u32,
    /// Fresh ACTIVE workers running none.
    pub workers_idle: u32,
    /// Fresh DRAINING workers.
    pub workers_draining: u32,
    /// Fresh QUARANTINED workers.
    pub workers_quarantined: u32,
    /// Live workers whose heartbeat is stale.
    pub workers_stale: u32,
    /// Jobs per priority, highest first.
    pub by_priority: Vec<PriorityStats>,
    /// Jobs per worker pool (selector), by selector: the [`MAX_POOLS`]
    /// pools with the most jobs.
    pub by_pool: Vec<PoolStats>,
}

/// Ready, scheduled and running jobs of one group of a [`QueueStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Depths {
    /// Ready pending jobs.
    pub ready: u64,
    /// Jobs waiting for a time.
    pub scheduled: u64,
    /// Leased jobs.
    pub running: u64,
}

/// The jobs of one priority.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PriorityStats {
    /// The priority.
    pub priority: i32,
    /// Its jobs.
    pub depths: Depths,
}

/// Most pools a [`QueueStats`] lists (and the metrics label): those with
/// the most jobs. Clients choose selectors, so the pools are not bounded
/// otherwise.
pub const MAX_POOLS: usize = 100;

/// The [`MAX_POOLS`] pools of `pools` (selector, jobs, anything else)
/// with the most jobs, ties to the lower selector, in selector order.
pub fn deepest_pools<T>(mut pools: Vec<(String, Depths, T)>) -> Vec<(String, Depths, T)> {
    if pools.len() > MAX_POOLS {
        let total = |d: &Depths| d.ready + d.scheduled + d.running;
        pools.sort_by(|a, b| total(&b.1).cmp(&total(&a.1)).then_with(|| a.0.cmp(&b.0)));
        pools.truncate(MAX_POOLS);
        pools.sort_by(|a, b| a.0.cmp(&b.0));
    }
    pools
}

/// The jobs of one worker pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Canonical selector; empty: any worker.
    pub worker_selector: String,
    /// Its jobs.
    pub depths: Depths,
    /// Fresh ACTIVE workers whose tags match.
    pub workers_matching: u32,
}

/// What a schedule does with the ticks it missed while the server was
/// down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CatchUp {
    /// Every missed tick gets its action, oldest first, up to the
    /// [`MAX_CATCH_UP`] most recent.
    #[default]
    All,
    /// Only the latest missed tick gets an action.
    Latest,
    /// Missed ticks are dropped: only a tick less than
    /// [`SKIP_GRACE_MS`] late fires.
    Skip,
}

/// Most missed ticks of one schedule caught up at once
/// ([`CatchUp::All`]); older ones are dropped and counted.
pub const MAX_CATCH_UP: usize = 100;

/// How late a tick may fire under [`CatchUp::Skip`], ms.
pub const SKIP_GRACE_MS: i64 = 60_000;

/// A recurring schedule: at every tick of `cron` (read in `time_zone`) an
/// action of `plan_id` with `inputs` is submitted, in the transaction that
/// records the tick.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Id, `[A-Za-z0-9._-]{1,100}`.
    pub schedule_id: String,
    /// The plan each tick runs (its latest version then).
    pub plan_id: String,
    /// Cron expression ([`super::cron`]).
    pub cron: String,
    /// IANA time zone; empty: UTC.
    pub time_zone: String,
    /// The inputs of each action.
    pub inputs: Vec<HashMap<String, String>>,
    /// Attempts per job (validated: 1..=100).
    pub max_attempts: u32,
    /// Scheduling settings of each action.
    pub scheduling: Scheduling,
    /// Missed ticks.
    pub catch_up: CatchUp,
    /// Paused: no tick fires.
    pub paused: bool,
    /// The next tick, ms; `None` while paused.
    pub next_run_at_ms: Option<i64>,
    /// The tick of the last action submitted, ms.
    pub last_run_at_ms: Option<i64>,
    /// The last action submitted; empty before the first.
    pub last_action_id: String,
    /// Actions submitted so far.
    pub runs: u64,
    /// Why the last tick submitted nothing, or ticks were dropped.
    pub last_error: String,
    /// Creation time, ms.
    pub created_at_ms: i64,
}
