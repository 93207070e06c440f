//! Thin tonic implementations of the `agq.v1` services: check the caller's
//! role, convert the request to domain types ([`convert`]), call the engine
//! interface ([`crate::core::Engine`]), convert the reply back; engine
//! errors become statuses in one table ([`status`]). Every RPC runs in one
//! tracing span with its method and status code, and is counted in the
//! metrics.

mod action;
pub mod convert;
mod job;
mod plan;
mod queue;
mod schedule;
pub mod status;
mod worker;

use std::future::Future;

use tonic::{Code, Response, Status};
use tracing::Instrument;

pub use self::worker::{report_stream, BoxStream, MAX_UNANSWERED_REPORTS};
pub(crate) use self::{
    action::ActionApi, job::JobApi, plan::PlanApi, queue::QueueApi, schedule::ScheduleApi,
    worker::WorkerApi,
};
use crate::core::SharedEngine;

/// Runs one RPC body inside a span named after `method`, records its status
/// code in the metrics and the log, and wraps the reply.
async fn rpc<T>(
    engine: &SharedEngine,
    method: &'static str,
    body: impl Future<Output = Result<T, Status>>,
) -> Result<Response<T>, Status> {
    rpc_traced(engine, method, opentelemetry::Context::new(), body).await
}

/// [`rpc`], its span a child of the caller's trace context `parent` (from
/// its `traceparent` metadata, [`crate::telemetry::extract`]) when that
/// holds a span. Exported as an OpenTelemetry server span named `method`
/// when tracing is on.
async fn rpc_traced<T>(
    engine: &SharedEngine,
    method: &'static str,
    parent: opentelemetry::Context,
    body: impl Future<Output = Result<T, Status>>,
) -> Result<Response<T>, Status> {
    let span = tracing::info_span!(
        "rpc",
        method,
        code = tracing::field::Empty,
        otel.name = method,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
    );
    crate::telemetry::set_parent(&span, parent);
    let started = std::time::Instant::now();
    let result = body.instrument(span.clone()).await;
    let code = match &result {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    };
    span.record("code", tracing::field::debug(code));
    if code != Code::Ok {
        span.record("otel.status_code", "ERROR");
    }
    engine.metrics().rpc(method, code, started.elapsed());
    match &result {
        Ok(_) => tracing::debug!(parent: &span, "ok"),
        Err(s) if matches!(code, Code::Internal | Code::Unavailable) => {
            tracing::warn!(parent: &span, message = s.message(), "rpc failed")
        }
        Err(s) => tracing::debug!(parent: &span, message = s.message(), "rpc rejected"),
    }
    result.map(Response::new)
}
