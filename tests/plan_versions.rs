//! Plan versions (issue 20): SubmitPlan with `replace` stores a new
//! version, GetPlan fetches the latest or any version, ListPlans shows the
//! latest, ListPlanVersions lists them newest first; pending, running,
//! retried and restarted jobs keep running the version they were created
//! with; DeletePlan removes every version. Bad input gets a precise code
//! and changes nothing.

mod common;

use agq::pb::*;
use common::*;
use tonic::{transport::Channel, Code};

store_tests! {
    replace_stores_a_new_version_and_get_fetches_either,
    list_plan_versions_refuses_bad_requests,
    a_pending_job_keeps_its_version,
    running_failed_and_retried_jobs_keep_their_version,
    versions_survive_a_restart,
    delete_removes_every_version,
}

type Plans = plan_service_client::PlanServiceClient<Channel>;

/// A plan whose tasks run `cmds` in order, described as `desc`.
fn described(id: &str, cmds: &[&str], desc: &str) -> Plan {
    Plan {
        plan_description: desc.into(),
        ..plan(id, cmds)
    }
}

/// SubmitPlan of `p`, with `replace`.
async fn submit_plan(
    plans: &mut Plans,
    p: Plan,
    replace: bool,
) -> Result<SubmitPlanResponse, tonic::Status> {
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace,
        })
        .await
        .map(|r| r.into_inner())
}

/// GetPlan of `id` at `version` (0: the latest).
async fn get_plan(plans: &mut Plans, id: &str, version: u32) -> Result<Plan, tonic::Status> {
    plans
        .get_plan(GetPlanRequest {
            plan_id: id.into(),
            version,
        })
        .await
        .map(|r| r.into_inner().plan.unwrap())
}

/// Every version number of `id`, newest first, fetched `page_size` at a
/// time.
async fn versions(plans: &mut Plans, id: &str, page_size: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut page_token = String::new();
    loop {
        let r = plans
            .list_plan_versions(ListPlanVersionsRequest {
                plan_id: id.into(),
                page_size,
                page_token,
            })
            .await
            .expect("ListPlanVersions")
            .into_inner();
        out.extend(r.versions.iter().map(|v| v.version));
        if r.next_page_token.is_empty() {
            return out;
        }
        page_token = r.next_page_token;
    }
}

/// An action of one job (input `n=0`) of the plan's latest version;
/// returns (action_id, job_id).
async fn one_job(s: &TestServer, plan_id: &str, max_attempts: u32) -> (String, String) {
    let r = s
        .actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: plan_id.into(),
            inputs: vec![ActionInput {
                values: [("n".to_string(), "0".to_string())].into(),
            }],
            max_attempts,
            ..Default::default()
        })
        .await
        .expect("SubmitAction")
        .into_inner();
    (r.action_id, r.job_ids[0].clone())
}

/// The commands of a lease's plan and its version.
fn lease_plan(l: &JobLease) -> (Vec<String>, u32) {
    let p = l.plan.as_ref().expect("lease without plan");
    (
        p.tasks.iter().map(|t| t.command.clone()).collect(),
        p.version,
    )
}

fn job_id(l: &JobLease) -> &str {
    &l.job.as_ref().unwrap().job_id
}

async fn replace_stores_a_new_version_and_get_fetches_either(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    let v1 = described("p", &["cat"], "first");
    let v2 = described("p", &["cat", "sort"], "second");

    // The first submission is version 1; a version the client sends is
    // ignored (it is the server's).
    let r = submit_plan(
        &mut plans,
        Plan {
            version: 77,
            ..v1.clone()
        },
        false,
    )
    .await
    .unwrap();
    assert_eq!((r.plan_id.as_str(), r.version, r.created), ("p", 1, true));

    // Without replace an existing id is refused, identical or not, and
    // nothing changes.
    for p in [v1.clone(), v2.clone()] {
        let e = submit_plan(&mut plans, p, false).await.unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
        assert!(e.message().contains("replace"), "{}", e.message());
    }
    assert_eq!(versions(&mut plans, "p", 0).await, [1]);

    // With replace a changed plan is the next version.
    let r = submit_plan(&mut plans, v2.clone(), true).await.unwrap();
    assert_eq!((r.version, r.created), (2, true));
    let want_v1 = Plan {
        version: 1,
        ..v1.clone()
    };
    let want_v2 = Plan {
        version: 2,
        ..v2.clone()
    };
    assert_eq!(get_plan(&mut plans, "p", 0).await.unwrap(), want_v2);
    assert_eq!(get_plan(&mut plans, "p", 2).await.unwrap(), want_v2);
    assert_eq!(get_plan(&mut plans, "p", 1).await.unwrap(), want_v1);
    let e = get_plan(&mut plans, "p", 3).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("no version 3"), "{}", e.message());
    let e = get_plan(&mut plans, "nope", 1).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = get_plan(&mut plans, "no/such", 1).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Replacing with the same content stores nothing: the answer names
    // the latest version, and repeating it is harmless.
    for _ in 0..2 {
        let r = submit_plan(&mut plans, v2.clone(), true).await.unwrap();
        assert_eq!((r.version, r.created), (2, false));
    }
    // Only the description changed: that is a change.
    let v3 = described("p", &["cat", "sort"], "third");
    let r = submit_plan(&mut plans, v3.clone(), true).await.unwrap();
    assert_eq!((r.version, r.created), (3, true));

    // A bad plan with replace is refused and stores nothing.
    let mut bad = v3.clone();
    bad.tasks[0].timeout_secs = 0;
    let e = submit_plan(&mut plans, bad, true).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(get_plan(&mut plans, "p", 0).await.unwrap().version, 3);

    // Replace on a new id stores version 1.
    let r = submit_plan(&mut plans, described("q", &["tr"], "q"), true)
        .await
        .unwrap();
    assert_eq!((r.plan_id.as_str(), r.version, r.created), ("q", 1, true));

    // ListPlans shows each plan with its latest version.
    let l = plans
        .list_plans(ListPlansRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(l.plan_ids, ["p", "q"]);
    let summary: Vec<_> = l
        .plans
        .iter()
        .map(|p| (p.plan_id.as_str(), p.version, p.plan_description.as_str()))
        .collect();
    assert_eq!(summary, [("p", 3, "third"), ("q", 1, "q")]);
    let p = &l.plans[0];
    let (created, updated) = (p.created_at.unwrap(), p.updated_at.unwrap());
    assert!(
        (created.seconds, created.nanos) <= (updated.seconds, updated.nanos),
        "{created:?} > {updated:?}"
    );

    // ListPlanVersions: newest first, with descriptions, task counts and
    // times; the same over pages of one.
    let all = plans
        .list_plan_versions(ListPlanVersionsRequest {
            plan_id: "p".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(all.next_page_token.is_empty());
    let rows: Vec<_> = all
        .versions
        .iter()
        .map(|v| (v.version, v.plan_description.as_str(), v.task_count))
        .collect();
    assert_eq!(rows, [(3, "third", 2), (2, "second", 2), (1, "first", 1)]);
    assert!(all.versions.iter().all(|v| v.created_at.is_some()));
    assert_eq!(versions(&mut plans, "p", 1).await, [3, 2, 1]);
    s.stop().await;
}

async fn list_plan_versions_refuses_bad_requests(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    for (id, cmd) in [("p", "cat"), ("p", "sort"), ("q", "cat"), ("q", "sort")] {
        submit_plan(&mut plans, plan(id, &[cmd]), true)
            .await
            .unwrap();
    }
    let first = plans
        .list_plan_versions(ListPlanVersionsRequest {
            plan_id: "p".into(),
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.versions.len(), 1);
    assert!(!first.next_page_token.is_empty());
    let cases = [
        ("unknown plan", "nope", 0, String::new(), Code::NotFound),
        ("bad id", "no/such", 0, String::new(), Code::InvalidArgument),
        ("empty id", "", 0, String::new(), Code::InvalidArgument),
        (
            "page too big",
            "p",
            5000,
            String::new(),
            Code::InvalidArgument,
        ),
        ("garbage token", "p", 0, "zz".into(), Code::InvalidArgument),
        (
            "another plan's token",
            "q",
            0,
            first.next_page_token.clone(),
            Code::InvalidArgument,
        ),
    ];
    for (what, id, page_size, page_token, code) in cases {
        let e = plans
            .list_plan_versions(ListPlanVersionsRequest {
                plan_id: id.into(),
                page_size,
                page_token,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{what}: {e:?}");
    }
    // A ListPlans token is no ListPlanVersions token.
    let lp = plans
        .list_plans(ListPlansRequest {
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let e = plans
        .list_plan_versions(ListPlanVersionsRequest {
            plan_id: "p".into(),
            page_size: 1,
            page_token: lp.next_page_token,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    s.stop().await;
}

/// A pending job created under version 1 and leased after version 2 was
/// stored runs version 1's tasks, routed on version 1's tools; new jobs
/// run version 2.
async fn a_pending_job_keeps_its_version(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    submit_plan(&mut plans, plan("p", &["cat"]), false)
        .await
        .unwrap();
    let (a1, j1) = one_job(&s, "p", 3).await;
    submit_plan(&mut plans, plan("p", &["sort"]), true)
        .await
        .unwrap();
    let (a2, j2) = one_job(&s, "p", 3).await;
    assert_eq!(job(&s, &j1).await.plan_version, 1);
    assert_eq!(job(&s, &j2).await.plan_version, 2);
    let mut actions = s.actions().await;
    for (a, v) in [(&a1, 1), (&a2, 2)] {
        let st = actions
            .get_action(GetActionRequest {
                action_id: a.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .action
            .unwrap();
        assert_eq!(st.plan_version, v, "{a}");
    }

    // A worker with only `cat` runs the version 1 job and not the other.
    let mut cat = SimWorker::start(&s, "cat-only", &["cat"], 2).await;
    let l = cat.lease().await;
    assert_eq!(job_id(&l), j1);
    assert_eq!(lease_plan(&l), (vec!["cat".to_string()], 1));
    assert_eq!(l.job.as_ref().unwrap().plan_version, 1);
    assert!(cat.lease_within(300).await.is_none(), "v2 needs sort");
    let waiting = job(&s, &j2).await.waiting_reason;
    assert!(waiting.contains("[sort]"), "{waiting}");
    cat.complete(&l).await;

    let mut sort = SimWorker::start(&s, "sort-only", &["sort"], 1).await;
    let l = sort.lease().await;
    assert_eq!(job_id(&l), j2);
    assert_eq!(lease_plan(&l), (vec!["sort".to_string()], 2));
    sort.complete(&l).await;
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// A running job keeps its version through a replacement, its next
/// attempt after a failure, and a RetryJob after it went dead (which reads
/// the old version back from the database).
async fn running_failed_and_retried_jobs_keep_their_version(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    submit_plan(&mut plans, plan("p", &["cat"]), false)
        .await
        .unwrap();
    let mut w = SimWorker::start(&s, "w", &["cat", "sort", "tr"], 1).await;
    let (_, j) = one_job(&s, "p", 2).await;
    let l = w.lease().await;
    assert_eq!(lease_plan(&l), (vec!["cat".to_string()], 1));

    // Replaced while it runs: the running attempt is untouched and the
    // next attempt still runs version 1.
    submit_plan(&mut plans, plan("p", &["sort"]), true)
        .await
        .unwrap();
    w.report(&l, JobStatus::Failed).await.unwrap();
    let l = w.lease().await;
    assert_eq!(job_id(&l), j);
    assert_eq!(l.attempt, 2);
    assert_eq!(lease_plan(&l), (vec!["cat".to_string()], 1));
    w.report(&l, JobStatus::Failed).await.unwrap();
    eventually(5, "the job is dead", || async {
        job(&s, &j).await.status == JobStatus::Dead as i32
    })
    .await;

    // Another version later, then RetryJob: still version 1.
    submit_plan(&mut plans, plan("p", &["tr"]), true)
        .await
        .unwrap();
    let retried = s
        .jobs()
        .await
        .retry_job(RetryJobRequest {
            job_id: j.clone(),
            priority: None,
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(retried.plan_version, 1);
    let l = w.lease().await;
    assert_eq!(job_id(&l), j);
    assert_eq!(lease_plan(&l), (vec!["cat".to_string()], 1));
    w.complete(&l).await;
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// Versions are durable: after a restart a pending job of version 1 still
/// runs version 1, and GetPlan serves both versions.
async fn versions_survive_a_restart(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let s = TestServer::start_store(store, &db, fast_config()).await;
    let backing = s.backing.clone();
    let mut plans = s.plans().await;
    submit_plan(&mut plans, plan("p", &["cat"]), false)
        .await
        .unwrap();
    let (_, j1) = one_job(&s, "p", 3).await;
    submit_plan(&mut plans, plan("p", &["sort"]), true)
        .await
        .unwrap();
    let (_, j2) = one_job(&s, "p", 3).await;
    drop(plans);
    s.stop().await;

    let s = TestServer::start_on(&backing, fast_config()).await;
    let mut plans = s.plans().await;
    assert_eq!(get_plan(&mut plans, "p", 0).await.unwrap().version, 2);
    assert_eq!(
        get_plan(&mut plans, "p", 1).await.unwrap().tasks[0].command,
        "cat"
    );
    let mut w = SimWorker::start(&s, "w", &["cat", "sort"], 2).await;
    let mut got = vec![w.lease().await, w.lease().await];
    got.sort_by_key(|l| l.job.as_ref().unwrap().job_id.clone());
    let mut want = vec![
        (j1.clone(), vec!["cat".to_string()], 1),
        (j2.clone(), vec!["sort".to_string()], 2),
    ];
    want.sort();
    let seen: Vec<_> = got
        .iter()
        .map(|l| {
            let (cmds, v) = lease_plan(l);
            (job_id(l).to_string(), cmds, v)
        })
        .collect();
    assert_eq!(seen, want);
    for l in &got {
        w.complete(l).await;
    }
    // A new version after the restart continues the count.
    let r = submit_plan(&mut plans, plan("p", &["tr"]), true)
        .await
        .unwrap();
    assert_eq!(r.version, 3);
    assert_nothing_stranded(&s).await;
    s.stop().await;
}

/// DeletePlan is refused while a job of any version is open, then
/// removes every version; the id starts again at version 1.
async fn delete_removes_every_version(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    submit_plan(&mut plans, plan("p", &["cat"]), false)
        .await
        .unwrap();
    let (_, j1) = one_job(&s, "p", 3).await;
    submit_plan(&mut plans, plan("p", &["sort"]), true)
        .await
        .unwrap();
    // Only version 1 has an open job: the plan is still in use.
    let e = plans
        .delete_plan(DeletePlanRequest {
            plan_id: "p".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(versions(&mut plans, "p", 0).await, [2, 1]);
    s.jobs()
        .await
        .cancel_job(CancelJobRequest { job_id: j1 })
        .await
        .unwrap();
    plans
        .delete_plan(DeletePlanRequest {
            plan_id: "p".into(),
        })
        .await
        .unwrap();
    for v in [0, 1, 2] {
        let e = get_plan(&mut plans, "p", v).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "version {v}");
    }
    let e = plans
        .list_plan_versions(ListPlanVersionsRequest {
            plan_id: "p".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let r = submit_plan(&mut plans, plan("p", &["tr"]), false)
        .await
        .unwrap();
    assert_eq!((r.version, r.created), (1, true));
    assert_eq!(versions(&mut plans, "p", 0).await, [1]);
    s.stop().await;
}
