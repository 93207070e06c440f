//! The client side of a connection to AGQ: one [`Channel`] (plain or TLS)
//! shared by a client of each `agq.v1` service, every call carrying the
//! bearer token through [`BearerAuth`].

use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{interceptor::InterceptedService, Interceptor},
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
    Request, Status,
};

use super::{error::chain, CliError, ClientOptions};
use crate::pb::{
    action_service_client::ActionServiceClient, job_service_client::JobServiceClient,
    plan_service_client::PlanServiceClient, queue_service_client::QueueServiceClient,
    schedule_service_client::ScheduleServiceClient, worker_service_client::WorkerServiceClient,
};

/// Largest response the client accepts, in bytes (64 MiB): a job's task
/// results can be large.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// Largest request the client sends, in bytes (16 MiB, the server's limit).
pub const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// A tonic interceptor that adds `authorization: Bearer <token>` to every
/// call when a token is set.
#[derive(Clone, Default)]
pub struct BearerAuth {
    header: Option<MetadataValue<Ascii>>,
}

impl std::fmt::Debug for BearerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("BearerAuth")
            .field("token", &self.header.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl BearerAuth {
    /// An interceptor sending `token`, or nothing when `None`.
    ///
    /// # Errors
    ///
    /// [`CliError::Input`] when the token holds characters a header cannot carry.
    pub fn new(token: Option<&str>) -> Result<Self, CliError> {
        let header = match token {
            None => None,
            Some(t) => Some(format!("Bearer {}", t.trim()).parse().map_err(|_| {
                CliError::Input("the token holds characters an HTTP header cannot carry".into())
            })?),
        };
        Ok(BearerAuth { header })
    }
}

impl Interceptor for BearerAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// The channel type every service client uses.
pub type AuthChannel = InterceptedService<Channel, BearerAuth>;

/// A client of each `agq.v1` service over one connection. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Clients {
    /// PlanService.
    pub plan: PlanServiceClient<AuthChannel>,
    /// ActionService.
    pub action: ActionServiceClient<AuthChannel>,
    /// JobService.
    pub job: JobServiceClient<AuthChannel>,
    /// WorkerService.
    pub worker: WorkerServiceClient<AuthChannel>,
    /// QueueService.
    pub queue: QueueServiceClient<AuthChannel>,
    /// ScheduleService.
    pub schedule: ScheduleServiceClient<AuthChannel>,
}

macro_rules! client {
    ($ty:ident, $chan:expr, $auth:expr) => {
        $ty::with_interceptor($chan.clone(), $auth.clone())
            .max_decoding_message_size(MAX_RESPONSE_BYTES)
            .max_encoding_message_size(MAX_REQUEST_BYTES)
    };
}

impl Clients {
    /// Connects to `opts.server` (TLS when the URL is https:// or --tls-ca is
    /// set) and builds the service clients, sending the token `opts`
    /// selects (`token::resolve`, which warns on stderr about
    /// `--token` on the command line). The connection is made now, so an
    /// unreachable server is reported once, clearly.
    ///
    /// # Errors
    ///
    /// [`CliError::Connect`] when the URL is invalid, a TLS file cannot be
    /// read or the server cannot be reached; [`CliError::Input`] for a bad
    /// token, an unreadable or empty token file, or two token sources.
    pub async fn connect(opts: &ClientOptions) -> Result<Self, CliError> {
        let token = super::token::resolve(opts)?;
        let auth = BearerAuth::new(token.as_deref())?;
        let channel = endpoint(opts)?
            .connect()
            .await
            .map_err(|e| CliError::Connect {
                server: opts.server.clone(),
                reason: chain(&e),
            })?;
        Ok(Clients {
            plan: client!(PlanServiceClient, channel, auth),
            action: client!(ActionServiceClient, channel, auth),
            job: client!(JobServiceClient, channel, auth),
            worker: client!(WorkerServiceClient, channel, auth),
            queue: client!(QueueServiceClient, channel, auth),
            schedule: client!(ScheduleServiceClient, channel, auth),
        })
    }
}

/// The endpoint `opts` describes: URL, timeouts, keep-alive and TLS.
///
/// # Errors
///
/// [`CliError::Connect`] for a malformed URL, https:// without a CA, or
/// TLS files that cannot be read.
pub fn endpoint(opts: &ClientOptions) -> Result<Endpoint, CliError> {
    let fail = |reason: String| CliError::Connect {
        server: opts.server.clone(),
        reason,
    };
    let https = opts.server.starts_with("https://");
    if !https && !opts.server.starts_with("http://") {
        return Err(fail(
            "the server URL must start with http:// or https:// (e.g. http://127.0.0.1:6380)"
                .into(),
        ));
    }
    let mut ep = Endpoint::from_shared(opts.server.clone())
        .map_err(|e| fail(format!("invalid URL: {}", chain(&e))))?
        .connect_timeout(std::time::Duration::from_secs(10))
        .timeout(opts.timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(std::time::Duration::from_secs(30))
        .keep_alive_timeout(std::time::Duration::from_secs(20));
    let wants_tls = https
        || opts.tls_ca.is_some()
        || opts.tls_client_cert.is_some()
        || opts.tls_domain.is_some();
    if wants_tls {
        if !https {
            return Err(fail("TLS flags need an https:// server URL".into()));
        }
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| fail(format!("cannot read {}: {e}", p.display())))
        };
        let mut tls = ClientTlsConfig::new();
        match &opts.tls_ca {
            Some(ca) => tls = tls.ca_certificate(Certificate::from_pem(read(ca)?)),
            None => {
                return Err(fail(
                    "https:// needs --tls-ca (AGQ_TLS_CA): the PEM of the CA that signed the \
                     server's certificate"
                        .into(),
                ))
            }
        }
        match (&opts.tls_client_cert, &opts.tls_client_key) {
            (Some(cert), Some(key)) => {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            (None, None) => {}
            _ => {
                return Err(fail(
                    "--tls-client-cert and --tls-client-key go together".into(),
                ))
            }
        }
        if let Some(domain) = &opts.tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        ep = ep
            .tls_config(tls)
            .map_err(|e| fail(format!("TLS: {}", chain(&e))))?;
    }
    Ok(ep)
}
