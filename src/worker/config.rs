//! `agw` settings: the clap flags (each also read from an `AGW_*`
//! environment variable) and the checked [`WorkerConfig`] they become.

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use crate::core::model::AgenticUnit;

use clap::{Parser, ValueEnum};

use super::{
    client::TlsOptions,
    error::WorkerError,
    executor::DEFAULT_OUTPUT_CAP_BYTES,
    sandbox::{self, ResourceLimits, RunAs, Sandbox, SandboxConfig, DEFAULT_READ_PATHS},
    tools::{ToolSet, DEFAULT_TOOLS},
    units,
};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Command-line flags of `agw`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "agw",
    version,
    about = "AGQ worker: runs leased Plans as real processes"
)]
pub struct AgwArgs {
    /// AGQ server URL (http:// or https://).
    #[arg(long, env = "AGW_SERVER", default_value = "http://127.0.0.1:6380")]
    pub server: String,

    /// Refused: a command line is readable by every local user. Pass the
    /// token in a file (`--token-file`) or in `AGW_TOKEN`.
    #[arg(long = "token", hide = true)]
    pub token_on_command_line: Option<String>,

    /// File holding the token sent as `authorization: Bearer <token>` on
    /// every call (surrounding whitespace ignored). The `AGW_TOKEN`
    /// environment variable is the alternative.
    #[arg(long, env = "AGW_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// Worker id, [A-Za-z0-9_-]{1,64} [default: worker-<hostname>-<pid>].
    #[arg(long, env = "AGW_WORKER_ID")]
    pub worker_id: Option<String>,

    /// Identity of this process sent at registration, [A-Za-z0-9_-]{1,64}
    /// [default: a random id per start]. Only for tests and supervisors
    /// that give each process its own: two live processes with one id are
    /// taken for one.
    #[arg(long, env = "AGW_INSTANCE_ID", hide = true)]
    pub instance_id: Option<String>,

    /// Jobs run at once, 1..=1024 [default: number of CPUs]: the slots the
    /// server fills; a lease beyond them waits for a free slot.
    #[arg(long, env = "AGW_MAX_CONCURRENT_JOBS", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_concurrent_jobs: Option<u32>,

    /// Comma-separated allowlist of commands; only those found on $PATH are
    /// advertised [default: text tools such as sort, grep and jq that start
    /// no other program and write no files; --help lists them].
    #[arg(long, env = "AGW_TOOLS", value_delimiter = ',', long_help = tools_long_help())]
    pub tools: Option<Vec<String>>,

    /// A label `key=value` sent at registration; repeat for more.
    #[arg(long = "tag", env = "AGW_TAGS", value_delimiter = ',', value_parser = parse_tag)]
    pub tags: Vec<(String, String)>,

    /// An agentic unit to offer: an executable that prints a JSON
    /// description (name, version, description, inputs) when run with
    /// `--describe`. Tasks run it by naming it as their command, in the
    /// same sandbox as the tools (a script unit needs its interpreter in
    /// --tools). Repeatable.
    #[arg(
        long = "agentic-unit",
        env = "AGW_AGENTIC_UNITS",
        value_delimiter = ',',
        value_name = "PATH"
    )]
    pub agentic_units: Vec<PathBuf>,

    /// A directory whose executable files are agentic units (as
    /// --agentic-unit).
    #[arg(long, env = "AGW_AGENTIC_UNIT_DIR", value_name = "DIR")]
    pub agentic_unit_dir: Option<PathBuf>,

    /// Seconds running jobs get to finish after SIGTERM/SIGINT before they
    /// are killed, 0..=2592000 (30 days).
    #[arg(long, env = "AGW_DRAIN_TIMEOUT_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=2_592_000))]
    pub drain_timeout_secs: u64,

    /// Bytes of stdout and of stderr kept per task; the rest is dropped and
    /// flagged as truncated.
    #[arg(long, env = "AGW_OUTPUT_CAP_BYTES", default_value_t = DEFAULT_OUTPUT_CAP_BYTES)]
    pub output_cap_bytes: usize,

    /// PEM file of the CA that signs the server certificate (https).
    #[arg(long, env = "AGW_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// PEM client certificate for mutual TLS (with --tls-key).
    #[arg(long, env = "AGW_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM client private key for mutual TLS (with --tls-cert).
    #[arg(long, env = "AGW_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// Server name to verify the certificate against, when it differs from
    /// the URL's host.
    #[arg(long, env = "AGW_TLS_DOMAIN")]
    pub tls_domain: Option<String>,

    /// A path tasks may read (directory or file), added to the defaults the
    /// tools need (/usr, /bin, /lib*, the loader cache, locale and time-zone
    /// data); repeat, or comma-separate, for more. This is how input data is
    /// exposed, e.g. `--read-path /data`.
    #[arg(long = "read-path", env = "AGW_READ_PATHS", value_delimiter = ',')]
    pub read_paths: Vec<PathBuf>,

    /// Let tasks use the network (by default sockets of every family, UNIX
    /// ones included, and io_uring are refused to them). System V IPC,
    /// POSIX message queues and the kernel keyrings stay refused either way.
    #[arg(long, env = "AGW_ALLOW_NETWORK")]
    pub allow_network: bool,

    /// Run tasks without the kernel sandbox (Landlock and seccomp). Needed on
    /// kernels without Landlock ABI 3 (Linux < 6.2); logged at start and
    /// shown on the worker as `sandboxed: false`. Not for production.
    #[arg(long, env = "AGW_INSECURE_NO_SANDBOX")]
    pub insecure_no_sandbox: bool,

    /// User tasks run as when agw runs as root (never root itself)
    /// [default: nobody]. Ignored, with a warning, when agw is not root:
    /// tasks then run as agw's own user.
    #[arg(long, env = "AGW_RUN_AS")]
    pub run_as: Option<String>,

    /// Directory holding each job's scratch directory (the tasks' working
    /// directory, HOME and TMPDIR; the only place they may write)
    /// [default: $TMPDIR/agw-scratch-<worker id>].
    #[arg(long, env = "AGW_SCRATCH_DIR")]
    pub scratch_dir: Option<PathBuf>,

    /// Address space of each task process, MiB (RLIMIT_AS); 0: unlimited.
    #[arg(long, env = "AGW_MAX_ADDRESS_SPACE_MB", default_value_t = 4096)]
    pub max_address_space_mb: u64,

    /// Largest file a task may write, MiB (RLIMIT_FSIZE), and the most
    /// stdout agw keeps on disk for a later task to read (more fails the
    /// task); 0: unlimited.
    #[arg(long, env = "AGW_MAX_FILE_SIZE_MB", default_value_t = 1024)]
    pub max_file_size_mb: u64,

    /// Processes and threads of the task user at once (RLIMIT_NPROC); 0:
    /// unlimited. Counts every process of that uid, so size it for
    /// --max-concurrent-jobs pipelines.
    #[arg(long, env = "AGW_MAX_PROCESSES", default_value_t = 256)]
    pub max_processes: u64,

    /// CPU time of each task process, seconds (RLIMIT_CPU); 0: unlimited.
    #[arg(long, env = "AGW_MAX_CPU_SECS", default_value_t = 86_400)]
    pub max_cpu_secs: u64,

    /// Descriptors each task process may hold open (RLIMIT_NOFILE, soft
    /// and hard); 0: as agw inherited.
    #[arg(long, env = "AGW_MAX_OPEN_FILES", default_value_t = 1024)]
    pub max_open_files: u64,

    /// Log format (logs go to stderr; RUST_LOG sets the filter).
    #[arg(long, env = "AGW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// OpenTelemetry collector to send traces to over OTLP/gRPC (e.g.
    /// `http://localhost:4317`): a span per job and per task, joined to the
    /// trace of the job's SubmitAction. Unset: `OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// and when that is unset too, no traces are sent (the default).
    #[arg(long, env = "AGW_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

/// The long help of `--tools`: the rule and every default tool, from
/// [`DEFAULT_TOOLS`] itself so that the help cannot drift from it.
fn tools_long_help() -> String {
    format!(
        "Comma-separated allowlist of commands; only those found on $PATH are \
         advertised.\n\n\
         [default: {}]\n\n\
         The default tools start no other program and write no files. Tools \
         that do (awk, sed, xargs, tee, find, env, timeout, nice, tar, \
         interpreters) must be named here; the sandbox is what contains them.",
        DEFAULT_TOOLS.join(",")
    )
}

/// Parses one `key=value` tag.
fn parse_tag(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("tag {s:?} is not key=value")),
    }
}

/// Everything the worker needs to run, checked.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// AGQ server URL.
    pub server: String,
    /// Bearer token, if any.
    pub token: Option<String>,
    /// This worker's id.
    pub worker_id: String,
    /// This process's identity sent at registration (random per start
    /// unless `--instance-id` is given): the server lets one live process
    /// run a worker id.
    pub instance_id: String,
    /// Host name sent at registration.
    pub hostname: String,
    /// Jobs run at once (≥ 1).
    pub max_concurrent_jobs: u32,
    /// The advertised tools, agentic units included (by name, each with
    /// its executable).
    pub tools: Arc<ToolSet>,
    /// The agentic units, as they described themselves.
    pub units: Vec<AgenticUnit>,
    /// The sandbox every task runs in.
    pub sandbox: Arc<Sandbox>,
    /// Labels sent at registration.
    pub tags: HashMap<String, String>,
    /// Time running jobs get after SIGTERM/SIGINT.
    pub drain_timeout: Duration,
    /// Bytes of stdout and of stderr kept per task.
    pub output_cap_bytes: usize,
    /// TLS settings.
    pub tls: TlsOptions,
}

impl AgwArgs {
    /// Checks the flags and resolves defaults: worker id, CPU count, the
    /// tools found on `$PATH`.
    ///
    /// # Errors
    ///
    /// [`WorkerError::Config`] for a token on the command line, an
    /// unreadable token file, an invalid worker id, an empty tool set, a
    /// kernel without Landlock (unless `--insecure-no-sandbox`), an unknown
    /// or root `--run-as` user, or an unusable read path or scratch
    /// directory.
    pub fn into_config(self) -> Result<WorkerConfig, WorkerError> {
        if self.token_on_command_line.is_some() {
            return Err(WorkerError::Config(
                "--token is refused: a command line is readable by every local user; \
                 put the token in a file and pass --token-file FILE, or set AGW_TOKEN"
                    .into(),
            ));
        }
        let token = match &self.token_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| {
                        WorkerError::Config(format!(
                            "cannot read --token-file {}: {e}",
                            path.display()
                        ))
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => std::env::var("AGW_TOKEN").ok(),
        };
        let hostname = hostname();
        let worker_id = match self.worker_id {
            Some(id) => {
                if !valid_worker_id(&id) {
                    return Err(WorkerError::Config(format!(
                        "--worker-id {id:?} must match [A-Za-z0-9_-]{{1,64}}"
                    )));
                }
                id
            }
            None => default_worker_id(&hostname, std::process::id()),
        };
        let instance_id = match self.instance_id {
            Some(id) if valid_worker_id(&id) => id,
            Some(id) => {
                return Err(WorkerError::Config(format!(
                    "--instance-id {id:?} must match [A-Za-z0-9_-]{{1,64}}"
                )))
            }
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        let max_concurrent_jobs = self.max_concurrent_jobs.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| u32::try_from(n.get()).unwrap_or(1024).min(1024))
                .unwrap_or(1)
        });
        let mut tools = match self.tools {
            Some(list) => ToolSet::from_env(list),
            None => ToolSet::from_env(DEFAULT_TOOLS),
        };
        if tools.is_empty() {
            return Err(WorkerError::Config(
                "none of the --tools is an executable on $PATH".into(),
            ));
        }
        let found = units::discover(&self.agentic_units, self.agentic_unit_dir.as_deref())?;
        let mut units = Vec::with_capacity(found.len());
        for (unit, path) in found {
            if tools.contains(&unit.name) {
                return Err(WorkerError::Config(format!(
                    "agentic unit {} ({}) has the name of a tool; rename one of them",
                    unit.name,
                    path.display()
                )));
            }
            tools.add(&unit.name, path);
            units.push(unit);
        }
        let enabled = if self.insecure_no_sandbox {
            tracing::warn!(
                "--insecure-no-sandbox: tasks run WITHOUT the kernel sandbox; any plan can \
                 run code, read and write files and use the network as the task user"
            );
            false
        } else {
            sandbox::probe().map_err(|e| {
                WorkerError::Config(format!(
                    "{e}; agw refuses to run tasks unconfined. Run it on a kernel with \
                     Landlock, or pass --insecure-no-sandbox to run without the sandbox"
                ))
            })?;
            true
        };
        let run_as = resolve_run_as(self.run_as.as_deref())?;
        let mut read_paths: Vec<PathBuf> = DEFAULT_READ_PATHS.iter().map(PathBuf::from).collect();
        read_paths.extend(self.read_paths);
        let scratch_root = self
            .scratch_dir
            .unwrap_or_else(|| std::env::temp_dir().join(format!("agw-scratch-{worker_id}")));
        let mib = |n: u64| n.saturating_mul(1 << 20);
        let sandbox_config = SandboxConfig {
            enabled,
            read_paths,
            allow_network: self.allow_network,
            limits: ResourceLimits {
                address_space_bytes: mib(self.max_address_space_mb),
                file_size_bytes: mib(self.max_file_size_mb),
                processes: self.max_processes,
                cpu_secs: self.max_cpu_secs,
                open_files: self.max_open_files,
            },
            run_as,
            scratch_root,
        };
        let (sandbox, tools, dropped) =
            Sandbox::new(sandbox_config, &tools).map_err(|e| WorkerError::Config(e.to_string()))?;
        if !dropped.is_empty() {
            tracing::warn!(
                tools = %dropped.join(","),
                "not advertised: script tools whose interpreter is not an advertised tool \
                 cannot start in the sandbox"
            );
        }
        if tools.is_empty() {
            return Err(WorkerError::Config(
                "none of the --tools can run in the sandbox".into(),
            ));
        }
        // A unit the sandbox cannot start (a script whose interpreter is not
        // a tool) is not offered.
        units.retain(|u| tools.contains(&u.name));
        Ok(WorkerConfig {
            server: self.server,
            token: token.filter(|t| !t.is_empty()),
            worker_id,
            instance_id,
            hostname,
            max_concurrent_jobs,
            tools: Arc::new(tools),
            units,
            sandbox: Arc::new(sandbox),
            tags: self.tags.into_iter().collect(),
            drain_timeout: Duration::from_secs(self.drain_timeout_secs),
            output_cap_bytes: self.output_cap_bytes,
            tls: TlsOptions {
                ca: self.tls_ca,
                cert: self.tls_cert,
                key: self.tls_key,
                domain: self.tls_domain,
            },
        })
    }
}

/// The identity tasks run as. When agw is root: `name` (default `nobody`),
/// which must not be root. Otherwise `None` (tasks keep agw's user, which
/// is not root), with a warning when a different user was asked for.
///
/// # Errors
///
/// [`WorkerError::Config`] for an unknown user or a root one.
fn resolve_run_as(name: Option<&str>) -> Result<Option<RunAs>, WorkerError> {
    use nix::unistd::{Uid, User};
    if !Uid::effective().is_root() {
        if let Some(n) = name {
            let me = User::from_uid(Uid::effective()).ok().flatten();
            if me.is_none_or(|u| u.name != n) {
                tracing::warn!(
                    run_as = n,
                    "--run-as is ignored: agw is not root, so tasks run as agw's own user"
                );
            }
        }
        return Ok(None);
    }
    let name = name.unwrap_or("nobody");
    let user = User::from_name(name)
        .map_err(|e| WorkerError::Config(format!("--run-as {name}: {e}")))?
        .ok_or_else(|| WorkerError::Config(format!("--run-as {name}: no such user")))?;
    if user.uid.is_root() || user.gid.as_raw() == 0 {
        return Err(WorkerError::Config(format!(
            "--run-as {name}: tasks never run as root (uid or gid 0)"
        )));
    }
    Ok(Some(RunAs {
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
    }))
}

/// True for `[A-Za-z0-9_-]{1,64}`.
pub fn valid_worker_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `worker-<hostname>-<pid>`, with characters a worker id may not hold
/// replaced by `-` and the host part shortened so the id fits 64 bytes.
pub fn default_worker_id(hostname: &str, pid: u32) -> String {
    let suffix = format!("-{pid}");
    let room = 64 - "worker-".len() - suffix.len();
    let host: String = hostname
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(room)
        .collect();
    format!("worker-{host}{suffix}")
}

/// This host's name as printable ASCII (at most 255 bytes), or `unknown`.
pub fn hostname() -> String {
    let name: String = sysinfo::System::host_name()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(255)
        .collect();
    if name.is_empty() {
        "unknown".to_owned()
    } else {
        name
    }
}

/// The platform string sent at registration, e.g. `linux-x86_64`.
pub fn platform() -> String {
    format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_id_is_valid() {
        let id = default_worker_id("build.example.com", 4242);
        assert_eq!(id, "worker-build-example-com-4242");
        assert!(valid_worker_id(&id));
        let long = default_worker_id(&"h".repeat(300), u32::MAX);
        assert_eq!(long.len(), 64);
        assert!(valid_worker_id(&long));
    }

    #[test]
    fn tasks_never_run_as_root() {
        if nix::unistd::Uid::effective().is_root() {
            assert!(resolve_run_as(Some("root")).is_err());
            let nobody = resolve_run_as(None)
                .unwrap()
                .expect("root agw switches user");
            assert_ne!(nobody.uid, 0);
            assert_ne!(nobody.gid, 0);
            assert!(resolve_run_as(Some("no-such-user-agq")).is_err());
        } else {
            // An unprivileged agw cannot switch: tasks keep its (non-root) user.
            assert_eq!(resolve_run_as(Some("root")).unwrap(), None);
        }
    }

    #[test]
    fn help_names_the_default_tools() {
        use clap::CommandFactory;
        let short = AgwArgs::command().render_help().to_string();
        assert!(!short.contains("DEFAULT_TOOLS"), "{short}");
        assert!(short.contains("sort, grep and jq"), "{short}");
        let long = AgwArgs::command().render_long_help().to_string();
        for tool in DEFAULT_TOOLS {
            assert!(long.contains(tool), "{tool} missing from\n{long}");
        }
        assert!(long.contains(&DEFAULT_TOOLS.join(",")), "{long}");
    }

    #[test]
    fn parses_flags() {
        let args = AgwArgs::try_parse_from([
            "agw",
            "--worker-id",
            "w1",
            "--tools",
            "sort,uniq,definitely-not-a-tool",
            "--tag",
            "zone=a",
            "--tag",
            "gpu=no",
            "--max-concurrent-jobs",
            "3",
        ])
        .unwrap();
        let cfg = args.into_config().unwrap();
        assert_eq!(cfg.worker_id, "w1");
        assert_eq!(cfg.max_concurrent_jobs, 3);
        assert_eq!(cfg.tools.names(), ["sort".to_owned(), "uniq".to_owned()]);
        assert_eq!(cfg.tags.get("zone").map(String::as_str), Some("a"));
        assert_eq!(cfg.tags.len(), 2);
        assert_eq!(cfg.drain_timeout, Duration::from_secs(60));
        assert_eq!(cfg.server, "http://127.0.0.1:6380");

        let bad = AgwArgs::try_parse_from(["agw", "--worker-id", "a b"]).unwrap();
        assert!(bad.into_config().is_err());
        assert!(AgwArgs::try_parse_from(["agw", "--tag", "novalue"]).is_err());
        assert!(AgwArgs::try_parse_from(["agw", "--max-concurrent-jobs", "0"]).is_err());
        // A drain deadline past what a clock can add is refused, not a
        // panic at the first signal.
        let longest = AgwArgs::try_parse_from(["agw", "--drain-timeout-secs", "2592000"]).unwrap();
        assert_eq!(longest.drain_timeout_secs, 2_592_000);
        for n in ["2592001", "18446744073709551615"] {
            assert!(AgwArgs::try_parse_from(["agw", "--drain-timeout-secs", n]).is_err());
        }
    }
}
