//! The SQLite engine's in-memory state, owned by the writer thread: plans
//! (the latest version of each, and the older versions open jobs run),
//! the ready and delayed queues, leases and workers. The database is the
//! source of truth; this state is rebuilt from it at startup and after a
//! failed commit. This file holds the state and its bookkeeping (queues,
//! availability, interning, the batch hooks); the state machine is in
//! `jobs.rs`, worker lifecycle in `workers.rs`, lease grants in
//! `scheduler.rs`.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
    time::{Duration, Instant},
};

use rusqlite::Connection;

use super::{
    sql,
    writer::{BatchState, Commit},
};
use crate::{
    config::EngineConfig,
    core::{
        engine::{EventTx, HeartbeatEvent, QueueName},
        model::{
            HeartbeatReply, JobLease, JobStatus, Plan, Scheduling, Verification, Worker,
            WorkerCommand, WorkerState, WorkerStats,
        },
        selector::Selector,
        validate,
        watch::Watchers,
    },
    error::{Error, Result},
    metrics::SharedMetrics,
    time::now_ms,
};

/// The engine's in-memory maps, hashed with foldhash (seeded per map):
/// a third of the instructions of the standard library's SipHash on the
/// writer thread's per-job lookups.
pub(super) type Map<K, V> = HashMap<K, V, foldhash::quality::RandomState>;
/// The set counterpart of [`Map`].
pub(super) type Set<K> = std::collections::HashSet<K, foldhash::quality::RandomState>;

/// Which ready jobs take turns as one: the jobs of one action at one
/// priority (a RetryJob may give a job another priority than its
/// action's). The key of [`State::groups`].
pub(super) type GroupKey = (Arc<str>, i32);

/// Where a group stands in [`State::order`]: higher priority first, then
/// the group served longest ago (round robin among equals; 0: never
/// served), then its oldest job.
pub(super) type OrderKey = (Reverse<i32>, u64, i64);

/// The ready jobs of one [`GroupKey`], in FIFO order.
#[derive(Debug, Default)]
pub(super) struct ReadyGroup {
    /// Rows of its ready jobs.
    pub(super) rows: BTreeSet<i64>,
    /// [`State::lease_seq`] of its last lease; 0: none since it was
    /// created (a group with no ready job left is dropped and forgets).
    pub(super) served: u64,
    /// Leases granted in its current turn (see
    /// [`EngineConfig::round_robin_quantum`]).
    pub(super) turn: u32,
    /// Its entry in [`State::order`] while it has rows.
    pub(super) filed: Option<OrderKey>,
}

/// An action's fleet-scheduling settings as the scheduler uses them,
/// shared by the action's queued jobs and leases (a job whose RetryJob
/// changed its priority holds its own copy).
#[derive(Debug)]
pub(super) struct Sched {
    /// Higher leases first.
    pub(super) priority: i32,
    /// Workers whose tags match may run the jobs.
    pub(super) selector: Selector,
    /// Concurrency key and its limit of running jobs.
    pub(super) limit: Option<(Arc<str>, u32)>,
}

impl Sched {
    /// The scheduler's form of validated settings.
    ///
    /// Errors: `Internal` when the stored selector no longer parses (the
    /// engine stores only what [`validate::scheduling`] accepted).
    pub(super) fn new(s: &Scheduling) -> Result<Sched> {
        let selector = Selector::parse(&s.worker_selector).map_err(|e| {
            Error::Internal(format!(
                "stored worker selector {:?}: {e}",
                s.worker_selector
            ))
        })?;
        Ok(Sched {
            priority: s.priority,
            selector,
            limit: (!s.concurrency_key.is_empty())
                .then(|| (Arc::from(s.concurrency_key.as_str()), s.max_running)),
        })
    }

    /// The same settings at another priority.
    pub(super) fn with_priority(&self, priority: i32) -> Sched {
        Sched {
            priority,
            selector: self.selector.clone(),
            limit: self.limit.clone(),
        }
    }

    /// True when worker `w`'s tags match the selector.
    pub(super) fn admits(&self, w: &WorkerEntry) -> bool {
        self.selector.matches(&w.info.tags)
    }
}

/// One stored version of a plan with the tools it needs. Every queued job
/// and lease holds the entry of the version it runs, so an older version
/// stays in memory exactly as long as an open job runs it.
#[derive(Debug)]
pub(super) struct PlanEntry {
    /// The plan's id, shared by the keys of its queued jobs.
    pub(super) id: Arc<str>,
    /// The plan, at this version.
    pub(super) plan: Arc<Plan>,
    /// Distinct commands of its tasks, sorted.
    pub(super) tools: Vec<String>,
}

impl PlanEntry {
    /// The entry of `plan` (a stored version).
    pub(super) fn new(plan: Plan) -> PlanEntry {
        PlanEntry {
            id: Arc::from(plan.plan_id.as_str()),
            tools: validate::plan_tools(&plan),
            plan: Arc::new(plan),
        }
    }

    /// True when worker `w` can run this plan: it advertises every tool
    /// (or agentic unit), runs tasks in the kernel sandbox if the plan
    /// requires it, and passed a verification of each if the plan requires
    /// that. Freshness, state and free slots are the scheduler's to check.
    pub(super) fn runs_on(&self, w: &WorkerEntry) -> bool {
        (!self.plan.require_sandbox || w.info.sandboxed)
            && self.tools.iter().all(|t| w.tools.contains(t))
            && (!self.plan.require_verified_tools || self.tools.iter().all(|t| w.verified(t)))
    }
}

/// One open stream of a worker, identified so a late close of an old
/// stream does not clear a newer one.
#[derive(Debug)]
pub(super) struct StreamSlot<T> {
    /// Unique id of the stream.
    pub(super) id: u64,
    /// Where to push messages.
    pub(super) tx: EventTx<T>,
}

/// A worker's key in [`State::available`]: (active leases, last lease
/// seq, id).
pub(super) type AvailKey = (u32, u64, Arc<str>);

/// A worker as the scheduler sees it.
#[derive(Debug)]
pub(super) struct WorkerEntry {
    /// Registration metadata (hostname, capabilities, tags, ...).
    pub(super) info: Worker,
    /// Lifecycle state.
    pub(super) state: WorkerState,
    /// Advertised tools.
    pub(super) tools: Set<String>,
    /// Leases it may hold at once.
    pub(super) max: u32,
    /// Rows of the jobs it holds leases for.
    pub(super) leases: BTreeSet<i64>,
    /// Monotonic time of the last heartbeat (or registration).
    pub(super) last_heartbeat: Instant,
    /// Wall-clock time of the last heartbeat, ms.
    pub(super) last_heartbeat_ms: i64,
    /// When the heartbeat was last written to the database, ms.
    pub(super) flushed_heartbeat_ms: i64,
    /// Stats of the last heartbeat.
    pub(super) stats: WorkerStats,
    /// Open heartbeat stream.
    pub(super) heartbeat: Option<StreamSlot<HeartbeatEvent>>,
    /// Open lease stream.
    pub(super) lease_stream: Option<StreamSlot<JobLease>>,
    /// Since when its heartbeat stream is gone while it holds leases.
    pub(super) suspect_since: Option<Instant>,
    /// Registration time, ms.
    pub(super) registered_at_ms: i64,
    /// Key under which it sits in [`State::available`], if it does.
    pub(super) avail_key: Option<AvailKey>,
    /// Its id, shared with the keys of [`State::available`] (filing it
    /// there allocates nothing).
    pub(super) key_id: Arc<str>,
    /// Sequence number of its last lease, for round robin among equals.
    pub(super) last_lease_seq: u64,
    /// Its slots counted in [`State::fleet_slots`] (its max while ACTIVE
    /// with a lease stream open, else 0).
    pub(super) fleet_slots: u32,
    /// When its recent leases hit the job timeout (ms, oldest first),
    /// within the quarantine window; not persisted.
    pub(super) timeouts: std::collections::VecDeque<i64>,
    /// The latest answered verification of each command it was
    /// challenged on, by command.
    pub(super) verified: BTreeMap<String, Verification>,
    /// Challenges sent and not answered yet, by challenge id (at most one
    /// per command; in memory only).
    pub(super) pending: HashMap<String, Verification>,
}

impl WorkerEntry {
    /// True when the worker passed a verification of `command`.
    pub(super) fn verified(&self, command: &str) -> bool {
        self.verified.get(command).is_some_and(|v| v.passed)
    }
}

/// A granted lease.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    /// Fencing token.
    pub(super) lease_id: String,
    /// Holder.
    pub(super) worker_id: String,
    /// Public job id.
    pub(super) job_id: String,
    /// Owning action.
    pub(super) action_id: Arc<str>,
    /// The plan version the job runs.
    pub(super) plan: Arc<PlanEntry>,
    /// The job's scheduling settings (its concurrency key is counted in
    /// [`State::running_by_key`] while the lease lives).
    pub(super) sched: Arc<Sched>,
    /// Attempt number of this lease.
    pub(super) attempt: u32,
    /// Attempts allowed.
    pub(super) max_attempts: u32,
    /// Expiry (job timeout), ms.
    pub(super) expires_at_ms: i64,
    /// When it was granted, ms.
    pub(super) granted_at_ms: i64,
    /// Id of the lease stream it was sent on (0: loaded at startup).
    pub(super) stream_id: u64,
    /// The worker listed it in `held_leases` since it was granted, so it
    /// has it: it is never sent again (see [`State::open_lease_stream`]).
    pub(super) acknowledged: bool,
}

/// A pending job waiting in a queue.
#[derive(Debug, Clone)]
pub(super) struct Waiting {
    /// The plan version the job runs.
    pub(super) plan: Arc<PlanEntry>,
    /// Owning action.
    pub(super) action_id: Arc<str>,
    /// Its scheduling settings.
    pub(super) sched: Arc<Sched>,
    /// When it became (or becomes) eligible, ms.
    pub(super) since_ms: i64,
    /// Pending (scheduled or ready) or Failed (backing off).
    pub(super) status: JobStatus,
    /// A new job's row as inserted, kept for its first lease (see
    /// [`FreshJob`]); `None` for every other job, which is read back.
    pub(super) fresh: Option<Box<FreshJob>>,
}

/// What a job's row holds right after `sql::jobs::JobInserter::insert`, kept in
/// memory from its insertion until its first lease so that granting it
/// needs no read of the row, no parse of its input and no read of its
/// action's trace context. Only jobs that go straight to the ready queue
/// while the kept rows weigh less than [`FRESH_BYTES_MAX`] keep one
/// ([`FreshJob::weight`]), which bounds the memory they take.
#[derive(Debug, Clone)]
pub(super) struct FreshJob {
    /// Public job id.
    pub(super) job_id: String,
    /// The job's input.
    pub(super) input: HashMap<String, String>,
    /// Attempts allowed.
    pub(super) max_attempts: u32,
    /// Creation time, ms since the epoch.
    pub(super) created_at_ms: i64,
    /// The action's W3C `traceparent` (shared by its jobs).
    pub(super) traceparent: Option<Arc<str>>,
}

impl FreshJob {
    /// Bytes of memory this kept row stands for: its strings and a fixed
    /// allowance for the structures that hold them. Fixed while it is kept
    /// (nothing changes a [`FreshJob`]), so adding it when kept and
    /// subtracting it when taken balance.
    pub(super) fn weight(&self) -> usize {
        const FIXED: usize = 256;
        const PER_INPUT: usize = 64;
        FIXED
            + self.job_id.len()
            + self
                .input
                .iter()
                .map(|(k, v)| PER_INPUT + k.len() + v.len())
                .sum::<usize>()
    }
}

/// Most bytes ([`FreshJob::weight`]) of kept rows of queued jobs: 64 MiB,
/// about 180,000 jobs with one 128-byte input each. A burst larger than
/// that reads the rest back at their first lease.
pub(super) const FRESH_BYTES_MAX: usize = 64 << 20;

/// A side effect released only after the commit.
pub(super) enum Effect {
    /// Push a lease to a worker's lease stream.
    Lease(EventTx<JobLease>, Box<JobLease>),
    /// Push a message (command or end) to a worker's heartbeat stream.
    Heartbeat(EventTx<HeartbeatEvent>, HeartbeatEvent),
}

fn intern_in(map: &mut Map<String, std::sync::Weak<str>>, s: &str) -> Arc<str> {
    if let Some(a) = map.get(s).and_then(|w| w.upgrade()) {
        return a;
    }
    let a: Arc<str> = Arc::from(s);
    map.insert(s.to_string(), Arc::downgrade(&a));
    a
}

/// The in-memory state of the SQLite engine. See the module docs.
pub(super) struct State {
    /// Settings.
    pub(super) cfg: EngineConfig,
    /// Metrics.
    pub(super) metrics: SharedMetrics,
    /// The latest version of every plan, by id.
    pub(super) plans: Map<String, Arc<PlanEntry>>,
    /// Older versions read back from the database (for a retry, or at
    /// start for the open jobs that run them), weakly held: an entry lives
    /// while a queued job or lease holds it; dead entries are swept with
    /// the interned ids.
    pub(super) old_plans: Map<(String, u32), std::sync::Weak<PlanEntry>>,
    /// Ready pending jobs by row (FIFO).
    pub(super) ready: BTreeMap<i64, Waiting>,
    /// Ready jobs grouped by action and priority, each group FIFO.
    pub(super) groups: Map<GroupKey, ReadyGroup>,
    /// The groups with ready jobs in the order the dispatcher tries them
    /// (see [`OrderKey`]).
    pub(super) order: BTreeSet<(OrderKey, GroupKey)>,
    /// Leases held per concurrency key.
    pub(super) running_by_key: Map<Arc<str>, u32>,
    /// Leases granted by the dispatcher since the starvation guard last
    /// placed the oldest ready job.
    pub(super) since_guard: u32,
    /// When the first [`State::load`] ran (the server's start): until
    /// [`crate::config::EngineConfig::restart_grace`] after it, the
    /// workers it loaded may take that long to reconnect before their
    /// leases are re-queued.
    pub(super) started: Option<Instant>,
    /// Slots of the ACTIVE workers with a lease stream open (free or
    /// not): sizes the round-robin turn.
    pub(super) fleet_slots: u64,
    /// Jobs waiting for a time: (due ms, row).
    pub(super) delayed: BTreeSet<(i64, i64)>,
    /// Delayed jobs by row.
    pub(super) delayed_jobs: Map<i64, Waiting>,
    /// Sum of [`FreshJob::weight`] over the queued jobs that keep one.
    pub(super) fresh_bytes: usize,
    /// Leases by job row.
    pub(super) leases: Map<i64, Lease>,
    /// Row of each leased job by public job id (the same jobs as
    /// [`State::leases`]), so a worker's report finds its job without a query.
    pub(super) lease_by_job: Map<String, i64>,
    /// Every known worker by id.
    pub(super) workers: Map<String, WorkerEntry>,
    /// Workers that can take a lease now (ACTIVE, lease stream open, free
    /// slot), least loaded first: (active leases, last lease seq, id).
    pub(super) available: BTreeSet<AvailKey>,
    /// Side effects of the current batch.
    pub(super) outbox: Vec<Effect>,
    /// Actions whose jobs changed in the current batch.
    pub(super) changed_actions: Set<Arc<str>>,
    /// The action ids of open jobs that are not scheduled because their
    /// plan version is not stored (a database edited by hand): held so
    /// that their actions never count as finished (see `before_commit`).
    pub(super) unscheduled: Vec<Arc<str>>,
    /// WatchAction subscribers.
    pub(super) watchers: Arc<Watchers>,
    /// Set when the dispatcher may find work (job ready, slot freed).
    pub(super) wants_dispatch: bool,
    /// Counter of stream ids.
    pub(super) next_stream_id: u64,
    /// Counter of leases, for round robin.
    pub(super) lease_seq: u64,
    /// Interned action ids, weakly held: the strong count of an action's id is the
    /// number of its open jobs in memory (queued, delayed or leased) plus
    /// transient holders such as [`State::changed_actions`].
    pub(super) interned_actions: Map<String, std::sync::Weak<str>>,
    /// Size of [`State::interned_actions`] and [`State::old_plans`] after
    /// the last sweep.
    pub(super) interned_after_sweep: usize,
    /// Jobs deleted by retention in the current batch, counted in the
    /// metrics once the batch commits.
    pub(super) expired_in_batch: u64,
    /// Number of stored jobs in each status, indexed by the `JobStatus`
    /// value: counted by [`State::load`] (the open statuses as it loads
    /// them, the finished ones in the background, see
    /// [`State::job_counts`]) and moved by the writer with every status it
    /// writes (see [`State::moved`]), so reading it costs no scan and the
    /// job rows need no status index. A rolled-back batch reloads it with
    /// the rest of the state.
    pub(super) job_counts: [i64; JOB_STATUSES],
    /// The highest job row handed out (`sql::jobs::next_rows`): the
    /// largest stored at load (at least the stored open floor less one),
    /// or a larger one handed out since (rows of a rolled-back batch are
    /// not handed out again).
    pub(super) last_job_row: i64,
    /// The stored first row that may be open (`sql::jobs::open_floor`) as
    /// this writer last read, wrote or lowered it: the start-up load reads
    /// the job rows from it on. Raised by [`BatchState::before_commit`]
    /// (at most every [`FLOOR_EVERY`]) to the lowest open row in memory.
    pub(super) open_floor: i64,
    /// When `before_commit` last looked at raising [`State::open_floor`].
    pub(super) floor_checked: Instant,
    /// At most the lowest row in [`State::delayed_jobs`] (`i64::MAX`:
    /// none): lowered as jobs are delayed, made exact by
    /// [`State::first_open_row`] when the delayed jobs are few enough to
    /// walk ([`FLOOR_WALK_MAX`]).
    pub(super) delayed_low: i64,
    /// Read connections, for counting the finished jobs from a snapshot in
    /// the background after a load; `None`: [`State::load`] counts them
    /// itself.
    pub(super) pool: Option<sql::ReadPool>,
    /// The background count of finished jobs that [`State::load`] started,
    /// until [`State::job_counts`] takes its result: meanwhile
    /// [`State::job_counts`] holds only their changes since the load.
    pub(super) counting: Option<Counting>,
    /// The finished statuses of [`State::job_counts`] include the jobs
    /// counted at the last load (false while or when that count failed).
    pub(super) finished_counted: bool,
    /// Tests: the next background count waits for a message (or the
    /// sender's drop) on this before it reads a row.
    #[cfg(test)]
    pub(super) count_gate: Option<std::sync::mpsc::Receiver<()>>,
}

/// A background count of the finished jobs (see [`State::job_counts`]).
pub(super) struct Counting {
    /// Its result, once done.
    result: std::sync::mpsc::Receiver<Result<HashMap<i32, i64>>>,
    /// Stops its statement; `None` once it is done reading (the
    /// connection may be another reader's by then).
    interrupt: Arc<std::sync::Mutex<Option<rusqlite::InterruptHandle>>>,
}

/// Least time between two looks of `before_commit` at raising
/// [`State::open_floor`]: each look walks the leases (one per busy worker
/// slot) and up to [`FLOOR_WALK_MAX`] delayed jobs, and a raise writes
/// one row.
pub(super) const FLOOR_EVERY: Duration = Duration::from_secs(1);

/// Most delayed jobs [`State::first_open_row`] walks: about 0.1 ms (a
/// walk of a million took 11 ms on a two-core VM).
pub(super) const FLOOR_WALK_MAX: usize = 10_000;

/// The statuses of finished jobs: counted in the background after a load
/// (they are most of the table), while the open ones are counted as they
/// are loaded.
const FINISHED: [JobStatus; 3] = [JobStatus::Completed, JobStatus::Dead, JobStatus::Cancelled];

/// Length of [`State::job_counts`]: one past the largest `JobStatus` value.
pub(super) const JOB_STATUSES: usize = JobStatus::Cancelled as usize + 1;

impl State {
    /// An empty state; call [`State::load`] inside the first transaction.
    pub(super) fn new(cfg: EngineConfig, metrics: SharedMetrics, watchers: Arc<Watchers>) -> Self {
        State {
            cfg,
            metrics,
            plans: Map::default(),
            old_plans: Map::default(),
            ready: BTreeMap::new(),
            groups: Map::default(),
            order: BTreeSet::new(),
            running_by_key: Map::default(),
            since_guard: 0,
            started: None,
            fleet_slots: 0,
            delayed: BTreeSet::new(),
            delayed_jobs: Map::default(),
            fresh_bytes: 0,
            leases: Map::default(),
            lease_by_job: Map::default(),
            workers: Map::default(),
            available: BTreeSet::new(),
            outbox: Vec::new(),
            changed_actions: Default::default(),
            unscheduled: Vec::new(),
            watchers,
            wants_dispatch: true,
            next_stream_id: 1,
            lease_seq: 0,
            interned_actions: Map::default(),
            interned_after_sweep: 0,
            expired_in_batch: 0,
            job_counts: [0; JOB_STATUSES],
            last_job_row: 0,
            open_floor: 0,
            floor_checked: Instant::now(),
            delayed_low: i64::MAX,
            pool: None,
            counting: None,
            finished_counted: false,
            #[cfg(test)]
            count_gate: None,
        }
    }

    /// The same state counting the finished jobs after each load in the
    /// background, on a connection of `pool`.
    pub(super) fn with_pool(mut self, pool: sql::ReadPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Records in [`State::job_counts`] that one stored job went from
    /// status `from` to `to` (`None`: it was inserted, or deleted).
    pub(super) fn moved(&mut self, from: Option<JobStatus>, to: Option<JobStatus>) {
        if let Some(f) = from {
            self.job_counts[f as usize] -= 1;
        }
        if let Some(t) = to {
            self.job_counts[t as usize] += 1;
        }
    }

    /// The number of stored jobs in each status, keyed by the `JobStatus`
    /// value (statuses with no job included, as 0). The finished statuses
    /// are missing while their count since the last load is still under
    /// way (seconds for millions of rows).
    pub(super) fn job_counts(&mut self) -> HashMap<i32, i64> {
        if let Some(Counting { result, .. }) = &self.counting {
            match result.try_recv() {
                Ok(Ok(base)) => {
                    for s in FINISHED {
                        self.job_counts[s as usize] += base.get(&(s as i32)).copied().unwrap_or(0);
                    }
                    self.counting = None;
                    self.finished_counted = true;
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
                Ok(Err(e)) => {
                    tracing::error!(
                        error = %e,
                        "counting the finished jobs failed; their gauges stay unset until the next start"
                    );
                    self.counting = None;
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    tracing::error!(
                        "counting the finished jobs ended without a count; their gauges stay unset until the next start"
                    );
                    self.counting = None;
                }
            }
        }
        JobStatus::ALL
            .iter()
            .filter(|&&s| self.finished_counted || !FINISHED.contains(&s))
            .map(|&s| (s as i32, self.job_counts[s as usize]))
            .collect()
    }

    /// Starts counting the finished jobs as the database is now (before
    /// [`State::load`] writes anything): in the background on a snapshot
    /// of a read connection when the state has a pool, else here. The
    /// load's and later changes move [`State::job_counts`] from 0 meanwhile,
    /// and [`State::job_counts`] adds the count once it is done.
    ///
    /// Errors: [`Error::Storage`] when the snapshot cannot be taken (or,
    /// without a pool, the count fails); [`Error::Internal`] when the
    /// thread cannot start.
    fn count_finished(&mut self, conn: &Connection) -> Result<()> {
        self.stop_counting();
        self.finished_counted = false;
        for s in FINISHED {
            self.job_counts[s as usize] = 0;
        }
        let Some(pool) = &self.pool else {
            let counts = sql::jobs::count_by_status(conn)?;
            for s in FINISHED {
                self.job_counts[s as usize] = counts.get(&(s as i32)).copied().unwrap_or(0);
            }
            self.finished_counted = true;
            return Ok(());
        };
        let reader = pool.get()?;
        reader.execute_batch("BEGIN")?;
        // A read transaction's snapshot starts with its first read. The
        // connection goes back to the pool with no transaction open.
        if let Err(e) = sql::jobs::open_floor(&reader) {
            let _ = reader.execute_batch("ROLLBACK");
            return Err(e);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let interrupt = Arc::new(std::sync::Mutex::new(Some(reader.get_interrupt_handle())));
        let reading = interrupt.clone();
        #[cfg(test)]
        let gate = self.count_gate.take();
        std::thread::Builder::new()
            .name("agq-count".into())
            .spawn(move || {
                #[cfg(test)]
                if let Some(gate) = gate {
                    let _ = gate.recv();
                }
                let started = Instant::now();
                let counts = sql::jobs::count_by_status(&reader);
                // Done reading: from here on the connection may go back to
                // the pool, where an interrupt would hit another reader.
                reading.lock().unwrap_or_else(|e| e.into_inner()).take();
                if reader.execute_batch("COMMIT").is_err() {
                    let _ = reader.execute_batch("ROLLBACK");
                }
                tracing::debug!(
                    secs = started.elapsed().as_secs_f64(),
                    "counted the finished jobs"
                );
                let _ = tx.send(counts);
            })
            .map_err(|e| Error::Internal(format!("cannot start counting the jobs: {e}")))?;
        self.counting = Some(Counting {
            result: rx,
            interrupt,
        });
        Ok(())
    }

    /// Ends a background count still under way (its snapshot is no longer
    /// the state's), so counts do not pile up or hold the WAL.
    fn stop_counting(&mut self) {
        if let Some(c) = self.counting.take() {
            let reading = c.interrupt.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(handle) = reading.as_ref() {
                handle.interrupt();
            }
        }
    }

    /// The lowest row of an open job (queued, delayed or leased), or the
    /// next row to hand out when none is open: what the stored open floor
    /// may be raised to. `None` while open jobs are held outside the queues
    /// (their plan version is missing), whose rows memory does not know.
    /// The delayed jobs are walked only while there are at most
    /// [`FLOOR_WALK_MAX`] of them; beyond, the lowest row ever delayed
    /// since they were last walked stands for them (never above the
    /// lowest open one).
    pub(super) fn first_open_row(&mut self) -> Option<i64> {
        if !self.unscheduled.is_empty() {
            return None;
        }
        let queued = self.ready.first_key_value().map(|(&r, _)| r);
        let leased = self.leases.keys().copied().min();
        if self.delayed_jobs.len() <= FLOOR_WALK_MAX {
            self.delayed_low = self.delayed_jobs.keys().copied().min().unwrap_or(i64::MAX);
        }
        let delayed = Some(self.delayed_low).filter(|&r| r != i64::MAX);
        [queued, leased, delayed]
            .into_iter()
            .flatten()
            .min()
            .or(Some(self.last_job_row + 1))
    }

    /// An interned `Arc<str>` of the action id `s` (shared by its jobs).
    pub(super) fn intern_action(&mut self, s: &str) -> Arc<str> {
        intern_in(&mut self.interned_actions, s)
    }

    /// Drops interned ids and older plan versions no job uses any more
    /// (amortised: only when the tables have grown past twice their size
    /// after the last sweep).
    pub(super) fn sweep_interned(&mut self) {
        let len = self.old_plans.len() + self.interned_actions.len();
        if len > 1024 && len > 2 * self.interned_after_sweep {
            self.old_plans.retain(|_, w| w.strong_count() > 0);
            self.interned_actions.retain(|_, w| w.strong_count() > 0);
            self.interned_after_sweep = self.old_plans.len() + self.interned_actions.len();
        }
    }

    /// The entry of version `version` of plan `plan_id`: the latest from
    /// memory, an older one from [`State::old_plans`] or else read from the
    /// database. `None` when the plan or the version is not stored.
    ///
    /// Errors: [`crate::error::Error::Storage`], `Internal` for an
    /// undecodable row.
    pub(super) fn plan_version(
        &mut self,
        conn: &Connection,
        plan_id: &str,
        version: u32,
    ) -> Result<Option<Arc<PlanEntry>>> {
        let Some(latest) = self.plans.get(plan_id) else {
            return Ok(None);
        };
        if latest.plan.version == version {
            return Ok(Some(latest.clone()));
        }
        let key = (plan_id.to_string(), version);
        if let Some(e) = self.old_plans.get(&key).and_then(|w| w.upgrade()) {
            return Ok(Some(e));
        }
        let Some(plan) = sql::plans::get_version(conn, plan_id, version)? else {
            return Ok(None);
        };
        let entry = Arc::new(PlanEntry::new(plan));
        self.old_plans.insert(key, Arc::downgrade(&entry));
        Ok(Some(entry))
    }

    /// Rebuilds the state from the database. Stream slots, heartbeat
    /// times and the timeouts counted toward quarantine of workers already
    /// in memory are kept, and so is what memory knows of a lease it still
    /// holds (the stream it went out on, whether the worker acknowledged
    /// it, when it was granted, its expiry). Workers new to memory (server
    /// start) count as suspect from now, so their leases return to pending
    /// after the restart grace (the longer of the lease grace and the
    /// stale window) unless they reconnect; a lease new to memory expires
    /// no sooner than the restart grace from now, so a worker that
    /// finished its job while the server was down can still report it.
    ///
    /// Errors: [`crate::error::Error::Storage`].
    pub(super) fn load(&mut self, conn: &Connection) -> Result<()> {
        let now = Instant::now();
        let now_ms = now_ms();
        self.started.get_or_insert(now);
        self.plans.clear();
        self.old_plans.clear();
        for plan in sql::plans::load_all(conn)? {
            self.plans
                .insert(plan.plan_id.clone(), Arc::new(PlanEntry::new(plan)));
        }
        let mut old = std::mem::take(&mut self.workers);
        self.available.clear();
        self.fleet_slots = 0;
        let mut verifications = sql::workers::load_verifications(conn)?;
        for row in sql::workers::load_all(conn)? {
            let id = row.worker.worker_id.clone();
            let state = row.worker.state;
            let prev = old.remove(&id);
            let tools: Set<String> = row.worker.capabilities.commands().cloned().collect();
            let live = state.is_live();
            let mut entry = WorkerEntry {
                key_id: Arc::from(id.as_str()),
                max: row.worker.max_concurrent_jobs.max(1),
                stats: row.worker.stats,
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
                fleet_slots: 0,
                timeouts: Default::default(),
                verified: verifications
                    .remove(&id)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|v| (v.tool.clone(), v))
                    .collect(),
                pending: HashMap::new(),
            };
            if let Some(p) = prev {
                entry.last_heartbeat = p.last_heartbeat;
                entry.last_heartbeat_ms = p.last_heartbeat_ms;
                entry.stats = p.stats;
                // Streams that closed while the state could not be kept
                // (their close events were refused) are let go here.
                entry.heartbeat = p.heartbeat.filter(|s| !s.tx.is_closed());
                entry.lease_stream = p.lease_stream.filter(|s| !s.tx.is_closed());
                entry.suspect_since = match (&entry.heartbeat, p.suspect_since) {
                    (None, None) if live => Some(now),
                    (_, since) => since,
                };
                entry.last_lease_seq = p.last_lease_seq;
                entry.timeouts = p.timeouts;
                // Challenges still waiting for an answer live in memory only.
                entry.pending = p.pending;
            }
            self.workers.insert(id, entry);
        }
        self.ready.clear();
        self.groups.clear();
        self.order.clear();
        self.running_by_key.clear();
        self.delayed.clear();
        self.delayed_jobs.clear();
        self.delayed_low = i64::MAX;
        self.fresh_bytes = 0;
        let mut old_leases = std::mem::take(&mut self.leases);
        let grace_ms = i64::try_from(self.cfg.restart_grace().as_millis()).unwrap_or(i64::MAX / 4);
        self.lease_by_job.clear();
        self.unscheduled.clear();
        self.job_counts = [0; JOB_STATUSES];
        self.count_finished(conn)?;
        self.open_floor = sql::jobs::open_floor(conn)?;
        // Rows below the floor are never handed out again, even when the
        // rows above them were deleted.
        self.last_job_row = self
            .last_job_row
            .max(sql::jobs::last_row(conn)?)
            .max(self.open_floor - 1);
        self.floor_checked = now;
        let mut orphaned = Vec::new();
        let settings = sql::jobs::open_action_scheduling(conn)?;
        let mut scheds: HashMap<(String, i32), Arc<Sched>> = HashMap::new();
        for job in sql::jobs::load_open(conn, self.open_floor)? {
            self.job_counts[job.status as usize] += 1;
            // Deleting a plan deletes its jobs, and refuses while any is
            // open: only a database edited by hand lacks the version.
            let Some(plan) = self.plan_version(conn, &job.plan_id, job.plan_version)? else {
                tracing::error!(
                    job_id = %job.job_id,
                    plan_id = %job.plan_id,
                    plan_version = job.plan_version,
                    "an open job's plan version is not stored; the job is not scheduled"
                );
                let action_id = self.intern_action(&job.action_id);
                self.unscheduled.push(action_id);
                continue;
            };
            let action_id = self.intern_action(&job.action_id);
            let sched = match scheds.get(&(job.action_id.clone(), job.priority)) {
                Some(s) => s.clone(),
                None => {
                    let s = Arc::new(match settings.get(&job.action_id) {
                        Some(s) => Sched::new(s)?.with_priority(job.priority),
                        None => Sched::new(&Scheduling {
                            priority: job.priority,
                            ..Default::default()
                        })?,
                    });
                    scheds.insert((job.action_id.clone(), job.priority), s.clone());
                    s
                }
            };
            match job.status {
                JobStatus::Running => {
                    let worker_id = job.worker_id.clone().unwrap_or_default();
                    let lease_id = job.lease_id.clone().unwrap_or_default();
                    let mut lease = Lease {
                        lease_id,
                        worker_id: worker_id.clone(),
                        job_id: job.job_id.clone(),
                        action_id,
                        plan,
                        sched: sched.clone(),
                        attempt: job.attempt,
                        max_attempts: job.max_attempts,
                        expires_at_ms: job
                            .lease_expires_at_ms
                            .unwrap_or(now_ms)
                            .max(now_ms.saturating_add(grace_ms)),
                        granted_at_ms: now_ms,
                        stream_id: 0,
                        acknowledged: false,
                    };
                    if let Some(old) = old_leases
                        .remove(&job.row)
                        .filter(|o| o.lease_id == lease.lease_id && o.worker_id == worker_id)
                    {
                        lease.expires_at_ms = old.expires_at_ms;
                        lease.granted_at_ms = old.granted_at_ms;
                        lease.stream_id = old.stream_id;
                        lease.acknowledged = old.acknowledged;
                    }
                    self.lease_by_job.insert(job.job_id.clone(), job.row);
                    if let Some((key, _)) = &sched.limit {
                        *self.running_by_key.entry(key.clone()).or_default() += 1;
                    }
                    self.leases.insert(job.row, lease);
                    match self.workers.get_mut(&worker_id) {
                        Some(w) if w.state.is_live() => {
                            w.leases.insert(job.row);
                        }
                        _ => orphaned.push(job.row),
                    }
                }
                status => {
                    let waiting = Waiting {
                        plan,
                        action_id,
                        sched,
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
    pub(super) fn enqueue(&mut self, row: i64, waiting: Waiting, now_ms: i64) {
        if waiting.since_ms <= now_ms && waiting.status == JobStatus::Pending {
            let key = (waiting.action_id.clone(), waiting.sched.priority);
            let group = self.groups.entry(key.clone()).or_default();
            group.rows.insert(row);
            if group.rows.first() == Some(&row) {
                self.refile(&key);
            }
            self.ready.insert(row, waiting);
            self.wants_dispatch = true;
        } else {
            self.delayed.insert((waiting.since_ms, row));
            self.delayed_jobs.insert(row, waiting);
            self.delayed_low = self.delayed_low.min(row);
        }
    }

    /// True while a pending, running or failed (retrying) job uses any
    /// version of the plan: every such job is in the ready or delayed
    /// queue or leased.
    pub(super) fn plan_in_use(&self, plan_id: &str) -> bool {
        self.groups
            .values()
            .filter_map(|g| g.rows.first())
            .filter_map(|row| self.ready.get(row))
            .any(|w| &*w.plan.id == plan_id)
            || self.delayed_jobs.values().any(|w| &*w.plan.id == plan_id)
            || self.leases.values().any(|l| &*l.plan.id == plan_id)
    }

    /// Takes the kept row of the ready job at `row` (see [`FreshJob`]), if
    /// it has one, with the job's queue entry.
    pub(super) fn take_fresh(&mut self, row: i64) -> Option<(FreshJob, &Waiting)> {
        let waiting = self.ready.get_mut(&row)?;
        let fresh = *waiting.fresh.take()?;
        self.fresh_bytes = self.fresh_bytes.saturating_sub(fresh.weight());
        Some((fresh, waiting))
    }

    /// Removes a job from the ready or delayed queue; returns what it was.
    /// A kept row it still had no longer counts against the budget.
    pub(super) fn dequeue(&mut self, row: i64) -> Option<Waiting> {
        if let Some(w) = self.ready.remove(&row) {
            if let Some(fresh) = &w.fresh {
                self.fresh_bytes = self.fresh_bytes.saturating_sub(fresh.weight());
            }
            let key = (w.action_id.clone(), w.sched.priority);
            let was_head = self
                .groups
                .get_mut(&key)
                .is_some_and(|g| g.rows.first() == Some(&row) && g.rows.remove(&row));
            if was_head {
                self.refile(&key);
            } else if let Some(g) = self.groups.get_mut(&key) {
                g.rows.remove(&row);
            }
            return Some(w);
        }
        if let Some(w) = self.delayed_jobs.remove(&row) {
            self.delayed.remove(&(w.since_ms, row));
            return Some(w);
        }
        None
    }

    /// Re-files group `key` in [`State::order`] after its head or its
    /// last service changed; drops it when it has no ready job left.
    pub(super) fn refile(&mut self, key: &GroupKey) {
        let Some(group) = self.groups.get_mut(key) else {
            return;
        };
        if let Some(old) = group.filed.take() {
            self.order.remove(&(old, key.clone()));
        }
        match group.rows.first() {
            Some(&head) => {
                let at = (Reverse(key.1), group.served, head);
                group.filed = Some(at);
                self.order.insert((at, key.clone()));
            }
            None => {
                self.groups.remove(key);
            }
        }
    }

    /// Re-files worker `id` in [`State::available`] after a change of its
    /// state, streams or load.
    pub(super) fn refresh_available(&mut self, id: &str) {
        let Some(w) = self.workers.get_mut(id) else {
            return;
        };
        if let Some(key) = w.avail_key.take() {
            self.available.remove(&key);
        }
        // Not while suspect (its heartbeat stream dropped): what it leased
        // now would be taken back after the grace, each time costing the
        // job an attempt.
        let connected = w.state == WorkerState::Active
            && w.suspect_since.is_none()
            && w.lease_stream.as_ref().is_some_and(|s| !s.tx.is_closed());
        let slots = if connected { w.max } else { 0 };
        self.fleet_slots =
            self.fleet_slots.saturating_sub(u64::from(w.fleet_slots)) + u64::from(slots);
        w.fleet_slots = slots;
        let eligible = connected && (w.leases.len() as u32) < w.max;
        if eligible {
            let key = (w.leases.len() as u32, w.last_lease_seq, w.key_id.clone());
            w.avail_key = Some(key.clone());
            self.available.insert(key);
            self.wants_dispatch = true;
        }
    }

    /// True while the worker's last heartbeat is younger than 3 x interval.
    pub(super) fn is_fresh(&self, w: &WorkerEntry, now: Instant) -> bool {
        now.saturating_duration_since(w.last_heartbeat) < self.cfg.stale_after()
    }

    /// Queues a command for a worker's heartbeat stream, if it has one open.
    pub(super) fn command(&mut self, worker_id: &str, cmd: WorkerCommand) {
        let next_deadline_ms = self.next_deadline_ms();
        if let Some(slot) = self
            .workers
            .get(worker_id)
            .and_then(|w| w.heartbeat.as_ref())
        {
            let msg = HeartbeatEvent::Reply(HeartbeatReply {
                next_deadline_ms,
                command: Some(cmd),
                revoked_leases: Vec::new(),
            });
            self.outbox.push(Effect::Heartbeat(slot.tx.clone(), msg));
        }
    }

    /// The deadline of a heartbeat sent now, ms.
    pub(super) fn next_deadline_ms(&self) -> i64 {
        now_ms() + self.cfg.heartbeat_interval.as_millis() as i64
    }

    /// Rows of the next `count` jobs of a queue: the ready queue by
    /// priority, highest first, and by age within a priority (the lease
    /// order when workers can take every job, up to the round robin among
    /// actions and the starvation guard), or the scheduled one soonest
    /// first.
    pub(super) fn peek(&self, queue: QueueName, count: usize) -> Vec<i64> {
        match queue {
            QueueName::Scheduled => self.delayed.iter().take(count).map(|(_, r)| *r).collect(),
            QueueName::Ready => {
                let mut out = Vec::with_capacity(count.min(self.ready.len()));
                let mut entries = self.order.iter().peekable();
                while out.len() < count {
                    let Some(((Reverse(p), _, _), _)) = entries.peek() else {
                        break;
                    };
                    let p = *p;
                    // Merge the groups of priority p by row.
                    let mut iters = Vec::new();
                    let mut heap = std::collections::BinaryHeap::new();
                    while let Some((_, key)) = entries.next_if(|((Reverse(q), _, _), _)| *q == p) {
                        if let Some(g) = self.groups.get(key) {
                            let mut rows = g.rows.iter();
                            if let Some(&r) = rows.next() {
                                heap.push((Reverse(r), iters.len()));
                                iters.push(rows);
                            }
                        }
                    }
                    while out.len() < count {
                        let Some((Reverse(r), i)) = heap.pop() else {
                            break;
                        };
                        out.push(r);
                        if let Some(&next) = iters[i].next() {
                            heap.push((Reverse(next), i));
                        }
                    }
                }
                out
            }
        }
    }

    /// Workers by (state, fresh), for the `agq_workers` gauge.
    pub(super) fn worker_counts(&self) -> HashMap<(WorkerState, bool), i64> {
        let now = Instant::now();
        let mut counts = HashMap::new();
        for w in self.workers.values() {
            *counts.entry((w.state, self.is_fresh(w, now))).or_default() += 1;
        }
        counts
    }

    /// Records that a job of `action` changed status (for WatchAction).
    pub(super) fn touch(&mut self, action: &Arc<str>) {
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
        // Every open job is in memory (queued, delayed or leased) and holds
        // its action's id, so an id held by `changed_actions` alone is an
        // action with no open job: it is marked without reading its job
        // rows (retention reads them again before it deletes anything).
        // RetryJob and RetryAction clear the time themselves.
        let mut finished_ms = None;
        for action in &self.changed_actions {
            if Arc::strong_count(action) == 1 {
                let at_ms = *finished_ms.get_or_insert_with(now_ms);
                sql::retention::mark_finished(conn, action, at_ms)?;
            }
        }
        // Raise the stored open floor to the lowest open row, in the same
        // transaction as the changes that finished the jobs below it.
        if self.floor_checked.elapsed() >= FLOOR_EVERY {
            self.floor_checked = Instant::now();
            if let Some(row) = self.first_open_row().filter(|&r| r > self.open_floor) {
                sql::jobs::set_open_floor(conn, row)?;
                self.open_floor = row;
            }
        }
        Ok(())
    }

    fn after_commit(&mut self, commit: Option<Commit>) {
        if let Some(c) = commit {
            self.metrics.batch_size.observe(c.ops as f64);
            self.metrics.commit_duration.observe(c.took.as_secs_f64());
        }
        if self.expired_in_batch > 0 {
            self.metrics
                .expired_jobs
                .inc_by(std::mem::take(&mut self.expired_in_batch));
        }
        for effect in self.outbox.drain(..) {
            match effect {
                Effect::Lease(tx, lease) => {
                    let _ = tx.send(*lease);
                }
                Effect::Heartbeat(tx, msg) => {
                    let _ = tx.send(msg);
                }
            }
        }
        let watchers = self.watchers.clone();
        watchers.notify(&mut self.changed_actions);
    }

    fn after_rollback(&mut self, conn: &Connection) -> Result<()> {
        self.outbox.clear();
        self.expired_in_batch = 0;
        self.changed_actions.clear();
        self.load(conn)
    }

    fn on_shutdown(&mut self, conn: &Connection) {
        // A count still reading would hold the WAL the final checkpoint
        // truncates.
        self.stop_counting();
        if let Err(e) = self.flush_heartbeats(conn, true) {
            tracing::warn!(error = %e, "flushing heartbeats at shutdown failed");
        }
        for w in self.workers.values_mut() {
            w.heartbeat = None;
            w.lease_stream = None;
        }
    }
}
