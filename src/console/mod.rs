//! The web console: `agq serve` serves it on its own listener
//! (`--console-listen`, default `127.0.0.1:6382`), in the same process as
//! the gRPC API, from templates and assets compiled into the binary (no
//! CDN, nothing fetched at run time).
//!
//! It is a presentation layer over the gRPC services, not a second API:
//! every page and button calls the same service methods the gRPC server
//! runs ([`crate::service`]), in-process, with the caller's identity from
//! its `Authorization: Bearer <token>` header, so the roles, validation,
//! error codes and RPC metrics are exactly the API's.
//!
//! Pages are server-rendered ([`minijinja`] templates) and use htmx
//! (vendored under `src/console/assets/`): a page is a static shell whose
//! live region loads an HTML fragment through htmx and refreshes it every
//! 2 s. The browser keeps the token the operator enters in
//! `sessionStorage` and sends it on every fragment and button request.
//!
//! Safety rules (fail closed):
//! - with auth configured, every fragment and button needs a token with a
//!   role the API accepts for that call (client: read, retry, cancel;
//!   admin: also drain, release and forget workers); without a token a request is
//!   refused with 401 and a message saying what to enter;
//! - without auth the console listens only on loopback (as the gRPC API),
//!   and answers only requests whose `Host` is a loopback name (a page on
//!   another site cannot reach it through DNS rebinding);
//! - a state change is a `POST` carrying the `HX-Request` header, which a
//!   form or image on another site cannot send (no CSRF);
//! - `Content-Security-Policy` allows scripts and styles from the console
//!   itself only; fragments are `Cache-Control: no-store`.
//!
//! Lists are paginated with the API's page tokens (50 rows a page): no
//! page or fragment loads more than one page of jobs.

mod pages;
mod view;

use std::{collections::VecDeque, future::Future, sync::Arc, time::Duration};

use axum::{
    extract::{Request, State},
    http::{header, HeaderMap, HeaderValue, Method, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use tokio::{net::TcpListener, sync::watch};

use crate::{
    auth::{Authenticator, Identity},
    core::SharedEngine,
    service::{ActionApi, JobApi, PlanApi, QueueApi, WorkerApi},
};

/// Default of `--console-listen`: port 6382, next to the gRPC API's 6380
/// and the metrics' 6381.
pub const DEFAULT_CONSOLE_LISTEN: &str = "127.0.0.1:6382";

/// Rows per page of every console list (actions, jobs, plans).
pub const PAGE_SIZE: u32 = 50;

/// How often the overview samples throughput and latency.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// How many samples the overview keeps: 72 × 5 s = the last 6 minutes.
pub(crate) const SAMPLES_KEPT: usize = 72;

/// The console's shared state: the services it calls, the token table, the
/// templates and the overview's samples.
pub(crate) struct Console {
    plans: PlanApi,
    actions: ActionApi,
    jobs: JobApi,
    workers: WorkerApi,
    queue: QueueApi,
    engine: SharedEngine,
    auth: Authenticator,
    templates: minijinja::Environment<'static>,
    samples: std::sync::Mutex<VecDeque<view::Sample>>,
}

/// Serves the console on `listener` until `shutdown` resolves.
///
/// Errors: the transport error that stopped the HTTP server.
pub(crate) async fn serve(
    listener: TcpListener,
    engine: SharedEngine,
    auth: Authenticator,
    stop: watch::Receiver<bool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let console = Arc::new(Console {
        plans: PlanApi {
            engine: engine.clone(),
        },
        actions: ActionApi {
            engine: engine.clone(),
            shutdown: stop.clone(),
        },
        jobs: JobApi {
            engine: engine.clone(),
        },
        workers: WorkerApi {
            engine: engine.clone(),
            shutdown: stop.clone(),
            lease_streams: Default::default(),
        },
        queue: QueueApi {
            engine: engine.clone(),
        },
        engine,
        auth,
        templates: templates(),
        samples: std::sync::Mutex::new(VecDeque::with_capacity(SAMPLES_KEPT)),
    });
    let sampler = tokio::spawn(sample_loop(console.clone(), stop));
    let router = router(console);
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        use tower::ServiceExt;
        router.clone().oneshot(req.map(axum::body::Body::new))
    });
    crate::http::serve(listener, svc, shutdown, "console").await;
    sampler.abort();
    Ok(())
}

/// Every route of the console.
fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(pages::overview_page))
        .route("/actions", get(pages::actions_page))
        .route("/actions/{id}", get(pages::action_page))
        .route("/jobs/{id}", get(pages::job_page))
        .route("/workers", get(pages::workers_page))
        .route("/plans", get(pages::plans_page))
        .route("/plans/{id}", get(pages::plan_page))
        .route("/fragments/overview", get(pages::overview))
        .route("/fragments/actions", get(pages::actions))
        .route("/fragments/actions/{id}", get(pages::action))
        .route("/fragments/jobs/{id}", get(pages::job))
        .route("/fragments/workers", get(pages::workers))
        .route("/fragments/plans", get(pages::plans))
        .route("/fragments/plans/{id}", get(pages::plan))
        .route("/api/actions/{id}/retry", post(pages::retry_action))
        .route("/api/actions/{id}/cancel", post(pages::cancel_action))
        .route("/api/jobs/{id}/retry", post(pages::retry_job))
        .route("/api/jobs/{id}/cancel", post(pages::cancel_job))
        .route("/api/workers/{id}/drain", post(pages::drain_worker))
        .route("/api/workers/{id}/forget", post(pages::forget_worker))
        .route("/api/workers/{id}/release", post(pages::release_worker))
        .route("/assets/{name}", get(asset))
        .fallback(|| async { Refusal::new(StatusCode::NOT_FOUND, "no such page") })
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .with_state(console)
}

/// Checks every request before its handler: the Host rule without auth,
/// the HX-Request rule on state changes; adds the security headers, and
/// counts the handlers' token and role refusals in
/// `agq_auth_refusals_total`.
async fn guard(State(console): State<Arc<Console>>, req: Request, next: Next) -> Response {
    if console.auth.is_disabled() && !loopback_host(req.headers()) {
        return Refusal::new(
            StatusCode::FORBIDDEN,
            "this console has no auth configured and answers only requests to a loopback \
             host (127.0.0.1, [::1] or localhost)",
        )
        .into_response();
    }
    if req.method() != Method::GET
        && req.method() != Method::HEAD
        && req.headers().get("hx-request").is_none()
    {
        return Refusal::new(
            StatusCode::FORBIDDEN,
            "state changes come from the console's own buttons (HX-Request header missing)",
        )
        .into_response();
    }
    let mut res = next.run(req).await;
    // A refusal of the caller's token (401) or of its role (403: the guard
    // refuses its own cases above) counts as the API's refusals do.
    let refused = match res.status() {
        StatusCode::UNAUTHORIZED => Some(tonic::Code::Unauthenticated),
        StatusCode::FORBIDDEN => Some(tonic::Code::PermissionDenied),
        _ => None,
    };
    if let Some(code) = refused {
        let status = tonic::Status::new(code, "console request refused");
        console.engine.metrics().auth_refused(&status);
    }
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    res
}

/// True when the request's Host names a loopback address or `localhost`.
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    // Strip the port: "[::1]:6382", "127.0.0.1:6382", "localhost:6382".
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(n, _)| n)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Console {
    /// The caller's identity from its bearer token.
    ///
    /// Errors: 401 with what to enter when auth is on and the token is
    /// missing, malformed or unknown.
    fn caller(&self, headers: &HeaderMap) -> Result<Identity, Refusal> {
        if self.auth.is_disabled() {
            return Ok(Identity::Anonymous);
        }
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(Refusal::new(
                StatusCode::UNAUTHORIZED,
                "Refused: no token. This server requires one: enter a client token (read, \
                 retry, cancel) or an admin token (also drain, release and forget workers) under \
                 \u{201c}Token\u{201d} above.",
            ));
        };
        let value = value.as_bytes();
        let token = value
            .strip_prefix(b"Bearer ")
            .or_else(|| value.strip_prefix(b"bearer "))
            .ok_or_else(|| {
                Refusal::new(
                    StatusCode::UNAUTHORIZED,
                    "Refused: the Authorization header must be `Bearer <token>`.",
                )
            })?;
        self.auth.identify(token).ok_or_else(|| {
            Refusal::new(
                StatusCode::UNAUTHORIZED,
                "Refused: this token is not valid on this server. Enter another under \
                 \u{201c}Token\u{201d} above.",
            )
        })
    }

    /// Renders template `name` with `ctx`.
    ///
    /// Errors: 500 when the template fails (a bug, logged).
    fn render(&self, name: &str, ctx: minijinja::Value) -> Result<Response, Refusal> {
        let tpl = self.templates.get_template(name).map_err(internal)?;
        let html = tpl.render(ctx).map_err(internal)?;
        Ok(([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response())
    }
}

/// A request tonic's way: `msg` with the caller's identity in its
/// extensions, as the interceptor leaves it for the services.
fn grpc<T>(id: &Identity, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.extensions_mut().insert(id.clone());
    req
}

/// A refused or failed console request: an HTTP status and a message for
/// people, sent as plain text (the page shows it in its alert area).
#[derive(Debug)]
pub(crate) struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
    }
}

impl From<tonic::Status> for Refusal {
    /// The gRPC status of the service the console called, as HTTP: the
    /// same refusal the API gives, with its message.
    fn from(s: tonic::Status) -> Self {
        use tonic::Code;
        let (status, what) = match s.code() {
            Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "Refused: no valid token."),
            Code::PermissionDenied => (
                StatusCode::FORBIDDEN,
                "Refused: this token's role may not do this.",
            ),
            Code::NotFound => (StatusCode::NOT_FOUND, "Not found."),
            Code::InvalidArgument | Code::OutOfRange => {
                (StatusCode::BAD_REQUEST, "Invalid request.")
            }
            Code::FailedPrecondition | Code::AlreadyExists | Code::Aborted => {
                (StatusCode::CONFLICT, "Not possible now.")
            }
            Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "Too many requests."),
            Code::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "The server cannot serve this now.",
            ),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "Server error."),
        };
        Refusal::new(status, format!("{what} {}", s.message()))
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (
            self.status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            self.message,
        )
            .into_response()
    }
}

fn internal(e: impl std::fmt::Display) -> Refusal {
    tracing::error!(error = %e, "console template failed");
    Refusal::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Server error rendering this page.",
    )
}

/// The templates, compiled into the binary.
fn templates() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    macro_rules! add {
        ($($name:literal),*) => {$(
            env.add_template($name, include_str!(concat!("templates/", $name)))
                .expect(concat!("template ", $name, " parses"));
        )*};
    }
    // The templates are part of the binary: a syntax error in one is a
    // build-time bug, caught by every console test, never input.
    add!(
        "base.html",
        "shell.html",
        "overview.html",
        "actions.html",
        "action.html",
        "job.html",
        "workers.html",
        "plans.html",
        "plan.html",
        "macros.html"
    );
    env
}

/// Serves a vendored asset.
async fn asset(axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    let (body, kind): (&'static [u8], &str) = match name.as_str() {
        "htmx-2.0.11.min.js" => (
            include_bytes!("assets/htmx-2.0.11.min.js"),
            "text/javascript; charset=utf-8",
        ),
        "console.js" => (
            include_bytes!("assets/console.js"),
            "text/javascript; charset=utf-8",
        ),
        "console.css" => (
            include_bytes!("assets/console.css"),
            "text/css; charset=utf-8",
        ),
        _ => return Refusal::new(StatusCode::NOT_FOUND, "no such asset").into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

/// Every [`SAMPLE_EVERY`], records the completed/dead counters and the
/// enqueue-to-lease histogram's sum and count, for the overview's
/// throughput and latency of the last minutes.
async fn sample_loop(console: Arc<Console>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let s = view::Sample::take(console.engine.metrics());
        let mut samples = console
            .samples
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if samples.len() == SAMPLES_KEPT {
            samples.pop_front();
        }
        samples.push_back(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(h: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(header::HOST, HeaderValue::from_str(h).unwrap());
        m
    }

    #[test]
    fn only_loopback_hosts_pass_without_auth() {
        for ok in [
            "127.0.0.1:6382",
            "127.0.0.1",
            "localhost:1",
            "LOCALHOST",
            "[::1]:6382",
            "127.1.2.3:80",
        ] {
            assert!(loopback_host(&host(ok)), "{ok}");
        }
        for bad in [
            "evil.example:6382",
            "10.0.0.1:6382",
            "localhost.evil.example",
            "[::2]:1",
            "",
        ] {
            assert!(!loopback_host(&host(bad)), "{bad}");
        }
        assert!(!loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn every_template_parses() {
        let env = templates();
        assert!(env.get_template("shell.html").is_ok());
    }
}
