//! `agq queue stats|peek` and `agq metrics`.

use super::{
    job::show_jobs,
    print_json,
    table::{emit, emit_line},
    view::QueueStatsView,
    CliError, Clients, OutputFormat,
};
use crate::pb;

/// `agq queue ...`
#[derive(Debug, clap::Subcommand)]
pub enum QueueCommand {
    /// Queue depths, the oldest wait and worker counts.
    Stats,
    /// The next jobs of a queue, in the order they will be leased (ready)
    /// or become due (scheduled).
    Peek {
        /// Which queue.
        #[arg(value_enum, default_value_t = QueueName::Ready)]
        queue: QueueName,
        /// How many jobs, 1..=1000.
        #[arg(long, short = 'n', default_value_t = 10,
              value_parser = clap::value_parser!(u32).range(1..=1000))]
        count: u32,
    },
}

/// The queues `queue peek` can show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QueueName {
    /// Pending jobs eligible now.
    Ready,
    /// Pending jobs waiting for their run_at or retry backoff.
    Scheduled,
}

/// Format of `agq metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsFormat {
    /// Prometheus text exposition format.
    Prometheus,
    /// JSON.
    Json,
}

/// Flags of `agq metrics`.
#[derive(Debug, clap::Args)]
pub struct MetricsArgs {
    /// Body format [default: json with --output json, else prometheus].
    /// With --output json a Prometheus body is printed as
    /// `{"format": "prometheus", "body": "..."}`.
    #[arg(long, value_enum)]
    pub format: Option<MetricsFormat>,
}

/// Runs one `queue` subcommand.
///
/// # Errors
///
/// See [`super::run`].
pub async fn run(c: &Clients, out: OutputFormat, cmd: QueueCommand) -> Result<(), CliError> {
    match cmd {
        QueueCommand::Stats => {
            let stats = QueueStatsView::from(
                c.queue
                    .clone()
                    .get_queue_stats(pb::GetQueueStatsRequest {})
                    .await?
                    .into_inner(),
            );
            match out {
                OutputFormat::Json => print_json(&stats),
                OutputFormat::Table => emit(&stats.table()),
            }
        }
        QueueCommand::Peek { queue, count } => {
            let ids = c
                .queue
                .clone()
                .peek_queue(pb::PeekQueueRequest {
                    queue: match queue {
                        QueueName::Ready => "ready",
                        QueueName::Scheduled => "scheduled",
                    }
                    .into(),
                    count,
                })
                .await?
                .into_inner()
                .job_ids;
            show_jobs(c, (ids, String::new()), out).await
        }
    }
}

/// Prints the server's metrics body as it comes.
///
/// # Errors
///
/// See [`super::run`].
pub async fn metrics(c: &Clients, out: OutputFormat, args: MetricsArgs) -> Result<(), CliError> {
    let format = args.format.unwrap_or(match out {
        OutputFormat::Json => MetricsFormat::Json,
        OutputFormat::Table => MetricsFormat::Prometheus,
    });
    let body = c
        .queue
        .clone()
        .get_metrics(pb::GetMetricsRequest {
            format: match format {
                MetricsFormat::Prometheus => "prometheus",
                MetricsFormat::Json => "json",
            }
            .into(),
        })
        .await?
        .into_inner()
        .body;
    match (out, format) {
        // Valid JSON whatever the body: the server's JSON re-indented, or
        // the Prometheus text inside an object.
        (OutputFormat::Json, MetricsFormat::Json) => {
            let value: serde_json::Value = serde_json::from_str(&body)
                .map_err(|e| CliError::Output(format!("the server's JSON metrics: {e}")))?;
            print_json(&value)
        }
        (OutputFormat::Json, MetricsFormat::Prometheus) => {
            print_json(&serde_json::json!({ "format": "prometheus", "body": body }))
        }
        _ if body.ends_with('\n') => emit(&body),
        _ => emit_line(&body),
    }
}
