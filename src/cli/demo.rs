//! `agq demo`: the whole system on one machine in one command. Starts AGQ
//! in-process on `127.0.0.1:0` (a temporary database unless `--db`),
//! starts N real `agw` worker processes, submits the word-frequency Plan
//! as one Action over real text files, shows a progress bar, prints each
//! file's top words and a summary, then stops the workers with SIGTERM
//! (they drain, unregister and exit 0) and shuts the server down cleanly.

use std::{
    collections::BTreeMap,
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

use super::{
    fetch_each,
    table::{emit, emit_line, key_values},
    time::human_duration,
    view::job_status_name,
    watch::{watch, WatchOptions},
    CliError, ClientOptions, Clients, OutputFormat,
};
use crate::{
    auth::Authenticator,
    config::EngineConfig,
    local::LocalServer,
    pb::{self, JobStatus},
    server::{self, ServerOptions},
};

/// Where the demo looks for text files when none are given.
pub const DEFAULT_DIR: &str = "/usr/share/common-licenses";

/// Id of the demo Plan.
pub const PLAN_ID: &str = "word-frequency";

/// How long a worker may take to start and register.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a worker may take to drain and exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(75);

/// Flags of `agq demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// SQLite database file [default: a temporary one, removed at exit].
    #[arg(long, env = "AGQ_DEMO_DB")]
    pub db: Option<PathBuf>,
    /// Number of agw worker processes to start (each runs 2 jobs at once).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub workers: u32,
    /// Text files, or directories whose regular files are used
    /// [default: every regular file under /usr/share/common-licenses].
    pub files: Vec<PathBuf>,
}

/// The demo Plan: the ten most frequent words of `{{file}}`, as the shell
/// pipeline `cat FILE | tr -cs A-Za-z '\n' | tr A-Z a-z | sort | uniq -c |
/// sort -rn | head -n 10`, one task per command, each reading the previous
/// task's stdout. The same Plan is in `examples/word-frequency.plan.json`.
pub fn word_frequency_plan() -> pb::Plan {
    let steps: [(&str, &[&str]); 7] = [
        ("cat", &["{{file}}"]),
        ("tr", &["-cs", "A-Za-z", "\n"]),
        ("tr", &["A-Z", "a-z"]),
        ("sort", &[]),
        ("uniq", &["-c"]),
        ("sort", &["-rn"]),
        ("head", &["-n", "10"]),
    ];
    pb::Plan {
        plan_id: PLAN_ID.into(),
        plan_description: "The ten most frequent words of a text file: cat {{file}} | \
                           tr -cs A-Za-z '\\n' | tr A-Z a-z | sort | uniq -c | sort -rn | head -n 10"
            .into(),
        tasks: steps
            .iter()
            .zip(1u32..)
            .map(|((command, args), n)| pb::Task {
                task_number: n,
                command: (*command).into(),
                args: args.iter().map(|a| (*a).to_owned()).collect(),
                timeout_secs: 60,
                input_from_task: (n > 1).then(|| n - 1),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// The regular files of `paths` (directories walked recursively, symlinks
/// to files followed), as absolute UTF-8 paths, sorted, without duplicates.
///
/// # Errors
///
/// [`CliError::Input`] for a path that does not exist or is not UTF-8.
pub fn collect_files(paths: &[PathBuf]) -> Result<Vec<String>, CliError> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), CliError> {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| CliError::Input(format!("cannot read {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let p = entry.path();
            let is_symlink = entry.file_type().map(|t| t.is_symlink()).unwrap_or(false);
            if p.is_file() {
                out.push(p);
            } else if p.is_dir() && !is_symlink {
                walk(&p, out)?;
            }
        }
        Ok(())
    }
    let mut found = Vec::new();
    for p in paths {
        if p.is_file() {
            found.push(p.clone());
        } else if p.is_dir() {
            walk(p, &mut found)?;
        } else {
            return Err(CliError::Input(format!(
                "{}: no such file or directory",
                p.display()
            )));
        }
    }
    let mut files = Vec::new();
    for p in found {
        let abs = std::path::absolute(&p)
            .map_err(|e| CliError::Input(format!("{}: {e}", p.display())))?;
        match abs.to_str() {
            Some(s) => files.push(s.to_owned()),
            None => {
                return Err(CliError::Input(format!(
                    "{}: the path is not UTF-8",
                    abs.display()
                )))
            }
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// The `agw` binary the demo starts: the one next to the running `agq`
/// (`cargo build --release` builds both).
///
/// # Errors
///
/// [`CliError::Input`] telling how to build it when it is missing.
pub async fn agw_path() -> Result<PathBuf, CliError> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Input(format!("cannot locate the agq binary: {e}")))?;
    let agw = exe.with_file_name("agw");
    if agw.is_file() {
        return Ok(agw);
    }
    Err(CliError::Input(format!(
        "the worker binary {} is missing: the demo starts agw processes from the directory \
         of agq. Build both binaries first: `cargo build --release && ./target/release/agq demo`",
        agw.display()
    )))
}

/// One started `agw` process.
struct Worker {
    id: String,
    child: Child,
    log: PathBuf,
}

impl Worker {
    /// The last lines of the worker's log, indented, for error messages.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(15);
        lines[start..]
            .iter()
            .map(|l| format!("\n    {l}"))
            .collect::<String>()
    }
}

/// Starts one `agw` and waits until it prints `agw: registered`.
async fn start_worker(
    agw: &Path,
    server: &str,
    n: u32,
    scratch: &Path,
    read_paths: &[PathBuf],
) -> Result<Worker, CliError> {
    let id = format!("demo-{n}");
    let log = scratch.join(format!("{id}.log"));
    let log_file = std::fs::File::create(&log)
        .map_err(|e| CliError::Input(format!("cannot create {}: {e}", log.display())))?;
    let mut child = Command::new(agw)
        .args([
            "--server",
            server,
            "--worker-id",
            &id,
            "--max-concurrent-jobs",
            "2",
        ])
        // The tasks' sandbox lets them read the files the demo was given.
        .args(
            read_paths
                .iter()
                .flat_map(|p| [OsStr::new("--read-path"), p.as_os_str()]),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        // Its own process group: a Ctrl-C in the terminal reaches only agq,
        // which then stops the workers with one SIGTERM each.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| CliError::Input(format!("cannot start {}: {e}", agw.display())))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| CliError::Input("no stdout pipe to agw".into()))?;
    let mut worker = Worker { id, child, log };
    let mut lines = BufReader::new(stdout).lines();
    let registered = tokio::time::timeout(REGISTER_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.starts_with("agw: registered") {
                return true;
            }
        }
        false
    })
    .await;
    match registered {
        Ok(true) => {
            // Keep draining stdout so the worker never blocks on a full pipe.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok(worker)
        }
        Ok(false) => {
            let status = worker.child.wait().await.ok();
            Err(CliError::Failed(format!(
                "worker {} exited before registering ({}); its log:{}",
                worker.id,
                status.map_or_else(|| "unknown status".into(), |s| s.to_string()),
                worker.log_tail()
            )))
        }
        Err(_) => {
            let _ = worker.child.kill().await;
            Err(CliError::Failed(format!(
                "worker {} did not register within {}s; its log:{}",
                worker.id,
                REGISTER_TIMEOUT.as_secs(),
                worker.log_tail()
            )))
        }
    }
}

/// Sends SIGTERM to every worker and waits for them to drain and exit.
/// Returns a problem description per worker that did not exit 0.
async fn stop_workers(workers: &mut [Worker]) -> Vec<String> {
    for w in workers.iter() {
        if let Some(pid) = w.child.id() {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
    }
    let mut problems = Vec::new();
    for w in workers.iter_mut() {
        match tokio::time::timeout(STOP_TIMEOUT, w.child.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => problems.push(format!(
                "worker {} exited with {status}; its log:{}",
                w.id,
                w.log_tail()
            )),
            Ok(Err(e)) => problems.push(format!("worker {}: {e}", w.id)),
            Err(_) => {
                let _ = w.child.kill().await;
                problems.push(format!(
                    "worker {} did not exit within {}s of SIGTERM and was killed",
                    w.id,
                    STOP_TIMEOUT.as_secs()
                ));
            }
        }
    }
    problems
}

/// Stores the demo Plan; an identical Plan already stored (a reused
/// `--db`) is fine.
async fn ensure_plan(c: &Clients) -> Result<(), CliError> {
    let plan = word_frequency_plan();
    match c
        .plan
        .clone()
        .submit_plan(pb::SubmitPlanRequest {
            plan: Some(plan.clone()),
            replace: false,
        })
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if s.code() == tonic::Code::AlreadyExists => {
            let stored = super::plan::get_plan(c, PLAN_ID.into()).await?;
            if stored
                == (pb::Plan {
                    version: stored.version,
                    ..plan
                })
            {
                Ok(())
            } else {
                Err(CliError::Failed(format!(
                    "the database already holds a different plan {PLAN_ID:?}; use another --db"
                )))
            }
        }
        Err(s) => Err(s.into()),
    }
}

/// What the demo observed.
struct Outcome {
    jobs: usize,
    completed: usize,
    not_completed: usize,
}

/// Runs the demo: see the module documentation. Prints as it goes.
///
/// # Errors
///
/// [`CliError::Input`] when agw or the files are missing;
/// [`CliError::Failed`] when a job did not complete, a worker failed to
/// start or stop cleanly, or the server failed.
pub async fn run(args: DemoArgs) -> Result<(), CliError> {
    let paths = if args.files.is_empty() {
        vec![PathBuf::from(DEFAULT_DIR)]
    } else {
        args.files.clone()
    };
    let files = collect_files(&paths)?;
    if files.is_empty() {
        return Err(CliError::Input(format!(
            "no regular files under {}",
            paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    // What the workers' sandbox lets tasks read: the files and directories
    // named (the default directory is under /usr, readable anyway).
    let read_paths: Vec<PathBuf> = paths
        .iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    let agw = agw_path().await?;
    let scratch = tempfile::Builder::new()
        .prefix("agq-demo-")
        .tempdir()
        .map_err(|e| CliError::Input(format!("cannot create a temporary directory: {e}")))?;
    let db = args
        .db
        .clone()
        .unwrap_or_else(|| scratch.path().join("agq.db"));

    let opts = ServerOptions {
        store_ca_file: None,
        store: crate::config::Store::Sqlite,
        db: db.clone(),
        sqlite_synchronous: Default::default(),
        engine: EngineConfig::default(),
        auth: Authenticator::default(),
        tls: None,
        shutdown_grace: server::DEFAULT_SHUTDOWN_GRACE,
        request_buffer_bytes: crate::request_budget::DEFAULT_REQUEST_BUFFER_BYTES,
    };
    let mut server = LocalServer::start(opts, None, false)
        .await
        .map_err(|e| CliError::Failed(format!("the server did not start: {e}")))?;
    let url = server.url();
    emit_line(&format!(
        "AGQ demo: server on {url} (database {}), {} agw worker{}, {} file{}",
        db.display(),
        args.workers,
        if args.workers == 1 { "" } else { "s" },
        files.len(),
        if files.len() == 1 { "" } else { "s" },
    ))?;

    let mut workers: Vec<Worker> = Vec::new();
    let flow = demo_flow(
        &url,
        &agw,
        args.workers,
        scratch.path(),
        &files,
        &read_paths,
        &mut workers,
    );
    let outcome = tokio::select! {
        r = server.wait() => Err(CliError::Failed(match r {
            Ok(()) => "the server stopped unexpectedly".into(),
            Err(e) => format!("the server failed: {e}"),
        })),
        r = flow => r,
        signal = interrupted() => Err(CliError::Failed(format!("interrupted by {signal}"))),
    };

    // Clean shutdown, whatever happened: workers drain and leave, then the server stops.
    let problems = stop_workers(&mut workers).await;
    let served = tokio::time::timeout(Duration::from_secs(30), server.stop()).await;
    drop(scratch);
    if !workers.is_empty() && problems.is_empty() {
        emit_line(&format!(
            "stopped {} worker{} (SIGTERM: drained, unregistered) and the server",
            workers.len(),
            if workers.len() == 1 { "" } else { "s" }
        ))?;
    }
    let outcome = outcome?;
    match served {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(CliError::Failed(format!("the server failed: {e}"))),
        Err(_) => {
            return Err(CliError::Failed(
                "the server did not shut down in 30s".into(),
            ))
        }
    }
    if !problems.is_empty() {
        return Err(CliError::Failed(problems.join("\n")));
    }
    if outcome.not_completed > 0 {
        return Err(CliError::Failed(format!(
            "{} of {} jobs did not complete",
            outcome.not_completed, outcome.jobs
        )));
    }
    debug_assert_eq!(outcome.completed, outcome.jobs);
    Ok(())
}

/// Resolves on SIGINT or SIGTERM with the signal's name, so the demo can
/// stop its workers and server before it exits.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

/// Workers up, Plan and Action in, watch, results out.
async fn demo_flow(
    url: &str,
    agw: &Path,
    n_workers: u32,
    scratch: &Path,
    files: &[String],
    read_paths: &[PathBuf],
    workers: &mut Vec<Worker>,
) -> Result<Outcome, CliError> {
    let clients = Clients::connect(&ClientOptions::plain(url)).await?;
    for n in 1..=n_workers {
        let w = start_worker(agw, url, n, scratch, read_paths).await?;
        emit_line(&format!(
            "worker {} registered (pid {})",
            w.id,
            w.child.id().unwrap_or(0)
        ))?;
        workers.push(w);
    }
    ensure_plan(&clients).await?;

    let started = Instant::now();
    let submitted = clients
        .action
        .clone()
        .submit_action(pb::SubmitActionRequest {
            plan_id: PLAN_ID.into(),
            inputs: files
                .iter()
                .map(|f| pb::ActionInput {
                    values: [("file".to_owned(), f.clone())].into(),
                })
                .collect(),
            ..Default::default()
        })
        .await?
        .into_inner();
    emit_line(&format!(
        "plan {PLAN_ID} submitted; action {} created {} jobs\n",
        submitted.action_id, submitted.jobs_created
    ))?;
    watch(
        &clients,
        &submitted.action_id,
        OutputFormat::Table,
        WatchOptions::default(),
    )
    .await?;
    let wall = started.elapsed();

    let jobs = fetch_each(submitted.job_ids.clone(), |job_id| {
        let mut client = clients.job.clone();
        async move {
            client
                .get_job(pb::GetJobRequest { job_id })
                .await
                .map(|r| r.into_inner().job.unwrap_or_default())
        }
    })
    .await?;

    let mut completed = 0;
    let mut per_worker: BTreeMap<String, usize> = BTreeMap::new();
    let mut text = String::new();
    for job in &jobs {
        let file = job.input.get("file").map_or("?", String::as_str);
        let ok = job.status == JobStatus::Completed as i32;
        *per_worker.entry(job.worker_id.clone()).or_default() += 1;
        text.push_str(&format!("── {file}"));
        if ok {
            completed += 1;
            text.push_str(&format!("  ({})\n", job.worker_id));
            let top = job
                .task_results
                .iter()
                .max_by_key(|t| t.task_number)
                .map_or("", |t| t.stdout.as_str());
            if top.trim().is_empty() {
                text.push_str("   (no words)\n");
            }
            for line in top.lines() {
                text.push_str(&format!("   {}\n", line.trim_end()));
            }
        } else {
            text.push_str(&format!(
                "  {} after {} attempt(s): {}\n",
                job_status_name(job.status).to_uppercase(),
                job.attempt,
                if job.error.is_empty() {
                    "-"
                } else {
                    &job.error
                }
            ));
        }
    }
    emit(&text)?;
    let total = submitted.job_ids.len();
    let secs = wall.as_secs_f64().max(1e-3);
    let by_worker = per_worker
        .iter()
        .map(|(w, n)| format!("{}: {n}", if w.is_empty() { "-" } else { w }))
        .collect::<Vec<_>>()
        .join(", ");
    emit(&format!(
        "\n{}",
        key_values(&[
            ("jobs", total.to_string()),
            ("completed", completed.to_string()),
            ("failed", (total - completed).to_string()),
            ("wall time", human_duration(wall)),
            ("jobs/s", format!("{:.1}", total as f64 / secs)),
            ("by worker", by_worker),
        ])
    ))?;
    emit_line(
        "\ncheck a file with the same pipeline in your shell:\n  cat FILE | tr -cs A-Za-z '\\n' \
         | tr A-Z a-z | sort | uniq -c | sort -rn | head -n 10\n",
    )?;
    Ok(Outcome {
        jobs: total,
        completed,
        not_completed: total - completed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_chains_every_task_to_the_previous() {
        let p = word_frequency_plan();
        assert_eq!(p.tasks.len(), 7);
        assert_eq!(p.tasks[0].input_from_task, None);
        for (i, t) in p.tasks.iter().enumerate().skip(1) {
            assert_eq!(t.input_from_task, Some(i as u32));
            assert_eq!(t.timeout_secs, 60);
        }
        assert_eq!(p.tasks[1].args, ["-cs", "A-Za-z", "\n"]);
    }

    #[test]
    fn example_plan_file_is_the_demo_plan() {
        let text = include_str!("../../examples/word-frequency.plan.json");
        let parsed = super::super::plan::parse_plan(text, "example").unwrap();
        assert_eq!(parsed, word_frequency_plan());
    }

    #[test]
    fn collects_files_recursively() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("b"), "x").unwrap();
        std::fs::write(dir.path().join("sub/a"), "x").unwrap();
        let files = collect_files(&[dir.path().to_path_buf()]).unwrap();
        assert_eq!(files.len(), 2);
        assert!(files.iter().all(|f| Path::new(f).is_absolute()));
        assert!(collect_files(&[dir.path().join("nope")]).is_err());
    }
}
