//! Agentic units and capability verification, with real `agw` processes
//! against a server on 127.0.0.1:0: a unit answering `--describe` is
//! advertised (GetWorker shows its description) and a plan naming it runs;
//! a plan with `require_verified_tools` gets no lease on a worker that does
//! not answer its challenge (its job says why), and runs on a real agw
//! once the server's challenge is answered; VerifyWorker records a failing
//! answer, which takes the worker out of such plans until it passes again;
//! bad challenges are refused with precise statuses.

mod common;
mod process;

use std::{os::unix::fs::PermissionsExt, path::Path, time::Duration};

use agq::pb::{
    self, heartbeat_response::Command, ActionInput, JobStatus, SubmitActionRequest,
    SubmitPlanRequest, VerifyWorkerRequest,
};
use common::{eventually, fast_config, job, store_tests, worker, SimWorker, TestServer, TestStore};
use tonic::Code;

store_tests! {
    an_agentic_unit_is_advertised_described_and_runs,
    a_plan_requiring_verified_tools_runs_only_on_workers_that_answered,
    bad_challenges_are_refused_with_precise_statuses,
    a_challenge_lost_with_its_stream_is_sent_again_on_the_next,
    a_replaced_plans_open_jobs_keep_getting_their_workers_verified,
}

/// A directory the sandboxed tasks (run as `nobody` under a root agw) can
/// read.
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Starts a real agw `id` against `s` with `tools` and extra flags; waits
/// until it registered.
async fn agw(
    s: &TestServer,
    id: &str,
    tools: &str,
    scratch: &Path,
    extra: &[&str],
) -> process::AgwProc {
    let mut a = process::Agw::new(&s.url(), id)
        .args(["--tools", tools])
        .args(["--scratch-dir".as_ref(), scratch.join(id).as_os_str()])
        .args(["--read-path".as_ref(), std::env::temp_dir().as_os_str()])
        .args(extra)
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn();
    a.wait_registered_async().await;
    a
}

fn plan(id: &str, command: &str, args: &[&str], verified: bool) -> pb::Plan {
    pb::Plan {
        plan_id: id.into(),
        tasks: vec![pb::Task {
            task_number: 1,
            command: command.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            timeout_secs: 30,
            ..Default::default()
        }],
        require_verified_tools: verified,
        ..Default::default()
    }
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

async fn submit(s: &TestServer, plan_id: &str, input: &[(&str, &str)]) -> String {
    s.actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: plan_id.into(),
            inputs: vec![ActionInput {
                values: input
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            }],
            ..Default::default()
        })
        .await
        .expect("submit action")
        .into_inner()
        .job_ids
        .remove(0)
}

async fn an_agentic_unit_is_advertised_described_and_runs(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let files = open_dir();
    let unit = files.path().join("shout-unit");
    std::fs::write(
        &unit,
        r#"#!/bin/sh
if [ "$1" = "--describe" ]; then
  echo '{"name":"shout","version":"2.1","description":"Upper-cases a text file","inputs":[{"name":"file","description":"the text"}]}'
  exit 0
fi
tr a-z A-Z < "$1"
"#,
    )
    .unwrap();
    std::fs::set_permissions(&unit, std::fs::Permissions::from_mode(0o755)).unwrap();
    let input = files.path().join("words.txt");
    std::fs::write(&input, "hello units\n").unwrap();
    std::fs::set_permissions(&input, std::fs::Permissions::from_mode(0o644)).unwrap();
    let scratch = open_dir();
    let _agw = agw(
        &s,
        "unit-host",
        "sh,tr,cat",
        scratch.path(),
        &["--agentic-unit", unit.to_str().unwrap()],
    )
    .await;

    let w = worker(&s, "unit-host").await;
    let caps = w.capabilities.unwrap();
    assert_eq!(caps.agentic_units, vec!["shout".to_string()]);
    assert!(
        !caps.tools.contains(&"shout".to_string()),
        "a unit, not a tool"
    );
    let u = &caps.units[0];
    assert_eq!(
        (u.name.as_str(), u.version.as_str(), u.description.as_str()),
        ("shout", "2.1", "Upper-cases a text file")
    );
    assert_eq!(u.inputs[0].name, "file");

    put_plan(&s, plan("shout-plan", "shout", &["{{file}}"], false)).await;
    let id = submit(&s, "shout-plan", &[("file", input.to_str().unwrap())]).await;
    eventually(30, "the unit's job completed", || async {
        job(&s, &id).await.status == JobStatus::Completed as i32
    })
    .await;
    let done = job(&s, &id).await;
    assert_eq!(done.task_results[0].stdout, "HELLO UNITS\n");
    assert_eq!(done.worker_id, "unit-host");
}

async fn a_plan_requiring_verified_tools_runs_only_on_workers_that_answered(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    // A worker that advertises sort but never answers a challenge.
    let mut liar = SimWorker::start(&s, "liar", &["sort"], 1).await;
    put_plan(&s, plan("checked-sort", "sort", &[], true)).await;
    let challenge = loop {
        match liar.command_within(5_000).await {
            Some(Command::Verify(v)) => break v,
            Some(_) => continue,
            None => panic!("the server did not challenge the unverified worker"),
        }
    };
    assert_eq!(
        (challenge.command.as_str(), challenge.args.clone()),
        ("sort", vec!["--version".to_string()])
    );
    let id = submit(&s, "checked-sort", &[]).await;
    assert!(
        liar.lease_within(1_000).await.is_none(),
        "an unverified worker gets no lease of a plan that requires verification"
    );
    let waiting = job(&s, &id).await;
    assert_eq!(waiting.status, JobStatus::Pending as i32);
    assert!(
        waiting.waiting_reason.contains("not verified (liar)"),
        "{}",
        waiting.waiting_reason
    );
    let pending = worker(&s, "liar").await.verifications;
    assert_eq!(pending.len(), 1);
    assert!(pending[0].answered_at.is_none() && !pending[0].passed);

    // A real agw answers its challenge (sort --version, in its sandbox)
    // and gets the job.
    let scratch = open_dir();
    let _honest = agw(&s, "honest", "sort,cat", scratch.path(), &[]).await;
    eventually(30, "the job ran on the verified worker", || async {
        job(&s, &id).await.status == JobStatus::Completed as i32
    })
    .await;
    assert_eq!(job(&s, &id).await.worker_id, "honest");
    let v = worker(&s, "honest").await.verifications;
    let sort = v.iter().find(|v| v.tool == "sort").expect("sort verified");
    assert!(sort.passed && sort.answered_at.is_some(), "{sort:?}");
    assert_eq!(sort.exit_code, 0);
    assert!(sort.output.contains("sort"), "{:?}", sort.output);

    // An operator's challenge that fails is recorded and takes the worker
    // out of verified plans until it passes again.
    let mut workers = s.workers().await;
    let failing = workers
        .verify_worker(VerifyWorkerRequest {
            worker_id: "honest".into(),
            tool: "sort".into(),
            args: vec!["--no-such-option".into()],
        })
        .await
        .unwrap()
        .into_inner()
        .verification
        .unwrap();
    assert!(failing.answered_at.is_none(), "returned pending");
    eventually(30, "the failing answer recorded", || async {
        worker(&s, "honest")
            .await
            .verifications
            .iter()
            .any(|v| v.challenge_id == failing.challenge_id && v.answered_at.is_some())
    })
    .await;
    let v = worker(&s, "honest").await.verifications;
    let sort = v.iter().find(|v| v.tool == "sort").unwrap();
    assert!(!sort.passed && sort.exit_code != 0, "{sort:?}");
    assert!(!sort.error.is_empty());
    let second = submit(&s, "checked-sort", &[]).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        job(&s, &second).await.status,
        JobStatus::Pending as i32,
        "a failed verification stops the leases"
    );
    workers
        .verify_worker(VerifyWorkerRequest {
            worker_id: "honest".into(),
            tool: "sort".into(),
            args: vec![],
        })
        .await
        .unwrap();
    eventually(30, "verified again, the job runs", || async {
        job(&s, &second).await.status == JobStatus::Completed as i32
    })
    .await;
}

async fn bad_challenges_are_refused_with_precise_statuses(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let _w = SimWorker::start(&s, "w1", &["sort"], 1).await;
    let mut workers = s.workers().await;
    let cases = [
        ("nobody-here", "sort", vec![], Code::NotFound),
        ("w1", "jq", vec![], Code::FailedPrecondition),
        ("w1", "bad/name", vec![], Code::InvalidArgument),
        (
            "w1",
            "sort",
            vec!["x".to_string(); 17],
            Code::InvalidArgument,
        ),
        ("w1", "sort", vec!["x".repeat(257)], Code::InvalidArgument),
        ("bad id!", "sort", vec![], Code::InvalidArgument),
    ];
    for (id, tool, args, code) in cases {
        let err = workers
            .verify_worker(VerifyWorkerRequest {
                worker_id: id.into(),
                tool: tool.into(),
                args,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{id} {tool}: {err:?}");
    }
    assert!(
        worker(&s, "w1").await.verifications.is_empty(),
        "refused challenges record nothing"
    );
}

/// The next Verify command `w` gets within 5 s.
async fn next_challenge(w: &mut SimWorker) -> Option<pb::VerifyCommand> {
    loop {
        match w.command_within(5_000).await {
            Some(Command::Verify(v)) => return Some(v),
            Some(_) => continue,
            None => return None,
        }
    }
}

/// A challenge whose heartbeat stream ended before the worker answered
/// (lost in flight, say) is sent again, with the same id, on the worker's
/// next heartbeat stream; without it the worker would never be verified
/// until it registered again.
async fn a_challenge_lost_with_its_stream_is_sent_again_on_the_next(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut w = SimWorker::start(&s, "w", &["sort"], 1).await;
    put_plan(&s, plan("checked-sort", "sort", &[], true)).await;
    let first = next_challenge(&mut w)
        .await
        .expect("the server did not challenge the unverified worker");
    // The stream ends unanswered; the worker comes back on a new one.
    w.connect(None).await;
    let again = next_challenge(&mut w)
        .await
        .expect("the unanswered challenge was not sent again on the new stream");
    assert_eq!(again, first);
}

/// A job keeps its plan version's `require_verified_tools` after the plan
/// is replaced by a version without it, so the server still challenges
/// the workers that register later for that version's tools; it only
/// challenged for the latest versions, and the job waited for good.
async fn a_replaced_plans_open_jobs_keep_getting_their_workers_verified(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, plan("v", "sort", &[], true)).await;
    let id = submit(&s, "v", &[]).await;
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("v", "uniq", &[], false)),
            replace: true,
        })
        .await
        .expect("replace");
    let mut w = SimWorker::start(&s, "w", &["sort", "uniq"], 1).await;
    let challenge = next_challenge(&mut w)
        .await
        .expect("no challenge for the tools of the version the open job runs");
    assert_eq!(challenge.command, "sort");
    assert_eq!(job(&s, &id).await.status, JobStatus::Pending as i32);
}
