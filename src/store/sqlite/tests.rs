//! Unit tests of the scheduler and the job state machine, through the
//! engine interface with no gRPC: leases arrive on in-process channels.

use std::{collections::HashMap, time::Duration};

use tokio::sync::mpsc;

use super::SqliteEngine;
use crate::{
    config::{EngineConfig, SyncMode},
    core::{
        engine::{ActionRequest, Engine, HeartbeatEvent, JobQuery, StreamKind},
        model::{
            JobLease, JobReport, JobStatus, Plan, Registration, Task, WorkerCapabilities,
            WorkerCommand,
        },
        SharedEngine,
    },
    error::Error,
    metrics::Metrics,
};

/// The configuration of [`engine`]: heartbeat 100 ms (stale after
/// 300 ms), no grace, no backoff.
fn quick() -> EngineConfig {
    EngineConfig {
        heartbeat_interval: Duration::from_millis(100),
        lease_grace: Duration::ZERO,
        retry_backoff_base: Duration::ZERO,
        retry_backoff_max: Duration::ZERO,
        ..EngineConfig::default()
    }
}

/// The engine itself (its writer and state reachable) on a fresh
/// database in `dir` with `cfg`.
async fn open(dir: &tempfile::TempDir, cfg: EngineConfig) -> std::sync::Arc<SqliteEngine> {
    SqliteEngine::open(
        &dir.path().join("agq.db"),
        SyncMode::Normal,
        cfg,
        std::sync::Arc::new(Metrics::new()),
    )
    .await
    .unwrap()
}

/// An engine on a fresh database, configured by [`quick`].
async fn engine(dir: &tempfile::TempDir) -> SharedEngine {
    open(dir, quick()).await
}

fn plan(id: &str, tools: &[&str]) -> Plan {
    Plan {
        plan_id: id.into(),
        tasks: tools
            .iter()
            .enumerate()
            .map(|(i, t)| Task {
                task_number: i as u32 + 1,
                command: (*t).into(),
                timeout_secs: 10,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A worker with both streams open, as agw keeps them.
struct Worker {
    id: String,
    leases: mpsc::UnboundedReceiver<JobLease>,
    commands: mpsc::UnboundedReceiver<HeartbeatEvent>,
}

impl Worker {
    async fn start(e: &SharedEngine, id: &str, tools: &[&str], max: u32) -> Worker {
        e.register_worker(Registration {
            worker_id: id.into(),
            hostname: "h".into(),
            agw_version: "t".into(),
            capabilities: WorkerCapabilities {
                tools: tools.iter().map(|t| t.to_string()).collect(),
                agentic_units: vec![],
                ..Default::default()
            },
            max_concurrent_jobs: max,
            ..Default::default()
        })
        .await
        .unwrap();
        let (htx, commands) = mpsc::unbounded_channel();
        e.open_heartbeat(id.into(), htx).await.unwrap();
        let (ltx, leases) = mpsc::unbounded_channel();
        e.open_lease_stream(id.into(), ltx).await.unwrap();
        Worker {
            id: id.into(),
            leases,
            commands,
        }
    }

    async fn lease_within(&mut self, ms: u64) -> Option<JobLease> {
        tokio::time::timeout(Duration::from_millis(ms), self.leases.recv())
            .await
            .ok()
            .flatten()
    }

    fn report(&self, lease: &JobLease, status: JobStatus) -> JobReport {
        JobReport {
            job_id: lease.job.job_id.clone(),
            worker_id: self.id.clone(),
            lease_id: lease.lease_id.clone(),
            status: Some(status),
            ..Default::default()
        }
    }
}

async fn submit(e: &SharedEngine, plan_id: &str, n: usize, attempts: u32) -> Vec<String> {
    submit_as(e, "", plan_id, n, attempts).await
}

/// Submits an action of `n` empty inputs named `action_id` ("": the
/// engine names it) on plan `plan_id`; returns its job ids.
async fn submit_as(
    e: &SharedEngine,
    action_id: &str,
    plan_id: &str,
    n: usize,
    attempts: u32,
) -> Vec<String> {
    e.submit_action(ActionRequest {
        action_id: action_id.into(),
        plan_id: plan_id.into(),
        inputs: (0..n).map(|_| HashMap::new()).collect(),
        max_attempts: attempts,
        ..Default::default()
    })
    .await
    .unwrap()
    .job_ids
}

/// An engine on `dir` with plan "p" (`cat`) and worker "w" of `slots`
/// slots, which never beats: a 60 s interval keeps it live throughout.
async fn one_silent_worker(
    dir: &tempfile::TempDir,
    slots: u32,
) -> (std::sync::Arc<SqliteEngine>, SharedEngine, Worker) {
    let e = open(
        dir,
        EngineConfig {
            heartbeat_interval: Duration::from_secs(60),
            ..quick()
        },
    )
    .await;
    let shared: SharedEngine = e.clone();
    shared
        .submit_plan(plan("p", &["cat"]), false)
        .await
        .unwrap();
    let w = Worker::start(&shared, "w", &["cat"], slots).await;
    (e, shared, w)
}

/// When the database says a job no longer runs under a lease memory
/// holds, the operation that finds it (here releasing a worker's leases
/// one by one) does not leave memory half-changed: the batch is rolled
/// back and the state reloaded, so a retry succeeds on what the database
/// holds, and no job is left running in memory but not on disk.
#[tokio::test]
async fn a_lease_memory_holds_and_the_database_does_not_reloads_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let (e, shared, mut w) = one_silent_worker(&dir, 2).await;
    let ids = submit(&shared, "p", 2, 3).await;
    let first = w.lease_within(2000).await.expect("first lease");
    let second = w.lease_within(2000).await.expect("second lease");
    assert_eq!(first.job.job_id, ids[0]);
    // The second job's lease changes on disk only.
    let row = row_of(&second.job.job_id);
    e.writer
        .write(move |_, c| {
            c.execute(
                "UPDATE job_rows SET lease_id = 'elsewhere' WHERE id = ?1",
                [row],
            )?;
            Ok(())
        })
        .await
        .unwrap();
    let err = shared.unregister_worker("w".into()).await.unwrap_err();
    assert!(matches!(err, Error::Storage { fault: None, .. }), "{err:?}");
    // Memory was reloaded: the first job still runs under its lease.
    let job = shared.get_job(ids[0].clone()).await.unwrap();
    assert_eq!(job.status, JobStatus::Running, "{job:?}");
    assert_eq!(shared.unregister_worker("w".into()).await.unwrap(), 2);
    for id in &ids {
        let job = shared.get_job(id.clone()).await.unwrap();
        assert_ne!(job.status, JobStatus::Running, "{job:?}");
    }
    e.close().await;
}

/// A reload (as after a failed commit) keeps what only memory knows of a
/// lease it still holds (the stream it went out on, the worker's
/// acknowledgement, its grant and expiry) and the timeouts a worker has
/// counted toward quarantine: a reset would take an in-flight lease for
/// lost at the next held-leases heartbeat, and restart the count.
#[tokio::test]
async fn a_reload_keeps_what_memory_knew_of_leases_and_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let (e, shared, mut w) = one_silent_worker(&dir, 1).await;
    submit(&shared, "p", 1, 3).await;
    w.lease_within(2000).await.expect("a lease");
    let (before, after) = e
        .writer
        .write(|s, c| {
            let row = *s.leases.keys().next().expect("the lease in memory");
            let l = s.leases.get_mut(&row).unwrap();
            l.acknowledged = true;
            let before = (l.stream_id, l.expires_at_ms, l.granted_at_ms);
            s.workers.get_mut("w").unwrap().timeouts.push_back(42);
            s.load(c)?;
            let l = &s.leases[&row];
            let after = (l.stream_id, l.expires_at_ms, l.granted_at_ms);
            Ok((
                (before, true, vec![42]),
                (
                    after,
                    l.acknowledged,
                    s.workers["w"].timeouts.iter().copied().collect::<Vec<_>>(),
                ),
            ))
        })
        .await
        .unwrap();
    assert_ne!(before.0 .0, 0, "the lease went out on a stream");
    assert_eq!(after, before);
    e.close().await;
}

/// Leases go to capable workers only, up to their slots, oldest job
/// first; a job nobody can take waits and says why.
#[tokio::test]
async fn leases_go_fifo_to_capable_workers_up_to_their_slots() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("sorter", &["sort"]), false)
        .await
        .unwrap();
    let mut cat = Worker::start(&e, "w-cat", &["cat"], 4).await;
    let mut sort = Worker::start(&e, "w-sort", &["sort", "uniq"], 2).await;
    let ids = submit(&e, "sorter", 3, 3).await;
    let first = sort.lease_within(2000).await.expect("first lease");
    let second = sort.lease_within(2000).await.expect("second lease");
    assert_eq!(
        [first.job.job_id.as_str(), second.job.job_id.as_str()],
        [ids[0].as_str(), ids[1].as_str()],
        "FIFO"
    );
    assert_eq!(first.job.status, JobStatus::Running);
    assert_eq!(first.attempt, 1);
    assert!(sort.lease_within(200).await.is_none(), "only 2 slots");
    assert!(cat.lease_within(50).await.is_none(), "w-cat lacks sort");
    let waiting = e.get_job(ids[2].clone()).await.unwrap();
    assert_eq!(waiting.status, JobStatus::Pending);
    assert!(
        waiting.waiting_reason.contains("busy"),
        "{}",
        waiting.waiting_reason
    );
    // A freed slot takes the next job.
    let done = e
        .update_job(sort.report(&first, JobStatus::Completed))
        .await
        .unwrap();
    assert_eq!(done, JobStatus::Completed);
    let third = sort.lease_within(2000).await.expect("third lease");
    assert_eq!(third.job.job_id, ids[2]);
}

/// A worker whose heartbeat went stale (3 x the interval) gets no lease,
/// and the waiting job says no fresh worker has its tools.
#[tokio::test]
async fn a_stale_worker_gets_no_lease() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&e, "w1", &["sort"], 1).await;
    // No heartbeat for well past 300 ms.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let ids = submit(&e, "p", 1, 3).await;
    assert!(w.lease_within(300).await.is_none());
    let job = e.get_job(ids[0].clone()).await.unwrap();
    assert!(
        job.waiting_reason.contains("no fresh worker"),
        "{}",
        job.waiting_reason
    );
}

/// Reports are fenced: a stale lease id is FAILED_PRECONDITION, another
/// worker's report PERMISSION_DENIED, and neither changes the job; a
/// repeated final report is acknowledged; failures retry until dead;
/// retry and cancel follow the state rules.
#[tokio::test]
async fn the_state_machine_fences_reports_and_follows_its_transitions() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&e, "w1", &["sort"], 1).await;
    let other = Worker::start(&e, "w2", &["cat"], 1).await;
    let ids = submit(&e, "p", 1, 2).await;
    let lease = w.lease_within(2000).await.unwrap();

    let mut stale = w.report(&lease, JobStatus::Completed);
    stale.lease_id = "not-the-lease".into();
    let err = e.update_job(stale).await.unwrap_err();
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err:?}");
    let err = e
        .update_job(other.report(&lease, JobStatus::Completed))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    let mut bad = w.report(&lease, JobStatus::Completed);
    bad.status = None;
    let err = e.update_job(bad).await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert_eq!(
        e.get_job(ids[0].clone()).await.unwrap().status,
        JobStatus::Running
    );

    // Attempt 1 fails: with no backoff the job is pending and leased again.
    let after = e
        .update_job(w.report(&lease, JobStatus::Failed))
        .await
        .unwrap();
    assert!(matches!(after, JobStatus::Pending | JobStatus::Failed));
    let again = w.lease_within(2000).await.unwrap();
    assert_eq!(
        (again.attempt, again.job.job_id.as_str()),
        (2, ids[0].as_str())
    );
    assert_ne!(again.lease_id, lease.lease_id, "a new fencing token");
    // The first attempt's lease is stale now: its completion is refused
    // before anything is written (no completion row), and the job runs on.
    let err = e
        .update_job(w.report(&lease, JobStatus::Completed))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err:?}");
    assert_eq!(
        e.get_job(ids[0].clone()).await.unwrap().status,
        JobStatus::Running
    );
    let completions: i64 = rusqlite::Connection::open(dir.path().join("agq.db"))
        .unwrap()
        .query_row("SELECT count(*) FROM job_completions", [], |r| r.get(0))
        .unwrap();
    assert_eq!(completions, 0, "a stale completion was stored");
    // Attempt 2 of 2 fails: dead, and a repeat of that report is acknowledged.
    let report = w.report(&again, JobStatus::Failed);
    assert_eq!(e.update_job(report.clone()).await.unwrap(), JobStatus::Dead);
    assert_eq!(e.update_job(report).await.unwrap(), JobStatus::Dead);
    assert!(matches!(
        e.cancel_job(ids[0].clone()).await.unwrap_err(),
        Error::FailedPrecondition(_)
    ));
    // Retry brings it back with a fresh budget (and, a worker being
    // free, it may be leased in the same commit).
    let retried = e.retry_job(ids[0].clone(), None).await.unwrap();
    assert!(
        matches!(retried.status, JobStatus::Pending | JobStatus::Running),
        "{retried:?}"
    );
    let third = w.lease_within(2000).await.unwrap();
    assert_eq!(third.attempt, 1);
    assert!(matches!(
        e.retry_job(ids[0].clone(), None).await.unwrap_err(),
        Error::FailedPrecondition(_)
    ));
    // Cancelling a running job tells its holder over the heartbeat stream.
    let cancelled = e.cancel_job(ids[0].clone()).await.unwrap();
    assert_eq!(cancelled.status, JobStatus::Cancelled);
    let told = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match w.commands.recv().await {
                Some(HeartbeatEvent::Reply(r)) => {
                    if let Some(c) = r.command {
                        return Some(c);
                    }
                }
                _ => return None,
            }
        }
    })
    .await
    .ok()
    .flatten();
    assert_eq!(
        told,
        Some(WorkerCommand::CancelJob {
            job_id: ids[0].clone(),
            lease_id: third.lease_id.clone(),
        })
    );
    let err = e
        .update_job(w.report(&third, JobStatus::Completed))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err:?}");
    e.close().await;
}

/// A worker that unregisters gives its leases back: the job goes to the
/// next capable worker with a new lease.
#[tokio::test]
async fn leases_of_an_unregistered_worker_are_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut a = Worker::start(&e, "a", &["sort"], 1).await;
    let ids = submit(&e, "p", 1, 3).await;
    let first = a.lease_within(2000).await.unwrap();
    let mut b = Worker::start(&e, "b", &["sort"], 1).await;
    assert_eq!(e.unregister_worker("a".into()).await.unwrap(), 1);
    let second = b.lease_within(2000).await.expect("re-leased to b");
    assert_eq!(second.job.job_id, ids[0]);
    assert_ne!(second.lease_id, first.lease_id);
}

/// The `agq_jobs_current` gauge of an engine, by status name.
async fn gauge(e: &SharedEngine) -> HashMap<String, i64> {
    let text = e.metrics_text().await.unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("agq_jobs_current{status=\""))
        .map(|l| {
            let (name, n) = l.split_once("\"} ").unwrap();
            (name.to_string(), n.trim().parse().unwrap())
        })
        .collect()
}

/// The number of job rows in each status, by a scan of the database.
fn stored(dir: &tempfile::TempDir) -> HashMap<String, i64> {
    let conn = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    let mut stmt = conn
        .prepare("SELECT status, count(*) FROM jobs GROUP BY status")
        .unwrap();
    let mut out: HashMap<String, i64> = JobStatus::ALL
        .iter()
        .map(|s| (s.name().to_string(), 0))
        .collect();
    for row in stmt
        .query_map([], |r| Ok((r.get::<_, i32>(0)?, r.get::<_, i64>(1)?)))
        .unwrap()
    {
        let (s, n) = row.unwrap();
        out.insert(JobStatus::from_i32(s).unwrap().name().to_string(), n);
    }
    out
}

/// Waits (5 s at most) until retention has deleted every job row.
async fn wait_all_deleted(dir: &tempfile::TempDir) {
    for _ in 0..100 {
        if stored(dir).values().all(|&n| n == 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("retention left jobs: {:?}", stored(dir));
}

/// Asserts that the gauge equals the table. The engine's maintenance (a
/// stale worker's leases going back) may commit at any moment, so the
/// gauge is read between two scans that agree: no commit changed the
/// counts in between.
/// After a start the finished statuses are counted in the background:
/// their gauges appear once that count is done.
async fn assert_gauge_matches_table(e: &SharedEngine, dir: &tempfile::TempDir) {
    for _ in 0..100 {
        let before = stored(dir);
        let g = gauge(e).await;
        if g.len() < before.len() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        if stored(dir) == before {
            assert_eq!(g, before);
            return;
        }
    }
    panic!("the job counts kept changing or were never all counted");
}

/// The engine counts the jobs in each status without an index on the
/// status: the gauge equals a scan of the table after inserts, leases,
/// completions, failures (dead and retried), retries, cancellations of
/// pending and running jobs, a plan deletion, a restart and retention.
#[tokio::test]
async fn job_counts_follow_every_transition_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    e.submit_plan(plan("gone", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&e, "w1", &["sort"], 2).await;
    let once = submit(&e, "p", 4, 1).await;
    let twice = submit(&e, "p", 2, 2).await;
    assert_gauge_matches_table(&e, &dir).await;
    assert_eq!(gauge(&e).await["running"], 2);
    assert_eq!(gauge(&e).await["pending"], 4);

    // Leased in id order: once[0] completes, once[1] fails for good.
    let a = w.lease_within(2000).await.unwrap();
    let b = w.lease_within(2000).await.unwrap();
    assert_eq!((&a.job.job_id, &b.job.job_id), (&once[0], &once[1]));
    e.update_job(w.report(&a, JobStatus::Completed))
        .await
        .unwrap();
    assert_eq!(
        e.update_job(w.report(&b, JobStatus::Failed)).await.unwrap(),
        JobStatus::Dead
    );
    assert_gauge_matches_table(&e, &dir).await;
    // once[2] and once[3] are leased now; cancel a running and a pending job.
    let c = w.lease_within(2000).await.unwrap();
    let _d = w.lease_within(2000).await.unwrap();
    assert_eq!(c.job.job_id, once[2]);
    e.cancel_job(once[2].clone()).await.unwrap();
    let _ = w.lease_within(2000).await.unwrap(); // twice[0] takes the slot
    e.cancel_job(twice[1].clone()).await.unwrap();
    assert_gauge_matches_table(&e, &dir).await;
    assert_eq!(gauge(&e).await["cancelled"], 2);
    // The dead job comes back.
    e.retry_job(once[1].clone(), None).await.unwrap();
    assert_gauge_matches_table(&e, &dir).await;
    e.close().await;

    // Counted again at startup. The second plan's finished jobs go with it.
    let e = engine(&dir).await;
    assert_gauge_matches_table(&e, &dir).await;
    let gone = submit(&e, "gone", 3, 1).await;
    // w1's leases come back once it is stale; a failure with an attempt
    // left goes back to pending (no backoff).
    let mut w = Worker::start(&e, "w2", &["sort"], 8).await;
    let mut open = 0;
    for _ in 0..64 {
        let Some(l) = w.lease_within(500).await else {
            break;
        };
        match l.attempt {
            1 if l.job.plan_id == "gone" || open % 2 == 0 => {
                e.update_job(w.report(&l, JobStatus::Completed))
                    .await
                    .unwrap();
            }
            _ => {
                e.update_job(w.report(&l, JobStatus::Failed)).await.unwrap();
            }
        }
        open += 1;
    }
    assert_gauge_matches_table(&e, &dir).await;
    let g = gauge(&e).await;
    assert_eq!(g["pending"] + g["running"], 0, "{g:?} after {open} leases");
    assert!(g["completed"] >= 4 && g["dead"] >= 1, "{g:?}");
    e.delete_plan("gone".into()).await.unwrap();
    assert_gauge_matches_table(&e, &dir).await;
    // Only the deleted plan's jobs are gone.
    for id in &gone {
        assert!(matches!(
            e.get_job(id.clone()).await,
            Err(Error::NotFound(_))
        ));
    }
    for id in once.iter().chain(&twice) {
        assert_eq!(e.get_job(id.clone()).await.unwrap().plan_id, "p");
    }
    e.close().await;

    // Retention deletes every finished action; the counts fall to zero.
    let cfg = EngineConfig {
        heartbeat_interval: Duration::from_millis(100),
        job_retention: Some(Duration::from_millis(200)),
        ..EngineConfig::default()
    };
    let e: SharedEngine = SqliteEngine::open(
        &dir.path().join("agq.db"),
        SyncMode::Normal,
        cfg,
        std::sync::Arc::new(Metrics::new()),
    )
    .await
    .unwrap();
    wait_all_deleted(&dir).await;
    assert_gauge_matches_table(&e, &dir).await;
    e.close().await;
}

/// A job's public id names its row: every id an action returned finds its
/// job, before and after a restart, and ids follow submission order. An
/// action's counts, job listing and cancel see exactly its own jobs, not
/// those of the actions inserted around it; an id with the right row and
/// another key, or spelled otherwise, is `NotFound`.
#[tokio::test]
async fn job_ids_name_their_rows_and_actions_see_only_their_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut actions = Vec::new();
    for (i, n) in [3, 1, 4].into_iter().enumerate() {
        actions.push(submit_as(&e, &format!("a{i}"), "p", n, 1).await);
    }
    let all: Vec<String> = actions.concat();
    let mut sorted = all.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted, all, "ids are distinct and follow submission order");
    for (i, ids) in actions.iter().enumerate() {
        let action_id = format!("a{i}");
        for id in ids {
            let job = e.get_job(id.clone()).await.unwrap();
            assert_eq!((&job.job_id, &job.action_id), (id, &action_id));
        }
        let page = e
            .search_jobs(JobQuery {
                action_id: Some(action_id.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(&page.items, ids, "{action_id}");
        let status = e.get_action(action_id.clone()).await.unwrap();
        assert_eq!(status.pending as usize, ids.len(), "{action_id}");
    }
    let id = &actions[1][0];
    let other_key = format!(
        "{}{}",
        &id[..24],
        if &id[24..25] == "0" { "1" } else { "0" }
    ) + &id[25..];
    for wrong in [other_key, id.to_uppercase()] {
        assert!(
            matches!(e.get_job(wrong.clone()).await, Err(Error::NotFound(_))),
            "{wrong}"
        );
    }
    // Cancelling the middle action touches none of its neighbours' jobs.
    e.cancel_action("a1".into()).await.unwrap();
    assert_eq!(e.get_action("a0".into()).await.unwrap().pending, 3);
    assert_eq!(e.get_action("a2".into()).await.unwrap().pending, 4);
    assert_eq!(e.get_action("a1".into()).await.unwrap().cancelled, 1);
    e.close().await;

    let e = engine(&dir).await;
    let page = e
        .search_jobs(JobQuery {
            action_id: Some("a1".into()),
            status: Some(JobStatus::Pending),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(page.items.is_empty());
    let more = submit(&e, "p", 2, 1).await;
    assert!(more.iter().all(|id| id > &all[all.len() - 1]), "{more:?}");
    for i in [0, 2] {
        let ids = &actions[i];
        let page = e
            .search_jobs(JobQuery {
                action_id: Some(format!("a{i}")),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(&page.items, ids);
        for id in ids {
            assert_eq!(e.get_job(id.clone()).await.unwrap().job_id, *id);
        }
    }
    e.close().await;
}

/// The finish time of an action, read from the database (None: open).
fn finished_at(dir: &tempfile::TempDir, action_id: &str) -> Option<i64> {
    let conn = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    conn.query_row(
        "SELECT finished_at_ms FROM actions WHERE action_id = ?1",
        [action_id],
        |r| r.get(0),
    )
    .unwrap()
}

/// An action is marked finished when its last open job ends, and not
/// while it has an open job the scheduler does not hold (its plan version
/// is gone from a database edited by hand); nor does the open floor pass
/// that job.
#[tokio::test]
async fn an_action_with_an_unscheduled_open_job_is_never_finished() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    for (id, n) in [("kept", 2), ("done", 1)] {
        submit_as(&e, id, "p", n, 1).await;
    }
    e.close().await;
    rusqlite::Connection::open(dir.path().join("agq.db"))
        .unwrap()
        .execute(
            "UPDATE job_rows SET plan_version = 99
             WHERE id = (SELECT last_job_row FROM actions WHERE action_id = 'kept')",
            [],
        )
        .unwrap();

    let engine = open(&dir, quick()).await;
    let e = shared(&engine);
    let mut w = Worker::start(&e, "w", &["sort"], 4).await;
    for _ in 0..2 {
        let l = w.lease_within(2000).await.unwrap();
        e.update_job(w.report(&l, JobStatus::Completed))
            .await
            .unwrap();
    }
    assert!(
        w.lease_within(300).await.is_none(),
        "the unscheduled job ran"
    );
    // Memory does not hold the unscheduled job: the open floor stays put
    // below it (the next start still loads it).
    raise_floor(&engine).await;
    let unscheduled: i64 = rusqlite::Connection::open(dir.path().join("agq.db"))
        .unwrap()
        .query_row(
            "SELECT last_job_row FROM actions WHERE action_id = 'kept'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(
        stored_floor(&dir) <= unscheduled,
        "the floor passed the unscheduled job"
    );
    e.close().await;
    assert!(finished_at(&dir, "done").is_some(), "the finished action");
    assert_eq!(
        finished_at(&dir, "kept"),
        None,
        "the action with an open job"
    );
}

/// An action is stamped finished when its last open job ends, and
/// RetryAction and RetryJob, which open a job again, clear the stamp (so
/// retention never takes an action whose job runs again).
#[tokio::test]
async fn retries_clear_the_finish_time_of_their_action() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let jobs = submit_as(&e, "r", "p", 1, 1).await;
    let mut w = Worker::start(&e, "w", &["sort"], 1).await;
    let mut fail_it = async || {
        let l = w.lease_within(2000).await.unwrap();
        assert_eq!(
            e.update_job(w.report(&l, JobStatus::Failed)).await.unwrap(),
            JobStatus::Dead
        );
    };
    fail_it().await;
    assert!(finished_at(&dir, "r").is_some(), "its last job ended");
    e.retry_action("r".into(), None).await.unwrap();
    assert_eq!(finished_at(&dir, "r"), None, "RetryAction left it finished");
    fail_it().await;
    assert!(finished_at(&dir, "r").is_some(), "its job ended again");
    e.retry_job(jobs[0].clone(), None).await.unwrap();
    assert_eq!(finished_at(&dir, "r"), None, "RetryJob left it finished");
    e.close().await;
}

/// The weight of the rows the scheduler keeps for queued jobs, as the
/// state counts it, and as the kept rows add up.
async fn fresh_bytes(e: &std::sync::Arc<SqliteEngine>) -> (usize, usize) {
    e.writer
        .run(|st, _| {
            let kept = st
                .ready
                .values()
                .filter_map(|w| w.fresh.as_ref())
                .map(|f| f.weight())
                .sum();
            Ok((st.fresh_bytes, kept))
        })
        .await
        .unwrap()
}

/// New jobs keep their row in memory for their first lease within a byte
/// budget: the count follows every job that takes or drops its kept row
/// (lease, cancel), and a job queued past the budget is read back for its
/// lease, which then carries the job as GetJob shows it.
#[tokio::test]
async fn kept_rows_of_new_jobs_stay_within_their_byte_budget() {
    use super::state::FRESH_BYTES_MAX;
    let dir = tempfile::tempdir().unwrap();
    let engine = open(&dir, EngineConfig::default()).await;
    let e: SharedEngine = engine.clone();
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let ids = submit(&e, "p", 4, 1).await;
    let (counted, kept) = fresh_bytes(&engine).await;
    assert!(kept > 0, "new jobs keep their rows");
    assert_eq!(counted, kept);
    e.cancel_job(ids[0].clone()).await.unwrap();
    let (counted, kept) = fresh_bytes(&engine).await;
    assert_eq!(counted, kept);
    assert!(kept > 0);

    // Fill the budget but for a few bytes: the next jobs are queued
    // without their rows.
    let filler = engine
        .writer
        .run(move |st, _| {
            let filler = FRESH_BYTES_MAX - st.fresh_bytes - 10;
            st.fresh_bytes += filler;
            Ok(filler)
        })
        .await
        .unwrap();
    let late = e
        .submit_action(ActionRequest {
            plan_id: "p".into(),
            inputs: vec![HashMap::from([("k".to_string(), "v".repeat(100))]); 2],
            max_attempts: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .job_ids;
    let (counted, kept) = fresh_bytes(&engine).await;
    assert_eq!(counted, kept + filler, "jobs past the budget keep nothing");
    engine
        .writer
        .run(move |st, _| {
            st.fresh_bytes -= filler;
            Ok(())
        })
        .await
        .unwrap();

    let mut w = Worker::start(&e, "w", &["sort"], 8).await;
    let mut leased = HashMap::new();
    for _ in 0..5 {
        let l = w.lease_within(2000).await.expect("a lease");
        leased.insert(l.job.job_id.clone(), l);
    }
    assert!(w.lease_within(100).await.is_none());
    for id in ids[1..].iter().chain(&late) {
        let stored = e.get_job(id.clone()).await.unwrap();
        assert_eq!(leased.get(id).map(|l| &l.job), Some(&stored), "job {id}");
    }
    assert_eq!(
        leased[&late[0]].job.input.get("k").map(String::len),
        Some(100)
    );
    assert_eq!(fresh_bytes(&engine).await, (0, 0), "every kept row taken");
    e.close().await;
}

/// The reaper judges silence as of when its tick was queued: a tick queued
/// while a worker was fresh, that runs late behind a long operation with
/// the worker's next heartbeat queued behind it, declares nothing DEAD and
/// takes no lease back (time the writer spent on its queue is not the
/// worker's silence).
#[tokio::test]
async fn a_late_tick_does_not_count_the_writers_queue_as_silence() {
    use std::time::Instant;

    use crate::{core::model::WorkerState, time::now_ms};
    let dir = tempfile::tempdir().unwrap();
    let engine = open(&dir, quick()).await;
    let e: SharedEngine = engine.clone();
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&e, "w1", &["sort"], 1).await;
    let ids = submit(&e, "p", 1, 1).await;
    let lease = w.lease_within(2000).await.expect("a lease");
    let before = e.get_job(ids[0].clone()).await.unwrap().status;
    e.heartbeat("w1".into(), None, None).await.unwrap();
    // Hold the writer for twice the stale limit (300 ms).
    let hold = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .writer
                .run(|_, _| {
                    std::thread::sleep(Duration::from_millis(600));
                    Ok(())
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Queued while the worker is fresh; runs about 550 ms later.
    let (queued, queued_ms) = (Instant::now(), now_ms());
    assert!(engine
        .writer
        .submit(move |s, c| s.tick(c, queued, queued_ms)));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let beat = e.heartbeat("w1".into(), None, None);
    let (held, beat) = tokio::join!(hold, beat);
    held.unwrap().unwrap();
    beat.unwrap();
    let worker = e.get_worker("w1".into()).await.unwrap();
    assert_eq!(worker.state, WorkerState::Active);
    assert_eq!(worker.active_leases, 1);
    let job = e.get_job(ids[0].clone()).await.unwrap();
    assert_eq!(job.status, before);
    // The lease still stands: its report is accepted.
    e.update_job(w.report(&lease, JobStatus::Completed))
        .await
        .unwrap();
    e.close().await;
}

/// The stored open floor: `job_floor.first_open_row`.
fn stored_floor(dir: &tempfile::TempDir) -> i64 {
    let conn = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    conn.query_row("SELECT first_open_row FROM job_floor", [], |r| r.get(0))
        .unwrap()
}

/// The lowest row of an open job (pending, running, failed awaiting
/// retry) by a scan of the table; `None`: no open job.
fn lowest_open_row(dir: &tempfile::TempDir) -> Option<i64> {
    let conn = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    conn.query_row(
        "SELECT min(id) FROM jobs WHERE status IN (1, 2, 4)",
        [],
        |r| r.get(0),
    )
    .unwrap()
}

/// Runs a batch that looks at raising the open floor (as one does at
/// most every `FLOOR_EVERY`).
async fn raise_floor(e: &SqliteEngine) {
    e.writer
        .write(|s, _| {
            s.floor_checked = std::time::Instant::now() - super::state::FLOOR_EVERY;
            Ok(())
        })
        .await
        .unwrap();
}

/// The ids of the jobs in `status` (SearchJobs, first page).
async fn with_status(e: &SqliteEngine, status: JobStatus) -> Vec<String> {
    e.search_jobs(JobQuery {
        status: Some(status),
        ..Default::default()
    })
    .await
    .unwrap()
    .items
}

/// `e` behind the engine interface the helpers take.
fn shared(e: &std::sync::Arc<SqliteEngine>) -> SharedEngine {
    e.clone()
}

fn row_of(job_id: &str) -> i64 {
    super::sql::jobs::parse_job_id(job_id).unwrap().0
}

/// The start-up load reads the job rows from the stored open floor on:
/// a batch raises it past finished jobs to the lowest open one (never
/// past an open job), RetryJob lowers it to the job it reopens, and after
/// a restart every open job, the reopened one included, is leased again
/// while the gauges still count every stored job.
#[tokio::test]
async fn the_open_floor_passes_finished_jobs_and_a_retry_lowers_it() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&dir, quick()).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&shared(&e), "w1", &["sort"], 1).await;
    let first = submit(&shared(&e), "p", 3, 1).await;
    for (i, id) in first.iter().enumerate() {
        let l = w.lease_within(2000).await.unwrap();
        assert_eq!(&l.job.job_id, id);
        let status = if i == 1 {
            JobStatus::Failed
        } else {
            JobStatus::Completed
        };
        e.update_job(w.report(&l, status)).await.unwrap();
    }
    // Two attempts: the running one goes back to pending when its worker
    // does not come back after the restart.
    let later = submit(&shared(&e), "p", 2, 2).await;
    let running = w.lease_within(2000).await.unwrap();
    assert_eq!(running.job.job_id, later[0]);
    assert_eq!(
        stored_floor(&dir),
        0,
        "a database starts with the floor at 0"
    );
    raise_floor(&e).await;
    assert_eq!(
        stored_floor(&dir),
        row_of(&later[0]),
        "the running job holds it"
    );
    assert_eq!(lowest_open_row(&dir), Some(row_of(&later[0])));

    // A search by an open status starts at the floor; by a finished one,
    // at the first row.
    assert_eq!(
        with_status(&e, JobStatus::Running).await,
        [later[0].clone()]
    );
    assert_eq!(
        with_status(&e, JobStatus::Completed).await,
        [first[0].clone(), first[2].clone()]
    );

    // The dead job comes back: the floor follows it down, and a raise
    // while it is open leaves it there.
    e.retry_job(first[1].clone(), None).await.unwrap();
    assert_eq!(stored_floor(&dir), row_of(&first[1]));
    raise_floor(&e).await;
    assert_eq!(stored_floor(&dir), row_of(&first[1]));
    assert_eq!(
        with_status(&e, JobStatus::Pending).await,
        [first[1].clone(), later[1].clone()]
    );
    e.close().await;

    // Every open job is loaded again: the retried one and the two later
    // ones (the running one returns once its worker is stale, after the
    // restart grace). The new worker beats meanwhile.
    let e = open(&dir, quick()).await;
    assert_gauge_matches_table(&shared(&e), &dir).await;
    let mut w = Worker::start(&shared(&e), "w2", &["sort"], 4).await;
    let mut leased = Vec::new();
    for _ in 0..60 {
        if leased.len() == 3 {
            break;
        }
        e.heartbeat("w2".into(), None, None).await.unwrap();
        let Some(l) = w.lease_within(50).await else {
            continue;
        };
        e.update_job(w.report(&l, JobStatus::Completed))
            .await
            .unwrap();
        leased.push(l.job.job_id);
    }
    leased.sort();
    let mut want = vec![first[1].clone(), later[0].clone(), later[1].clone()];
    want.sort();
    assert_eq!(leased, want);
    // w2 goes (its streams close): the job submitted below stays pending.
    drop(w);
    assert_eq!(lowest_open_row(&dir), None);
    // With nothing open the floor goes past the last row; jobs submitted
    // later get rows from it on and are loaded after a restart.
    raise_floor(&e).await;
    assert_eq!(stored_floor(&dir), row_of(&later[1]) + 1);
    let last = submit(&shared(&e), "p", 1, 2).await;
    assert!(row_of(&last[0]) >= stored_floor(&dir));
    e.close().await;
    let e = open(&dir, quick()).await;
    let mut w = Worker::start(&shared(&e), "w3", &["sort"], 1).await;
    assert_eq!(w.lease_within(3000).await.unwrap().job.job_id, last[0]);
    assert_gauge_matches_table(&shared(&e), &dir).await;
    e.close().await;
}

/// Once retention has deleted every job row, the stored floor stays where
/// the last job left it and a restarted server hands out rows from it on
/// (rows also carry their creation time, so this holds with the clock as
/// it is; the load lifts the row counter to the floor for a clock set
/// back), so its new jobs are loaded again after the next restart.
#[tokio::test]
async fn rows_after_retention_emptied_the_table_start_at_the_floor() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        job_retention: Some(Duration::from_millis(200)),
        ..quick()
    };
    let e = open(&dir, cfg).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&shared(&e), "w1", &["sort"], 2).await;
    let ids = submit(&shared(&e), "p", 2, 1).await;
    for _ in 0..2 {
        let l = w.lease_within(2000).await.unwrap();
        e.update_job(w.report(&l, JobStatus::Completed))
            .await
            .unwrap();
    }
    raise_floor(&e).await;
    let floor = stored_floor(&dir);
    assert_eq!(floor, row_of(&ids[1]) + 1);
    wait_all_deleted(&dir).await;
    e.close().await;

    let e = open(&dir, quick()).await;
    let fresh = submit(&shared(&e), "p", 1, 1).await;
    assert!(
        row_of(&fresh[0]) >= floor,
        "{} < {floor}",
        row_of(&fresh[0])
    );
    e.close().await;
    let e = open(&dir, quick()).await;
    let mut w = Worker::start(&shared(&e), "w2", &["sort"], 1).await;
    assert_eq!(w.lease_within(3000).await.unwrap().job.job_id, fresh[0]);
    e.close().await;
}

/// Under a mix of completions, failures with retries left (backoff),
/// dead jobs, cancellations and RetryJob, with the floor looked at after
/// every step, the stored floor never passes an open job.
#[tokio::test]
async fn the_open_floor_never_passes_an_open_job() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        heartbeat_interval: Duration::from_secs(10),
        retry_backoff_base: Duration::from_millis(30),
        retry_backoff_max: Duration::from_millis(60),
        ..quick()
    };
    let e = open(&dir, cfg).await;
    let shared: SharedEngine = e.clone();
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&shared, "w1", &["sort"], 3).await;
    let mut ids = Vec::new();
    let mut dead = Vec::new();
    let mut retried = 0;
    // A fixed pseudo-random sequence (xorshift), so a failure repeats.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..300 {
        match next(8) {
            0 => ids.extend(submit(&shared, "p", 1 + next(3) as usize, 1 + next(2) as u32).await),
            1 if !ids.is_empty() => {
                let id = ids[next(ids.len() as u64) as usize].clone();
                let _ = e.cancel_job(id).await;
            }
            2 if !dead.is_empty() => {
                let id = dead.swap_remove(next(dead.len() as u64) as usize);
                if e.retry_job(id, None).await.is_ok() {
                    retried += 1;
                }
            }
            _ => {
                if let Some(l) = w.lease_within(20).await {
                    let status = if next(3) == 0 {
                        JobStatus::Failed
                    } else {
                        JobStatus::Completed
                    };
                    if matches!(
                        e.update_job(w.report(&l, status)).await,
                        Ok(JobStatus::Dead)
                    ) {
                        dead.push(l.job.job_id);
                    }
                }
            }
        }
        raise_floor(&e).await;
        let floor = stored_floor(&dir);
        if let Some(open) = lowest_open_row(&dir) {
            assert!(
                floor <= open,
                "step {step}: floor {floor} passed open row {open}"
            );
        }
    }
    assert!(stored_floor(&dir) > 0, "the floor never moved");
    assert!(retried >= 5, "only {retried} dead jobs were retried");
    e.close().await;
}

/// The finished jobs are counted on a snapshot taken as the state loads,
/// while the writer goes on: completions, failures to dead, a cancel, a
/// retry and retention commit before that count reads a row, and the
/// gauge adds up to the table once it is done (the changes are neither
/// lost nor counted twice). Until then the counts lack the finished
/// statuses.
#[tokio::test]
async fn finished_jobs_counted_in_the_background_add_up_with_later_changes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        job_retention: Some(Duration::from_millis(300)),
        ..quick()
    };
    let e = open(&dir, cfg).await;
    let shared: SharedEngine = e.clone();
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&shared, "w1", &["sort"], 4).await;
    let heartbeat = |e: SharedEngine| async move {
        e.heartbeat("w1".into(), None, None).await.unwrap();
    };
    // An action that finishes now (retention deletes it later), and one
    // that stays.
    let old = submit(&shared, "p", 2, 1).await;
    for _ in &old {
        let l = w.lease_within(2000).await.unwrap();
        e.update_job(w.report(&l, JobStatus::Completed))
            .await
            .unwrap();
    }
    let ids = submit(&shared, "p", 6, 1).await;
    assert_gauge_matches_table(&shared, &dir).await;

    // Load again (as after a failed commit) with the count held.
    let release = load_with_count_held(&e).await;
    // (The gauge keeps its last values; the counts behind it lack the
    // finished statuses.)
    let c = counts_of(&e).await;
    let (pending, running) = (JobStatus::Pending as i32, JobStatus::Running as i32);
    assert_eq!(c.len(), 3, "only the open statuses: {c:?}");
    assert_eq!(c[&pending] + c[&running], 6, "{c:?}");
    heartbeat(shared.clone()).await;
    let mut leased = Vec::new();
    while leased.len() < 4 {
        leased.push(w.lease_within(2000).await.expect("a lease"));
    }
    e.update_job(w.report(&leased[0], JobStatus::Completed))
        .await
        .unwrap();
    e.update_job(w.report(&leased[1], JobStatus::Completed))
        .await
        .unwrap();
    assert!(matches!(
        e.update_job(w.report(&leased[2], JobStatus::Failed)).await,
        Ok(JobStatus::Dead)
    ));
    let cancelled = ids
        .iter()
        .find(|id| !leased.iter().any(|l| &l.job.job_id == *id))
        .unwrap();
    e.cancel_job(cancelled.clone()).await.unwrap();
    e.retry_job(leased[2].job.job_id.clone(), None)
        .await
        .unwrap();
    // Retention deletes the first action's two completed jobs meanwhile.
    for _ in 0..100 {
        if old.iter().all(|id| stored_has_not(&dir, id)) {
            break;
        }
        heartbeat(shared.clone()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        old.iter().all(|id| stored_has_not(&dir, id)),
        "retention ran"
    );
    assert_eq!(counts_of(&e).await.len(), 3, "still counting");
    release.send(()).unwrap();
    wait_counted(&e).await;
    assert_gauge_matches_table(&shared, &dir).await;
    e.close().await;
}

/// Loads `e`'s state again (as after a failed commit) with the background
/// count of finished jobs held until the returned sender is used or
/// dropped.
async fn load_with_count_held(e: &SqliteEngine) -> std::sync::mpsc::Sender<()> {
    let (release, gate) = std::sync::mpsc::channel();
    e.writer
        .write(move |s, c| {
            s.count_gate = Some(gate);
            s.load(c)
        })
        .await
        .unwrap();
    release
}

/// The engine's job counts by status value (`State::job_counts`).
async fn counts_of(e: &SqliteEngine) -> HashMap<i32, i64> {
    e.writer.run(|s, _| Ok(s.job_counts())).await.unwrap()
}

/// Waits (2 s at most) until the finished statuses are counted too.
async fn wait_counted(e: &SqliteEngine) {
    for _ in 0..100 {
        if counts_of(e).await.len() == JobStatus::ALL.len() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "the finished jobs were never counted: {:?}",
        counts_of(e).await
    );
}

/// True when no job row has the public id `job_id`.
fn stored_has_not(dir: &tempfile::TempDir, job_id: &str) -> bool {
    let conn = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    let n: i64 = conn
        .query_row(
            "SELECT count(*) FROM job_rows WHERE id = ?1",
            [row_of(job_id)],
            |r| r.get(0),
        )
        .unwrap();
    n == 0
}

/// With more delayed jobs than the floor walks (`FLOOR_WALK_MAX`), the
/// lowest row ever delayed stands for them: the floor stays at or below
/// every open job when the lowest delayed one leaves, and rises once the
/// delayed jobs are few enough to walk again.
#[tokio::test]
async fn many_delayed_jobs_hold_the_floor_at_or_below_them() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&dir, quick()).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let delayed = |n: usize| {
        e.submit_action(ActionRequest {
            plan_id: "p".into(),
            inputs: vec![HashMap::new(); n],
            max_attempts: 1,
            run_at_ms: Some(crate::time::now_ms() + 3_600_000),
            ..Default::default()
        })
    };
    // FLOOR_WALK_MAX + 2 delayed jobs (an action has at most 10,000).
    let later = delayed(2).await.unwrap().job_ids;
    let rest = delayed(super::state::FLOOR_WALK_MAX).await.unwrap().job_ids;
    raise_floor(&e).await;
    assert_eq!(stored_floor(&dir), row_of(&later[0]));
    // The lowest delayed job leaves; the floor may not pass the next.
    e.cancel_job(later[0].clone()).await.unwrap();
    raise_floor(&e).await;
    assert_eq!(lowest_open_row(&dir), Some(row_of(&later[1])));
    assert!(stored_floor(&dir) <= row_of(&later[1]));
    // One fewer: few enough to walk, and the floor reaches the lowest.
    e.cancel_job(later[1].clone()).await.unwrap();
    raise_floor(&e).await;
    assert_eq!(stored_floor(&dir), row_of(&rest[0]));
    e.close().await;
}

/// A load while the last one's count is still under way replaces that
/// count: its result, when it comes, is not added, and the counts add up
/// to the table once the new one is done.
#[tokio::test]
async fn a_new_load_replaces_a_count_under_way() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&dir, quick()).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&shared(&e), "w1", &["sort"], 1).await;
    let ids = submit(&shared(&e), "p", 4, 1).await;
    let mut done = 0;
    let mut complete_next = async || {
        let l = w.lease_within(2000).await.unwrap();
        assert_eq!(l.job.job_id, ids[done]);
        e.update_job(w.report(&l, JobStatus::Completed))
            .await
            .unwrap();
        done += 1;
    };
    complete_next().await;
    // A completion between the two loads: their snapshots differ.
    let first = load_with_count_held(&e).await;
    complete_next().await;
    let second = load_with_count_held(&e).await;
    drop(first);
    // The first count may now finish; its result must not count.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        counts_of(&e).await.len(),
        3,
        "the finished jobs are not counted yet"
    );
    complete_next().await;
    drop(second);
    wait_counted(&e).await;
    assert_eq!(counts_of(&e).await[&(JobStatus::Completed as i32)], 3);
    complete_next().await;
    assert_gauge_matches_table(&shared(&e), &dir).await;
    e.close().await;
}

/// SearchJobs for dead jobs of any action reads the index of dead jobs:
/// it finds them across actions and plans in row order, page by page,
/// with the plan and time filters, and a retried one is no longer dead.
#[tokio::test]
async fn dead_jobs_are_searched_across_actions_page_by_page() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&dir, quick()).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    e.submit_plan(plan("q", &["sort"]), false).await.unwrap();
    let mut w = Worker::start(&shared(&e), "w1", &["sort"], 1).await;
    let mut dead = Vec::new();
    for plan_id in ["p", "q", "p"] {
        let ids = submit(&shared(&e), plan_id, 3, 1).await;
        for (j, id) in ids.iter().enumerate() {
            let l = w.lease_within(2000).await.unwrap();
            assert_eq!(&l.job.job_id, id);
            // Jobs 0 and 2 of each action fail for good, job 1 completes.
            let status = if j == 1 {
                JobStatus::Completed
            } else {
                JobStatus::Failed
            };
            e.update_job(w.report(&l, status)).await.unwrap();
            if j != 1 {
                dead.push((plan_id, id.clone()));
            }
        }
    }
    let all = assert_found_across_actions(&e, JobStatus::Dead, &dead).await;
    e.retry_job(all[0].clone(), None).await.unwrap();
    assert_eq!(with_status(&e, JobStatus::Dead).await, all[1..]);
    e.close().await;
}

/// SearchJobs for cancelled jobs of any action reads the index of
/// cancelled rows: it finds them across actions and plans in row order,
/// page by page, with the plan and time filters.
#[tokio::test]
async fn cancelled_jobs_are_searched_across_actions_page_by_page() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&dir, quick()).await;
    e.submit_plan(plan("p", &["sort"]), false).await.unwrap();
    e.submit_plan(plan("q", &["sort"]), false).await.unwrap();
    let mut cancelled = Vec::new();
    for plan_id in ["p", "q", "p"] {
        let ids = submit(&shared(&e), plan_id, 3, 1).await;
        // Jobs 0 and 2 of each action are cancelled, job 1 stays pending.
        for id in [&ids[0], &ids[2]] {
            e.cancel_job(id.clone()).await.unwrap();
            cancelled.push((plan_id, id.clone()));
        }
    }
    let all = assert_found_across_actions(&e, JobStatus::Cancelled, &cancelled).await;
    // Cancelled is final: a retry is refused and the job stays found.
    let e2 = e.retry_job(all[0].clone(), None).await.unwrap_err();
    assert!(
        matches!(e2, crate::error::Error::FailedPrecondition(_)),
        "{e2:?}"
    );
    assert_eq!(with_status(&e, JobStatus::Cancelled).await, all);
    e.close().await;
}

/// Asserts that SearchJobs for `status` without an action finds `want`
/// ((plan, job id) in submission order) across actions and plans: page by
/// page (pages of 2, following their tokens), with the plan filter (plan
/// "q"), and nothing with a creation time far ahead. Returns the job ids.
async fn assert_found_across_actions(
    e: &SqliteEngine,
    status: JobStatus,
    want: &[(&str, String)],
) -> Vec<String> {
    let search = |plan_id: Option<&str>, created_after_ms: Option<i64>, page_token: String| {
        e.search_jobs(JobQuery {
            status: Some(status),
            plan_id: plan_id.map(str::to_string),
            created_after_ms,
            page_size: 2,
            page_token,
            ..Default::default()
        })
    };
    let mut found = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let page = search(None, None, token).await.unwrap();
        assert!(page.items.len() <= 2);
        found.extend(page.items);
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    assert!(token.is_empty(), "more than 10 pages");
    let all: Vec<String> = want.iter().map(|(_, id)| id.clone()).collect();
    assert_eq!(found, all);
    let of_q: Vec<String> = want
        .iter()
        .filter(|(p, _)| *p == "q")
        .map(|(_, id)| id.clone())
        .collect();
    let by_plan = search(Some("q"), None, String::new()).await.unwrap();
    assert_eq!(by_plan.items, of_q);
    let later = search(None, Some(i64::MAX / 2), String::new())
        .await
        .unwrap();
    assert!(later.items.is_empty());
    all
}

/// A CancelAction that storage fails under part-way (a trigger refuses
/// the update of its second job, after the first was cancelled in
/// memory) changes nothing, in memory as on disk: the cancel is refused,
/// and every job of the action is still pending and leased once a worker
/// comes, the first one included.
#[tokio::test]
async fn an_operation_storage_fails_under_part_way_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = open(&dir, quick()).await;
    let e = shared(&sqlite);
    e.submit_plan(plan("p", &["cat"]), false).await.unwrap();
    let ids = submit_as(&e, "a", "p", 3, 1).await;
    let trigger = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    trigger
        .execute_batch(&format!(
            "CREATE TRIGGER refuse_update BEFORE UPDATE ON job_rows WHEN OLD.id = {}
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;",
            row_of(&ids[1])
        ))
        .unwrap();
    let cancelled = e.cancel_action("a".into()).await;
    assert!(
        matches!(cancelled, Err(Error::Storage { .. })),
        "{cancelled:?}"
    );
    trigger.execute_batch("DROP TRIGGER refuse_update").unwrap();
    assert_eq!(with_status(&sqlite, JobStatus::Pending).await.len(), 3);
    let mut w = Worker::start(&e, "w", &["cat"], 3).await;
    assert_leased_all(&mut w, &ids).await;
}

/// Asserts that `w` gets a lease of each of `ids` (1 s at most between
/// two), and of nothing else.
async fn assert_leased_all(w: &mut Worker, ids: &[String]) {
    let mut leased = Vec::new();
    while let Some(l) = w.lease_within(1000).await {
        leased.push(l.job.job_id);
        if leased.len() == ids.len() {
            break;
        }
    }
    leased.sort();
    let mut want = ids.to_vec();
    want.sort();
    assert_eq!(leased, want);
}

/// When the state cannot be read back after such a rollback (here the
/// verifications table is gone while it is read), every operation is
/// refused with `StoreUnavailable`, reads of the state included, until a
/// later read-back succeeds; then the engine serves again, the jobs the
/// failed operation touched still pending and leased.
#[tokio::test]
async fn a_state_that_cannot_be_read_back_refuses_everything_until_it_can() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["cat"]), false).await.unwrap();
    let ids = submit_as(&e, "a", "p", 2, 1).await;
    let db = rusqlite::Connection::open(dir.path().join("agq.db")).unwrap();
    db.execute_batch(&format!(
        "CREATE TRIGGER refuse_update BEFORE UPDATE ON job_rows WHEN OLD.id = {}
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;
         ALTER TABLE worker_verifications RENAME TO hidden_verifications;",
        row_of(&ids[1])
    ))
    .unwrap();
    let cancelled = e.cancel_action("a".into()).await;
    assert!(
        matches!(cancelled, Err(Error::Storage { .. })),
        "{cancelled:?}"
    );
    for _ in 0..3 {
        let read = e.list_workers(None).await;
        assert!(matches!(read, Err(Error::StoreUnavailable(_))), "{read:?}");
        let write = e.cancel_job(ids[0].clone()).await;
        assert!(
            matches!(write, Err(Error::StoreUnavailable(_))),
            "{write:?}"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    db.execute_batch(
        "DROP TRIGGER refuse_update;
         ALTER TABLE hidden_verifications RENAME TO worker_verifications;",
    )
    .unwrap();
    let mut served = false;
    for _ in 0..300 {
        if e.list_workers(None).await.is_ok() && e.queue_stats().await.is_ok() {
            match e
                .register_worker(Registration {
                    worker_id: "probe".into(),
                    hostname: "h".into(),
                    agw_version: "t".into(),
                    max_concurrent_jobs: 1,
                    ..Default::default()
                })
                .await
            {
                Ok(_) => {
                    served = true;
                    break;
                }
                Err(Error::StoreUnavailable(_)) => {}
                Err(other) => panic!("{other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(served, "the engine never served again");
    let mut w = Worker::start(&e, "w", &["cat"], 2).await;
    assert_leased_all(&mut w, &ids).await;
}

/// An action retention has partly deleted (a large action goes over
/// several batches) cannot be reopened: RetryJob and RetryAction on a job
/// it has not deleted yet are `FailedPrecondition` and change nothing,
/// and the next batch deletes the rest.
#[tokio::test]
async fn an_action_retention_is_deleting_cannot_be_retried() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&dir, quick()).await;
    let se = shared(&e);
    se.submit_plan(plan("p", &["cat"]), false).await.unwrap();
    let ids = submit_as(&se, "a", "p", 5, 1).await;
    let mut w = Worker::start(&se, "w", &["cat"], 5).await;
    for _ in 0..ids.len() {
        let l = w.lease_within(2000).await.expect("lease");
        let status = se
            .update_job(w.report(&l, JobStatus::Failed))
            .await
            .unwrap();
        assert_eq!(status, JobStatus::Dead);
    }
    let removed = e
        .writer
        .write(|s, c| s.expire_finished(c, i64::MAX, 2))
        .await
        .unwrap();
    assert_eq!(removed, 2);
    let job = se.retry_job(ids[4].clone(), None).await;
    assert!(matches!(job, Err(Error::FailedPrecondition(_))), "{job:?}");
    let action = se.retry_action("a".into(), None).await;
    assert!(
        matches!(action, Err(Error::FailedPrecondition(_))),
        "{action:?}"
    );
    assert_eq!(with_status(&e, JobStatus::Dead).await.len(), 3);
    assert!(w.lease_within(300).await.is_none());
    let removed = e
        .writer
        .write(|s, c| s.expire_finished(c, i64::MAX, 100))
        .await
        .unwrap();
    assert_eq!(removed, 4, "three jobs and the action row");
    wait_all_deleted(&dir).await;
}

/// A lease sent on a lease stream that died without the server noticing
/// (the worker's connection broke; the stream still looks open) is kept
/// as in flight when the worker reconnects without listing it, and sent
/// again on the worker's new lease stream: the same lease, no attempt
/// lost. The lease the worker listed as held is not sent again.
#[tokio::test]
async fn a_lease_in_flight_on_a_stream_that_died_unnoticed_goes_on_the_next_stream() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&dir).await;
    e.submit_plan(plan("p", &["cat"]), false).await.unwrap();
    let mut w = Worker::start(&e, "w", &["cat"], 2).await;
    submit(&e, "p", 2, 1).await;
    let running = w.lease_within(1000).await.expect("a lease");
    let unread = w.lease_within(1000).await.expect("a second lease");
    // The worker runs `running`; `unread` never reached it. It reconnects
    // on a new connection while its old lease stream still looks open.
    let (htx, _commands) = mpsc::unbounded_channel();
    e.open_heartbeat("w".into(), htx).await.unwrap();
    let reply = e
        .heartbeat("w".into(), None, Some(vec![running.lease_id.clone()]))
        .await
        .unwrap();
    assert!(reply.revoked_leases.is_empty(), "{reply:?}");
    let (ltx, mut leases) = mpsc::unbounded_channel();
    e.open_lease_stream("w".into(), ltx).await.unwrap();
    let again = tokio::time::timeout(Duration::from_secs(1), leases.recv())
        .await
        .ok()
        .flatten()
        .expect("the unread lease, sent again on the new stream");
    assert_eq!(
        (&again.lease_id, &again.job.job_id, again.attempt),
        (&unread.lease_id, &unread.job.job_id, 1)
    );
    assert_eq!(again.job.status, JobStatus::Running);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), leases.recv())
            .await
            .is_err(),
        "the held lease was sent again"
    );
    for lease in [&again, &running] {
        let status = e
            .update_job(w.report(lease, JobStatus::Completed))
            .await
            .unwrap();
        assert_eq!(status, JobStatus::Completed);
    }
}

/// A stream that closes while the store cannot commit is let go at once
/// (letting it go needs no commit): the worker shows as disconnected, not
/// connected to a dead heartbeat stream until its heartbeats go stale.
#[tokio::test]
async fn a_stream_closed_while_the_store_cannot_commit_is_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = open(
        &dir,
        EngineConfig {
            heartbeat_interval: Duration::from_secs(10),
            lease_grace: Duration::from_secs(60),
            ..quick()
        },
    )
    .await;
    let e = shared(&sqlite);
    e.register_worker(Registration {
        worker_id: "w".into(),
        hostname: "h".into(),
        agw_version: "t".into(),
        max_concurrent_jobs: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let (htx, commands) = mpsc::unbounded_channel();
    let beats = e.open_heartbeat("w".into(), htx).await.unwrap();
    let (ltx, _leases) = mpsc::unbounded_channel();
    e.open_lease_stream("w".into(), ltx).await.unwrap();
    assert!(e.get_worker("w".into()).await.unwrap().connected);
    // Queued behind a busy writer, in this order: an operation storage
    // fails under ("disk full"), which rolls its batch back and leaves
    // the store refusing writes; the heartbeat stream's end (its
    // receiver dropped on the writer thread, after the rollback); and
    // the stream's close event, which thus runs while writes are refused.
    let hold = hold_writer(&sqlite, Duration::from_millis(300));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let broken = break_with_disk_full(&sqlite);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ender = sqlite.writer.clone();
    let ended = tokio::spawn(async move {
        ender
            .run(move |_, _| {
                drop(commands);
                Ok(())
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    e.close_stream("w".into(), StreamKind::Heartbeat, beats);
    hold.await.unwrap().unwrap();
    let broken = broken.await.unwrap();
    assert!(
        broken.as_ref().is_err_and(|e| e.store_fault().is_some()),
        "{broken:?}"
    );
    ended.await.unwrap().unwrap();
    let w = e.get_worker("w".into()).await.unwrap();
    assert!(!w.connected, "{w:?}");
}

/// A heartbeat that shares its batch with an operation storage breaks
/// ("disk full") is still answered: freshness lives in memory and
/// outlives the rollback, and an error would end the worker's heartbeat
/// stream, leaving it unable to reconnect (registering is a write) until
/// the store commits again.
#[tokio::test]
async fn a_heartbeat_in_a_batch_that_fails_to_commit_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = open(&dir, quick()).await;
    let e = shared(&sqlite);
    let _w = Worker::start(&e, "w", &["cat"], 1).await;
    let hold = hold_writer(&sqlite, Duration::from_millis(200));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let beater = e.clone();
    let beat = tokio::spawn(async move { beater.heartbeat("w".into(), None, None).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let broken = break_with_disk_full(&sqlite).await.unwrap();
    assert!(
        broken.as_ref().is_err_and(|e| e.store_fault().is_some()),
        "{broken:?}"
    );
    hold.await.unwrap().unwrap();
    let beat = beat.await.unwrap();
    assert!(beat.is_ok(), "{beat:?}");
}

/// Keeps `e`'s writer busy for `busy` in an operation of its own, so the
/// operations queued meanwhile go into the next batch together.
fn hold_writer(
    e: &SqliteEngine,
    busy: Duration,
) -> tokio::task::JoinHandle<crate::error::Result<()>> {
    let w = e.writer.clone();
    tokio::spawn(async move {
        w.write(move |_, _| {
            std::thread::sleep(busy);
            Ok(())
        })
        .await
    })
}

/// Queues on `e`'s writer an operation that storage breaks as a full
/// disk would: its batch rolls back and the store refuses writes until a
/// probe commits.
fn break_with_disk_full(e: &SqliteEngine) -> tokio::task::JoinHandle<crate::error::Result<()>> {
    let w = e.writer.clone();
    tokio::spawn(async move {
        w.write_direct(|_, _| -> crate::error::Result<()> {
            Err(Error::from(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
                None,
            )))
        })
        .await
    })
}
