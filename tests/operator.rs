//! The operator's API (AGQ additions): ListActions with its filters and
//! paging, CancelAction, RetryAction and ForgetWorker, through real
//! servers and the generated clients.

mod common;

use std::{collections::HashSet, time::Duration};

use agq::{config::EngineConfig, pb::*};
use common::*;
use tonic::Code;

/// Every page of `req` (page size 2), concatenated; panics after 50 pages.
async fn all_pages(s: &TestServer, mut req: ListActionsRequest) -> Vec<ActionStatus> {
    let mut actions = s.actions().await;
    req.page_size = 2;
    let mut out = Vec::new();
    for _ in 0..50 {
        let r = actions
            .list_actions(req.clone())
            .await
            .expect("list actions")
            .into_inner();
        assert!(r.actions.len() <= 2, "a page holds at most page_size");
        out.extend(r.actions);
        if r.next_page_token.is_empty() {
            return out;
        }
        req.page_token = r.next_page_token;
    }
    panic!("more than 50 pages");
}

fn ids(a: &[ActionStatus]) -> Vec<String> {
    a.iter().map(|a| a.action_id.clone()).collect()
}

fn ms(t: &Option<prost_types::Timestamp>) -> i64 {
    let t = t.as_ref().expect("timestamp");
    t.seconds * 1000 + i64::from(t.nanos) / 1_000_000
}

#[tokio::test]
async fn list_actions_filters_orders_newest_first_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let mut actions = s.actions().await;
    // Submission order: 4 actions of "idle-a" (no worker has the tool:
    // their jobs stay pending), 2 of "idle-b", one of "dies" whose job a
    // worker fails into the dead letter.
    let mut submitted = Vec::new();
    for _ in 0..4 {
        submitted.push(submit(&s, plan("idle-a", &["idle"]), 2, 3).await.0);
    }
    let mut of_b = Vec::new();
    for _ in 0..2 {
        let id = submit(&s, plan("idle-b", &["idle"]), 1, 3).await.0;
        of_b.push(id.clone());
        submitted.push(id);
    }
    let mut w = SimWorker::start(&s, "lw", &["die"], 1).await;
    let (dead_action, dead_jobs) = submit(&s, plan("dies", &["die"]), 1, 1).await;
    submitted.push(dead_action.clone());
    let l = w.lease().await;
    w.report(&l, JobStatus::Failed).await.unwrap();
    assert_eq!(job(&s, &dead_jobs[0]).await.status, JobStatus::Dead as i32);
    // One action of "idle-a" finished by cancelling it.
    let cancelled_action = submitted[1].clone();
    actions
        .cancel_action(CancelActionRequest {
            action_id: cancelled_action.clone(),
        })
        .await
        .unwrap();

    let newest_first: Vec<String> = submitted.iter().rev().cloned().collect();
    let all = all_pages(&s, ListActionsRequest::default()).await;
    assert_eq!(ids(&all), newest_first, "every action once, newest first");
    let one_page = actions
        .list_actions(ListActionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(&one_page.actions), newest_first);
    assert!(one_page.next_page_token.is_empty());
    // The aggregate of each action is its GetAction.
    for a in &all {
        let got = actions
            .get_action(GetActionRequest {
                action_id: a.action_id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .action
            .unwrap();
        assert_eq!(&got, a);
    }

    let plan_b = all_pages(
        &s,
        ListActionsRequest {
            plan_id: "idle-b".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&plan_b), of_b.iter().rev().cloned().collect::<Vec<_>>());

    let by_state = |state: ActionState| {
        let s = &s;
        async move {
            ids(&all_pages(
                s,
                ListActionsRequest {
                    state: state as i32,
                    ..Default::default()
                },
            )
            .await)
        }
    };
    let finished = vec![dead_action.clone(), cancelled_action.clone()];
    let open: Vec<String> = newest_first
        .iter()
        .filter(|id| !finished.contains(id))
        .cloned()
        .collect();
    assert_eq!(by_state(ActionState::Open).await, open);
    assert_eq!(by_state(ActionState::Finished).await, finished);
    assert_eq!(by_state(ActionState::HasDead).await, vec![dead_action]);
    let open_of_a = all_pages(
        &s,
        ListActionsRequest {
            plan_id: "idle-a".into(),
            state: ActionState::Open as i32,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(open_of_a.len(), 3, "{open_of_a:?}");

    // A time range splits the listing at the creation time of an action.
    let pivot = all[3].created_at;
    let after = all_pages(
        &s,
        ListActionsRequest {
            created_after: pivot,
            ..Default::default()
        },
    )
    .await;
    let before = all_pages(
        &s,
        ListActionsRequest {
            created_before: pivot,
            ..Default::default()
        },
    )
    .await;
    let pivot_ms = ms(&pivot);
    assert!(after.iter().all(|a| ms(&a.created_at) >= pivot_ms));
    assert!(before.iter().all(|a| ms(&a.created_at) < pivot_ms));
    assert!(ids(&after).contains(&all[3].action_id));
    let mut joined = ids(&after);
    joined.extend(ids(&before));
    assert_eq!(joined, newest_first, "the two halves make the whole");

    // Bad requests: precise codes.
    let bad = [
        ListActionsRequest {
            page_size: 1001,
            ..Default::default()
        },
        ListActionsRequest {
            page_token: "not-a-token".into(),
            ..Default::default()
        },
        ListActionsRequest {
            state: 99,
            ..Default::default()
        },
        ListActionsRequest {
            plan_id: "bad plan".into(),
            ..Default::default()
        },
        ListActionsRequest {
            created_after: pivot,
            created_before: pivot,
            ..Default::default()
        },
    ];
    for req in bad {
        let e = actions.list_actions(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{req:?}: {e:?}");
    }
    s.stop().await;
}

#[tokio::test]
async fn cancel_action_cancels_exactly_the_open_jobs_and_tells_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let mut w = SimWorker::start(&s, "cw", &["cat"], 2).await;
    let mut actions = s.actions().await;
    // 4 jobs, 2 slots: two leased, one completed (its slot takes the third),
    // one left pending.
    let (action_id, job_ids) = submit(&s, plan("c", &["cat"]), 4, 3).await;
    let first = w.lease().await;
    let second = w.lease().await;
    w.complete(&second).await;
    let third = w.lease().await;
    let completed = second.job.unwrap().job_id;
    let running: HashSet<String> = [&first, &third]
        .iter()
        .map(|l| l.job.as_ref().unwrap().job_id.clone())
        .collect();

    let r = actions
        .cancel_action(CancelActionRequest {
            action_id: action_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.cancelled, 3);
    let a = r.action.unwrap();
    assert_eq!(
        (a.cancelled, a.completed, a.pending, a.running),
        (3, 1, 0, 0)
    );
    for id in &job_ids {
        let want = if *id == completed {
            JobStatus::Completed
        } else {
            JobStatus::Cancelled
        };
        assert_eq!(job(&s, id).await.status, want as i32, "{id}");
    }
    // The worker is told to stop each running job.
    let mut told = HashSet::new();
    for _ in 0..2 {
        match w.command_within(5000).await {
            Some(heartbeat_response::Command::CancelJobId(id)) => told.insert(id),
            other => panic!("expected a cancel command, got {other:?}"),
        };
    }
    assert_eq!(told, running);

    // Nothing open is left: a second cancel changes nothing.
    let again = actions
        .cancel_action(CancelActionRequest {
            action_id: action_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.cancelled, 0);
    assert_eq!(again.action.unwrap().cancelled, 3);
    for (id, code) in [("nope", Code::NotFound), ("", Code::InvalidArgument)] {
        let e = actions
            .cancel_action(CancelActionRequest {
                action_id: id.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{id:?}");
    }
    s.stop().await;
}

#[tokio::test]
async fn retry_action_retries_exactly_the_matching_jobs() {
    let dir = tempfile::tempdir().unwrap();
    // A failed job waits out a long backoff, so it stays FAILED.
    let cfg = EngineConfig {
        retry_backoff_base: Duration::from_secs(600),
        retry_backoff_max: Duration::from_secs(600),
        ..fast_config()
    };
    let s = TestServer::start(&dir.path().join("agq.db"), cfg).await;
    let mut w = SimWorker::start(&s, "rw", &["cat"], 4).await;
    let mut actions = s.actions().await;
    // One attempt each: two dead, one completed, one still running.
    let (dead_action, _) = submit(&s, plan("r", &["cat"]), 4, 1).await;
    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(w.lease().await);
    }
    let id_of = |l: &JobLease| l.job.as_ref().unwrap().job_id.clone();
    w.report(&leases[0], JobStatus::Failed).await.unwrap();
    w.report(&leases[1], JobStatus::Failed).await.unwrap();
    w.complete(&leases[2]).await;
    let dead: Vec<String> = leases[..2].iter().map(id_of).collect();
    for id in &dead {
        assert_eq!(job(&s, id).await.status, JobStatus::Dead as i32);
    }

    let retry = |action_id: &str, status: JobStatus| RetryActionRequest {
        action_id: action_id.into(),
        status: status as i32,
    };
    // Only failed jobs: there are none here; nothing changes.
    let r = actions
        .retry_action(retry(&dead_action, JobStatus::Failed))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.retried, 0);
    assert_eq!(r.action.unwrap().dead, 2);
    let r = actions
        .retry_action(retry(&dead_action, JobStatus::Dead))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.retried, 2);
    assert_eq!(r.action.unwrap().dead, 0);
    for id in &dead {
        let j = job(&s, id).await;
        assert!(
            [JobStatus::Pending as i32, JobStatus::Running as i32].contains(&j.status),
            "{j:?}"
        );
    }
    assert_eq!(
        job(&s, &id_of(&leases[2])).await.status,
        JobStatus::Completed as i32
    );
    assert_eq!(
        job(&s, &id_of(&leases[3])).await.status,
        JobStatus::Running as i32
    );
    // Finish this action's work so the worker's slots are free again.
    w.complete(&leases[3]).await;
    for _ in 0..2 {
        let l = w.lease().await;
        w.complete(&l).await;
    }

    // Two attempts each: one failed (waiting out the backoff), one completed.
    let (failed_action, _) = submit(&s, plan("r", &["cat"]), 2, 2).await;
    let a = w.lease().await;
    let b = w.lease().await;
    w.report(&a, JobStatus::Failed).await.unwrap();
    w.complete(&b).await;
    assert_eq!(job(&s, &id_of(&a)).await.status, JobStatus::Failed as i32);
    let r = actions
        .retry_action(retry(&failed_action, JobStatus::Dead))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.retried, 0);
    let r = actions
        .retry_action(RetryActionRequest {
            action_id: failed_action.clone(),
            status: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.retried, 1);
    let after = r.action.unwrap();
    assert_eq!((after.failed, after.completed), (0, 1));
    assert_ne!(job(&s, &id_of(&a)).await.status, JobStatus::Failed as i32);

    for (req, code) in [
        (
            retry(&failed_action, JobStatus::Pending),
            Code::InvalidArgument,
        ),
        (
            retry(&failed_action, JobStatus::Completed),
            Code::InvalidArgument,
        ),
        (retry("nope", JobStatus::Dead), Code::NotFound),
        (retry("", JobStatus::Dead), Code::InvalidArgument),
    ] {
        let e = actions.retry_action(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}");
    }
    s.stop().await;
}

#[tokio::test]
async fn forget_worker_refuses_live_workers_and_forgets_departed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let mut workers = s.workers().await;
    let forget = |id: &str| ForgetWorkerRequest {
        worker_id: id.into(),
    };
    let gone = |r: Result<tonic::Response<GetWorkerResponse>, tonic::Status>| {
        r.is_err_and(|e| e.code() == Code::NotFound)
    };

    // ACTIVE, then DRAINING: refused, the worker stays.
    let quits = SimWorker::start(&s, "quits", &["cat"], 1).await;
    let e = workers.forget_worker(forget("quits")).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    workers
        .drain_worker(DrainWorkerRequest {
            worker_id: "quits".into(),
        })
        .await
        .unwrap();
    let e = workers.forget_worker(forget("quits")).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(
        worker(&s, "quits").await.state,
        WorkerState::Draining as i32
    );
    // UNREGISTERED: forgotten.
    workers
        .unregister_worker(UnregisterWorkerRequest {
            worker_id: "quits".into(),
        })
        .await
        .unwrap();
    drop(quits);
    workers.forget_worker(forget("quits")).await.unwrap();
    assert!(gone(
        workers
            .get_worker(GetWorkerRequest {
                worker_id: "quits".into()
            })
            .await
    ));

    // DEAD (stopped heartbeating): forgotten.
    let mut dies = SimWorker::start(&s, "dies", &["cat"], 1).await;
    dies.disconnect();
    eventually(10, "the silent worker is declared DEAD", || {
        let s = &s;
        async move { worker(s, "dies").await.state == WorkerState::Dead as i32 }
    })
    .await;
    workers.forget_worker(forget("dies")).await.unwrap();
    assert!(gone(
        workers
            .get_worker(GetWorkerRequest {
                worker_id: "dies".into()
            })
            .await
    ));
    let listed = workers
        .list_workers(ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert!(listed.is_empty(), "{listed:?}");

    for (id, code) in [
        ("dies", Code::NotFound),
        ("never", Code::NotFound),
        ("", Code::InvalidArgument),
    ] {
        let e = workers.forget_worker(forget(id)).await.unwrap_err();
        assert_eq!(e.code(), code, "{id:?}");
    }
    // A forgotten id may register again.
    let back = SimWorker::start(&s, "dies", &["cat"], 1).await;
    assert_eq!(worker(&s, "dies").await.state, WorkerState::Active as i32);
    drop(back);
    s.stop().await;
}
