//! The server-wide budget for request messages being received.
//!
//! tonic buffers each gRPC request message whole before decoding it, up to
//! [`crate::server::MAX_MESSAGE_BYTES`]. A caller with a valid token could
//! open many calls (256 per connection, any number of connections), send
//! all but the last byte of a large message on each and make the server
//! hold gigabytes. [`RequestBudgetLayer`] reads the 5-byte gRPC frame
//! header of every request message as it arrives and reserves the
//! announced length from one budget shared by all calls. The reservation
//! lasts as long as the server holds the message, decoded or not:
//!
//! - a unary request's until its answer is ready (the handler has run, its
//!   commit included) or the call ends;
//! - a ReportJobs request's until that request is answered: the stream
//!   hands each message's reservation to its handler
//!   ([`MessageReservations`]), which keeps it beside the decoded
//!   reports while they wait for the writer;
//! - a Heartbeat request's until the whole message has arrived: the stream
//!   handles one message at a time and reads no further while replies
//!   are unread;
//! - any other streaming request's until the whole message has arrived,
//!   once the call's answer has started.
//!
//! Health checking and server reflection need no token: their messages
//! are not reserved (a caller without a token could otherwise hold the
//! whole budget), and their services refuse messages past
//! [`UNBUDGETED_MAX_MESSAGE_BYTES`] instead.
//!
//! So decoded requests queued for the writer count too: callers that send
//! faster than the store commits meet the limit instead of growing the
//! server's memory. A message the budget cannot hold fails its call with
//! `RESOURCE_EXHAUSTED` at once, before its bytes are buffered; the caller
//! may retry once other messages are through. Messages larger than the
//! message limit are left to tonic, which refuses them (`OUT_OF_RANGE`)
//! without buffering them.

use std::{
    collections::VecDeque,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    task::futures::TaskLocalFuture,
};
use tonic::{body::Body, Status};

/// Default of the budget, in bytes (256 MiB): sixteen messages of the
/// largest size at once, or thousands of ordinary ones.
pub const DEFAULT_REQUEST_BUFFER_BYTES: usize = 256 * 1024 * 1024;

/// Bytes of a gRPC frame header: a compression flag and a big-endian
/// 32-bit length.
const HEADER_BYTES: usize = 5;

/// The shared budget: a semaphore of one permit per byte.
#[derive(Debug, Clone)]
pub struct RequestBudget {
    bytes: Arc<Semaphore>,
    /// Messages longer than this are not reserved (tonic refuses them).
    max_message: usize,
}

/// The trailer of a refusal for a full request buffer that tells the
/// client to send the same request again after this many milliseconds
/// (gRPC's retry pushback): the request was refused for now only, not
/// for what it holds. agw retries such a report as it is, outputs
/// included.
pub const RETRY_PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";

/// The wait [`RETRY_PUSHBACK_HEADER`] asks for, ms: about the time the
/// store takes to commit what holds the buffer.
pub const RETRY_PUSHBACK_MS: u64 = 100;

impl RequestBudget {
    /// A budget of `total` bytes for messages of at most `max_message`
    /// bytes (a message larger than `total` always fails with
    /// `RESOURCE_EXHAUSTED`, so `total` should be at least `max_message`).
    pub fn new(total: usize, max_message: usize) -> Self {
        RequestBudget {
            bytes: Arc::new(Semaphore::new(total.min(Semaphore::MAX_PERMITS))),
            max_message,
        }
    }

    /// Bytes not reserved now.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// Reserves `len` bytes for one message; `Err` with
    /// `RESOURCE_EXHAUSTED` when the budget cannot hold it now. `None` for
    /// an empty message or one over the message limit.
    fn reserve(&self, len: usize) -> Result<Option<OwnedSemaphorePermit>, Status> {
        if len == 0 || len > self.max_message {
            return Ok(None);
        }
        let n = u32::try_from(len).unwrap_or(u32::MAX);
        match Arc::clone(&self.bytes).try_acquire_many_owned(n) {
            Ok(permit) => Ok(Some(permit)),
            Err(_) => {
                let mut st = Status::resource_exhausted(format!(
                    "the server is receiving too many large messages at once: a {len}-byte message does not fit its request buffer now; retry later"
                ));
                st.metadata_mut().insert(
                    RETRY_PUSHBACK_HEADER,
                    tonic::metadata::MetadataValue::from(RETRY_PUSHBACK_MS),
                );
                Err(st)
            }
        }
    }
}

/// Path prefixes of the services that need no token (health checking,
/// server reflection): their messages are left out of the budget, so that
/// a caller without a token cannot take it from the callers with one by
/// announcing large messages and never sending them. Their own message
/// limit is small instead ([`UNBUDGETED_MAX_MESSAGE_BYTES`]).
const UNBUDGETED: [&str; 2] = ["/grpc.health.v1.Health/", "/grpc.reflection."];

/// The largest request message of the services in [`UNBUDGETED`], bytes
/// (16 KiB): their requests name a service, a symbol or a file.
pub const UNBUDGETED_MAX_MESSAGE_BYTES: usize = 16 * 1024;

/// Paths of the calls whose request is a stream, and what becomes of each
/// message's reservation once the message has arrived.
const STREAMING_REQUESTS: [(&str, Release); 2] = [
    ("/agq.v1.WorkerService/Heartbeat", Release::OnArrival),
    ("/agq.v1.WorkerService/ReportJobs", Release::ByHandler),
];

/// When a call's message reservations are given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// Once the whole message has arrived.
    OnArrival,
    /// When the handler and what it queued for the store drop what it
    /// took from [`MessageReservations`].
    ByHandler,
    /// A unary request: when the call and what it queued for the store
    /// are done ([`current_share`]). A message that arrives after the
    /// call's answer is ready (a stream this list does not name, server
    /// reflection's say) gives its share back on arrival.
    WithCall,
}

/// A hold on part of the request buffer: the bytes go back once every
/// clone of it is dropped. What a request queues for the store keeps one
/// ([`current_share`]) while it waits there with the request's data.
#[derive(Debug, Clone)]
pub struct BufferShare {
    _held: Arc<dyn std::fmt::Debug + Send + Sync>,
}

tokio::task_local! {
    /// The share of the request buffer of the request being handled.
    static SHARE: Option<BufferShare>;
}

/// Runs `f` holding `share` as its request's share of the request buffer:
/// [`current_share`] gives it to what `f` queues for the store.
pub async fn holding<F: Future>(share: Option<BufferShare>, f: F) -> F::Output {
    SHARE.scope(share, f).await
}

/// The share of the request buffer of the request this task is handling
/// (a unary call, or a ReportJobs message under [`holding`]); `None`
/// outside one. The store's queue keeps it with each operation until the
/// operation has run, so a request whose caller went away still counts
/// while its data waits in the queue.
pub fn current_share() -> Option<BufferShare> {
    SHARE.try_with(|s| s.clone()).ok().flatten()
}

/// The reservations of one call's messages that have arrived whole, in
/// message order, for the handler to take one by one (ReportJobs). The
/// layer puts it in the request's extensions; a handler takes one entry
/// per message it reads, in order, and holds it while it holds the
/// message (and [`holding`] it, while the message waits in the store's
/// queue). Entries not taken are given back when the call ends.
#[derive(Debug, Clone, Default)]
pub struct MessageReservations {
    queue: Arc<Mutex<Kept>>,
}

/// The reservations kept for a call.
#[derive(Debug, Default)]
struct Kept {
    /// One entry per message, oldest first (`None`: an empty message,
    /// which reserves nothing).
    permits: VecDeque<Option<OwnedSemaphorePermit>>,
    /// Keeps no more: later messages give their share back on arrival.
    closed: bool,
}

impl MessageReservations {
    /// The reservation of the oldest message not yet taken. `None` when it
    /// reserved nothing (an empty message) or there is none to take.
    pub fn take_next(&self) -> Option<BufferShare> {
        let mut kept = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        kept.permits
            .pop_front()
            .flatten()
            .map(|p| BufferShare { _held: Arc::new(p) })
    }

    fn keep(&self, permit: Option<OwnedSemaphorePermit>) {
        let mut kept = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if !kept.closed {
            kept.permits.push_back(permit);
        }
    }

    /// Keeps no more reservations: those of messages arriving from now
    /// on go back at once. The ones kept stay with their holders (what
    /// the call queued for the store holds [`Self::share`]).
    fn close(&self) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
    }

    /// The whole call's reservations as one share.
    fn share(&self) -> BufferShare {
        BufferShare {
            _held: self.queue.clone(),
        }
    }
}

/// A tower layer that puts every request body under a [`RequestBudget`];
/// for `tonic::transport::Server::layer`.
#[derive(Debug, Clone)]
pub struct RequestBudgetLayer {
    budget: RequestBudget,
}

impl RequestBudgetLayer {
    /// Layer drawing on `budget`.
    pub fn new(budget: RequestBudget) -> Self {
        RequestBudgetLayer { budget }
    }
}

impl<S> tower::Layer<S> for RequestBudgetLayer {
    type Service = RequestBudgetService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestBudgetService {
            inner,
            budget: self.budget.clone(),
        }
    }
}

/// The service of [`RequestBudgetLayer`].
#[derive(Debug, Clone)]
pub struct RequestBudgetService<S> {
    inner: S,
    budget: RequestBudget,
}

impl<S> tower::Service<http::Request<Body>> for RequestBudgetService<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Answer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        if UNBUDGETED
            .iter()
            .any(|prefix| req.uri().path().starts_with(prefix))
        {
            return Answer {
                inner: Box::pin(SHARE.scope(None, self.inner.call(req))),
                close: None,
            };
        }
        let release = STREAMING_REQUESTS
            .iter()
            .find(|(path, _)| *path == req.uri().path())
            .map_or(Release::WithCall, |(_, r)| *r);
        // Kept only where a message's share outlives its arrival.
        let kept = (release != Release::OnArrival).then(MessageReservations::default);
        if let (Release::ByHandler, Some(kept)) = (release, &kept) {
            req.extensions_mut().insert(kept.clone());
        }
        let close = kept.clone().filter(|_| release == Release::WithCall);
        let share = close.as_ref().map(MessageReservations::share);
        let budget = self.budget.clone();
        let req = req.map(|inner| Body::new(BudgetedBody::new(inner, budget, kept)));
        Answer {
            inner: Box::pin(SHARE.scope(share, self.inner.call(req))),
            close,
        }
    }
}

/// The answer of a call under the layer: the inner service's, run with
/// the call's share ([`current_share`]); once it is ready, a call whose
/// messages' shares last as long as the call keeps no more of them.
pub struct Answer<F> {
    inner: Pin<Box<TaskLocalFuture<Option<BufferShare>, F>>>,
    close: Option<MessageReservations>,
}

impl<F: Future> Future for Answer<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let out = std::task::ready!(self.inner.as_mut().poll(cx));
        if let Some(kept) = self.close.take() {
            kept.close();
        }
        Poll::Ready(out)
    }
}

/// Where the body stands in its gRPC framing.
#[derive(Debug)]
enum Framing {
    /// Reading a frame header: the bytes of it read so far.
    Header {
        buf: [u8; HEADER_BYTES],
        have: usize,
    },
    /// Inside a message: bytes of it still to come, and its reservation.
    Message {
        left: usize,
        held: Option<OwnedSemaphorePermit>,
    },
}

/// A request body that reserves each message's length from the budget as
/// its header passes, and, once the message has passed, gives it back or
/// keeps it in `kept` (see [`Release`]).
struct BudgetedBody {
    inner: Body,
    budget: RequestBudget,
    framing: Framing,
    failed: bool,
    /// Where the reservations of messages that arrived whole go; `None`:
    /// given back at once.
    kept: Option<MessageReservations>,
}

impl BudgetedBody {
    fn new(inner: Body, budget: RequestBudget, kept: Option<MessageReservations>) -> Self {
        BudgetedBody {
            inner,
            budget,
            framing: Framing::Header {
                buf: [0; HEADER_BYTES],
                have: 0,
            },
            failed: false,
            kept,
        }
    }

    /// A message has arrived whole: tonic decodes it now. Its reservation
    /// goes back, or into `kept`.
    fn arrived(&self, held: Option<OwnedSemaphorePermit>) {
        if let Some(kept) = &self.kept {
            kept.keep(held);
        }
    }

    /// Follows the framing over one chunk of data.
    fn track(&mut self, data: &Bytes) -> Result<(), Status> {
        let mut rest = data.clone();
        while rest.has_remaining() {
            match &mut self.framing {
                Framing::Header { buf, have } => {
                    let take = (HEADER_BYTES - *have).min(rest.remaining());
                    rest.copy_to_slice(&mut buf[*have..*have + take]);
                    *have += take;
                    if *have == HEADER_BYTES {
                        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                        let held = self.budget.reserve(len)?;
                        if len == 0 {
                            self.arrived(held);
                            self.framing = Framing::Header {
                                buf: [0; HEADER_BYTES],
                                have: 0,
                            };
                        } else {
                            self.framing = Framing::Message { left: len, held };
                        }
                    }
                }
                Framing::Message { left, held } => {
                    let take = (*left).min(rest.remaining());
                    rest.advance(take);
                    *left -= take;
                    if *left == 0 {
                        let held = held.take();
                        self.framing = Framing::Header {
                            buf: [0; HEADER_BYTES],
                            have: 0,
                        };
                        self.arrived(held);
                    }
                }
            }
        }
        Ok(())
    }
}

impl HttpBody for BudgetedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            if let Err(status) = self.track(data) {
                self.failed = true;
                return Poll::Ready(Some(Err(status)));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(len: u32) -> Vec<u8> {
        let mut h = vec![0u8];
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    fn body(budget: &RequestBudget) -> BudgetedBody {
        BudgetedBody::new(Body::empty(), budget.clone(), None)
    }

    /// A message's length is held from its header until its last byte,
    /// whatever the chunking; headers split across chunks are read whole.
    #[test]
    fn a_message_is_held_from_its_header_to_its_last_byte() {
        let budget = RequestBudget::new(1000, 10_000);
        let mut b = body(&budget);
        let mut first = header(600);
        first.truncate(3);
        b.track(&Bytes::from(first)).unwrap();
        assert_eq!(budget.available(), 1000, "half a header reserves nothing");
        let mut rest = header(600)[3..].to_vec();
        rest.extend_from_slice(&[7; 100]);
        b.track(&Bytes::from(rest)).unwrap();
        assert_eq!(budget.available(), 400);
        // Another call's message that does not fit is refused.
        let mut other = body(&budget);
        let err = other.track(&Bytes::from(header(500))).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        // The rest of the first message, then the next message's header
        // in the same chunk.
        let mut tail = vec![7; 500];
        tail.extend_from_slice(&header(300));
        b.track(&Bytes::from(tail)).unwrap();
        assert_eq!(budget.available(), 700);
        drop(b);
        assert_eq!(
            budget.available(),
            1000,
            "a call that ends gives back what it held"
        );
    }

    /// Empty messages and messages over the message limit reserve nothing
    /// (tonic refuses the latter itself).
    #[test]
    fn empty_and_oversized_messages_reserve_nothing() {
        let budget = RequestBudget::new(1000, 2000);
        let mut b = body(&budget);
        let mut chunk = header(0);
        chunk.extend_from_slice(&header(5000));
        b.track(&Bytes::from(chunk)).unwrap();
        assert_eq!(budget.available(), 1000);
    }
}
