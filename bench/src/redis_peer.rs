//! The peer: the seed design on a real `redis-server`, started by the bench
//! on a free loopback port in a temporary directory with
//! `--appendonly yes --appendfsync everysec --save ''`.
//!
//! Submit: per action, one pipeline of `LPUSH queue:ready <job json>` and
//! `SET job:<id> pending` for each job. Worker: `BRPOP queue:ready`, then
//! `SET job:<id>:worker <worker>` and `SET job:<id> running` (pipelined, as
//! the seed's worker set both before running), then `SET job:<id> <result
//! json>` once done. A worker with S slots is S connections.
//!
//! The client is the `redis` crate (RESP2). Every connection the bench
//! opens is its own TCP connection (one [`MultiplexedConnection`] per
//! submit client and per worker slot, never cloned or shared), so a slot
//! blocked in BRPOP holds up no one else and the connection count is the
//! one `maxclients` is sized for. Connections are opened with TCP_NODELAY,
//! without the `CLIENT SETINFO` handshake and without a response timeout.

use std::{
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use redis::{
    aio::MultiplexedConnection, io::tcp::TcpSettings, AsyncConnectionConfig, Client,
    ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, RedisError,
};
use serde::{Deserialize, Serialize};

use super::{
    agq_load::{job_input, task_result},
    harness::TempDir,
    stats::{now_us, Recorder},
    BenchError,
};

/// How to install the peer when it is missing.
pub const INSTALL_HINT: &str =
    "redis-server not found on PATH: install it with `apt-get install redis-server` \
     (Debian/Ubuntu) to compare against the Redis-list design";

/// A running `redis-server` child, killed when dropped.
pub struct RedisServer {
    /// Its address.
    pub addr: SocketAddr,
    child: Child,
    _dir: TempDir,
}

/// True when `redis-server` can be run.
pub fn available() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl RedisServer {
    /// Starts `redis-server` on a free 127.0.0.1 port in a fresh directory
    /// under `base`, allowing `max_clients` connections; returns once it
    /// answers PING (at most 10 s).
    ///
    /// Errors: it cannot be started or does not answer.
    pub async fn start(base: &Path, max_clients: usize) -> Result<RedisServer, BenchError> {
        let dir = TempDir::new(base, "redis")?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")
                .map_err(|e| BenchError::Setup(format!("bind: {e}")))?;
            l.local_addr()
                .map_err(|e| BenchError::Setup(e.to_string()))?
                .port()
        };
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--appendonly", "yes", "--appendfsync", "everysec"])
            .args(["--save", ""])
            .args(["--maxclients", &max_clients.max(128).to_string()])
            .args(["--protected-mode", "yes", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Setup(format!("cannot start redis-server: {e}")))?;
        let server = RedisServer {
            addr,
            child,
            _dir: dir,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let client = client(addr)?;
        loop {
            if let Ok(mut c) = connect(&client).await {
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut c).await;
                if pong.is_ok_and(|s| s == "PONG") {
                    return Ok(server);
                }
            }
            if tokio::time::Instant::now() > deadline {
                return Err(BenchError::Setup(
                    "redis-server did not answer PING within 10 s".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Its process id (for CPU and RSS).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A job as the seed design stored it in `queue:ready`.
#[derive(Serialize, Deserialize)]
struct JobJson {
    job_id: String,
    action_id: String,
    plan_id: String,
    input: std::collections::HashMap<String, String>,
}

#[derive(Serialize)]
struct ResultJson {
    status: &'static str,
    worker_id: String,
    task_results: Vec<TaskResultJson>,
}

#[derive(Serialize)]
struct TaskResultJson {
    task_number: u32,
    command: String,
    exit_code: i32,
    stdout: String,
    stderr: String,
    duration_ms: u64,
}

/// Maps a Redis client error on `what` into a [`BenchError`]: I/O failures
/// (cannot connect, connection closed) as [`BenchError::Io`], error replies
/// and replies of an unexpected shape as [`BenchError::Failed`].
fn redis_err(what: &'static str) -> impl Fn(RedisError) -> BenchError {
    move |e| {
        if e.is_io_error() {
            BenchError::Io(std::io::Error::other(format!("{what}: {e}")))
        } else {
            BenchError::Failed(format!("redis {what}: {e}"))
        }
    }
}

/// A client for the server at `addr`: TCP_NODELAY, no `CLIENT SETINFO`
/// on connect (the handshake is the TCP connect alone).
///
/// Errors: the address is refused by the crate (not expected for an IP).
fn client(addr: SocketAddr) -> Result<Client, BenchError> {
    let info = ConnectionAddr::Tcp(addr.ip().to_string(), addr.port())
        .into_connection_info()
        .map_err(redis_err("connect"))?
        .set_tcp_settings(TcpSettings::default().set_nodelay(true))
        .set_redis_settings(RedisConnectionInfo::default().set_skip_set_lib_name());
    Client::open(info).map_err(redis_err("connect"))
}

/// Opens one new TCP connection through `client`, with no connect or
/// response timeout (a BRPOP may wait, and a loaded server may be slow;
/// the bench's own deadlines apply). Each call is its own connection: the
/// bench never clones a [`MultiplexedConnection`], so a blocking BRPOP
/// holds up only its own slot.
///
/// Errors: the connect error.
async fn connect(client: &Client) -> Result<MultiplexedConnection, BenchError> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(None)
        .set_response_timeout(None);
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(redis_err("connect"))
}

/// Submits action `a` (jobs `a*k ..`) in one pipeline.
async fn submit_action(
    conn: &mut MultiplexedConnection,
    a: usize,
    k: usize,
    payload: &str,
) -> Result<(), BenchError> {
    let t = now_us();
    let action_id = format!("action-{a}");
    let mut pipe = redis::pipe();
    for j in 0..k {
        let i = (a * k + j) as u64;
        let job = JobJson {
            job_id: uuid::Uuid::now_v7().to_string(),
            action_id: action_id.clone(),
            plan_id: "bench".into(),
            input: job_input(i, t, payload),
        };
        let json = serde_json::to_vec(&job).map_err(|e| BenchError::Failed(e.to_string()))?;
        let key = format!("job:{}", job.job_id);
        pipe.cmd("LPUSH").arg("queue:ready").arg(json.as_slice());
        pipe.cmd("SET").arg(key).arg("pending");
    }
    pipe.exec_async(conn).await.map_err(redis_err("submit"))
}

/// Submits `actions` actions of `k` jobs from `clients` connections, closed loop.
///
/// Errors: Redis errors.
pub async fn submit_closed_loop(
    addr: SocketAddr,
    clients: usize,
    actions: usize,
    k: usize,
    payload: Arc<str>,
) -> Result<(), BenchError> {
    let client = client(addr)?;
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients.max(1) {
        let next = next.clone();
        let payload = payload.clone();
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = connect(&client).await?;
            loop {
                let a = next.fetch_add(1, Ordering::Relaxed);
                if a >= actions {
                    return Ok::<_, BenchError>(());
                }
                submit_action(&mut conn, a, k, &payload).await?;
            }
        }));
    }
    super::join_submitters(tasks).await
}

/// Submits `actions` actions of `k` jobs at `jobs_per_sec` (open loop, a
/// small pool of connections so a slow reply does not delay the next send).
///
/// Errors: Redis errors.
pub async fn submit_paced(
    addr: SocketAddr,
    actions: usize,
    k: usize,
    jobs_per_sec: f64,
    payload: Arc<str>,
) -> Result<(), BenchError> {
    let period = Duration::from_secs_f64(k as f64 / jobs_per_sec.max(1.0));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (tx, rx) = submit_pool(8, addr, k, payload).await?;
    for a in 0..actions {
        ticker.tick().await;
        if tx.send(a).await.is_err() {
            break;
        }
    }
    drop(tx);
    super::join_submitters(rx).await
}

type PoolTasks = Vec<tokio::task::JoinHandle<Result<(), BenchError>>>;

/// `n` connections taking action numbers from one shared queue.
async fn submit_pool(
    n: usize,
    addr: SocketAddr,
    k: usize,
    payload: Arc<str>,
) -> Result<(tokio::sync::mpsc::Sender<usize>, PoolTasks), BenchError> {
    let (tx, rx) = tokio::sync::mpsc::channel::<usize>(1024);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let client = client(addr)?;
    let mut tasks = Vec::new();
    for _ in 0..n {
        let mut conn = connect(&client).await?;
        let rx = rx.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let next = rx.lock().await.recv().await;
                let Some(a) = next else { return Ok(()) };
                submit_action(&mut conn, a, k, &payload).await?;
            }
        }));
    }
    Ok((tx, tasks))
}

/// Runs `workers` x `slots` worker connections until `stop` is set. Each
/// BRPOPs with a 0.2 s timeout so it notices the stop.
///
/// Errors: connection failures at start.
pub async fn start_workers(
    addr: SocketAddr,
    workers: usize,
    slots: u32,
    rec: Arc<Recorder>,
    stop: Arc<AtomicBool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, BenchError> {
    let client = client(addr)?;
    let mut tasks = Vec::new();
    for w in 0..workers {
        for _ in 0..slots.max(1) {
            let mut conn = connect(&client).await?;
            let rec = rec.clone();
            let stop = stop.clone();
            let worker_id = format!("redis-worker-{w}");
            tasks.push(tokio::spawn(async move {
                let mut freed: Option<u64> = None;
                while !stop.load(Ordering::Relaxed) {
                    if let Err(e) =
                        work_one(&mut conn, &worker_id, &rec, &mut freed, slots == 1).await
                    {
                        rec.error(format!("{worker_id}: {e}"));
                        return;
                    }
                }
            }));
        }
    }
    Ok(tasks)
}

/// One BRPOP on `conn` and, when it popped a job, its two pipelined SETs
/// and the result SET, recorded in `rec` (`freed` carries the previous
/// completion time of a one-slot worker, for the lease gap).
///
/// Errors: Redis errors and a job that is not the seed's JSON.
async fn work_one(
    conn: &mut MultiplexedConnection,
    worker_id: &str,
    rec: &Recorder,
    freed: &mut Option<u64>,
    one_slot: bool,
) -> Result<(), BenchError> {
    // (key, element), or nil when the 0.2 s timeout passed.
    let popped: Option<(Vec<u8>, Vec<u8>)> = redis::cmd("BRPOP")
        .arg("queue:ready")
        .arg("0.2")
        .query_async(conn)
        .await
        .map_err(redis_err("BRPOP"))?;
    let Some((_, json)) = popped else {
        return Ok(());
    };
    let now = now_us();
    let job: JobJson =
        serde_json::from_slice(&json).map_err(|e| BenchError::Failed(format!("job json: {e}")))?;
    let t = job.input.get("t").and_then(|t| t.parse().ok());
    rec.leased(t, if one_slot { freed.take() } else { None }, now);
    let key = format!("job:{}", job.job_id);
    let worker_key = format!("job:{}:worker", job.job_id);
    let mut pipe = redis::pipe();
    pipe.cmd("SET").arg(worker_key).arg(worker_id);
    pipe.cmd("SET").arg(&key).arg("running");
    pipe.exec_async(conn)
        .await
        .map_err(redis_err("SET running"))?;
    let r = task_result();
    let result = ResultJson {
        status: "completed",
        worker_id: worker_id.to_string(),
        task_results: vec![TaskResultJson {
            task_number: r.task_number,
            command: r.command,
            exit_code: r.exit_code,
            stdout: r.stdout,
            stderr: r.stderr,
            duration_ms: r.duration_ms,
        }],
    };
    let body = serde_json::to_vec(&result).map_err(|e| BenchError::Failed(e.to_string()))?;
    let sent = now_us();
    redis::cmd("SET")
        .arg(key)
        .arg(body.as_slice())
        .exec_async(conn)
        .await
        .map_err(redis_err("SET result"))?;
    let done = now_us();
    rec.completed_at(sent, done);
    if one_slot {
        *freed = Some(done);
    }
    Ok(())
}
