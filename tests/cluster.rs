//! The clustered mode under failure: `agq serve` replicas (real processes,
//! the binary of this build) on one fresh PostgreSQL database each test,
//! workers spread over them, and submitters (each starting on another
//! replica and moving round-robin).
//!
//! The workers ([`roam`]) drive the WorkerService as agw does, only faster:
//! register, open the heartbeat stream (its first message lists the leases
//! they still hold), and once it is answered the lease stream; run each
//! lease for a few milliseconds and report it. When a call or a stream
//! fails, or their replica stops answering heartbeats, they move to the
//! next replica at once, keeping the jobs they run (listed as held there)
//! and the reports not acknowledged yet (sent again there), as agw does.
//! They record every lease they receive and every completion the server
//! acknowledges, by job, with the worker and the lease id.
//!
//! - `replica_kills_lose_and_duplicate_nothing`: 3 replicas, 6 workers,
//!   3 submitters submitting for as long as it kills: kill -9 a random
//!   replica every 100–400 ms and restart it on the same address,
//!   `AGQ_CLUSTER_KILLS` times (default 20). Then every acknowledged job is
//!   completed (the API says so), no job was acknowledged completed under
//!   two leases or to two workers, every acknowledged completion is in the
//!   database, nothing is stranded (no job running on a worker that is not
//!   live; every job, acknowledged or not, finishes). Kills, reconnects,
//!   re-executions, fenced reports and jobs that kept their lease across a
//!   failover are printed.
//! - `the_leader_killed_or_paused_hands_maintenance_over`: kill -9 the
//!   maintenance leader (found through the `leader` row and the replica id
//!   each replica logs at start): another replica takes the row within the
//!   TTL (1 s at these tests' 200 ms heartbeat) plus slack and declares a
//!   silent worker DEAD, whose job a live worker then completes. Then SIGSTOP the new leader past the TTL:
//!   the same happens, and once resumed (SIGCONT) the old leader changes
//!   nothing: the job stays completed at its second attempt, leased once to
//!   each worker, the leadership stays where it went, the resumed replica
//!   serves again.
//! - `a_killed_listener_connection_still_leases`: the replicas' LISTEN
//!   connections are terminated (`pg_terminate_backend`) every 50 ms while
//!   jobs are submitted on one replica for a worker on the other: each is
//!   leased within the 500 ms poll interval plus slack, and the listeners
//!   come back.
//! - `a_silent_listener_connection_is_replaced`: the replicas' LISTEN
//!   connections go silent without an error (their server processes
//!   stopped with SIGSTOP): each replica opens another, and a WatchAction
//!   on B reports a job completed through A.
//! - `departed_workers_leave_no_entry_on_their_replica`: workers that
//!   unregistered through B, whose streams A ended, leave no entry in A's
//!   memory (`agq_replica_workers` back at 0). The second one's beat
//!   reaches A before A's command pump takes the unregistration's `end`
//!   (held by a trigger): refusing the beat ends its lease stream too.
//! - `a_replica_whose_database_stops_answering_turns_not_serving`: every
//!   server process of the replica's database stopped (SIGSTOP): its
//!   health turns NOT_SERVING, and SERVING again once they resume.
//! - `selectors_of_finished_actions_are_dropped`: the worker selectors
//!   the dispatchers read keep only those of open jobs; a job retried
//!   after its selector was dropped brings it back and is leased.
//! - `a_refused_heartbeat_stream_is_closed`: a heartbeat stream refused
//!   after the worker was taken over (a statement after the takeover
//!   failed) is closed like one that ended.
//! - `a_refused_lease_stream_is_closed`: the same for a lease stream
//!   refused after it was attached.
//! - `a_submit_notifies_the_dispatchers`: a SubmitAction's commit sends
//!   `NOTIFY agq_ready` (a test connection LISTENs).
//! - `work_crosses_replicas`: a job submitted on B runs on a worker
//!   connected to A; a CancelJob sent to B reaches it (a heartbeat command)
//!   and a DrainWorker sent to C reaches the worker on A.
//! - `a_database_crash_under_load_loses_nothing`: PostgreSQL itself is
//!   crashed (immediate shutdown) and restarted under load: every replica
//!   reports SERVING again, and the checks of the kill test hold. It
//!   restarts the server every test of this binary uses, so it runs alone
//!   ([`PG_SERVER`]). tests/cluster_db_restart.rs does the same with real
//!   `agw` processes.
//! - `commands_follow_a_worker_that_moved`: a worker that moved from A to
//!   B while A still holds its old heartbeat stream (a half-open
//!   connection) gets its commands on B, not on the stale stream on A
//!   (which A ends once it sees the worker owned elsewhere).
//! - `a_worker_drained_while_its_stream_is_closed_is_told_when_it_opens_one`:
//!   a worker drained (through B) while its heartbeat stream on A is
//!   closed, whose queued Drain command is then lost (as when A's command
//!   pump took it for a stream that had just ended), gets the Drain command
//!   when it opens a heartbeat stream on B.
//! - `a_completion_batch_locks_its_jobs_by_row_id`: a batch of completions
//!   [J2, J1] waiting for J1's row (held by the test) holds no lock on J2
//!   (the later row id): job rows are locked by id ascending, as cancels
//!   do, so the two never deadlock.
//! - `a_late_leader_statement_leaves_a_re_leased_job_alone`: the leader,
//!   held up between listing a DEAD worker's running jobs and failing them
//!   (here by a row lock the test holds), does not fail the lease another
//!   worker got meanwhile for one of those jobs.
//! - `a_claim_reads_no_job_scheduled_for_later`: with 20,000 jobs
//!   scheduled an hour ahead and one ready, the dispatcher's readiness
//!   check and claim (EXPLAIN ANALYZE on the test's database) read a few
//!   rows and buffers, not one per scheduled job; the ready job is leased
//!   at once, one scheduled 2 s ahead once due, none of the 20,000; and
//!   GetQueueStats's statement scans the jobs once.
//!
//! Every test that kills or pauses replicas also checks that no replica
//! process panicked (their logs are kept, killed ones included).
//!
//! Environment: `AGQ_CLUSTER_KILLS` (default 20) sets the number of replica
//! kills of the kill test (200: about 70 s on two cores).
//! `AGQ_TEST_DATABASE_URL` (crates/testpg) runs the tests on an
//! existing server, except the database crash, which needs the tests' own.

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

use agq::pb::{self, heartbeat_response::Command, *};
use common::{eventually, pg, plan};
use nix::sys::signal::Signal;
use process::{AgqServe, Serve};
use rand::Rng;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::timeout,
};
use tokio_stream::{wrappers::ReceiverStream, StreamExt};
use tonic::{transport::Channel, Code};

/// Heartbeat interval of the replicas, ms (a worker is stale after 3 x).
const HEARTBEAT_MS: u64 = 200;

/// How long any one call of a test client may take.
const CALL: Duration = Duration::from_secs(3);

/// A worker moves on when its replica answered no heartbeat for this long
/// (a paused process: its connections stay open).
const SILENCE: Duration = Duration::from_millis(1500);

/// The leader row's TTL (src/store/postgres/maintenance.rs): 3 x the
/// heartbeat interval, at least 1 s.
const LEADER_TTL: Duration = Duration::from_secs(1);

/// Every test but the database crash holds it shared; the crash holds it
/// alone, since it restarts the server of every test of this binary.
static PG_SERVER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// `n` replicas on one fresh database.
struct Cluster {
    url: String,
    /// Dropped before `dir` (fields drop in order): a replica dropped
    /// while a test panics prints its log, which must still be there.
    replicas: Vec<AgqServe>,
    /// The replicas' logs, every process's (killed ones included).
    dir: tempfile::TempDir,
    addrs: Vec<String>,
    /// Processes started so far (names the logs).
    started: AtomicU64,
}

impl Cluster {
    async fn start(n: usize) -> Cluster {
        let url = pg::fresh_database().await;
        let dir = tempfile::tempdir().unwrap();
        let mut c = Cluster {
            url,
            replicas: Vec::new(),
            dir,
            addrs: Vec::new(),
            started: AtomicU64::new(0),
        };
        for _ in 0..n {
            let r = tokio::task::block_in_place(|| c.spawn("127.0.0.1:0"));
            c.addrs.push(r.addr.clone());
            c.replicas.push(r);
        }
        c
    }

    /// The command line of a replica listening on `listen`.
    fn serve(&self, listen: &str) -> Serve {
        let n = self.started.fetch_add(1, Ordering::Relaxed);
        Serve::new(self.dir.path().join("unused.db"))
            .listen(listen)
            .log_to(self.dir.path().join(format!("replica-{n}.log")))
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

    /// kill -9 replica `i` and start it again on the same address
    /// (blocking: call it in `block_in_place`).
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
                Err(_) if attempt < 49 => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => panic!("replica {i} did not restart on {addr}: {e:?}"),
            }
        }
    }

    fn urls(&self) -> Vec<String> {
        self.addrs.iter().map(|a| format!("http://{a}")).collect()
    }

    /// The replica id replica `i` logged at start
    /// (`PostgreSQL engine started replica_id=…`).
    fn replica_id(&self, i: usize) -> Option<String> {
        self.replicas[i]
            .log()
            .lines()
            .filter(|l| l.contains("PostgreSQL engine started"))
            .filter_map(|l| l.split("\"replica_id\":\"").nth(1))
            .filter_map(|s| s.split('"').next())
            .map(str::to_string)
            .next_back()
    }

    /// Panics when a replica process (killed ones included) panicked.
    fn assert_no_panic(&self) {
        for e in std::fs::read_dir(self.dir.path()).unwrap() {
            let path = e.unwrap().path();
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            if let Some(at) = log.find("panicked") {
                let from = log[..at].rfind('\n').map_or(0, |i| i + 1);
                let excerpt: String = log[from..].chars().take(2000).collect();
                panic!("a replica panicked ({}):\n{excerpt}", path.display());
            }
        }
    }

    /// The index of the replica whose id is `holder`.
    fn index_of(&self, holder: &str) -> Option<usize> {
        (0..self.replicas.len()).find(|i| self.replica_id(*i).as_deref() == Some(holder))
    }
}

async fn channel(url: &str) -> Option<Channel> {
    let endpoint = Channel::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(500));
    timeout(Duration::from_secs(2), endpoint.connect())
        .await
        .ok()?
        .ok()
}

/// Leases a job got: (worker, lease id, when it arrived).
type Leases = Vec<(String, String, Instant)>;

/// What the workers saw, by job id.
#[derive(Default)]
struct Ledger {
    /// Leases received: (worker, lease id, when).
    leased: Mutex<HashMap<String, Leases>>,
    /// Completions the server acknowledged: (worker, lease id). A report
    /// whose reply was lost is sent again and acknowledged again: the same
    /// pair twice.
    completed: Mutex<HashMap<String, Vec<(String, String)>>>,
    /// Reports refused by fencing (the lease was lost meanwhile).
    fenced: AtomicU64,
    /// Completions acknowledged in a later session (on another replica, or
    /// the same one restarted) than the one that received the lease: the
    /// job kept its lease across the failover.
    carried: AtomicU64,
    /// Reports that failed (replica gone) and were sent again.
    retried: AtomicU64,
    /// Sessions opened: a registration and both streams on a replica.
    sessions: AtomicU64,
    /// Commands received: (worker, command).
    commands: Mutex<Vec<(String, Command)>>,
}

impl Ledger {
    fn leases_of(&self, job: &str) -> Vec<(String, String)> {
        self.leased
            .lock()
            .unwrap()
            .get(job)
            .map(|v| v.iter().map(|(w, l, _)| (w.clone(), l.clone())).collect())
            .unwrap_or_default()
    }

    fn got_command(&self, f: impl Fn(&str, &Command) -> bool) -> bool {
        self.commands.lock().unwrap().iter().any(|(w, c)| f(w, c))
    }
}

/// A simulated worker: see the module documentation.
#[derive(Clone)]
struct Roam {
    id: String,
    /// The replicas it may connect to, tried in turn from `start`.
    urls: Vec<String>,
    start: usize,
    slots: u32,
    /// How long a lease runs, ms: uniform in this range.
    work_ms: (u64, u64),
    /// Pause before the next session after one ended, ms.
    reconnect_ms: u64,
    ledger: Arc<Ledger>,
}

/// A lease the worker runs (or ran, report not acknowledged yet).
struct Held {
    job_id: String,
    lease_id: String,
    done_at: tokio::time::Instant,
    /// The session it arrived in.
    session: u64,
}

/// How a report ended.
enum Reported {
    Acked,
    Fenced,
    /// No answer (the replica went away): send it again elsewhere.
    Failed,
}

impl Roam {
    fn new(id: &str, urls: &[String], start: usize, ledger: &Arc<Ledger>) -> Roam {
        Roam {
            id: id.into(),
            urls: urls.to_vec(),
            start,
            slots: 2,
            work_ms: (1, 30),
            reconnect_ms: 20,
            ledger: ledger.clone(),
        }
    }

    /// Waits `ms` before reconnecting, as agw does (its first backoff is
    /// 1 s): longer than 3 heartbeat intervals, it is declared DEAD
    /// meanwhile and the jobs it still runs are leased to others.
    fn slow_reconnect(mut self, ms: u64) -> Roam {
        self.reconnect_ms = ms;
        self
    }

    fn work_ms(mut self, lo: u64, hi: u64) -> Roam {
        self.work_ms = (lo, hi);
        self
    }

    fn spawn(self, stop: &watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(roam(self, stop.clone()))
    }
}

/// The worker loop: sessions on one replica after another until `stop`.
async fn roam(w: Roam, mut stop: watch::Receiver<bool>) {
    let mut held: HashMap<String, Held> = HashMap::new();
    let mut unreported: Vec<Held> = Vec::new();
    let mut i = w.start;
    let mut session_no = 0u64;
    while !*stop.borrow() {
        let r = i % w.urls.len();
        i += 1;
        session_no += 1;
        let stopped = session(
            &w,
            &w.urls[r],
            session_no,
            &mut held,
            &mut unreported,
            &mut stop,
        )
        .await;
        if stopped {
            return;
        }
        let pause = tokio::time::sleep(Duration::from_millis(w.reconnect_ms));
        tokio::select! {
            _ = pause => {}
            _ = stop.changed() => return,
        }
    }
}

/// One session on the replica at `url`; true when stopped.
async fn session(
    w: &Roam,
    url: &str,
    session_no: u64,
    held: &mut HashMap<String, Held>,
    unreported: &mut Vec<Held>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let Some(ch) = channel(url).await else {
        return false;
    };
    let mut client = worker_service_client::WorkerServiceClient::new(ch);
    let reg = RegisterWorkerRequest {
        worker_id: w.id.clone(),
        hostname: "cluster-test".into(),
        agw_version: "sim".into(),
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            ..Default::default()
        }),
        max_concurrent_jobs: w.slots,
        instance_id: format!("instance-{}", w.id),
        ..Default::default()
    };
    if !matches!(timeout(CALL, client.register_worker(reg)).await, Ok(Ok(_))) {
        return false;
    }
    // The first heartbeat lists what this process still runs or has to
    // report; its answer comes before the lease stream is opened.
    let (hb_tx, hb_rx) = mpsc::channel(16);
    let lease_ids = held
        .keys()
        .cloned()
        .chain(unreported.iter().map(|h| h.lease_id.clone()))
        .collect();
    let first = HeartbeatRequest {
        worker_id: w.id.clone(),
        stats: Some(WorkerStats::default()),
        held_leases: Some(HeldLeases { lease_ids }),
        verification: None,
    };
    if hb_tx.try_send(first).is_err() {
        return false;
    }
    let Ok(Ok(inbound)) = timeout(CALL, client.heartbeat(ReceiverStream::new(hb_rx))).await else {
        return false;
    };
    let mut inbound = inbound.into_inner();
    match timeout(CALL, inbound.next()).await {
        Ok(Some(Ok(resp))) => on_reply(w, resp, held),
        _ => return false,
    }
    w.ledger.sessions.fetch_add(1, Ordering::Relaxed);
    // Reports whose reply was lost: sent again here.
    while let Some(h) = unreported.pop() {
        if let Reported::Failed = report(w, &mut client, &h, session_no).await {
            unreported.push(h);
            return false;
        }
    }
    let Ok(Ok(leases)) = timeout(
        CALL,
        client.lease_jobs(LeaseJobsRequest {
            worker_id: w.id.clone(),
        }),
    )
    .await
    else {
        return false;
    };
    let mut leases = leases.into_inner();
    let mut ticker = tokio::time::interval(Duration::from_millis(HEARTBEAT_MS / 2));
    let mut last_reply = Instant::now();
    let far = tokio::time::Instant::now() + Duration::from_secs(3600);
    loop {
        let next_done = held.values().map(|h| h.done_at).min().unwrap_or(far);
        tokio::select! {
            _ = stop.changed() => return true,
            _ = ticker.tick() => {
                if last_reply.elapsed() > SILENCE {
                    return false;
                }
                let beat = HeartbeatRequest {
                    worker_id: w.id.clone(),
                    stats: Some(WorkerStats::default()),
                    held_leases: None,
                    verification: None,
                };
                // A full buffer: the replica reads nothing (paused).
                if hb_tx.try_send(beat).is_err() {
                    return false;
                }
            }
            msg = inbound.next() => match msg {
                Some(Ok(resp)) => {
                    last_reply = Instant::now();
                    on_reply(w, resp, held);
                }
                _ => return false,
            },
            lease = leases.next(), if held.len() < w.slots as usize => {
                let Some(Ok(lease)) = lease else { return false };
                let job_id = lease.job.as_ref().map(|j| j.job_id.clone()).unwrap_or_default();
                w.ledger
                    .leased
                    .lock()
                    .unwrap()
                    .entry(job_id.clone())
                    .or_default()
                    .push((w.id.clone(), lease.lease_id.clone(), Instant::now()));
                let ms = rand::rng().random_range(w.work_ms.0..=w.work_ms.1);
                held.insert(lease.lease_id.clone(), Held {
                    job_id,
                    lease_id: lease.lease_id,
                    done_at: tokio::time::Instant::now() + Duration::from_millis(ms),
                    session: session_no,
                });
            }
            _ = tokio::time::sleep_until(next_done), if !held.is_empty() => {
                let now = tokio::time::Instant::now();
                let due: Vec<String> = held
                    .iter()
                    .filter(|(_, h)| h.done_at <= now)
                    .map(|(l, _)| l.clone())
                    .collect();
                for lease in due {
                    let Some(h) = held.remove(&lease) else { continue };
                    if let Reported::Failed = report(w, &mut client, &h, session_no).await {
                        unreported.push(h);
                        return false;
                    }
                }
            }
        }
    }
}

/// Records a heartbeat answer's command; a cancel stops the job (its
/// lease is already revoked: no report).
fn on_reply(w: &Roam, resp: HeartbeatResponse, held: &mut HashMap<String, Held>) {
    if let Some(c) = resp.command {
        if let Command::CancelJobId(job) = &c {
            held.retain(|_, h| h.job_id != *job);
        }
        w.ledger.commands.lock().unwrap().push((w.id.clone(), c));
    }
}

/// Reports `h` completed.
async fn report(
    w: &Roam,
    client: &mut worker_service_client::WorkerServiceClient<Channel>,
    h: &Held,
    session_no: u64,
) -> Reported {
    let call = client.update_job(UpdateJobRequest {
        job_id: h.job_id.clone(),
        worker_id: w.id.clone(),
        lease_id: h.lease_id.clone(),
        status: JobStatus::Completed as i32,
        ..Default::default()
    });
    match timeout(CALL, call).await {
        Ok(Ok(_)) => {
            w.ledger
                .completed
                .lock()
                .unwrap()
                .entry(h.job_id.clone())
                .or_default()
                .push((w.id.clone(), h.lease_id.clone()));
            if h.session != session_no {
                w.ledger.carried.fetch_add(1, Ordering::Relaxed);
            }
            Reported::Acked
        }
        Ok(Err(s))
            if matches!(
                s.code(),
                Code::FailedPrecondition | Code::PermissionDenied | Code::NotFound
            ) =>
        {
            w.ledger.fenced.fetch_add(1, Ordering::Relaxed);
            Reported::Fenced
        }
        _ => {
            w.ledger.retried.fetch_add(1, Ordering::Relaxed);
            Reported::Failed
        }
    }
}

/// What the submitters got.
#[derive(Default)]
struct Submitted {
    /// Job ids of acknowledged SubmitAction calls.
    acked: Vec<String>,
    /// Calls that failed (their jobs may exist or not).
    failed: u32,
}

/// Submits actions of `per` jobs every `pace_ms` until `stop`, round-robin
/// over the replicas from `start`, moving on when one fails.
async fn submitter(
    urls: Vec<String>,
    start: usize,
    per: usize,
    pace_ms: u64,
    stop: watch::Receiver<bool>,
) -> Submitted {
    let mut out = Submitted::default();
    let mut i = start;
    while !*stop.borrow() {
        let url = &urls[i % urls.len()];
        i += 1;
        let Some(ch) = channel(url).await else {
            out.failed += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let mut c = action_service_client::ActionServiceClient::new(ch);
        let r = timeout(
            CALL,
            c.submit_action(SubmitActionRequest {
                plan_id: "p".into(),
                inputs: (0..per)
                    .map(|n| ActionInput {
                        values: [("n".to_string(), n.to_string())].into(),
                    })
                    .collect(),
                max_attempts: 100,
                ..Default::default()
            }),
        )
        .await;
        match r {
            Ok(Ok(r)) => out.acked.extend(r.into_inner().job_ids),
            _ => out.failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(pace_ms)).await;
    }
    out
}

async fn submit_one(url: &str) -> String {
    let ch = channel(url).await.expect("connect");
    let r = action_service_client::ActionServiceClient::new(ch)
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![ActionInput {
                values: [("n".to_string(), "1".to_string())].into(),
            }],
            max_attempts: 5,
            ..Default::default()
        })
        .await
        .expect("submit")
        .into_inner();
    r.job_ids[0].clone()
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
    timeout(
        CALL,
        job_service_client::JobServiceClient::new(ch).get_job(GetJobRequest { job_id: id.into() }),
    )
    .await
    .ok()?
    .ok()?
    .into_inner()
    .job
}

async fn worker_of(url: &str, id: &str) -> Option<pb::Worker> {
    let ch = channel(url).await?;
    timeout(
        CALL,
        worker_service_client::WorkerServiceClient::new(ch).get_worker(GetWorkerRequest {
            worker_id: id.into(),
        }),
    )
    .await
    .ok()?
    .ok()?
    .into_inner()
    .worker
}

/// The first answer of `f` on any of `urls`.
async fn on_any<T, F, Fut>(urls: &[String], f: F) -> Option<T>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    for u in urls {
        if let Some(t) = f(u.clone()).await {
            return Some(t);
        }
    }
    None
}

/// Every job id in `status` (all pages), through `url`.
async fn search(url: &str, status: JobStatus) -> Option<HashSet<String>> {
    let ch = channel(url).await?;
    let mut c = job_service_client::JobServiceClient::new(ch);
    let mut out = HashSet::new();
    let mut token = String::new();
    loop {
        let r = timeout(
            CALL,
            c.search_jobs(SearchJobsRequest {
                status: status as i32,
                page_size: 1000,
                page_token: token.clone(),
                ..Default::default()
            }),
        )
        .await
        .ok()?
        .ok()?
        .into_inner();
        out.extend(r.job_ids);
        if r.next_page_token.is_empty() {
            return Some(out);
        }
        token = r.next_page_token;
    }
}

/// Statements of this test's database, their text `LIKE` `pattern`,
/// that wait for a lock (a row lock another transaction holds).
async fn lock_waiters(db: &tokio_postgres::Client, pattern: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
         AND wait_event_type = 'Lock' AND query LIKE $1",
        &[&pattern],
    )
    .await
    .unwrap()
    .get(0)
}

async fn serving(url: &str) -> bool {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let Some(ch) = channel(url).await else {
        return false;
    };
    let r = timeout(
        CALL,
        HealthClient::new(ch).check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await;
    matches!(r, Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32)
}

/// Running jobs whose worker is not live or holds no lease, re-read to
/// rule out a change between the two reads (the issue 3 invariant of
/// `assert_nothing_stranded`, on a cluster that keeps moving).
async fn stranded(urls: &[String]) -> Vec<String> {
    let running = on_any(
        urls,
        |u| async move { search(&u, JobStatus::Running).await },
    )
    .await
    .expect("no replica answers SearchJobs");
    let mut out = Vec::new();
    for id in running {
        let Some(j) = on_any(urls, |u| {
            let id = id.clone();
            async move { job_of(&u, &id).await }
        })
        .await
        else {
            continue;
        };
        if j.status != JobStatus::Running as i32 {
            continue;
        }
        let w = on_any(urls, |u| {
            let wid = j.worker_id.clone();
            async move { worker_of(&u, &wid).await }
        })
        .await;
        let live = w.as_ref().is_some_and(|w| {
            (w.state == WorkerState::Active as i32 || w.state == WorkerState::Draining as i32)
                && w.active_leases > 0
        });
        if live {
            continue;
        }
        let again = on_any(urls, |u| {
            let id = id.clone();
            async move { job_of(&u, &id).await }
        })
        .await;
        if again.is_some_and(|a| {
            a.status == JobStatus::Running as i32
                && a.worker_id == j.worker_id
                && a.attempt == j.attempt
        }) {
            out.push(format!(
                "job {id} (attempt {}) running on {} which is {:?}",
                j.attempt,
                j.worker_id,
                w.map(|w| (WorkerState::try_from(w.state), w.active_leases))
            ));
        }
    }
    out
}

/// The end of a run under failures: waits for every acknowledged job to
/// complete (bounded), checks that nothing is stranded while the workers
/// still run, waits for every job of the database to finish, stops the
/// workers, and checks the ledger. Panics on any violation; returns the
/// line to print.
async fn settle(
    urls: &[String],
    sub: &Submitted,
    ledger: &Ledger,
    stop_workers: watch::Sender<bool>,
    workers: Vec<JoinHandle<()>>,
) -> String {
    let acked: HashSet<String> = sub.acked.iter().cloned().collect();
    assert_eq!(acked.len(), sub.acked.len(), "a job id acknowledged twice");
    assert!(!acked.is_empty(), "no submission was acknowledged");
    // 1. Every acknowledged job completes.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut left: Vec<String>;
    loop {
        let done = on_any(
            urls,
            |u| async move { search(&u, JobStatus::Completed).await },
        )
        .await
        .unwrap_or_default();
        left = acked.difference(&done).cloned().collect();
        if left.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    if !left.is_empty() {
        let sample = on_any(urls, |u| {
            let id = left[0].clone();
            async move { job_of(&u, &id).await }
        })
        .await;
        panic!(
            "{} of {} acknowledged jobs never completed, e.g. {sample:?}, leased as {:?}",
            left.len(),
            acked.len(),
            ledger.leases_of(&left[0])
        );
    }
    // 2. Nothing stranded, the workers still running.
    let bad = stranded(urls).await;
    assert!(bad.is_empty(), "stranded jobs: {bad:?}");
    // 3. Every job in the database finishes, acknowledged or not.
    let mut open: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        open.clear();
        for s in [JobStatus::Pending, JobStatus::Running, JobStatus::Failed] {
            let ids = on_any(urls, |u| async move { search(&u, s).await })
                .await
                .expect("no replica answers SearchJobs");
            open.extend(ids);
        }
        if open.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        open.is_empty(),
        "{} jobs never finished, e.g. {:?}",
        open.len(),
        job_of(&urls[0], &open[0]).await
    );
    let total = on_any(
        urls,
        |u| async move { search(&u, JobStatus::Completed).await },
    )
    .await
    .unwrap_or_default();
    let _ = stop_workers.send(true);
    for w in workers {
        let _ = timeout(Duration::from_secs(5), w).await;
    }
    // 4. The ledger: no job acknowledged completed under two leases or to
    //    two workers; every acknowledged completion is in the database.
    let completed = ledger.completed.lock().unwrap().clone();
    let mut twice = Vec::new();
    let mut repeats = 0;
    for (job, acks) in &completed {
        let distinct: HashSet<_> = acks.iter().collect();
        repeats += acks.len() - distinct.len();
        if distinct.len() > 1 {
            twice.push(format!("{job}: {acks:?}"));
        }
        assert!(
            total.contains(job),
            "job {job}'s completion was acknowledged ({acks:?}) but it is not completed"
        );
    }
    assert!(
        twice.is_empty(),
        "jobs acknowledged completed under two leases: {twice:?}"
    );
    let leased = ledger.leased.lock().unwrap().clone();
    let re_executions: usize = leased.values().map(|l| l.len().saturating_sub(1)).sum();
    let on_two_workers = leased
        .values()
        .filter(|l| l.iter().map(|(w, _, _)| w).collect::<HashSet<_>>().len() > 1)
        .count();
    format!(
        "{} jobs acknowledged ({} submissions failed), {} completed in all, {re_executions} \
         re-executions ({on_two_workers} jobs ran on two workers), {} late reports fenced, \
         {} reports sent again ({repeats} acknowledged twice), {} completions kept their lease \
         across a reconnect, {} worker sessions",
        acked.len(),
        sub.failed,
        total.len(),
        ledger.fenced.load(Ordering::Relaxed),
        ledger.retried.load(Ordering::Relaxed),
        ledger.carried.load(Ordering::Relaxed),
        ledger.sessions.load(Ordering::Relaxed),
    )
}

/// The job counts kept by the triggers (`job_counts`, what `/metrics`
/// reads) equal a count of the job rows: transactions cut by a replica's
/// `kill -9` or the database's crash took their counts with them.
async fn assert_counts_kept(url: &str) {
    let db = pg::connect(url).await;
    let jobs: i64 = db
        .query_one("SELECT count(*) FROM jobs", &[])
        .await
        .unwrap()
        .get(0);
    assert!(jobs > 0, "no jobs");
    common::assert_job_counts_kept(&db).await;
}

fn env_or(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_kills_lose_and_duplicate_nothing() {
    let _shared = PG_SERVER.read().await;
    let kills = env_or("AGQ_CLUSTER_KILLS", 20);
    let mut cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    let ledger = Arc::new(Ledger::default());
    let (stop_workers, stop) = watch::channel(false);
    // Four workers reconnect at once and keep their jobs; two wait a
    // second, like agw, and lose theirs to the others.
    let workers: Vec<_> = (0..6)
        .map(|n| {
            let w = Roam::new(&format!("w{n}"), &urls, n, &ledger);
            let w = if n < 4 {
                w
            } else {
                w.slow_reconnect(1000).work_ms(20, 300)
            };
            w.spawn(&stop)
        })
        .collect();
    let (stop_submitting, submitting) = watch::channel(false);
    let submitters: Vec<_> = (0..3)
        .map(|n| tokio::spawn(submitter(urls.clone(), n, 5, 100, submitting.clone())))
        .collect();
    let started = Instant::now();
    let mut victims = [0u32; 3];
    for _ in 0..kills {
        let wait = rand::rng().random_range(100..=400);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let victim = rand::rng().random_range(0..3);
        victims[victim] += 1;
        tokio::task::block_in_place(|| cluster.kill_and_restart(victim));
    }
    let killing = started.elapsed();
    let _ = stop_submitting.send(true);
    let mut sub = Submitted::default();
    for s in submitters {
        let s = timeout(Duration::from_secs(10), s)
            .await
            .expect("a submitter did not stop")
            .unwrap();
        sub.acked.extend(s.acked);
        sub.failed += s.failed;
    }
    let summary = settle(&urls, &sub, &ledger, stop_workers, workers).await;
    cluster.assert_no_panic();
    assert_counts_kept(&cluster.url).await;
    println!(
        "cluster kills: {kills} kill -9s ({victims:?} per replica) in {:.1} s; {summary}; \
         settled in {:.1} s",
        killing.as_secs_f64(),
        (started.elapsed() - killing).as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_killed_or_paused_hands_maintenance_over() {
    let _shared = PG_SERVER.read().await;
    let mut cluster = Cluster::start(3).await;
    let urls = cluster.urls();
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
    for round in ["kill", "stop"] {
        let holder = leader().await.expect("a leader");
        let i = cluster
            .index_of(&holder)
            .unwrap_or_else(|| panic!("the leader {holder} is none of the replicas"));
        // A worker on another replica that will go silent holding a job.
        let other = (i + 1) % 3;
        let ledger = Arc::new(Ledger::default());
        let (stop_tx, stop) = watch::channel(false);
        let silent = format!("silent-{round}");
        let w = Roam::new(&silent, &urls[other..=other], 0, &ledger)
            .work_ms(600_000, 600_000)
            .spawn(&stop);
        let job = submit_one(&urls[other]).await;
        // Committed and received: a lease committed but still on its way
        // when the worker is aborted below would never reach the ledger.
        eventually(10, "the silent worker holds the job", || async {
            ledger.leases_of(&job).iter().any(|(w, _)| *w == silent)
                && job_of(&urls[other], &job)
                    .await
                    .is_some_and(|j| j.status == JobStatus::Running as i32 && j.worker_id == silent)
        })
        .await;
        let t0 = Instant::now();
        match round {
            "kill" => cluster.replicas[i].kill(),
            _ => cluster.replicas[i].signal(Signal::SIGSTOP),
        }
        // Its streams drop: the worker is suspect, then stale; only a
        // leader re-queues its job and declares it DEAD.
        w.abort();
        let _ = stop_tx.send(true);
        eventually(10, "another replica took the leadership", || async {
            leader().await.is_some_and(|h| h != holder)
        })
        .await;
        let took_over = t0.elapsed();
        let new_holder = leader().await.unwrap();
        assert!(
            cluster.index_of(&new_holder).is_some_and(|j| j != i),
            "the new leader {new_holder} is not another replica"
        );
        assert!(
            took_over < LEADER_TTL + Duration::from_secs(3),
            "the leadership moved only after {took_over:?}"
        );
        eventually(5, "the silent worker is declared DEAD", || async {
            worker_of(&urls[other], &silent)
                .await
                .is_some_and(|w| w.state == WorkerState::Dead as i32)
        })
        .await;
        let dead_after = t0.elapsed();
        // Its job is leased again and completed by a live worker.
        let live = format!("live-{round}");
        let (stop_tx, stop) = watch::channel(false);
        let helper = Roam::new(&live, &urls[other..=other], 0, &ledger)
            .work_ms(1, 1)
            .spawn(&stop);
        eventually(10, "the job completes on a live worker", || async {
            job_of(&urls[other], &job)
                .await
                .is_some_and(|j| j.status == JobStatus::Completed as i32)
        })
        .await;
        if round == "stop" {
            // Resumed, the old leader's late work changes nothing.
            cluster.replicas[i].signal(Signal::SIGCONT);
            eventually(10, "the resumed replica serves again", || async {
                serving(&urls[i]).await
            })
            .await;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            assert_eq!(
                leader().await.as_deref(),
                Some(new_holder.as_str()),
                "the leadership moved again after the old leader resumed"
            );
            let j = job_of(&urls[i], &job)
                .await
                .expect("the job, via the resumed replica");
            assert_eq!(j.status, JobStatus::Completed as i32, "{j:?}");
            assert_eq!(j.attempt, 2, "{j:?}");
            assert_eq!(j.worker_id, live, "{j:?}");
        }
        let _ = stop_tx.send(true);
        let _ = timeout(Duration::from_secs(5), helper).await;
        let leases = ledger.leases_of(&job);
        assert_eq!(
            leases.iter().map(|(w, _)| w.as_str()).collect::<Vec<_>>(),
            [silent.as_str(), live.as_str()],
            "one lease to each worker: {leases:?}"
        );
        let acks = ledger.completed.lock().unwrap().get(&job).cloned();
        assert_eq!(acks, Some(vec![leases[1].clone()]), "one completion");
        println!(
            "cluster leader ({round}): leadership moved after {:.1} s, the silent worker DEAD \
             after {:.1} s",
            took_over.as_secs_f64(),
            dead_after.as_secs_f64()
        );
        if round == "kill" {
            // Back to three replicas for the next round.
            tokio::task::block_in_place(|| cluster.kill_and_restart(i));
        }
    }
    cluster.assert_no_panic();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_listener_connection_still_leases() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    // The worker on A, the jobs submitted on B: A learns of them through
    // the database (a notification, else its poll).
    let worker = Roam::new("w", &urls[..1], 0, &ledger)
        .work_ms(1, 1)
        .spawn(&stop);
    let warm = submit_one(&urls[1]).await;
    eventually(10, "a first job completes", || async {
        job_of(&urls[1], &warm)
            .await
            .is_some_and(|j| j.status == JobStatus::Completed as i32)
    })
    .await;
    let db = pg::connect(&cluster.url).await;
    let listeners = || async {
        db.query_one(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    eventually(10, "one listener connection per replica", || async {
        listeners().await == 2
    })
    .await;
    // Cut every listener connection every 50 ms while jobs are submitted.
    let cutter = {
        let db = pg::connect(&cluster.url).await;
        let (done_tx, mut done) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut cut = 0i64;
            while !*done.borrow() {
                cut += db
                    .query_one(
                        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                         WHERE datname = current_database() AND query LIKE 'LISTEN%') t",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get::<_, i64>(0);
                let _ = timeout(Duration::from_millis(50), done.changed()).await;
            }
            cut
        });
        (done_tx, task)
    };
    let mut latencies = Vec::new();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let job = submit_one(&urls[1]).await;
        let acked = Instant::now();
        eventually(5, "the job is leased", || async {
            ledger.leased.lock().unwrap().contains_key(&job)
        })
        .await;
        let at = ledger.leased.lock().unwrap()[&job][0].2;
        latencies.push(at.saturating_duration_since(acked));
    }
    let _ = cutter.0.send(true);
    let cut = cutter.1.await.unwrap();
    assert!(cut >= 2, "no listener connection was cut");
    let worst = latencies.iter().max().copied().unwrap_or_default();
    assert!(
        worst < Duration::from_millis(1500),
        "a job waited {worst:?} for its lease with the listeners cut (poll 500 ms): {latencies:?}"
    );
    eventually(10, "both listeners are back", || async {
        listeners().await == 2
    })
    .await;
    let _ = stop_tx.send(true);
    let _ = timeout(Duration::from_secs(5), worker).await;
    println!(
        "cluster listener: {cut} listener connections cut; lease latencies {:?}",
        latencies
            .iter()
            .map(|d| d.as_millis() as u64)
            .collect::<Vec<_>>()
    );
}

/// Server processes stopped with SIGSTOP, resumed (SIGCONT) when dropped.
struct Stopped(Vec<i32>);

impl Stopped {
    /// Stops `pids`.
    fn stop(pids: Vec<i32>) -> Stopped {
        let mut stopped = Stopped(Vec::new());
        for pid in pids {
            stopped.add(pid);
        }
        stopped
    }

    /// Stops `pid` too.
    fn add(&mut self, pid: i32) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGSTOP)
            .expect("SIGSTOP a PostgreSQL server process");
        self.0.push(pid);
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), Signal::SIGCONT);
        }
    }
}

/// A LISTEN connection that went silent, without an error (its server
/// process stopped with SIGSTOP here, as a half-open TCP connection or a
/// stalled server behaves), is replaced: a WatchAction on replica B still
/// reports a job completed through replica A. B's watchers learn of
/// another replica's changes only through its listener; a listener that
/// waited on a silent connection for good left them waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_listener_connection_is_replaced() {
    if std::env::var("AGQ_TEST_DATABASE_URL").is_ok_and(|u| !u.trim().is_empty()) {
        eprintln!("skipped: AGQ_TEST_DATABASE_URL names a server these tests do not own");
        return;
    }
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    let db = pg::connect(&cluster.url).await;
    let listeners = || async {
        db.query(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.get::<_, i32>(0))
        .collect::<Vec<i32>>()
    };
    eventually(10, "one listener connection per replica", || async {
        listeners().await.len() == 2
    })
    .await;
    let mut w = HandWorker::start(&urls[0], "w", "instance-w", &["cat"]).await;
    let (action, job) = submit_action_of(&urls[0], "p", 1, None).await;
    let l = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("W leases the job")
        .unwrap()
        .unwrap();
    assert_eq!(l.job.as_ref().unwrap().job_id, job);
    // Both listeners go silent.
    let stopped = Stopped::stop(listeners().await);
    assert_eq!(stopped.0.len(), 2, "one listener connection per replica");
    let (mut watch, first) = watch_on(&urls[1], &action).await;
    assert_eq!(first.running, 1, "{first:?}");
    w.client
        .update_job(UpdateJobRequest {
            job_id: job.clone(),
            worker_id: "w".into(),
            lease_id: l.lease_id.clone(),
            status: JobStatus::Completed as i32,
            ..Default::default()
        })
        .await
        .expect("W completes the job through A");
    let seen = timeout(Duration::from_secs(15), async {
        while let Some(Ok(m)) = watch.next().await {
            let a = m.action.unwrap();
            if a.completed == 1 {
                return Some(a);
            }
        }
        None
    })
    .await;
    drop(stopped);
    assert!(
        matches!(seen, Ok(Some(_))),
        "the watch on replica B did not report the job completed through A within 15 s of its \
         listener connection going silent: {seen:?}"
    );
    eventually(10, "both replicas listen again", || async {
        listeners().await.len() >= 2
    })
    .await;
    cluster.assert_no_panic();
}

/// A watch learns of a change whose notification never came (the replica
/// that committed it died before its `NOTIFY`): a replica's WatchAction
/// streams re-read their action every 10 s without one. A re-read that
/// finds the action unchanged sends nothing. The change here is made in
/// the database directly, so no replica notifies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_learns_of_a_change_whose_notification_was_lost() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    let (action, job) = submit_action_of(&url, "p", 1, None).await;
    let (mut watch, first) = watch_on(&url, &action).await;
    assert_eq!((first.pending, first.dead), (1, 0), "{first:?}");
    let quiet = timeout(Duration::from_secs(11), watch.next()).await;
    assert!(
        quiet.is_err(),
        "the watch sent a message with nothing changed: {quiet:?}"
    );
    let db = pg::connect(&cluster.url).await;
    let changed = db
        .execute(
            "UPDATE jobs SET status = 5, completed_at_ms = agq_now_ms(), error = 'failed'
             WHERE job_id = $1 AND status = 1",
            &[&job],
        )
        .await
        .unwrap();
    assert_eq!(changed, 1);
    let seen = timeout(Duration::from_secs(15), watch.next())
        .await
        .expect("the watch re-read the action within 15 s of the unnotified change")
        .expect("a message")
        .expect("not an error")
        .action
        .unwrap();
    assert_eq!((seen.pending, seen.dead), (0, 1), "{seen:?}");
    cluster.assert_no_panic();
}

/// A replica whose database stops answering without an error (every
/// server process of its database stopped with SIGSTOP, new ones too, as
/// behind a network partition that drops packets) turns NOT_SERVING, so
/// that probes take it out of the Service, and SERVING again once the
/// database answers. Its health refresh waited on the silent connection
/// for good, and readiness stayed SERVING while every call hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_database_stops_answering_turns_not_serving() {
    if std::env::var("AGQ_TEST_DATABASE_URL").is_ok_and(|u| !u.trim().is_empty()) {
        eprintln!("skipped: AGQ_TEST_DATABASE_URL names a server these tests do not own");
        return;
    }
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    eventually(10, "the replica serves", || serving(&url)).await;
    let db = pg::connect(&cluster.url).await;
    let (done_tx, mut done) = watch::channel(false);
    // Every server process of the database but this test's, stopped, and
    // those the replica opens meanwhile as they appear.
    let stopper = tokio::spawn(async move {
        let mut stopped = Stopped(Vec::new());
        while !*done.borrow() {
            let pids: Vec<i32> = db
                .query(
                    "SELECT pid FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                    &[],
                )
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.get(0))
                .collect();
            for pid in pids {
                if !stopped.0.contains(&pid) {
                    stopped.add(pid);
                }
            }
            let _ = timeout(Duration::from_millis(50), done.changed()).await;
        }
        stopped.0.len()
    });
    let turned = timeout(Duration::from_secs(20), async {
        while serving(&url).await {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let _ = done_tx.send(true);
    let stopped = stopper.await.unwrap();
    assert!(stopped > 0, "no server process of the database was stopped");
    assert!(
        turned.is_ok(),
        "the replica still reported SERVING 20 s after its database stopped answering"
    );
    eventually(20, "the replica serves again", || serving(&url)).await;
    cluster.assert_no_panic();
}

/// A heartbeat stream the replica refuses after it took the worker over
/// (here: one of the statements that follow the takeover fails, its
/// connection cut while it waits for a lock the test holds) is closed
/// like one that ended: the worker is suspect (`heartbeat_open` false,
/// its leases re-queued after the grace) and the replica keeps no entry
/// for it (`agq_replica_workers`). The refused stream was left open in
/// the database and in the replica's memory for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_heartbeat_stream_is_closed() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    let probe = pg::connect(&cluster.url).await;
    // No maintenance pass declares the silent worker DEAD meanwhile (its
    // End command would end what the replica holds for it).
    let leader = hold_maintenance(&cluster.url).await;
    let mut client = worker_service_client::WorkerServiceClient::new(channel(&url).await.unwrap());
    register_cat_worker(&mut client, "w", "instance-w", 1)
        .await
        .unwrap();
    // The statements after the takeover read the worker's challenges.
    let mut locker = pg::connect(&cluster.url).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE worker_challenges IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(16);
    tx.send(first_heartbeat("w")).await.unwrap();
    let opening = tokio::spawn(async move { client.heartbeat(ReceiverStream::new(rx)).await });
    cut_statements_waiting_on(&probe, "%worker_challenges%").await;
    lock.rollback().await.unwrap();
    let opened = timeout(CALL, opening)
        .await
        .expect("the opening ends")
        .unwrap();
    assert!(opened.is_err(), "the stream was refused");
    drop(tx);
    let closed = closes_within_5_s(&probe, "heartbeat_open", || async {
        metric_of(&url, "agq_replica_workers").await == Some(0.0)
    })
    .await;
    leader.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        closed,
        "5 s after the replica refused W's heartbeat stream, the stream is still open in the \
         database or in the replica's memory"
    );
    cluster.assert_no_panic();
}

/// A WatchAction stream of `action` opened on the replica at `url`, and
/// its first message (the action as it is).
async fn watch_on(
    url: &str,
    action: &str,
) -> (tonic::Streaming<WatchActionResponse>, ActionStatus) {
    let mut watch = action_service_client::ActionServiceClient::new(channel(url).await.unwrap())
        .watch_action(WatchActionRequest {
            action_id: action.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = timeout(CALL, watch.next())
        .await
        .expect("the watch's first message")
        .unwrap()
        .unwrap()
        .action
        .unwrap();
    (watch, first)
}

/// Waits until a statement waits for a lock the test holds, its text
/// matching `pattern` (LIKE), then terminates every such backend: the
/// connection under a replica's statement is lost mid-call.
async fn cut_statements_waiting_on(probe: &tokio_postgres::Client, pattern: &str) {
    eventually(10, "a statement waits for the lock", || async {
        lock_waiters(probe, pattern).await >= 1
    })
    .await;
    let cut: i64 = probe
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE $1) t",
            &[&pattern],
        )
        .await
        .unwrap()
        .get(0);
    assert!(cut >= 1, "no statement waited");
}

/// Whether, within 5 s, worker `w`'s stream flag `column` of `workers`
/// turns false and `also` holds.
async fn closes_within_5_s<F, Fut>(probe: &tokio_postgres::Client, column: &str, also: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let sql = format!("SELECT {column} FROM workers WHERE worker_id = 'w'");
    timeout(Duration::from_secs(5), async {
        loop {
            let open: bool = probe.query_one(&sql, &[]).await.unwrap().get(0);
            if !open && also().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .is_ok()
}

/// The same for a lease stream: one refused after it was attached (here:
/// reading back the leases still in flight to the worker fails, its
/// connection cut while it waits for a lock the test holds) is closed
/// like one that ended (`lease_stream_open` false), not left open in the
/// database and in the replica's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_lease_stream_is_closed() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    let probe = pg::connect(&cluster.url).await;
    let leader = hold_maintenance(&cluster.url).await;
    let mut w = HandWorker::start(&url, "w", "instance-w", &["cat"]).await;
    submit_one(&url).await;
    next_lease(&mut w, Duration::from_secs(5))
        .await
        .expect("W leases the job");
    // The lease stream reconnects: the lease just pushed is read back.
    let mut locker = pg::connect(&cluster.url).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE actions IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut client = w.client.clone();
    let opening = tokio::spawn(async move {
        client
            .lease_jobs(LeaseJobsRequest {
                worker_id: "w".into(),
            })
            .await
    });
    cut_statements_waiting_on(&probe, "%JOIN actions%").await;
    lock.rollback().await.unwrap();
    let opened = timeout(CALL, opening)
        .await
        .expect("the opening ends")
        .unwrap();
    assert!(opened.is_err(), "the stream was refused");
    let closed = closes_within_5_s(&probe, "lease_stream_open", || async { true }).await;
    leader.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        closed,
        "5 s after the replica refused W's new lease stream, it is still open in the database"
    );
    cluster.assert_no_panic();
}

/// The worker selectors stored in `db` (`selectors`) but the empty one,
/// in order.
async fn stored_selectors(db: &tokio_postgres::Client) -> Vec<String> {
    db.query(
        "SELECT selector FROM selectors WHERE selector <> '' ORDER BY selector",
        &[],
    )
    .await
    .unwrap()
    .into_iter()
    .map(|r| r.get::<_, String>(0))
    .collect()
}

/// The worker selectors of stored actions (`selectors`, which every
/// dispatcher round reads whole and matches against its workers' tags)
/// keep only those of open jobs: the selector of an action whose jobs
/// all ended is dropped by the leader, so distinct selectors used once
/// (a selector per batch, say) do not pile up and slow every round of
/// every replica for good. A job retried after its selector was dropped
/// brings it back, and is leased to a worker that matches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn selectors_of_finished_actions_are_dropped() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    let db = pg::connect(&cluster.url).await;
    let kept = || stored_selectors(&db);
    let mut actions = action_service_client::ActionServiceClient::new(channel(&url).await.unwrap());
    let mut submitted = Vec::new();
    for batch in ["batch=1", "batch=2"] {
        let r = actions
            .submit_action(SubmitActionRequest {
                plan_id: "p".into(),
                inputs: vec![ActionInput::default()],
                max_attempts: 1,
                worker_selector: batch.into(),
                ..Default::default()
            })
            .await
            .expect("submit")
            .into_inner();
        submitted.push((r.action_id, r.job_ids[0].clone()));
    }
    assert_eq!(kept().await, ["batch=1", "batch=2"]);
    // Both end: the first cancelled, the second dead (its one attempt
    // failed).
    actions
        .cancel_action(CancelActionRequest {
            action_id: submitted[0].0.clone(),
        })
        .await
        .expect("cancel");
    db.execute(
        "UPDATE jobs SET status = 5, completed_at_ms = agq_now_ms(), error = 'failed'
         WHERE job_id = $1 AND status = 1",
        &[&submitted[1].1],
    )
    .await
    .unwrap();
    eventually(10, "the selectors of ended jobs are dropped", || async {
        kept().await.is_empty()
    })
    .await;
    // The dead job is retried: its selector is back, and a worker with a
    // matching tag leases it.
    job_service_client::JobServiceClient::new(channel(&url).await.unwrap())
        .retry_job(RetryJobRequest {
            job_id: submitted[1].1.clone(),
            priority: None,
        })
        .await
        .expect("retry");
    assert_eq!(kept().await, ["batch=2"]);
    let mut w =
        HandWorker::start_tagged(&url, "w", "instance-w", &["cat"], &[("batch", "2")]).await;
    let l = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("the retried job is leased to the worker that matches its selector")
        .unwrap()
        .unwrap();
    assert_eq!(l.job.unwrap().job_id, submitted[1].1);
    cluster.assert_no_panic();
}

/// A submit that reuses a selector no open job uses, while the leader
/// drops unused selectors, keeps it: the submit holds its selector's row
/// until it commits, so the drop passes that row over (and drops the
/// other unused one), and the submitted job is leased to a worker that
/// matches it. Dropped under the submit, the job would never be claimed:
/// a dispatcher matches only stored selectors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_selector_reused_while_unused_ones_are_dropped_is_kept() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    let db = pg::connect(&cluster.url).await;
    let kept = || stored_selectors(&db);
    let actions = action_service_client::ActionServiceClient::new(channel(&url).await.unwrap());
    let submit = |selector: &'static str| {
        let mut actions = actions.clone();
        async move {
            actions
                .submit_action(SubmitActionRequest {
                    plan_id: "p".into(),
                    inputs: vec![ActionInput::default()],
                    worker_selector: selector.into(),
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner())
        }
    };
    // "batch=old" stored, then unused: its action is cancelled. The test
    // holds its row (as a submit does) from before the cancel until the
    // reuse below holds it: a drop pass in between would drop it, and the
    // reuse would store it again, so no drop would run under the reuse.
    let old = submit("batch=old").await.expect("submit");
    let mut guard_conn = pg::connect(&cluster.url).await;
    let guard = guard_conn.transaction().await.unwrap();
    guard
        .batch_execute("SELECT 1 FROM selectors WHERE selector = 'batch=old' FOR KEY SHARE")
        .await
        .unwrap();
    actions
        .clone()
        .cancel_action(CancelActionRequest {
            action_id: old.action_id,
        })
        .await
        .expect("cancel");
    // "batch=other" stays in use until the reuse holds "batch=old".
    let other = submit("batch=other").await.expect("submit");
    // A submit reusing "batch=old" waits in the insert of its job (a
    // trigger waits for an advisory lock the test holds); nothing else
    // waits.
    db.batch_execute(
        "CREATE FUNCTION agq_test_stall() RETURNS trigger AS $$
         BEGIN
           IF NEW.worker_selector = 'batch=old' THEN PERFORM pg_advisory_xact_lock(4242); END IF;
           RETURN NEW;
         END $$ LANGUAGE plpgsql;
         CREATE TRIGGER agq_test_stall BEFORE INSERT ON jobs
           FOR EACH ROW EXECUTE FUNCTION agq_test_stall();",
    )
    .await
    .unwrap();
    let mut locker = pg::connect(&cluster.url).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("SELECT pg_advisory_xact_lock(4242)")
        .await
        .unwrap();
    let reuse = tokio::spawn(submit("batch=old"));
    eventually(10, "the submit waits to insert its job", || async {
        lock_waiters(&db, "%INSERT INTO jobs%").await >= 1
    })
    .await;
    // Only the reuse holds "batch=old" now; "batch=other" becomes unused.
    guard.commit().await.unwrap();
    actions
        .clone()
        .cancel_action(CancelActionRequest {
            action_id: other.action_id,
        })
        .await
        .expect("cancel");
    eventually(
        20,
        "a drop pass drops the other unused selector",
        || async { kept().await == ["batch=old"] },
    )
    .await;
    lock.rollback().await.unwrap();
    let r = timeout(CALL, reuse)
        .await
        .expect("the submit ends")
        .unwrap()
        .expect("the submit is taken");
    assert_eq!(kept().await, ["batch=old"]);
    let mut w =
        HandWorker::start_tagged(&url, "w", "instance-w", &["cat"], &[("batch", "old")]).await;
    let l = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("the job is leased to the worker that matches its selector")
        .unwrap()
        .unwrap();
    assert_eq!(l.job.unwrap().job_id, r.job_ids[0]);
    cluster.assert_no_panic();
}

/// The value of the sample `name` in the `GetMetrics` text of the replica
/// at `url`; `None` when it cannot be read.
async fn metric_of(url: &str, name: &str) -> Option<f64> {
    let body = queue_service_client::QueueServiceClient::new(channel(url).await?)
        .get_metrics(GetMetricsRequest {
            format: "prometheus".into(),
        })
        .await
        .ok()?
        .into_inner()
        .body;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Workers whose streams a replica ended (here: they unregistered through
/// another replica, and the replica holding their streams delivered the
/// End command; the same path serves workers declared DEAD, taken over by
/// a new instance, or moved to another replica) leave no entry in that
/// replica's memory (`agq_replica_workers`). Such entries were kept for
/// good, one per departed worker id: with agw pods coming and going under
/// new names, a replica's memory only grew.
///
/// Their rows no longer read as connected: the stream flags are cleared
/// by whichever path ended the streams (the delivered `end`, a refused
/// beat, or, for a worker that had closed its heartbeat stream first, the
/// pump finding its lone lease stream's worker gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn departed_workers_leave_no_entry_on_their_replica() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    let (a, b) = (&urls[0], &urls[1]);
    let mut workers = Vec::new();
    for n in 0..3 {
        workers
            .push(HandWorker::start(a, &format!("w{n}"), &format!("instance-{n}"), &["cat"]).await);
    }
    eventually(10, "A holds the workers' streams", || async {
        metric_of(a, "agq_replica_workers").await == Some(3.0)
    })
    .await;
    let mut admin = worker_service_client::WorkerServiceClient::new(channel(b).await.unwrap());
    let db = pg::connect(&cluster.url).await;
    let mut locker = pg::connect(&cluster.url).await;
    let flags = |id: String| {
        let db = &db;
        async move {
            let r = db
                .query_one(
                    "SELECT heartbeat_open, lease_stream_open FROM workers WHERE worker_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (r.get::<_, bool>(0), r.get::<_, bool>(1))
        }
    };
    for (n, w) in workers.iter_mut().enumerate() {
        assert_eq!(
            flags(w.id.clone()).await,
            (true, true),
            "{} connected",
            w.id
        );
        // The third worker closes its heartbeat stream first: A holds
        // only its lease stream, on which no `end` can be delivered.
        if n == 2 {
            w.close_heartbeat();
            eventually(10, "A records the closed heartbeat stream", || async {
                flags(w.id.clone()).await == (false, true)
            })
            .await;
        }
        // The second worker's next beat reaches A before A's command pump
        // delivers the unregistration's `end`: the pump's take of queued
        // commands waits (a trigger waits for an advisory lock the test
        // holds) until A has refused that beat.
        let held = if n == 1 {
            db.batch_execute(
                "CREATE FUNCTION agq_test_stall() RETURNS trigger AS $$
                 BEGIN PERFORM pg_advisory_xact_lock(4243); RETURN NULL; END $$ LANGUAGE plpgsql;
                 CREATE TRIGGER agq_test_stall BEFORE DELETE ON worker_commands
                   FOR EACH STATEMENT EXECUTE FUNCTION agq_test_stall();",
            )
            .await
            .unwrap();
            let lock = locker.transaction().await.unwrap();
            lock.batch_execute("SELECT pg_advisory_xact_lock(4243)")
                .await
                .unwrap();
            Some(lock)
        } else {
            None
        };
        admin
            .unregister_worker(UnregisterWorkerRequest {
                worker_id: w.id.clone(),
            })
            .await
            .expect("unregister through B");
        if let Some(lock) = held {
            // The heartbeat stream ends when A refuses a beat of the
            // unregistered worker (the reader's channel closes).
            timeout(Duration::from_secs(5), async {
                while w.commands.recv().await.is_some() {}
            })
            .await
            .expect("A refuses a beat of a worker that unregistered");
            eventually(10, "A's command pump waits to take the `end`", || async {
                lock_waiters(&db, "%DELETE FROM worker_commands%").await >= 1
            })
            .await;
            lock.rollback().await.unwrap();
        }
        // A ends the worker's streams.
        timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = w.leases.next().await {}
        })
        .await
        .expect("A ends the lease stream of a worker that unregistered");
        eventually(
            10,
            "the row of a worker whose streams A ended reads closed",
            || async { flags(w.id.clone()).await == (false, false) },
        )
        .await;
        let got = worker_of(b, &w.id).await.unwrap();
        assert!(!got.connected, "{got:?}");
        assert_eq!(got.state, WorkerState::Unregistered as i32, "{got:?}");
    }
    drop(workers);
    eventually(10, "A keeps no entry for the departed workers", || async {
        metric_of(a, "agq_replica_workers").await == Some(0.0)
    })
    .await;
    cluster.assert_no_panic();
}

/// A replica that holds the streams of a worker whose row is gone (the
/// retention pass or ForgetWorker deleted it, and the `end` meant for the
/// streams was lost) ends them, telling the worker to register again, and
/// keeps no entry for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_streams_of_a_worker_whose_row_is_gone_are_ended() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let a = cluster.urls()[0].clone();
    let db = pg::connect(&cluster.url).await;
    // One beat only: a refused beat would end the streams itself.
    let (_client, _hb_tx, mut hb, mut leases) = silent_cat_worker(&a, "gone", 1).await;
    eventually(10, "A holds the worker's streams", || async {
        metric_of(&a, "agq_replica_workers").await == Some(1.0)
    })
    .await;
    db.execute("DELETE FROM workers WHERE worker_id = 'gone'", &[])
        .await
        .unwrap();
    let ended = timeout(Duration::from_secs(5), async {
        loop {
            match hb.next().await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    })
    .await
    .expect("A ends the heartbeat stream of a worker whose row is gone")
    .expect("the heartbeat stream ends with a status");
    assert_eq!(ended.code(), Code::FailedPrecondition, "{ended:?}");
    assert!(
        ended
            .message()
            .contains("is not registered; register again"),
        "{ended:?}"
    );
    timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = leases.next().await {}
    })
    .await
    .expect("A ends the lease stream of a worker whose row is gone");
    eventually(10, "A keeps no entry for the worker", || async {
        metric_of(&a, "agq_replica_workers").await == Some(0.0)
    })
    .await;
    cluster.assert_no_panic();
}

/// A replica that stops (SIGTERM) marks the streams it held closed: a
/// worker that had both streams there is suspect (its leases re-queued
/// after the grace unless it reconnects), and one that held only its
/// lease stream there no longer reads as having one. Each is fenced by
/// the replica and the worker's connection epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_replica_marks_its_streams_closed() {
    let _shared = PG_SERVER.read().await;
    let mut cluster = Cluster::start(1).await;
    let a = cluster.urls()[0].clone();
    let db = pg::connect(&cluster.url).await;
    // Nothing declares the workers DEAD meanwhile.
    let leader = hold_maintenance(&cluster.url).await;
    let both = HandWorker::start(&a, "both", "instance-both", &["cat"]).await;
    let mut lone = HandWorker::start(&a, "lone", "instance-lone", &["cat"]).await;
    lone.close_heartbeat();
    let row = |id: &'static str| {
        let db = &db;
        async move {
            let r = db
                .query_one(
                    "SELECT heartbeat_open, lease_stream_open, suspect_since_ms IS NOT NULL
                     FROM workers WHERE worker_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (
                r.get::<_, bool>(0),
                r.get::<_, bool>(1),
                r.get::<_, bool>(2),
            )
        }
    };
    eventually(10, "A records the lone lease stream", || async {
        row("lone").await == (false, true, true)
    })
    .await;
    assert_eq!(row("both").await, (true, true, false));
    // A cannot finish stopping while the test holds the leader row (its
    // maintenance loop and its release of the leadership wait for it):
    // the streams must read closed while it is still there.
    let pid = nix::unistd::Pid::from_raw(cluster.replicas[0].pid());
    nix::sys::signal::kill(pid, Signal::SIGTERM).unwrap();
    eventually(10, "A marks the streams it held closed", || async {
        row("both").await == (false, false, true) && row("lone").await == (false, false, true)
    })
    .await;
    leader.batch_execute("ROLLBACK").await.unwrap();
    let stopped = tokio::task::block_in_place(|| cluster.replicas[0].terminate());
    assert!(stopped.is_some_and(|s| s.success()), "A stops: {stopped:?}");
    drop((both, lone));
}

/// A submit sends `NOTIFY agq_ready` at its commit: the dispatchers wake
/// on it at once, the poll being only the fallback for a lost one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_submit_notifies_the_dispatchers() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = &cluster.urls()[0];
    put_plan(url).await;
    let (client, mut conn) = tokio_postgres::connect(&cluster.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = m {
                let _ = tx.send(n.channel().to_string());
            }
        }
    });
    client.batch_execute("LISTEN agq_ready").await.unwrap();
    submit_one(url).await;
    let got = timeout(Duration::from_secs(5), rx.recv()).await;
    assert_eq!(
        got.ok().flatten().as_deref(),
        Some("agq_ready"),
        "SubmitAction sent no notification on agq_ready"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn work_crosses_replicas() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    let (a, b, c) = (&urls[0], &urls[1], &urls[2]);
    put_plan(a).await;
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    // One worker, on A only; its jobs last long enough to be cancelled.
    let worker = Roam::new("on-a", &urls[..1], 0, &ledger)
        .work_ms(60_000, 60_000)
        .spawn(&stop);
    let job_id = submit_one(b).await;
    eventually(10, "the job submitted on B runs on A's worker", || async {
        ledger.leased.lock().unwrap().contains_key(&job_id)
            && job_of(c, &job_id)
                .await
                .is_some_and(|j| j.status == JobStatus::Running as i32 && j.worker_id == "on-a")
    })
    .await;
    // Cancel through B: the command reaches the worker held by A.
    let ch = channel(b).await.unwrap();
    job_service_client::JobServiceClient::new(ch)
        .cancel_job(CancelJobRequest {
            job_id: job_id.clone(),
        })
        .await
        .unwrap();
    eventually(5, "the cancel reached the worker on A", || async {
        ledger.got_command(|_, c| matches!(c, Command::CancelJobId(id) if *id == job_id))
    })
    .await;
    let j = job_of(c, &job_id).await.unwrap();
    assert_eq!(j.status, JobStatus::Cancelled as i32, "{j:?}");
    // Drain through C: the command reaches the worker on A.
    let ch = channel(c).await.unwrap();
    worker_service_client::WorkerServiceClient::new(ch)
        .drain_worker(DrainWorkerRequest {
            worker_id: "on-a".into(),
        })
        .await
        .unwrap();
    eventually(5, "the drain reached the worker on A", || async {
        ledger.got_command(|_, c| matches!(c, Command::Drain(_)))
    })
    .await;
    let w = worker_of(b, "on-a").await.unwrap();
    assert_eq!(w.state, WorkerState::Draining as i32, "{w:?}");
    let _ = stop_tx.send(true);
    let _ = timeout(Duration::from_secs(5), worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_crash_under_load_loses_nothing() {
    if std::env::var("AGQ_TEST_DATABASE_URL").is_ok_and(|u| !u.trim().is_empty()) {
        eprintln!("skipped: AGQ_TEST_DATABASE_URL names a server these tests do not own");
        return;
    }
    let _alone = PG_SERVER.write().await;
    let cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    let ledger = Arc::new(Ledger::default());
    let (stop_workers, stop) = watch::channel(false);
    let workers: Vec<_> = (0..4)
        .map(|n| Roam::new(&format!("w{n}"), &urls, n, &ledger).spawn(&stop))
        .collect();
    let (stop_submitting, submitting) = watch::channel(false);
    let submitters: Vec<_> = (0..3)
        .map(|n| tokio::spawn(submitter(urls.clone(), n, 5, 100, submitting.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let t0 = Instant::now();
    pg::crash_and_restart().await;
    let restarted = t0.elapsed();
    // Every replica serves again.
    eventually(30, "every replica reports SERVING again", || async {
        let mut all = true;
        for u in &urls {
            all &= serving(u).await;
        }
        all
    })
    .await;
    let recovered = t0.elapsed();
    // Submissions go on a while after the restart.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let _ = stop_submitting.send(true);
    let mut sub = Submitted::default();
    for s in submitters {
        let s = timeout(Duration::from_secs(10), s)
            .await
            .expect("a submitter did not stop")
            .unwrap();
        sub.acked.extend(s.acked);
        sub.failed += s.failed;
    }
    let summary = settle(&urls, &sub, &ledger, stop_workers, workers).await;
    cluster.assert_no_panic();
    assert_counts_kept(&cluster.url).await;
    println!(
        "cluster database crash: PostgreSQL back after {:.1} s, every replica SERVING after \
         {:.1} s; {summary}",
        restarted.as_secs_f64(),
        recovered.as_secs_f64()
    );
}

/// A worker that moved from A to B while A still holds its old heartbeat
/// stream (a half-open connection after a network partition: A notices
/// only when HTTP/2 keepalive gives up, 30 s later) gets the commands sent
/// to it on B, its current stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commands_follow_a_worker_that_moved() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    let (a, c) = (&urls[0], &urls[2]);
    put_plan(a).await;
    // The old session on A: registered, heartbeat stream open and answered,
    // then never used again (but not closed).
    let mut old = worker_service_client::WorkerServiceClient::new(channel(a).await.unwrap());
    register_cat_worker(&mut old, "mover", "instance-mover", 4)
        .await
        .unwrap();
    let (old_tx, mut old_stream) = open_answered_heartbeat(&mut old, "mover").await;
    // The same worker (same instance) now on B.
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    let mut mover = Roam::new("mover", &urls[1..2], 0, &ledger).work_ms(60_000, 60_000);
    mover.slots = 4;
    let worker = mover.spawn(&stop);
    let jobs: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(submit_one(c).await);
        }
        v
    };
    eventually(10, "the worker on B runs the four jobs", || async {
        let leased = ledger.leased.lock().unwrap();
        jobs.iter().all(|j| leased.contains_key(j))
    })
    .await;
    // Commands through C: every one reaches the worker on B.
    let mut js = job_service_client::JobServiceClient::new(channel(c).await.unwrap());
    for j in &jobs {
        js.cancel_job(CancelJobRequest { job_id: j.clone() })
            .await
            .unwrap();
    }
    worker_service_client::WorkerServiceClient::new(channel(c).await.unwrap())
        .drain_worker(DrainWorkerRequest {
            worker_id: "mover".into(),
        })
        .await
        .unwrap();
    let all_arrived = timeout(Duration::from_secs(5), async {
        loop {
            let cancels = ledger
                .commands
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, c)| matches!(c, Command::CancelJobId(_)))
                .count();
            let drained = ledger.got_command(|_, c| matches!(c, Command::Drain(_)));
            if cancels == jobs.len() && drained {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok();
    let got: Vec<_> = ledger
        .commands
        .lock()
        .unwrap()
        .iter()
        .map(|(_, c)| c.clone())
        .collect();
    // What the old stream on A received instead.
    let mut on_old = Vec::new();
    while let Ok(Some(Ok(m))) = timeout(Duration::from_millis(200), old_stream.next()).await {
        if let Some(c) = m.command {
            on_old.push(c);
        }
    }
    let _ = stop_tx.send(true);
    let _ = timeout(Duration::from_secs(5), worker).await;
    drop(old_tx);
    assert!(
        all_arrived,
        "commands for the worker on B were delivered on its stale stream on A: \
         on B {got:?}, on A's stale stream {on_old:?}"
    );
}

/// A replica that ends the stale heartbeat stream of a worker that moved
/// to another replica changes nothing for the worker there:
/// - the stream flags it clears are its own only (fenced by replica and
///   epoch): the new owner's row keeps both streams open and no suspect
///   mark;
/// - a beat still read from the ended stream, naming no held lease, is
///   refused, not applied: applied, it re-queued the lease the worker
///   holds through its current stream ("reconnected without it").
///
/// So the job the worker runs on B keeps its lease past the grace, and
/// its completion under that lease counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ending_a_moved_workers_old_streams_leaves_the_new_owner_alone() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    let (a, b) = (&urls[0], &urls[1]);
    put_plan(a).await;
    let db = pg::connect(&cluster.url).await;
    // The old session on A, heartbeat stream only (a lease stream would
    // let A's dispatcher demote the entry when it finds the worker moved,
    // and end it without a flag to clear); then the same worker (same
    // instance) on B.
    let mut old = worker_service_client::WorkerServiceClient::new(channel(a).await.unwrap());
    register_cat_worker(&mut old, "mover", "instance-mover", 1)
        .await
        .unwrap();
    let (old_tx, mut old_stream) = open_answered_heartbeat(&mut old, "mover").await;
    let mut w = HandWorker::start(b, "mover", "instance-mover", &["cat"]).await;
    let job = submit_one(a).await;
    let lease = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("the worker leases the job on B")
        .unwrap()
        .unwrap();
    assert_eq!(lease.job.as_ref().unwrap().job_id, job);
    // A's command pump finds the worker owned through B and ends the old
    // stream (clearing the flags it holds at the old epoch).
    timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = old_stream.next().await {}
    })
    .await
    .expect("A ends the old heartbeat stream");
    eventually(10, "A keeps no entry for the worker", || async {
        metric_of(a, "agq_replica_workers").await == Some(0.0)
    })
    .await;
    // One more beat on the ended stream, naming no held lease: A still
    // reads it, and must not apply it.
    old_tx.send(first_heartbeat("mover")).await.unwrap();
    // Past the grace (400 ms) and several maintenance passes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = db
        .query_one(
            "SELECT heartbeat_open, lease_stream_open, suspect_since_ms IS NULL
             FROM workers WHERE worker_id = 'mover'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            r.get::<_, bool>(0),
            r.get::<_, bool>(1),
            r.get::<_, bool>(2)
        ),
        (true, true, true),
        "the row of the worker on B: heartbeat_open, lease_stream_open, not suspect"
    );
    let v = worker_of(b, "mover").await.unwrap();
    assert!(v.connected, "{v:?}");
    let j = job_of(b, &job).await.unwrap();
    assert_eq!(
        (j.status, j.attempt, j.worker_id.as_str()),
        (JobStatus::Running as i32, 1, "mover"),
        "{j:?}"
    );
    // Its lease is still the one granted: the completion under it counts.
    w.client
        .update_job(UpdateJobRequest {
            job_id: job.clone(),
            worker_id: "mover".into(),
            lease_id: lease.lease_id.clone(),
            status: JobStatus::Completed as i32,
            ..Default::default()
        })
        .await
        .expect("the completion under the lease granted on B is accepted");
    let j = job_of(a, &job).await.unwrap();
    assert_eq!(
        (j.status, j.attempt),
        (JobStatus::Completed as i32, 1),
        "{j:?}"
    );
    cluster.assert_no_panic();
}

/// The group commit of completions locks its job rows in the engine's
/// one order for job row locks, row id ascending (src/store/postgres/jobs.rs),
/// whatever the order its reports arrived in: a batch holding a later job
/// while it waits for an earlier one would deadlock with a CancelAction
/// (which locks by id) holding the earlier one and waiting for the later.
/// Here the test holds the row of J1 (the lower id) while one batch
/// completes [J2, J1]: while the batch waits for J1, J2's row is free.
/// (An `UPDATE … FROM unnest(…)` alone locks in its join's order: the
/// reports' order, or that of its scan of `jobs`; all put J2 first here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completion_batch_locks_its_jobs_by_row_id() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = &cluster.urls()[0];
    put_plan(url).await;
    let mut w = HandWorker::start_with_slots(url, "w", "instance-w", &["cat"], 2).await;
    let jobs = action_service_client::ActionServiceClient::new(channel(url).await.unwrap())
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: (1..=2)
                .map(|n| ActionInput {
                    values: [("n".to_string(), n.to_string())].into(),
                })
                .collect(),
            max_attempts: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .job_ids;
    let mut leases = HashMap::new();
    for _ in 0..2 {
        let l = timeout(Duration::from_secs(5), w.leases.next())
            .await
            .expect("W leases both jobs")
            .unwrap()
            .unwrap();
        leases.insert(l.job.as_ref().unwrap().job_id.clone(), l.lease_id);
    }
    let probe = pg::connect(&cluster.url).await;
    let mut by_id: Vec<(i64, String)> = Vec::new();
    for j in &jobs {
        let r = probe
            .query_one("SELECT id FROM jobs WHERE job_id = $1", &[j])
            .await
            .unwrap();
        by_id.push((r.get(0), j.clone()));
    }
    by_id.sort();
    let (j1, j2) = (by_id[0].1.clone(), by_id[1].1.clone());
    // J1's lease expires a second later than J2's (both were granted in
    // one statement, with one expiry) and its row is a new version, after
    // J2's in the table: J2 then comes first in the reports and in any
    // scan of the running jobs (by lease expiry, the plan the statement
    // before the fix got here, or through the table), and only the row id
    // order puts J1 first.
    probe
        .execute(
            "UPDATE jobs SET lease_expires_at_ms = lease_expires_at_ms + 1000 WHERE job_id = $1",
            &[&j1],
        )
        .await
        .unwrap();
    let mut holder = pg::connect(&cluster.url).await;
    let hold = holder.transaction().await.unwrap();
    hold.query("SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE", &[&j1])
        .await
        .unwrap();
    // One batch (one BatchUpdateJobs call: its completions are queued
    // together), J2's report first.
    let report = |job: &str| UpdateJobRequest {
        job_id: job.into(),
        worker_id: "w".into(),
        lease_id: leases[job].clone(),
        status: JobStatus::Completed as i32,
        ..Default::default()
    };
    let mut client = w.client.clone();
    let batch = BatchUpdateJobsRequest {
        worker_id: "w".into(),
        requests: vec![report(&j2), report(&j1)],
    };
    let call = tokio::spawn(async move { client.batch_update_jobs(batch).await });
    eventually(10, "the batch waits for J1's row", || async {
        lock_waiters(
            &probe,
            "%unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int4[])%",
        )
        .await
            == 1
    })
    .await;
    let status: i16 = probe
        .query_one("SELECT status FROM jobs WHERE job_id = $1", &[&j2])
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, 2, "J2 was completed in a batch of its own");
    let mut checker = pg::connect(&cluster.url).await;
    let check = checker.transaction().await.unwrap();
    let j2_free = check
        .query(
            "SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE NOWAIT",
            &[&j2],
        )
        .await;
    check.rollback().await.unwrap();
    hold.rollback().await.unwrap();
    let done = timeout(CALL, call)
        .await
        .expect("the batch ends once J1's row is free")
        .unwrap()
        .unwrap()
        .into_inner();
    assert!(
        j2_free.is_ok(),
        "the batch locked J2 (the later row id) while it waited for J1: {j2_free:?}"
    );
    let codes: Vec<i32> = done.results.iter().map(|r| r.code).collect();
    assert_eq!(codes, [0, 0], "{done:?}");
    for j in [&j1, &j2] {
        let job = job_of(url, j).await.unwrap();
        assert_eq!(job.status, JobStatus::Completed as i32, "{job:?}");
    }
    cluster.assert_no_panic();
}

/// Waits until a replica leads maintenance, then holds the leader row
/// locked (in an open transaction of the returned connection), so that no
/// maintenance pass runs until it rolls back or is dropped.
async fn hold_maintenance(url: &str) -> tokio_postgres::Client {
    let c = pg::connect(url).await;
    eventually(10, "a maintenance leader", || async {
        c.query_one("SELECT count(*) FROM leader", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    c.batch_execute("BEGIN; SELECT 1 FROM leader FOR UPDATE")
        .await
        .unwrap();
    c
}

/// A worker drained while its heartbeat stream is closed (it is
/// reconnecting) learns it when it opens one, on any replica: the server
/// sends the Drain command again on every heartbeat stream a DRAINING
/// worker opens. Here the command DrainWorker queued is lost before the
/// stream opens (the test deletes its row, as A's command pump does when
/// it takes it for a stream that ended right after: the send then goes
/// nowhere); otherwise the worker would stay DRAINING on the server,
/// getting no leases, without ever learning to drain. The test holds the
/// maintenance leader's row meanwhile, so that no maintenance pass
/// declares the silent worker DEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_drained_while_its_stream_is_closed_is_told_when_it_opens_one() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    let (a, b) = (&urls[0], &urls[1]);
    let probe = pg::connect(&cluster.url).await;
    let leader = hold_maintenance(&cluster.url).await;
    // W on A; its heartbeat stream closes (it is reconnecting).
    let mut w = HandWorker::start(a, "w", "instance-w", &["cat"]).await;
    w.close_heartbeat();
    eventually(10, "W's heartbeat stream is closed", || async {
        !probe
            .query_one(
                "SELECT heartbeat_open FROM workers WHERE worker_id = 'w'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    let drained = worker_service_client::WorkerServiceClient::new(channel(b).await.unwrap())
        .drain_worker(DrainWorkerRequest {
            worker_id: "w".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .worker
        .unwrap();
    assert_eq!(drained.state, WorkerState::Draining as i32, "{drained:?}");
    // The queued Drain command is lost: here, unless A's command pump
    // already took it (a pass that listed W's stream before it closed
    // takes W's commands, and has no stream to send them on).
    let lost = probe
        .execute("DELETE FROM worker_commands WHERE worker_id = 'w'", &[])
        .await
        .unwrap();
    assert!(
        lost <= 1,
        "DrainWorker queued one command for W, not {lost}"
    );
    // W opens its heartbeat stream again, on B.
    let mut client = worker_service_client::WorkerServiceClient::new(channel(b).await.unwrap());
    let (hb_tx, mut hb) = open_heartbeat(&mut client, "w").await;
    let got = timeout(Duration::from_secs(5), async {
        while let Some(Ok(m)) = hb.next().await {
            if m.command.is_some() {
                return m.command;
            }
        }
        None
    })
    .await;
    leader.batch_execute("ROLLBACK").await.unwrap();
    drop(hb_tx);
    match got {
        Ok(Some(Command::Drain(d))) => assert_eq!(d.reason, "drain requested"),
        other => panic!(
            "W, drained while its stream was closed, got no Drain command within 5 s of \
             opening a stream on B: {other:?}"
        ),
    }
    let v = worker_of(a, "w").await.unwrap();
    assert_eq!(v.state, WorkerState::Draining as i32, "{v:?}");
    cluster.assert_no_panic();
}

/// The leader declares a silent worker W DEAD and re-queues its running
/// jobs J1 and J2 (one transaction: it lists W's running jobs, then fails
/// each under its row lock). Held up between the two (here: the test holds
/// J1's row lock, as a pause of the leader would), it must not touch J2 if
/// J2 moved on meanwhile: W reported J2 failed, J2 was retried and leased
/// to V. V's lease must survive the late statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_leader_statement_leaves_a_re_leased_job_alone() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    // W on replica 0, by hand: it will stop heartbeating, streams open.
    let (mut w, hb_tx, _hb, mut leases) = silent_cat_worker(&urls[0], "w", 2).await;
    let j1 = submit_one(&urls[1]).await;
    let j2 = submit_one(&urls[1]).await;
    let mut got = HashMap::new();
    for _ in 0..2 {
        let l = timeout(Duration::from_secs(5), leases.next())
            .await
            .expect("W leases both jobs")
            .unwrap()
            .unwrap();
        got.insert(l.job.unwrap().job_id, l.lease_id);
    }
    // Hold J1's row: the leader's pass will wait on it, W's jobs listed.
    let mut db = pg::connect(&cluster.url).await;
    let lock = db.transaction().await.unwrap();
    lock.query("SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE", &[&j1])
        .await
        .unwrap();
    // W goes silent (no heartbeat; its streams stay open); the leader
    // declares it DEAD after 3 x 200 ms and starts failing its leases.
    let probe = pg::connect(&cluster.url).await;
    eventually(
        10,
        "the leader waits on J1 while failing W's leases",
        || async { lock_waiters(&probe, "%FROM jobs%").await == 1 },
    )
    .await;
    // Meanwhile J2 moves on: W reports it failed, it is retried, and V
    // (on replica 1) leases it.
    w.update_job(UpdateJobRequest {
        job_id: j2.clone(),
        worker_id: "w".into(),
        lease_id: got[&j2].clone(),
        status: JobStatus::Failed as i32,
        error: "boom".into(),
        ..Default::default()
    })
    .await
    .expect("W's report of J2");
    job_service_client::JobServiceClient::new(channel(&urls[1]).await.unwrap())
        .retry_job(RetryJobRequest {
            job_id: j2.clone(),
            priority: None,
        })
        .await
        .expect("retry J2");
    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop) = watch::channel(false);
    let v = Roam::new("v", &urls[1..2], 0, &ledger)
        .work_ms(1500, 1500)
        .spawn(&stop);
    eventually(10, "V leases J2", || async {
        ledger.leased.lock().unwrap().contains_key(&j2)
    })
    .await;
    // The leader goes on.
    lock.rollback().await.unwrap();
    eventually(10, "J2 completes", || async {
        job_of(&urls[1], &j2)
            .await
            .is_some_and(|j| j.status == JobStatus::Completed as i32)
    })
    .await;
    let j = job_of(&urls[1], &j2).await.unwrap();
    let _ = stop_tx.send(true);
    let _ = timeout(Duration::from_secs(5), v).await;
    drop(hb_tx);
    let cancels: Vec<_> = ledger
        .commands
        .lock()
        .unwrap()
        .iter()
        .map(|(_, c)| c.clone())
        .collect();
    assert!(
        cancels.is_empty() && j.attempt == 1 && ledger.leases_of(&j2).len() == 1,
        "the late statement failed V's lease of J2: V was sent {cancels:?}, V leased it {} \
         times, J2 is {j:?}",
        ledger.leases_of(&j2).len()
    );
}

/// The leader stamps an action finished (for retention) once no job of it
/// is pending, running or failed. Its pass reads the jobs in one snapshot
/// and then waits for the action's row; if the action is reopened
/// meanwhile (RetryJob or RetryAction: a job pending again, the stamp
/// cleared, one transaction), the late pass must not stamp it with the
/// jobs as they were before, or retention would delete an action that
/// runs. The test holds the action's row, as a slow retry would, ends the
/// job, waits until the leader's statement waits on the row, then reopens
/// the action in the held transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_finish_stamp_leaves_a_reopened_action_open() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    let job = submit_one(&urls[0]).await;
    let mut db = pg::connect(&cluster.url).await;
    let action: String = db
        .query_one("SELECT action_id FROM jobs WHERE job_id = $1", &[&job])
        .await
        .unwrap()
        .get(0);
    let retry = db.transaction().await.unwrap();
    retry
        .query(
            "SELECT 1 FROM actions WHERE action_id = $1 FOR UPDATE",
            &[&action],
        )
        .await
        .unwrap();
    // The job ends (cancelled): the leader's next pass finds the action
    // finished and waits for its row.
    let probe = pg::connect(&cluster.url).await;
    probe
        .execute(
            "UPDATE jobs SET status = 6 WHERE action_id = $1",
            &[&action],
        )
        .await
        .unwrap();
    let stamp_waits =
        || async { lock_waiters(&probe, "%SET finished_at_ms = coalesce%").await == 1 };
    eventually(
        10,
        "the leader's finish stamp waits on the action",
        stamp_waits,
    )
    .await;
    // The retry: the job pending again, the stamp cleared, committed while
    // the stamp waits.
    retry
        .execute(
            "UPDATE jobs SET status = 1 WHERE action_id = $1",
            &[&action],
        )
        .await
        .unwrap();
    retry
        .execute(
            "UPDATE actions SET finished_at_ms = NULL WHERE action_id = $1",
            &[&action],
        )
        .await
        .unwrap();
    retry.commit().await.unwrap();
    eventually(10, "the finish stamp no longer waits", || async {
        !stamp_waits().await
    })
    .await;
    // A few more passes (one every 100 ms) see the pending job.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stamp: Option<i64> = probe
        .query_one(
            "SELECT finished_at_ms FROM actions WHERE action_id = $1",
            &[&action],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stamp, None, "a reopened action was stamped finished");
    cluster.assert_no_panic();
}

/// A plan deleted and stored again under the same id (version 1 again)
/// through one replica is what another replica's leases carry: its cache
/// of the old version 1 is not used for the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_stored_again_under_its_id_reaches_workers_of_every_replica() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    let plans =
        || async { plan_service_client::PlanServiceClient::new(channel(&urls[1]).await.unwrap()) };
    let put = |command: &'static str| async move {
        plans()
            .await
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan("p", &[command])),
                replace: false,
            })
            .await
            .unwrap()
            .into_inner()
    };
    assert_eq!(put("cat").await.version, 1);
    // W on replica 0, by hand, with both tools.
    let mut w = HandWorker::start(&urls[0], "w", "instance-w", &["cat", "sort"]).await;
    submit_one(&urls[1]).await;
    lease_and_complete(&mut w, "cat").await;
    // Deleted and stored again through replica 1: version 1 again.
    plans()
        .await
        .delete_plan(DeletePlanRequest {
            plan_id: "p".into(),
        })
        .await
        .unwrap();
    assert_eq!(put("sort").await.version, 1);
    submit_one(&urls[1]).await;
    lease_and_complete(&mut w, "sort").await;
}

/// Takes `w`'s next lease, completes it, and asserts its plan's first
/// command is `expected`.
async fn lease_and_complete(w: &mut HandWorker, expected: &str) {
    let l = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("W gets a lease")
        .unwrap()
        .unwrap();
    let command = l.plan.as_ref().unwrap().tasks[0].command.clone();
    w.client
        .update_job(UpdateJobRequest {
            job_id: l.job.as_ref().unwrap().job_id.clone(),
            worker_id: w.id.clone(),
            lease_id: l.lease_id.clone(),
            status: JobStatus::Completed as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        command, expected,
        "the lease carries the plan's current body"
    );
}

/// A worker driven by hand on one replica: registered, its heartbeat
/// stream open (one heartbeat every 100 ms, so it stays fresh), the
/// commands it gets on it collected in `commands`, its lease stream open.
/// The first heartbeat of worker `id`: no leases held.
fn first_heartbeat(id: &str) -> HeartbeatRequest {
    HeartbeatRequest {
        worker_id: id.into(),
        stats: Some(WorkerStats::default()),
        held_leases: Some(HeldLeases::default()),
        verification: None,
    }
}

/// Registers worker `id` (instance `instance`, advertising `cat`, `slots`
/// concurrent jobs) through `client`, as a hand-made worker does.
async fn register_cat_worker(
    client: &mut worker_service_client::WorkerServiceClient<Channel>,
    id: &str,
    instance: &str,
    slots: u32,
) -> Result<tonic::Response<RegisterWorkerResponse>, tonic::Status> {
    client
        .register_worker(RegisterWorkerRequest {
            worker_id: id.into(),
            hostname: "cluster-test".into(),
            agw_version: "sim".into(),
            capabilities: Some(WorkerCapabilities {
                tools: vec!["cat".into()],
                ..Default::default()
            }),
            max_concurrent_jobs: slots,
            instance_id: instance.into(),
            ..Default::default()
        })
        .await
}

/// Registers worker `id` (instance `instance-ID`, advertising `cat`,
/// `slots` concurrent jobs) on `url` and opens both its streams there,
/// with one heartbeat sent and answered and no more: the client, the
/// sender for more beats, the heartbeat replies and the lease stream.
async fn silent_cat_worker(
    url: &str,
    id: &str,
    slots: u32,
) -> (
    worker_service_client::WorkerServiceClient<Channel>,
    mpsc::Sender<HeartbeatRequest>,
    tonic::Streaming<HeartbeatResponse>,
    tonic::Streaming<JobLease>,
) {
    let mut client = worker_service_client::WorkerServiceClient::new(channel(url).await.unwrap());
    register_cat_worker(&mut client, id, &format!("instance-{id}"), slots)
        .await
        .unwrap();
    let (hb_tx, hb) = open_answered_heartbeat(&mut client, id).await;
    let leases = open_leases(&mut client, id).await;
    (client, hb_tx, hb, leases)
}

/// Opens worker `id`'s lease stream on `client`.
async fn open_leases(
    client: &mut worker_service_client::WorkerServiceClient<Channel>,
    id: &str,
) -> tonic::Streaming<JobLease> {
    client
        .lease_jobs(LeaseJobsRequest {
            worker_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// [`open_heartbeat`], and waits for the first heartbeat's answer.
async fn open_answered_heartbeat(
    client: &mut worker_service_client::WorkerServiceClient<Channel>,
    id: &str,
) -> (
    mpsc::Sender<HeartbeatRequest>,
    tonic::Streaming<HeartbeatResponse>,
) {
    let (tx, mut replies) = open_heartbeat(client, id).await;
    timeout(CALL, replies.next())
        .await
        .expect("the first heartbeat is answered")
        .unwrap()
        .unwrap();
    (tx, replies)
}

/// Opens worker `id`'s heartbeat stream on `client` with its first
/// heartbeat already sent; returns the sender for more and the replies.
async fn open_heartbeat(
    client: &mut worker_service_client::WorkerServiceClient<Channel>,
    id: &str,
) -> (
    mpsc::Sender<HeartbeatRequest>,
    tonic::Streaming<HeartbeatResponse>,
) {
    let (tx, rx) = mpsc::channel(16);
    tx.send(first_heartbeat(id)).await.unwrap();
    let replies = client
        .heartbeat(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, replies)
}

struct HandWorker {
    id: String,
    client: worker_service_client::WorkerServiceClient<Channel>,
    /// The heartbeat stream's sender; `None` once closed.
    hb_tx: Option<mpsc::Sender<HeartbeatRequest>>,
    commands: mpsc::UnboundedReceiver<Command>,
    leases: tonic::Streaming<JobLease>,
    tasks: Vec<JoinHandle<()>>,
}

impl HandWorker {
    /// Registers worker `id` (instance `instance`, advertising `tools`)
    /// on `url` and opens its streams there.
    async fn start(url: &str, id: &str, instance: &str, tools: &[&str]) -> HandWorker {
        Self::start_with_slots(url, id, instance, tools, 1).await
    }

    /// [`HandWorker::start`] with `slots` concurrent jobs.
    async fn start_with_slots(
        url: &str,
        id: &str,
        instance: &str,
        tools: &[&str],
        slots: u32,
    ) -> HandWorker {
        Self::start_as(url, id, instance, tools, slots, &[]).await
    }

    /// [`HandWorker::start`] with `tags`.
    async fn start_tagged(
        url: &str,
        id: &str,
        instance: &str,
        tools: &[&str],
        tags: &[(&str, &str)],
    ) -> HandWorker {
        Self::start_as(url, id, instance, tools, 1, tags).await
    }

    /// [`HandWorker::start`] with `slots` concurrent jobs and `tags`.
    async fn start_as(
        url: &str,
        id: &str,
        instance: &str,
        tools: &[&str],
        slots: u32,
        tags: &[(&str, &str)],
    ) -> HandWorker {
        let mut client =
            worker_service_client::WorkerServiceClient::new(channel(url).await.unwrap());
        client
            .register_worker(RegisterWorkerRequest {
                worker_id: id.into(),
                hostname: "cluster-test".into(),
                agw_version: "sim".into(),
                capabilities: Some(WorkerCapabilities {
                    tools: tools.iter().map(|t| t.to_string()).collect(),
                    ..Default::default()
                }),
                max_concurrent_jobs: slots,
                instance_id: instance.into(),
                tags: tags
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            })
            .await
            .unwrap();
        let (hb_tx, mut hb) = open_heartbeat(&mut client, id).await;
        // Later beats name no leases: the server reconciles only against
        // a list it is given.
        let beat = HeartbeatRequest {
            held_leases: None,
            ..first_heartbeat(id)
        };
        timeout(CALL, hb.next())
            .await
            .expect("the first heartbeat is answered")
            .unwrap()
            .unwrap();
        let (cmd_tx, commands) = mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            while let Some(Ok(m)) = hb.next().await {
                if let Some(c) = m.command {
                    let _ = cmd_tx.send(c);
                }
            }
        });
        let pump_tx = hb_tx.clone();
        let pump = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if pump_tx.send(beat.clone()).await.is_err() {
                    return;
                }
            }
        });
        let leases = open_leases(&mut client, id).await;
        HandWorker {
            id: id.into(),
            client,
            hb_tx: Some(hb_tx),
            commands,
            leases,
            tasks: vec![reader, pump],
        }
    }

    /// Closes the heartbeat stream (the lease stream stays open).
    fn close_heartbeat(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.hb_tx = None;
    }

    /// The next Verify command within `within`.
    async fn next_verify(&mut self, within: Duration) -> Option<VerifyCommand> {
        timeout(within, async {
            loop {
                match self.commands.recv().await {
                    Some(Command::Verify(v)) => return Some(v),
                    Some(_) => {}
                    None => return None,
                }
            }
        })
        .await
        .ok()
        .flatten()
    }

    /// Answers challenge `v` (passed) on the heartbeat stream.
    async fn answer(&self, v: &VerifyCommand) {
        self.hb_tx
            .as_ref()
            .expect("heartbeat stream open")
            .send(HeartbeatRequest {
                worker_id: self.id.clone(),
                stats: Some(WorkerStats::default()),
                held_leases: None,
                verification: Some(VerificationAnswer {
                    challenge_id: v.challenge_id.clone(),
                    exit_code: 0,
                    output: format!("{} (GNU coreutils) 9.1", v.command),
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
    }
}

impl Drop for HandWorker {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Submits one action of `plan_id` (one input) through `url`; returns
/// its action id and job id.
async fn submit_action_of(
    url: &str,
    plan_id: &str,
    max_attempts: u32,
    run_at: Option<prost_types::Timestamp>,
) -> (String, String) {
    let ch = channel(url).await.expect("connect");
    let r = action_service_client::ActionServiceClient::new(ch)
        .submit_action(SubmitActionRequest {
            plan_id: plan_id.into(),
            inputs: vec![ActionInput {
                values: [("n".to_string(), "1".to_string())].into(),
            }],
            max_attempts,
            run_at,
            ..Default::default()
        })
        .await
        .expect("submit")
        .into_inner();
    (r.action_id, r.job_ids[0].clone())
}

/// A plan with `require_verified_tools` stored through replica 1 gets a
/// worker streaming to replica 0 challenged (a Verify command on its
/// heartbeat stream) at once, not at its next reconnect; once it answered,
/// it leases the plan's jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_requiring_verified_tools_challenges_workers_of_every_replica() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    let mut w = HandWorker::start(&urls[0], "w", "instance-w", &["cat"]).await;
    let mut p = plan("v", &["cat"]);
    p.require_verified_tools = true;
    plan_service_client::PlanServiceClient::new(channel(&urls[1]).await.unwrap())
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .unwrap();
    let v = w
        .next_verify(Duration::from_secs(5))
        .await
        .expect("the worker on replica 0 is challenged within 5 s of the plan stored on replica 1");
    assert_eq!(v.command, "cat");
    w.answer(&v).await;
    let (_, job) = submit_action_of(&urls[1], "v", 1, None).await;
    let l = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("the verified worker leases the plan's job")
        .unwrap()
        .unwrap();
    assert_eq!(l.job.unwrap().job_id, job);
    cluster.assert_no_panic();
}

/// A WatchAction stream learns of jobs lost in a transaction (here a
/// takeover of a worker id by a new instance) once that transaction
/// committed: its change notification is sent after the commit, not
/// before (when a watcher re-reading would see the old state and get no
/// second notification). The test holds the takeover between losing the
/// job and committing (a table lock on `worker_verifications`, which it
/// writes last) for half a second, and the maintenance leader's row, so
/// that no maintenance pass re-queues the job meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_sees_jobs_lost_by_a_transaction_after_its_commit() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(2).await;
    let urls = cluster.urls();
    put_plan(&urls[0]).await;
    let probe = pg::connect(&cluster.url).await;
    let leader = hold_maintenance(&cluster.url).await;
    let mut w = HandWorker::start(&urls[0], "w", "instance-1", &["cat"]).await;
    let (action, job) = submit_action_of(&urls[1], "p", 1, None).await;
    let l = timeout(Duration::from_secs(5), w.leases.next())
        .await
        .expect("W leases the job")
        .unwrap()
        .unwrap();
    assert_eq!(l.job.unwrap().job_id, job);
    let (mut watch, first) = watch_on(&urls[1], &action).await;
    assert_eq!(first.running, 1, "{first:?}");
    // W's process is gone (its heartbeat stream closed): a new instance
    // may take the id over.
    w.close_heartbeat();
    eventually(10, "W's heartbeat stream is closed", || async {
        !probe
            .query_one(
                "SELECT heartbeat_open FROM workers WHERE worker_id = 'w'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    let mut locker = pg::connect(&cluster.url).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE worker_verifications IN SHARE MODE")
        .await
        .unwrap();
    let url0 = urls[0].clone();
    let takeover = tokio::spawn(async move {
        let mut c = worker_service_client::WorkerServiceClient::new(channel(&url0).await.unwrap());
        register_cat_worker(&mut c, "w", "instance-2", 1).await
    });
    eventually(10, "the takeover waits, its job lost", || async {
        lock_waiters(&probe, "%DELETE FROM worker_verifications%").await == 1
    })
    .await;
    // A notification sent before the commit reaches the watch meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    lock.rollback().await.unwrap();
    timeout(CALL, takeover)
        .await
        .expect("the takeover ends")
        .unwrap()
        .expect("the takeover is accepted");
    let dead = timeout(Duration::from_secs(5), async {
        while let Some(Ok(m)) = watch.next().await {
            let a = m.action.unwrap();
            if a.dead == 1 {
                return Some(a);
            }
        }
        None
    })
    .await;
    leader.batch_execute("ROLLBACK").await.unwrap();
    let j = job_of(&urls[1], &job).await;
    assert!(
        matches!(dead, Ok(Some(_))),
        "the watch on replica 1 did not report the job lost by the takeover ({dead:?}); the job \
         is {j:?}"
    );
    cluster.assert_no_panic();
}

/// Retention goes past open actions: with more open actions (scheduled a
/// day ahead) than the leader's finish-stamp pass examines at once, an
/// action submitted after them that finished (its job cancelled) is still
/// stamped finished and, past the retention (1 s here), deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_reaches_finished_actions_behind_many_open_ones() {
    let _shared = PG_SERVER.read().await;
    let mut cluster = Cluster::start(0).await;
    let r = cluster
        .serve("127.0.0.1:0")
        .args(["--job-retention-secs", "1"])
        .spawn()
        .unwrap_or_else(|e| panic!("replica did not start: {e:?}"));
    cluster.addrs.push(r.addr.clone());
    cluster.replicas.push(r);
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    let day_ahead = prost_types::Timestamp {
        seconds: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
            + 86_400,
        nanos: 0,
    };
    // More open actions than one pass examines (1000).
    const OPEN: usize = 1100;
    let mut submitters = Vec::new();
    for k in 0..10 {
        let url = url.clone();
        submitters.push(tokio::spawn(async move {
            for _ in (k..OPEN).step_by(10) {
                submit_action_of(&url, "p", 1, Some(day_ahead)).await;
            }
        }));
    }
    for s in submitters {
        s.await.unwrap();
    }
    let (action, job) = submit_action_of(&url, "p", 1, None).await;
    job_service_client::JobServiceClient::new(channel(&url).await.unwrap())
        .cancel_job(CancelJobRequest { job_id: job })
        .await
        .unwrap();
    let probe = pg::connect(&cluster.url).await;
    eventually(
        20,
        "the finished action is deleted by retention",
        || async {
            probe
                .query_one(
                    "SELECT count(*) FROM actions WHERE action_id = $1",
                    &[&action],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 0
        },
    )
    .await;
    let open: i64 = probe
        .query_one("SELECT count(*) FROM actions", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(open, OPEN as i64, "retention deleted an open action");
    cluster.assert_no_panic();
}

/// Milliseconds since the epoch, as a Timestamp.
fn timestamp_ms(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

/// The test's clock, ms since the epoch (the database runs on this host).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The plan (`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`) of the statement
/// `explain` runs on `db`, after `setup` (which may open a transaction and
/// prepare the statement); the transaction, if any, is rolled back.
async fn explain(db: &tokio_postgres::Client, setup: &str, explain: &str) -> serde_json::Value {
    db.batch_execute(setup).await.expect("explain setup");
    let out = db.simple_query(explain).await.expect("EXPLAIN");
    let _ = db.batch_execute("ROLLBACK").await;
    let text = out
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .expect("EXPLAIN returns its plan");
    serde_json::from_str(&text).expect("EXPLAIN's JSON")
}

/// Rows of table `relation` that the nodes of `node` (recursively) read:
/// the rows they returned plus those their filters removed, over every
/// loop.
fn rows_read(node: &serde_json::Value, relation: &str) -> f64 {
    let n = |k: &str| {
        node.get(k)
            .and_then(serde_json::Value::as_f64)
            .unwrap_or(0.0)
    };
    let mut rows = 0.0;
    if node
        .get("Relation Name")
        .and_then(serde_json::Value::as_str)
        == Some(relation)
    {
        rows +=
            (n("Actual Rows") + n("Rows Removed by Filter") + n("Rows Removed by Index Recheck"))
                * n("Actual Loops").max(1.0);
    }
    if let Some(children) = node.get("Plans").and_then(serde_json::Value::as_array) {
        rows += children.iter().map(|c| rows_read(c, relation)).sum::<f64>();
    }
    rows
}

/// Shared buffers (hit and read) the whole plan touched: its root's
/// counts, which include every node below it.
fn buffers(plan: &serde_json::Value) -> f64 {
    let root = &plan[0]["Plan"];
    root["Shared Hit Blocks"].as_f64().unwrap_or(0.0)
        + root["Shared Read Blocks"].as_f64().unwrap_or(0.0)
}

/// `w`'s next lease within `within`.
async fn next_lease(w: &mut HandWorker, within: Duration) -> Option<JobLease> {
    timeout(within, w.leases.next())
        .await
        .ok()
        .flatten()
        .map(|l| l.expect("lease stream"))
}

/// Reports lease `l` of `w` completed.
async fn complete(w: &HandWorker, l: &JobLease) {
    w.client
        .clone()
        .update_job(UpdateJobRequest {
            job_id: l.job.as_ref().unwrap().job_id.clone(),
            worker_id: w.id.clone(),
            lease_id: l.lease_id.clone(),
            status: JobStatus::Completed as i32,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// A job whose plan version cannot be read (its stored body no longer
/// decodes) is dead, naming why, instead of failing every grant that
/// claims it: the job queued behind it, of another plan, is leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_whose_plan_cannot_be_read_is_dead_and_stops_no_other() {
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    plan_service_client::PlanServiceClient::new(channel(&url).await.expect("connect"))
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("q", &["cat"])),
            replace: false,
        })
        .await
        .expect("plan q");
    let (_, broken) = submit_action_of(&url, "p", 3, None).await;
    let (_, sound) = submit_action_of(&url, "q", 3, None).await;
    let db = pg::connect(&cluster.url).await;
    let changed = db
        .execute(
            "UPDATE plan_versions SET body = '\\xffff'::bytea WHERE plan_id = 'p'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(changed, 1);
    let mut w = HandWorker::start(&url, "w", "instance-w", &["cat"]).await;
    let l = next_lease(&mut w, Duration::from_secs(10))
        .await
        .expect("the job of the sound plan is leased");
    assert_eq!(l.job.as_ref().unwrap().job_id, sound);
    let job = job_of(&url, &broken).await.expect("the broken job");
    assert_eq!(job.status, JobStatus::Dead as i32, "{job:?}");
    assert!(
        job.error.contains("permanent failure")
            && job.error.contains("its plan p version 1 cannot be read"),
        "{}",
        job.error
    );
    assert!(
        next_lease(&mut w, Duration::from_secs(1)).await.is_none(),
        "the job of the broken plan was leased"
    );
    cluster.assert_no_panic();
}

/// Submits `n` (a multiple of 10,000) jobs of plan `p` to `url`, due an
/// hour from now, with worker selector `selector`, in actions of 10,000
/// (max_inputs_per_action).
async fn submit_for_later(url: &str, n: usize, selector: &str) {
    let hour_ahead = timestamp_ms(now_ms() + 3_600_000);
    let mut actions =
        action_service_client::ActionServiceClient::new(channel(url).await.expect("connect"));
    for _ in 0..n / 10_000 {
        actions
            .submit_action(SubmitActionRequest {
                plan_id: "p".into(),
                inputs: (0..10_000)
                    .map(|n| ActionInput {
                        values: [("n".to_string(), n.to_string())].into(),
                    })
                    .collect(),
                max_attempts: 1,
                run_at: Some(hour_ahead),
                worker_selector: selector.into(),
                ..Default::default()
            })
            .await
            .expect("submit the jobs due later");
    }
}

/// Jobs scheduled for later (20,000 an hour ahead) cost the dispatcher
/// nothing: with one ready job behind them (a later row id, same
/// priority), the dispatcher's readiness check and its claim (the
/// statements of src/store/postgres/dispatch.rs, EXPLAIN ANALYZEd with
/// the claim's transaction settings on the test's database) read a few
/// rows and buffers, not one index entry per scheduled job. Then a worker
/// gets the ready job at once, a job scheduled 2 s ahead once it is due
/// (not before), and none of the 20,000; GetQueueStats counts them in one
/// pass over the open jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_reads_no_job_scheduled_for_later() {
    use agq::store::postgres::{CLAIM, CLAIM_SETTINGS, QUEUE_STATS, READY_CHECK};
    const LATER: usize = 20_000;
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    submit_for_later(&url, LATER, "").await;
    let (_, ready) = submit_action_of(&url, "p", 1, None).await;
    // No worker yet: the dispatcher claims nothing while the test looks.
    let db = pg::connect(&cluster.url).await;
    db.batch_execute("ANALYZE jobs").await.unwrap();
    let check = explain(
        &db,
        "SELECT 1",
        &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {READY_CHECK}"),
    )
    .await;
    let claim = explain(
        &db,
        &format!(
            "BEGIN; {CLAIM_SETTINGS}; PREPARE agq_claim (text[], boolean, text[], text[], bigint, \
             bigint[]) AS {CLAIM}"
        ),
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE agq_claim ('{cat}', false, '{}', '{\"\"}', 33, '{}')",
    )
    .await;
    let (check_rows, check_buffers) = (rows_read(&check[0]["Plan"], "jobs"), buffers(&check));
    let (claim_rows, claim_buffers) = (rows_read(&claim[0]["Plan"], "jobs"), buffers(&claim));
    println!(
        "with {LATER} jobs scheduled for later and 1 ready: readiness check read {check_rows} job \
         rows, {check_buffers} buffers; claim read {claim_rows} job rows, {claim_buffers} buffers"
    );
    assert_eq!(
        claim[0]["Plan"]["Actual Rows"].as_f64(),
        Some(1.0),
        "the claim finds the ready job: {claim:#}"
    );
    // Before the jobs scheduled for later were kept out of the claim's
    // index, both read all 20,001 rows (the check by a sequential scan,
    // the claim walking `jobs_claim`): 466 and 546 buffers.
    assert!(
        check_rows <= 10.0 && check_buffers <= 50.0 && claim_rows <= 10.0 && claim_buffers <= 100.0,
        "the dispatcher reads past the jobs scheduled for later:\nreadiness check: {check:#}\nclaim: {claim:#}"
    );

    // The ready job is leased at once; a job due in 2 s once due.
    let mut w = HandWorker::start(&url, "w", "instance-w", &["cat"]).await;
    let l = next_lease(&mut w, Duration::from_secs(5))
        .await
        .expect("the ready job is leased");
    assert_eq!(l.job.as_ref().unwrap().job_id, ready);
    complete(&w, &l).await;
    let due_ms = now_ms() + 2_000;
    let (_, soon) = submit_action_of(&url, "p", 1, Some(timestamp_ms(due_ms))).await;
    let l = next_lease(&mut w, Duration::from_secs(10))
        .await
        .expect("the job scheduled 2 s ahead is leased once due");
    let leased_ms = now_ms();
    assert_eq!(l.job.as_ref().unwrap().job_id, soon);
    assert!(
        leased_ms >= due_ms,
        "leased {} ms before it was due",
        due_ms - leased_ms
    );
    complete(&w, &l).await;
    assert!(
        next_lease(&mut w, Duration::from_secs(1)).await.is_none(),
        "a job scheduled an hour ahead was leased"
    );
    let stats = queue_service_client::QueueServiceClient::new(channel(&url).await.unwrap())
        .get_queue_stats(GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            stats.ready_length,
            stats.scheduled_length,
            stats.running_length
        ),
        (0, LATER as u64, 0)
    );
    // GetQueueStats reads the open jobs once (its totals, its depths by
    // priority and by pool: three passes before).
    let plan = explain(
        &db,
        "SELECT 1",
        &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {QUEUE_STATS}"),
    )
    .await;
    assert_eq!(
        scans(&plan[0]["Plan"], "jobs"),
        1,
        "GetQueueStats scans the jobs more than once: {plan:#}"
    );
    cluster.assert_no_panic();
}

/// The leader's drop of unused worker selectors does not read the
/// backlog: with 20,000 open jobs of one selector (scheduled for later,
/// so none runs) and one selector no job uses, its first statement
/// (EXPLAIN ANALYZEd on the test's database) finds the unused one and
/// reads a few job rows, not one per open job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_selector_drop_does_not_read_the_backlog() {
    use agq::store::postgres::SELECTOR_DROP_CANDIDATES;
    const OPEN: usize = 20_000;
    let _shared = PG_SERVER.read().await;
    let cluster = Cluster::start(1).await;
    let url = cluster.urls()[0].clone();
    put_plan(&url).await;
    submit_for_later(&url, OPEN, "busy=1").await;
    let db = pg::connect(&cluster.url).await;
    db.batch_execute("ANALYZE jobs").await.unwrap();
    // The unused selector exists only in the explaining transaction: the
    // leader cannot drop it before the statement runs.
    let plan = explain(
        &db,
        "BEGIN; INSERT INTO selectors VALUES ('gone=1')",
        &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {SELECTOR_DROP_CANDIDATES}"),
    )
    .await;
    let (rows, buffers) = (rows_read(&plan[0]["Plan"], "jobs"), buffers(&plan));
    println!(
        "with {OPEN} open jobs of one selector: the selector drop read {rows} job rows, \
         {buffers} buffers"
    );
    assert_eq!(
        plan[0]["Plan"]["Actual Rows"].as_f64(),
        Some(1.0),
        "the drop finds the unused selector, and only it: {plan:#}"
    );
    // Without an index of the open jobs by selector it read all 20,000.
    assert!(
        rows <= 10.0 && buffers <= 50.0,
        "the selector drop reads the open jobs: {plan:#}"
    );
    cluster.assert_no_panic();
}

/// Scans of table `relation` in plan node `node` and below.
fn scans(node: &serde_json::Value, relation: &str) -> usize {
    usize::from(
        node.get("Relation Name")
            .and_then(serde_json::Value::as_str)
            == Some(relation),
    ) + node
        .get("Plans")
        .and_then(serde_json::Value::as_array)
        .map_or(0, |c| c.iter().map(|c| scans(c, relation)).sum())
}
