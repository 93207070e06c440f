//! `agq.v1.WorkerService`: the WORKER.REGISTER, WORKER.HEARTBEAT (as a
//! bidirectional stream), JOB.UPDATE, WORKER.UNREGISTER, `KEYS
//! worker:*:alive` and `GET worker:<id>:stats` commands of the
//! specification, and LeaseJobs, the server stream of leases that replaces
//! polling the ready queue. The engine pushes domain events
//! ([`HeartbeatEvent`], [`JobLease`]) into a channel per stream; this
//! module turns them into messages and statuses.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Weak},
    task::{Context, Poll, Waker},
};

use futures_util::{Stream, StreamExt};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{
    convert::{report_results, state_filter},
    rpc, rpc_traced,
};
use crate::{
    auth::{identity, require_admin, require_client, require_worker, Identity},
    core::{
        engine::{HeartbeatEvent, StreamKind},
        model::{JobLease, JobReport},
        page, validate, SharedEngine,
    },
    error::Error,
    pb::{self, worker_service_server::WorkerService},
    request_budget::{self, MessageReservations},
    telemetry,
};

/// Closes its semaphore when dropped: the reply stream of a heartbeat
/// stream holds one, so its reader stops waiting for permits once the
/// replies are gone.
struct CloseOnDrop(Arc<Semaphore>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The lease as sent to the worker. A traced job gets a `lease` span (a
/// child of its SubmitAction, ended as the lease is sent) whose context
/// replaces the lease's `traceparent`, so the worker's job span hangs
/// under it; without exported spans the submission's context goes as is.
fn traced_lease(l: JobLease) -> pb::JobLease {
    let Some(tp) = l.traceparent.clone() else {
        return l.into();
    };
    let span = tracing::info_span!(
        "lease",
        otel.kind = "producer",
        job_id = %l.job.job_id,
        lease_id = %l.lease_id,
        worker_id = %l.job.worker_id,
        attempt = l.attempt,
    );
    telemetry::set_parent(&span, telemetry::context_of(&tp));
    let mut lease = pb::JobLease::from(l);
    if let Some(own) = telemetry::span_traceparent(&span) {
        lease.traceparent = own;
    }
    lease
}

/// Most replies of one Heartbeat stream the worker has not read: the
/// stream reads no further heartbeat until it reads one (HTTP/2 flow
/// control then holds the worker's sends), so a worker that sends without
/// reading cannot make the server queue replies without bound.
pub const MAX_UNREAD_HEARTBEAT_REPLIES: usize = 8;

/// How many heartbeat intervals a Heartbeat stream waits for its first
/// message (the worker sends it as it opens the stream) before it ends
/// with `DEADLINE_EXCEEDED`: as long as a worker may stay silent and
/// still count as alive.
pub const FIRST_HEARTBEAT_INTERVALS: u32 = 3;

/// Most requests of one ReportJobs stream read and not yet answered: the
/// stream reads no further until the oldest is answered.
pub const MAX_UNANSWERED_REPORTS: usize = 64;

/// Checks one ReportJobs request before anything of it is applied: the
/// token may act for its worker, which is the stream's first request's,
/// and the reports are a valid batch of that worker (each is checked on
/// its own when applied). Returns the worker and the reports.
///
/// Errors: `PERMISSION_DENIED` (the token), `INVALID_ARGUMENT` (another
/// worker than the stream's, a bad worker id, no reports or more than
/// 1024, a report naming another worker).
fn check_reports(
    who: &Identity,
    bound: &mut Option<String>,
    m: pb::ReportJobsRequest,
) -> Result<(String, Vec<JobReport>), Status> {
    match bound {
        Some(w) if *w != m.worker_id => {
            return Err(Status::invalid_argument(format!(
                "worker_id changed within one ReportJobs stream: {w:?}, then {:?}",
                m.worker_id
            )))
        }
        Some(_) => {}
        None => {
            require_worker(who, &m.worker_id)?;
            *bound = Some(m.worker_id.clone());
        }
    }
    let reports = m.requests.into_iter().map(Into::into).collect();
    let reports = validate::batch(&m.worker_id, reports).map_err(Status::from)?;
    Ok((m.worker_id, reports))
}

/// The answers of one ReportJobs stream (WorkerService/ReportJobs) to
/// `requests`, read as `who`: each request is checked as it is read
/// ([`check_reports`]), its reports are applied as by BatchUpdateJobs
/// while up to [`MAX_UNANSWERED_REPORTS`] earlier requests are still being
/// committed, and it is answered, in request order, once committed, with
/// one result per report. Each request keeps its share of the server's
/// request buffer, taken from `reservations` in request order, until it
/// is answered. The first refused request (or a transport error of
/// `requests`) is the last answer, as an error: nothing read after it is
/// applied. The stream ends when `requests` ends and every answer is
/// out.
///
/// Errors (as the stream's last item): `PERMISSION_DENIED`,
/// `INVALID_ARGUMENT` (see [`check_reports`]); `UNAVAILABLE` when the
/// store cannot commit; the status of a broken `requests`.
pub fn report_stream(
    engine: SharedEngine,
    who: Identity,
    requests: impl Stream<Item = Result<pb::ReportJobsRequest, Status>> + Send + 'static,
    reservations: Option<MessageReservations>,
) -> BoxStream<pb::ReportJobsResponse> {
    let answers = requests
        .scan((None::<String>, false), move |(bound, refused), m| {
            if *refused {
                return std::future::ready(None);
            }
            // The message's reservation, held until it is answered.
            let held = match &m {
                Ok(_) => reservations.as_ref().and_then(|r| r.take_next()),
                Err(_) => None,
            };
            let checked = m.and_then(|m| check_reports(&who, bound, m));
            *refused = checked.is_err();
            std::future::ready(Some((checked, held)))
        })
        .map(move |(checked, held)| {
            let engine = engine.clone();
            async move {
                let (worker_id, reports) = checked?;
                let outcomes =
                    request_budget::holding(held, engine.batch_update_jobs(worker_id, reports))
                        .await?;
                Ok(pb::ReportJobsResponse {
                    results: report_results(outcomes),
                })
            }
        })
        .buffered(MAX_UNANSWERED_REPORTS);
    Box::pin(answers)
}

/// The WorkerService implementation.
pub struct WorkerApi {
    /// The engine.
    pub engine: SharedEngine,
    /// Turns true when the server shuts down; ends open streams.
    pub shutdown: watch::Receiver<bool>,
    /// The lease streams open on this server, so that a newer stream of
    /// a worker ends the older one at once.
    pub lease_streams: LeaseStreams,
}

/// The buffer of one lease stream: the receiver of the engine's channel,
/// which [`LeaseStreams`] can drop (with every lease still in it) while
/// the stream waits for a client that does not read, and the waker of the
/// stream's last poll.
type LeaseBuffer = Arc<LeaseBufferInner>;

/// The open lease streams of a server, by worker id: each worker's newest
/// (its engine stream id and buffer). A LeaseJobs call of a worker whose
/// older stream is still open (a broken connection the server has not
/// noticed yet, or a client that opened another without reading the
/// first) drops the older stream's buffer and ends it: a replaced stream
/// holds no leases, however many are opened. Cheap to clone.
#[derive(Clone, Default)]
pub struct LeaseStreams(Arc<std::sync::Mutex<HashMap<String, NewestLeaseStream>>>);

/// A worker's newest lease stream in [`LeaseStreams`]: its engine stream
/// id and its buffer.
type NewestLeaseStream = (u64, Weak<LeaseBufferInner>);

/// What a [`LeaseBuffer`] points to.
type LeaseBufferInner =
    std::sync::Mutex<(Option<mpsc::UnboundedReceiver<JobLease>>, Option<Waker>)>;

impl LeaseStreams {
    /// Records `buffer` as worker `worker_id`'s stream `sid`, and ends the
    /// worker's older stream, dropping the leases it still holds. Stream
    /// ids grow with each stream the engine opens: when two calls race, the
    /// stream the engine opened last stays, whichever gets here first.
    fn open(&self, worker_id: &str, sid: u64, buffer: &LeaseBuffer) {
        let ended = {
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            match map.get(worker_id) {
                Some((newer, _)) if *newer > sid => Some(buffer.clone()),
                _ => map
                    .insert(worker_id.to_string(), (sid, Arc::downgrade(buffer)))
                    .and_then(|(_, old)| old.upgrade()),
            }
        };
        if let Some(ended) = ended {
            let (rx, waker) = {
                let mut b = ended.lock().unwrap_or_else(|e| e.into_inner());
                (b.0.take(), b.1.take())
            };
            drop(rx);
            if let Some(w) = waker {
                w.wake();
            }
        }
    }

    /// Forgets worker `worker_id`'s stream `sid` (it closed), unless a
    /// newer one replaced it.
    fn close(&self, worker_id: &str, sid: u64) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if map.get(worker_id).is_some_and(|(s, _)| *s == sid) {
            map.remove(worker_id);
        }
    }
}

/// The leases of a [`LeaseBuffer`], ending when its receiver is dropped
/// or the engine lets the stream go.
struct BufferedLeases(LeaseBuffer);

impl Stream for BufferedLeases {
    type Item = JobLease;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<JobLease>> {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (rx, waker) = &mut *b;
        match rx {
            Some(rx) => {
                let next = rx.poll_recv(cx);
                if next.is_pending() {
                    *waker = Some(cx.waker().clone());
                }
                next
            }
            None => Poll::Ready(None),
        }
    }
}

/// A boxed stream of messages or a status, as the streaming RPCs return.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A server stream that tells the engine when it is dropped (the client went
/// away or the server ended it).
struct ClosingStream<T> {
    inner: BoxStream<T>,
    on_close: Option<Box<dyn FnOnce() + Send>>,
}

impl<T> Stream for ClosingStream<T> {
    type Item = Result<T, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl<T> Drop for ClosingStream<T> {
    fn drop(&mut self) {
        if let Some(f) = self.on_close.take() {
            f();
        }
    }
}

fn until_shutdown<T: Send + 'static>(
    stream: impl Stream<Item = Result<T, Status>> + Send + 'static,
    mut shutdown: watch::Receiver<bool>,
) -> BoxStream<T> {
    let stop = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    Box::pin(stream.take_until(Box::pin(stop)))
}

#[tonic::async_trait]
impl WorkerService for WorkerApi {
    async fn register_worker(
        &self,
        req: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/RegisterWorker", async {
            let r = req.get_ref();
            require_worker(&identity(&req), &r.worker_id)?;
            let r = req.into_inner();
            let worker_id = r.worker_id.clone();
            let done = self.engine.register_worker(r.into()).await?;
            let interval = done.heartbeat_interval;
            Ok(pb::RegisterWorkerResponse {
                worker_id,
                resumed: done.resumed,
                heartbeat_interval_secs: interval.as_secs_f64().ceil() as u32,
                heartbeat_interval_ms: interval.as_millis().min(u32::MAX as u128) as u32,
            })
        })
        .await
    }

    type HeartbeatStream = BoxStream<pb::HeartbeatResponse>;

    async fn heartbeat(
        &self,
        req: Request<Streaming<pb::HeartbeatRequest>>,
    ) -> Result<Response<Self::HeartbeatStream>, Status> {
        rpc(&self.engine, "WorkerService/Heartbeat", async {
            let who = identity(&req);
            let mut inbound = req.into_inner();
            let wait = self.engine.config().heartbeat_interval * FIRST_HEARTBEAT_INTERVALS;
            let first = tokio::time::timeout(wait, inbound.message())
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(format!(
                        "no first heartbeat within {} ms of opening the stream",
                        wait.as_millis()
                    ))
                })??
                .ok_or_else(|| {
                    Status::invalid_argument("the heartbeat stream ended before its first message")
                })?;
            require_worker(&who, &first.worker_id)?;
            let worker_id = first.worker_id.clone();
            // Checked before the stream is attached: attaching replaces
            // the worker's open heartbeat stream, so a refusal after it
            // would leave the worker without one (suspect, its leases
            // re-queued after the grace).
            validate::worker_id(&worker_id)?;
            let first_answer = first
                .verification
                .map(|a| validate::verification_answer(a.into()))
                .transpose()?;
            let (tx, rx) = mpsc::unbounded_channel();
            let engine = self.engine.clone();
            let sid = engine.open_heartbeat(worker_id.clone(), tx.clone()).await?;
            if let Some(answer) = first_answer {
                if let Err(e) = engine.answer_verification(worker_id.clone(), answer).await {
                    engine.close_stream(worker_id, StreamKind::Heartbeat, sid);
                    return Err(e.into());
                }
            }
            let held = first.held_leases.map(|h| h.lease_ids);
            let stats = first.stats.map(Into::into);
            match engine.heartbeat(worker_id.clone(), stats, held).await {
                Ok(reply) => {
                    let _ = tx.send(HeartbeatEvent::Reply(reply));
                }
                Err(e) => {
                    engine.close_stream(worker_id, StreamKind::Heartbeat, sid);
                    return Err(e.into());
                }
            }
            let mut shutdown = self.shutdown.clone();
            // One permit per reply the worker has not read yet (the first
            // one's is taken): at MAX_UNREAD_HEARTBEAT_REPLIES the stream
            // reads no further heartbeat until the worker reads a reply.
            // The reply stream closes the semaphore when it goes (the
            // worker went away, or the engine let the stream go), so the
            // reader never waits for a permit nobody will give back.
            let unread = Arc::new(Semaphore::new(MAX_UNREAD_HEARTBEAT_REPLIES - 1));
            let read = unread.clone();
            let closes = CloseOnDrop(unread.clone());
            // The engine's slot holds the stream's only sender from here:
            // when it lets the stream go (a newer stream of the worker
            // replaced it, the worker was let go), the replies end and so
            // does the reader, instead of keeping the worker fresh on a
            // stream nobody answers on.
            let weak = tx.downgrade();
            drop(tx);
            let send = move |event| weak.upgrade().is_some_and(|tx| tx.send(event).is_ok());
            tokio::spawn(async move {
                loop {
                    let permit = tokio::select! {
                        p = unread.clone().acquire_owned() => p,
                        _ = shutdown.wait_for(|s| *s) => break,
                    };
                    let Ok(permit) = permit else { break };
                    permit.forget();
                    let msg = tokio::select! {
                        m = inbound.message() => m,
                        _ = shutdown.wait_for(|s| *s) => break,
                    };
                    let m = match msg {
                        Ok(Some(m)) => m,
                        Ok(None) | Err(_) => break,
                    };
                    if unread.is_closed() {
                        break;
                    }
                    if m.worker_id != worker_id {
                        send(HeartbeatEvent::End(Error::invalid(
                            "worker_id changed within one heartbeat stream",
                        )));
                        break;
                    }
                    if let Some(answer) = m.verification {
                        // Recorded before the heartbeat is answered.
                        if let Err(e) = engine
                            .answer_verification(worker_id.clone(), answer.into())
                            .await
                        {
                            send(HeartbeatEvent::End(e));
                            break;
                        }
                    }
                    let held = m.held_leases.map(|h| h.lease_ids);
                    let stats = m.stats.map(Into::into);
                    match engine.heartbeat(worker_id.clone(), stats, held).await {
                        Ok(reply) => {
                            if !send(HeartbeatEvent::Reply(reply)) {
                                break;
                            }
                        }
                        Err(e) => {
                            send(HeartbeatEvent::End(e));
                            break;
                        }
                    }
                }
                engine.close_stream(worker_id, StreamKind::Heartbeat, sid);
            });
            let events = UnboundedReceiverStream::new(rx).map(move |event| match event {
                HeartbeatEvent::Reply(reply) => {
                    let _ = &closes;
                    // Read (or about to be): one more heartbeat may be
                    // read. The engine's own messages (commands) give
                    // back a permit too; the count stays within the limit.
                    if read.available_permits() < MAX_UNREAD_HEARTBEAT_REPLIES {
                        read.add_permits(1);
                    }
                    Ok(pb::HeartbeatResponse::from(reply))
                }
                HeartbeatEvent::End(e) => Err(Status::from(e)),
            });
            Ok(until_shutdown(events, self.shutdown.clone()))
        })
        .await
    }

    type LeaseJobsStream = BoxStream<pb::JobLease>;

    async fn lease_jobs(
        &self,
        req: Request<pb::LeaseJobsRequest>,
    ) -> Result<Response<Self::LeaseJobsStream>, Status> {
        rpc(&self.engine, "WorkerService/LeaseJobs", async {
            require_worker(&identity(&req), &req.get_ref().worker_id)?;
            let worker_id = req.into_inner().worker_id;
            let (tx, rx) = mpsc::unbounded_channel();
            let sid = self.engine.open_lease_stream(worker_id.clone(), tx).await?;
            let buffer: LeaseBuffer = Arc::new(std::sync::Mutex::new((Some(rx), None)));
            self.lease_streams.open(&worker_id, sid, &buffer);
            let engine = self.engine.clone();
            let streams = self.lease_streams.clone();
            let leases = BufferedLeases(buffer).map(|l: JobLease| Ok(traced_lease(l)));
            let stream: BoxStream<pb::JobLease> = Box::pin(ClosingStream {
                inner: until_shutdown(leases, self.shutdown.clone()),
                on_close: Some(Box::new(move || {
                    streams.close(&worker_id, sid);
                    engine.close_stream(worker_id, StreamKind::Lease, sid)
                })),
            });
            Ok(stream)
        })
        .await
    }

    async fn update_job(
        &self,
        req: Request<pb::UpdateJobRequest>,
    ) -> Result<Response<pb::UpdateJobResponse>, Status> {
        let remote = telemetry::extract(req.metadata());
        rpc_traced(&self.engine, "WorkerService/UpdateJob", remote, async {
            require_worker(&identity(&req), &req.get_ref().worker_id)?;
            let status = self.engine.update_job(req.into_inner().into()).await?;
            Ok(pb::UpdateJobResponse {
                status: pb::JobStatus::from(status) as i32,
            })
        })
        .await
    }

    async fn batch_update_jobs(
        &self,
        req: Request<pb::BatchUpdateJobsRequest>,
    ) -> Result<Response<pb::BatchUpdateJobsResponse>, Status> {
        rpc(&self.engine, "WorkerService/BatchUpdateJobs", async {
            require_worker(&identity(&req), &req.get_ref().worker_id)?;
            let r = req.into_inner();
            let reports: Vec<JobReport> = r.requests.into_iter().map(Into::into).collect();
            let outcomes = self.engine.batch_update_jobs(r.worker_id, reports).await?;
            Ok(pb::BatchUpdateJobsResponse {
                results: report_results(outcomes),
            })
        })
        .await
    }

    type ReportJobsStream = BoxStream<pb::ReportJobsResponse>;

    async fn report_jobs(
        &self,
        req: Request<Streaming<pb::ReportJobsRequest>>,
    ) -> Result<Response<Self::ReportJobsStream>, Status> {
        rpc(&self.engine, "WorkerService/ReportJobs", async {
            let who = identity(&req);
            let reservations = req.extensions().get::<MessageReservations>().cloned();
            // At shutdown the stream stops reading; what it read is still
            // answered (the buffered answers drain), then it ends.
            let requests = until_shutdown(req.into_inner(), self.shutdown.clone());
            Ok(report_stream(
                self.engine.clone(),
                who,
                requests,
                reservations,
            ))
        })
        .await
    }

    async fn unregister_worker(
        &self,
        req: Request<pb::UnregisterWorkerRequest>,
    ) -> Result<Response<pb::UnregisterWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/UnregisterWorker", async {
            require_worker(&identity(&req), &req.get_ref().worker_id)?;
            let requeued_jobs = self
                .engine
                .unregister_worker(req.into_inner().worker_id)
                .await?;
            Ok(pb::UnregisterWorkerResponse { requeued_jobs })
        })
        .await
    }

    async fn list_workers(
        &self,
        req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        rpc(&self.engine, "WorkerService/ListWorkers", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let state = state_filter(r.state)?;
            let limit = match r.page_size {
                0 => usize::MAX,
                n => page::page_size(n)?,
            };
            // The filter is part of the token's kind: a token of another
            // state's listing is refused.
            let kind = format!("worker/{}", r.state);
            let after = page::decode_token(&kind, &r.page_token)?;
            let mut workers: Vec<pb::Worker> = self
                .engine
                .list_workers(state)
                .await?
                .into_iter()
                .filter(|w| after.as_ref().is_none_or(|a| w.worker_id > *a))
                .map(Into::into)
                .collect();
            workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
            let (workers, next_page_token) = page::split_page_within(
                workers,
                limit,
                &kind,
                |w| w.worker_id.clone(),
                prost::Message::encoded_len,
                page::PAGE_BYTES,
            );
            Ok(pb::ListWorkersResponse {
                workers,
                next_page_token,
            })
        })
        .await
    }

    async fn get_worker(
        &self,
        req: Request<pb::GetWorkerRequest>,
    ) -> Result<Response<pb::GetWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/GetWorker", async {
            require_client(&identity(&req))?;
            let worker = self.engine.get_worker(req.into_inner().worker_id).await?;
            Ok(pb::GetWorkerResponse {
                worker: Some(worker.into()),
            })
        })
        .await
    }

    async fn drain_worker(
        &self,
        req: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::DrainWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/DrainWorker", async {
            require_worker(&identity(&req), &req.get_ref().worker_id)?;
            let worker = self.engine.drain_worker(req.into_inner().worker_id).await?;
            Ok(pb::DrainWorkerResponse {
                worker: Some(worker.into()),
            })
        })
        .await
    }

    async fn forget_worker(
        &self,
        req: Request<pb::ForgetWorkerRequest>,
    ) -> Result<Response<pb::ForgetWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/ForgetWorker", async {
            // The same token as DrainWorker: the worker's own (or its
            // pool's) or an admin's; a client token may only read workers.
            require_worker(&identity(&req), &req.get_ref().worker_id)?;
            self.engine
                .forget_worker(req.into_inner().worker_id)
                .await?;
            Ok(pb::ForgetWorkerResponse {})
        })
        .await
    }

    async fn release_worker(
        &self,
        req: Request<pb::ReleaseWorkerRequest>,
    ) -> Result<Response<pb::ReleaseWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/ReleaseWorker", async {
            // An operator's decision: neither the worker itself nor a
            // client may end a quarantine.
            require_admin(&identity(&req))?;
            let worker = self
                .engine
                .release_worker(req.into_inner().worker_id)
                .await?;
            Ok(pb::ReleaseWorkerResponse {
                worker: Some(worker.into()),
            })
        })
        .await
    }

    async fn verify_worker(
        &self,
        req: Request<pb::VerifyWorkerRequest>,
    ) -> Result<Response<pb::VerifyWorkerResponse>, Status> {
        rpc(&self.engine, "WorkerService/VerifyWorker", async {
            // Challenging a worker is an operator's decision, as releasing it.
            require_admin(&identity(&req))?;
            let r = req.into_inner();
            let v = self
                .engine
                .verify_worker(r.worker_id, r.tool, r.args)
                .await?;
            Ok(pb::VerifyWorkerResponse {
                verification: Some(v.into()),
            })
        })
        .await
    }
}
