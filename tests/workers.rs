//! Worker coordination with simulated workers and short intervals
//! (heartbeat 200 ms, stale after 600 ms, grace 400 ms): capability
//! routing, least-loaded choice, slots, freshness, fencing, grace,
//! reconnects, max attempts, drain, cancel and server restarts. Every test
//! ends by checking that no running job is stranded.
//! Each test runs on SQLite and on PostgreSQL (`sqlite::` and `postgres::`).

mod common;

use std::time::Duration;

use agq::pb::*;
use common::*;
use tonic::Code;

// Every test runs on both stores: `sqlite::NAME` and `postgres::NAME`.
store_tests! {
    capability_routing_and_waiting_reason,
    least_loaded_and_max_concurrent_jobs,
    a_worker_that_stops_heartbeating_gets_no_new_lease,
    frozen_worker_loses_its_lease_and_fencing_rejects_its_late_report,
    dropped_worker_job_is_re_leased_after_the_grace,
    a_worker_that_reconnects_within_the_grace_keeps_its_leases,
    max_attempts_then_dead,
    drain_keeps_leases_but_gives_no_new_ones,
    cancel_of_a_running_job_reaches_the_worker,
    registration_rules_and_heartbeat_errors,
    server_restart_mid_lease_strands_nothing,
    a_worker_that_registers_and_never_heartbeats_strands_nothing,
    batch_update_jobs_applies_each_report_on_its_own,
    report_jobs_answers_each_request_in_order,
    report_jobs_ends_without_an_error_when_the_server_stops,
    agw_reporter_streams_reports,
    a_lease_carries_the_job_as_stored,
    task_results_are_replaced_by_the_next_report,
    a_worker_that_does_not_read_its_heartbeat_replies_is_not_read_either,
    a_stalled_heartbeat_stream_that_goes_away_is_closed,
    a_replaced_heartbeat_stream_ends,
    a_replaced_lease_stream_drops_the_leases_it_buffered,
    progress_reports_are_bounded,
    a_reconnecting_worker_is_told_which_held_leases_were_revoked,
    a_worker_whose_heartbeat_stream_dropped_gets_no_lease,
    a_worker_drained_without_a_heartbeat_stream_is_told_when_it_opens_one,
    a_lease_in_flight_on_a_lost_stream_goes_again_on_the_next_one,
    workers_are_listed_a_page_at_a_time,
}

/// A worker may describe 256 agentic units of 4 KiB each: ListWorkers
/// pages end at 3 MiB (what a client takes by default is 4 MiB), or at
/// page_size workers, by id; a token belongs to its state's listing.
async fn workers_are_listed_a_page_at_a_time(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    // The workers never beat: a long interval keeps them ACTIVE throughout.
    let cfg = agq::config::EngineConfig {
        heartbeat_interval: Duration::from_secs(60),
        ..fast_config()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    let mut c = s.workers().await;
    for i in 0..5 {
        c.register_worker(RegisterWorkerRequest {
            worker_id: format!("w{i}"),
            hostname: "h".into(),
            agw_version: "1".into(),
            capabilities: Some(WorkerCapabilities {
                units: (0..256)
                    .map(|u| AgenticUnit {
                        name: format!("unit{u}"),
                        description: "d".repeat(4096),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("register");
    }
    assert_eq!(
        worker_pages(&c, 0, 0).await,
        [vec!["w0", "w1"], vec!["w2", "w3"], vec!["w4"]],
        "about 1 MiB each: two a page"
    );
    assert_eq!(worker_pages(&c, 1, 0).await.len(), 5);
    let active = WorkerState::Active as i32;
    assert_eq!(worker_pages(&c, 0, active).await.concat().len(), 5);
    let first = c
        .list_workers(ListWorkersRequest {
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let e = c
        .list_workers(ListWorkersRequest {
            state: active,
            page_size: 1,
            page_token: first.next_page_token,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = c
        .list_workers(ListWorkersRequest {
            page_size: 1001,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    s.stop().await;
}

/// The worker ids of every page of ListWorkers (10 pages at most).
async fn worker_pages(
    c: &worker_service_client::WorkerServiceClient<tonic::transport::Channel>,
    page_size: u32,
    state: i32,
) -> Vec<Vec<String>> {
    let mut c = c.clone();
    let mut pages = Vec::new();
    let mut page_token = String::new();
    for _ in 0..10 {
        let page = c
            .list_workers(ListWorkersRequest {
                state,
                page_size,
                page_token,
            })
            .await
            .expect("a page fits a client's default limit")
            .into_inner();
        pages.push(page.workers.into_iter().map(|w| w.worker_id).collect());
        page_token = page.next_page_token;
        if page_token.is_empty() {
            break;
        }
    }
    pages
}

async fn capability_routing_and_waiting_reason(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("needs-jq", &["cat", "jq"]), 1, 3).await;
    let mut plain = SimWorker::start(&s, "plain", &["cat", "sort"], 4).await;
    assert!(
        plain.lease_within(400).await.is_none(),
        "a worker without jq got the job"
    );
    let j = job(&s, &ids[0]).await;
    assert_eq!(j.status, JobStatus::Pending as i32);
    assert!(
        j.waiting_reason
            .contains("no fresh worker has tools [cat, jq]"),
        "{}",
        j.waiting_reason
    );

    let mut capable = SimWorker::start(&s, "capable", &["cat", "jq"], 1).await;
    let l = capable.lease().await;
    assert_eq!(l.job.as_ref().unwrap().job_id, ids[0]);
    assert_eq!(l.plan.as_ref().unwrap().plan_id, "needs-jq");
    assert_eq!(l.attempt, 1);
    // the only capable worker is busy now
    let (_, more) = submit(&s, plan("needs-jq", &["cat", "jq"]), 1, 3).await;
    let j = job(&s, &more[0]).await;
    assert!(
        j.waiting_reason.contains("all 1 capable workers are busy"),
        "{}",
        j.waiting_reason
    );
    capable.complete(&l).await;
    let l2 = capable.lease().await;
    assert_eq!(l2.job.as_ref().unwrap().job_id, more[0]);
    capable.complete(&l2).await;
    assert!(plain.lease_within(100).await.is_none());
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn least_loaded_and_max_concurrent_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut a = SimWorker::start(&s, "a", &["cat"], 3).await;
    let mut b = SimWorker::start(&s, "b", &["cat"], 3).await;
    // 4 jobs over 6 slots: least loaded spreads them 2 and 2 (filling the
    // first worker would give 3 and 1)
    let (_, ids) = submit(&s, plan("p", &["cat"]), 4, 3).await;
    let mut la = vec![a.lease().await, a.lease().await];
    let mut lb = vec![b.lease().await, b.lease().await];
    assert!(
        a.lease_within(300).await.is_none(),
        "a got more than its share"
    );
    assert!(
        b.lease_within(10).await.is_none(),
        "b got more than its share"
    );
    let mut leased: Vec<String> = la
        .iter()
        .chain(lb.iter())
        .map(|l| l.job.as_ref().unwrap().job_id.clone())
        .collect();
    leased.sort();
    let mut all = ids.clone();
    all.sort();
    assert_eq!(leased, all);
    // 4 more jobs, 2 free slots: max_concurrent_jobs holds, 2 stay pending
    let (_, more) = submit(&s, plan("p", &["cat"]), 4, 3).await;
    la.push(a.lease().await);
    lb.push(b.lease().await);
    assert!(
        a.lease_within(300).await.is_none(),
        "a exceeded max_concurrent_jobs"
    );
    assert!(
        b.lease_within(10).await.is_none(),
        "b exceeded max_concurrent_jobs"
    );
    assert_eq!(worker(&s, "a").await.active_leases, 3);
    // FIFO: the two oldest of the new jobs went out
    let mut got: Vec<String> = [&la[2], &lb[2]]
        .iter()
        .map(|l| l.job.as_ref().unwrap().job_id.clone())
        .collect();
    got.sort();
    let mut first2 = more[..2].to_vec();
    first2.sort();
    assert_eq!(got, first2);
    // a frees a slot and gets the next job in line
    a.complete(&la.remove(0)).await;
    let next = a.lease().await;
    assert_eq!(next.job.as_ref().unwrap().job_id, more[2]);
    la.push(next);
    // a third, idle worker is the least loaded and gets the last job
    let mut c = SimWorker::start(&s, "c", &["cat"], 2).await;
    let l = c.lease().await;
    assert_eq!(l.job.as_ref().unwrap().job_id, more[3]);
    for (w, ls) in [(&mut a, la), (&mut b, lb), (&mut c, vec![l])] {
        for l in ls {
            w.complete(&l).await;
        }
    }
    let st = s
        .queue()
        .await
        .get_queue_stats(GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    // All three run nothing now: idle, and not counted as active.
    assert_eq!(
        (st.workers_total, st.workers_active, st.workers_idle),
        (3, 0, 3)
    );
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn a_worker_that_stops_heartbeating_gets_no_new_lease(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut w = SimWorker::start(&s, "frozen", &["cat"], 4).await;
    w.freeze(); // lease stream stays open, heartbeats stop
    tokio::time::sleep(Duration::from_millis(700)).await; // > 3 x 200 ms
    let (_, ids) = submit(&s, plan("p", &["cat"]), 1, 3).await;
    assert!(
        w.lease_within(500).await.is_none(),
        "a stale worker got a lease"
    );
    let j = job(&s, &ids[0]).await;
    assert!(
        j.waiting_reason.contains("no fresh worker"),
        "{}",
        j.waiting_reason
    );
    let v = worker(&s, "frozen").await;
    assert!(!v.fresh);
    assert_eq!(
        v.state,
        WorkerState::Dead as i32,
        "the reaper marks it DEAD"
    );
    // a fresh worker takes it
    let mut ok = SimWorker::start(&s, "alive", &["cat"], 1).await;
    let l = ok.lease().await;
    ok.complete(&l).await;
    // a DEAD worker's heartbeat is refused until it registers again
    let e = s
        .workers()
        .await
        .lease_jobs(LeaseJobsRequest {
            worker_id: "frozen".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn frozen_worker_loses_its_lease_and_fencing_rejects_its_late_report(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 1, 3).await;
    let mut old = SimWorker::start(&s, "old", &["cat"], 1).await;
    let stale = old.lease().await;
    old.freeze();
    let mut new = SimWorker::start(&s, "new", &["cat"], 1).await;
    let fresh = new.lease().await; // after 3 x interval + backoff
    assert_eq!(fresh.job.as_ref().unwrap().job_id, ids[0]);
    assert_eq!(fresh.attempt, 2, "the lost lease counted as an attempt");
    assert_ne!(fresh.lease_id, stale.lease_id);
    // the old holder wakes up and reports: rejected
    let e = old.report(&stale, JobStatus::Completed).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
    // same worker id, stale lease id: FAILED_PRECONDITION
    let mut forged = stale.clone();
    forged.lease_id = "00000000-0000-0000-0000-000000000000".into();
    let e = new.report(&forged, JobStatus::Completed).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    new.complete(&fresh).await;
    let j = job(&s, &ids[0]).await;
    assert_eq!(
        (j.status, j.worker_id.as_str()),
        (JobStatus::Completed as i32, "new")
    );
    // a completed job stays completed whatever arrives later
    let e = new.report(&fresh, JobStatus::Failed).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(job(&s, &ids[0]).await.status, JobStatus::Completed as i32);
    let m = s
        .queue()
        .await
        .get_metrics(GetMetricsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .body;
    assert!(
        m.contains("agq_requeues_total{reason=\"stale_heartbeat\"} 1"),
        "{m}"
    );
    assert!(m.contains("agq_fencing_rejections_total 3"), "{m}");
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn dropped_worker_job_is_re_leased_after_the_grace(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 1, 3).await;
    let mut a = SimWorker::start(&s, "a", &["cat"], 1).await;
    let mut b = SimWorker::start(&s, "b", &["cat"], 1).await;
    let (mut holder, mut other) = match a.lease_within(2000).await {
        Some(l) => ((a, l), b),
        None => {
            let l = b.lease().await;
            ((b, l), a)
        }
    };
    let dropped_at = tokio::time::Instant::now();
    holder.0.disconnect(); // crash: both streams gone
    let l = other.lease().await;
    let waited = dropped_at.elapsed();
    assert_eq!(l.job.as_ref().unwrap().job_id, ids[0]);
    assert!(
        waited >= Duration::from_millis(350),
        "re-leased before the grace: {waited:?}"
    );
    let j = job(&s, &ids[0]).await;
    assert_eq!(j.attempt, 2);
    other.complete(&l).await;
    let e = holder
        .0
        .report(&holder.1, JobStatus::Completed)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn a_worker_that_reconnects_within_the_grace_keeps_its_leases(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = fast_config();
    cfg.lease_grace = std::time::Duration::from_millis(1500);
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 2, 3).await;
    let mut w = SimWorker::start(&s, "blip", &["cat"], 2).await;
    let l1 = w.lease().await;
    let l2 = w.lease().await;
    w.disconnect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // it comes back still running l1 only: l2 is given up, l1 kept
    let mut client = w.client();
    let e = client.register_worker(RegisterWorkerRequest {
        worker_id: "blip".into(),
        hostname: "h".into(),
        agw_version: "sim".into(),
        ..Default::default()
    });
    assert_eq!(
        e.await.unwrap_err().code(),
        Code::AlreadyExists,
        "still registered: resume"
    );
    w.connect(Some(vec![l1.lease_id.clone()])).await;
    let again = w.lease().await; // l2's job, re-leased to the same worker with a new lease
    assert_eq!(
        again.job.as_ref().unwrap().job_id,
        l2.job.as_ref().unwrap().job_id
    );
    assert_ne!(again.lease_id, l2.lease_id);
    tokio::time::sleep(Duration::from_millis(1600)).await; // past the original grace
    assert_eq!(
        job(&s, &ids[0]).await.attempt,
        1,
        "the kept lease was not re-queued"
    );
    w.complete(&l1).await;
    w.complete(&again).await;
    assert_eq!(
        job(&s, &l1.job.as_ref().unwrap().job_id).await.status,
        JobStatus::Completed as i32
    );
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn max_attempts_then_dead(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (action_id, ids) = submit(&s, plan("p", &["false"]), 1, 3).await;
    let mut w = SimWorker::start(&s, "w", &["false"], 1).await;
    for attempt in 1..=3 {
        let l = w.lease().await;
        assert_eq!(l.attempt, attempt);
        let r = w.report(&l, JobStatus::Failed).await.unwrap();
        if attempt < 3 {
            assert_eq!(r.status, JobStatus::Failed as i32, "backing off");
            let j = job(&s, &ids[0]).await;
            if j.status == JobStatus::Failed as i32 {
                assert!(
                    j.waiting_reason.contains("backing off until"),
                    "{}",
                    j.waiting_reason
                );
                assert!(j.error.contains("boom"), "{}", j.error);
            }
        } else {
            assert_eq!(r.status, JobStatus::Dead as i32);
        }
    }
    assert!(w.lease_within(300).await.is_none());
    let j = job(&s, &ids[0]).await;
    assert_eq!((j.status, j.attempt), (JobStatus::Dead as i32, 3));
    assert!(j.error.contains("attempt 3 of 3"), "{}", j.error);
    assert_eq!(j.task_results.len(), 1);
    let a = s
        .actions()
        .await
        .get_action(GetActionRequest { action_id })
        .await
        .unwrap()
        .into_inner()
        .action
        .unwrap();
    assert_eq!(a.dead, 1);
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn drain_keeps_leases_but_gives_no_new_ones(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 3, 3).await;
    let mut w = SimWorker::start(&s, "d", &["cat"], 1).await;
    let l = w.lease().await;
    let v = s
        .workers()
        .await
        .drain_worker(DrainWorkerRequest {
            worker_id: "d".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .worker
        .unwrap();
    assert_eq!(v.state, WorkerState::Draining as i32);
    match w.command_within(2000).await {
        Some(heartbeat_response::Command::Drain(_)) => {}
        other => panic!("expected a drain command, got {other:?}"),
    }
    // Draining it again changes nothing and queues no second command (a
    // caller repeating DrainWorker cannot pile commands up).
    for _ in 0..3 {
        let again = s
            .workers()
            .await
            .drain_worker(DrainWorkerRequest {
                worker_id: "d".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(again.worker.unwrap().state, WorkerState::Draining as i32);
    }
    let second = w.command_within(1000).await;
    assert!(second.is_none(), "a second command: {second:?}");
    w.complete(&l).await; // its lease is still valid
    assert!(
        w.lease_within(400).await.is_none(),
        "a draining worker got a new lease"
    );
    let n = w
        .client()
        .unregister_worker(UnregisterWorkerRequest {
            worker_id: "d".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(n.requeued_jobs, 0);
    assert_eq!(
        worker(&s, "d").await.state,
        WorkerState::Unregistered as i32
    );
    // unregistering with a lease re-queues it
    let mut u = SimWorker::start(&s, "u", &["cat"], 1).await;
    let held = u.lease().await;
    let n = u
        .client()
        .unregister_worker(UnregisterWorkerRequest {
            worker_id: "u".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(n.requeued_jobs, 1);
    let j = job(&s, &held.job.as_ref().unwrap().job_id).await;
    assert!(j.status == JobStatus::Failed as i32 || j.status == JobStatus::Pending as i32);
    assert_eq!(ids.len(), 3);
    // an unregistered id may register again
    let _again = SimWorker::start(&s, "u", &["cat"], 1).await;
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn cancel_of_a_running_job_reaches_the_worker(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["sleep"]), 1, 3).await;
    let mut w = SimWorker::start(&s, "c", &["sleep"], 1).await;
    let l = w.lease().await;
    let j = s
        .jobs()
        .await
        .cancel_job(CancelJobRequest {
            job_id: ids[0].clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(j.status, JobStatus::Cancelled as i32);
    match w.command_within(2000).await {
        Some(heartbeat_response::Command::CancelJobId(id)) => assert_eq!(id, ids[0]),
        other => panic!("expected cancel_job_id, got {other:?}"),
    }
    // The cancel names the attempt (a newer lease of the job runs on).
    assert_eq!(w.cancel_leases.recv().await.as_deref(), Some(&*l.lease_id));
    let e = w.report(&l, JobStatus::Completed).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(
        worker(&s, "c").await.active_leases,
        0,
        "the slot is free again"
    );
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn registration_rules_and_heartbeat_errors(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut c = s.workers().await;
    let reg = |id: &str| RegisterWorkerRequest {
        worker_id: id.into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        ..Default::default()
    };
    for bad in ["", "with space", "dot.not.allowed", &"x".repeat(65)] {
        assert_eq!(
            c.register_worker(reg(bad)).await.unwrap_err().code(),
            Code::InvalidArgument,
            "{bad:?}"
        );
    }
    let mut r = reg("ok");
    r.max_concurrent_jobs = 5000;
    assert_eq!(
        c.register_worker(r).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut r = reg("ok");
    r.capabilities = Some(WorkerCapabilities {
        tools: vec!["/bin/sh".into()],
        agentic_units: vec![],
        ..Default::default()
    });
    assert_eq!(
        c.register_worker(r).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut r = reg("ok");
    r.hostname = String::new();
    assert_eq!(
        c.register_worker(r).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // Two descriptions of one agentic unit: refused, and nothing stored.
    let unit = |version: &str| AgenticUnit {
        name: "u".into(),
        version: version.into(),
        ..Default::default()
    };
    let mut r = reg("twice");
    r.capabilities = Some(WorkerCapabilities {
        agentic_units: vec!["u".into()],
        units: vec![unit("1"), unit("2")],
        ..Default::default()
    });
    let e = c.register_worker(r).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("described twice"), "{e:?}");
    let e = c
        .get_worker(GetWorkerRequest {
            worker_id: "twice".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::NotFound,
        "a refused registration stores nothing"
    );
    let resp = c.register_worker(reg("ok")).await.unwrap().into_inner();
    assert_eq!(
        (resp.heartbeat_interval_ms, resp.heartbeat_interval_secs),
        (200, 1)
    );
    assert_eq!(
        c.register_worker(reg("ok")).await.unwrap_err().code(),
        Code::AlreadyExists
    );
    assert_eq!(worker(&s, "ok").await.max_concurrent_jobs, 1, "0 means 1");
    // heartbeat of an unknown worker
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(HeartbeatRequest {
        worker_id: "ghost".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let e = c
        .heartbeat(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .update_job(UpdateJobRequest {
            job_id: "nope".into(),
            worker_id: "ok".into(),
            lease_id: "x".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .get_worker(GetWorkerRequest {
            worker_id: "ghost".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let all = c
        .list_workers(ListWorkersRequest {
            state: WorkerState::Active as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.workers.len(), 1);
    s.stop().await;
}

/// A connection to `s` whose HTTP/2 windows (stream and connection) are
/// 1 KiB: what the server sends on it waits once that much is unread.
async fn small_window(s: &TestServer) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(s.url())
        .unwrap()
        .initial_stream_window_size(1024)
        .initial_connection_window_size(1024)
        .connect()
        .await
        .unwrap()
}

/// A heartbeat stream the server stopped reading (its replies were not
/// read) and whose worker then went away is closed like any other: the
/// worker, still fresh (it goes stale after 30 s here), gets no lease
/// while its lease stream, on another connection, stays open.
async fn a_stalled_heartbeat_stream_that_goes_away_is_closed(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = agq::config::EngineConfig {
        heartbeat_interval: Duration::from_secs(10),
        ..fast_config()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    // An HTTP/2 window of 1 KiB: a few dozen replies fill it.
    let small = small_window(&s).await;
    let mut c = worker_service_client::WorkerServiceClient::new(small);
    c.register_worker(RegisterWorkerRequest {
        worker_id: "w".into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            ..Default::default()
        }),
        max_concurrent_jobs: 4,
        ..Default::default()
    })
    .await
    .unwrap();
    let beat = || HeartbeatRequest {
        worker_id: "w".into(),
        stats: Some(WorkerStats::default()),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(beat()).unwrap();
    let mut replies = c
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    replies.message().await.unwrap().expect("the first reply");
    let mut leases = s
        .workers()
        .await
        .lease_jobs(LeaseJobsRequest {
            worker_id: "w".into(),
        })
        .await
        .unwrap()
        .into_inner();
    // Heartbeats whose replies are never read, until the server stops
    // reading them; then the worker's connection goes.
    for _ in 0..2_000 {
        tx.send(beat()).unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop((replies, tx, c));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 2, 3).await;
    let got = tokio::time::timeout(Duration::from_millis(1000), leases.message()).await;
    assert!(
        got.is_err(),
        "a lease went to a worker whose heartbeat stream is gone: {got:?}"
    );
    for id in &ids {
        let j = job(&s, id).await;
        assert_eq!(j.status, JobStatus::Pending as i32, "{id}");
    }
    s.stop().await;
}

/// A lease stream replaced by a newer one of the same worker ends at once
/// and drops the leases it still buffered for a client that does not read
/// them (the newer stream carries them again): opening streams without
/// reading them holds no copies of the worker's leases on the server.
async fn a_replaced_lease_stream_drops_the_leases_it_buffered(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let _w = SimWorker::start(&s, "w", &["cat"], 64).await;
    // An HTTP/2 window of 1 KiB, and 64 leases of more than 4 KiB: the
    // server holds the leases of a stream that is not read.
    let small = small_window(&s).await;
    let open = |ch: tonic::transport::Channel| async move {
        worker_service_client::WorkerServiceClient::new(ch)
            .lease_jobs(LeaseJobsRequest {
                worker_id: "w".into(),
            })
            .await
            .unwrap()
            .into_inner()
    };
    let mut first = open(small).await;
    let mut p = plan("p", &["cat"]);
    p.tasks[0].args = vec!["x".repeat(4096)];
    let (_, ids) = submit(&s, p, 64, 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The newer stream carries them all again.
    let mut second = open(s.channel().await).await;
    for _ in 0..64 {
        let l = tokio::time::timeout(Duration::from_secs(5), second.message())
            .await
            .expect("a lease in time")
            .unwrap()
            .expect("a lease");
        assert!(ids.contains(&l.job.unwrap().job_id));
    }
    // The older one ends with at most what was already on its way (the
    // gRPC encoder takes up to 32 KiB of messages ahead).
    let mut got = 0;
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = first.message().await {
            got += 1;
        }
    })
    .await;
    assert!(ended.is_ok(), "the replaced stream is still open");
    assert!(
        got < 32,
        "the replaced stream still held {got} of 64 leases"
    );
    s.stop().await;
}

/// A heartbeat stream replaced by a newer one of the same worker ends: a
/// worker that reconnected does not keep its old stream, and heartbeats
/// on it, alive on the server.
async fn a_replaced_heartbeat_stream_ends(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut c = s.workers().await;
    c.register_worker(RegisterWorkerRequest {
        worker_id: "w".into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let beat = || HeartbeatRequest {
        worker_id: "w".into(),
        stats: Some(WorkerStats::default()),
        ..Default::default()
    };
    let open = || {
        let mut c = c.clone();
        async move {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tx.send(beat()).unwrap();
            let mut replies = c
                .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            replies.message().await.unwrap().expect("the first reply");
            (tx, replies)
        }
    };
    let (old_tx, mut old) = open().await;
    let (new_tx, mut new) = open().await;
    // The old stream ends, whether or not its worker still beats on it.
    let _ = old_tx.send(beat());
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match old.message().await {
                Ok(Some(_)) => continue,
                _ => return,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the replaced stream is still open");
    // The new one serves on.
    new_tx.send(beat()).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), new.message())
        .await
        .expect("a reply in time");
    assert!(matches!(r, Ok(Some(_))), "{r:?}");
    s.stop().await;
}

/// What a worker that misbehaves on its heartbeat stream can cost the
/// server is bounded: one that sends heartbeats without reading the
/// replies is not read either (the replies it would queue are bounded)
/// until it reads; one that opens the stream and sends nothing is ended
/// after three heartbeat intervals.
async fn a_worker_that_does_not_read_its_heartbeat_replies_is_not_read_either(store: TestStore) {
    const SENT: u64 = 2_000;
    let dir = tempfile::tempdir().unwrap();
    // A 1 s interval: the worker must not go stale (3 s without an applied
    // heartbeat) while the test waits for the server to stop reading, even
    // on a loaded machine.
    let cfg = agq::config::EngineConfig {
        heartbeat_interval: Duration::from_secs(1),
        ..fast_config()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    // An HTTP/2 window of 1 KiB: a few dozen replies fill it.
    let small = small_window(&s).await;
    let mut c = worker_service_client::WorkerServiceClient::new(small);
    c.register_worker(RegisterWorkerRequest {
        worker_id: "w".into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 1..=SENT {
        tx.send(HeartbeatRequest {
            worker_id: "w".into(),
            stats: Some(WorkerStats {
                uptime_secs: i,
                ..Default::default()
            }),
            ..Default::default()
        })
        .unwrap();
    }
    let mut replies = c
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // The last heartbeat the server applied, as GetWorker shows it.
    let applied = || async {
        s.workers()
            .await
            .get_worker(GetWorkerRequest {
                worker_id: "w".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .worker
            .unwrap()
            .stats
            .map_or(0, |st| st.uptime_secs)
    };
    // Unread replies: the server stops reading (it stays put for 500 ms).
    let mut last = applied().await;
    let mut still_since = std::time::Instant::now();
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = applied().await;
        if now != last {
            (last, still_since) = (now, std::time::Instant::now());
        } else if still_since.elapsed() >= Duration::from_millis(500) {
            break;
        }
    }
    assert!(
        last < SENT / 2,
        "the server read {last} of {SENT} heartbeats with no reply read"
    );
    // Reading the replies lets it go on to the last heartbeat.
    let mut read = 0;
    while read < SENT {
        let r = tokio::time::timeout(Duration::from_secs(30), replies.message())
            .await
            .expect("a reply within 30 s")
            .unwrap();
        assert!(r.is_some(), "the stream ended after {read} replies");
        read += 1;
    }
    let mut tries = 0;
    while applied().await != SENT {
        tries += 1;
        assert!(tries < 100, "the last heartbeat was not applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A stream whose first heartbeat never comes ends after three
    // heartbeat intervals (3 s here), holding nothing.
    let (_silent, rx) = tokio::sync::mpsc::unbounded_channel::<HeartbeatRequest>();
    let opened = std::time::Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(10),
        c.heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)),
    )
    .await
    .expect("the server ends a stream with no first heartbeat")
    .unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(
        opened.elapsed() >= Duration::from_secs(3),
        "{:?}",
        opened.elapsed()
    );
    s.stop().await;
}

async fn server_restart_mid_lease_strands_nothing(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let s = TestServer::start_store(store, &db, fast_config()).await;
    let (addr, backing) = (s.addr, s.backing.clone());
    let (_, ids) = submit(&s, plan("p", &["cat"]), 2, 3).await;
    let mut keeper = SimWorker::start(&s, "keeper", &["cat"], 1).await;
    let mut gone = SimWorker::start(&s, "gone", &["cat"], 1).await;
    let kl = keeper.lease().await;
    let _gl = gone.lease().await;
    s.stop().await;
    drop(gone); // never comes back

    let s =
        TestServer::start_on_with(&backing, fast_config(), Default::default(), Some(addr)).await;
    assert_eq!(
        s.queue()
            .await
            .get_queue_stats(GetQueueStatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .running_length,
        2
    );
    // keeper reconnects: already registered, resumes with its lease
    keeper.connect(Some(vec![kl.lease_id.clone()])).await;
    keeper.complete(&kl).await;
    // gone's job goes back to pending after the grace and runs on keeper
    let l = keeper.lease().await;
    assert_eq!(l.attempt, 2);
    keeper.complete(&l).await;
    for id in &ids {
        assert_eq!(job(&s, id).await.status, JobStatus::Completed as i32);
    }
    // gone turns DEAD after 3 x interval
    eventually(5, "gone is DEAD", || async {
        worker(&s, "gone").await.state == WorkerState::Dead as i32
    })
    .await;
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

async fn a_worker_that_registers_and_never_heartbeats_strands_nothing(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 1, 3).await;
    let mut c = s.workers().await;
    c.register_worker(RegisterWorkerRequest {
        worker_id: "mute".into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            agentic_units: vec![],
            ..Default::default()
        }),
        max_concurrent_jobs: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    // it opens a lease stream, takes the job, and is never heard of again
    let mut leases = c
        .lease_jobs(LeaseJobsRequest {
            worker_id: "mute".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let l = leases.message().await.unwrap().unwrap();
    assert_eq!(l.job.unwrap().job_id, ids[0]);
    eventually(5, "mute is DEAD", || async {
        worker(&s, "mute").await.state == WorkerState::Dead as i32
    })
    .await;
    let mut ok = SimWorker::start(&s, "talker", &["cat"], 1).await;
    let again = ok.lease().await;
    assert_eq!(again.attempt, 2);
    ok.complete(&again).await;
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A report for `lease` as BatchUpdateJobs carries it (worker_id empty:
/// the batch's worker).
fn batched(lease: &JobLease, status: JobStatus) -> UpdateJobRequest {
    UpdateJobRequest {
        job_id: lease.job.as_ref().unwrap().job_id.clone(),
        lease_id: lease.lease_id.clone(),
        status: status as i32,
        error: if status == JobStatus::Failed {
            "boom".into()
        } else {
            String::new()
        },
        ..Default::default()
    }
}

async fn batch_update_jobs_applies_each_report_on_its_own(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    submit(&s, plan("p", &["cat"]), 4, 3).await;
    let mut w1 = SimWorker::start(&s, "w1", &["cat"], 3).await;
    let (l1, l2, l3) = (w1.lease().await, w1.lease().await, w1.lease().await);
    let mut w2 = SimWorker::start(&s, "w2", &["cat"], 1).await;
    let l4 = w2.lease().await;
    let mut c = w1.client();
    let batch = |requests: Vec<UpdateJobRequest>| BatchUpdateJobsRequest {
        worker_id: "w1".into(),
        requests,
    };

    // Refused as a whole, nothing applied: no reports, too many, a report
    // naming another worker, a bad worker_id.
    let call = |r: BatchUpdateJobsRequest| {
        let mut c = c.clone();
        async move { c.batch_update_jobs(r).await.map(|r| r.into_inner()) }
    };
    let code = |r: Result<BatchUpdateJobsResponse, tonic::Status>| r.unwrap_err().code();
    assert_eq!(code(call(batch(vec![])).await), Code::InvalidArgument);
    let many = vec![batched(&l1, JobStatus::Completed); 1025];
    assert_eq!(code(call(batch(many)).await), Code::InvalidArgument);
    let mut other = batched(&l4, JobStatus::Completed);
    other.worker_id = "w2".into();
    let mixed = vec![batched(&l1, JobStatus::Completed), other];
    assert_eq!(code(call(batch(mixed)).await), Code::InvalidArgument);
    let mut bad = batch(vec![batched(&l1, JobStatus::Completed)]);
    bad.worker_id = String::new();
    assert_eq!(code(call(bad).await), Code::InvalidArgument);
    for l in [&l1, &l4] {
        let id = &l.job.as_ref().unwrap().job_id;
        assert_eq!(job(&s, id).await.status, JobStatus::Running as i32);
    }

    // Each report gets what UpdateJob would have answered.
    let mut stale = batched(&l3, JobStatus::Completed);
    stale.lease_id = "not-the-lease".into();
    let mut ghost = batched(&l3, JobStatus::Completed);
    ghost.job_id = "no-such-job".into();
    let r = c
        .batch_update_jobs(batch(vec![
            batched(&l1, JobStatus::Completed),
            batched(&l2, JobStatus::Failed),
            stale,
            batched(&l4, JobStatus::Completed), // w2's lease
            ghost,
        ]))
        .await
        .unwrap()
        .into_inner();
    let codes: Vec<Code> = r.results.iter().map(|r| Code::from(r.code)).collect();
    assert_eq!(
        codes,
        [
            Code::Ok,
            Code::Ok,
            Code::FailedPrecondition,
            Code::PermissionDenied,
            Code::NotFound
        ]
    );
    assert_eq!(r.results[0].status, JobStatus::Completed as i32);
    assert_eq!(r.results[1].status, JobStatus::Failed as i32);
    assert!(
        r.results[2].message.contains("stale lease"),
        "{:?}",
        r.results[2]
    );
    let status = |j: Job| (j.status, j.worker_id);
    let id = |l: &JobLease| l.job.as_ref().unwrap().job_id.clone();
    assert_eq!(
        status(job(&s, &id(&l1)).await).0,
        JobStatus::Completed as i32
    );
    assert_ne!(status(job(&s, &id(&l2)).await).0, JobStatus::Running as i32);
    assert_eq!(
        status(job(&s, &id(&l3)).await),
        (JobStatus::Running as i32, "w1".to_string())
    );
    assert_eq!(
        status(job(&s, &id(&l4)).await),
        (JobStatus::Running as i32, "w2".to_string())
    );
    // The freed slots are refilled; the rest finish normally.
    w1.complete(&l3).await;
    w2.complete(&l4).await;
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// ReportJobs: each request is answered in order, each report as
/// UpdateJob would answer it; an idle stream stays open; a refused request
/// ends the stream after the answers before it, and nothing sent behind it
/// is applied; a half-closed stream answers what it was sent, then ends.
async fn report_jobs_answers_each_request_in_order(store: TestStore) {
    use tokio_stream::wrappers::UnboundedReceiverStream;
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    submit(&s, plan("p", &["cat"]), 5, 3).await;
    let mut w1 = SimWorker::start(&s, "w1", &["cat"], 5).await;
    let mut l = Vec::new();
    for _ in 0..5 {
        l.push(w1.lease().await);
    }
    let id = |l: &JobLease| l.job.as_ref().unwrap().job_id.clone();
    let req = |requests: Vec<UpdateJobRequest>| ReportJobsRequest {
        worker_id: "w1".into(),
        requests,
    };
    let codes = |a: Option<ReportJobsResponse>| -> Vec<Code> {
        let a = a.expect("an answer, not the end of the stream");
        a.results.iter().map(|r| Code::from(r.code)).collect()
    };
    let mut c = w1.client();

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut stale = batched(&l[2], JobStatus::Completed);
    stale.lease_id = "not-the-lease".into();
    tx.send(req(vec![batched(&l[0], JobStatus::Completed)]))
        .unwrap();
    tx.send(req(vec![batched(&l[1], JobStatus::Failed), stale]))
        .unwrap();
    let mut answers = c
        .report_jobs(UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(codes(answers.message().await.unwrap()), [Code::Ok]);
    assert_eq!(
        codes(answers.message().await.unwrap()),
        [Code::Ok, Code::FailedPrecondition]
    );
    assert_eq!(
        job(&s, &id(&l[0])).await.status,
        JobStatus::Completed as i32
    );
    assert_ne!(job(&s, &id(&l[1])).await.status, JobStatus::Running as i32);
    // Idle for a while, the stream still takes the next request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx.send(req(vec![batched(&l[2], JobStatus::Completed)]))
        .unwrap();
    assert_eq!(codes(answers.message().await.unwrap()), [Code::Ok]);
    // Another worker's id: refused, the stream ends; the request sent
    // behind it is not applied.
    tx.send(ReportJobsRequest {
        worker_id: "w2".into(),
        requests: vec![batched(&l[3], JobStatus::Completed)],
    })
    .unwrap();
    tx.send(req(vec![batched(&l[4], JobStatus::Completed)]))
        .unwrap();
    let end = answers.message().await.unwrap_err();
    assert_eq!(end.code(), Code::InvalidArgument, "{end:?}");
    assert!(end.message().contains("changed"), "{end:?}");
    for l in &l[3..] {
        assert_eq!(job(&s, &id(l)).await.status, JobStatus::Running as i32);
    }

    // Refused as a whole, nothing applied: no reports, too many, a report
    // naming another worker, a bad worker_id.
    let mut other = batched(&l[3], JobStatus::Completed);
    other.worker_id = "w2".into();
    let mut bad = req(vec![batched(&l[3], JobStatus::Completed)]);
    bad.worker_id = String::new();
    for refused in [
        req(vec![]),
        req(vec![batched(&l[3], JobStatus::Completed); 1025]),
        req(vec![batched(&l[4], JobStatus::Completed), other]),
        bad,
    ] {
        let mut answers = c
            .report_jobs(tokio_stream::iter(vec![refused]))
            .await
            .unwrap()
            .into_inner();
        let end = answers.message().await.unwrap_err();
        assert_eq!(end.code(), Code::InvalidArgument, "{end:?}");
    }
    for l in &l[3..] {
        assert_eq!(job(&s, &id(l)).await.status, JobStatus::Running as i32);
    }

    // Half-closed after three requests: all answered, then the end; the
    // repeat of a report already applied (its answer lost with a broken
    // stream) is acknowledged again.
    let last = vec![
        req(vec![batched(&l[3], JobStatus::Completed)]),
        req(vec![batched(&l[4], JobStatus::Completed)]),
        req(vec![batched(&l[0], JobStatus::Completed)]),
    ];
    let mut answers = c
        .report_jobs(tokio_stream::iter(last))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        assert_eq!(codes(answers.message().await.unwrap()), [Code::Ok]);
    }
    assert!(answers.message().await.unwrap().is_none());
    assert_eq!(
        job(&s, &id(&l[0])).await.status,
        JobStatus::Completed as i32
    );
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A server that stops ends an open ReportJobs stream after answering
/// what it read, without an error, and the server's stop does not wait
/// for the worker to close it.
async fn report_jobs_ends_without_an_error_when_the_server_stops(store: TestStore) {
    use tokio_stream::wrappers::UnboundedReceiverStream;
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    submit(&s, plan("p", &["cat"]), 1, 3).await;
    let mut w = SimWorker::start(&s, "w1", &["cat"], 1).await;
    let l = w.lease().await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(ReportJobsRequest {
        worker_id: "w1".into(),
        requests: vec![batched(&l, JobStatus::Completed)],
    })
    .unwrap();
    let mut answers = w
        .client()
        .report_jobs(UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let a = answers.message().await.unwrap().expect("an answer");
    assert_eq!(a.results[0].code, 0, "{a:?}");
    // The request stream stays open (tx is kept): the server ends it.
    s.stop().await;
    let end = tokio::time::timeout(Duration::from_secs(10), answers.message())
        .await
        .expect("the stream ended");
    assert!(matches!(end, Ok(None)), "{end:?}");
    drop(tx);
}

/// agw's reporter: every report goes on one ReportJobs stream (the ones
/// queued together in one request), each caller gets its own report's
/// outcome, and a traced report sent alone goes as a plain UpdateJob with
/// its trace context.
async fn agw_reporter_streams_reports(store: TestStore) {
    use agq::worker::{client::worker_client, reporter::Reporter};
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 5, 3).await;
    let mut w = SimWorker::start(&s, "w1", &["cat"], 5).await;
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(w.lease().await);
    }
    let client = worker_client(s.channel().await, None).unwrap();
    let reporter = Reporter::start(client, "w1".into(), Duration::from_secs(5));
    let mut reqs: Vec<UpdateJobRequest> = leases
        .iter()
        .map(|l| {
            let mut r = batched(l, JobStatus::Completed);
            r.worker_id = "w1".into();
            r
        })
        .collect();
    reqs[4].lease_id = "stale".into();
    // One thread: every send is queued before the sender task runs.
    let outcomes =
        futures_util::future::join_all(reqs.into_iter().map(|r| reporter.send(r, None))).await;
    let codes: Vec<Code> = outcomes
        .iter()
        .map(|r| r.as_ref().err().map_or(Code::Ok, |e| e.code()))
        .collect();
    assert_eq!(
        codes,
        [
            Code::Ok,
            Code::Ok,
            Code::Ok,
            Code::Ok,
            Code::FailedPrecondition
        ]
    );
    let m = s
        .queue()
        .await
        .get_metrics(GetMetricsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .body;
    assert!(
        m.contains("agq_rpc_requests_total{method=\"WorkerService/ReportJobs\",code=\"Ok\"} 1\n"),
        "{m}"
    );
    assert!(!m.contains("WorkerService/UpdateJob\""), "{m}");
    assert!(!m.contains("WorkerService/BatchUpdateJobs\""), "{m}");
    let done = futures_util::future::join_all(ids.iter().map(|id| job(&s, id))).await;
    let completed = done
        .iter()
        .filter(|j| j.status == JobStatus::Completed as i32)
        .count();
    assert_eq!(completed, 4);
    // A lone traced report goes as a plain UpdateJob; the stream stays.
    let last = &leases[4];
    let mut r = batched(last, JobStatus::Completed);
    r.worker_id = "w1".into();
    let traced = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    reporter.send(r, Some(traced.into())).await.unwrap();
    let m = s
        .queue()
        .await
        .get_metrics(GetMetricsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .body;
    assert!(
        m.contains("agq_rpc_requests_total{method=\"WorkerService/UpdateJob\",code=\"Ok\"} 1\n"),
        "{m}"
    );
    assert!(
        m.contains("agq_rpc_requests_total{method=\"WorkerService/ReportJobs\",code=\"Ok\"} 1\n"),
        "{m}"
    );
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A lease carries the job as GetJob shows it: for a new job (whose row the
/// scheduler keeps in memory until its first lease), for a retried one
/// (read back from the database) and for one leased in the transaction
/// that inserts it.
async fn a_lease_carries_the_job_as_stored(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 1, 3).await;
    let mut w = SimWorker::start(&s, "w1", &["cat"], 1).await;
    let first = w.lease().await;
    let stored = job(&s, &ids[0]).await;
    assert_eq!(first.job.as_ref(), Some(&stored));
    assert_eq!(stored.input.get("n").map(String::as_str), Some("0"));
    assert_eq!(
        (stored.attempt, stored.status),
        (1, JobStatus::Running as i32)
    );
    w.report(&first, JobStatus::Failed).await.unwrap();
    let second = w.lease().await;
    assert_ne!(second.lease_id, first.lease_id);
    let stored = job(&s, &ids[0]).await;
    let mut leased = second.job.clone().unwrap();
    // GetJob also shows the task results of the failed attempt, kept until
    // the next report replaces them.
    leased.task_results = stored.task_results.clone();
    assert_eq!(leased, stored);
    assert_eq!(
        (stored.attempt, stored.error.as_str()),
        (2, "attempt 1 of 3: boom")
    );
    w.complete(&second).await;

    // Submitted while an idle worker waits and nothing else is queued: the
    // job is inserted already leased, in the submit's own transaction.
    let (_, more) = submit(&s, plan("p", &["cat"]), 1, 3).await;
    let third = w.lease().await;
    let stored = job(&s, &more[0]).await;
    assert_eq!(third.job.as_ref(), Some(&stored));
    assert_eq!(
        (stored.attempt, stored.status, stored.worker_id.as_str()),
        (1, JobStatus::Running as i32, "w1")
    );
    assert_eq!(third.attempt, 1);
    w.report(&third, JobStatus::Failed).await.unwrap();
    let fourth = w.lease().await;
    assert_eq!(fourth.job.as_ref().unwrap().job_id, more[0]);
    assert_eq!(fourth.attempt, 2);
    w.complete(&fourth).await;
    assert_eq!(job(&s, &more[0]).await.status, JobStatus::Completed as i32);
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A worker that reconnects naming a lease the server took back while it
/// was away (its job was cancelled) is told so in the answer to that
/// heartbeat, to stop running it; a lease still its own is not listed.
async fn a_reconnecting_worker_is_told_which_held_leases_were_revoked(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 2, 3).await;
    let mut w = SimWorker::start(&s, "w1", &["cat"], 2).await;
    let (a, b) = (w.lease().await, w.lease().await);
    w.disconnect();
    let cancelled = a.job.as_ref().unwrap().job_id.clone();
    s.jobs()
        .await
        .cancel_job(CancelJobRequest {
            job_id: cancelled.clone(),
        })
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(HeartbeatRequest {
        worker_id: "w1".into(),
        held_leases: Some(HeldLeases {
            lease_ids: vec![
                a.lease_id.clone(),
                b.lease_id.clone(),
                "never-granted".into(),
            ],
        }),
        ..Default::default()
    })
    .unwrap();
    let mut replies = w
        .client()
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // The answer to the heartbeat (commands queued for the worker may
    // come first).
    let mut answer = None;
    for _ in 0..10 {
        let r = tokio::time::timeout(Duration::from_secs(5), replies.message())
            .await
            .expect("an answer within 5 s")
            .unwrap()
            .expect("the stream stays open");
        if r.command.is_none() {
            answer = Some(r);
            break;
        }
    }
    let mut revoked = answer.expect("the heartbeat's answer").revoked_lease_ids;
    revoked.sort();
    let mut expected = vec![a.lease_id.clone(), "never-granted".to_string()];
    expected.sort();
    assert_eq!(revoked, expected);
    assert_eq!(
        job(&s, &cancelled).await.status,
        JobStatus::Cancelled as i32
    );
    let kept = b.job.as_ref().unwrap().job_id.clone();
    assert!(ids.contains(&kept));
    let kept = job(&s, &kept).await;
    assert_eq!(
        (kept.status, kept.worker_id.as_str()),
        (JobStatus::Running as i32, "w1")
    );
    drop(tx);
    s.stop().await;
}

/// A worker whose heartbeat stream dropped while its lease stream stays
/// open is suspect: it gets no lease (what it leased would be taken back
/// after the grace, each time costing the job an attempt) until it
/// heartbeats on a stream again.
async fn a_worker_whose_heartbeat_stream_dropped_gets_no_lease(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    // Stale only after 6 s: the worker stays ACTIVE and fresh throughout,
    // so only its missing heartbeat stream keeps leases away.
    let cfg = agq::config::EngineConfig {
        heartbeat_interval: Duration::from_secs(2),
        ..fast_config()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    let mut c = s.workers().await;
    c.register_worker(RegisterWorkerRequest {
        worker_id: "half".into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        max_concurrent_jobs: 4,
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let beat = || HeartbeatRequest {
        worker_id: "half".into(),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(beat()).unwrap();
    let replies = c
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut leases = c
        .lease_jobs(LeaseJobsRequest {
            worker_id: "half".into(),
        })
        .await
        .unwrap()
        .into_inner();
    // The heartbeat stream ends; the lease stream stays open.
    drop((tx, replies));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (_, ids) = submit(&s, plan("p", &["cat"]), 3, 3).await;
    let got = tokio::time::timeout(Duration::from_millis(500), leases.message()).await;
    assert!(
        got.is_err(),
        "a lease went to a worker without a heartbeat stream: {got:?}"
    );
    for id in &ids {
        let j = job(&s, id).await;
        assert_eq!(
            (j.status, j.attempt),
            (JobStatus::Pending as i32, 0),
            "{id}"
        );
    }
    // Its heartbeat stream back, it leases again.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(beat()).unwrap();
    let _replies = c
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let lease = tokio::time::timeout(Duration::from_secs(5), leases.message())
        .await
        .expect("a lease once the heartbeat stream is back")
        .unwrap()
        .expect("the lease stream is open");
    assert!(ids.contains(&lease.job.unwrap().job_id));
    drop(tx);
    s.stop().await;
}

/// DrainWorker tells the worker over its heartbeat stream; a worker that
/// had none open at the time (reconnecting, or registered and not yet
/// streaming) gets the Drain command as soon as it opens one: otherwise it
/// would stay DRAINING on the server, getting no leases, without ever
/// learning it should drain (and agw would never finish and exit).
async fn a_worker_drained_without_a_heartbeat_stream_is_told_when_it_opens_one(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    // Stale only after 6 s: the workers stay live while they have no
    // stream.
    let cfg = agq::config::EngineConfig {
        heartbeat_interval: Duration::from_secs(2),
        ..fast_config()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    let drain = |id: &'static str| {
        let s = &s;
        async move {
            let w = s
                .workers()
                .await
                .drain_worker(DrainWorkerRequest {
                    worker_id: id.into(),
                })
                .await
                .unwrap()
                .into_inner()
                .worker
                .unwrap();
            assert_eq!(w.state, WorkerState::Draining as i32, "{w:?}");
        }
    };
    let expect_drain = |got: Option<heartbeat_response::Command>, who: &str| match got {
        Some(heartbeat_response::Command::Drain(d)) => {
            assert_eq!(d.reason, "drain requested", "{who}")
        }
        other => panic!("{who}: expected a drain command, got {other:?}"),
    };

    // Streamed, then its streams closed (reconnecting) when drained.
    let mut away = SimWorker::start(&s, "away", &["cat"], 1).await;
    away.disconnect();
    eventually(5, "the server sees away's streams closed", || async {
        !worker(&s, "away").await.connected
    })
    .await;
    drain("away").await;
    assert!(
        away.command_within(200).await.is_none(),
        "a command reached a closed stream"
    );
    away.connect(None).await;
    expect_drain(away.command_within(3000).await, "away, its stream reopened");

    // Registered, and drained before it ever opened its heartbeat stream.
    let mut c = s.workers().await;
    c.register_worker(RegisterWorkerRequest {
        worker_id: "late".into(),
        hostname: "test-host".into(),
        agw_version: "sim".into(),
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            ..Default::default()
        }),
        max_concurrent_jobs: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    drain("late").await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(HeartbeatRequest {
        worker_id: "late".into(),
        ..Default::default()
    })
    .unwrap();
    let mut replies = c
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let got = tokio::time::timeout(Duration::from_secs(3), async {
        while let Some(r) = replies.message().await.unwrap() {
            if r.command.is_some() {
                return r.command;
            }
        }
        None
    })
    .await
    .unwrap_or(None);
    expect_drain(got, "late, its first stream");
    drop((tx, replies));

    // Still DRAINING: no lease.
    submit(&s, plan("p", &["cat"]), 1, 3).await;
    assert!(away.lease_within(300).await.is_none(), "away got a lease");
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A report's task numbers are bounded by the plan version its job runs
/// (its `current_task`, how many task results it holds, and each result's
/// `task_number`), and its percentage by 100, the same on both stores and
/// whether it comes alone or in a BatchUpdateJobs (the grouped completion
/// paths included); one out of bounds changes nothing.
async fn progress_reports_are_bounded(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat", "sort", "cat"]), 2, 3).await;
    let mut w = SimWorker::start(&s, "w1", &["cat", "sort"], 2).await;
    let (lease, other) = (w.lease().await, w.lease().await);
    let job_id = lease.job.as_ref().unwrap().job_id.clone();
    assert!(ids.contains(&job_id));
    let report = |status: JobStatus, task: u32, percent: u32, results: &[u32]| UpdateJobRequest {
        job_id: job_id.clone(),
        worker_id: "w1".into(),
        lease_id: lease.lease_id.clone(),
        status: status as i32,
        current_task: task,
        progress_percent: percent,
        task_results: results
            .iter()
            .map(|n| TaskResult {
                task_number: *n,
                command: "cat".into(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let progress = |task, percent| report(JobStatus::Running, task, percent, &[]);
    let mut c = w.client();
    c.update_job(progress(1, 40)).await.unwrap();
    let mut bad = vec![
        progress(4, 50),
        progress(101, 50),
        progress(u32::MAX, 50),
        progress(1, 101),
    ];
    for status in [JobStatus::Running, JobStatus::Completed] {
        for results in [&[0][..], &[1, 4], &[1, 2, 3, 3], &[u32::MAX]] {
            bad.push(report(status, 1, 50, results));
        }
    }
    for r in &bad {
        let e = c.update_job(r.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{r:?}: {e:?}");
    }
    // In a batch beside a valid completion, so the grouped path runs.
    let fine = batched(&other, JobStatus::Completed);
    for r in &bad {
        let answer = c
            .batch_update_jobs(BatchUpdateJobsRequest {
                worker_id: "w1".into(),
                requests: vec![r.clone(), fine.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            Code::from(answer.results[0].code),
            Code::InvalidArgument,
            "{r:?}"
        );
        assert_eq!(Code::from(answer.results[1].code), Code::Ok, "{r:?}");
    }
    let stored = job(&s, &job_id).await;
    assert_eq!(stored.status, JobStatus::Running as i32);
    assert_eq!((stored.current_task, stored.progress_percent), (1, 40));
    assert!(stored.task_results.is_empty());
    c.update_job(report(JobStatus::Running, 3, 100, &[1, 2]))
        .await
        .unwrap();
    let stored = job(&s, &job_id).await;
    assert_eq!((stored.current_task, stored.progress_percent), (3, 100));
    c.update_job(report(JobStatus::Completed, 3, 100, &[1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(job(&s, &job_id).await.status, JobStatus::Completed as i32);
    s.stop().await;
}

/// A report's task results replace whatever the job had stored: those of
/// a progress report of the same attempt (a new job's first lease, which
/// the server knows starts with none) and those of an earlier attempt.
async fn task_results_are_replaced_by_the_next_report(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["cat", "sort"]), 1, 3).await;
    let mut w = SimWorker::start(&s, "w1", &["cat", "sort"], 1).await;
    let result = |n: u32, out: &str| TaskResult {
        task_number: n,
        command: "cat".into(),
        stdout: out.into(),
        ..Default::default()
    };
    let report = |lease: &JobLease, status: JobStatus, results: Vec<TaskResult>| {
        let mut r = batched(lease, status);
        r.worker_id = "w1".into();
        r.task_results = results;
        r
    };
    let stdout =
        |j: &Job| -> Vec<String> { j.task_results.iter().map(|t| t.stdout.clone()).collect() };

    let first = w.lease().await;
    let mut c = w.client();
    c.update_job(report(
        &first,
        JobStatus::Running,
        vec![result(1, "a1"), result(2, "a2")],
    ))
    .await
    .unwrap();
    assert_eq!(stdout(&job(&s, &ids[0]).await), ["a1", "a2"]);
    c.update_job(report(&first, JobStatus::Failed, vec![result(1, "b1")]))
        .await
        .unwrap();
    assert_eq!(stdout(&job(&s, &ids[0]).await), ["b1"]);

    let second = w.lease().await;
    c.update_job(report(&second, JobStatus::Completed, vec![result(1, "c1")]))
        .await
        .unwrap();
    let done = job(&s, &ids[0]).await;
    assert_eq!(done.status, JobStatus::Completed as i32);
    assert_eq!(stdout(&done), ["c1"]);
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A WorkerService standing in for a server agw's reporter talks to: it
/// records the RPCs it gets and has UpdateJob only (answered COMPLETED);
/// ReportJobs is either missing too (an older server) or opens and never
/// answers (a server that stopped answering).
mod fake {
    use std::{
        pin::Pin,
        sync::{Arc, Mutex},
        time::Duration,
    };

    use agq::{
        pb::{
            worker_service_server::{WorkerService, WorkerServiceServer},
            *,
        },
        worker::{client::worker_client, reporter::Reporter},
    };
    use tonic::{Request, Response, Status, Streaming};

    type Answers<T> = Pin<Box<dyn futures_util::Stream<Item = Result<T, Status>> + Send>>;

    /// What the fake does with a ReportJobs stream.
    #[derive(Clone, Copy)]
    pub enum ReportJobs {
        /// UNIMPLEMENTED.
        Missing,
        /// Opens it and never answers.
        Silent,
    }

    struct Fake {
        seen: Arc<Mutex<Vec<&'static str>>>,
        report_jobs: ReportJobs,
    }

    impl Fake {
        fn missing<T>(&self, rpc: &'static str) -> Result<T, Status> {
            self.seen.lock().unwrap().push(rpc);
            Err(Status::unimplemented(rpc))
        }
    }

    /// The fake's WorkerService: UpdateJob and ReportJobs as above, every
    /// other RPC recorded and refused with UNIMPLEMENTED.
    macro_rules! fake {
        ($(fn $name:ident($req:ty) -> $resp:ty = $rpc:literal;)*) => {
            #[tonic::async_trait]
            impl WorkerService for Fake {
                type HeartbeatStream = Answers<HeartbeatResponse>;
                type LeaseJobsStream = Answers<JobLease>;
                type ReportJobsStream = Answers<ReportJobsResponse>;
                async fn update_job(
                    &self,
                    _: Request<UpdateJobRequest>,
                ) -> Result<Response<UpdateJobResponse>, Status> {
                    self.seen.lock().unwrap().push("UpdateJob");
                    Ok(Response::new(UpdateJobResponse {
                        status: JobStatus::Completed as i32,
                    }))
                }
                async fn report_jobs(
                    &self,
                    _: Request<Streaming<ReportJobsRequest>>,
                ) -> Result<Response<Self::ReportJobsStream>, Status> {
                    match self.report_jobs {
                        ReportJobs::Missing => self.missing("ReportJobs"),
                        ReportJobs::Silent => {
                            self.seen.lock().unwrap().push("ReportJobs");
                            Ok(Response::new(Box::pin(futures_util::stream::pending())))
                        }
                    }
                }
                $(
                    async fn $name(&self, _: Request<$req>) -> Result<Response<$resp>, Status> {
                        self.missing($rpc)
                    }
                )*
            }
        };
    }
    fake! {
        fn register_worker(RegisterWorkerRequest) -> RegisterWorkerResponse = "RegisterWorker";
        fn heartbeat(Streaming<HeartbeatRequest>) -> Answers<HeartbeatResponse> = "Heartbeat";
        fn lease_jobs(LeaseJobsRequest) -> Answers<JobLease> = "LeaseJobs";
        fn batch_update_jobs(BatchUpdateJobsRequest) -> BatchUpdateJobsResponse = "BatchUpdateJobs";
        fn unregister_worker(UnregisterWorkerRequest) -> UnregisterWorkerResponse = "UnregisterWorker";
        fn list_workers(ListWorkersRequest) -> ListWorkersResponse = "ListWorkers";
        fn get_worker(GetWorkerRequest) -> GetWorkerResponse = "GetWorker";
        fn drain_worker(DrainWorkerRequest) -> DrainWorkerResponse = "DrainWorker";
        fn forget_worker(ForgetWorkerRequest) -> ForgetWorkerResponse = "ForgetWorker";
        fn release_worker(ReleaseWorkerRequest) -> ReleaseWorkerResponse = "ReleaseWorker";
        fn verify_worker(VerifyWorkerRequest) -> VerifyWorkerResponse = "VerifyWorker";
    }

    /// Serves a fake on 127.0.0.1:0 and starts agw's reporter for "w1" on
    /// it with `call_timeout`; returns the RPCs seen, the reporter and the
    /// server's task.
    pub async fn reporter(
        report_jobs: ReportJobs,
        call_timeout: Duration,
    ) -> (
        Arc<Mutex<Vec<&'static str>>>,
        Reporter,
        tokio::task::JoinHandle<()>,
    ) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = Fake {
            seen: seen.clone(),
            report_jobs,
        };
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(WorkerServiceServer::new(fake))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let reporter = Reporter::start(
            worker_client(channel, None).unwrap(),
            "w1".into(),
            call_timeout,
        );
        (seen, reporter, server)
    }

    /// A completion report of job `n` of worker w1.
    pub fn report(n: u32) -> UpdateJobRequest {
        UpdateJobRequest {
            job_id: format!("job-{n}"),
            worker_id: "w1".into(),
            lease_id: format!("lease-{n}"),
            status: JobStatus::Completed as i32,
            ..Default::default()
        }
    }

    /// Each outcome's code (OK for success).
    pub fn codes(outcomes: Vec<Result<(), Status>>) -> Vec<tonic::Code> {
        outcomes
            .iter()
            .map(|r| r.as_ref().err().map_or(tonic::Code::Ok, |e| e.code()))
            .collect()
    }
}

/// agw's reporter against a server without ReportJobs and BatchUpdateJobs
/// (an older server): the report that found them missing is answered
/// UNAVAILABLE (its caller sends it again), then the reporter falls back
/// to BatchUpdateJobs and then to one UpdateJob per report.
#[tokio::test]
async fn agw_reporter_falls_back_on_a_server_without_the_stream() {
    let (seen, reporter, server) =
        fake::reporter(fake::ReportJobs::Missing, Duration::from_secs(5)).await;
    let alone = reporter.send(fake::report(1), None).await;
    assert_eq!(fake::codes(vec![alone]), [Code::Unavailable]);
    // One thread: both sends are queued before the sender task runs, so
    // they go together (a batch), then, the batch refused, one by one.
    let two =
        || futures_util::future::join_all([1, 2].map(|n| reporter.send(fake::report(n), None)));
    assert_eq!(
        fake::codes(two().await),
        [Code::Unavailable, Code::Unavailable]
    );
    assert_eq!(fake::codes(two().await), [Code::Ok, Code::Ok]);
    assert_eq!(
        *seen.lock().unwrap(),
        ["ReportJobs", "BatchUpdateJobs", "UpdateJob", "UpdateJob"]
    );
    server.abort();
}

/// agw's reporter on a stream the server stopped answering: a report
/// unanswered for the call timeout gets DEADLINE_EXCEEDED (its caller
/// sends it again, as after a timed-out call), and the next report opens
/// a new stream instead of waiting behind the silent one.
#[tokio::test]
async fn agw_reporter_gives_up_on_a_silent_stream_and_opens_another() {
    let (seen, reporter, server) =
        fake::reporter(fake::ReportJobs::Silent, Duration::from_millis(300)).await;
    let started = tokio::time::Instant::now();
    for n in [1, 2] {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            reporter.send(fake::report(n), None),
        )
        .await
        .expect("the report's wait is bounded by the call timeout");
        assert_eq!(fake::codes(vec![r]), [Code::DeadlineExceeded]);
    }
    assert!(started.elapsed() >= Duration::from_millis(600));
    assert_eq!(*seen.lock().unwrap(), ["ReportJobs", "ReportJobs"]);
    server.abort();
}

/// A lease sent on a lease stream the worker lost while the server still
/// sees it open (the connection broke unnoticed) is kept as in flight
/// when the worker reconnects without listing it, and sent again on the
/// worker's new lease stream: the same lease, no attempt lost. The lease
/// the worker listed as held is not sent again.
async fn a_lease_in_flight_on_a_lost_stream_goes_again_on_the_next_one(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    submit(&s, plan("p", &["cat"]), 2, 1).await;
    let mut w = SimWorker::start(&s, "w1", &["cat"], 2).await;
    let (running, unread) = (w.lease().await, w.lease().await);
    // The worker runs `running`; `unread` never reached it.
    let _lost = w.take_lease_stream();
    w.connect(Some(vec![running.lease_id.clone()])).await;
    let again = w
        .lease_within(2000)
        .await
        .expect("the unread lease, sent again");
    let job_of = |l: &JobLease| l.job.as_ref().map(|j| (j.job_id.clone(), j.status));
    assert_eq!(
        (&again.lease_id, again.attempt, job_of(&again)),
        (&unread.lease_id, 1, job_of(&unread))
    );
    assert_eq!(job_of(&again).unwrap().1, JobStatus::Running as i32);
    assert!(
        w.lease_within(300).await.is_none(),
        "the held lease was sent again"
    );
    w.complete(&again).await;
    w.complete(&running).await;
    for l in [&again, &running] {
        let j = job(&s, &l.job.as_ref().unwrap().job_id).await;
        assert_eq!(j.status, JobStatus::Completed as i32, "{j:?}");
    }
    assert_nothing_stranded(&s).await;
    s.stop().await;
}
