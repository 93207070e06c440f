//! Final job reports: one task sends them on the worker's `ReportJobs`
//! stream, each as soon as it is ready (the reports that queued up while
//! the task was busy go together in one request), with up to
//! [`MAX_UNANSWERED`] requests awaiting their answers. Nothing waits to
//! fill a request, and no report pays for a call of its own. A report of
//! a traced job that would go alone is sent as a plain `UpdateJob`
//! carrying the job's `traceparent`, so the server's span joins its trace.
//!
//! Each report's caller gets the outcome the server gave that report, as
//! the `Status` `UpdateJob` would have returned, so its retry rules do not
//! change; when the stream breaks (the server restarts, a call times out)
//! every unanswered report gets the stream's status (`UNAVAILABLE`,
//! `DEADLINE_EXCEEDED`, ...), which its caller retries, and the next report
//! opens a new stream. A server without `ReportJobs` (`UNIMPLEMENTED`)
//! gets batched `BatchUpdateJobs` calls instead (one call in flight, the
//! reports that queue up meanwhile in the next; a lone report as a plain
//! `UpdateJob`), and one without `BatchUpdateJobs` one `UpdateJob` per
//! report.

use std::{collections::VecDeque, time::Duration};

use prost::Message;
use tokio::{
    sync::{mpsc, oneshot},
    time::{timeout, Instant},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};
use tracing::{debug, info};

use super::client::WorkerClient;
use crate::pb::{BatchUpdateJobsRequest, ReportJobsRequest, UpdateJobRequest, UpdateJobResult};

/// Most reports in one request or call (the server takes up to 1024).
pub const MAX_BATCH_REPORTS: usize = 256;

/// Most encoded bytes of reports in one request or call: under the 4 MiB
/// message limit gRPC servers use by default (one report alone may be up
/// to [`super::agent::REPORT_BUDGET_BYTES`] plus its fields).
pub const MAX_BATCH_BYTES: usize = 3584 * 1024;

/// Most `ReportJobs` requests sent and not yet answered; more reports wait
/// (and go together) until the oldest is answered. The server reads as
/// many ahead.
pub const MAX_UNANSWERED: usize = 64;

/// A report and where its outcome goes.
struct Pending {
    req: UpdateJobRequest,
    /// W3C `traceparent` metadata for a report sent alone.
    traceparent: Option<String>,
    reply: oneshot::Sender<Result<(), Status>>,
}

/// Sends final reports; cheap to share by reference.
pub struct Reporter {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Reporter {
    /// Starts the sending task for `worker_id` on `client`; `call_timeout`
    /// bounds each call and each request's wait for its answer. Must be
    /// called inside a tokio runtime.
    pub fn start(client: WorkerClient, worker_id: String, call_timeout: Duration) -> Reporter {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_loop(client, worker_id, call_timeout, rx));
        Reporter { tx }
    }

    /// Sends `req` and returns its outcome. A traced report sent alone (a
    /// plain `UpdateJob`) carries `traceparent` as metadata, so the
    /// server's span joins the job's trace; reports sent together carry
    /// none.
    ///
    /// Errors: the `Status` the server gave this report (as `UpdateJob`
    /// would), `DEADLINE_EXCEEDED` when its answer took longer than the
    /// call timeout, or the transport error that broke the stream or call
    /// (`UNAVAILABLE`, ...).
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

/// How the server takes reports; each falls back to the next when the
/// server answers `UNIMPLEMENTED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Requests on one `ReportJobs` stream.
    Stream,
    /// `BatchUpdateJobs` calls, one in flight.
    Batch,
    /// One `UpdateJob` call per report.
    Single,
}

/// How a `ReportJobs` stream ended.
enum Session {
    /// The reporter was dropped and every request was answered.
    Done,
    /// The server has no `ReportJobs`.
    Unimplemented,
    /// The stream broke; its unanswered reports got the error.
    Broken,
}

async fn send_loop(
    mut client: WorkerClient,
    worker_id: String,
    call_timeout: Duration,
    mut rx: mpsc::UnboundedReceiver<Pending>,
) {
    let mut way = Way::Stream;
    let mut carry: Option<Pending> = None;
    loop {
        let first = match carry.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let batch = gather(first, &mut rx, &mut carry);
        if way == Way::Single || goes_alone(&batch) {
            send_each(&mut client, batch, call_timeout).await;
            continue;
        }
        if way == Way::Stream {
            match stream_session(
                &client,
                &worker_id,
                call_timeout,
                batch,
                &mut rx,
                &mut carry,
            )
            .await
            {
                Session::Done => return,
                Session::Broken => {}
                Session::Unimplemented => {
                    info!("the server has no ReportJobs: reporting with BatchUpdateJobs");
                    way = Way::Batch;
                }
            }
            continue;
        }
        if batch.len() == 1 {
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
        match outcome {
            Ok(results) => answer(results, replies, "BatchUpdateJobs"),
            Err(st) if st.code() == Code::Unimplemented => {
                info!("the server has no BatchUpdateJobs: reporting one job per call");
                way = Way::Single;
                fail_all(
                    replies,
                    &Status::unavailable(
                        "the server has no BatchUpdateJobs: send the report again",
                    ),
                );
            }
            // An answer for the whole call is each report's answer
            // (UpdateJob would have said the same); the transient ones
            // are retried.
            Err(st) => fail_all(replies, &st),
        }
    }
}

/// `first` and the reports queued behind it, up to [`MAX_BATCH_REPORTS`]
/// and [`MAX_BATCH_BYTES`]; the first one that does not fit goes to
/// `carry`.
fn gather(
    first: Pending,
    rx: &mut mpsc::UnboundedReceiver<Pending>,
    carry: &mut Option<Pending>,
) -> Vec<Pending> {
    let mut bytes = first.req.encoded_len();
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH_REPORTS {
        let Ok(p) = rx.try_recv() else { break };
        let len = p.req.encoded_len();
        if bytes + len > MAX_BATCH_BYTES {
            *carry = Some(p);
            break;
        }
        bytes += len;
        batch.push(p);
    }
    batch
}

/// True for a lone report of a traced job: it goes as a plain `UpdateJob`
/// carrying the job's `traceparent`, so the server's span joins its trace.
fn goes_alone(batch: &[Pending]) -> bool {
    matches!(batch, [p] if p.traceparent.is_some())
}

/// Gives each report of a call or request its own result; a count that
/// does not match the reports' is every report's `UNKNOWN`.
fn answer(
    results: Vec<UpdateJobResult>,
    replies: Vec<oneshot::Sender<Result<(), Status>>>,
    what: &str,
) {
    if results.len() != replies.len() {
        let st = Status::unknown(format!(
            "{what} answered {} results for {} reports",
            results.len(),
            replies.len()
        ));
        return fail_all(replies, &st);
    }
    debug!(reports = results.len(), "{what}: reports answered");
    for (r, reply) in results.into_iter().zip(replies) {
        let _ = reply.send(match r.code {
            0 => Ok(()),
            code => Err(Status::new(Code::from(code), r.message)),
        });
    }
}

/// Answers every report with `st`.
fn fail_all(replies: impl IntoIterator<Item = oneshot::Sender<Result<(), Status>>>, st: &Status) {
    for reply in replies {
        let _ = reply.send(Err(st.clone()));
    }
}

/// A `ReportJobs` request sent and not yet answered.
struct Unanswered {
    /// When its answer is overdue.
    due: Instant,
    replies: Vec<oneshot::Sender<Result<(), Status>>>,
}

/// Opens a `ReportJobs` stream with `batch` as its first request and sends
/// every later report on it until the stream breaks or the reporter is
/// dropped with nothing left unanswered. A report taken and not sent
/// (it did not fit in a request) is left in `carry`.
async fn stream_session(
    client: &WorkerClient,
    worker_id: &str,
    call_timeout: Duration,
    batch: Vec<Pending>,
    rx: &mut mpsc::UnboundedReceiver<Pending>,
    carry: &mut Option<Pending>,
) -> Session {
    // The stream's requests; its buffer holds every request allowed
    // unanswered, so a send never waits.
    let (tx, requests) = mpsc::channel::<ReportJobsRequest>(MAX_UNANSWERED);
    let mut tx = Some(tx);
    let mut unanswered: VecDeque<Unanswered> = VecDeque::new();
    let send = |tx: &mpsc::Sender<ReportJobsRequest>,
                unanswered: &mut VecDeque<Unanswered>,
                batch: Vec<Pending>| {
        let (reqs, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|p| (p.req, p.reply)).unzip();
        let request = ReportJobsRequest {
            worker_id: worker_id.to_string(),
            requests: reqs,
        };
        match tx.try_send(request) {
            Ok(()) => unanswered.push_back(Unanswered {
                due: Instant::now() + call_timeout,
                replies,
            }),
            Err(_) => fail_all(replies, &Status::unavailable("the report stream is closed")),
        }
    };
    if let Some(tx) = &tx {
        send(tx, &mut unanswered, batch);
    }
    let fail_unanswered = |unanswered: &mut VecDeque<Unanswered>, st: &Status| {
        fail_all(unanswered.drain(..).flat_map(|u| u.replies), st);
    };
    let mut opener = client.clone();
    let opened = timeout(
        call_timeout,
        opener.report_jobs(ReceiverStream::new(requests)),
    )
    .await;
    let mut answers = match opened {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(st)) if st.code() == Code::Unimplemented => {
            let again = Status::unavailable("the server has no ReportJobs: send the report again");
            fail_unanswered(&mut unanswered, &again);
            return Session::Unimplemented;
        }
        Ok(Err(st)) => {
            fail_unanswered(&mut unanswered, &st);
            return Session::Broken;
        }
        Err(_) => {
            let st = Status::deadline_exceeded("opening the ReportJobs stream timed out");
            fail_unanswered(&mut unanswered, &st);
            return Session::Broken;
        }
    };
    loop {
        if tx.is_none() && unanswered.is_empty() {
            return Session::Done;
        }
        let due = unanswered.front().map(|u| u.due);
        let room = tx.is_some() && unanswered.len() < MAX_UNANSWERED;
        tokio::select! {
            next = async {
                match carry.take() {
                    Some(p) => Some(p),
                    None => rx.recv().await,
                }
            }, if room => match next {
                Some(p) => {
                    let batch = gather(p, rx, carry);
                    if goes_alone(&batch) {
                        let mut c = client.clone();
                        tokio::spawn(async move { send_each(&mut c, batch, call_timeout).await });
                    } else if let Some(tx) = &tx {
                        send(tx, &mut unanswered, batch);
                    }
                }
                // The reporter is gone: half-close the stream; the server
                // answers what it read, then ends it.
                None => tx = None,
            },
            msg = answers.message() => match msg {
                Ok(Some(a)) => match unanswered.pop_front() {
                    Some(u) => answer(a.results, u.replies, "ReportJobs"),
                    None => {
                        debug!("ReportJobs answered a request never sent; opening a new stream");
                        return Session::Broken;
                    }
                },
                Ok(None) => {
                    let st = Status::unavailable("the ReportJobs stream ended before answering every report");
                    fail_unanswered(&mut unanswered, &st);
                    return if tx.is_none() { Session::Done } else { Session::Broken };
                }
                Err(st) if st.code() == Code::Unimplemented => {
                    let again = Status::unavailable("the server has no ReportJobs: send the report again");
                    fail_unanswered(&mut unanswered, &again);
                    return Session::Unimplemented;
                }
                Err(st) => {
                    debug!(status = %st, "the ReportJobs stream broke");
                    fail_unanswered(&mut unanswered, &st);
                    return Session::Broken;
                }
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                let st = Status::deadline_exceeded("a ReportJobs answer took longer than the call timeout");
                fail_unanswered(&mut unanswered, &st);
                return Session::Broken;
            }
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
