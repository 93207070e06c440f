//! Scrapes `GET /metrics` from a live server after a small workload and
//! checks that every metric family is there with sane values, in both
//! formats the endpoint negotiates (classic text 0.0.4 and OpenMetrics).

mod common;

use agq::pb::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn scrape(addr: std::net::SocketAddr, path: &str) -> String {
    scrape_accepting(addr, path, None).await
}

async fn scrape_accepting(addr: std::net::SocketAddr, path: &str, accept: Option<&str>) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n{accept}\r\n").as_bytes())
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
    assert!(
        resp.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4; charset=utf-8"),
        "{resp}"
    );
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    // Classic text: counters named with _total in TYPE, no EOF marker.
    assert!(body.contains("# TYPE agq_jobs_total counter"), "{body}");
    assert!(!body.contains("# EOF"));
    assert!(body.contains("# TYPE agq_build_info gauge"));
    assert!(value(body, "process_resident_memory_bytes") > 0.0);
    assert!(value(body, "process_open_fds") > 0.0);
    assert!(
        value(
            body,
            "agq_rpc_duration_seconds_count{method=\"ActionService/SubmitAction\",code=\"Ok\"}"
        ) >= 1.0
    );
    // OpenMetrics when the scraper asks for it, as Prometheus does.
    let om = scrape_accepting(
        addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
    )
    .await;
    assert!(
        om.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{om}"
    );
    let om_body = om.split("\r\n\r\n").nth(1).unwrap();
    assert!(om_body.contains("# TYPE agq_jobs counter"));
    assert!(om_body.trim_end().ends_with("# EOF"));
    assert_eq!(value(om_body, "agq_jobs_total{status=\"pending\"}"), 4.0);
    assert_eq!(value(body, "agq_jobs_total{status=\"pending\"}"), 4.0);
    assert_eq!(value(body, "agq_jobs_total{status=\"running\"}"), 4.0);
    assert_eq!(value(body, "agq_jobs_total{status=\"completed\"}"), 2.0);
    assert_eq!(value(body, "agq_jobs_total{status=\"dead\"}"), 1.0);
    assert_eq!(value(body, "agq_jobs_current{status=\"completed\"}"), 2.0);
    assert_eq!(value(body, "agq_jobs_current{status=\"cancelled\"}"), 1.0);
    assert_eq!(value(body, "agq_jobs_current{status=\"running\"}"), 0.0);
    assert_eq!(value(body, "agq_queue_length{queue=\"ready\"}"), 0.0);
    assert_eq!(value(body, "agq_queue_length{queue=\"scheduled\"}"), 0.0);
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
    // Every commit's time, in the buckets the bench reads a latency
    // target off: one observation per commit (a background commit may
    // fall between the two series of one scrape), all under +Inf, some
    // time spent.
    let commits = value(body, "agq_store_commit_seconds_count");
    assert!(commits >= 1.0);
    assert!((commits - value(body, "agq_commit_batch_ops_count")).abs() <= 1.0);
    assert_eq!(
        value(body, "agq_store_commit_seconds_bucket{le=\"+Inf\"}"),
        commits
    );
    assert!(value(body, "agq_store_commit_seconds_bucket{le=\"0.003\"}") <= commits);
    assert!(value(body, "agq_store_commit_seconds_sum") > 0.0);
    let missing = scrape(addr, "/nope").await;
    assert!(missing.contains(" 404 "), "{missing}");
    s.stop().await;
}
