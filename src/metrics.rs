//! Prometheus metrics (prometheus-client) and the HTTP `GET /metrics`
//! endpoint. The same text is returned by `QueueService.GetMetrics`.

use std::{convert::Infallible, sync::Arc};

use http_body_util::Full;
use hyper::{body::Bytes, Request, Response};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio::net::TcpListener;

/// Label of metrics split by job status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// Lower-case job status, e.g. "completed".
    pub status: String,
}

/// Label of the re-queue counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why a lease was lost: stream_lost, stale_heartbeat, timeout,
    /// unregister, job_failed, not_held.
    pub reason: String,
}

/// Label of queue depth gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// "ready", "scheduled" or "running".
    pub queue: String,
}

/// Label of worker gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// Lower-case worker state.
    pub state: String,
    /// "true" when the last heartbeat is younger than 3 x interval.
    pub fresh: String,
}

/// Label of RPC counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabel {
    /// "Service/Method".
    pub method: String,
    /// gRPC code name, e.g. "Ok", "NotFound".
    pub code: String,
}

/// Every AGQ metric.
pub struct Metrics {
    registry: Registry,
    /// Jobs entering each status (counter).
    pub job_transitions: Family<StatusLabel, Counter>,
    /// Jobs currently in each status (gauge, refreshed at scrape).
    pub jobs: Family<StatusLabel, Gauge>,
    /// Pending jobs by queue (gauge, refreshed at scrape).
    pub queue_depth: Family<QueueLabel, Gauge>,
    /// Seconds from a job becoming ready to its lease being sent.
    pub enqueue_to_lease: Histogram,
    /// Seconds from lease to the completed or failed report.
    pub job_duration: Histogram,
    /// Leases lost and re-queued (or sent to dead), by reason.
    pub requeues: Family<ReasonLabel, Counter>,
    /// UpdateJob calls rejected by fencing (stale lease or another worker).
    pub fencing_rejections: Counter,
    /// Workers by state and freshness (gauge, refreshed at scrape).
    pub workers: Family<WorkerLabel, Gauge>,
    /// RPCs by method and status code.
    pub rpcs: Family<RpcLabel, Counter>,
    /// Operations committed per SQLite transaction (group commit size).
    pub batch_size: Histogram,
    /// Finished jobs deleted by the retention sweep (counter).
    pub expired_jobs: Counter,
    /// Writes the store could not commit for a cause outside AGQ (disk
    /// full, I/O error): failed batch commits, failed probe commits and
    /// operations broken by such an error (counter,
    /// `agq_store_write_errors_total`).
    pub store_write_errors: Counter,
    /// 1 while the store commits, 0 while it cannot (gauge, `agq_store_up`).
    pub store_up: Gauge,
    /// Open WatchAction streams (gauge, `agq_watch_streams`): each holds one
    /// subscription, released when its stream ends.
    pub watch_streams: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every AGQ metric registered under the `agq_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("agq");
        let job_transitions = Family::<StatusLabel, Counter>::default();
        registry.register(
            "job_transitions",
            "Jobs entering each status",
            job_transitions.clone(),
        );
        let jobs = Family::<StatusLabel, Gauge>::default();
        registry.register("jobs", "Jobs currently in each status", jobs.clone());
        let queue_depth = Family::<QueueLabel, Gauge>::default();
        registry.register(
            "queue_depth",
            "Jobs waiting (ready, scheduled) or running",
            queue_depth.clone(),
        );
        let latency_buckets = [
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0,
        ];
        let enqueue_to_lease = Histogram::new(latency_buckets);
        registry.register(
            "enqueue_to_lease_seconds",
            "Seconds from a job becoming ready to its lease being sent",
            enqueue_to_lease.clone(),
        );
        let job_duration = Histogram::new([
            0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
        ]);
        registry.register(
            "job_duration_seconds",
            "Seconds from lease to final report",
            job_duration.clone(),
        );
        let requeues = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "requeues",
            "Leases lost and re-queued or sent to dead, by reason",
            requeues.clone(),
        );
        let fencing_rejections = Counter::default();
        registry.register(
            "fencing_rejections",
            "UpdateJob calls rejected by lease fencing",
            fencing_rejections.clone(),
        );
        let workers = Family::<WorkerLabel, Gauge>::default();
        registry.register("workers", "Workers by state and freshness", workers.clone());
        let rpcs = Family::<RpcLabel, Counter>::default();
        registry.register(
            "rpc_requests",
            "gRPC requests by method and status code",
            rpcs.clone(),
        );
        let batch_size = Histogram::new([
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ]);
        registry.register(
            "commit_batch_ops",
            "Operations per SQLite commit",
            batch_size.clone(),
        );
        let expired_jobs = Counter::default();
        registry.register(
            "expired_jobs",
            "Finished jobs deleted by the retention sweep",
            expired_jobs.clone(),
        );
        let store_write_errors = Counter::default();
        registry.register(
            "store_write_errors",
            "Writes the store could not commit for a cause outside AGQ (disk full, I/O error)",
            store_write_errors.clone(),
        );
        let store_up = Gauge::default();
        store_up.set(1);
        registry.register(
            "store_up",
            "1 while the store commits, 0 while it cannot (health NOT_SERVING)",
            store_up.clone(),
        );
        let watch_streams = Gauge::default();
        registry.register(
            "watch_streams",
            "Open WatchAction streams",
            watch_streams.clone(),
        );
        Metrics {
            registry,
            store_write_errors,
            store_up,
            watch_streams,
            job_transitions,
            jobs,
            queue_depth,
            enqueue_to_lease,
            job_duration,
            requeues,
            fencing_rejections,
            workers,
            rpcs,
            batch_size,
            expired_jobs,
        }
    }

    /// Counts a job entering `status`.
    pub fn transition(&self, status: crate::pb::JobStatus) {
        self.job_transitions
            .get_or_create(&StatusLabel {
                status: status_name(status).into(),
            })
            .inc();
    }

    /// Counts a lost lease.
    pub fn requeue(&self, reason: &str) {
        self.requeues
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Counts a finished RPC.
    pub fn rpc(&self, method: &str, code: tonic::Code) {
        self.rpcs
            .get_or_create(&RpcLabel {
                method: method.into(),
                code: format!("{code:?}"),
            })
            .inc();
    }

    /// The registry in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Lower-case name of a job status, as used in labels and text.
pub fn status_name(s: crate::pb::JobStatus) -> &'static str {
    use crate::pb::JobStatus::*;
    match s {
        Unspecified => "unspecified",
        Pending => "pending",
        Running => "running",
        Completed => "completed",
        Failed => "failed",
        Dead => "dead",
        Cancelled => "cancelled",
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves; the body
/// comes from `render`, called per request. Other paths get 404.
pub async fn serve_http<F, Fut>(
    listener: TcpListener,
    render: F,
    shutdown: impl std::future::Future<Output = ()>,
) where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = String> + Send,
{
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    continue;
                }
            },
        };
        let render = render.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let render = render.clone();
                async move {
                    let resp = if req.uri().path() == "/metrics" {
                        Response::builder()
                            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                            .body(Full::new(Bytes::from(render().await)))
                    } else {
                        Response::builder()
                            .status(404)
                            .body(Full::new(Bytes::from("not found\n")))
                    };
                    Ok::<_, Infallible>(
                        resp.unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
                    )
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, svc)
                .await;
        });
    }
}

/// Shared handle to the metrics.
pub type SharedMetrics = Arc<Metrics>;
