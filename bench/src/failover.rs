//! `--failover`: how long a job stays stranded when its worker dies.
//!
//! - kill: the worker holding the job drops its streams and its connection
//!   (what the server sees when the process is killed); with the lease
//!   grace at 0 and retry backoff at 0 the job is re-queued at once and
//!   leased to a standby worker. Measured: kill to the standby's receipt.
//! - freeze: the worker stops heartbeating but keeps its streams open (a
//!   hung process); the reaper declares it DEAD at 3 x the heartbeat
//!   interval. Measured: its last acknowledged heartbeat's send time to the
//!   standby's receipt (the bar is 3 x interval + 1 s).

use std::{net::SocketAddr, time::Duration};

use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{transport::Channel, Streaming};

use super::{
    agq_load,
    harness::{self, Harness},
    report::{verdict, PLAN},
    stats::{histogram, now_us, Summary},
    BenchArgs, BenchError,
};
use agq::{
    config::EngineConfig,
    pb::{
        self, action_service_client::ActionServiceClient,
        worker_service_client::WorkerServiceClient,
    },
};

/// A worker the bench can kill or freeze, on its own connection.
pub(crate) struct CtlWorker {
    id: String,
    client: Option<WorkerServiceClient<Channel>>,
    hb_task: Option<JoinHandle<()>>,
    hb_tx: Option<mpsc::Sender<pb::HeartbeatRequest>>,
    frozen: watch::Sender<bool>,
    /// Send time (µs) of the last acknowledged heartbeat.
    acked: watch::Receiver<u64>,
    leases: Option<Streaming<pb::JobLease>>,
}

impl CtlWorker {
    /// Registers `registration` at `addr` (a connection of its own) and
    /// opens its heartbeat stream (every `interval`) and lease stream.
    ///
    /// Errors: connection failures, a refused registration or stream.
    pub(crate) async fn start(
        addr: SocketAddr,
        registration: pb::RegisterWorkerRequest,
        interval: Duration,
    ) -> Result<CtlWorker, BenchError> {
        let id = registration.worker_id.clone();
        let id = id.as_str();
        let mut client = WorkerServiceClient::new(harness::connect(addr).await?);
        client.register_worker(registration).await?;
        let (hb_tx, rx) = mpsc::channel(8);
        let beat = {
            let id = id.to_string();
            move || pb::HeartbeatRequest {
                worker_id: id.clone(),
                stats: Some(pb::WorkerStats::default()),
                held_leases: None,
                ..Default::default()
            }
        };
        let first = now_us();
        let _ = hb_tx.send(beat()).await;
        let mut inbound = client
            .heartbeat(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let (frozen, frozen_rx) = watch::channel(false);
        let (acked_tx, acked) = watch::channel(0u64);
        let tx = hb_tx.clone();
        let hb_task = tokio::spawn(async move {
            let mut sent = std::collections::VecDeque::from([first]);
            let mut ticker = tokio::time::interval(interval);
            ticker.tick().await;
            loop {
                tokio::select! {
                    _ = ticker.tick() => {
                        if *frozen_rx.borrow() {
                            continue;
                        }
                        sent.push_back(now_us());
                        if tx.send(beat()).await.is_err() {
                            return;
                        }
                    }
                    m = inbound.message() => match m {
                        Ok(Some(resp)) if resp.command.is_none() => {
                            if let Some(t) = sent.pop_front() {
                                let _ = acked_tx.send(t);
                            }
                        }
                        Ok(Some(_)) => {}
                        _ => return,
                    }
                }
            }
        });
        let leases = client
            .lease_jobs(pb::LeaseJobsRequest {
                worker_id: id.into(),
            })
            .await?
            .into_inner();
        Ok(CtlWorker {
            id: id.into(),
            client: Some(client),
            hb_task: Some(hb_task),
            hb_tx: Some(hb_tx),
            frozen,
            acked,
            leases: Some(leases),
        })
    }

    /// The next lease, if one arrives within `d`.
    pub(crate) async fn lease_within(&mut self, d: Duration) -> Option<pb::JobLease> {
        let s = self.leases.as_mut()?;
        match tokio::time::timeout(d, s.message()).await {
            Ok(Ok(Some(l))) => Some(l),
            _ => None,
        }
    }

    /// Reports `lease` completed.
    ///
    /// Errors: the UpdateJob call failed.
    pub(crate) async fn complete(&mut self, lease: pb::JobLease) -> Result<(), BenchError> {
        let job = lease.job.unwrap_or_default();
        if let Some(c) = self.client.as_mut() {
            c.update_job(pb::UpdateJobRequest {
                job_id: job.job_id,
                worker_id: self.id.clone(),
                lease_id: lease.lease_id,
                status: pb::JobStatus::Completed as i32,
                task_results: vec![agq_load::task_result()],
                ..Default::default()
            })
            .await?;
        }
        Ok(())
    }

    /// Drops both streams and the connection at once.
    pub(crate) fn kill(&mut self) {
        if let Some(t) = self.hb_task.take() {
            t.abort();
        }
        self.hb_tx = None;
        self.leases = None;
        self.client = None;
    }

    /// Stops heartbeating right after the next acknowledged heartbeat;
    /// returns that heartbeat's send time (µs).
    async fn freeze_after_next_ack(&mut self) -> u64 {
        self.acked.borrow_and_update();
        let _ = self.acked.changed().await;
        let _ = self.frozen.send(true);
        *self.acked.borrow()
    }
}

impl Drop for CtlWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The registration of a bench worker `id` with one slot.
pub(crate) fn one_slot(id: &str) -> pb::RegisterWorkerRequest {
    agq_load::register_request(id, 1)
}

/// Submits one job and waits for `holder` to be leased it.
async fn strand_one(
    actions: &mut ActionServiceClient<Channel>,
    holder: &mut CtlWorker,
    n: u64,
) -> Result<(), BenchError> {
    agq_load::submit_action(actions, PLAN, n, 1, "failover").await?;
    holder
        .lease_within(Duration::from_secs(10))
        .await
        .map(|_| ())
        .ok_or_else(|| BenchError::Failed(format!("{} got no lease", holder.id)))
}

/// Runs the failover mode. Returns false when a job was not re-leased.
pub async fn run(args: &BenchArgs) -> Result<bool, BenchError> {
    let interval = Duration::from_millis(args.heartbeat_ms.max(10));
    let cfg = EngineConfig {
        heartbeat_interval: interval,
        lease_grace: Duration::ZERO,
        retry_backoff_base: Duration::ZERO,
        retry_backoff_max: Duration::ZERO,
        ..EngineConfig::default()
    };
    println!(
        "failover: heartbeat {} ms (stale at 3 x), lease grace 0, retry backoff 0, \
         {} kill and {} freeze trials",
        interval.as_millis(),
        args.kill_trials,
        args.freeze_trials
    );
    let h = Harness::start(&args.base_dir(), cfg, args.synchronous, args.server_threads).await?;
    let result = trials(args, &h, interval).await;
    let stopped = h.stop().await;
    let ok = result?;
    stopped?;
    Ok(ok)
}

async fn trials(args: &BenchArgs, h: &Harness, interval: Duration) -> Result<bool, BenchError> {
    let ch = harness::connect(h.addr).await?;
    agq_load::submit_plan(ch.clone(), PLAN).await?;
    let mut actions = ActionServiceClient::new(ch);
    let mut ok = true;
    let mut kill = histogram();
    let mut n = 0u64;
    for i in 0..args.kill_trials {
        let mut holder =
            CtlWorker::start(h.addr, one_slot(&format!("fo-kill-{i}")), interval).await?;
        strand_one(&mut actions, &mut holder, n).await?;
        n += 1;
        let mut standby =
            CtlWorker::start(h.addr, one_slot(&format!("fo-standby-k{i}")), interval).await?;
        let t0 = now_us();
        holder.kill();
        match standby.lease_within(Duration::from_secs(10)).await {
            Some(l) => {
                let _ = kill.record((now_us() - t0).max(1));
                standby.complete(l).await?;
            }
            None => {
                println!("  kill trial {i}: the job was not re-leased within 10 s");
                ok = false;
            }
        }
    }
    let mut freeze = histogram();
    for i in 0..args.freeze_trials {
        let mut holder =
            CtlWorker::start(h.addr, one_slot(&format!("fo-freeze-{i}")), interval).await?;
        strand_one(&mut actions, &mut holder, n).await?;
        n += 1;
        let mut standby =
            CtlWorker::start(h.addr, one_slot(&format!("fo-standby-f{i}")), interval).await?;
        let t0 = holder.freeze_after_next_ack().await;
        match standby
            .lease_within(interval * 3 + Duration::from_secs(10))
            .await
        {
            Some(l) => {
                let _ = freeze.record((now_us() - t0).max(1));
                standby.complete(l).await?;
            }
            None => {
                println!("  freeze trial {i}: the job was not re-leased in time");
                ok = false;
            }
        }
        holder.kill();
    }
    let k = Summary::of(&kill);
    let f = Summary::of(&freeze);
    println!(
        "  kill -> re-lease (grace 0), {} trials: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        k.count, k.p50, k.p99, k.max
    );
    println!(
        "  freeze (last heartbeat) -> re-lease, {} trials: p50 {:.0} ms, max {:.0} ms \
         (3 x interval = {} ms)",
        f.count,
        f.p50,
        f.max,
        interval.as_millis() * 3
    );
    let bar = (interval * 3 + Duration::from_secs(1)).as_secs_f64() * 1000.0;
    println!("bars (issue 7):");
    println!(
        "  re-lease after kill <= 100 ms (grace 0): max {:.1} ms -> {}",
        k.max,
        verdict(k.count > 0 && k.max <= 100.0)
    );
    println!(
        "  re-lease after freeze <= 3 x interval + 1 s ({bar:.0} ms): max {:.0} ms -> {}",
        f.max,
        verdict(f.count > 0 && f.max <= bar)
    );
    Ok(ok)
}
