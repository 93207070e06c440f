//! Logging and optional OpenTelemetry tracing for the `agq` and `agw`
//! binaries, and the W3C trace-context helpers the services and the worker
//! use to carry one trace per job from SubmitAction to the worker's tasks.
//!
//! Tracing is off by default. [`init`] always installs the log output
//! (stderr, `RUST_LOG` filter); given an OTLP endpoint (`--otlp-endpoint`,
//! or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`) it also exports the spans
//! at INFO and above over OTLP/gRPC, whatever `RUST_LOG` filters out of the
//! log. The context travels as a W3C `traceparent` value: in gRPC metadata
//! between processes, and as a plain string in the engine and the lease
//! (`JobLease.traceparent`). See `docs/tracing.md`.

use std::collections::HashMap;

use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::{TraceContextExt, TracerProvider as _},
    Context,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider, Resource};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    filter::LevelFilter, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer,
};

/// The standard OpenTelemetry variable naming the collector.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The metadata key (and carrier key) of the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// The installed tracing: keeps the span exporter alive. Call
/// [`Telemetry::shutdown`] before the runtime stops so the last spans are
/// sent.
#[must_use = "dropping it without shutdown may lose the last spans"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// True when spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans still buffered and stops the exporter (waits at most
    /// the exporter's timeout, 10 s by default). Errors are logged, never
    /// returned: a collector that is down must not change the exit code.
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            if let Err(e) = p.shutdown() {
                tracing::warn!(error = %e, "OpenTelemetry: the last spans may not have been sent");
            }
        }
    }
}

/// The collector endpoint: `flag` when set and not empty, else
/// `OTEL_EXPORTER_OTLP_ENDPOINT` when set and not empty; `None`: tracing is
/// off.
pub fn endpoint(flag: Option<&str>) -> Option<String> {
    let set = |s: String| Some(s.trim().to_owned()).filter(|s| !s.is_empty());
    flag.and_then(|f| set(f.to_owned()))
        .or_else(|| std::env::var(OTLP_ENDPOINT_ENV).ok().and_then(set))
}

/// A tracer provider exporting in batches over OTLP/gRPC to `endpoint`
/// (e.g. `http://localhost:4317`) with `service.name` = `service`. Must run
/// inside a tokio runtime (the exporter's channel is bound to it).
///
/// # Errors
///
/// A message when the endpoint is not a valid URL.
pub fn otlp_provider(service: &'static str, endpoint: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("OpenTelemetry exporter for {endpoint}: {e}"))?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service).build())
        .build())
}

/// A `tracing` layer turning spans (INFO and above) into OpenTelemetry
/// spans of `provider`, named by `service`.
pub fn layer<S>(provider: &SdkTracerProvider, service: &'static str) -> impl Layer<S>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service))
        .with_filter(LevelFilter::INFO)
}

/// Installs the global subscriber: logs on stderr (JSON when `json`)
/// filtered by `RUST_LOG` (default `info`), and, when `otlp_endpoint` is
/// set, the OpenTelemetry layer exporting to it as `service`. Must run
/// inside a tokio runtime when `otlp_endpoint` is set.
///
/// # Errors
///
/// A message when the endpoint is not a valid URL.
pub fn init(
    service: &'static str,
    json: bool,
    otlp_endpoint: Option<&str>,
) -> Result<Telemetry, String> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let provider = otlp_endpoint
        .map(|e| otlp_provider(service, e))
        .transpose()?;
    let otel = provider.as_ref().map(|p| layer(p, service));
    tracing_subscriber::registry().with(fmt).with(otel).init();
    if let Some(e) = otlp_endpoint {
        tracing::info!(
            endpoint = e,
            "OpenTelemetry: exporting traces over OTLP/gRPC"
        );
    }
    Ok(Telemetry { provider })
}

/// Reads gRPC metadata as an OpenTelemetry carrier.
struct MetadataReader<'a>(&'a MetadataMap);

impl Extractor for MetadataReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes an OpenTelemetry carrier into gRPC metadata.
struct MetadataWriter<'a>(&'a mut MetadataMap);

impl Injector for MetadataWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// The remote trace context a caller sent in `traceparent` metadata; an
/// empty context when there is none or it is malformed.
pub fn extract(metadata: &MetadataMap) -> Context {
    TraceContextPropagator::new().extract(&MetadataReader(metadata))
}

/// The trace context of a `traceparent` value; an empty context when it is
/// malformed.
pub fn context_of(traceparent: &str) -> Context {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    TraceContextPropagator::new().extract(&carrier)
}

/// The `traceparent` value of `cx`; `None` when it holds no valid span.
pub fn traceparent_of(cx: &Context) -> Option<String> {
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The `traceparent` of `span` when spans are exported (OpenTelemetry
/// layer installed and the span enabled); `None` otherwise.
pub fn span_traceparent(span: &tracing::Span) -> Option<String> {
    traceparent_of(&span.context())
}

/// Makes `span` a child of the remote context `cx` when `cx` holds a valid
/// span; does nothing when spans are not exported. Call it before the span
/// is first entered.
pub fn set_parent(span: &tracing::Span, cx: Context) {
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Adds `traceparent` metadata for `traceparent` (when set and well-formed)
/// to an outgoing request.
pub fn inject<T>(request: &mut tonic::Request<T>, traceparent: Option<&str>) {
    if let Some(tp) = traceparent {
        let cx = context_of(tp);
        if cx.span().span_context().is_valid() {
            TraceContextPropagator::new()
                .inject_context(&cx, &mut MetadataWriter(request.metadata_mut()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparent_round_trips_through_metadata() {
        let mut req = tonic::Request::new(());
        inject(&mut req, Some(TP));
        assert_eq!(req.metadata().get(TRACEPARENT).unwrap(), TP);
        assert_eq!(
            traceparent_of(&extract(req.metadata())).as_deref(),
            Some(TP)
        );
    }

    #[test]
    fn malformed_or_missing_context_is_ignored() {
        let mut req = tonic::Request::new(());
        inject(&mut req, Some("00-zz-00f067aa0ba902b7-01"));
        inject(&mut req, None);
        assert!(req.metadata().get(TRACEPARENT).is_none());
        assert_eq!(traceparent_of(&extract(req.metadata())), None);
    }

    #[test]
    fn endpoint_prefers_the_flag() {
        assert_eq!(
            endpoint(Some("http://127.0.0.1:4317")).as_deref(),
            Some("http://127.0.0.1:4317")
        );
    }
}
