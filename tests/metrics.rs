//! Scrapes `GET /metrics` from a live server after a small workload and
//! checks that every metric family is there with sane values.

mod common;

use agq::pb::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn scrape(addr: std::net::SocketAddr, path: &str) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    conn.read_to_string(&mut out).await.unwrap();
    out
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

#[tokio::test]
async fn metrics_endpoint_after_a_workload() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with_metrics(&dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = submit(&s, plan("m", &["cat"]), 4, 1).await;
    let mut w = SimWorker::start(&s, "m1", &["cat"], 4).await;
    let leases = [
        w.lease().await,
        w.lease().await,
        w.lease().await,
        w.lease().await,
    ];
    w.complete(&leases[0]).await;
    w.complete(&leases[1]).await;
    w.report(&leases[2], JobStatus::Failed).await.unwrap();
    s.jobs()
        .await
        .cancel_job(CancelJobRequest {
            job_id: leases[3].job.as_ref().unwrap().job_id.clone(),
        })
        .await
        .unwrap();
    // A report on the cancelled job's lease is fenced (a repeat of a
    // recorded report would be acknowledged, not fenced).
    let e = w.report(&leases[3], JobStatus::Completed).await;
    assert!(e.is_err());
    assert_eq!(ids.len(), 4);

    let addr = s.metrics_addr.unwrap();
    let resp = scrape(addr, "/metrics").await;
    assert!(
        resp.starts_with("HTTP/1.0 200") || resp.starts_with("HTTP/1.1 200"),
        "{resp}"
    );
    assert!(resp.contains("text/plain"));
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    assert_eq!(
        value(body, "agq_job_transitions_total{status=\"pending\"}"),
        4.0
    );
    assert_eq!(
        value(body, "agq_job_transitions_total{status=\"running\"}"),
        4.0
    );
    assert_eq!(
        value(body, "agq_job_transitions_total{status=\"completed\"}"),
        2.0
    );
    assert_eq!(
        value(body, "agq_job_transitions_total{status=\"dead\"}"),
        1.0
    );
    assert_eq!(value(body, "agq_jobs{status=\"completed\"}"), 2.0);
    assert_eq!(value(body, "agq_jobs{status=\"cancelled\"}"), 1.0);
    assert_eq!(value(body, "agq_jobs{status=\"running\"}"), 0.0);
    assert_eq!(value(body, "agq_queue_depth{queue=\"ready\"}"), 0.0);
    assert_eq!(value(body, "agq_queue_depth{queue=\"scheduled\"}"), 0.0);
    assert_eq!(value(body, "agq_enqueue_to_lease_seconds_count"), 4.0);
    assert!(value(body, "agq_enqueue_to_lease_seconds_sum") < 5.0);
    assert_eq!(value(body, "agq_job_duration_seconds_count"), 3.0);
    assert_eq!(
        value(body, "agq_requeues_total{reason=\"job_failed\"}"),
        1.0
    );
    assert_eq!(value(body, "agq_fencing_rejections_total"), 1.0);
    assert_eq!(
        value(body, "agq_workers{state=\"active\",fresh=\"true\"}"),
        1.0
    );
    assert_eq!(
        value(body, "agq_workers{state=\"dead\",fresh=\"false\"}"),
        0.0
    );
    assert_eq!(
        value(
            body,
            "agq_rpc_requests_total{method=\"ActionService/SubmitAction\",code=\"Ok\"}"
        ),
        1.0
    );
    assert_eq!(value(body, "agq_rpc_requests_total{method=\"WorkerService/UpdateJob\",code=\"FailedPrecondition\"}"), 1.0);
    assert!(value(body, "agq_commit_batch_ops_count") >= 1.0);
    let missing = scrape(addr, "/nope").await;
    assert!(missing.contains(" 404 "), "{missing}");
    s.stop().await;
}
