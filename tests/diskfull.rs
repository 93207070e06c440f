//! A full disk must not freeze the queue (issue 14). AGQ runs with its
//! database on a 4 MiB tmpfs, 2 MiB of it a filler file (a real file
//! system that fills up, not an injected fault), real `agw` workers run the jobs, and a client submits
//! until the store cannot commit. Then: writes are refused with
//! UNAVAILABLE (or RESOURCE_EXHAUSTED) naming the cause, gRPC health is
//! NOT_SERVING, `agq_store_write_errors_total` counts, reads keep working.
//! To keep the disk full while the test looks (a store whose log can be
//! reused commits small writes even on a full disk, and rightly reports
//! SERVING), the test holds a read transaction open, so every commit must
//! grow the log, and fills the space left after the first refusal.
//! The filler files on the tmpfs are deleted to free space; without a restart
//! health returns to SERVING and every acknowledged job completes, its side
//! effect (a line appended to a log outside the tmpfs) done exactly once,
//! and `PRAGMA integrity_check` says ok.
//!
//! Mounting needs root, as CI runs; without it the test fails (it does not
//! skip).

mod common;
mod process;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use agq::{
    config::EngineConfig,
    pb::{
        ActionInput, GetQueueStatsRequest, JobStatus, ListPlansRequest, SearchJobsRequest,
        SubmitActionRequest, SubmitPlanRequest,
    },
};
use common::{metric, TestServer};
use tonic::Code;
use tonic_health::pb::{
    health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
};

/// Size of the tmpfs holding the database.
const FS_SIZE: &str = "4m";
/// Bytes of the filler file deleted to free space.
const FILLER_BYTES: usize = 2 * 1024 * 1024;
/// Bytes of padding per job input: each job takes ~8 KiB of the database.
const PAD_BYTES: usize = 8 * 1024;
/// Jobs per SubmitAction.
const JOBS_PER_ACTION: usize = 8;
/// Most SubmitAction calls before the disk must be full (2 MiB / 64 KiB).
const MAX_SUBMITS: usize = 200;
/// How long any wait may take, in seconds.
const WAIT_SECS: u64 = 120;

/// A tmpfs mounted on a temporary directory; unmounted when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of [`FS_SIZE`]. Panics (never skips) when not root
    /// or when mount fails.
    fn mount() -> Tmpfs {
        assert!(
            // SAFETY: geteuid has no preconditions and cannot fail.
            unsafe { libc::geteuid() } == 0,
            "tests/diskfull.rs mounts a tmpfs and must run as root (CI does)"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={FS_SIZE}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(st.success(), "mount -t tmpfs failed: {st}");
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// A real `agw` process, killed when dropped.
struct Agw(#[allow(dead_code)] process::AgwProc);

impl Agw {
    fn start(server: &TestServer, id: &str) -> Agw {
        let agw = process::Agw::new(&server.url(), id)
            .args(["--tools", "echo,tee"])
            // The side effect this test counts is a write outside the job's
            // scratch directory, which the sandbox forbids (tests/sandbox.rs);
            // these workers run without it. Tasks still run unprivileged,
            // hence the world-writable log.
            .args(["--insecure-no-sandbox"])
            .args(["--max-concurrent-jobs", "4"])
            .env(
                "RUST_LOG",
                &std::env::var("AGW_TEST_LOG").unwrap_or_else(|_| "error".into()),
            )
            .kill_on_drop()
            .spawn();
        Agw(agw)
    }
}

async fn health(server: &TestServer) -> ServingStatus {
    let mut h = HealthClient::new(server.channel().await);
    let r = h
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health check")
        .into_inner();
    ServingStatus::try_from(r.status).expect("status")
}

async fn count(server: &TestServer, status: JobStatus) -> usize {
    let mut jobs = server.jobs().await;
    let mut n = 0;
    let mut token = String::new();
    for _ in 0..1000 {
        let r = jobs
            .search_jobs(SearchJobsRequest {
                status: status as i32,
                page_size: 1000,
                page_token: token,
                ..Default::default()
            })
            .await
            .expect("SearchJobs")
            .into_inner();
        n += r.job_ids.len();
        if r.next_page_token.is_empty() {
            return n;
        }
        token = r.next_page_token;
    }
    panic!("too many pages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_then_the_queue_recovers_without_a_restart() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let fs = Tmpfs::mount();
    let side = tempfile::tempdir().expect("tempdir");
    let log: PathBuf = side.path().join("runs.log");
    std::fs::write(&log, "").unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(side.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let filler = fs.path().join("filler");
    std::fs::write(&filler, vec![0xA5u8; FILLER_BYTES]).expect("write the filler");

    // Heartbeats every 2 s and a long grace: a worker reconnecting
    // after the outage keeps its leases (its jobs run once).
    let cfg = EngineConfig {
        heartbeat_interval: Duration::from_secs(2),
        lease_grace: Duration::from_secs(60),
        retry_backoff_base: Duration::from_millis(50),
        retry_backoff_max: Duration::from_millis(200),
        job_retention: None,
        ..EngineConfig::default()
    };
    let server = TestServer::start(&fs.path().join("agq.db"), cfg).await;
    assert_eq!(health(&server).await, ServingStatus::Serving);
    server
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(agq::pb::Plan {
                plan_id: "once".into(),
                plan_description: "appends one line per run".into(),
                tasks: vec![
                    agq::pb::Task {
                        task_number: 1,
                        command: "echo".into(),
                        args: vec!["ran {{n}}".into()],
                        timeout_secs: 30,
                        input_from_task: None,
                        ..Default::default()
                    },
                    agq::pb::Task {
                        task_number: 2,
                        command: "tee".into(),
                        args: vec!["-a".into(), "{{log}}".into()],
                        timeout_secs: 30,
                        input_from_task: Some(1),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            replace: false,
        })
        .await
        .expect("SubmitPlan");
    let _w1 = Agw::start(&server, "disk-w1");
    let _w2 = Agw::start(&server, "disk-w2");

    // Submit until the store cannot commit.
    let mut actions = server.actions().await;
    let mut acknowledged: Vec<String> = Vec::new();
    let mut refusal = None;
    for i in 0..MAX_SUBMITS {
        let inputs = (0..JOBS_PER_ACTION)
            .map(|j| ActionInput {
                values: HashMap::from([
                    ("n".to_string(), format!("{i}-{j}")),
                    ("log".to_string(), log.to_str().unwrap().to_string()),
                    ("pad".to_string(), "x".repeat(PAD_BYTES)),
                ]),
            })
            .collect();
        match actions
            .submit_action(SubmitActionRequest {
                plan_id: "once".into(),
                inputs,
                ..Default::default()
            })
            .await
        {
            Ok(r) => acknowledged.extend(r.into_inner().job_ids),
            Err(st) => {
                refusal = Some(st);
                break;
            }
        }
    }
    let st = refusal.expect("the file system never filled up");
    assert!(
        matches!(st.code(), Code::Unavailable | Code::ResourceExhausted),
        "a full disk must be UNAVAILABLE or RESOURCE_EXHAUSTED, got {st:?}"
    );
    assert!(
        st.message().contains("full"),
        "the message must name the cause: {:?}",
        st.message()
    );
    eprintln!(
        "disk full after {} acknowledged jobs: {:?}: {}",
        acknowledged.len(),
        st.code(),
        st.message()
    );

    // A reader holding its snapshot: the log cannot restart, every commit
    // appends to it.
    let reader = rusqlite::Connection::open(&server.db).expect("open a reader");
    reader.execute_batch("BEGIN").unwrap();
    let _: i64 = reader
        .query_row("SELECT count(*) FROM plans", [], |r| r.get(0))
        .unwrap();
    // Take the space a smaller commit could still use.
    let filler2 = fs.path().join("filler2");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler2).expect("create filler2");
        let chunk = vec![0x5Au8; 4096];
        let mut written = 0;
        for _ in 0..1024 {
            match f.write_all(&chunk).and_then(|()| f.sync_data()) {
                Ok(()) => written += chunk.len(),
                Err(_) => break,
            }
        }
        eprintln!("filled the last {written} bytes");
    }
    // Small writes may still fit in log space a failed commit left
    // behind: submit single jobs (acknowledged ones count like the rest)
    // until one is refused; the file system has no room left, so the
    // store stays refusing until space is freed.
    let mut refused = false;
    for i in 0..MAX_SUBMITS {
        match actions
            .submit_action(SubmitActionRequest {
                plan_id: "once".into(),
                inputs: vec![ActionInput {
                    values: HashMap::from([
                        ("n".to_string(), format!("small-{i}")),
                        ("log".to_string(), log.to_str().unwrap().to_string()),
                    ]),
                }],
                ..Default::default()
            })
            .await
        {
            Ok(r) => acknowledged.extend(r.into_inner().job_ids),
            Err(st) => {
                assert!(
                    matches!(st.code(), Code::Unavailable | Code::ResourceExhausted),
                    "{st:?}"
                );
                refused = true;
                break;
            }
        }
    }
    assert!(refused, "small writes never failed on a full file system");

    // While it cannot commit: NOT_SERVING, counted, reads work, writes
    // refused.
    assert_eq!(health(&server).await, ServingStatus::NotServing);
    assert!(metric(&server, "agq_store_write_errors_total").await >= 1.0);
    assert_eq!(metric(&server, "agq_store_up").await, 0.0);
    let plans = server
        .plans()
        .await
        .list_plans(ListPlansRequest::default())
        .await
        .expect("ListPlans while the disk is full")
        .into_inner();
    assert_eq!(plans.plan_ids, ["once"]);
    server
        .queue()
        .await
        .get_queue_stats(GetQueueStatsRequest::default())
        .await
        .expect("GetQueueStats while the disk is full");
    let first = common::job(&server, &acknowledged[0]).await;
    assert_eq!(first.job_id, acknowledged[0]);
    let again = actions
        .submit_action(SubmitActionRequest {
            plan_id: "once".into(),
            inputs: vec![ActionInput {
                values: HashMap::from([("n".to_string(), "late".to_string())]),
            }],
            ..Default::default()
        })
        .await
        .expect_err("a write while the disk is full");
    assert!(
        matches!(again.code(), Code::Unavailable | Code::ResourceExhausted),
        "{again:?}"
    );

    // Free space; no restart.
    reader.execute_batch("COMMIT").unwrap();
    drop(reader);
    std::fs::remove_file(&filler).expect("delete the filler");
    std::fs::remove_file(&filler2).expect("delete filler2");
    common::eventually(
        WAIT_SECS,
        "health SERVING after space was freed",
        || async { health(&server).await == ServingStatus::Serving },
    )
    .await;
    let total = acknowledged.len();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(WAIT_SECS);
    loop {
        let done = count(&server, JobStatus::Completed).await;
        if done == total {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let mut by = Vec::new();
            for s in [
                JobStatus::Pending,
                JobStatus::Running,
                JobStatus::Failed,
                JobStatus::Dead,
                JobStatus::Cancelled,
            ] {
                by.push((s, count(&server, s).await));
            }
            let stats = server
                .queue()
                .await
                .get_queue_stats(GetQueueStatsRequest::default())
                .await
                .unwrap()
                .into_inner();
            panic!(
                "{done} of {total} acknowledged jobs completed; others: {by:?}; queue: {stats:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&server, "agq_store_up").await, 1.0);
    for id in acknowledged.iter().step_by(7) {
        let j = common::job(&server, id).await;
        assert_eq!(j.status, JobStatus::Completed as i32, "{j:?}");
    }
    // Every job's side effect ran exactly once.
    let text = std::fs::read_to_string(&log).unwrap();
    let mut runs: HashMap<&str, usize> = HashMap::new();
    for line in text.lines() {
        *runs.entry(line).or_default() += 1;
    }
    assert_eq!(runs.len(), total, "one distinct line per job");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "side effects ran more than once: {twice:?}"
    );
    // The queue takes new work again.
    actions
        .submit_action(SubmitActionRequest {
            plan_id: "once".into(),
            inputs: vec![ActionInput {
                values: HashMap::from([
                    ("n".to_string(), "after".to_string()),
                    ("log".to_string(), log.to_str().unwrap().to_string()),
                ]),
            }],
            ..Default::default()
        })
        .await
        .expect("SubmitAction after recovery");

    let db = server.db.clone();
    server.stop().await;
    let conn = rusqlite::Connection::open(&db).expect("open the database");
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .expect("integrity_check");
    assert_eq!(check, "ok");
    drop(conn);
    drop(fs);
}
