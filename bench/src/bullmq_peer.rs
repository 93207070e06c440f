//! The second peer: BullMQ, the Node.js job queue on Redis, running the
//! bench's workload from the harness in `bench/bullmq/` (`run.mjs`, its
//! `package.json` and the committed `package-lock.json`; install it with
//! `npm ci --prefix bench/bullmq`).
//!
//! The bench starts a fresh `redis-server` for it ([`RedisServer::start`]:
//! its own temporary directory, `--appendonly yes --appendfsync everysec
//! --save ''`, the Redis peer's settings) and then one `node run.mjs`
//! child, which is the whole client side: W `Worker` instances with
//! `concurrency: S` (each with its own connections), and the producers,
//! each a `Queue` of its own adding actions of K jobs with
//! `Queue.addBulk`. The child runs the peak phase (closed loop) and the
//! half-of-its-peak phase (open loop) like [`super::report::run_redis`],
//! measures latency, throughput and its own CPU, and writes them as JSON
//! lines on stdout ([`parse_line`]); the bench reads `redis-server`'s CPU
//! at the child's phase marks and its peak RSS from `/proc`
//! ([`super::procstat`]), as it does for the Redis peer.
//!
//! What the child measures: enqueue-to-lease is the processor's start
//! minus the submit time carried in the job's data (one clock, the child's
//! own); completion ack is the time from the processor's return to the
//! worker's `completed` event (BullMQ's `moveToFinished` script, which
//! stores the result and fetches the worker's next job in one round trip);
//! end-to-end ends at the last `completed` event. Completed jobs are kept
//! (`removeOnComplete: false`), as the Redis peer keeps every `job:<id>`.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::Deserialize;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader},
    process::{Child, Command},
};

use super::{
    procstat::{self, CpuMark},
    redis_peer::RedisServer,
    report::{Phase, SystemRun},
    stats::Summary,
    BenchArgs, BenchError,
};

/// The harness's install command, relative to the repository root.
pub const INSTALL_HINT: &str = "run `npm ci --prefix bench/bullmq` to compare against BullMQ";

/// Most BullMQ `Worker`s the bench starts in its one node process (each
/// holds two Redis connections; 1,000 take about 400 MB of node's memory).
/// With more, as in the 10,000-worker fleet measurement, the peer is skipped.
pub const MAX_WORKERS: usize = 1000;

/// Producers of the harness's open-loop phase (its `PACED_PRODUCERS`).
const PACED_PRODUCERS: usize = 8;

/// Bytes of the child's stderr kept for error messages (the last ones).
const STDERR_TAIL: usize = 4096;

/// Longest wait for the child to exit once its stdout closed.
const EXIT_WAIT: Duration = Duration::from_secs(10);

/// The harness directory this bench was built from: `bench/bullmq` beside
/// this crate's `Cargo.toml` (fixed at compile time).
pub fn default_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/bullmq"))
}

/// The harness directory of a run: `--bullmq-dir` (`AGQ_BENCH_BULLMQ_DIR`)
/// when given, else [`default_dir`].
pub fn dir(args: &BenchArgs) -> PathBuf {
    args.bullmq_dir.clone().unwrap_or_else(default_dir)
}

/// Checks that the peer can run from `dir`: `node` answers `--version` and
/// `dir` holds `run.mjs` and an installed `node_modules/bullmq`.
///
/// Errors: why it cannot, as one sentence for the report's skip line.
pub fn check(dir: &Path) -> Result<(), String> {
    let node = std::process::Command::new("node")
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !node.is_ok_and(|s| s.success()) {
        return Err("node not found on PATH: install Node.js (>= 20) and \
                    run `npm ci --prefix bench/bullmq` to compare against BullMQ"
            .into());
    }
    if !dir.join("run.mjs").is_file() {
        return Err(format!(
            "no harness at {} (set --bullmq-dir to bench/bullmq)",
            dir.join("run.mjs").display()
        ));
    }
    if !dir.join("node_modules/bullmq/package.json").is_file() {
        return Err(format!(
            "{} is not installed: {INSTALL_HINT}",
            dir.join("node_modules").display()
        ));
    }
    Ok(())
}

/// Connections the peer opens: two per worker (BullMQ's normal and
/// blocking connection), one per producer, and a margin.
pub fn connections(args: &BenchArgs) -> usize {
    2 * args.workers + args.clients.max(PACED_PRODUCERS) + 16
}

/// A latency summary as the harness writes it (milliseconds).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct NodeSummary {
    /// Samples.
    pub count: u64,
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile (nearest rank), ms.
    pub p99_ms: f64,
    /// Largest, ms.
    pub max_ms: f64,
}

impl From<&NodeSummary> for Summary {
    fn from(s: &NodeSummary) -> Summary {
        Summary {
            count: s.count,
            p50: s.p50_ms,
            p99: s.p99_ms,
            max: s.max_ms,
        }
    }
}

/// One phase's figures as the harness writes them.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct NodePhase {
    /// Jobs submitted (whole actions of K).
    pub jobs: u64,
    /// Jobs whose `completed` event arrived.
    pub completed: u64,
    /// Seconds from the first submit to the last `addBulk`'s reply.
    pub submit_secs: f64,
    /// Seconds from the first submit to the last `completed` event.
    pub e2e_secs: f64,
    /// Offered rate, jobs/s (0: closed loop).
    pub rate: f64,
    /// Enqueue-to-lease latency.
    pub lease: NodeSummary,
    /// Completion ack latency.
    pub ack: NodeSummary,
    /// CPU seconds of the node process during the phase (`process.cpuUsage`).
    pub client_cpu_secs: f64,
    /// Failed jobs, worker or queue errors, and a phase that timed out.
    pub errors: u64,
    /// The last of those errors.
    pub last_error: Option<String>,
}

/// The harness's final line.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct NodeResult {
    /// `process.version` of the node that ran it.
    pub node: String,
    /// The installed bullmq version.
    pub bullmq: String,
    /// The peak phase.
    pub peak: NodePhase,
    /// The half-of-peak phase (absent when skipped).
    pub paced: Option<NodePhase>,
}

/// Which edge of a phase a mark is.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MarkAt {
    /// Right before the phase's first submit.
    Start,
    /// Right after its last completion (or its timeout).
    End,
}

/// One line of the harness's stdout.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Line {
    /// A phase starts or ends.
    Mark {
        /// `peak` or `paced`.
        phase: String,
        /// Which edge.
        at: MarkAt,
    },
    /// The figures (last line).
    Result(Box<NodeResult>),
    /// The harness gave up.
    Error {
        /// Why.
        message: String,
    },
}

/// Parses one stdout line of the harness. Blank lines and lines that do
/// not start with `{` (stray output of a library) give `Ok(None)`.
///
/// Errors: [`BenchError::Failed`] for a `{` line that is not one of the
/// harness's events.
pub fn parse_line(line: &str) -> Result<Option<Line>, BenchError> {
    let line = line.trim();
    if !line.starts_with('{') {
        return Ok(None);
    }
    serde_json::from_str(line).map(Some).map_err(|e| {
        let shown: String = line.chars().take(200).collect();
        BenchError::Failed(format!("BullMQ harness: bad line ({e}): {shown}"))
    })
}

/// Everything the BullMQ peer measured.
#[derive(Debug, Clone, Default)]
pub struct BullmqRun {
    /// The figures, in the report's shape (no idle phase).
    pub run: SystemRun,
    /// `process.version` of node.
    pub node: String,
    /// The bullmq version.
    pub bullmq: String,
}

/// The server side of one phase, read by the bench: redis-server CPU
/// seconds between the phase's marks and its peak RSS (bytes) at the end.
#[derive(Debug, Clone, Copy, Default)]
struct ServerSide {
    cpu: f64,
    peak_rss: u64,
}

/// Converts a phase of the harness into the report's [`Phase`].
///
/// Errors: [`BenchError::Failed`] when a figure is negative or not finite.
fn to_phase(p: &NodePhase, server: ServerSide) -> Result<Phase, BenchError> {
    let figures = [
        p.submit_secs,
        p.e2e_secs,
        p.rate,
        p.client_cpu_secs,
        p.lease.p50_ms,
        p.lease.p99_ms,
        p.lease.max_ms,
        p.ack.p50_ms,
        p.ack.p99_ms,
        p.ack.max_ms,
    ];
    if figures.iter().any(|f| !f.is_finite() || *f < 0.0) {
        return Err(BenchError::Failed(format!(
            "BullMQ harness: a figure is negative or not finite: {p:?}"
        )));
    }
    Ok(Phase {
        jobs: p.jobs,
        completed: p.completed,
        submit_secs: p.submit_secs,
        e2e_secs: p.e2e_secs,
        lease: (&p.lease).into(),
        ack: (&p.ack).into(),
        server_cpu: server.cpu,
        client_cpu: p.client_cpu_secs,
        peak_rss: server.peak_rss,
        errors: p.errors,
        last_error: p.last_error.clone(),
        rate: p.rate,
        ..Phase::default()
    })
}

/// The harness's command line for `args` against redis on `port`.
fn command(args: &BenchArgs, dir: &Path, port: u16) -> Command {
    let mut cmd = Command::new("node");
    cmd.arg(dir.join("run.mjs"))
        .arg("--port")
        .arg(port.to_string())
        .arg("--workers")
        .arg(args.workers.max(1).to_string())
        .arg("--concurrency")
        .arg(args.slots.max(1).to_string())
        .arg("--jobs")
        .arg(args.jobs.max(1).to_string())
        .arg("--batch")
        .arg(args.per_action.to_string())
        .arg("--payload-bytes")
        .arg(args.payload_bytes.to_string())
        .arg("--clients")
        .arg(args.clients.max(1).to_string())
        .arg("--paced-secs")
        .arg(args.paced_secs.to_string())
        .arg("--timeout-secs")
        .arg(args.timeout_secs.max(1).to_string())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Keeps the last [`STDERR_TAIL`] bytes of the child's stderr.
fn collect_stderr(child: &mut Child) -> Arc<Mutex<Vec<u8>>> {
    let tail = Arc::new(Mutex::new(Vec::new()));
    if let Some(mut err) = child.stderr.take() {
        let tail = tail.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            // Ends at EOF or on a read error (the child is gone).
            while let Ok(n) = err.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                t.extend_from_slice(&buf[..n]);
                let excess = t.len().saturating_sub(STDERR_TAIL);
                t.drain(..excess);
            }
        });
    }
    tail
}

fn stderr_text(tail: &Mutex<Vec<u8>>) -> String {
    let t = tail.lock().unwrap_or_else(|e| e.into_inner());
    let text = String::from_utf8_lossy(&t).trim().to_string();
    if text.is_empty() {
        "(no stderr)".into()
    } else {
        format!("stderr: {text}")
    }
}

/// Runs the BullMQ half of the default mode with the harness in `dir`: a
/// fresh redis-server, then `node run.mjs`, read until its result line.
/// The child is killed when the run takes longer than three times
/// `--timeout-secs` plus 30 s (setup, peak and half-peak are each bounded
/// by `--timeout-secs` in the child), when it fails, and on drop.
///
/// Errors: [`BenchError::Setup`] when redis-server or node cannot be
/// started; [`BenchError::Io`] when the child's stdout cannot be read;
/// [`BenchError::Failed`] for a timeout, an error event, a bad line, or an
/// exit without a result (with the tail of its stderr).
pub async fn run(args: &BenchArgs, dir: &Path) -> Result<BullmqRun, BenchError> {
    let server = RedisServer::start(&args.base_dir(), connections(args) + 64).await?;
    let mut child = command(args, dir, server.addr.port())
        .spawn()
        .map_err(|e| BenchError::Setup(format!("cannot start node: {e}")))?;
    let stderr = collect_stderr(&mut child);
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| BenchError::Setup("node's stdout is not piped".into()))?;
    let limit = Duration::from_secs(args.timeout_secs.max(1).saturating_mul(3) + 30);
    let deadline = tokio::time::Instant::now() + limit;
    let mut lines = BufReader::new(stdout).lines();
    let mut marks: HashMap<String, CpuMark> = HashMap::new();
    let mut server_side: HashMap<String, ServerSide> = HashMap::new();
    let mut result: Option<NodeResult> = None;
    let read = async {
        loop {
            let line = match tokio::time::timeout_at(deadline, lines.next_line()).await {
                Err(_) => {
                    return Err(BenchError::Failed(format!(
                        "BullMQ harness did not finish within {} s",
                        limit.as_secs()
                    )))
                }
                Ok(Err(e)) => return Err(BenchError::Io(e)),
                Ok(Ok(None)) => return Ok(()),
                Ok(Ok(Some(line))) => line,
            };
            match parse_line(&line)? {
                None => {}
                Some(Line::Mark {
                    phase,
                    at: MarkAt::Start,
                }) => {
                    marks.insert(phase, CpuMark::now(Some(server.pid())));
                }
                Some(Line::Mark {
                    phase,
                    at: MarkAt::End,
                }) => {
                    let cpu = marks.get(&phase).map_or(0.0, |m| m.since().2);
                    let peak_rss = procstat::peak_rss(Some(server.pid()));
                    server_side.insert(phase, ServerSide { cpu, peak_rss });
                }
                Some(Line::Result(r)) => result = Some(*r),
                Some(Line::Error { message }) => {
                    return Err(BenchError::Failed(format!("BullMQ harness: {message}")))
                }
            }
        }
    }
    .await;
    if let Err(e) = read {
        let _ = child.kill().await;
        return Err(match e {
            BenchError::Failed(m) => BenchError::Failed(format!("{m}; {}", stderr_text(&stderr))),
            e => e,
        });
    }
    let status = match tokio::time::timeout(EXIT_WAIT, child.wait()).await {
        Ok(Ok(status)) => Some(status),
        _ => {
            let _ = child.kill().await;
            None
        }
    };
    let Some(result) = result else {
        return Err(BenchError::Failed(format!(
            "BullMQ harness exited ({}) without a result; {}",
            status.map_or_else(|| "killed".to_string(), |s| s.to_string()),
            stderr_text(&stderr)
        )));
    };
    let side = |name: &str| server_side.get(name).copied().unwrap_or_default();
    let peak = to_phase(&result.peak, side("peak"))?;
    let paced = match &result.paced {
        Some(p) => Some(to_phase(p, side("paced"))?),
        None => None,
    };
    drop(server);
    Ok(BullmqRun {
        run: SystemRun {
            idle: None,
            peak,
            paced,
        },
        node: result.node,
        bullmq: result.bullmq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RESULT: &str = r#"{"event":"result","node":"v20.20.2","bullmq":"6.7.0","peak":{"jobs":400,"completed":400,"leased":400,"submit_secs":0.069,"e2e_secs":0.143,"rate":0,"lease":{"count":400,"p50_ms":69.3,"p99_ms":75.5,"max_ms":75.9},"ack":{"count":400,"p50_ms":1.7,"p99_ms":9.1,"max_ms":10.2},"client_cpu_secs":0.17,"errors":0,"last_error":null},"paced":null}"#;

    #[test]
    fn parses_marks_and_the_result() {
        let mark = parse_line(r#"{"event":"mark","phase":"peak","at":"start"}"#).unwrap();
        assert_eq!(
            mark,
            Some(Line::Mark {
                phase: "peak".into(),
                at: MarkAt::Start
            })
        );
        let Some(Line::Result(r)) = parse_line(RESULT).unwrap() else {
            panic!("not a result");
        };
        assert_eq!(r.bullmq, "6.7.0");
        assert!(r.paced.is_none());
        let p = to_phase(
            &r.peak,
            ServerSide {
                cpu: 0.5,
                peak_rss: 1 << 20,
            },
        )
        .unwrap();
        assert_eq!((p.jobs, p.completed), (400, 400));
        assert!((p.lease.p99 - 75.5).abs() < 1e-9);
        assert!((p.server_cpu - 0.5).abs() < 1e-9);
        assert!(p.e2e_rate() > 2000.0);
    }

    #[test]
    fn bad_lines_are_errors_not_panics() {
        assert!(parse_line("").unwrap().is_none());
        assert!(parse_line("(node) warning").unwrap().is_none());
        assert!(parse_line("{not json").is_err());
        assert!(parse_line(r#"{"event":"nope"}"#).is_err());
        assert!(parse_line(r#"{"event":"result","node":"v20"}"#).is_err());
        // NaN is written as null by JSON.stringify: not a number here.
        let nan = RESULT.replace("\"e2e_secs\":0.143", "\"e2e_secs\":null");
        assert!(parse_line(&nan).is_err());
        let Some(Line::Result(r)) = parse_line(&RESULT.replace("0.069", "-1")).unwrap() else {
            panic!("not a result");
        };
        assert!(to_phase(&r.peak, ServerSide::default()).is_err());
    }

    #[test]
    fn error_events_parse() {
        let e = parse_line(r#"{"event":"error","message":"boom"}"#).unwrap();
        assert_eq!(
            e,
            Some(Line::Error {
                message: "boom".into()
            })
        );
    }
}
