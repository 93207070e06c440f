//! Permanent failures: a task's `permanent_exit_codes` and a worker's
//! `permanent` report send a job to dead after one attempt, whatever
//! attempts are left; RetryJob still brings it back; bad codes and
//! misplaced flags are refused and change nothing.

mod common;

use agq::pb::{
    self, GetJobRequest, GetPlanRequest, JobStatus, RetryJobRequest, SubmitPlanRequest,
    UpdateJobRequest,
};
use common::{fast_config, job, plan, store_tests, submit, SimWorker, TestServer, TestStore};
use tonic::Code;

store_tests! {
    bad_permanent_exit_codes_are_refused_and_store_nothing,
    a_permanent_failure_is_dead_at_once_and_can_still_be_retried,
    an_ordinary_failure_is_still_retried,
}

async fn bad_permanent_exit_codes_are_refused_and_store_nothing(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    let cases: [(&str, Vec<i32>); 5] = [
        ("zero", vec![0]),
        ("negative", vec![-1]),
        ("too-big", vec![256]),
        ("twice", vec![3, 4, 3]),
        ("too-many", (1..=33).collect()),
    ];
    for (id, codes) in cases {
        let mut p = plan(id, &["false"]);
        p.tasks[0].permanent_exit_codes = codes;
        let err = plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(p),
                replace: false,
            })
            .await
            .expect_err(id);
        assert_eq!(err.code(), Code::InvalidArgument, "{id}: {err:?}");
        assert!(
            err.message().contains("permanent_exit_codes"),
            "{id}: {err:?}"
        );
        let missing = plans
            .get_plan(GetPlanRequest {
                plan_id: id.into(),
                version: 0,
            })
            .await
            .expect_err("nothing stored");
        assert_eq!(missing.code(), Code::NotFound);
    }
    // Good codes are stored and read back as given.
    let mut p = plan("ok", &["false"]);
    p.tasks[0].permanent_exit_codes = vec![2, 64, 255];
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .expect("valid codes");
    let got = plans
        .get_plan(GetPlanRequest {
            plan_id: "ok".into(),
            version: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .plan
        .unwrap();
    assert_eq!(got.tasks[0].permanent_exit_codes, vec![2, 64, 255]);
    s.stop().await;
}

async fn a_permanent_failure_is_dead_at_once_and_can_still_be_retried(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("perm", &["false"]), 1, 5).await;
    let mut w = SimWorker::start(&s, "w1", &["false"], 1).await;
    let lease = w.lease().await;
    let report = |status: JobStatus, permanent: bool| UpdateJobRequest {
        job_id: ids[0].clone(),
        worker_id: "w1".into(),
        lease_id: lease.lease_id.clone(),
        status: status as i32,
        error: "task 1 (false) exited with code 1".into(),
        permanent,
        ..Default::default()
    };

    // `permanent` belongs to failure reports only: refused, nothing changes.
    for status in [JobStatus::Completed, JobStatus::Running] {
        let err = w
            .client()
            .update_job(report(status, true))
            .await
            .expect_err("permanent with another status");
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert_eq!(job(&s, &ids[0]).await.status, JobStatus::Running as i32);
    }

    // Four attempts are left, yet the job is dead after this one.
    let r = w
        .client()
        .update_job(report(JobStatus::Failed, true))
        .await
        .expect("permanent failure")
        .into_inner();
    assert_eq!(r.status, JobStatus::Dead as i32);
    let j = job(&s, &ids[0]).await;
    assert_eq!((j.status, j.attempt), (JobStatus::Dead as i32, 1));
    assert!(
        j.error
            .starts_with("attempt 1 of 5: permanent failure, not retried: task 1 (false)"),
        "{}",
        j.error
    );
    // The repeated report (its reply lost) is acknowledged, not re-applied.
    let again = w
        .client()
        .update_job(report(JobStatus::Failed, true))
        .await
        .expect("repeat")
        .into_inner();
    assert_eq!(again.status, JobStatus::Dead as i32);
    assert!(
        w.lease_within(300).await.is_none(),
        "a dead job is not leased"
    );

    // RetryJob brings it back for another attempt.
    let retried = s
        .jobs()
        .await
        .retry_job(RetryJobRequest {
            job_id: ids[0].clone(),
            priority: None,
        })
        .await
        .expect("retry")
        .into_inner()
        .job
        .unwrap();
    // Pending, or already leased again to the waiting worker.
    assert!(
        [JobStatus::Pending as i32, JobStatus::Running as i32].contains(&retried.status),
        "{retried:?}"
    );
    let second = w.lease().await;
    assert_ne!(second.lease_id, lease.lease_id);
    w.complete(&second).await;
    let done = s
        .jobs()
        .await
        .get_job(GetJobRequest {
            job_id: ids[0].clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(done.status, JobStatus::Completed as i32);
    s.stop().await;
}

async fn an_ordinary_failure_is_still_retried(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("retry", &["false"]), 1, 2).await;
    let mut w = SimWorker::start(&s, "w1", &["false"], 1).await;
    let first = w.lease().await;
    let r = w.report(&first, JobStatus::Failed).await.expect("failure");
    assert_ne!(
        r.status,
        pb::JobStatus::Dead as i32,
        "attempt 1 of 2 is retried"
    );
    let second = w.lease().await;
    assert_eq!(second.attempt, 2);
    let r = w.report(&second, JobStatus::Failed).await.expect("failure");
    assert_eq!(r.status, JobStatus::Dead as i32);
    assert_eq!(job(&s, &ids[0]).await.attempt, 2);
    s.stop().await;
}
