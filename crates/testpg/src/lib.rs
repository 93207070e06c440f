//! A throwaway PostgreSQL server for AGQ's tests and benchmark.
//!
//! One server per process, started on first use from the system's
//! binaries (`AGQ_PG_BIN`, else the newest `/usr/lib/postgresql/<ver>/bin`,
//! else `pg_config --bindir`) in `<temp>/agq-pg-<pid>-<n>`, listening on a
//! free loopback port, with `fsync=off` unless [`configure`] asks for a
//! durable one. Each [`fresh_database`] call creates an empty database on
//! it. When the variable [`Options::url_env`] names (for the tests
//! `AGQ_TEST_DATABASE_URL`) is set, that server is used instead (databases
//! are created through the database its URL names, and left behind).
//!
//! As root, initdb and postgres run as the `postgres` user (else `nobody`),
//! since both refuse to run as root. The postmaster gets SIGKILL when this
//! process dies (PR_SET_PDEATHSIG); at a normal exit it is stopped
//! (SIGQUIT) and its directory removed. Directories left by dead processes
//! are removed at the next start.
//!
//! Setup failures panic with what to do: a test or a bench without its
//! database cannot go on.

use std::{
    fs,
    io::Read,
    net::TcpListener,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering},
        mpsc, Mutex, OnceLock,
    },
    time::{Duration, Instant},
};

/// How the server of this process is started.
#[derive(Debug, Clone)]
pub struct Options {
    /// `fsync` on, as in production (a benchmark); off for tests, whose
    /// crashes of the server are process crashes, not power losses.
    pub durable: bool,
    /// The environment variable that points at an existing server instead.
    pub url_env: &'static str,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            durable: false,
            url_env: "AGQ_TEST_DATABASE_URL",
        }
    }
}

/// Set by [`configure`]; the defaults otherwise.
static OPTIONS: OnceLock<Options> = OnceLock::new();

/// Sets how this process's server is started. Call it before the first
/// [`fresh_database`] or [`admin_url`]; returns false (and changes nothing)
/// when the options were already set or the server already started.
pub fn configure(options: Options) -> bool {
    OPTIONS.set(options).is_ok()
}

fn options() -> &'static Options {
    OPTIONS.get_or_init(Options::default)
}

/// The server the databases are created on.
struct Cluster {
    /// URL of the database `CREATE DATABASE` is sent through.
    admin_url: String,
}

impl Cluster {
    /// The URL of database `name` on this server.
    fn url_of(&self, name: &str) -> String {
        with_dbname(&self.admin_url, name)
    }
}

/// The cluster of this test process, or why there is none (every caller
/// panics with the same message).
static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

/// Numbers the databases of this process.
static NEXT_DB: AtomicU32 = AtomicU32::new(0);

/// Numbers the cluster directories of this process.
static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// Pid of the running postmaster (0: none), for the exit hook.
static POSTMASTER: AtomicI32 = AtomicI32::new(0);
/// Set by the waiter thread once the postmaster is reaped.
static POSTMASTER_GONE: AtomicBool = AtomicBool::new(false);
/// The cluster directory, removed by the exit hook.
static CLUSTER_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);
/// How the postmaster was started (binaries, directory, data, port, user),
/// for [`crash_and_restart`].
#[allow(clippy::type_complexity)]
static STARTED: Mutex<Option<(PathBuf, PathBuf, PathBuf, u16, Option<(u32, u32)>)>> =
    Mutex::new(None);

/// Attempts at a free port before giving up.
const PORT_ATTEMPTS: usize = 8;
/// How long postgres may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Creates a new, empty database and returns its URL,
/// `postgres://agq@127.0.0.1:<port>/agq_<pid>_<n>` (or a database on the
/// server of `AGQ_TEST_DATABASE_URL`). Starts this process's cluster on
/// first use; panics when no PostgreSQL can be had.
pub async fn fresh_database() -> String {
    let cluster = cluster().await;
    let client = connect(&cluster.admin_url).await;
    let pid = std::process::id();
    loop {
        let name = format!("agq_{pid}_{}", NEXT_DB.fetch_add(1, Ordering::Relaxed));
        match client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
        {
            Ok(()) => return cluster.url_of(&name),
            // left by an earlier process with the same pid on a shared server
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_DATABASE) => {
                continue
            }
            Err(e) => panic!("CREATE DATABASE {name} on the test PostgreSQL: {e}"),
        }
    }
}

/// URL of the maintenance database of the test server (`postgres`, or the
/// database `AGQ_TEST_DATABASE_URL` names), starting the cluster if needed.
pub async fn admin_url() -> String {
    cluster().await.admin_url.clone()
}

/// The pid of this process's postmaster, once started (`None` with a
/// server of the [`Options::url_env`] variable, or before the start).
pub fn postmaster_pid() -> Option<i32> {
    Some(POSTMASTER.load(Ordering::SeqCst)).filter(|p| *p > 0)
}

/// A client on `url`, its connection driven on the current runtime.
pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to the test PostgreSQL ({url}): {e}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Crashes this process's cluster and starts it again on the same port and
/// data, as `pg_ctl restart -m immediate` does: the postmaster gets SIGQUIT
/// (immediate shutdown: no checkpoint, crash recovery at the next start).
/// Returns once it accepts connections again.
///
/// # Panics
///
/// With `AGQ_TEST_DATABASE_URL` (a server the tests do not own), or when
/// the cluster does not come back.
pub async fn crash_and_restart() {
    crash_and_restart_after(Duration::ZERO).await
}

/// As [`crash_and_restart`], with the cluster left down for `down` between
/// the crash and the start (an outage).
///
/// # Panics
///
/// As [`crash_and_restart`].
pub async fn crash_and_restart_after(down: Duration) {
    cluster().await;
    let started = STARTED.lock().unwrap().clone();
    let Some((bin, dir, data, port, user)) = started else {
        panic!("crash_and_restart needs the tests' own cluster: unset AGQ_TEST_DATABASE_URL");
    };
    tokio::task::spawn_blocking(move || {
        let pid = POSTMASTER.load(Ordering::SeqCst);
        // SAFETY: a signal to the child this process started.
        unsafe { libc::kill(pid, libc::SIGQUIT) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !POSTMASTER_GONE.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "postgres did not stop");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(down);
        let log = dir.join("postgres-restart.log");
        match start_postmaster(&bin, &dir, &data, port, &log, user) {
            Ok(Started::Ready) => {}
            Ok(Started::PortTaken(text)) => panic!("port {port} taken on restart:\n{text}"),
            Err(e) => panic!("postgres did not restart: {e}"),
        }
    })
    .await
    .expect("restart panicked");
}

/// This process's cluster, started on first use.
async fn cluster() -> &'static Cluster {
    let c = tokio::task::spawn_blocking(|| CLUSTER.get_or_init(start_cluster))
        .await
        .expect("cluster start panicked");
    match c {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

fn start_cluster() -> Result<Cluster, String> {
    if let Ok(url) = std::env::var(options().url_env) {
        if !url.trim().is_empty() {
            return Ok(Cluster {
                admin_url: url.trim().to_string(),
            });
        }
    }
    let bin = bin_dir().ok_or_else(|| {
        format!(
            "no PostgreSQL server binaries (initdb, postgres) found in $AGQ_PG_BIN, \
             /usr/lib/postgresql/<version>/bin or `pg_config --bindir`: run \
             scripts/test-deps.sh (it installs Debian's postgresql), or set \
             {} to a server databases may be created on",
            options().url_env
        )
    })?;
    remove_stale_dirs();
    let dir = std::env::temp_dir().join(format!(
        "agq-pg-{}-{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    *CLUSTER_DIR.lock().unwrap() = Some(dir.clone());
    // SAFETY: registers a plain extern "C" function.
    unsafe { libc::atexit(stop_at_exit) };

    let user = run_as();
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
            .map_err(|e| format!("chown {} to uid {uid}: {e}", dir.display()))?;
    }
    let data = dir.join("data");
    let mut initdb = Command::new(bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(&data)
        .args(["-A", "trust", "-U", "agq", "--no-sync", "-E", "UTF8"])
        .arg("--locale=C")
        .current_dir(&dir)
        .stdin(Stdio::null());
    as_user(&mut initdb, user);
    let out = initdb
        .output()
        .map_err(|e| format!("run {}: {e}", bin.join("initdb").display()))?;
    if !out.status.success() {
        return Err(format!(
            "initdb failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }

    let mut last = String::new();
    for attempt in 0..PORT_ATTEMPTS {
        let port = free_port().map_err(|e| format!("find a free port: {e}"))?;
        let log = dir.join(format!("postgres-{attempt}.log"));
        match start_postmaster(&bin, &dir, &data, port, &log, user)? {
            Started::Ready => {
                *STARTED.lock().unwrap() =
                    Some((bin.clone(), dir.clone(), data.clone(), port, user));
                return Ok(Cluster {
                    admin_url: format!("postgres://agq@127.0.0.1:{port}/postgres"),
                });
            }
            Started::PortTaken(text) => last = text,
        }
    }
    Err(format!(
        "postgres found no free port in {PORT_ATTEMPTS} attempts; last log:\n{last}"
    ))
}

enum Started {
    Ready,
    /// The postmaster exited because the port was taken (its log).
    PortTaken(String),
}

/// Starts the postmaster on `port` from a dedicated thread (the parent of
/// the child for PR_SET_PDEATHSIG, it lives as long as the child) and waits
/// until it accepts connections.
fn start_postmaster(
    bin: &Path,
    dir: &Path,
    data: &Path,
    port: u16,
    log: &Path,
    user: Option<(u32, u32)>,
) -> Result<Started, String> {
    let log_file = fs::File::create(log).map_err(|e| format!("create {}: {e}", log.display()))?;
    let mut cmd = Command::new(bin.join("postgres"));
    cmd.arg("-D")
        .arg(data)
        .arg("-k")
        .arg(dir)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", "max_connections=300"])
        // fsync off for tests: a commit still reaches the kernel before it
        // is acknowledged (synchronous_commit stays on), so the crashes the
        // tests cause lose nothing; only a power loss would.
        .args([
            "-c",
            if options().durable {
                "fsync=on"
            } else {
                "fsync=off"
            },
        ])
        // dynamic shared memory in files under the data directory: nothing
        // is left in /dev/shm (small in containers) when postgres is killed
        .args(["-c", "dynamic_shared_memory_type=mmap"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
        .stderr(log_file);
    as_user(&mut cmd, user);
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls between fork and exec. The std
    // library changes uid/gid before running this closure, so the
    // death-signal setting (cleared on credential changes) stays.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // the test process died before the prctl
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel::<Result<i32, String>>();
    let (exit_tx, exit_rx) = mpsc::channel::<String>();
    std::thread::Builder::new()
        .name(format!("postgres-{port}"))
        .spawn(move || match cmd.spawn() {
            Err(e) => {
                let _ = tx.send(Err(format!("spawn postgres: {e}")));
            }
            Ok(mut child) => {
                let pid = child.id() as i32;
                POSTMASTER_GONE.store(false, Ordering::SeqCst);
                POSTMASTER.store(pid, Ordering::SeqCst);
                let _ = tx.send(Ok(pid));
                let status = child.wait();
                POSTMASTER_GONE.store(true, Ordering::SeqCst);
                let _ = exit_tx.send(format!("{status:?}"));
            }
        })
        .map_err(|e| format!("spawn the postgres thread: {e}"))?;
    rx.recv().map_err(|e| e.to_string())??;

    let deadline = Instant::now() + READY_TIMEOUT;
    let pid_file = data.join("postmaster.pid");
    loop {
        if let Ok(status) = exit_rx.try_recv() {
            let text = fs::read_to_string(log).unwrap_or_default();
            if text.contains("could not bind") || text.contains("Address already in use") {
                return Ok(Started::PortTaken(text));
            }
            return Err(format!(
                "postgres exited ({status}) before it was ready:\n{text}"
            ));
        }
        // line 8 of postmaster.pid is the postmaster's status
        let ready = fs::read_to_string(&pid_file)
            .map(|t| t.lines().nth(7).map(str::trim) == Some("ready"))
            .unwrap_or(false);
        if ready {
            return Ok(Started::Ready);
        }
        if Instant::now() > deadline {
            let text = fs::read_to_string(log).unwrap_or_default();
            return Err(format!(
                "postgres did not accept connections within {READY_TIMEOUT:?}:\n{text}"
            ));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Stops the postmaster (immediate shutdown, which also removes its System V
/// segment) and removes the cluster directory, at the test process's exit.
extern "C" fn stop_at_exit() {
    let pid = POSTMASTER.swap(0, Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: a signal to the child this process started.
        unsafe { libc::kill(pid, libc::SIGQUIT) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !POSTMASTER_GONE.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    if let Ok(mut dir) = CLUSTER_DIR.lock() {
        if let Some(d) = dir.take() {
            let _ = fs::remove_dir_all(d);
        }
    }
}

/// The uid and gid initdb and postgres run as: None unless this process is
/// root; then `postgres`, else `nobody`.
fn run_as() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    for name in ["postgres", "nobody"] {
        if let Ok(Some(u)) = nix::unistd::User::from_name(name) {
            return Some((u.uid.as_raw(), u.gid.as_raw()));
        }
    }
    panic!("running as root, and neither a `postgres` nor a `nobody` user exists to run initdb as");
}

fn as_user(cmd: &mut Command, user: Option<(u32, u32)>) {
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
}

/// A loopback port nothing listens on right now (it may be taken before
/// postgres binds it: the caller retries).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The directory holding `initdb` and `postgres`.
fn bin_dir() -> Option<PathBuf> {
    let has_both = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some(d) = std::env::var_os("AGQ_PG_BIN") {
        let d = PathBuf::from(d);
        return has_both(&d).then_some(d);
    }
    let mut versions: Vec<(Vec<u32>, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let v = name
                .split('.')
                .map(|p| p.parse().ok())
                .collect::<Option<Vec<u32>>>()?;
            let bin = e.path().join("bin");
            has_both(&bin).then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && has_both(&d)).then_some(d)
}

/// Removes `agq-pg-<pid>-<n>` directories of processes no longer alive,
/// with what their postmaster may have left: the postmaster itself (if it
/// outlived its parent) and its System V shared memory segment.
fn remove_stale_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("agq-pg-")) else {
            continue;
        };
        let Some(Ok(pid)) = rest.split('-').next().map(str::parse::<i32>) else {
            continue;
        };
        if pid <= 0 || alive(pid) {
            continue;
        }
        let dir = e.path();
        if let Ok(text) = fs::read_to_string(dir.join("data/postmaster.pid")) {
            let lines: Vec<&str> = text.lines().collect();
            if let Some(Ok(pm)) = lines.first().map(|l| l.trim().parse::<i32>()) {
                if pm > 0 && alive(pm) && cmdline_mentions(pm, &dir) {
                    // SAFETY: a signal to a postgres running in our directory.
                    unsafe { libc::kill(pm, libc::SIGKILL) };
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            // line 7: "<shm key> <shm id>"
            if let Some(id) = lines
                .get(6)
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|id| id.parse::<i32>().ok())
            {
                remove_unattached_segment(id);
            }
        }
        let _ = fs::remove_dir_all(&dir);
    }
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn cmdline_mentions(pid: i32, dir: &Path) -> bool {
    let mut text = String::new();
    fs::File::open(format!("/proc/{pid}/cmdline"))
        .and_then(|mut f| f.read_to_string(&mut text))
        .is_ok()
        && text.contains(&*dir.to_string_lossy())
}

/// Removes System V shared memory segment `id` when no process has it
/// attached.
fn remove_unattached_segment(id: i32) {
    // SAFETY: shmctl fills `ds`; IPC_RMID only on a segment nobody uses.
    unsafe {
        let mut ds: libc::shmid_ds = std::mem::zeroed();
        if libc::shmctl(id, libc::IPC_STAT, &mut ds) == 0 && ds.shm_nattch == 0 {
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
        }
    }
}

/// `url` with its database replaced by `name`: the path of a
/// `postgres://` URL, or the `dbname` of a `key=value` string.
pub fn with_dbname(url: &str, name: &str) -> String {
    if let Some(scheme_end) = url.find("://") {
        let after = scheme_end + 3;
        let auth_end = url[after..]
            .find(['/', '?'])
            .map_or(url.len(), |i| after + i);
        let query = url[auth_end..]
            .find('?')
            .map_or("", |i| &url[auth_end + i..]);
        format!("{}/{name}{query}", &url[..auth_end])
    } else {
        let mut parts: Vec<&str> = url
            .split_whitespace()
            .filter(|p| !p.starts_with("dbname="))
            .collect();
        let db = format!("dbname={name}");
        parts.push(&db);
        parts.join(" ")
    }
}
