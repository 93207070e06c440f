//! Prometheus metrics (prometheus-client) and the HTTP `GET /metrics`
//! endpoint. The same text is returned by `QueueService.GetMetrics`.
//!
//! `GET /metrics` negotiates its format by the `Accept` header: a scraper
//! that accepts `application/openmetrics-text` (Prometheus does) gets
//! OpenMetrics 1.0.0 with that content type; anything else gets the
//! classic text format 0.0.4 (`text/plain; version=0.0.4`), whose counter
//! families are named with their `_total` suffix and which has no `# EOF`.
//! Besides the `agq_*` metrics the registry carries the standard
//! `process_*` metrics of the server process and `agq_build_info`.

use std::{convert::Infallible, sync::Arc};

use http_body_util::Full;
use hyper::{body::Bytes, Request, Response};
use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::Histogram,
        info::Info,
    },
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

/// Label of the refused-call counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabel {
    /// gRPC code name: "Unauthenticated" (no token, a malformed one or an
    /// unknown one) or "PermissionDenied" (a token of another role).
    pub code: String,
}

/// Label of queue depth gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// "ready", "scheduled" or "running".
    pub queue: String,
}

/// Label of the per-pool queue gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    /// "ready", "scheduled" or "running".
    pub queue: String,
    /// The pool's worker selector in canonical form; "" for jobs any
    /// worker may run.
    pub worker_selector: String,
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
    /// Jobs entering each status (counter, `agq_jobs_total{status}`, the
    /// specification's name).
    pub jobs_total: Family<StatusLabel, Counter>,
    /// The counters of [`Metrics::jobs_total`], one per status in
    /// [`JobStatus::ALL`](crate::core::model::JobStatus::ALL) order, made
    /// once: counting a transition neither allocates a label nor takes the
    /// family's lock.
    jobs_total_by_status: Vec<Counter>,
    /// Jobs currently in each status (gauge, `agq_jobs_current{status}`,
    /// refreshed at scrape). On SQLite the `completed`, `dead` and
    /// `cancelled` series appear once the start-up count of the stored
    /// jobs is done (seconds for millions of rows).
    pub jobs: Family<StatusLabel, Gauge>,
    /// Jobs by queue: ready, scheduled, running (gauge,
    /// `agq_queue_length{queue}`, the specification's name; refreshed at
    /// scrape).
    pub queue_length: Family<QueueLabel, Gauge>,
    /// Jobs by queue and worker pool (gauge,
    /// `agq_pool_queue_length{queue,worker_selector}`; refreshed at
    /// scrape; only pools with jobs, at most the 100 with the most).
    pub pool_queue_length: Family<PoolLabel, Gauge>,
    /// Fresh ACTIVE workers running at least one job (gauge,
    /// `agq_workers_active`, the specification's name; refreshed at scrape).
    pub workers_active: Gauge,
    /// Fresh ACTIVE workers running no job (gauge, `agq_workers_idle`;
    /// not counted in `agq_workers_active`).
    pub workers_idle: Gauge,
    /// Seconds from a job becoming ready to its lease being sent.
    pub enqueue_to_lease: Histogram,
    /// Seconds from lease to the completed or failed report.
    pub job_duration: Histogram,
    /// Sum (µs) and count of the enqueue-to-lease observations, for
    /// in-process readers (the console's overview); not exported.
    lease_wait: (std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64),
    /// Leases lost and re-queued (or sent to dead), by reason.
    pub requeues: Family<ReasonLabel, Counter>,
    /// UpdateJob calls rejected by fencing (stale lease or another worker).
    pub fencing_rejections: Counter,
    /// Calls refused by the token check before any handler ran
    /// (`agq_auth_refusals_total`, by code): a rising count of
    /// `Unauthenticated` is someone guessing tokens or a fleet with a
    /// wrong one.
    pub auth_refusals: Family<RefusalLabel, Counter>,
    /// Workers by state and freshness (gauge, refreshed at scrape).
    pub workers: Family<WorkerLabel, Gauge>,
    /// RPCs by method and status code.
    pub rpcs: Family<RpcLabel, Counter>,
    /// Seconds an RPC took to answer (streams: to their first message
    /// stream set-up), by method and status code.
    pub rpc_duration: Family<RpcLabel, Histogram, fn() -> Histogram>,
    /// Operations committed per SQLite transaction (group commit size).
    pub batch_size: Histogram,
    /// Seconds the SQLite engine's `COMMIT` took: writing the batch's WAL
    /// frames and, with `synchronous=FULL`, syncing them to disk (histogram,
    /// `agq_store_commit_seconds`). Every acknowledgement and lease waits
    /// for one; its tail is the floor of theirs.
    pub commit_duration: Histogram,
    /// Finished jobs deleted by the retention sweep (counter).
    pub expired_jobs: Counter,
    /// Workers quarantined after too many job timeouts (counter,
    /// `agq_worker_quarantines_total`); the ones quarantined now are
    /// `agq_workers{state="quarantined"}`.
    pub worker_quarantines: Counter,
    /// Actions submitted by recurring schedules (counter,
    /// `agq_schedule_runs_total`).
    pub schedule_runs: Counter,
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
    /// Workers whose streams this replica holds, each an entry in its
    /// memory (gauge, `agq_replica_workers`; set by the PostgreSQL engine
    /// when the metrics are read, 0 on the embedded store).
    pub replica_workers: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every AGQ metric registered under the `agq_` prefix.
    pub fn new() -> Self {
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessCollector));
        let registry = root.sub_registry_with_prefix("agq");
        registry.register(
            "build",
            "Version of the running agq",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        let jobs_total = Family::<StatusLabel, Counter>::default();
        registry.register("jobs", "Jobs entering each status", jobs_total.clone());
        let jobs = Family::<StatusLabel, Gauge>::default();
        registry.register(
            "jobs_current",
            "Jobs currently in each status",
            jobs.clone(),
        );
        let queue_length = Family::<QueueLabel, Gauge>::default();
        registry.register(
            "queue_length",
            "Jobs waiting (ready, scheduled) or running",
            queue_length.clone(),
        );
        let pool_queue_length = Family::<PoolLabel, Gauge>::default();
        registry.register(
            "pool_queue_length",
            "Jobs waiting (ready, scheduled) or running, by worker pool (the worker selector of their action)",
            pool_queue_length.clone(),
        );
        let workers_active = Gauge::default();
        registry.register(
            "workers_active",
            "Fresh ACTIVE workers running at least one job",
            workers_active.clone(),
        );
        let workers_idle = Gauge::default();
        registry.register(
            "workers_idle",
            "Fresh ACTIVE workers running no job",
            workers_idle.clone(),
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
        let auth_refusals = Family::<RefusalLabel, Counter>::default();
        registry.register(
            "auth_refusals",
            "Calls refused by the token check before any handler ran, by gRPC code",
            auth_refusals.clone(),
        );
        let workers = Family::<WorkerLabel, Gauge>::default();
        registry.register("workers", "Workers by state and freshness", workers.clone());
        let rpcs = Family::<RpcLabel, Counter>::default();
        registry.register(
            "rpc_requests",
            "gRPC requests by method and status code",
            rpcs.clone(),
        );
        let rpc_duration: Family<RpcLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| {
                Histogram::new([
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0, 10.0,
                ])
            });
        registry.register(
            "rpc_duration_seconds",
            "Seconds to answer a gRPC request, by method and status code",
            rpc_duration.clone(),
        );
        let batch_size = Histogram::new([
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ]);
        registry.register(
            "commit_batch_ops",
            "Operations per SQLite commit",
            batch_size.clone(),
        );
        let commit_duration = Histogram::new(COMMIT_SECONDS_BUCKETS);
        registry.register(
            "store_commit_seconds",
            "Seconds a SQLite commit took (writing and syncing the WAL)",
            commit_duration.clone(),
        );
        let worker_quarantines = Counter::default();
        registry.register(
            "worker_quarantines",
            "Workers quarantined after too many of their leases hit the job timeout",
            worker_quarantines.clone(),
        );
        let schedule_runs = Counter::default();
        registry.register(
            "schedule_runs",
            "Actions submitted by recurring schedules",
            schedule_runs.clone(),
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
        let replica_workers = Gauge::default();
        registry.register(
            "replica_workers",
            "Workers whose streams this replica holds in memory (clustered mode)",
            replica_workers.clone(),
        );
        let jobs_total_by_status = crate::core::model::JobStatus::ALL
            .iter()
            .map(|s| {
                jobs_total
                    .get_or_create(&StatusLabel {
                        status: s.name().into(),
                    })
                    .clone()
            })
            .collect();
        Metrics {
            registry: root,
            store_write_errors,
            store_up,
            watch_streams,
            replica_workers,
            jobs_total,
            jobs_total_by_status,
            jobs,
            queue_length,
            pool_queue_length,
            workers_active,
            workers_idle,
            enqueue_to_lease,
            job_duration,
            lease_wait: Default::default(),
            requeues,
            fencing_rejections,
            auth_refusals,
            workers,
            rpcs,
            rpc_duration,
            batch_size,
            commit_duration,
            expired_jobs,
            worker_quarantines,
            schedule_runs,
        }
    }

    /// Counts a job entering `status`.
    pub fn transition(&self, status: crate::core::model::JobStatus) {
        // ALL is in wire order from 1.
        if let Some(c) = self.jobs_total_by_status.get(status as usize - 1) {
            c.inc();
        }
    }

    /// Records a job's wait from ready to leased, in ms: the
    /// `enqueue_to_lease_seconds` histogram and [`Metrics::lease_wait`].
    pub fn lease_waited(&self, ms: i64) {
        use std::sync::atomic::Ordering::Relaxed;
        let ms = ms.max(0);
        self.enqueue_to_lease.observe(ms as f64 / 1000.0);
        self.lease_wait.0.fetch_add(ms as u64 * 1000, Relaxed);
        self.lease_wait.1.fetch_add(1, Relaxed);
    }

    /// Total seconds jobs waited from ready to leased, and how many leases
    /// that covers, since the start.
    pub fn lease_wait(&self) -> (f64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.lease_wait.0.load(Relaxed) as f64 / 1e6,
            self.lease_wait.1.load(Relaxed),
        )
    }

    /// Counts a lost lease.
    pub fn requeue(&self, reason: &str) {
        self.requeues
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Counts a finished RPC and records how long it took (`elapsed`).
    pub fn rpc(&self, method: &str, code: tonic::Code, elapsed: std::time::Duration) {
        let label = RpcLabel {
            method: method.into(),
            code: format!("{code:?}"),
        };
        self.rpcs.get_or_create(&label).inc();
        self.rpc_duration
            .get_or_create(&label)
            .observe(elapsed.as_secs_f64());
    }

    /// The registry in OpenMetrics 1.0.0 text (ends with `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The standard `process_*` metrics of this process, read from `/proc` at
/// each scrape (Linux; nothing elsewhere): CPU seconds, resident and
/// virtual memory, open and maximum file descriptors, threads, start time.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(me) = procfs::process::Process::myself() else {
            return Ok(());
        };
        let Ok(stat) = me.stat() else {
            return Ok(());
        };
        let ticks = procfs::ticks_per_second() as f64;
        let page = procfs::page_size();
        let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / ticks);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let mut gauge = |name: &str, help: &str, v: i64| -> Result<(), std::fmt::Error> {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
        };
        let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            int(stat.rss.saturating_mul(page)),
        )?;
        gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            int(stat.vsize),
        )?;
        gauge(
            "process_threads",
            "Number of OS threads in the process",
            stat.num_threads,
        )?;
        if let Ok(n) = me.fd_count() {
            gauge(
                "process_open_fds",
                "Number of open file descriptors",
                int(n as u64),
            )?;
        }
        if let Ok(limits) = me.limits() {
            if let procfs::process::LimitValue::Value(v) = limits.max_open_files.soft_limit {
                gauge(
                    "process_max_fds",
                    "Maximum number of open file descriptors",
                    int(v),
                )?;
            }
        }
        if let Ok(boot) = procfs::boot_time_secs() {
            gauge(
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                int(boot + stat.starttime / ticks as u64),
            )?;
        }
        Ok(())
    }
}

/// Bucket bounds (seconds) of `agq_store_commit_seconds`: fine around the
/// 1–5 ms that a synced commit takes on common disks, so the share of
/// commits over a latency target (for example 3 ms) can be read off a
/// bucket.
pub const COMMIT_SECONDS_BUCKETS: [f64; 12] = [
    0.000_25, 0.000_5, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
];

/// The OpenMetrics content type of `GET /metrics`.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The classic Prometheus text content type of `GET /metrics`.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Rewrites an OpenMetrics exposition (as [`Metrics::encode`] makes it)
/// into the classic text format 0.0.4: counter and info families take
/// their sample names (`x_total`, `x_info`) in `# HELP` and `# TYPE`, info
/// families become gauges, and `# UNIT`, `# EOF` and `_created` samples
/// are dropped. Histogram and gauge families are the same in both.
pub fn openmetrics_to_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<&str> = None;
    let mut created: Option<String> = None;
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest);
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gaugehistogram" | "stateset" | "unknown" => (name.to_owned(), "untyped"),
                k => (name.to_owned(), k),
            };
            created = (kind == "counter").then(|| format!("{}_created", &name[..name.len() - 6]));
            if let Some(h) = help.take() {
                let text = h.split_once(' ').map_or("", |(_, t)| t);
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        if created.as_deref().is_some_and(|c| line.starts_with(c)) {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// True when an `Accept` header value lets the server answer OpenMetrics.
fn accepts_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|part| {
        let mut fields = part.split(';').map(str::trim);
        let media = fields.next().unwrap_or_default();
        let refused = fields.any(|f| f.replace(' ', "") == "q=0");
        media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
    })
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves; the body
/// comes from `render`, called per request. Other paths get 404. The
/// connection limits are [`crate::http::serve`]'s.
pub async fn serve_http<F, Fut>(
    listener: TcpListener,
    render: F,
    shutdown: impl std::future::Future<Output = ()>,
) where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = String> + Send,
{
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let render = render.clone();
        async move {
            let resp = if req.uri().path() == "/metrics" {
                let om = req
                    .headers()
                    .get(hyper::header::ACCEPT)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(accepts_openmetrics);
                let body = render().await;
                let (body, content_type) = if om {
                    (body, OPENMETRICS_CONTENT_TYPE)
                } else {
                    (openmetrics_to_text(&body), TEXT_CONTENT_TYPE)
                };
                Response::builder()
                    .header("content-type", content_type)
                    .body(Full::new(Bytes::from(body)))
            } else {
                Response::builder()
                    .status(404)
                    .body(Full::new(Bytes::from("not found\n")))
            };
            Ok::<_, Infallible>(resp.unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))))
        }
    });
    crate::http::serve(listener, svc, shutdown, "metrics").await;
}

impl Metrics {
    /// Counts a call refused by the token check, and logs it at debug
    /// level (never the token).
    pub fn auth_refused(&self, status: &tonic::Status) {
        let code = format!("{:?}", status.code());
        tracing::debug!(code = %code, reason = status.message(), "call refused by the token check");
        self.auth_refusals
            .get_or_create(&RefusalLabel { code })
            .inc();
    }
}

/// Shared handle to the metrics.
pub type SharedMetrics = Arc<Metrics>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_counters_with_total_and_has_no_eof() {
        let m = Metrics::new();
        m.transition(crate::core::model::JobStatus::Completed);
        m.rpc(
            "PlanService/GetPlan",
            tonic::Code::Ok,
            std::time::Duration::from_millis(3),
        );
        let om = m.encode();
        assert!(om.contains("# TYPE agq_jobs counter"), "{om}");
        assert!(om.ends_with("# EOF\n"));
        let text = openmetrics_to_text(&om);
        assert!(text.contains("# TYPE agq_jobs_total counter"), "{text}");
        assert!(text.contains("# HELP agq_jobs_total Jobs entering each status"));
        assert!(text.contains("agq_jobs_total{status=\"completed\"} 1"));
        assert!(text.contains("# TYPE agq_build_info gauge"), "{text}");
        assert!(text.contains("agq_build_info{version=\""), "{text}");
        assert!(
            text.contains("# TYPE process_cpu_seconds_total counter"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE process_resident_memory_bytes gauge"),
            "{text}"
        );
        assert!(
            text.contains(
                "agq_rpc_duration_seconds_count{method=\"PlanService/GetPlan\",code=\"Ok\"} 1"
            ),
            "{text}"
        );
        assert!(!text.contains("# EOF"));
        assert!(!text.contains("# TYPE agq_jobs counter"));
    }

    #[test]
    fn accept_header_negotiation() {
        assert!(accepts_openmetrics(
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ));
        assert!(!accepts_openmetrics("text/plain"));
        assert!(!accepts_openmetrics("*/*"));
        assert!(!accepts_openmetrics("application/openmetrics-text; q=0"));
    }
}
