//! The web console in a real headless browser (Debian's `chromium`, driven
//! through `chromedriver` with fantoccini), against a real `agq serve`
//! process with an auth file and a real `agw` process: an operator follows a 200-job action to 100 %,
//! reads a dead job's stderr, is refused a retry without a token, retries
//! with an admin token and gets the job back, and drains the worker.
//!
//! Screenshots of every page go to `target/ui-screenshots/` (CI keeps
//! them; docs/console.md shows them). Needs `chromium` and `chromedriver`
//! (`scripts/test-deps.sh` installs them; `AGQ_CHROMIUM` and
//! `AGQ_CHROMEDRIVER` name other binaries). Without them the test fails
//! and says how to install them: it never skips.

mod common;
mod process;

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agq::pb::{self, ActionInput, SubmitActionRequest, SubmitPlanRequest};
use common::Bearer;
use fantoccini::{Client, ClientBuilder, Locator};

const ADMIN: &str = "admin-token-0123456789abcdef";
const CLIENT: &str = "client-token-0123456789abcdef";
const WORKER: &str = "worker-token-0123456789abcdef";
const WORKER_ID: &str = "w-browser";
const JOBS: usize = 200;
/// How long any wait for the page may take.
const WAIT: Duration = Duration::from_secs(60);

/// A chromedriver process on a free loopback port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    fn start() -> Driver {
        let bin = std::env::var("AGQ_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(&bin)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {bin}: {e}. The console's browser test needs Chromium and \
                     ChromeDriver: run `bash scripts/test-deps.sh` (installs Debian's chromium and \
                     chromium-driver), or set AGQ_CHROMEDRIVER and AGQ_CHROMIUM"
                )
            });
        let driver = Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        driver
    }

    async fn browser(&self, profile: &Path) -> Client {
        let chromium = std::env::var("AGQ_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let caps = serde_json::json!({
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--window-size=1280,800",
                    format!("--user-data-dir={}", profile.display()),
                ]
            }
        });
        let serde_json::Value::Object(caps) = caps else {
            unreachable!()
        };
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a chromium session through chromedriver")
    }
}

/// The page, with waits that retry while htmx swaps the live region.
struct Page {
    b: Client,
    base: String,
    shots: PathBuf,
}

impl Page {
    async fn open(&self, path: &str) {
        self.b
            .goto(&format!("{}{path}", self.base))
            .await
            .expect("goto");
    }

    /// Waits until the text of the first element matching `css` satisfies
    /// `ok`; returns it.
    async fn text_when(&self, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        let mut last = String::new();
        loop {
            if let Ok(e) = self.b.find(Locator::Css(css)).await {
                if let Ok(t) = e.text().await {
                    if ok(&t) {
                        return t;
                    }
                    last = t;
                }
            }
            if Instant::now() > deadline {
                let _ = self.shot("failure").await;
                panic!("{css}: waited {WAIT:?} for {what}; last text {last:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn click(&self, css: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let err = match self.b.find(Locator::Css(css)).await {
                Ok(e) => match e.click().await {
                    Ok(()) => return,
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                let _ = self.shot("failure").await;
                panic!("cannot click {css}: {err}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Enters `token` in the header's token field (empty: forgets it).
    async fn use_token(&self, token: &str) {
        if token.is_empty() {
            self.click("#forget-token").await;
            self.text_when("#token-state", "no token", |t| t == "no token")
                .await;
            return;
        }
        let field = self
            .b
            .find(Locator::Css("#token"))
            .await
            .expect("token field");
        field.send_keys(token).await.expect("type the token");
        self.click("#token-form button[type=submit]").await;
        self.text_when("#token-state", "token set", |t| t.starts_with("token set"))
            .await;
    }

    async fn shot(&self, name: &str) -> PathBuf {
        let png = self.b.screenshot().await.expect("screenshot");
        let path = self.shots.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write screenshot");
        path
    }
}

/// Where the screenshots go: `<target>/ui-screenshots`.
fn screenshot_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir")
        .join("ui-screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_follows_and_fixes_an_action_in_the_browser() {
    // Inputs agw's sandbox may read: 199 files, and one missing file whose
    // job dies with cat's complaint on stderr.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let input = dir.path().join("in");
    std::fs::create_dir(&input).unwrap();
    std::fs::set_permissions(&input, std::fs::Permissions::from_mode(0o755)).unwrap();
    for i in 0..JOBS - 1 {
        std::fs::write(input.join(format!("f{i:03}.txt")), format!("line {i}\n")).unwrap();
    }
    let missing = input.join(format!("f{:03}.txt", JOBS - 1));

    // A real `agq serve` with an auth file; a 1 s heartbeat (stale after
    // 3 s) and a long grace, so that a loaded CI machine loses no lease to
    // a slow heartbeat.
    let auth_file = dir.path().join("auth.toml");
    std::fs::write(
        &auth_file,
        format!(
            "[[tokens]]\ntoken = \"{ADMIN}\"\nrole = \"admin\"\n\n\
             [[tokens]]\ntoken = \"{CLIENT}\"\nrole = \"client\"\n\n\
             [[tokens]]\ntoken = \"{WORKER}\"\nrole = \"worker\"\nworker_id = \"{WORKER_ID}\"\n"
        ),
    )
    .unwrap();
    let serve = process::Serve::new(dir.path().join("agq.db"))
        .args(["--auth-file".as_ref(), auth_file.as_os_str()])
        .args([
            "--heartbeat-interval-ms",
            "1000",
            "--lease-grace-ms",
            "10000",
        ])
        .args([
            "--retry-backoff-base-ms",
            "50",
            "--retry-backoff-max-ms",
            "200",
        ])
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("agq serve starts");
    let mut console = None;
    let deadline = Instant::now() + WAIT;
    while console.is_none() {
        let line = serve
            .next_line_async(deadline)
            .await
            .expect("agq serve prints its console address");
        console = line
            .strip_prefix("console on ")
            .map(|u| u.trim_end_matches('/').to_owned());
    }
    let console = console.unwrap();
    let channel = tonic::transport::Channel::from_shared(serve.url())
        .unwrap()
        .connect()
        .await
        .expect("connect to agq serve");
    let admin = Bearer(Some(ADMIN.into()));
    let mut plans = pb::plan_service_client::PlanServiceClient::with_interceptor(
        channel.clone(),
        admin.clone(),
    );
    let mut actions = pb::action_service_client::ActionServiceClient::with_interceptor(
        channel.clone(),
        admin.clone(),
    );
    let mut workers =
        pb::worker_service_client::WorkerServiceClient::with_interceptor(channel.clone(), admin);

    let scratch = dir.path().join("jobs");
    let mut agw = process::Agw::new(&serve.url(), WORKER_ID)
        .args(["--tools", "cat,tr,sort,uniq", "--max-concurrent-jobs", "8"])
        .args(["--read-path".as_ref(), dir.path().as_os_str()])
        .args(["--scratch-dir".as_ref(), scratch.as_os_str()])
        .env("AGW_TOKEN", WORKER)
        .env("RUST_LOG", "warn")
        .kill_on_drop()
        .spawn();
    agw.wait_registered_async().await;

    let task = |n: u32, command: &str, args: &[&str], from: Option<u32>| pb::Task {
        task_number: n,
        command: command.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        timeout_secs: 30,
        input_from_task: from,
        ..Default::default()
    };
    plans
        .submit_plan(SubmitPlanRequest {
            plan: Some(pb::Plan {
                plan_id: "cat-file".into(),
                plan_description: "Print one file".into(),
                tasks: vec![task(1, "cat", &["{{file}}"], None)],
                ..Default::default()
            }),
            replace: false,
        })
        .await
        .expect("plan cat-file");
    // Two versions of "wordcount": the console lists both.
    for (description, last) in [
        (
            "Count the words of a file",
            vec![task(4, "uniq", &["-c"], Some(3))],
        ),
        (
            "Count the words of a file, most frequent first",
            vec![
                task(4, "uniq", &["-c"], Some(3)),
                task(5, "sort", &["-rn"], Some(4)),
            ],
        ),
    ] {
        let mut tasks = vec![
            task(1, "cat", &["{{file}}"], None),
            task(2, "tr", &["-s", " ", "\n"], Some(1)),
            task(3, "sort", &[], Some(2)),
        ];
        tasks.extend(last);
        plans
            .submit_plan(SubmitPlanRequest {
                plan: Some(pb::Plan {
                    plan_id: "wordcount".into(),
                    plan_description: description.into(),
                    tasks,
                    ..Default::default()
                }),
                replace: true,
            })
            .await
            .expect("plan wordcount");
    }
    let inputs = (0..JOBS)
        .map(|i| ActionInput {
            values: [(
                "file".to_string(),
                input.join(format!("f{i:03}.txt")).display().to_string(),
            )]
            .into(),
        })
        .collect();
    actions
        .submit_action(SubmitActionRequest {
            action_id: "browser-200".into(),
            plan_id: "cat-file".into(),
            inputs,
            // The missing file fails both attempts (50 ms apart); a second
            // attempt keeps a slow machine from killing a healthy job.
            max_attempts: 2,
            ..Default::default()
        })
        .await
        .expect("action of 200 jobs");

    let driver = Driver::start();
    let profile = tempfile::tempdir().expect("profile dir");
    let page = Page {
        b: driver.browser(profile.path()).await,
        base: console.clone(),
        shots: screenshot_dir(),
    };

    // Without a token the data is refused, with a message saying what to do.
    page.open("/actions").await;
    page.text_when("#live .refused", "the no-token refusal", |t| {
        t.contains("no token") && t.contains("Token")
    })
    .await;

    // A client token reads: the action is listed and reaches 100 %.
    page.use_token(CLIENT).await;
    let row = "tr[data-action-id=\"browser-200\"]";
    page.text_when(&format!("{row} .percent"), "100 %", |t| t == "100 %")
        .await;
    page.text_when(
        &format!("{row} td:nth-child(4)"),
        "199 done and 1 dead",
        |t| t.contains("199 done") && t.contains("1 dead"),
    )
    .await;
    page.shot("actions").await;

    // The overview: the queue, the fleet and the dead job.
    page.open("/").await;
    page.text_when("#d-h + table", "the dead job listed", |t| {
        t.contains("No such file or directory")
    })
    .await;
    page.shot("overview").await;
    page.open("/actions").await;

    // The action's page: counts, and its jobs one page at a time.
    page.click(&format!("{row} a")).await;
    page.text_when("#percent", "100 %", |t| t == "100 %").await;
    page.text_when("#n-dead", "1 dead", |t| t == "1").await;
    assert_eq!(
        page.b
            .find_all(Locator::Css("tr[data-job-id]"))
            .await
            .unwrap()
            .len(),
        50,
        "one page of jobs"
    );
    page.shot("action").await;

    // The dead job's page shows cat's stderr.
    page.open("/actions/browser-200?status=dead").await;
    page.text_when("tr[data-job-id] td:nth-child(2)", "a dead job", |t| {
        t == "dead"
    })
    .await;
    page.click("tr[data-job-id] a").await;
    page.text_when("#stderr-1", "cat's complaint", |t| {
        t.contains("No such file or directory")
    })
    .await;
    page.text_when("#job-status", "dead", |t| t == "dead").await;
    let dead_job = page
        .b
        .current_url()
        .await
        .unwrap()
        .path()
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned();
    page.shot("job").await;

    // The file appears; without a token, retrying is refused.
    std::fs::write(&missing, "late line\n").unwrap();
    std::fs::set_permissions(&missing, std::fs::Permissions::from_mode(0o644)).unwrap();
    page.open("/actions/browser-200").await;
    page.use_token("").await;
    page.click("#retry-action").await;
    page.text_when("#flash", "the refusal", |t| {
        t.starts_with("Refused: no token") && t.contains("admin token")
    })
    .await;
    page.shot("refused").await;
    let job_state = |id: String| {
        let channel = channel.clone();
        async move {
            pb::job_service_client::JobServiceClient::with_interceptor(
                channel,
                Bearer(Some(CLIENT.into())),
            )
            .get_job(pb::GetJobRequest { job_id: id })
            .await
            .expect("GetJob")
            .into_inner()
            .job
            .expect("job")
            .status
        }
    };
    assert_eq!(
        job_state(dead_job.clone()).await,
        pb::JobStatus::Dead as i32,
        "a refused retry changes nothing"
    );

    // With an admin token the retry brings the job back, and it completes.
    page.use_token(ADMIN).await;
    page.click("#retry-action").await;
    page.text_when("#flash", "the retry's answer", |t| t == "Retried 1 job.")
        .await;
    page.text_when("#n-dead", "no dead job", |t| t == "0").await;
    page.text_when("#n-completed", "200 completed", |t| t == "200")
        .await;
    assert_eq!(job_state(dead_job).await, pb::JobStatus::Completed as i32);

    // The workers page shows the worker; a client may not drain it, an
    // admin may.
    page.open("/workers").await;
    let wrow = format!("tr[data-worker-id=\"{WORKER_ID}\"]");
    page.text_when(&format!("{wrow} td:nth-child(2)"), "active", |t| {
        t.starts_with("active")
    })
    .await;
    page.text_when("#stale-after", "the stale threshold", |t| t == "3.0 s")
        .await;
    page.shot("workers").await;
    page.use_token(CLIENT).await;
    page.click(&format!("{wrow} button.drain")).await;
    page.text_when("#flash", "the role refusal", |t| {
        t.starts_with("Refused: this token's role may not do this")
    })
    .await;
    page.use_token(ADMIN).await;
    page.click(&format!("{wrow} button.drain")).await;
    page.text_when("#flash", "the drain's answer", |t| {
        t.contains("is draining")
    })
    .await;
    // An idle agw that is told to drain has nothing to finish: it
    // unregisters and exits 0, and the page shows that.
    page.text_when(
        &format!("{wrow} td:nth-child(2)"),
        "draining, then unregistered",
        |t| t.starts_with("draining") || t.starts_with("unregistered"),
    )
    .await;
    assert_eq!(
        agw.wait_exit_async(WAIT).await.code(),
        Some(0),
        "the drained agw exits cleanly"
    );
    page.text_when(&format!("{wrow} td:nth-child(2)"), "unregistered", |t| {
        t.starts_with("unregistered")
    })
    .await;
    let state = workers
        .get_worker(pb::GetWorkerRequest {
            worker_id: WORKER_ID.into(),
        })
        .await
        .expect("GetWorker")
        .into_inner()
        .worker
        .expect("worker")
        .state;
    assert_eq!(state, pb::WorkerState::Unregistered as i32);
    // A departed worker can be forgotten (after a confirmation).
    page.click(&format!("{wrow} button.forget")).await;
    page.b.accept_alert().await.expect("confirm the forget");
    page.text_when("#flash", "the forget's answer", |t| {
        t.contains("is forgotten")
    })
    .await;
    page.text_when("#live", "no worker row", |t| {
        t.contains("No workers have registered")
    })
    .await;

    // The plan as a pipeline, the plans list, the overview; the action
    // page at a phone's width.
    page.open("/plans/wordcount").await;
    page.text_when("svg.diagram", "the diagram", |_| true).await;
    page.text_when("table.versions", "both versions", |t| {
        t.contains("most frequent first") && t.contains("Count the words of a file")
    })
    .await;
    let edges = page
        .b
        .find_all(Locator::Css("svg.diagram path.edge"))
        .await
        .unwrap();
    assert_eq!(edges.len(), 4, "one arrow per input_from_task of version 2");
    page.shot("plan").await;
    page.open("/plans/wordcount?version=1").await;
    page.text_when("#live p strong", "version 1", |t| t == "Version 1")
        .await;
    let edges = page
        .b
        .find_all(Locator::Css("svg.diagram path.edge"))
        .await
        .unwrap();
    assert_eq!(edges.len(), 3, "version 1: four tasks, three arrows");
    page.open("/plans").await;
    page.text_when("table.plans", "both plans", |t| {
        t.contains("wordcount") && t.contains("cat-file")
    })
    .await;
    page.shot("plans").await;
    page.open("/").await;
    page.text_when("#q-ready", "the queue", |t| t == "0").await;
    page.b.set_window_size(390, 844).await.expect("phone width");
    page.open("/actions/browser-200").await;
    page.text_when("#percent", "100 %", |t| t == "100 %").await;
    let overflow = page
        .b
        .execute(
            "return document.documentElement.scrollWidth > window.innerWidth + 1",
            vec![],
        )
        .await
        .expect("measure");
    assert_eq!(
        overflow,
        serde_json::Value::Bool(false),
        "no sideways scrolling at 390 px"
    );
    page.shot("action-phone").await;

    page.b.close().await.expect("close the browser");
    drop(agw);
    let mut serve = serve;
    assert!(
        serve.terminate().is_some_and(|st| st.success()),
        "agq serve stops cleanly on SIGTERM"
    );
}
