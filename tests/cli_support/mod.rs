//! Harness of the CLI tests: a real `agq serve` process on 127.0.0.1:0
//! with a temporary database, real `agw` workers, and a runner for the
//! built `agq` binary that captures stdout, stderr and the exit code.
#![allow(dead_code)]

#[path = "../process/mod.rs"]
pub mod process;

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

pub use process::{clean_command, AGQ, WAIT};
use process::{AgqServe, Agw, AgwProc, Serve};

/// A running `agq serve` child process and its `agw` workers; all stopped
/// with SIGTERM on drop, the workers first.
pub struct Server {
    workers: Vec<AgwProc>,
    child: AgqServe,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// Its temporary directory (database, logs).
    pub dir: tempfile::TempDir,
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
        let mut serve = Serve::new(dir.path().join("agq.db"))
            .args([
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
            .log_to(dir.path().join("server.log"));
        if default_level {
            serve = serve.env_remove("RUST_LOG");
        }
        let child = serve
            .spawn()
            .unwrap_or_else(|e| panic!("agq serve did not start: {e:?}"));
        Server {
            addr: child.addr.clone(),
            child,
            dir,
            workers: Vec::new(),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        self.child.url()
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
        let mut agw = Agw::new(&self.url(), id)
            .args([
                "--read-path".as_ref(),
                self.dir.path().as_os_str(),
                "--scratch-dir".as_ref(),
                self.dir.path().join(format!("scratch-{id}")).as_os_str(),
            ])
            .args(["--max-concurrent-jobs", "2", "--drain-timeout-secs", "5"])
            .args(extra)
            .env_remove("RUST_LOG")
            .log_to(self.dir.path().join(format!("{id}.log")));
        for (k, v) in env {
            agw = agw.env(k, v);
        }
        let mut agw = agw.spawn();
        agw.wait_registered();
        self.workers.push(agw);
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        self.child.log()
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

impl Drop for Server {
    fn drop(&mut self) {
        // Workers first (they drain and unregister), then the server.
        for w in &mut self.workers {
            w.terminate();
        }
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
