//! Server crash test: under a steady load of submissions and simulated
//! workers, `kill -9` the `agq` process at random moments and restart it on
//! the same database. At the end every acknowledged job exists and is
//! completed, none was accepted as completed twice, none is stuck in
//! running, and `PRAGMA integrity_check` is ok. Every fourth server lives
//! long enough to store the open floor, so the restarts after it load the
//! jobs from that floor on.
//!
//! `AGQ_CRASH_KILLS` sets the number of kills (default 20).

mod process;

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use agq::pb::{self, *};
use process::{AgqServe, Serve};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_stream::{
    wrappers::{ReceiverStream, UnboundedReceiverStream},
    StreamExt,
};
use tonic::{transport::Endpoint, Code};

/// Starts `agq serve` on `db` at `listen` (killed when dropped).
fn spawn_server(db: &std::path::Path, listen: &str) -> AgqServe {
    Serve::new(db)
        .listen(listen)
        .args([
            "--heartbeat-interval-ms",
            "200",
            "--lease-grace-ms",
            "300",
            "--retry-backoff-base-ms",
            "20",
            "--retry-backoff-max-ms",
            "500",
        ])
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn()
        .unwrap_or_else(|e| panic!("agq did not start: {e:?}"))
}

#[derive(Default)]
struct Ledger {
    /// Job ids whose SubmitAction was acknowledged.
    acked: Vec<String>,
    /// Leases received per job.
    leases: HashMap<String, u32>,
    /// Accepted completions per job (lease ids).
    completions: HashMap<String, Vec<String>>,
    /// Completions accepted on a ReportJobs stream.
    streamed: usize,
}

async fn channel(url: &str) -> Option<tonic::transport::Channel> {
    Endpoint::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await
        .ok()
}

async fn submitter(
    url: String,
    ledger: Arc<Mutex<Ledger>>,
    mut stop: watch::Receiver<bool>,
) -> u32 {
    let mut n = 0u32;
    while !*stop.borrow() {
        let Some(ch) = channel(&url).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let mut c = action_service_client::ActionServiceClient::new(ch);
        loop {
            if *stop.borrow() {
                return n;
            }
            let inputs = (0..5)
                .map(|i| ActionInput {
                    values: [("i".to_string(), i.to_string())].into(),
                })
                .collect();
            let req = SubmitActionRequest {
                plan_id: "crash".into(),
                inputs,
                max_attempts: 100,
                ..Default::default()
            };
            match c.submit_action(req).await {
                Ok(r) => {
                    n += 1;
                    ledger.lock().unwrap().acked.extend(r.into_inner().job_ids);
                }
                Err(_) => break,
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                _ = stop.changed() => {}
            }
        }
    }
    n
}

/// A simulated worker: registers, heartbeats, completes every lease at
/// once; with `streamed` it reports on ReportJobs (as agw does), without
/// it one UpdateJob per lease.
async fn worker(
    url: String,
    id: String,
    streamed: bool,
    ledger: Arc<Mutex<Ledger>>,
    stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let Some(ch) = channel(&url).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let mut c = worker_service_client::WorkerServiceClient::new(ch);
        let reg = RegisterWorkerRequest {
            worker_id: id.clone(),
            hostname: "crash-test".into(),
            agw_version: "sim".into(),
            capabilities: Some(WorkerCapabilities {
                tools: vec!["cat".into()],
                agentic_units: vec![],
                ..Default::default()
            }),
            max_concurrent_jobs: 4,
            ..Default::default()
        };
        match c.register_worker(reg).await {
            Ok(_) => {}
            Err(e) if e.code() == Code::AlreadyExists => {}
            Err(_) => continue,
        }
        // We complete every lease at once, so we hold none when we reconnect.
        let (tx, rx) = mpsc::channel(4);
        let first = HeartbeatRequest {
            worker_id: id.clone(),
            held_leases: Some(HeldLeases { lease_ids: vec![] }),
            ..Default::default()
        };
        if tx.send(first).await.is_err() {
            continue;
        }
        let Ok(hb) = c.heartbeat(ReceiverStream::new(rx)).await else {
            continue;
        };
        let beat_id = id.clone();
        // Dropped with this loop turn or with the task (`abort` of a load
        // worker): an aborted worker must stop heartbeating, or the server
        // rightly keeps the lease it was running for a live worker.
        let _beats = AbortOnDrop(tokio::spawn(async move {
            let mut hb = hb.into_inner();
            let mut tick = tokio::time::interval(Duration::from_millis(80));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        if tx.send(HeartbeatRequest { worker_id: beat_id.clone(), ..Default::default() }).await.is_err() { return; }
                    }
                    m = hb.next() => if !matches!(m, Some(Ok(_))) { return; },
                }
            }
        }));
        if let Ok(stream) = c
            .lease_jobs(LeaseJobsRequest {
                worker_id: id.clone(),
            })
            .await
        {
            let mut stream = stream.into_inner();
            let mut stop = stop.clone();
            // A streamed worker reports as agw does: requests on one
            // ReportJobs stream, sent without waiting, answered later; a
            // report counts as accepted only once its answer came.
            let (report_tx, report_rx) = mpsc::unbounded_channel::<ReportJobsRequest>();
            let mut answers = if streamed {
                match c.report_jobs(UnboundedReceiverStream::new(report_rx)).await {
                    Ok(a) => Some(a.into_inner()),
                    Err(_) => continue,
                }
            } else {
                None
            };
            // Jobs and leases of the requests not yet answered, oldest first.
            let mut unanswered: VecDeque<(String, String)> = VecDeque::new();
            loop {
                let answer = async {
                    match answers.as_mut() {
                        Some(a) => a.next().await,
                        None => std::future::pending().await,
                    }
                };
                let next = tokio::select! {
                    n = stream.next() => n,
                    a = answer => {
                        let Some(Ok(a)) = a else { break };
                        let Some((job_id, lease_id)) = unanswered.pop_front() else { break };
                        if a.results.first().is_some_and(|r| r.code == 0) {
                            accepted(&ledger, job_id, lease_id);
                            ledger.lock().unwrap().streamed += 1;
                        }
                        continue;
                    }
                    _ = stop.changed() => None,
                };
                let Some(Ok(lease)) = next else { break };
                let job_id = lease
                    .job
                    .as_ref()
                    .map(|j| j.job_id.clone())
                    .unwrap_or_default();
                *ledger
                    .lock()
                    .unwrap()
                    .leases
                    .entry(job_id.clone())
                    .or_default() += 1;
                let upd = UpdateJobRequest {
                    job_id: job_id.clone(),
                    worker_id: id.clone(),
                    lease_id: lease.lease_id.clone(),
                    status: JobStatus::Completed as i32,
                    ..Default::default()
                };
                if streamed {
                    let request = ReportJobsRequest {
                        worker_id: id.clone(),
                        requests: vec![upd],
                    };
                    if report_tx.send(request).is_err() {
                        break;
                    }
                    unanswered.push_back((job_id, lease.lease_id));
                } else if c.update_job(upd).await.is_ok() {
                    accepted(&ledger, job_id, lease.lease_id);
                }
            }
        }
    }
}

/// Records a completion the server acknowledged.
fn accepted(ledger: &Mutex<Ledger>, job_id: String, lease_id: String) {
    ledger
        .lock()
        .unwrap()
        .completions
        .entry(job_id)
        .or_default()
        .push(lease_id);
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts `agq serve` on `db` at a free port and stores the one-task
/// `cat` plan the load uses; returns the process, its port and its URL.
async fn start_with_plan(db: &std::path::Path) -> (AgqServe, String, String) {
    let server = spawn_server(db, "127.0.0.1:0");
    let (addr, url) = (server.addr.clone(), server.url());
    let ch = channel(&url).await.expect("connect");
    let plan = pb::Plan {
        plan_id: "crash".into(),
        plan_description: String::new(),
        tasks: vec![Task {
            task_number: 1,
            command: "cat".into(),
            args: vec![],
            timeout_secs: 10,
            input_from_task: None,
            ..Default::default()
        }],
        ..Default::default()
    };
    plan_service_client::PlanServiceClient::new(ch)
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan),
            replace: false,
        })
        .await
        .unwrap();
    (server, addr, url)
}

/// The number in environment variable `name`, or `default`.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_dash_nine_under_load_loses_and_strands_nothing() {
    let kills: u32 = env_or("AGQ_CRASH_KILLS", 20);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let (mut server, addr, url) = start_with_plan(&db).await;

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let sub = tokio::spawn(submitter(url.clone(), ledger.clone(), stop_rx.clone()));
    let workers: Vec<_> = (0..3)
        .map(|i| {
            tokio::spawn(worker(
                url.clone(),
                format!("crash-w{i}"),
                i % 2 == 1,
                ledger.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();

    for i in 0..kills {
        // Every fourth server lives long enough to store the open floor
        // (at most once a second), so the restarts after it load the
        // jobs from that floor on instead of from the first row.
        let wait = if i % 4 == 3 {
            1_500
        } else {
            rand::rng().random_range(100..400)
        };
        tokio::time::sleep(Duration::from_millis(wait)).await;
        server.kill(); // SIGKILL
        server = spawn_server(&db, &addr);
    }
    // stop submitting, let the workers finish the backlog
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop_tx.send(true);
    let submitted = sub.await.unwrap();

    let ch = channel(&url).await.expect("connect");
    let mut jobs = job_service_client::JobServiceClient::new(ch.clone());
    let acked: Vec<String> = ledger.lock().unwrap().acked.clone();
    assert!(
        acked.len() >= 50,
        "too little load to mean anything: {} jobs",
        acked.len()
    );
    // the load workers stop with the submitter; fresh workers drive the rest
    for w in workers {
        w.abort();
    }
    let (stop2_tx, stop2_rx) = watch::channel(false);
    let finishers: Vec<_> = (0..2)
        .map(|i| {
            tokio::spawn(worker(
                url.clone(),
                format!("finish-w{i}"),
                i % 2 == 1,
                ledger.clone(),
                stop2_rx.clone(),
            ))
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut not_done: Vec<String> = acked.clone();
    while !not_done.is_empty() {
        if tokio::time::Instant::now() > deadline {
            let j = jobs
                .get_job(GetJobRequest {
                    job_id: not_done[0].clone(),
                })
                .await
                .unwrap()
                .into_inner()
                .job
                .unwrap();
            panic!("{} jobs never completed, e.g. {j:?}", not_done.len());
        }
        let mut still = Vec::new();
        for id in &not_done {
            let j = jobs
                .get_job(GetJobRequest { job_id: id.clone() })
                .await
                .expect("acknowledged job exists")
                .into_inner()
                .job
                .unwrap();
            if j.status != JobStatus::Completed as i32 {
                assert_ne!(j.status, JobStatus::Dead as i32, "job {id} went dead");
                still.push(id.clone());
            }
        }
        not_done = still;
        if !not_done.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let _ = stop2_tx.send(true);
    for f in finishers {
        f.abort();
    }
    let running = jobs
        .search_jobs(SearchJobsRequest {
            status: JobStatus::Running as i32,
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .job_ids;
    assert!(running.is_empty(), "jobs stuck in running: {running:?}");

    let l = ledger.lock().unwrap();
    let acked_set: HashSet<&String> = l.acked.iter().collect();
    for (job, leases) in &l.completions {
        assert!(
            leases.len() <= 1,
            "job {job} was accepted as completed under {} leases: {leases:?}",
            leases.len()
        );
    }
    let re_executions: u32 = l
        .leases
        .iter()
        .filter(|(j, _)| acked_set.contains(j))
        .map(|(_, n)| n.saturating_sub(1))
        .sum();
    assert!(
        l.streamed > 0,
        "no completion was accepted on a ReportJobs stream"
    );
    println!(
        "crash test: {kills} kills survived, {} actions / {} jobs acknowledged and checked, {} completions accepted on ReportJobs, {re_executions} re-executions (at-least-once)",
        submitted,
        l.acked.len(),
        l.streamed
    );
    drop(l);
    server.kill();
    let conn = rusqlite::Connection::open(&db).unwrap();
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
    // A floor was stored (the restarts after one load from it).
    let floor: i64 = conn
        .query_row("SELECT first_open_row FROM job_floor", [], |r| r.get(0))
        .unwrap();
    assert!(floor > 0, "the open floor was never stored");
}
