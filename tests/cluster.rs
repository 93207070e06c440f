//! The clustered mode under failure: three `agq serve` replicas (real
//! processes) on one PostgreSQL database, workers that move to another
//! replica when theirs dies, a submitter on each replica.
//!
//! - `replica_kills_lose_and_duplicate_nothing`: kill -9 a random replica
//!   every 100–400 ms and restart it on the same address,
//!   `AGQ_CLUSTER_KILLS` times (default 20): every acknowledged job is
//!   completed, no job is acknowledged completed under two leases, nothing
//!   is stranded; re-executions are counted and printed.
//! - `the_leader_killed_or_paused_hands_maintenance_over`: kill -9, and
//!   separately SIGSTOP past its TTL, the maintenance leader: another
//!   replica takes the leadership and declares a silent worker DEAD; the
//!   paused one, resumed, changes nothing that was done meanwhile.
//! - `a_killed_listener_connection_still_leases`: the listener connections
//!   are terminated (`pg_terminate_backend`): jobs still lease.
//! - `work_crosses_replicas`: a job submitted on B runs on a worker of A;
//!   a cancel sent to B and a drain sent to C reach that worker.
//!
//! A crash of PostgreSQL itself under load: tests/cluster_db_restart.rs.

mod common;
mod process;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use agq::pb::{self, *};
use common::{eventually, pg, plan};
use nix::sys::signal::Signal;
use process::{AgqServe, Serve};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_stream::{wrappers::ReceiverStream, StreamExt};
use tonic::{transport::Channel, Code};

/// Heartbeat interval of the replicas, ms (stale after 3 x).
const HEARTBEAT_MS: u64 = 200;

/// Three (or `n`) replicas on one fresh database.
struct Cluster {
    url: String,
    dir: tempfile::TempDir,
    replicas: Vec<AgqServe>,
    addrs: Vec<String>,
}

impl Cluster {
    async fn start(n: usize) -> Cluster {
        let url = pg::fresh_database().await;
        let dir = tempfile::tempdir().unwrap();
        let mut c = Cluster {
            url,
            dir,
            replicas: Vec::new(),
            addrs: Vec::new(),
        };
        for _ in 0..n {
            let r = c.spawn("127.0.0.1:0");
            c.addrs.push(r.addr.clone());
            c.replicas.push(r);
        }
        c
    }

    /// The command line of a replica listening on `listen`.
    fn serve(&self, listen: &str) -> Serve {
        Serve::new(self.dir.path().join("unused.db"))
            .listen(listen)
            .args([
                "--store",
                &self.url,
                "--heartbeat-interval-ms",
                &HEARTBEAT_MS.to_string(),
                "--lease-grace-ms",
                "400",
                "--retry-backoff-base-ms",
                "50",
                "--retry-backoff-max-ms",
                "200",
                "--no-console",
                "--log-format",
                "json",
            ])
            .env("RUST_LOG", "info")
            .kill_on_drop()
    }

    fn spawn(&self, listen: &str) -> AgqServe {
        self.serve(listen)
            .spawn()
            .unwrap_or_else(|e| panic!("replica did not start: {e:?}"))
    }

    /// kill -9 replica `i` and start it again on the same address.
    fn kill_and_restart(&mut self, i: usize) {
        self.replicas[i].kill();
        let addr = self.addrs[i].clone();
        // The port may take a moment to be free again: bounded retries.
        for attempt in 0..50 {
            match self.serve(&addr).spawn() {
                Ok(r) => {
                    self.replicas[i] = r;
                    return;
                }
                Err(e) if attempt < 49 => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("replica {i} did not restart on {addr}: {e:?}"),
            }
        }
    }

    fn url_of(&self, i: usize) -> String {
        format!("http://{}", self.addrs[i])
    }

    /// The replica id each replica logged at start, by replica index.
    fn replica_id(&self, i: usize) -> Option<String> {
        let log = self.replicas[i].log();
        log.lines()
            .filter_map(|l| l.split("\"replica_id\":\"").nth(1))
            .filter_map(|s| s.split('"').next())
            .map(str::to_string)
            .next_back()
    }
}

async fn channel(url: &str) -> Option<Channel> {
    let endpoint = Channel::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(500));
    tokio::time::timeout(Duration::from_secs(2), endpoint.connect())
        .await
        .ok()?
        .ok()
}

/// What the workers saw.
#[derive(Default)]
struct Ledger {
    /// Acknowledged completions: job id -> lease ids.
    completed: Mutex<HashMap<String, Vec<String>>>,
    /// Leases received per job.
    leased: Mutex<HashMap<String, HashSet<String>>>,
    /// Reports refused by fencing.
    fenced: AtomicU64,
    /// Commands received, by worker.
    commands: Mutex<Vec<(String, heartbeat_response::Command)>>,
}

/// A worker that runs each lease for `work_ms` and reports it; when its
/// replica goes away it moves to the next one, starting at `start`.
/// Returns when `stop` turns true.
async fn roam(
    id: String,
    urls: Vec<String>,
    start: usize,
    ledger: Arc<Ledger>,
    work_ms: u64,
    mut stop: watch::Receiver<bool>,
) {
    let mut i = start;
    while !*stop.borrow() {
        let url = &urls[i % urls.len()];
        i += 1;
        let Some(ch) = channel(url).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut client = worker_service_client::WorkerServiceClient::new(ch);
        let reg = client
            .register_worker(RegisterWorkerRequest {
                worker_id: id.clone(),
                hostname: "cluster-test".into(),
                agw_version: "sim".into(),
                capabilities: Some(WorkerCapabilities {
                    tools: vec!["cat".into()],
                    ..Default::default()
                }),
                max_concurrent_jobs: 1,
                instance_id: format!("instance-{id}"),
                ..Default::default()
            })
            .await;
        if reg.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let (hb_tx, hb_rx) = mpsc::channel(16);
        let first = HeartbeatRequest {
            worker_id: id.clone(),
            stats: Some(WorkerStats::default()),
            held_leases: Some(HeldLeases { lease_ids: vec![] }),
            verification: None,
        };
        if hb_tx.send(first).await.is_err() {
            continue;
        }
        let Ok(inbound) = client.heartbeat(ReceiverStream::new(hb_rx)).await else {
            continue;
        };
        let mut inbound = inbound.into_inner();
        let Ok(leases) = client
            .lease_jobs(LeaseJobsRequest {
                worker_id: id.clone(),
            })
            .await
        else {
            continue;
        };
        let mut leases = leases.into_inner();
        let mut ticker = tokio::time::interval(Duration::from_millis(HEARTBEAT_MS / 2));
        // The lease being worked on and when its work ends: the loop keeps
        // heartbeating and reading commands meanwhile.
        let mut running: Option<(JobLease, tokio::time::Instant)> = None;
        let far = || tokio::time::Instant::now() + Duration::from_secs(3600);
        loop {
            let until = running.as_ref().map_or_else(far, |(_, t)| *t);
            tokio::select! {
                _ = stop.changed() => return,
                _ = ticker.tick() => {
                    let beat = HeartbeatRequest { worker_id: id.clone(), stats: Some(WorkerStats::default()), held_leases: None, verification: None };
                    if hb_tx.send(beat).await.is_err() { break; }
                }
                msg = inbound.next() => match msg {
                    Some(Ok(resp)) => {
                        if let Some(c) = resp.command {
                            ledger.commands.lock().unwrap().push((id.clone(), c));
                        }
                    }
                    _ => break,
                },
                lease = leases.next(), if running.is_none() => {
                    let Some(Ok(lease)) = lease else { break };
                    let job_id = lease.job.as_ref().map(|j| j.job_id.clone()).unwrap_or_default();
                    ledger.leased.lock().unwrap().entry(job_id).or_default().insert(lease.lease_id.clone());
                    running = Some((lease, tokio::time::Instant::now() + Duration::from_millis(work_ms)));
                }
                _ = tokio::time::sleep_until(until), if running.is_some() => {
                    let Some((lease, _)) = running.take() else { continue };
                    let job_id = lease.job.as_ref().map(|j| j.job_id.clone()).unwrap_or_default();
                    let r = client
                        .update_job(UpdateJobRequest {
                            job_id: job_id.clone(),
                            worker_id: id.clone(),
                            lease_id: lease.lease_id.clone(),
                            status: JobStatus::Completed as i32,
                            ..Default::default()
                        })
                        .await;
                    match r {
                        Ok(_) => ledger.completed.lock().unwrap().entry(job_id).or_default().push(lease.lease_id),
                        Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::PermissionDenied) => {
                            ledger.fenced.fetch_add(1, Ordering::Relaxed);
                        }
                        // The replica went away: the outcome is in the
                        // database or the job will be leased again.
                        Err(_) => break,
                    }
                }
            }
        }
        // A lease in progress when the replica went away is dropped (the
        // next registration names no held lease): it is leased again.
        drop(running);
    }
}

/// Submits `actions` actions of `per` jobs round-robin over the replicas,
/// moving on when one fails; returns the acknowledged job ids.
async fn submitter(urls: Vec<String>, start: usize, actions: usize, per: usize) -> Vec<String> {
    let mut acked = Vec::new();
    let mut i = start;
    let mut done = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while done < actions && Instant::now() < deadline {
        let url = &urls[i % urls.len()];
        i += 1;
        let Some(ch) = channel(url).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let mut c = action_service_client::ActionServiceClient::new(ch);
        let r = c
            .submit_action(SubmitActionRequest {
                plan_id: "p".into(),
                inputs: (0..per)
                    .map(|n| ActionInput {
                        values: [("n".to_string(), n.to_string())].into(),
                    })
                    .collect(),
                max_attempts: 100,
                ..Default::default()
            })
            .await;
        if let Ok(r) = r {
            acked.extend(r.into_inner().job_ids);
            done += 1;
        }
    }
    acked
}

async fn put_plan(url: &str) {
    let ch = channel(url).await.expect("connect");
    plan_service_client::PlanServiceClient::new(ch)
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("p", &["cat"])),
            replace: false,
        })
        .await
        .expect("plan");
}

async fn job_of(url: &str, id: &str) -> Option<pb::Job> {
    let ch = channel(url).await?;
    job_service_client::JobServiceClient::new(ch)
        .get_job(GetJobRequest { job_id: id.into() })
        .await
        .ok()?
        .into_inner()
        .job
}

fn env_or(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_kills_lose_and_duplicate_nothing() {
    let kills = env_or("AGQ_CLUSTER_KILLS", 20);
    let mut cluster = Cluster::start(3).await;
    let urls: Vec<String> = (0..3).map(|i| cluster.url_of(i)).collect();
    put_plan(&urls[0]).await;
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    let workers: Vec<_> = (0..6)
        .map(|n| {
            tokio::spawn(roam(
                format!("w{n}"),
                urls.clone(),
                n,
                ledger.clone(),
                3,
                stop.clone(),
            ))
        })
        .collect();
    let submitters: Vec<_> = (0..3)
        .map(|n| tokio::spawn(submitter(urls.clone(), n, kills as usize, 10)))
        .collect();
    let started = Instant::now();
    for _ in 0..kills {
        let wait = rand::rng().random_range(100..=400);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let victim = rand::rng().random_range(0..3);
        tokio::task::block_in_place(|| cluster.kill_and_restart(victim));
    }
    let mut acked = Vec::new();
    for s in submitters {
        acked.extend(s.await.unwrap());
    }
    assert!(!acked.is_empty(), "no submission was acknowledged");
    // Every acknowledged job completes (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut left: Vec<String> = acked.clone();
    while !left.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for id in left {
            match job_of(&urls[0], &id).await {
                Some(j) if j.status == JobStatus::Completed as i32 => {}
                _ => still.push(id),
            }
        }
        left = still;
        if !left.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let _ = stop_tx.send(true);
    for w in workers {
        let _ = tokio::time::timeout(Duration::from_secs(5), w).await;
    }
    assert!(
        left.is_empty(),
        "{} acknowledged jobs never completed, e.g. {:?}",
        left.len(),
        job_of(&urls[0], &left[0]).await
    );
    // No job was acknowledged completed under two different leases.
    let completed = ledger.completed.lock().unwrap().clone();
    for (job, leases) in &completed {
        let distinct: HashSet<_> = leases.iter().collect();
        assert_eq!(distinct.len(), 1, "job {job} completed under {leases:?}");
    }
    let leased = ledger.leased.lock().unwrap().clone();
    let re_executions: usize = leased.values().map(|l| l.len().saturating_sub(1)).sum();
    println!(
        "cluster: {kills} replica kills in {:.1} s, {} jobs acknowledged and completed, \
         {re_executions} re-executions, {} late reports fenced",
        started.elapsed().as_secs_f64(),
        acked.len(),
        ledger.fenced.load(Ordering::Relaxed)
    );
    // Nothing stranded: no job is running without a live worker.
    let ch = channel(&urls[0]).await.expect("connect");
    let mut jobs = job_service_client::JobServiceClient::new(ch);
    let running = jobs
        .search_jobs(SearchJobsRequest {
            status: JobStatus::Running as i32,
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        running.job_ids.is_empty(),
        "jobs still running with every worker stopped: {:?}",
        running.job_ids
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn work_crosses_replicas() {
    let cluster = Cluster::start(3).await;
    let (a, b, c) = (cluster.url_of(0), cluster.url_of(1), cluster.url_of(2));
    put_plan(&a).await;
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    // One worker, on A only; its jobs take long enough to be cancelled.
    let worker = tokio::spawn(roam(
        "on-a".into(),
        vec![a.clone()],
        0,
        ledger.clone(),
        3_000,
        stop.clone(),
    ));
    let ch = channel(&b).await.unwrap();
    let submitted = action_service_client::ActionServiceClient::new(ch)
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![ActionInput {
                values: [("n".to_string(), "1".to_string())].into(),
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let job_id = submitted.job_ids[0].clone();
    eventually(10, "the job submitted on B runs on A's worker", || async {
        job_of(&c, &job_id)
            .await
            .is_some_and(|j| j.status == JobStatus::Running as i32 && j.worker_id == "on-a")
    })
    .await;
    // Cancel through B: the command reaches the worker held by A.
    let ch = channel(&b).await.unwrap();
    job_service_client::JobServiceClient::new(ch)
        .cancel_job(CancelJobRequest {
            job_id: job_id.clone(),
        })
        .await
        .unwrap();
    eventually(5, "the cancel reached the worker on A", || async {
        ledger.commands.lock().unwrap().iter().any(
            |(_, c)| matches!(c, heartbeat_response::Command::CancelJobId(id) if *id == job_id),
        )
    })
    .await;
    // Drain through C: the command reaches the worker on A.
    let ch = channel(&c).await.unwrap();
    worker_service_client::WorkerServiceClient::new(ch)
        .drain_worker(DrainWorkerRequest {
            worker_id: "on-a".into(),
        })
        .await
        .unwrap();
    eventually(5, "the drain reached the worker on A", || async {
        ledger
            .commands
            .lock()
            .unwrap()
            .iter()
            .any(|(_, c)| matches!(c, heartbeat_response::Command::Drain(_)))
    })
    .await;
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_listener_connection_still_leases() {
    let cluster = Cluster::start(2).await;
    let urls = [cluster.url_of(0), cluster.url_of(1)];
    put_plan(&urls[0]).await;
    let db = pg::connect(&cluster.url).await;
    let killed: i64 = db
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%') t",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(killed >= 1, "no listener connection found");
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    let worker = tokio::spawn(roam(
        "w".into(),
        vec![urls[0].clone()],
        0,
        ledger.clone(),
        1,
        stop.clone(),
    ));
    // Submitted right after the cut, on the other replica: leased within
    // the poll interval even if the notification was lost.
    let acked = submitter(vec![urls[1].clone()], 0, 1, 5).await;
    eventually(
        5,
        "jobs leased and completed after the listener was cut",
        || async {
            let mut all = true;
            for id in &acked {
                all &= job_of(&urls[1], id)
                    .await
                    .is_some_and(|j| j.status == JobStatus::Completed as i32);
            }
            all
        },
    )
    .await;
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_killed_or_paused_hands_maintenance_over() {
    let mut cluster = Cluster::start(3).await;
    let urls: Vec<String> = (0..3).map(|i| cluster.url_of(i)).collect();
    put_plan(&urls[0]).await;
    let db = pg::connect(&cluster.url).await;
    let leader = || async {
        db.query_opt(
            "SELECT holder FROM leader WHERE name = 'maintenance' AND expires_at_ms > agq_now_ms()",
            &[],
        )
        .await
        .unwrap()
        .map(|r| r.get::<_, String>(0))
    };
    eventually(10, "a leader is elected", || async {
        leader().await.is_some()
    })
    .await;
    let index_of =
        |holder: &str, c: &Cluster| (0..3).find(|i| c.replica_id(*i).as_deref() == Some(holder));
    for round in ["kill", "stop"] {
        let holder = leader().await.unwrap();
        let i = index_of(&holder, &cluster).expect("the leader is one of the replicas");
        // A worker on another replica that goes silent holding a job.
        let other = (i + 1) % 3;
        let ledger = Arc::new(Ledger::default());
        let (stop_tx, stop) = watch::channel(false);
        let silent = format!("silent-{round}");
        let w = tokio::spawn(roam(
            silent.clone(),
            vec![urls[other].clone()],
            0,
            ledger.clone(),
            60_000,
            stop.clone(),
        ));
        let acked = submitter(vec![urls[other].clone()], 0, 1, 1).await;
        eventually(10, "the silent worker holds the job", || async {
            job_of(&urls[other], &acked[0])
                .await
                .is_some_and(|j| j.status == JobStatus::Running as i32)
        })
        .await;
        match round {
            "kill" => cluster.replicas[i].kill(),
            _ => cluster.replicas[i].signal(Signal::SIGSTOP),
        }
        w.abort();
        let _ = stop_tx.send(true);
        // Another replica leads and declares the silent worker DEAD.
        eventually(15, "another replica took the leadership", || async {
            leader().await.is_some_and(|h| h != holder)
        })
        .await;
        eventually(15, "the silent worker is declared DEAD", || async {
            let Some(ch) = channel(&urls[other]).await else {
                return false;
            };
            worker_service_client::WorkerServiceClient::new(ch)
                .get_worker(GetWorkerRequest {
                    worker_id: silent.clone(),
                })
                .await
                .is_ok_and(|r| {
                    r.into_inner()
                        .worker
                        .is_some_and(|w| w.state == WorkerState::Dead as i32)
                })
        })
        .await;
        // Its job is leased again and completed by a live worker.
        let ledger = Arc::new(Ledger::default());
        let (stop_tx, stop) = watch::channel(false);
        let helper = tokio::spawn(roam(
            format!("live-{round}"),
            vec![urls[other].clone()],
            0,
            ledger,
            1,
            stop,
        ));
        eventually(15, "the job completes on a live worker", || async {
            job_of(&urls[other], &acked[0])
                .await
                .is_some_and(|j| j.status == JobStatus::Completed as i32)
        })
        .await;
        if round == "stop" {
            // Resumed, the old leader's late work changes nothing.
            cluster.replicas[i].signal(Signal::SIGCONT);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let j = job_of(&urls[other], &acked[0]).await.unwrap();
            assert_eq!(j.status, JobStatus::Completed as i32);
            assert_eq!(j.attempt, 2, "{j:?}");
        }
        let _ = stop_tx.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(5), helper).await;
        if round == "kill" {
            // Back to three replicas for the next round.
            tokio::task::block_in_place(|| cluster.kill_and_restart(i));
        }
    }
}
