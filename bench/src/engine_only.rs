//! `--engine-only`: the AGQ engine without gRPC. The same workload (W
//! workers x S slots, M jobs in actions of K) calls the SQLite engine
//! through [`agq::core::Engine`] directly: leases arrive on in-process channels,
//! completions go straight to [`agq::core::Engine::update_job`]. What it reaches is the ceiling the store, the
//! state machine and group commit put on AGQ; the gap to the full run is
//! the cost of gRPC (tonic, HTTP/2, protobuf) on both sides.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use futures_util::{stream::FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, watch};

use super::{
    agq_load::{bench_plan, job_input, register_request, task_result},
    harness::TempDir,
    procstat::CpuMark,
    report::{wait_done, PLAN},
    stats::{now_us, Recorder, Summary},
    BenchArgs, BenchError,
};
use agq::{
    core::{
        engine::{ActionRequest, HeartbeatEvent},
        model::{JobLease, JobReport, JobStatus, Plan, Registration, TaskResult},
        SharedEngine,
    },
    metrics::Metrics,
    store::sqlite::SqliteEngine,
};

fn internal(e: agq::error::Error) -> BenchError {
    BenchError::Failed(format!("engine: {e}"))
}

async fn worker(
    engine: SharedEngine,
    id: String,
    mut leases: mpsc::UnboundedReceiver<JobLease>,
    rec: Arc<Recorder>,
    mut stop: watch::Receiver<bool>,
) {
    let mut inflight = FuturesUnordered::new();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            l = leases.recv() => {
                let Some(lease) = l else { return };
                let job = lease.job;
                let t = job.input.get("t").and_then(|t| t.parse().ok());
                rec.leased(t, None, now_us());
                let req = JobReport {
                    job_id: job.job_id,
                    worker_id: id.clone(),
                    lease_id: lease.lease_id,
                    status: Some(JobStatus::Completed),
                    task_results: vec![TaskResult::from(task_result())],
                    ..Default::default()
                };
                let engine = engine.clone();
                inflight.push(async move {
                    let sent = now_us();
                    (sent, engine.update_job(req).await)
                });
            }
            Some((sent, r)) = inflight.next(), if !inflight.is_empty() => match r {
                Ok(_) => rec.completed_at(sent, now_us()),
                Err(e) => rec.error(format!("{id}: {e}")),
            },
        }
    }
}

/// Runs the engine-only mode. Returns false when a job did not complete.
pub async fn run(args: &BenchArgs) -> Result<bool, BenchError> {
    let dir = TempDir::new(&args.base_dir(), "engine")?;
    let engine: SharedEngine = SqliteEngine::open(
        &dir.path().join("agq.db"),
        args.synchronous,
        args.engine_config(),
        Arc::new(Metrics::new()),
    )
    .await
    .map_err(internal)?;
    let result = drive(args, &engine).await;
    engine.close().await;
    result
}

async fn drive(args: &BenchArgs, engine: &SharedEngine) -> Result<bool, BenchError> {
    engine
        .submit_plan(Plan::from(bench_plan(PLAN)), false)
        .await
        .map_err(internal)?;
    let rec = Arc::new(Recorder::default());
    let (stop_tx, stop) = watch::channel(false);
    let mut tasks = Vec::new();
    // Heartbeat streams stay open (receivers held) for the whole run.
    let mut heartbeat_streams = Vec::new();
    for i in 0..args.workers {
        let id = format!("engine-{i}");
        engine
            .register_worker(Registration::from(register_request(&id, args.slots)))
            .await
            .map_err(internal)?;
        let (hb_tx, hb_rx) = mpsc::unbounded_channel::<HeartbeatEvent>();
        heartbeat_streams.push(hb_rx);
        engine
            .open_heartbeat(id.clone(), hb_tx)
            .await
            .map_err(internal)?;
        let (tx, rx) = mpsc::unbounded_channel();
        engine
            .open_lease_stream(id.clone(), tx)
            .await
            .map_err(internal)?;
        tasks.push(tokio::spawn(worker(
            engine.clone(),
            id,
            rx,
            rec.clone(),
            stop.clone(),
        )));
    }
    // One task heartbeats for every worker, so none turns stale.
    let ids: Vec<String> = (0..args.workers).map(|i| format!("engine-{i}")).collect();
    let beat = {
        let engine = engine.clone();
        let mut stop = stop.clone();
        let period = Duration::from_millis(args.heartbeat_ms.max(10));
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(period);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = ticker.tick() => {
                        for id in &ids {
                            let _ = engine.heartbeat(id.clone(), None, None).await;
                        }
                    }
                }
            }
        })
    };
    tasks.push(beat);
    let k = args.per_action as usize;
    let actions = args.jobs.div_ceil(k);
    let jobs = (actions * k) as u64;
    rec.reset(jobs);
    let mark = CpuMark::now(None);
    let t0 = now_us();
    let next = Arc::new(AtomicUsize::new(0));
    let payload = args.payload();
    let mut submitters = Vec::new();
    for _ in 0..args.clients.max(1) {
        let engine = engine.clone();
        let next = next.clone();
        let payload = payload.clone();
        submitters.push(tokio::spawn(async move {
            loop {
                let a = next.fetch_add(1, Ordering::Relaxed);
                if a >= actions {
                    return Ok::<_, BenchError>(());
                }
                let t = now_us();
                let inputs = (0..k as u64)
                    .map(|j| job_input((a * k) as u64 + j, t, &payload))
                    .collect();
                engine
                    .submit_action(ActionRequest {
                        plan_id: PLAN.into(),
                        inputs,
                        max_attempts: 3,
                        ..Default::default()
                    })
                    .await
                    .map_err(internal)?;
            }
        }));
    }
    super::join_submitters(submitters).await?;
    let submit_secs = (now_us() - t0) as f64 / 1e6;
    let finished = wait_done(&rec, jobs, args.timeout()).await;
    let (_, process_cpu, _) = mark.since();
    let writer_cpu = mark.writer_since();
    let r = rec.take();
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    drop(heartbeat_streams);
    let e2e = (r.last_done_us.saturating_sub(t0)) as f64 / 1e6;
    let lease = Summary::of(&r.enqueue_to_lease);
    let ack = Summary::of(&r.completion_ack);
    println!(
        "engine only (no gRPC): W={} x {} slots, M={jobs} jobs in actions of {k}, SQLite synchronous={}",
        args.workers,
        args.slots,
        super::report::sync_name(args)
    );
    println!(
        "  submit {:.0} jobs/s, end-to-end {:.0} jobs/s, {} of {jobs} completed",
        jobs as f64 / submit_secs.max(1e-9),
        r.completed as f64 / e2e.max(1e-9),
        r.completed
    );
    println!(
        "  enqueue-to-lease p50/p99/max {:.2}/{:.2}/{:.1} ms, completion ack p50/p99 {:.2}/{:.2} ms",
        lease.p50, lease.p99, lease.max, ack.p50, ack.p99
    );
    let per = |cpu: f64| cpu * 1e6 / r.completed.max(1) as f64;
    println!(
        "  writer thread: {:.0}% busy, {:.1} µs CPU per job; whole process {:.1} µs CPU per job",
        writer_cpu * 100.0 / e2e.max(1e-9),
        per(writer_cpu),
        per(process_cpu)
    );
    if r.errors > 0 {
        println!(
            "  {} errors, last: {}",
            r.errors,
            r.last_error.unwrap_or_default()
        );
    }
    Ok(finished && r.errors == 0)
}
