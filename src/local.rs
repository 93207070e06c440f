//! An AGQ server started inside the calling process: the one way tests,
//! `agq demo` and the benchmark start [`crate::server::run`] in-process.
//!
//! [`LocalServer::start`] binds `127.0.0.1:0` (or the address given),
//! optionally a `GET /metrics` listener on `127.0.0.1:0`, spawns
//! [`crate::server::run`] with a oneshot shutdown, and returns once the
//! server is ready (its database is open and health reports SERVING) or has
//! failed. [`LocalServer::stop`] shuts it down gracefully and returns how
//! `run` ended. Dropping a [`LocalServer`] without stopping it also begins a
//! graceful shutdown, without waiting for it.

use std::net::SocketAddr;

use tokio::{runtime::Handle, sync::oneshot, task::JoinHandle};

use crate::{
    core::SharedEngine,
    error::{Error, Result},
    server::{self, ServerOptions},
};

/// A running in-process AGQ server.
pub struct LocalServer {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    console_addr: Option<SocketAddr>,
    engine: SharedEngine,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<()>>>,
}

impl LocalServer {
    /// Starts AGQ with `opts` on the current tokio runtime, listening on
    /// `listen` (`127.0.0.1:0` when `None`) and, when `with_metrics`, serving
    /// `GET /metrics` on `127.0.0.1:0`. Returns once the server is ready.
    ///
    /// Errors: [`Error::Internal`] when an address cannot be bound or the
    /// server stopped before it was ready; the error `run` returned when it
    /// failed to start (the database cannot be opened, say).
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub async fn start(
        opts: ServerOptions,
        listen: Option<SocketAddr>,
        with_metrics: bool,
    ) -> Result<LocalServer> {
        Self::start_on(&Handle::current(), opts, listen, with_metrics).await
    }

    /// Like [`LocalServer::start`], with the server's tasks and sockets on
    /// `runtime` instead of the current one: the benchmark runs the server
    /// on its own runtime so that its CPU time can be told apart.
    ///
    /// Errors: as [`LocalServer::start`].
    pub async fn start_on(
        runtime: &Handle,
        opts: ServerOptions,
        listen: Option<SocketAddr>,
        with_metrics: bool,
    ) -> Result<LocalServer> {
        Self::start_with(runtime, opts, listen, with_metrics, false).await
    }

    /// Like [`LocalServer::start_on`], and when `with_console` also serving
    /// the web console ([`crate::console`]) on `127.0.0.1:0`
    /// ([`LocalServer::console_url`]).
    ///
    /// Errors: as [`LocalServer::start`].
    pub async fn start_with(
        runtime: &Handle,
        opts: ServerOptions,
        listen: Option<SocketAddr>,
        with_metrics: bool,
        with_console: bool,
    ) -> Result<LocalServer> {
        let listen = listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        // Bound with std here, registered with the server's runtime in its task.
        let listener = bind(listen)?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Internal(format!("local address of {listen}: {e}")))?;
        let metrics_listener = if with_metrics {
            Some(bind(SocketAddr::from(([127, 0, 0, 1], 0)))?)
        } else {
            None
        };
        let metrics_addr = match &metrics_listener {
            Some(l) => Some(
                l.local_addr()
                    .map_err(|e| Error::Internal(format!("local address of metrics: {e}")))?,
            ),
            None => None,
        };
        let console_listener = if with_console {
            Some(bind(SocketAddr::from(([127, 0, 0, 1], 0)))?)
        } else {
            None
        };
        let console_addr = match &console_listener {
            Some(l) => Some(
                l.local_addr()
                    .map_err(|e| Error::Internal(format!("local address of the console: {e}")))?,
            ),
            None => None,
        };
        let (stop, stop_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = oneshot::channel::<SharedEngine>();
        let task = runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener)
                .map_err(|e| Error::Internal(format!("listener: {e}")))?;
            let metrics_listener = metrics_listener
                .map(tokio::net::TcpListener::from_std)
                .transpose()
                .map_err(|e| Error::Internal(format!("metrics listener: {e}")))?;
            let console_listener = console_listener
                .map(tokio::net::TcpListener::from_std)
                .transpose()
                .map_err(|e| Error::Internal(format!("console listener: {e}")))?;
            server::run(
                listener,
                metrics_listener,
                console_listener,
                opts,
                async move {
                    // A dropped sender (the LocalServer was dropped) stops it too.
                    let _ = stop_rx.await;
                },
                move |engine| {
                    let _ = ready_tx.send(engine.clone());
                },
            )
            .await
        });
        let Ok(engine) = ready_rx.await else {
            // `run` returned (or panicked) before it was ready: say why.
            return Err(match task.await {
                Ok(Err(e)) => e,
                Ok(Ok(())) => Error::Internal("the server stopped before it was ready".into()),
                Err(e) => Error::Internal(format!("the server task failed: {e}")),
            });
        };
        Ok(LocalServer {
            addr,
            metrics_addr,
            console_addr,
            engine,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The gRPC address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address of `GET /metrics`, when started with it.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// `http://ADDR` of the web console, when started with it.
    pub fn console_url(&self) -> Option<String> {
        self.console_addr.map(|a| format!("http://{a}"))
    }

    /// `http://ADDR`, for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The engine behind the services, as `run`'s `ready` callback gave it:
    /// for in-process observers such as the benchmark's commit counters.
    pub fn engine(&self) -> &SharedEngine {
        &self.engine
    }

    /// Waits until the server stops without being asked to (it failed),
    /// and returns how `run` ended; never resolves while it serves.
    /// Cancel-safe, so it can be one branch of a `tokio::select!`. After it
    /// has returned, [`LocalServer::stop`] returns `Ok(())`.
    pub async fn wait(&mut self) -> Result<()> {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let ended = join_result(task.await);
        self.task = None;
        ended
    }

    /// Stops the server gracefully: health turns NOT_SERVING, streams end,
    /// in-flight calls finish (within the options' shutdown grace), the
    /// database is closed. Returns once `run` returned, with its result.
    ///
    /// Errors: what `run` returned; [`Error::Internal`] when its task panicked.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.task.take() {
            Some(task) => join_result(task.await),
            None => Ok(()),
        }
    }
}

/// A nonblocking std listener on `addr`.
fn bind(addr: SocketAddr) -> Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)
        .map_err(|e| Error::Internal(format!("cannot listen on {addr}: {e}")))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::Internal(format!("listener on {addr}: {e}")))?;
    Ok(l)
}

/// How the server task ended, a panic included.
fn join_result(r: std::result::Result<Result<()>, tokio::task::JoinError>) -> Result<()> {
    r.unwrap_or_else(|e| Err(Error::Internal(format!("the server task failed: {e}"))))
}
