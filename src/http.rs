//! The HTTP/1 server loop of the console and the metrics endpoint, with
//! the limits a listener reachable by untrusted callers needs:
//!
//! - a request's head must arrive within [`HEADER_READ_TIMEOUT`] (a
//!   caller that sends it a byte at a time, or never finishes it, is
//!   disconnected instead of holding its connection for good);
//! - at most [`MAX_CONNECTIONS`] connections are served at once per
//!   listener; further ones wait in the kernel's backlog, unaccepted,
//!   holding no descriptor of the process;
//! - an accept that fails (out of descriptors) is retried after a pause
//!   ([`ACCEPT_RETRY`]), not at once in a loop that burns a core and floods
//!   the log.
//!
//! On shutdown the loop stops accepting, asks every connection to close
//! once its current request is answered, and returns when all are closed;
//! dropping its future before that aborts the connections.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body::Body;
use hyper::{body::Incoming, service::Service, Request, Response};
use tokio::{net::TcpListener, sync::Semaphore};

/// How long a request's head (request line and headers) may take to
/// arrive, from the moment the server starts reading it.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections one listener serves at once.
pub const MAX_CONNECTIONS: usize = 256;

/// The pause after a failed accept.
pub const ACCEPT_RETRY: Duration = Duration::from_millis(250);

/// The limits of one listener.
#[derive(Debug, Clone, Copy)]
struct Limits {
    header_read_timeout: Duration,
    max_connections: usize,
}

/// Serves HTTP/1 on `listener` with `service` until `shutdown` resolves,
/// then closes the connections gracefully and returns once they are
/// closed. `what` names the listener in logs ("console", "metrics").
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    what: &'static str,
) where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limits = Limits {
        header_read_timeout: HEADER_READ_TIMEOUT,
        max_connections: MAX_CONNECTIONS,
    };
    serve_with(listener, service, shutdown, what, limits).await
}

async fn serve_with<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    what: &'static str,
    limits: Limits,
) where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    // The connections' tasks: dropping this future (a caller that gives up
    // waiting for the shutdown) aborts them too.
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, listener = what, "accept failed; retrying shortly");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
        };
        let service = service.clone();
        let mut closing = closing_rx.clone();
        conns.spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(io, service);
            tokio::pin!(conn);
            let closed = tokio::select! {
                _ = conn.as_mut() => true,
                _ = async { let _ = closing.wait_for(|c| *c).await; } => false,
            };
            if !closed {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
            drop(slot);
        });
    }
    let _ = closing_tx.send(true);
    while conns.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use http_body_util::Full;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server answering "ok" with the given limits, its address, and
    /// the sender that stops it.
    async fn server(
        limits: Limits,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = hyper::service::service_fn(|_req: Request<Incoming>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve_with(
            listener,
            svc,
            async {
                let _ = stop_rx.await;
            },
            "test",
            limits,
        ));
        (addr, stop_tx, task)
    }

    /// Sends a whole request on a new connection and reads the answer.
    async fn get(addr: std::net::SocketAddr) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        let _ = c.read_to_string(&mut out).await;
        out
    }

    #[tokio::test]
    async fn a_request_head_that_never_ends_is_cut_and_the_slots_come_back() {
        let limits = Limits {
            header_read_timeout: Duration::from_millis(300),
            max_connections: 2,
        };
        let (addr, stop, task) = server(limits).await;
        // Two callers take both slots with heads they never finish.
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").await.unwrap();
            held.push(c);
        }
        let start = Instant::now();
        for mut c in held {
            let mut buf = Vec::new();
            // The server closes the connection (after a 408 or without an
            // answer): the read ends instead of waiting for good.
            let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut buf)).await;
            assert!(read.is_ok(), "a half-sent request head held its connection");
        }
        assert!(start.elapsed() < Duration::from_secs(10));
        // The slots are free again: a whole request is answered.
        let answer = tokio::time::timeout(Duration::from_secs(10), get(addr))
            .await
            .expect("answered once the held connections were cut");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the server stops")
            .unwrap();
    }

    #[tokio::test]
    async fn past_the_connection_limit_callers_wait_unaccepted() {
        let limits = Limits {
            header_read_timeout: Duration::from_secs(30),
            max_connections: 1,
        };
        let (addr, stop, task) = server(limits).await;
        // One caller holds the only slot with an open keep-alive connection.
        let mut first = tokio::net::TcpStream::connect(addr).await.unwrap();
        first
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let n = first.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        // A second caller is not served while the first holds the slot...
        let second = tokio::spawn(get(addr));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!second.is_finished(), "served past the connection limit");
        // ...and is once the first goes.
        drop(first);
        let answer = tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("served once the slot was free")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let _ = stop.send(());
        task.await.unwrap();
    }
}
