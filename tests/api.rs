//! Core service: every RPC's happy path, every validation rule with its
//! exact status code, the auth matrix, and persistence across a restart.
//! Each test runs on SQLite and on PostgreSQL (`sqlite::` and `postgres::`).

mod common;

use std::collections::HashMap;

use agq::{
    auth::{AuthFile, Authenticator, Role, TokenEntry},
    config::EngineConfig,
    pb::*,
};
use common::*;
use tonic::Code;

// Every test runs on both stores: `sqlite::NAME` and `postgres::NAME`.
store_tests! {
    plan_submit_get_list_delete,
    plan_validation_rules,
    submit_action_rejects_bad_requests_and_leaves_no_jobs,
    submit_action_creates_one_pending_job_per_input,
    a_taken_action_id_is_already_exists_and_adds_no_jobs,
    get_job_shows_input_attempts_and_why_it_waits,
    list_jobs_pages_through_an_action,
    cancel_and_retry_follow_the_job_state_rules,
    search_jobs_filters_by_status_plan_and_time,
    run_at_schedules_the_jobs,
    queue_stats_peek_and_metrics_count_ready_and_scheduled_jobs,
    delete_plan_is_refused_while_jobs_are_pending,
    watch_action_streams_until_terminal,
    auth_matrix,
    state_survives_a_restart,
    shutdown_turns_health_not_serving_finishes_calls_and_cuts_held_streams,
    finished_actions_expire_after_the_retention_with_their_jobs,
    a_wrong_finish_stamp_never_deletes_an_open_action,
    job_counts_follow_every_transition_and_a_restart,
    many_reads_of_a_waiting_job_at_once_all_succeed,
}

fn task(n: u32, cmd: &str) -> Task {
    Task {
        task_number: n,
        command: cmd.into(),
        args: vec![],
        timeout_secs: 10,
        input_from_task: None,
        ..Default::default()
    }
}

async fn plan_submit_get_list_delete(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s =
        TestServer::start_store(store, &dir.path().join("agq.db"), EngineConfig::default()).await;
    let mut plans = s.plans().await;
    for id in ["alpha-1", "alpha-2", "alpha-3", "beta.1"] {
        let r = plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan(id, &["sort", "uniq"])),
                replace: false,
            })
            .await
            .unwrap();
        assert_eq!(r.into_inner().plan_id, id);
    }
    let got = plans
        .get_plan(GetPlanRequest {
            plan_id: "alpha-2".into(),
            version: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .plan
        .unwrap();
    assert_eq!(
        got,
        Plan {
            version: 1,
            ..plan("alpha-2", &["sort", "uniq"])
        }
    );

    let all = plans
        .list_plans(ListPlansRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        all.plan_ids,
        vec!["alpha-1", "alpha-2", "alpha-3", "beta.1"]
    );
    assert!(all.next_page_token.is_empty());
    // glob + pagination
    let p1 = plans
        .list_plans(ListPlansRequest {
            pattern: "alpha-*".into(),
            page_size: 2,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p1.plan_ids, vec!["alpha-1", "alpha-2"]);
    assert!(!p1.next_page_token.is_empty());
    let p2 = plans
        .list_plans(ListPlansRequest {
            pattern: "alpha-*".into(),
            page_size: 2,
            page_token: p1.next_page_token,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p2.plan_ids, vec!["alpha-3"]);
    assert!(p2.next_page_token.is_empty());
    let q = plans
        .list_plans(ListPlansRequest {
            pattern: "?eta.[0-9]".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(q.into_inner().plan_ids, vec!["beta.1"]);

    let d = plans
        .delete_plan(DeletePlanRequest {
            plan_id: "alpha-1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.deleted);
    let e = plans
        .get_plan(GetPlanRequest {
            plan_id: "alpha-1".into(),
            version: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = plans
        .delete_plan(DeletePlanRequest {
            plan_id: "alpha-1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    s.stop().await;
}

async fn plan_validation_rules(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s =
        TestServer::start_store(store, &dir.path().join("agq.db"), EngineConfig::default()).await;
    let mut plans = s.plans().await;
    let base = plan("ok", &["cat", "sort"]);
    let mut cases: Vec<(String, Plan)> = Vec::new();
    let mut p = base.clone();
    p.tasks.clear();
    cases.push(("no tasks".into(), p));
    let mut p = base.clone();
    p.tasks = (1..=101).map(|n| task(n, "cat")).collect();
    cases.push(("101 tasks".into(), p));
    let mut p = base.clone();
    p.tasks[0].task_number = 0;
    cases.push(("task_number 0".into(), p));
    let mut p = base.clone();
    p.tasks[1].task_number = 3;
    cases.push(("gap in task numbers".into(), p));
    let mut p = base.clone();
    p.tasks[1].input_from_task = Some(2);
    cases.push(("input_from_task self".into(), p));
    let mut p = base.clone();
    p.tasks[0].input_from_task = Some(2);
    cases.push(("input_from_task forward".into(), p));
    for cmd in [
        "", "/bin/cat", "ca t", "cat;rm", "$(id)", "a|b", "x\0y", "..", "`id`", "a>b",
    ] {
        let mut p = base.clone();
        p.tasks[0].command = cmd.into();
        cases.push((format!("bad command {cmd:?}"), p));
    }
    let mut p = base.clone();
    p.tasks[0].timeout_secs = 0;
    cases.push(("timeout 0".into(), p));
    let mut p = base.clone();
    p.tasks[0].timeout_secs = 86_401;
    cases.push(("timeout too big".into(), p));
    for id in ["", "has space", "a/b", &"x".repeat(129), "ü"] {
        let mut p = base.clone();
        p.plan_id = id.to_string();
        cases.push((format!("bad plan_id {id:?}"), p));
    }
    let mut p = base.clone();
    p.tasks[0].args = vec!["a\0b".into()];
    cases.push(("NUL in arg".into(), p));
    for (what, p) in cases {
        let e = plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(p),
                replace: false,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {}", e.message());
    }
    let e = plans
        .submit_plan(SubmitPlanRequest {
            plan: None,
            replace: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // nothing was written
    let all = plans
        .list_plans(ListPlansRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(all.plan_ids.is_empty(), "{:?}", all.plan_ids);
    // valid, then duplicate
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(base.clone()),
            replace: false,
        })
        .await
        .unwrap();
    let e = plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(base),
            replace: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    // other bad inputs
    let e = plans
        .get_plan(GetPlanRequest {
            plan_id: "no/such".into(),
            version: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = plans
        .list_plans(ListPlansRequest {
            page_size: 5000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = plans
        .list_plans(ListPlansRequest {
            page_token: "zz".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = plans
        .list_plans(ListPlansRequest {
            pattern: "[".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    s.stop().await;
}

// ------------------------------------------- actions, jobs and the queue --

/// Limits of the action tests: at most 50 inputs per action, and a
/// `run_at` horizon of 100 years (the tests schedule in 2096, past the
/// default of 366 days).
fn action_config() -> EngineConfig {
    EngineConfig {
        max_inputs_per_action: 50,
        max_run_at_ahead: std::time::Duration::from_secs(100 * 366 * 86_400),
        ..fast_config()
    }
}

/// A server on `store` with [`action_config`] and the one-task plan `p` stored.
async fn server_with_plan_p(store: TestStore, dir: &tempfile::TempDir) -> TestServer {
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), action_config()).await;
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("p", &["cat"])),
            replace: false,
        })
        .await
        .unwrap();
    s
}

/// Input `i` of the action tests: `file=/tmp/<i>`.
fn input(i: usize) -> ActionInput {
    ActionInput {
        values: HashMap::from([("file".to_string(), format!("/tmp/{i}"))]),
    }
}

/// Submits an action of plan `p` with inputs `0..n`.
async fn submit_p(s: &TestServer, n: usize) -> SubmitActionResponse {
    s.actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: (0..n).map(input).collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// Cancels pending job `id`.
async fn cancel(s: &TestServer, id: &str) -> Job {
    s.jobs()
        .await
        .cancel_job(CancelJobRequest { job_id: id.into() })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
}

/// A time in 2096.
const YEAR_2096: prost_types::Timestamp = prost_types::Timestamp {
    seconds: 4_000_000_000,
    nanos: 0,
};

async fn submit_action_rejects_bad_requests_and_leaves_no_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let mut actions = s.actions().await;
    let mut jobs = s.jobs().await;
    let on_p = |inputs: Vec<ActionInput>| SubmitActionRequest {
        plan_id: "p".into(),
        inputs,
        ..Default::default()
    };
    // (case, request, code, fragment of the message)
    let cases = [
        (
            "unknown plan",
            SubmitActionRequest {
                plan_id: "nope".into(),
                ..on_p(vec![input(0)])
            },
            Code::NotFound,
            "",
        ),
        ("no inputs", on_p(vec![]), Code::InvalidArgument, ""),
        (
            "51 inputs, over the limit of 50 (named)",
            on_p((0..51).map(input).collect()),
            Code::InvalidArgument,
            "50",
        ),
        (
            "max_attempts 101",
            SubmitActionRequest {
                max_attempts: 101,
                ..on_p(vec![input(0)])
            },
            Code::InvalidArgument,
            "",
        ),
        (
            "bad action id",
            SubmitActionRequest {
                action_id: "bad id".into(),
                ..on_p(vec![input(0)])
            },
            Code::InvalidArgument,
            "",
        ),
        (
            "a bad input key after a good input",
            on_p(vec![
                input(0),
                ActionInput {
                    values: HashMap::from([("bad key!".to_string(), "v".to_string())]),
                },
            ]),
            Code::InvalidArgument,
            "",
        ),
        (
            "an input value of 70,000 bytes",
            on_p(vec![ActionInput {
                values: HashMap::from([("k".to_string(), "x".repeat(70_000))]),
            }]),
            Code::InvalidArgument,
            "",
        ),
        (
            "run_at with negative nanos",
            SubmitActionRequest {
                run_at: Some(prost_types::Timestamp {
                    seconds: 1,
                    nanos: -5,
                }),
                ..on_p(vec![input(0)])
            },
            Code::InvalidArgument,
            "",
        ),
    ];
    for (case, req, code, fragment) in cases {
        let e = actions
            .submit_action(req)
            .await
            .expect_err(&format!("{case}: accepted"));
        assert_eq!(e.code(), code, "{case}: {}", e.message());
        assert!(
            e.message().contains(fragment),
            "{case}: the message {:?} lacks {fragment:?}",
            e.message()
        );
        let none = jobs
            .search_jobs(SearchJobsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(
            none.job_ids.is_empty(),
            "{case}: a rejected action left jobs behind"
        );
    }
    s.stop().await;
}

async fn submit_action_creates_one_pending_job_per_input(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    // 5 jobs, server-made id
    let r = submit_p(&s, 5).await;
    assert_eq!(r.jobs_created, 5);
    assert_eq!(r.job_ids.len(), 5);
    assert!(!r.action_id.is_empty());
    let a = s
        .actions()
        .await
        .get_action(GetActionRequest {
            action_id: r.action_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .action
        .unwrap();
    assert_eq!((a.total_jobs, a.pending, a.plan_id.as_str()), (5, 5, "p"));
    assert!(a.completed_jobs_at.is_none());
    s.stop().await;
}

async fn a_taken_action_id_is_already_exists_and_adds_no_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let mut actions = s.actions().await;
    let named = actions
        .submit_action(SubmitActionRequest {
            action_id: "batch-7".into(),
            plan_id: "p".into(),
            inputs: vec![input(9)],
            max_attempts: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(named.action_id, "batch-7");
    let e = actions
        .submit_action(SubmitActionRequest {
            action_id: "batch-7".into(),
            plan_id: "p".into(),
            inputs: vec![input(1), input(2)],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let a7 = actions
        .get_action(GetActionRequest {
            action_id: "batch-7".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .action
        .unwrap();
    assert_eq!(a7.total_jobs, 1, "the duplicate did not add jobs");
    s.stop().await;
}

async fn get_job_shows_input_attempts_and_why_it_waits(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let r = submit_p(&s, 1).await;
    let j = job(&s, &r.job_ids[0]).await;
    assert_eq!(j.status, JobStatus::Pending as i32);
    assert_eq!(j.input.get("file").map(String::as_str), Some("/tmp/0"));
    assert_eq!((j.attempt, j.max_attempts), (0, 3));
    assert!(
        j.waiting_reason.contains("no fresh worker has tools [cat]"),
        "{}",
        j.waiting_reason
    );
    assert!(j.created_at.is_some());
    let e = s
        .jobs()
        .await
        .get_job(GetJobRequest {
            job_id: "missing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    s.stop().await;
}

async fn list_jobs_pages_through_an_action(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let mut jobs = s.jobs().await;
    let r = submit_p(&s, 5).await;
    let p1 = jobs
        .list_jobs(ListJobsRequest {
            action_id: r.action_id.clone(),
            page_size: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p1.job_ids, r.job_ids[..3]);
    let p2 = jobs
        .list_jobs(ListJobsRequest {
            action_id: r.action_id.clone(),
            page_size: 3,
            page_token: p1.next_page_token,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p2.job_ids, r.job_ids[3..]);
    assert!(p2.next_page_token.is_empty());
    let e = jobs
        .list_jobs(ListJobsRequest {
            action_id: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // A page token belongs to its query: with other filters (where it
    // would silently skip rows) it is refused, and changes nothing.
    let other = submit_p(&s, 2).await;
    let first = |action_id: &str, status: JobStatus| ListJobsRequest {
        action_id: action_id.into(),
        status: status as i32,
        page_size: 1,
        ..Default::default()
    };
    let token = jobs
        .list_jobs(first(&r.action_id, JobStatus::Unspecified))
        .await
        .unwrap()
        .into_inner()
        .next_page_token;
    assert!(!token.is_empty());
    for (case, req) in [
        (
            "another action",
            first(&other.action_id, JobStatus::Unspecified),
        ),
        ("another status", first(&r.action_id, JobStatus::Pending)),
    ] {
        let e = jobs
            .list_jobs(ListJobsRequest {
                page_token: token.clone(),
                ..req
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{case}: {e:?}");
    }
    let e = jobs
        .search_jobs(SearchJobsRequest {
            page_token: token.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "ListJobs' token in SearchJobs"
    );
    let search = jobs
        .search_jobs(SearchJobsRequest {
            plan_id: "p".into(),
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .next_page_token;
    let e = jobs
        .search_jobs(SearchJobsRequest {
            status: JobStatus::Pending as i32,
            page_size: 1,
            page_token: search.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "SearchJobs with another status"
    );
    let next = jobs
        .search_jobs(SearchJobsRequest {
            plan_id: "p".into(),
            page_size: 1,
            page_token: search,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next.job_ids, r.job_ids[1..2], "the same query goes on");
    let mut actions = s.actions().await;
    let token = actions
        .list_actions(ListActionsRequest {
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .next_page_token;
    assert!(!token.is_empty());
    let e = actions
        .list_actions(ListActionsRequest {
            plan_id: "p".into(),
            page_size: 1,
            page_token: token,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "ListActions with a plan filter"
    );
    let mut plans = s.plans().await;
    for id in ["q1", "q2"] {
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(Plan {
                    plan_id: id.into(),
                    tasks: vec![task(1, "cat")],
                    ..Default::default()
                }),
                replace: false,
            })
            .await
            .unwrap();
    }
    let token = plans
        .list_plans(ListPlansRequest {
            pattern: "q*".into(),
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .next_page_token;
    assert!(!token.is_empty());
    let e = plans
        .list_plans(ListPlansRequest {
            pattern: "p*".into(),
            page_size: 1,
            page_token: token,
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "ListPlans with another pattern"
    );
    s.stop().await;
}

async fn cancel_and_retry_follow_the_job_state_rules(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let mut jobs = s.jobs().await;
    let r = submit_p(&s, 5).await;
    let (pending, cancelled) = (&r.job_ids[0], &r.job_ids[4]);
    let c = cancel(&s, cancelled).await;
    assert_eq!(c.status, JobStatus::Cancelled as i32);

    // (case, job, cancel (true) or retry (false)): each FAILED_PRECONDITION
    let refused = [
        ("cancel of a cancelled job", cancelled, true),
        ("retry of a pending job", pending, false),
        ("retry of a cancelled job", cancelled, false),
    ];
    for (case, id, is_cancel) in refused {
        let e = if is_cancel {
            jobs.cancel_job(CancelJobRequest { job_id: id.clone() })
                .await
                .map(drop)
        } else {
            jobs.retry_job(RetryJobRequest {
                job_id: id.clone(),
                priority: None,
            })
            .await
            .map(drop)
        }
        .expect_err(case);
        assert_eq!(e.code(), Code::FailedPrecondition, "{case}");
    }

    // ListJobs with a status filter
    let listed = jobs
        .list_jobs(ListJobsRequest {
            action_id: r.action_id.clone(),
            status: JobStatus::Cancelled as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.job_ids, vec![cancelled.clone()]);
    s.stop().await;
}

async fn search_jobs_filters_by_status_plan_and_time(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let mut jobs = s.jobs().await;
    // 5 pending jobs and a cancelled one
    let r = submit_p(&s, 6).await;
    cancel(&s, &r.job_ids[5]).await;
    let pending = jobs
        .search_jobs(SearchJobsRequest {
            status: JobStatus::Pending as i32,
            plan_id: "p".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(pending.into_inner().job_ids.len(), 5);
    let later = jobs
        .search_jobs(SearchJobsRequest {
            created_after: Some(YEAR_2096),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(later.into_inner().job_ids.is_empty());
    let before = jobs
        .search_jobs(SearchJobsRequest {
            created_before: Some(YEAR_2096),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(before.into_inner().job_ids.len(), 6);
    s.stop().await;
}

async fn run_at_schedules_the_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    let sch = s
        .actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![input(1)],
            run_at: Some(YEAR_2096),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let sj = job(&s, &sch.job_ids[0]).await;
    assert!(
        sj.waiting_reason.starts_with("scheduled for 2096"),
        "{}",
        sj.waiting_reason
    );
    s.stop().await;
}

async fn queue_stats_peek_and_metrics_count_ready_and_scheduled_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    // 5 ready jobs, a cancelled one, and one scheduled for 2096
    let r = submit_p(&s, 6).await;
    cancel(&s, &r.job_ids[5]).await;
    let sch = s
        .actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![input(1)],
            run_at: Some(YEAR_2096),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    let mut queue = s.queue().await;
    let st = queue
        .get_queue_stats(GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((st.ready_length, st.scheduled_length), (5, 1));
    assert!(st.next_scheduled_due_in_secs > 1_000_000);
    let peek = queue
        .peek_queue(PeekQueueRequest {
            queue: "ready".into(),
            count: 2,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(peek.job_ids, r.job_ids[..2]);
    let peek = queue
        .peek_queue(PeekQueueRequest {
            queue: "scheduled".into(),
            count: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(peek.job_ids, sch.job_ids);
    let e = queue
        .peek_queue(PeekQueueRequest {
            queue: "nope".into(),
            count: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let m = queue
        .get_metrics(GetMetricsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .body;
    assert!(m.contains("agq_jobs_current{status=\"pending\"} 6"), "{m}");
    assert!(m.contains("agq_queue_length{queue=\"ready\"} 5"), "{m}");
    let mj = queue
        .get_metrics(GetMetricsRequest {
            format: "json".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .body;
    let v: serde_json::Value = serde_json::from_str(&mj).unwrap();
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["name"] == "agq_jobs_current"
            && s["labels"]["status"] == "cancelled"
            && s["value"] == 1.0));
    s.stop().await;
}

async fn delete_plan_is_refused_while_jobs_are_pending(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(store, &dir).await;
    submit_p(&s, 1).await;
    let e = s
        .plans()
        .await
        .delete_plan(DeletePlanRequest {
            plan_id: "p".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    s.stop().await;
}

async fn watch_action_streams_until_terminal(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (action_id, ids) = submit(&s, plan("w", &["cat"]), 3, 1).await;
    let mut stream = s
        .actions()
        .await
        .watch_action(WatchActionRequest {
            action_id: action_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap().action.unwrap();
    assert_eq!(first.pending, 3);
    let mut w = SimWorker::start(&s, "w1", &["cat"], 3).await;
    let mut leases = vec![];
    for _ in 0..3 {
        leases.push(w.lease().await);
    }
    w.complete(&leases[0]).await;
    w.report(&leases[1], JobStatus::Failed).await.unwrap();
    s.jobs()
        .await
        .cancel_job(CancelJobRequest {
            job_id: leases[2].job.as_ref().unwrap().job_id.clone(),
        })
        .await
        .unwrap();
    let mut last = first;
    while let Some(msg) = stream.message().await.unwrap() {
        last = msg.action.unwrap();
    }
    assert_eq!(
        (
            last.completed,
            last.dead,
            last.cancelled,
            last.running,
            last.pending
        ),
        (1, 1, 1, 0, 0)
    );
    assert!(last.completed_jobs_at.is_some());
    let e = s
        .actions()
        .await
        .watch_action(WatchActionRequest {
            action_id: "missing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // the dead job can be retried, and gets a fresh budget
    let dead = ids
        .iter()
        .find(|id| **id == leases[1].job.as_ref().unwrap().job_id)
        .unwrap();
    let r = s
        .jobs()
        .await
        .retry_job(RetryJobRequest {
            job_id: dead.clone(),
            priority: None,
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    // Pending, or already leased again in the same commit (the worker is idle).
    assert!(
        r.status == JobStatus::Pending as i32 || r.status == JobStatus::Running as i32,
        "{r:?}"
    );
    assert!(r.attempt <= 1);
    let again = w.lease().await;
    assert_eq!(&again.job.as_ref().unwrap().job_id, dead);
    assert_eq!(again.attempt, 1);
    w.complete(&again).await;
    s.stop().await;
}

fn tokens() -> Authenticator {
    let e = |token: &str, role, worker_id: Option<&str>| TokenEntry {
        token: token.into(),
        role,
        worker_id: worker_id.map(Into::into),
        worker_id_prefix: None,
    };
    Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                e("client-token-0123456789", Role::Client, None),
                e("admin-token-0123456789", Role::Admin, None),
                e("worker-token-0123456789", Role::Worker, Some("w1")),
            ],
        },
    )
    .unwrap()
}

/// A call of the auth matrix.
#[derive(Debug, Clone, Copy)]
enum AuthCall {
    /// PlanService.ListPlans: a client call.
    ListPlans,
    /// WorkerService.ListWorkers: a client call on the worker service.
    ListWorkers,
    /// WorkerService.RegisterWorker of this id: a worker call.
    Register(&'static str),
    /// WorkerService.UnregisterWorker of this id: a worker call.
    Unregister(&'static str),
}

async fn auth_matrix(store: TestStore) {
    const CLIENT: Option<&str> = Some("client-token-0123456789");
    const ADMIN: Option<&str> = Some("admin-token-0123456789");
    const WORKER_W1: Option<&str> = Some("worker-token-0123456789");
    use AuthCall::*;
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store_with(
        store,
        &dir.path().join("agq.db"),
        fast_config(),
        tokens(),
        None,
    )
    .await;
    let ch = s.channel().await;
    let reg = |id: &str| RegisterWorkerRequest {
        worker_id: id.into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            agentic_units: vec![],
            ..Default::default()
        }),
        ..Default::default()
    };

    // (case, token, call, refused with this code or allowed), in order
    let matrix: [(&str, Option<&str>, AuthCall, Option<Code>); 12] = [
        // no token, wrong token
        ("no token", None, ListPlans, Some(Code::Unauthenticated)),
        (
            "wrong token",
            Some("wrong-token-0123456789"),
            ListPlans,
            Some(Code::Unauthenticated),
        ),
        (
            "no token",
            None,
            Register("w1"),
            Some(Code::Unauthenticated),
        ),
        // client: client calls yes, worker calls no
        ("client", CLIENT, ListPlans, None),
        (
            "client",
            CLIENT,
            Register("w1"),
            Some(Code::PermissionDenied),
        ),
        ("client", CLIENT, ListWorkers, None),
        // worker: its own worker calls yes, another worker's and client calls no
        ("worker w1", WORKER_W1, Register("w1"), None),
        (
            "worker w1",
            WORKER_W1,
            Register("w2"),
            Some(Code::PermissionDenied),
        ),
        (
            "worker w1",
            WORKER_W1,
            Unregister("w2"),
            Some(Code::PermissionDenied),
        ),
        (
            "worker w1",
            WORKER_W1,
            ListPlans,
            Some(Code::PermissionDenied),
        ),
        // admin: everything
        ("admin", ADMIN, ListPlans, None),
        ("admin", ADMIN, Register("w2"), None),
    ];
    for (who, token, call, want) in matrix {
        let bearer = Bearer(token.map(Into::into));
        let mut plans =
            plan_service_client::PlanServiceClient::with_interceptor(ch.clone(), bearer.clone());
        let mut workers =
            worker_service_client::WorkerServiceClient::with_interceptor(ch.clone(), bearer);
        let got = match call {
            ListPlans => plans
                .list_plans(ListPlansRequest::default())
                .await
                .map(drop),
            ListWorkers => workers
                .list_workers(ListWorkersRequest::default())
                .await
                .map(drop),
            Register(id) => workers.register_worker(reg(id)).await.map(drop),
            Unregister(id) => workers
                .unregister_worker(UnregisterWorkerRequest {
                    worker_id: id.into(),
                })
                .await
                .map(drop),
        };
        match (want, got) {
            (None, Ok(())) => {}
            (None, Err(e)) => panic!("{who} {call:?}: refused: {e:?}"),
            (Some(code), Ok(())) => panic!("{who} {call:?}: allowed, want {code:?}"),
            (Some(code), Err(e)) => assert_eq!(e.code(), code, "{who} {call:?}: {}", e.message()),
        }
    }

    // health and reflection need no token
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    let h = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        h.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let h = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "agq.v1.PlanService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        h.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    s.stop().await;
}

async fn state_survives_a_restart(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("nested/dir/agq.db");
    let s = TestServer::start_store(store, &db, fast_config()).await;
    let backing = s.backing.clone();
    let (action_id, ids) = submit(&s, plan("keep", &["cat"]), 4, 3).await;
    s.jobs()
        .await
        .cancel_job(CancelJobRequest {
            job_id: ids[3].clone(),
        })
        .await
        .unwrap();
    s.stop().await;

    let s = TestServer::start_on(&backing, fast_config()).await;
    let p = s
        .plans()
        .await
        .get_plan(GetPlanRequest {
            plan_id: "keep".into(),
            version: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .plan
        .unwrap();
    assert_eq!(
        p,
        Plan {
            version: 1,
            ..plan("keep", &["cat"])
        }
    );
    let a = s
        .actions()
        .await
        .get_action(GetActionRequest { action_id })
        .await
        .unwrap()
        .into_inner()
        .action
        .unwrap();
    assert_eq!((a.total_jobs, a.pending, a.cancelled), (4, 3, 1));
    let st = s
        .queue()
        .await
        .get_queue_stats(GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        st.ready_length, 3,
        "pending jobs are back in the ready queue"
    );
    // and they still run
    let mut w = SimWorker::start(&s, "after-restart", &["cat"], 4).await;
    for _ in 0..3 {
        let l = w.lease().await;
        w.complete(&l).await;
    }
    s.stop().await;
}

async fn shutdown_turns_health_not_serving_finishes_calls_and_cuts_held_streams(store: TestStore) {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut health = HealthClient::new(s.channel().await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "agq.v1.JobService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    // a call in flight when the shutdown starts still gets its answer
    let (action_id, _) = submit(&s, plan("drain", &["cat"]), 100, 3).await;
    let mut actions = s.actions().await;
    let in_flight =
        tokio::spawn(async move { actions.get_action(GetActionRequest { action_id }).await });
    let stopping = tokio::spawn(s.stop());
    let mut saw_not_serving = false;
    while let Ok(Some(msg)) = watch.message().await {
        if msg.status == ServingStatus::NotServing as i32 {
            saw_not_serving = true;
            break;
        }
    }
    assert!(saw_not_serving, "health never said NOT_SERVING");
    let a = in_flight
        .await
        .unwrap()
        .expect("the in-flight call finished")
        .into_inner()
        .action
        .unwrap();
    assert_eq!(a.total_jobs, 100);
    tokio::time::timeout(std::time::Duration::from_secs(10), stopping)
        .await
        .expect("shutdown finished with a health watcher still connected")
        .unwrap();
    drop(watch);
}

/// A server on `store` whose finished actions expire after 1 s.
async fn start_with_retention(store: TestStore, dir: &tempfile::TempDir) -> TestServer {
    let cfg = EngineConfig {
        job_retention: Some(std::time::Duration::from_secs(1)),
        ..fast_config()
    };
    TestServer::start_store(store, &dir.path().join("agq.db"), cfg).await
}

/// GetAction of `id`.
async fn get_action(
    actions: &action_service_client::ActionServiceClient<tonic::transport::Channel>,
    id: &str,
) -> Result<ActionStatus, tonic::Status> {
    let mut actions = actions.clone();
    let r = actions
        .get_action(GetActionRequest {
            action_id: id.to_string(),
        })
        .await?;
    Ok(r.into_inner()
        .action
        .expect("GetAction answers with the action"))
}

/// Waits (at most 10 s) until GetAction of `id` answers NOT_FOUND.
async fn expires(
    actions: &action_service_client::ActionServiceClient<tonic::transport::Channel>,
    id: &str,
    what: &str,
) {
    eventually(10, what, || async {
        get_action(actions, id)
            .await
            .is_err_and(|e| e.code() == Code::NotFound)
    })
    .await;
}

/// Job retention: an action whose jobs all ended is deleted, with its jobs,
/// once it has been finished for longer than the retention; an action with
/// an open job is kept however old its other jobs are, and a dead job
/// retried before the deadline opens its action again until it ends anew.
/// Completed, dead and cancelled endings all count.
async fn finished_actions_expire_after_the_retention_with_their_jobs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with_retention(store, &dir).await;
    let mut w = SimWorker::start(&s, "ret-w", &["cat"], 4).await;
    let mut jobs = s.jobs().await;
    let actions = s.actions().await;

    // B: one job, one attempt: it fails into the dead letter, then is retried.
    let (b, b_jobs) = submit(&s, plan("ret", &["cat"]), 1, 1).await;
    let l = w.lease().await;
    w.report(&l, JobStatus::Failed).await.unwrap();
    assert_eq!(job(&s, &b_jobs[0]).await.status, JobStatus::Dead as i32);
    let (a, a_jobs) = submit(&s, plan("ret", &["cat"]), 2, 1).await;
    for _ in 0..2 {
        let l = w.lease().await;
        w.complete(&l).await;
    }
    jobs.retry_job(RetryJobRequest {
        job_id: b_jobs[0].clone(),
        priority: None,
    })
    .await
    .unwrap();
    let b_lease = w.lease().await;
    // C: a job no worker can run, cancelled while pending.
    let (c, c_jobs) = submit(&s, plan("ret-none", &["no-such-tool"]), 1, 1).await;
    jobs.cancel_job(CancelJobRequest {
        job_id: c_jobs[0].clone(),
    })
    .await
    .unwrap();

    expires(&actions, &a, "the completed action expires").await;
    expires(&actions, &c, "the cancelled action expires").await;
    for id in &a_jobs {
        let e = jobs
            .get_job(GetJobRequest { job_id: id.clone() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "job {id} outlived its action");
    }
    // B has been open since its retry: kept, with its running job.
    let kept = get_action(&actions, &b).await.unwrap();
    assert_eq!((kept.total_jobs, kept.running), (1, 1));
    let listed = jobs
        .search_jobs(SearchJobsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.job_ids, b_jobs, "only B's job is left");

    // Once B's job ends, B expires in turn.
    w.complete(&b_lease).await;
    assert!(get_action(&actions, &b).await.is_ok());
    expires(&actions, &b, "the retried action expires once it ended").await;
    let metrics = s
        .queue()
        .await
        .get_metrics(GetMetricsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        metrics.body.contains("agq_expired_jobs_total 4"),
        "{}",
        metrics.body
    );
    s.stop().await;
}

/// An action's finish time is a cache of "no job open": retention checks
/// the jobs again before it deletes. An action whose job is pending, its
/// finish time set long ago by hand (what a stamp racing a retry once
/// wrote), outlives retention passes that delete a really finished action
/// beside it, with its job untouched.
async fn a_wrong_finish_stamp_never_deletes_an_open_action(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with_retention(store, &dir).await;
    let mut jobs = s.jobs().await;
    let actions = s.actions().await;
    // Open: a job no worker can run, pending.
    let (open, open_jobs) = submit(&s, plan("stamp-open", &["no-such-tool"]), 1, 1).await;
    // Finished: cancelled.
    let (done, done_jobs) = submit(&s, plan("stamp-done", &["no-such-tool"]), 1, 1).await;
    jobs.cancel_job(CancelJobRequest {
        job_id: done_jobs[0].clone(),
    })
    .await
    .unwrap();
    // Action ids are [A-Za-z0-9._-]: quoted as they are.
    s.exec_sql(&format!(
        "UPDATE actions SET finished_at_ms = 1 WHERE action_id = '{open}'"
    ))
    .await;
    expires(&actions, &done, "the cancelled action expires").await;
    // Two more leader ticks at least, past the retention.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let kept = get_action(&actions, &open)
        .await
        .expect("an action with a pending job survives a wrong finish stamp");
    assert_eq!((kept.total_jobs, kept.pending), (1, 1));
    assert_eq!(
        job(&s, &open_jobs[0]).await.status,
        JobStatus::Pending as i32
    );
    s.stop().await;
}

/// The jobs of each status in `agq_jobs_current`, in the order of
/// [`COUNTED`].
async fn job_gauges(s: &TestServer) -> Vec<f64> {
    let mut out = Vec::new();
    for status in COUNTED {
        out.push(metric(s, &format!("agq_jobs_current{{status=\"{status}\"}}")).await);
    }
    out
}

/// The statuses [`job_gauges`] reads.
const COUNTED: [&str; 6] = [
    "pending",
    "running",
    "failed",
    "completed",
    "dead",
    "cancelled",
];

/// `agq_jobs_current` follows each transition (submit, lease, complete,
/// fail into the dead letter, cancel, retry, retention's deletes) and
/// reads the same after a restart. On PostgreSQL the gauges are the kept
/// counts of `job_counts` (not a count of the rows at each scrape), which
/// must equal a count of the rows; the leader folds them into one row per
/// status without changing a gauge.
async fn job_counts_follow_every_transition_and_a_restart(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    // The lease held across the restarts stays held: no grace or
    // heartbeat runs out within the test.
    let cfg = || EngineConfig {
        lease_grace: std::time::Duration::from_secs(300),
        ..EngineConfig::default()
    };
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), cfg()).await;
    let backing = s.backing.clone();
    let (action_id, ids) = submit(&s, plan("counts", &["cat"]), 5, 1).await;
    assert_eq!(job_gauges(&s).await, [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    // One slot: the worker holds one lease at a time.
    let mut w = SimWorker::start(&s, "counts-w", &["cat"], 1).await;
    let done = w.lease().await;
    w.complete(&done).await;
    let failed = w.lease().await;
    w.report(&failed, JobStatus::Failed).await.unwrap();
    let running = w.lease().await;
    let dead_id = job_id_of(&failed).to_string();
    assert_eq!(job(&s, &dead_id).await.status, JobStatus::Dead as i32);
    let leased = [job_id_of(&done), job_id_of(&failed), job_id_of(&running)];
    let waiting: Vec<&String> = ids
        .iter()
        .filter(|id| !leased.contains(&id.as_str()))
        .collect();
    assert_eq!(waiting.len(), 2);
    let mut jobs = s.jobs().await;
    jobs.cancel_job(CancelJobRequest {
        job_id: waiting[0].clone(),
    })
    .await
    .unwrap();
    jobs.retry_job(RetryJobRequest {
        job_id: dead_id.clone(),
        priority: None,
    })
    .await
    .unwrap();
    // 2 pending (one of them retried), 1 running, 1 completed, 1 cancelled.
    let want = [2.0, 1.0, 0.0, 1.0, 0.0, 1.0];
    assert_eq!(job_gauges(&s).await, want);
    drop(w);
    s.stop().await;

    let mut s = TestServer::start_on(&backing, cfg()).await;
    // The finished statuses of SQLite are counted in the background.
    eventually(10, "the counts after a restart", || async {
        job_gauges(&s).await == want
    })
    .await;
    if let agq::config::Store::Postgres(url) = s.backing.store.clone() {
        let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        assert_job_counts_kept(&db).await;
        // The gauges read the kept counts: 7 counted completions the rows
        // do not have show up at the next scrape.
        let completed = "INSERT INTO job_counts (status, n) VALUES (3, $1)";
        db.execute(completed, &[&7i64]).await.unwrap();
        let mut more = want;
        more[3] += 7.0;
        assert_eq!(job_gauges(&s).await, more);
        db.execute(completed, &[&-7i64]).await.unwrap();
        assert_eq!(job_gauges(&s).await, want);
        // The leader's first pass folds the rows into one per status,
        // the sums unchanged.
        s.stop().await;
        db.execute(
            "INSERT INTO job_counts (status, n) VALUES (1, 3), (1, -3), (3, 5), (3, -5)",
            &[],
        )
        .await
        .unwrap();
        let rows_and_statuses = "SELECT count(*), count(DISTINCT status) FROM job_counts";
        let r = db.query_one(rows_and_statuses, &[]).await.unwrap();
        let (n, statuses): (i64, i64) = (r.get(0), r.get(1));
        assert!(
            n > statuses,
            "{n} rows for {statuses} statuses before a fold"
        );
        s = TestServer::start_on(&backing, cfg()).await;
        eventually(10, "the counts folded into a row per status", || async {
            let r = db.query_one(rows_and_statuses, &[]).await.unwrap();
            r.get::<_, i64>(0) == r.get::<_, i64>(1)
        })
        .await;
        // Folded rows stay as they are while nothing changes: the leader's
        // later folds (every 2 s) write nothing.
        let versions =
            "SELECT string_agg(ctid::text || xmin::text, ',' ORDER BY status) FROM job_counts";
        let before: String = db.query_one(versions, &[]).await.unwrap().get(0);
        tokio::time::sleep(std::time::Duration::from_millis(4500)).await;
        let after: String = db.query_one(versions, &[]).await.unwrap().get(0);
        assert_eq!(before, after, "an idle fold rewrote the counts");
        assert_eq!(job_gauges(&s).await, want);
        assert_job_counts_kept(&db).await;
        // Migration 2 on a database of schema 1 with jobs stored: the
        // counts start from a count of the rows.
        s.stop().await;
        db.batch_execute(
            "DROP TABLE job_counts; DROP FUNCTION agq_count_jobs() CASCADE;
             DELETE FROM agq_schema WHERE version >= 2;",
        )
        .await
        .unwrap();
        s = TestServer::start_on(&backing, cfg()).await;
        assert_eq!(job_gauges(&s).await, want);
        assert_job_counts_kept(&db).await;
    }
    // With a short retention, once every job has ended (CancelAction
    // ends the running and pending ones) the action is deleted with its
    // jobs, and every gauge falls to 0.
    s.stop().await;
    let s = TestServer::start_on(
        &backing,
        EngineConfig {
            job_retention: Some(std::time::Duration::from_secs(1)),
            ..cfg()
        },
    )
    .await;
    s.actions()
        .await
        .cancel_action(CancelActionRequest {
            action_id: action_id.clone(),
        })
        .await
        .unwrap();
    eventually(15, "every gauge back to 0 after retention", || async {
        job_gauges(&s).await == [0.0; 6]
    })
    .await;
    s.stop().await;
}

/// The job id of a lease.
fn job_id_of(l: &JobLease) -> &str {
    &l.job.as_ref().unwrap().job_id
}

/// PostgreSQL: folds of the job counts running at once (a paused leader
/// resuming beside the new one), from four connections beside the
/// server's own leader and a writer appending counts, keep every
/// status's sum exact, and a last fold leaves one row per status.
#[tokio::test]
async fn concurrent_folds_keep_the_postgres_job_counts_exact() {
    use agq::store::postgres::FOLD_JOB_COUNTS;
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(
        TestStore::Postgres,
        &dir.path().join("agq.db"),
        fast_config(),
    )
    .await;
    let agq::config::Store::Postgres(url) = s.backing.store.clone() else {
        unreachable!("a PostgreSQL test server")
    };
    let connect = || async {
        let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        db
    };
    let sums = "SELECT status, sum(n)::bigint FROM job_counts GROUP BY status ORDER BY status";
    let read = |rows: Vec<tokio_postgres::Row>| -> Vec<(i16, i64)> {
        rows.iter().map(|r| (r.get(0), r.get(1))).collect()
    };
    let db = connect().await;
    // Counts no job row has: 400 appended rows over statuses 1..=4,
    // status s getting s each time.
    let appender = {
        let db = connect().await;
        tokio::spawn(async move {
            for i in 0..400i64 {
                let status = (i % 4 + 1) as i16;
                db.execute(
                    "INSERT INTO job_counts (status, n) VALUES ($1, $2)",
                    &[&status, &i64::from(status)],
                )
                .await
                .unwrap();
            }
        })
    };
    let mut folders = Vec::new();
    for _ in 0..4 {
        let db = connect().await;
        folders.push(tokio::spawn(async move {
            for _ in 0..100 {
                db.execute(FOLD_JOB_COUNTS, &[]).await.unwrap();
            }
        }));
    }
    appender.await.unwrap();
    for f in folders {
        f.await.unwrap();
    }
    assert_eq!(
        read(db.query(sums, &[]).await.unwrap()),
        [(1, 100), (2, 200), (3, 300), (4, 400)]
    );
    db.execute(FOLD_JOB_COUNTS, &[]).await.unwrap();
    let r = db
        .query_one(
            "SELECT count(*), count(DISTINCT status) FROM job_counts",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((r.get::<_, i64>(0), r.get::<_, i64>(1)), (4, 4));
    assert_eq!(
        read(db.query(sums, &[]).await.unwrap()),
        [(1, 100), (2, 200), (3, 300), (4, 400)]
    );
    s.stop().await;
}

/// PostgreSQL: RetryAction waits for a job row another transaction holds;
/// when that transaction moved the job on (cancelled it here), the retry
/// leaves it as it is and retries only the jobs still failed or dead.
#[tokio::test]
async fn a_retry_leaves_a_job_that_moved_while_it_waited_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let s = server_with_plan_p(TestStore::Postgres, &dir).await;
    let agq::config::Store::Postgres(url) = s.backing.store.clone() else {
        unreachable!("a PostgreSQL test server")
    };
    let (mut db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let r = submit_p(&s, 2).await;
    // Both jobs dead (no worker ever takes them).
    db.execute(
        "UPDATE jobs SET status = 5, attempt = 1 WHERE action_id = $1",
        &[&r.action_id],
    )
    .await
    .unwrap();
    let tx = db.transaction().await.unwrap();
    tx.query_one(
        "SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE",
        &[&r.job_ids[0]],
    )
    .await
    .unwrap();
    let retry = {
        let mut actions = s.actions().await;
        let action_id = r.action_id.clone();
        tokio::spawn(async move {
            actions
                .retry_action(RetryActionRequest {
                    action_id,
                    ..Default::default()
                })
                .await
        })
    };
    // The retry is waiting for the row; the holder cancels the job.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!retry.is_finished(), "the retry did not wait for the row");
    tx.execute(
        "UPDATE jobs SET status = 6 WHERE job_id = $1",
        &[&r.job_ids[0]],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let done = retry.await.unwrap().unwrap().into_inner();
    assert_eq!(done.retried, 1, "only the job still dead is retried");
    assert_eq!(
        job(&s, &r.job_ids[0]).await.status,
        JobStatus::Cancelled as i32
    );
    assert_eq!(
        job(&s, &r.job_ids[1]).await.status,
        JobStatus::Pending as i32
    );
    s.stop().await;
}

/// GetJob of a waiting job (which says why it waits) and GetQueueStats,
/// many at once, more than a PostgreSQL replica's pool has connections:
/// each is answered. A call that held a connection while it waited for a
/// second one made as many such calls as the pool has connections wait on
/// each other until the pool's timeout (UNAVAILABLE), and every other call
/// of the replica, heartbeats included, with them.
async fn many_reads_of_a_waiting_job_at_once_all_succeed(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("p", &["no-such-tool"]), 1, 1).await;
    let jobs = s.jobs().await;
    let queue = s.queue().await;
    let reads = (0..48).map(|i| {
        let (mut jobs, mut queue, id) = (jobs.clone(), queue.clone(), ids[0].clone());
        async move {
            if i % 3 == 0 {
                queue
                    .get_queue_stats(GetQueueStatsRequest {})
                    .await
                    .map(|_| String::new())
            } else {
                jobs.get_job(GetJobRequest { job_id: id })
                    .await
                    .map(|r| r.into_inner().job.unwrap_or_default().waiting_reason)
            }
        }
    });
    let answers = futures_util::future::join_all(reads).await;
    for (i, a) in answers.into_iter().enumerate() {
        let reason = a.unwrap_or_else(|st| panic!("read {i}: {st:?}"));
        assert!(
            i % 3 == 0 || reason.contains("no-such-tool"),
            "read {i}: {reason:?}"
        );
    }
    s.stop().await;
}

/// A SubmitPlan that finds its plan held by a DeletePlan (another replica)
/// and then deleted stores version 1 anew, as if it had come after the
/// delete; it was INTERNAL ("query returned an unexpected number of
/// rows"), with the plan left absent.
// PostgreSQL only: SQLite runs the two calls one after the other.
#[tokio::test]
async fn a_plan_deleted_under_a_submit_is_stored_anew() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(
        TestStore::Postgres,
        &dir.path().join("agq.db"),
        fast_config(),
    )
    .await;
    let agq::config::Store::Postgres(url) = s.backing.store.clone() else {
        unreachable!("a PostgreSQL test server")
    };
    let mut plans = s.plans().await;
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("p", &["sort"])),
            replace: false,
        })
        .await
        .unwrap();
    // Another replica's DeletePlan holds the row...
    let mut deleter = pg::connect(&url).await;
    let tx = deleter.transaction().await.unwrap();
    tx.execute("SELECT 1 FROM plans WHERE plan_id = 'p' FOR UPDATE", &[])
        .await
        .unwrap();
    // ...while this replica's SubmitPlan (with replace) runs into it.
    let submit = tokio::spawn(async move {
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan("p", &["uniq"])),
                replace: true,
            })
            .await
    });
    let watcher = pg::connect(&url).await;
    let mut waited = false;
    for _ in 0..200 {
        let n: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                 AND wait_event_type = 'Lock' AND query LIKE '%FROM plans%FOR UPDATE%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if n > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(waited, "the submit never waited for the deleter's lock");
    tx.execute("DELETE FROM plans WHERE plan_id = 'p'", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stored = submit
        .await
        .unwrap()
        .expect("stored once the delete committed")
        .into_inner();
    assert_eq!(stored.version, 1);
    let got = s
        .plans()
        .await
        .get_plan(GetPlanRequest {
            plan_id: "p".into(),
            version: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .plan
        .unwrap();
    assert_eq!((got.version, got.tasks[0].command.as_str()), (1, "uniq"));
    s.stop().await;
}
