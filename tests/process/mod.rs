//! Child processes of the integration tests: the one way they start the
//! built `agq serve` and `agw` binaries.
//!
//! [`Serve`] starts `agq serve` on `127.0.0.1:0` (or a given address) with
//! the database given and waits until it printed `listening on ADDR`, which
//! it does once it answers. [`Agw`] starts `agw` against a server. Both
//! clear the caller's `AGQ_*` / `AGW_*` variables, write the child's stderr
//! to a log file, collect its stdout lines, and stop the child when the
//! handle is dropped (SIGTERM then, after a bounded wait, SIGKILL; or
//! SIGKILL at once), printing its log when the test is panicking.
//! `env!("CARGO_BIN_EXE_…")` only exists in integration tests, hence here.
#![allow(dead_code)]

use std::{
    ffi::{OsStr, OsString},
    io::{BufRead, BufReader},
    ops::{Deref, DerefMut},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use nix::sys::signal::Signal;

/// The `agq` binary under test.
pub const AGQ: &str = env!("CARGO_BIN_EXE_agq");
/// The `agw` binary of the same build.
pub const AGW: &str = env!("CARGO_BIN_EXE_agw");

/// How long a child may take to start, register or exit.
pub const WAIT: Duration = Duration::from_secs(60);

/// How long a child may take to exit after SIGTERM before it is killed.
const TERM_WAIT: Duration = Duration::from_secs(20);

/// A command for `program` without the caller's `AGQ_*` / `AGW_*` variables.
pub fn clean_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for (k, _) in std::env::vars() {
        if k.starts_with("AGQ_") || k.starts_with("AGW_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// What dropping a [`Proc`] does to a child still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDrop {
    /// SIGTERM, then SIGKILL if it has not exited within 20 s.
    Terminate,
    /// SIGKILL at once (a crash).
    Kill,
}

/// A running child process with its stderr in a log file and its stdout
/// lines collected.
pub struct Proc {
    child: Child,
    name: String,
    log: PathBuf,
    lines: mpsc::Receiver<String>,
    on_drop: OnDrop,
    _log_dir: Option<tempfile::TempDir>,
}

impl Proc {
    /// Spawns `cmd` (stdin null, stdout collected, stderr to `log`, or to a
    /// file in a temporary directory when `None`); `name` names it in
    /// messages.
    pub fn spawn(mut cmd: Command, name: &str, log: Option<PathBuf>, on_drop: OnDrop) -> Proc {
        let (log, log_dir) = match log {
            Some(p) => (p, None),
            None => {
                let d = tempfile::tempdir().expect("tempdir for a log");
                (d.path().join("stderr.log"), Some(d))
            }
        };
        let file = std::fs::File::create(&log).expect("create the log file");
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        // Reads to the end, so the child never writes into a closed pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Proc {
            child,
            name: name.to_owned(),
            log,
            lines,
            on_drop,
            _log_dir: log_dir,
        }
    }

    /// Its process id.
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// Sends `sig`.
    pub fn signal(&self, sig: Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig)
            .unwrap_or_else(|e| panic!("cannot signal {}: {e}", self.name));
    }

    /// What it wrote on stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The path of its stderr log.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Its exit status if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Waits (blocking) until it exits; panics with its log after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.try_wait() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {within:?}; log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Like [`Proc::wait_exit`], sleeping on the tokio timer.
    pub async fn wait_exit_async(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.try_wait() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {within:?}; log:\n{}",
                self.name,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The next stdout line within `within`; `None` when it closed stdout
    /// (exited) or printed nothing in time.
    pub fn next_line(&self, within: Duration) -> Option<String> {
        self.lines.recv_timeout(within).ok()
    }

    /// The next stdout line before `deadline`, sleeping on the tokio timer;
    /// `None` when stdout closed or the deadline passed.
    pub async fn next_line_async(&self, deadline: Instant) -> Option<String> {
        loop {
            match self.lines.try_recv() {
                Ok(l) => return Some(l),
                Err(mpsc::TryRecvError::Disconnected) => return None,
                Err(mpsc::TryRecvError::Empty) => {}
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGTERM, then waits up to 20 s for it to exit, then SIGKILL. Returns
    /// its exit status, `None` when it had to be killed.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        if let Some(st) = self.try_wait() {
            return Some(st);
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), Signal::SIGTERM);
        let deadline = Instant::now() + TERM_WAIT;
        while Instant::now() < deadline {
            if let Some(st) = self.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    /// SIGKILL, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- log of {} ---\n{}--- end ---", self.name, self.log());
        }
        match self.on_drop {
            OnDrop::Terminate => {
                self.terminate();
            }
            OnDrop::Kill => self.kill(),
        }
    }
}

/// A command line of `agq serve`, started by [`Serve::spawn`].
pub struct Serve {
    listen: String,
    db: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    log: Option<PathBuf>,
    on_drop: OnDrop,
}

impl Serve {
    /// `agq serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --db DB`,
    /// with the caller's `RUST_LOG`, terminated on drop.
    pub fn new(db: impl Into<PathBuf>) -> Serve {
        Serve {
            listen: "127.0.0.1:0".into(),
            db: db.into(),
            args: Vec::new(),
            env: Vec::new(),
            log: None,
            on_drop: OnDrop::Terminate,
        }
    }

    /// Listens on `addr` instead of `127.0.0.1:0`.
    pub fn listen(mut self, addr: &str) -> Serve {
        self.listen = addr.to_owned();
        self
    }

    /// Adds flags.
    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Serve {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Serve {
        self.env.push((key.into(), Some(value.into())));
        self
    }

    /// Removes an environment variable (`RUST_LOG` for the default level).
    pub fn env_remove(mut self, key: &str) -> Serve {
        self.env.push((key.into(), None));
        self
    }

    /// Writes stderr to `path` instead of a temporary file.
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Serve {
        self.log = Some(path.into());
        self
    }

    /// Kills it with SIGKILL on drop instead of SIGTERM.
    pub fn kill_on_drop(mut self) -> Serve {
        self.on_drop = OnDrop::Kill;
        self
    }

    /// Starts it and waits (up to [`WAIT`]) for `listening on ADDR`.
    ///
    /// Errors: it exited, or printed something else first: its exit status
    /// (when it exited) and its log.
    pub fn spawn(self) -> Result<AgqServe, Exited> {
        let mut cmd = clean_command(AGQ);
        cmd.arg("serve")
            .args(["--listen", &self.listen, "--metrics-listen", "127.0.0.1:0"])
            .args(["--console-listen", "127.0.0.1:0"])
            .arg("--db")
            .arg(&self.db)
            .args(&self.args);
        for (k, v) in &self.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let mut proc = Proc::spawn(cmd, "agq serve", self.log, self.on_drop);
        let first = proc.next_line(WAIT);
        match first
            .as_deref()
            .and_then(|l| l.strip_prefix("listening on "))
        {
            Some(addr) => Ok(AgqServe {
                addr: addr.trim().to_owned(),
                db: self.db,
                proc,
            }),
            None => {
                // Bounded: a server that printed something else is killed.
                let status = match proc.try_wait() {
                    Some(st) => Some(st),
                    None if first.is_none() => Some(proc.wait_exit(WAIT)),
                    None => {
                        proc.kill();
                        None
                    }
                };
                Err(Exited {
                    status,
                    first_line: first,
                    log: proc.log(),
                })
            }
        }
    }
}

/// An `agq serve` that did not start.
#[derive(Debug)]
pub struct Exited {
    /// Its exit status; `None` when it printed something unexpected and was killed.
    pub status: Option<ExitStatus>,
    /// The first line it printed, if any.
    pub first_line: Option<String>,
    /// Its stderr.
    pub log: String,
}

/// A running `agq serve`.
pub struct AgqServe {
    /// `127.0.0.1:<port>`, as it printed.
    pub addr: String,
    /// Its database file.
    pub db: PathBuf,
    /// The process.
    pub proc: Proc,
}

impl AgqServe {
    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Deref for AgqServe {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl DerefMut for AgqServe {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

/// A command line of `agw`, started by [`Agw::spawn`].
pub struct Agw {
    id: String,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    log: Option<PathBuf>,
    on_drop: OnDrop,
    user: Option<(u32, u32)>,
}

impl Agw {
    /// `agw --server URL --worker-id ID`, with the caller's `RUST_LOG`,
    /// terminated on drop.
    pub fn new(server_url: &str, id: &str) -> Agw {
        Agw {
            id: id.to_owned(),
            args: vec![
                "--server".into(),
                server_url.into(),
                "--worker-id".into(),
                id.into(),
            ],
            env: Vec::new(),
            log: None,
            on_drop: OnDrop::Terminate,
            user: None,
        }
    }

    /// Like [`Agw::new`] without `--server`, for callers that pass their
    /// own (`https://…`, say).
    pub fn without_server(id: &str) -> Agw {
        let mut a = Agw::new("", id);
        a.args.drain(..2);
        a
    }

    /// Adds flags.
    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Agw {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Agw {
        self.env.push((key.into(), Some(value.into())));
        self
    }

    /// Removes an environment variable (`RUST_LOG` for the default level).
    pub fn env_remove(mut self, key: &str) -> Agw {
        self.env.push((key.into(), None));
        self
    }

    /// Writes stderr to `path` instead of a temporary file.
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Agw {
        self.log = Some(path.into());
        self
    }

    /// Kills it with SIGKILL on drop instead of SIGTERM.
    pub fn kill_on_drop(mut self) -> Agw {
        self.on_drop = OnDrop::Kill;
        self
    }

    /// Runs it as user `uid` and group `gid`, without supplementary
    /// groups (the caller must be root).
    pub fn user(mut self, uid: u32, gid: u32) -> Agw {
        self.user = Some((uid, gid));
        self
    }

    /// Starts it without waiting for anything.
    pub fn spawn(self) -> AgwProc {
        let mut cmd = clean_command(AGW);
        cmd.args(&self.args);
        for (k, v) in &self.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        if let Some((uid, gid)) = self.user {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(gid);
        }
        let name = format!("agw {}", self.id);
        AgwProc {
            proc: Proc::spawn(cmd, &name, self.log, self.on_drop),
            id: self.id,
        }
    }
}

/// A running `agw`.
pub struct AgwProc {
    /// Its worker id.
    pub id: String,
    /// The process.
    pub proc: Proc,
}

impl AgwProc {
    /// Waits (blocking, up to [`WAIT`]) for its `agw: registered ID with …`
    /// line and returns it.
    ///
    /// Errors: it exited first: its exit status and log. Panics when it
    /// neither registered nor exited in time.
    pub fn registered(&mut self) -> Result<String, Exited> {
        let want = format!("agw: registered {} with ", self.id);
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.proc.next_line(left) {
                Some(l) if l.starts_with(&want) => return Ok(l),
                Some(_) => {}
                None => return Err(self.exited_early(deadline)),
            }
        }
    }

    /// Like [`AgwProc::registered`], panicking with its log when it exited.
    pub fn wait_registered(&mut self) -> String {
        self.registered()
            .unwrap_or_else(|e| panic!("agw {} exited before registering: {e:?}", self.id))
    }

    /// Like [`AgwProc::wait_registered`], sleeping on the tokio timer.
    pub async fn wait_registered_async(&mut self) -> String {
        let want = format!("agw: registered {} with ", self.id);
        let deadline = Instant::now() + WAIT;
        loop {
            match self.proc.next_line_async(deadline).await {
                Some(l) if l.starts_with(&want) => return l,
                Some(_) => {}
                None => {
                    let e = self.exited_early(deadline);
                    panic!("agw {} exited before registering: {e:?}", self.id)
                }
            }
        }
    }

    /// Why no line came before `deadline`: it closed stdout (it exits),
    /// or, past the deadline, a panic.
    fn exited_early(&mut self, deadline: Instant) -> Exited {
        assert!(
            Instant::now() < deadline,
            "agw {} did not register within {WAIT:?}; log:\n{}",
            self.id,
            self.proc.log()
        );
        let status = self.proc.wait_exit(WAIT);
        Exited {
            status: Some(status),
            first_line: None,
            log: self.proc.log(),
        }
    }
}

impl Deref for AgwProc {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl DerefMut for AgwProc {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}
