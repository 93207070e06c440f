//! Hostile input over gRPC: a table of malformed requests, each answered
//! with its documented status code, the server staying up and nothing
//! written.

mod common;

use std::collections::HashMap;

use agq::pb::*;
use common::*;
use tonic::Code;

/// GetPlanRequest with `plan_id` as raw bytes, to send invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawGetPlan {
    #[prost(bytes = "vec", tag = "1")]
    plan_id: Vec<u8>,
}

async fn counts(s: &TestServer) -> (usize, usize) {
    let plans = s
        .plans()
        .await
        .list_plans(ListPlansRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    let jobs = s
        .jobs()
        .await
        .search_jobs(SearchJobsRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    (
        plans.into_inner().plan_ids.len(),
        jobs.into_inner().job_ids.len(),
    )
}

#[tokio::test]
async fn malformed_requests_get_their_codes_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let (_, _) = submit(&s, plan("base", &["cat"]), 2, 3).await;
    let before = counts(&s).await;
    let mut plans = s.plans().await;
    let mut actions = s.actions().await;
    let mut jobs = s.jobs().await;
    let mut workers = s.workers().await;
    let mut tried = 0;
    let mut expect = |what: &str, got: Result<(), tonic::Status>, code: Code| {
        tried += 1;
        let e = got.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {}", e.message());
    };

    let big_plan = Plan {
        plan_id: "huge".into(),
        plan_description: String::new(),
        tasks: (1..=10_000)
            .map(|n| Task {
                task_number: n,
                command: "cat".into(),
                args: vec![],
                timeout_secs: 1,
                input_from_task: None,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    expect(
        "10,000 tasks",
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(big_plan),
            })
            .await
            .map(|_| ()),
        Code::InvalidArgument,
    );
    for cmd in [
        "/bin/sh", "a;b", "a b", "a\0b", "&&", "", "x\ny", "$HOME", "*",
    ] {
        let mut p = plan("cmd", &["cat"]);
        p.tasks[0].command = cmd.into();
        expect(
            "bad command",
            plans
                .submit_plan(SubmitPlanRequest { plan: Some(p) })
                .await
                .map(|_| ()),
            Code::InvalidArgument,
        );
    }
    for id in [
        "".to_string(),
        "x".repeat(129),
        "../etc".into(),
        "a b".into(),
    ] {
        expect(
            "bad plan id",
            plans
                .get_plan(GetPlanRequest {
                    plan_id: id.clone(),
                })
                .await
                .map(|_| ()),
            Code::InvalidArgument,
        );
        expect(
            "bad job id",
            jobs.get_job(GetJobRequest { job_id: id.clone() })
                .await
                .map(|_| ()),
            Code::InvalidArgument,
        );
        expect(
            "bad action id",
            actions
                .get_action(GetActionRequest {
                    action_id: id.clone(),
                })
                .await
                .map(|_| ()),
            Code::InvalidArgument,
        );
    }
    let mut p = plan("selfref", &["cat", "sort"]);
    p.tasks[1].input_from_task = Some(2);
    expect(
        "self input_from_task",
        plans
            .submit_plan(SubmitPlanRequest { plan: Some(p) })
            .await
            .map(|_| ()),
        Code::InvalidArgument,
    );
    let mut p = plan("fwd", &["cat", "sort"]);
    p.tasks[0].input_from_task = Some(2);
    expect(
        "forward input_from_task",
        plans
            .submit_plan(SubmitPlanRequest { plan: Some(p) })
            .await
            .map(|_| ()),
        Code::InvalidArgument,
    );
    let huge_input = ActionInput {
        values: HashMap::from([("v".to_string(), "x".repeat(65 * 1024))]),
    };
    expect(
        "huge input value",
        actions
            .submit_action(SubmitActionRequest {
                plan_id: "base".into(),
                inputs: vec![huge_input],
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Code::InvalidArgument,
    );
    let many_keys = ActionInput {
        values: (0..65).map(|i| (format!("k{i}"), "v".into())).collect(),
    };
    expect(
        "too many input keys",
        actions
            .submit_action(SubmitActionRequest {
                plan_id: "base".into(),
                inputs: vec![many_keys],
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Code::InvalidArgument,
    );
    // over the 16 MiB message limit
    let over = ActionInput {
        values: HashMap::from([("v".to_string(), "x".repeat(17 * 1024 * 1024))]),
    };
    expect(
        "message over the size limit",
        actions
            .submit_action(SubmitActionRequest {
                plan_id: "base".into(),
                inputs: vec![over],
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Code::OutOfRange,
    );
    // unknown enum values
    expect(
        "unknown job status filter",
        jobs.search_jobs(SearchJobsRequest {
            status: 99,
            ..Default::default()
        })
        .await
        .map(|_| ()),
        Code::InvalidArgument,
    );
    expect(
        "unknown worker state",
        workers
            .list_workers(ListWorkersRequest { state: 42 })
            .await
            .map(|_| ()),
        Code::InvalidArgument,
    );
    let mut w = SimWorker::start(&s, "hostile", &["cat"], 1).await;
    let lease = w.lease().await;
    let bad_status = UpdateJobRequest {
        job_id: lease.job.as_ref().unwrap().job_id.clone(),
        worker_id: "hostile".into(),
        lease_id: lease.lease_id.clone(),
        status: 77,
        ..Default::default()
    };
    expect(
        "unknown job status in UpdateJob",
        workers.update_job(bad_status.clone()).await.map(|_| ()),
        Code::InvalidArgument,
    );
    let mut pct = bad_status;
    pct.status = JobStatus::Running as i32;
    pct.progress_percent = 101;
    expect(
        "progress over 100",
        workers.update_job(pct).await.map(|_| ()),
        Code::InvalidArgument,
    );
    // invalid UTF-8 in a string field: a protobuf decode error (INTERNAL, as gRPC specifies)
    let mut grpc = tonic::client::Grpc::new(s.channel().await);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/agq.v1.PlanService/GetPlan");
    let codec: tonic_prost::ProstCodec<RawGetPlan, GetPlanResponse> =
        tonic_prost::ProstCodec::default();
    let r = grpc
        .unary(
            tonic::Request::new(RawGetPlan {
                plan_id: vec![0xff, 0xfe, b'a'],
            }),
            path,
            codec,
        )
        .await;
    expect("invalid UTF-8", r.map(|_| ()), Code::Internal);

    // the job is still ours and the server is up; nothing was written
    w.complete(&lease).await;
    let after = counts(&s).await;
    assert_eq!(before, after);
    assert!(tried >= 30, "{tried}");
    println!("hostile input: {tried} malformed requests tried");
    s.stop().await;
}
