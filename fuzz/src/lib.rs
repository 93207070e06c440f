//! Shared harness of AGQ's fuzz targets.
//!
//! Every target decodes the fuzzer's bytes with prost into a real
//! `agq.v1` request message and hands it to the same code the gRPC
//! service of that RPC runs: the request conversions of
//! `agq::service::convert`, then the `agq::core::Engine` method behind the
//! RPC, on a real engine (`agq::store::sqlite::SqliteEngine` in a private
//! directory under /dev/shm, removed at exit); errors become statuses
//! through `agq::service::status`, so outcomes are compared by their gRPC
//! code. [`Harness`]'s RPC methods do what each service method does, minus
//! the role check. The pure checks of `agq::core::validate` serve as the
//! targets' oracles. The worker's argument templating
//! (`agq::worker::template`) is fuzzed on decoded job leases. Each target
//! asserts properties, not only "no panic".

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use agq::{
    auth::Identity,
    config::{EngineConfig, SyncMode},
    core::{
        engine::{HeartbeatEvent, PlanQuery, QueueName},
        model::{JobLease, JobReport, Plan},
        SharedEngine,
    },
    error::Error,
    metrics::Metrics,
    pb,
    service::convert::{action_request, list_jobs_query, search_jobs_query},
    store::sqlite::SqliteEngine,
    worker::template,
};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tonic::{Code, Status};

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
                timeout_secs: 1800,
                input_from_task: None,
                allow_option_values: false,
                permanent_exit_codes: vec![],
            },
            pb::Task {
                task_number: 2,
                command: "sort".into(),
                args: vec!["-k{{ key }}".into(), "{{}}".into(), "{{unclosed".into()],
                timeout_secs: 1800,
                input_from_task: Some(1),
                allow_option_values: false,
                permanent_exit_codes: vec![],
            },
        ],
        require_sandbox: false,
        version: 0,
        worker_selector: String::new(),
        require_verified_tools: false,
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
    /// Runs the engine's async API (and its background loops).
    pub rt: tokio::runtime::Runtime,
    /// The real engine every service calls.
    pub engine: SharedEngine,
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
        let engine: SharedEngine = rt
            .block_on(SqliteEngine::open(
                &dir.join("agq.db"),
                SyncMode::Normal,
                EngineConfig::default(),
                Arc::new(Metrics::new()),
            ))
            .expect("open the engine");
        let h = Harness {
            rt,
            engine,
            worker: OnceLock::new(),
        };
        h.submit_plan(pb::SubmitPlanRequest {
            plan: Some(fixture_plan()),
            replace: false,
        })
        .expect("submit the fixture plan");
        for id in LISTED_PLANS {
            let mut p = fixture_plan();
            p.plan_id = id.into();
            h.submit_plan(pb::SubmitPlanRequest {
                plan: Some(p),
                replace: false,
            })
            .expect("submit a listed plan");
        }
        h
    })
}

/// The gRPC code of an RPC's outcome (`OK` for a reply).
pub fn code<T>(r: &Result<T, Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// True when `r` is the status every refused request must get.
pub fn is_invalid<T>(r: &Result<T, Status>) -> bool {
    code(r) == Code::InvalidArgument
}

/// The RPCs the targets call: each does what its service method does
/// (`src/service/*.rs`) after the role check, on the harness's engine:
/// convert the request (`agq::service::convert`), call the engine, convert
/// the reply; an error becomes its status (`agq::service::status`).
impl Harness {
    fn call<T>(&self, f: impl std::future::Future<Output = Result<T, Error>>) -> Result<T, Status> {
        self.rt.block_on(f).map_err(Status::from)
    }

    /// PlanService/SubmitPlan.
    pub fn submit_plan(
        &self,
        req: pb::SubmitPlanRequest,
    ) -> Result<pb::SubmitPlanResponse, Status> {
        let plan = req.plan.ok_or_else(|| Error::invalid("plan is required"))?;
        let stored = self.call(self.engine.submit_plan(Plan::from(plan), req.replace))?;
        Ok(pb::SubmitPlanResponse {
            plan_id: stored.plan_id,
            version: stored.version,
            created: stored.created,
        })
    }

    /// PlanService/GetPlan.
    pub fn get_plan(&self, req: pb::GetPlanRequest) -> Result<pb::GetPlanResponse, Status> {
        let version = (req.version != 0).then_some(req.version);
        let plan = self.call(self.engine.get_plan(req.plan_id, version))?;
        Ok(pb::GetPlanResponse {
            plan: Some(pb::Plan::from(&plan)),
        })
    }

    /// PlanService/ListPlans.
    pub fn list_plans(&self, r: pb::ListPlansRequest) -> Result<pb::ListPlansResponse, Status> {
        let page = self.call(self.engine.list_plans(PlanQuery {
            pattern: r.pattern,
            page_size: r.page_size,
            page_token: r.page_token,
        }))?;
        Ok(pb::ListPlansResponse {
            plan_ids: page.items.iter().map(|p| p.plan_id.clone()).collect(),
            plans: page.items.into_iter().map(pb::PlanSummary::from).collect(),
            next_page_token: page.next_page_token,
        })
    }

    /// PlanService/DeletePlan.
    pub fn delete_plan(
        &self,
        req: pb::DeletePlanRequest,
    ) -> Result<pb::DeletePlanResponse, Status> {
        self.call(self.engine.delete_plan(req.plan_id))?;
        Ok(pb::DeletePlanResponse { deleted: true })
    }

    /// ActionService/SubmitAction.
    pub fn submit_action(
        &self,
        req: pb::SubmitActionRequest,
    ) -> Result<pb::SubmitActionResponse, Status> {
        let action = action_request(req)?;
        let done = self.call(self.engine.submit_action(action))?;
        Ok(pb::SubmitActionResponse {
            action_id: done.action_id,
            jobs_created: done.job_ids.len() as u32,
            job_ids: done.job_ids,
        })
    }

    /// ActionService/GetAction.
    pub fn get_action(&self, req: pb::GetActionRequest) -> Result<pb::GetActionResponse, Status> {
        let action = self.call(self.engine.get_action(req.action_id))?;
        Ok(pb::GetActionResponse {
            action: Some(action.into()),
        })
    }

    /// JobService/GetJob.
    pub fn get_job(&self, req: pb::GetJobRequest) -> Result<pb::GetJobResponse, Status> {
        let job = self.call(self.engine.get_job(req.job_id))?;
        Ok(pb::GetJobResponse {
            job: Some(job.into()),
        })
    }

    /// JobService/ListJobs.
    pub fn list_jobs(&self, req: pb::ListJobsRequest) -> Result<pb::ListJobsResponse, Status> {
        let page = self.call(self.engine.search_jobs(list_jobs_query(req)?))?;
        Ok(pb::ListJobsResponse {
            job_ids: page.items,
            next_page_token: page.next_page_token,
        })
    }

    /// JobService/SearchJobs.
    pub fn search_jobs(
        &self,
        req: pb::SearchJobsRequest,
    ) -> Result<pb::SearchJobsResponse, Status> {
        let page = self.call(self.engine.search_jobs(search_jobs_query(req)?))?;
        Ok(pb::SearchJobsResponse {
            job_ids: page.items,
            next_page_token: page.next_page_token,
        })
    }

    /// JobService/CancelJob.
    pub fn cancel_job(&self, req: pb::CancelJobRequest) -> Result<pb::CancelJobResponse, Status> {
        let job = self.call(self.engine.cancel_job(req.job_id))?;
        Ok(pb::CancelJobResponse {
            job: Some(job.into()),
        })
    }

    /// QueueService/PeekQueue.
    pub fn peek_queue(&self, r: pb::PeekQueueRequest) -> Result<pb::PeekQueueResponse, Status> {
        let queue = match r.queue.as_str() {
            "" | "ready" => QueueName::Ready,
            "scheduled" => QueueName::Scheduled,
            q => {
                return Err(Error::invalid(format!(
                    "queue must be \"ready\" or \"scheduled\", got {q:?}"
                ))
                .into())
            }
        };
        let job_ids = self.call(self.engine.peek_queue(queue, r.count))?;
        Ok(pb::PeekQueueResponse { job_ids })
    }

    /// WorkerService/RegisterWorker.
    pub fn register_worker(
        &self,
        r: pb::RegisterWorkerRequest,
    ) -> Result<pb::RegisterWorkerResponse, Status> {
        let worker_id = r.worker_id.clone();
        let done = self.call(self.engine.register_worker(r.into()))?;
        let interval = done.heartbeat_interval;
        Ok(pb::RegisterWorkerResponse {
            worker_id,
            resumed: done.resumed,
            heartbeat_interval_secs: interval.as_secs_f64().ceil() as u32,
            heartbeat_interval_ms: interval.as_millis().min(u32::MAX as u128) as u32,
        })
    }

    /// WorkerService/UpdateJob.
    pub fn update_job(&self, req: pb::UpdateJobRequest) -> Result<pb::UpdateJobResponse, Status> {
        let status = self.call(self.engine.update_job(req.into()))?;
        Ok(pb::UpdateJobResponse {
            status: pb::JobStatus::from(status) as i32,
        })
    }

    /// WorkerService/BatchUpdateJobs.
    pub fn batch_update_jobs(
        &self,
        r: pb::BatchUpdateJobsRequest,
    ) -> Result<pb::BatchUpdateJobsResponse, Status> {
        let reports: Vec<JobReport> = r.requests.into_iter().map(Into::into).collect();
        let outcomes = self.call(self.engine.batch_update_jobs(r.worker_id, reports))?;
        Ok(pb::BatchUpdateJobsResponse {
            results: agq::service::convert::report_results(outcomes),
        })
    }

    /// WorkerService/ReportJobs: the answers of the service's own stream
    /// ([`agq::service::report_stream`], its role check included) to
    /// `requests` sent by `who`, read until the stream ends.
    pub fn report_jobs(
        &self,
        who: Identity,
        requests: Vec<pb::ReportJobsRequest>,
    ) -> Vec<Result<pb::ReportJobsResponse, Status>> {
        let requests = futures_util::stream::iter(requests.into_iter().map(Ok));
        let answers = agq::service::report_stream(self.engine.clone(), who, requests, None);
        self.rt.block_on(answers.collect())
    }

    /// WorkerService/UnregisterWorker.
    pub fn unregister_worker(
        &self,
        req: pb::UnregisterWorkerRequest,
    ) -> Result<pb::UnregisterWorkerResponse, Status> {
        let requeued_jobs = self.call(self.engine.unregister_worker(req.worker_id))?;
        Ok(pb::UnregisterWorkerResponse { requeued_jobs })
    }

    /// WorkerService/GetWorker.
    pub fn get_worker(&self, req: pb::GetWorkerRequest) -> Result<pb::GetWorkerResponse, Status> {
        let worker = self.call(self.engine.get_worker(req.worker_id))?;
        Ok(pb::GetWorkerResponse {
            worker: Some(worker.into()),
        })
    }
}

/// One report's outcome in a BatchUpdateJobsResponse, as a client reads
/// it: the job's status after the report, or the report's status.
pub fn batch_result(r: &pb::UpdateJobResult) -> Result<pb::JobStatus, Status> {
    if r.code == Code::Ok as i32 {
        Ok(pb::JobStatus::try_from(r.status).expect("an accepted report returns a job status"))
    } else {
        Err(Status::new(Code::from_i32(r.code), r.message.clone()))
    }
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
/// heartbeat and a lease stream open, and the leases it holds (as the
/// LeaseJobs stream sends them).
pub struct Worker {
    leases: Mutex<Vec<pb::JobLease>>,
    lease_rx: Mutex<mpsc::UnboundedReceiver<JobLease>>,
    heartbeat_rx: Mutex<mpsc::UnboundedReceiver<HeartbeatEvent>>,
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
            self.register_worker(req).expect("register the fuzz worker");
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
        let take = |l: JobLease, leases: &mut Vec<pb::JobLease>| {
            let l = pb::JobLease::from(l);
            let job = l.job.as_ref().map(|j| j.job_id.clone());
            leases.retain(|h| h.job.as_ref().map(|j| &j.job_id) != job.as_ref());
            leases.push(l);
        };
        while let Ok(l) = rx.try_recv() {
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
            self.submit_action(req)
                .expect("submit an action for the fuzz worker");
            let got = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(2), rx.recv()).await });
            if let Ok(Some(l)) = got {
                take(l, &mut leases);
            }
            while let Ok(l) = rx.try_recv() {
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
