//! Fleet scheduling over the generated client: worker selectors (pools
//! by labels), priorities with the starvation guard, round robin among
//! actions of equal priority, concurrency keys (checked by the workers'
//! own count of what they run), RetryJob changing a priority, and the
//! settings surviving a restart.

mod common;

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use agq::{
    auth::Authenticator,
    config::EngineConfig,
    pb::{self, ActionInput, JobStatus, SubmitActionRequest, SubmitPlanRequest},
};
use common::{eventually, fast_config, job, plan, store_tests, SimWorker, TestServer, TestStore};
use tonic::Code;

store_tests! {
    a_selector_keeps_jobs_off_workers_whose_tags_do_not_match,
    a_plan_default_selector_applies_unless_the_action_sets_one,
    malformed_scheduling_settings_are_refused_and_store_nothing,
    a_high_priority_action_overtakes_a_10000_job_backlog,
    a_concurrency_key_of_2_never_has_3_running,
    a_saturated_concurrency_key_does_not_hold_up_other_jobs,
    an_actions_own_max_running_holds_beside_a_larger_limit_on_the_same_key,
    retry_job_may_change_a_jobs_priority,
    scheduling_settings_and_running_counts_survive_a_restart,
    queue_stats_break_down_by_priority_and_pool_and_count_idle_workers_apart,
    queue_stats_list_only_the_deepest_pools,
}

/// `n` inputs `{n: i}`.
fn inputs(n: usize) -> Vec<ActionInput> {
    (0..n)
        .map(|i| ActionInput {
            values: [("n".to_string(), i.to_string())].into_iter().collect(),
        })
        .collect()
}

async fn put_plan(s: &TestServer, p: pb::Plan) {
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .expect("submit plan");
}

/// Submits `req` and returns its job ids.
async fn submit(s: &TestServer, req: SubmitActionRequest) -> Vec<String> {
    s.actions()
        .await
        .submit_action(req)
        .await
        .expect("submit action")
        .into_inner()
        .job_ids
}

fn action(plan_id: &str, id: &str, n: usize) -> SubmitActionRequest {
    SubmitActionRequest {
        action_id: id.into(),
        plan_id: plan_id.into(),
        inputs: inputs(n),
        ..Default::default()
    }
}

async fn action_status(s: &TestServer, id: &str) -> pb::ActionStatus {
    s.actions()
        .await
        .get_action(pb::GetActionRequest {
            action_id: id.into(),
        })
        .await
        .expect("get action")
        .into_inner()
        .action
        .unwrap()
}

fn job_of(l: &pb::JobLease) -> &pb::Job {
    l.job.as_ref().expect("a lease carries its job")
}

async fn a_selector_keeps_jobs_off_workers_whose_tags_do_not_match(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("train", &["python3"])).await;
    let mut plain = SimWorker::start(&s, "w-cpu", &["python3"], 4).await;
    let mut spot = SimWorker::start_tagged(
        &s,
        "w-spot-gpu",
        &["python3"],
        4,
        &[("gpu", "true"), ("spot", "")],
    )
    .await;

    let ids = submit(
        &s,
        SubmitActionRequest {
            worker_selector: "gpu=true, !spot".into(),
            ..action("train", "a-gpu", 3)
        },
    )
    .await;
    assert!(plain.lease_within(800).await.is_none(), "untagged worker");
    assert!(spot.lease_within(200).await.is_none(), "a spot worker");
    let j = job(&s, &ids[0]).await;
    assert_eq!(j.status, JobStatus::Pending as i32);
    assert!(
        j.waiting_reason
            .contains("worker selector `gpu=true, !spot`"),
        "{}",
        j.waiting_reason
    );
    let a = action_status(&s, "a-gpu").await;
    assert_eq!(a.worker_selector, "gpu=true, !spot");

    // A matching worker joins: it gets all three, the others none.
    let mut gpu = SimWorker::start_tagged(
        &s,
        "w-gpu",
        &["python3"],
        4,
        &[("gpu", "true"), ("region", "eu")],
    )
    .await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let l = gpu.lease().await;
        got.push(job_of(&l).job_id.clone());
        gpu.complete(&l).await;
    }
    got.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(got, want);
    assert!(plain.lease_within(200).await.is_none());
    assert!(spot.lease_within(100).await.is_none());

    // A job with no selector runs anywhere, the matching worker included.
    submit(&s, action("train", "a-any", 1)).await;
    let any = tokio::select! {
        l = plain.lease() => l,
        l = spot.lease() => l,
        l = gpu.lease() => l,
    };
    assert_eq!(job_of(&any).action_id, "a-any");
}

async fn a_plan_default_selector_applies_unless_the_action_sets_one(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut p = plan("render", &["blender"]);
    p.worker_selector = "region   in (eu,us)".into();
    put_plan(&s, p).await;
    let stored = s
        .plans()
        .await
        .get_plan(pb::GetPlanRequest {
            plan_id: "render".into(),
            version: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .plan
        .unwrap();
    assert_eq!(
        stored.worker_selector, "region in (eu, us)",
        "canonical form"
    );

    let mut asia =
        SimWorker::start_tagged(&s, "w-asia", &["blender"], 1, &[("region", "asia")]).await;
    submit(&s, action("render", "a-default", 1)).await;
    assert!(asia.lease_within(800).await.is_none());
    assert_eq!(
        action_status(&s, "a-default").await.worker_selector,
        "region in (eu, us)"
    );
    // The action's own selector replaces the plan's default.
    submit(
        &s,
        SubmitActionRequest {
            worker_selector: "region=asia".into(),
            ..action("render", "a-own", 1)
        },
    )
    .await;
    let l = asia.lease().await;
    assert_eq!(job_of(&l).action_id, "a-own");
}

async fn malformed_scheduling_settings_are_refused_and_store_nothing(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    let bad = [
        SubmitActionRequest {
            worker_selector: "gpu in (a".into(),
            ..action("p", "bad-1", 1)
        },
        SubmitActionRequest {
            worker_selector: "gpu=true,".into(),
            ..action("p", "bad-2", 1)
        },
        SubmitActionRequest {
            priority: 1001,
            ..action("p", "bad-3", 1)
        },
        SubmitActionRequest {
            concurrency_key: "db".into(),
            ..action("p", "bad-4", 1)
        },
        SubmitActionRequest {
            max_running: 2,
            ..action("p", "bad-5", 1)
        },
        SubmitActionRequest {
            concurrency_key: "has space".into(),
            max_running: 2,
            ..action("p", "bad-6", 1)
        },
    ];
    for req in bad {
        let id = req.action_id.clone();
        let err = s.actions().await.submit_action(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{id}: {err:?}");
    }
    let mut p = plan("q", &["true"]);
    p.worker_selector = "a notin ()".into();
    let err = s
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let listed = s
        .actions()
        .await
        .list_actions(pb::ListActionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.actions.is_empty(), "{:?}", listed.actions);
    let plans = s
        .plans()
        .await
        .list_plans(pb::ListPlansRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(plans.plan_ids, vec!["p".to_string()]);
}

async fn a_high_priority_action_overtakes_a_10000_job_backlog(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    submit(&s, action("p", "backlog", 10_000)).await;
    let mut w = SimWorker::start(&s, "w1", &["true"], 1).await;
    // The backlog is flowing when the urgent action arrives.
    for _ in 0..5 {
        let l = w.lease().await;
        assert_eq!(job_of(&l).action_id, "backlog");
        w.complete(&l).await;
    }
    let urgent = submit(
        &s,
        SubmitActionRequest {
            priority: 10,
            ..action("p", "urgent", 10)
        },
    )
    .await;
    assert_eq!(job(&s, &urgent[0]).await.priority, 10);
    let mut backlog_after = 0;
    let mut urgent_done = 0;
    while urgent_done < urgent.len() {
        let l = w.lease().await;
        if job_of(&l).action_id == "urgent" {
            urgent_done += 1;
        } else {
            backlog_after += 1;
        }
        w.complete(&l).await;
        assert!(
            backlog_after < 100,
            "the urgent action waited behind the backlog"
        );
    }
    // One lease was already in flight, and the starvation guard gives the
    // backlog every 20th lease: a handful at most.
    assert!(
        backlog_after <= 2,
        "{backlog_after} backlog jobs went first"
    );
    let a = action_status(&s, "urgent").await;
    assert_eq!((a.priority, a.completed), (10, 10));
}

/// With the guard every 5 leases, a low-priority job older than a stream
/// of high-priority ones is leased 5th; with the guard off, last. An older
/// job still that no worker can run (a tool none has) is passed over: it
/// does not turn the guard off.
// SQLite only: the PostgreSQL claim is FIFO within a priority (no round
// robin among actions, no starvation guard; docs/scaling.md).
#[tokio::test]
async fn the_starvation_guard_bounds_how_long_a_low_priority_job_waits() {
    let store = TestStore::Sqlite;
    for (every, stuck_first, want_position) in [(5u32, false, 5usize), (5, true, 5), (0, false, 31)]
    {
        let dir = tempfile::tempdir().unwrap();
        let cfg = EngineConfig {
            starvation_guard_every: every,
            ..fast_config()
        };
        let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
        put_plan(&s, plan("p", &["true"])).await;
        if stuck_first {
            put_plan(&s, plan("stuck", &["no-such-tool"])).await;
            submit(&s, action("stuck", "stuck", 1)).await;
        }
        let low = submit(
            &s,
            SubmitActionRequest {
                priority: -5,
                ..action("p", "low", 1)
            },
        )
        .await;
        submit(
            &s,
            SubmitActionRequest {
                priority: 5,
                ..action("p", "high", 30)
            },
        )
        .await;
        let waiting = job(&s, &low[0]).await;
        assert!(
            waiting
                .waiting_reason
                .starts_with("no fresh worker has tools [true]"),
            "{}",
            waiting.waiting_reason
        );
        let mut w = SimWorker::start(&s, "w1", &["true"], 1).await;
        let mut position = None;
        for i in 1..=31 {
            let l = w.lease().await;
            if job_of(&l).job_id == low[0] {
                position = Some(i);
            }
            w.complete(&l).await;
        }
        assert_eq!(
            position,
            Some(want_position),
            "guard every {every}, an older job no worker can run: {stuck_first}"
        );
    }
}

// SQLite only: the PostgreSQL claim is FIFO within a priority (no round
// robin among actions, no starvation guard; docs/scaling.md).
#[tokio::test]
async fn actions_of_equal_priority_take_turns_on_one_slot() {
    let store = TestStore::Sqlite;
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    let a_ids = submit(&s, action("p", "big", 50)).await;
    let b_ids = submit(&s, action("p", "small", 5)).await;
    let mut w = SimWorker::start(&s, "w1", &["true"], 1).await;
    let mut order = Vec::new();
    for _ in 0..10 {
        let l = w.lease().await;
        order.push(job_of(&l).action_id.clone());
        w.complete(&l).await;
    }
    let alternating = order.windows(2).all(|p| p[0] != p[1]);
    assert!(alternating, "{order:?}");
    assert_eq!(order.iter().filter(|a| *a == "small").count(), 5);
    // Within each action, submission order.
    let mut seen_a = Vec::new();
    for _ in 0..5 {
        let l = w.lease().await;
        seen_a.push(job_of(&l).job_id.clone());
        w.complete(&l).await;
    }
    assert_eq!(seen_a, a_ids[5..10].to_vec());
    assert_eq!(
        action_status(&s, "small").await.completed,
        b_ids.len() as u32
    );
}

/// Two actions share the key `db` with max_running 2; three workers with
/// three slots each count, on their side, the leases they are running.
/// A long backlog of a concurrency key at its limit, ahead of other jobs
/// of the same priority, keeps none of them from a free slot.
async fn a_saturated_concurrency_key_does_not_hold_up_other_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    submit(
        &s,
        SubmitActionRequest {
            concurrency_key: "k".into(),
            max_running: 1,
            ..action("p", "keyed", 100)
        },
    )
    .await;
    submit(&s, action("p", "free", 3)).await;
    let mut w = SimWorker::start(&s, "w", &["true"], 4).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        match w.lease_within(5_000).await {
            Some(l) => held.push(job_of(&l).action_id.clone()),
            None => break,
        }
    }
    held.sort();
    assert_eq!(
        held,
        ["free", "free", "free", "keyed"],
        "the leases of 4 free slots"
    );
    s.stop().await;
}

/// Two actions share a key with different limits: "wide" (max_running 3,
/// higher priority) and "narrow" (max_running 1). Once a job of "wide"
/// runs, the key runs 1 job, so "narrow"'s job may not start (its own
/// limit applies to its jobs), even when both are picked in one round.
async fn an_actions_own_max_running_holds_beside_a_larger_limit_on_the_same_key(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    submit(
        &s,
        SubmitActionRequest {
            concurrency_key: "k".into(),
            max_running: 3,
            priority: 10,
            ..action("p", "wide", 1)
        },
    )
    .await;
    submit(
        &s,
        SubmitActionRequest {
            concurrency_key: "k".into(),
            max_running: 1,
            ..action("p", "narrow", 1)
        },
    )
    .await;
    // One worker with room for both.
    let mut w = SimWorker::start(&s, "w", &["true"], 2).await;
    let first = w.lease().await;
    assert_eq!(job_of(&first).action_id, "wide");
    if let Some(l) = w.lease_within(1_500).await {
        panic!(
            "{} leased while a job of key k runs, beyond its max_running 1",
            job_of(&l).action_id
        );
    }
    // The key is free again: "narrow"'s job starts.
    w.complete(&first).await;
    let second = w.lease_within(5_000).await.expect("narrow leased");
    assert_eq!(job_of(&second).action_id, "narrow");
    s.stop().await;
}

async fn a_concurrency_key_of_2_never_has_3_running(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    for id in ["migrate-1", "migrate-2"] {
        submit(
            &s,
            SubmitActionRequest {
                concurrency_key: "db".into(),
                max_running: 2,
                ..action("p", id, 12)
            },
        )
        .await;
    }
    let free = submit(&s, action("p", "free", 6)).await;
    let running_db = Arc::new(AtomicU32::new(0));
    let peak_db = Arc::new(AtomicU32::new(0));
    let done = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for n in 0..3 {
        let mut w = SimWorker::start(&s, &format!("w{n}"), &["true"], 3).await;
        let (running_db, peak_db, done) = (running_db.clone(), peak_db.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut held: Vec<pb::JobLease> = Vec::new();
            let mut rounds = 0;
            while done.load(Ordering::SeqCst) < 30 {
                rounds += 1;
                assert!(rounds < 2_000, "bounded");
                if let Some(l) = w.lease_within(30).await {
                    if job_of(&l).action_id.starts_with("migrate") {
                        let now = running_db.fetch_add(1, Ordering::SeqCst) + 1;
                        peak_db.fetch_max(now, Ordering::SeqCst);
                    }
                    held.push(l);
                    continue;
                }
                // Finish the oldest: it stops running before it is reported.
                if !held.is_empty() {
                    let l = held.remove(0);
                    if job_of(&l).action_id.starts_with("migrate") {
                        running_db.fetch_sub(1, Ordering::SeqCst);
                    }
                    w.complete(&l).await;
                    done.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    // While the key is saturated, a waiting job of it says why.
    let mut saw_reason = false;
    for _ in 0..100 {
        let page = s
            .jobs()
            .await
            .list_jobs(pb::ListJobsRequest {
                action_id: "migrate-2".into(),
                status: JobStatus::Pending as i32,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        if let Some(id) = page.job_ids.first() {
            let r = job(&s, id).await.waiting_reason;
            if r.starts_with("concurrency limit of db reached (2 running") {
                saw_reason = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(saw_reason, "no waiting job named the concurrency limit");
    assert_eq!(peak_db.load(Ordering::SeqCst), 2, "the key's peak");
    let free_job = job(&s, &free[0]).await;
    assert_eq!(free_job.status, JobStatus::Completed as i32);
    let a = action_status(&s, "migrate-1").await;
    assert_eq!((a.concurrency_key.as_str(), a.max_running), ("db", 2));
    assert_eq!(a.completed, 12);
    assert_eq!(action_status(&s, "migrate-2").await.completed, 12);
}

async fn retry_job_may_change_a_jobs_priority(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    let first = submit(
        &s,
        SubmitActionRequest {
            max_attempts: 1,
            ..action("p", "a", 1)
        },
    )
    .await;
    let mut w = SimWorker::start(&s, "w1", &["true"], 1).await;
    let l = w.lease().await;
    w.report(&l, JobStatus::Failed).await.unwrap();
    eventually(5, "dead", || async {
        job(&s, &first[0]).await.status == JobStatus::Dead as i32
    })
    .await;
    w.disconnect();
    let queued = submit(&s, action("p", "b", 20)).await;
    let err = s
        .jobs()
        .await
        .retry_job(pb::RetryJobRequest {
            job_id: first[0].clone(),
            priority: Some(-1001),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(
        job(&s, &first[0]).await.status,
        JobStatus::Dead as i32,
        "a refused retry changes nothing"
    );
    let retried = s
        .jobs()
        .await
        .retry_job(pb::RetryJobRequest {
            job_id: first[0].clone(),
            priority: Some(7),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(retried.priority, 7);
    assert_eq!(
        action_status(&s, "a").await.priority,
        0,
        "the action keeps its own"
    );
    let mut w = SimWorker::start(&s, "w2", &["true"], 1).await;
    let l = w.lease().await;
    assert_eq!(job_of(&l).job_id, first[0], "the retried job goes first");
    assert_eq!(job_of(&l).priority, 7);
    let _ = queued;
}

async fn scheduling_settings_and_running_counts_survive_a_restart(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let s = TestServer::start_store(store, &db, fast_config()).await;
    let backing = s.backing.clone();
    put_plan(&s, plan("p", &["true"])).await;
    submit(
        &s,
        SubmitActionRequest {
            priority: 3,
            worker_selector: "pool=batch".into(),
            concurrency_key: "k".into(),
            max_running: 1,
            ..action("p", "a", 3)
        },
    )
    .await;
    let mut w = SimWorker::start_tagged(&s, "w1", &["true"], 3, &[("pool", "batch")]).await;
    let held = w.lease().await;
    assert!(w.lease_within(500).await.is_none(), "max_running 1");
    w.disconnect();
    let addr = s.addr;
    s.stop().await;

    // The same address, so the worker's client reconnects as agw would.
    let s = TestServer::start_on_with(
        &backing,
        fast_config(),
        Authenticator::default(),
        Some(addr),
    )
    .await;
    let a = action_status(&s, "a").await;
    assert_eq!(
        (
            a.priority,
            a.worker_selector.as_str(),
            a.concurrency_key.as_str(),
            a.max_running
        ),
        (3, "pool=batch", "k", 1)
    );
    // The loaded lease still counts against the key: the worker comes
    // back with it, and nothing else of the key starts.
    w.connect(Some(vec![held.lease_id.clone()])).await;
    let mut other = SimWorker::start(&s, "w-untagged", &["true"], 3).await;
    assert!(
        w.lease_within(800).await.is_none(),
        "limit held across the restart"
    );
    assert!(
        other.lease_within(100).await.is_none(),
        "selector held across the restart"
    );
    w.complete(&held).await;
    let next = w.lease().await;
    assert_eq!(
        (job_of(&next).action_id.as_str(), job_of(&next).priority),
        ("a", 3)
    );
    assert!(w.lease_within(300).await.is_none(), "still max_running 1");
}

/// The server's queue stats (GetQueueStats).
async fn queue_stats(s: &TestServer) -> pb::GetQueueStatsResponse {
    s.queue()
        .await
        .get_queue_stats(pb::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Clients choose selectors, so the pools the queue stats (and the
/// metrics) list are bounded: the 100 with the most jobs, by selector.
async fn queue_stats_list_only_the_deepest_pools(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    for i in 0..105 {
        submit(
            &s,
            SubmitActionRequest {
                worker_selector: format!("pool=p{i:03}"),
                ..action("p", &format!("a{i}"), 1)
            },
        )
        .await;
    }
    submit(
        &s,
        SubmitActionRequest {
            worker_selector: "pool=zz-deep".into(),
            ..action("p", "deep", 3)
        },
    )
    .await;
    let st = queue_stats(&s).await;
    let pools: Vec<&str> = st
        .by_pool
        .iter()
        .map(|p| p.worker_selector.as_str())
        .collect();
    assert_eq!(pools.len(), 100, "{pools:?}");
    assert_eq!(
        pools.last(),
        Some(&"pool=zz-deep"),
        "the deepest pool is listed"
    );
    assert!(
        pools.windows(2).all(|w| w[0] < w[1]),
        "by selector: {pools:?}"
    );
    assert_eq!(st.ready_length, 108, "the totals count every job");
    s.stop().await;
}

async fn queue_stats_break_down_by_priority_and_pool_and_count_idle_workers_apart(
    store: TestStore,
) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("p", &["true"])).await;
    let mut busy = SimWorker::start(&s, "w-busy", &["true"], 1).await;
    let _idle = SimWorker::start(&s, "w-idle", &["other"], 1).await;
    let _draining = SimWorker::start(&s, "w-drain", &["other"], 1).await;
    s.workers()
        .await
        .drain_worker(pb::DrainWorkerRequest {
            worker_id: "w-drain".into(),
        })
        .await
        .unwrap();
    submit(&s, action("p", "a", 3)).await;
    let held = busy.lease().await;
    assert_eq!(job_of(&held).action_id, "a");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let gpu = submit(
        &s,
        SubmitActionRequest {
            priority: 5,
            worker_selector: "gpu=true".into(),
            ..action("p", "b", 2)
        },
    )
    .await;
    submit(
        &s,
        SubmitActionRequest {
            priority: -1,
            run_at: Some(prost_types::Timestamp {
                seconds: (std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs()
                    + 86_400) as i64,
                nanos: 0,
            }),
            ..action("p", "c", 1)
        },
    )
    .await;

    let st = queue_stats(&s).await;
    assert_eq!(
        (st.ready_length, st.scheduled_length, st.running_length),
        (4, 1, 1)
    );
    assert!(st.oldest_ready_age_secs >= 1, "{st:?}");
    assert_eq!(st.newest_job_age_secs, 0, "{st:?}");
    assert_eq!(
        (
            st.workers_total,
            st.workers_active,
            st.workers_idle,
            st.workers_draining,
            st.workers_quarantined,
            st.workers_stale
        ),
        (3, 1, 1, 1, 0, 0),
        "idle workers are not a subset of active ones"
    );
    let by_priority: Vec<_> = st
        .by_priority
        .iter()
        .map(|p| {
            (
                p.priority,
                p.ready_length,
                p.scheduled_length,
                p.running_length,
            )
        })
        .collect();
    assert_eq!(by_priority, vec![(5, 2, 0, 0), (0, 2, 0, 1), (-1, 0, 1, 0)]);
    let by_pool: Vec<_> = st
        .by_pool
        .iter()
        .map(|p| {
            (
                p.worker_selector.as_str(),
                p.ready_length,
                p.scheduled_length,
                p.running_length,
                p.workers_matching,
            )
        })
        .collect();
    assert_eq!(by_pool, vec![("", 2, 1, 1, 2), ("gpu=true", 2, 0, 0, 0)]);

    // PeekQueue lists the ready queue by priority.
    let peek = s
        .queue()
        .await
        .peek_queue(pb::PeekQueueRequest {
            queue: "ready".into(),
            count: 3,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(peek.job_ids[..2], gpu[..]);

    // The specification's metric names.
    assert_eq!(common::metric(&s, "agq_workers_active").await, 1.0);
    assert_eq!(common::metric(&s, "agq_workers_idle").await, 1.0);
    assert_eq!(
        common::metric(&s, "agq_queue_length{queue=\"ready\"}").await,
        4.0
    );
    assert_eq!(
        common::metric(&s, "agq_jobs_total{status=\"pending\"}").await,
        6.0
    );
    assert_eq!(
        common::metric(&s, "agq_jobs_current{status=\"running\"}").await,
        1.0
    );
    assert_eq!(
        common::metric(
            &s,
            "agq_pool_queue_length{queue=\"ready\",worker_selector=\"gpu=true\"}"
        )
        .await,
        2.0
    );
    assert_eq!(
        common::metric(
            &s,
            "agq_pool_queue_length{queue=\"scheduled\",worker_selector=\"\"}"
        )
        .await,
        1.0
    );
}

/// A round-robin turn of 3 leases (`--round-robin-quantum 3`): on one
/// slot, three jobs of one action, then three of the other.
// SQLite only: the PostgreSQL claim is FIFO within a priority (no round
// robin among actions, no starvation guard; docs/scaling.md).
#[tokio::test]
async fn a_longer_round_robin_turn_keeps_an_actions_jobs_together() {
    let store = TestStore::Sqlite;
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        round_robin_quantum: 3,
        ..fast_config()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await;
    put_plan(&s, plan("p", &["true"])).await;
    submit(&s, action("p", "a", 9)).await;
    submit(&s, action("p", "b", 9)).await;
    let mut w = SimWorker::start(&s, "w1", &["true"], 1).await;
    let mut order = String::new();
    for _ in 0..12 {
        let l = w.lease().await;
        order.push_str(&job_of(&l).action_id);
        w.complete(&l).await;
    }
    assert_eq!(order, "aaabbbaaabbb");
}
