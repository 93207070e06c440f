//! The core's in-memory state, owned by the writer thread: plans, the ready
//! and delayed queues, leases and workers. The database is the source of
//! truth; this state is rebuilt from it at startup and after a failed commit.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Instant,
};

use rusqlite::Connection;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::{
    config::EngineConfig,
    error::Result,
    metrics::SharedMetrics,
    pb::{self, JobStatus, WorkerState},
    store::{self, writer::BatchState},
};

/// A stored plan with the tools it needs.
#[derive(Debug)]
pub struct PlanEntry {
    /// The plan.
    pub plan: pb::Plan,
    /// Distinct commands of its tasks, sorted.
    pub tools: Vec<String>,
}

impl PlanEntry {
    /// True when worker `w` can run this plan: it advertises every tool, and
    /// runs tasks in the kernel sandbox if the plan requires it. Freshness,
    /// state and free slots are the scheduler's to check.
    pub fn runs_on(&self, w: &WorkerEntry) -> bool {
        (!self.plan.require_sandbox || w.info.sandboxed)
            && self.tools.iter().all(|t| w.tools.contains(t))
    }
}

/// Sender half of a server stream to one worker.
pub type StreamTx<T> = mpsc::UnboundedSender<Result<T, Status>>;

/// One open stream of a worker, identified so a late close of an old
/// stream does not clear a newer one.
#[derive(Debug)]
pub struct StreamSlot<T> {
    /// Unique id of the stream.
    pub id: u64,
    /// Where to push messages.
    pub tx: StreamTx<T>,
}

/// A worker as the scheduler sees it.
#[derive(Debug)]
pub struct WorkerEntry {
    /// Registration metadata (hostname, capabilities, tags, ...).
    pub info: pb::Worker,
    /// Lifecycle state.
    pub state: WorkerState,
    /// Advertised tools.
    pub tools: HashSet<String>,
    /// Leases it may hold at once.
    pub max: u32,
    /// Rows of the jobs it holds leases for.
    pub leases: BTreeSet<i64>,
    /// Monotonic time of the last heartbeat (or registration).
    pub last_heartbeat: Instant,
    /// Wall-clock time of the last heartbeat, ms.
    pub last_heartbeat_ms: i64,
    /// When the heartbeat was last written to the database, ms.
    pub flushed_heartbeat_ms: i64,
    /// Stats of the last heartbeat.
    pub stats: pb::WorkerStats,
    /// Open heartbeat stream.
    pub heartbeat: Option<StreamSlot<pb::HeartbeatResponse>>,
    /// Open lease stream.
    pub lease_stream: Option<StreamSlot<pb::JobLease>>,
    /// Since when its heartbeat stream is gone while it holds leases.
    pub suspect_since: Option<Instant>,
    /// Registration time, ms.
    pub registered_at_ms: i64,
    /// Key under which it sits in [`State::available`], if it does.
    pub avail_key: Option<(u32, u64)>,
    /// Sequence number of its last lease, for round robin among equals.
    pub last_lease_seq: u64,
}

/// A granted lease.
#[derive(Debug, Clone)]
pub struct Lease {
    /// Fencing token.
    pub lease_id: String,
    /// Holder.
    pub worker_id: String,
    /// Public job id.
    pub job_id: String,
    /// Owning action.
    pub action_id: Arc<str>,
    /// Plan the job runs.
    pub plan_id: Arc<str>,
    /// Attempt number of this lease.
    pub attempt: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Expiry (job timeout), ms.
    pub expires_at_ms: i64,
    /// When it was granted, ms.
    pub granted_at_ms: i64,
    /// Id of the lease stream it was sent on (0: loaded at startup).
    pub stream_id: u64,
    /// Whether the job may have task results stored (from an earlier
    /// attempt or a progress report of this one). False only for a new
    /// job's first lease until it reports results: storing its results
    /// then needs no look for old ones.
    pub results_stored: bool,
}

/// A pending job waiting in a queue.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// Plan the job runs.
    pub plan_id: Arc<str>,
    /// Owning action.
    pub action_id: Arc<str>,
    /// When it became (or becomes) eligible, ms.
    pub since_ms: i64,
    /// Pending (scheduled or ready) or Failed (backing off).
    pub status: JobStatus,
    /// A new job's row as inserted, kept for its first lease (see
    /// [`FreshJob`]); `None` for every other job, which is read back.
    pub fresh: Option<Box<FreshJob>>,
}

/// What a job's row holds right after `store::jobs::insert_job`, kept in
/// memory from its insertion until its first lease so that granting it
/// needs no read of the row (and no parse of its input). Only jobs that go
/// straight to the ready queue while it holds fewer than
/// [`FRESH_JOBS_MAX`] jobs keep one, which bounds the memory it takes.
#[derive(Debug, Clone)]
pub struct FreshJob {
    /// Public job id.
    pub job_id: String,
    /// The job's input.
    pub input: HashMap<String, String>,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Creation time, ms since the epoch.
    pub created_at_ms: i64,
}

/// Most queued jobs that keep a [`FreshJob`] (a few MiB).
pub const FRESH_JOBS_MAX: usize = 16_384;

/// A side effect released only after the commit.
pub enum Effect {
    /// Push a lease to a worker's lease stream.
    Lease(StreamTx<pb::JobLease>, Box<pb::JobLease>),
    /// Push a message (command or error) to a worker's heartbeat stream.
    Heartbeat(
        StreamTx<pb::HeartbeatResponse>,
        Result<pb::HeartbeatResponse, Status>,
    ),
}

/// Watch channels of actions someone streams with WatchAction, and the
/// bounds on how many streams may be open. Every subscription is a
/// [`WatchSubscription`] that gives its place back when dropped, so nothing
/// a WatchAction call registers outlives its stream.
pub struct Watchers {
    inner: Mutex<WatchersInner>,
    max_total: usize,
    max_per_connection: usize,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

#[derive(Default)]
struct WatchersInner {
    /// One channel per watched action, while it has a subscriber.
    map: HashMap<String, watch::Sender<u64>>,
    /// Open subscriptions.
    total: usize,
    /// Open subscriptions per client connection (its peer address).
    per_connection: HashMap<Option<std::net::SocketAddr>, usize>,
}

impl Default for Watchers {
    fn default() -> Self {
        Watchers::new(10_000, 100, Default::default())
    }
}

impl Watchers {
    /// Watchers allowing `max_total` open subscriptions in all and
    /// `max_per_connection` per client connection; `gauge` follows the
    /// number open (`agq_watch_streams`).
    pub fn new(
        max_total: usize,
        max_per_connection: usize,
        gauge: prometheus_client::metrics::gauge::Gauge,
    ) -> Self {
        Watchers {
            inner: Mutex::default(),
            max_total,
            max_per_connection,
            gauge,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchersInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A subscription that changes whenever a job of `action_id` (an id
    /// already validated) changes status, counted against the bounds for
    /// `connection` (the client's address; `None` when unknown).
    ///
    /// Errors: [`crate::error::Error::ResourceExhausted`] when the total or
    /// the connection's bound is reached.
    pub fn subscribe(
        self: &Arc<Self>,
        action_id: &str,
        connection: Option<std::net::SocketAddr>,
    ) -> Result<WatchSubscription> {
        let mut inner = self.lock();
        if inner.total >= self.max_total {
            return Err(crate::error::Error::ResourceExhausted(format!(
                "{} WatchAction streams are open, the most this server allows (--max-watch-streams); retry later",
                self.max_total
            )));
        }
        let n = inner.per_connection.entry(connection).or_default();
        if *n >= self.max_per_connection {
            let n = *n;
            if n == 0 {
                inner.per_connection.remove(&connection);
            }
            return Err(crate::error::Error::ResourceExhausted(format!(
                "this connection has {n} WatchAction streams open, the most allowed per connection (--max-watch-streams-per-connection)"
            )));
        }
        *n += 1;
        inner.total += 1;
        self.gauge.set(inner.total as i64);
        let rx = inner
            .map
            .entry(action_id.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Ok(WatchSubscription {
            rx,
            action_id: action_id.to_string(),
            connection,
            owner: self.clone(),
        })
    }

    /// Open subscriptions.
    pub fn count(&self) -> usize {
        self.lock().total
    }

    fn release(&self, action_id: &str, connection: Option<std::net::SocketAddr>) {
        let mut inner = self.lock();
        inner.total = inner.total.saturating_sub(1);
        self.gauge.set(inner.total as i64);
        if let Some(n) = inner.per_connection.get_mut(&connection) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                inner.per_connection.remove(&connection);
            }
        }
        // The subscription being dropped still holds its receiver.
        if inner
            .map
            .get(action_id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            inner.map.remove(action_id);
        }
    }

    fn notify(&self, actions: &mut HashSet<Arc<str>>) {
        if actions.is_empty() {
            return;
        }
        let inner = self.lock();
        if inner.map.is_empty() {
            actions.clear();
            return;
        }
        for a in actions.drain() {
            if let Some(tx) = inner.map.get(&*a) {
                tx.send_modify(|v| *v += 1);
            }
        }
    }
}

/// One WatchAction stream's subscription: changes whenever a job of its
/// action changes status. Dropping it (the stream ended, was cancelled, or
/// the call failed) gives its place back and forgets the action's channel
/// once nobody watches it.
pub struct WatchSubscription {
    rx: watch::Receiver<u64>,
    action_id: String,
    connection: Option<std::net::SocketAddr>,
    owner: Arc<Watchers>,
}

impl WatchSubscription {
    /// Waits for the next change. Errors when the channel is gone (never,
    /// while the subscription lives).
    pub async fn changed(&mut self) -> std::result::Result<(), watch::error::RecvError> {
        self.rx.changed().await
    }

    /// Marks the current value seen.
    pub fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }
}

impl Drop for WatchSubscription {
    fn drop(&mut self) {
        self.owner.release(&self.action_id, self.connection);
    }
}

fn intern_in(map: &mut HashMap<String, std::sync::Weak<str>>, s: &str) -> Arc<str> {
    if let Some(a) = map.get(s).and_then(|w| w.upgrade()) {
        return a;
    }
    let a: Arc<str> = Arc::from(s);
    map.insert(s.to_string(), Arc::downgrade(&a));
    a
}

/// The in-memory state of the core. See the module docs.
pub struct State {
    /// Settings.
    pub cfg: EngineConfig,
    /// Metrics.
    pub metrics: SharedMetrics,
    /// Every plan by id.
    pub plans: HashMap<String, Arc<PlanEntry>>,
    /// Ready pending jobs by row (FIFO).
    pub ready: BTreeMap<i64, Waiting>,
    /// Ready rows per plan.
    pub ready_by_plan: HashMap<Arc<str>, BTreeSet<i64>>,
    /// Jobs waiting for a time: (due ms, row).
    pub delayed: BTreeSet<(i64, i64)>,
    /// Delayed jobs by row.
    pub delayed_jobs: HashMap<i64, Waiting>,
    /// Leases by job row.
    pub leases: HashMap<i64, Lease>,
    /// Row of each leased job by public job id (the same jobs as
    /// [`State::leases`]), so a worker's report finds its job without a query.
    pub lease_by_job: HashMap<String, i64>,
    /// Every known worker by id.
    pub workers: HashMap<String, WorkerEntry>,
    /// Workers that can take a lease now (ACTIVE, lease stream open, free
    /// slot), least loaded first: (active leases, last lease seq, id).
    pub available: BTreeSet<(u32, u64, String)>,
    /// Side effects of the current batch.
    pub outbox: Vec<Effect>,
    /// Actions whose jobs changed in the current batch.
    pub changed_actions: HashSet<Arc<str>>,
    /// WatchAction subscribers.
    pub watchers: Arc<Watchers>,
    /// Set when the dispatcher may find work (job ready, slot freed).
    pub wants_dispatch: bool,
    /// Counter of stream ids.
    pub next_stream_id: u64,
    /// Counter of leases, for round robin.
    pub lease_seq: u64,
    /// Interned plan ids, weakly held: an id lives as long as a queued job
    /// or lease uses it; dead entries are swept by the reaper.
    pub interned: HashMap<String, std::sync::Weak<str>>,
    /// Interned action ids, apart from the plan ids (a client may name an
    /// action like a plan): the strong count of an action's id is the
    /// number of its open jobs in memory (queued, delayed or leased) plus
    /// transient holders such as [`State::changed_actions`].
    pub interned_actions: HashMap<String, std::sync::Weak<str>>,
    /// Size of [`State::interned`] after the last sweep.
    pub interned_after_sweep: usize,
    /// Jobs deleted by retention in the current batch, counted in the
    /// metrics once the batch commits.
    pub expired_in_batch: u64,
}

impl State {
    /// An empty state; call [`State::load`] inside the first transaction.
    pub fn new(cfg: EngineConfig, metrics: SharedMetrics, watchers: Arc<Watchers>) -> Self {
        State {
            cfg,
            metrics,
            plans: HashMap::new(),
            ready: BTreeMap::new(),
            ready_by_plan: HashMap::new(),
            delayed: BTreeSet::new(),
            delayed_jobs: HashMap::new(),
            leases: HashMap::new(),
            lease_by_job: HashMap::new(),
            workers: HashMap::new(),
            available: BTreeSet::new(),
            outbox: Vec::new(),
            changed_actions: HashSet::new(),
            watchers,
            wants_dispatch: true,
            next_stream_id: 1,
            lease_seq: 0,
            interned: HashMap::new(),
            interned_actions: HashMap::new(),
            interned_after_sweep: 0,
            expired_in_batch: 0,
        }
    }

    /// An interned `Arc<str>` of the plan id `s` (shared by many jobs).
    pub fn intern(&mut self, s: &str) -> Arc<str> {
        intern_in(&mut self.interned, s)
    }

    /// An interned `Arc<str>` of the action id `s` (shared by its jobs).
    pub fn intern_action(&mut self, s: &str) -> Arc<str> {
        intern_in(&mut self.interned_actions, s)
    }

    /// Drops interned ids no job uses any more (amortised: only when the
    /// table has grown past twice its size after the last sweep).
    pub fn sweep_interned(&mut self) {
        let len = self.interned.len() + self.interned_actions.len();
        if len > 1024 && len > 2 * self.interned_after_sweep {
            self.interned.retain(|_, w| w.strong_count() > 0);
            self.interned_actions.retain(|_, w| w.strong_count() > 0);
            self.interned_after_sweep = self.interned.len() + self.interned_actions.len();
        }
    }

    /// Rebuilds the state from the database. Stream slots and heartbeat
    /// times of workers already in memory are kept; workers new to memory
    /// (server start) count as suspect from now, so their leases return to
    /// pending after the grace period unless they reconnect.
    ///
    /// Errors: [`crate::error::Error::Storage`].
    pub fn load(&mut self, conn: &Connection) -> Result<()> {
        let now = Instant::now();
        let now_ms = store::now_ms();
        self.plans.clear();
        for plan in store::plans::load_all(conn)? {
            let tools = super::validate::plan_tools(&plan);
            self.plans
                .insert(plan.plan_id.clone(), Arc::new(PlanEntry { plan, tools }));
        }
        let mut old = std::mem::take(&mut self.workers);
        self.available.clear();
        for row in store::workers::load_all(conn)? {
            let id = row.worker.worker_id.clone();
            let state = WorkerState::try_from(row.worker.state).unwrap_or(WorkerState::Dead);
            let prev = old.remove(&id);
            let tools: HashSet<String> = row
                .worker
                .capabilities
                .as_ref()
                .map(|c| c.tools.iter().cloned().collect())
                .unwrap_or_default();
            let live = matches!(state, WorkerState::Active | WorkerState::Draining);
            let mut entry = WorkerEntry {
                max: row.worker.max_concurrent_jobs.max(1),
                stats: row.worker.stats.unwrap_or_default(),
                info: row.worker,
                state,
                tools,
                leases: BTreeSet::new(),
                last_heartbeat: now,
                last_heartbeat_ms: row.last_heartbeat_at_ms.unwrap_or(row.registered_at_ms),
                flushed_heartbeat_ms: row.last_heartbeat_at_ms.unwrap_or(row.registered_at_ms),
                heartbeat: None,
                lease_stream: None,
                suspect_since: if live { Some(now) } else { None },
                registered_at_ms: row.registered_at_ms,
                avail_key: None,
                last_lease_seq: 0,
            };
            if let Some(p) = prev {
                entry.last_heartbeat = p.last_heartbeat;
                entry.last_heartbeat_ms = p.last_heartbeat_ms;
                entry.stats = p.stats;
                entry.heartbeat = p.heartbeat;
                entry.lease_stream = p.lease_stream;
                entry.suspect_since = p.suspect_since;
                entry.last_lease_seq = p.last_lease_seq;
            }
            self.workers.insert(id, entry);
        }
        self.ready.clear();
        self.ready_by_plan.clear();
        self.delayed.clear();
        self.delayed_jobs.clear();
        self.leases.clear();
        self.lease_by_job.clear();
        let mut orphaned = Vec::new();
        for job in store::jobs::load_open(conn)? {
            let plan_id = self.intern(&job.plan_id);
            let action_id = self.intern_action(&job.action_id);
            match job.status {
                JobStatus::Running => {
                    let worker_id = job.worker_id.clone().unwrap_or_default();
                    let lease = Lease {
                        lease_id: job.lease_id.clone().unwrap_or_default(),
                        worker_id: worker_id.clone(),
                        job_id: job.job_id.clone(),
                        action_id,
                        plan_id,
                        attempt: job.attempt,
                        max_attempts: job.max_attempts,
                        expires_at_ms: job.lease_expires_at_ms.unwrap_or(now_ms),
                        granted_at_ms: now_ms,
                        stream_id: 0,
                        results_stored: true,
                    };
                    self.lease_by_job.insert(job.job_id.clone(), job.row);
                    self.leases.insert(job.row, lease);
                    match self.workers.get_mut(&worker_id) {
                        Some(w)
                            if matches!(w.state, WorkerState::Active | WorkerState::Draining) =>
                        {
                            w.leases.insert(job.row);
                        }
                        _ => orphaned.push(job.row),
                    }
                }
                status => {
                    let waiting = Waiting {
                        plan_id,
                        action_id,
                        since_ms: job.ready_at_ms,
                        status,
                        fresh: None,
                    };
                    self.enqueue(job.row, waiting, now_ms);
                }
            }
        }
        let ids: Vec<String> = self.workers.keys().cloned().collect();
        for id in ids {
            self.refresh_available(&id);
        }
        for row in orphaned {
            self.lose_lease(conn, row, "its worker is gone", "stream_lost")?;
        }
        self.wants_dispatch = true;
        Ok(())
    }

    /// Puts a waiting job in the ready queue when due, else in the delayed set.
    /// A due job stored as Failed must be promoted by the caller first.
    pub fn enqueue(&mut self, row: i64, waiting: Waiting, now_ms: i64) {
        if waiting.since_ms <= now_ms && waiting.status == JobStatus::Pending {
            self.ready_by_plan
                .entry(waiting.plan_id.clone())
                .or_default()
                .insert(row);
            self.ready.insert(row, waiting);
            self.wants_dispatch = true;
        } else {
            self.delayed.insert((waiting.since_ms, row));
            self.delayed_jobs.insert(row, waiting);
        }
    }

    /// True while a pending, running or failed (retrying) job uses the
    /// plan: every such job is in the ready or delayed queue or leased.
    pub fn plan_in_use(&self, plan_id: &str) -> bool {
        self.ready_by_plan.contains_key(plan_id)
            || self.delayed_jobs.values().any(|w| &*w.plan_id == plan_id)
            || self.leases.values().any(|l| &*l.plan_id == plan_id)
    }

    /// Removes a job from the ready or delayed queue; returns what it was.
    pub fn dequeue(&mut self, row: i64) -> Option<Waiting> {
        if let Some(w) = self.ready.remove(&row) {
            if let Some(set) = self.ready_by_plan.get_mut(&w.plan_id) {
                set.remove(&row);
                if set.is_empty() {
                    self.ready_by_plan.remove(&w.plan_id);
                }
            }
            return Some(w);
        }
        if let Some(w) = self.delayed_jobs.remove(&row) {
            self.delayed.remove(&(w.since_ms, row));
            return Some(w);
        }
        None
    }

    /// Re-files worker `id` in [`State::available`] after a change of its
    /// state, streams or load.
    pub fn refresh_available(&mut self, id: &str) {
        let Some(w) = self.workers.get_mut(id) else {
            return;
        };
        if let Some((load, seq)) = w.avail_key.take() {
            self.available.remove(&(load, seq, id.to_string()));
        }
        let eligible = w.state == WorkerState::Active
            && w.lease_stream.as_ref().is_some_and(|s| !s.tx.is_closed())
            && (w.leases.len() as u32) < w.max;
        if eligible {
            let key = (w.leases.len() as u32, w.last_lease_seq);
            w.avail_key = Some(key);
            self.available.insert((key.0, key.1, id.to_string()));
            self.wants_dispatch = true;
        }
    }

    /// True while the worker's last heartbeat is younger than 3 x interval.
    pub fn is_fresh(&self, w: &WorkerEntry, now: Instant) -> bool {
        now.saturating_duration_since(w.last_heartbeat) < self.cfg.stale_after()
    }

    /// Queues a command for a worker's heartbeat stream, if it has one open.
    pub fn command(&mut self, worker_id: &str, cmd: pb::heartbeat_response::Command) {
        let deadline = self.next_deadline_ts();
        if let Some(slot) = self
            .workers
            .get(worker_id)
            .and_then(|w| w.heartbeat.as_ref())
        {
            let msg = pb::HeartbeatResponse {
                next_deadline: Some(deadline),
                command: Some(cmd),
            };
            self.outbox
                .push(Effect::Heartbeat(slot.tx.clone(), Ok(msg)));
        }
    }

    /// The deadline of a heartbeat sent now.
    pub fn next_deadline_ts(&self) -> prost_types::Timestamp {
        crate::time::ts(store::now_ms() + self.cfg.heartbeat_interval.as_millis() as i64)
    }

    /// Records that a job of `action` changed status (for WatchAction).
    pub fn touch(&mut self, action: &Arc<str>) {
        if !self.changed_actions.contains(action) {
            self.changed_actions.insert(action.clone());
        }
    }
}

impl BatchState for State {
    fn before_commit(&mut self, conn: &Connection) -> Result<()> {
        if self.wants_dispatch {
            self.dispatch(conn)?;
        }
        // Record the finish time (for retention) of each changed action
        // that has no open job left, in the same transaction as the change.
        // An action with an open job holds its id in memory (a queued job
        // or a lease), so only ids held by `changed_actions` alone are
        // checked against the database; RetryJob clears the time itself.
        let mut now_ms = None;
        for action in &self.changed_actions {
            if Arc::strong_count(action) == 1 {
                let now_ms = *now_ms.get_or_insert_with(store::now_ms);
                store::retention::mark_finished(conn, action, now_ms)?;
            }
        }
        Ok(())
    }

    fn after_commit(&mut self, ops: usize) {
        if ops > 0 {
            self.metrics.batch_size.observe(ops as f64);
        }
        if self.expired_in_batch > 0 {
            self.metrics
                .expired_jobs
                .inc_by(std::mem::take(&mut self.expired_in_batch));
        }
        for effect in self.outbox.drain(..) {
            match effect {
                Effect::Lease(tx, lease) => {
                    let _ = tx.send(Ok(*lease));
                }
                Effect::Heartbeat(tx, msg) => {
                    let _ = tx.send(msg);
                }
            }
        }
        let watchers = self.watchers.clone();
        watchers.notify(&mut self.changed_actions);
    }

    fn after_rollback(&mut self, conn: &Connection) {
        self.outbox.clear();
        self.expired_in_batch = 0;
        self.changed_actions.clear();
        if let Err(e) = self.load(conn) {
            tracing::error!(error = %e, "reloading the state after a rollback failed");
        }
    }

    fn on_shutdown(&mut self, conn: &Connection) {
        if let Err(e) = self.flush_heartbeats(conn, true) {
            tracing::warn!(error = %e, "flushing heartbeats at shutdown failed");
        }
        for w in self.workers.values_mut() {
            w.heartbeat = None;
            w.lease_stream = None;
        }
    }
}
