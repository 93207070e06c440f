//! Hung workers are quarantined: a worker whose leases hit the job timeout
//! K times within the window, while it keeps heartbeating, gets no new
//! lease, is listed as QUARANTINED with a reason, is counted in the
//! metrics, stays quarantined when it registers again, and takes work again
//! once an admin releases it (ForgetWorker, which a worker token may call,
//! cannot end it). A task longer than the job timeout is refused at plan
//! submit.

mod common;

use std::time::Duration;

use agq::{
    auth::{AuthFile, Authenticator, Role, TokenEntry},
    config::EngineConfig,
    pb::{
        self, ForgetWorkerRequest, JobStatus, ReleaseWorkerRequest, SubmitPlanRequest,
        UnregisterWorkerRequest, WorkerState,
    },
};
use common::{
    eventually, fast_config, job, metric, plan, store_tests, submit, worker, Backing, SimWorker,
    TestServer, TestStore,
};
use tonic::Code;

store_tests! {
    a_worker_whose_leases_time_out_is_quarantined_until_released,
    only_an_admin_releases_and_zero_never_quarantines,
    a_plan_whose_tasks_may_outlive_the_job_timeout_is_refused,
    forgetting_a_quarantined_worker_is_refused_until_it_is_released,
    a_quarantined_worker_outlives_the_departed_retention,
    leases_that_expired_while_the_server_was_down_quarantine_no_one,
}

/// A 1 s job timeout and quarantine after 2 timeouts within an hour.
fn cfg() -> EngineConfig {
    EngineConfig {
        job_timeout: Duration::from_secs(1),
        quarantine_after_timeouts: 2,
        quarantine_window: Duration::from_secs(3600),
        ..fast_config()
    }
}

/// A one-task plan whose task may run 1 s (the job timeout).
fn short_plan(id: &str) -> pb::Plan {
    let mut p = plan(id, &["sleep"]);
    p.tasks[0].timeout_secs = 1;
    p
}

async fn a_worker_whose_leases_time_out_is_quarantined_until_released(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg()).await;
    let (_, ids) = submit(&s, short_plan("hang"), 3, 5).await;
    let mut hung = SimWorker::start(&s, "w-hung", &["sleep"], 1).await;
    hang_until_quarantined(&s, &mut hung).await;
    let w = worker(&s, "w-hung").await;
    assert!(w.fresh, "it kept heartbeating: hung, not gone");
    assert!(
        w.quarantine_reason
            .starts_with("2 leases hit the job timeout (1 s) within 3600 s"),
        "{}",
        w.quarantine_reason
    );
    let listed = s
        .workers()
        .await
        .list_workers(pb::ListWorkersRequest {
            state: WorkerState::Quarantined as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(listed.len(), 1);
    assert_eq!(metric(&s, "agq_worker_quarantines_total").await, 1.0);

    // No new lease while quarantined, though jobs are ready.
    assert!(
        hung.lease_within(1_500).await.is_none(),
        "a quarantined worker gets no lease"
    );
    let waiting = job(&s, &ids[0]).await;
    assert_eq!(waiting.status, JobStatus::Pending as i32);
    assert!(
        waiting
            .waiting_reason
            .contains("1 worker(s) that could are quarantined"),
        "{}",
        waiting.waiting_reason
    );

    // Going away and registering again does not end it.
    hung.disconnect();
    eventually(10, "stale, then DEAD", || async {
        worker(&s, "w-hung").await.state == WorkerState::Dead as i32
    })
    .await;
    assert!(!worker(&s, "w-hung").await.quarantine_reason.is_empty());
    let mut again = SimWorker::start(&s, "w-hung", &["sleep"], 1).await;
    assert_eq!(
        worker(&s, "w-hung").await.state,
        WorkerState::Quarantined as i32,
        "the quarantine survives a re-registration"
    );
    assert!(again.lease_within(800).await.is_none());

    // Released, it is ACTIVE and takes work again.
    let released = s
        .workers()
        .await
        .release_worker(ReleaseWorkerRequest {
            worker_id: "w-hung".into(),
        })
        .await
        .expect("release")
        .into_inner()
        .worker
        .unwrap();
    assert_eq!(released.state, WorkerState::Active as i32);
    assert!(released.quarantine_reason.is_empty());
    let lease = again.lease_within(5_000).await.expect("leases again");
    again.complete(&lease).await;

    // Releasing a worker that is not quarantined changes nothing.
    let err = s
        .workers()
        .await
        .release_worker(ReleaseWorkerRequest {
            worker_id: "w-hung".into(),
        })
        .await
        .expect_err("not quarantined");
    assert_eq!(err.code(), Code::FailedPrecondition);
    let err = s
        .workers()
        .await
        .release_worker(ReleaseWorkerRequest {
            worker_id: "nobody".into(),
        })
        .await
        .expect_err("unknown");
    assert_eq!(err.code(), Code::NotFound);
    s.stop().await;
}

async fn only_an_admin_releases_and_zero_never_quarantines(store: TestStore) {
    let tokens = |t: &str, role| TokenEntry {
        token: t.into(),
        role,
        worker_id: None,
        worker_id_prefix: None,
    };
    let mut worker_token = tokens("worker-token-0123456789", Role::Worker);
    worker_token.worker_id = Some("w1".into());
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                tokens("admin-token-0123456789", Role::Admin),
                tokens("client-token-0123456789", Role::Client),
                worker_token,
            ],
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backing = Backing::new(store, &dir.path().join("agq.db")).await;
    let s = TestServer::start_on_with(&backing, cfg(), auth, None).await;
    for (token, code) in [
        (None, Code::Unauthenticated),
        (Some("client-token-0123456789"), Code::PermissionDenied),
        (Some("worker-token-0123456789"), Code::PermissionDenied),
        (Some("admin-token-0123456789"), Code::NotFound),
    ] {
        let mut c = pb::worker_service_client::WorkerServiceClient::with_interceptor(
            s.channel().await,
            common::Bearer(token.map(Into::into)),
        );
        let err = c
            .release_worker(ReleaseWorkerRequest {
                worker_id: "w1".into(),
            })
            .await
            .expect_err("refused");
        assert_eq!(err.code(), code, "{token:?}: {err:?}");
    }
    s.stop().await;

    // quarantine_after_timeouts = 0: timeouts are retried, never quarantine.
    let dir = tempfile::tempdir().unwrap();
    let off = EngineConfig {
        quarantine_after_timeouts: 0,
        ..cfg()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), off).await;
    submit(&s, short_plan("hang"), 3, 5).await;
    let mut w = SimWorker::start(&s, "w-slow", &["sleep"], 1).await;
    for _ in 0..3 {
        w.lease_within(5_000).await.expect("leased again and again");
    }
    assert_eq!(worker(&s, "w-slow").await.state, WorkerState::Active as i32);
    s.stop().await;
}

async fn a_plan_whose_tasks_may_outlive_the_job_timeout_is_refused(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg()).await;
    let mut p = short_plan("long");
    p.tasks[0].timeout_secs = 2;
    let err = s
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .expect_err("2 s task, 1 s job timeout");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message()
            .contains("longer than the server's job timeout (1 s"),
        "{err:?}"
    );
    // Each task within the job timeout, their sum past it: a run within
    // them could outlive its lease.
    let mut p = short_plan("long");
    p.tasks = vec![p.tasks[0].clone(), p.tasks[0].clone()];
    p.tasks[1].task_number = 2;
    for t in &mut p.tasks {
        t.timeout_secs = 1;
    }
    let err = s
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .expect_err("two 1 s tasks, 1 s job timeout");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("add up to 2 s"), "{err:?}");
    let stored = s
        .plans()
        .await
        .get_plan(pb::GetPlanRequest {
            plan_id: "long".into(),
            version: 0,
        })
        .await
        .expect_err("nothing stored");
    assert_eq!(stored.code(), Code::NotFound);
    s.stop().await;
}

/// Unregisters `id` and forgets it (both calls a worker token bound to
/// `id` may make); returns ForgetWorker's answer.
async fn unregister_and_forget(s: &TestServer, id: &str) -> Result<(), tonic::Status> {
    let mut c = s.workers().await;
    c.unregister_worker(UnregisterWorkerRequest {
        worker_id: id.into(),
    })
    .await
    .expect("unregister");
    c.forget_worker(ForgetWorkerRequest {
        worker_id: id.into(),
    })
    .await
    .map(|_| ())
}

/// A server down past its leases' expiry does not take its workers for
/// hung: they could not heartbeat while it was down. After the restart no
/// worker is quarantined for those leases. With SQLite, which restarts
/// the whole queue, a lease still expires no sooner than the grace period
/// after the start, so a worker that finished its job during the outage
/// reports it and the result counts. (On PostgreSQL the leases get the
/// grace when every replica was down, as here: tests/cluster_db_outage.rs
/// shows the report counting.)
async fn leases_that_expired_while_the_server_was_down_quarantine_no_one(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    // A job timeout of 2 s: the first server stops well before the leases
    // expire, while the worker is still connected.
    let cfg = EngineConfig {
        heartbeat_interval: Duration::from_millis(500),
        lease_grace: Duration::from_secs(3),
        job_timeout: Duration::from_secs(2),
        ..cfg()
    };
    let backing = Backing::new(store, &dir.path().join("agq.db")).await;
    let s = TestServer::start_on(&backing, cfg.clone()).await;
    let (_, ids) = submit(&s, short_plan("outage"), 2, 5).await;
    let mut w = SimWorker::start(&s, "w-outage", &["sleep"], 2).await;
    let first = w.lease().await;
    let second = w.lease().await;
    let expires = [&first, &second]
        .iter()
        .map(|l| l.expires_at.as_ref().expect("an expiry").seconds)
        .max()
        .unwrap();
    w.disconnect();
    s.stop().await;
    // Down until both leases expired.
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    };
    while now() <= expires + 1 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let s = TestServer::start_on(&backing, cfg).await;
    if store == TestStore::Sqlite {
        let job_id = first.job.as_ref().unwrap().job_id.clone();
        s.workers()
            .await
            .update_job(pb::UpdateJobRequest {
                job_id: job_id.clone(),
                worker_id: "w-outage".into(),
                lease_id: first.lease_id.clone(),
                status: JobStatus::Completed as i32,
                ..Default::default()
            })
            .await
            .expect("a result finished during the outage counts");
        assert_eq!(job(&s, &job_id).await.status, JobStatus::Completed as i32);
    }
    // Several reaper passes: the expiries, then the grace running out.
    tokio::time::sleep(Duration::from_millis(3_600)).await;
    let w = worker(&s, "w-outage").await;
    assert_ne!(
        w.state,
        WorkerState::Quarantined as i32,
        "quarantined for leases it could not report on: {}",
        w.quarantine_reason
    );
    assert!(w.quarantine_reason.is_empty(), "{w:?}");
    assert!(ids.contains(&first.job.unwrap().job_id));
    s.stop().await;
}

/// `hung` (worker `w-hung`, one slot) takes a lease and never reports:
/// the lease times out, the job is retried, and it takes the next one (it
/// still heartbeats). That one times out too, and it is quarantined.
async fn hang_until_quarantined(s: &TestServer, hung: &mut SimWorker) {
    let first = hung.lease().await;
    // Maintenance judges lease expiry once the restart grace after its
    // start has passed (up to 6 s with a 2 s heartbeat interval).
    let second = hung.lease_within(15_000).await.expect("a second lease");
    assert_ne!(first.lease_id, second.lease_id);
    eventually(15, "quarantined after 2 timeouts", || async {
        worker(s, "w-hung").await.state == WorkerState::Quarantined as i32
    })
    .await;
}

/// Quarantines worker `w-hung` of `s`: two of its leases of a hanging
/// plan time out; then it disconnects. Returns its quarantine reason.
async fn quarantine_hung_worker(s: &TestServer) -> String {
    submit(s, short_plan("hang"), 3, 5).await;
    let mut hung = SimWorker::start(s, "w-hung", &["sleep"], 1).await;
    hang_until_quarantined(s, &mut hung).await;
    hung.disconnect();
    worker(s, "w-hung").await.quarantine_reason
}

/// ForgetWorker takes the worker's own token, ReleaseWorker an admin's: a
/// quarantined worker that unregistered cannot forget its record (and so
/// its quarantine) and come back ACTIVE. The refusal changes nothing, in
/// memory as on disk; once an admin releases it, it can be forgotten.
async fn forgetting_a_quarantined_worker_is_refused_until_it_is_released(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let backing = Backing::new(store, &dir.path().join("agq.db")).await;
    let s = TestServer::start_on(&backing, cfg()).await;
    let reason = quarantine_hung_worker(&s).await;

    let err = unregister_and_forget(&s, "w-hung")
        .await
        .expect_err("a quarantined worker is not forgotten");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("quarantined"), "{err:?}");
    let w = worker(&s, "w-hung").await;
    assert_eq!(w.state, WorkerState::Unregistered as i32);
    assert_eq!(w.quarantine_reason, reason, "the record is kept whole");

    // Nor on disk: after a restart it registers QUARANTINED.
    s.stop().await;
    let s = TestServer::start_on(&backing, cfg()).await;
    assert_eq!(worker(&s, "w-hung").await.quarantine_reason, reason);
    let mut again = SimWorker::start(&s, "w-hung", &["sleep"], 1).await;
    assert_eq!(
        worker(&s, "w-hung").await.state,
        WorkerState::Quarantined as i32,
        "still quarantined after the refused forget"
    );
    assert!(again.lease_within(800).await.is_none());
    again.disconnect();

    // Released by an admin, it can be forgotten.
    s.workers()
        .await
        .release_worker(ReleaseWorkerRequest {
            worker_id: "w-hung".into(),
        })
        .await
        .expect("release");
    unregister_and_forget(&s, "w-hung")
        .await
        .expect("a released worker is forgotten");
    let err = s
        .workers()
        .await
        .get_worker(pb::GetWorkerRequest {
            worker_id: "w-hung".into(),
        })
        .await
        .expect_err("forgotten");
    assert_eq!(err.code(), Code::NotFound);
    s.stop().await;
}

/// The 24 hours departed workers stay listed do not end a quarantine
/// either: retention forgets a departed worker's record, but keeps one
/// whose quarantine holds (only an admin ends it).
async fn a_quarantined_worker_outlives_the_departed_retention(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let backing = Backing::new(store, &dir.path().join("agq.db")).await;
    let s = TestServer::start_on(&backing, cfg()).await;
    quarantine_hung_worker(&s).await;
    // A departed worker beside it, which retention does forget.
    let mut gone = SimWorker::start(&s, "w-gone", &["other"], 1).await;
    gone.disconnect();
    let mut c = s.workers().await;
    for id in ["w-hung", "w-gone"] {
        c.unregister_worker(UnregisterWorkerRequest {
            worker_id: id.into(),
        })
        .await
        .expect("unregister");
    }
    // Both last heard of long ago, as read at the next start.
    s.stop().await;
    let s = TestServer::start_on(&backing, cfg()).await;
    s.exec_sql(
        "UPDATE workers SET last_heartbeat_at_ms = 1000 \
         WHERE worker_id IN ('w-hung', 'w-gone')",
    )
    .await;
    s.stop().await;
    let s = TestServer::start_on(&backing, cfg()).await;
    eventually(10, "retention forgets w-gone", || async {
        s.workers()
            .await
            .get_worker(pb::GetWorkerRequest {
                worker_id: "w-gone".into(),
            })
            .await
            .is_err_and(|e| e.code() == Code::NotFound)
    })
    .await;
    assert!(
        !worker(&s, "w-hung").await.quarantine_reason.is_empty(),
        "the quarantined record is kept"
    );
    let mut again = SimWorker::start(&s, "w-hung", &["sleep"], 1).await;
    assert_eq!(
        worker(&s, "w-hung").await.state,
        WorkerState::Quarantined as i32,
        "still quarantined past the retention"
    );
    assert!(again.lease_within(800).await.is_none());
    again.disconnect();
    s.stop().await;
}

/// PostgreSQL only: the quarantine commits with the lease timeout that
/// causes it. Were it a transaction of its own, a dispatch round between
/// the two would see the worker ACTIVE with the slot the expiry just
/// freed, and lease it the retried job again. A statement trigger stalls
/// the update that counts a timeout by 1.5 s before it locks the row,
/// which holds such a window open far longer than the retry's backoff
/// and the dispatcher's poll.
#[tokio::test]
async fn postgres_the_quarantine_commits_with_the_timeout_that_causes_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        // Stale after 6 s: a heartbeat waiting for the stalled sweep's
        // lock on the worker stays fresh.
        heartbeat_interval: Duration::from_secs(2),
        ..cfg()
    };
    let s = TestServer::start_store(TestStore::Postgres, &dir.path().join("agq.db"), cfg).await;
    let (_, ids) = submit(&s, short_plan("hang"), 3, 5).await;
    let mut hung = SimWorker::start(&s, "w-hung", &["sleep"], 1).await;
    s.exec_sql(
        "CREATE FUNCTION stall() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN
                 IF current_query() LIKE '%array_append%' THEN PERFORM pg_sleep(1.5); END IF;
                 RETURN NULL;
             END $$;
         CREATE TRIGGER stall_timeout_count BEFORE UPDATE OF timeouts_ms ON workers
             FOR EACH STATEMENT EXECUTE FUNCTION stall();",
    )
    .await;
    hang_until_quarantined(&s, &mut hung).await;
    assert!(
        hung.lease_within(2_000).await.is_none(),
        "the hung worker was leased the job its second timeout retried"
    );
    // Nor is a lease recorded for it that the stream did not deliver.
    for id in &ids {
        assert_ne!(job(&s, id).await.status, JobStatus::Running as i32, "{id}");
    }
}
