//! The clustered mode across an outage of PostgreSQL longer than the
//! stale window and the job timeout: while the database is down no worker
//! can reach the cluster, so its silence then says nothing about the
//! worker. When maintenance resumes, the workers get a stale window to
//! beat again and their leases the lease grace, and a job that finished
//! during the outage counts in its first attempt. Its own test binary,
//! since it stops the test process's PostgreSQL cluster.

mod common;
mod process;

use std::time::{Duration, Instant};

use agq::pb::*;
use common::{pg, plan};
use nix::sys::signal::Signal;
use process::Serve;
use tonic::transport::Channel;

/// The heartbeat interval of the replica, ms: a stale window of 9 s.
const INTERVAL_MS: u64 = 3_000;
/// How long the database stays down: longer than the stale window and the
/// job timeout.
const OUTAGE: Duration = Duration::from_secs(11);
/// How long the worker stays stopped after the database is back: several
/// maintenance ticks, well within the stale window and the lease grace.
const HELD_AFTER: Duration = Duration::from_secs(4);

async fn job(ch: &Channel, id: &str) -> Option<Job> {
    job_service_client::JobServiceClient::new(ch.clone())
        .get_job(GetJobRequest {
            job_id: id.to_string(),
        })
        .await
        .ok()?
        .into_inner()
        .job
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_that_finished_during_a_database_outage_counts_in_its_first_attempt() {
    let url = pg::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let replica = Serve::new(dir.path().join("unused.db"))
        .args([
            "--store",
            &url,
            "--heartbeat-interval-ms",
            &INTERVAL_MS.to_string(),
            "--lease-grace-ms",
            "10000",
            "--job-timeout-secs",
            "5",
            "--no-console",
        ])
        .kill_on_drop()
        .spawn()
        .expect("replica started");
    assert!(OUTAGE > Duration::from_millis(3 * INTERVAL_MS) && OUTAGE > Duration::from_secs(5));
    let ch = Channel::from_shared(replica.url())
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut p = plan("p", &["sleep"]);
    p.tasks[0].args = vec!["3".into()];
    p.tasks[0].timeout_secs = 4;
    plan_service_client::PlanServiceClient::new(ch.clone())
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await
        .expect("plan");
    let agw = process::Agw::new(&replica.url(), "w")
        .args(["--tools", "sleep", "--max-concurrent-jobs", "1"])
        .spawn();
    let id = action_service_client::ActionServiceClient::new(ch.clone())
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![ActionInput::default()],
            max_attempts: 3,
            ..Default::default()
        })
        .await
        .expect("submit")
        .into_inner()
        .job_ids
        .remove(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let j = job(&ch, &id).await.expect("job");
        if j.status == JobStatus::Running as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "the job was never leased: {j:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The worker is held still (its task runs on, and ends) while the
    // database is down and for a while after it is back, so that
    // maintenance has run before the worker reconnects (it would have
    // declared the worker DEAD and expired the lease), and the reconnect
    // does not depend on where the worker's backoff stood.
    agw.proc.signal(Signal::SIGSTOP);
    pg::crash_and_restart_after(OUTAGE).await;
    tokio::time::sleep(HELD_AFTER).await;
    agw.proc.signal(Signal::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(60);
    let done = loop {
        if let Some(j) = job(&ch, &id).await {
            if j.status == JobStatus::Completed as i32 {
                break j;
            }
            assert!(
                Instant::now() < deadline,
                "the job did not complete after the outage: {j:?}\nagw:\n{}",
                agw.proc.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (done.attempt, done.error.as_str()),
        (1, ""),
        "the outage cost the job an attempt"
    );
}
