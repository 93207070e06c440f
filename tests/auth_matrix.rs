//! The auth matrix for every RPC: no token, wrong token, client, admin, a
//! worker token for its own and for another worker_id, and a worker-pool
//! token for ids inside and outside its pool; and a worker token that
//! tries to report another worker's lease, checked by the job's state.

mod common;
mod process;

use agq::{
    auth::{AuthFile, Authenticator, Role, TokenEntry},
    pb::*,
};
use common::*;
use tonic::{service::interceptor::InterceptedService, transport::Channel, Code, Status};

type Ch = InterceptedService<Channel, Bearer>;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    /// Plans, actions, jobs, queue, schedules, worker listing.
    Client,
    /// Worker calls naming worker "w1" (and DrainWorker, ForgetWorker).
    Worker,
    /// Operator decisions only an admin token may make (ReleaseWorker).
    Admin,
}

async fn call(ch: Ch, rpc: &str) -> Result<(), Status> {
    call_for(ch, rpc, "w1").await
}

/// Calls `rpc`; worker RPCs (and GetWorker) name `worker`.
async fn call_for(ch: Ch, rpc: &str, worker: &str) -> Result<(), Status> {
    let mut p = plan_service_client::PlanServiceClient::new(ch.clone());
    let mut a = action_service_client::ActionServiceClient::new(ch.clone());
    let mut j = job_service_client::JobServiceClient::new(ch.clone());
    let mut w = worker_service_client::WorkerServiceClient::new(ch.clone());
    let mut q = queue_service_client::QueueServiceClient::new(ch.clone());
    let mut sc = schedule_service_client::ScheduleServiceClient::new(ch);
    let id = || "x".to_string();
    match rpc {
        "SubmitPlan" => p
            .submit_plan(SubmitPlanRequest {
                plan: None,
                replace: false,
            })
            .await
            .map(|_| ()),
        "GetPlan" => p
            .get_plan(GetPlanRequest {
                plan_id: id(),
                version: 0,
            })
            .await
            .map(|_| ()),
        "ListPlans" => p.list_plans(ListPlansRequest::default()).await.map(|_| ()),
        "ListPlanVersions" => p
            .list_plan_versions(ListPlanVersionsRequest {
                plan_id: id(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        "DeletePlan" => p
            .delete_plan(DeletePlanRequest { plan_id: id() })
            .await
            .map(|_| ()),
        "SubmitAction" => a
            .submit_action(SubmitActionRequest::default())
            .await
            .map(|_| ()),
        "GetAction" => a
            .get_action(GetActionRequest { action_id: id() })
            .await
            .map(|_| ()),
        "WatchAction" => a
            .watch_action(WatchActionRequest { action_id: id() })
            .await
            .map(|_| ()),
        "GetJob" => j.get_job(GetJobRequest { job_id: id() }).await.map(|_| ()),
        "ListJobs" => j
            .list_jobs(ListJobsRequest {
                action_id: id(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        "SearchJobs" => j
            .search_jobs(SearchJobsRequest::default())
            .await
            .map(|_| ()),
        "RetryJob" => j
            .retry_job(RetryJobRequest {
                job_id: id(),
                priority: None,
            })
            .await
            .map(|_| ()),
        "CancelJob" => j
            .cancel_job(CancelJobRequest { job_id: id() })
            .await
            .map(|_| ()),
        "ListWorkers" => w
            .list_workers(ListWorkersRequest::default())
            .await
            .map(|_| ()),
        "GetWorker" => w
            .get_worker(GetWorkerRequest {
                worker_id: worker.into(),
            })
            .await
            .map(|_| ()),
        "GetQueueStats" => q.get_queue_stats(GetQueueStatsRequest {}).await.map(|_| ()),
        "PeekQueue" => q.peek_queue(PeekQueueRequest::default()).await.map(|_| ()),
        "GetMetrics" => q
            .get_metrics(GetMetricsRequest::default())
            .await
            .map(|_| ()),
        "RegisterWorker" => w
            .register_worker(RegisterWorkerRequest {
                worker_id: worker.into(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        "Heartbeat" => {
            let req = HeartbeatRequest {
                worker_id: worker.into(),
                ..Default::default()
            };
            w.heartbeat(tokio_stream::iter(vec![req])).await.map(|_| ())
        }
        "LeaseJobs" => w
            .lease_jobs(LeaseJobsRequest {
                worker_id: worker.into(),
            })
            .await
            .map(|_| ()),
        "UpdateJob" => w
            .update_job(UpdateJobRequest {
                job_id: id(),
                worker_id: worker.into(),
                lease_id: id(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        "BatchUpdateJobs" => w
            .batch_update_jobs(BatchUpdateJobsRequest {
                worker_id: worker.into(),
                requests: vec![UpdateJobRequest {
                    job_id: id(),
                    lease_id: id(),
                    ..Default::default()
                }],
            })
            .await
            .map(|_| ()),
        // The stream opens for any authenticated caller; each request is
        // checked as it is read, so a refusal ends the stream before the
        // first answer.
        "ReportJobs" => {
            let req = ReportJobsRequest {
                worker_id: worker.into(),
                requests: vec![UpdateJobRequest {
                    job_id: id(),
                    lease_id: id(),
                    ..Default::default()
                }],
            };
            match w.report_jobs(tokio_stream::iter(vec![req])).await {
                Ok(answers) => answers.into_inner().message().await.map(|_| ()),
                Err(st) => Err(st),
            }
        }
        "UnregisterWorker" => w
            .unregister_worker(UnregisterWorkerRequest {
                worker_id: worker.into(),
            })
            .await
            .map(|_| ()),
        "DrainWorker" => w
            .drain_worker(DrainWorkerRequest {
                worker_id: worker.into(),
            })
            .await
            .map(|_| ()),
        "ForgetWorker" => w
            .forget_worker(ForgetWorkerRequest {
                worker_id: worker.into(),
            })
            .await
            .map(|_| ()),
        "ReleaseWorker" => w
            .release_worker(ReleaseWorkerRequest {
                worker_id: worker.into(),
            })
            .await
            .map(|_| ()),
        "ListActions" => a
            .list_actions(ListActionsRequest::default())
            .await
            .map(|_| ()),
        "CancelAction" => a
            .cancel_action(CancelActionRequest { action_id: id() })
            .await
            .map(|_| ()),
        "RetryAction" => a
            .retry_action(RetryActionRequest {
                action_id: id(),
                status: 0,
            })
            .await
            .map(|_| ()),
        "VerifyWorker" => w
            .verify_worker(VerifyWorkerRequest {
                worker_id: worker.into(),
                tool: "sort".into(),
                args: vec![],
            })
            .await
            .map(|_| ()),
        "CreateSchedule" => sc
            .create_schedule(CreateScheduleRequest::default())
            .await
            .map(|_| ()),
        "GetSchedule" => sc
            .get_schedule(GetScheduleRequest { schedule_id: id() })
            .await
            .map(|_| ()),
        "ListSchedules" => sc
            .list_schedules(ListSchedulesRequest::default())
            .await
            .map(|_| ()),
        "PauseSchedule" => sc
            .pause_schedule(PauseScheduleRequest { schedule_id: id() })
            .await
            .map(|_| ()),
        "ResumeSchedule" => sc
            .resume_schedule(ResumeScheduleRequest { schedule_id: id() })
            .await
            .map(|_| ()),
        "DeleteSchedule" => sc
            .delete_schedule(DeleteScheduleRequest { schedule_id: id() })
            .await
            .map(|_| ()),
        other => panic!("unknown rpc {other}"),
    }
}

const RPCS: &[(&str, Kind)] = &[
    ("SubmitPlan", Kind::Client),
    ("GetPlan", Kind::Client),
    ("ListPlans", Kind::Client),
    ("DeletePlan", Kind::Client),
    ("ListPlanVersions", Kind::Client),
    ("SubmitAction", Kind::Client),
    ("GetAction", Kind::Client),
    ("WatchAction", Kind::Client),
    ("ListActions", Kind::Client),
    ("CancelAction", Kind::Client),
    ("RetryAction", Kind::Client),
    ("GetJob", Kind::Client),
    ("ListJobs", Kind::Client),
    ("SearchJobs", Kind::Client),
    ("RetryJob", Kind::Client),
    ("CancelJob", Kind::Client),
    ("ListWorkers", Kind::Client),
    ("GetWorker", Kind::Client),
    ("GetQueueStats", Kind::Client),
    ("PeekQueue", Kind::Client),
    ("GetMetrics", Kind::Client),
    ("CreateSchedule", Kind::Client),
    ("GetSchedule", Kind::Client),
    ("ListSchedules", Kind::Client),
    ("PauseSchedule", Kind::Client),
    ("ResumeSchedule", Kind::Client),
    ("DeleteSchedule", Kind::Client),
    ("RegisterWorker", Kind::Worker),
    ("Heartbeat", Kind::Worker),
    ("LeaseJobs", Kind::Worker),
    ("UpdateJob", Kind::Worker),
    ("BatchUpdateJobs", Kind::Worker),
    ("ReportJobs", Kind::Worker),
    ("UnregisterWorker", Kind::Worker),
    ("DrainWorker", Kind::Worker),
    // An operator action on a worker's record: the worker's own (or its
    // pool's) token or an admin's, as DrainWorker; never a client token.
    ("ForgetWorker", Kind::Worker),
    // Ending a quarantine is an operator's decision, not the worker's own.
    ("ReleaseWorker", Kind::Admin),
    // Challenging a worker is an operator's decision too.
    ("VerifyWorker", Kind::Admin),
];

#[tokio::test]
async fn every_rpc_under_every_identity() {
    let e = |token: &str, role, worker_id: Option<&str>| TokenEntry {
        token: token.into(),
        role,
        worker_id: worker_id.map(Into::into),
        worker_id_prefix: None,
    };
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                e("client-token-0123456789", Role::Client, None),
                e("admin-token-0123456789", Role::Admin, None),
                e("worker-w1-token-0123456789", Role::Worker, Some("w1")),
                e("worker-w2-token-0123456789", Role::Worker, Some("w2")),
            ],
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&dir.path().join("agq.db"), fast_config(), auth, None).await;
    let ch = s.channel().await;
    let with = |t: Option<&str>| InterceptedService::new(ch.clone(), Bearer(t.map(Into::into)));
    let denied = |r: &Result<(), Status>| r.as_ref().err().map(|e| e.code());
    let mut checked = 0;
    for (rpc, kind) in RPCS {
        for token in [None, Some("wrong-token-0123456789")] {
            assert_eq!(
                denied(&call(with(token), rpc).await),
                Some(Code::Unauthenticated),
                "{rpc} with {token:?}"
            );
        }
        let client = call(with(Some("client-token-0123456789")), rpc).await;
        let admin = call(with(Some("admin-token-0123456789")), rpc).await;
        let own = call(with(Some("worker-w1-token-0123456789")), rpc).await;
        let other = call(with(Some("worker-w2-token-0123456789")), rpc).await;
        let allowed = |r: &Result<(), Status>| {
            !matches!(
                denied(r),
                Some(Code::Unauthenticated | Code::PermissionDenied)
            )
        };
        assert!(allowed(&admin), "admin may call {rpc}: {admin:?}");
        match kind {
            Kind::Client => {
                assert!(allowed(&client), "client may call {rpc}: {client:?}");
                assert_eq!(
                    denied(&own),
                    Some(Code::PermissionDenied),
                    "worker token on {rpc}"
                );
                assert_eq!(
                    denied(&other),
                    Some(Code::PermissionDenied),
                    "worker token on {rpc}"
                );
            }
            Kind::Worker => {
                assert_eq!(
                    denied(&client),
                    Some(Code::PermissionDenied),
                    "client token on {rpc}"
                );
                assert!(allowed(&own), "w1's token may call {rpc} for w1: {own:?}");
                assert_eq!(
                    denied(&other),
                    Some(Code::PermissionDenied),
                    "w2's token on {rpc} for w1"
                );
            }
            Kind::Admin => {
                for (who, r) in [("client", &client), ("w1", &own), ("w2", &other)] {
                    assert_eq!(
                        denied(r),
                        Some(Code::PermissionDenied),
                        "{who}'s token on {rpc}"
                    );
                }
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 38);
    s.stop().await;
}

/// A worker-pool token (what the Helm chart gives its worker Deployment):
/// every worker RPC for ids of its pool, nothing for other ids, no client
/// RPC.
#[tokio::test]
async fn a_worker_pool_token_acts_for_its_pool_only() {
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                TokenEntry {
                    token: "pool-agw-token-0123456789".into(),
                    role: Role::Worker,
                    worker_id: None,
                    worker_id_prefix: Some("agw-".into()),
                },
                TokenEntry {
                    token: "admin-token-0123456789".into(),
                    role: Role::Admin,
                    worker_id: None,
                    worker_id_prefix: None,
                },
            ],
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&dir.path().join("agq.db"), fast_config(), auth, None).await;
    let ch = s.channel().await;
    let pool =
        InterceptedService::new(ch.clone(), Bearer(Some("pool-agw-token-0123456789".into())));
    // A worker of another pool, registered by an admin: the pool token's
    // refused calls on it (drain, unregister, register again) must leave
    // it as it is.
    let mut admin = worker_service_client::WorkerServiceClient::new(InterceptedService::new(
        ch,
        Bearer(Some("admin-token-0123456789".into())),
    ));
    admin
        .register_worker(RegisterWorkerRequest {
            worker_id: "gpu-pod-1".into(),
            hostname: "gpu-host".into(),
            agw_version: "test".into(),
            max_concurrent_jobs: 1,
            ..Default::default()
        })
        .await
        .expect("admin registers gpu-pod-1");
    let code = |r: &Result<(), Status>| r.as_ref().err().map(|e| e.code());
    let mut checked = 0;
    for (rpc, kind) in RPCS {
        let inside = call_for(pool.clone(), rpc, "agw-pod-7f9c").await;
        let outside = call_for(pool.clone(), rpc, "gpu-pod-1").await;
        let prefix_only = call_for(pool.clone(), rpc, "agw").await;
        match kind {
            Kind::Client | Kind::Admin => {
                assert_eq!(
                    code(&inside),
                    Some(Code::PermissionDenied),
                    "pool token on {rpc}"
                );
            }
            Kind::Worker => {
                assert!(
                    !matches!(
                        code(&inside),
                        Some(Code::Unauthenticated | Code::PermissionDenied)
                    ),
                    "the pool token may call {rpc} for agw-pod-7f9c: {inside:?}"
                );
                assert_eq!(
                    code(&outside),
                    Some(Code::PermissionDenied),
                    "pool token on {rpc} for gpu-pod-1"
                );
                assert_eq!(
                    code(&prefix_only),
                    Some(Code::PermissionDenied),
                    "pool token on {rpc} for agw"
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 38);
    // The refused calls changed nothing: gpu-pod-1 is still ACTIVE with
    // the registration the admin made, and no worker "agw" exists.
    let gpu = admin
        .get_worker(GetWorkerRequest {
            worker_id: "gpu-pod-1".into(),
        })
        .await
        .expect("GetWorker gpu-pod-1")
        .into_inner()
        .worker
        .expect("worker");
    assert_eq!(gpu.state, WorkerState::Active as i32, "{gpu:?}");
    assert_eq!(gpu.hostname, "gpu-host");
    let bare = admin
        .get_worker(GetWorkerRequest {
            worker_id: "agw".into(),
        })
        .await;
    assert_eq!(code(&bare.map(|_| ())), Some(Code::NotFound));
    // A pool token needs exactly one binding and a valid prefix.
    let bad = |worker_id: Option<&str>, prefix: Option<&str>| {
        Authenticator::from_file(
            "test",
            AuthFile {
                tokens: vec![TokenEntry {
                    token: "pool-agw-token-0123456789".into(),
                    role: Role::Worker,
                    worker_id: worker_id.map(Into::into),
                    worker_id_prefix: prefix.map(Into::into),
                }],
            },
        )
        .is_err()
    };
    assert!(bad(Some("w1"), Some("agw-")));
    assert!(bad(None, None));
    assert!(bad(None, Some("agw pods")));
    assert!(bad(None, Some("")));
    s.stop().await;
}

/// An auth file that grants nothing is refused (it never turns
/// authentication off), and so is one whose pool prefix covers another
/// worker token's ids (that pool's token could drain the other's
/// workers); two tokens of one pool or one worker (a rotation) are fine.
#[test]
fn an_empty_auth_file_or_overlapping_pools_are_refused() {
    let worker = |token: &str, id: Option<&str>, prefix: Option<&str>| TokenEntry {
        token: token.into(),
        role: Role::Worker,
        worker_id: id.map(Into::into),
        worker_id_prefix: prefix.map(Into::into),
    };
    let load = |tokens: Vec<TokenEntry>| Authenticator::from_file("test", AuthFile { tokens });
    let empty = load(vec![]).unwrap_err().to_string();
    assert!(empty.contains("declares no token"), "{empty}");
    let overlap = load(vec![
        worker("pool-cpu-token-0123456789", None, Some("agq-worker-")),
        worker("pool-gpu-token-0123456789", None, Some("agq-worker-gpu-")),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        overlap.contains("token #1") && overlap.contains("token #2"),
        "{overlap}"
    );
    assert!(load(vec![
        worker("pool-cpu-token-0123456789", None, Some("agq-worker-")),
        worker("one-worker-token-0123456789", Some("agq-worker-7"), None),
    ])
    .is_err());
    let fine = load(vec![
        worker("pool-cpu-token-0123456789", None, Some("cpu-")),
        worker("pool-cpu-token-rotated-0123", None, Some("cpu-")),
        worker("pool-gpu-token-0123456789", None, Some("gpu-")),
        worker("one-worker-token-0123456789", Some("w1"), None),
        worker("one-worker-token-rotated-01", Some("w1"), None),
    ]);
    assert!(fine.is_ok(), "{:?}", fine.err());
}

/// A worker token cannot report another worker's lease by any of the
/// three report RPCs: refused, and the job stays running under its
/// holder's lease; the holder's own token then completes it on
/// ReportJobs.
#[tokio::test]
async fn another_workers_token_cannot_report_its_lease() {
    let e = |token: &str, role, worker_id: Option<&str>| TokenEntry {
        token: token.into(),
        role,
        worker_id: worker_id.map(Into::into),
        worker_id_prefix: None,
    };
    let (client, w1, w2) = (
        "client-token-0123456789",
        "worker-w1-token-0123456789",
        "worker-w2-token-0123456789",
    );
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                e(client, Role::Client, None),
                e(w1, Role::Worker, Some("w1")),
                e(w2, Role::Worker, Some("w2")),
            ],
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&dir.path().join("agq.db"), fast_config(), auth, None).await;
    let ch = s.channel().await;
    let with = |t: &str| InterceptedService::new(ch.clone(), Bearer(Some(t.into())));
    let workers = |t: &str| worker_service_client::WorkerServiceClient::new(with(t));
    let register = |id: &str| RegisterWorkerRequest {
        worker_id: id.into(),
        hostname: "h".into(),
        agw_version: "1".into(),
        capabilities: Some(WorkerCapabilities {
            tools: vec!["cat".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    // w1 registers, opens its streams and is leased the job.
    let mut holder = workers(w1);
    holder.register_worker(register("w1")).await.unwrap();
    let (beat_tx, beats) = tokio::sync::mpsc::channel(4);
    beat_tx
        .send(HeartbeatRequest {
            worker_id: "w1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let _heartbeats = holder
        .heartbeat(tokio_stream::wrappers::ReceiverStream::new(beats))
        .await
        .unwrap();
    let mut leases = holder
        .lease_jobs(LeaseJobsRequest {
            worker_id: "w1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    plan_service_client::PlanServiceClient::new(with(client))
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("p", &["cat"])),
            replace: false,
        })
        .await
        .unwrap();
    action_service_client::ActionServiceClient::new(with(client))
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![ActionInput::default()],
            ..Default::default()
        })
        .await
        .unwrap();
    let lease = leases.message().await.unwrap().expect("a lease for w1");
    let job_id = lease.job.as_ref().unwrap().job_id.clone();
    let report = |worker_id: &str| UpdateJobRequest {
        job_id: job_id.clone(),
        worker_id: worker_id.into(),
        lease_id: lease.lease_id.clone(),
        status: JobStatus::Completed as i32,
        ..Default::default()
    };
    let reports = |worker_id: &str, r: UpdateJobRequest| ReportJobsRequest {
        worker_id: worker_id.into(),
        requests: vec![r],
    };
    let first_answer = |mut w: worker_service_client::WorkerServiceClient<Ch>, r| async move {
        let mut answers = w
            .report_jobs(tokio_stream::iter(vec![r]))
            .await
            .unwrap()
            .into_inner();
        answers.message().await
    };

    // w2's token, naming w1: refused by every report RPC.
    let mut thief = workers(w2);
    let st = thief.update_job(report("w1")).await.unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    let st = thief
        .batch_update_jobs(BatchUpdateJobsRequest {
            worker_id: "w1".into(),
            requests: vec![report("")],
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    let st = first_answer(workers(w2), reports("w1", report("")))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    // w2's token for w2, with w1's lease: the report is refused (the
    // lease is another worker's).
    thief.register_worker(register("w2")).await.unwrap();
    let a = first_answer(workers(w2), reports("w2", report("")))
        .await
        .unwrap()
        .expect("an answer");
    assert_eq!(
        Code::from(a.results[0].code),
        Code::PermissionDenied,
        "{a:?}"
    );

    let jobs = job_service_client::JobServiceClient::new(with(client));
    let job = || {
        let mut jobs = jobs.clone();
        let id = job_id.clone();
        async move {
            jobs.get_job(GetJobRequest { job_id: id })
                .await
                .unwrap()
                .into_inner()
                .job
                .unwrap()
        }
    };
    let j = job().await;
    assert_eq!(
        (j.status, j.worker_id.as_str(), j.attempt),
        (JobStatus::Running as i32, "w1", 1)
    );
    // The holder's own token completes it.
    let a = first_answer(workers(w1), reports("w1", report("")))
        .await
        .unwrap()
        .expect("an answer");
    assert_eq!(a.results[0].code, 0, "{a:?}");
    assert_eq!(job().await.status, JobStatus::Completed as i32);
    s.stop().await;
}

/// A worker token is refused a client call when the call starts, before
/// its request message has arrived: the server does not wait for (nor
/// buffer) the body of a call the token may not make.
#[tokio::test]
async fn a_worker_token_is_refused_a_client_call_before_its_message_arrives() {
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![TokenEntry {
                token: "worker-w1-token-0123456789".into(),
                role: Role::Worker,
                worker_id: Some("w1".into()),
                worker_id_prefix: None,
            }],
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&dir.path().join("agq.db"), fast_config(), auth, None).await;
    let ch = InterceptedService::new(
        s.channel().await,
        Bearer(Some("worker-w1-token-0123456789".into())),
    );
    let answer = call_without_message::<SubmitPlanRequest, SubmitPlanResponse>(
        ch,
        "/agq.v1.PlanService/SubmitPlan",
    )
    .await;
    assert_eq!(answer.err().map(|e| e.code()), Some(Code::PermissionDenied));
}

/// Calls `path` with a request message that never comes; the answer
/// (bounded by 5 s: the server must answer without waiting for it).
async fn call_without_message<Req, Resp>(ch: Ch, path: &'static str) -> Result<(), Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    // The request message never comes: the stream stays open, empty.
    let body = futures_util::stream::pending::<Req>();
    let call = grpc.client_streaming(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        tonic_prost::ProstCodec::<Req, Resp>::default(),
    );
    tokio::time::timeout(std::time::Duration::from_secs(5), call)
        .await
        .expect("no answer while the message was still to come")
        .map(|_: tonic::Response<Resp>| ())
}

/// The worker service refuses a call the token's role can never make when
/// the call starts, before its request message has arrived: a client
/// token's worker call, a worker token's client call, a worker token's
/// admin call.
#[tokio::test]
async fn the_worker_service_refuses_a_role_before_the_message_arrives() {
    let tokens = vec![
        TokenEntry {
            token: "worker-w1-token-0123456789".into(),
            role: Role::Worker,
            worker_id: Some("w1".into()),
            worker_id_prefix: None,
        },
        TokenEntry {
            token: "client-token-0123456789".into(),
            role: Role::Client,
            worker_id: None,
            worker_id_prefix: None,
        },
    ];
    let auth = Authenticator::from_file("test", AuthFile { tokens }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&dir.path().join("agq.db"), fast_config(), auth, None).await;
    let with = |token: &str| {
        let token = token.to_string();
        let s = &s;
        async move { InterceptedService::new(s.channel().await, Bearer(Some(token))) }
    };
    let client = with("client-token-0123456789").await;
    let worker = with("worker-w1-token-0123456789").await;
    let refused = [
        call_without_message::<HeartbeatRequest, HeartbeatResponse>(
            client.clone(),
            "/agq.v1.WorkerService/Heartbeat",
        )
        .await,
        call_without_message::<RegisterWorkerRequest, RegisterWorkerResponse>(
            client,
            "/agq.v1.WorkerService/RegisterWorker",
        )
        .await,
        call_without_message::<ListWorkersRequest, ListWorkersResponse>(
            worker.clone(),
            "/agq.v1.WorkerService/ListWorkers",
        )
        .await,
        call_without_message::<ReleaseWorkerRequest, ReleaseWorkerResponse>(
            worker,
            "/agq.v1.WorkerService/ReleaseWorker",
        )
        .await,
    ];
    for (i, r) in refused.iter().enumerate() {
        assert_eq!(
            r.as_ref().err().map(|e| e.code()),
            Some(Code::PermissionDenied),
            "call {i}: {r:?}"
        );
    }
    s.stop().await;
}

/// Request bytes sent as they are: a whole gRPC message of any content.
#[derive(Clone, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = bytes::Bytes;
    type Decode = ();
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = bytes::Bytes;
    type Error = Status;
    fn encode(
        &mut self,
        item: bytes::Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = ();
    type Error = Status;
    fn decode(&mut self, buf: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<()>, Status> {
        // The message is skipped, whole.
        use bytes::Buf;
        buf.advance(buf.remaining());
        Ok(Some(()))
    }
}

/// Calls SubmitPlan with a whole message of `len` zero bytes (not a valid
/// plan: the server refuses it when it decodes it).
async fn submit_raw(ch: Channel, len: usize) -> Status {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(bytes::Bytes::from(vec![0u8; len])),
        tonic::codegen::http::uri::PathAndQuery::from_static("/agq.v1.PlanService/SubmitPlan"),
        RawCodec,
    )
    .await
    .expect_err("zero bytes are not a plan")
}

/// The server receives at most its request buffer's worth of messages at
/// once over all calls: while one call holds most of it (a large message
/// announced, its bytes still coming), another call's message that does
/// not fit fails with RESOURCE_EXHAUSTED before it is buffered, small
/// calls go on, and the buffer is free again once the first call is gone.
/// Health checking and server reflection need no token, so their
/// messages stay out of the request buffer: calls without a token that
/// announce large messages and never send them take nothing from the
/// callers with one (they filled the whole buffer, and every call with a
/// message failed with RESOURCE_EXHAUSTED), and such messages are refused
/// past a small limit of their own.
#[tokio::test]
async fn calls_that_need_no_token_cannot_fill_the_request_buffer() {
    let dir = tempfile::tempdir().unwrap();
    // Two such calls, each announcing the most its service takes, would
    // hold 32 of the buffer's 40 KiB.
    let (server, ch) = budget_server(dir.path(), 40 * 1024).await;
    let most = u32::try_from(agq::request_budget::UNBUDGETED_MAX_MESSAGE_BYTES).unwrap();
    let holders = [
        hold(&server, &ch, "/grpc.health.v1.Health/Check", most, 1024),
        hold(
            &server,
            &ch,
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            most,
            1024,
        ),
    ];
    for _ in 0..30 {
        let st = submit_raw(ch.clone(), 20 * 1024).await;
        assert_ne!(st.code(), Code::ResourceExhausted, "{st:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health answers");
    let big = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "x".repeat(32 * 1024),
        })
        .await
        .expect_err("a 32 KiB health check is over the limit");
    assert_eq!(big.code(), Code::OutOfRange, "{big:?}");
    for h in holders {
        h.abort();
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn messages_beyond_the_request_buffer_are_refused_until_it_frees() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ch) = budget_server(dir.path(), 1024 * 1024).await;
    let holder = hold_900_kib(&server, &ch);
    // A 200 KiB message does not fit beside it.
    let mut refused = None;
    for _ in 0..100 {
        let st = submit_raw(ch.clone(), 200 * 1024).await;
        if st.code() == Code::ResourceExhausted {
            refused = Some(st);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let refused = refused.expect("a message over the free request buffer was refused");
    assert!(refused.message().contains("retry"), "{refused:?}");
    // Refused for now only: the trailers say when to send it again.
    assert_pushback(&refused);
    // Small messages still go through.
    let small = submit_raw(ch.clone(), 16).await;
    assert_ne!(small.code(), Code::ResourceExhausted, "{small:?}");
    let mut q = queue_service_client::QueueServiceClient::new(ch.clone());
    q.get_queue_stats(GetQueueStatsRequest::default())
        .await
        .expect("a small call is served");
    // The holding call ends: its part of the buffer comes back.
    holder.abort();
    let _ = holder.await;
    let mut after = None;
    for _ in 0..100 {
        let st = submit_raw(ch.clone(), 200 * 1024).await;
        if st.code() != Code::ResourceExhausted {
            after = Some(st);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let after = after.expect("the buffer was given back once the holding call ended");
    // Received whole and decoded: refused as what it is, not a plan.
    assert_ne!(after.code(), Code::ResourceExhausted);
    server.stop().await.unwrap();
}

/// A report refused for a full request buffer is refused for now only:
/// the ReportJobs stream ends with RESOURCE_EXHAUSTED and a retry
/// pushback, which agw takes as "send it again as it is" (a refusal
/// without one, a report too large, makes agw send it again without its
/// outputs).
#[tokio::test]
async fn a_report_refused_for_a_full_request_buffer_carries_a_retry_pushback() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ch) = budget_server(dir.path(), 1024 * 1024).await;
    let holder = hold_900_kib(&server, &ch);
    // The reports go over a connection of their own.
    let other = Channel::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut workers = worker_service_client::WorkerServiceClient::new(other);
    let mut refused = None;
    for _ in 0..100 {
        let report = ReportJobsRequest {
            worker_id: "w1".into(),
            requests: vec![UpdateJobRequest {
                job_id: "j".into(),
                worker_id: "w1".into(),
                lease_id: "l".into(),
                status: JobStatus::Completed as i32,
                error: "x".repeat(200 * 1024),
                ..Default::default()
            }],
        };
        let st = match workers.report_jobs(tokio_stream::iter([report])).await {
            Err(st) => st,
            Ok(answers) => match answers.into_inner().message().await {
                Err(st) => st,
                // Answered: the holding call had not taken the buffer yet.
                Ok(_) => Status::ok(""),
            },
        };
        if st.code() == Code::ResourceExhausted {
            refused = Some(st);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let refused = refused.expect("a report over the free request buffer was refused");
    assert_pushback(&refused);
    holder.abort();
    server.stop().await.unwrap();
}

/// agw sends a report that the server refused for a full request buffer
/// again as it is, its outputs included, once there is room: the refusal's
/// retry pushback says it was refused for now only. Before, agw sent it
/// again without its outputs (as for a report too large), so a busy
/// server lost every output it refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agw_sends_a_report_refused_for_a_full_buffer_again_with_its_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ch) = budget_server(dir.path(), 1024 * 1024).await;
    let other = Channel::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    plan_service_client::PlanServiceClient::new(other.clone())
        .submit_plan(SubmitPlanRequest {
            plan: Some(Plan {
                plan_id: "count".into(),
                tasks: vec![Task {
                    task_number: 1,
                    command: "seq".into(),
                    args: vec!["1".into(), "40000".into()],
                    timeout_secs: 30,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            replace: false,
        })
        .await
        .expect("SubmitPlan");
    // 900 KiB of the 1 MiB buffer held: the 229 kB report cannot fit.
    let holder = hold_900_kib(&server, &ch);
    let mut held = false;
    for _ in 0..100 {
        if submit_raw(other.clone(), 200 * 1024).await.code() == Code::ResourceExhausted {
            held = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(held, "the request buffer was never held");
    let mut agw = process::Agw::new(&server.url(), "w-busy")
        .args(["--tools", "seq", "--output-cap-bytes", "262144"])
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn();
    agw.wait_registered_async().await;
    let job_id = action_service_client::ActionServiceClient::new(other.clone())
        .submit_action(SubmitActionRequest {
            plan_id: "count".into(),
            inputs: vec![ActionInput::default()],
            ..Default::default()
        })
        .await
        .expect("SubmitAction")
        .into_inner()
        .job_ids
        .remove(0);
    // The report was refused once (agw says how it goes on), then room.
    let mut refused = false;
    for _ in 0..300 {
        let log = agw.log();
        if log.contains("result not acknowledged yet") || log.contains("without outputs") {
            refused = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(refused, "the report was never refused: {}", agw.log());
    holder.abort();
    let mut jobs = job_service_client::JobServiceClient::new(other);
    let mut job = None;
    for _ in 0..300 {
        let j = jobs
            .get_job(GetJobRequest {
                job_id: job_id.clone(),
            })
            .await
            .expect("GetJob")
            .into_inner()
            .job
            .expect("the job");
        if j.status == JobStatus::Completed as i32 {
            job = Some(j);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let job = job.unwrap_or_else(|| panic!("the job never completed: {}", agw.log()));
    let out = &job.task_results[0];
    assert_eq!(
        (out.stdout.len(), out.stdout_truncated),
        (228_894, false),
        "the outputs were dropped: {}",
        agw.log()
    );
    server.stop().await.unwrap();
}

/// Asserts that `refused` carries the retry pushback of a refusal for a
/// full request buffer: 100 ms.
fn assert_pushback(refused: &Status) {
    assert_eq!(
        refused
            .metadata()
            .get("grpc-retry-pushback-ms")
            .and_then(|v| v.to_str().ok()),
        Some("100"),
        "{refused:?}"
    );
}

/// Holds 900 KiB of `server`'s request buffer: a SubmitPlan over `ch`
/// announcing a 900 KiB message and sending 100 KiB of it, never
/// answered while the returned task runs.
fn hold_900_kib(server: &agq::local::LocalServer, ch: &Channel) -> tokio::task::JoinHandle<()> {
    hold(
        server,
        ch,
        "/agq.v1.PlanService/SubmitPlan",
        900 * 1024,
        100 * 1024,
    )
}

/// A call of `path` announcing a message of `announced` bytes that sends
/// `sent` bytes of it and never the rest.
fn hold(
    server: &agq::local::LocalServer,
    ch: &Channel,
    path: &str,
    announced: u32,
    sent: usize,
) -> tokio::task::JoinHandle<()> {
    use futures_util::StreamExt;
    use http_body_util::BodyExt;
    use tower::Service;
    let mut first = vec![0u8];
    first.extend_from_slice(&announced.to_be_bytes());
    first.extend_from_slice(&vec![0u8; sent]);
    let frames = futures_util::stream::iter([Ok::<_, Status>(http_body::Frame::data(
        bytes::Bytes::from(first),
    ))])
    .chain(futures_util::stream::pending());
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("{}{path}", server.url()))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(http_body_util::StreamBody::new(
            frames,
        )))
        .unwrap();
    let mut raw = ch.clone();
    tokio::spawn(async move {
        std::future::poll_fn(|cx| raw.poll_ready(cx)).await.unwrap();
        let resp = raw.call(req).await;
        // Never answered while its message is incomplete.
        if let Ok(r) = resp {
            let _ = r.into_body().collect().await;
        }
    })
}

/// A server on a fresh database with a request buffer of `bytes`, and a
/// connection to it.
async fn budget_server(dir: &std::path::Path, bytes: usize) -> (agq::local::LocalServer, Channel) {
    let opts = agq::server::ServerOptions {
        store_ca_file: None,
        store: agq::config::Store::Sqlite,
        db: dir.join("agq.db"),
        sqlite_synchronous: Default::default(),
        engine: fast_config(),
        auth: Authenticator::default(),
        tls: None,
        shutdown_grace: std::time::Duration::from_secs(2),
        request_buffer_bytes: bytes,
    };
    let server = agq::local::LocalServer::start(opts, None, false)
        .await
        .unwrap();
    let ch = Channel::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    (server, ch)
}

/// Stores plan "p" (`true`).
async fn store_plan_p(ch: &Channel) {
    plan_service_client::PlanServiceClient::new(ch.clone())
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("p", &["true"])),
            replace: false,
        })
        .await
        .unwrap();
}

/// Holds the database's write lock from another connection, so the
/// server's writer waits (up to its 10 s busy timeout) with everything
/// queued for it; the lock goes when the returned connection does.
fn hold_write_lock(db: &std::path::Path) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.execute_batch("BEGIN IMMEDIATE").unwrap();
    conn
}

/// Sends a 700 KiB message the server decodes and refuses at once (zero
/// bytes are not a plan), until the request buffer cannot hold it, at
/// most `tries` times 50 ms: whether the buffer filled up.
async fn probe_until_refused(ch: &Channel, tries: usize) -> bool {
    for _ in 0..tries {
        if submit_raw(ch.clone(), 700 * 1024).await.code() == Code::ResourceExhausted {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// Sends a request with `send` (a task that ends when the request is
/// answered) until it waits for the writer holding its share of the
/// request buffer: a 700 KiB probe is refused and stays refused
/// ([`holds_the_buffer`]). A request that a probe kept out (refused with
/// RESOURCE_EXHAUSTED as it arrived) is sent again; at most 100 tries.
/// Returns what `send` returned for the request that waits.
async fn send_until_held<K, T: std::fmt::Debug>(
    ch: &Channel,
    mut send: impl FnMut() -> (K, tokio::task::JoinHandle<Result<T, Status>>),
) -> (K, tokio::task::JoinHandle<Result<T, Status>>) {
    let (mut keep, mut task) = send();
    for _ in 0..100 {
        if task.is_finished() {
            let answer = (&mut task).await.unwrap();
            assert_eq!(
                answer.as_ref().map_err(|e| e.code()).err(),
                Some(Code::ResourceExhausted),
                "answered while the writer waits: {answer:?}"
            );
            (keep, task) = send();
        }
        if probe_until_refused(ch, 1).await && holds_the_buffer(ch).await {
            return (keep, task);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("a message that does not fit beside a queued request was taken");
}

/// Whether a 700 KiB message stays refused over 300 ms (three probes
/// 100 ms apart): the buffer is held, not just taken by a message still
/// arriving.
async fn holds_the_buffer(ch: &Channel) -> bool {
    for _ in 0..3 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        if submit_raw(ch.clone(), 700 * 1024).await.code() != Code::ResourceExhausted {
            return false;
        }
    }
    true
}

/// Waits, at most 10 s, until a 700 KiB message fits the request buffer
/// again.
async fn wait_until_it_fits(ch: &Channel) {
    for _ in 0..200 {
        if submit_raw(ch.clone(), 700 * 1024).await.code() != Code::ResourceExhausted {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the request buffer was not given back");
}

/// A unary request keeps its share of the request buffer until the store
/// has taken its data, not only until its bytes have arrived: while the
/// writer waits for the database, a SubmitAction of 700 KiB queued for it
/// leaves no room in a 1 MiB buffer for another 700 KiB message, even
/// after its caller went away (its data still waits in the writer's
/// queue). Once the writer has run it, the action exists and the buffer
/// is free again. Before, the buffer only bounded messages being
/// received: callers faster than the store grew the server's memory
/// without bound.
#[tokio::test]
async fn a_unary_request_holds_the_request_buffer_until_the_store_has_taken_it() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ch) = budget_server(dir.path(), 1024 * 1024).await;
    store_plan_p(&ch).await;
    let lock = hold_write_lock(&dir.path().join("agq.db"));
    let big = SubmitActionRequest {
        action_id: "big".into(),
        plan_id: "p".into(),
        inputs: (0..11)
            .map(|i| ActionInput {
                values: [(format!("k{i}"), "x".repeat(64_000))].into(),
            })
            .collect(),
        ..Default::default()
    };
    let mut actions = action_service_client::ActionServiceClient::new(ch.clone());
    let send = |req: SubmitActionRequest| {
        let mut actions = actions.clone();
        tokio::spawn(async move { actions.submit_action(req).await })
    };
    let ((), caller) = send_until_held(&ch, || ((), send(big.clone()))).await;
    // The caller goes away; its request still waits for the writer.
    caller.abort();
    let _ = caller.await;
    assert!(
        holds_the_buffer(&ch).await,
        "the share of a request whose caller went away was given back while its data waited"
    );
    drop(lock);
    wait_until_it_fits(&ch).await;
    let a = actions
        .get_action(GetActionRequest {
            action_id: "big".into(),
        })
        .await
        .expect("the queued request was applied")
        .into_inner();
    assert_eq!(a.action.map(|a| a.total_jobs), Some(11));
    server.stop().await.unwrap();
}

/// A ReportJobs request keeps its share of the request buffer until the
/// store has taken it: while the writer waits for the database, a 700 KiB
/// request of reports read from the stream leaves no room in a 1 MiB
/// buffer for another 700 KiB message, also after the worker dropped the
/// stream (the request still waits in the writer's queue); the buffer is
/// free again once the writer has run it.
#[tokio::test]
async fn a_report_request_holds_the_request_buffer_until_the_store_has_taken_it() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ch) = budget_server(dir.path(), 1024 * 1024).await;
    store_plan_p(&ch).await;
    // A worker "w" holding the lease of a job of the action.
    let mut workers = worker_service_client::WorkerServiceClient::new(ch.clone());
    workers
        .register_worker(RegisterWorkerRequest {
            worker_id: "w".into(),
            hostname: "test-host".into(),
            platform: "linux-x86_64".into(),
            agw_version: "sim".into(),
            capabilities: Some(WorkerCapabilities {
                tools: vec!["true".into()],
                ..Default::default()
            }),
            max_concurrent_jobs: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let (beat, beats) = tokio::sync::mpsc::unbounded_channel();
    beat.send(HeartbeatRequest {
        worker_id: "w".into(),
        stats: Some(WorkerStats::default()),
        ..Default::default()
    })
    .unwrap();
    let _heartbeats = workers
        .heartbeat(tokio_stream::wrappers::UnboundedReceiverStream::new(beats))
        .await
        .unwrap()
        .into_inner();
    let mut leases = workers
        .lease_jobs(LeaseJobsRequest {
            worker_id: "w".into(),
        })
        .await
        .unwrap()
        .into_inner();
    action_service_client::ActionServiceClient::new(ch.clone())
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![ActionInput::default()],
            ..Default::default()
        })
        .await
        .unwrap();
    let lease = tokio::time::timeout(std::time::Duration::from_secs(10), leases.message())
        .await
        .expect("a lease within 10 s")
        .unwrap()
        .expect("a lease");
    let lock = hold_write_lock(&dir.path().join("agq.db"));
    // Its completion, with 700 KB of output.
    let reports = vec![UpdateJobRequest {
        job_id: lease.job.as_ref().unwrap().job_id.clone(),
        lease_id: lease.lease_id.clone(),
        status: JobStatus::Completed as i32,
        task_results: vec![TaskResult {
            task_number: 1,
            stdout: "x".repeat(700_000),
            ..Default::default()
        }],
        ..Default::default()
    }];
    // Opens a stream and sends the request on it; the stream stays open.
    let open = || {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(ReportJobsRequest {
            worker_id: "w".into(),
            requests: reports.clone(),
        })
        .unwrap();
        let mut workers = workers.clone();
        let task = tokio::spawn(async move {
            let mut answers = workers
                .report_jobs(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
                .await?
                .into_inner();
            answers.message().await
        });
        (tx, task)
    };
    let (tx, stream) = send_until_held(&ch, open).await;
    // The worker drops the stream; its request still waits for the writer.
    stream.abort();
    let _ = stream.await;
    drop(tx);
    assert!(
        holds_the_buffer(&ch).await,
        "the share of a dropped stream's request was given back while it waited"
    );
    drop(lock);
    wait_until_it_fits(&ch).await;
    server.stop().await.unwrap();
}

/// Calls refused by the token check count in
/// `agq_auth_refusals_total{code}`, so token guessing and a fleet with a
/// wrong token show on the metrics: a missing or unknown token is
/// `Unauthenticated`, a token of another role `PermissionDenied`, whether
/// the interceptor or the worker service's gate refuses it.
#[tokio::test]
async fn refused_calls_are_counted_by_code() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let entry = |token: &str, role, worker_id: Option<&str>| TokenEntry {
        token: token.into(),
        role,
        worker_id: worker_id.map(Into::into),
        worker_id_prefix: None,
    };
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                entry("client-token-0123456789", Role::Client, None),
                entry("worker-w1-token-0123456789", Role::Worker, Some("w1")),
            ],
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with_console(&dir.path().join("agq.db"), fast_config(), auth).await;
    let ch = s.channel().await;
    let with = |t: Option<&str>| InterceptedService::new(ch.clone(), Bearer(t.map(Into::into)));
    for token in [
        None,
        Some("wrong-token-0123456789"),
        Some("another-wrong-token-01"),
    ] {
        let st = call(with(token), "ListPlans").await.unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated);
    }
    // A worker token on a client call (the interceptor), a client token on
    // a worker call (the gate).
    let st = call(with(Some("worker-w1-token-0123456789")), "ListPlans")
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied);
    let st = call(with(Some("client-token-0123456789")), "DrainWorker")
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied);
    call(with(Some("client-token-0123456789")), "ListPlans")
        .await
        .expect("a client call with a client token");
    let mut conn = tokio::net::TcpStream::connect(s.metrics_addr.unwrap())
        .await
        .unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).await.unwrap();
    let count = |code: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(&format!("agq_auth_refusals_total{{code=\"{code}\"}} "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or_else(|| panic!("no refusal count for {code} in:\n{text}"))
    };
    assert_eq!(count("Unauthenticated"), 3.0);
    assert_eq!(count("PermissionDenied"), 2.0);
    s.stop().await;
}
