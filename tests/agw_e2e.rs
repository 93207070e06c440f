//! End-to-end tests of `agw` against a real `agq serve` process: real
//! worker processes run Plans as real Unix processes.
//!
//! Each test starts its own server on `127.0.0.1:0` with a temporary SQLite
//! database, a 200 ms heartbeat interval and a 500 ms lease grace, starts
//! `agw` processes against it, and drives it with the generated clients.

mod process;

use std::{
    collections::HashMap,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use agq::pb::{
    action_service_client::ActionServiceClient, job_service_client::JobServiceClient,
    plan_service_client::PlanServiceClient, queue_service_client::QueueServiceClient,
    worker_service_client::WorkerServiceClient, ActionInput, CancelJobRequest, GetActionRequest,
    GetJobRequest, GetMetricsRequest, GetWorkerRequest, Job, JobStatus, Plan,
    RegisterWorkerRequest, SubmitActionRequest, SubmitPlanRequest, Task, WorkerCapabilities,
    WorkerState,
};
use process::{AgqServe, AgwProc, Serve};
use tonic::transport::Channel;

/// Tools every test worker advertises (`sh` only for tests that need a
/// process with children).
const TOOLS: &str = "sort,uniq,cat,wc,tr,head,sleep,echo,tee,sh,grep";

/// How long any wait in these tests may take.
const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------- helpers --

/// A running `agq serve` (killed with SIGKILL when dropped) and how it
/// was started, so it can be restarted.
struct Server {
    proc: AgqServe,
    addr: String,
    db: PathBuf,
    heartbeat_ms: u64,
    grace_ms: u64,
    extra: Vec<String>,
}

impl Server {
    /// Starts a server on an ephemeral port with a database in `dir`.
    fn start(dir: &Path) -> Server {
        Self::start_with(dir.join("agq.db"), "127.0.0.1:0", 200, 500)
    }

    /// Starts a server on `listen` with database `db`, the given heartbeat
    /// interval and lease grace.
    fn start_with(db: PathBuf, listen: &str, heartbeat_ms: u64, grace_ms: u64) -> Server {
        Self::try_start_with(db, listen, heartbeat_ms, grace_ms, Vec::new())
            .expect("agq did not start")
    }

    /// Like [`Server::start_with`], `None` when the server exits before it
    /// listens (e.g. its port is not free yet).
    fn try_start_with(
        db: PathBuf,
        listen: &str,
        heartbeat_ms: u64,
        grace_ms: u64,
        extra: Vec<String>,
    ) -> Option<Server> {
        let proc = Serve::new(&db)
            .listen(listen)
            .args(["--heartbeat-interval-ms", &heartbeat_ms.to_string()])
            .args(["--lease-grace-ms", &grace_ms.to_string()])
            .args(&extra)
            .env("RUST_LOG", "warn")
            .kill_on_drop()
            .spawn()
            .ok()?;
        Some(Server {
            addr: proc.addr.clone(),
            proc,
            db,
            heartbeat_ms,
            grace_ms,
            extra,
        })
    }

    /// Restarts a stopped server on the same address and database; the old
    /// port may take a moment to be free again.
    fn restart(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (db, hb, grace) = (self.db.clone(), self.heartbeat_ms, self.grace_ms);
            if let Some(s) = Self::try_start_with(db, &self.addr, hb, grace, self.extra.clone()) {
                *self = s;
                return;
            }
            assert!(
                Instant::now() < deadline,
                "agq did not restart on {}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills the server with SIGKILL and reaps it.
    fn kill(&mut self) {
        self.proc.kill();
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(self.url())
            .expect("url")
            .connect()
            .await
            .expect("connect to agq")
    }
}

/// A temporary directory the task user can enter (agw runs tasks as
/// `nobody` when it is root): tests keep their input files in it.
fn test_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// A running `agw` (killed with SIGKILL when dropped). It runs tasks in
/// the sandbox, may read the system's temporary directory (where the
/// tests' input files are) and keeps its jobs' scratch directories under
/// its own root, where tests find files that tasks write there.
struct Agw {
    proc: AgwProc,
    scratch: tempfile::TempDir,
}

impl Agw {
    /// Starts `agw` with id `id` against `server` and waits until it has
    /// registered and opened its streams.
    async fn start(server: &Server, id: &str, extra: &[&str]) -> Agw {
        let mut agw = Self::spawn(server, id, extra, &[]);
        agw.wait_registered().await;
        agw
    }

    /// Starts `agw` with extra flags and environment variables, without
    /// waiting.
    fn spawn(server: &Server, id: &str, extra: &[&str], env: &[(&str, &str)]) -> Agw {
        let mut cmd = if extra.contains(&"--server") {
            process::Agw::without_server(id)
        } else {
            process::Agw::new(&server.url(), id)
        };
        if !extra.contains(&"--tools") {
            cmd = cmd.args(["--tools", TOOLS]);
        }
        let scratch = test_dir();
        if !extra.contains(&"--scratch-dir") {
            cmd = cmd.args([
                "--scratch-dir".as_ref(),
                scratch.path().join("jobs").as_os_str(),
            ]);
        }
        if !extra.contains(&"--read-path") {
            cmd = cmd.args(["--read-path".as_ref(), std::env::temp_dir().as_os_str()]);
        }
        cmd = cmd.args(extra).env(
            "RUST_LOG",
            &std::env::var("AGW_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        Agw {
            proc: cmd.kill_on_drop().spawn(),
            scratch,
        }
    }

    /// Waits for a file `name` that a running task wrote in its job's
    /// scratch directory; returns its path.
    async fn task_file(&self, name: &str) -> PathBuf {
        let root = self.scratch.path().join("jobs");
        let deadline = Instant::now() + WAIT;
        loop {
            let found = std::fs::read_dir(&root).ok().and_then(|dirs| {
                dirs.filter_map(Result::ok)
                    .map(|d| d.path().join(name))
                    .find(|p| p.is_file())
            });
            if let Some(p) = found {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "no task wrote {name} under {}",
                root.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the next `agw: registered <id> …` line.
    async fn wait_registered(&mut self) -> String {
        self.proc.wait_registered_async().await
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        self.proc.signal(sig);
    }

    /// Waits for the process to exit; returns its exit code.
    async fn wait_exit(&mut self) -> Option<i32> {
        self.proc.wait_exit_async(WAIT).await.code()
    }
}

/// Generated clients on one channel.
struct Clients {
    plans: PlanServiceClient<Channel>,
    actions: ActionServiceClient<Channel>,
    jobs: JobServiceClient<Channel>,
    workers: WorkerServiceClient<Channel>,
}

impl Clients {
    async fn new(server: &Server) -> Clients {
        let ch = server.channel().await;
        Clients {
            plans: PlanServiceClient::new(ch.clone()),
            actions: ActionServiceClient::new(ch.clone()),
            // A job's input alone may be 4 MiB, tonic's default limit.
            jobs: JobServiceClient::new(ch.clone()).max_decoding_message_size(64 << 20),
            workers: WorkerServiceClient::new(ch),
        }
    }

    /// Stores `tasks` as plan `plan_id`.
    async fn plan(&mut self, plan_id: &str, tasks: Vec<Task>) {
        self.plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(Plan {
                    plan_id: plan_id.to_owned(),
                    plan_description: format!("test plan {plan_id}"),
                    tasks,
                    ..Default::default()
                }),
                replace: false,
            })
            .await
            .expect("SubmitPlan");
    }

    /// Submits one job of `plan_id` on `input`; returns its id.
    async fn submit(&mut self, plan_id: &str, input: &[(&str, &str)], max_attempts: u32) -> String {
        let values: HashMap<String, String> = input
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let resp = self
            .actions
            .submit_action(SubmitActionRequest {
                action_id: String::new(),
                plan_id: plan_id.to_owned(),
                inputs: vec![ActionInput { values }],
                run_at: None,
                max_attempts,
                ..Default::default()
            })
            .await
            .expect("SubmitAction")
            .into_inner();
        resp.job_ids.into_iter().next().expect("one job id")
    }

    async fn job(&mut self, job_id: &str) -> Job {
        self.jobs
            .get_job(GetJobRequest {
                job_id: job_id.to_owned(),
            })
            .await
            .expect("GetJob")
            .into_inner()
            .job
            .expect("job in GetJobResponse")
    }

    /// Polls the job until `pred` holds; returns it.
    async fn wait_job(&mut self, job_id: &str, what: &str, pred: impl Fn(&Job) -> bool) -> Job {
        let deadline = Instant::now() + WAIT;
        loop {
            let job = self.job(job_id).await;
            if pred(&job) {
                return job;
            }
            assert!(
                Instant::now() < deadline,
                "job {job_id} never became {what}: {job:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the job reaches `status`.
    async fn wait_status(&mut self, job_id: &str, status: JobStatus) -> Job {
        self.wait_job(job_id, status.as_str_name(), |j| j.status == status as i32)
            .await
    }

    async fn worker_state(&mut self, worker_id: &str) -> WorkerState {
        let w = self
            .workers
            .get_worker(GetWorkerRequest {
                worker_id: worker_id.to_owned(),
            })
            .await
            .expect("GetWorker")
            .into_inner()
            .worker
            .expect("worker");
        WorkerState::try_from(w.state).expect("state")
    }
}

fn task(n: u32, cmd: &str, args: &[&str], timeout: u32, from: Option<u32>) -> Task {
    Task {
        task_number: n,
        command: cmd.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        timeout_secs: timeout,
        input_from_task: from,
        ..Default::default()
    }
}

/// A plan whose run sleeps `secs`, then appends `ran {{tag}}` to the file
/// `{{log}}`: one line per completed run, so a test can count that its
/// side effect happened exactly once.
fn runs_once(secs: u32) -> Vec<Task> {
    vec![
        task(1, "sleep", &[&secs.to_string()], 60, None),
        task(2, "echo", &["ran {{tag}}"], 60, None),
        task(3, "tee", &["-a", "{{log}}"], 60, Some(2)),
    ]
}

/// An empty, world-writable `runs.log` in `dir` for [`runs_once`]. The
/// append is a write outside the job's scratch directory, which the
/// sandbox forbids (tests/sandbox.rs), so the workers of these tests run
/// with `--insecure-no-sandbox`; their tasks still run as the unprivileged
/// task user, hence the mode.
fn side_effect_log(dir: &Path) -> PathBuf {
    let log = dir.join("runs.log");
    std::fs::write(&log, "").unwrap();
    std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o666)).unwrap();
    log
}

/// A text file with repeated words, some non-ASCII.
/// Task `n`: writes its pid to `task.pid` in its scratch directory (see
/// [`Agw::task_file`]), then sleeps 30 s (time limit 60 s) as that same
/// process.
fn writes_pid_then_sleeps(n: u32) -> Task {
    task(
        n,
        "sh",
        &["-c", "echo $$ > task.pid; exec sleep 30"],
        60,
        None,
    )
}

fn words_file(dir: &Path) -> String {
    let mut text = String::new();
    for i in 0..500 {
        let w = [
            "pear",
            "apple",
            "fig",
            "kiwi",
            "ünïcode",
            "banana split",
            "",
        ][i * 7 % 13 % 7];
        text.push_str(w);
        text.push('\n');
        if i % 3 == 0 {
            text.push_str("apple\n");
        }
    }
    let path = dir.join("words.txt");
    std::fs::write(&path, text).expect("write words");
    path.to_str().expect("utf-8 path").to_owned()
}

fn shell(script: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .output()
        .expect("sh");
    String::from_utf8(out.stdout).expect("utf-8")
}

/// True when `pid` is gone or a zombie.
fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

async fn wait_dead(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !is_dead(pid) {
        assert!(Instant::now() < deadline, "process {pid} is still alive");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads a pid a task wrote into `path`, waiting for it to appear.
async fn read_pid(path: &Path) -> i32 {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        assert!(Instant::now() < deadline, "no pid in {}", path.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ------------------------------------------------------------------ tests --

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_matches_the_shell_pipeline() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(&server, "w-pipe", &[]).await;
    let file = words_file(dir.path());
    c.plan(
        "count-words",
        vec![
            task(1, "sort", &["{{file}}"], 30, None),
            task(2, "uniq", &["-c"], 30, Some(1)),
            task(3, "sort", &["-rn"], 30, Some(2)),
        ],
    )
    .await;
    let job_id = c.submit("count-words", &[("file", &file)], 1).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    let expected = shell(&format!("sort '{file}' | uniq -c | sort -rn"));
    assert_eq!(job.task_results.len(), 3);
    assert_eq!(job.task_results[2].stdout, expected);
    assert!(job.task_results.iter().all(|r| r.exit_code == 0));
    assert_eq!(job.worker_id, "w-pipe");
    assert!(job.error.is_empty());
}

/// A lease larger than gRPC's customary 4 MiB (the largest input the
/// server accepts, 64 values of 64 KiB, and a plan with long arguments)
/// reaches agw and runs: agw takes messages up to the server's 16 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_past_4_mib_runs() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(&server, "w-big", &[]).await;
    let long = "x".repeat(60_000);
    c.plan("big", vec![task(1, "echo", &["-n", &long], 30, None)])
        .await;
    let keys: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
    let value = "v".repeat(64 * 1024);
    let input: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), value.as_str())).collect();
    let job_id = c.submit("big", &input, 1).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.attempt, 1);
    assert_eq!(job.task_results[0].stdout, long);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_exit_code_makes_the_job_dead_after_one_attempt() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(&server, "w-perm", &[]).await;
    // `grep` exits 1 when nothing matches and 2 on an error (a missing
    // file): 2 is permanent here, 1 is retried.
    let mut t = task(1, "grep", &["needle", "{{file}}"], 30, None);
    t.permanent_exit_codes = vec![2];
    c.plan("grep-perm", vec![t]).await;
    let missing = dir.path().join("missing.txt").display().to_string();
    let job_id = c.submit("grep-perm", &[("file", &missing)], 5).await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert_eq!(job.attempt, 1, "not retried: {job:#?}");
    assert!(
        job.error.contains("permanent failure, not retried")
            && job
                .error
                .contains("exited with code 2 (one of its permanent_exit_codes)"),
        "{}",
        job.error
    );
    assert_eq!(job.task_results[0].exit_code, 2);
    // Exit code 1 (no match) is not listed: that failure is retried.
    let haystack = dir.path().join("haystack.txt");
    std::fs::write(&haystack, "hay\n").unwrap();
    std::fs::set_permissions(&haystack, std::fs::Permissions::from_mode(0o644)).unwrap();
    let job_id = c
        .submit("grep-perm", &[("file", &haystack.display().to_string())], 2)
        .await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert_eq!(job.attempt, 2, "retried until its attempts ran out");
    assert!(!job.error.contains("permanent"), "{}", job.error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templating_fills_args_from_the_job_input() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(&server, "w-tpl", &[]).await;
    let file = words_file(dir.path());
    c.plan(
        "grep-count",
        vec![
            task(1, "grep", &["-c", "{{word}}", "{{file}}"], 30, None),
            task(
                2,
                "echo",
                &["file={{file}}", "{{ word }}", "{{literal"],
                30,
                None,
            ),
        ],
    )
    .await;
    let job_id = c
        .submit("grep-count", &[("file", &file), ("word", "apple")], 1)
        .await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(
        job.task_results[0].stdout,
        shell(&format!("grep -c apple '{file}'"))
    );
    assert_eq!(
        job.task_results[1].stdout,
        format!("file={file} apple {{{{literal\n")
    );

    // A variable the input lacks fails the job, naming it, and runs nothing.
    let job_id = c.submit("grep-count", &[("file", &file)], 1).await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert!(
        job.error.contains("\"{{word}}\""),
        "error should name the variable: {}",
        job.error
    );
    assert!(job.task_results.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_from_a_task_other_than_the_previous_one() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(&server, "w-fanout", &[]).await;
    let file = words_file(dir.path());
    c.plan(
        "fan-out",
        vec![
            task(1, "cat", &["{{file}}"], 30, None),
            task(2, "wc", &["-l"], 30, Some(1)),
            task(3, "tr", &["a-z", "A-Z"], 30, Some(1)),
            task(4, "sort", &[], 30, Some(1)),
        ],
    )
    .await;
    let job_id = c.submit("fan-out", &[("file", &file)], 1).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    let content = std::fs::read_to_string(&file).unwrap();
    assert_eq!(
        job.task_results[1].stdout.trim(),
        content.lines().count().to_string()
    );
    assert_eq!(job.task_results[2].stdout, content.to_ascii_uppercase());
    assert_eq!(job.task_results[3].stdout, shell(&format!("sort '{file}'")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_timeout_kills_the_sleep_and_its_children() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let agw = Agw::start(&server, "w-timeout", &[]).await;
    // The shell starts a background sleep (a child in the task's process
    // group), records its pid and waits for it.
    c.plan(
        "slow",
        vec![task(
            1,
            "sh",
            &["-c", "sleep 30 & echo $! > child.pid; wait"],
            2,
            None,
        )],
    )
    .await;
    let start = Instant::now();
    let job_id = c.submit("slow", &[], 1).await;
    // Read while the job runs: its scratch directory goes when it ends.
    let child = read_pid(&agw.task_file("child.pid").await).await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert!(start.elapsed() < Duration::from_secs(10));
    // The server may prefix the attempt ("attempt 1 of 1: …").
    assert!(
        job.error.ends_with("task 1 (sh) timed out after 2 s"),
        "{}",
        job.error
    );
    assert_eq!(job.task_results[0].exit_code, -1);
    wait_dead(child).await;
}

/// Pids of the processes whose command line starts with `name`.
fn processes_named(name: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (cmdline.starts_with(name.as_bytes()) && !is_dead(pid)).then_some(pid)
        })
        .collect()
}

/// Waits up to `within` until no live process's command line starts with
/// `name`; returns the pids still running then (empty: all gone).
async fn wait_none_named(name: &str, within: Duration) -> Vec<i32> {
    let deadline = Instant::now() + within;
    loop {
        let left = processes_named(name);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_process_tree_that_keeps_growing_is_killed_whole() {
    // A task leaves a chain of processes in a session of its own: each
    // forks the next and sleeps, the newest forks again every 0.2 s.
    // Killing only agw's direct children (the chain's top) each round
    // takes one link per round while the chain grows ten: the whole tree
    // of an escaped process must go at once. Every link ends by itself
    // after 40 s, so a failure leaves nothing behind for long.
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(
        &server,
        "w-hydra",
        &["--tools", "perl,sleep,echo", "--max-processes", "64"],
    )
    .await;
    const NAME: &str = "agq-e2e-escaped-chain";
    c.plan(
        "chain",
        vec![task(
            1,
            "perl",
            &[
                "-MPOSIX",
                "-e",
                &format!(
                    "my $p = fork // die \"fork: $!\"; if ($p) {{ print \"started\\n\"; exit 0 }} \
                     POSIX::setsid(); close STDOUT; close STDERR; $0 = '{NAME}'; \
                     my $end = time + 40; \
                     while (time < $end) {{ my $c = fork; \
                       if (!defined $c) {{ select(undef, undef, undef, 0.2); next }} \
                       if ($c) {{ sleep 1 while time < $end; exit 0 }} \
                       select(undef, undef, undef, 0.2) }}"
                ),
            ],
            30,
            None,
        )],
    )
    .await;
    let job_id = c.submit("chain", &[], 1).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.task_results[0].stdout, "started\n");
    // The task is over: after two reaping rounds (every 2 s) nothing of it
    // may run.
    let left = wait_none_named(NAME, Duration::from_secs(6)).await;
    assert!(
        left.is_empty(),
        "{} processes of a finished task still run: {left:?}",
        left.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_that_do_not_stop_at_once_do_not_stall_agw() {
    // A task leaves, for 6 s, bursts of orphans waiting in vfork (each in
    // uninterruptible sleep, which SIGSTOP does not stop at once). agw's
    // sweep of escaped processes must neither hold the start and end of
    // other tasks nor stall agw past its heartbeats: the worker stays
    // ACTIVE (stale after 3 s without a heartbeat), another job meanwhile
    // completes in its first attempt, and no orphan is left.
    let dir = test_dir();
    let server = Server::start_with(dir.path().join("agq.db"), "127.0.0.1:0", 1000, 500);
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(
        &server,
        "w-vfork",
        &["--tools", "perl,echo", "--max-concurrent-jobs", "2"],
    )
    .await;
    const NAME: &str = "agq-e2e-vfork-orphan";
    c.plan(
        "vfork",
        vec![task(
            1,
            "perl",
            &[
                "-MPOSIX",
                "-e",
                &format!(
                    "my $end = time + 6; \
                     while (time < $end) {{ for (1..60) {{ my $x = fork // last; \
                       if ($x == 0) {{ my $e = fork // POSIX::_exit(1); \
                         if ($e == 0) {{ POSIX::setsid(); $0 = '{NAME}'; my $r = syscall(58); \
                           if ($r == 0) {{ sleep 60; POSIX::_exit(0) }} POSIX::_exit(0) }} \
                         POSIX::_exit(0) }} waitpid($x, 0) }} \
                       select(undef, undef, undef, 0.5) }} print \"done\\n\""
                ),
            ],
            60,
            None,
        )],
    )
    .await;
    c.plan("echo", vec![task(1, "echo", &["hi"], 30, None)])
        .await;
    let vfork = c.submit("vfork", &[], 1).await;
    c.wait_status(&vfork, JobStatus::Running).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let echo = c.submit("echo", &[], 1).await;
    let job = c.wait_status(&echo, JobStatus::Completed).await;
    assert_eq!(
        (job.attempt, job.task_results[0].stdout.as_str()),
        (1, "hi\n")
    );
    let job = c.wait_status(&vfork, JobStatus::Completed).await;
    assert_eq!(job.attempt, 1, "{job:?}");
    assert_eq!(c.worker_state("w-vfork").await, WorkerState::Active);
    let left = wait_none_named(NAME, Duration::from_secs(10)).await;
    assert!(
        left.is_empty(),
        "{} orphans still run: {left:?}",
        left.len()
    );
}

/// The process group of live process `pid` (field 5 of its stat).
fn pgid_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("its stat");
    let after_name = &stat[stat.rfind(')').expect("a command name") + 2..];
    after_name
        .split(' ')
        .nth(2)
        .and_then(|f| f.parse().ok())
        .expect("a process group")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_move_a_process_into_another_tasks_group() {
    // A process in another running task's group would be spared by the
    // sweep of escaped processes until that task ended, and killed with
    // it. Each task runs in a session of its own, so a task cannot join
    // another's group at all.
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let _agw = Agw::start(
        &server,
        "w-groups",
        &["--tools", "perl", "--max-concurrent-jobs", "2"],
    )
    .await;
    const NAME: &str = "agq-e2e-group-host";
    c.plan(
        "host",
        vec![task(
            1,
            "perl",
            &["-e", &format!("$0 = '{NAME}'; sleep 30")],
            40,
            None,
        )],
    )
    .await;
    c.plan(
        "joiner",
        vec![task(
            1,
            "perl",
            &[
                "-MPOSIX",
                "-e",
                "POSIX::setpgid(0, $ARGV[0]) or die \"setpgid: $!\\n\"; print \"joined\\n\"",
                "{{pgid}}",
            ],
            10,
            None,
        )],
    )
    .await;
    let host = c.submit("host", &[], 1).await;
    let mut found = Vec::new();
    for _ in 0..100 {
        found = processes_named(NAME);
        if !found.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = *found.first().expect("the host task runs");
    let pgid = pgid_of(pid).to_string();
    let job_id = c.submit("joiner", &[("pgid", &pgid)], 1).await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert!(
        job.error.contains("setpgid: Operation not permitted"),
        "{}",
        job.error
    );
    assert_eq!(job.task_results[0].stdout, "");
    c.jobs
        .cancel_job(CancelJobRequest { job_id: host })
        .await
        .expect("CancelJob");
    let left = wait_none_named(NAME, Duration::from_secs(10)).await;
    assert!(left.is_empty(), "the host task still runs: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_also_kills_a_daemon_a_running_task_started() {
    // The task forks a daemon in a session of its own and sleeps on. At
    // the forced exit agw kills the task's group; the daemon, orphaned,
    // comes to agw, which must kill it before it exits itself: otherwise
    // it goes to init and runs on (40 s here) with its job long gone.
    // The signals are a hangup and a quit: they stop agw as SIGINT and
    // SIGTERM do (the kernel's default for them ends it without the sweep).
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let mut agw = Agw::start(&server, "w-forced-daemon", &["--tools", "perl,sleep,echo"]).await;
    const NAME: &str = "agq-e2e-forced-exit-daemon";
    c.plan(
        "daemon",
        vec![task(
            1,
            "perl",
            &[
                "-MPOSIX",
                "-e",
                &format!(
                    "my $p = fork // die \"fork: $!\"; if ($p == 0) {{ POSIX::setsid(); \
                     close STDOUT; close STDERR; $0 = '{NAME}'; sleep 40; exit 0 }} \
                     open my $f, '>', 'daemon.pid' or die $!; print $f $p; close $f; sleep 40"
                ),
            ],
            60,
            None,
        )],
    )
    .await;
    let _job_id = c.submit("daemon", &[], 1).await;
    let daemon = read_pid(&agw.task_file("daemon.pid").await).await;
    assert!(!is_dead(daemon));
    agw.signal(nix::sys::signal::Signal::SIGHUP);
    tokio::time::sleep(Duration::from_millis(300)).await;
    agw.signal(nix::sys::signal::Signal::SIGQUIT);
    assert_eq!(agw.wait_exit().await, Some(130));
    let left = wait_none_named(NAME, Duration::from_secs(5)).await;
    assert!(
        left.is_empty(),
        "the daemon of a task outlived agw's forced exit: {left:?}"
    );
}

/// Starts `sleep 30` in a process group of its own with pid `pid` (free
/// now), by setting the kernel's last pid (`ns_last_pid`, root only) just
/// before; `None` when that is not possible here or another process took
/// the pid first every time.
fn spawn_with_pid(pid: i32) -> Option<std::process::Child> {
    use std::os::unix::process::CommandExt;
    for _ in 0..50 {
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return None;
        }
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
        let mut child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("spawn sleep");
        if i32::try_from(child.id()).ok() == Some(pid) {
            return Some(child);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_tasks_group_id_reused_by_another_process_is_not_killed() {
    // The task's leader exits while a process it left outside its group
    // holds its stdout, so agw reads on for a grace (2 s) after it reaped
    // the leader. A process group id names nothing once its leader is
    // reaped and its members are gone: the kernel may give the number to
    // any new process. agw must not signal the old id after the reap; here
    // a process of the test's own, in a group of its own, gets that id.
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: setting the next pid (ns_last_pid) needs root");
        return;
    }
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let agw = Agw::start(&server, "w-pgid-reuse", &["--tools", "perl,sleep,echo"]).await;
    c.plan(
        "holder",
        vec![task(
            1,
            "perl",
            &[
                "-MPOSIX",
                "-e",
                "my $p = fork // die \"fork: $!\"; if ($p == 0) { POSIX::setsid(); \
                 $0 = 'agq-e2e-pipe-holder'; sleep 6; exit 0 } \
                 open my $f, '>', 'leader.pid' or die $!; print $f $$; close $f; \
                 select(undef, undef, undef, 0.5); exit 0",
            ],
            30,
            None,
        )],
    )
    .await;
    let job_id = c.submit("holder", &[], 1).await;
    let leader = read_pid(&agw.task_file("leader.pid").await).await;
    // Reaped (not only dead): its pid is free again.
    let deadline = Instant::now() + WAIT;
    while std::path::Path::new(&format!("/proc/{leader}")).exists() {
        assert!(
            Instant::now() < deadline,
            "the leader {leader} was not reaped"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let Some(mut victim) = spawn_with_pid(leader) else {
        eprintln!("skipped: could not start a process with pid {leader}");
        return;
    };
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.task_results[0].exit_code, 0);
    // Past the job's end (and the grace): the victim must still run.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = victim.try_wait().expect("try_wait");
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(
        status.is_none(),
        "a process that took the finished task's group id {leader} was killed: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unadvertised_command_is_refused_and_nothing_runs() {
    // The server routes a job only to workers that advertise its tools, so
    // the refusal guards against a stale registration: the id was
    // registered (here by the test, with the instance id the agw is then
    // started with) with `rm`, and an agw with fewer tools resumes it. A
    // 2 s interval keeps that registration fresh while agw starts.
    let dir = test_dir();
    let server = Server::start_with(dir.path().join("agq.db"), "127.0.0.1:0", 2000, 500);
    let mut c = Clients::new(&server).await;
    c.workers
        .register_worker(RegisterWorkerRequest {
            worker_id: "w-refuse".into(),
            hostname: "test".into(),
            platform: "linux-x86_64".into(),
            agw_version: "0.0.0".into(),
            capabilities: Some(WorkerCapabilities {
                tools: vec!["tee".into(), "rm".into()],
                agentic_units: vec![],
                ..Default::default()
            }),
            max_concurrent_jobs: 1,
            tags: HashMap::new(),
            instance_id: "stale-registration".into(),
            ..Default::default()
        })
        .await
        .expect("RegisterWorker");
    let _agw = Agw::start(
        &server,
        "w-refuse",
        &["--tools", "tee,cat", "--instance-id", "stale-registration"],
    )
    .await;
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep me").unwrap();
    let marker = dir.path().join("marker");
    c.plan(
        "dangerous",
        vec![
            task(1, "tee", &["{{marker}}"], 30, None),
            task(2, "rm", &["-f", "{{victim}}"], 30, None),
        ],
    )
    .await;
    let job_id = c
        .submit(
            "dangerous",
            &[
                ("marker", marker.to_str().unwrap()),
                ("victim", victim.to_str().unwrap()),
            ],
            1,
        )
        .await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert_eq!(job.worker_id, "w-refuse");
    assert!(
        job.error
            .contains("command \"rm\" is not advertised by this worker"),
        "{}",
        job.error
    );
    assert!(job.task_results.is_empty());
    assert!(!marker.exists(), "task 1 ran although the plan was refused");
    assert!(victim.exists(), "rm ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_job_stops_a_running_job() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let agw = Agw::start(&server, "w-cancel", &[]).await;
    c.plan(
        "long",
        vec![
            writes_pid_then_sleeps(1),
            task(2, "echo", &["never"], 60, None),
        ],
    )
    .await;
    let job_id = c.submit("long", &[], 1).await;
    c.wait_job(&job_id, "running task 1", |j| {
        j.status == JobStatus::Running as i32 && j.current_task == 1
    })
    .await;
    let pid = read_pid(&agw.task_file("task.pid").await).await;
    let start = Instant::now();
    let job = c
        .jobs
        .cancel_job(CancelJobRequest {
            job_id: job_id.clone(),
        })
        .await
        .expect("CancelJob")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(job.status, JobStatus::Cancelled as i32);
    wait_dead(pid).await;
    assert!(start.elapsed() < Duration::from_secs(5));
    // The cancel is final: the worker's late FAILED report is rejected.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(c.job(&job_id).await.status, JobStatus::Cancelled as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_job_the_job_completes_once_on_another_worker() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    let log = side_effect_log(dir.path());
    let unsandboxed = ["--max-concurrent-jobs", "1", "--insecure-no-sandbox"];
    c.plan("once", runs_once(3)).await;
    let mut a = Agw::start(&server, "w-a", &unsandboxed).await;
    let job_id = c
        .submit("once", &[("tag", "x"), ("log", log.to_str().unwrap())], 3)
        .await;
    c.wait_job(&job_id, "running on w-a", |j| {
        j.status == JobStatus::Running as i32 && j.worker_id == "w-a"
    })
    .await;
    let _b = Agw::start(&server, "w-b", &unsandboxed).await;
    a.signal(nix::sys::signal::Signal::SIGKILL);
    a.wait_exit().await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.worker_id, "w-b");
    assert_eq!(job.attempt, 2);
    assert_eq!(job.task_results[2].stdout, "ran x\n");
    // Give a zombie run every chance to show up, then count.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "ran x\n");
    let action = c
        .actions
        .get_action(GetActionRequest {
            action_id: job.action_id.clone(),
        })
        .await
        .expect("GetAction")
        .into_inner()
        .action
        .expect("action");
    assert_eq!((action.total_jobs, action.completed), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_then_sigcont_the_late_completion_is_rejected_by_fencing() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan(
        "frozen",
        vec![
            task(1, "sleep", &["2"], 60, None),
            task(2, "echo", &["done {{tag}}"], 60, None),
        ],
    )
    .await;
    let a = Agw::start(&server, "w-frozen", &["--max-concurrent-jobs", "1"]).await;
    let job_id = c.submit("frozen", &[("tag", "x")], 3).await;
    c.wait_job(&job_id, "running on w-frozen", |j| {
        j.status == JobStatus::Running as i32 && j.worker_id == "w-frozen"
    })
    .await;
    // Freeze the worker: its streams stay open, its heartbeats stop.
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    let _b = Agw::start(&server, "w-thawed-peer", &["--max-concurrent-jobs", "1"]).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!((job.worker_id.as_str(), job.attempt), ("w-thawed-peer", 2));
    assert_eq!(c.worker_state("w-frozen").await, WorkerState::Dead);
    // Thaw it: whatever it reports for its old lease is fenced off.
    a.signal(nix::sys::signal::Signal::SIGCONT);
    let mut queue = QueueServiceClient::new(server.channel().await);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let body = queue
            .get_metrics(GetMetricsRequest::default())
            .await
            .expect("GetMetrics")
            .into_inner()
            .body;
        let rejected = body
            .lines()
            .find_map(|l| l.strip_prefix("agq_fencing_rejections_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        if rejected >= 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the thawed worker's report was never rejected"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = c.job(&job_id).await;
    assert_eq!(
        (after.status, after.worker_id.as_str(), after.attempt),
        (JobStatus::Completed as i32, "w-thawed-peer", 2),
        "the outcome is recorded once"
    );
}

/// A lease lost while its worker could not hear of it: the worker is
/// frozen and the server restarts (no stream is open to carry a cancel),
/// the lease returns to pending after the grace and the job moves to
/// another worker. Thawed, the first worker reconnects with the old lease
/// among its held leases; the server answers that it is revoked, and agw
/// kills that attempt's processes, leaving the new attempt alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_while_away_is_killed_when_the_worker_comes_back() {
    let dir = test_dir();
    let mut server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan("revoked", vec![writes_pid_then_sleeps(1)]).await;
    let a = Agw::start(&server, "w-revoked", &["--max-concurrent-jobs", "1"]).await;
    let job_id = c.submit("revoked", &[], 3).await;
    c.wait_job(&job_id, "running on w-revoked", |j| {
        j.status == JobStatus::Running as i32 && j.worker_id == "w-revoked"
    })
    .await;
    let old = read_pid(&a.task_file("task.pid").await).await;
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    server.kill();
    server.restart();
    let mut c = Clients::new(&server).await;
    let b = Agw::start(&server, "w-revoked-peer", &["--max-concurrent-jobs", "1"]).await;
    c.wait_job(&job_id, "running on the peer", |j| {
        j.status == JobStatus::Running as i32 && j.worker_id == "w-revoked-peer"
    })
    .await;
    let new = read_pid(&b.task_file("task.pid").await).await;
    assert!(!is_dead(old), "the frozen worker's task runs on meanwhile");
    a.signal(nix::sys::signal::Signal::SIGCONT);
    let deadline = Instant::now() + WAIT;
    while !is_dead(old) || !a.proc.log().contains("lease revoked while disconnected") {
        assert!(
            Instant::now() < deadline,
            "the revoked attempt's process {old} was not killed on the server's word (dead: {}); agw log:\n{}",
            is_dead(old),
            a.proc.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let job = c.job(&job_id).await;
    assert_eq!(
        (job.status, job.worker_id.as_str(), job.attempt),
        (JobStatus::Running as i32, "w-revoked-peer", 2),
        "the new attempt is untouched"
    );
    assert!(!is_dead(new), "the new attempt's process runs on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_job_finishes_the_job_unregisters_and_exits_0() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan(
        "short",
        vec![
            task(1, "sleep", &["2"], 60, None),
            task(2, "echo", &["finished"], 60, None),
        ],
    )
    .await;
    let mut agw = Agw::start(&server, "w-term", &["--max-concurrent-jobs", "2"]).await;
    let job_id = c.submit("short", &[], 1).await;
    c.wait_job(&job_id, "running", |j| {
        j.status == JobStatus::Running as i32
    })
    .await;
    agw.signal(nix::sys::signal::Signal::SIGTERM);
    // While draining, the worker takes no new job although it has a slot.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = c.submit("short", &[], 1).await;
    let code = agw.wait_exit().await;
    assert_eq!(code, Some(0));
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.worker_id, "w-term");
    assert_eq!(job.task_results[1].stdout, "finished\n");
    assert_eq!(c.worker_state("w-term").await, WorkerState::Unregistered);
    let second = c.job(&second).await;
    assert_eq!(second.status, JobStatus::Pending as i32, "{second:#?}");
    assert_eq!(second.attempt, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agw_reconnects_after_a_server_restart_and_takes_new_work() {
    let dir = test_dir();
    let mut server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan("hello", vec![task(1, "echo", &["hello {{who}}"], 30, None)])
        .await;
    let mut agw = Agw::start(&server, "w-restart", &[]).await;
    let first = c.submit("hello", &[("who", "before")], 1).await;
    c.wait_status(&first, JobStatus::Completed).await;

    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart();
    agw.wait_registered().await;

    let mut c = Clients::new(&server).await;
    let second = c.submit("hello", &[("who", "after")], 1).await;
    let job = c.wait_status(&second, JobStatus::Completed).await;
    assert_eq!(job.worker_id, "w-restart");
    assert_eq!(job.task_results[0].stdout, "hello after\n");
    assert_eq!(c.worker_state("w-restart").await, WorkerState::Active);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_run_concurrently_up_to_max_concurrent_jobs() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan("nap", vec![task(1, "sleep", &["30"], 60, None)])
        .await;
    let _agw = Agw::start(&server, "w-conc", &["--max-concurrent-jobs", "3"]).await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(c.submit("nap", &[], 1).await);
    }
    // Three 30-second jobs run at the same time on three slots...
    let deadline = Instant::now() + WAIT;
    let running = loop {
        let mut running = Vec::new();
        for id in &ids {
            if c.job(id).await.status == JobStatus::Running as i32 {
                running.push(id.clone());
            }
        }
        if running.len() >= 3 || Instant::now() > deadline {
            break running;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if running.len() != 3 {
        let mut seen = Vec::new();
        for id in &ids {
            let j = c.job(id).await;
            seen.push((j.status, j.attempt, j.worker_id, j.error, j.waiting_reason));
        }
        panic!("running at once: {running:?}; jobs (status, attempt, worker, error, waiting): {seen:?}");
    }
    // ...and the fourth waits for a free slot.
    let fourth = ids.iter().find(|id| !running.contains(id)).unwrap();
    assert_eq!(c.job(fourth).await.status, JobStatus::Pending as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_kills_jobs_at_the_drain_timeout_and_still_exits_0() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan("stuck", vec![writes_pid_then_sleeps(1)]).await;
    let mut agw = Agw::start(&server, "w-drain", &["--drain-timeout-secs", "1"]).await;
    let job_id = c.submit("stuck", &[], 1).await;
    c.wait_job(&job_id, "running", |j| {
        j.status == JobStatus::Running as i32
    })
    .await;
    let pid = read_pid(&agw.task_file("task.pid").await).await;
    let start = Instant::now();
    agw.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(agw.wait_exit().await, Some(0));
    assert!(start.elapsed() < Duration::from_secs(5));
    wait_dead(pid).await;
    let job = c.wait_status(&job_id, JobStatus::Dead).await;
    assert!(
        job.error.contains("killed: drain timeout of 1 s exceeded"),
        "{}",
        job.error
    );
    assert_eq!(c.worker_state("w-drain").await, WorkerState::Unregistered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_keeps_a_finished_jobs_result_until_the_server_takes_it() {
    // The job ends while the server is down, within the drain timeout
    // (its 1 s task starts before the SIGTERM; the timeout, 3 s, leaves it
    // room on a loaded machine); agw, draining, keeps its result past the
    // drain timeout and the kill grace (3 s + 10 s), and exits only once
    // the returning server has it.
    let dir = test_dir();
    let mut server = Server::start_with(dir.path().join("agq.db"), "127.0.0.1:0", 2000, 60_000);
    let mut c = Clients::new(&server).await;
    c.plan(
        "brief",
        vec![
            task(1, "sleep", &["1"], 60, None),
            task(2, "echo", &["kept"], 60, None),
        ],
    )
    .await;
    let mut agw = Agw::start(&server, "w-keeps", &["--drain-timeout-secs", "3"]).await;
    let job_id = c.submit("brief", &[], 1).await;
    c.wait_job(&job_id, "running", |j| {
        j.status == JobStatus::Running as i32
    })
    .await;
    server.kill();
    agw.signal(nix::sys::signal::Signal::SIGTERM);
    // Past the drain timeout and the grace for killed jobs' reports.
    let deadline = Instant::now() + Duration::from_secs(14);
    while Instant::now() < deadline {
        assert!(
            agw.proc.try_wait().is_none(),
            "agw exited with the job's result unreported"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.restart();
    assert_eq!(agw.wait_exit().await, Some(0));
    let mut c = Clients::new(&server).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.attempt, 1, "the job was re-run: {job:#?}");
    assert_eq!(job.task_results[1].stdout, "kept\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once_with_130_and_kills_the_tasks() {
    let dir = test_dir();
    let server = Server::start(dir.path());
    let mut c = Clients::new(&server).await;
    c.plan("stuck", vec![writes_pid_then_sleeps(1)]).await;
    let mut agw = Agw::start(&server, "w-twice", &[]).await;
    let job_id = c.submit("stuck", &[], 2).await;
    let pid = read_pid(&agw.task_file("task.pid").await).await;
    agw.signal(nix::sys::signal::Signal::SIGINT);
    tokio::time::sleep(Duration::from_millis(300)).await;
    agw.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(agw.wait_exit().await, Some(130));
    wait_dead(pid).await;
    // It did not unregister: the server re-queues the job after the grace.
    assert_ne!(c.worker_state("w-twice").await, WorkerState::Unregistered);
    c.wait_job(&job_id, "re-queued", |j| {
        j.status != JobStatus::Running as i32
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_job_survives_a_server_restart() {
    // A 2 s heartbeat interval and a 5 s grace: the worker is back long
    // before the server could give up on it, so it keeps its lease.
    let dir = test_dir();
    let mut server = Server::start_with(dir.path().join("agq.db"), "127.0.0.1:0", 2000, 5000);
    let mut c = Clients::new(&server).await;
    c.plan(
        "steady",
        vec![
            task(1, "sleep", &["3"], 60, None),
            task(2, "echo", &["survived"], 60, None),
        ],
    )
    .await;
    let mut agw = Agw::start(&server, "w-steady", &[]).await;
    let job_id = c.submit("steady", &[], 1).await;
    c.wait_job(&job_id, "running", |j| {
        j.status == JobStatus::Running as i32
    })
    .await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    agw.wait_registered().await;
    let mut c = Clients::new(&server).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.attempt, 1, "the job was re-run: {job:#?}");
    assert_eq!(job.task_results[1].stdout, "survived\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_authenticates_every_call_and_stays_out_of_task_env() {
    use tonic::{metadata::MetadataValue, Request};
    let dir = test_dir();
    let auth = dir.path().join("auth.toml");
    std::fs::write(
        &auth,
        r#"
[[tokens]]
token = "admin-token-0123456789"
role = "admin"

[[tokens]]
token = "worker-token-0123456789"
role = "worker"
worker_id = "w-auth"
"#,
    )
    .unwrap();
    let server = Server::try_start_with(
        dir.path().join("agq.db"),
        "127.0.0.1:0",
        200,
        500,
        vec!["--auth-file".into(), auth.to_str().unwrap().into()],
    )
    .expect("agq with auth");

    // A wrong token: the first registration is refused for good, exit 1.
    let mut bad = Agw::spawn(
        &server,
        "w-auth",
        &[],
        &[("AGW_TOKEN", "wrong-token-0123456789")],
    );
    assert_eq!(bad.wait_exit().await, Some(1));

    let mut agw = Agw::spawn(
        &server,
        "w-auth",
        &[],
        &[("AGW_TOKEN", "worker-token-0123456789")],
    );
    agw.wait_registered().await;

    let ch = server.channel().await;
    let bearer: MetadataValue<_> = "Bearer admin-token-0123456789".parse().unwrap();
    let add = move |mut r: Request<()>| {
        r.metadata_mut().insert("authorization", bearer.clone());
        Ok(r)
    };
    let mut plans = PlanServiceClient::with_interceptor(ch.clone(), add.clone());
    let mut actions = ActionServiceClient::with_interceptor(ch.clone(), add.clone());
    let mut jobs = JobServiceClient::with_interceptor(ch, add);
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(Plan {
                plan_id: "env".into(),
                plan_description: "print the task environment".into(),
                tasks: vec![task(1, "sh", &["-c", "export -p"], 30, None)],
                ..Default::default()
            }),
            replace: false,
        })
        .await
        .expect("SubmitPlan");
    let job_id = actions
        .submit_action(SubmitActionRequest {
            plan_id: "env".into(),
            inputs: vec![ActionInput::default()],
            max_attempts: 1,
            ..Default::default()
        })
        .await
        .expect("SubmitAction")
        .into_inner()
        .job_ids
        .remove(0);
    let deadline = Instant::now() + WAIT;
    let job = loop {
        let job = jobs
            .get_job(GetJobRequest {
                job_id: job_id.clone(),
            })
            .await
            .expect("GetJob")
            .into_inner()
            .job
            .expect("job");
        if job.status == JobStatus::Completed as i32 {
            break job;
        }
        assert!(Instant::now() < deadline, "job never completed: {job:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let env = &job.task_results[0].stdout;
    assert!(env.contains("PATH="), "{env}");
    assert!(!env.contains("worker-token"), "the token leaked: {env}");
    assert!(!env.contains("AGW_"), "{env}");
}

/// Makes a CA and a server certificate for `agq.test` with the openssl
/// CLI; `None` when openssl is not installed.
fn make_certs(dir: &Path) -> Option<()> {
    let run = |args: &[&str]| {
        Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    if !run(&["version"]) {
        return None;
    }
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:agq.test\nbasicConstraints=CA:FALSE\n\
         keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    assert!(run(&[
        &["req", "-x509"][..],
        &ec,
        &[
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "1",
            "-subj",
            "/CN=agw-test-ca"
        ],
    ]
    .concat()));
    assert!(run(&[
        &["req"][..],
        &ec,
        &[
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=agq.test"
        ],
    ]
    .concat()));
    assert!(run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    ]));
    Some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agw_talks_tls_to_the_server() {
    use tonic::transport::{Certificate, ClientTlsConfig};
    let dir = test_dir();
    if make_certs(dir.path()).is_none() {
        eprintln!("openssl not installed: skipping the TLS test");
        return;
    }
    let p = |f: &str| dir.path().join(f).to_str().unwrap().to_owned();
    let mut server = Server::try_start_with(
        dir.path().join("agq.db"),
        "127.0.0.1:0",
        200,
        500,
        vec![
            "--tls-cert".into(),
            p("server.pem"),
            "--tls-key".into(),
            p("server.key"),
        ],
    )
    .expect("agq with TLS");
    let url = format!("https://{}", server.addr);
    let ca = p("ca.pem");
    let mut agw = Agw::spawn(
        &server,
        "w-tls",
        &[
            "--server",
            &url,
            "--tls-ca",
            &ca,
            "--tls-domain",
            "agq.test",
        ],
        &[],
    );
    agw.wait_registered().await;

    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&ca).unwrap()))
        .domain_name("agq.test");
    let ch = Channel::from_shared(url)
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("TLS connect");
    let mut c = Clients {
        plans: PlanServiceClient::new(ch.clone()),
        actions: ActionServiceClient::new(ch.clone()),
        jobs: JobServiceClient::new(ch.clone()),
        workers: WorkerServiceClient::new(ch),
    };
    c.plan("tls", vec![task(1, "echo", &["over tls"], 30, None)])
        .await;
    let job_id = c.submit("tls", &[], 1).await;
    let job = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(job.task_results[0].stdout, "over tls\n");
    server.kill();
}

/// Runs `agw` with id `id` and waits (bounded) for it to exit; returns
/// its exit code and what it wrote on stderr.
async fn agw_exit(server: &Server, id: &str) -> (Option<i32>, String) {
    let mut agw = process::Agw::new(&server.url(), id)
        .args(["--tools", TOOLS])
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn();
    let status = agw.wait_exit_async(WAIT).await;
    let err = agw.log();
    (status.code(), err)
}

/// Issue 14: one live process per worker id. A second `agw` with the id of
/// a live one exits non-zero with a message saying so, and the first one's
/// burst of 4-second jobs all complete exactly once (side effect counted on
/// disk, every job on its first attempt). After the first dies (kill -9),
/// a new `agw` with the same id takes over: the job it was running is run
/// again by the new process and its side effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agw_with_a_live_id_exits_and_a_restart_after_kill_9_takes_over() {
    let dir = test_dir();
    // A 1 s heartbeat (stale after 3 s): a loaded machine must not make
    // the first worker stale, which would re-run its jobs for another
    // reason than the one under test.
    let server = Server::start_with(dir.path().join("agq.db"), "127.0.0.1:0", 1000, 5000);
    let mut c = Clients::new(&server).await;
    let log = side_effect_log(dir.path());
    let flags = ["--max-concurrent-jobs", "8", "--insecure-no-sandbox"];
    c.plan("slow-once", runs_once(4)).await;
    let mut first = Agw::start(&server, "dup", &flags).await;
    let inputs: Vec<ActionInput> = (0..8)
        .map(|i| ActionInput {
            values: HashMap::from([
                ("tag".to_owned(), format!("j{i}")),
                ("log".to_owned(), log.to_str().unwrap().to_owned()),
            ]),
        })
        .collect();
    let burst = c
        .actions
        .submit_action(SubmitActionRequest {
            action_id: String::new(),
            plan_id: "slow-once".into(),
            inputs,
            run_at: None,
            max_attempts: 3,
            ..Default::default()
        })
        .await
        .expect("SubmitAction")
        .into_inner();
    c.wait_job(&burst.job_ids[0], "running", |j| {
        j.status == JobStatus::Running as i32
    })
    .await;

    // A second process with the same id, while the first runs the burst.
    let (code, err) = agw_exit(&server, "dup").await;
    assert_eq!(code, Some(1), "stderr: {err}");
    assert!(
        err.contains("worker id dup is taken by another live agw process"),
        "stderr: {err}"
    );

    for id in &burst.job_ids {
        let j = c.wait_status(id, JobStatus::Completed).await;
        assert_eq!(j.attempt, 1, "job {id} ran more than once: {j:?}");
    }
    let mut lines: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    let want: Vec<String> = (0..8).map(|i| format!("ran j{i}")).collect();
    assert_eq!(lines, want, "each side effect exactly once");

    // The first process dies mid-job; a new one with the id takes over.
    let job_id = c
        .submit(
            "slow-once",
            &[("tag", "after"), ("log", log.to_str().unwrap())],
            3,
        )
        .await;
    c.wait_job(&job_id, "running on dup", |j| {
        j.status == JobStatus::Running as i32 && j.worker_id == "dup"
    })
    .await;
    first.signal(nix::sys::signal::Signal::SIGKILL);
    first.wait_exit().await;
    // The server notices the dead process's streams close.
    let deadline = Instant::now() + WAIT;
    loop {
        let w = c
            .workers
            .get_worker(GetWorkerRequest {
                worker_id: "dup".into(),
            })
            .await
            .expect("GetWorker")
            .into_inner()
            .worker
            .expect("worker");
        if !w.connected {
            break;
        }
        assert!(Instant::now() < deadline, "the server never saw dup go");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _second = Agw::start(&server, "dup", &flags).await;
    let j = c.wait_status(&job_id, JobStatus::Completed).await;
    assert_eq!(j.attempt, 2, "{j:?}");
    assert_eq!(c.worker_state("dup").await, WorkerState::Active);
    // Give a zombie run every chance to show up, then count.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        text.lines().filter(|l| *l == "ran after").count(),
        1,
        "{text}"
    );
}

/// Issue 14: agw's warnings tell the truth. In a normal run of many short
/// jobs on two slots (the server frees a slot when it commits a report and
/// may send the next lease before agw has the reply), agw logs neither
/// "more leases than slots" nor "result dropped".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_normal_run_logs_no_false_warnings() {
    let dir = test_dir();
    let server = Server::start_with(dir.path().join("agq.db"), "127.0.0.1:0", 1000, 5000);
    let mut c = Clients::new(&server).await;
    c.plan("quick", vec![task(1, "echo", &["hi {{n}}"], 30, None)])
        .await;
    let mut agw = process::Agw::new(&server.url(), "honest")
        .args(["--tools", TOOLS, "--max-concurrent-jobs", "2"])
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn();
    let inputs: Vec<ActionInput> = (0..80)
        .map(|i| ActionInput {
            values: HashMap::from([("n".to_owned(), i.to_string())]),
        })
        .collect();
    let action = c
        .actions
        .submit_action(SubmitActionRequest {
            action_id: String::new(),
            plan_id: "quick".into(),
            inputs,
            run_at: None,
            max_attempts: 3,
            ..Default::default()
        })
        .await
        .expect("SubmitAction")
        .into_inner();
    for id in &action.job_ids {
        c.wait_status(id, JobStatus::Completed).await;
    }
    agw.signal(nix::sys::signal::Signal::SIGTERM);
    let status = agw.wait_exit_async(WAIT).await;
    assert_eq!(status.code(), Some(0));
    let err = agw.log();
    assert!(!err.contains("more leases than slots"), "{err}");
    assert!(!err.contains("result dropped"), "{err}");
}

/// A job that finished while the server was down counts in its first
/// attempt once the server is back, after an outage longer than the lease
/// grace: the server waits the stale window for the workers it loaded, and
/// agw, holding a job, retries at least once per heartbeat interval. (With
/// the lease grace only and agw's backoff grown to 8 s, the lease was
/// re-queued before agw came back, its result dropped, and the job, on
/// its only attempt, went dead.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_finished_while_the_server_was_down_counts_in_its_first_attempt() {
    let dir = test_dir();
    let mut server =
        Server::try_start_with(dir.path().join("agq.db"), "127.0.0.1:0", 2000, 1000, vec![])
            .expect("agq started");
    let mut c = Clients::new(&server).await;
    c.plan("nap", vec![task(1, "sleep", &["2"], 30, None)])
        .await;
    let _agw = Agw::start(&server, "w-outage", &[]).await;
    let id = c.submit("nap", &[], 1).await;
    c.wait_status(&id, JobStatus::Running).await;
    server.kill();
    // The job ends meanwhile; agw's reconnects back off.
    tokio::time::sleep(Duration::from_secs(8)).await;
    server.restart();
    let mut c = Clients::new(&server).await;
    let job = c
        .wait_job(&id, "the job ends", |j| {
            j.status != JobStatus::Running as i32 && j.status != JobStatus::Pending as i32
        })
        .await;
    assert_eq!(
        (job.status, job.attempt, job.error.as_str()),
        (JobStatus::Completed as i32, 1, ""),
        "{job:#?}"
    );
}

/// A report still over the server's `--max-report-bytes` once its
/// outputs are dropped (the error quotes a long stderr) is sent again
/// with its outcome only, and the job ends at once with its own error; it
/// was retried for good, the job timed out, and a draining agw never
/// exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_too_big_even_without_outputs_still_ends_the_job() {
    let dir = test_dir();
    let server = Server::try_start_with(
        dir.path().join("agq.db"),
        "127.0.0.1:0",
        200,
        500,
        vec!["--max-report-bytes".into(), "1024".into()],
    )
    .expect("agq started");
    let mut c = Clients::new(&server).await;
    c.plan("missing", vec![task(1, "cat", &["{{file}}"], 30, None)])
        .await;
    let _agw = Agw::start(&server, "w-big-report", &[]).await;
    // cat names the missing file in its error: 1.4 KB of stderr.
    let missing = format!("/nonexistent/{}", "a/".repeat(700));
    let id = c.submit("missing", &[("file", &missing)], 1).await;
    let job = c.wait_status(&id, JobStatus::Dead).await;
    assert!(job.error.contains("task 1 (cat)"), "{}", job.error);
    assert!(!job.error.contains("timed out"), "{}", job.error);
}
