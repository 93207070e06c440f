//! Conversions between AGQ's domain types ([`crate::core::model`]) and the
//! generated `agq.v1` messages: the only place that knows both. Times go
//! from milliseconds to `google.protobuf.Timestamp`, enums to their wire
//! values, requests to the engine's request types. A request field that
//! cannot be converted (an unknown enum value, a timestamp out of range)
//! is refused with `InvalidArgument`.

use crate::{
    core::{
        engine::{ActionQuery, ActionRequest, ActionState, JobQuery},
        model::{
            ActionStatus, AgenticUnit, AgenticUnitInput, CatchUp, HeartbeatReply, Job, JobLease,
            JobReport, JobStatus, Plan, PlanSummary, PlanVersion, QueueStats, Registration,
            Schedule, Scheduling, Task, TaskResult, Verification, VerificationAnswer, Worker,
            WorkerCapabilities, WorkerCommand, WorkerState, WorkerStats,
        },
    },
    error::{Error, Result},
    pb,
    time::{ms_of, ts},
};

impl From<&Task> for pb::Task {
    fn from(t: &Task) -> Self {
        pb::Task {
            task_number: t.task_number,
            command: t.command.clone(),
            args: t.args.clone(),
            timeout_secs: t.timeout_secs,
            input_from_task: t.input_from_task,
            allow_option_values: t.allow_option_values,
            permanent_exit_codes: t.permanent_exit_codes.clone(),
        }
    }
}

impl From<pb::Task> for Task {
    fn from(t: pb::Task) -> Self {
        Task {
            task_number: t.task_number,
            command: t.command,
            args: t.args,
            timeout_secs: t.timeout_secs,
            input_from_task: t.input_from_task,
            allow_option_values: t.allow_option_values,
            permanent_exit_codes: t.permanent_exit_codes,
        }
    }
}

impl From<&Plan> for pb::Plan {
    fn from(p: &Plan) -> Self {
        pb::Plan {
            plan_id: p.plan_id.clone(),
            plan_description: p.plan_description.clone(),
            tasks: p.tasks.iter().map(pb::Task::from).collect(),
            require_sandbox: p.require_sandbox,
            version: p.version,
            worker_selector: p.worker_selector.clone(),
            require_verified_tools: p.require_verified_tools,
        }
    }
}

impl From<pb::Plan> for Plan {
    fn from(p: pb::Plan) -> Self {
        Plan {
            plan_id: p.plan_id,
            plan_description: p.plan_description,
            tasks: p.tasks.into_iter().map(Task::from).collect(),
            require_sandbox: p.require_sandbox,
            version: p.version,
            worker_selector: p.worker_selector,
            require_verified_tools: p.require_verified_tools,
        }
    }
}

impl From<PlanSummary> for pb::PlanSummary {
    fn from(p: PlanSummary) -> Self {
        pb::PlanSummary {
            plan_id: p.plan_id,
            version: p.version,
            plan_description: p.plan_description,
            created_at: Some(ts(p.created_at_ms)),
            updated_at: Some(ts(p.updated_at_ms)),
        }
    }
}

impl From<PlanVersion> for pb::PlanVersion {
    fn from(v: PlanVersion) -> Self {
        pb::PlanVersion {
            version: v.version,
            plan_description: v.plan_description,
            task_count: v.task_count,
            created_at: Some(ts(v.created_at_ms)),
        }
    }
}

impl From<TaskResult> for pb::TaskResult {
    fn from(t: TaskResult) -> Self {
        pb::TaskResult {
            task_number: t.task_number,
            command: t.command,
            exit_code: t.exit_code,
            stdout: t.stdout,
            stderr: t.stderr,
            duration_ms: t.duration_ms,
            stdout_truncated: t.stdout_truncated,
            stderr_truncated: t.stderr_truncated,
        }
    }
}

impl From<pb::TaskResult> for TaskResult {
    fn from(t: pb::TaskResult) -> Self {
        TaskResult {
            task_number: t.task_number,
            command: t.command,
            exit_code: t.exit_code,
            stdout: t.stdout,
            stderr: t.stderr,
            duration_ms: t.duration_ms,
            stdout_truncated: t.stdout_truncated,
            stderr_truncated: t.stderr_truncated,
        }
    }
}

impl From<JobStatus> for pb::JobStatus {
    fn from(s: JobStatus) -> Self {
        match s {
            JobStatus::Pending => pb::JobStatus::Pending,
            JobStatus::Running => pb::JobStatus::Running,
            JobStatus::Completed => pb::JobStatus::Completed,
            JobStatus::Failed => pb::JobStatus::Failed,
            JobStatus::Dead => pb::JobStatus::Dead,
            JobStatus::Cancelled => pb::JobStatus::Cancelled,
        }
    }
}

impl From<WorkerState> for pb::WorkerState {
    fn from(s: WorkerState) -> Self {
        match s {
            WorkerState::Active => pb::WorkerState::Active,
            WorkerState::Draining => pb::WorkerState::Draining,
            WorkerState::Dead => pb::WorkerState::Dead,
            WorkerState::Unregistered => pb::WorkerState::Unregistered,
            WorkerState::Quarantined => pb::WorkerState::Quarantined,
        }
    }
}

/// The job status a filter field names: `None` for UNSPECIFIED (match all).
///
/// Errors: `InvalidArgument` for a value that is no job status.
pub fn status_filter(v: i32) -> Result<Option<JobStatus>> {
    match v {
        0 => Ok(None),
        v => JobStatus::from_i32(v)
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("unknown job status {v}"))),
    }
}

/// The worker state a filter field names: `None` for UNSPECIFIED (match all).
///
/// Errors: `InvalidArgument` for a value that is no worker state.
pub fn state_filter(v: i32) -> Result<Option<WorkerState>> {
    match v {
        0 => Ok(None),
        v => WorkerState::from_i32(v)
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("unknown worker state {v}"))),
    }
}

/// Milliseconds of an optional request timestamp named `what`.
///
/// Errors: `InvalidArgument` when it is out of range.
pub fn time_field(what: &str, t: Option<prost_types::Timestamp>) -> Result<Option<i64>> {
    t.map(|t| ms_of(&t).ok_or_else(|| Error::invalid(format!("{what} is not a valid timestamp"))))
        .transpose()
}

impl From<Job> for pb::Job {
    fn from(j: Job) -> Self {
        pb::Job {
            job_id: j.job_id,
            action_id: j.action_id,
            plan_id: j.plan_id,
            plan_version: j.plan_version,
            priority: j.priority,
            status: pb::JobStatus::from(j.status) as i32,
            input: j.input,
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            created_at: Some(ts(j.created_at_ms)),
            started_at: j.started_at_ms.map(ts),
            completed_at: j.completed_at_ms.map(ts),
            worker_id: j.worker_id,
            task_results: j.task_results.into_iter().map(Into::into).collect(),
            error: j.error,
            waiting_reason: j.waiting_reason,
            current_task: j.current_task,
            progress_percent: j.progress_percent,
            ready_at: j.ready_at_ms.map(ts),
        }
    }
}

impl From<ActionStatus> for pb::ActionStatus {
    fn from(a: ActionStatus) -> Self {
        pb::ActionStatus {
            action_id: a.action_id,
            plan_id: a.plan_id,
            plan_version: a.plan_version,
            priority: a.scheduling.priority,
            worker_selector: a.scheduling.worker_selector,
            concurrency_key: a.scheduling.concurrency_key,
            max_running: a.scheduling.max_running,
            total_jobs: a.total_jobs,
            pending: a.pending,
            running: a.running,
            completed: a.completed,
            failed: a.failed,
            dead: a.dead,
            cancelled: a.cancelled,
            created_at: Some(ts(a.created_at_ms)),
            completed_jobs_at: a.completed_jobs_at_ms.map(ts),
        }
    }
}

impl From<WorkerStats> for pb::WorkerStats {
    fn from(s: WorkerStats) -> Self {
        pb::WorkerStats {
            active_jobs: s.active_jobs,
            completed_jobs_total: s.completed_jobs_total,
            failed_jobs_total: s.failed_jobs_total,
            uptime_secs: s.uptime_secs,
            cpu_usage_percent: s.cpu_usage_percent,
            memory_mb: s.memory_mb,
            disk_available_gb: s.disk_available_gb,
            avg_job_duration_ms: s.avg_job_duration_ms,
        }
    }
}

impl From<pb::WorkerStats> for WorkerStats {
    fn from(s: pb::WorkerStats) -> Self {
        WorkerStats {
            active_jobs: s.active_jobs,
            completed_jobs_total: s.completed_jobs_total,
            failed_jobs_total: s.failed_jobs_total,
            uptime_secs: s.uptime_secs,
            cpu_usage_percent: s.cpu_usage_percent,
            memory_mb: s.memory_mb,
            disk_available_gb: s.disk_available_gb,
            avg_job_duration_ms: s.avg_job_duration_ms,
        }
    }
}

impl From<Worker> for pb::Worker {
    fn from(w: Worker) -> Self {
        pb::Worker {
            worker_id: w.worker_id,
            hostname: w.hostname,
            platform: w.platform,
            agw_version: w.agw_version,
            capabilities: Some(pb::WorkerCapabilities {
                tools: w.capabilities.tools,
                agentic_units: w.capabilities.agentic_units,
                units: w
                    .capabilities
                    .units
                    .into_iter()
                    .map(pb::AgenticUnit::from)
                    .collect(),
            }),
            max_concurrent_jobs: w.max_concurrent_jobs,
            tags: w.tags,
            state: pb::WorkerState::from(w.state) as i32,
            fresh: w.fresh,
            last_heartbeat_at: Some(ts(w.last_heartbeat_at_ms)),
            stats: Some(w.stats.into()),
            active_leases: w.active_leases,
            connected: w.connected,
            registered_at: Some(ts(w.registered_at_ms)),
            sandboxed: w.sandboxed,
            instance_id: w.instance_id,
            quarantine_reason: w.quarantine_reason,
            verifications: w
                .verifications
                .into_iter()
                .map(pb::Verification::from)
                .collect(),
        }
    }
}

impl From<AgenticUnit> for pb::AgenticUnit {
    fn from(u: AgenticUnit) -> Self {
        pb::AgenticUnit {
            name: u.name,
            version: u.version,
            description: u.description,
            inputs: u
                .inputs
                .into_iter()
                .map(|i| pb::AgenticUnitInput {
                    name: i.name,
                    description: i.description,
                })
                .collect(),
        }
    }
}

impl From<pb::AgenticUnit> for AgenticUnit {
    fn from(u: pb::AgenticUnit) -> Self {
        AgenticUnit {
            name: u.name,
            version: u.version,
            description: u.description,
            inputs: u
                .inputs
                .into_iter()
                .map(|i| AgenticUnitInput {
                    name: i.name,
                    description: i.description,
                })
                .collect(),
        }
    }
}

impl From<Verification> for pb::Verification {
    fn from(v: Verification) -> Self {
        pb::Verification {
            tool: v.tool,
            args: v.args,
            challenge_id: v.challenge_id,
            requested_at: Some(ts(v.requested_at_ms)),
            answered_at: v.answered_at_ms.map(ts),
            passed: v.passed,
            exit_code: v.exit_code,
            output: v.output,
            error: v.error,
        }
    }
}

impl From<pb::VerificationAnswer> for VerificationAnswer {
    fn from(a: pb::VerificationAnswer) -> Self {
        VerificationAnswer {
            challenge_id: a.challenge_id,
            exit_code: a.exit_code,
            output: a.output,
            error: a.error,
        }
    }
}

impl From<pb::RegisterWorkerRequest> for Registration {
    fn from(r: pb::RegisterWorkerRequest) -> Self {
        let caps = r.capabilities.unwrap_or_default();
        Registration {
            worker_id: r.worker_id,
            hostname: r.hostname,
            platform: r.platform,
            agw_version: r.agw_version,
            capabilities: WorkerCapabilities {
                tools: caps.tools,
                agentic_units: caps.agentic_units,
                units: caps.units.into_iter().map(AgenticUnit::from).collect(),
            },
            max_concurrent_jobs: r.max_concurrent_jobs,
            tags: r.tags,
            instance_id: r.instance_id,
            sandboxed: r.sandboxed,
        }
    }
}

impl From<pb::UpdateJobRequest> for JobReport {
    fn from(r: pb::UpdateJobRequest) -> Self {
        JobReport {
            job_id: r.job_id,
            worker_id: r.worker_id,
            lease_id: r.lease_id,
            // An unknown or unspecified status is refused by the engine
            // once the lease is checked.
            status: JobStatus::from_i32(r.status),
            current_task: r.current_task,
            progress_percent: r.progress_percent,
            task_results: r.task_results.into_iter().map(Into::into).collect(),
            error: r.error,
            permanent: r.permanent,
        }
    }
}

impl From<JobLease> for pb::JobLease {
    /// The lease as sent: the previous attempt's error is cut to
    /// [`crate::core::validate::MAX_LEASE_ERROR_BYTES`].
    fn from(mut l: JobLease) -> Self {
        let keep = crate::core::validate::truncate(
            &l.job.error,
            crate::core::validate::MAX_LEASE_ERROR_BYTES,
        )
        .len();
        l.job.error.truncate(keep);
        pb::JobLease {
            lease_id: l.lease_id,
            job: Some(l.job.into()),
            plan: Some(pb::Plan::from(&*l.plan)),
            attempt: l.attempt,
            expires_at: Some(ts(l.expires_at_ms)),
            traceparent: l.traceparent.as_deref().unwrap_or_default().to_owned(),
        }
    }
}

impl From<HeartbeatReply> for pb::HeartbeatResponse {
    fn from(r: HeartbeatReply) -> Self {
        let mut cancel_lease_id = String::new();
        pb::HeartbeatResponse {
            next_deadline: Some(ts(r.next_deadline_ms)),
            command: r.command.map(|c| match c {
                WorkerCommand::Drain { reason } => {
                    pb::heartbeat_response::Command::Drain(pb::DrainCommand { reason })
                }
                WorkerCommand::CancelJob { job_id, lease_id } => {
                    cancel_lease_id = lease_id;
                    pb::heartbeat_response::Command::CancelJobId(job_id)
                }
                WorkerCommand::Verify {
                    challenge_id,
                    command,
                    args,
                } => pb::heartbeat_response::Command::Verify(pb::VerifyCommand {
                    challenge_id,
                    command,
                    args,
                }),
            }),
            revoked_lease_ids: r.revoked_leases,
            cancel_lease_id,
        }
    }
}

impl From<QueueStats> for pb::GetQueueStatsResponse {
    fn from(s: QueueStats) -> Self {
        pb::GetQueueStatsResponse {
            ready_length: s.ready_length,
            scheduled_length: s.scheduled_length,
            oldest_ready_age_secs: s.oldest_ready_age_secs,
            next_scheduled_due_in_secs: s.next_scheduled_due_in_secs,
            workers_total: s.workers_total,
            workers_active: s.workers_active,
            workers_idle: s.workers_idle,
            workers_stale: s.workers_stale,
            running_length: s.running_length,
            newest_job_age_secs: s.newest_job_age_secs,
            workers_draining: s.workers_draining,
            workers_quarantined: s.workers_quarantined,
            by_priority: s
                .by_priority
                .into_iter()
                .map(|p| pb::PriorityQueueStats {
                    priority: p.priority,
                    ready_length: p.depths.ready,
                    scheduled_length: p.depths.scheduled,
                    running_length: p.depths.running,
                })
                .collect(),
            by_pool: s
                .by_pool
                .into_iter()
                .map(|p| pb::PoolQueueStats {
                    worker_selector: p.worker_selector,
                    ready_length: p.depths.ready,
                    scheduled_length: p.depths.scheduled,
                    running_length: p.depths.running,
                    workers_matching: p.workers_matching,
                })
                .collect(),
        }
    }
}

/// The engine's request for a SubmitAction.
///
/// Errors: `InvalidArgument` for a `run_at` out of range.
pub fn action_request(r: pb::SubmitActionRequest) -> Result<ActionRequest> {
    Ok(ActionRequest {
        run_at_ms: r
            .run_at
            .map(|t| ms_of(&t).ok_or_else(|| Error::invalid("run_at is not a valid timestamp")))
            .transpose()?,
        action_id: r.action_id,
        plan_id: r.plan_id,
        inputs: r.inputs.into_iter().map(|i| i.values).collect(),
        max_attempts: r.max_attempts,
        traceparent: None,
        priority: r.priority,
        worker_selector: r.worker_selector,
        concurrency_key: r.concurrency_key,
        max_running: r.max_running,
    })
}

/// The engine's query for a ListJobs call.
///
/// Errors: `InvalidArgument` (no action id, unknown status).
pub fn list_jobs_query(r: pb::ListJobsRequest) -> Result<JobQuery> {
    if r.action_id.is_empty() {
        return Err(Error::invalid("action_id is required"));
    }
    Ok(JobQuery {
        action_id: Some(r.action_id),
        status: status_filter(r.status)?,
        page_size: r.page_size,
        page_token: r.page_token,
        ..Default::default()
    })
}

/// The engine's query for a SearchJobs call.
///
/// Errors: `InvalidArgument` (unknown status, timestamps out of range).
pub fn search_jobs_query(r: pb::SearchJobsRequest) -> Result<JobQuery> {
    Ok(JobQuery {
        action_id: None,
        status: status_filter(r.status)?,
        plan_id: (!r.plan_id.is_empty()).then_some(r.plan_id),
        created_after_ms: time_field("created_after", r.created_after)?,
        created_before_ms: time_field("created_before", r.created_before)?,
        page_size: r.page_size,
        page_token: r.page_token,
    })
}

/// The engine's query for a ListActions call.
///
/// Errors: `InvalidArgument` (unknown state, timestamps out of range).
pub fn list_actions_query(r: pb::ListActionsRequest) -> Result<ActionQuery> {
    let state = match pb::ActionState::try_from(r.state) {
        Ok(pb::ActionState::Unspecified) => None,
        Ok(pb::ActionState::Open) => Some(ActionState::Open),
        Ok(pb::ActionState::Finished) => Some(ActionState::Finished),
        Ok(pb::ActionState::HasDead) => Some(ActionState::HasDead),
        Err(_) => return Err(Error::invalid(format!("unknown action state {}", r.state))),
    };
    Ok(ActionQuery {
        plan_id: (!r.plan_id.is_empty()).then_some(r.plan_id),
        state,
        created_after_ms: time_field("created_after", r.created_after)?,
        created_before_ms: time_field("created_before", r.created_before)?,
        page_size: r.page_size,
        page_token: r.page_token,
    })
}

impl From<Schedule> for pb::Schedule {
    fn from(s: Schedule) -> Self {
        pb::Schedule {
            schedule_id: s.schedule_id,
            plan_id: s.plan_id,
            cron: s.cron,
            time_zone: s.time_zone,
            inputs: s
                .inputs
                .into_iter()
                .map(|values| pb::ActionInput { values })
                .collect(),
            max_attempts: s.max_attempts,
            priority: s.scheduling.priority,
            worker_selector: s.scheduling.worker_selector,
            concurrency_key: s.scheduling.concurrency_key,
            max_running: s.scheduling.max_running,
            catch_up: match s.catch_up {
                CatchUp::All => pb::CatchUp::All,
                CatchUp::Latest => pb::CatchUp::Latest,
                CatchUp::Skip => pb::CatchUp::Skip,
            } as i32,
            paused: s.paused,
            next_run_at: s.next_run_at_ms.map(ts),
            last_run_at: s.last_run_at_ms.map(ts),
            last_action_id: s.last_action_id,
            runs: s.runs,
            last_error: s.last_error,
            created_at: Some(ts(s.created_at_ms)),
        }
    }
}

/// The engine's schedule for a CreateSchedule; the read-only fields are
/// ignored.
///
/// Errors: `InvalidArgument` for an unknown catch-up policy.
pub fn schedule_request(s: pb::Schedule) -> Result<Schedule> {
    let catch_up = match pb::CatchUp::try_from(s.catch_up) {
        Ok(pb::CatchUp::Unspecified | pb::CatchUp::All) => CatchUp::All,
        Ok(pb::CatchUp::Latest) => CatchUp::Latest,
        Ok(pb::CatchUp::Skip) => CatchUp::Skip,
        Err(_) => {
            return Err(Error::invalid(format!(
                "catch_up {} is not a CatchUp value",
                s.catch_up
            )))
        }
    };
    Ok(Schedule {
        schedule_id: s.schedule_id,
        plan_id: s.plan_id,
        cron: s.cron,
        time_zone: s.time_zone,
        inputs: s.inputs.into_iter().map(|i| i.values).collect(),
        max_attempts: s.max_attempts,
        scheduling: Scheduling {
            priority: s.priority,
            worker_selector: s.worker_selector,
            concurrency_key: s.concurrency_key,
            max_running: s.max_running,
        },
        catch_up,
        ..Default::default()
    })
}

/// Each report's outcome as an UpdateJobResult (the code and message
/// UpdateJob would have returned, or the job's new status), as
/// BatchUpdateJobs and ReportJobs answer.
pub fn report_results(outcomes: Vec<Result<JobStatus, Error>>) -> Vec<pb::UpdateJobResult> {
    outcomes
        .into_iter()
        .map(|r| match r {
            Ok(status) => pb::UpdateJobResult {
                code: 0,
                message: String::new(),
                status: pb::JobStatus::from(status) as i32,
            },
            Err(e) => {
                let st = tonic::Status::from(e);
                pb::UpdateJobResult {
                    code: st.code() as i32,
                    message: st.message().to_string(),
                    status: 0,
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The domain enums carry the wire values, both ways.
    #[test]
    fn enums_keep_their_wire_values() {
        for s in JobStatus::ALL {
            assert_eq!(pb::JobStatus::from(s) as i32, s as i32);
            assert_eq!(JobStatus::from_i32(s as i32), Some(s));
        }
        for s in WorkerState::ALL {
            assert_eq!(pb::WorkerState::from(s) as i32, s as i32);
        }
        assert_eq!(status_filter(0).unwrap(), None);
        assert!(status_filter(99).is_err());
        assert!(state_filter(-1).is_err());
    }

    /// A plan survives the round trip through the wire type.
    #[test]
    fn plans_round_trip() {
        let plan = Plan {
            plan_id: "p".into(),
            plan_description: "d".into(),
            tasks: vec![Task {
                task_number: 1,
                command: "sort".into(),
                args: vec!["-r".into()],
                timeout_secs: 5,
                input_from_task: None,
                allow_option_values: true,
                permanent_exit_codes: vec![2, 64],
            }],
            require_sandbox: true,
            version: 3,
            worker_selector: "gpu=true".into(),
            require_verified_tools: true,
        };
        assert_eq!(Plan::from(pb::Plan::from(&plan)), plan);
    }
}
