//! Shared harness of AGQ's fuzz targets.
//!
//! Every target decodes the fuzzer's bytes with prost into a real
//! `agq.v1` request message and hands it to the same code the gRPC
//! services call: the pure checks of `agq::core::validate` and the
//! `agq::core::Engine` methods behind each RPC, on a real engine (SQLite
//! in a private directory under /dev/shm, removed at exit). The worker's
//! argument templating (`agq::worker::template`) is fuzzed on decoded job
//! leases. Each target asserts properties, not only "no panic".

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use agq::{
    config::{EngineConfig, SyncMode},
    core::Engine,
    error::Error,
    metrics::Metrics,
    pb,
    worker::template,
};
use tokio::sync::mpsc;

/// The plan every harness has; its tasks use `{{file}}` and `{{ key }}`.
pub const PLAN_ID: &str = "fuzz-plan";
/// The worker the `worker_reports` target reports as.
pub const WORKER_ID: &str = "fuzz-w";
/// A report whose `job_id` is this gets the job id and, when its
/// `lease_id` is [`LEASE_MAGIC`], the lease id of a lease the harness's
/// worker really holds (the fuzzer cannot guess random lease ids).
pub const JOB_MAGIC: &str = "JOB";
/// See [`JOB_MAGIC`].
pub const LEASE_MAGIC: &str = "LEASE";

/// The fixture plan: `cat {{file}}` piped into `sort -k{{ key }} {{}} {{unclosed`.
pub fn fixture_plan() -> pb::Plan {
    pb::Plan {
        plan_id: PLAN_ID.into(),
        plan_description: "fuzz fixture".into(),
        tasks: vec![
            pb::Task {
                task_number: 1,
                command: "cat".into(),
                args: vec!["{{file}}".into()],
                timeout_secs: 3600,
                input_from_task: None,
                allow_option_values: false,
            },
            pb::Task {
                task_number: 2,
                command: "sort".into(),
                args: vec!["-k{{ key }}".into(), "{{}}".into(), "{{unclosed".into()],
                timeout_secs: 3600,
                input_from_task: Some(1),
                allow_option_values: false,
            },
        ],
        require_sandbox: false,
    }
}

/// The variables [`fixture_plan`]'s arguments need.
pub const FIXTURE_VARIABLES: [&str; 2] = ["file", "key"];

/// Plan ids the `queries` target lists over (besides [`PLAN_ID`]).
pub const LISTED_PLANS: [&str; 13] = [
    "a", "ab", "abc", "a.b", "a-b", "a_b", "b", "ba", "Z", "z9", "_x", "-y", "0",
];

/// One engine per fuzz process.
pub struct Harness {
    /// Runs the engine's async API (and its reaper).
    pub rt: tokio::runtime::Runtime,
    /// The real core every service calls.
    pub engine: Arc<Engine>,
    worker: OnceLock<Worker>,
}

static DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_dir() {
    if let Some(d) = DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The process's harness, opened on first use.
pub fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        // A crash leaves through _exit (no atexit): remove the databases of
        // fuzz processes that are gone.
        if let Ok(entries) = std::fs::read_dir(&base) {
            for e in entries.flatten() {
                let name = e.file_name();
                let pid = name.to_str().and_then(|n| n.strip_prefix("agq-fuzz-"));
                if pid.is_some_and(|p| !Path::new("/proc").join(p).exists()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = base.join(format!("agq-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz database directory");
        if DIR.set(dir.clone()).is_ok() {
            // libFuzzer leaves through exit(): remove the database then.
            // SAFETY: registers a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(remove_dir) };
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let cfg = EngineConfig {
            synchronous: SyncMode::Normal,
            ..EngineConfig::default()
        };
        let engine = rt
            .block_on(Engine::open(
                &dir.join("agq.db"),
                cfg,
                Arc::new(Metrics::new()),
            ))
            .expect("open the engine");
        rt.block_on(engine.submit_plan(Some(fixture_plan())))
            .expect("submit the fixture plan");
        for id in LISTED_PLANS {
            let mut p = fixture_plan();
            p.plan_id = id.into();
            rt.block_on(engine.submit_plan(Some(p)))
                .expect("submit a listed plan");
        }
        Harness {
            rt,
            engine,
            worker: OnceLock::new(),
        }
    })
}

/// True when `r` is the error every refused request must get.
pub fn is_invalid<T>(r: &Result<T, Error>) -> bool {
    matches!(r, Err(Error::InvalidArgument(_)))
}

/// Checks one `render` call against the documented rules:
/// - an argument without `{{` is returned unchanged;
/// - a missing variable is named trimmed, non-empty, absent from the
///   input, and appears in the argument;
/// - with an empty input, success means the argument is unchanged;
/// - when no value contains a brace, the result holds no placeholder:
///   rendering it again with no input at all succeeds and changes nothing.
pub fn check_render(arg: &str, input: &HashMap<String, String>) {
    let r = template::render(arg, input);
    if !arg.contains("{{") {
        assert_eq!(r.as_deref(), Ok(arg), "an argument without '{{{{' changed");
    }
    match r {
        Err(e) => {
            assert!(!e.name.is_empty(), "empty missing-variable name");
            assert_eq!(e.name, e.name.trim(), "untrimmed missing-variable name");
            assert!(!input.contains_key(&e.name), "{:?} is in the input", e.name);
            assert!(arg.contains(&e.name), "{:?} is not in {arg:?}", e.name);
        }
        Ok(out) => {
            if input.is_empty() {
                assert_eq!(out, arg, "nothing to substitute, yet the argument changed");
            }
            if input.values().all(|v| !v.contains(['{', '}'])) {
                let empty = HashMap::new();
                assert_eq!(
                    template::render(&out, &empty).as_deref(),
                    Ok(out.as_str()),
                    "a placeholder is left in {out:?} (from {arg:?})"
                );
            }
        }
    }
}

/// The harness's worker: registered with the fixture plan's tools, with a
/// heartbeat and a lease stream open, and the leases it holds.
pub struct Worker {
    leases: Mutex<Vec<pb::JobLease>>,
    lease_rx: Mutex<mpsc::UnboundedReceiver<Result<pb::JobLease, tonic::Status>>>,
    heartbeat_rx: Mutex<mpsc::UnboundedReceiver<Result<pb::HeartbeatResponse, tonic::Status>>>,
    last_heartbeat: Mutex<Instant>,
    last_submit: Mutex<Option<Instant>>,
}

impl Harness {
    /// The harness's worker, registered on first use.
    pub fn worker(&self) -> &Worker {
        self.worker.get_or_init(|| {
            let e = &self.engine;
            let req = pb::RegisterWorkerRequest {
                worker_id: WORKER_ID.into(),
                hostname: "fuzz".into(),
                agw_version: "fuzz".into(),
                max_concurrent_jobs: 16,
                capabilities: Some(pb::WorkerCapabilities {
                    tools: vec!["cat".into(), "sort".into()],
                    ..Default::default()
                }),
                ..Default::default()
            };
            self.rt
                .block_on(e.register_worker(req))
                .expect("register the fuzz worker");
            let (htx, hrx) = mpsc::unbounded_channel();
            self.rt
                .block_on(e.open_heartbeat(WORKER_ID.into(), htx))
                .expect("open the heartbeat stream");
            let (ltx, lrx) = mpsc::unbounded_channel();
            self.rt
                .block_on(e.open_lease_stream(WORKER_ID.into(), ltx))
                .expect("open the lease stream");
            Worker {
                leases: Mutex::new(Vec::new()),
                lease_rx: Mutex::new(lrx),
                heartbeat_rx: Mutex::new(hrx),
                last_heartbeat: Mutex::new(Instant::now()),
                last_submit: Mutex::new(None),
            }
        })
    }

    /// A lease the harness's worker holds now: keeps the worker fresh,
    /// takes the leases pushed to it and, when it holds none, submits an
    /// action for it to lease.
    pub fn held_lease(&self) -> Option<pb::JobLease> {
        let w = self.worker();
        {
            let mut last = w.last_heartbeat.lock().unwrap();
            if last.elapsed() > Duration::from_secs(1) {
                let _ = self
                    .rt
                    .block_on(self.engine.heartbeat(WORKER_ID.into(), None, None));
                *last = Instant::now();
                let mut hrx = w.heartbeat_rx.lock().unwrap();
                while hrx.try_recv().is_ok() {}
            }
        }
        let mut rx = w.lease_rx.lock().unwrap();
        let mut leases = w.leases.lock().unwrap();
        let take = |l: pb::JobLease, leases: &mut Vec<pb::JobLease>| {
            let job = l.job.as_ref().map(|j| j.job_id.clone());
            leases.retain(|h| h.job.as_ref().map(|j| &j.job_id) != job.as_ref());
            leases.push(l);
        };
        while let Ok(Ok(l)) = rx.try_recv() {
            take(l, &mut leases);
        }
        let mut last_submit = w.last_submit.lock().unwrap();
        // At most 5 actions a second, should leases ever stop coming.
        let may_submit = last_submit.is_none_or(|t| t.elapsed() > Duration::from_millis(200));
        if leases.is_empty() && may_submit {
            *last_submit = Some(Instant::now());
            let inputs = (0..4)
                .map(|i| pb::ActionInput {
                    values: HashMap::from([
                        ("file".to_string(), format!("/tmp/{i}")),
                        ("key".to_string(), "2".to_string()),
                    ]),
                })
                .collect();
            let req = pb::SubmitActionRequest {
                plan_id: PLAN_ID.into(),
                inputs,
                max_attempts: 2,
                ..Default::default()
            };
            self.rt
                .block_on(self.engine.submit_action(req))
                .expect("submit an action for the fuzz worker");
            let got = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(2), rx.recv()).await });
            if let Ok(Some(Ok(l))) = got {
                take(l, &mut leases);
            }
            while let Ok(Ok(l)) = rx.try_recv() {
                take(l, &mut leases);
            }
        }
        leases.first().cloned()
    }

    /// Forgets a held lease (its attempt ended or it was fenced off).
    pub fn drop_lease(&self, job_id: &str) {
        let w = self.worker();
        w.leases
            .lock()
            .unwrap()
            .retain(|h| h.job.as_ref().map(|j| j.job_id.as_str()) != Some(job_id));
    }
}
