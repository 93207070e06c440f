//! `agq job status|list|search|retry|cancel`. Listing RPCs return job ids;
//! the client fetches each job (a few at a time) so that tables and JSON
//! show status, attempts, worker and errors. `retry` and `cancel` also
//! take `--action` (and `--status`) to act on many jobs of an Action: over
//! RetryAction and CancelAction (one transaction each) where the filter is
//! what those RPCs do, and job by job otherwise.

use std::time::SystemTime;

use super::{
    action::{cancel_action, retry_action, show_change},
    collect_pages, fetch_each, more_hint, print_json,
    table::emit,
    time::{parse_time, to_timestamp},
    view::{CancelStatusArg, JobPage, JobSummary, JobView, RetryStatusArg, StatusArg},
    CliError, Clients, OutputFormat, PageArgs,
};
use crate::pb::{self, JobStatus};

/// `agq job ...`
#[derive(Debug, clap::Subcommand)]
pub enum JobCommand {
    /// Show one job: status, attempts, worker, why it waits, task results.
    Status {
        /// Job id.
        job_id: String,
        /// Print every task's stdout (by default only the last task's).
        #[arg(long)]
        full: bool,
    },
    /// List the jobs of an Action.
    List {
        /// Action id.
        action_id: String,
        /// Only jobs in this status.
        #[arg(long, value_enum)]
        status: Option<StatusArg>,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Search jobs across Actions by status, plan and creation time.
    Search {
        /// Only jobs in this status.
        #[arg(long, value_enum)]
        status: Option<StatusArg>,
        /// Only jobs of this Plan.
        #[arg(long, value_name = "PLAN_ID")]
        plan: Option<String>,
        /// Only jobs created at or after this time (RFC 3339, or "2h ago").
        #[arg(long, value_name = "TIME", value_parser = parse_time)]
        after: Option<SystemTime>,
        /// Only jobs created before this time (RFC 3339, or "2h ago").
        #[arg(long, value_name = "TIME", value_parser = parse_time)]
        before: Option<SystemTime>,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Put a failed or dead job back to pending with a fresh attempt
    /// budget; with --action, every failed and dead job of the Action (or
    /// those in --status) at once (RetryAction).
    Retry {
        /// Job id.
        #[arg(required_unless_present = "action", conflicts_with = "action")]
        job_id: Option<String>,
        /// Retry the jobs of this Action instead of one job.
        #[arg(long, value_name = "ACTION_ID")]
        action: Option<String>,
        /// With --action: only jobs in this status.
        #[arg(long, value_enum, requires = "action")]
        status: Option<RetryStatusArg>,
        /// Give the retried job this priority, -1000..=1000 (not with
        /// --action) [default: it keeps its own].
        #[arg(long, conflicts_with = "action", allow_negative_numbers = true,
              value_parser = clap::value_parser!(i32).range(-1000..=1000))]
        priority: Option<i32>,
    },
    /// Cancel a pending, running or failed job (a running one is killed on
    /// its worker); with --action, every such job of the Action at once
    /// (CancelAction), or with --status only those in that status (one
    /// CancelJob each, not atomic).
    Cancel {
        /// Job id.
        #[arg(required_unless_present = "action", conflicts_with = "action")]
        job_id: Option<String>,
        /// Cancel the jobs of this Action instead of one job.
        #[arg(long, value_name = "ACTION_ID")]
        action: Option<String>,
        /// With --action: only jobs in this status.
        #[arg(long, value_enum, requires = "action")]
        status: Option<CancelStatusArg>,
    },
}

/// Runs one `job` subcommand.
///
/// # Errors
///
/// See [`super::run`].
pub async fn run(c: &Clients, out: OutputFormat, cmd: JobCommand) -> Result<(), CliError> {
    match cmd {
        JobCommand::Status { job_id, full } => {
            let job = c
                .job
                .clone()
                .get_job(pb::GetJobRequest { job_id })
                .await?
                .into_inner()
                .job
                .unwrap_or_default();
            show_job(JobView::from(job), out, full)
        }
        JobCommand::List {
            action_id,
            status,
            page,
        } => {
            let status = status.map_or(0, |s| JobStatus::from(s) as i32);
            let ids = collect_pages(&page, |page_size, page_token| {
                let mut client = c.job.clone();
                let action_id = action_id.clone();
                async move {
                    let r = client
                        .list_jobs(pb::ListJobsRequest {
                            action_id,
                            status,
                            page_size,
                            page_token,
                        })
                        .await?
                        .into_inner();
                    Ok((r.job_ids, r.next_page_token))
                }
            })
            .await?;
            show_jobs(c, ids, out).await
        }
        JobCommand::Search {
            status,
            plan,
            after,
            before,
            page,
        } => {
            let status = status.map_or(0, |s| JobStatus::from(s) as i32);
            let ids = collect_pages(&page, |page_size, page_token| {
                let mut client = c.job.clone();
                let req = pb::SearchJobsRequest {
                    status,
                    plan_id: plan.clone().unwrap_or_default(),
                    created_after: after.map(to_timestamp),
                    created_before: before.map(to_timestamp),
                    page_size,
                    page_token,
                };
                async move {
                    let r = client.search_jobs(req).await?.into_inner();
                    Ok((r.job_ids, r.next_page_token))
                }
            })
            .await?;
            show_jobs(c, ids, out).await
        }
        JobCommand::Retry {
            action: Some(action_id),
            status,
            ..
        } => retry_action(c, out, action_id, status).await,
        JobCommand::Cancel {
            action: Some(action_id),
            status: None,
            ..
        } => cancel_action(c, out, action_id).await,
        JobCommand::Cancel {
            action: Some(action_id),
            status: Some(status),
            ..
        } => cancel_by_status(c, out, action_id, status).await,
        JobCommand::Retry {
            job_id, priority, ..
        } => {
            let job_id = job_id.unwrap_or_default();
            let job = c
                .job
                .clone()
                .retry_job(pb::RetryJobRequest { job_id, priority })
                .await?
                .into_inner()
                .job
                .unwrap_or_default();
            show_job(JobView::from(job), out, false)
        }
        JobCommand::Cancel { job_id, .. } => {
            let job_id = job_id.unwrap_or_default();
            let job = c
                .job
                .clone()
                .cancel_job(pb::CancelJobRequest { job_id })
                .await?
                .into_inner()
                .job
                .unwrap_or_default();
            show_job(JobView::from(job), out, false)
        }
    }
}

/// Cancels the jobs of `action_id` in `status`, one CancelJob each, page
/// by page of ListJobs; jobs that ended meanwhile are skipped. Prints the
/// count and the Action.
///
/// # Errors
///
/// The first server error other than a job that ended meanwhile; the jobs
/// cancelled before it are counted on stderr.
async fn cancel_by_status(
    c: &Clients,
    out: OutputFormat,
    action_id: String,
    status: CancelStatusArg,
) -> Result<(), CliError> {
    let mut cancelled = 0;
    let mut page_token = String::new();
    // Each page moves the token forward (ids in row order): at most one
    // pass over the Action's jobs.
    loop {
        let r = c
            .job
            .clone()
            .list_jobs(pb::ListJobsRequest {
                action_id: action_id.clone(),
                status: JobStatus::from(status) as i32,
                page_size: 1000,
                page_token,
            })
            .await?
            .into_inner();
        for job_id in r.job_ids {
            match c
                .job
                .clone()
                .cancel_job(pb::CancelJobRequest { job_id })
                .await
            {
                Ok(_) => cancelled += 1,
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::FailedPrecondition | tonic::Code::NotFound
                    ) => {}
                Err(s) => {
                    if cancelled > 0 {
                        // The cancels before it stand: say how many.
                        super::to_stderr(format_args!(
                            "agq: cancelled {cancelled} job(s) of action {action_id} before this \
                             error; run the command again for the rest"
                        ));
                    }
                    return Err(s.into());
                }
            }
        }
        if r.next_page_token.is_empty() {
            break;
        }
        page_token = r.next_page_token;
    }
    let action = c
        .action
        .clone()
        .get_action(pb::GetActionRequest { action_id })
        .await?
        .into_inner()
        .action
        .unwrap_or_default();
    show_change("cancelled", cancelled, action, out)
}

fn show_job(view: JobView, out: OutputFormat, full: bool) -> Result<(), CliError> {
    match out {
        OutputFormat::Json => print_json(&view),
        OutputFormat::Table => emit(&view.table(full)),
    }
}

/// Fetches and prints the jobs of a listing.
///
/// # Errors
///
/// See [`super::run`].
pub async fn show_jobs(
    c: &Clients,
    (ids, next_page_token): (Vec<String>, String),
    out: OutputFormat,
) -> Result<(), CliError> {
    let jobs = job_summaries(c, ids).await?;
    let page = JobPage {
        jobs,
        next_page_token,
    };
    match out {
        OutputFormat::Json => print_json(&page),
        OutputFormat::Table => {
            emit(&page.table())?;
            more_hint(&page.next_page_token);
            Ok(())
        }
    }
}

/// The jobs of `ids` in order; jobs deleted meanwhile are skipped.
///
/// # Errors
///
/// The first server error other than `NOT_FOUND`.
pub async fn job_summaries(c: &Clients, ids: Vec<String>) -> Result<Vec<JobSummary>, CliError> {
    fetch_each(ids, |job_id| {
        let mut client = c.job.clone();
        async move {
            let job = client
                .get_job(pb::GetJobRequest { job_id })
                .await?
                .into_inner()
                .job
                .unwrap_or_default();
            Ok(JobSummary::from(job))
        }
    })
    .await
}
