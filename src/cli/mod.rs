//! The `agq` command-line client: `plan`, `action`, `job`, `worker`,
//! `queue` and `metrics` subcommands that call the `agq.v1` services, and
//! `agq demo`, which runs the whole system locally.
//!
//! - [`ClientOptions`]: the flags every client subcommand shares (`--server`,
//!   `--token-file`, `--token`, `--output`, TLS), parsed once at the top of `agq`.
//! - [`ClientCommand`]: the subcommand tree; [`run`] executes one.
//! - [`client`]: the connection (TLS, bearer-token interceptor).
//! - `token`: where the bearer token comes from (`--token-file`,
//!   `AGQ_TOKEN_FILE`, `AGQ_TOKEN`, `--token` with a warning).
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
pub(crate) mod token;
pub(crate) mod view;
pub(crate) mod watch;
pub(crate) mod worker;

use std::{path::PathBuf, time::Duration};

pub use self::{
    client::Clients,
    error::CliError,
    table::{visible, visible_lines},
};

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
///
/// Parsed through `ClientFlags` (clap's derive), which this type wraps to
/// keep where the token came from: `--token` on the command line warns,
/// `AGQ_TOKEN` does not (`token::select` picks the token).
#[derive(Clone)]
pub struct ClientOptions {
    /// AGQ server URL.
    pub server: String,
    /// Bearer token of `--token` or `AGQ_TOKEN` (see
    /// [`Self::token_on_command_line`]).
    pub token: Option<String>,
    /// True when [`Self::token`] came from `--token` on the command line
    /// (readable by every local user), false for `AGQ_TOKEN`.
    pub token_on_command_line: bool,
    /// File holding the bearer token, from `--token-file` or `AGQ_TOKEN_FILE`.
    pub token_file: Option<PathBuf>,
    /// True when [`Self::token_file`] came from `--token-file` on the
    /// command line, false for `AGQ_TOKEN_FILE`.
    pub token_file_on_command_line: bool,
    /// Output format.
    pub output: OutputFormat,
    /// CA of the server's certificate; enables TLS.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate for mutual TLS.
    pub tls_client_cert: Option<PathBuf>,
    /// Private key of [`Self::tls_client_cert`].
    pub tls_client_key: Option<PathBuf>,
    /// Server name to verify the certificate against.
    pub tls_domain: Option<String>,
    /// Deadline of each call.
    pub timeout: Duration,
}

impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("ClientOptions")
            .field("server", &self.server)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("token_on_command_line", &self.token_on_command_line)
            .field("token_file", &self.token_file)
            .field(
                "token_file_on_command_line",
                &self.token_file_on_command_line,
            )
            .field("output", &self.output)
            .field("tls_ca", &self.tls_ca)
            .field("tls_client_cert", &self.tls_client_cert)
            .field("tls_client_key", &self.tls_client_key)
            .field("tls_domain", &self.tls_domain)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// The clap definition of the client flags; [`ClientOptions`] is built
/// from what it parses, with the source of the token flags added.
#[derive(clap::Args)]
#[command(next_help_heading = "Client options (plan, action, job, worker, queue, metrics)")]
struct ClientFlags {
    /// AGQ server URL (http://, or https:// with --tls-ca).
    #[arg(
        long,
        global = true,
        env = "AGQ_SERVER",
        default_value = "http://127.0.0.1:6380"
    )]
    server: String,
    /// Bearer token sent as `authorization: Bearer <token>` on every call.
    /// On the command line it is visible to every local user (and warned
    /// about): prefer --token-file or AGQ_TOKEN.
    #[arg(
        long,
        global = true,
        env = "AGQ_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    token: Option<String>,
    /// File holding the bearer token (surrounding whitespace ignored).
    /// Overrides AGQ_TOKEN; not with --token.
    // Any value, empty included: an empty AGQ_TOKEN_FILE counts as unset.
    #[arg(long, global = true, env = "AGQ_TOKEN_FILE", value_name = "PATH",
          value_parser = clap::builder::TypedValueParser::map(
              clap::builder::OsStringValueParser::new(), PathBuf::from))]
    token_file: Option<PathBuf>,
    /// Output format.
    #[arg(long, short = 'o', global = true, env = "AGQ_OUTPUT", value_enum,
          default_value_t = OutputFormat::Table)]
    output: OutputFormat,
    /// PEM file of the CA that signed the server's certificate; enables TLS.
    #[arg(long, global = true, env = "AGQ_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (with --tls-client-key).
    #[arg(long, global = true, env = "AGQ_TLS_CLIENT_CERT")]
    tls_client_cert: Option<PathBuf>,
    /// PEM private key of --tls-client-cert.
    #[arg(long, global = true, env = "AGQ_TLS_CLIENT_KEY")]
    tls_client_key: Option<PathBuf>,
    /// Server name to verify the certificate against, when it differs from
    /// the URL's host.
    #[arg(long, global = true, env = "AGQ_TLS_DOMAIN")]
    tls_domain: Option<String>,
    /// Deadline of each call (not of `--watch` streams), e.g. 30s, 2m;
    /// more than zero.
    #[arg(long, global = true, env = "AGQ_TIMEOUT", default_value = "30s",
          value_parser = call_timeout)]
    timeout: Duration,
}

/// Parses `--timeout`: a duration (`30s`, `2m`, `1h 30m`) above zero, as a
/// zero deadline fails every call.
///
/// Errors: the text does not parse, or is zero (a usage error, exit 2).
fn call_timeout(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => Err("a zero deadline fails every call: give more than 0".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

impl clap::Args for ClientOptions {
    fn group_id() -> Option<clap::Id> {
        ClientFlags::group_id()
    }

    fn augment_args(cmd: clap::Command) -> clap::Command {
        ClientFlags::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        ClientFlags::augment_args_for_update(cmd)
    }
}

impl clap::FromArgMatches for ClientOptions {
    /// The flags, with whether `--token` and `--token-file` were on the
    /// command line (not from their environment variables).
    ///
    /// # Errors
    ///
    /// clap's errors, and a usage error (exit 2) for `--token` together
    /// with `--token-file` on the command line.
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let opts = ClientOptions::from_flags(
            ClientFlags::from_arg_matches(matches)?,
            on_command_line(matches, "token"),
            on_command_line(matches, "token_file"),
        );
        opts.check_token_flags()?;
        Ok(opts)
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        let mut flags = self.to_flags();
        flags.update_from_arg_matches(matches)?;
        let mut opts = ClientOptions::from_flags(
            flags,
            self.token_on_command_line,
            self.token_file_on_command_line,
        );
        if matches.contains_id("token") {
            opts.token_on_command_line = on_command_line(matches, "token");
        }
        if matches.contains_id("token_file") {
            opts.token_file_on_command_line = on_command_line(matches, "token_file");
        }
        opts.check_token_flags()?;
        *self = opts;
        Ok(())
    }
}

/// True when the value of argument `id` was given on the command line
/// (not taken from its environment variable or its default).
fn on_command_line(matches: &clap::ArgMatches, id: &str) -> bool {
    matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
}

impl ClientOptions {
    /// Options from parsed flags and the sources of the token flags.
    fn from_flags(
        f: ClientFlags,
        token_on_command_line: bool,
        token_file_on_command_line: bool,
    ) -> Self {
        ClientOptions {
            server: f.server,
            token: f.token,
            token_on_command_line,
            token_file: f.token_file,
            token_file_on_command_line,
            output: f.output,
            tls_ca: f.tls_ca,
            tls_client_cert: f.tls_client_cert,
            tls_client_key: f.tls_client_key,
            tls_domain: f.tls_domain,
            timeout: f.timeout,
        }
    }

    /// The flags these options hold (for clap's update).
    fn to_flags(&self) -> ClientFlags {
        let o = self.clone();
        ClientFlags {
            server: o.server,
            token: o.token,
            token_file: o.token_file,
            output: o.output,
            tls_ca: o.tls_ca,
            tls_client_cert: o.tls_client_cert,
            tls_client_key: o.tls_client_key,
            tls_domain: o.tls_domain,
            timeout: o.timeout,
        }
    }

    /// A usage error when `--token` and `--token-file` are both on the
    /// command line (a flag and the other's environment variable are not:
    /// the flag wins, see [`token`]).
    fn check_token_flags(&self) -> Result<(), clap::Error> {
        if self.token_on_command_line && self.token_file_on_command_line {
            return Err(clap::Error::raw(
                clap::error::ErrorKind::ArgumentConflict,
                token::CONFLICT,
            ));
        }
        Ok(())
    }

    /// Options for a plain-text connection to `server` with defaults
    /// elsewhere (what `agq demo` uses).
    pub fn plain(server: impl Into<String>) -> Self {
        ClientOptions {
            server: server.into(),
            token: None,
            token_on_command_line: false,
            token_file: None,
            token_file_on_command_line: false,
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
/// error status (`DEADLINE_EXCEEDED` for a call that got no answer within
/// `--timeout`), or a local input (file, JSON) is invalid.
pub async fn run(opts: &ClientOptions, cmd: ClientCommand) -> Result<(), CliError> {
    let clients = Clients::connect(opts).await?;
    let out = opts.output;
    let result = match cmd {
        ClientCommand::Plan(c) => plan::run(&clients, out, c).await,
        ClientCommand::Action(c) => action::run(&clients, out, c).await,
        ClientCommand::Job(c) => job::run(&clients, out, c).await,
        ClientCommand::Worker(c) => worker::run(&clients, out, c).await,
        ClientCommand::Queue(c) => queue::run(&clients, out, c).await,
        ClientCommand::Metrics(a) => queue::metrics(&clients, out, a).await,
        ClientCommand::Schedule(c) => schedule::run(&clients, out, c).await,
    };
    result.map_err(|e| e.explain_timeout(opts.timeout))
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
        to_stderr(format_args!(
            "more results: pass --page-token {next_page_token} (or --all)"
        ));
    }
}

/// Writes one line to stderr, ignoring a failure to write: a closed or
/// full stderr (`2>&1 | head`) must not turn the command's outcome into a
/// panic. Every message of the client commands goes through it.
pub fn to_stderr(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// The shape of `agq`'s parser: client flags and a subcommand.
    #[derive(Debug, Parser)]
    struct TestCli {
        #[command(flatten)]
        client: ClientOptions,
        #[command(subcommand)]
        command: TestCommand,
    }

    #[derive(Debug, clap::Subcommand)]
    enum TestCommand {
        List,
    }

    fn parse(args: &[&str]) -> Result<ClientOptions, clap::Error> {
        let mut all = vec!["agq"];
        all.extend_from_slice(args);
        TestCli::try_parse_from(all).map(|c| c.client)
    }

    #[test]
    fn token_flags_on_the_command_line_are_marked_so() {
        for args in [&["--token", "t", "list"][..], &["list", "--token=t"][..]] {
            let o = parse(args).unwrap();
            assert_eq!(o.token.as_deref(), Some("t"));
            assert!(o.token_on_command_line, "{args:?}");
            assert!(!o.token_file_on_command_line, "{args:?}");
        }
        for args in [
            &["--token-file", "f", "list"][..],
            &["list", "--token-file", "f"][..],
        ] {
            let o = parse(args).unwrap();
            assert_eq!(o.token_file, Some(PathBuf::from("f")));
            assert!(o.token_file_on_command_line, "{args:?}");
            assert!(!o.token_on_command_line, "{args:?}");
        }
    }

    #[test]
    fn token_and_token_file_together_are_a_usage_error() {
        for args in [
            &["--token", "t", "--token-file", "f", "list"][..],
            &["--token-file", "f", "list", "--token", "t"][..],
            &["list", "--token", "t", "--token-file", "f"][..],
        ] {
            let e = parse(args).expect_err("a conflict");
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
            assert_eq!(e.exit_code(), 2);
        }
    }

    #[test]
    fn debug_output_hides_the_token() {
        let o = parse(&["--token", "secret-0123456789", "list"]).unwrap();
        let text = format!("{o:?}");
        assert!(!text.contains("secret"), "{text}");
        assert!(text.contains("<redacted>"), "{text}");
    }
}
