//! The clustered mode across a crash of PostgreSQL itself: two replicas
//! under load, the database killed with an immediate shutdown
//! (`pg_ctl restart -m immediate`) and started again: no acknowledged job
//! is lost, the replicas recover and finish the work. Its own test binary,
//! since it restarts the test process's PostgreSQL cluster.

mod common;
mod process;

use std::time::{Duration, Instant};

use agq::pb::*;
use common::{pg, plan};
use process::Serve;
use tonic::transport::Channel;

async fn channel(url: &str) -> Option<Channel> {
    let endpoint = Channel::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(500));
    tokio::time::timeout(Duration::from_secs(2), endpoint.connect())
        .await
        .ok()?
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_crash_loses_no_acknowledged_job() {
    let url = pg::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let replicas: Vec<_> = (0..2)
        .map(|_| {
            Serve::new(dir.path().join("unused.db"))
                .args([
                    "--store",
                    &url,
                    "--heartbeat-interval-ms",
                    "300",
                    "--lease-grace-ms",
                    "600",
                    "--retry-backoff-base-ms",
                    "50",
                    "--retry-backoff-max-ms",
                    "200",
                    "--no-console",
                ])
                .kill_on_drop()
                .spawn()
                .expect("replica started")
        })
        .collect();
    let urls: Vec<String> = replicas.iter().map(|r| r.url()).collect();
    let ch = channel(&urls[0]).await.expect("connect");
    plan_service_client::PlanServiceClient::new(ch)
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("p", &["cat"])),
            replace: false,
        })
        .await
        .expect("plan");
    // agw workers, one on each replica, running `cat` for real.
    let mut workers = Vec::new();
    for (i, u) in urls.iter().enumerate() {
        workers.push(
            process::Agw::new(u, &format!("agw-{i}"))
                .args(["--tools", "cat", "--max-concurrent-jobs", "4"])
                .spawn(),
        );
    }
    // Submissions before, during and after the crash; only acknowledged
    // ones count.
    let mut acked: Vec<String> = Vec::new();
    let submit = |u: String| async move {
        let ch = channel(&u).await?;
        action_service_client::ActionServiceClient::new(ch)
            .submit_action(SubmitActionRequest {
                plan_id: "p".into(),
                inputs: (0..5)
                    .map(|n| ActionInput {
                        values: [("n".to_string(), n.to_string())].into(),
                    })
                    .collect(),
                max_attempts: 100,
                ..Default::default()
            })
            .await
            .ok()
            .map(|r| r.into_inner().job_ids)
    };
    for i in 0..10 {
        if let Some(ids) = submit(urls[i % 2].clone()).await {
            acked.extend(ids);
        }
    }
    pg::crash_and_restart().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut after = 0;
    while after < 10 && Instant::now() < deadline {
        if let Some(ids) = submit(urls[after % 2].clone()).await {
            acked.extend(ids);
            after += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(after, 10, "the replicas did not take submissions again");
    // Every acknowledged job completes.
    let mut left = acked.clone();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !left.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for id in left {
            let done = match channel(&urls[0]).await {
                Some(ch) => job_service_client::JobServiceClient::new(ch)
                    .get_job(GetJobRequest { job_id: id.clone() })
                    .await
                    .ok()
                    .and_then(|r| r.into_inner().job)
                    .is_some_and(|j| j.status == JobStatus::Completed as i32),
                None => false,
            };
            if !done {
                still.push(id);
            }
        }
        left = still;
        if !left.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert!(
        left.is_empty(),
        "{} of {} acknowledged jobs never completed after the database crash",
        left.len(),
        acked.len()
    );
    println!(
        "database crash: {} acknowledged jobs all completed",
        acked.len()
    );
    drop(workers);
}
