//! The gRPC channel to AGQ: endpoint, TLS, keep-alives and the
//! `authorization: Bearer <token>` header on every call.

use std::{path::PathBuf, time::Duration};

use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{interceptor::InterceptedService, Interceptor},
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
    Request, Status,
};

use super::error::WorkerError;
use crate::pb::worker_service_client::WorkerServiceClient;

/// TLS settings of the connection (tonic's rustls client).
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    /// PEM file with the CA certificate(s) that sign the server's certificate.
    pub ca: Option<PathBuf>,
    /// PEM file with the client certificate, for mutual TLS (with `key`).
    pub cert: Option<PathBuf>,
    /// PEM file with the client's private key, for mutual TLS (with `cert`).
    pub key: Option<PathBuf>,
    /// Name to verify the server certificate against, when it differs from
    /// the host of the server URL.
    pub domain: Option<String>,
}

impl TlsOptions {
    /// True when any TLS option is set.
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some() || self.domain.is_some()
    }
}

/// Adds `authorization: Bearer <token>` to every request when a token is set.
#[derive(Debug, Clone, Default)]
pub struct AuthInterceptor {
    header: Option<MetadataValue<Ascii>>,
}

impl AuthInterceptor {
    /// An interceptor sending `token`, or nothing when `None`.
    ///
    /// # Errors
    ///
    /// [`WorkerError::Config`] when the token holds characters that cannot
    /// go into an HTTP header.
    pub fn new(token: Option<&str>) -> Result<Self, WorkerError> {
        let header = token
            .map(|t| {
                format!("Bearer {t}")
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| {
                        WorkerError::Config(
                            "the token holds characters not allowed in a header".into(),
                        )
                    })
            })
            .transpose()?;
        Ok(AuthInterceptor { header })
    }
}

impl Interceptor for AuthInterceptor {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// The worker's client of `agq.v1.WorkerService`.
pub type WorkerClient = WorkerServiceClient<InterceptedService<Channel, AuthInterceptor>>;

/// Builds a lazily connecting channel to `server` (an `http://` or
/// `https://` URL): it connects on first use and reconnects on its own after
/// a loss, so one channel serves every reconnect of the worker. HTTP/2
/// keep-alives notice a dead server on an idle stream.
///
/// # Errors
///
/// [`WorkerError::Config`] for a bad URL, unreadable TLS files, a client
/// certificate without key (or the reverse), or `https` without `tls_ca`.
pub async fn channel(server: &str, tls: &TlsOptions) -> Result<Channel, WorkerError> {
    let mut endpoint = Endpoint::from_shared(server.to_owned())
        .map_err(|e| WorkerError::Config(format!("bad --server {server:?}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .tcp_keepalive(Some(Duration::from_secs(30)))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    let https = server.starts_with("https://");
    if https || tls.is_set() {
        if !https {
            return Err(WorkerError::Config(format!(
                "TLS options given but --server {server:?} is not an https:// URL"
            )));
        }
        let mut cfg = ClientTlsConfig::new();
        match &tls.ca {
            Some(ca) => cfg = cfg.ca_certificate(Certificate::from_pem(read(ca).await?)),
            None => {
                return Err(WorkerError::Config(
                    "an https:// server needs --tls-ca (the CA that signs its certificate)".into(),
                ))
            }
        }
        match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => {
                cfg = cfg.identity(Identity::from_pem(read(cert).await?, read(key).await?));
            }
            (None, None) => {}
            _ => {
                return Err(WorkerError::Config(
                    "--tls-cert and --tls-key go together".into(),
                ))
            }
        }
        if let Some(domain) = &tls.domain {
            cfg = cfg.domain_name(domain.clone());
        }
        endpoint = endpoint
            .tls_config(cfg)
            .map_err(|e| WorkerError::Config(format!("TLS configuration: {e}")))?;
    }
    Ok(endpoint.connect_lazy())
}

/// Reads a PEM file.
async fn read(path: &PathBuf) -> Result<Vec<u8>, WorkerError> {
    tokio::fs::read(path)
        .await
        .map_err(|e| WorkerError::Config(format!("cannot read {}: {e}", path.display())))
}

/// A [`WorkerClient`] on `channel` that sends `token` with every call and
/// takes messages up to the server's limit
/// ([`crate::server::MAX_MESSAGE_BYTES`], 16 MiB): a lease carries the
/// job's input and its plan, together up to about 8 MiB, past gRPC's
/// customary 4 MiB.
///
/// # Errors
///
/// [`WorkerError::Config`] when the token is not a valid header value.
pub fn worker_client(channel: Channel, token: Option<&str>) -> Result<WorkerClient, WorkerError> {
    Ok(
        WorkerServiceClient::with_interceptor(channel, AuthInterceptor::new(token)?)
            .max_decoding_message_size(crate::server::MAX_MESSAGE_BYTES),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interceptor_adds_bearer_token() {
        let mut i = AuthInterceptor::new(Some("s3cret")).unwrap();
        let req = i.call(Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer s3cret"
        );
        let mut none = AuthInterceptor::new(None).unwrap();
        assert!(none.call(Request::new(())).unwrap().metadata().is_empty());
        assert!(AuthInterceptor::new(Some("bad\ntoken")).is_err());
    }

    #[tokio::test]
    async fn https_needs_a_ca() {
        let err = channel("https://example.com:6380", &TlsOptions::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("--tls-ca"), "{err}");
        let tls = TlsOptions {
            domain: Some("x".into()),
            ..Default::default()
        };
        assert!(channel("http://127.0.0.1:1", &tls).await.is_err());
        assert!(channel("http://127.0.0.1:1", &TlsOptions::default())
            .await
            .is_ok());
    }
}
