//! `agq-bench`: AGQ measured against a Redis-list job queue and against
//! BullMQ, in one run, on one machine. Its own crate in the workspace
//! (`bench/`), outside the `agq` package; it uses only agq's public API.
//!
//! AGQ runs in-process ([`harness`]) on 127.0.0.1:0 with a temporary
//! database and is driven over gRPC by simulated workers and submit
//! clients ([`agq_load`]); the Redis design runs on a real `redis-server`
//! child ([`redis_peer`]) with the same workers, jobs and payload, and so
//! does BullMQ, from a Node.js harness in `bench/bullmq/` on a
//! `redis-server` of its own ([`bullmq_peer`]). Modes:
//!
//! - default: peak throughput and latency, then latency at half of peak,
//!   and an idle phase where only heartbeats flow (with `--workers 10000`
//!   this is the fleet measurement: RSS, CPU and heartbeat ack p99);
//! - `--backlog N`: lease latency with N pending jobs against 1,000;
//! - `--failover`: re-lease time after a worker's kill (grace 0) and freeze;
//! - `--engine-only`: the workload on the core without gRPC;
//! - `--soak-secs N`: N seconds at half of peak, sampling RSS, open files
//!   and database size;
//! - `--store postgres --replicas N`: the clustered mode (N `agq serve`
//!   replicas on one PostgreSQL database) beside one SQLite node: peak and
//!   half-peak phases, and re-lease time after a replica's kill
//!   ([`cluster`]);
//! - `--smoke`: tiny sizes, asserts every job completed (for CI).
//!
//! Nothing here is a timed test: the numbers are printed, not asserted
//! (only `--smoke` asserts that every job completed).

pub mod agq_load;
pub mod backlog;
pub mod bullmq_peer;
pub mod cluster;
pub mod engine_only;
pub mod failover;
pub mod harness;
pub mod heap;
pub mod procstat;
pub mod redis_peer;
pub mod report;
pub mod soak;
pub mod stats;

use std::{path::PathBuf, sync::Arc, time::Duration};

use agq::config::{EngineConfig, SyncMode};

/// The store the default mode measures (`--store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchStore {
    /// One node on SQLite, beside the Redis and BullMQ peers.
    Sqlite,
    /// `--replicas` nodes on one PostgreSQL database, beside one SQLite node.
    Postgres,
}

/// Errors of a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Something could not be started (runtime, server, redis, connection).
    #[error("setup failed: {0}")]
    Setup(String),
    /// An AGQ call failed.
    #[error("AGQ call failed: {0}")]
    Rpc(#[from] tonic::Status),
    /// A Redis connection failed.
    #[error("redis I/O failed: {0}")]
    Io(#[from] std::io::Error),
    /// The run went wrong (timeout, lost jobs, bad reply).
    #[error("{0}")]
    Failed(String),
}

/// Flags of `agq-bench` (each also read from an `AGQ_BENCH_*` variable).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Simulated workers W (the same for AGQ and Redis). With thousands,
    /// the idle phase is the fleet measurement (RSS, CPU, heartbeat ack p99).
    #[arg(long, env = "AGQ_BENCH_WORKERS", default_value_t = 64)]
    pub workers: usize,
    /// Leases each worker holds at once (max_concurrent_jobs); a Redis
    /// worker with S slots is S connections, each BRPOPing.
    #[arg(long, env = "AGQ_BENCH_SLOTS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub slots: u32,
    /// Jobs M of the peak-throughput phase.
    #[arg(long, env = "AGQ_BENCH_JOBS", default_value_t = 200_000)]
    pub jobs: usize,
    /// Inputs K per Action (jobs per SubmitAction, or per Redis pipeline).
    #[arg(long, env = "AGQ_BENCH_PER_ACTION", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub per_action: u64,
    /// Bytes of payload in each job's input.
    #[arg(long, env = "AGQ_BENCH_PAYLOAD_BYTES", default_value_t = 128)]
    pub payload_bytes: usize,
    /// Concurrent submit clients of the peak phase.
    #[arg(long, env = "AGQ_BENCH_CLIENTS", default_value_t = 4)]
    pub clients: usize,
    /// Simulated workers per HTTP/2 connection to AGQ.
    #[arg(long, env = "AGQ_BENCH_WORKERS_PER_CONNECTION", default_value_t = 32)]
    pub workers_per_connection: usize,
    /// Heartbeat interval of the server and the simulated workers, ms.
    #[arg(long, env = "AGQ_BENCH_HEARTBEAT_MS", default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// Consecutive leases of one action per round-robin turn among actions
    /// of equal priority (the server's `--round-robin-quantum`); unset:
    /// the server's default.
    #[arg(long, env = "AGQ_BENCH_ROUND_ROBIN_QUANTUM")]
    pub round_robin_quantum: Option<u32>,
    /// Seconds of the idle phase (workers connected, only heartbeats).
    #[arg(long, env = "AGQ_BENCH_IDLE_SECS", default_value_t = 3)]
    pub idle_secs: u64,
    /// Seconds of the half-peak phase (0 skips it).
    #[arg(long, env = "AGQ_BENCH_PACED_SECS", default_value_t = 5)]
    pub paced_secs: u64,
    /// SQLite `synchronous` setting of AGQ's store.
    #[arg(long, env = "AGQ_BENCH_SYNCHRONOUS", value_enum, default_value_t = SyncMode::Full)]
    pub synchronous: SyncMode,
    /// Worker threads of the in-process server's runtime.
    #[arg(long, env = "AGQ_BENCH_SERVER_THREADS", default_value_t = 2)]
    pub server_threads: usize,
    /// Worker threads of the simulated clients' runtime.
    #[arg(long, env = "AGQ_BENCH_CLIENT_THREADS", default_value_t = 2)]
    pub client_threads: usize,
    /// Skip the Redis peer.
    #[arg(long, env = "AGQ_BENCH_NO_REDIS", default_value_t = false)]
    pub no_redis: bool,
    /// Skip the BullMQ peer (it runs when `node` is on PATH, redis-server
    /// is installed and `npm ci --prefix bench/bullmq` was run).
    #[arg(long, env = "AGQ_BENCH_NO_BULLMQ", default_value_t = false)]
    pub no_bullmq: bool,
    /// Directory of the BullMQ harness (`run.mjs` and its `node_modules`);
    /// default: `bench/bullmq` of the source tree this bench was built from.
    #[arg(long, env = "AGQ_BENCH_BULLMQ_DIR")]
    pub bullmq_dir: Option<PathBuf>,
    /// Backlog mode: lease latency with this many pending jobs against 1,000.
    #[arg(long, env = "AGQ_BENCH_BACKLOG")]
    pub backlog: Option<usize>,
    /// Leases measured per backlog size.
    #[arg(long, env = "AGQ_BENCH_BACKLOG_SAMPLE", default_value_t = 1000)]
    pub backlog_sample: usize,
    /// Failover mode: re-lease time after a worker's kill and freeze.
    #[arg(long, env = "AGQ_BENCH_FAILOVER", default_value_t = false)]
    pub failover: bool,
    /// Kill trials of the failover mode.
    #[arg(long, env = "AGQ_BENCH_KILL_TRIALS", default_value_t = 20)]
    pub kill_trials: usize,
    /// Freeze trials of the failover mode (each takes about 3 x the heartbeat interval).
    #[arg(long, env = "AGQ_BENCH_FREEZE_TRIALS", default_value_t = 3)]
    pub freeze_trials: usize,
    /// Engine-only mode: the same workload on the core without gRPC (the
    /// ceiling the store and the state machine put on AGQ).
    #[arg(long, env = "AGQ_BENCH_ENGINE_ONLY", default_value_t = false)]
    pub engine_only: bool,
    /// Run AGQ as a child process of this `agq` binary (`agq serve`)
    /// instead of in-process in the default mode, so its CPU and RSS are
    /// its own (e.g. target/release/agq).
    #[arg(long, env = "AGQ_BENCH_AGQ_BINARY")]
    pub agq_binary: Option<PathBuf>,
    /// Soak mode: this many seconds at half of the measured peak (or
    /// `--soak-rate`), sampling the server's RSS, open files and database size.
    #[arg(long, env = "AGQ_BENCH_SOAK_SECS")]
    pub soak_secs: Option<u64>,
    /// Rate of the soak, jobs/s (default: half of a peak phase run first).
    #[arg(long, env = "AGQ_BENCH_SOAK_RATE")]
    pub soak_rate: Option<f64>,
    /// Seconds between two samples of the soak.
    #[arg(long, env = "AGQ_BENCH_SOAK_SAMPLE_SECS", default_value_t = 30)]
    pub soak_sample_secs: u64,
    /// The server's job retention in seconds (`agq serve
    /// --job-retention-secs`; 0 keeps everything); with a short one the
    /// soak shows the database size level off.
    #[arg(long, env = "AGQ_BENCH_JOB_RETENTION_SECS", default_value_t = 7 * 24 * 3600)]
    pub job_retention_secs: u64,
    /// How the simulated AGQ workers report completions: `stream` (each
    /// report as it is ready on one ReportJobs stream per worker, as agw
    /// does), `batch` (the reports that queue up while one BatchUpdateJobs
    /// call is in flight go in the next) or `unary` (one UpdateJob each).
    #[arg(long, env = "AGQ_BENCH_REPORTS", value_enum, default_value_t = agq_load::Reports::Stream)]
    pub reports: agq_load::Reports,
    /// The store of the default mode: `sqlite` (one node, beside the
    /// Redis and BullMQ peers) or `postgres` (the clustered mode beside one
    /// SQLite node; needs the `agq` binary and PostgreSQL).
    #[arg(long, env = "AGQ_BENCH_STORE", value_enum, default_value_t = BenchStore::Sqlite)]
    pub store: BenchStore,
    /// Replicas of the clustered mode (`--store postgres`).
    #[arg(long, env = "AGQ_BENCH_REPLICAS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub replicas: u32,
    /// PostgreSQL server of the clustered mode (a database is created on
    /// it through the database this URL names); default: a throwaway
    /// server from the system's binaries (`initdb`/`postgres`, fsync on).
    #[arg(long, env = "AGQ_BENCH_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Replica kills of the clustered mode (each waits about 3 x the
    /// heartbeat interval for the re-lease).
    #[arg(long, env = "AGQ_BENCH_REPLICA_KILL_TRIALS", default_value_t = 5)]
    pub replica_kill_trials: usize,
    /// Tiny sizes; exits non-zero unless every job completed (CI).
    #[arg(long, env = "AGQ_BENCH_SMOKE", default_value_t = false)]
    pub smoke: bool,
    /// Where the temporary databases go (default: the system temp dir).
    #[arg(long, env = "AGQ_BENCH_DIR")]
    pub dir: Option<PathBuf>,
    /// Longest any one phase may take before the run fails, seconds.
    #[arg(long, env = "AGQ_BENCH_TIMEOUT_SECS", default_value_t = 300)]
    pub timeout_secs: u64,
}

impl BenchArgs {
    /// The sizes of `--smoke`.
    fn smoke_sizes(&mut self) {
        self.workers = self.workers.min(4);
        self.slots = self.slots.min(2);
        self.jobs = self.jobs.min(400);
        self.per_action = self.per_action.min(20);
        self.clients = self.clients.min(2);
        self.idle_secs = self.idle_secs.min(1);
        self.paced_secs = self.paced_secs.min(1);
        self.timeout_secs = self.timeout_secs.min(60);
        self.replica_kill_trials = self.replica_kill_trials.min(1);
    }

    pub(crate) fn base_dir(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(std::env::temp_dir)
    }

    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms.max(10)),
            max_inputs_per_action: 10_000,
            job_retention: (self.job_retention_secs > 0)
                .then(|| Duration::from_secs(self.job_retention_secs)),
            round_robin_quantum: self
                .round_robin_quantum
                .unwrap_or(EngineConfig::default().round_robin_quantum),
            ..EngineConfig::default()
        }
    }

    /// How the simulated AGQ workers behave, with `slots` leases each.
    fn worker_spec(&self, slots: u32) -> agq_load::WorkerSpec {
        agq_load::WorkerSpec {
            slots,
            heartbeat: Duration::from_millis(self.heartbeat_ms.max(10)),
            reports: self.reports,
        }
    }

    fn payload(&self) -> Arc<str> {
        Arc::from("x".repeat(self.payload_bytes))
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_secs.max(1))
    }
}

/// Waits for every submit task; the first failure (or panic) wins.
///
/// Errors: a task's own error, or [`BenchError::Failed`] when it panicked.
pub async fn join_submitters(
    tasks: impl IntoIterator<Item = tokio::task::JoinHandle<Result<(), BenchError>>>,
) -> Result<(), BenchError> {
    for t in tasks {
        t.await
            .map_err(|e| BenchError::Failed(format!("submit task: {e}")))??;
    }
    Ok(())
}

/// Raises the soft open-files limit to the hard one (many sockets).
fn raise_nofile() -> u64 {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        lim.rlim_cur
    }
}

/// Logs to stderr at the level `AGQ_BENCH_LOG` sets (default: errors only,
/// so the figures on stdout stand alone).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("AGQ_BENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// Runs the bench the flags ask for and prints the results. Returns the
/// process exit code: 0, or 1 when the run failed (or, with `--smoke`,
/// when a job did not complete).
pub fn main(mut args: BenchArgs) -> i32 {
    if args.smoke {
        args.smoke_sizes();
    }
    let nofile = raise_nofile();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads.max(1))
        .thread_name("bench-cli")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("agq-bench: cannot start the client runtime: {e}");
            return 1;
        }
    };
    let result = rt.block_on(async move {
        report::print_machine(&args);
        if let Some(bin) = &args.agq_binary {
            println!(
                "AGQ runs as a child process: {} serve (its own CPU and RSS)",
                bin.display()
            );
        }
        let mut ok = true;
        if args.failover {
            ok &= failover::run(&args).await?;
        }
        if let Some(n) = args.backlog {
            ok &= backlog::run(&args, n).await?;
        }
        if args.engine_only {
            ok &= engine_only::run(&args).await?;
        }
        if let Some(secs) = args.soak_secs {
            ok &= soak::run(&args, secs).await?;
        }
        if !args.failover && args.backlog.is_none() && !args.engine_only && args.soak_secs.is_none()
        {
            ok &= match args.store {
                BenchStore::Sqlite => report::run_default(&args, nofile).await?,
                BenchStore::Postgres => cluster::run(&args).await?,
            };
        }
        Ok::<_, BenchError>(ok)
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    match result {
        Ok(true) => 0,
        Ok(false) => {
            eprintln!("agq-bench: FAILED (see above)");
            1
        }
        Err(e) => {
            eprintln!("agq-bench: {e}");
            1
        }
    }
}
