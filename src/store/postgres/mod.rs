//! The PostgreSQL engine, AGQ's clustered mode: any number of `agq serve`
//! replicas share one PostgreSQL database, which holds the whole state.
//! A replica keeps in memory only the streams of the workers connected to
//! it (their heartbeat freshness, the lease ids it pushed on their current
//! lease stream) and a cache of immutable plan versions. Every time that
//! decides anything comes from the database's clock (`agq_now_ms()`).
//!
//! Where things are: the job state machine in [`jobs`], worker streams and
//! lifecycle in [`workers`], lease claims in [`dispatch`], the maintenance
//! leader (lease expiry, backoff promotion, stale workers, retention,
//! schedules) in [`maintenance`], LISTEN/NOTIFY in [`listen`], rows to
//! domain types in [`rows`], the schema and its migrations in [`schema`].
//! docs/scaling.md describes the design and its failure table.

mod completions;
mod dispatch;
mod jobs;
mod listen;
mod maintenance;
mod rows;
mod schedules;
mod schema;
mod workers;

pub use dispatch::{CLAIM, CLAIM_SETTINGS, READY_CHECK};
pub use maintenance::{FOLD_JOB_COUNTS, SELECTOR_DROP_CANDIDATES};
pub use workers::QUEUE_STATS;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::{
    sync::{watch, Notify},
    task::JoinHandle,
};

use crate::{
    config::EngineConfig,
    core::{
        engine::{EventTx, HeartbeatEvent},
        model::{JobLease, Plan},
        watch::Watchers,
    },
    error::{Error, Result},
    metrics::SharedMetrics,
};

/// Channel of `NOTIFY` sent once per committed batch that made jobs ready.
const READY_CHANNEL: &str = "agq_ready";
/// Channel of `NOTIFY` naming workers with new commands (comma-separated).
const COMMAND_CHANNEL: &str = "agq_commands";
/// How often a WatchAction stream re-reads its action when no change was
/// notified: a replica that dies between a commit and its watch `NOTIFY`
/// (sent within about 10 ms) takes the notification with it, and the
/// watchers of that change learn of it by this re-read at the latest.
const WATCH_REREAD: Duration = Duration::from_secs(10);
/// Channel of `NOTIFY` naming actions whose jobs changed (comma-separated,
/// or `*` for all).
const WATCH_CHANNEL: &str = "agq_watch";
/// Channel of `NOTIFY` sent when a plan with `require_verified_tools` is
/// stored (payload: its id): every replica challenges the workers
/// connected to it for the tools they have not passed yet.
const VERIFY_CHANNEL: &str = "agq_verify";
/// How often a replica challenges its connected workers without having
/// been woken, at most: a challenge that could not be sent when a plan
/// asked for it (the database unreachable) is sent by then.
const CHALLENGE_SWEEP: Duration = Duration::from_secs(10);
/// Largest `NOTIFY` payload AGQ sends, in bytes (PostgreSQL's limit is
/// 8000).
const MAX_PAYLOAD: usize = 7000;

/// How often a dispatcher claims without having been woken, at most: a
/// lost notification delays a lease by no more than this.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Connections of one replica's pool.
const POOL_SIZE: usize = 16;

/// One stream of a worker held by this replica.
struct StreamSlot<T> {
    id: u64,
    tx: EventTx<T>,
}

/// A worker whose streams this replica holds.
struct LocalWorker {
    /// `workers.conn_epoch` when this replica took its heartbeat stream:
    /// every write the replica makes for the worker is fenced by it.
    epoch: i64,
    heartbeat: Option<StreamSlot<HeartbeatEvent>>,
    lease: Option<StreamSlot<JobLease>>,
    /// Last heartbeat received here.
    last_heartbeat: Instant,
    /// Lease ids pushed on the current lease stream within the last
    /// 3 x heartbeat interval, with when: they may still be in flight, so
    /// a heartbeat that does not name them loses nothing. Older ones have
    /// arrived (or the stream is gone, and a new one clears the map).
    in_flight: HashMap<String, Instant>,
    /// Commands it advertises, sorted.
    tools: Vec<String>,
    /// Tags, for worker selectors.
    tags: HashMap<String, String>,
    sandboxed: bool,
    max: u32,
}

/// What a replica keeps in memory.
#[derive(Default)]
struct Local {
    workers: HashMap<String, LocalWorker>,
    next_stream_id: u64,
    /// Actions touched since the last watch notification.
    touched: HashSet<String>,
}

impl Local {
    /// Forgets worker `id`'s entry once this replica holds neither of its
    /// streams: an entry lives only as long as a stream it holds, or every
    /// worker id that ever connected here would stay in memory.
    fn forget_streamless(&mut self, id: &str) {
        if self
            .workers
            .get(id)
            .is_some_and(|w| w.heartbeat.is_none() && w.lease.is_none())
        {
            self.workers.remove(id);
        }
    }

    /// Ends every stream of worker `id` held here and forgets its entry:
    /// the heartbeat stream gets `end` as its last event (or just closes,
    /// for a caller that answers the worker itself), the lease stream
    /// closes. Returns the entry's epoch (`None` without an entry), for
    /// [`workers::clear_stream_flags`], which the caller runs once it has
    /// let go of the lock.
    fn end_streams(&mut self, id: &str, end: Option<Error>) -> Option<i64> {
        let w = self.workers.remove(id)?;
        if let (Some(hb), Some(end)) = (w.heartbeat, end) {
            let _ = hb.tx.send(HeartbeatEvent::End(end));
        }
        Some(w.epoch)
    }
}

/// A cached plan version with its stamp ([`rows::PLAN_STAMP`]).
type StampedPlan = (String, Arc<Plan>);

/// The PostgreSQL engine of one replica. Cheap to share behind an `Arc`.
pub struct PgEngine {
    /// TLS for connections whose `sslmode` asks for it.
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    /// This engine, for tasks it spawns from `&self`.
    me: std::sync::Weak<PgEngine>,
    pool: Pool,
    /// The connection string, for the listener's own connection.
    pg_config: tokio_postgres::Config,
    cfg: EngineConfig,
    metrics: SharedMetrics,
    watchers: Arc<Watchers>,
    /// This replica's id (`hostname-uuid`), in `workers.replica_id`.
    replica_id: String,
    local: Mutex<Local>,
    /// Plan versions by (id, version), each with its stamp
    /// ([`rows::PLAN_STAMP`]): immutable rows, cached for leases.
    plans: Mutex<HashMap<(String, u32), StampedPlan>>,
    /// Wakes the dispatcher (jobs ready, a slot freed, a stream opened).
    dispatch_wake: Notify,
    /// Wakes the command pump (commands for local workers).
    commands_wake: Notify,
    /// Wakes the watch notifier.
    watch_wake: Notify,
    /// Wakes the schedule firing loop.
    schedules_wake: Notify,
    /// Wakes the challenge loop (a plan with `require_verified_tools` was
    /// stored, on any replica).
    verify_wake: Notify,
    health: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    closed: AtomicBool,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Leases granted by this replica (for the enqueue-to-lease metric).
    granted: AtomicU64,
    /// Completion reports for the group commit ([`completions`]).
    completions: tokio::sync::mpsc::Sender<completions::Completion>,
}

/// Locks a mutex, recovering from poisoning (the data are plain maps).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps a database error: a lost or refused connection is
/// `StoreUnavailable` (the client retries; health turns NOT_SERVING), any
/// other is a storage error (`Internal`).
/// `sql` as a statement prepared once per pooled connection: the hot
/// statements (claims, reports, heartbeats, submits) are parsed and
/// planned once, not at every call.
///
/// Errors: storage errors (the statement could not be prepared).
async fn cached(
    c: &impl deadpool_postgres::GenericClient,
    sql: &str,
) -> Result<tokio_postgres::Statement> {
    c.prepare_cached(sql).await.map_err(db_err)
}

fn db_err(e: tokio_postgres::Error) -> Error {
    let io = std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>());
    if e.is_closed() || io {
        tracing::warn!(error = %e, "database unreachable");
        return Error::StoreUnavailable("the PostgreSQL database is unreachable");
    }
    let code = e.code().map(|c| c.code()).unwrap_or_default();
    // Connection-class (08), admin shutdown (57P0x), too many connections
    // (53300): the database is unavailable, not the request wrong.
    if code.starts_with("08") || code.starts_with("57P") || code == "53300" {
        tracing::warn!(error = %e, "database unavailable");
        return Error::StoreUnavailable("the PostgreSQL database is unavailable");
    }
    // A deadlock or serialization failure between replicas: the
    // transaction was rolled back; the client retries.
    if code == "40P01" || code == "40001" {
        return Error::StoreBusy(format!(
            "a concurrent transaction conflicted ({code}); retry"
        ));
    }
    Error::Storage {
        detail: format!("{e}: {}", e.as_db_error().map_or("", |d| d.message())),
        fault: None,
    }
}

/// TCP keepalive idle time of a database connection unless the URL sets
/// `keepalives_idle`: an idle connection whose peer is gone (a NAT entry
/// dropped, a failover) is found after this plus
/// [`KEEPALIVE_INTERVAL`] × [`KEEPALIVE_RETRIES`].
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// Interval between TCP keepalive probes, unless the URL sets
/// `keepalives_interval`.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered keepalive probes before the connection is dropped, unless
/// the URL sets `keepalives_retries`.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// Longest time data sent on a database connection may stay
/// unacknowledged by the peer's TCP before the connection is dropped
/// (`TCP_USER_TIMEOUT`), unless the URL sets `tcp_user_timeout`: a
/// statement sent into a silently dropped connection fails after this, not
/// after the kernel's retransmissions (about 15 minutes).
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest time to open a database connection, unless the URL sets
/// `connect_timeout`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Applies the connection settings every replica connection gets: a
/// session idle in a transaction ends after 60 s (a replica paused mid-way
/// must not hold row locks for long), TCP keepalive and a TCP user timeout
/// (a connection silently dropped by the network fails within about 30 s
/// instead of stalling the replica's dispatcher and calls), and a connect
/// timeout. A value the URL sets itself is kept; TCP keepalive stays off
/// when the URL says `keepalives=0`. tokio-postgres' default keepalive
/// idle time (2 hours) cannot be told from one the URL sets to the same
/// value, and is replaced.
fn connection_settings(c: &mut tokio_postgres::Config) {
    let options = format!(
        "{} -c idle_in_transaction_session_timeout=60000",
        c.get_options().unwrap_or_default()
    );
    c.options(options.trim());
    if c.get_keepalives() {
        if c.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
            c.keepalives_idle(KEEPALIVE_IDLE);
        }
        if c.get_keepalives_interval().is_none() {
            c.keepalives_interval(KEEPALIVE_INTERVAL);
        }
        if c.get_keepalives_retries().is_none() {
            c.keepalives_retries(KEEPALIVE_RETRIES);
        }
    }
    if c.get_tcp_user_timeout().is_none() {
        c.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    if c.get_connect_timeout().is_none() {
        c.connect_timeout(CONNECT_TIMEOUT);
    }
}

impl PgEngine {
    /// Connects to the database at `url` (a `postgres://` URL or a libpq
    /// key=value string), runs the migrations under a transaction-level
    /// advisory lock (replicas starting together take turns), registers
    /// this replica, and starts its dispatcher, listener, command pump and
    /// maintenance loops.
    ///
    /// Errors: `InvalidArgument` (an unparsable URL), `StoreUnavailable`
    /// (the database cannot be reached), `Internal` (the schema is newer
    /// than this binary), storage errors.
    pub async fn open(
        url: &str,
        ca_file: Option<&std::path::Path>,
        cfg: EngineConfig,
        metrics: SharedMetrics,
    ) -> Result<Arc<PgEngine>> {
        let pg_config: tokio_postgres::Config = url
            .parse()
            .map_err(|e| Error::invalid(format!("--store: not a PostgreSQL URL: {e}")))?;
        let mut pg_config = pg_config;
        connection_settings(&mut pg_config);
        let tls = tls_connector(ca_file)?;
        let manager = Manager::from_config(
            pg_config.clone(),
            tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(Duration::from_secs(10)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| Error::Internal(format!("PostgreSQL pool: {e}")))?;
        {
            let mut client = pool.get().await.map_err(|e| Error::Storage {
                detail: format!("cannot connect to PostgreSQL: {e}"),
                fault: Some("the PostgreSQL database is unreachable"),
            })?;
            schema::migrate(&mut client).await?;
        }
        let host = sysinfo::System::host_name().unwrap_or_else(|| "agq".into());
        let replica_id = format!("{host}-{}", uuid::Uuid::new_v4().simple());
        let watchers = Arc::new(
            Watchers::new(
                cfg.max_watch_streams,
                cfg.max_watch_streams_per_connection,
                metrics.watch_streams.clone(),
            )
            .with_reread(WATCH_REREAD),
        );
        let (completions_tx, completions_rx) = tokio::sync::mpsc::channel(completions::QUEUE);
        let engine = Arc::new_cyclic(|me| PgEngine {
            tls,
            me: me.clone(),
            pool,
            pg_config,
            cfg,
            metrics,
            watchers,
            replica_id,
            local: Mutex::default(),
            plans: Mutex::default(),
            dispatch_wake: Notify::new(),
            commands_wake: Notify::new(),
            watch_wake: Notify::new(),
            schedules_wake: Notify::new(),
            verify_wake: Notify::new(),
            health: watch::channel(true).0,
            stop: watch::channel(false).0,
            closed: AtomicBool::new(false),
            tasks: Mutex::default(),
            granted: AtomicU64::new(0),
            completions: completions_tx,
        });
        engine
            .client()
            .await?
            .execute(
                "INSERT INTO replicas (replica_id, hostname, started_at_ms, last_seen_ms)
                 VALUES ($1, $2, agq_now_ms(), agq_now_ms())",
                &[&engine.replica_id, &host],
            )
            .await
            .map_err(db_err)?;
        engine.metrics.store_up.set(1);
        let tasks = vec![
            tokio::spawn(dispatch::run(engine.clone())),
            tokio::spawn(listen::run(engine.clone())),
            tokio::spawn(workers::command_pump(engine.clone())),
            tokio::spawn(workers::challenge_loop(engine.clone())),
            tokio::spawn(listen::watch_notifier(engine.clone())),
            tokio::spawn(maintenance::run(engine.clone())),
            tokio::spawn(maintenance::replica_heartbeat(engine.clone())),
            tokio::spawn(maintenance::schedule_loop(engine.clone())),
            tokio::spawn(completions::run(engine.clone(), completions_rx)),
        ];
        *lock(&engine.tasks) = tasks;
        tracing::info!(replica_id = %engine.replica_id, "PostgreSQL engine started");
        Ok(engine)
    }

    /// A pooled connection.
    ///
    /// Errors: `Unavailable` after close, `StoreUnavailable` when none can
    /// be had.
    async fn client(&self) -> Result<deadpool_postgres::Object> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(Error::Unavailable);
        }
        self.pool.get().await.map_err(|e| {
            // Every connection busy is load, not an unreachable database:
            // the caller retries, health stays as it is.
            if let deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait) = e {
                return Error::StoreBusy(format!(
                    "all {POOL_SIZE} PostgreSQL connections of this replica are busy; retry"
                ));
            }
            let _ = self
                .health
                .send_if_modified(|up| std::mem::replace(up, false));
            pool_err(e)
        })
    }

    /// Marks `actions` as changed: their watchers, on every replica, are
    /// woken by the next watch notification.
    fn touch<'a>(&self, actions: impl IntoIterator<Item = &'a str>) {
        let mut local = lock(&self.local);
        let before = local.touched.len();
        local
            .touched
            .extend(actions.into_iter().map(str::to_string));
        if local.touched.len() != before {
            drop(local);
            self.watch_wake.notify_one();
        }
    }

    /// Commits `tx`, then touches `actions` ([`PgEngine::touch`]): the
    /// watch notification for a change goes out after the change is
    /// visible, so a watcher it wakes re-reads the new state. The actions
    /// are touched also when the commit fails: its outcome may be unknown
    /// (a connection lost during the commit), and a watcher woken for
    /// nothing only re-reads the same state.
    ///
    /// Errors: storage errors of the commit (`StoreUnavailable` for a lost
    /// connection, `StoreBusy` for a conflict with another transaction).
    async fn commit_and_touch(
        &self,
        tx: deadpool_postgres::Transaction<'_>,
        actions: &[String],
    ) -> Result<()> {
        let r = tx.commit().await.map_err(db_err);
        self.touch(actions.iter().map(String::as_str));
        r
    }

    /// Records the outcome of an operation for health: a database that
    /// cannot be reached turns health NOT_SERVING until it answers again.
    fn observe<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(Error::StoreUnavailable(_)) = &r {
            let _ = self
                .health
                .send_if_modified(|up| std::mem::replace(up, false));
        }
        r
    }

    /// The plan version `(plan_id, version)`, from the cache or the
    /// database; `None` when it was deleted. `stamp`, when given, is the
    /// stored row's [`rows::PLAN_STAMP`] as the caller read it: a cached
    /// copy of another stamp is of a plan deleted since (maybe on another
    /// replica) whose id and version were used again, and is read anew.
    ///
    /// Errors: storage errors.
    async fn plan_version(
        &self,
        c: &impl deadpool_postgres::GenericClient,
        plan_id: &str,
        version: u32,
        stamp: Option<&str>,
    ) -> Result<Option<Arc<Plan>>> {
        if let Some((cached, p)) = lock(&self.plans).get(&(plan_id.to_string(), version)) {
            if stamp.is_none_or(|s| s == cached) {
                return Ok(Some(p.clone()));
            }
        }
        let Some((plan, stamp)) = rows::get_plan_version_stamped(c, plan_id, version).await? else {
            return Ok(None);
        };
        let plan = Arc::new(plan);
        let mut cache = lock(&self.plans);
        if cache.len() > 10_000 {
            cache.clear();
        }
        cache.insert((plan_id.to_string(), version), (stamp, plan.clone()));
        Ok(Some(plan))
    }

    /// This engine as an `Arc`, unless it is being dropped.
    fn me(&self) -> Option<Arc<PgEngine>> {
        self.me.upgrade()
    }

    /// Refreshes the job, queue and worker gauges from the database (and
    /// `agq_replica_workers` from this replica's memory). The
    /// job counts are the sums of `job_counts` (kept by triggers in the
    /// transactions that change jobs; migration 0002), not a count of the
    /// rows: a scrape costs the same with a week of history.
    ///
    /// Errors: storage errors.
    async fn refresh_gauges(&self) -> Result<()> {
        let held = lock(&self.local).workers.len();
        self.metrics
            .replica_workers
            .set(i64::try_from(held).unwrap_or(i64::MAX));
        let c = self.client().await?;
        let counts: HashMap<i32, i64> = c
            .query(
                "SELECT status, sum(n)::bigint FROM job_counts GROUP BY status",
                &[],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| (i32::from(r.get::<_, i16>(0)), r.get(1)))
            .collect();
        drop(c);
        let queue = self.pg_queue_stats().await?;
        let mut workers: HashMap<(crate::core::model::WorkerState, bool), i64> = HashMap::new();
        for w in self.pg_workers(None, None).await? {
            *workers.entry((w.state, w.fresh)).or_default() += 1;
        }
        crate::store::sqlite::loops::refresh_gauges(
            &self.metrics,
            &counts,
            &queue,
            &workers,
            false,
        );
        Ok(())
    }

    /// Whether the engine is stopping.
    fn stopping(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

/// The TLS connector of every connection: the system's trusted roots
/// plus the PEM certificates in `ca_file` (`--store-ca-file`). TLS is
/// used as the URL's `sslmode` says (`prefer` by default, `require` to
/// refuse plain connections, `disable`).
///
/// Errors: `InvalidArgument` when `ca_file` cannot be read or holds no
/// certificate; `Internal` when no TLS configuration can be built.
fn tls_connector(
    ca_file: Option<&std::path::Path>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        let _ = roots.add(cert);
    }
    if let Some(file) = ca_file {
        let path = file.display();
        let pem = std::fs::read(file)
            .map_err(|e| Error::invalid(format!("--store-ca-file {path}: {e}")))?;
        let mut added = 0;
        for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
            let cert: rustls::pki_types::CertificateDer<'static> =
                cert.map_err(|e| Error::invalid(format!("--store-ca-file {path}: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::invalid(format!("--store-ca-file {path}: {e}")))?;
            added += 1;
        }
        if added == 0 {
            return Err(Error::invalid(format!(
                "--store-ca-file {path}: no PEM certificate in it"
            )));
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Internal(format!("TLS to PostgreSQL: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// Gives back pooled connection `c` after `e` failed an operation on it:
/// a connection lost (`StoreUnavailable`) leaves the pool, where the next
/// caller (often the one cleaning up after `e`) would get it and fail too
/// before the pool noticed.
fn release(c: deadpool_postgres::Object, e: &Error) {
    if matches!(e, Error::StoreUnavailable(_)) {
        drop(deadpool_postgres::Object::take(c));
    }
}

/// Maps a pool error to `StoreUnavailable`.
fn pool_err(e: deadpool_postgres::PoolError) -> Error {
    tracing::warn!(error = %e, "no PostgreSQL connection");
    Error::StoreUnavailable("the PostgreSQL database is unreachable")
}

/// Waits for `wake` or `timeout`, whichever first; false when the engine
/// stops meanwhile.
async fn wait(wake: &Notify, timeout: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return false;
    }
    tokio::select! {
        _ = wake.notified() => true,
        _ = tokio::time::sleep(timeout) => true,
        _ = stop.changed() => false,
    }
}

/// Sends `NOTIFY channel, payload` for each payload: a list of names is
/// split so that no payload exceeds [`MAX_PAYLOAD`].
///
/// Errors: storage errors.
async fn notify_names(
    c: &impl deadpool_postgres::GenericClient,
    channel: &str,
    names: &[String],
) -> Result<()> {
    let mut payload = String::new();
    for n in names {
        if !payload.is_empty() && payload.len() + n.len() + 1 > MAX_PAYLOAD {
            c.execute(
                &cached(c, "SELECT pg_notify($1, $2)").await?,
                &[&channel, &payload],
            )
            .await
            .map_err(db_err)?;
            payload.clear();
        }
        if !payload.is_empty() {
            payload.push(',');
        }
        payload.push_str(n);
    }
    // An empty name is a notification without a payload (agq_ready).
    if !names.is_empty() {
        c.execute(
            &cached(c, "SELECT pg_notify($1, $2)").await?,
            &[&channel, &payload],
        )
        .await
        .map_err(db_err)?;
    }
    Ok(())
}

mod engine_impl;

#[cfg(test)]
mod connection_tests {
    use super::*;

    fn settings_of(url: &str) -> tokio_postgres::Config {
        let mut c: tokio_postgres::Config = url.parse().expect("a valid URL");
        connection_settings(&mut c);
        c
    }

    #[test]
    fn a_connection_gets_keepalive_and_timeouts_by_default() {
        let c = settings_of("postgres://agq@127.0.0.1/agq");
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), KEEPALIVE_IDLE);
        assert_eq!(c.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(c.get_keepalives_retries(), Some(KEEPALIVE_RETRIES));
        assert_eq!(c.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        assert_eq!(c.get_connect_timeout(), Some(&CONNECT_TIMEOUT));
        assert_eq!(
            c.get_options(),
            Some("-c idle_in_transaction_session_timeout=60000")
        );
    }

    #[test]
    fn settings_the_url_gives_are_kept() {
        let c = settings_of(
            "postgres://agq@127.0.0.1/agq?keepalives_idle=60&keepalives_interval=7\
             &keepalives_retries=9&tcp_user_timeout=90&connect_timeout=3&options=-c%20search_path%3Dq",
        );
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(7)));
        assert_eq!(c.get_keepalives_retries(), Some(9));
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(90)));
        assert_eq!(c.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(
            c.get_options(),
            Some("-c search_path=q -c idle_in_transaction_session_timeout=60000")
        );
        let off = settings_of("postgres://agq@127.0.0.1/agq?keepalives=0");
        assert!(!off.get_keepalives());
        assert_eq!(off.get_keepalives_interval(), None);
        assert_eq!(off.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
    }
}
