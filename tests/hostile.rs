//! Hostile input over gRPC: a table of malformed requests, each answered
//! with its documented status code and a message naming the fault, the
//! server staying up and nothing written.

mod common;

use std::collections::HashMap;

use agq::pb::*;
use common::*;
use tonic::{Code, Status};

/// GetPlanRequest with `plan_id` as raw bytes, to send invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawGetPlan {
    #[prost(bytes = "vec", tag = "1")]
    plan_id: Vec<u8>,
}

/// One malformed request of the table.
struct Case {
    /// What is wrong with it, for failure messages.
    name: String,
    /// The request.
    call: Call,
    /// The status code it must get.
    code: Code,
    /// A fragment the status message must contain.
    message: &'static str,
}

/// The RPC a [`Case`] sends.
enum Call {
    /// PlanService.SubmitPlan of this plan.
    SubmitPlan(Plan),
    /// PlanService.GetPlan of this id.
    GetPlan(String),
    /// JobService.GetJob of this id.
    GetJob(String),
    /// ActionService.GetAction of this id.
    GetAction(String),
    /// ActionService.SubmitAction.
    SubmitAction(SubmitActionRequest),
    /// JobService.SearchJobs.
    SearchJobs(SearchJobsRequest),
    /// WorkerService.ListWorkers.
    ListWorkers(ListWorkersRequest),
    /// WorkerService.UpdateJob.
    UpdateJob(UpdateJobRequest),
    /// GetPlan with these raw bytes as its id.
    RawGetPlan(Vec<u8>),
}

/// A case with a name.
fn case(name: impl Into<String>, call: Call, code: Code, message: &'static str) -> Case {
    Case {
        name: name.into(),
        call,
        code,
        message,
    }
}

/// A plan with tasks `cmds` whose task `task` reads the output of `from`.
fn plan_reading(id: &str, cmds: &[&str], task: usize, from: u32) -> Plan {
    let mut p = plan(id, cmds);
    p.tasks[task].input_from_task = Some(from);
    p
}

/// An action on plan `base` with one input.
fn action_with(input: ActionInput) -> Call {
    Call::SubmitAction(SubmitActionRequest {
        plan_id: "base".into(),
        inputs: vec![input],
        ..Default::default()
    })
}

/// Every malformed request; `lease` is a job lease held by worker `hostile`.
fn cases(lease: &JobLease) -> Vec<Case> {
    use Code::*;
    let mut cases = vec![case(
        "a plan of 10,000 tasks",
        Call::SubmitPlan(Plan {
            plan_id: "huge".into(),
            tasks: (1..=10_000)
                .map(|n| Task {
                    task_number: n,
                    command: "cat".into(),
                    timeout_secs: 1,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
        InvalidArgument,
        "at most 100 tasks",
    )];
    for cmd in [
        "/bin/sh", "a;b", "a b", "a\0b", "&&", "", "x\ny", "$HOME", "*",
    ] {
        let mut p = plan("cmd", &["cat"]);
        p.tasks[0].command = cmd.into();
        cases.push(case(
            format!("bad command {cmd:?}"),
            Call::SubmitPlan(p),
            InvalidArgument,
            "bare executable name",
        ));
    }
    for id in [
        "".to_string(),
        "x".repeat(129),
        "../etc".into(),
        "a b".into(),
    ] {
        let short: String = id.chars().take(12).collect();
        cases.push(case(
            format!("bad plan id {short:?}"),
            Call::GetPlan(id.clone()),
            InvalidArgument,
            "plan_id must match",
        ));
        cases.push(case(
            format!("bad job id {short:?}"),
            Call::GetJob(id.clone()),
            InvalidArgument,
            "job_id must match",
        ));
        cases.push(case(
            format!("bad action id {short:?}"),
            Call::GetAction(id),
            InvalidArgument,
            "action_id must match",
        ));
    }
    let update = UpdateJobRequest {
        job_id: lease.job.as_ref().unwrap().job_id.clone(),
        worker_id: "hostile".into(),
        lease_id: lease.lease_id.clone(),
        status: 77,
        ..Default::default()
    };
    let mut big = plan("big", &["cat"; 65]);
    for t in &mut big.tasks {
        t.args = vec!["a".repeat(64 * 1024)];
    }
    cases.extend([
        case(
            "a plan whose args would not fit its leases (65 x 64 KiB)",
            Call::SubmitPlan(big),
            InvalidArgument,
            "args are 4259840 bytes in all",
        ),
        case(
            "a task reading its own output",
            Call::SubmitPlan(plan_reading("selfref", &["cat", "sort"], 1, 2)),
            InvalidArgument,
            "input_from_task must name an earlier task",
        ),
        case(
            "a task reading a later task's output",
            Call::SubmitPlan(plan_reading("fwd", &["cat", "sort"], 0, 2)),
            InvalidArgument,
            "input_from_task must name an earlier task",
        ),
        case(
            "an input value of 65 KiB",
            action_with(ActionInput {
                values: HashMap::from([("v".to_string(), "x".repeat(65 * 1024))]),
            }),
            InvalidArgument,
            "at most 65536 allowed",
        ),
        case(
            "an input of 65 keys",
            action_with(ActionInput {
                values: (0..65).map(|i| (format!("k{i}"), "v".into())).collect(),
            }),
            InvalidArgument,
            "at most 64 allowed",
        ),
        case(
            "a message over the 16 MiB limit",
            action_with(ActionInput {
                values: HashMap::from([("v".to_string(), "x".repeat(17 * 1024 * 1024))]),
            }),
            OutOfRange,
            "message length too large",
        ),
        case(
            "an unknown job status filter",
            Call::SearchJobs(SearchJobsRequest {
                status: 99,
                ..Default::default()
            }),
            InvalidArgument,
            "unknown job status 99",
        ),
        case(
            "an unknown worker state",
            Call::ListWorkers(ListWorkersRequest {
                state: 42,
                ..Default::default()
            }),
            InvalidArgument,
            "unknown worker state 42",
        ),
        case(
            "an unknown job status in UpdateJob",
            Call::UpdateJob(update.clone()),
            InvalidArgument,
            "status must be JOB_STATUS_RUNNING",
        ),
        case(
            "progress over 100",
            Call::UpdateJob(UpdateJobRequest {
                status: JobStatus::Running as i32,
                progress_percent: 101,
                ..update
            }),
            InvalidArgument,
            "progress_percent must be in 0..=100",
        ),
        // A protobuf decode error: INTERNAL, as gRPC specifies.
        case(
            "invalid UTF-8 in a string field",
            Call::RawGetPlan(vec![0xff, 0xfe, b'a']),
            Internal,
            "UTF-8",
        ),
    ]);
    cases
}

/// Sends `call`; only its status matters.
async fn send(s: &TestServer, call: Call) -> Result<(), Status> {
    match call {
        Call::SubmitPlan(p) => s
            .plans()
            .await
            .submit_plan(SubmitPlanRequest {
                plan: Some(p),
                replace: false,
            })
            .await
            .map(drop),
        Call::GetPlan(plan_id) => s
            .plans()
            .await
            .get_plan(GetPlanRequest {
                plan_id,
                version: 0,
            })
            .await
            .map(drop),
        Call::GetJob(job_id) => s
            .jobs()
            .await
            .get_job(GetJobRequest { job_id })
            .await
            .map(drop),
        Call::GetAction(action_id) => s
            .actions()
            .await
            .get_action(GetActionRequest { action_id })
            .await
            .map(drop),
        Call::SubmitAction(r) => s.actions().await.submit_action(r).await.map(drop),
        Call::SearchJobs(r) => s.jobs().await.search_jobs(r).await.map(drop),
        Call::ListWorkers(r) => s.workers().await.list_workers(r).await.map(drop),
        Call::UpdateJob(r) => s.workers().await.update_job(r).await.map(drop),
        Call::RawGetPlan(plan_id) => {
            let mut grpc = tonic::client::Grpc::new(s.channel().await);
            grpc.ready().await.unwrap();
            let path =
                tonic::codegen::http::uri::PathAndQuery::from_static("/agq.v1.PlanService/GetPlan");
            let codec: tonic_prost::ProstCodec<RawGetPlan, GetPlanResponse> =
                tonic_prost::ProstCodec::default();
            grpc.unary(tonic::Request::new(RawGetPlan { plan_id }), path, codec)
                .await
                .map(drop)
        }
    }
}

/// (plans, jobs) stored.
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
    let mut w = SimWorker::start(&s, "hostile", &["cat"], 1).await;
    let lease = w.lease().await;
    let job_id = lease.job.as_ref().unwrap().job_id.clone();

    let cases = cases(&lease);
    let tried = cases.len();
    for Case {
        name,
        call,
        code,
        message,
    } in cases
    {
        let e = send(&s, call)
            .await
            .expect_err(&format!("case {name:?}: the request was accepted"));
        assert_eq!(
            e.code(),
            code,
            "case {name:?}: wrong code; message {:?}",
            e.message()
        );
        assert!(
            e.message().contains(message),
            "case {name:?}: the message {:?} lacks {message:?}",
            e.message()
        );
        // The server is up and nothing was written: no plan or job was
        // added, and the leased job is still running on our worker.
        assert_eq!(counts(&s).await, before, "case {name:?} changed the store");
        let j = job(&s, &job_id).await;
        assert_eq!(
            (j.status, j.worker_id.as_str()),
            (JobStatus::Running as i32, "hostile"),
            "case {name:?} changed the leased job"
        );
    }

    // the job is still ours and the server is up; nothing was written
    w.complete(&lease).await;
    let after = counts(&s).await;
    assert_eq!(before, after);
    assert!(tried >= 30, "{tried}");
    println!("hostile input: {tried} malformed requests tried");
    s.stop().await;
}
