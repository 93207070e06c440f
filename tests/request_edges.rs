//! Edges of request handling, each over the generated client against a real
//! server: GetMetrics in JSON keeps a label value with `"` and `\` whole;
//! SearchJobs refuses an empty time range as ListActions does; and the
//! PostgreSQL listings that page by a text id (plans, schedules) go in
//! byte order, as on SQLite, on a database whose collation is not C.
//! [`nul_bytes`]: text with a NUL byte (which PostgreSQL cannot store) is
//! refused from clients and kept, as U+FFFD, from workers, on both stores.

mod common;

use agq::{config::Store, pb::*};
use common::*;
use tonic::Code;

store_tests! {
    metrics_json_unescapes_a_label_value_with_quotes_and_backslashes,
    search_jobs_refuses_an_empty_time_range,
    a_selector_longer_than_the_limit_in_canonical_form_is_refused_and_stores_nothing,
}

/// A worker selector the grammar accepts with a `"` and a trailing `\`,
/// in canonical form (requirements joined by `, `): it is the label value
/// of `agq_pool_queue_length` as written.
const ODD_SELECTOR: &str = "zz=x\"y, q=a\\";

async fn metrics_json_unescapes_a_label_value_with_quotes_and_backslashes(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("odd", &["true"])),
            replace: false,
        })
        .await
        .expect("submit plan");
    // the selector is accepted as it is
    s.actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: "odd".into(),
            inputs: vec![ActionInput {
                values: [("n".to_string(), "1".to_string())].into(),
            }],
            worker_selector: ODD_SELECTOR.into(),
            ..Default::default()
        })
        .await
        .expect("the selector grammar accepts \" and \\");

    let mut queue = s.queue().await;
    let text = queue
        .get_metrics(GetMetricsRequest {
            format: "prometheus".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .body;
    // the text exposition escapes it (`\"` and `\\`)
    assert!(
        text.contains(r#"worker_selector="zz=x\"y, q=a\\""#),
        "{text}"
    );

    let body = queue
        .get_metrics(GetMetricsRequest {
            format: "json".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .body;
    let samples: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
    let pool: Vec<&serde_json::Value> = samples
        .iter()
        .filter(|s| s["name"] == "agq_pool_queue_length")
        .collect();
    assert!(!pool.is_empty(), "no agq_pool_queue_length in {body}");
    for sample in &pool {
        let labels = sample["labels"].as_object().unwrap();
        let mut keys: Vec<&str> = labels.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["queue", "worker_selector"], "{sample}");
    }
    let odd: Vec<_> = pool
        .iter()
        .filter(|s| s["labels"]["worker_selector"] == ODD_SELECTOR)
        .collect();
    assert!(
        odd.iter()
            .any(|s| s["labels"]["queue"] == "ready" && s["value"] == 1.0),
        "no ready sample with worker_selector {ODD_SELECTOR:?}: {pool:?}"
    );
    // one JSON sample per sample line of the text (fetched again: the
    // calls above added the series of GetMetrics itself), none made up
    let text = queue
        .get_metrics(GetMetricsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .body;
    let lines = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .count();
    assert_eq!(samples.len(), lines, "{body}\n{text}");
    s.stop().await;
}

async fn search_jobs_refuses_an_empty_time_range(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    submit(&s, plan("p", &["true"]), 2, 1).await;
    let at = |secs: i64| {
        Some(prost_types::Timestamp {
            seconds: secs,
            nanos: 0,
        })
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;

    // a range that holds the jobs finds them
    let found = s
        .jobs()
        .await
        .search_jobs(SearchJobsRequest {
            created_after: at(now - 3600),
            created_before: at(now + 3600),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.job_ids.len(), 2);

    // after later than before, or equal (after is inclusive, before is
    // not): empty ranges, refused as ListActions refuses them
    for (after, before) in [(now + 3600, now - 3600), (now, now)] {
        let e = s
            .jobs()
            .await
            .search_jobs(SearchJobsRequest {
                created_after: at(after),
                created_before: at(before),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let listed = s
            .actions()
            .await
            .list_actions(ListActionsRequest {
                created_after: at(after),
                created_before: at(before),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(listed.code(), Code::InvalidArgument);
        assert_eq!(e.message(), listed.message());
        assert!(
            e.message()
                .contains("created_after must be before created_before"),
            "{e:?}"
        );
    }
    s.stop().await;
}

/// Plan (and schedule) ids whose order differs between byte order
/// (`A-3, a-1, a-2, a-4`) and ICU's en-US (`a-1, a-2, A-3, a-4`).
const MIXED_CASE_IDS: [&str; 4] = ["a-1", "a-2", "A-3", "a-4"];

/// A PostgreSQL server on a fresh database whose default collation is
/// ICU en-US (the harness's cluster is initialised with the C locale).
async fn start_on_icu_database(dir: &std::path::Path) -> TestServer {
    let admin = pg::connect(&pg::admin_url().await).await;
    let name = format!("agq_icu_{}", std::process::id());
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8' \
             LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'"
        ))
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE {name} with ICU en-US: {e}"));
    let url = pg::with_dbname(&pg::admin_url().await, &name);
    // the database does order these ids other than by bytes
    let c = pg::connect(&url).await;
    let sorted: Vec<String> = c
        .query(
            "SELECT id FROM unnest($1::text[]) id ORDER BY id",
            &[&MIXED_CASE_IDS.to_vec()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(sorted, MIXED_CASE_IDS, "not an en-US collation");
    // as in common::Backing::new: the server must not fall back to SQLite
    let blocker = dir.join("postgres-store-has-no-sqlite-file");
    std::fs::write(&blocker, "the PostgreSQL store must not open SQLite\n").unwrap();
    let backing = Backing {
        test_store: TestStore::Postgres,
        store: Store::Postgres(url),
        db: blocker.join("agq.db"),
    };
    TestServer::start_on(&backing, fast_config()).await
}

/// Every id ListPlans gives for `pattern`, page by page of `page_size`.
async fn list_plans(s: &TestServer, pattern: &str, page_size: u32) -> Vec<String> {
    let mut plans = s.plans().await;
    let (mut out, mut token) = (Vec::new(), String::new());
    for _ in 0..20 {
        let r = plans
            .list_plans(ListPlansRequest {
                pattern: pattern.into(),
                page_size,
                page_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        out.extend(r.plan_ids);
        if r.next_page_token.is_empty() {
            return out;
        }
        token = r.next_page_token;
    }
    panic!("ListPlans {pattern:?} did not end in 20 pages: {out:?}");
}

#[tokio::test]
async fn postgres_lists_plans_and_schedules_in_byte_order_under_a_non_c_collation() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_on_icu_database(dir.path()).await;
    for id in MIXED_CASE_IDS {
        s.plans()
            .await
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan(id, &["true"])),
                replace: false,
            })
            .await
            .expect("submit plan");
        s.schedules()
            .await
            .create_schedule(CreateScheduleRequest {
                schedule: Some(Schedule {
                    schedule_id: id.into(),
                    plan_id: id.into(),
                    cron: "0 0 0 1 1 *".into(),
                    inputs: vec![ActionInput {
                        values: [("n".to_string(), "1".to_string())].into(),
                    }],
                    ..Default::default()
                }),
            })
            .await
            .expect("create schedule");
    }
    let bytes = ["A-3", "a-1", "a-2", "a-4"];

    // the glob's literal prefix bounds the scan: by bytes, A-3 is before it
    assert_eq!(list_plans(&s, "a-*", 100).await, ["a-1", "a-2", "a-4"]);
    assert_eq!(list_plans(&s, "a-*", 1).await, ["a-1", "a-2", "a-4"]);
    assert_eq!(list_plans(&s, "A-*", 1).await, ["A-3"]);
    assert_eq!(list_plans(&s, "", 100).await, bytes);
    assert_eq!(list_plans(&s, "", 1).await, bytes);
    assert_eq!(list_plans(&s, "*", 1).await, bytes);

    let mut schedules = s.schedules().await;
    let (mut listed, mut token) = (Vec::new(), String::new());
    loop {
        let r = schedules
            .list_schedules(ListSchedulesRequest {
                page_size: 1,
                page_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        listed.extend(r.schedules.into_iter().map(|s| s.schedule_id));
        if r.next_page_token.is_empty() {
            break;
        }
        token = r.next_page_token;
        assert!(listed.len() <= 4, "{listed:?}");
    }
    assert_eq!(listed, bytes);
    s.stop().await;
}

/// NUL bytes, which PostgreSQL `text` and `jsonb` cannot hold: client
/// text (identifiers, configuration, page tokens) with a NUL is refused
/// with INVALID_ARGUMENT before anything is stored, on both stores alike;
/// what a worker reports about a task (outputs, error text, a
/// verification answer's output and error) is never refused for one: each
/// NUL is stored as U+FFFD.
mod nul_bytes {
    use super::*;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;

    store_tests! {
        client_text_with_nul_is_refused_and_nothing_is_stored,
        worker_identifiers_with_nul_or_control_characters_are_refused,
        reported_text_with_nul_is_kept_with_replacement_characters,
        verification_answer_text_with_nul_is_kept_with_replacement_characters,
    }

    /// Asserts that `r` is INVALID_ARGUMENT naming `field`.
    #[track_caller]
    fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, tonic::Status>, field: &str) {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(
            e.message().contains(field),
            "{what}: the message does not name {field}: {e:?}"
        );
    }

    fn input(k: &str, v: &str) -> Vec<ActionInput> {
        vec![ActionInput {
            values: [(k.to_string(), v.to_string())].into(),
        }]
    }

    fn schedule(id: &str, cron: &str, time_zone: &str, inputs: Vec<ActionInput>) -> Schedule {
        Schedule {
            schedule_id: id.into(),
            plan_id: "p".into(),
            cron: cron.into(),
            time_zone: time_zone.into(),
            inputs,
            ..Default::default()
        }
    }

    fn registration(id: &str) -> RegisterWorkerRequest {
        RegisterWorkerRequest {
            worker_id: id.into(),
            hostname: "test-host".into(),
            platform: "linux-x86_64".into(),
            agw_version: "sim".into(),
            capabilities: Some(WorkerCapabilities {
                tools: vec!["true".into()],
                ..Default::default()
            }),
            max_concurrent_jobs: 1,
            ..Default::default()
        }
    }

    fn unit(description: &str, input_description: &str) -> AgenticUnit {
        AgenticUnit {
            name: "summarise".into(),
            version: "1".into(),
            description: description.into(),
            inputs: vec![AgenticUnitInput {
                name: "text".into(),
                description: input_description.into(),
            }],
        }
    }

    async fn client_text_with_nul_is_refused_and_nothing_is_stored(store: TestStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
        let mut plans = s.plans().await;
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan("p", &["true"])),
                replace: false,
            })
            .await
            .expect("submit plan");

        // plans
        let mut p = plan("nul-desc", &["true"]);
        p.plan_description = "a\0b".into();
        let r = plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(p),
                replace: false,
            })
            .await;
        refused("a description with NUL", r, "plan_description");
        let mut p = plan("p", &["true"]);
        p.plan_description = "new\0".into();
        let r = plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(p),
                replace: true,
            })
            .await;
        refused("a replacing description with NUL", r, "plan_description");

        // actions
        let mut actions = s.actions().await;
        let action = |id: &str, inputs: Vec<ActionInput>| SubmitActionRequest {
            action_id: id.into(),
            plan_id: "p".into(),
            inputs,
            ..Default::default()
        };
        let cases = [
            (action("a-value", input("n", "a\0b")), "inputs[0].n"),
            (action("a-key", input("n\0", "1")), "key"),
            (
                SubmitActionRequest {
                    worker_selector: "zone=a\0".into(),
                    ..action("a-selector", input("n", "1"))
                },
                "worker_selector",
            ),
            (
                SubmitActionRequest {
                    concurrency_key: "k\0".into(),
                    max_running: 1,
                    ..action("a-key-limit", input("n", "1"))
                },
                "concurrency_key",
            ),
            (action("a\0", input("n", "1")), "action_id"),
        ];
        for (req, field) in cases {
            let r = actions.submit_action(req).await;
            refused("SubmitAction", r, field);
        }

        // schedules
        let mut schedules = s.schedules().await;
        let cases = [
            (
                schedule("s\0", "0 0 * * *", "", input("n", "1")),
                "schedule_id",
            ),
            (
                schedule("s-cron", "0 0 * * *\0", "", input("n", "1")),
                "cron",
            ),
            (
                schedule("s-tz", "0 0 * * *", "UTC\0", input("n", "1")),
                "time_zone",
            ),
            (
                schedule("s-input", "0 0 * * *", "", input("n", "\0")),
                "inputs[0].n",
            ),
        ];
        for (sched, field) in cases {
            let r = schedules
                .create_schedule(CreateScheduleRequest {
                    schedule: Some(sched),
                })
                .await;
            refused("CreateSchedule", r, field);
        }

        // worker registrations
        let mut workers = s.workers().await;
        let with_unit = |u: AgenticUnit| RegisterWorkerRequest {
            capabilities: Some(WorkerCapabilities {
                tools: vec!["true".into()],
                units: vec![u],
                ..Default::default()
            }),
            ..registration("w-unit")
        };
        let cases = [
            (with_unit(unit("sums\0up", "")), "description"),
            (with_unit(unit("", "the\0text")), "input description"),
            (
                RegisterWorkerRequest {
                    tags: [("zone".to_string(), "a\0".to_string())].into(),
                    ..registration("w-tag")
                },
                "tag value",
            ),
            (
                RegisterWorkerRequest {
                    hostname: "h\0".into(),
                    ..registration("w-host")
                },
                "hostname",
            ),
        ];
        for (req, field) in cases {
            let r = workers.register_worker(req).await;
            refused("RegisterWorker", r, field);
        }

        // page tokens: a token the server issued, with a NUL in its value
        // (the last key of the page)
        let with_nul = |token: &str| {
            let mut text = String::from_utf8(hex::decode(token).unwrap()).unwrap();
            text.push('\0');
            hex::encode(text)
        };
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(plan("q", &["true"])),
                replace: false,
            })
            .await
            .expect("submit plan");
        let token = plans
            .list_plans(ListPlansRequest {
                page_size: 1,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .next_page_token;
        let r = plans
            .list_plans(ListPlansRequest {
                page_size: 1,
                page_token: with_nul(&token),
                ..Default::default()
            })
            .await;
        refused("ListPlans with a token holding NUL", r, "page_token");
        let r = plans
            .list_plans(ListPlansRequest {
                pattern: "p\0".into(),
                ..Default::default()
            })
            .await;
        refused("ListPlans with a pattern holding NUL", r, "pattern");
        for id in ["s-1", "s-2"] {
            schedules
                .create_schedule(CreateScheduleRequest {
                    schedule: Some(schedule(id, "0 0 1 1 *", "", input("n", "1"))),
                })
                .await
                .expect("create schedule");
        }
        let token = schedules
            .list_schedules(ListSchedulesRequest {
                page_size: 1,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .next_page_token;
        let r = schedules
            .list_schedules(ListSchedulesRequest {
                page_size: 1,
                page_token: with_nul(&token),
            })
            .await;
        refused("ListSchedules with a token holding NUL", r, "page_token");

        // nothing was stored
        let listed = plans
            .list_plans(ListPlansRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.plan_ids, ["p", "q"]);
        let p = plans
            .get_plan(GetPlanRequest {
                plan_id: "p".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .plan
            .unwrap();
        assert_eq!((p.version, p.plan_description.as_str()), (1, "test plan p"));
        let listed = actions
            .list_actions(ListActionsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(listed.actions.is_empty(), "{listed:?}");
        let listed = schedules
            .list_schedules(ListSchedulesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<&str> = listed
            .schedules
            .iter()
            .map(|s| s.schedule_id.as_str())
            .collect();
        assert_eq!(ids, ["s-1", "s-2"]);
        let listed = workers
            .list_workers(ListWorkersRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(listed.workers.is_empty(), "{listed:?}");
        s.stop().await;
    }

    /// A heartbeat stream opened by hand, to answer challenges.
    struct Beat {
        tx: mpsc::Sender<HeartbeatRequest>,
        rx: tonic::Streaming<HeartbeatResponse>,
    }

    impl Beat {
        async fn open(s: &TestServer, worker_id: &str) -> Beat {
            let mut workers = s.workers().await;
            workers
                .register_worker(registration(worker_id))
                .await
                .expect("register");
            let (tx, rx) = mpsc::channel(16);
            // the first message goes before the call: the server answers
            // the call once it has read it
            tx.send(HeartbeatRequest {
                worker_id: worker_id.into(),
                stats: Some(WorkerStats::default()),
                ..Default::default()
            })
            .await
            .unwrap();
            Beat {
                tx,
                rx: workers
                    .heartbeat(ReceiverStream::new(rx))
                    .await
                    .expect("heartbeat stream")
                    .into_inner(),
            }
        }

        async fn send(&self, worker_id: &str, verification: Option<VerificationAnswer>) {
            self.tx
                .send(HeartbeatRequest {
                    worker_id: worker_id.into(),
                    stats: Some(WorkerStats::default()),
                    held_leases: None,
                    verification,
                })
                .await
                .unwrap();
        }

        /// Challenges the worker to run `true` and returns the challenge
        /// id it is sent.
        async fn challenge(&mut self, s: &TestServer, worker_id: &str) -> String {
            s.workers()
                .await
                .verify_worker(VerifyWorkerRequest {
                    worker_id: worker_id.into(),
                    tool: "true".into(),
                    args: vec![],
                })
                .await
                .expect("verify worker");
            loop {
                let m = tokio::time::timeout(std::time::Duration::from_secs(5), self.rx.message())
                    .await
                    .expect("no challenge within 5 s")
                    .expect("heartbeat stream")
                    .expect("heartbeat stream ended");
                if let Some(heartbeat_response::Command::Verify(v)) = m.command {
                    return v.challenge_id;
                }
            }
        }
    }

    async fn worker_identifiers_with_nul_or_control_characters_are_refused(store: TestStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
        let (_, jobs) = submit(&s, plan("p", &["true"]), 1, 1).await;
        let mut w = SimWorker::start(&s, "w1", &["true"], 1).await;
        let lease = w.lease().await;
        for bad in ["x\0", &format!("{}\0", lease.lease_id), "x\n"] {
            let r = w
                .client()
                .update_job(UpdateJobRequest {
                    job_id: jobs[0].clone(),
                    worker_id: "w1".into(),
                    lease_id: bad.into(),
                    status: JobStatus::Completed as i32,
                    ..Default::default()
                })
                .await;
            refused("UpdateJob with a lease id holding NUL", r, "lease_id");
            assert_eq!(job(&s, &jobs[0]).await.status, JobStatus::Running as i32);
        }
        w.complete(&lease).await;
        assert_eq!(job(&s, &jobs[0]).await.status, JobStatus::Completed as i32);

        // an answer to a challenge id with NUL ends the heartbeat stream;
        // the challenge stays pending
        let mut beat = Beat::open(&s, "w2").await;
        let id = beat.challenge(&s, "w2").await;
        beat.send(
            "w2",
            Some(VerificationAnswer {
                challenge_id: format!("{id}\0"),
                exit_code: 0,
                output: "ok".into(),
                error: String::new(),
            }),
        )
        .await;
        let ended = loop {
            match tokio::time::timeout(std::time::Duration::from_secs(5), beat.rx.message())
                .await
                .expect("the stream did not end within 5 s")
            {
                Ok(Some(_)) => continue,
                other => break other,
            }
        };
        refused(
            "an answer with NUL in its challenge_id",
            ended,
            "challenge_id",
        );
        let v = worker(&s, "w2").await.verifications;
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].answered_at.is_none(), "{v:?}");
        s.stop().await;
    }

    async fn reported_text_with_nul_is_kept_with_replacement_characters(store: TestStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
        let (_, jobs) = submit(&s, plan("p", &["find"]), 4, 1).await;
        let mut w = SimWorker::start(&s, "w1", &["find"], 4).await;
        let mut leases = Vec::new();
        for _ in 0..4 {
            leases.push(w.lease().await);
        }
        let report =
            |l: &JobLease, status: JobStatus, stdout: &str, error: &str| UpdateJobRequest {
                job_id: l.job.as_ref().unwrap().job_id.clone(),
                worker_id: "w1".into(),
                lease_id: l.lease_id.clone(),
                status: status as i32,
                task_results: vec![TaskResult {
                    task_number: 1,
                    command: "find".into(),
                    exit_code: if status == JobStatus::Completed { 0 } else { 1 },
                    stdout: stdout.into(),
                    stderr: "warn\0".into(),
                    ..Default::default()
                }],
                error: error.into(),
                ..Default::default()
            };
        let mut client = w.client();

        // a failure whose error holds NUL
        let st = client
            .update_job(report(&leases[0], JobStatus::Failed, "a\0", "exit 1: \0\0"))
            .await
            .expect("a FAILED report with NUL in its error")
            .into_inner()
            .status;
        assert_eq!(st, JobStatus::Dead as i32);
        // a completion whose stdout holds NUL (find -print0)
        let st = client
            .update_job(report(&leases[1], JobStatus::Completed, "./a\0./b\0", ""))
            .await
            .expect("a COMPLETED report with NUL in its stdout")
            .into_inner()
            .status;
        assert_eq!(st, JobStatus::Completed as i32);
        // two completions in one batch (one statement on PostgreSQL)
        let results = client
            .batch_update_jobs(BatchUpdateJobsRequest {
                worker_id: "w1".into(),
                requests: leases[2..]
                    .iter()
                    .map(|l| report(l, JobStatus::Completed, "./a\0./b\0", ""))
                    .collect(),
            })
            .await
            .expect("a batch of completions with NUL")
            .into_inner()
            .results;
        for r in &results {
            assert_eq!(r.code, 0, "{results:?}");
        }

        let by_id = |l: &JobLease| l.job.as_ref().unwrap().job_id.clone();
        let failed = job(&s, &by_id(&leases[0])).await;
        assert_eq!(failed.status, JobStatus::Dead as i32);
        // (the server prefixes the attempt)
        assert!(
            failed.error.ends_with("exit 1: \u{FFFD}\u{FFFD}"),
            "{:?}",
            failed.error
        );
        assert_eq!(failed.task_results[0].stdout, "a\u{FFFD}");
        assert_eq!(failed.task_results[0].stderr, "warn\u{FFFD}");
        for l in &leases[1..] {
            let done = job(&s, &by_id(l)).await;
            assert_eq!(done.status, JobStatus::Completed as i32);
            assert_eq!(done.task_results[0].stdout, "./a\u{FFFD}./b\u{FFFD}");
            assert_eq!(done.task_results[0].stderr, "warn\u{FFFD}");
        }
        assert!(jobs.iter().all(|j| leases.iter().any(|l| by_id(l) == *j)));
        s.stop().await;
    }

    async fn verification_answer_text_with_nul_is_kept_with_replacement_characters(
        store: TestStore,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
        let mut beat = Beat::open(&s, "w1").await;
        let id = beat.challenge(&s, "w1").await;
        beat.send(
            "w1",
            Some(VerificationAnswer {
                challenge_id: id,
                exit_code: 2,
                output: "out\0".into(),
                error: "\0err".into(),
            }),
        )
        .await;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let answered = loop {
            let v = worker(&s, "w1").await.verifications;
            if let Some(v) = v.into_iter().find(|v| v.answered_at.is_some()) {
                break Some(v);
            }
            assert!(tokio::time::Instant::now() < deadline, "no answer recorded");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        let v = answered.unwrap();
        assert!(!v.passed);
        assert_eq!(
            (v.output.as_str(), v.error.as_str()),
            ("out\u{FFFD}", "\u{FFFD}err")
        );
        // the stream is still open: the answer was not refused
        beat.send("w1", None).await;
        let m = tokio::time::timeout(std::time::Duration::from_secs(5), beat.rx.message())
            .await
            .expect("no reply within 5 s");
        assert!(matches!(m, Ok(Some(_))), "{m:?}");
        s.stop().await;
    }
}

/// A selector of 966 bytes whose canonical form (`, ` between values)
/// is 1029 bytes, over the 1024 a selector may have.
fn widening_selector() -> String {
    let values: Vec<String> = (0..64).map(|i| format!("v{i:013}")).collect();
    let text = format!("k in ({})", values.join(","));
    assert!(
        text.len() <= 1024 && text.len() + 63 > 1024,
        "{}",
        text.len()
    );
    text
}

/// A worker selector within the size limit as written, whose canonical
/// form (what the server stores, and parses again to schedule) is over
/// it, is refused with INVALID_ARGUMENT wherever a selector is given
/// (SubmitAction, SubmitPlan, CreateSchedule) and stores nothing. It was
/// stored, and every use of it failed: SubmitAction with INTERNAL.
async fn a_selector_longer_than_the_limit_in_canonical_form_is_refused_and_stores_nothing(
    store: TestStore,
) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    submit(&s, plan("p", &["true"]), 1, 1).await;
    let selector = widening_selector();

    let e = s
        .actions()
        .await
        .submit_action(SubmitActionRequest {
            action_id: "wide".into(),
            plan_id: "p".into(),
            inputs: vec![ActionInput::default()],
            worker_selector: selector.clone(),
            ..Default::default()
        })
        .await
        .expect_err("an action with the selector was accepted");
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
    let e = s
        .actions()
        .await
        .get_action(GetActionRequest {
            action_id: "wide".into(),
        })
        .await
        .expect_err("the refused action was stored");
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());

    let mut wide = plan("wide", &["true"]);
    wide.worker_selector = selector.clone();
    let e = s
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(wide),
            replace: false,
        })
        .await
        .expect_err("a plan with the selector was accepted");
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
    let e = s
        .plans()
        .await
        .get_plan(GetPlanRequest {
            plan_id: "wide".into(),
            ..Default::default()
        })
        .await
        .expect_err("the refused plan was stored");
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());

    let e = s
        .schedules()
        .await
        .create_schedule(CreateScheduleRequest {
            schedule: Some(Schedule {
                schedule_id: "wide".into(),
                plan_id: "p".into(),
                cron: "* * * * * *".into(),
                inputs: vec![ActionInput::default()],
                worker_selector: selector.clone(),
                ..Default::default()
            }),
        })
        .await
        .expect_err("a schedule with the selector was accepted");
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
    let e = s
        .schedules()
        .await
        .get_schedule(GetScheduleRequest {
            schedule_id: "wide".into(),
        })
        .await
        .expect_err("the refused schedule was stored");
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());

    // The same selector within the limit once canonical is accepted.
    let fits = selector.replacen(",v0000000000063", "", 1);
    s.actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id: "p".into(),
            inputs: vec![ActionInput::default()],
            worker_selector: fits,
            ..Default::default()
        })
        .await
        .expect("a selector that fits in canonical form");
    s.stop().await;
}

/// A Heartbeat call refused for its first message (a verification answer
/// whose challenge_id holds a control character: INVALID_ARGUMENT)
/// changes nothing: the worker's open heartbeat stream stays its stream,
/// so it is not made suspect and keeps its lease past the grace.
#[tokio::test]
async fn a_refused_heartbeat_call_leaves_the_open_stream_and_the_lease_alone() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let (_, job_ids) = submit(&s, plan("p", &["true"]), 1, 1).await;
    let mut w = SimWorker::start(&s, "w", &["true"], 1).await;
    let lease = w.lease().await;
    assert_eq!(lease.job.as_ref().unwrap().job_id, job_ids[0]);

    let first = HeartbeatRequest {
        worker_id: "w".into(),
        stats: Some(WorkerStats::default()),
        held_leases: None,
        verification: Some(VerificationAnswer {
            challenge_id: "bad\u{1}id".into(),
            ..Default::default()
        }),
    };
    let e = s
        .workers()
        .await
        .heartbeat(tokio_stream::iter(vec![first]))
        .await
        .expect_err("a control character in challenge_id was accepted");
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());

    // Past the 400 ms grace a suspect worker's leases are re-queued; this
    // one's open stream kept beating all along.
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let wk = worker(&s, "w").await;
    assert!(wk.connected, "the worker lost its heartbeat stream: {wk:?}");
    let j = job(&s, &job_ids[0]).await;
    assert_eq!(
        (j.status, j.worker_id.as_str()),
        (JobStatus::Running as i32, "w"),
        "the lease was lost: {j:?}"
    );
    w.complete(&lease).await;
    assert_eq!(
        job(&s, &job_ids[0]).await.status,
        JobStatus::Completed as i32
    );
    s.stop().await;
}
