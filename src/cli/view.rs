//! What the client prints: serde view structs of the protobuf messages for
//! `--output json` (snake_case field names, status enums as short
//! lower-case names such as `"completed"`, times as RFC 3339 strings, unset
//! times as `null`), and the `--output table` rendering of each.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    table::{key_values, visible, visible_lines, Table},
    time::{ago, human_duration, rfc3339},
};
use crate::pb::{self, JobStatus, WorkerState};

/// Short lower-case name of a job status (`"completed"`): the proto name
/// (`JOB_STATUS_COMPLETED`) without its prefix; `"unknown"` for values this
/// client does not know.
pub fn job_status_name(status: i32) -> String {
    JobStatus::try_from(status).map_or_else(
        |_| "unknown".into(),
        |s| short_name(s.as_str_name(), "JOB_STATUS_"),
    )
}

/// Short lower-case name of a worker state (`"active"`): the proto name
/// (`WORKER_STATE_ACTIVE`) without its prefix; `"unknown"` for values this
/// client does not know.
pub fn worker_state_name(state: i32) -> String {
    WorkerState::try_from(state).map_or_else(
        |_| "unknown".into(),
        |s| short_name(s.as_str_name(), "WORKER_STATE_"),
    )
}

/// The lower-case name of an enum value named `PREFIX_NAME` in the proto.
fn short_name(proto_name: &str, prefix: &str) -> String {
    proto_name
        .strip_prefix(prefix)
        .unwrap_or(proto_name)
        .to_ascii_lowercase()
}

/// A job status as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StatusArg {
    /// Waiting to be leased.
    Pending,
    /// Leased to a worker.
    Running,
    /// Finished successfully.
    Completed,
    /// Last attempt failed; will be retried.
    Failed,
    /// Every attempt failed.
    Dead,
    /// Cancelled by a client.
    Cancelled,
}

impl From<StatusArg> for JobStatus {
    fn from(s: StatusArg) -> Self {
        match s {
            StatusArg::Pending => JobStatus::Pending,
            StatusArg::Running => JobStatus::Running,
            StatusArg::Completed => JobStatus::Completed,
            StatusArg::Failed => JobStatus::Failed,
            StatusArg::Dead => JobStatus::Dead,
            StatusArg::Cancelled => JobStatus::Cancelled,
        }
    }
}

/// A worker state as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StateArg {
    /// Registered and taking leases.
    Active,
    /// Finishing its leases, taking no new ones.
    Draining,
    /// Missed its heartbeats.
    Dead,
    /// Left cleanly.
    Unregistered,
    /// Flagged after too many job timeouts; no new leases until released.
    Quarantined,
}

impl From<StateArg> for WorkerState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Active => WorkerState::Active,
            StateArg::Draining => WorkerState::Draining,
            StateArg::Dead => WorkerState::Dead,
            StateArg::Unregistered => WorkerState::Unregistered,
            StateArg::Quarantined => WorkerState::Quarantined,
        }
    }
}

/// One task of a Plan: what `agq plan get` prints and `agq plan submit`
/// reads, so `agq plan get X -o json` can be edited and submitted again.
/// Reading accepts lowerCamel names and integers as numeric strings
/// (proto3 JSON) and refuses unknown fields.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TaskView {
    /// 1-based position.
    #[serde(alias = "taskNumber", deserialize_with = "super::plan::lenient_u32")]
    pub task_number: u32,
    /// Executable name.
    pub command: String,
    /// Arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Time limit in seconds (the server requires 1..=86400).
    #[serde(
        default,
        alias = "timeoutSecs",
        deserialize_with = "super::plan::lenient_u32"
    )]
    pub timeout_secs: u32,
    /// Task whose stdout is this task's stdin.
    #[serde(
        default,
        alias = "inputFromTask",
        deserialize_with = "super::plan::lenient_opt_u32",
        skip_serializing_if = "Option::is_none"
    )]
    pub input_from_task: Option<u32>,
    /// Input values starting with `-` may begin an argument.
    #[serde(
        default,
        alias = "allowOptionValues",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub allow_option_values: bool,
    /// Exit codes after which the job is not retried (it goes dead).
    #[serde(
        default,
        alias = "permanentExitCodes",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub permanent_exit_codes: Vec<i32>,
}

/// A Plan, printed by `agq plan get` and read by `agq plan submit`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PlanView {
    /// Id.
    #[serde(alias = "planId")]
    pub plan_id: String,
    /// Description.
    #[serde(default, alias = "planDescription")]
    pub plan_description: String,
    /// Tasks in order.
    #[serde(default)]
    pub tasks: Vec<TaskView>,
    /// Only sandboxed workers get this plan's jobs.
    #[serde(
        default,
        alias = "requireSandbox",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub require_sandbox: bool,
    /// Version under the id, set by the server (0: not stored); read and
    /// ignored by `plan submit`, so a printed plan submits again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub version: u32,
    /// Default worker selector of the plan's actions (label selector
    /// syntax); empty: any worker.
    #[serde(
        default,
        alias = "workerSelector",
        skip_serializing_if = "String::is_empty"
    )]
    pub worker_selector: String,
    /// Only workers that passed a verification of every command run it.
    #[serde(
        default,
        alias = "requireVerifiedTools",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub require_verified_tools: bool,
}

/// True for 0 (fields the JSON output leaves out when unset).
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// `id` and, when known (not 0), its version: `word-frequency (version 2)`.
pub fn plan_with_version(id: &str, version: u32) -> String {
    if version == 0 {
        id.to_string()
    } else {
        format!("{id} (version {version})")
    }
}

impl From<pb::Plan> for PlanView {
    fn from(p: pb::Plan) -> Self {
        PlanView {
            plan_id: p.plan_id,
            plan_description: p.plan_description,
            tasks: p
                .tasks
                .into_iter()
                .map(|t| TaskView {
                    task_number: t.task_number,
                    command: t.command,
                    args: t.args,
                    timeout_secs: t.timeout_secs,
                    input_from_task: t.input_from_task,
                    allow_option_values: t.allow_option_values,
                    permanent_exit_codes: t.permanent_exit_codes,
                })
                .collect(),
            require_sandbox: p.require_sandbox,
            version: p.version,
            worker_selector: p.worker_selector,
            require_verified_tools: p.require_verified_tools,
        }
    }
}

impl PlanView {
    /// The plan as a `key value` header and a task table; the pipeline is
    /// also shown shell-like (`cat {{file}} | tr ...`) when it is linear.
    pub fn table(&self) -> String {
        let mut out = key_values(&[
            ("plan", self.plan_id.clone()),
            ("version", self.version.to_string()),
            ("description", self.plan_description.clone()),
            ("tasks", self.tasks.len().to_string()),
            (
                "sandbox",
                if self.require_sandbox {
                    "required".into()
                } else {
                    "not required".into()
                },
            ),
            (
                "workers",
                if self.worker_selector.is_empty() {
                    "any".into()
                } else {
                    format!("matching {}", self.worker_selector)
                },
            ),
            (
                "verification",
                if self.require_verified_tools {
                    "required (every command verified on the worker)".into()
                } else {
                    "not required".into()
                },
            ),
        ]);
        out.push('\n');
        let mut t = Table::new(["TASK", "COMMAND", "ARGS", "STDIN", "TIMEOUT"]);
        for task in &self.tasks {
            t.row([
                task.task_number.to_string(),
                task.command.clone(),
                shell_words(&task.args),
                task.input_from_task
                    .map(|n| format!("task {n}"))
                    .unwrap_or_else(|| "-".into()),
                format!("{}s", task.timeout_secs),
            ]);
        }
        out.push_str(&t.render());
        out
    }
}

/// Arguments quoted like a shell would need them, for display only:
/// `-cs A-Za-z $'\n'`. Quoting is `shlex`'s (POSIX quotes); an argument
/// with a control character (a newline, a tab) is written in the ANSI-C
/// form `$'...'` instead, which shlex does not produce, so that each plan
/// task stays on one line.
pub fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if a.chars().any(char::is_control) {
                ansi_c_quote(a)
            } else {
                shlex::try_quote(a).map_or_else(|_| ansi_c_quote(a), |q| q.into_owned())
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `a` in the shell's ANSI-C quoting, `$'a\tb\n'`.
fn ansi_c_quote(a: &str) -> String {
    let mut q = String::from("$'");
    for c in a.chars() {
        match c {
            '\n' => q.push_str("\\n"),
            '\t' => q.push_str("\\t"),
            '\r' => q.push_str("\\r"),
            '\\' => q.push_str("\\\\"),
            '\'' => q.push_str("\\'"),
            c if c.is_control() => q.push_str(&format!("\\x{:02x}", c as u32)),
            c => q.push(c),
        }
    }
    q.push('\'');
    q
}

/// Aggregate progress of an Action.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ActionView {
    /// Id.
    pub action_id: String,
    /// The Plan it runs.
    pub plan_id: String,
    /// The version of the Plan its jobs run (0: a server without versions).
    pub plan_version: u32,
    /// Jobs created.
    pub total_jobs: u32,
    /// Jobs pending.
    pub pending: u32,
    /// Jobs running.
    pub running: u32,
    /// Jobs completed.
    pub completed: u32,
    /// Jobs failed, waiting for another attempt.
    pub failed: u32,
    /// Jobs dead.
    pub dead: u32,
    /// Jobs cancelled.
    pub cancelled: u32,
    /// True when every job is terminal (completed, dead or cancelled).
    pub done: bool,
    /// Submission time.
    pub created_at: Option<String>,
    /// When the last job became terminal.
    pub completed_jobs_at: Option<String>,
    /// Priority of its jobs; higher leases first.
    pub priority: i32,
    /// Worker selector in effect; empty: any worker.
    pub worker_selector: String,
    /// Concurrency key; empty: none.
    pub concurrency_key: String,
    /// Most jobs with the key running at once; 0 without a key.
    pub max_running: u32,
}

impl From<&pb::ActionStatus> for ActionView {
    fn from(a: &pb::ActionStatus) -> Self {
        ActionView {
            action_id: a.action_id.clone(),
            plan_id: a.plan_id.clone(),
            plan_version: a.plan_version,
            total_jobs: a.total_jobs,
            pending: a.pending,
            running: a.running,
            completed: a.completed,
            failed: a.failed,
            dead: a.dead,
            cancelled: a.cancelled,
            done: action_done(a),
            created_at: rfc3339(a.created_at.as_ref()),
            completed_jobs_at: rfc3339(a.completed_jobs_at.as_ref()),
            priority: a.priority,
            worker_selector: a.worker_selector.clone(),
            concurrency_key: a.concurrency_key.clone(),
            max_running: a.max_running,
        }
    }
}

/// True when every job of the Action is terminal.
pub fn action_done(a: &pb::ActionStatus) -> bool {
    a.completed + a.dead + a.cancelled >= a.total_jobs
}

impl ActionView {
    /// `key value` lines.
    pub fn table(&self) -> String {
        key_values(&[
            ("action", self.action_id.clone()),
            ("plan", plan_with_version(&self.plan_id, self.plan_version)),
            ("jobs", self.total_jobs.to_string()),
            ("pending", self.pending.to_string()),
            ("running", self.running.to_string()),
            ("completed", self.completed.to_string()),
            ("failed", self.failed.to_string()),
            ("dead", self.dead.to_string()),
            ("cancelled", self.cancelled.to_string()),
            ("done", if self.done { "yes" } else { "no" }.into()),
            ("priority", self.priority.to_string()),
            (
                "workers",
                if self.worker_selector.is_empty() {
                    "any".into()
                } else {
                    format!("matching {}", self.worker_selector)
                },
            ),
            (
                "limit",
                if self.concurrency_key.is_empty() {
                    "unlimited".into()
                } else {
                    format!(
                        "{} (max_running {})",
                        self.concurrency_key, self.max_running
                    )
                },
            ),
            (
                "created",
                self.created_at.clone().unwrap_or_else(|| "-".into()),
            ),
            (
                "finished",
                self.completed_jobs_at.clone().unwrap_or_else(|| "-".into()),
            ),
        ])
    }
}

/// A page of Actions (`agq action list`).
#[derive(Debug, Clone, Serialize)]
pub struct ActionPage {
    /// The Actions, newest first.
    pub actions: Vec<ActionView>,
    /// Token of the next page; empty on the last page.
    pub next_page_token: String,
}

impl ActionPage {
    /// One row per Action: id, plan, job counts, creation time.
    pub fn table(&self) -> String {
        let mut t = Table::new([
            "ACTION",
            "PLAN",
            "JOBS",
            "PENDING",
            "RUNNING",
            "COMPLETED",
            "FAILED",
            "DEAD",
            "CANCELLED",
            "CREATED",
        ]);
        for a in &self.actions {
            t.row([
                a.action_id.clone(),
                a.plan_id.clone(),
                a.total_jobs.to_string(),
                a.pending.to_string(),
                a.running.to_string(),
                a.completed.to_string(),
                a.failed.to_string(),
                a.dead.to_string(),
                a.cancelled.to_string(),
                a.created_at.clone().unwrap_or_else(|| "-".into()),
            ]);
        }
        t.render()
    }
}

/// The outcome of a bulk change of an Action's jobs (`agq action
/// cancel|retry`, `agq job cancel|retry --action`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ActionChangeView {
    /// What was done: "cancelled" or "retried".
    pub change: String,
    /// How many jobs it changed.
    pub jobs: u32,
    /// The Action after the change.
    pub action: ActionView,
}

impl ActionChangeView {
    /// A `<change> N jobs` line, then the Action's `key value` lines.
    pub fn table(&self) -> String {
        format!(
            "{} {} job(s)\n{}",
            self.change,
            self.jobs,
            self.action.table()
        )
    }
}

/// A job status of `agq action retry --status` and `agq job retry
/// --action`: the statuses RetryAction accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RetryStatusArg {
    /// Failed jobs waiting for their next attempt.
    Failed,
    /// Dead jobs (every attempt failed).
    Dead,
}

impl From<RetryStatusArg> for JobStatus {
    fn from(s: RetryStatusArg) -> Self {
        match s {
            RetryStatusArg::Failed => JobStatus::Failed,
            RetryStatusArg::Dead => JobStatus::Dead,
        }
    }
}

/// A job status of `agq job cancel --action --status`: the statuses a job
/// can be cancelled from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CancelStatusArg {
    /// Waiting to be leased.
    Pending,
    /// Leased to a worker (its worker is told to kill it).
    Running,
    /// Waiting for its next attempt.
    Failed,
}

impl From<CancelStatusArg> for JobStatus {
    fn from(s: CancelStatusArg) -> Self {
        match s {
            CancelStatusArg::Pending => JobStatus::Pending,
            CancelStatusArg::Running => JobStatus::Running,
            CancelStatusArg::Failed => JobStatus::Failed,
        }
    }
}

/// An Action state of `agq action list --state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ActionStateArg {
    /// Some job is pending, running or failed.
    Open,
    /// Every job is completed, dead or cancelled.
    Finished,
    /// At least one job is dead.
    HasDead,
}

impl From<ActionStateArg> for pb::ActionState {
    fn from(s: ActionStateArg) -> Self {
        match s {
            ActionStateArg::Open => pb::ActionState::Open,
            ActionStateArg::Finished => pb::ActionState::Finished,
            ActionStateArg::HasDead => pb::ActionState::HasDead,
        }
    }
}

/// Outcome of one task.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct TaskResultView {
    /// The task's number.
    pub task_number: u32,
    /// The command that ran.
    pub command: String,
    /// Exit code; -1 when killed or never started.
    pub exit_code: i32,
    /// Run time in milliseconds.
    pub duration_ms: u64,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
    /// stdout was cut at the worker's cap.
    pub stdout_truncated: bool,
    /// stderr was cut at the worker's cap.
    pub stderr_truncated: bool,
}

/// A Job with its task results.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct JobView {
    /// Id.
    pub job_id: String,
    /// The Action that created it.
    pub action_id: String,
    /// The Plan it runs.
    pub plan_id: String,
    /// The version of the Plan it runs (0: a server without versions).
    pub plan_version: u32,
    /// Status name.
    pub status: String,
    /// Input values.
    pub input: BTreeMap<String, String>,
    /// Attempts started.
    pub attempt: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Worker holding or last holding the lease; empty when none.
    pub worker_id: String,
    /// Why the last attempt failed.
    pub error: String,
    /// Why a pending job waits.
    pub waiting_reason: String,
    /// Task running now, 0 when unknown.
    pub current_task: u32,
    /// Worker-reported progress.
    pub progress_percent: u32,
    /// Creation time.
    pub created_at: Option<String>,
    /// Start of the current or last attempt.
    pub started_at: Option<String>,
    /// When it became terminal.
    pub completed_at: Option<String>,
    /// When it becomes eligible to run (scheduled or backing off).
    pub ready_at: Option<String>,
    /// Scheduling priority; higher leases first.
    pub priority: i32,
    /// Results of the latest reported attempt.
    pub task_results: Vec<TaskResultView>,
}

impl From<pb::Job> for JobView {
    fn from(j: pb::Job) -> Self {
        JobView {
            status: job_status_name(j.status),
            input: j.input.into_iter().collect(),
            created_at: rfc3339(j.created_at.as_ref()),
            started_at: rfc3339(j.started_at.as_ref()),
            completed_at: rfc3339(j.completed_at.as_ref()),
            ready_at: rfc3339(j.ready_at.as_ref()),
            task_results: j
                .task_results
                .into_iter()
                .map(|t| TaskResultView {
                    task_number: t.task_number,
                    command: t.command,
                    exit_code: t.exit_code,
                    duration_ms: t.duration_ms,
                    stdout: t.stdout,
                    stderr: t.stderr,
                    stdout_truncated: t.stdout_truncated,
                    stderr_truncated: t.stderr_truncated,
                })
                .collect(),
            job_id: j.job_id,
            action_id: j.action_id,
            plan_id: j.plan_id,
            plan_version: j.plan_version,
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            worker_id: j.worker_id,
            error: j.error,
            waiting_reason: j.waiting_reason,
            current_task: j.current_task,
            progress_percent: j.progress_percent,
            priority: j.priority,
        }
    }
}

/// `k=v, k=v` of an input map.
pub fn input_text(input: &BTreeMap<String, String>) -> String {
    input
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Size and first line of captured output, for a table cell.
fn preview(text: &str, truncated: bool) -> String {
    if text.is_empty() {
        return "-".into();
    }
    let lines = text.lines().count();
    let first: String = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
        .chars()
        .take(32)
        .collect();
    let more = if truncated { "+, truncated" } else { "" };
    format!(
        "{first:?} ({} line{}{more})",
        lines,
        if lines == 1 { "" } else { "s" }
    )
}

/// Text indented by two spaces, with a marker when it was truncated; each
/// line shown through [`visible_lines`] (task output is anyone's text: its
/// escape sequences and carriage returns are printed, not obeyed).
fn block(text: &str, truncated: bool) -> String {
    let mut out: String = text
        .lines()
        .map(|l| format!("  {}\n", visible_lines(l)))
        .collect();
    if truncated {
        out.push_str("  [... truncated by the worker's output cap]\n");
    }
    out
}

impl JobView {
    /// The job as `key value` lines, a task table (number, command, exit
    /// code, duration, stdout/stderr preview), then the full stderr of
    /// every task that wrote any and the full stdout of the last task (the
    /// job's result). `full` prints every task's stdout and stderr.
    pub fn table(&self, full: bool) -> String {
        let mut pairs = vec![
            ("job", self.job_id.clone()),
            ("action", self.action_id.clone()),
            ("plan", plan_with_version(&self.plan_id, self.plan_version)),
            ("status", self.status.clone()),
            ("priority", self.priority.to_string()),
            (
                "attempts",
                format!("{}/{}", self.attempt, self.max_attempts),
            ),
            (
                "worker",
                if self.worker_id.is_empty() {
                    "-".into()
                } else {
                    self.worker_id.clone()
                },
            ),
            ("input", input_text(&self.input)),
        ];
        if !self.waiting_reason.is_empty() {
            pairs.push(("waiting", self.waiting_reason.clone()));
        }
        if !self.error.is_empty() {
            pairs.push(("error", self.error.clone()));
        }
        if self.status == "running" && self.current_task > 0 {
            pairs.push((
                "progress",
                format!("task {}, {}%", self.current_task, self.progress_percent),
            ));
        }
        let dash = |t: &Option<String>| t.clone().unwrap_or_else(|| "-".into());
        pairs.push(("created", dash(&self.created_at)));
        pairs.push(("started", dash(&self.started_at)));
        pairs.push(("finished", dash(&self.completed_at)));
        if self.ready_at.is_some() {
            pairs.push(("ready at", dash(&self.ready_at)));
        }
        let mut out = key_values(&pairs);
        if self.task_results.is_empty() {
            return out;
        }
        out.push('\n');
        let mut t = Table::new(["TASK", "COMMAND", "EXIT", "DURATION", "STDOUT", "STDERR"]);
        for r in &self.task_results {
            t.row([
                r.task_number.to_string(),
                r.command.clone(),
                r.exit_code.to_string(),
                human_duration(std::time::Duration::from_millis(r.duration_ms)),
                preview(&r.stdout, r.stdout_truncated),
                preview(&r.stderr, r.stderr_truncated),
            ]);
        }
        out.push_str(&t.render());
        let last = self.task_results.len() - 1;
        for (i, r) in self.task_results.iter().enumerate() {
            if (full || i == last) && !r.stdout.is_empty() {
                out.push_str(&format!(
                    "\nstdout of task {} ({}):\n",
                    r.task_number,
                    visible(&r.command)
                ));
                out.push_str(&block(&r.stdout, r.stdout_truncated));
            }
            if !r.stderr.is_empty() {
                out.push_str(&format!(
                    "\nstderr of task {} ({}):\n",
                    r.task_number,
                    visible(&r.command)
                ));
                out.push_str(&block(&r.stderr, r.stderr_truncated));
            }
        }
        out
    }
}

/// A job in a list: everything but the task results.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct JobSummary {
    /// Id.
    pub job_id: String,
    /// The Action that created it.
    pub action_id: String,
    /// The Plan it runs.
    pub plan_id: String,
    /// Status name.
    pub status: String,
    /// Attempts started.
    pub attempt: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Worker holding or last holding the lease.
    pub worker_id: String,
    /// Input values.
    pub input: BTreeMap<String, String>,
    /// Why the last attempt failed.
    pub error: String,
    /// Why a pending job waits.
    pub waiting_reason: String,
    /// Creation time.
    pub created_at: Option<String>,
    /// When it became terminal.
    pub completed_at: Option<String>,
}

impl From<pb::Job> for JobSummary {
    fn from(j: pb::Job) -> Self {
        JobSummary {
            status: job_status_name(j.status),
            input: j.input.into_iter().collect(),
            created_at: rfc3339(j.created_at.as_ref()),
            completed_at: rfc3339(j.completed_at.as_ref()),
            job_id: j.job_id,
            action_id: j.action_id,
            plan_id: j.plan_id,
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            worker_id: j.worker_id,
            error: j.error,
            waiting_reason: j.waiting_reason,
        }
    }
}

/// A page of jobs.
#[derive(Debug, Clone, Serialize)]
pub struct JobPage {
    /// The jobs, in the server's order.
    pub jobs: Vec<JobSummary>,
    /// Token of the next page; empty on the last page.
    pub next_page_token: String,
}

impl JobPage {
    /// One row per job: id, status, attempts, worker, input and the error
    /// or waiting reason.
    pub fn table(&self) -> String {
        let mut t = Table::new(["JOB", "STATUS", "ATTEMPTS", "WORKER", "INPUT", "NOTE"]);
        for j in &self.jobs {
            let note = if !j.error.is_empty() {
                j.error.clone()
            } else {
                j.waiting_reason.clone()
            };
            t.row([
                j.job_id.clone(),
                j.status.clone(),
                format!("{}/{}", j.attempt, j.max_attempts),
                if j.worker_id.is_empty() {
                    "-".into()
                } else {
                    j.worker_id.clone()
                },
                input_text(&j.input),
                one_line(&note, 80),
            ]);
        }
        t.render()
    }
}

/// The first line of `s`, cut to `max` characters with an ellipsis.
pub fn one_line(s: &str, max: usize) -> String {
    let line = s.lines().next().unwrap_or("");
    if line.chars().count() > max || s.lines().nth(1).is_some() {
        let cut: String = line.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    } else {
        line.to_owned()
    }
}

/// Load figures a worker reports.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WorkerStatsView {
    /// Jobs running now.
    pub active_jobs: u32,
    /// Jobs completed since start.
    pub completed_jobs_total: u64,
    /// Jobs failed since start.
    pub failed_jobs_total: u64,
    /// Seconds since start.
    pub uptime_secs: u64,
    /// Host CPU usage, percent.
    pub cpu_usage_percent: f64,
    /// Host memory used, MiB.
    pub memory_mb: u64,
    /// Free disk, GiB.
    pub disk_available_gb: u64,
    /// Mean job run time, ms.
    pub avg_job_duration_ms: u64,
}

/// A worker as the server sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WorkerView {
    /// Id.
    pub worker_id: String,
    /// State name (`"active"`).
    pub state: String,
    /// Heartbeat younger than 3 x the interval.
    pub fresh: bool,
    /// Heartbeat and lease streams open.
    pub connected: bool,
    /// Runs tasks in the kernel sandbox.
    pub sandboxed: bool,
    /// Host.
    pub hostname: String,
    /// Platform.
    pub platform: String,
    /// agw version.
    pub agw_version: String,
    /// Leases it may hold.
    pub max_concurrent_jobs: u32,
    /// Leases it holds.
    pub active_leases: u32,
    /// Advertised tools.
    pub tools: Vec<String>,
    /// Advertised agentic units.
    pub agentic_units: Vec<String>,
    /// The agentic units as they described themselves.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub units: Vec<UnitView>,
    /// The latest verification of each command it was challenged on.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub verifications: Vec<VerificationView>,
    /// Labels.
    pub tags: BTreeMap<String, String>,
    /// Last heartbeat.
    pub last_heartbeat_at: Option<String>,
    /// Registration time.
    pub registered_at: Option<String>,
    /// Figures of the last heartbeat.
    pub stats: Option<WorkerStatsView>,
    /// Why it is quarantined (empty: it is not).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub quarantine_reason: String,
    /// Raw timestamp of the last heartbeat, for "3s ago" in tables.
    #[serde(skip)]
    pub last_heartbeat_ts: Option<prost_types::Timestamp>,
}

impl From<pb::Worker> for WorkerView {
    fn from(w: pb::Worker) -> Self {
        let caps = w.capabilities.unwrap_or_default();
        WorkerView {
            state: worker_state_name(w.state),
            last_heartbeat_at: rfc3339(w.last_heartbeat_at.as_ref()),
            registered_at: rfc3339(w.registered_at.as_ref()),
            last_heartbeat_ts: w.last_heartbeat_at,
            stats: w.stats.map(|s| WorkerStatsView {
                active_jobs: s.active_jobs,
                completed_jobs_total: s.completed_jobs_total,
                failed_jobs_total: s.failed_jobs_total,
                uptime_secs: s.uptime_secs,
                cpu_usage_percent: s.cpu_usage_percent,
                memory_mb: s.memory_mb,
                disk_available_gb: s.disk_available_gb,
                avg_job_duration_ms: s.avg_job_duration_ms,
            }),
            tools: caps.tools,
            agentic_units: caps.agentic_units,
            units: caps
                .units
                .into_iter()
                .map(|u| UnitView {
                    name: u.name,
                    version: u.version,
                    description: u.description,
                    inputs: u.inputs.into_iter().map(|i| i.name).collect(),
                })
                .collect(),
            verifications: w
                .verifications
                .into_iter()
                .map(VerificationView::from)
                .collect(),
            tags: w.tags.into_iter().collect(),
            worker_id: w.worker_id,
            fresh: w.fresh,
            connected: w.connected,
            sandboxed: w.sandboxed,
            hostname: w.hostname,
            platform: w.platform,
            agw_version: w.agw_version,
            max_concurrent_jobs: w.max_concurrent_jobs,
            active_leases: w.active_leases,
            quarantine_reason: w.quarantine_reason,
        }
    }
}

/// An agentic unit of a worker.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct UnitView {
    /// Name tasks use.
    pub name: String,
    /// Version.
    pub version: String,
    /// What it does.
    pub description: String,
    /// Names of its inputs.
    pub inputs: Vec<String>,
}

/// A capability verification of a worker.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VerificationView {
    /// Tool or unit.
    pub tool: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Challenge id.
    pub challenge_id: String,
    /// When it was sent.
    pub requested_at: Option<String>,
    /// When the answer came; `None` while pending.
    pub answered_at: Option<String>,
    /// Exit 0.
    pub passed: bool,
    /// Exit code.
    pub exit_code: i32,
    /// Start of its output.
    pub output: String,
    /// Why it did not pass.
    pub error: String,
}

impl From<pb::Verification> for VerificationView {
    fn from(v: pb::Verification) -> Self {
        VerificationView {
            requested_at: rfc3339(v.requested_at.as_ref()),
            answered_at: rfc3339(v.answered_at.as_ref()),
            tool: v.tool,
            args: v.args,
            challenge_id: v.challenge_id,
            passed: v.passed,
            exit_code: v.exit_code,
            output: v.output,
            error: v.error,
        }
    }
}

impl VerificationView {
    /// `tool args: passed at T ("first line of output")`.
    pub fn line(&self) -> String {
        let cmd = format!("{} {}", self.tool, shell_words(&self.args));
        match &self.answered_at {
            None => format!(
                "{cmd}: pending (asked {})",
                self.requested_at.clone().unwrap_or_default()
            ),
            Some(at) if self.passed => format!(
                "{cmd}: passed at {at} ({:?})",
                self.output
                    .lines()
                    .next()
                    .unwrap_or("")
                    .chars()
                    .take(60)
                    .collect::<String>()
            ),
            Some(at) => format!(
                "{cmd}: FAILED at {at} (exit {}): {}",
                self.exit_code, self.error
            ),
        }
    }
}

/// `yes` / `no`.
fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

impl WorkerView {
    /// All fields as `key value` lines.
    pub fn table(&self) -> String {
        let mut pairs = vec![
            ("worker", self.worker_id.clone()),
            ("state", self.state.clone()),
        ];
        if !self.quarantine_reason.is_empty() {
            pairs.push(("quarantined because", self.quarantine_reason.clone()));
        }
        pairs.extend([
            ("fresh", yes_no(self.fresh)),
            ("connected", yes_no(self.connected)),
            ("sandboxed", yes_no(self.sandboxed)),
            ("host", self.hostname.clone()),
            ("platform", self.platform.clone()),
            ("agw version", self.agw_version.clone()),
            (
                "leases",
                format!("{}/{}", self.active_leases, self.max_concurrent_jobs),
            ),
            ("tools", self.tools.join(" ")),
        ]);
        if !self.agentic_units.is_empty() {
            pairs.push(("agentic units", self.agentic_units.join(" ")));
        }
        for u in &self.units {
            let mut line = u.name.clone();
            if !u.version.is_empty() {
                line.push_str(&format!(" {}", u.version));
            }
            if !u.description.is_empty() {
                line.push_str(&format!(": {}", u.description));
            }
            if !u.inputs.is_empty() {
                line.push_str(&format!(" (inputs: {})", u.inputs.join(", ")));
            }
            pairs.push(("unit", line));
        }
        for v in &self.verifications {
            pairs.push(("verified", v.line()));
        }
        if !self.tags.is_empty() {
            pairs.push(("tags", input_text(&self.tags)));
        }
        pairs.push((
            "last heartbeat",
            match &self.last_heartbeat_at {
                Some(t) => format!("{t} ({})", ago(self.last_heartbeat_ts.as_ref())),
                None => "-".into(),
            },
        ));
        pairs.push((
            "registered",
            self.registered_at.clone().unwrap_or_else(|| "-".into()),
        ));
        if let Some(s) = &self.stats {
            pairs.push(("active jobs", s.active_jobs.to_string()));
            pairs.push(("completed jobs", s.completed_jobs_total.to_string()));
            pairs.push(("failed jobs", s.failed_jobs_total.to_string()));
            pairs.push((
                "uptime",
                human_duration(std::time::Duration::from_secs(s.uptime_secs)),
            ));
            pairs.push(("cpu", format!("{:.1}%", s.cpu_usage_percent)));
            pairs.push(("memory", format!("{} MiB", s.memory_mb)));
            pairs.push(("disk free", format!("{} GiB", s.disk_available_gb)));
            pairs.push((
                "avg job",
                human_duration(std::time::Duration::from_millis(s.avg_job_duration_ms)),
            ));
        }
        key_values(&pairs)
    }
}

/// Workers as rows: id, state, freshness, leases, host, heartbeat age, tools.
pub fn workers_table(workers: &[WorkerView]) -> String {
    let mut t = Table::new([
        "WORKER",
        "STATE",
        "FRESH",
        "CONNECTED",
        "LEASES",
        "HOST",
        "LAST HEARTBEAT",
        "TOOLS",
    ]);
    for w in workers {
        t.row([
            w.worker_id.clone(),
            w.state.clone(),
            yes_no(w.fresh),
            yes_no(w.connected),
            format!("{}/{}", w.active_leases, w.max_concurrent_jobs),
            w.hostname.clone(),
            ago(w.last_heartbeat_ts.as_ref()),
            w.tools.len().to_string(),
        ]);
    }
    t.render()
}

/// Queue depth and worker counts.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct QueueStatsView {
    /// Pending jobs eligible now.
    pub ready_length: u64,
    /// Pending jobs waiting for run_at or backoff.
    pub scheduled_length: u64,
    /// Jobs running.
    pub running_length: u64,
    /// Age of the oldest ready job, seconds.
    pub oldest_ready_age_secs: u64,
    /// Age of the newest ready job, seconds.
    pub newest_job_age_secs: u64,
    /// Seconds until the next scheduled job is due.
    pub next_scheduled_due_in_secs: u64,
    /// Workers ACTIVE, DRAINING or QUARANTINED: the sum of the counts below.
    pub workers_total: u32,
    /// Fresh ACTIVE workers running at least one job.
    pub workers_active: u32,
    /// Fresh ACTIVE workers running none.
    pub workers_idle: u32,
    /// Fresh DRAINING workers.
    pub workers_draining: u32,
    /// Fresh QUARANTINED workers.
    pub workers_quarantined: u32,
    /// Workers whose heartbeat is stale.
    pub workers_stale: u32,
    /// Jobs per priority, highest first.
    pub by_priority: Vec<QueueSliceView>,
    /// Jobs per worker pool (selector; "" is any worker).
    pub by_pool: Vec<QueueSliceView>,
}

/// Jobs of one priority or one worker pool.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct QueueSliceView {
    /// The priority, or the pool's worker selector.
    pub key: String,
    /// Ready jobs.
    pub ready: u64,
    /// Scheduled or backing-off jobs.
    pub scheduled: u64,
    /// Running jobs.
    pub running: u64,
    /// Fresh ACTIVE workers whose tags match (pools only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers_matching: Option<u32>,
}

impl From<pb::GetQueueStatsResponse> for QueueStatsView {
    fn from(s: pb::GetQueueStatsResponse) -> Self {
        QueueStatsView {
            ready_length: s.ready_length,
            scheduled_length: s.scheduled_length,
            running_length: s.running_length,
            oldest_ready_age_secs: s.oldest_ready_age_secs,
            newest_job_age_secs: s.newest_job_age_secs,
            next_scheduled_due_in_secs: s.next_scheduled_due_in_secs,
            workers_total: s.workers_total,
            workers_active: s.workers_active,
            workers_idle: s.workers_idle,
            workers_draining: s.workers_draining,
            workers_quarantined: s.workers_quarantined,
            workers_stale: s.workers_stale,
            by_priority: s
                .by_priority
                .into_iter()
                .map(|p| QueueSliceView {
                    key: p.priority.to_string(),
                    ready: p.ready_length,
                    scheduled: p.scheduled_length,
                    running: p.running_length,
                    workers_matching: None,
                })
                .collect(),
            by_pool: s
                .by_pool
                .into_iter()
                .map(|p| QueueSliceView {
                    key: p.worker_selector,
                    ready: p.ready_length,
                    scheduled: p.scheduled_length,
                    running: p.running_length,
                    workers_matching: Some(p.workers_matching),
                })
                .collect(),
        }
    }
}

impl QueueStatsView {
    /// `key value` lines, then a table per priority and per pool.
    pub fn table(&self) -> String {
        let mut out = key_values(&[
            ("ready", self.ready_length.to_string()),
            ("scheduled", self.scheduled_length.to_string()),
            ("running", self.running_length.to_string()),
            ("oldest ready", format!("{}s", self.oldest_ready_age_secs)),
            ("newest ready", format!("{}s", self.newest_job_age_secs)),
            (
                "next scheduled in",
                format!("{}s", self.next_scheduled_due_in_secs),
            ),
            ("workers", self.workers_total.to_string()),
            ("workers active", self.workers_active.to_string()),
            ("workers idle", self.workers_idle.to_string()),
            ("workers draining", self.workers_draining.to_string()),
            ("workers quarantined", self.workers_quarantined.to_string()),
            ("workers stale", self.workers_stale.to_string()),
        ]);
        if !self.by_priority.is_empty() {
            out.push('\n');
            let mut t = Table::new(["PRIORITY", "READY", "SCHEDULED", "RUNNING"]);
            for p in &self.by_priority {
                t.row([
                    p.key.clone(),
                    p.ready.to_string(),
                    p.scheduled.to_string(),
                    p.running.to_string(),
                ]);
            }
            out.push_str(&t.render());
        }
        if !self.by_pool.is_empty() {
            out.push('\n');
            let mut t = Table::new(["POOL", "READY", "SCHEDULED", "RUNNING", "WORKERS"]);
            for p in &self.by_pool {
                t.row([
                    if p.key.is_empty() {
                        "(any worker)".to_string()
                    } else {
                        p.key.clone()
                    },
                    p.ready.to_string(),
                    p.scheduled.to_string(),
                    p.running.to_string(),
                    p.workers_matching.unwrap_or(0).to_string(),
                ]);
            }
            out.push_str(&t.render());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_are_the_proto_names_without_prefix() {
        assert_eq!(job_status_name(JobStatus::Completed as i32), "completed");
        assert_eq!(job_status_name(JobStatus::Pending as i32), "pending");
        assert_eq!(job_status_name(JobStatus::Cancelled as i32), "cancelled");
        assert_eq!(
            job_status_name(JobStatus::Unspecified as i32),
            "unspecified"
        );
        assert_eq!(job_status_name(99), "unknown");
        assert_eq!(worker_state_name(WorkerState::Active as i32), "active");
        assert_eq!(
            worker_state_name(WorkerState::Unregistered as i32),
            "unregistered"
        );
        assert_eq!(worker_state_name(-1), "unknown");
    }

    #[test]
    fn quotes_arguments_like_a_shell() {
        let words =
            |a: &[&str]| shell_words(&a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        assert_eq!(words(&["-cs", "A-Za-z", "\n"]), "-cs A-Za-z $'\\n'");
        assert_eq!(words(&["a b", "it's", ""]), "'a b' \"it's\" ''");
        assert_eq!(words(&["$HOME", "x;y"]), "'$HOME' 'x;y'");
        assert_eq!(
            words(&["tab\there", "back\\slash\r"]),
            "$'tab\\there' $'back\\\\slash\\r'"
        );
        assert_eq!(words(&["nul\0"]), "$'nul\\x00'");
    }
}
