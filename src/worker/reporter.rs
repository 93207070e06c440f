//! Final job reports, batched: one task sends them, one call at a time;
//! the reports of jobs that finish while a call is in flight queue up and
//! go together in the next `BatchUpdateJobs` call. A lone report goes as a
//! plain `UpdateJob`. Nothing waits to fill a batch, so an idle worker's
//! report leaves at once, and a busy one makes one call for many jobs.
//!
//! Each report's caller gets the outcome the server gave that report, as
//! the `Status` `UpdateJob` would have returned, so its retry rules do not
//! change; a status for the whole call is every report's. A server without
//! `BatchUpdateJobs` (`UNIMPLEMENTED`) gets `UNAVAILABLE` back to each
//! caller, which retries, and from then on one `UpdateJob` per report.

use std::time::Duration;

use prost::Message;
use tokio::{
    sync::{mpsc, oneshot},
    time::timeout,
};
use tonic::{Code, Status};
use tracing::{debug, info};

use super::client::WorkerClient;
use crate::pb::{BatchUpdateJobsRequest, UpdateJobRequest};

/// Most reports in one call (the server takes up to 1024).
pub const MAX_BATCH_REPORTS: usize = 256;

/// Most encoded bytes of reports in one call: under the 4 MiB message
/// limit gRPC servers use by default (one report alone may be up to
/// [`super::agent::REPORT_BUDGET_BYTES`] plus its fields).
pub const MAX_BATCH_BYTES: usize = 3584 * 1024;

/// A report and where its outcome goes.
struct Pending {
    req: UpdateJobRequest,
    /// W3C `traceparent` metadata for a report sent alone.
    traceparent: Option<String>,
    reply: oneshot::Sender<Result<(), Status>>,
}

/// Sends final reports in batches; cheap to share by reference.
pub struct Reporter {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Reporter {
    /// Starts the sending task for `worker_id` on `client`; `call_timeout`
    /// bounds each call. Must be called inside a tokio runtime.
    pub fn start(client: WorkerClient, worker_id: String, call_timeout: Duration) -> Reporter {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_loop(client, worker_id, call_timeout, rx));
        Reporter { tx }
    }

    /// Sends `req` (in the next call) and returns its outcome. A report
    /// sent alone (a plain `UpdateJob`) carries `traceparent` as metadata,
    /// so the server's span joins the job's trace; a batch carries none.
    ///
    /// Errors: the `Status` the server gave this report (as `UpdateJob`
    /// would), `DEADLINE_EXCEEDED` when the call timed out, or the call's
    /// transport error (`UNAVAILABLE`, ...).
    pub async fn send(
        &self,
        req: UpdateJobRequest,
        traceparent: Option<String>,
    ) -> Result<(), Status> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Pending {
                req,
                traceparent,
                reply,
            })
            .map_err(|_| Status::unavailable("the report sender has stopped"))?;
        rx.await
            .unwrap_or_else(|_| Err(Status::unavailable("the report sender has stopped")))
    }
}

async fn send_loop(
    mut client: WorkerClient,
    worker_id: String,
    call_timeout: Duration,
    mut rx: mpsc::UnboundedReceiver<Pending>,
) {
    let mut batches = true;
    let mut carry: Option<Pending> = None;
    loop {
        let first = match carry.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let mut bytes = first.req.encoded_len();
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH_REPORTS {
            let Ok(p) = rx.try_recv() else { break };
            let len = p.req.encoded_len();
            if bytes + len > MAX_BATCH_BYTES {
                carry = Some(p);
                break;
            }
            bytes += len;
            batch.push(p);
        }
        if batch.len() == 1 || !batches {
            send_each(&mut client, batch, call_timeout).await;
            continue;
        }
        let (reqs, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|p| (p.req, p.reply)).unzip();
        let call = client.batch_update_jobs(BatchUpdateJobsRequest {
            worker_id: worker_id.clone(),
            requests: reqs,
        });
        let outcome = match timeout(call_timeout, call).await {
            Ok(r) => r.map(|r| r.into_inner().results),
            Err(_) => Err(Status::deadline_exceeded("BatchUpdateJobs timed out")),
        };
        let whole = match outcome {
            Ok(results) if results.len() == replies.len() => {
                debug!(reports = results.len(), "reports sent in one batch");
                for (r, reply) in results.into_iter().zip(replies) {
                    let _ = reply.send(match r.code {
                        0 => Ok(()),
                        code => Err(Status::new(Code::from(code), r.message)),
                    });
                }
                continue;
            }
            Ok(results) => Status::unknown(format!(
                "BatchUpdateJobs answered {} results for {} reports",
                results.len(),
                replies.len()
            )),
            Err(st) if st.code() == Code::Unimplemented => {
                info!("the server has no BatchUpdateJobs: reporting one job per call");
                batches = false;
                Status::unavailable("the server has no BatchUpdateJobs: send the report again")
            }
            Err(st) => st,
        };
        // An answer for the whole call is each report's answer (UpdateJob
        // would have said the same); the transient ones are retried.
        for reply in replies {
            let _ = reply.send(Err(whole.clone()));
        }
    }
}

/// Sends each report as its own `UpdateJob`.
async fn send_each(client: &mut WorkerClient, batch: Vec<Pending>, call_timeout: Duration) {
    for p in batch {
        let mut req = tonic::Request::new(p.req);
        crate::telemetry::inject(&mut req, p.traceparent.as_deref());
        let r = match timeout(call_timeout, client.update_job(req)).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(Status::deadline_exceeded("UpdateJob timed out")),
        };
        let _ = p.reply.send(r);
    }
}
