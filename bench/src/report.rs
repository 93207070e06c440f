//! The default mode (peak, half-peak and idle phases on AGQ and on the
//! Redis peer) and the printing of its table, with the bars.

use std::{
    path::Path,
    sync::{atomic::AtomicBool, Arc},
    time::{Duration, Instant},
};

use tonic::transport::Channel;

use super::{
    agq_load::{self, Fleet},
    harness::Harness,
    procstat::{self, CpuMark},
    redis_peer::{self, RedisServer},
    stats::{now_us, Record, Recorder, Summary},
    BenchArgs, BenchError,
};

/// Most HTTP/2 connections the simulated workers open to AGQ.
pub const MAX_CONNECTIONS: usize = 64;

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

/// Opens the simulated workers' connections (`--workers-per-connection`
/// workers each, at most [`MAX_CONNECTIONS`]) and the submit clients' (at
/// most 8), and stores the bench plan. Returns (workers', clients').
///
/// Errors: connection failures, a failed SubmitPlan.
pub async fn load_channels(
    args: &BenchArgs,
    h: &Harness,
) -> Result<(Vec<Channel>, Vec<Channel>), BenchError> {
    let conns = args
        .workers
        .div_ceil(args.workers_per_connection.max(1))
        .clamp(1, MAX_CONNECTIONS);
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
    /// SQLite commits during the phase and the operations they carried.
    pub commits: (u64, u64),
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
    fn from_record(r: Record, jobs: u64, t0: u64, submit_end: u64) -> Phase {
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
    p.commits = (commits1.0 - commits0.0, commits1.1 - commits0.1);
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

fn row(name: &str, agq: String, redis: Option<String>, r: Option<String>) {
    println!(
        "  {name:<38} {agq:>14} {:>14} {:>10}",
        redis.unwrap_or_else(|| "-".into()),
        r.unwrap_or_default()
    );
}

fn lat(s: &Summary) -> String {
    format!("{:.2}/{:.2}/{:.1}", s.p50, s.p99, s.max)
}

fn print_phase(a: &Phase, r: Option<&Phase>, paced: bool) {
    if !paced {
        row(
            "submit throughput (jobs/s)",
            format!("{:.0}", a.submit_rate()),
            r.map(|r| format!("{:.0}", r.submit_rate())),
            r.map(|r| ratio(a.submit_rate(), r.submit_rate())),
        );
    } else {
        row(
            "offered load (jobs/s)",
            format!("{:.0}", a.rate),
            r.map(|r| format!("{:.0}", r.rate)),
            None,
        );
    }
    row(
        "end-to-end throughput (jobs/s)",
        format!("{:.0}", a.e2e_rate()),
        r.map(|r| format!("{:.0}", r.e2e_rate())),
        r.map(|r| ratio(a.e2e_rate(), r.e2e_rate())),
    );
    row(
        "jobs completed",
        format!("{}/{}", a.completed, a.jobs),
        r.map(|r| format!("{}/{}", r.completed, r.jobs)),
        None,
    );
    row(
        "enqueue-to-lease p50/p99/max (ms)",
        lat(&a.lease),
        r.map(|r| lat(&r.lease)),
        r.map(|r| ratio(a.lease.p99, r.lease.p99) + " p99"),
    );
    row(
        "completion ack p50/p99/max (ms)",
        lat(&a.ack),
        r.map(|r| lat(&r.ack)),
        r.map(|r| ratio(a.ack.p99, r.ack.p99) + " p99"),
    );
    row(
        "server CPU (s)",
        format!("{:.2}", a.server_cpu),
        r.map(|r| format!("{:.2}", r.server_cpu)),
        r.map(|r| ratio(a.server_cpu, r.server_cpu)),
    );
    let per_k = |p: &Phase| {
        if p.completed > 0 {
            p.server_cpu * 1e6 / p.completed as f64
        } else {
            0.0
        }
    };
    row(
        "server CPU per job (µs)",
        format!("{:.1}", per_k(a)),
        r.map(|r| format!("{:.1}", per_k(r))),
        r.map(|r| ratio(per_k(a), per_k(r))),
    );
    if a.e2e_secs > 0.0 && a.completed > 0 && a.writer_cpu > 0.0 {
        row(
            "AGQ writer thread: busy %, CPU/job (µs)",
            format!(
                "{:.0}%, {:.1}",
                a.writer_cpu * 100.0 / a.e2e_secs,
                a.writer_cpu * 1e6 / a.completed as f64
            ),
            None,
            None,
        );
    }
    if a.commits.0 > 0 {
        row(
            "AGQ commits/s, operations per commit",
            format!(
                "{:.0}, {:.1}",
                a.commits.0 as f64 / a.e2e_secs.max(1e-9),
                a.commits.1 as f64 / a.commits.0 as f64
            ),
            None,
            None,
        );
    }
    row(
        "client CPU (s)",
        format!("{:.2}", a.client_cpu),
        r.map(|r| format!("{:.2}", r.client_cpu)),
        None,
    );
    row(
        "peak RSS (MB)",
        format!("{:.0}", mb(a.peak_rss)),
        r.map(|r| format!("{:.0}", mb(r.peak_rss))),
        None,
    );
    for (name, p) in [("AGQ", Some(a)), ("Redis", r)] {
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
    println!();
    println!(
        "  {:<38} {:>14} {:>14} {:>10}",
        "", "AGQ", "Redis", "AGQ/Redis"
    );
    println!("peak load (closed loop, {} submit clients)", args.clients);
    print_phase(&agq.peak, redis.as_ref().map(|r| &r.peak), false);
    if let Some(p) = &agq.paced {
        println!("half of each system's peak (open loop)");
        print_phase(p, redis.as_ref().and_then(|r| r.paced.as_ref()), true);
    }
    if let Some(i) = &agq.idle {
        println!(
            "idle fleet: {} workers, {} HTTP/2 connections, heartbeat every {} ms, {:.1} s",
            args.workers,
            args.workers
                .div_ceil(args.workers_per_connection.max(1))
                .clamp(1, MAX_CONNECTIONS),
            args.heartbeat_ms,
            i.secs
        );
        row(
            "register + connect all workers (s)",
            format!("{:.2}", i.connect_secs),
            None,
            None,
        );
        row(
            "heartbeat ack p50/p99/max (ms)",
            lat(&i.heartbeat),
            None,
            None,
        );
        row(
            "server CPU (% of one core)",
            format!("{:.1}", i.server_cpu_share * 100.0),
            None,
            None,
        );
        row(
            if args.agq_binary.is_some() {
                "agq serve RSS now / peak (MB)"
            } else {
                "process RSS now / peak (MB)"
            },
            format!("{:.0} / {:.0}", mb(i.rss), mb(i.peak_rss)),
            None,
            None,
        );
        if args.agq_binary.is_none() {
            row(
                "live heap: server / clients (MB)",
                format!("{} / {}", heap_mb(i.server_heap), heap_mb(i.client_heap)),
                None,
                None,
            );
            row(
                "server RSS bound: RSS - client heap (MB)",
                format!("{:.0}", mb(i.server_rss_bound())),
                None,
                None,
            );
        }
    }
    println!();
    if !args.smoke {
        print_bars(args, &agq, redis.as_ref());
    }
    let mut ok = true;
    for (name, run) in [("AGQ", Some(&agq)), ("Redis", redis.as_ref())] {
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
            } else {
                "FAILED: not every job completed"
            }
        );
    }
    Ok(ok)
}

/// Prints the bars that the default mode measures.
fn print_bars(args: &BenchArgs, agq: &SystemRun, redis: Option<&SystemRun>) {
    println!("bars (issue 7):");
    let e2e = agq.peak.e2e_rate();
    if let Some(r) = redis {
        let re = r.peak.e2e_rate();
        println!(
            "  e2e >= 1.0 x Redis: {:.0} vs {:.0} jobs/s = {} -> {}",
            e2e,
            re,
            ratio(e2e, re),
            verdict(e2e >= re)
        );
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
}
