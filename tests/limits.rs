//! Bounds on what a request may make the server hold or do (issue 14):
//! WatchAction registers nothing before it validates and gives back what
//! it registered when its stream ends, within per-connection and total
//! bounds; one glob dialect for ListPlans; plan ids "." and ".." refused;
//! report size capped; oversized input maps refused; `run_at` bounded; a
//! final report repeated after a lost reply acknowledged again.

mod common;

use std::{collections::HashMap, time::Duration};

use agq::{
    config::EngineConfig,
    pb::{
        ActionInput, GetPlanRequest, GetQueueStatsRequest, JobStatus, ListPlansRequest,
        SubmitActionRequest, SubmitPlanRequest, TaskResult, UpdateJobRequest, WatchActionRequest,
    },
};
use common::{fast_config, metric, plan, SimWorker, TestServer};
use tonic::Code;

/// Submits an action of `n` jobs of plan `plan_id` (which no worker can
/// run, so they stay pending); returns its id.
async fn pending_action(server: &TestServer, plan_id: &str) -> String {
    let _ = server
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan(plan_id, &["no-such-tool"])),
            replace: false,
        })
        .await;
    server
        .actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: plan_id.into(),
            inputs: vec![ActionInput::default()],
            ..Default::default()
        })
        .await
        .expect("SubmitAction")
        .into_inner()
        .action_id
}

/// 1,000 WatchAction calls with large invalid ids and 1,000 valid streams
/// cancelled by the client leave the server's watcher count
/// (`agq_watch_streams`) back at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_action_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let action_id = pending_action(&s, "watched").await;
    let mut actions = s.actions().await;
    for i in 0..1000 {
        // 64 KiB ids: half with characters no id may hold, half too long.
        let id = if i % 2 == 0 {
            "#".repeat(64 * 1024)
        } else {
            "a".repeat(64 * 1024)
        };
        let e = actions
            .watch_action(WatchActionRequest { action_id: id })
            .await
            .expect_err("a bad id");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    assert_eq!(metric(&s, "agq_watch_streams").await, 0.0);
    // 1,000 valid streams, each read once then cancelled, on a few
    // connections (at most 100 open at once per connection).
    for round in 0..20 {
        let mut actions = s.actions().await;
        let mut open = Vec::new();
        for _ in 0..50 {
            let mut stream = actions
                .watch_action(WatchActionRequest {
                    action_id: action_id.clone(),
                })
                .await
                .unwrap_or_else(|e| panic!("round {round}: {e:?}"))
                .into_inner();
            let first = stream.message().await.expect("first update").expect("open");
            assert_eq!(first.action.unwrap().action_id, action_id);
            open.push(stream);
        }
        drop(open);
    }
    common::eventually(10, "agq_watch_streams back at 0", || async {
        metric(&s, "agq_watch_streams").await == 0.0
    })
    .await;
    // An unknown (valid) id registers nothing either.
    let e = actions
        .watch_action(WatchActionRequest {
            action_id: "no-such-action".into(),
        })
        .await
        .expect_err("unknown action");
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(metric(&s, "agq_watch_streams").await, 0.0);
}

/// Open WatchAction streams are bounded per connection and in total;
/// over a bound, RESOURCE_EXHAUSTED; a closed stream frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_are_bounded_per_connection_and_in_total() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        max_watch_streams: 5,
        max_watch_streams_per_connection: 3,
        ..fast_config()
    };
    let s = TestServer::start(&dir.path().join("agq.db"), cfg).await;
    let action_id = pending_action(&s, "bounded").await;
    let req = || WatchActionRequest {
        action_id: action_id.clone(),
    };
    let mut c1 = s.actions().await;
    let mut c2 = s.actions().await;
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(c1.watch_action(req()).await.expect("within bounds"));
    }
    let e = c1
        .watch_action(req())
        .await
        .expect_err("4th on one connection");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("per connection"), "{e:?}");
    for _ in 0..2 {
        open.push(c2.watch_action(req()).await.expect("other connection"));
    }
    let mut c3 = s.actions().await;
    let e = c3.watch_action(req()).await.expect_err("6th in all");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(metric(&s, "agq_watch_streams").await, 5.0);
    drop(open);
    common::eventually(10, "places freed", || async {
        metric(&s, "agq_watch_streams").await == 0.0
    })
    .await;
    c3.watch_action(req()).await.expect("a freed place");
}

/// ListPlans matches with the engine that validates the pattern: `[!a]*`
/// is negation, `[^a]*` is not (the `^` is a member), `**a` is refused,
/// and paging walks exactly the matches.
#[tokio::test]
async fn list_plans_speaks_one_glob_dialect() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    for id in ["apple", "avocado", "banana", "cherry", "a.b"] {
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan(id, &["cat"])),
                replace: false,
            })
            .await
            .expect("SubmitPlan");
    }
    let list = |pattern: &str, page_size: u32, page_token: String| {
        let mut plans = plans.clone();
        let pattern = pattern.to_string();
        async move {
            plans
                .list_plans(ListPlansRequest {
                    pattern,
                    page_size,
                    page_token,
                })
                .await
                .map(|r| r.into_inner())
        }
    };
    // (pattern, the ids it matches, in order)
    let cases: [(&str, &[&str]); 6] = [
        ("[!a]*", &["banana", "cherry"]),
        ("[^a]*", &["a.b", "apple", "avocado"]),
        ("a*", &["a.b", "apple", "avocado"]),
        ("*o", &["avocado"]),
        ("?????", &["apple"]),
        ("a[.]b", &["a.b"]),
    ];
    for (pattern, want) in cases {
        let got = list(pattern, 0, String::new())
            .await
            .unwrap_or_else(|e| panic!("pattern {pattern:?}: {e:?}"))
            .plan_ids;
        assert_eq!(got, want, "pattern {pattern:?}");
    }
    let e = list("**********a", 0, String::new()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Paging one id at a time returns the same matches.
    let mut seen = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let r = list("a*", 1, token).await.unwrap();
        seen.extend(r.plan_ids);
        if r.next_page_token.is_empty() {
            break;
        }
        token = r.next_page_token;
    }
    assert_eq!(seen, ["a.b", "apple", "avocado"]);
}

/// Plan ids "." and ".." are refused like any path-like id.
#[tokio::test]
async fn dot_and_dot_dot_are_not_plan_ids() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    for id in [".", ".."] {
        let e = plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan(id, &["cat"])),
                replace: false,
            })
            .await
            .expect_err("a path-like id");
        assert_eq!(e.code(), Code::InvalidArgument, "{id}: {e:?}");
        let e = plans
            .get_plan(GetPlanRequest {
                plan_id: id.into(),
                version: 0,
            })
            .await
            .expect_err("a path-like id");
        assert_eq!(e.code(), Code::InvalidArgument, "{id}: {e:?}");
    }
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("...", &["cat"])),
            replace: false,
        })
        .await
        .expect("three dots are a name, not a path step");
}

/// A report larger than `max_report_bytes` is refused with
/// RESOURCE_EXHAUSTED and stores nothing; the same outcome without the
/// outputs is accepted. The default cap is what agw sends at most.
#[tokio::test]
async fn worker_reports_are_size_capped() {
    assert!(
        EngineConfig::default().max_report_bytes >= agq::worker::agent::REPORT_BUDGET_BYTES + 4096,
        "the default cap must take what agw sends"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        max_report_bytes: 64 * 1024,
        ..fast_config()
    };
    let s = TestServer::start(&dir.path().join("agq.db"), cfg).await;
    let (_, ids) = common::submit(&s, plan("capped", &["cat"]), 1, 3).await;
    let mut w = SimWorker::start(&s, "cap-w", &["cat"], 1).await;
    let lease = w.lease().await;
    let report = |stdout: String| UpdateJobRequest {
        job_id: ids[0].clone(),
        worker_id: "cap-w".into(),
        lease_id: lease.lease_id.clone(),
        status: JobStatus::Completed as i32,
        task_results: vec![TaskResult {
            task_number: 1,
            command: "cat".into(),
            stdout,
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut client = w.client();
    let e = client
        .update_job(report("x".repeat(65 * 1024)))
        .await
        .expect_err("over the cap");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("--max-report-bytes"), "{e:?}");
    assert_eq!(
        common::job(&s, &ids[0]).await.status,
        JobStatus::Running as i32
    );
    client
        .update_job(report("y".repeat(1024)))
        .await
        .expect("under the cap");
    let j = common::job(&s, &ids[0]).await;
    assert_eq!(j.status, JobStatus::Completed as i32);
    assert_eq!(j.task_results[0].stdout.len(), 1024);
}

/// A final report sent again after its outcome was recorded (the first
/// reply lost) is acknowledged with the job's status and changes
/// nothing; a report on a lease the server ended (not by that report) is
/// still refused.
#[tokio::test]
async fn a_repeated_final_report_is_acknowledged_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let (_, ids) = common::submit(&s, plan("repeat", &["cat"]), 2, 3).await;
    let mut w = SimWorker::start(&s, "rep-w", &["cat"], 2).await;
    let a = w.lease().await;
    let b = w.lease().await;
    w.complete(&a).await;
    let again = w
        .report(&a, JobStatus::Completed)
        .await
        .expect("the repeat of a recorded completion");
    assert_eq!(again.status, JobStatus::Completed as i32);
    let failed = w
        .report(&a, JobStatus::Failed)
        .await
        .expect_err("a different outcome for a completed job");
    assert_eq!(failed.code(), Code::FailedPrecondition);
    // A failure reported twice: acknowledged both times, one attempt used.
    let first = w.report(&b, JobStatus::Failed).await.expect("failure");
    let second = w.report(&b, JobStatus::Failed).await.expect("repeat");
    assert_eq!(first.status, second.status);
    let jb = common::job(&s, &b.job.as_ref().unwrap().job_id).await;
    assert_eq!(jb.attempt, 1);
    assert!(ids.contains(&jb.job_id));
}

/// An input map with a million keys is refused with INVALID_ARGUMENT
/// before any key is looked at or anything is stored.
#[tokio::test]
async fn a_million_key_input_is_refused_early() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let mut plans = s.plans().await;
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("wide", &["cat"])),
            replace: false,
        })
        .await
        .unwrap();
    let values: HashMap<String, String> = (0..1_000_000)
        .map(|i| (format!("k{i}"), String::new()))
        .collect();
    let req = SubmitActionRequest {
        plan_id: "wide".into(),
        inputs: vec![ActionInput { values }],
        ..Default::default()
    };
    let encoding = std::time::Instant::now();
    let bytes = prost::Message::encoded_len(&req);
    let _ = prost::Message::encode_to_vec(&req);
    let encoding = encoding.elapsed();
    let started = std::time::Instant::now();
    let e = s
        .actions()
        .await
        .submit_action(req)
        .await
        .expect_err("a million keys");
    eprintln!(
        "a 1M-key input ({bytes} bytes) refused in {:?} (of which encoding it, client side, takes about {encoding:?})",
        started.elapsed()
    );
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("1000000 values"), "{e:?}");
    let stats = s
        .queue()
        .await
        .get_queue_stats(GetQueueStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!((stats.ready_length, stats.scheduled_length), (0, 0));
}

/// `run_at` is bounded: year 9999 and anything past the horizon are
/// refused; within it, the job is scheduled.
#[tokio::test]
async fn run_at_is_bounded_to_a_horizon() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        max_run_at_ahead: Duration::from_secs(3600),
        ..fast_config()
    };
    let s = TestServer::start(&dir.path().join("agq.db"), cfg).await;
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("later", &["cat"])),
            replace: false,
        })
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let at = |seconds: i64| SubmitActionRequest {
        plan_id: "later".into(),
        inputs: vec![ActionInput::default()],
        run_at: Some(prost_types::Timestamp { seconds, nanos: 0 }),
        ..Default::default()
    };
    let mut actions = s.actions().await;
    for seconds in [253_402_300_799, now + 2 * 3600] {
        let e = actions
            .submit_action(at(seconds))
            .await
            .expect_err("past the horizon");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("--max-run-at-ahead-secs"), "{e:?}");
    }
    actions
        .submit_action(at(now + 1800))
        .await
        .expect("within the horizon");
    let stats = s
        .queue()
        .await
        .get_queue_stats(GetQueueStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.scheduled_length, 1);
    assert!(stats.next_scheduled_due_in_secs <= 1800);
    // The default horizon is a year and a day.
    assert_eq!(
        EngineConfig::default().max_run_at_ahead,
        Duration::from_secs(366 * 86_400)
    );
}

/// One HTTP/2 connection holds at most `MAX_CONCURRENT_STREAMS` calls
/// open: with that many ReportJobs streams open, a further call on the
/// same connection waits, and goes through once one of them ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_holds_a_bounded_number_of_calls() {
    use agq::{pb::worker_service_client::WorkerServiceClient, server::MAX_CONCURRENT_STREAMS};
    use tokio_stream::wrappers::ReceiverStream;
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let channel = s.channel().await;
    let mut open = Vec::new();
    for _ in 0..MAX_CONCURRENT_STREAMS {
        let (tx, rx) = tokio::sync::mpsc::channel::<agq::pb::ReportJobsRequest>(1);
        let stream = tokio::time::timeout(
            Duration::from_secs(10),
            WorkerServiceClient::new(channel.clone()).report_jobs(ReceiverStream::new(rx)),
        )
        .await
        .expect("a call within the bound opens")
        .expect("ReportJobs");
        open.push((tx, stream));
    }
    let mut queue = agq::pb::queue_service_client::QueueServiceClient::new(channel.clone());
    let waiting = tokio::spawn(async move { queue.get_queue_stats(GetQueueStatsRequest {}).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "a call past the bound was not held back"
    );
    drop(open.pop());
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the held call goes through once a stream ends")
        .unwrap()
        .expect("GetQueueStats");
}
