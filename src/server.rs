//! Builds and runs the gRPC server: the six `agq.v1` services behind the
//! auth interceptor, `grpc.health.v1` and server reflection (v1 and
//! v1alpha, both unauthenticated), and the HTTP metrics endpoint.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::watch};
use tonic::transport::{
    server::TcpIncoming, Certificate, Identity as TlsIdentity, Server, ServerTlsConfig,
};

use crate::{
    auth::Authenticator,
    config::{EngineConfig, SyncMode},
    core::SharedEngine,
    error::{Error, Result},
    metrics::Metrics,
    pb::{
        action_service_server::ActionServiceServer, job_service_server::JobServiceServer,
        plan_service_server::PlanServiceServer, queue_service_server::QueueServiceServer,
        schedule_service_server::ScheduleServiceServer, worker_service_server::WorkerServiceServer,
        FILE_DESCRIPTOR_SET,
    },
    service::{ActionApi, JobApi, PlanApi, QueueApi, ScheduleApi, WorkerApi},
    store::sqlite::SqliteEngine,
};

/// Health service name that is SERVING while the process runs, until
/// shutdown begins: for liveness probes. The server ("") and the `agq.v1`
/// services also turn NOT_SERVING while the store cannot commit (for
/// readiness); restarting would not free the disk.
pub const LIVENESS_SERVICE: &str = "liveness";

/// Largest gRPC message the server accepts, in bytes (16 MiB).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Most streams (calls) one HTTP/2 connection may have open at once, as
/// the server announces in its SETTINGS: 256. A worker process needs 3
/// (heartbeat, leases, reports) and a client a few; without a bound one
/// connection could open any number of calls, each buffering a message of
/// up to [`MAX_MESSAGE_BYTES`]. A client that opens more waits for one
/// to finish (HTTP/2 flow control), or gets `REFUSED_STREAM`.
pub const MAX_CONCURRENT_STREAMS: u32 = 256;

/// PEM files of the server's TLS setup.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: std::path::PathBuf,
    /// Private key.
    pub key: std::path::PathBuf,
    /// CA that client certificates must chain to (mutual TLS).
    pub client_ca: Option<std::path::PathBuf>,
}

/// Everything [`run`] needs besides the listeners.
pub struct ServerOptions {
    /// The store: SQLite at `db`, or PostgreSQL.
    pub store: crate::config::Store,
    /// CA certificates (PEM) trusted for TLS to PostgreSQL besides the
    /// system's.
    pub store_ca_file: Option<std::path::PathBuf>,
    /// SQLite database file (with [`crate::config::Store::Sqlite`]).
    pub db: std::path::PathBuf,
    /// SQLite `synchronous` mode of the database.
    pub sqlite_synchronous: SyncMode,
    /// Core settings.
    pub engine: EngineConfig,
    /// Tokens; empty means auth off.
    pub auth: Authenticator,
    /// TLS, if enabled.
    pub tls: Option<TlsFiles>,
    /// How long in-flight calls may run after shutdown begins; streams a
    /// client keeps open past it (a health Watch, say) are cut.
    pub shutdown_grace: Duration,
    /// Bytes of request messages held at once over all calls, from their arrival until handled
    /// ([`crate::request_budget`]; default
    /// [`crate::request_budget::DEFAULT_REQUEST_BUFFER_BYTES`]).
    pub request_buffer_bytes: usize,
}

/// Default of [`ServerOptions::shutdown_grace`]: 10 seconds.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Runs AGQ on `listener` (and `GET /metrics` on `metrics_listener`, the
/// web console on `console_listener`, [`crate::console`]) until
/// `shutdown` resolves. On shutdown, health turns NOT_SERVING, open streams
/// end, in-flight calls finish, then the database is closed cleanly.
/// `ready` is called with the engine once the database is open and health
/// reports SERVING.
///
/// Errors: storage errors opening the database, TLS files that cannot be
/// read, transport errors.
pub async fn run(
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    console_listener: Option<TcpListener>,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()> + Send,
    ready: impl FnOnce(&SharedEngine),
) -> Result<()> {
    let metrics = Arc::new(Metrics::new());
    let engine: SharedEngine = match &opts.store {
        crate::config::Store::Sqlite => {
            SqliteEngine::open(
                &opts.db,
                opts.sqlite_synchronous,
                opts.engine.clone(),
                metrics,
            )
            .await?
        }
        crate::config::Store::Postgres(url) => {
            crate::store::postgres::PgEngine::open(
                url,
                opts.store_ca_file.as_deref(),
                opts.engine.clone(),
                metrics,
            )
            .await?
        }
    };
    let (stop_tx, stop_rx) = watch::channel(false);

    // Health and reflection need no token: their messages stay out of the
    // request buffer, under a small limit of their own.
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let health_service = health_service
        .max_decoding_message_size(crate::request_budget::UNBUDGETED_MAX_MESSAGE_BYTES);
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| Error::Internal(format!("reflection: {e}")))?
        .max_decoding_message_size(crate::request_budget::UNBUDGETED_MAX_MESSAGE_BYTES);
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| Error::Internal(format!("reflection: {e}")))?
        .max_decoding_message_size(crate::request_budget::UNBUDGETED_MAX_MESSAGE_BYTES);

    // The worker service's calls need a worker, client or admin token
    // depending on the call (refused by its gate when the call starts;
    // each handler checks the worker id); every call of the other
    // services is a client call, refused to a worker token before its
    // request is read.
    let (auth, metrics) = (opts.auth.clone(), engine.metrics().clone());
    let intercept = move |req| {
        auth.intercept(req)
            .inspect_err(|st| metrics.auth_refused(st))
    };
    let (auth, metrics) = (opts.auth.clone(), engine.metrics().clone());
    let intercept_client = move |req| {
        auth.intercept_client_call(req)
            .inspect_err(|st| metrics.auth_refused(st))
    };
    macro_rules! svc {
        ($server:ident, $api:expr) => {
            svc!($server, $api, intercept_client)
        };
        ($server:ident, $api:expr, $intercept:ident) => {
            tonic::service::interceptor::InterceptedService::new(
                $server::new($api)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
                $intercept.clone(),
            )
        };
    }
    let plan = svc!(
        PlanServiceServer,
        PlanApi {
            engine: engine.clone()
        }
    );
    let action = svc!(
        ActionServiceServer,
        ActionApi {
            engine: engine.clone(),
            shutdown: stop_rx.clone()
        }
    );
    let job = svc!(
        JobServiceServer,
        JobApi {
            engine: engine.clone()
        }
    );
    // Inside its interceptor, a gate refuses a call the token's role can
    // never make before its message is read (the handlers check the
    // worker id once it has arrived).
    let worker = tonic::service::interceptor::InterceptedService::new(
        crate::auth::WorkerCallGate::new(
            WorkerServiceServer::new(WorkerApi {
                engine: engine.clone(),
                shutdown: stop_rx.clone(),
                lease_streams: Default::default(),
            })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
            engine.metrics().clone(),
        ),
        intercept.clone(),
    );
    let queue = svc!(
        QueueServiceServer,
        QueueApi {
            engine: engine.clone()
        }
    );

    let schedule = svc!(
        ScheduleServiceServer,
        ScheduleApi {
            engine: engine.clone()
        }
    );

    set_health(&health_reporter, true).await;
    health_reporter
        .set_service_status(LIVENESS_SERVICE, tonic_health::ServingStatus::Serving)
        .await;

    // Health follows the store: NOT_SERVING while it cannot commit (disk
    // full, I/O error), SERVING again once a commit succeeds.
    let store_health_task = {
        let reporter = health_reporter.clone();
        let mut up = engine.store_health();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                let ok = *up.borrow_and_update();
                set_health(&reporter, ok).await;
                tokio::select! {
                    r = up.changed() => if r.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        })
    };

    let mut builder = Server::builder()
        .max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)));
    if let Some(tls) = &opts.tls {
        let read = |p: &std::path::Path| {
            std::fs::read(p)
                .map_err(|e| Error::Internal(format!("cannot read {}: {e}", p.display())))
        };
        let mut cfg = ServerTlsConfig::new()
            .identity(TlsIdentity::from_pem(read(&tls.cert)?, read(&tls.key)?));
        if let Some(ca) = &tls.client_ca {
            cfg = cfg.client_ca_root(Certificate::from_pem(read(ca)?));
        }
        builder = builder
            .tls_config(cfg)
            .map_err(|e| Error::Internal(format!("TLS: {e}")))?;
    }

    let metrics_task = metrics_listener.map(|l| {
        let engine = engine.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(crate::metrics::serve_http(
            l,
            move || {
                let engine = engine.clone();
                async move {
                    engine
                        .metrics_text()
                        .await
                        .unwrap_or_else(|e| format!("# error: {e}\n"))
                }
            },
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        ))
    });

    let console_task = console_listener.map(|l| {
        let mut stop = stop_rx.clone();
        tokio::spawn(crate::console::serve(
            l,
            engine.clone(),
            opts.auth.clone(),
            stop_rx.clone(),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        ))
    });

    ready(&engine);
    let reporter = health_reporter.clone();
    let health_task = store_health_task;
    let (began_tx, began_rx) = tokio::sync::oneshot::channel::<()>();
    let graceful = async move {
        shutdown.await;
        tracing::info!("shutting down: health NOT_SERVING, ending streams, finishing calls");
        health_task.abort();
        set_health(&reporter, false).await;
        reporter
            .set_service_status(LIVENESS_SERVICE, tonic_health::ServingStatus::NotServing)
            .await;
        let _ = stop_tx.send(true);
        let _ = began_tx.send(());
    };
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let budget =
        crate::request_budget::RequestBudget::new(opts.request_buffer_bytes, MAX_MESSAGE_BYTES);
    let serve = builder
        .layer(crate::request_budget::RequestBudgetLayer::new(budget))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(plan)
        .add_service(action)
        .add_service(job)
        .add_service(worker)
        .add_service(queue)
        .add_service(schedule)
        .serve_with_incoming_shutdown(incoming, graceful);
    // Graceful shutdown waits for every open call; a client that keeps a
    // stream open must not hold the database open forever.
    let grace = opts.shutdown_grace;
    let deadline = async move {
        if began_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let served = tokio::select! {
        r = serve => r,
        _ = deadline => {
            tracing::warn!(grace_secs = grace.as_secs_f64(), "calls still open after the shutdown grace; cutting them");
            Ok(())
        }
    };
    // The HTTP listeners began their graceful shutdown with the gRPC
    // server's; a connection that never finishes its request (a client
    // that sent half a header) must not keep the database open either.
    if let Some(mut t) = metrics_task {
        if tokio::time::timeout(grace, &mut t).await.is_err() {
            tracing::warn!("metrics connections still open after the shutdown grace; cutting them");
            t.abort();
        }
    }
    if let Some(mut t) = console_task {
        match tokio::time::timeout(grace, &mut t).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "console listener ended with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "console task failed"),
            Ok(Ok(Ok(()))) => {}
            Err(_) => {
                tracing::warn!(
                    "console connections still open after the shutdown grace; cutting them"
                );
                t.abort();
            }
        }
    }
    engine.close().await;
    tracing::info!("database closed");
    served.map_err(|e| Error::Internal(format!("transport: {e}")))
}

/// Sets the health of the server ("") and of every `agq.v1` service.
async fn set_health(reporter: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter.set_service_status("", status).await;
    for name in [
        <PlanServiceServer<PlanApi> as tonic::server::NamedService>::NAME,
        <ActionServiceServer<ActionApi> as tonic::server::NamedService>::NAME,
        <JobServiceServer<JobApi> as tonic::server::NamedService>::NAME,
        <WorkerServiceServer<WorkerApi> as tonic::server::NamedService>::NAME,
        <QueueServiceServer<QueueApi> as tonic::server::NamedService>::NAME,
        <ScheduleServiceServer<ScheduleApi> as tonic::server::NamedService>::NAME,
    ] {
        reporter.set_service_status(name, status).await;
    }
}
