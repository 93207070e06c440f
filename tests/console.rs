//! The web console over HTTP (no browser: `tests/console_browser.rs`
//! drives one): paging under a 20,000-job action, the auth and loopback
//! rules, the CSRF rule, the security headers, and `agq serve`'s refusal
//! to serve it publicly without auth.

mod common;

use std::time::Duration;

use agq::{
    auth::{AuthFile, Authenticator, Role, TokenEntry},
    config::EngineConfig,
    pb::{self, ActionInput, SubmitActionRequest, SubmitPlanRequest},
};
use common::{fast_config, plan, TestServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ADMIN: &str = "admin-token-0123456789abcdef";
const CLIENT: &str = "client-token-0123456789abcdef";
const WORKER: &str = "worker-token-0123456789abcdef";

/// An HTTP answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request to the console at `base` (`http://ADDR`), with
/// extra header lines; the connection closes after the answer.
async fn http(base: &str, method: &str, path: &str, extra: &[(&str, &str)]) -> Answer {
    let addr = base.strip_prefix("http://").expect("http url");
    let mut s = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n");
    if !extra.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8(raw).expect("utf-8 answer");
    let (head, body) = text.split_once("\r\n\r\n").expect("header end");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    // Chunked bodies: join the chunks.
    let body = if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        body.to_owned()
    };
    Answer {
        status,
        headers,
        body,
    }
}

fn bearer(token: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {token}"))
}

/// The sum of `agq_rpc_requests_total` samples of `method`.
async fn rpc_count(server: &TestServer, method: &str) -> f64 {
    let body = server
        .queue()
        .await
        .get_metrics(pb::GetMetricsRequest {
            format: "prometheus".into(),
        })
        .await
        .expect("GetMetrics")
        .into_inner()
        .body;
    let key = format!("method=\"{method}\"");
    body.lines()
        .filter(|l| l.starts_with("agq_rpc_requests_total{") && l.contains(&key))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `agq_auth_refusals_total` sample of `code` on the metrics listener
/// (0 when there is none yet).
async fn refusals(server: &TestServer, code: &str) -> f64 {
    let base = format!("http://{}", server.metrics_addr.expect("metrics listener"));
    let page = http(&base, "GET", "/metrics", &[]).await;
    assert_eq!(page.status, 200);
    let key = format!("agq_auth_refusals_total{{code=\"{code}\"}} ");
    page.body
        .lines()
        .find_map(|l| l.strip_prefix(&key)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_20000_job_action_is_shown_one_page_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        max_inputs_per_action: 20_000,
        ..fast_config()
    };
    let s =
        TestServer::start_with_console(&dir.path().join("agq.db"), cfg, Authenticator::default())
            .await;
    let console = s.console_url.clone().expect("console url");
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("big", &["cat"])),
            replace: false,
        })
        .await
        .expect("plan");
    let inputs = (0..20_000)
        .map(|i| ActionInput {
            values: [("file".to_string(), format!("/nonexistent/{i}"))].into(),
        })
        .collect();
    s.actions()
        .await
        .submit_action(SubmitActionRequest {
            action_id: "huge".into(),
            plan_id: "big".into(),
            inputs,
            ..Default::default()
        })
        .await
        .expect("20,000-job action");

    // Whatever a client stores is shown as text, never as markup.
    let mut hostile = plan("xss", &["cat"]);
    hostile.plan_description = "<img src=x onerror=alert(1)>".into();
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(hostile),
            replace: false,
        })
        .await
        .expect("plan xss");
    let plans = http(&console, "GET", "/fragments/plans", &[]).await;
    assert!(
        plans.body.contains("&lt;img src=x onerror=alert(1)&gt;") && !plans.body.contains("<img"),
        "{}",
        plans.body
    );

    // The actions list shows counts from the action, loading no job.
    let before = rpc_count(&s, "JobService/GetJob").await;
    let list = http(&console, "GET", "/fragments/actions", &[]).await;
    assert_eq!(list.status, 200, "{}", list.body);
    assert!(list.body.contains("data-action-id=\"huge\""));
    assert!(list.body.contains("0 done of 20000"), "{}", list.body);
    assert_eq!(rpc_count(&s, "JobService/GetJob").await, before);

    // The action page: one page of 50 jobs and a link to the next.
    let page1 = http(&console, "GET", "/fragments/actions/huge", &[]).await;
    assert_eq!(page1.status, 200, "{}", page1.body);
    let rows1: Vec<&str> = page1.body.split("data-job-id=\"").skip(1).collect();
    assert_eq!(rows1.len(), 50, "one page of jobs");
    assert!(page1.body.len() < 200_000, "{} bytes", page1.body.len());
    assert_eq!(
        rpc_count(&s, "JobService/GetJob").await - before,
        50.0,
        "the page fetched exactly its own jobs"
    );
    let next = page1
        .body
        .split("class=\"next\" href=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("a next-page link")
        .replace("&amp;", "&")
        .replace("&#x2f;", "/");
    assert!(next.starts_with("/actions/huge?"), "{next}");
    let page2 = http(
        &console,
        "GET",
        &next.replacen("/actions/", "/fragments/actions/", 1),
        &[],
    )
    .await;
    assert_eq!(page2.status, 200, "{}", page2.body);
    let ids = |rows: &[&str]| -> Vec<String> {
        rows.iter()
            .map(|r| r.split('"').next().unwrap().to_owned())
            .collect()
    };
    let rows2: Vec<&str> = page2.body.split("data-job-id=\"").skip(1).collect();
    assert_eq!(rows2.len(), 50);
    let (a, b) = (ids(&rows1), ids(&rows2));
    assert!(a.iter().all(|id| !b.contains(id)), "pages do not overlap");

    // The overview and the status filter stay within a page too.
    let before = rpc_count(&s, "JobService/GetJob").await;
    let o = http(&console, "GET", "/fragments/overview", &[]).await;
    assert_eq!(o.status, 200, "{}", o.body);
    assert!(o.body.contains("id=\"q-ready\">20000<"), "{}", o.body);
    let pending = http(
        &console,
        "GET",
        "/fragments/actions/huge?status=pending",
        &[],
    )
    .await;
    assert_eq!(
        pending.body.split("data-job-id=\"").count() - 1,
        50,
        "{}",
        pending.body
    );
    assert!(rpc_count(&s, "JobService/GetJob").await - before <= 60.0);
    s.stop().await;
}

fn auth() -> Authenticator {
    Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![
                TokenEntry {
                    token: ADMIN.into(),
                    role: Role::Admin,
                    worker_id: None,
                    worker_id_prefix: None,
                },
                TokenEntry {
                    token: CLIENT.into(),
                    role: Role::Client,
                    worker_id: None,
                    worker_id_prefix: None,
                },
                TokenEntry {
                    token: WORKER.into(),
                    role: Role::Worker,
                    worker_id: Some("w1".into()),
                    worker_id_prefix: None,
                },
            ],
        },
    )
    .expect("auth")
}

#[tokio::test]
async fn tokens_grant_exactly_their_roles_and_state_changes_need_the_console() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with_console(&dir.path().join("agq.db"), fast_config(), auth()).await;
    let c = s.console_url.clone().expect("console url");
    let hx = ("HX-Request", "true");

    // The page shell needs no token (it holds no data) and says one is needed.
    let shell = http(&c, "GET", "/actions", &[]).await;
    assert_eq!(shell.status, 200);
    assert!(shell.body.contains("data-auth=\"on\""));
    let csp = shell.header("content-security-policy").expect("CSP");
    assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(shell.header("x-content-type-options"), Some("nosniff"));

    // Data needs a token: none, an unknown one, a worker's are refused.
    let none = http(&c, "GET", "/fragments/actions", &[]).await;
    assert_eq!(none.status, 401);
    assert!(none.body.contains("no token"), "{}", none.body);
    let (k, v) = bearer("not-a-token-at-all-xxxxxxxx");
    let bad = http(&c, "GET", "/fragments/actions", &[(k, &v)]).await;
    assert_eq!(bad.status, 401, "{}", bad.body);
    let (k, w) = bearer(WORKER);
    let worker = http(&c, "GET", "/fragments/actions", &[(k, &w)]).await;
    assert_eq!(worker.status, 403, "{}", worker.body);
    // The refusals count as the API's do.
    assert_eq!(refusals(&s, "Unauthenticated").await, 2.0);
    assert_eq!(refusals(&s, "PermissionDenied").await, 1.0);
    let (k, client) = bearer(CLIENT);
    let ok = http(&c, "GET", "/fragments/actions", &[(k, &client)]).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.header("cache-control"), Some("no-store"));

    // A worker to drain: a client may not, an admin may; without the
    // HX-Request header nothing changes whatever the token.
    let mut workers = pb::worker_service_client::WorkerServiceClient::with_interceptor(
        s.channel().await,
        common::Bearer(Some(ADMIN.into())),
    );
    workers
        .register_worker(pb::RegisterWorkerRequest {
            worker_id: "w1".into(),
            hostname: "h".into(),
            platform: "linux".into(),
            agw_version: "test".into(),
            instance_id: "i1".into(),
            capabilities: Some(pb::WorkerCapabilities {
                tools: vec!["cat".into()],
                agentic_units: vec![],
                ..Default::default()
            }),
            max_concurrent_jobs: 1,
            ..Default::default()
        })
        .await
        .expect("register w1");
    let state = || {
        let mut w = workers.clone();
        async move {
            w.get_worker(pb::GetWorkerRequest {
                worker_id: "w1".into(),
            })
            .await
            .expect("GetWorker")
            .into_inner()
            .worker
            .expect("worker")
            .state
        }
    };
    let (k, admin) = bearer(ADMIN);
    let forged = http(&c, "POST", "/api/workers/w1/drain", &[(k, &admin)]).await;
    assert_eq!(forged.status, 403, "{}", forged.body);
    assert!(forged.body.contains("HX-Request"));
    let by_client = http(&c, "POST", "/api/workers/w1/drain", &[(k, &client), hx]).await;
    assert_eq!(by_client.status, 403, "{}", by_client.body);
    assert!(by_client.body.contains("role"), "{}", by_client.body);
    assert_eq!(
        state().await,
        pb::WorkerState::Active as i32,
        "refused calls changed nothing"
    );
    let no_token = http(&c, "POST", "/api/workers/w1/drain", &[hx]).await;
    assert_eq!(no_token.status, 401);
    let by_admin = http(&c, "POST", "/api/workers/w1/drain", &[(k, &admin), hx]).await;
    assert_eq!(by_admin.status, 200, "{}", by_admin.body);
    assert!(by_admin.body.contains("draining"));
    assert_eq!(by_admin.header("hx-trigger"), Some("agq-refresh"));
    assert_eq!(state().await, pb::WorkerState::Draining as i32);
    let drained = http(&c, "GET", "/fragments/workers", &[(k, &client)]).await;
    assert!(drained.body.contains("st-draining"), "{}", drained.body);

    // Unknown things are 404 with the API's message; bad filters are 400.
    let missing = http(&c, "GET", "/fragments/jobs/nope", &[(k, &client)]).await;
    assert_eq!(missing.status, 404, "{}", missing.body);
    let filter = http(&c, "GET", "/fragments/actions?state=bogus", &[(k, &client)]).await;
    assert_eq!(filter.status, 400, "{}", filter.body);
    let page = http(&c, "GET", "/no/such/page", &[]).await;
    assert_eq!(page.status, 404);
    // A page of an id nothing can have is not shown: a link cannot put
    // its own words in the page's title.
    for path in [
        "/actions/Your%20account%20is%20locked",
        "/jobs/call%20%2B1%20555",
        "/plans/..",
    ] {
        let spoof = http(&c, "GET", path, &[(k, &client)]).await;
        assert_eq!(spoof.status, 404, "{path}: {}", spoof.body);
        assert!(
            !spoof.body.contains("locked") && !spoof.body.contains("555"),
            "{}",
            spoof.body
        );
    }
    let real = http(&c, "GET", "/actions/some-action.1", &[(k, &client)]).await;
    assert_eq!(real.status, 200, "{}", real.body);
    s.stop().await;
}

#[tokio::test]
async fn without_auth_only_loopback_hosts_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with_console(
        &dir.path().join("agq.db"),
        fast_config(),
        Authenticator::default(),
    )
    .await;
    let c = s.console_url.clone().expect("console url");
    // An action with open jobs (no worker takes them): what a forged
    // cancel would destroy.
    let (action_id, ids) = common::submit(&s, plan("open", &["cat"]), 3, 1).await;
    let cancel = format!("/api/actions/{action_id}/cancel");
    for host in ["evil.example", "evil.example:6382", "10.0.0.1:6382"] {
        let a = http(&c, "GET", "/fragments/overview", &[("Host", host)]).await;
        assert_eq!(a.status, 403, "{host}: {}", a.body);
        let p = http(
            &c,
            "POST",
            &cancel,
            &[("Host", host), ("HX-Request", "true")],
        )
        .await;
        assert_eq!(p.status, 403, "{host}");
    }
    // A loopback host without the HX-Request header: refused too.
    let forged = http(&c, "POST", &cancel, &[("Host", "127.0.0.1")]).await;
    assert_eq!(forged.status, 403, "{}", forged.body);
    for id in &ids {
        assert_eq!(
            common::job(&s, id).await.status,
            pb::JobStatus::Pending as i32,
            "a refused cancel changed nothing"
        );
    }
    for host in ["localhost:6382", "127.0.0.1"] {
        let a = http(&c, "GET", "/fragments/overview", &[("Host", host)]).await;
        assert_eq!(a.status, 200, "{host}: {}", a.body);
    }
    // The console's own button, from a loopback host, does cancel.
    let ok = http(
        &c,
        "POST",
        &cancel,
        &[("Host", "localhost:6382"), ("HX-Request", "true")],
    )
    .await;
    assert_eq!((ok.status, ok.body.as_str()), (200, "Cancelled 3 jobs."));
    for id in &ids {
        assert_eq!(
            common::job(&s, id).await.status,
            pb::JobStatus::Cancelled as i32
        );
    }
    s.stop().await;
}

#[test]
fn serve_refuses_a_public_console_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agq"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--console-listen", "0.0.0.0:0", "--db"])
        .arg(dir.path().join("agq.db"))
        .output()
        .expect("run agq serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to serve the console on 0.0.0.0:0 without authentication"),
        "{err}"
    );
    assert!(!dir.path().join("agq.db").exists(), "nothing was created");
}
