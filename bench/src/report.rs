//! The default mode (peak, half-peak and idle phases on AGQ, peak and
//! half-peak on the Redis peer and on the BullMQ peer) and the printing of
//! its table, with the issue's bars.

use std::{
    path::Path,
    sync::{atomic::AtomicBool, Arc},
    time::{Duration, Instant},
};

use tonic::transport::Channel;

use super::{
    agq_load::{self, Fleet},
    bullmq_peer::{self, BullmqRun},
    harness::{CommitStats, Harness},
    procstat::{self, CpuMark},
    redis_peer::{self, RedisServer},
    stats::{now_us, Record, Recorder, Summary},
    BenchArgs, BenchError,
};

/// Most HTTP/2 connections the simulated workers open to AGQ, unless the
/// server's per-connection call limit needs more (see [`worker_connections`]).
pub const MAX_CONNECTIONS: usize = 64;

/// Streams each simulated worker keeps open: Heartbeat, LeaseJobs and
/// ReportJobs.
const STREAMS_PER_WORKER: usize = 3;

/// HTTP/2 connections for `workers` simulated workers with at most
/// `per_connection` on each: up to [`MAX_CONNECTIONS`], and as many more as
/// their streams need to stay under the server's limit of open calls per
/// connection ([`agq::server::MAX_CONCURRENT_STREAMS`], with room for the
/// unary calls of setting up). A stream beyond that limit would wait for
/// another to end, and its worker would never connect.
pub fn worker_connections(workers: usize, per_connection: usize) -> usize {
    let limit = agq::server::MAX_CONCURRENT_STREAMS as usize;
    let fit = (limit - limit / 8) / STREAMS_PER_WORKER;
    let wanted = workers
        .div_ceil(per_connection.max(1))
        .clamp(1, MAX_CONNECTIONS);
    wanted.max(workers.div_ceil(fit))
}

/// Plan id of the bench jobs.
pub const PLAN: &str = "bench";

/// Prints the machine and the settings.
pub fn print_machine(args: &BenchArgs) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gb = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown cpu".into());
    println!("agq-bench {}", env!("CARGO_PKG_VERSION"));
    println!(
        "machine: {cpus} cpus ({model}), {mem_gb:.1} GiB memory, load average before the run {}",
        load.join(" ")
    );
    println!(
        "AGQ: {}, SQLite synchronous={} (WAL), {} server threads, {} client threads",
        if args.soak_secs.is_some() || args.agq_binary.is_some() {
            "child process where found (see below)"
        } else {
            "in-process"
        },
        sync_name(args),
        args.server_threads,
        args.client_threads
    );
}

/// `FULL` or `NORMAL`.
pub fn sync_name(args: &BenchArgs) -> &'static str {
    match args.synchronous {
        agq::config::SyncMode::Full => "FULL",
        agq::config::SyncMode::Normal => "NORMAL",
    }
}

/// Waits until `target` completions are recorded or `timeout` passes.
/// Returns false on timeout.
pub async fn wait_done(rec: &Recorder, target: u64, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if rec.completed() >= target {
            return true;
        }
        let wait = tokio::time::timeout_at(deadline, rec.done.notified());
        let _ = tokio::time::timeout(Duration::from_millis(200), wait).await;
        if tokio::time::Instant::now() >= deadline {
            return rec.completed() >= target;
        }
    }
}

/// Opens `n` HTTP/2 connections to the harness.
pub async fn channels(h: &Harness, n: usize) -> Result<Vec<Channel>, BenchError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        out.push(h.connect().await?);
    }
    Ok(out)
}

/// Starts AGQ for a loaded run: as a child `binary serve` process when
/// given (its own CPU and RSS), else in-process.
///
/// Errors: setup failures.
pub async fn start_agq(args: &BenchArgs, binary: Option<&Path>) -> Result<Harness, BenchError> {
    match binary {
        Some(bin) => {
            Harness::start_child(
                bin,
                &args.base_dir(),
                &args.engine_config(),
                args.synchronous,
            )
            .await
        }
        None => {
            Harness::start(
                &args.base_dir(),
                args.engine_config(),
                args.synchronous,
                args.server_threads,
            )
            .await
        }
    }
}

/// Opens the simulated workers' connections ([`worker_connections`]) and
/// the submit clients' (at most 8), and stores the bench plan. Returns
/// (workers', clients').
///
/// Errors: connection failures, a failed SubmitPlan.
pub async fn load_channels(
    args: &BenchArgs,
    h: &Harness,
) -> Result<(Vec<Channel>, Vec<Channel>), BenchError> {
    let conns = worker_connections(args.workers, args.workers_per_connection);
    let worker_channels = channels(h, conns).await?;
    let submit_channels = channels(h, args.clients.clamp(1, 8)).await?;
    agq_load::submit_plan(submit_channels[0].clone(), PLAN).await?;
    Ok((worker_channels, submit_channels))
}

/// The figures of one loaded phase of one system.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// Jobs submitted.
    pub jobs: u64,
    /// Jobs completed.
    pub completed: u64,
    /// Seconds from the first submit to the last submit's reply.
    pub submit_secs: f64,
    /// Seconds from the first submit to the last completion's ack.
    pub e2e_secs: f64,
    /// Enqueue-to-lease latency.
    pub lease: Summary,
    /// Completion ack latency.
    pub ack: Summary,
    /// Server CPU seconds.
    pub server_cpu: f64,
    /// CPU seconds of AGQ's writer thread (the single SQLite writer).
    pub writer_cpu: f64,
    /// SQLite commits during the phase, the operations they carried and
    /// their time.
    pub commits: CommitStats,
    /// CPU seconds of the simulated clients (the bench process less the
    /// in-process server).
    pub client_cpu: f64,
    /// Peak RSS of the server, bytes (AGQ: the whole process).
    pub peak_rss: u64,
    /// Failed calls.
    pub errors: u64,
    /// The last failure.
    pub last_error: Option<String>,
    /// Offered rate of a paced phase, jobs/s.
    pub rate: f64,
}

impl Phase {
    pub(crate) fn from_record(r: Record, jobs: u64, t0: u64, submit_end: u64) -> Phase {
        Phase {
            jobs,
            completed: r.completed,
            submit_secs: (submit_end.saturating_sub(t0)) as f64 / 1e6,
            e2e_secs: (r.last_done_us.saturating_sub(t0)) as f64 / 1e6,
            lease: Summary::of(&r.enqueue_to_lease),
            ack: Summary::of(&r.completion_ack),
            errors: r.errors,
            last_error: r.last_error,
            ..Default::default()
        }
    }

    /// Submit throughput, jobs/s.
    pub fn submit_rate(&self) -> f64 {
        rate(self.jobs, self.submit_secs)
    }

    /// End-to-end throughput, jobs/s.
    pub fn e2e_rate(&self) -> f64 {
        rate(self.completed, self.e2e_secs)
    }
}

fn rate(n: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// The idle phase: workers connected, only heartbeats.
#[derive(Debug, Clone, Default)]
pub struct Idle {
    /// Seconds to register and connect every worker.
    pub connect_secs: f64,
    /// Heartbeat ack latency.
    pub heartbeat: Summary,
    /// Server CPU, share of one core.
    pub server_cpu_share: f64,
    /// Process RSS at the end of the idle phase, bytes.
    pub rss: u64,
    /// Process peak RSS up to the end of the idle phase, bytes.
    pub peak_rss: u64,
    /// Seconds measured.
    pub secs: f64,
    /// Live heap of the server's threads at the end, bytes (`None`: not
    /// counted, see [`super::heap::live`]).
    pub server_heap: Option<u64>,
    /// Live heap of the simulated clients' threads at the end, bytes.
    pub client_heap: Option<u64>,
}

impl Idle {
    /// Process RSS minus the clients' heap: an upper bound of the server's
    /// RSS (the process RSS when the heap was not counted).
    pub fn server_rss_bound(&self) -> u64 {
        self.rss.saturating_sub(self.client_heap.unwrap_or(0))
    }
}

/// Megabytes of a heap figure, or "n/a" when it was not counted.
fn heap_mb(b: Option<u64>) -> String {
    b.map_or_else(|| "n/a".to_string(), |b| format!("{:.0}", mb(b)))
}

/// Everything the default mode measured on one system.
#[derive(Debug, Clone, Default)]
pub struct SystemRun {
    /// Idle phase (AGQ only).
    pub idle: Option<Idle>,
    /// Peak phase.
    pub peak: Phase,
    /// Half-peak phase.
    pub paced: Option<Phase>,
}

/// Runs a loaded phase on AGQ: `jobs` jobs in actions of `k`, closed loop
/// from `clients` clients, or paced at `rate` jobs/s when given.
///
/// Errors: a SubmitAction failed.
#[allow(clippy::too_many_arguments)]
pub async fn agq_phase(
    args: &BenchArgs,
    h: &Harness,
    submit_channels: &[Channel],
    rec: &Arc<Recorder>,
    jobs: u64,
    rate: Option<f64>,
) -> Result<Phase, BenchError> {
    let k = args.per_action as usize;
    let actions = (jobs as usize).div_ceil(k);
    let jobs = (actions * k) as u64;
    procstat::reset_peak_rss();
    rec.reset(jobs);
    let mark = CpuMark::now(None);
    let commits0 = h.commits();
    let mark = match h.pid() {
        Some(pid) => CpuMark::now(Some(pid)),
        None => mark,
    };
    let t0 = now_us();
    match rate {
        None => {
            agq_load::submit_closed_loop(
                submit_channels,
                args.clients,
                PLAN,
                actions,
                k,
                args.payload(),
            )
            .await?
        }
        Some(r) => {
            agq_load::submit_paced(
                submit_channels[0].clone(),
                PLAN,
                actions,
                k,
                r,
                args.payload(),
            )
            .await?
        }
    }
    let submit_end = now_us();
    let finished = wait_done(rec, jobs, args.timeout()).await;
    let (mut server_cpu, process_cpu, child_cpu) = mark.since();
    if h.pid().is_some() {
        server_cpu = child_cpu;
    }
    let writer_cpu = mark.writer_since();
    let mut p = Phase::from_record(rec.take(), jobs, t0, submit_end);
    p.writer_cpu = writer_cpu;
    let commits1 = h.commits();
    p.commits = commits1 - commits0;
    if !finished {
        p.errors += 1;
        p.last_error = Some(format!(
            "only {} of {jobs} jobs completed within {} s",
            p.completed, args.timeout_secs
        ));
    }
    p.server_cpu = server_cpu;
    p.client_cpu = if h.pid().is_some() {
        process_cpu
    } else {
        (process_cpu - server_cpu).max(0.0)
    };
    p.peak_rss = procstat::peak_rss(h.pid());
    p.rate = rate.unwrap_or(0.0);
    Ok(p)
}

/// The AGQ half of the default mode.
pub async fn run_agq(args: &BenchArgs) -> Result<SystemRun, BenchError> {
    procstat::reset_peak_rss();
    let h = start_agq(args, args.agq_binary.as_deref()).await?;
    let (worker_channels, submit_channels) = load_channels(args, &h).await?;
    let rec = Arc::new(Recorder::default());
    let started = Instant::now();
    let spec = args.worker_spec(args.slots);
    let fleet = Fleet::start(&worker_channels, args.workers, "bench", spec, rec.clone()).await?;
    let connect_secs = started.elapsed().as_secs_f64();
    let mut out = SystemRun::default();
    // Idle: heartbeats only.
    rec.reset(u64::MAX);
    let mark = CpuMark::now(h.pid());
    let idle_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let secs = idle_start.elapsed().as_secs_f64();
    let (mut server_cpu, _, child_cpu) = mark.since();
    if h.pid().is_some() {
        server_cpu = child_cpu;
    }
    let r = rec.take();
    out.idle = Some(Idle {
        connect_secs,
        heartbeat: Summary::of(&r.heartbeat_ack),
        server_cpu_share: if secs > 0.0 { server_cpu / secs } else { 0.0 },
        rss: procstat::rss(h.pid()),
        peak_rss: procstat::peak_rss(h.pid()),
        secs,
        server_heap: super::heap::live(super::heap::SERVER),
        client_heap: super::heap::live(super::heap::CLIENT),
    });
    let result = async {
        out.peak = agq_phase(args, &h, &submit_channels, &rec, args.jobs as u64, None).await?;
        if args.paced_secs > 0 && out.peak.e2e_rate() > 0.0 {
            let r = out.peak.e2e_rate() / 2.0;
            let jobs = (r * args.paced_secs as f64).max(args.per_action as f64) as u64;
            out.paced = Some(agq_phase(args, &h, &submit_channels, &rec, jobs, Some(r)).await?);
        }
        Ok::<_, BenchError>(())
    }
    .await;
    fleet.stop().await;
    drop(worker_channels);
    drop(submit_channels);
    let stopped = h.stop().await;
    result?;
    stopped?;
    Ok(out)
}

/// Runs a loaded phase on Redis.
async fn redis_phase(
    args: &BenchArgs,
    server: &RedisServer,
    rec: &Arc<Recorder>,
    jobs: u64,
    rate: Option<f64>,
) -> Result<Phase, BenchError> {
    let k = args.per_action as usize;
    let actions = (jobs as usize).div_ceil(k);
    let jobs = (actions * k) as u64;
    rec.reset(jobs);
    let mark = CpuMark::now(Some(server.pid()));
    let t0 = now_us();
    match rate {
        None => {
            redis_peer::submit_closed_loop(server.addr, args.clients, actions, k, args.payload())
                .await?
        }
        Some(r) => redis_peer::submit_paced(server.addr, actions, k, r, args.payload()).await?,
    }
    let submit_end = now_us();
    let finished = wait_done(rec, jobs, args.timeout()).await;
    let (_, process_cpu, server_cpu) = mark.since();
    let mut p = Phase::from_record(rec.take(), jobs, t0, submit_end);
    if !finished {
        p.errors += 1;
        p.last_error = Some(format!(
            "only {} of {jobs} jobs completed within {} s",
            p.completed, args.timeout_secs
        ));
    }
    p.server_cpu = server_cpu;
    p.client_cpu = process_cpu;
    p.peak_rss = procstat::peak_rss(Some(server.pid()));
    p.rate = rate.unwrap_or(0.0);
    Ok(p)
}

/// The Redis half of the default mode.
pub async fn run_redis(args: &BenchArgs) -> Result<SystemRun, BenchError> {
    let conns = args.workers * args.slots as usize + args.clients + 16;
    let server = RedisServer::start(&args.base_dir(), conns + 64).await?;
    let rec = Arc::new(Recorder::default());
    let stop = Arc::new(AtomicBool::new(false));
    let workers = redis_peer::start_workers(
        server.addr,
        args.workers,
        args.slots,
        rec.clone(),
        stop.clone(),
    )
    .await?;
    let mut out = SystemRun::default();
    let result = async {
        out.peak = redis_phase(args, &server, &rec, args.jobs as u64, None).await?;
        if args.paced_secs > 0 && out.peak.e2e_rate() > 0.0 {
            let r = out.peak.e2e_rate() / 2.0;
            let jobs = (r * args.paced_secs as f64).max(args.per_action as f64) as u64;
            out.paced = Some(redis_phase(args, &server, &rec, jobs, Some(r)).await?);
        }
        Ok::<_, BenchError>(())
    }
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        let _ = tokio::time::timeout(Duration::from_secs(5), w).await;
    }
    drop(server);
    result?;
    Ok(out)
}

fn mb(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

fn ratio(a: f64, b: f64) -> String {
    if a > 0.0 && b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

/// The report's columns: AGQ, Redis and AGQ/Redis always, BullMQ and
/// AGQ/BullMQ when the BullMQ peer ran.
#[derive(Debug, Clone, Copy)]
struct Table {
    bullmq: bool,
}

/// A peer's cells in one row: its figure and AGQ's ratio to it.
type Cells = (Option<String>, Option<String>);

/// AGQ's figure of a phase against a peer's, as a ratio cell.
type Cmp<'a> = &'a dyn Fn(&Phase, &Phase) -> String;

impl Table {
    fn header(&self) {
        self.row(
            "",
            "AGQ".into(),
            (Some("Redis".into()), Some("AGQ/Redis".into())),
            (Some("BullMQ".into()), Some("AGQ/BullMQ".into())),
        );
    }

    /// One row: AGQ's figure, then (figure, ratio) of Redis and of BullMQ
    /// (a missing figure is `-`, a missing ratio blank; no trailing blanks).
    fn row(&self, name: &str, agq: String, redis: Cells, bullmq: Cells) {
        let mut line = format!(
            "  {name:<38} {agq:>14} {:>14} {:>10}",
            redis.0.unwrap_or_else(|| "-".into()),
            redis.1.unwrap_or_default()
        );
        if self.bullmq {
            line.push_str(&format!(
                " {:>14} {:>11}",
                bullmq.0.unwrap_or_else(|| "-".into()),
                bullmq.1.unwrap_or_default()
            ));
        }
        println!("{}", line.trim_end());
    }

    /// A row of AGQ's figure alone.
    fn agq_row(&self, name: &str, agq: String) {
        self.row(name, agq, (None, None), (None, None));
    }

    /// A row of a loaded phase: `value` of each system and, with `cmp`,
    /// AGQ's figure against each peer's.
    fn phase_row(
        &self,
        name: &str,
        a: &Phase,
        peers: [Option<&Phase>; 2],
        value: &dyn Fn(&Phase) -> String,
        cmp: Option<Cmp<'_>>,
    ) {
        let cells =
            |p: Option<&Phase>| -> Cells { (p.map(value), p.and_then(|p| cmp.map(|c| c(a, p)))) };
        self.row(name, value(a), cells(peers[0]), cells(peers[1]));
    }
}

fn lat(s: &Summary) -> String {
    format!("{:.2}/{:.2}/{:.1}", s.p50, s.p99, s.max)
}

/// Server CPU per completed job, µs.
fn cpu_per_job(p: &Phase) -> f64 {
    if p.completed > 0 {
        p.server_cpu * 1e6 / p.completed as f64
    } else {
        0.0
    }
}

/// Prints a loaded phase of AGQ (`a`) beside the peers' (Redis, BullMQ).
fn print_phase(t: &Table, a: &Phase, peers: [Option<&Phase>; 2], paced: bool) {
    if !paced {
        t.phase_row(
            "submit throughput (jobs/s)",
            a,
            peers,
            &|p| format!("{:.0}", p.submit_rate()),
            Some(&|a, p| ratio(a.submit_rate(), p.submit_rate())),
        );
    } else {
        t.phase_row(
            "offered load (jobs/s)",
            a,
            peers,
            &|p| format!("{:.0}", p.rate),
            None,
        );
    }
    t.phase_row(
        "end-to-end throughput (jobs/s)",
        a,
        peers,
        &|p| format!("{:.0}", p.e2e_rate()),
        Some(&|a, p| ratio(a.e2e_rate(), p.e2e_rate())),
    );
    t.phase_row(
        "jobs completed",
        a,
        peers,
        &|p| format!("{}/{}", p.completed, p.jobs),
        None,
    );
    t.phase_row(
        "enqueue-to-lease p50/p99/max (ms)",
        a,
        peers,
        &|p| lat(&p.lease),
        Some(&|a, p| ratio(a.lease.p99, p.lease.p99) + " p99"),
    );
    t.phase_row(
        "completion ack p50/p99/max (ms)",
        a,
        peers,
        &|p| lat(&p.ack),
        Some(&|a, p| ratio(a.ack.p99, p.ack.p99) + " p99"),
    );
    t.phase_row(
        "server CPU (s)",
        a,
        peers,
        &|p| format!("{:.2}", p.server_cpu),
        Some(&|a, p| ratio(a.server_cpu, p.server_cpu)),
    );
    t.phase_row(
        "server CPU per job (µs)",
        a,
        peers,
        &|p| format!("{:.1}", cpu_per_job(p)),
        Some(&|a, p| ratio(cpu_per_job(a), cpu_per_job(p))),
    );
    if a.e2e_secs > 0.0 && a.completed > 0 && a.writer_cpu > 0.0 {
        t.agq_row(
            "AGQ writer thread: busy %, CPU/job (µs)",
            format!(
                "{:.0}%, {:.1}",
                a.writer_cpu * 100.0 / a.e2e_secs,
                a.writer_cpu * 1e6 / a.completed as f64
            ),
        );
    }
    let c = a.commits;
    if c.commits > 0 {
        t.agq_row(
            "AGQ commits/s, operations per commit",
            format!(
                "{:.0}, {:.1}",
                c.commits as f64 / a.e2e_secs.max(1e-9),
                c.ops as f64 / c.commits as f64
            ),
        );
        t.agq_row(
            "AGQ commit ms, % over 3 ms, n over 50 ms",
            format!(
                "{:.2}, {}, {}",
                c.seconds * 1e3 / c.commits as f64,
                c.over_3ms.map_or("-".into(), |n| format!(
                    "{:.1}%",
                    n as f64 * 100.0 / c.commits as f64
                )),
                c.over_50ms.map_or("-".into(), |n| n.to_string())
            ),
        );
    }
    t.phase_row(
        "client CPU (s)",
        a,
        peers,
        &|p| format!("{:.2}", p.client_cpu),
        None,
    );
    t.phase_row(
        "peak RSS (MB)",
        a,
        peers,
        &|p| format!("{:.0}", mb(p.peak_rss)),
        None,
    );
    for (name, p) in [("AGQ", Some(a)), ("Redis", peers[0]), ("BullMQ", peers[1])] {
        if let Some(p) = p {
            if p.errors > 0 {
                println!(
                    "  {name}: {} errors, last: {}",
                    p.errors,
                    p.last_error.clone().unwrap_or_default()
                );
            }
        }
    }
}

/// Met / missed.
pub fn verdict(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "MISSED"
    }
}

/// The default mode. Returns false when a job did not complete.
pub async fn run_default(args: &BenchArgs, nofile: u64) -> Result<bool, BenchError> {
    println!(
        "workload: W={} workers x {} slots, M={} jobs as actions of K={} inputs, payload {} B, \
         {} submit clients, heartbeat {} ms",
        args.workers,
        args.slots,
        args.jobs,
        args.per_action,
        args.payload_bytes,
        args.clients,
        args.heartbeat_ms
    );
    let agq = run_agq(args).await?;
    let redis_conns = (args.workers * args.slots as usize + args.clients + 64) as u64;
    let redis = if args.no_redis {
        println!("Redis peer: skipped (--no-redis)");
        None
    } else if !redis_peer::available() {
        println!("Redis peer: skipped. {}", redis_peer::INSTALL_HINT);
        None
    } else if redis_conns + 256 > nofile {
        println!(
            "Redis peer: skipped: it needs {redis_conns} connections (W x S) and the open-files \
             limit is {nofile}; use fewer slots (--slots 1) or raise `ulimit -n`"
        );
        None
    } else {
        println!(
            "Redis peer: redis-server, appendonly yes, appendfsync everysec, save '' \
             (LPUSH/BRPOP queue:ready, status in job:<id> keys)"
        );
        Some(run_redis(args).await?)
    };
    let (bullmq, bullmq_ok) = run_bullmq_or_skip(args, nofile).await;
    let bullmq = bullmq.map(|b| b.run);
    println!();
    let t = Table {
        bullmq: bullmq.is_some(),
    };
    t.header();
    println!("peak load (closed loop, {} submit clients)", args.clients);
    print_phase(
        &t,
        &agq.peak,
        [
            redis.as_ref().map(|r| &r.peak),
            bullmq.as_ref().map(|b| &b.peak),
        ],
        false,
    );
    if let Some(p) = &agq.paced {
        println!("half of each system's peak (open loop)");
        print_phase(
            &t,
            p,
            [
                redis.as_ref().and_then(|r| r.paced.as_ref()),
                bullmq.as_ref().and_then(|b| b.paced.as_ref()),
            ],
            true,
        );
    }
    if let Some(i) = &agq.idle {
        println!(
            "idle fleet: {} workers, {} HTTP/2 connections, heartbeat every {} ms, {:.1} s",
            args.workers,
            worker_connections(args.workers, args.workers_per_connection),
            args.heartbeat_ms,
            i.secs
        );
        t.agq_row(
            "register + connect all workers (s)",
            format!("{:.2}", i.connect_secs),
        );
        t.agq_row("heartbeat ack p50/p99/max (ms)", lat(&i.heartbeat));
        t.agq_row(
            "server CPU (% of one core)",
            format!("{:.1}", i.server_cpu_share * 100.0),
        );
        t.agq_row(
            if args.agq_binary.is_some() {
                "agq serve RSS now / peak (MB)"
            } else {
                "process RSS now / peak (MB)"
            },
            format!("{:.0} / {:.0}", mb(i.rss), mb(i.peak_rss)),
        );
        if args.agq_binary.is_none() {
            t.agq_row(
                "live heap: server / clients (MB)",
                format!("{} / {}", heap_mb(i.server_heap), heap_mb(i.client_heap)),
            );
            t.agq_row(
                "server RSS bound: RSS - client heap (MB)",
                format!("{:.0}", mb(i.server_rss_bound())),
            );
        }
    }
    println!();
    if !args.smoke {
        print_bars(args, &agq, redis.as_ref(), bullmq.as_ref());
    }
    let mut ok = bullmq_ok;
    for (name, run) in [
        ("AGQ", Some(&agq)),
        ("Redis", redis.as_ref()),
        ("BullMQ", bullmq.as_ref()),
    ] {
        let Some(run) = run else { continue };
        for p in std::iter::once(&run.peak).chain(run.paced.iter()) {
            if p.completed != p.jobs || p.errors > 0 {
                println!(
                    "  {name}: {} of {} jobs completed, {} errors",
                    p.completed, p.jobs, p.errors
                );
                ok = false;
            }
        }
    }
    if args.smoke {
        println!(
            "smoke: {}",
            if ok {
                "every job completed"
            } else if bullmq_ok {
                "FAILED: not every job completed"
            } else {
                "FAILED: the BullMQ peer failed"
            }
        );
    }
    Ok(ok)
}

/// Runs the BullMQ peer unless it is skipped (`--no-bullmq`, no
/// redis-server, more than [`bullmq_peer::MAX_WORKERS`] workers, no node
/// or harness, too few file descriptors), printing
/// one line that says which. Returns its run, if any, and false when it
/// was run and failed (the failure is printed; the report goes on
/// without it).
async fn run_bullmq_or_skip(args: &BenchArgs, nofile: u64) -> (Option<BullmqRun>, bool) {
    let conns = bullmq_peer::connections(args) as u64;
    let dir = bullmq_peer::dir(args);
    if args.no_bullmq {
        println!("BullMQ peer: skipped (--no-bullmq)");
        return (None, true);
    }
    if !redis_peer::available() {
        println!("BullMQ peer: skipped: {}", redis_peer::INSTALL_HINT);
        return (None, true);
    }
    if args.workers > bullmq_peer::MAX_WORKERS {
        println!(
            "BullMQ peer: skipped: W={} is more Workers than one node process runs here (at \
             most {})",
            args.workers,
            bullmq_peer::MAX_WORKERS
        );
        return (None, true);
    }
    if let Err(why) = bullmq_peer::check(&dir) {
        println!("BullMQ peer: skipped: {why}");
        return (None, true);
    }
    if conns + 256 > nofile {
        println!(
            "BullMQ peer: skipped: it needs {conns} connections (2 x W) and the open-files \
             limit is {nofile}; use fewer workers or raise `ulimit -n`"
        );
        return (None, true);
    }
    println!(
        "BullMQ peer: bullmq on node ({}), its own redis-server, appendonly yes, appendfsync \
         everysec, save '' ({} Workers x concurrency {} in one node process, Queue.addBulk \
         of K jobs, completed jobs kept)",
        dir.display(),
        args.workers,
        args.slots
    );
    match bullmq_peer::run(args, &dir).await {
        Ok(b) => {
            println!("BullMQ peer: bullmq {} on node {}", b.bullmq, b.node);
            (Some(b), true)
        }
        Err(e) => {
            println!("BullMQ peer: FAILED: {e}");
            (None, false)
        }
    }
}

/// Prints the bars of issues 7 and 19 that the default mode measures:
/// AGQ's end-to-end throughput against the peers' and its own, its
/// latencies, its writer and (10,000 workers) its memory.
fn print_bars(
    args: &BenchArgs,
    agq: &SystemRun,
    redis: Option<&SystemRun>,
    bullmq: Option<&SystemRun>,
) {
    println!("bars (issue 7):");
    let e2e = agq.peak.e2e_rate();
    let against = |name: &str, times: f64, peer: &SystemRun| {
        let pe = peer.peak.e2e_rate();
        println!(
            "  e2e >= {times:.1} x {name}: {e2e:.0} vs {pe:.0} jobs/s = {} -> {}",
            ratio(e2e, pe),
            verdict(e2e >= times * pe)
        );
    };
    if let Some(r) = redis {
        against("Redis", 1.0, r);
    }
    println!(
        "  e2e >= 20,000 jobs/s: {:.0} -> {}",
        e2e,
        verdict(e2e >= 20_000.0)
    );
    if let Some(p) = &agq.paced {
        println!(
            "  enqueue-to-lease p99 <= 5 ms at half peak ({:.0} jobs/s): {:.2} ms -> {}",
            p.rate,
            p.lease.p99,
            verdict(p.lease.p99 <= 5.0)
        );
    }
    if let Some(i) = &agq.idle {
        if args.workers >= 10_000 {
            if args.agq_binary.is_some() {
                println!(
                    "  {} workers <= 500 MB RSS: agq serve RSS {:.0} MB (peak {:.0} MB) -> {}",
                    args.workers,
                    mb(i.rss),
                    mb(i.peak_rss),
                    verdict(mb(i.peak_rss) <= 500.0)
                );
            } else {
                println!(
                "  {} workers <= 500 MB RSS: server <= {:.0} MB (process RSS {:.0} MB - client heap {} MB; server heap {} MB) -> {}",
                args.workers,
                mb(i.server_rss_bound()),
                mb(i.rss),
                heap_mb(i.client_heap),
                heap_mb(i.server_heap),
                verdict(mb(i.server_rss_bound()) <= 500.0)
            );
            }
        }
    }
    print_issue_19_bars(agq, redis, bullmq, &against);
}

/// Prints issue 19's bars: the end-to-end throughput against the
/// Redis-list design's (≥ 1.3×) and BullMQ's (≥ 3×) through `against`,
/// the writer's CPU per job at peak, the half-peak enqueue-to-lease p99
/// and the completion-ack p99 at peak against the Redis-list design's.
/// Each line is printed only when the run measured what it compares.
fn print_issue_19_bars(
    agq: &SystemRun,
    redis: Option<&SystemRun>,
    bullmq: Option<&SystemRun>,
    against: &dyn Fn(&str, f64, &SystemRun),
) {
    let peak = &agq.peak;
    let writer = (peak.completed > 0 && peak.writer_cpu > 0.0)
        .then(|| peak.writer_cpu * 1e6 / peak.completed as f64);
    let half = agq.paced.as_ref();
    if writer.is_none() && half.is_none() && redis.is_none() && bullmq.is_none() {
        return;
    }
    println!("bars (issue 19):");
    if let Some(r) = redis {
        against("Redis", 1.3, r);
    }
    if let Some(b) = bullmq {
        against("BullMQ", 3.0, b);
    }
    if let Some(us) = writer {
        println!(
            "  writer CPU <= 15 µs/job at peak: {us:.1} µs -> {}",
            verdict(us <= 15.0)
        );
    }
    if let Some(p) = half {
        println!(
            "  enqueue-to-lease p99 <= 3 ms at half peak ({:.0} jobs/s): {:.2} ms -> {}",
            p.rate,
            p.lease.p99,
            verdict(p.lease.p99 <= 3.0)
        );
    }
    if let Some(r) = redis {
        println!(
            "  completion-ack p99 at peak <= Redis's: {:.2} vs {:.2} ms -> {}",
            peak.ack.p99,
            r.peak.ack.p99,
            verdict(peak.ack.p99 <= r.peak.ack.p99)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_streams_stay_under_the_servers_call_limit() {
        let limit = agq::server::MAX_CONCURRENT_STREAMS as usize;
        for (workers, per) in [
            (64, 32),
            (10_000, 32),
            (10_000, 1_000),
            (100_000, 32),
            (1, 0),
        ] {
            let conns = worker_connections(workers, per);
            let busiest = workers.div_ceil(conns);
            assert!(
                busiest * STREAMS_PER_WORKER <= limit,
                "{workers} workers on {conns} connections: {busiest} on one"
            );
        }
        // Within the limit, the requested spread and the cap hold.
        assert_eq!(worker_connections(64, 32), 2);
        assert_eq!(worker_connections(4_000, 32), MAX_CONNECTIONS);
    }
}
