//! Authentication: bearer tokens from a TOML file, each with a role
//! (client, admin, or worker bound to one `worker_id` or to a pool of ids
//! sharing a `worker_id_prefix`), checked by a tonic
//! interceptor in constant time (`subtle`). Implements the specification's
//! `AUTH <key>` command as `authorization: Bearer <token>` metadata.
//! Tokens are never logged.

use std::{path::Path, sync::Arc};

use serde::Deserialize;
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

/// What a caller may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// Auth is off (loopback-only server): everything is allowed.
    Anonymous,
    /// Plans, actions, jobs, queue, read workers.
    Client,
    /// Everything, including any worker's calls.
    Admin,
    /// The worker RPCs of this one worker_id.
    Worker(String),
    /// The worker RPCs of every worker_id that starts with this prefix (a
    /// pool, e.g. the replicas of one Deployment named `agw-<pod>`).
    WorkerPool(String),
}

/// Role names of the auth file.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// See [`Identity::Client`].
    Client,
    /// See [`Identity::Admin`].
    Admin,
    /// See [`Identity::Worker`] and [`Identity::WorkerPool`]; needs
    /// `worker_id` or `worker_id_prefix`.
    Worker,
}

/// One entry of the auth file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// The bearer token (at least 16 bytes).
    pub token: String,
    /// Its role.
    pub role: Role,
    /// The worker a worker token is bound to.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// The pool a worker token is bound to: every worker id starting with
    /// this prefix (`[A-Za-z0-9_-]{1,63}`).
    #[serde(default)]
    pub worker_id_prefix: Option<String>,
}

/// The auth file: `[[tokens]]` entries.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthFile {
    /// Every token.
    pub tokens: Vec<TokenEntry>,
}

/// Errors loading the auth file.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The file could not be read.
    #[error("cannot read auth file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("auth file {path} is invalid: {why}")]
    Parse {
        /// The file.
        path: String,
        /// Why, with the line and column: never the text of the line,
        /// which may hold a token.
        why: String,
    },
    /// The file declares no token. Authentication is off only without
    /// `--auth-file`; a file that grants nothing is a mistake, never a
    /// way to trust every caller.
    #[error(
        "auth file {path} declares no token: add [[tokens]] entries, or run without \
         --auth-file (every caller trusted, loopback only)"
    )]
    Empty {
        /// The file.
        path: String,
    },
    /// An entry breaks a rule (token length, worker binding, a pool whose
    /// ids another worker token also covers).
    #[error("auth file {path}: token #{index}: {why}")]
    Entry {
        /// The file.
        path: String,
        /// 1-based entry number.
        index: usize,
        /// The rule broken.
        why: String,
    },
}

/// A TOML error of `text` as its message and position (`line L, column
/// C`), without the quoted source line `toml` adds to its `Display`.
fn parse_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim_end();
    match e.span() {
        Some(span) => {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|b| **b == b'\n').count() + 1;
            let column = before.iter().rev().take_while(|b| **b != b'\n').count() + 1;
            format!("{message} (line {line}, column {column})")
        }
        None => message.to_string(),
    }
}

/// The token table the interceptor checks against.
#[derive(Debug, Clone, Default)]
pub struct Authenticator {
    entries: Arc<Vec<(Vec<u8>, Identity)>>,
}

impl Authenticator {
    /// Loads and checks the auth file.
    ///
    /// Errors: [`AuthError`] naming the file and the problem (never the token).
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: p.clone(),
            source,
        })?;
        let file: AuthFile = toml::from_str(&text).map_err(|e| AuthError::Parse {
            path: p.clone(),
            why: parse_error(&text, &e),
        })?;
        Self::from_file(&p, file)
    }

    /// Builds the table from parsed entries.
    ///
    /// Errors: [`AuthError::Empty`] for no entry; [`AuthError::Entry`] for
    /// a short token, a worker token without exactly one valid
    /// `worker_id` or `worker_id_prefix`, either on another role, or a
    /// `worker_id_prefix` that covers another worker token's
    /// `worker_id_prefix` or `worker_id` (that pool's token could then act
    /// for the other's workers). Several tokens of the same worker id or
    /// prefix (a rotation) are fine.
    pub fn from_file(path: &str, file: AuthFile) -> Result<Self, AuthError> {
        if file.tokens.is_empty() {
            return Err(AuthError::Empty {
                path: path.to_string(),
            });
        }
        let mut entries = Vec::new();
        for (i, e) in file.tokens.into_iter().enumerate() {
            let err = |why: &str| AuthError::Entry {
                path: path.to_string(),
                index: i + 1,
                why: why.to_string(),
            };
            if e.token.len() < 16 || e.token.chars().any(|c| c.is_whitespace()) {
                return Err(err(
                    "token must be at least 16 characters without whitespace",
                ));
            }
            let identity = match (e.role, e.worker_id, e.worker_id_prefix) {
                (Role::Client, None, None) => Identity::Client,
                (Role::Admin, None, None) => Identity::Admin,
                (Role::Worker, Some(w), None) if crate::core::validate::worker_id(&w).is_ok() => {
                    Identity::Worker(w)
                }
                (Role::Worker, None, Some(p))
                    if p.len() < 64 && crate::core::validate::worker_id(&p).is_ok() =>
                {
                    Identity::WorkerPool(p)
                }
                (Role::Worker, _, _) => {
                    return Err(err(
                        "a worker token needs exactly one of a valid worker_id or \
                         worker_id_prefix ([A-Za-z0-9_-], at most 63 bytes)",
                    ))
                }
                (_, _, _) => {
                    return Err(err(
                        "only worker tokens take a worker_id or worker_id_prefix",
                    ))
                }
            };
            entries.push((e.token.into_bytes(), identity));
        }
        for (i, (_, pool)) in entries.iter().enumerate() {
            let Identity::WorkerPool(prefix) = pool else {
                continue;
            };
            for (j, (_, other)) in entries.iter().enumerate() {
                let covered = match other {
                    Identity::WorkerPool(p) => p != prefix && p.starts_with(prefix.as_str()),
                    Identity::Worker(w) => w.starts_with(prefix.as_str()),
                    _ => false,
                };
                if covered {
                    return Err(AuthError::Entry {
                        path: path.to_string(),
                        index: i + 1,
                        why: format!(
                            "worker_id_prefix {prefix:?} covers the worker ids of token #{}, so \
                             its holder could act for those workers too: use prefixes that do \
                             not start with one another (e.g. gpu- and cpu-)",
                            j + 1
                        ),
                    });
                }
            }
        }
        Ok(Authenticator {
            entries: Arc::new(entries),
        })
    }

    /// True when no token is configured (auth off).
    pub fn is_disabled(&self) -> bool {
        self.entries.is_empty()
    }

    /// The identity of a bearer token. Compares against every entry in
    /// constant time per entry, without early exit.
    pub fn identify(&self, token: &[u8]) -> Option<Identity> {
        let mut found = None;
        for (t, id) in self.entries.iter() {
            if bool::from(t.as_slice().ct_eq(token)) && found.is_none() {
                found = Some(id.clone());
            }
        }
        found
    }

    /// The interceptor: puts the caller's [`Identity`] into the request
    /// extensions, or rejects the call.
    ///
    /// Errors: `UNAUTHENTICATED` when the `authorization: Bearer <token>`
    /// metadata is missing, malformed or unknown.
    #[allow(clippy::result_large_err)]
    pub fn intercept(&self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if self.is_disabled() {
            req.extensions_mut().insert(Identity::Anonymous);
            return Ok(req);
        }
        let header = req.metadata().get("authorization").ok_or_else(|| {
            Status::unauthenticated(
                "missing authorization metadata: send `authorization: Bearer <token>`",
            )
        })?;
        let value = header.as_bytes();
        let token = value
            .strip_prefix(b"Bearer ")
            .or_else(|| value.strip_prefix(b"bearer "))
            .ok_or_else(|| Status::unauthenticated("authorization must be `Bearer <token>`"))?;
        let identity = self
            .identify(token)
            .ok_or_else(|| Status::unauthenticated("invalid token"))?;
        req.extensions_mut().insert(identity);
        Ok(req)
    }
}

impl Authenticator {
    /// [`Authenticator::intercept`] for a service whose every call is a
    /// client call (plans, actions, jobs, queue, schedules): a worker or
    /// worker-pool token is refused here, when the call starts, before
    /// its request message is read (the handlers check it again).
    ///
    /// Errors: those of [`Authenticator::intercept`]; `PERMISSION_DENIED`
    /// for a worker or worker-pool token.
    #[allow(clippy::result_large_err)]
    pub fn intercept_client_call(&self, req: Request<()>) -> Result<Request<()>, Status> {
        let req = self.intercept(req)?;
        require_client(&identity(&req))?;
        Ok(req)
    }
}

/// The caller's identity from a request's extensions (Anonymous if the
/// interceptor did not run, which only happens with auth off).
pub fn identity<T>(req: &Request<T>) -> Identity {
    req.extensions()
        .get::<Identity>()
        .cloned()
        .unwrap_or(Identity::Anonymous)
}

/// Allows clients, admins and anonymous callers.
///
/// Errors: `PERMISSION_DENIED` for worker and worker-pool tokens.
#[allow(clippy::result_large_err)]
pub fn require_client(id: &Identity) -> Result<(), Status> {
    match id {
        Identity::Worker(_) | Identity::WorkerPool(_) => Err(Status::permission_denied(
            "a worker token cannot make client calls",
        )),
        _ => Ok(()),
    }
}

/// Allows admins and anonymous callers (auth off) only.
///
/// Errors: `PERMISSION_DENIED` for client, worker and worker-pool tokens.
#[allow(clippy::result_large_err)]
pub fn require_admin(id: &Identity) -> Result<(), Status> {
    match id {
        Identity::Anonymous | Identity::Admin => Ok(()),
        _ => Err(Status::permission_denied("this call needs an admin token")),
    }
}

/// Allows the worker `worker_id` itself, a pool token whose prefix
/// `worker_id` starts with, admins and anonymous callers.
///
/// Errors: `PERMISSION_DENIED` for clients, other workers' tokens and
/// other pools' tokens.
#[allow(clippy::result_large_err)]
pub fn require_worker(id: &Identity, worker_id: &str) -> Result<(), Status> {
    match id {
        Identity::Anonymous | Identity::Admin => Ok(()),
        Identity::Worker(w) if w == worker_id => Ok(()),
        Identity::Worker(_) => Err(Status::permission_denied(format!(
            "this worker token is bound to another worker, not {worker_id}"
        ))),
        Identity::WorkerPool(p) if worker_id.starts_with(p.as_str()) => Ok(()),
        Identity::WorkerPool(p) => Err(Status::permission_denied(format!(
            "this worker token acts for worker ids starting with {p:?}, not {worker_id}"
        ))),
        Identity::Client => require_worker_role(id),
    }
}

/// Allows every identity but a client token: the part of
/// [`require_worker`] that does not depend on the worker id.
///
/// Errors: `PERMISSION_DENIED` for client tokens.
#[allow(clippy::result_large_err)]
pub fn require_worker_role(id: &Identity) -> Result<(), Status> {
    match id {
        Identity::Client => Err(Status::permission_denied(
            "worker calls need a worker or admin token",
        )),
        _ => Ok(()),
    }
}

/// The role check of a WorkerService call that its method alone decides
/// (`method` is the RPC name, e.g. `ListWorkers`): ListWorkers and
/// GetWorker are client calls, ReleaseWorker and VerifyWorker admin
/// calls, every other call a worker call (whose worker id the handler
/// checks against the token once the request has arrived).
///
/// Errors: `PERMISSION_DENIED` as [`require_client`], [`require_admin`]
/// and [`require_worker_role`].
#[allow(clippy::result_large_err)]
pub fn check_worker_service_call(method: &str, id: &Identity) -> Result<(), Status> {
    match method {
        "ListWorkers" | "GetWorker" => require_client(id),
        "ReleaseWorker" | "VerifyWorker" => require_admin(id),
        _ => require_worker_role(id),
    }
}

/// Wraps the WorkerService (inside its interceptor, which puts the
/// caller's [`Identity`] in the request's extensions) and refuses a call
/// its token's role can never make when the call starts, before its
/// request message is read ([`check_worker_service_call`]); the handlers
/// check again, with the worker id. Without it the server would read, and
/// buffer, a message it then refuses.
#[derive(Clone)]
pub struct WorkerCallGate<S> {
    inner: S,
    /// Counts the calls it refuses.
    metrics: crate::metrics::SharedMetrics,
}

impl<S> WorkerCallGate<S> {
    /// Gate in front of `inner`; its refusals count in `metrics`
    /// (`agq_auth_refusals_total`).
    pub fn new(inner: S, metrics: crate::metrics::SharedMetrics) -> Self {
        WorkerCallGate { inner, metrics }
    }
}

impl<S, B> tower::Service<http::Request<B>> for WorkerCallGate<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures_util::future::Either<
        std::future::Ready<Result<Self::Response, Self::Error>>,
        S::Future,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let id = req
            .extensions()
            .get::<Identity>()
            .cloned()
            .unwrap_or(Identity::Anonymous);
        let method = req.uri().path().rsplit('/').next().unwrap_or_default();
        match check_worker_service_call(method, &id) {
            Ok(()) => futures_util::future::Either::Right(self.inner.call(req)),
            Err(status) => {
                self.metrics.auth_refused(&status);
                futures_util::future::Either::Left(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for WorkerCallGate<S> {
    const NAME: &'static str = S::NAME;
}
