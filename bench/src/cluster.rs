//! `--store postgres`: the clustered mode beside single-node SQLite.
//!
//! - SQLite: one `agq serve` child process on a fresh database
//!   (`synchronous` as `--synchronous` sets it), peak and half-peak phases.
//! - PostgreSQL: `--replicas N` `agq serve --store postgres://…` child
//!   processes on one fresh database of a durable server (`fsync=on`,
//!   `synchronous_commit=on`): the throwaway server of `agq-testpg` from
//!   the system's binaries, or `--database-url`. The simulated workers'
//!   connections and the submit clients are spread over the replicas
//!   round-robin; the half-peak phase submits through the first replica
//!   only, so its enqueue-to-lease latency includes the NOTIFY that wakes
//!   the other replicas' dispatchers.
//! - Replica kill: a worker connected to replica k holds a job; a standby
//!   worker on another replica is idle; replica k gets `kill -9` and the
//!   worker goes with it (it does not reconnect). Measured: the kill to the
//!   standby's receipt of the job (the job's holder is declared DEAD once
//!   its last heartbeat is 3 x the interval old, by the maintenance leader,
//!   itself elected anew when the killed replica held the leadership).
//!   The killed replica is started again on its address after each trial.
//!   The replicas run with no retry backoff (as `--failover` does), so
//!   the figure is the failure detection's, not the retry policy's.
//!
//! Server CPU is the replicas' processes'; database CPU is the PostgreSQL
//! server's processes' (its own server only).

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rand::Rng;
use tonic::transport::Channel;

use super::{
    agq_load::{self, Fleet},
    failover::{self, CtlWorker},
    harness::{self, Harness},
    procstat,
    report::{self, verdict, Phase, PLAN},
    stats::{histogram, now_us, Recorder, Summary},
    BenchArgs, BenchError,
};
use agq::pb::action_service_client::ActionServiceClient;

/// The replicas of one run, on one database.
struct Replicas {
    binary: PathBuf,
    base: PathBuf,
    cfg: agq::config::EngineConfig,
    url: String,
    nodes: Vec<Harness>,
    addrs: Vec<SocketAddr>,
}

impl Replicas {
    async fn start(args: &BenchArgs, binary: &Path, url: &str) -> Result<Replicas, BenchError> {
        let mut r = Replicas {
            binary: binary.to_path_buf(),
            base: args.base_dir(),
            // A lost lease is re-queued at once (no retry backoff), so the
            // re-lease time is the failure detection's, as in `--failover`.
            cfg: agq::config::EngineConfig {
                retry_backoff_base: Duration::ZERO,
                ..args.engine_config()
            },
            url: url.to_string(),
            nodes: Vec::new(),
            addrs: Vec::new(),
        };
        for _ in 0..args.replicas.max(1) {
            let h = Harness::start_replica(&r.binary, &r.base, &r.cfg, &r.url, None).await?;
            r.addrs.push(h.addr);
            r.nodes.push(h);
        }
        Ok(r)
    }

    /// kill -9 replica `i`.
    fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts replica `i` again on its address (the port may stay taken
    /// for a moment after the kill: retried for 10 s).
    async fn restart(&mut self, i: usize) -> Result<(), BenchError> {
        let mut last = None;
        for _ in 0..50 {
            match Harness::start_replica(
                &self.binary,
                &self.base,
                &self.cfg,
                &self.url,
                Some(self.addrs[i]),
            )
            .await
            {
                Ok(h) => {
                    self.nodes[i] = h;
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last.unwrap_or_else(|| BenchError::Setup("replica restart".into())))
    }

    /// `n` connections, spread over the replicas round-robin.
    async fn channels(&self, n: usize) -> Result<Vec<Channel>, BenchError> {
        let mut out = Vec::with_capacity(n);
        for i in 0..n.max(self.addrs.len()) {
            out.push(harness::connect(self.addrs[i % self.addrs.len()]).await?);
        }
        Ok(out)
    }

    /// CPU seconds the replicas used so far (killed ones excluded).
    fn cpu(&self) -> f64 {
        self.nodes
            .iter()
            .filter_map(Harness::pid)
            .map(|p| procstat::pid_cpu(p).as_secs_f64())
            .sum()
    }

    async fn stop(self) -> Result<(), BenchError> {
        let mut first = Ok(());
        for h in self.nodes {
            if let Err(e) = h.stop().await {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// CPU seconds used so far by the PostgreSQL server whose postmaster is
/// `pid`: it and its children (the backends of the pooled connections,
/// which live as long as the replicas).
fn db_cpu(pid: Option<i32>) -> Option<f64> {
    let pid = pid?;
    let mut total = procstat::pid_cpu(pid as u32).as_secs_f64();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // the fields after the command name (in parentheses): state, ppid
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(pid) {
            total += procstat::pid_cpu(child).as_secs_f64();
        }
    }
    Some(total)
}

/// The `agq` binary the replicas run: `--agq-binary`, else `agq` beside
/// this bench's executable (both are built into the same target folder).
fn agq_binary(args: &BenchArgs) -> Result<PathBuf, BenchError> {
    if let Some(b) = &args.agq_binary {
        return Ok(b.clone());
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("agq")))
        .filter(|p| p.is_file());
    beside.ok_or_else(|| {
        BenchError::Setup(
            "the clustered mode runs `agq serve` replicas: build it (cargo build --release \
             --workspace --bins) or pass --agq-binary"
                .into(),
        )
    })
}

/// A fresh database for the replicas: on `--database-url`'s server, else
/// on a durable throwaway server started from the system's binaries.
/// Returns its URL and the postmaster's pid (own server only).
async fn database(args: &BenchArgs) -> Result<(String, Option<i32>), BenchError> {
    agq_testpg::configure(agq_testpg::Options {
        durable: true,
        url_env: "AGQ_BENCH_DATABASE_URL",
    });
    if let Some(url) = &args.database_url {
        // SAFETY: set before any other thread reads the environment for it
        // (the throwaway server's start reads it once, below).
        unsafe { std::env::set_var("AGQ_BENCH_DATABASE_URL", url) };
    }
    let url = tokio::spawn(agq_testpg::fresh_database())
        .await
        .map_err(|e| BenchError::Setup(format!("no PostgreSQL for the clustered mode: {e}")))?;
    Ok((url, agq_testpg::postmaster_pid()))
}

/// One loaded phase on the replicas (see [`report::agq_phase`]).
async fn phase(
    args: &BenchArgs,
    replicas: &Replicas,
    postmaster: Option<i32>,
    submit_channels: &[Channel],
    rec: &Arc<Recorder>,
    jobs: u64,
    rate: Option<f64>,
) -> Result<(Phase, Option<f64>), BenchError> {
    let k = args.per_action as usize;
    let actions = (jobs as usize).div_ceil(k);
    let jobs = (actions * k) as u64;
    rec.reset(jobs);
    let cpu0 = replicas.cpu();
    let db0 = db_cpu(postmaster);
    let client0 = procstat::process_cpu().as_secs_f64();
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
    let finished = report::wait_done(rec, jobs, args.timeout()).await;
    let mut p = Phase::from_record(rec.take(), jobs, t0, submit_end);
    p.server_cpu = replicas.cpu() - cpu0;
    p.client_cpu = procstat::process_cpu().as_secs_f64() - client0;
    p.rate = rate.unwrap_or(0.0);
    if !finished {
        p.errors += 1;
        p.last_error = Some(format!(
            "only {} of {jobs} jobs completed within {} s",
            p.completed, args.timeout_secs
        ));
    }
    let db = db0.zip(db_cpu(postmaster)).map(|(a, b)| b - a);
    Ok((p, db))
}

/// What the clustered mode measured.
struct ClusterRun {
    peak: Phase,
    peak_db_cpu: Option<f64>,
    paced: Option<Phase>,
    /// Kill -> re-lease, ms.
    relase: Summary,
    /// Trials whose job was not re-leased within the wait.
    missed: usize,
    /// Trials that killed the maintenance leader.
    leader_kills: usize,
}

/// The replica holding the maintenance leadership, by index: the one
/// owning the probe worker `cl-probe-<trial>-<index>`.
async fn leader(url: &str, trial: usize) -> Option<usize> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    let holder: String = client
        .query_opt("SELECT holder FROM leader", &[])
        .await
        .ok()??
        .get(0);
    let rows = client
        .query(
            "SELECT replica_id, worker_id FROM workers WHERE replica_id = $1",
            &[&holder],
        )
        .await
        .ok()?;
    rows.iter().find_map(|r| {
        let w: String = r.get(1);
        w.strip_prefix(&format!("cl-probe-{trial}-"))?.parse().ok()
    })
}

/// The replica-kill trials: see the module documentation.
async fn kill_trials(
    args: &BenchArgs,
    replicas: &mut Replicas,
    run: &mut ClusterRun,
) -> Result<(), BenchError> {
    let interval = std::time::Duration::from_millis(args.heartbeat_ms.max(10));
    let n = replicas.addrs.len();
    if n < 2 {
        println!("  replica kill: skipped (one replica)");
        return Ok(());
    }
    let mut h = histogram();
    for trial in 0..args.replica_kill_trials {
        // one idle probe worker per replica: the leader's is how the bench
        // finds which replica leads
        let mut probes = Vec::new();
        for (i, addr) in replicas.addrs.iter().enumerate() {
            // no tools: it is never leased a job
            let mut probe = failover::one_slot(&format!("cl-probe-{trial}-{i}"));
            probe.capabilities = Some(Default::default());
            probes.push(CtlWorker::start(*addr, probe, interval).await?);
        }
        let victim_at = rand::rng().random_range(0..n);
        let standby_at = (victim_at + 1 + rand::rng().random_range(0..n - 1)) % n;
        let mut victim = CtlWorker::start(
            replicas.addrs[victim_at],
            failover::one_slot(&format!("cl-victim-{trial}")),
            interval,
        )
        .await?;
        let mut actions =
            ActionServiceClient::new(harness::connect(replicas.addrs[standby_at]).await?);
        agq_load::submit_action(&mut actions, PLAN, trial as u64, 1, "replica-kill").await?;
        if victim.lease_within(Duration::from_secs(10)).await.is_none() {
            return Err(BenchError::Failed(format!(
                "replica kill trial {trial}: the victim got no lease"
            )));
        }
        let mut standby = CtlWorker::start(
            replicas.addrs[standby_at],
            failover::one_slot(&format!("cl-standby-{trial}")),
            interval,
        )
        .await?;
        let was_leader = leader(&replicas.url, trial).await == Some(victim_at);
        // the kill lands at a random point of the heartbeat period
        let jitter = rand::rng().random_range(0..interval.as_millis() as u64);
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        let t0 = now_us();
        replicas.kill(victim_at);
        victim.kill();
        let wait = interval * 3 + Duration::from_secs(15);
        match standby.lease_within(wait).await {
            Some(l) => {
                let _ = h.record((now_us() - t0).max(1));
                standby.complete(l).await?;
                run.leader_kills += usize::from(was_leader);
            }
            None => run.missed += 1,
        }
        drop(probes);
        drop(standby);
        replicas.restart(victim_at).await?;
    }
    run.relase = Summary::of(&h);
    Ok(())
}

/// Runs the clustered mode beside single-node SQLite and prints both.
/// Returns false when a job did not complete or was not re-leased.
///
/// Errors: setup failures (no `agq` binary, no PostgreSQL), failed calls.
pub async fn run(args: &BenchArgs) -> Result<bool, BenchError> {
    let binary = agq_binary(args)?;
    println!(
        "clustered mode: {} replicas of {} on PostgreSQL, beside one SQLite node (synchronous={})",
        args.replicas.max(1),
        binary.display(),
        report::sync_name(args)
    );
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
    // SQLite, one node: the same binary as a child process.
    let mut sqlite_args = args.clone();
    sqlite_args.agq_binary = Some(binary.clone());
    sqlite_args.idle_secs = 0;
    let sqlite = report::run_agq(&sqlite_args).await?;

    let (url, postmaster) = database(args).await?;
    println!(
        "PostgreSQL: {}",
        if postmaster.is_some() {
            "a throwaway server from the system's binaries, fsync=on, synchronous_commit=on"
        } else {
            "the server of --database-url"
        }
    );
    let mut replicas = Replicas::start(args, &binary, &url).await?;
    let result = async {
        let conns = report::worker_connections(args.workers, args.workers_per_connection);
        let worker_channels = replicas.channels(conns).await?;
        let submit_channels = replicas.channels(args.clients.clamp(1, 8)).await?;
        agq_load::submit_plan(submit_channels[0].clone(), PLAN).await?;
        let rec = Arc::new(Recorder::default());
        let fleet = Fleet::start(
            &worker_channels,
            args.workers,
            "bench",
            args.worker_spec(args.slots),
            rec.clone(),
        )
        .await?;
        let loaded = async {
            let (peak, peak_db_cpu) = phase(
                args,
                &replicas,
                postmaster,
                &submit_channels,
                &rec,
                args.jobs as u64,
                None,
            )
            .await?;
            let mut run = ClusterRun {
                peak,
                peak_db_cpu,
                paced: None,
                relase: Summary::default(),
                missed: 0,
                leader_kills: 0,
            };
            if args.paced_secs > 0 && run.peak.e2e_rate() > 0.0 {
                let r = run.peak.e2e_rate() / 2.0;
                let jobs = (r * args.paced_secs as f64).max(args.per_action as f64) as u64;
                let (p, _) = phase(
                    args,
                    &replicas,
                    postmaster,
                    &submit_channels,
                    &rec,
                    jobs,
                    Some(r),
                )
                .await?;
                run.paced = Some(p);
            }
            Ok::<_, BenchError>(run)
        }
        .await;
        fleet.stop().await;
        let mut run = loaded?;
        kill_trials(args, &mut replicas, &mut run).await?;
        Ok::<_, BenchError>(run)
    }
    .await;
    let stopped = replicas.stop().await;
    let run = result?;
    stopped?;
    print(args, &sqlite, &run);
    let mut ok = run.missed == 0;
    for (name, p) in [
        ("SQLite", Some(&sqlite.peak)),
        ("SQLite", sqlite.paced.as_ref()),
        ("PostgreSQL", Some(&run.peak)),
        ("PostgreSQL", run.paced.as_ref()),
    ] {
        let Some(p) = p else { continue };
        if p.completed != p.jobs || p.errors > 0 {
            println!(
                "  {name}: {} of {} jobs completed, {} errors (last: {})",
                p.completed,
                p.jobs,
                p.errors,
                p.last_error.as_deref().unwrap_or("-")
            );
            ok = false;
        }
    }
    if args.smoke {
        println!(
            "smoke: {}",
            if ok {
                "every job completed and was re-leased"
            } else {
                "FAILED"
            }
        );
    }
    Ok(ok)
}

fn lat(s: &Summary) -> String {
    format!("{:.2} / {:.2}", s.p50, s.p99)
}

fn per_job_us(cpu: f64, p: &Phase) -> String {
    if p.completed == 0 {
        return "-".into();
    }
    format!("{:.0}", cpu * 1e6 / p.completed as f64)
}

fn print(args: &BenchArgs, sqlite: &report::SystemRun, run: &ClusterRun) {
    let replicas = args.replicas.max(1);
    let pg = format!("PostgreSQL x{replicas}");
    println!();
    println!("{:<44} {:>18} {:>18}", "", "SQLite, 1 node", pg);
    let row = |name: &str, a: String, b: String| println!("{name:<44} {a:>18} {b:>18}");
    println!("peak load (closed loop, {} submit clients)", args.clients);
    row(
        "  e2e jobs/s",
        format!("{:.0}", sqlite.peak.e2e_rate()),
        format!("{:.0}", run.peak.e2e_rate()),
    );
    row(
        "  submit jobs/s",
        format!("{:.0}", sqlite.peak.submit_rate()),
        format!("{:.0}", run.peak.submit_rate()),
    );
    row(
        "  enqueue->lease p50 / p99 (ms)",
        lat(&sqlite.peak.lease),
        lat(&run.peak.lease),
    );
    row(
        "  completion ack p50 / p99 (ms)",
        lat(&sqlite.peak.ack),
        lat(&run.peak.ack),
    );
    row(
        "  server CPU per job (µs, all replicas)",
        per_job_us(sqlite.peak.server_cpu, &sqlite.peak),
        per_job_us(run.peak.server_cpu, &run.peak),
    );
    row(
        "  database CPU per job (µs, PostgreSQL)",
        "-".into(),
        run.peak_db_cpu
            .map_or_else(|| "n/a".into(), |c| per_job_us(c, &run.peak)),
    );
    if let (Some(a), Some(b)) = (&sqlite.paced, &run.paced) {
        println!("half of each one's peak (open loop, one submitter on the first replica)");
        row(
            "  offered jobs/s",
            format!("{:.0}", a.rate),
            format!("{:.0}", b.rate),
        );
        row(
            "  enqueue->lease p50 / p99 (ms)",
            lat(&a.lease),
            lat(&b.lease),
        );
        row("  completion ack p50 / p99 (ms)", lat(&a.ack), lat(&b.ack));
    }
    let interval_ms = args.heartbeat_ms.max(10);
    let bar = (interval_ms * 3 + 1000) as f64;
    let k = &run.relase;
    println!(
        "replica kill -> re-lease of its worker's job: {} trials ({} killed the leader, {} not \
         re-leased): p50 {:.0} ms, max {:.0} ms",
        k.count, run.leader_kills, run.missed, k.p50, k.max
    );
    println!("bars (clustered mode):");
    println!(
        "  e2e >= 5,000 jobs/s with 3 replicas: {:.0} jobs/s with {replicas} -> {}",
        run.peak.e2e_rate(),
        verdict(replicas >= 3 && run.peak.e2e_rate() >= 5000.0)
    );
    println!(
        "  re-lease after a replica kill <= 3 x heartbeat + 1 s ({bar:.0} ms): max {:.0} ms -> {}",
        k.max,
        verdict(k.count > 0 && run.missed == 0 && k.max <= bar)
    );
}
