//! The task sandbox, end to end: a real `agq serve` and a real `agw` (with
//! the sandbox on, as by default) run a table of escape attempts as a
//! client would submit them. Each attempt must end with its job failed or
//! its side effect absent, checked on the file system, on a loopback
//! listener or in the job's output, and the server and worker must stay
//! healthy throughout. Ordinary pipelines must keep working in the sandbox.
//!
//! The files the attempts aim at are readable and writable by everyone
//! (mode 0666 in 0777/0755 directories), so only the sandbox, not the file
//! permissions, stands between a task and them.

mod process;

use std::{
    collections::HashMap,
    net::{TcpListener, UdpSocket},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use agq::pb::{
    action_service_client::ActionServiceClient, job_service_client::JobServiceClient,
    plan_service_client::PlanServiceClient, worker_service_client::WorkerServiceClient,
    ActionInput, GetJobRequest, GetWorkerRequest, Job, JobStatus, Plan, SubmitActionRequest,
    SubmitPlanRequest, Task,
};
use process::{clean_command, AgqServe, Agw, AgwProc, Serve, AGW};
use tonic::transport::Channel;

/// How long any wait in these tests may take.
const WAIT: Duration = Duration::from_secs(60);

/// The token agw holds; no task may ever see it.
const TOKEN: &str = "agw-secret-token-0123456789abcdef";

/// Tools of the test worker: the default safe set plus the dangerous ones
/// the attempts go through. `sh` and `id` are deliberately not advertised.
const TOOLS: &str = "cat,sort,uniq,tr,head,wc,echo,awk,sed,xargs,tee,date,perl,jq";

// ---------------------------------------------------------------- helpers --

/// Starts `agq serve` on an ephemeral loopback port (killed when
/// dropped); returns it and its URL.
fn start_server(dir: &Path) -> (AgqServe, String) {
    let server = Serve::new(dir.join("agq.db"))
        // Generous: the fork bomb attempt loads the machine for seconds.
        .args(["--heartbeat-interval-ms", "2000"])
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn()
        .unwrap_or_else(|e| panic!("agq did not start: {e:?}"));
    let url = server.url();
    (server, url)
}

/// Starts `agw` with `args` and `env` (killed when dropped); waits for its
/// `agw: registered` line, or returns its exit status and stderr when it
/// exits first.
fn start_agw(url: &str, id: &str, args: &[&str], env: &[(&str, &str)]) -> Result<AgwProc, String> {
    let mut agw = Agw::new(url, id).args(args).env("RUST_LOG", "warn");
    for (k, v) in env {
        agw = agw.env(k, v);
    }
    let mut agw = agw.kill_on_drop().spawn();
    match agw.registered() {
        Ok(_) => Ok(agw),
        Err(e) => Err(format!("{}: {}", e.status.expect("agw exited"), e.log)),
    }
}

/// The generated clients on one channel.
#[derive(Clone)]
struct Clients {
    plans: PlanServiceClient<Channel>,
    actions: ActionServiceClient<Channel>,
    jobs: JobServiceClient<Channel>,
    workers: WorkerServiceClient<Channel>,
}

impl Clients {
    async fn connect(url: &str) -> Clients {
        let ch = Channel::from_shared(url.to_owned())
            .expect("url")
            .connect()
            .await
            .expect("connect");
        Clients {
            plans: PlanServiceClient::new(ch.clone()),
            actions: ActionServiceClient::new(ch.clone()),
            jobs: JobServiceClient::new(ch.clone()),
            workers: WorkerServiceClient::new(ch),
        }
    }

    /// Stores `tasks` as plan `id`.
    async fn plan(&mut self, id: &str, tasks: Vec<Task>, require_sandbox: bool) {
        self.plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(Plan {
                    plan_id: id.to_owned(),
                    plan_description: String::new(),
                    tasks,
                    require_sandbox,
                    ..Default::default()
                }),
                replace: false,
            })
            .await
            .unwrap_or_else(|e| panic!("SubmitPlan {id}: {e}"));
    }

    /// Submits one job of `plan` with `input`, one attempt; returns its id.
    async fn submit(&mut self, plan: &str, input: &[(&str, &str)]) -> String {
        let values: HashMap<String, String> = input
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let r = self
            .actions
            .submit_action(SubmitActionRequest {
                plan_id: plan.to_owned(),
                inputs: vec![ActionInput { values }],
                max_attempts: 1,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("SubmitAction {plan}: {e}"))
            .into_inner();
        r.job_ids[0].clone()
    }

    async fn job(&mut self, id: &str) -> Job {
        self.jobs
            .get_job(GetJobRequest { job_id: id.into() })
            .await
            .expect("GetJob")
            .into_inner()
            .job
            .expect("job")
    }

    /// Waits until the job is completed, failed for good or dead.
    async fn finished(&mut self, id: &str) -> Job {
        let deadline = Instant::now() + WAIT;
        loop {
            let job = self.job(id).await;
            let s = JobStatus::try_from(job.status).unwrap_or(JobStatus::Unspecified);
            if matches!(
                s,
                JobStatus::Completed | JobStatus::Dead | JobStatus::Cancelled
            ) {
                return job;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} did not finish: {job:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn sandboxed(&mut self, worker_id: &str) -> bool {
        self.workers
            .get_worker(GetWorkerRequest {
                worker_id: worker_id.into(),
            })
            .await
            .expect("GetWorker")
            .into_inner()
            .worker
            .expect("worker")
            .sandboxed
    }
}

fn task(n: u32, cmd: &str, args: &[&str], from: Option<u32>) -> Task {
    Task {
        task_number: n,
        command: cmd.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        timeout_secs: 20,
        input_from_task: from,
        ..Default::default()
    }
}

/// Everything a job printed, all tasks, stdout and stderr, plus its error.
fn all_output(job: &Job) -> String {
    let mut s = job.error.clone();
    for r in &job.task_results {
        s.push('\n');
        s.push_str(&r.stdout);
        s.push('\n');
        s.push_str(&r.stderr);
    }
    s
}

fn status(job: &Job) -> JobStatus {
    JobStatus::try_from(job.status).unwrap_or(JobStatus::Unspecified)
}

fn mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The directories and files the attempts aim at.
struct Fixture {
    _dir: tempfile::TempDir,
    /// Exposed with --read-path: input data (`words.txt`, `big.txt`,
    /// `victim.txt`, world-writable).
    data: PathBuf,
    /// Not exposed: `secret.txt`, world-readable.
    secret: PathBuf,
    /// Not exposed, world-writable: where write attempts aim.
    target: PathBuf,
    /// The server's database directory.
    db: PathBuf,
    /// The workers' scratch root.
    scratch: PathBuf,
}

const SECRET: &str = "top-secret-contents-7f3a";
const VICTIM: &str = "victim stays as it is\n";

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    mode(dir.path(), 0o755);
    let data = dir.path().join("data");
    let secret = dir.path().join("secret");
    let target = dir.path().join("target");
    let db = dir.path().join("db");
    let scratch = dir.path().join("scratch");
    for d in [&data, &secret, &target, &db] {
        std::fs::create_dir(d).expect("mkdir");
    }
    mode(&data, 0o777);
    mode(&secret, 0o755);
    mode(&target, 0o777);
    let mut words = String::new();
    for i in 0..400 {
        words.push_str(["the", "quick", "brown", "fox", "the", "lazy", "dog", "the"][i % 8]);
        words.push(if i % 5 == 0 { '\n' } else { ' ' });
    }
    std::fs::write(data.join("words.txt"), &words).expect("write");
    // Enough input for `sort -S 100K` to spill to temporary files.
    let big: String = (0..60_000)
        .map(|i| format!("line {}\n", 60_000 - i))
        .collect();
    std::fs::write(data.join("big.txt"), big).expect("write");
    std::fs::write(data.join("victim.txt"), VICTIM).expect("write");
    mode(&data.join("victim.txt"), 0o666);
    std::fs::write(secret.join("secret.txt"), SECRET).expect("write");
    mode(&secret.join("secret.txt"), 0o644);
    Fixture {
        _dir: dir,
        data,
        secret,
        target,
        db,
        scratch,
    }
}

/// What an attempt must show after its job finished.
enum Expect {
    /// The job must not complete (it failed or died).
    Fails,
    /// Whatever the job's status, this file must not exist.
    NoFile(PathBuf),
    /// Whatever the job's status, its output must not contain this text.
    NotInOutput(String),
    /// `victim.txt` must be unchanged.
    VictimIntact,
    /// The job's error must contain this text: what stopped it (a limit's
    /// signal, say), so that it did not fail for another reason.
    ErrorHolds(String),
    /// Within a few seconds of the job's end no process runs whose command
    /// line starts with this.
    NoProcess(&'static str),
}

/// True while some process's command line starts with `name`.
fn process_named(name: &str) -> bool {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| c.starts_with(name.as_bytes()))
}

/// One escape attempt: a plan, an input, and what must hold afterwards.
struct Attempt {
    name: &'static str,
    tasks: Vec<Task>,
    input: Vec<(&'static str, String)>,
    expect: Vec<Expect>,
}

fn attempt(name: &'static str, tasks: Vec<Task>, expect: Vec<Expect>) -> Attempt {
    Attempt {
        name,
        tasks,
        input: Vec::new(),
        expect,
    }
}

/// A one-task plan `cmd args`.
fn one(cmd: &str, args: &[&str]) -> Vec<Task> {
    vec![task(1, cmd, args, None)]
}

/// `echo LINE` piped into `cmd args`.
fn piped(line: &str, cmd: &str, args: &[&str]) -> Vec<Task> {
    vec![task(1, "echo", &[line], None), task(2, cmd, args, Some(1))]
}

// ------------------------------------------------------------------ tests --

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escape_attempts_fail_and_ordinary_pipelines_work() {
    let f = fixture();
    let (_server, url) = start_server(&f.db);
    let data = f.data.to_str().expect("utf-8").to_owned();
    let scratch = f.scratch.to_str().expect("utf-8").to_owned();
    // A descriptor agw inherits (as from a service manager or a wrapper
    // script): the secret, which no task may read through it.
    let inherited = std::fs::File::open(f.secret.join("secret.txt")).expect("open the secret");
    nix::fcntl::fcntl(
        &inherited,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )
    .expect("let children inherit it");
    let agw = start_agw(
        &url,
        "sandboxed-1",
        &[
            "--tools",
            TOOLS,
            "--read-path",
            &data,
            "--scratch-dir",
            &scratch,
            "--max-concurrent-jobs",
            "2",
            "--max-processes",
            "32",
            "--max-file-size-mb",
            "1",
            "--max-address-space-mb",
            "1024",
            "--max-cpu-secs",
            "2",
            "--max-open-files",
            "64",
        ],
        &[("AGW_TOKEN", TOKEN)],
    )
    .expect("agw starts with the sandbox on this kernel");
    let agw_pid = agw.pid().to_string();
    let mut c = Clients::connect(&url).await;
    assert!(
        c.sandboxed("sandboxed-1").await,
        "GetWorker shows sandboxed"
    );

    // Loopback listeners the network attempts aim at; nothing may arrive.
    let tcp = TcpListener::bind("127.0.0.1:0").expect("tcp listener");
    tcp.set_nonblocking(true).expect("nonblocking");
    let tcp_port = tcp.local_addr().expect("addr").port().to_string();
    let udp = UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    udp.set_nonblocking(true).expect("nonblocking");
    let udp_port = udp.local_addr().expect("addr").port().to_string();
    // A named UNIX socket everyone may connect to (as a system bus is).
    let unix_path = f.target.join("unix.sock");
    let unix = std::os::unix::net::UnixListener::bind(&unix_path).expect("unix listener");
    unix.set_nonblocking(true).expect("nonblocking");
    mode(&unix_path, 0o666);
    let unix_path = unix_path.to_str().expect("utf-8").to_owned();

    let t = |name: &str| f.target.join(name);
    let t_str = |name: &str| t(name).to_str().expect("utf-8").to_owned();
    let words = format!("{data}/words.txt");
    let big = format!("{data}/big.txt");
    let victim = format!("{data}/victim.txt");
    let secret = f
        .secret
        .join("secret.txt")
        .to_str()
        .expect("utf-8")
        .to_owned();
    let environ = format!("/proc/{agw_pid}/environ");
    let uid_marker = || Expect::NotInOutput("uid=".into());

    let attempts: Vec<Attempt> =
        vec![
        // --- execute: only the advertised tools may start -----------------
        attempt(
            "awk system()",
            one("awk", &["BEGIN{system(\"id\")}"]),
            vec![uid_marker()],
        ),
        attempt(
            "awk command | getline",
            one("awk", &["BEGIN{\"id\" | getline x; print x}"]),
            vec![uid_marker()],
        ),
        attempt(
            "awk print | command",
            one("awk", &["BEGIN{print \"id\" | \"sh\"}"]),
            vec![uid_marker()],
        ),
        attempt(
            "sed 1e",
            one("sed", &["-n", "1e id", &words]),
            vec![uid_marker()],
        ),
        attempt(
            "sed s///e",
            one("sed", &["s/.*/id/e", &words]),
            vec![uid_marker()],
        ),
        attempt(
            "xargs sh -c id",
            piped("x", "xargs", &["sh", "-c", "id"]),
            vec![uid_marker(), Expect::Fails],
        ),
        attempt(
            "xargs /usr/bin/id",
            // A blank line: xargs runs the command once, without arguments.
            piped("", "xargs", &["/usr/bin/id"]),
            vec![uid_marker(), Expect::Fails],
        ),
        attempt(
            // gzip would work as a compressor: only the sandbox stops it.
            "sort --compress-program=gzip",
            one(
                "sort",
                &["--compress-program=gzip", "-S", "100K", "-T", ".", &big],
            ),
            vec![Expect::Fails],
        ),
        attempt(
            "sort --compress-program",
            one(
                "sort",
                &["--compress-program=sh", "-S", "100K", "-T", ".", &big],
            ),
            vec![Expect::Fails],
        ),
        attempt(
            "perl exec /bin/sh",
            one("perl", &["-e", "exec '/bin/sh', '-c', 'id'; exit 7"]),
            vec![uid_marker(), Expect::Fails],
        ),
        attempt(
            "a binary copied into scratch",
            one(
                "perl",
                &[
                    "-e",
                    "open my $i, '<', '/usr/bin/id' or die; binmode $i; local $/; my $b = <$i>; \
                     open my $o, '>', 'myid' or die; binmode $o; print $o $b; close $o; \
                     chmod 0755, 'myid'; exec './myid'; exit 7",
                ],
            ),
            vec![uid_marker(), Expect::Fails],
        ),
        // --- write: only the job's scratch directory ------------------------
        attempt(
            "tee FILE",
            piped("pwned", "tee", &[&t_str("tee")]),
            vec![Expect::NoFile(t("tee"))],
        ),
        attempt(
            "sed -i",
            one("sed", &["-i", "s/victim/PWNED/", &victim]),
            vec![Expect::VictimIntact],
        ),
        attempt(
            "sed w FILE",
            one("sed", &["-n", &format!("w {}", t_str("sed-w")), &words]),
            vec![Expect::NoFile(t("sed-w"))],
        ),
        attempt(
            "sort -o",
            one("sort", &["-o", &t_str("sort-o"), &words]),
            vec![Expect::NoFile(t("sort-o"))],
        ),
        attempt(
            "uniq IN OUT",
            one("uniq", &[&words, &t_str("uniq-out")]),
            vec![Expect::NoFile(t("uniq-out"))],
        ),
        attempt(
            "awk print > FILE",
            one(
                "awk",
                &[&format!("{{print > \"{}\"}}", t_str("awk-out")), &words],
            ),
            vec![Expect::NoFile(t("awk-out"))],
        ),
        attempt(
            "perl open > FILE",
            one(
                "perl",
                &["-e", &format!("open F, '>', '{}' or die $!", t_str("perl-out"))],
            ),
            vec![Expect::NoFile(t("perl-out")), Expect::Fails],
        ),
        attempt(
            "perl truncate a readable file",
            one(
                "perl",
                &["-e", &format!("truncate '{victim}', 0 or die $!")],
            ),
            vec![Expect::VictimIntact, Expect::Fails],
        ),
        attempt(
            "perl unlink a readable file",
            one("perl", &["-e", &format!("unlink '{victim}' or die $!")]),
            vec![Expect::VictimIntact, Expect::Fails],
        ),
        attempt(
            "perl mkdir",
            one(
                "perl",
                &["-e", &format!("mkdir '{}' or die $!", t_str("dir"))],
            ),
            vec![Expect::NoFile(t("dir")), Expect::Fails],
        ),
        attempt(
            "perl symlink",
            one(
                "perl",
                &[
                    "-e",
                    &format!("symlink '/etc/passwd', '{}' or die $!", t_str("link")),
                ],
            ),
            vec![Expect::NoFile(t("link")), Expect::Fails],
        ),
        attempt(
            "tee into /tmp",
            piped("pwned", "tee", &["/tmp/agq-sandbox-test-escape"]),
            vec![Expect::NoFile(PathBuf::from("/tmp/agq-sandbox-test-escape"))],
        ),
        // --- read: only the read paths and the scratch directory ----------
        attempt(
            "cat a file outside the read paths",
            one("cat", &[&secret]),
            vec![Expect::NotInOutput(SECRET.into()), Expect::Fails],
        ),
        attempt(
            "date -f FILE",
            one("date", &["-f", &secret]),
            vec![Expect::NotInOutput(SECRET.into())],
        ),
        attempt(
            "sort a file outside the read paths",
            one("sort", &[&secret]),
            vec![Expect::NotInOutput(SECRET.into()), Expect::Fails],
        ),
        attempt(
            "cat /etc/shadow",
            one("cat", &["/etc/shadow"]),
            vec![Expect::NotInOutput("root:".into()), Expect::Fails],
        ),
        attempt(
            "cat /proc/<agw pid>/environ",
            one("cat", &[&environ]),
            vec![Expect::NotInOutput(TOKEN.into()), Expect::Fails],
        ),
        attempt(
            "perl reads its parent's environ",
            one(
                "perl",
                &[
                    "-e",
                    "open F, '<', '/proc/' . getppid() . '/environ' or die $!; print <F>",
                ],
            ),
            vec![Expect::NotInOutput(TOKEN.into()), Expect::Fails],
        ),
        attempt(
            "jq $ENV",
            one("jq", &["-n", "$ENV"]),
            vec![
                Expect::NotInOutput(TOKEN.into()),
                Expect::NotInOutput("AGW_".into()),
            ],
        ),
        attempt(
            "perl %ENV",
            one("perl", &["-e", "print join qq(\\n), %ENV"]),
            vec![
                Expect::NotInOutput(TOKEN.into()),
                Expect::NotInOutput("AGW_".into()),
            ],
        ),
        // --- network: none ------------------------------------------------
        attempt(
            "perl TCP connect to a loopback listener",
            one(
                "perl",
                &[
                    "-MIO::Socket::INET",
                    "-e",
                    &format!(
                        "IO::Socket::INET->new(PeerAddr => '127.0.0.1:{tcp_port}', \
                         Proto => 'tcp') or die $!; print 'connected'"
                    ),
                ],
            ),
            vec![Expect::Fails, Expect::NotInOutput("connected".into())],
        ),
        attempt(
            "perl UDP send to a loopback socket",
            one(
                "perl",
                &[
                    "-MIO::Socket::INET",
                    "-e",
                    &format!(
                        "my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1:{udp_port}', \
                         Proto => 'udp') or die $!; $s->send('leak') or die $!; print 'sent'"
                    ),
                ],
            ),
            vec![Expect::Fails, Expect::NotInOutput("sent".into())],
        ),
        attempt(
            "perl TCP listen",
            one(
                "perl",
                &[
                    "-MIO::Socket::INET",
                    "-e",
                    "IO::Socket::INET->new(LocalAddr => '127.0.0.1:0', Listen => 1) \
                     or die $!; print 'listening'",
                ],
            ),
            vec![Expect::Fails, Expect::NotInOutput("listening".into())],
        ),
        attempt(
            "perl connects to a named UNIX socket",
            one(
                "perl",
                &[
                    "-MIO::Socket::UNIX",
                    "-e",
                    &format!(
                        "IO::Socket::UNIX->new(Peer => '{unix_path}') or die $!; print 'connected'"
                    ),
                ],
            ),
            vec![Expect::Fails, Expect::NotInOutput("connected".into())],
        ),
        attempt(
            "perl opens a socket through the x32 system call numbers",
            one(
                "perl",
                &[
                    "-e",
                    "my $r = syscall(0x40000000 + 41, 2, 2, 0); \
                     print $r >= 0 ? 'x32-socket-open' : \"refused: $!\"",
                ],
            ),
            vec![Expect::NotInOutput("x32-socket-open".into())],
        ),
        // --- descriptors: only standard input, output and error -----------
        attempt(
            "perl reads a descriptor agw inherited",
            one(
                "perl",
                &[
                    "-e",
                    "for my $fd (3..255) { open(my $f, '<&=', $fd) or next; local $/; \
                     my $c = <$f>; print \"fd $fd: $c\\n\" if defined $c }",
                ],
            ),
            vec![Expect::NotInOutput(SECRET.into())],
        ),
        attempt(
            "perl writes its standard input, which a later task reads",
            vec![
                task(1, "echo", &["original-input"], None),
                task(
                    2,
                    "perl",
                    &[
                        "-e",
                        "open(my $o, '>&=', 0) or die \"dup: $!\"; \
                         defined syswrite($o, 'TAMPERED') or die \"write: $!\"",
                    ],
                    Some(1),
                ),
                task(3, "cat", &[], Some(1)),
            ],
            vec![Expect::NotInOutput("TAMPERED".into())],
        ),
        // --- processes: none outlives its job -----------------------------
        attempt(
            "perl forks a daemon in a session of its own",
            one(
                "perl",
                &[
                    "-MPOSIX",
                    "-e",
                    "my $p = fork // die $!; if ($p == 0) { POSIX::setsid(); \
                     $0 = 'agq-escaped-daemon'; sleep 300; exit 0 } print \"forked\\n\"",
                ],
            ),
            vec![Expect::NoProcess("agq-escaped-daemon")],
        ),
        // --- signals and resources ----------------------------------------
        attempt(
            "perl kills agw",
            one("perl", &["-e", "kill 'KILL', getppid() or die $!"]),
            vec![Expect::Fails],
        ),
        attempt(
            "fork bomb",
            vec![Task {
                timeout_secs: 3,
                ..task(1, "perl", &["-e", "fork while 1"], None)
            }],
            vec![Expect::Fails],
        ),
        attempt(
            "a file over the size limit",
            one(
                "perl",
                &[
                    "-e",
                    "open F, '>', 'big' or die; print F 'x' x 2_000_000 or die $!; \
                     close F or die $!",
                ],
            ),
            vec![Expect::Fails, Expect::ErrorHolds("SIGXFSZ".into())],
        ),
        attempt(
            "memory over the address-space limit",
            one(
                "perl",
                &["-e", "my $x = 'x' x 2_000_000_000; print length $x"],
            ),
            vec![Expect::Fails, Expect::NotInOutput("2000000000".into())],
        ),
        attempt(
            "endless output piped to a later task (agw keeps it on disk)",
            // The task's own timeout (20 s) is far off: the file size
            // limit holds the output agw keeps for task 2 too.
            vec![
                task(1, "perl", &["-e", "print 'x' x 65536 while 1"], None),
                task(2, "wc", &["-c"], Some(1)),
            ],
            vec![
                Expect::Fails,
                Expect::ErrorHolds("more than the file size limit of 1 MiB".into()),
            ],
        ),
        attempt(
            "more open descriptors than the limit",
            one(
                "perl",
                &[
                    "-e",
                    "my @f; for (1..100) { open(my $h, '<', '/dev/null') or die \"open: $!\"; \
                     push @f, $h } print 'opened all'",
                ],
            ),
            vec![
                Expect::Fails,
                Expect::NotInOutput("opened all".into()),
                Expect::ErrorHolds("Too many open files".into()),
            ],
        ),
        attempt(
            "a CPU loop over the CPU-time limit",
            // The task's own timeout (20 s) is far off: the limit stops it.
            one("perl", &["-e", "1 while 1"]),
            vec![Expect::Fails, Expect::ErrorHolds("SIGXCPU".into())],
        ),
    ];
    // Input values are data, not options.
    let mut attempts = attempts;
    attempts.push(Attempt {
        name: "input value -o/FILE given to a vetted `sort {{file}}`",
        tasks: one("sort", &["{{file}}"]),
        input: vec![("file", format!("-o{}", t_str("opt-out")))],
        expect: vec![Expect::NoFile(t("opt-out")), Expect::Fails],
    });
    attempts.push(Attempt {
        name: "input value --compress-program=sh",
        tasks: one("sort", &["-S", "100K", "{{opt}}", &big]),
        input: vec![("opt", "--compress-program=sh".into())],
        expect: vec![Expect::Fails],
    });
    assert!(attempts.len() >= 30, "{} attempts", attempts.len());

    let mut failures = Vec::new();
    for (i, a) in attempts.iter().enumerate() {
        let plan_id = format!("escape-{i}");
        c.plan(&plan_id, a.tasks.clone(), false).await;
        let input: Vec<(&str, &str)> = a.input.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let job_id = c.submit(&plan_id, &input).await;
        let job = c.finished(&job_id).await;
        let out = all_output(&job);
        for e in &a.expect {
            let broken = match e {
                Expect::Fails => {
                    (status(&job) == JobStatus::Completed).then(|| "the job completed".to_owned())
                }
                Expect::NoFile(p) => p
                    .symlink_metadata()
                    .is_ok()
                    .then(|| format!("{} exists", p.display())),
                Expect::NotInOutput(s) => out
                    .contains(s.as_str())
                    .then(|| format!("its output holds {s:?}")),
                Expect::VictimIntact => (std::fs::read_to_string(&victim).ok().as_deref()
                    != Some(VICTIM))
                .then(|| "victim.txt changed".to_owned()),
                Expect::ErrorHolds(s) => (!job.error.contains(s.as_str()))
                    .then(|| format!("its error does not name {s:?}")),
                Expect::NoProcess(name) => {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while process_named(name) && Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    process_named(name).then(|| format!("{name} still runs"))
                }
            };
            if let Some(why) = broken {
                failures.push(format!("{}: {why}\n{out}", a.name));
            }
        }
    }
    let _ = std::fs::remove_file("/tmp/agq-sandbox-test-escape");
    let mut buf = [0u8; 16];
    if tcp.accept().is_ok() {
        failures.push("a task connected to the loopback TCP listener".into());
    }
    if udp.recv_from(&mut buf).is_ok() {
        failures.push("a task sent a datagram to the loopback UDP socket".into());
    }
    if unix.accept().is_ok() {
        failures.push("a task connected to the named UNIX socket".into());
    }
    drop(inherited);
    assert!(
        failures.is_empty(),
        "{} of {} escape attempts got through:\n{}",
        failures.len(),
        attempts.len(),
        failures.join("\n---\n")
    );

    // The worker is still alive, registered and sandboxed; the escape
    // attempts left no scratch directory behind.
    let mut agw = agw;
    assert!(agw.try_wait().is_none(), "agw died");
    assert!(c.sandboxed("sandboxed-1").await);

    // Ordinary pipelines still work under the sandbox.
    // 1. The word-frequency plan on a file under --read-path.
    let wf = [
        task(1, "cat", &["{{file}}"], None),
        task(2, "tr", &["-cs", "A-Za-z", "\n"], Some(1)),
        task(3, "tr", &["A-Z", "a-z"], Some(2)),
        task(4, "sort", &[], Some(3)),
        task(5, "uniq", &["-c"], Some(4)),
        task(6, "sort", &["-rn"], Some(5)),
        task(7, "head", &["-n", "3"], Some(6)),
    ];
    c.plan("word-frequency", wf.to_vec(), true).await;
    let job = c.submit("word-frequency", &[("file", &words)]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    let expected = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cat {words} | tr -cs A-Za-z '\\n' | tr A-Z a-z | sort | uniq -c | sort -rn | head -n 3"
        ))
        .output()
        .expect("sh");
    assert_eq!(
        job.task_results[6].stdout,
        String::from_utf8(expected.stdout).expect("utf-8")
    );

    // 2. input_from_task reaching back past the previous task, and 3. a
    // task that writes its scratch directory and a later one that reads it.
    c.plan(
        "scratch",
        vec![
            task(1, "echo", &["hello sandbox"], None),
            task(2, "tee", &["note.txt"], Some(1)),
            task(3, "sort", &["-o", "sorted.txt", "note.txt"], None),
            task(4, "cat", &["sorted.txt", "note.txt"], None),
            task(5, "wc", &["-w"], Some(1)),
        ],
        true,
    )
    .await;
    let job = c.submit("scratch", &[]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    assert_eq!(job.task_results[3].stdout, "hello sandbox\nhello sandbox\n");
    assert_eq!(job.task_results[4].stdout.trim(), "2");

    // A value starting with '-' is accepted where the task allows it.
    c.plan(
        "options-allowed",
        vec![Task {
            allow_option_values: true,
            ..task(1, "head", &["{{n}}", &words], None)
        }],
        false,
    )
    .await;
    let job = c.submit("options-allowed", &[("n", "-n1")]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    assert_eq!(job.task_results[0].stdout.lines().count(), 1);

    // Tasks never run as root: agw (root in CI) runs them as `nobody` with
    // no supplementary group; an unprivileged agw runs them as itself.
    let (uid, gid) = if nix::unistd::Uid::effective().is_root() {
        let nobody = nix::unistd::User::from_name("nobody")
            .expect("passwd")
            .expect("a nobody user");
        (nobody.uid.as_raw(), nobody.gid.as_raw())
    } else {
        (
            nix::unistd::Uid::effective().as_raw(),
            nix::unistd::Gid::effective().as_raw(),
        )
    };
    c.plan(
        "identity",
        one("perl", &["-e", "print \"$< $>\\n$)\\n\""]),
        false,
    )
    .await;
    let job = c.submit("identity", &[]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    let out = &job.task_results[0].stdout;
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(format!("{uid} {uid}").as_str()), "{out}");
    let groups: Vec<u32> = lines
        .next()
        .expect("groups line")
        .split_whitespace()
        .map(|g| g.parse().expect("gid"))
        .collect();
    assert!(
        !groups.is_empty() && groups.iter().all(|&g| g == gid),
        "the task's groups {groups:?} are not just {gid}"
    );
    assert_ne!(uid, 0, "tasks must not run as root");

    // Every job's scratch directory is gone once it ended.
    let left: Vec<_> = std::fs::read_dir(&f.scratch)
        .expect("scratch root")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(left.is_empty(), "scratch directories left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_landlock_agw_refuses_to_start_unless_told_to_run_unsandboxed() {
    let f = fixture();
    let (_server, url) = start_server(&f.db);
    let unsupported = [("AGW_SANDBOX_PROBE", "unsupported")];
    let err = start_agw(&url, "no-landlock", &["--tools", "cat"], &unsupported)
        .err()
        .expect("agw must refuse to start without Landlock");
    assert!(!err.starts_with("exit status: 0"), "{err}");
    assert!(err.contains("--insecure-no-sandbox"), "{err}");

    let _insecure = start_agw(
        &url,
        "no-landlock",
        &["--tools", "echo", "--insecure-no-sandbox"],
        &unsupported,
    )
    .expect("agw starts with --insecure-no-sandbox");
    let mut c = Clients::connect(&url).await;
    assert!(
        !c.sandboxed("no-landlock").await,
        "GetWorker shows sandboxed: false"
    );

    // A plan that requires the sandbox waits, and says why.
    c.plan("needs-sandbox", one("echo", &["hello"]), true).await;
    let job_id = c.submit("needs-sandbox", &[]).await;
    let deadline = Instant::now() + WAIT;
    let job = loop {
        let job = c.job(&job_id).await;
        if job.waiting_reason.contains("sandbox") {
            break job;
        }
        assert!(
            Instant::now() < deadline,
            "no sandbox waiting reason: {job:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status(&job), JobStatus::Pending);

    // A sandboxed worker takes it.
    let scratch = f.scratch.to_str().expect("utf-8").to_owned();
    let _sandboxed = start_agw(
        &url,
        "with-landlock",
        &["--tools", "echo", "--scratch-dir", &scratch],
        &[],
    )
    .expect("sandboxed agw");
    let job = c.finished(&job_id).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    assert_eq!(job.worker_id, "with-landlock");
}

/// Ids of the System V IPC objects of `kind` (`shm`, `msg`, `sem`) with
/// `key` that exist now (`/proc/sysvipc/<kind>`: key, then id).
fn sysv_ids(kind: &str, key: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/sysvipc/{kind}"))
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let k: i32 = f.next()?.parse().ok()?;
            let id: i32 = f.next()?.parse().ok()?;
            (k == key).then_some(id)
        })
        .collect()
}

/// Removes the shared memory segments and message queues with `key`.
fn remove_sysv(key: i32) {
    for id in sysv_ids("shm", key) {
        // SAFETY: shmctl(IPC_RMID) with no buffer.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    }
    for id in sysv_ids("msg", key) {
        // SAFETY: msgctl(IPC_RMID) with no buffer.
        unsafe { libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_leave_system_v_ipc_objects_behind() {
    // Shared memory and message queues of System V IPC outlive the
    // process that made them (until removed or reboot), count against no
    // rlimit of the task (a segment touched and detached is memory beyond
    // --max-address-space-mb) and are reachable by id from any process of
    // the uid: one job could fill the host's memory past its end, or read
    // another program's world-readable segment. The sandbox refuses them.
    const KEY: i32 = 0x4147_5131;
    remove_sysv(KEY);
    let f = fixture();
    let (_server, url) = start_server(&f.db);
    let scratch = f.scratch.to_str().expect("utf-8").to_owned();
    let _agw = start_agw(
        &url,
        "sysv-ipc",
        &["--tools", "perl", "--scratch-dir", &scratch],
        &[],
    )
    .expect("agw starts with the sandbox on this kernel");
    let mut c = Clients::connect(&url).await;
    // IPC_CREAT is 01000.
    c.plan(
        "shm",
        one(
            "perl",
            &[
                "-e",
                &format!(
                    "my $id = shmget({KEY}, 1 << 20, 0666 | 01000) // die \"shmget: $!\"; \
                     shmwrite($id, 'x' x 4096, 0, 4096) or die \"shmwrite: $!\"; \
                     print \"segment $id\\n\""
                ),
            ],
        ),
        false,
    )
    .await;
    c.plan(
        "msg",
        one(
            "perl",
            &[
                "-e",
                &format!(
                    "my $id = msgget({KEY}, 0666 | 01000) // die \"msgget: $!\"; \
                     msgsnd($id, pack('l! a*', 1, 'left behind'), 0) or die \"msgsnd: $!\"; \
                     print \"queue $id\\n\""
                ),
            ],
        ),
        false,
    )
    .await;
    let shm = c.submit("shm", &[]).await;
    let shm = c.finished(&shm).await;
    let msg = c.submit("msg", &[]).await;
    let msg = c.finished(&msg).await;
    let (segments, queues) = (sysv_ids("shm", KEY), sysv_ids("msg", KEY));
    remove_sysv(KEY);
    assert!(
        segments.is_empty(),
        "a finished job left shared memory segment(s) {segments:?}: {}",
        all_output(&shm)
    );
    assert!(
        queues.is_empty(),
        "a finished job left message queue(s) {queues:?}: {}",
        all_output(&msg)
    );
    for job in [&shm, &msg] {
        assert_eq!(status(job), JobStatus::Dead, "{}", all_output(job));
        assert!(
            job.error.contains("Permission denied"),
            "{}",
            all_output(job)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_leave_data_for_another_job_in_the_kernel_keyring() {
    // The user keyring belongs to the uid, not to a process: a key one
    // job's task adds outlives the job, and every later task of that uid
    // (another client's job, any other process running as `nobody`) finds
    // and reads it, past every rule of the sandbox. The sandbox refuses
    // the keyring calls (add_key, request_key, keyctl).
    const PAYLOAD: &str = "left-behind-by-job-one-5d1e";
    let f = fixture();
    let (_server, url) = start_server(&f.db);
    let scratch = f.scratch.to_str().expect("utf-8").to_owned();
    let _agw = start_agw(
        &url,
        "keyring",
        &["--tools", "perl", "--scratch-dir", &scratch],
        &[],
    )
    .expect("agw starts with the sandbox on this kernel");
    let mut c = Clients::connect(&url).await;
    // add_key(2) is 248, keyctl(2) 250 (x86-64); the user keyring is -4;
    // KEYCTL_SEARCH 10, KEYCTL_READ 11, KEYCTL_UNLINK 9.
    let (add_key, keyctl) = match std::env::consts::ARCH {
        "x86_64" => (248, 250),
        "aarch64" => (217, 219),
        other => {
            eprintln!("skipped: no system call numbers for {other}");
            return;
        }
    };
    c.plan(
        "leave-key",
        one(
            "perl",
            &[
                "-e",
                &format!(
                    "my ($t, $d, $k) = (\"user\\0\", \"agq-sandbox-test-key\\0\", '{PAYLOAD}'); \
                     my $id = syscall({add_key}, $t, $d, $k, length $k, -4); \
                     $id > 0 or die \"add_key: $!\"; print \"key $id\\n\""
                ),
            ],
        ),
        false,
    )
    .await;
    c.plan(
        "find-key",
        one(
            "perl",
            &[
                "-e",
                &format!(
                    "my ($t, $d) = (\"user\\0\", \"agq-sandbox-test-key\\0\"); \
                     my $id = syscall({keyctl}, 10, -4, $t, $d, 0); \
                     $id > 0 or die \"search: $!\"; my $buf = \"\\0\" x 64; \
                     my $n = syscall({keyctl}, 11, $id, $buf, 64); \
                     print 'found: ', substr($buf, 0, $n > 0 ? $n : 0), \"\\n\"; \
                     syscall({keyctl}, 9, $id, -4)"
                ),
            ],
        ),
        false,
    )
    .await;
    let first = c.submit("leave-key", &[]).await;
    let first = c.finished(&first).await;
    let second = c.submit("find-key", &[]).await;
    let second = c.finished(&second).await;
    assert!(
        !all_output(&second).contains(PAYLOAD),
        "a job read what an earlier job left in the keyring:\n{}\n---\n{}",
        all_output(&first),
        all_output(&second)
    );
    assert_eq!(status(&first), JobStatus::Dead, "{}", all_output(&first));
    assert!(
        first.error.contains("Permission denied"),
        "{}",
        all_output(&first)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_change_the_limits_or_scheduling_of_another_process() {
    // The kernel lets a process set the resource limits, nice value,
    // scheduling and I/O priority of every process of its uid, and no
    // Landlock right covers that: a task could drop `agw`'s open-file
    // limit to nothing (every later job fails) or another job's file size
    // limit to 0. The sandbox refuses these calls unless they name the
    // caller itself. The target here is the task's own child, a process
    // of the same uid, so only the filter can refuse; the same calls on
    // the task itself still work.
    let f = fixture();
    let (_server, url) = start_server(&f.db);
    let scratch = f.scratch.to_str().expect("utf-8").to_owned();
    let _agw = start_agw(
        &url,
        "limits",
        &["--tools", "perl", "--scratch-dir", &scratch],
        &[],
    )
    .expect("agw starts with the sandbox on this kernel");
    let mut c = Clients::connect(&url).await;
    // prlimit64, setpriority, sched_setscheduler, sched_setparam,
    // sched_setaffinity, ioprio_set.
    let nr = match std::env::consts::ARCH {
        "x86_64" => [302, 141, 144, 142, 203, 251],
        "aarch64" => [261, 140, 119, 118, 122, 30],
        other => {
            eprintln!("skipped: no system call numbers for {other}");
            return;
        }
    };
    let [prlimit, setprio, setsched, setparam, setaff, ioprio] = nr;
    let code = format!(
        "use Errno; my $kid = fork() // die \"fork: $!\\n\"; \
         if (!$kid) {{ sleep 30; exit 0 }} \
         my ($old, $lim, $p, $m) = (\"\\0\" x 16, pack('QQ', 64, 64), pack('i', 0), pack('Q', 1)); \
         my $io = (2 << 13) | 4; my (@let, @failed); \
         for ([prlimit64 => {prlimit}, $kid, 7, $lim, $old], \
              [setpriority => {setprio}, 0, $kid, 5], [setpriority_pgrp => {setprio}, 1, 0, 5], \
              [sched_setscheduler => {setsched}, $kid, 0, $p], [sched_setparam => {setparam}, $kid, $p], \
              [sched_setaffinity => {setaff}, $kid, 8, $m], [ioprio_set => {ioprio}, 1, $kid, $io], \
              [ioprio_set_user => {ioprio}, 3, $<, $io]) {{ \
           my ($name, $nr, @args) = @$_; \
           push @let, $name unless syscall($nr, @args) == -1 && $!{{EACCES}}; }} \
         for ([setrlimit => {prlimit}, 0, 7, $lim, $old], [nice => {setprio}, 0, 0, 5], \
              [self_affinity => {setaff}, 0, 8, $m], [self_ioprio => {ioprio}, 1, 0, $io]) {{ \
           my ($name, $nr, @args) = @$_; \
           push @failed, \"$name: $!\" if syscall($nr, @args) == -1; }} \
         kill 'KILL', $kid; waitpid($kid, 0); \
         die \"allowed on another process: @let\\n\" if @let; \
         die \"refused on itself: @failed\\n\" if @failed; print \"refused\\n\""
    );
    c.plan("limits", one("perl", &["-e", &code]), false).await;
    let job = c.submit("limits", &[]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    assert_eq!(job.task_results[0].stdout, "refused\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_change_the_mode_or_owner_of_a_file_it_can_name_outside_scratch() {
    // Landlock has no right for chmod, chown or extended attributes: a
    // task could open up any file of its own uid that it can name, though
    // it may not read it (agw's token, when tasks run as agw's user). The
    // file here belongs to the tasks' user (nobody under a root agw) and
    // lies outside every read path.
    let f = fixture();
    let victim = f.secret.join("tasks-own.txt");
    std::fs::write(&victim, "private").expect("write");
    mode(&victim, 0o600);
    if nix::unistd::Uid::effective().is_root() {
        std::os::unix::fs::chown(&victim, Some(65534), Some(65534)).expect("chown");
    }
    let (_server, url) = start_server(&f.db);
    let scratch = f.scratch.to_str().expect("utf-8").to_owned();
    let _agw = start_agw(
        &url,
        "metadata",
        &["--tools", "perl", "--scratch-dir", &scratch],
        &[],
    )
    .expect("agw starts with the sandbox on this kernel");
    let mut c = Clients::connect(&url).await;
    let path = victim.to_str().expect("utf-8");
    for (name, code) in [
        (
            "chmod",
            format!("chmod(0666, '{path}') or die \"chmod: $!\\n\""),
        ),
        (
            "chown",
            format!("chown($<, $(, '{path}') or die \"chown: $!\\n\""),
        ),
    ] {
        c.plan(name, one("perl", &["-e", &code]), false).await;
        let job = c.submit(name, &[]).await;
        let job = c.finished(&job).await;
        assert_eq!(
            status(&job),
            JobStatus::Dead,
            "{name}: {}",
            all_output(&job)
        );
        assert!(
            job.error.contains("Permission denied"),
            "{name}: {}",
            all_output(&job)
        );
    }
    let meta = std::fs::metadata(&victim).expect("stat");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "the mode changed");

    // Nor can a program be run from memory, out of Landlock's reach.
    let memfd = match std::env::consts::ARCH {
        "x86_64" => 319,
        "aarch64" => 279,
        other => {
            eprintln!("memfd part skipped: no system call number for {other}");
            return;
        }
    };
    c.plan(
        "memfd",
        one(
            "perl",
            &[
                "-e",
                &format!(
                    "my $n = \"x\\0\"; syscall({memfd}, $n, 0) >= 0 \
                     or die \"memfd_create: $!\\n\""
                ),
            ],
        ),
        false,
    )
    .await;
    let job = c.submit("memfd", &[]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Dead, "{}", all_output(&job));
    assert!(
        job.error.contains("Permission denied"),
        "{}",
        all_output(&job)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_keep_its_scratch_directory_past_its_job() {
    // agw not root (as the Helm chart runs it): tasks run as agw's own
    // user and own what they make in their scratch directory. A task that
    // takes the permissions away (a directory of mode 0, 1,500 more, more
    // than agw walks with descriptors held at once, the scratch directory
    // itself read-only; through descriptors, since a chmod by path is
    // refused) must not make agw, which has no
    // privilege over them, leave its scratch directory (and whatever data
    // is in it) behind after the job.
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: starting agw as another user needs root");
        return;
    }
    let nobody = nix::unistd::User::from_name("nobody")
        .expect("passwd")
        .expect("a nobody user");
    let (uid, gid) = (nobody.uid.as_raw(), nobody.gid.as_raw());
    let f = fixture();
    let (_server, url) = start_server(&f.db);
    // The scratch root's parent, agw's user's.
    let home = f.db.parent().expect("parent").join("agw-home");
    std::fs::create_dir(&home).expect("mkdir");
    std::os::unix::fs::chown(&home, Some(uid), Some(gid)).expect("chown");
    let scratch = home.join("scratch");
    let mut agw = Agw::new(&url, "unprivileged")
        .args(["--tools", "perl", "--scratch-dir"])
        .args([&scratch])
        .env("RUST_LOG", "warn")
        .user(uid, gid)
        .kill_on_drop()
        .spawn();
    agw.registered()
        .unwrap_or_else(|e| panic!("agw as nobody did not start: {e:?}"));
    let mut c = Clients::connect(&url).await;
    c.plan(
        "keep-scratch",
        one(
            "perl",
            &[
                "-MFcntl",
                "-e",
                "mkdir 'd' or die $!; open my $o, '>', 'd/data' or die $!; \
                 print $o 'x' x 100_000; close $o; \
                 sysopen my $d, 'd', O_RDONLY | O_DIRECTORY or die $!; chmod 0, $d or die $!; \
                 for my $i (1..1500) { mkdir \"m$i\" or die $!; \
                   open my $f, '>', \"m$i/f\" or die $!; print $f 'y'; close $f; \
                   sysopen my $h, \"m$i\", O_RDONLY | O_DIRECTORY or die $!; chmod 0, $h or die $!; } \
                 sysopen my $s, '.', O_RDONLY | O_DIRECTORY or die $!; chmod 0500, $s or die $!; \
                 print \"done\\n\"",
            ],
        ),
        false,
    )
    .await;
    let job = c.submit("keep-scratch", &[]).await;
    let job = c.finished(&job).await;
    assert_eq!(status(&job), JobStatus::Completed, "{}", all_output(&job));
    let deadline = Instant::now() + Duration::from_secs(5);
    let left = loop {
        let left: Vec<_> = std::fs::read_dir(&scratch)
            .expect("scratch root")
            .map(|e| e.expect("entry").file_name())
            .collect();
        if left.is_empty() || Instant::now() >= deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        left.is_empty(),
        "scratch directories left after their job: {left:?}"
    );
}

#[test]
fn the_token_on_the_command_line_is_refused() {
    let out = clean_command(AGW)
        .args(["--token", "a-token-on-the-command-line", "--tools", "cat"])
        .output()
        .expect("run agw");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--token-file") && err.contains("AGW_TOKEN"),
        "{err}"
    );
}
