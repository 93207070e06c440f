//! Configuration of `agq serve`: clap flags, each also readable from an
//! `AGQ_*` environment variable, and the plain [`EngineConfig`] the engine uses.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// SQLite `synchronous` setting of the embedded store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SyncMode {
    /// fsync on every commit: durable across power loss (the default).
    #[default]
    Full,
    /// fsync at WAL checkpoints only: durable across process crashes
    /// (kill -9), may lose the last commits on power loss.
    Normal,
}

/// The store `agq serve` keeps its state in (`--store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// The embedded SQLite database at `--db`: one server.
    Sqlite,
    /// A PostgreSQL database (a `postgres://` or `postgresql://` URL, or a
    /// libpq key=value string starting with `host=`) shared by any number
    /// of replicas.
    Postgres(String),
}

/// Parses `--store`: `sqlite`, or a PostgreSQL connection string.
///
/// Errors: any other value, with what is accepted.
pub fn parse_store(text: &str) -> Result<Store, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("sqlite") {
        Ok(Store::Sqlite)
    } else if t.starts_with("postgres://")
        || t.starts_with("postgresql://")
        || t.starts_with("host=")
    {
        Ok(Store::Postgres(t.to_string()))
    } else {
        Err("expected `sqlite` or a PostgreSQL URL (postgres://user@host:port/db)".into())
    }
}

/// Flags of `agq serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// gRPC listen address.
    #[arg(long, env = "AGQ_LISTEN", default_value = "127.0.0.1:6380")]
    pub listen: SocketAddr,
    /// SQLite database file; missing directories are created. Used when
    /// --store is `sqlite`.
    #[arg(long, env = "AGQ_DB", default_value = "./agq-data/agq.db")]
    pub db: PathBuf,
    /// Where the state lives: `sqlite` (the embedded database at --db, one
    /// server) or a PostgreSQL connection URL (`postgres://user@host/db`),
    /// which several `agq serve` replicas may share (the clustered mode).
    #[arg(long, env = "AGQ_STORE", default_value = "sqlite", value_parser = parse_store)]
    pub store: Store,
    /// PEM file of CA certificates trusted for TLS to PostgreSQL, besides
    /// the system's (for `sslmode=require` with a private CA).
    #[arg(long, env = "AGQ_STORE_CA_FILE")]
    pub store_ca_file: Option<PathBuf>,
    /// Interval workers must heartbeat at, in seconds; a worker silent for
    /// 3 x this interval is stale and gets no leases.
    #[arg(long, env = "AGQ_HEARTBEAT_INTERVAL_SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub heartbeat_interval_secs: u64,
    /// The heartbeat interval in milliseconds; overrides
    /// --heartbeat-interval-secs when set (for tests and benchmarks).
    #[arg(long, env = "AGQ_HEARTBEAT_INTERVAL_MS",
          value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub heartbeat_interval_ms: Option<u64>,
    /// Grace period in milliseconds after a worker's heartbeat stream drops
    /// before its leases are re-queued (it keeps them if it reconnects),
    /// 0..=86400000 (a day).
    #[arg(long, env = "AGQ_LEASE_GRACE_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(0..=86_400_000))]
    pub lease_grace_ms: u64,
    /// A running job whose lease is older than this many seconds fails its attempt.
    #[arg(long, env = "AGQ_JOB_TIMEOUT_SECS", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(1..=604_800))]
    pub job_timeout_secs: u64,
    /// First retry backoff in milliseconds, 0..=86400000 (a day); doubles
    /// per attempt, with jitter. 0 re-queues at once.
    #[arg(long, env = "AGQ_RETRY_BACKOFF_BASE_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(0..=86_400_000))]
    pub retry_backoff_base_ms: u64,
    /// Upper bound of the retry backoff in milliseconds, 0..=604800000 (a
    /// week).
    #[arg(long, env = "AGQ_RETRY_BACKOFF_MAX_MS", default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(0..=604_800_000))]
    pub retry_backoff_max_ms: u64,
    /// Most inputs (jobs) one SubmitAction may carry, 1..=400000 (its
    /// reply lists every job's id, and must fit a 16 MiB message).
    #[arg(long, env = "AGQ_MAX_INPUTS_PER_ACTION", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..=MAX_INPUTS_PER_ACTION))]
    pub max_inputs_per_action: u64,
    /// Seconds a finished action (every job completed, dead or cancelled)
    /// is kept before it is deleted with its jobs and task results; 0 keeps
    /// everything forever. Default: 7 days.
    #[arg(long, env = "AGQ_JOB_RETENTION_SECS", default_value_t = 7 * 24 * 3600)]
    pub job_retention_secs: u64,
    /// TOML file of tokens (client, admin, worker bound to a worker_id).
    /// Without it AGQ runs unauthenticated and only on loopback.
    #[arg(long, env = "AGQ_AUTH_FILE")]
    pub auth_file: Option<PathBuf>,
    /// Allow a non-loopback --listen without --auth-file.
    #[arg(long, env = "AGQ_INSECURE", default_value_t = false)]
    pub insecure: bool,
    /// HTTP listen address of `GET /metrics` (OpenMetrics or Prometheus text
    /// 0.0.4, by the `Accept` header). Port 6381: 9090 is Prometheus's own.
    #[arg(long, env = "AGQ_METRICS_LISTEN", default_value = "127.0.0.1:6381")]
    pub metrics_listen: SocketAddr,
    /// HTTP listen address of the web console (`agq serve` serves it on
    /// its own listener, not the metrics one: the console shows job inputs
    /// and outputs and can retry, cancel and drain, so it needs the API's
    /// tokens and loopback rule, while /metrics is scraped without a token).
    /// Without --auth-file only a loopback address is accepted.
    #[arg(long, env = "AGQ_CONSOLE_LISTEN", default_value = crate::console::DEFAULT_CONSOLE_LISTEN)]
    pub console_listen: SocketAddr,
    /// Do not serve the web console.
    #[arg(long, env = "AGQ_NO_CONSOLE", default_value_t = false)]
    pub no_console: bool,
    /// Server TLS certificate (PEM); enables TLS together with --tls-key.
    #[arg(long, env = "AGQ_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Server TLS private key (PEM).
    #[arg(long, env = "AGQ_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA bundle (PEM) for mutual TLS: clients must present a certificate it signed.
    #[arg(long, env = "AGQ_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Seconds in-flight calls may run after SIGTERM/SIGINT before open
    /// streams are cut and the database is closed, 0..=86400 (a day).
    #[arg(long, env = "AGQ_SHUTDOWN_GRACE_SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub shutdown_grace_secs: u64,
    /// MiB of request messages the server holds at once, over all calls,
    /// from their arrival until they are handled (16..=65536): a message
    /// that does not fit fails its call with RESOURCE_EXHAUSTED before it
    /// is buffered.
    #[arg(long, env = "AGQ_REQUEST_BUFFER_MB", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(16..=65536))]
    pub request_buffer_mb: u64,
    /// SQLite synchronous mode.
    #[arg(long, env = "AGQ_SQLITE_SYNCHRONOUS", value_enum, default_value_t = SyncMode::Full)]
    pub sqlite_synchronous: SyncMode,
    /// Most WatchAction streams open at once on the server; one more is
    /// refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "AGQ_MAX_WATCH_STREAMS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_watch_streams: u64,
    /// Most WatchAction streams open at once on one client connection; one
    /// more is refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "AGQ_MAX_WATCH_STREAMS_PER_CONNECTION", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_watch_streams_per_connection: u64,
    /// Largest worker report (one UpdateJob, or one report of
    /// BatchUpdateJobs) the server stores, in bytes of its encoded task
    /// results and error; a larger one is refused with RESOURCE_EXHAUSTED
    /// (agw then sends it again without outputs). The default is what agw
    /// sends at most (3 MiB of captured output) plus room for the fields.
    #[arg(long, env = "AGQ_MAX_REPORT_BYTES", default_value_t = DEFAULT_MAX_REPORT_BYTES,
          value_parser = clap::value_parser!(u64).range(1024..=16 * 1024 * 1024))]
    pub max_report_bytes: u64,
    /// Furthest ahead a SubmitAction's run_at may be, in seconds (default
    /// 366 days); later is refused with INVALID_ARGUMENT.
    #[arg(long, env = "AGQ_MAX_RUN_AT_AHEAD_SECS", default_value_t = DEFAULT_MAX_RUN_AT_AHEAD.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=100 * 366 * 86_400))]
    pub max_run_at_ahead_secs: u64,
    /// Quarantine a worker (no new leases until `agq worker release`) when
    /// this many of its leases hit --job-timeout-secs within
    /// --quarantine-window-secs while it keeps heartbeating: a hung worker.
    /// 0 never quarantines.
    #[arg(long, env = "AGQ_QUARANTINE_AFTER_TIMEOUTS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub quarantine_after_timeouts: u32,
    /// The window, in seconds, in which --quarantine-after-timeouts
    /// timeouts quarantine a worker.
    #[arg(long, env = "AGQ_QUARANTINE_WINDOW_SECS", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(1..=30 * 86_400))]
    pub quarantine_window_secs: u64,
    /// Starvation guard of the priority scheduler: every Nth lease goes to
    /// the oldest ready job (the first that a worker can take), whatever
    /// its priority, so a low priority is slowed by higher ones but never
    /// stopped. 0 turns the guard off (strict priorities).
    #[arg(long, env = "AGQ_STARVATION_GUARD_EVERY", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub starvation_guard_every: u32,
    /// Round robin among actions of equal priority: an action's turn is
    /// this many consecutive leases, then the next action's turn comes.
    /// 0 (the default) sizes the turn to the fleet: a quarter of the slots
    /// of the ACTIVE connected workers, between 1 and 64 (a one-slot fleet
    /// alternates job by job; a large one keeps an action's jobs together,
    /// which writes fewer database pages per job).
    #[arg(long, env = "AGQ_ROUND_ROBIN_QUANTUM", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub round_robin_quantum: u32,
    /// Log format.
    #[arg(long, env = "AGQ_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// OpenTelemetry collector to send traces to over OTLP/gRPC (e.g.
    /// `http://localhost:4317`); unset: `OTEL_EXPORTER_OTLP_ENDPOINT`, and
    /// when that is unset too, no traces are sent (the default).
    #[arg(long, env = "AGQ_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

impl ServeArgs {
    /// The core settings these flags describe.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            heartbeat_interval: match self.heartbeat_interval_ms {
                Some(ms) => Duration::from_millis(ms),
                None => Duration::from_secs(self.heartbeat_interval_secs),
            },
            lease_grace: Duration::from_millis(self.lease_grace_ms),
            job_timeout: Duration::from_secs(self.job_timeout_secs),
            retry_backoff_base: Duration::from_millis(self.retry_backoff_base_ms),
            retry_backoff_max: Duration::from_millis(self.retry_backoff_max_ms),
            max_inputs_per_action: usize::try_from(self.max_inputs_per_action)
                .unwrap_or(usize::MAX),
            job_retention: (self.job_retention_secs > 0)
                .then(|| Duration::from_secs(self.job_retention_secs)),
            max_watch_streams: usize::try_from(self.max_watch_streams).unwrap_or(usize::MAX),
            max_watch_streams_per_connection: usize::try_from(
                self.max_watch_streams_per_connection,
            )
            .unwrap_or(usize::MAX),
            max_report_bytes: usize::try_from(self.max_report_bytes).unwrap_or(usize::MAX),
            max_run_at_ahead: Duration::from_secs(self.max_run_at_ahead_secs),
            quarantine_after_timeouts: self.quarantine_after_timeouts,
            quarantine_window: Duration::from_secs(self.quarantine_window_secs),
            starvation_guard_every: self.starvation_guard_every,
            round_robin_quantum: self.round_robin_quantum,
        }
    }
}

/// Default of [`EngineConfig::max_report_bytes`]: the 3 MiB of captured
/// output agw puts in one report at most
/// ([`crate::worker::agent::REPORT_BUDGET_BYTES`]) plus 64 KiB for the other
/// fields (commands, error text, framing).
pub const DEFAULT_MAX_REPORT_BYTES: u64 = 3 * 1024 * 1024 + 64 * 1024;

/// Default of [`EngineConfig::max_run_at_ahead`]: 366 days.
pub const DEFAULT_MAX_RUN_AT_AHEAD: Duration = Duration::from_secs(366 * 86_400);

/// Settings of the engine (scheduler, leases, reaper, limits) that every
/// store shares, free of clap. Store-specific settings (the SQLite file and
/// its `synchronous` mode) are in [`crate::server::ServerOptions`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Interval workers heartbeat at; stale after 3 x this.
    pub heartbeat_interval: Duration,
    /// Grace after a heartbeat stream drops before leases are re-queued.
    pub lease_grace: Duration,
    /// Longest a lease (job attempt) may run.
    pub job_timeout: Duration,
    /// First retry backoff; doubles per attempt.
    pub retry_backoff_base: Duration,
    /// Upper bound of the retry backoff.
    pub retry_backoff_max: Duration,
    /// Most inputs one SubmitAction may carry.
    pub max_inputs_per_action: usize,
    /// How long a finished action (and its jobs) is kept; `None` keeps
    /// everything.
    pub job_retention: Option<Duration>,
    /// Most WatchAction streams open at once.
    pub max_watch_streams: usize,
    /// Most WatchAction streams open at once on one client connection.
    pub max_watch_streams_per_connection: usize,
    /// Largest worker report stored, in encoded bytes of its task results
    /// and error.
    pub max_report_bytes: usize,
    /// Furthest ahead of now a SubmitAction's `run_at` may be.
    pub max_run_at_ahead: Duration,
    /// Leases of one worker that hit the job timeout within
    /// [`EngineConfig::quarantine_window`] before it is QUARANTINED; 0
    /// never quarantines.
    pub quarantine_after_timeouts: u32,
    /// The window the timeouts are counted in.
    pub quarantine_window: Duration,
    /// Every this many leases, the oldest ready job that a worker can
    /// take is leased first whatever its priority (the starvation
    /// guard); 0: strict priorities.
    pub starvation_guard_every: u32,
    /// Consecutive leases of one action per round-robin turn; 0: a
    /// quarter of the fleet's slots, between 1 and 64.
    pub round_robin_quantum: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            heartbeat_interval: Duration::from_secs(30),
            lease_grace: Duration::from_secs(10),
            job_timeout: Duration::from_secs(3600),
            retry_backoff_base: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(60),
            max_inputs_per_action: 10_000,
            job_retention: Some(Duration::from_secs(7 * 24 * 3600)),
            max_watch_streams: 10_000,
            max_watch_streams_per_connection: 100,
            max_report_bytes: DEFAULT_MAX_REPORT_BYTES as usize,
            max_run_at_ahead: DEFAULT_MAX_RUN_AT_AHEAD,
            quarantine_after_timeouts: 3,
            quarantine_window: Duration::from_secs(3600),
            starvation_guard_every: 20,
            round_robin_quantum: 0,
        }
    }
}

/// Longest retry backoff, in ms, whatever the configuration says (a week,
/// the top of `--retry-backoff-max-ms`): a job's ready time stays far from
/// overflow.
pub const MAX_RETRY_BACKOFF_MS: u64 = 604_800_000;

/// The most inputs `--max-inputs-per-action` allows: the SubmitAction
/// reply lists each job's id (38 bytes encoded), and 400,000 of them fit
/// the server's 16 MiB message limit with room to spare.
pub const MAX_INPUTS_PER_ACTION: u64 = 400_000;

impl EngineConfig {
    /// Age of the last heartbeat at which a worker stops being fresh (3 x interval).
    pub fn stale_after(&self) -> Duration {
        self.heartbeat_interval * 3
    }

    /// How long after the server comes back from an outage (a restart on
    /// SQLite; every replica down, or the database unreachable, on
    /// PostgreSQL) its workers may take to reconnect before the leases
    /// they held are re-queued: the longer of `lease_grace` and the stale
    /// window. During the outage agw backs off its reconnects (at most one
    /// heartbeat interval apart while it holds jobs), so the lease grace
    /// alone, meant for one dropped connection, would re-queue the jobs of
    /// workers that are on their way back, and drop the results they
    /// finished meanwhile.
    pub fn restart_grace(&self) -> Duration {
        self.lease_grace.max(self.stale_after())
    }

    /// Backoff before the attempt after failed attempt `attempt` (1-based),
    /// in ms: `retry_backoff_base` doubled per attempt, at most
    /// `retry_backoff_max` and [`MAX_RETRY_BACKOFF_MS`], with ±25 % jitter;
    /// 0 when the base is 0. Both engines use it.
    pub fn retry_backoff_ms(&self, attempt: u32) -> i64 {
        use rand::Rng;
        let base = self.retry_backoff_base.as_millis() as f64;
        if base <= 0.0 {
            return 0;
        }
        let max = (self.retry_backoff_max.as_millis() as f64).min(MAX_RETRY_BACKOFF_MS as f64);
        let exp = base * 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
        let jitter = rand::rng().random_range(0.75..=1.25);
        (exp.min(max) * jitter) as i64
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// `agq serve` without flags syncs every commit (`synchronous=FULL`);
    /// `normal` is only ever asked for.
    #[test]
    fn serve_syncs_every_commit_unless_told_otherwise() {
        let plain = Cli::try_parse_from(["agq"]).unwrap();
        assert_eq!(plain.serve.sqlite_synchronous, SyncMode::Full);
        assert_eq!(SyncMode::default(), SyncMode::Full);
        let normal = Cli::try_parse_from(["agq", "--sqlite-synchronous", "normal"]).unwrap();
        assert_eq!(normal.serve.sqlite_synchronous, SyncMode::Normal);
        assert!(Cli::try_parse_from(["agq", "--sqlite-synchronous", "off"]).is_err());
    }

    /// A backoff configured past every bound (a library caller's
    /// EngineConfig skips the flags' ranges) is held to a week, jitter
    /// included, so a job's ready time cannot overflow.
    #[test]
    fn the_retry_backoff_is_bounded_whatever_the_configuration() {
        let huge = EngineConfig {
            retry_backoff_base: Duration::MAX,
            retry_backoff_max: Duration::MAX,
            ..EngineConfig::default()
        };
        for attempt in [0, 1, 2, 40, u32::MAX] {
            let ms = huge.retry_backoff_ms(attempt);
            assert!(
                ms >= (MAX_RETRY_BACKOFF_MS as f64 * 0.75) as i64
                    && ms <= (MAX_RETRY_BACKOFF_MS as f64 * 1.25) as i64,
                "{attempt}: {ms}"
            );
        }
        let plain = EngineConfig::default();
        for (attempt, expected) in [(1, 1000.0), (2, 2000.0), (3, 4000.0), (10, 60_000.0)] {
            let ms = plain.retry_backoff_ms(attempt) as f64;
            assert!(
                ms >= expected * 0.75 && ms <= expected * 1.25,
                "{attempt}: {ms}"
            );
        }
        let none = EngineConfig {
            retry_backoff_base: Duration::ZERO,
            ..EngineConfig::default()
        };
        assert_eq!(none.retry_backoff_ms(3), 0);
    }

    /// The reply of a SubmitAction of the most inputs allowed, with the
    /// longest action id, fits the largest message the server sends.
    #[test]
    fn the_reply_of_the_largest_action_fits_a_message() {
        use prost::Message;
        let reply = crate::pb::SubmitActionResponse {
            action_id: "a".repeat(128),
            jobs_created: u32::MAX,
            job_ids: vec![uuid::Uuid::now_v7().to_string(); MAX_INPUTS_PER_ACTION as usize],
        };
        assert!(reply.encoded_len() <= crate::server::MAX_MESSAGE_BYTES);
    }

    /// Durations and limits past their ranges are usage errors: a backoff
    /// of u64::MAX ms once overflowed the job's ready time, and a limit of
    /// 0 inputs started a server that refused every action.
    #[test]
    fn durations_past_their_ranges_are_refused() {
        assert!(Cli::try_parse_from(["agq", "--max-inputs-per-action", "0"]).is_err());
        for (flag, top) in [
            ("--max-inputs-per-action", "400000"),
            ("--lease-grace-ms", "86400000"),
            ("--retry-backoff-base-ms", "86400000"),
            ("--retry-backoff-max-ms", "604800000"),
            ("--shutdown-grace-secs", "86400"),
        ] {
            assert!(
                Cli::try_parse_from(["agq", flag, top]).is_ok(),
                "{flag} {top}"
            );
            let over = (top.parse::<u64>().unwrap() + 1).to_string();
            for n in [over.as_str(), "18446744073709551615"] {
                assert!(Cli::try_parse_from(["agq", flag, n]).is_err(), "{flag} {n}");
            }
        }
    }
}
