//! `agq job status|list|search|retry|cancel`. Listing RPCs return job ids;
//! the client fetches each job (a few at a time) so that tables and JSON
//! show status, attempts, worker and errors.

use std::time::SystemTime;

use super::{
    collect_pages, fetch_each, more_hint, print_json,
    table::emit,
    time::{parse_time, to_timestamp},
    view::{JobPage, JobSummary, JobView, StatusArg},
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
    /// Put a failed or dead job back to pending with a fresh attempt budget.
    Retry {
        /// Job id.
        job_id: String,
    },
    /// Cancel a pending or running job (a running one is killed on its worker).
    Cancel {
        /// Job id.
        job_id: String,
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
        JobCommand::Retry { job_id } => {
            let job = c
                .job
                .clone()
                .retry_job(pb::RetryJobRequest { job_id })
                .await?
                .into_inner()
                .job
                .unwrap_or_default();
            show_job(JobView::from(job), out, false)
        }
        JobCommand::Cancel { job_id } => {
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
