//! The AGQ side of the load: simulated workers that drive the real
//! WorkerService (RegisterWorker, the Heartbeat stream, the LeaseJobs
//! stream, UpdateJob) and clients that submit Actions.
//!
//! Many workers share few HTTP/2 connections: every worker holds two
//! long-lived streams (heartbeat, leases) plus one per UpdateJob in flight.
//! tonic's server sets no SETTINGS_MAX_CONCURRENT_STREAMS (unlimited), and
//! the bench keeps at most `--workers-per-connection` workers on one
//! connection so a connection's task is not the bottleneck.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use futures_util::{future::BoxFuture, stream::FuturesUnordered, FutureExt, StreamExt};
use rand::Rng;
use tokio::{
    sync::{mpsc, watch, Semaphore},
    task::JoinHandle,
};
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tonic::transport::Channel;

use super::{
    stats::{now_us, Recorder},
    BenchError,
};
use agq::pb::{
    self, action_service_client::ActionServiceClient, plan_service_client::PlanServiceClient,
    worker_service_client::WorkerServiceClient,
};

/// The tool the bench plan runs (workers advertise it; nothing is executed).
pub const TOOL: &str = "true";

/// The one-task plan every bench job runs.
pub fn bench_plan(plan_id: &str) -> pb::Plan {
    pb::Plan {
        plan_id: plan_id.into(),
        plan_description: "agq-bench: one task, simulated".into(),
        tasks: vec![pb::Task {
            task_number: 1,
            command: TOOL.into(),
            args: vec!["{{i}}".into()],
            timeout_secs: 60,
            input_from_task: None,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Stores the bench plan.
///
/// Errors: the SubmitPlan call failed.
pub async fn submit_plan(ch: Channel, plan_id: &str) -> Result<(), BenchError> {
    PlanServiceClient::new(ch)
        .submit_plan(pb::SubmitPlanRequest {
            plan: Some(bench_plan(plan_id)),
            replace: false,
        })
        .await?;
    Ok(())
}

/// The input of job `i`: its index, the submit time (µs, [`now_us`]) and
/// the payload. The same map, as JSON, is the Redis peer's job input.
pub fn job_input(i: u64, t_us: u64, payload: &str) -> HashMap<String, String> {
    let mut m = HashMap::with_capacity(3);
    m.insert("i".to_string(), i.to_string());
    m.insert("t".to_string(), t_us.to_string());
    m.insert("payload".to_string(), payload.to_string());
    m
}

/// The task result a simulated worker reports (and the Redis peer stores).
pub fn task_result() -> pb::TaskResult {
    pb::TaskResult {
        task_number: 1,
        command: TOOL.into(),
        exit_code: 0,
        stdout: "ok\n".into(),
        stderr: String::new(),
        duration_ms: 0,
        stdout_truncated: false,
        stderr_truncated: false,
    }
}

/// Submits one action of `k` jobs numbered from `first`; returns the job ids.
///
/// Errors: the SubmitAction call failed.
pub async fn submit_action(
    client: &mut ActionServiceClient<Channel>,
    plan_id: &str,
    first: u64,
    k: usize,
    payload: &str,
) -> Result<Vec<String>, BenchError> {
    let t = now_us();
    let inputs = (0..k as u64)
        .map(|j| pb::ActionInput {
            values: job_input(first + j, t, payload),
        })
        .collect();
    let r = client
        .submit_action(pb::SubmitActionRequest {
            plan_id: plan_id.into(),
            inputs,
            max_attempts: 3,
            ..Default::default()
        })
        .await?;
    Ok(r.into_inner().job_ids)
}

/// The registration of simulated worker `id` with `slots` leases at once:
/// it offers [`TOOL`] only.
pub fn register_request(id: &str, slots: u32) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        worker_id: id.into(),
        hostname: "bench-host".into(),
        platform: "linux-x86_64".into(),
        agw_version: "agq-bench".into(),
        capabilities: Some(pb::WorkerCapabilities {
            tools: vec![TOOL.into()],
            agentic_units: vec![],
            ..Default::default()
        }),
        max_concurrent_jobs: slots,
        tags: Default::default(),
        ..Default::default()
    }
}

/// How simulated workers behave.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Leases a worker holds at once (max_concurrent_jobs).
    pub slots: u32,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// How completions are reported.
    pub reports: Reports,
}

/// How a simulated worker reports its completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Reports {
    /// Each report as it is ready, one request on the worker's ReportJobs
    /// stream (as agw does).
    Stream,
    /// The reports that queued up while the previous BatchUpdateJobs call
    /// was in flight, in the next call.
    Batch,
    /// One UpdateJob call per report.
    Unary,
}

/// A running set of simulated workers.
pub struct Fleet {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// Number of workers.
    pub size: usize,
}

impl Fleet {
    /// Registers `n` workers named `<prefix>-<i>` spread over `channels`,
    /// opens their streams and starts them; returns once every worker is
    /// connected. At most 256 registrations run at once.
    ///
    /// Errors: a worker failed to register or connect within 120 s.
    pub async fn start(
        channels: &[Channel],
        n: usize,
        prefix: &str,
        spec: WorkerSpec,
        rec: Arc<Recorder>,
    ) -> Result<Fleet, BenchError> {
        let (stop, stop_rx) = watch::channel(false);
        let (ready_tx, mut ready_rx) = mpsc::channel::<Result<(), String>>(1024);
        let gate = Arc::new(Semaphore::new(256));
        let spec = Arc::new(spec);
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let client = WorkerServiceClient::new(channels[i % channels.len()].clone())
                .max_decoding_message_size(agq::server::MAX_MESSAGE_BYTES);
            let id = format!("{prefix}-{i}");
            tasks.push(tokio::spawn(worker_main(
                client,
                id,
                spec.clone(),
                rec.clone(),
                ready_tx.clone(),
                gate.clone(),
                stop_rx.clone(),
            )));
        }
        drop(ready_tx);
        let fleet = Fleet {
            stop,
            tasks,
            size: n,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut ready = 0;
        while ready < n {
            match tokio::time::timeout_at(deadline, ready_rx.recv()).await {
                Ok(Some(Ok(()))) => ready += 1,
                Ok(Some(Err(e))) => {
                    fleet.stop().await;
                    return Err(BenchError::Failed(format!("worker setup: {e}")));
                }
                Ok(None) => break,
                Err(_) => {
                    fleet.stop().await;
                    return Err(BenchError::Failed(format!(
                        "only {ready} of {n} workers connected within 120 s"
                    )));
                }
            }
        }
        Ok(fleet)
    }

    /// Stops every worker (their streams drop) and waits for them, 10 s in
    /// all; a worker not gone by then (one still waiting for a call's
    /// answer) is aborted.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for t in self.tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout_at(deadline, t).await.is_err() {
                abort.abort();
            }
        }
    }
}

/// Report calls in flight: each yields its send time and one outcome per
/// report it carried.
type Inflight = FuturesUnordered<BoxFuture<'static, (u64, Vec<Result<(), String>>)>>;

/// One UpdateJob call for `req`.
fn send_one(
    mut c: WorkerServiceClient<Channel>,
    req: pb::UpdateJobRequest,
) -> BoxFuture<'static, (u64, Vec<Result<(), String>>)> {
    async move {
        let sent = now_us();
        let r = c
            .update_job(req)
            .await
            .map(|_| ())
            .map_err(|e| format!("UpdateJob: {e}"));
        (sent, vec![r])
    }
    .boxed()
}

/// One BatchUpdateJobs call for `reqs`.
fn send_batch(
    mut c: WorkerServiceClient<Channel>,
    worker_id: String,
    requests: Vec<pb::UpdateJobRequest>,
) -> BoxFuture<'static, (u64, Vec<Result<(), String>>)> {
    async move {
        let sent = now_us();
        let n = requests.len();
        let out = match c
            .batch_update_jobs(pb::BatchUpdateJobsRequest {
                worker_id,
                requests,
            })
            .await
        {
            Ok(r) => r
                .into_inner()
                .results
                .into_iter()
                .map(|r| match r.code {
                    0 => Ok(()),
                    code => Err(format!(
                        "BatchUpdateJobs report: code {code}: {}",
                        r.message
                    )),
                })
                .collect(),
            Err(e) => vec![Err(format!("BatchUpdateJobs: {e}")); n],
        };
        (sent, out)
    }
    .boxed()
}

async fn worker_main(
    mut client: WorkerServiceClient<Channel>,
    id: String,
    spec: Arc<WorkerSpec>,
    rec: Arc<Recorder>,
    ready: mpsc::Sender<Result<(), String>>,
    gate: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    let permit = gate.acquire_owned().await;
    let setup = async {
        client
            .register_worker(register_request(&id, spec.slots))
            .await?;
        let (hb_tx, hb_rx) = mpsc::channel::<pb::HeartbeatRequest>(8);
        let beat = || pb::HeartbeatRequest {
            worker_id: id.clone(),
            stats: Some(pb::WorkerStats::default()),
            held_leases: None,
            ..Default::default()
        };
        let first = now_us();
        let _ = hb_tx.send(beat()).await;
        let inbound = client
            .heartbeat(ReceiverStream::new(hb_rx))
            .await?
            .into_inner();
        let leases = client
            .lease_jobs(pb::LeaseJobsRequest {
                worker_id: id.clone(),
            })
            .await?
            .into_inner();
        let (report_tx, report_rx) = mpsc::unbounded_channel::<pb::ReportJobsRequest>();
        let answers = match spec.reports {
            Reports::Stream => Some(
                client
                    .report_jobs(UnboundedReceiverStream::new(report_rx))
                    .await?
                    .into_inner(),
            ),
            Reports::Batch | Reports::Unary => None,
        };
        Ok::<_, tonic::Status>((hb_tx, inbound, leases, first, beat, report_tx, answers))
    }
    .await;
    drop(permit);
    let (hb_tx, mut inbound, mut leases, first, beat, report_tx, mut answers) = match setup {
        Ok(s) => {
            let _ = ready.send(Ok(())).await;
            s
        }
        Err(e) => {
            let _ = ready.send(Err(format!("{id}: {e}"))).await;
            return;
        }
    };
    drop(ready);
    let mut hb_sent: VecDeque<u64> = VecDeque::from([first]);
    // Spread the heartbeats of a fleet evenly over the period.
    let offset = rand::rng().random_range(0..spec.heartbeat.as_micros().max(1) as u64);
    let mut ticker = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_micros(offset),
        spec.heartbeat,
    );
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut inflight: Inflight = FuturesUnordered::new();
    // Reports waiting for the batch in flight to return.
    let mut queued: Vec<pb::UpdateJobRequest> = Vec::new();
    let one_slot = spec.slots == 1;
    let mut freed_at: Option<u64> = None;
    // Send times of the ReportJobs requests not yet answered, oldest first.
    let mut unanswered: VecDeque<u64> = VecDeque::new();
    loop {
        let answer = async {
            match answers.as_mut() {
                Some(a) => a.message().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stop.changed() => break,
            _ = ticker.tick() => {
                hb_sent.push_back(now_us());
                if hb_tx.send(beat()).await.is_err() {
                    break;
                }
            }
            msg = inbound.message() => match msg {
                Ok(Some(resp)) => {
                    if resp.command.is_none() {
                        if let Some(t) = hb_sent.pop_front() {
                            rec.heartbeat(now_us().saturating_sub(t));
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if !*stop.borrow() {
                        rec.error(format!("{id} heartbeat stream: {e}"));
                    }
                    break;
                }
            },
            msg = leases.message() => match msg {
                Ok(Some(lease)) => {
                    let now = now_us();
                    let job = lease.job.unwrap_or_default();
                    let t = job.input.get("t").and_then(|t| t.parse().ok());
                    rec.leased(t, if one_slot { freed_at.take() } else { None }, now);
                    let req = pb::UpdateJobRequest {
                        job_id: job.job_id,
                        worker_id: if spec.reports == Reports::Unary { id.clone() } else { String::new() },
                        lease_id: lease.lease_id,
                        status: pb::JobStatus::Completed as i32,
                        task_results: vec![task_result()],
                        ..Default::default()
                    };
                    if spec.reports == Reports::Stream {
                        unanswered.push_back(now_us());
                        let sent = report_tx.send(pb::ReportJobsRequest {
                            worker_id: id.clone(),
                            requests: vec![req],
                        });
                        if sent.is_err() {
                            break;
                        }
                    } else if spec.reports == Reports::Unary {
                        inflight.push(send_one(client.clone(), req));
                    } else if inflight.is_empty() {
                        inflight.push(send_batch(client.clone(), id.clone(), vec![req]));
                    } else {
                        queued.push(req);
                    }
                    if one_slot {
                        freed_at = Some(now_us());
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if !*stop.borrow() {
                        rec.error(format!("{id} lease stream: {e}"));
                    }
                    break;
                }
            },
            msg = answer => match msg {
                Ok(Some(a)) => {
                    let now = now_us();
                    let sent = unanswered.pop_front().unwrap_or(now);
                    for r in a.results {
                        match r.code {
                            0 => rec.completed_at(sent, now),
                            code => rec.error(format!("{id} ReportJobs report: code {code}: {}", r.message)),
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if !*stop.borrow() {
                        rec.error(format!("{id} report stream: {e}"));
                    }
                    break;
                }
            },
            Some((sent, results)) = inflight.next(), if !inflight.is_empty() => {
                let now = now_us();
                for r in results {
                    match r {
                        Ok(()) => rec.completed_at(sent, now),
                        Err(e) => rec.error(format!("{id} {e}")),
                    }
                }
                if !queued.is_empty() {
                    inflight.push(send_batch(client.clone(), id.clone(), std::mem::take(&mut queued)));
                }
            }
        }
    }
}

/// Submits `actions` actions of `k` jobs from `clients` concurrent clients,
/// each sending its next action as soon as the previous one returned.
///
/// Errors: a SubmitAction failed.
pub async fn submit_closed_loop(
    channels: &[Channel],
    clients: usize,
    plan_id: &str,
    actions: usize,
    k: usize,
    payload: Arc<str>,
) -> Result<(), BenchError> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for c in 0..clients.max(1) {
        let mut client = ActionServiceClient::new(channels[c % channels.len()].clone())
            .max_encoding_message_size(agq::server::MAX_MESSAGE_BYTES);
        let next = next.clone();
        let plan_id = plan_id.to_string();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let a = next.fetch_add(1, Ordering::Relaxed);
                if a >= actions {
                    return Ok::<_, BenchError>(());
                }
                submit_action(&mut client, &plan_id, (a * k) as u64, k, &payload).await?;
            }
        }));
    }
    super::join_submitters(tasks).await
}

/// Submits `actions` actions of `k` jobs at a fixed rate of `jobs_per_sec`
/// (open loop: a slow reply does not delay the next send).
///
/// Errors: a SubmitAction failed.
pub async fn submit_paced(
    channel: Channel,
    plan_id: &str,
    actions: usize,
    k: usize,
    jobs_per_sec: f64,
    payload: Arc<str>,
) -> Result<(), BenchError> {
    let period = Duration::from_secs_f64(k as f64 / jobs_per_sec.max(1.0));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let client =
        ActionServiceClient::new(channel).max_encoding_message_size(agq::server::MAX_MESSAGE_BYTES);
    let mut tasks = Vec::with_capacity(actions);
    for a in 0..actions {
        ticker.tick().await;
        let mut client = client.clone();
        let plan_id = plan_id.to_string();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            submit_action(&mut client, &plan_id, (a * k) as u64, k, &payload)
                .await
                .map(|_| ())
        }));
    }
    super::join_submitters(tasks).await
}
