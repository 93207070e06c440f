//! OpenTelemetry tracing end to end, in one process: a client submits an
//! action with a W3C `traceparent`, a real AGQ server (on 127.0.0.1) leases
//! the job to the `agw` worker library, which runs the plan's tasks and
//! reports. Every span goes to an in-memory exporter; the test checks that
//! they form one trace: client → SubmitAction → lease → job → tasks, and
//! the worker's UpdateJob calls under the job.
//!
//! This file holds one test only: it installs the global subscriber.

mod common;

use std::time::Duration;

use agq::{
    pb::{self, *},
    telemetry,
    worker::{self, AgwArgs, Exit},
};
use clap::Parser;
use common::{plan, TestServer};
use opentelemetry::{trace::SpanId, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tonic::Request;
use tracing_subscriber::layer::SubscriberExt;

/// The caller's context: trace 4bf92f…, its span 00f067aa0ba902b7, sampled.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn attr(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

fn str_attr(span: &SpanData, key: &str) -> String {
    attr(span, key)
        .map(|v| v.as_str().into_owned())
        .unwrap_or_default()
}

/// An integer attribute (unsigned ones may be exported as strings).
fn int_attr(span: &SpanData, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::I64(v)) => v,
        Some(Value::String(v)) if v.as_str().parse::<i64>().is_ok() => v.as_str().parse().unwrap(),
        other => panic!("span {} has {key} = {other:?}", span.name),
    }
}

/// The one span of the trace named `name`.
fn one<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "spans named {name}: {found:#?}");
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_trace_from_submit_to_the_workers_tasks() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry().with(telemetry::layer(&provider, "agq-test"));
    tracing::subscriber::set_global_default(subscriber).expect("first subscriber");

    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(&dir.path().join("agq.db"), common::fast_config()).await;

    // agw, in this process: two tasks, the second fails (exit code 1).
    let args = AgwArgs::try_parse_from([
        "agw",
        "--server",
        &server.url(),
        "--worker-id",
        "traced",
        "--tools",
        "true,false",
        "--insecure-no-sandbox",
    ])
    .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::mpsc::channel(1);
    let agw = tokio::spawn(worker::run(args.into_config().unwrap(), stop_rx));

    server
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("traced", &["true", "false"])),
            replace: false,
        })
        .await
        .unwrap();
    let mut req = Request::new(SubmitActionRequest {
        plan_id: "traced".into(),
        inputs: vec![ActionInput::default()],
        max_attempts: 1,
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CLIENT_SPAN}-01").parse().unwrap(),
    );
    let job_id = server
        .actions()
        .await
        .submit_action(req)
        .await
        .unwrap()
        .into_inner()
        .job_ids
        .remove(0);

    // Until the failure is recorded and its UpdateJob span has ended
    // (bounded: 30 s).
    let mut jobs = server.jobs().await;
    let mut spans = Vec::new();
    for _ in 0..300 {
        let job = jobs
            .get_job(GetJobRequest {
                job_id: job_id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        spans = exporter.get_finished_spans().unwrap();
        spans.retain(|s| s.span_context.trace_id().to_string() == TRACE_ID);
        let done =
            job.status == pb::JobStatus::Dead as i32 && spans.iter().any(|s| s.name == "job");
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let submit = one(&spans, "ActionService/SubmitAction");
    assert_eq!(submit.parent_span_id.to_string(), CLIENT_SPAN);
    let lease = one(&spans, "lease");
    assert_eq!(lease.parent_span_id, submit.span_context.span_id());
    let job = one(&spans, "job");
    assert_eq!(job.parent_span_id, lease.span_context.span_id());
    assert_eq!(str_attr(job, "job_id"), job_id);

    let mut tasks: Vec<_> = spans.iter().filter(|s| s.name == "task").collect();
    tasks.sort_by_key(|t| int_attr(t, "task_number"));
    assert_eq!(tasks.len(), 2, "{tasks:#?}");
    for t in &tasks {
        assert_eq!(t.parent_span_id, job.span_context.span_id(), "{t:#?}");
    }
    assert_eq!(str_attr(tasks[0], "command"), "true");
    assert_eq!(int_attr(tasks[0], "exit_code"), 0);
    assert_eq!(str_attr(tasks[1], "command"), "false");
    assert_eq!(int_attr(tasks[1], "exit_code"), 1);

    // The worker's reports (progress and the final one) join the trace
    // under the job span.
    let updates: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "WorkerService/UpdateJob")
        .collect();
    assert!(!updates.is_empty(), "no UpdateJob span in {spans:#?}");
    for u in &updates {
        assert_eq!(u.parent_span_id, job.span_context.span_id(), "{u:#?}");
    }
    assert!(spans.iter().all(|s| s.parent_span_id != SpanId::INVALID));

    stop_tx.send(()).await.unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(30), agw)
        .await
        .expect("agw drained")
        .unwrap()
        .unwrap();
    assert_eq!(exit, Exit::Drained);
    server.stop().await;
    provider.shutdown().unwrap();
}
