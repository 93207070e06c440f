//! The AGQ server under test: [`agq::local::LocalServer`] on 127.0.0.1:0
//! with a temporary database, on its own tokio runtime whose threads are
//! named `agq-srv` so its CPU time can be told apart from the simulated
//! clients'; or the real `agq serve` as a child process.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use tonic::transport::{Channel, Endpoint};

use super::BenchError;
use agq::{
    auth::Authenticator,
    config::{EngineConfig, SyncMode},
    local::LocalServer,
    server::{self, ServerOptions},
};

/// A directory removed (with its contents) when dropped.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates a fresh directory `agq-bench-<pid>-<n>-<tag>` under `base`.
    ///
    /// Errors: the directory cannot be created.
    pub fn new(base: &Path, tag: &str) -> Result<TempDir, BenchError> {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = base.join(format!("agq-bench-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&path)
            .map_err(|e| BenchError::Setup(format!("cannot create {}: {e}", path.display())))?;
        Ok(TempDir { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A running in-process AGQ server.
pub struct Harness {
    /// Its gRPC address.
    pub addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
    server: Option<LocalServer>,
    child: Option<std::process::Child>,
    dir: TempDir,
}

impl Harness {
    /// Starts AGQ with `cfg` on a fresh database under `base`, on a runtime
    /// of `threads` worker threads. Returns once health reports SERVING.
    ///
    /// Errors: setup failures (runtime, directory, bind, database).
    pub async fn start(
        base: &Path,
        cfg: EngineConfig,
        sync: SyncMode,
        threads: usize,
    ) -> Result<Harness, BenchError> {
        let dir = TempDir::new(base, "agq")?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("agq-srv")
            .thread_keep_alive(Duration::from_secs(3600))
            .enable_all()
            .build()
            .map_err(|e| BenchError::Setup(format!("server runtime: {e}")))?;
        let opts = ServerOptions {
            store_ca_file: None,
            store: agq::config::Store::Sqlite,
            db: dir.path().join("agq.db"),
            sqlite_synchronous: sync,
            engine: cfg,
            auth: Authenticator::default(),
            tls: None,
            shutdown_grace: server::DEFAULT_SHUTDOWN_GRACE,
            request_buffer_bytes: agq::request_budget::DEFAULT_REQUEST_BUFFER_BYTES,
        };
        let server = match LocalServer::start_on(rt.handle(), opts, None, false).await {
            Ok(server) => server,
            Err(e) => {
                rt.shutdown_background();
                return Err(BenchError::Setup(format!("AGQ did not start: {e}")));
            }
        };
        Ok(Harness {
            addr: server.addr(),
            rt: Some(rt),
            server: Some(server),
            child: None,
            dir,
        })
    }

    /// Starts `binary serve` (the real `agq` server) as a child process on
    /// a free 127.0.0.1 port with a fresh database under `base`, so its CPU
    /// and memory are its own. Returns once it accepts connections.
    ///
    /// Errors: it cannot be started or does not listen within 30 s.
    pub async fn start_child(
        binary: &Path,
        base: &Path,
        cfg: &EngineConfig,
        sync: SyncMode,
    ) -> Result<Harness, BenchError> {
        Harness::spawn(binary, base, cfg, sync, None, None).await
    }

    /// Starts `binary serve --store <url>`: a replica of the clustered mode
    /// on the PostgreSQL database `url`, as a child process on `addr` (a
    /// free 127.0.0.1 port when `None`). Returns once it accepts
    /// connections.
    ///
    /// Errors: it cannot be started or does not listen within 30 s.
    pub async fn start_replica(
        binary: &Path,
        base: &Path,
        cfg: &EngineConfig,
        url: &str,
        addr: Option<SocketAddr>,
    ) -> Result<Harness, BenchError> {
        Harness::spawn(binary, base, cfg, SyncMode::Full, Some(url), addr).await
    }

    async fn spawn(
        binary: &Path,
        base: &Path,
        cfg: &EngineConfig,
        sync: SyncMode,
        store: Option<&str>,
        addr: Option<SocketAddr>,
    ) -> Result<Harness, BenchError> {
        let dir = TempDir::new(base, "agq-child")?;
        let addr: SocketAddr = match addr {
            Some(a) => a,
            None => std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| BenchError::Setup(format!("bind 127.0.0.1:0: {e}")))?,
        };
        let sync = match sync {
            SyncMode::Full => "full",
            SyncMode::Normal => "normal",
        };
        let mut cmd = std::process::Command::new(binary);
        cmd.arg("serve");
        match store {
            Some(url) => cmd.args(["--store", url]),
            None => cmd.env_remove("AGQ_STORE"),
        };
        let child = cmd
            .args([
                "--listen",
                &addr.to_string(),
                "--metrics-listen",
                "127.0.0.1:0",
                "--no-console",
            ])
            .arg("--db")
            .arg(dir.path().join("agq.db"))
            .args([
                "--heartbeat-interval-ms",
                &cfg.heartbeat_interval.as_millis().to_string(),
                "--sqlite-synchronous",
                sync,
                "--max-inputs-per-action",
                &cfg.max_inputs_per_action.to_string(),
                "--job-retention-secs",
                &cfg.job_retention.map_or(0, |r| r.as_secs()).to_string(),
                "--retry-backoff-base-ms",
                &cfg.retry_backoff_base.as_millis().to_string(),
            ])
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Setup(format!("cannot start {}: {e}", binary.display())))?;
        let mut h = Harness {
            addr,
            rt: None,
            server: None,
            child: Some(child),
            dir,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(h);
            }
            if let Some(c) = h.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(BenchError::Setup(format!("agq serve exited: {status}")));
                }
            }
            if tokio::time::Instant::now() > deadline {
                return Err(BenchError::Setup(
                    "agq serve did not listen within 30 s".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// kill -9 of a child server (no graceful shutdown: a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's SQLite database file.
    pub fn db_path(&self) -> PathBuf {
        self.dir.path().join("agq.db")
    }

    /// The server's process id when it runs as a child process.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The server's commits so far, from its `commit_batch_ops` and
    /// `store_commit_seconds` histograms: how well group commit batches
    /// and how long each commit (WAL write and sync) takes (in-process
    /// only; zero otherwise).
    pub fn commits(&self) -> CommitStats {
        let Some(server) = &self.server else {
            return CommitStats::default();
        };
        let text = server.engine().metrics().encode();
        let find = |suffix: &str| {
            text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
                let (name, v) = l.split_once(' ')?;
                name.ends_with(suffix)
                    .then(|| v.trim().parse::<f64>().ok())?
            })
        };
        let timed = find("store_commit_seconds_count").unwrap_or(0.0) as u64;
        // Commits slower than the bucket bound `le`; None when the
        // histogram has no such bucket (its bounds are
        // agq::metrics::COMMIT_SECONDS_BUCKETS).
        let over = |le: &str| {
            find(&format!("store_commit_seconds_bucket{{le=\"{le}\"}}"))
                .map(|n| timed.saturating_sub(n as u64))
        };
        CommitStats {
            commits: find("commit_batch_ops_count").unwrap_or(0.0) as u64,
            ops: find("commit_batch_ops_sum").unwrap_or(0.0) as u64,
            seconds: find("store_commit_seconds_sum").unwrap_or(0.0),
            over_3ms: over("0.003"),
            over_50ms: over("0.05"),
        }
    }

    /// A new HTTP/2 connection to the server.
    ///
    /// Errors: connection failures.
    pub async fn connect(&self) -> Result<Channel, BenchError> {
        connect(self.addr).await
    }

    /// Stops the server gracefully (streams end, database closed) and
    /// removes its directory.
    ///
    /// Errors: the server returned an error or did not stop within 60 s.
    pub async fn stop(mut self) -> Result<(), BenchError> {
        let result = match self.server.take() {
            Some(server) => {
                match tokio::time::timeout(Duration::from_secs(60), server.stop()).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(BenchError::Failed(format!("AGQ stopped with: {e}"))),
                    Err(_) => Err(BenchError::Failed("AGQ did not stop within 60 s".into())),
                }
            }
            None => Ok(()),
        };
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        if let Some(mut c) = self.child.take() {
            // SIGTERM: the graceful shutdown an operator's would get.
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return result;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = c.kill();
            let _ = c.wait();
            return Err(BenchError::Failed(
                "agq serve did not stop within 30 s".into(),
            ));
        }
        result
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Dropping the server starts its graceful shutdown.
        drop(self.server.take());
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A new HTTP/2 connection to `addr`.
///
/// Errors: connection failures.
pub async fn connect(addr: SocketAddr) -> Result<Channel, BenchError> {
    Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| BenchError::Setup(e.to_string()))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| BenchError::Setup(format!("connect to AGQ at {addr}: {e}")))
}

/// Counts of the server's commits (see [`Harness::commits`]); the
/// difference of two readings covers the time between them.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitStats {
    /// Commits.
    pub commits: u64,
    /// Operations they carried.
    pub ops: u64,
    /// Seconds spent in `COMMIT` (writing and syncing the WAL).
    pub seconds: f64,
    /// Commits that took longer than 3 ms (`None`: not known).
    pub over_3ms: Option<u64>,
    /// Commits that took longer than 50 ms, the stalls that hold every
    /// queued operation up (`None`: not known).
    pub over_50ms: Option<u64>,
}

impl std::ops::Sub for CommitStats {
    type Output = CommitStats;

    fn sub(self, before: CommitStats) -> CommitStats {
        let since =
            |now: Option<u64>, then: Option<u64>| now.zip(then).map(|(a, b)| a.saturating_sub(b));
        CommitStats {
            commits: self.commits.saturating_sub(before.commits),
            ops: self.ops.saturating_sub(before.ops),
            seconds: (self.seconds - before.seconds).max(0.0),
            over_3ms: since(self.over_3ms, before.over_3ms),
            over_50ms: since(self.over_50ms, before.over_50ms),
        }
    }
}
