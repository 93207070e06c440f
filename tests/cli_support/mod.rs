//! Harness of the CLI tests: a real `agq serve` process on 127.0.0.1:0
//! with a temporary database, real `agw` workers, and a runner for the
//! built `agq` binary that captures stdout, stderr and the exit code.
#![allow(dead_code)]

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

/// The `agq` binary under test.
pub const AGQ: &str = env!("CARGO_BIN_EXE_agq");
/// The `agw` binary of the same build.
pub const AGW: &str = env!("CARGO_BIN_EXE_agw");

/// How long any wait in these tests may take.
pub const WAIT: Duration = Duration::from_secs(60);

/// A command without the caller's `AGQ_*` / `AGW_*` variables.
pub fn clean_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for (k, _) in std::env::vars() {
        if k.starts_with("AGQ_") || k.starts_with("AGW_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// A running `agq serve` child process; stopped with SIGTERM on drop.
pub struct Server {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// Its temporary directory (database, logs).
    pub dir: tempfile::TempDir,
    workers: Vec<Child>,
}

impl Server {
    /// Starts a server with short heartbeat and backoff settings.
    pub fn start() -> Server {
        Self::start_with(&[])
    }

    /// Starts a server with extra `agq serve` flags.
    pub fn start_with(extra: &[&str]) -> Server {
        Self::start_logging(extra, false)
    }

    /// Starts a server with extra flags at the default log level (no
    /// `RUST_LOG`, whatever the caller's environment says).
    pub fn start_at_default_log_level(extra: &[&str]) -> Server {
        Self::start_logging(extra, true)
    }

    fn start_logging(extra: &[&str], default_level: bool) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        // The workers' tasks run as an unprivileged user when the tests
        // run as root: they must be able to enter it to read input files.
        std::fs::set_permissions(
            dir.path(),
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
        )
        .expect("chmod");
        let db = dir.path().join("agq.db");
        let log = std::fs::File::create(dir.path().join("server.log")).expect("log");
        let mut child = clean_command(AGQ);
        child
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--db",
                db.to_str().expect("utf-8 path"),
                "--heartbeat-interval-ms",
                "300",
                "--lease-grace-ms",
                "1000",
                "--retry-backoff-base-ms",
                "50",
                "--retry-backoff-max-ms",
                "200",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        if default_level {
            child.env_remove("RUST_LOG");
        }
        let mut child = child.spawn().expect("spawn agq serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("agq serve printed nothing; log: {}", log_of(dir.path())));
        let addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .trim()
            .to_owned();
        // Keep reading so the server never writes into a closed pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            addr,
            dir,
            workers: Vec::new(),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Runs `agq --server <url> ARGS`.
    pub fn agq(&self, args: &[&str]) -> Run {
        self.agq_stdin(args, None)
    }

    /// Runs `agq --server <url> ARGS` with `stdin` as its standard input.
    pub fn agq_stdin(&self, args: &[&str], stdin: Option<&str>) -> Run {
        let url = self.url();
        let mut all = vec!["--server", url.as_str()];
        all.extend_from_slice(args);
        run_agq(&all, stdin, &[])
    }

    /// Runs `agq --server <url> -o json ARGS`, asserts success and parses
    /// stdout as one JSON document.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["-o", "json"];
        all.extend_from_slice(args);
        let run = self.agq(&all);
        run.assert_ok();
        run.json()
    }

    /// Starts an `agw` worker with this id and waits until it registered.
    pub fn start_worker(&mut self, id: &str) {
        self.start_worker_with(id, &[]);
    }

    /// Starts an `agw` worker with this id and extra flags (at agw's
    /// default log level) and waits until it registered; its log is
    /// `<dir>/<id>.log`.
    pub fn start_worker_with(&mut self, id: &str, extra: &[&str]) {
        self.start_worker_env(id, extra, &[]);
    }

    /// Like [`Self::start_worker_with`], with extra environment variables
    /// (`AGW_TOKEN`). Tasks may read this session's directory; their
    /// scratch directories are under it too.
    pub fn start_worker_env(&mut self, id: &str, extra: &[&str], env: &[(&str, &str)]) {
        let log = std::fs::File::create(self.dir.path().join(format!("{id}.log"))).expect("log");
        let mut child = clean_command(AGW)
            .arg("--read-path")
            .arg(self.dir.path())
            .arg("--scratch-dir")
            .arg(self.dir.path().join(format!("scratch-{id}")))
            .envs(env.iter().copied())
            .args([
                "--server",
                &self.url(),
                "--worker-id",
                id,
                "--max-concurrent-jobs",
                "2",
                "--drain-timeout-secs",
                "5",
            ])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn agw");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.starts_with("agw: registered") => break,
                Some(Ok(_)) => {}
                _ => panic!(
                    "agw {id} exited before registering; log: {}",
                    std::fs::read_to_string(self.dir.path().join(format!("{id}.log")))
                        .unwrap_or_default()
                ),
            }
        }
        std::thread::spawn(move || for _ in lines {});
        self.workers.push(child);
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        log_of(self.dir.path())
    }

    /// Runs `agq ARGS` until `check` accepts its parsed JSON output or
    /// [`WAIT`] passes; returns the accepted value.
    pub fn wait_json(
        &self,
        args: &[&str],
        check: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let v = self.json(args);
            if check(&v) {
                return v;
            }
            assert!(
                start.elapsed() < WAIT,
                "timed out waiting on {args:?}: last {v:#}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
}

fn terminate(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Server {
    fn drop(&mut self) {
        for w in &mut self.workers {
            terminate(w);
        }
        terminate(&mut self.child);
    }
}

/// One finished `agq` run.
#[derive(Debug)]
pub struct Run {
    /// The arguments, for messages.
    pub args: Vec<String>,
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Run {
    /// Panics unless the run exited 0.
    pub fn assert_ok(&self) {
        assert_eq!(
            self.code, 0,
            "agq {:?} failed:\nstdout: {}\nstderr: {}",
            self.args, self.stdout, self.stderr
        );
    }

    /// Panics unless the run exited with `code` and stderr contains `needle`.
    pub fn assert_err(&self, code: i32, needle: &str) {
        assert_eq!(
            self.code, code,
            "agq {:?}: expected exit {code}:\nstdout: {}\nstderr: {}",
            self.args, self.stdout, self.stderr
        );
        assert!(
            self.stderr.contains(needle),
            "agq {:?}: stderr lacks {needle:?}: {}",
            self.args,
            self.stderr
        );
    }

    /// stdout as one JSON document.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "agq {:?}: stdout is not JSON ({e}):\n{}",
                self.args, self.stdout
            )
        })
    }

    /// stdout as JSON lines.
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        self.stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("agq {:?}: line is not JSON ({e}): {l}", self.args))
            })
            .collect()
    }
}

/// Runs the `agq` binary with `args`, optional stdin and extra environment.
pub fn run_agq(args: &[&str], stdin: Option<&str>, env: &[(&str, &str)]) -> Run {
    let mut cmd = clean_command(AGQ);
    cmd.args(args)
        .envs(env.iter().copied())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn agq");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin");
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    let out: Output = child.wait_with_output().expect("wait agq");
    Run {
        args: args.iter().map(|s| (*s).to_owned()).collect(),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Writes `text` to `dir/name` and returns the path as a string.
pub fn write_file(dir: &Path, name: &str, text: &str) -> String {
    let p: PathBuf = dir.join(name);
    std::fs::write(&p, text).expect("write file");
    p.to_str().expect("utf-8 path").to_owned()
}

/// The word-frequency pipeline run by the shell on `file`: what the demo
/// Plan must print for it.
pub fn shell_top_words(file: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg("cat \"$1\" | tr -cs A-Za-z '\\n' | tr A-Z a-z | sort | uniq -c | sort -rn | head -n 10")
        .arg("sh")
        .arg(file)
        .output()
        .expect("sh");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A text with a known word frequency.
pub fn sample_text(seed: usize) -> String {
    let words = ["alpha", "Beta", "gamma", "delta", "EPSILON", "zeta", "eta"];
    let mut text = String::new();
    for i in 0..200 {
        let w = words[(i * (seed + 3) + i / 7) % words.len()];
        text.push_str(w);
        text.push_str(if i % 11 == 0 { ".\n" } else { ", " });
    }
    text
}

/// The repository's `examples/` directory.
pub fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}
