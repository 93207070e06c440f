//! Test harness: a real AGQ server on 127.0.0.1:0 with a temporary
//! database, generated clients, and simulated workers that drive the
//! WorkerService like agw does. A test server keeps its state in SQLite
//! or, with [`TestStore::Postgres`], in a fresh database of the throwaway
//! PostgreSQL cluster of [`pg`]; [`store_tests!`] runs a test on both.
#![allow(dead_code)]

pub use agq_testpg as pg;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use agq::{
    auth::Authenticator,
    config::{EngineConfig, Store},
    local::LocalServer,
    pb::{self, *},
    server::ServerOptions,
};
use tokio::{sync::mpsc, task::JoinHandle};
use tokio_stream::{wrappers::ReceiverStream, StreamExt};
use tonic::{
    metadata::MetadataValue, service::interceptor::InterceptedService, transport::Channel, Request,
    Status,
};

/// Short intervals so no test waits long: heartbeat 200 ms (stale after
/// 600 ms), grace 400 ms, backoff 50 ms.
pub fn fast_config() -> EngineConfig {
    EngineConfig {
        heartbeat_interval: Duration::from_millis(200),
        lease_grace: Duration::from_millis(400),
        retry_backoff_base: Duration::from_millis(50),
        retry_backoff_max: Duration::from_millis(200),
        ..EngineConfig::default()
    }
}

/// The store a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestStore {
    /// SQLite at the test's database path.
    Sqlite,
    /// A fresh database of the test PostgreSQL server ([`pg`]).
    Postgres,
}

/// Where a test server keeps its state, resolved: start a server again on
/// the same [`Backing`] to reopen the same database.
#[derive(Debug, Clone)]
pub struct Backing {
    pub test_store: TestStore,
    /// [`ServerOptions::store`].
    pub store: Store,
    /// [`ServerOptions::db`]: the SQLite file; with PostgreSQL, a path no
    /// SQLite database can be created at (see [`Backing::new`]).
    pub db: PathBuf,
}

impl Backing {
    /// SQLite at `db`, or a fresh PostgreSQL database. With PostgreSQL the
    /// server's SQLite path lies under a regular file, so a server that
    /// opened SQLite instead of the PostgreSQL store fails to start rather
    /// than pass the test on the wrong store.
    pub async fn new(test_store: TestStore, db: &Path) -> Backing {
        match test_store {
            TestStore::Sqlite => Backing {
                test_store,
                store: Store::Sqlite,
                db: db.to_path_buf(),
            },
            TestStore::Postgres => {
                let parent = db.parent().unwrap_or(Path::new("."));
                std::fs::create_dir_all(parent).unwrap();
                let blocker = parent.join("postgres-store-has-no-sqlite-file");
                std::fs::write(&blocker, "the PostgreSQL store must not open SQLite\n").unwrap();
                Backing {
                    test_store,
                    store: Store::Postgres(pg::fresh_database().await),
                    db: blocker.join("agq.db"),
                }
            }
        }
    }
}

/// A running server: an [`agq::local::LocalServer`] and its database.
pub struct TestServer {
    pub addr: SocketAddr,
    /// Address of `GET /metrics`, when started with one.
    pub metrics_addr: Option<SocketAddr>,
    /// `http://ADDR` of the web console, when started with it.
    pub console_url: Option<String>,
    /// The SQLite file ([`Backing::db`]).
    pub db: PathBuf,
    /// Where the state is: [`TestServer::start_on`] reopens it.
    pub backing: Backing,
    server: LocalServer,
}

impl TestServer {
    /// Starts a server on SQLite at `db` (created if missing).
    pub async fn start(db: &Path, cfg: EngineConfig) -> TestServer {
        Self::start_with(db, cfg, Authenticator::default(), None).await
    }

    /// Starts a server on `store`: SQLite at `db`, or a fresh PostgreSQL
    /// database.
    pub async fn start_store(store: TestStore, db: &Path, cfg: EngineConfig) -> TestServer {
        Self::start_store_with(store, db, cfg, Authenticator::default(), None).await
    }

    /// [`TestServer::start_store`] with auth, optionally on a fixed address.
    pub async fn start_store_with(
        store: TestStore,
        db: &Path,
        cfg: EngineConfig,
        auth: Authenticator,
        addr: Option<SocketAddr>,
    ) -> TestServer {
        let b = Backing::new(store, db).await;
        Self::start_full(&b, cfg, auth, addr, false, false).await
    }

    /// [`TestServer::start_store`] also serving `GET /metrics` on
    /// 127.0.0.1:0.
    pub async fn start_store_with_metrics(
        store: TestStore,
        db: &Path,
        cfg: EngineConfig,
    ) -> TestServer {
        let b = Backing::new(store, db).await;
        Self::start_full(&b, cfg, Authenticator::default(), None, true, false).await
    }

    /// [`TestServer::start_store`] also serving `GET /metrics` and the web
    /// console on 127.0.0.1:0.
    pub async fn start_store_with_console(
        store: TestStore,
        db: &Path,
        cfg: EngineConfig,
        auth: Authenticator,
    ) -> TestServer {
        let b = Backing::new(store, db).await;
        Self::start_full(&b, cfg, auth, None, true, true).await
    }

    /// Starts a server on an existing backing (a restart: the same SQLite
    /// file or PostgreSQL database).
    pub async fn start_on(backing: &Backing, cfg: EngineConfig) -> TestServer {
        Self::start_on_with(backing, cfg, Authenticator::default(), None).await
    }

    /// [`TestServer::start_on`] with auth, optionally on a fixed address.
    pub async fn start_on_with(
        backing: &Backing,
        cfg: EngineConfig,
        auth: Authenticator,
        addr: Option<SocketAddr>,
    ) -> TestServer {
        Self::start_full(backing, cfg, auth, addr, false, false).await
    }

    /// Starts a server with auth, optionally on a fixed address.
    pub async fn start_with(
        db: &Path,
        cfg: EngineConfig,
        auth: Authenticator,
        addr: Option<SocketAddr>,
    ) -> TestServer {
        Self::start_full(&sqlite(db), cfg, auth, addr, false, false).await
    }

    /// Starts a server that also serves `GET /metrics` and the web console
    /// on 127.0.0.1:0.
    pub async fn start_with_console(
        db: &Path,
        cfg: EngineConfig,
        auth: Authenticator,
    ) -> TestServer {
        Self::start_full(&sqlite(db), cfg, auth, None, true, true).await
    }

    /// Starts a server that also serves `GET /metrics` on 127.0.0.1:0.
    pub async fn start_with_metrics(db: &Path, cfg: EngineConfig) -> TestServer {
        Self::start_full(
            &sqlite(db),
            cfg,
            Authenticator::default(),
            None,
            true,
            false,
        )
        .await
    }

    async fn start_full(
        backing: &Backing,
        cfg: EngineConfig,
        auth: Authenticator,
        addr: Option<SocketAddr>,
        metrics: bool,
        console: bool,
    ) -> TestServer {
        let opts = ServerOptions {
            store_ca_file: None,
            store: backing.store.clone(),
            sqlite_synchronous: Default::default(),
            db: backing.db.clone(),
            engine: cfg,
            auth,
            tls: None,
            shutdown_grace: Duration::from_secs(2),
            request_buffer_bytes: agq::request_budget::DEFAULT_REQUEST_BUFFER_BYTES,
        };
        let handle = tokio::runtime::Handle::current();
        let server = LocalServer::start_with(&handle, opts, addr, metrics, console)
            .await
            .unwrap_or_else(|e| panic!("server failed to start: {e}"));
        TestServer {
            addr: server.addr(),
            metrics_addr: server.metrics_addr(),
            console_url: server.console_url(),
            db: backing.db.clone(),
            backing: backing.clone(),
            server,
        }
    }

    /// Runs `sql` (statements, no parameters) on the server's database
    /// from a connection of its own, beside the server: to put a stored
    /// row into a state no RPC makes.
    pub async fn exec_sql(&self, sql: &str) {
        match &self.backing.store {
            agq::config::Store::Postgres(url) => {
                pg::connect(url).await.batch_execute(sql).await.unwrap();
            }
            _ => {
                let conn = rusqlite::Connection::open(&self.db).unwrap();
                conn.busy_timeout(Duration::from_secs(10)).unwrap();
                conn.execute_batch(sql).unwrap();
            }
        }
    }

    /// Stops the server gracefully and waits until the database is closed.
    pub async fn stop(self) {
        tokio::time::timeout(Duration::from_secs(20), self.server.stop())
            .await
            .expect("server did not stop in time")
            .expect("server returned an error");
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.url())
            .unwrap()
            .connect()
            .await
            .expect("connect")
    }

    pub async fn plans(&self) -> plan_service_client::PlanServiceClient<Channel> {
        plan_service_client::PlanServiceClient::new(self.channel().await)
    }
    pub async fn actions(&self) -> action_service_client::ActionServiceClient<Channel> {
        action_service_client::ActionServiceClient::new(self.channel().await)
    }
    pub async fn jobs(&self) -> job_service_client::JobServiceClient<Channel> {
        job_service_client::JobServiceClient::new(self.channel().await)
    }
    pub async fn workers(&self) -> worker_service_client::WorkerServiceClient<Channel> {
        worker_service_client::WorkerServiceClient::new(self.channel().await)
    }
    pub async fn queue(&self) -> queue_service_client::QueueServiceClient<Channel> {
        queue_service_client::QueueServiceClient::new(self.channel().await)
    }
    pub async fn schedules(&self) -> schedule_service_client::ScheduleServiceClient<Channel> {
        schedule_service_client::ScheduleServiceClient::new(self.channel().await)
    }
}

/// The backing of SQLite at `db`.
fn sqlite(db: &Path) -> Backing {
    Backing {
        test_store: TestStore::Sqlite,
        store: Store::Sqlite,
        db: db.to_path_buf(),
    }
}

/// Runs each listed test on both stores. Every name is an
/// `async fn NAME(store: TestStore)` of the test file; the macro writes
/// `sqlite::NAME` and `postgres::NAME`, `#[tokio::test]`s calling it with
/// [`TestStore::Sqlite`] and [`TestStore::Postgres`] (run one half with
/// `cargo test --test FILE sqlite::` or `postgres::`).
#[allow(unused_macros)]
macro_rules! store_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($crate::common::TestStore::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($crate::common::TestStore::Postgres).await
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use store_tests;

/// An interceptor adding a bearer token.
#[derive(Clone)]
pub struct Bearer(pub Option<String>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert(
                "authorization",
                MetadataValue::try_from(format!("Bearer {t}")).unwrap(),
            );
        }
        Ok(req)
    }
}

/// A channel whose calls carry `token`.
pub type Authed = InterceptedService<Channel, Bearer>;

/// A one-task plan running `cmd`.
pub fn plan(id: &str, cmds: &[&str]) -> pb::Plan {
    pb::Plan {
        plan_id: id.into(),
        plan_description: format!("test plan {id}"),
        tasks: cmds
            .iter()
            .enumerate()
            .map(|(i, c)| pb::Task {
                task_number: i as u32 + 1,
                command: c.to_string(),
                args: vec![],
                timeout_secs: 30,
                input_from_task: None,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Submits `plan` and an action with `n` inputs; returns (action_id, job_ids).
pub async fn submit(
    server: &TestServer,
    p: pb::Plan,
    n: usize,
    max_attempts: u32,
) -> (String, Vec<String>) {
    let plan_id = p.plan_id.clone();
    let _ = server
        .plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(p),
            replace: false,
        })
        .await;
    let inputs = (0..n)
        .map(|i| ActionInput {
            values: [("n".to_string(), i.to_string())].into_iter().collect(),
        })
        .collect();
    let r = server
        .actions()
        .await
        .submit_action(SubmitActionRequest {
            plan_id,
            inputs,
            max_attempts,
            ..Default::default()
        })
        .await
        .expect("submit action")
        .into_inner();
    (r.action_id, r.job_ids)
}

pub async fn job(server: &TestServer, id: &str) -> pb::Job {
    server
        .jobs()
        .await
        .get_job(GetJobRequest { job_id: id.into() })
        .await
        .expect("get job")
        .into_inner()
        .job
        .unwrap()
}

pub async fn worker(server: &TestServer, id: &str) -> pb::Worker {
    server
        .workers()
        .await
        .get_worker(GetWorkerRequest {
            worker_id: id.into(),
        })
        .await
        .expect("get worker")
        .into_inner()
        .worker
        .unwrap()
}

/// Polls `f` every 20 ms until it returns true or `secs` pass.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if f().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A simulated worker: registers, heartbeats on a timer over the
/// bidirectional stream, and receives leases on the server stream.
pub struct SimWorker {
    pub id: String,
    client: worker_service_client::WorkerServiceClient<Channel>,
    hb_tx: Option<mpsc::Sender<HeartbeatRequest>>,
    hb_task: Option<JoinHandle<()>>,
    pub commands: mpsc::UnboundedReceiver<heartbeat_response::Command>,
    cmd_tx: mpsc::UnboundedSender<heartbeat_response::Command>,
    /// The `cancel_lease_id` of each cancel command, in order.
    pub cancel_leases: mpsc::UnboundedReceiver<String>,
    cancel_tx: mpsc::UnboundedSender<String>,
    leases: Option<tonic::Streaming<JobLease>>,
    pub interval: Duration,
}

impl SimWorker {
    /// Registers `id` with `tools` and `max` slots and opens both streams.
    pub async fn start(server: &TestServer, id: &str, tools: &[&str], max: u32) -> SimWorker {
        Self::start_tagged(server, id, tools, max, &[]).await
    }

    /// [`SimWorker::start`] with tags (labels), `key=value` pairs.
    pub async fn start_tagged(
        server: &TestServer,
        id: &str,
        tools: &[&str],
        max: u32,
        tags: &[(&str, &str)],
    ) -> SimWorker {
        let mut client = server.workers().await;
        let r = client
            .register_worker(RegisterWorkerRequest {
                worker_id: id.into(),
                hostname: "test-host".into(),
                platform: "linux-x86_64".into(),
                agw_version: "sim".into(),
                capabilities: Some(WorkerCapabilities {
                    tools: tools.iter().map(|t| t.to_string()).collect(),
                    agentic_units: vec![],
                    units: vec![],
                }),
                max_concurrent_jobs: max,
                tags: tags
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            })
            .await
            .expect("register")
            .into_inner();
        let (cmd_tx, commands) = mpsc::unbounded_channel();
        let (cancel_tx, cancel_leases) = mpsc::unbounded_channel();
        let mut w = SimWorker {
            id: id.into(),
            client,
            hb_tx: None,
            hb_task: None,
            commands,
            cmd_tx,
            cancel_leases,
            cancel_tx,
            leases: None,
            interval: Duration::from_millis(r.heartbeat_interval_ms as u64),
        };
        w.connect(None).await;
        w
    }

    /// Opens (or reopens) the heartbeat stream, sending `held` lease ids on
    /// its first message when given, then the lease stream.
    pub async fn connect(&mut self, held: Option<Vec<String>>) {
        self.disconnect();
        let (tx, rx) = mpsc::channel(16);
        tx.send(HeartbeatRequest {
            worker_id: self.id.clone(),
            stats: Some(WorkerStats::default()),
            held_leases: held.map(|lease_ids| HeldLeases { lease_ids }),
            verification: None,
        })
        .await
        .unwrap();
        let mut inbound = self
            .client
            .heartbeat(ReceiverStream::new(rx))
            .await
            .expect("heartbeat stream")
            .into_inner();
        let id = self.id.clone();
        let interval = self.interval;
        let beat = tx.clone();
        let cmd_tx = self.cmd_tx.clone();
        let cancel_tx = self.cancel_tx.clone();
        self.hb_task = Some(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval / 2);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {
                        let req = HeartbeatRequest { worker_id: id.clone(), stats: Some(WorkerStats::default()), held_leases: None, verification: None };
                        if beat.send(req).await.is_err() { return; }
                    }
                    msg = inbound.next() => match msg {
                        Some(Ok(resp)) => if let Some(c) = resp.command {
                            if matches!(c, heartbeat_response::Command::CancelJobId(_)) {
                                let _ = cancel_tx.send(resp.cancel_lease_id);
                            }
                            let _ = cmd_tx.send(c);
                        },
                        _ => return,
                    }
                }
            }
        }));
        self.hb_tx = Some(tx);
        let leases = self
            .client
            .lease_jobs(LeaseJobsRequest {
                worker_id: self.id.clone(),
            })
            .await
            .expect("lease stream")
            .into_inner();
        self.leases = Some(leases);
    }

    /// Drops both streams (a crash or a network cut).
    pub fn disconnect(&mut self) {
        if let Some(t) = self.hb_task.take() {
            t.abort();
        }
        self.hb_tx = None;
        self.leases = None;
    }

    /// Takes the lease stream out, so that a later [`SimWorker::connect`]
    /// leaves it open: a stream the worker lost (its connection broke)
    /// that still looks open to the server.
    pub fn take_lease_stream(&mut self) -> Option<tonic::Streaming<JobLease>> {
        self.leases.take()
    }

    /// Stops heartbeating but keeps the streams open (a frozen process).
    pub fn freeze(&mut self) {
        if let Some(t) = self.hb_task.take() {
            t.abort();
        }
    }

    /// The next lease, or None if none arrives within `ms`.
    pub async fn lease_within(&mut self, ms: u64) -> Option<JobLease> {
        let s = self.leases.as_mut()?;
        match tokio::time::timeout(Duration::from_millis(ms), s.next()).await {
            Ok(Some(Ok(l))) => Some(l),
            _ => None,
        }
    }

    /// The next lease; panics if none arrives within 5 s.
    pub async fn lease(&mut self) -> JobLease {
        self.lease_within(5000)
            .await
            .unwrap_or_else(|| panic!("{} got no lease", self.id))
    }

    /// Reports `status` for `lease`.
    pub async fn report(
        &mut self,
        lease: &JobLease,
        status: JobStatus,
    ) -> Result<UpdateJobResponse, Status> {
        let job_id = lease.job.as_ref().unwrap().job_id.clone();
        self.client
            .update_job(UpdateJobRequest {
                job_id,
                worker_id: self.id.clone(),
                lease_id: lease.lease_id.clone(),
                status: status as i32,
                task_results: vec![TaskResult {
                    task_number: 1,
                    command: "x".into(),
                    exit_code: if status == JobStatus::Completed { 0 } else { 1 },
                    ..Default::default()
                }],
                error: if status == JobStatus::Failed {
                    "boom".into()
                } else {
                    String::new()
                },
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn complete(&mut self, lease: &JobLease) {
        self.report(lease, JobStatus::Completed)
            .await
            .expect("complete");
    }

    /// The next command pushed over the heartbeat stream within `ms`.
    pub async fn command_within(&mut self, ms: u64) -> Option<heartbeat_response::Command> {
        tokio::time::timeout(Duration::from_millis(ms), self.commands.recv())
            .await
            .ok()
            .flatten()
    }

    pub fn client(&self) -> worker_service_client::WorkerServiceClient<Channel> {
        self.client.clone()
    }
}

impl Drop for SimWorker {
    fn drop(&mut self) {
        self.disconnect();
    }
}

/// The invariant of issue 3: no job is running without a live or
/// recoverable lease — its worker is ACTIVE or DRAINING (it will heartbeat,
/// or turn DEAD and lose the lease).
pub async fn assert_nothing_stranded(server: &TestServer) {
    let mut jobs = server.jobs().await;
    let running = jobs
        .search_jobs(SearchJobsRequest {
            status: JobStatus::Running as i32,
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .job_ids;
    for id in running {
        let j = job(server, &id).await;
        let w = worker(server, &j.worker_id).await;
        assert!(
            w.state == WorkerState::Active as i32 || w.state == WorkerState::Draining as i32,
            "job {id} is running on {} which is {:?}",
            j.worker_id,
            WorkerState::try_from(w.state)
        );
        assert!(
            w.active_leases > 0,
            "job {id} running but its worker holds no lease"
        );
    }
}

/// The value of the sample `name` (a metric name with its labels, e.g.
/// `agq_store_up`) in the server's `GetMetrics` text; panics when absent.
pub async fn metric(server: &TestServer, name: &str) -> f64 {
    let body = server
        .queue()
        .await
        .get_metrics(GetMetricsRequest {
            format: "prometheus".into(),
        })
        .await
        .expect("GetMetrics")
        .into_inner()
        .body;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in metrics:\n{body}"))
}

/// Asserts that the PostgreSQL store's kept job counts (`job_counts`,
/// what `/metrics` reads) equal a count of the job rows, by status, in
/// one statement (one snapshot: a transaction committing meanwhile
/// cannot make them differ). Panics with the differences.
pub async fn assert_job_counts_kept(db: &tokio_postgres::Client) {
    let off: Vec<(i16, i64)> = db
        .query(
            "SELECT status, sum(n)::bigint FROM (
                 SELECT status, n FROM job_counts
                 UNION ALL SELECT status, -count(*) FROM jobs GROUP BY status) t
             GROUP BY status HAVING sum(n) <> 0 ORDER BY status",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        off.is_empty(),
        "job_counts less a count of the job rows, by status: {off:?}"
    );
}
