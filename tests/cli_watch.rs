//! `agq action status --watch` with stdout not a terminal (as in CI logs),
//! run as the built `agq` binary against a real server: a progress line at
//! the start, every `--interval` and at the end, with the counts (dead
//! apart from completed), jobs/s and an ETA, and no terminal escapes; a
//! watch that outlives a server restart (graceful, then a SIGKILL) on the
//! same address and database and ends with the right totals; a watch that
//! gives up after `--reconnect-for`; errors that are not retried.
//!
//! Jobs are driven by simulated workers ([`common::SimWorker`]), so the test
//! decides when each job completes or dies. Every wait is bounded.

mod common;
mod process;

use std::time::{Duration, Instant};

use agq::{
    auth::{AuthFile, Authenticator, Role, TokenEntry},
    pb::{
        action_service_client::ActionServiceClient, plan_service_client::PlanServiceClient,
        ActionInput, CancelActionRequest, JobLease, JobStatus, SubmitActionRequest,
        SubmitPlanRequest,
    },
};
use common::{fast_config, plan, submit, Bearer, SimWorker, TestServer};
use process::{clean_command, OnDrop, Proc, Serve, AGQ};
use tonic::{service::interceptor::InterceptedService, transport::Channel};

/// How long any one expected line or exit may take.
const WAIT: Duration = Duration::from_secs(30);

/// A running `agq action status ID --watch`, with the stdout lines read so
/// far.
struct Watch {
    proc: Proc,
    lines: Vec<String>,
}

impl Watch {
    /// Starts `agq --server URL action status ACTION_ID --watch EXTRA...`,
    /// stdout into a pipe, stderr into a log file.
    fn start(url: &str, action_id: &str, extra: &[&str]) -> Watch {
        let mut cmd = clean_command(AGQ);
        cmd.args(["--server", url, "action", "status", action_id, "--watch"])
            .args(extra);
        Watch {
            proc: Proc::spawn(cmd, "agq action status --watch", None, OnDrop::Kill),
            lines: Vec::new(),
        }
    }

    /// Reads stdout lines until one satisfies `want`, and returns it.
    /// Panics with everything read and the stderr log after [`WAIT`].
    async fn line(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        while let Some(l) = self.proc.next_line_async(deadline).await {
            assert!(!l.contains('\x1b'), "a terminal escape in {l:?}");
            self.lines.push(l.clone());
            if want(&l) {
                return l;
            }
        }
        panic!(
            "no line {what} within {WAIT:?}; stdout:\n{}\nstderr:\n{}",
            self.lines.join("\n"),
            self.proc.log()
        );
    }

    /// Waits until stderr holds `needle`.
    async fn stderr_has(&self, needle: &str) {
        let deadline = Instant::now() + WAIT;
        while !self.proc.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "stderr lacks {needle:?} after {WAIT:?}:\n{}",
                self.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reads stdout to its end and waits for the exit; returns the exit
    /// code and stderr.
    async fn end(&mut self) -> (i32, String) {
        let deadline = Instant::now() + WAIT;
        while let Some(l) = self.proc.next_line_async(deadline).await {
            self.lines.push(l);
        }
        let code = self.proc.wait_exit_async(WAIT).await.code().unwrap_or(-1);
        (code, self.proc.log())
    }
}

/// The progress lines among `lines` (not the final status table).
fn progress_lines(lines: &[String], action_id: &str) -> Vec<String> {
    let head = format!(" action {action_id} ");
    lines
        .iter()
        .filter(|l| l.contains(&head))
        .cloned()
        .collect()
}

/// `n` leases for `w`.
async fn leases(w: &mut SimWorker, n: usize) -> Vec<JobLease> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(w.lease().await);
    }
    out
}

/// Stores a one-task `cat` Plan `plan_id` and submits an Action of `n`
/// jobs over `channel`; returns the action id.
async fn submit_over<C>(channel: C, plan_id: &str, n: usize) -> String
where
    C: tonic::client::GrpcService<tonic::body::Body> + Clone,
    C::Error: Into<tonic::codegen::StdError>,
    C::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <C::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    PlanServiceClient::new(channel.clone())
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan(plan_id, &["cat"])),
            replace: false,
        })
        .await
        .expect("submit plan");
    ActionServiceClient::new(channel)
        .submit_action(SubmitActionRequest {
            plan_id: plan_id.into(),
            inputs: (0..n)
                .map(|i| ActionInput {
                    values: [("n".to_string(), i.to_string())].into(),
                })
                .collect(),
            ..Default::default()
        })
        .await
        .expect("submit action")
        .into_inner()
        .action_id
}

/// The jobs/s figure of a progress line, `None` for `- jobs/s`.
fn rate_of(line: &str) -> Option<f64> {
    let before = line.split(" jobs/s").next()?;
    before.rsplit(' ').next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_lines_show_counts_rate_eta_and_dead_apart() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("agq.db"), fast_config()).await;
    let (id, _) = submit(&s, plan("lines", &["cat"]), 10, 1).await;
    let mut watch = Watch::start(&s.url(), &id, &["--interval", "1"]);

    // A line at once, before anything ran: no rate, no ETA yet.
    let first = watch.line("at the start", |l| l.contains(" action ")).await;
    let timestamp = first.split(' ').next().unwrap();
    assert!(
        humantime::parse_rfc3339(timestamp).is_ok() && timestamp.ends_with('Z'),
        "{first}"
    );
    assert!(
        first.ends_with(&format!(
            " action {id} 0/10 finished (0 %): completed 0, dead 0, running 0, pending 10 \
             · - jobs/s · ETA -"
        )),
        "{first}"
    );

    let mut w = SimWorker::start(&s, "w1", &["cat"], 10).await;
    let leased = leases(&mut w, 10).await;
    for l in &leased[..4] {
        w.complete(l).await;
    }
    // Four finished within the last few seconds: a rate, and an ETA for six.
    let rated = watch
        .line("with 4 completed and a rate", |l| {
            l.contains("4/10 finished (40 %): completed 4, dead 0, running 6, pending 0")
                && rate_of(l).is_some_and(|r| r > 0.0)
        })
        .await;
    let eta = rated.rsplit("ETA ").next().unwrap();
    assert!(eta.ends_with('s') && eta != "-", "{rated}");

    // Two jobs die (one attempt each): counted apart from the completed.
    for l in &leased[4..6] {
        w.report(l, JobStatus::Failed).await.unwrap();
    }
    watch
        .line("with 2 dead", |l| {
            l.contains("6/10 finished (60 %): completed 4, dead 2, running 4, pending 0")
        })
        .await;
    for l in &leased[6..] {
        w.complete(l).await;
    }
    let (code, stderr) = watch.end().await;
    assert_eq!(code, 1, "dead jobs make the watch fail; stderr:\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "agq: action {id} finished with 2 dead and 0 cancelled of 10 jobs"
        )),
        "{stderr}"
    );
    let lines = progress_lines(&watch.lines, &id);
    let last = lines.last().unwrap();
    assert!(
        last.contains(
            "10/10 finished (100 %): completed 8, dead 2, running 0, pending 0 · done in "
        ),
        "{last}"
    );
    // One line per second or so, never a flood: at most one per update.
    assert!(lines.len() <= 30, "{lines:#?}");
    // Then the final status, as without a watch.
    let out = watch.lines.join("\n");
    assert!(out.contains("completed  8"), "{out}");
    assert!(out.contains("dead       2"), "{out}");
    assert!(out.contains("done       yes"), "{out}");
    drop(w);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_reconnects_after_a_graceful_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let s = TestServer::start(&db, fast_config()).await;
    let addr = s.addr;
    // Three attempts: the jobs running when the server stops go back to
    // pending after the restart instead of dying.
    let (id, _) = submit(&s, plan("restart", &["cat"]), 6, 3).await;
    let mut watch = Watch::start(&s.url(), &id, &["--interval", "1", "--reconnect-for", "30"]);
    watch
        .line("at the start", |l| l.contains("pending 6"))
        .await;

    let mut w = SimWorker::start(&s, "w1", &["cat"], 2).await;
    for l in leases(&mut w, 2).await {
        w.complete(&l).await;
    }
    watch
        .line("with 2 completed", |l| l.contains("completed 2,"))
        .await;

    // The server stops (its watch streams end with UNAVAILABLE) and stays
    // away long enough for a reconnect attempt to be refused.
    drop(w);
    s.stop().await;
    watch
        .stderr_has(&format!("agq: lost the watch of action {id} (UNAVAILABLE"))
        .await;
    watch.stderr_has("reconnect attempt 1 failed").await;

    let s = TestServer::start_with(&db, fast_config(), Authenticator::default(), Some(addr)).await;
    watch.stderr_has("agq: reconnected after ").await;
    // A line at once after the reconnect, with the state kept across the
    // restart.
    watch
        .line("after the reconnect", |l| {
            l.contains("2/6 finished (33 %): completed 2, dead 0")
        })
        .await;
    // The two jobs w1 was running are leased again once their lease expires.
    let mut w = SimWorker::start(&s, "w2", &["cat"], 4).await;
    for l in leases(&mut w, 4).await {
        w.complete(&l).await;
    }

    let (code, stderr) = watch.end().await;
    assert_eq!(code, 0, "{stderr}");
    let lines = progress_lines(&watch.lines, &id);
    let last = lines.last().unwrap();
    assert!(
        last.contains("6/6 finished (100 %): completed 6, dead 0, running 0, pending 0 · done in "),
        "{last}"
    );
    assert!(watch.lines.join("\n").contains("done       yes"));
    drop(w);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_reconnects_after_a_server_crash() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let mut server = Serve::new(&db).kill_on_drop().spawn().expect("agq serve");
    let addr = server.addr.clone();
    let url = server.url();
    let channel = Channel::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let id = submit_over(channel, "crash", 3).await;
    let mut watch = Watch::start(&url, &id, &["--interval", "1", "--reconnect-for", "30"]);
    watch
        .line("at the start", |l| l.contains("pending 3"))
        .await;

    // SIGKILL: no goodbye on the stream, the connection just breaks.
    server.kill();
    watch
        .stderr_has(&format!("agq: lost the watch of action {id} ("))
        .await;
    let server = Serve::new(&db)
        .listen(&addr)
        .kill_on_drop()
        .spawn()
        .expect("agq serve again on the same address");
    watch.stderr_has("agq: reconnected after ").await;
    let mut client = ActionServiceClient::connect(server.url()).await.unwrap();
    client
        .cancel_action(CancelActionRequest {
            action_id: id.clone(),
        })
        .await
        .unwrap();
    let (code, stderr) = watch.end().await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("finished with 0 dead and 3 cancelled of 3 jobs"),
        "{stderr}"
    );
    let lines = progress_lines(&watch.lines, &id);
    assert!(
        lines.last().unwrap().contains(
            "3/3 finished (100 %): completed 0, dead 0, running 0, pending 0, cancelled 3"
        ),
        "{lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gives_up_after_reconnect_for_and_never_retries_not_found_or_auth() {
    let dir = tempfile::tempdir().unwrap();
    let auth = Authenticator::from_file(
        "test",
        AuthFile {
            tokens: vec![TokenEntry {
                token: "client-token-0123456789".into(),
                role: Role::Client,
                worker_id: None,
                worker_id_prefix: None,
            }],
        },
    )
    .unwrap();
    let s = TestServer::start_with(&dir.path().join("agq.db"), fast_config(), auth, None).await;
    let url = s.url();

    // Neither a missing action nor a refused token is retried.
    let token = ["--token", "client-token-0123456789"];
    for (extra, needle) in [
        (&token[..], "agq: NOT_FOUND: "),
        (&[][..], "agq: UNAUTHENTICATED: "),
    ] {
        let started = Instant::now();
        let mut watch = Watch::start(&url, "nope", extra);
        let (code, stderr) = watch.end().await;
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains(needle), "{stderr}");
        assert!(!stderr.contains("reconnect"), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    // A server that does not come back: given up after --reconnect-for.
    let authed = InterceptedService::new(
        s.channel().await,
        Bearer(Some("client-token-0123456789".into())),
    );
    let id = submit_over(authed, "gone", 1).await;
    let mut args = token.to_vec();
    args.extend(["--reconnect-for", "2"]);
    let mut watch = Watch::start(&url, &id, &args);
    watch
        .line("at the start", |l| l.contains("pending 1"))
        .await;
    s.stop().await;
    let stopped = Instant::now();
    let (code, stderr) = watch.end().await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("agq: lost the watch of action"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "agq: gave up watching action {id}: no connection for "
        )),
        "{stderr}"
    );
    assert!(stderr.contains("(--reconnect-for 2)"), "{stderr}");
    assert!(
        stopped.elapsed() < Duration::from_secs(10),
        "{:?}",
        stopped.elapsed()
    );
}
