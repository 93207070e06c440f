//! The `agq` command-line client: `plan`, `action`, `job`, `worker`,
//! `queue` and `metrics` subcommands that call the `agq.v1` services, and
//! `agq demo`, which runs the whole system locally.
//!
//! - [`ClientOptions`]: the flags every client subcommand shares (`--server`,
//!   `--token`, `--output`, TLS), parsed once at the top of `agq`.
//! - [`ClientCommand`]: the subcommand tree; [`run`] executes one.
//! - [`client`]: the connection (TLS, bearer-token interceptor).
//! - [`view`]: the serde structs `--output json` prints, and their tables.
//! - One module per command group: [`plan`], [`action`], [`job`],
//!   [`worker`], [`queue`]; [`demo`] for `agq demo`.
//! - [`watch`]: `--watch`, following an Action to its end (progress bar or
//!   progress lines, jobs/s and ETA, reconnecting after a server restart).

pub(crate) mod action;
pub(crate) mod client;
pub mod demo;
pub(crate) mod error;
pub(crate) mod job;
pub(crate) mod plan;
pub(crate) mod queue;
pub(crate) mod schedule;
pub(crate) mod table;
pub(crate) mod time;
pub(crate) mod view;
pub(crate) mod watch;
pub(crate) mod worker;

use std::{path::PathBuf, time::Duration};

pub use self::{client::Clients, error::CliError};

/// How client subcommands print their results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Aligned, human-friendly columns.
    Table,
    /// Valid JSON (one document, or one JSON line per update when watching).
    Json,
}

/// Flags shared by every client subcommand. They are global: they may stand
/// before or after the subcommand (`agq -o json plan list` or
/// `agq plan list -o json`). `agq serve` and `agq demo` ignore them.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Client options (plan, action, job, worker, queue, metrics)")]
pub struct ClientOptions {
    /// AGQ server URL (http://, or https:// with --tls-ca).
    #[arg(
        long,
        global = true,
        env = "AGQ_SERVER",
        default_value = "http://127.0.0.1:6380"
    )]
    pub server: String,
    /// Bearer token sent as `authorization: Bearer <token>` on every call.
    #[arg(long, global = true, env = "AGQ_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Output format.
    #[arg(long, short = 'o', global = true, env = "AGQ_OUTPUT", value_enum,
          default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// PEM file of the CA that signed the server's certificate; enables TLS.
    #[arg(long, global = true, env = "AGQ_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (with --tls-client-key).
    #[arg(long, global = true, env = "AGQ_TLS_CLIENT_CERT")]
    pub tls_client_cert: Option<PathBuf>,
    /// PEM private key of --tls-client-cert.
    #[arg(long, global = true, env = "AGQ_TLS_CLIENT_KEY")]
    pub tls_client_key: Option<PathBuf>,
    /// Server name to verify the certificate against, when it differs from
    /// the URL's host.
    #[arg(long, global = true, env = "AGQ_TLS_DOMAIN")]
    pub tls_domain: Option<String>,
    /// Deadline of each call (not of `--watch` streams), e.g. 30s, 2m.
    #[arg(long, global = true, env = "AGQ_TIMEOUT", default_value = "30s",
          value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl ClientOptions {
    /// Options for a plain-text connection to `server` with defaults
    /// elsewhere (what `agq demo` uses).
    pub fn plain(server: impl Into<String>) -> Self {
        ClientOptions {
            server: server.into(),
            token: None,
            output: OutputFormat::Table,
            tls_ca: None,
            tls_client_cert: None,
            tls_client_key: None,
            tls_domain: None,
            timeout: Duration::from_secs(30),
        }
    }
}

/// The client subcommands of `agq`.
#[derive(Debug, clap::Subcommand)]
pub enum ClientCommand {
    /// Store, show, list and delete Plans.
    #[command(subcommand)]
    Plan(plan::PlanCommand),
    /// Submit, list, watch, cancel and retry Actions (a Plan over many inputs).
    #[command(subcommand)]
    Action(action::ActionCommand),
    /// Inspect, list, search, retry and cancel Jobs.
    #[command(subcommand)]
    Job(job::JobCommand),
    /// List, inspect, drain and forget workers.
    #[command(subcommand)]
    Worker(worker::WorkerCommand),
    /// Queue depth and the next jobs in line.
    #[command(subcommand)]
    Queue(queue::QueueCommand),
    /// Print the server's metrics (Prometheus text or JSON).
    Metrics(queue::MetricsArgs),
    /// Create, list, pause, resume and delete recurring schedules.
    #[command(subcommand)]
    Schedule(schedule::ScheduleCommand),
}

/// Runs one client subcommand against the server `opts` names, printing
/// its result to stdout in the chosen format.
///
/// # Errors
///
/// [`CliError`] when the connection fails, the server answers with an
/// error status, or a local input (file, JSON) is invalid.
pub async fn run(opts: &ClientOptions, cmd: ClientCommand) -> Result<(), CliError> {
    let clients = Clients::connect(opts).await?;
    let out = opts.output;
    match cmd {
        ClientCommand::Plan(c) => plan::run(&clients, out, c).await,
        ClientCommand::Action(c) => action::run(&clients, out, c).await,
        ClientCommand::Job(c) => job::run(&clients, out, c).await,
        ClientCommand::Worker(c) => worker::run(&clients, out, c).await,
        ClientCommand::Queue(c) => queue::run(&clients, out, c).await,
        ClientCommand::Metrics(a) => queue::metrics(&clients, out, a).await,
        ClientCommand::Schedule(c) => schedule::run(&clients, out, c).await,
    }
}

/// Prints `value` as pretty JSON on stdout.
///
/// # Errors
///
/// [`CliError::Output`] when serialization or writing fails.
pub fn print_json<T: serde::Serialize>(value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::Output(e.to_string()))?;
    table::emit_line(&text)
}

/// How many detail calls (`GetJob`, `GetPlan`) a listing runs at once.
const FETCH_CONCURRENCY: usize = 16;

/// Paging flags of the listings (jobs, plans).
#[derive(Debug, Clone, clap::Args)]
pub struct PageArgs {
    /// Results per page, 1..=1000 [server default: 100].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub page_size: Option<u32>,
    /// Token of the page to fetch (printed after a partial page).
    #[arg(long, conflicts_with = "all")]
    pub page_token: Option<String>,
    /// Fetch every page.
    #[arg(long)]
    pub all: bool,
}

/// The ids of one page (or every page with `--all`) and the next token;
/// `fetch(page_size, page_token)` makes one listing call.
///
/// Errors: the first failed call.
async fn collect_pages<F, Fut>(
    page: &PageArgs,
    mut fetch: F,
) -> Result<(Vec<String>, String), CliError>
where
    F: FnMut(u32, String) -> Fut,
    Fut: std::future::Future<Output = Result<(Vec<String>, String), tonic::Status>>,
{
    let mut ids = Vec::new();
    let mut token = page.page_token.clone().unwrap_or_default();
    let size = page.page_size.unwrap_or(if page.all { 1000 } else { 0 });
    loop {
        let (more, next) = fetch(size, token).await?;
        ids.extend(more);
        token = next;
        if !page.all || token.is_empty() {
            return Ok((ids, token));
        }
    }
}

/// Runs `fetch` for every id, a few at a time, and returns the results in
/// id order. Ids that are `NOT_FOUND` by now (deleted between the listing
/// and the fetch) are skipped.
///
/// # Errors
///
/// The first error status other than `NOT_FOUND`.
pub async fn fetch_each<T, F, Fut>(ids: Vec<String>, fetch: F) -> Result<Vec<T>, CliError>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    use futures_util::{StreamExt, TryStreamExt};
    let items: Vec<Option<T>> = futures_util::stream::iter(ids)
        .map(fetch)
        .buffered(FETCH_CONCURRENCY)
        .map(|r| match r {
            Ok(v) => Ok(Some(v)),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(CliError::from(s)),
        })
        .try_collect()
        .await?;
    Ok(items.into_iter().flatten().collect())
}

/// Tells the user on stderr how to fetch the next page, when there is one.
pub fn more_hint(next_page_token: &str) {
    if !next_page_token.is_empty() {
        eprintln!("more results: pass --page-token {next_page_token} (or --all)");
    }
}
