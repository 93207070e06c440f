//! `agq worker list|get|drain|forget|release|verify`.

use super::{
    print_json,
    table::{emit, visible},
    view::{workers_table, StateArg, VerificationView, WorkerView},
    CliError, Clients, OutputFormat,
};
use crate::pb::{self, WorkerState};

/// `agq worker ...`
#[derive(Debug, clap::Subcommand)]
pub enum WorkerCommand {
    /// List workers with state, freshness and load.
    List {
        /// Only workers in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
    },
    /// Show one worker: capabilities, heartbeat, stats.
    Get {
        /// Worker id.
        worker_id: String,
    },
    /// Put a worker in DRAINING: it finishes its jobs and takes no new ones.
    Drain {
        /// Worker id.
        worker_id: String,
    },
    /// Delete the record of a DEAD or UNREGISTERED worker now (they are
    /// otherwise listed for 24 hours). Needs the worker's or an admin token.
    Forget {
        /// Worker id.
        worker_id: String,
    },
    /// End a worker's quarantine (too many job timeouts): it takes leases
    /// again. Needs an admin token.
    Release {
        /// Worker id.
        worker_id: String,
    },
    /// Challenge a worker to run one of its tools or agentic units with
    /// fixed arguments and wait for its answer (WORKER.VERIFY). Needs an
    /// admin token.
    Verify {
        /// Worker id.
        worker_id: String,
        /// Tool or agentic unit.
        tool: String,
        /// Arguments [default: --describe for a unit, --version for a tool].
        #[arg(last = true)]
        args: Vec<String>,
        /// Seconds to wait for the answer, 0..=86400; no answer by then
        /// exits 1 (0: send the challenge and exit 0 without waiting).
        #[arg(long, default_value_t = 30,
              value_parser = clap::value_parser!(u64).range(0..=86_400))]
        wait_secs: u64,
    },
}

/// Runs one `worker` subcommand.
///
/// # Errors
///
/// See [`super::run`].
pub async fn run(c: &Clients, out: OutputFormat, cmd: WorkerCommand) -> Result<(), CliError> {
    let one = |w: Option<pb::Worker>| -> Result<(), CliError> {
        let view = WorkerView::from(w.unwrap_or_default());
        match out {
            OutputFormat::Json => print_json(&view),
            OutputFormat::Table => emit(&view.table()),
        }
    };
    match cmd {
        WorkerCommand::List { state } => {
            // Page after page: each has at least one worker, so this ends.
            let mut workers: Vec<WorkerView> = Vec::new();
            let mut page_token = String::new();
            loop {
                let page = c
                    .worker
                    .clone()
                    .list_workers(pb::ListWorkersRequest {
                        state: state.map_or(0, |s| WorkerState::from(s) as i32),
                        page_size: 0,
                        page_token,
                    })
                    .await?
                    .into_inner();
                workers.extend(page.workers.into_iter().map(WorkerView::from));
                if page.next_page_token.is_empty() {
                    break;
                }
                page_token = page.next_page_token;
            }
            match out {
                OutputFormat::Json => print_json(&serde_json::json!({ "workers": workers })),
                OutputFormat::Table => emit(&workers_table(&workers)),
            }
        }
        WorkerCommand::Get { worker_id } => one(c
            .worker
            .clone()
            .get_worker(pb::GetWorkerRequest { worker_id })
            .await?
            .into_inner()
            .worker),
        WorkerCommand::Drain { worker_id } => one(c
            .worker
            .clone()
            .drain_worker(pb::DrainWorkerRequest { worker_id })
            .await?
            .into_inner()
            .worker),
        WorkerCommand::Release { worker_id } => one(c
            .worker
            .clone()
            .release_worker(pb::ReleaseWorkerRequest { worker_id })
            .await?
            .into_inner()
            .worker),
        WorkerCommand::Verify {
            worker_id,
            tool,
            args,
            wait_secs,
        } => {
            let pending = c
                .worker
                .clone()
                .verify_worker(pb::VerifyWorkerRequest {
                    worker_id: worker_id.clone(),
                    tool,
                    args,
                })
                .await?
                .into_inner()
                .verification
                .unwrap_or_default();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_secs);
            let mut last = pending.clone();
            while wait_secs > 0 && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                let w = c
                    .worker
                    .clone()
                    .get_worker(pb::GetWorkerRequest {
                        worker_id: worker_id.clone(),
                    })
                    .await?
                    .into_inner()
                    .worker
                    .unwrap_or_default();
                if let Some(v) = w
                    .verifications
                    .into_iter()
                    .find(|v| v.challenge_id == pending.challenge_id && v.answered_at.is_some())
                {
                    last = v;
                    break;
                }
            }
            let view = VerificationView::from(last);
            match out {
                OutputFormat::Json => print_json(&view)?,
                OutputFormat::Table => emit(&format!("{}\n", visible(&view.line())))?,
            }
            if view.answered_at.is_some() && !view.passed {
                return Err(CliError::Failed(format!(
                    "worker {worker_id} failed the verification of {}",
                    view.tool
                )));
            }
            if wait_secs > 0 && view.answered_at.is_none() {
                return Err(CliError::Failed(format!(
                    "worker {worker_id} did not answer the verification of {} within \
                     --wait-secs {wait_secs}; it stays pending (`agq worker get {worker_id}` \
                     shows the answer when it comes)",
                    view.tool
                )));
            }
            Ok(())
        }
        WorkerCommand::Forget { worker_id } => {
            c.worker
                .clone()
                .forget_worker(pb::ForgetWorkerRequest {
                    worker_id: worker_id.clone(),
                })
                .await?;
            match out {
                OutputFormat::Json => print_json(&serde_json::json!({
                    "worker_id": worker_id,
                    "forgotten": true,
                })),
                OutputFormat::Table => emit(&format!("worker {worker_id} forgotten\n")),
            }
        }
    }
}
