//! The single writer: one thread owns the write connection and the engine's
//! in-memory state, and runs every state change as an operation. Operations
//! that arrive together share one transaction and one commit (group commit).
//! An operation that refuses changes nothing: it refuses before it touches
//! the in-memory state, and its SQL writes, if any, are undone to its
//! savepoint. One that storage fails under (which may have changed the
//! state), or after which SQLite has rolled the transaction back by itself
//! (a read's I/O error does that too), rolls back its whole batch; the
//! state is then rebuilt from the database and the operations queued
//! behind it run in the next batch.
//! Replies and side effects (lease pushes, stream commands) are released
//! only after the commit succeeded.

use std::{
    cell::{RefCell, RefMut},
    collections::VecDeque,
    ops::Deref,
    sync::Arc,
    time::{Duration, Instant},
};

use prometheus_client::metrics::counter::Counter;
use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot, watch};

use super::sql::CheckpointSignal;
use crate::error::{Error, Result};

/// The most operations one commit carries.
const MAX_BATCH: usize = 1024;

/// The most rows the large operations of one commit write, as their
/// callers declare them ([`Writer::write_direct_rows`]: a submission counts
/// one row per job; every other operation counts as one): 1,024, a few
/// milliseconds of the writer's time. Each batch takes every small (one-row)
/// operation queued, then the large ones in arrival order while the
/// batch stays within this (the oldest always, however large, so none
/// starves). Reports, heartbeats, reaper ticks and lease streams queued
/// behind a burst of large submissions thus wait for the commit in
/// progress and then commit in the next, both bounded, not for the whole
/// burst; and each submission is answered after its own commit. Small operations keep their order among
/// themselves, and large ones among themselves; a small operation may
/// overtake a large one queued before it (concurrent requests, whose
/// callers had not seen each other's replies).
const MAX_BATCH_ROWS: usize = 1024;

/// One durable commit of the batch loop, as [`BatchState::after_commit`]
/// is told of it.
#[derive(Debug, Clone, Copy)]
pub struct Commit {
    /// Operations the commit carried (at least 1).
    pub ops: usize,
    /// How long the `COMMIT` itself took: writing the WAL frames and,
    /// with `synchronous=FULL`, syncing them.
    pub took: Duration,
}

/// State owned by the writer thread, with the hooks the batch loop calls.
pub trait BatchState: Send + 'static {
    /// Runs after the batch's operations, inside the transaction, before
    /// the commit (the dispatcher grants leases here).
    ///
    /// Errors: a storage error rolls the whole batch back.
    fn before_commit(&mut self, conn: &Connection) -> Result<()>;
    /// Runs once the commit is durable: releases buffered side effects.
    /// `commit` describes the commit; `None` when no operation was
    /// committed (a batch of reads run while the store cannot commit, or
    /// a batch that only carried the stop).
    fn after_commit(&mut self, commit: Option<Commit>);
    /// Runs when the batch was rolled back: drops buffered side effects and
    /// rebuilds the in-memory state from the database.
    ///
    /// Errors: a storage error of the rebuild. The state is then not to be
    /// trusted: the writer refuses every operation, reads included, and
    /// tries the rebuild again until it succeeds.
    fn after_rollback(&mut self, conn: &Connection) -> Result<()>;
    /// Runs when the writer stops, after the last batch.
    fn on_shutdown(&mut self, conn: &Connection);
}

type Reply = Box<dyn FnOnce(Result<()>) + Send>;
type TxFn<S> = Box<dyn for<'a, 'c> FnOnce(Ctx<'a, 'c, S>) -> (Outcome, Reply) + Send>;

/// The write connection as the operations of one batch see it: it
/// derefs to the [`Connection`], and keeps the statements the operations
/// take with [`BatchConn::kept`] prepared until the batch ends. A
/// statement of the connection's cache costs two hashes of its SQL text
/// and two updates of the cache's LRU order at every use; a kept one,
/// after its first use in the batch, a comparison with the few others
/// kept.
pub struct BatchConn<'c> {
    conn: &'c Connection,
    kept: RefCell<Vec<(&'static str, rusqlite::CachedStatement<'c>)>>,
}

impl<'c> BatchConn<'c> {
    /// `conn`, with no statement kept yet.
    pub fn new(conn: &'c Connection) -> Self {
        BatchConn {
            conn,
            kept: RefCell::new(Vec::new()),
        }
    }

    /// The statement of `sql`, prepared (from the connection's cache) at
    /// its first use in the batch and kept for the batch's other
    /// operations. Use it within one expression: a second statement
    /// cannot be taken while one is held.
    ///
    /// Errors: [`Error::Storage`] when SQLite cannot prepare it;
    /// [`Error::Internal`] when a kept statement is held already.
    pub fn kept(&self, sql: &'static str) -> Result<RefMut<'_, rusqlite::CachedStatement<'c>>> {
        let mut kept = self
            .kept
            .try_borrow_mut()
            .map_err(|_| Error::Internal("a kept statement is held already".into()))?;
        let i = match kept.iter().position(|(s, _)| *s == sql) {
            Some(i) => i,
            None => {
                kept.push((sql, self.conn.prepare_cached(sql)?));
                kept.len() - 1
            }
        };
        Ok(RefMut::map(kept, |k| &mut k[i].1))
    }
}

impl Deref for BatchConn<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// What a queued operation gets: the state and connection to run on, or,
/// while the store cannot commit, the cause to refuse with (it does not run).
enum Ctx<'a, 'c, S> {
    /// Run on this state and connection.
    Run(&'a mut S, &'a BatchConn<'c>),
    /// Do not run: the store cannot commit (the cause, in words).
    Refuse(&'static str),
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// It succeeded.
    Done,
    /// It refused (bad input, wrong state, ...), or was refused.
    Refused,
    /// Storage failed under it; with the cause when the environment (disk
    /// full, I/O error) is to blame (see [`super::sql::store_fault`]).
    Broken(Option<&'static str>),
}

impl Outcome {
    fn of<R>(r: &Result<R>) -> Outcome {
        match r {
            Ok(_) => Outcome::Done,
            Err(e @ (Error::Storage { .. } | Error::StoreBusy(_))) => {
                Outcome::Broken(e.store_fault())
            }
            Err(_) => Outcome::Refused,
        }
    }
}

/// Whether the store can commit, shared by the writer (which sets it) and
/// the server (which turns gRPC health `NOT_SERVING` while it cannot).
/// Cheap to clone.
#[derive(Clone)]
pub struct StoreHealth {
    ok: Arc<watch::Sender<bool>>,
    errors: Counter,
}

impl StoreHealth {
    /// A healthy store whose failed writes count in `errors`
    /// (`agq_store_write_errors_total`).
    pub fn new(errors: Counter) -> StoreHealth {
        StoreHealth {
            ok: Arc::new(watch::channel(true).0),
            errors,
        }
    }

    /// A receiver of the current state: true while the store commits,
    /// false from a commit that failed for a cause outside AGQ (disk full,
    /// I/O error) until one succeeds again.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.ok.subscribe()
    }

    /// True while the store commits.
    #[cfg(test)]
    pub fn is_ok(&self) -> bool {
        *self.ok.borrow()
    }

    fn failed(&self) {
        self.errors.inc();
        self.ok.send_if_modified(|ok| std::mem::replace(ok, false));
    }

    fn recovered(&self) {
        self.ok.send_if_modified(|ok| !std::mem::replace(ok, true));
    }
}

impl Default for StoreHealth {
    fn default() -> Self {
        StoreHealth::new(Counter::default())
    }
}

enum Op<S> {
    /// A state change: runs in a savepoint. It must refuse before it
    /// changes the in-memory state; its SQL writes before a refusal are
    /// rolled back to the savepoint. A storage error rolls back the whole
    /// batch, as for [`Op::Direct`].
    Write(TxFn<S>),
    /// A state change that checks everything before its first SQL write,
    /// so once it writes only a storage error can stop it: no savepoint
    /// (a savepoint copies every page the operation touches), and a storage
    /// error rolls the whole batch back; the operations after it in the
    /// batch are carried over to the next batch. With the rows it writes
    /// (see [`MAX_BATCH_ROWS`]).
    Direct(TxFn<S>, usize),
    /// A read of the state and database: no savepoint.
    Read(TxFn<S>),
    /// Finish the queued operations, then stop the thread.
    Stop,
}

/// Handle to the writer thread. Cloning is cheap; the thread stops when the
/// last handle is dropped.
pub struct Writer<S> {
    tx: mpsc::UnboundedSender<Op<S>>,
}

impl<S> Op<S> {
    /// The rows this operation counts for in [`MAX_BATCH_ROWS`].
    fn rows(&self) -> usize {
        match self {
            Op::Direct(_, rows) => (*rows).max(1),
            Op::Write(_) | Op::Read(_) => 1,
            Op::Stop => 0,
        }
    }
}

impl<S> Clone for Writer<S> {
    fn clone(&self) -> Self {
        Writer {
            tx: self.tx.clone(),
        }
    }
}

impl<S: BatchState> Writer<S> {
    /// Starts the writer thread on `conn` with `state`; `checkpoint` is
    /// woken after every commit that wrote; `health` follows whether the
    /// store can commit. The returned join handle finishes after every
    /// handle is dropped and the queue drained.
    ///
    /// Errors: [`Error::Internal`] when the thread cannot be spawned.
    pub fn start(
        conn: Connection,
        state: S,
        checkpoint: CheckpointSignal,
        health: StoreHealth,
    ) -> Result<(Self, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = std::thread::Builder::new()
            .name("agq-writer".into())
            .spawn(move || run(conn, state, rx, checkpoint, health))
            .map_err(|e| Error::Internal(format!("cannot start the writer thread: {e}")))?;
        Ok((Writer { tx }, handle))
    }

    /// Runs `f` as a state change and returns its result once committed.
    /// `f` may write SQL before it refuses (those writes are rolled back),
    /// but must refuse before it changes the in-memory state: after that
    /// only a storage error may stop it, which rolls back the whole batch
    /// and rebuilds the state from the database.
    ///
    /// Errors: whatever `f` returns (its writes are rolled back);
    /// [`Error::StoreUnavailable`] when the store cannot commit (disk full,
    /// I/O error: `f` did not run or was rolled back); [`Error::Internal`]
    /// when the commit failed otherwise; [`Error::Unavailable`] when the
    /// writer has stopped.
    pub async fn write<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::Write).await
    }

    /// Runs `f` as a state change without a savepoint and returns its result
    /// once committed. `f` must check everything before its first SQL write:
    /// once it has written, the only error it may return is a storage error
    /// ([`Error::Storage`]), which rolls back the whole batch (the writes of
    /// a refused `f` would otherwise be committed). Worth it for the
    /// frequent operations (a savepoint journals every page touched).
    ///
    /// Errors: as [`Writer::write`].
    pub async fn write_direct<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::Direct(1)).await
    }

    /// As [`Writer::write_direct`], for an operation that writes about
    /// `rows` rows (a submission of `rows` jobs): it counts for that many
    /// in the batch's [`MAX_BATCH_ROWS`], so large ones do not pile up
    /// in one commit.
    ///
    /// Errors: as [`Writer::write`].
    pub async fn write_direct_rows<R, F>(&self, rows: usize, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::Direct(rows)).await
    }

    /// Runs `f` on the writer thread without a savepoint, for operations
    /// that write no SQL (reads of the in-memory state, heartbeats); the
    /// reply follows the batch's commit like any other. While the store
    /// cannot commit, these still run (outside any transaction).
    ///
    /// Errors: whatever `f` returns; [`Error::StoreUnavailable`] or
    /// [`Error::Internal`] when the batch it ran in failed to commit;
    /// [`Error::Unavailable`] when the writer has stopped.
    pub async fn run<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::Read).await
    }

    /// As [`Writer::run`], for an operation whose effect lives in memory
    /// only and outlives a rollback's rebuild of the state (a heartbeat's
    /// freshness): its answer stands even when the batch it ran in fails to
    /// commit, so a store that cannot commit does not turn it into an error.
    ///
    /// Errors: whatever `f` returns; [`Error::StoreUnavailable`] when the
    /// state could not be rebuilt after a rollback (nothing runs then);
    /// [`Error::Unavailable`] when the writer has stopped.
    pub async fn run_uncommitted<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::ReadUncommitted).await
    }

    /// Queues a state change whose result nobody waits for (stream-closed
    /// events, reaper ticks). While the store cannot commit it is dropped
    /// without running (a reaper tick comes again; see [`StoreHealth`]).
    /// Returns false when the writer has stopped.
    pub fn submit<F>(&self, f: F) -> bool
    where
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<()> + Send + 'static,
    {
        let op: TxFn<S> = Box::new(move |ctx| {
            let Ctx::Run(s, c) = ctx else {
                return (Outcome::Refused, Box::new(|_| {}));
            };
            let r = f(s, c);
            match &r {
                Err(e) if e.store_fault().is_some() => {
                    tracing::debug!(error = %e, "background operation failed")
                }
                Err(e) => tracing::warn!(error = %e, "background operation failed"),
                Ok(()) => {}
            }
            (Outcome::of(&r), Box::new(|_| {}))
        });
        self.tx.send(Op::Write(op)).is_ok()
    }

    /// Queues an operation that writes no SQL and whose result nobody
    /// waits for (a stream that closed): it runs like [`Writer::run`],
    /// while the store cannot commit too. Only a state that could not be
    /// rebuilt after a rollback drops it (the rebuild then lets closed
    /// streams go itself). Returns false when the writer has stopped.
    pub fn submit_run<F>(&self, f: F) -> bool
    where
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<()> + Send + 'static,
    {
        let op: TxFn<S> = Box::new(move |ctx| {
            let Ctx::Run(s, c) = ctx else {
                return (Outcome::Refused, Box::new(|_| {}));
            };
            if let Err(e) = f(s, c) {
                tracing::warn!(error = %e, "background operation failed");
            }
            (Outcome::Done, Box::new(|_| {}))
        });
        self.tx.send(Op::Read(op)).is_ok()
    }

    /// Asks the writer to stop after the operations queued so far; later
    /// calls fail with [`Error::Unavailable`].
    pub fn stop(&self) {
        let _ = self.tx.send(Op::Stop);
    }

    async fn call<R, F>(&self, f: F, kind: Kind) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &BatchConn<'_>) -> Result<R> + Send + 'static,
    {
        let (reply_tx, reply_rx) = oneshot::channel::<Result<R>>();
        let stands = matches!(kind, Kind::ReadUncommitted);
        // The request's share of the request buffer stays held while its
        // data waits here, even if the caller goes away.
        let share = crate::request_budget::current_share();
        let op: TxFn<S> = Box::new(move |ctx| {
            let _share = share;
            let r = match ctx {
                Ctx::Run(s, c) => f(s, c),
                Ctx::Refuse(cause) => Err(Error::StoreUnavailable(cause)),
            };
            let outcome = Outcome::of(&r);
            let reply: Reply = Box::new(move |commit: Result<()>| {
                let out = match (commit, r) {
                    (Ok(()), r) => r,
                    (Err(_), Err(e)) => Err(e),
                    (Err(_), Ok(v)) if stands => Ok(v),
                    (Err(e), Ok(_)) => Err(e),
                };
                let _ = reply_tx.send(out);
            });
            (outcome, reply)
        });
        let op = match kind {
            Kind::Write => Op::Write(op),
            Kind::Direct(rows) => Op::Direct(op, rows),
            Kind::Read | Kind::ReadUncommitted => Op::Read(op),
        };
        self.tx.send(op).map_err(|_| Error::Unavailable)?;
        reply_rx.await.map_err(|_| Error::Unavailable)?
    }
}

/// The kind of operation [`Writer::call`] queues.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Write,
    /// With the rows it writes.
    Direct(usize),
    Read,
    /// A read whose answer stands whatever the batch's commit does.
    ReadUncommitted,
}

/// The cause the writer refuses operations with while its in-memory state
/// could not be rebuilt from the database after a rollback.
const STALE_STATE: &str = "the server's state could not be read back from the database";

/// First wait before probing a store that could not commit.
const PROBE_FIRST: Duration = Duration::from_millis(25);
/// Longest wait between two probes of a store that cannot commit.
const PROBE_MAX: Duration = Duration::from_secs(2);
/// Least time between two log lines about a store that still cannot commit.
const FAULT_LOG_EVERY: Duration = Duration::from_secs(10);

/// The writer's record of a store that cannot commit.
struct Fault {
    /// The cause, in words.
    cause: &'static str,
    /// When it began.
    since: Instant,
    /// Wait before the next probe after this one fails.
    backoff: Duration,
    /// When the next probe is due.
    next_probe: Instant,
    /// When the last "still cannot commit" line was logged.
    logged: Instant,
    /// Operations refused since the last log line.
    refused: u64,
}

impl Fault {
    fn new(cause: &'static str, backoff: Duration) -> Fault {
        let now = Instant::now();
        Fault {
            cause,
            since: now,
            backoff,
            next_probe: now + backoff,
            logged: now,
            refused: 0,
        }
    }
}

/// Free space the database's file system must have before a store that
/// could not commit is tried again: 256 KiB. Without it a store on a full
/// disk would flap: a small commit fits in log space a failed one left
/// behind, and the next real batch fails again.
pub const RECOVERY_HEADROOM_BYTES: u64 = 256 * 1024;

/// Bytes free (for unprivileged users) on the file system of `path`;
/// `None` when unknown.
fn free_bytes(path: &str) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    #[allow(clippy::useless_conversion)] // the field types differ by platform
    let (avail, frag) = (
        u64::from(st.blocks_available()),
        u64::from(st.fragment_size()),
    );
    Some(avail.saturating_mul(frag))
}

/// Tries one tiny commit (the schema version, rewritten unchanged) once
/// the file system has [`RECOVERY_HEADROOM_BYTES`] free: it succeeds only
/// when the store can append to its log again.
///
/// Returns false, without trying, while the free space is short.
///
/// Errors: storage errors of the commit.
fn probe(conn: &Connection) -> Result<bool> {
    let room = conn
        .path()
        .filter(|p| !p.is_empty())
        .and_then(free_bytes)
        .is_none_or(|free| free >= RECOVERY_HEADROOM_BYTES);
    if !room {
        return Ok(false);
    }
    let r = (|| -> Result<()> {
        exec(conn, "BEGIN IMMEDIATE")?;
        let v: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        conn.pragma_update(None, "user_version", v)?;
        exec(conn, "COMMIT")?;
        Ok(())
    })();
    if r.is_err() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    r.map(|()| true)
}

/// Puts an operation taken from the queue where it belongs: a small one
/// (one row) into the batch being built, a large one at the end of
/// `waiting`; [`Op::Stop`] goes nowhere and sets `stopping` (the
/// operations queued after it are not taken).
fn sort_op<S>(
    op: Op<S>,
    batch: &mut Vec<Op<S>>,
    waiting: &mut VecDeque<Op<S>>,
    stopping: &mut bool,
) {
    match op {
        Op::Stop => *stopping = true,
        op if op.rows() > 1 => waiting.push_back(op),
        op => batch.push(op),
    }
}

fn run<S: BatchState>(
    conn: Connection,
    mut state: S,
    mut rx: mpsc::UnboundedReceiver<Op<S>>,
    checkpoint: CheckpointSignal,
    health: StoreHealth,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut replies: Vec<Reply> = Vec::with_capacity(MAX_BATCH);
    // Operations not run because a storage error ended their batch.
    let mut carried: Vec<Op<S>> = Vec::new();
    let mut stopping = false;
    // Set while the store cannot commit: writes are refused without
    // running, and a probe commit is tried with backoff.
    let mut fault: Option<Fault> = None;
    // When the last fault ended and the backoff it had reached, so a store
    // that keeps failing right after recovering is probed less often.
    let mut last_fault: Option<(Instant, Duration)> = None;
    // Consecutive batches that failed for a cause that is not the store's.
    let mut internal_failures = 0u32;
    // Set while the in-memory state could not be rebuilt after a rollback:
    // every operation is refused (reads too) until a rebuild succeeds.
    let mut stale = false;
    // Operations of more than one row waiting for a batch, oldest first
    // (small operations queued after them may go first).
    let mut waiting: VecDeque<Op<S>> = VecDeque::new();
    while !stopping || !carried.is_empty() || !waiting.is_empty() {
        batch.append(&mut carried);
        let mut taken = 0;
        if batch.is_empty() && waiting.is_empty() {
            let Some(first) = rx.blocking_recv() else {
                break;
            };
            sort_op(first, &mut batch, &mut waiting, &mut stopping);
            taken += 1;
        }
        // Whatever else is queued: small operations join this batch,
        // large ones wait their turn in arrival order.
        while !stopping && taken < MAX_BATCH && batch.len() < MAX_BATCH {
            let Ok(op) = rx.try_recv() else {
                break;
            };
            sort_op(op, &mut batch, &mut waiting, &mut stopping);
            taken += 1;
        }
        if stopping {
            rx.close();
        }
        // Then the large ones, oldest first, while the batch's rows stay
        // within MAX_BATCH_ROWS; the oldest always, so none starves.
        let mut rows: usize = batch.iter().map(Op::rows).sum();
        let mut took_large = false;
        while let Some(next) = waiting.front() {
            if took_large && (rows + next.rows() > MAX_BATCH_ROWS || batch.len() >= MAX_BATCH) {
                break;
            }
            rows += next.rows();
            took_large = true;
            batch.extend(waiting.pop_front());
        }
        let ops = batch.len();
        if let Some(f) = &mut fault {
            if Instant::now() >= f.next_probe {
                match probe(&conn) {
                    Ok(false) => {
                        tracing::debug!("not enough free space to probe the store");
                        f.backoff = (f.backoff * 2).min(PROBE_MAX);
                        f.next_probe = Instant::now() + f.backoff;
                    }
                    Ok(true) if stale => match state.after_rollback(&conn) {
                        Ok(()) => {
                            tracing::info!("the in-memory state was rebuilt from the database");
                            stale = false;
                            // Cleared at the next probe, which also sees
                            // whether the store commits.
                            f.next_probe = Instant::now();
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "rebuilding the in-memory state failed again");
                            f.backoff = (f.backoff * 2).min(PROBE_MAX);
                            f.next_probe = Instant::now() + f.backoff;
                        }
                    },
                    Ok(true) => {
                        tracing::info!(
                            down_secs = f.since.elapsed().as_secs_f64(),
                            cause = f.cause,
                            "the store commits again: writes accepted, health SERVING"
                        );
                        last_fault = Some((Instant::now(), f.backoff));
                        fault = None;
                        health.recovered();
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "probe commit failed");
                        health.failed();
                        if let Some(cause) = e.store_fault() {
                            f.cause = cause;
                        }
                        f.backoff = (f.backoff * 2).min(PROBE_MAX);
                        f.next_probe = Instant::now() + f.backoff;
                    }
                }
            }
        }
        if let Some(f) = &mut fault {
            // Refuse the writes without running them; run the reads.
            for op in batch.drain(..) {
                match op {
                    Op::Write(g) | Op::Direct(g, _) => {
                        f.refused += 1;
                        replies.push(g(Ctx::Refuse(f.cause)).1);
                    }
                    Op::Read(g) if stale => replies.push(g(Ctx::Refuse(f.cause)).1),
                    Op::Read(g) => replies.push(g(Ctx::Run(&mut state, &BatchConn::new(&conn))).1),
                    Op::Stop => {}
                }
            }
            state.after_commit(None);
            for reply in replies.drain(..) {
                reply(Ok(()));
            }
            if f.logged.elapsed() >= FAULT_LOG_EVERY {
                tracing::warn!(
                    cause = f.cause,
                    down_secs = f.since.elapsed().as_secs_f64(),
                    refused_writes = f.refused,
                    "the store still cannot commit; writes are refused with UNAVAILABLE"
                );
                f.logged = Instant::now();
                f.refused = 0;
            }
            continue;
        }
        let changes_before = conn.total_changes();
        let result = run_batch(&conn, &mut state, &mut batch, &mut replies, &mut carried);
        match result {
            Ok(commit) => {
                internal_failures = 0;
                let restart = if conn.total_changes() != changes_before {
                    checkpoint.committed()
                } else {
                    None
                };
                state.after_commit((ops > 0).then_some(Commit { ops, took: commit }));
                for reply in replies.drain(..) {
                    reply(Ok(()));
                }
                if let Some(restart) = restart {
                    // Between two batches, with this one's replies and
                    // leases already on their way.
                    if let Err(e) = restart.run(&conn) {
                        tracing::warn!(error = %e, "WAL checkpoint of the writer failed");
                    }
                }
            }
            Err(e) => {
                let _ = conn.execute_batch("ROLLBACK");
                if let Err(re) = state.after_rollback(&conn) {
                    tracing::error!(
                        error = %re,
                        "rebuilding the in-memory state after a rollback failed; every operation is refused with UNAVAILABLE until it succeeds"
                    );
                    stale = true;
                }
                let cause = e.store_fault();
                match cause {
                    Some(cause) => {
                        health.failed();
                        // Probe sooner the first time; later as it repeats.
                        let backoff = match last_fault {
                            Some((ended, b)) if ended.elapsed() < FAULT_LOG_EVERY => {
                                (b * 2).min(PROBE_MAX)
                            }
                            _ => PROBE_FIRST,
                        };
                        if last_fault.is_none_or(|(ended, _)| ended.elapsed() >= FAULT_LOG_EVERY) {
                            tracing::error!(
                                cause,
                                "the store cannot commit: batch rolled back; writes are refused with UNAVAILABLE and health is NOT_SERVING until a commit succeeds"
                            );
                        } else {
                            tracing::warn!(
                                cause,
                                "the store cannot commit again: batch rolled back"
                            );
                        }
                        fault = Some(Fault::new(cause, backoff));
                    }
                    None => {
                        tracing::error!(error = %e, "batch rolled back");
                        internal_failures += 1;
                        if stale {
                            health.failed();
                            fault = Some(Fault::new(STALE_STATE, PROBE_FIRST));
                        }
                    }
                }
                for reply in replies.drain(..) {
                    reply(Err(match cause {
                        Some(cause) => Error::StoreUnavailable(cause),
                        None => Error::Internal(format!("commit failed: {e}")),
                    }));
                }
                if internal_failures > 1 {
                    // A failure that repeats is a bug, not load: do not
                    // spin on it.
                    let n = internal_failures.min(7);
                    std::thread::sleep(PROBE_FIRST * (1 << n));
                }
            }
        }
    }
    state.on_shutdown(&conn);
    if let Err(e) = conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);") {
        tracing::warn!(error = %e, "final WAL checkpoint failed");
    }
    if let Err((_, e)) = conn.close() {
        tracing::warn!(error = %e, "closing the database failed");
    }
}

/// The error that ends a batch in which storage failed under an
/// operation: [`Error::StoreUnavailable`] with `cause` when the
/// environment is to blame, else [`Error::Internal`].
fn broken(cause: Option<&'static str>) -> Error {
    match cause {
        Some(cause) => Error::StoreUnavailable(cause),
        None => Error::Internal("storage failed in the middle of an operation".into()),
    }
}

/// Runs one batch in one transaction. Returns how long the `COMMIT` took.
///
/// Errors: storage errors of the transaction; the error of [`broken`] when
/// storage failed under an operation (a write or a direct one, which may
/// have changed the in-memory state before it failed), or when an
/// operation of any kind left no transaction open (SQLite rolls the whole
/// transaction back by itself when a statement, a read included, fails
/// with an I/O error, a full disk or no memory): the caller rolls the
/// batch back and rebuilds the state, and the operations after the broken
/// one are in `carried`, not run. A failed savepoint statement also ends
/// the batch, with the rest carried.
fn run_batch<S: BatchState>(
    conn: &Connection,
    state: &mut S,
    batch: &mut Vec<Op<S>>,
    replies: &mut Vec<Reply>,
    carried: &mut Vec<Op<S>>,
) -> Result<Duration> {
    exec(conn, "BEGIN")?;
    let batch_conn = BatchConn::new(conn);
    let mut ops = batch.drain(..);
    while let Some(op) = ops.next() {
        let step = run_op(op, state, &batch_conn, replies).and_then(|cause| {
            // Outside any transaction now, whatever the operation said:
            // what the batch wrote before is gone, and what follows would
            // commit statement by statement.
            if conn.is_autocommit() {
                Err(broken(cause.or(Some(TRANSACTION_LOST))))
            } else {
                Ok(())
            }
        });
        if let Err(e) = step {
            carried.extend(ops);
            return Err(e);
        }
    }
    drop(batch_conn);
    state.before_commit(conn)?;
    let commit = Instant::now();
    exec(conn, "COMMIT")?;
    Ok(commit.elapsed())
}

/// The cause a batch ends with when SQLite rolled its transaction back by
/// itself under an operation that did not say why.
const TRANSACTION_LOST: &str =
    "the database rolled the transaction back (I/O error or out of memory)";

/// Runs one operation of a batch and queues its reply. Returns the cause
/// of a storage failure the operation reported but that does not end the
/// batch by itself (a read's: the batch goes on unless the transaction is
/// gone, which [`run_batch`] checks).
///
/// Errors: the error of [`broken`] when storage failed under a write or a
/// direct operation; the error of a savepoint statement.
fn run_op<S: BatchState>(
    op: Op<S>,
    state: &mut S,
    batch_conn: &BatchConn<'_>,
    replies: &mut Vec<Reply>,
) -> Result<Option<&'static str>> {
    match op {
        Op::Write(f) => {
            batch_conn.kept("SAVEPOINT op")?.execute([])?;
            let (outcome, reply) = f(Ctx::Run(state, batch_conn));
            replies.push(reply);
            match outcome {
                Outcome::Done => {}
                // It refused before it changed the state: only its SQL
                // writes, if any, are undone.
                Outcome::Refused => {
                    batch_conn.kept("ROLLBACK TO op")?.execute([])?;
                }
                // It may have changed the state before storage failed
                // under it: the whole batch goes, as for a direct one.
                Outcome::Broken(cause) => return Err(broken(cause)),
            }
            batch_conn.kept("RELEASE op")?.execute([])?;
            Ok(None)
        }
        Op::Direct(f, _) => {
            let (outcome, reply) = f(Ctx::Run(state, batch_conn));
            replies.push(reply);
            match outcome {
                Outcome::Broken(cause) => Err(broken(cause)),
                _ => Ok(None),
            }
        }
        Op::Read(f) => {
            let (outcome, reply) = f(Ctx::Run(state, batch_conn));
            replies.push(reply);
            Ok(match outcome {
                Outcome::Broken(cause) => cause,
                _ => None,
            })
        }
        Op::Stop => Ok(None),
    }
}

/// Runs a transaction-control statement through the statement cache
/// (`execute_batch` would parse it again for every operation).
fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A state that records what the batch loop told it.
    #[derive(Default)]
    struct Log {
        rollbacks: usize,
        /// The operations of each commit, in order.
        commits: Vec<usize>,
    }

    impl BatchState for Log {
        fn before_commit(&mut self, _: &Connection) -> Result<()> {
            Ok(())
        }
        fn after_commit(&mut self, commit: Option<Commit>) {
            self.commits.push(commit.map_or(0, |c| c.ops));
        }
        fn after_rollback(&mut self, _: &Connection) -> Result<()> {
            self.rollbacks += 1;
            Ok(())
        }
        fn on_shutdown(&mut self, _: &Connection) {}
    }

    /// A writer on an in-memory database with one table `t (v TEXT)`.
    fn start(health: StoreHealth) -> (Writer<Log>, std::thread::JoinHandle<()>) {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (v TEXT NOT NULL)")
            .unwrap();
        Writer::start(conn, Log::default(), CheckpointSignal::default(), health).unwrap()
    }

    /// Keeps the writer busy for `busy` in an operation of its own, so
    /// the operations queued meanwhile wait for the next batch.
    fn hold(w: &Writer<Log>, busy: Duration) -> tokio::task::JoinHandle<Result<()>> {
        let w = w.clone();
        tokio::spawn(async move {
            w.write(move |_, _| {
                std::thread::sleep(busy);
                Ok(())
            })
            .await
        })
    }

    /// The values of `t` in `order` (an ORDER BY clause).
    fn values(c: &Connection, order: &str) -> Result<Vec<String>> {
        let mut st = c.prepare(&format!("SELECT v FROM t ORDER BY {order}"))?;
        let v = st
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        Ok(v)
    }

    fn insert(c: &Connection, v: &str) -> Result<()> {
        c.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
        Ok(())
    }

    /// A kept statement is prepared once per batch and serves every later
    /// use of its SQL; taking one while another is held is an error, not
    /// a panic; a statement of other SQL is a statement of its own.
    #[test]
    fn kept_statements_serve_the_whole_batch() {
        const INSERT: &str = "INSERT INTO t (v) VALUES (?1)";
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (v TEXT NOT NULL)")
            .unwrap();
        let b = BatchConn::new(&conn);
        for v in ["a", "b"] {
            b.kept(INSERT).unwrap().execute([v]).unwrap();
        }
        assert_eq!(b.kept.borrow().len(), 1);
        let held = b.kept(INSERT).unwrap();
        assert!(matches!(b.kept(INSERT), Err(Error::Internal(_))));
        drop(held);
        let n: i64 = b
            .kept("SELECT count(*) FROM t")
            .unwrap()
            .query_row([], |r| r.get(0))
            .unwrap();
        assert_eq!((n, b.kept.borrow().len()), (2, 2));
        drop(b);
        // The statements went back to the connection's cache.
        assert_eq!(
            conn.prepare_cached(INSERT).unwrap().execute(["c"]).unwrap(),
            1
        );
    }

    /// An operation broken by storage after it wrote (a direct one, or a
    /// write one, which may have changed the in-memory state first) rolls
    /// back its whole batch and has the state rebuilt: the operation before
    /// it in the batch is answered with the failure, not committed; those
    /// queued behind it are carried over to the next batch, where a refused
    /// one (nothing written) is refused and the next commits.
    async fn broken_operation_rolls_back_its_batch_and_carries_the_rest(direct: bool) {
        let (w, thread) = start(StoreHealth::default());
        // Hold the writer so the next operations queue up into one batch.
        let hold = w.write(|_, _| {
            std::thread::sleep(Duration::from_millis(200));
            Ok(())
        });
        let breaks = |_: &mut Log, c: &BatchConn<'_>| -> Result<()> {
            insert(c, "lost")?;
            c.execute("INSERT INTO missing VALUES (1)", [])?;
            Ok(())
        };
        let refuses = |_: &mut Log, _: &BatchConn<'_>| -> Result<()> { Err(Error::invalid("no")) };
        let (held, before, broken, refused, after) = tokio::join!(
            hold,
            async {
                tokio::time::sleep(Duration::from_millis(40)).await;
                w.write(|_, c| insert(c, "before")).await
            },
            async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if direct {
                    w.write_direct(breaks).await
                } else {
                    w.write(breaks).await
                }
            },
            async {
                tokio::time::sleep(Duration::from_millis(60)).await;
                if direct {
                    w.write_direct(refuses).await
                } else {
                    w.write(refuses).await
                }
            },
            async {
                tokio::time::sleep(Duration::from_millis(70)).await;
                w.write(|_, c| insert(c, "kept")).await
            },
        );
        held.unwrap();
        assert!(matches!(before, Err(Error::Internal(_))), "{before:?}");
        assert!(matches!(broken, Err(Error::Storage { .. })), "{broken:?}");
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{refused:?}"
        );
        after.unwrap();
        let rows: Vec<String> = w
            .run(|s, c| {
                assert_eq!(s.rollbacks, 1);
                values(c, "v")
            })
            .await
            .unwrap();
        assert_eq!(rows, vec!["kept".to_string()]);
        w.stop();
        drop(w);
        thread.join().unwrap();
    }

    #[tokio::test]
    async fn a_broken_direct_operation_rolls_back_its_batch() {
        broken_operation_rolls_back_its_batch_and_carries_the_rest(true).await;
    }

    #[tokio::test]
    async fn a_broken_write_operation_rolls_back_its_batch_and_rebuilds_the_state() {
        broken_operation_rolls_back_its_batch_and_carries_the_rest(false).await;
    }

    /// A read under which SQLite rolled the transaction back by itself
    /// (a statement that fails with an I/O error, a full disk or no
    /// memory does that, a read included) ends its batch like a broken
    /// write: the write before it is answered with the failure, and the
    /// one behind it is carried over, not committed on its own outside the
    /// transaction while its caller is told the batch failed.
    #[tokio::test]
    async fn a_read_that_lost_the_transaction_ends_its_batch() {
        let (w, thread) = start(StoreHealth::default());
        let hold = hold(&w, Duration::from_millis(200));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (before, read, after) = tokio::join!(
            w.write(|_, c| insert(c, "before")),
            w.run(|_, c| -> Result<()> {
                c.execute("ROLLBACK", [])?;
                Err(Error::Storage {
                    detail: "disk I/O error".into(),
                    fault: Some("disk I/O error"),
                })
            }),
            w.write(|_, c| insert(c, "after")),
        );
        hold.await.unwrap().unwrap();
        assert!(
            matches!(before, Err(Error::StoreUnavailable(_))),
            "{before:?}"
        );
        assert!(matches!(read, Err(Error::Storage { .. })), "{read:?}");
        // The store commits again after its first probe.
        let mut probe = Err(Error::Unavailable);
        for _ in 0..200 {
            probe = w.write(|_, c| insert(c, "probe")).await;
            if probe.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        probe.unwrap();
        let rows: Vec<String> = w.run(|_, c| values(c, "v")).await.unwrap();
        assert!(!rows.contains(&"before".to_string()), "{rows:?}");
        // Carried over: refused while the store was probed, or committed
        // in a later batch; never committed while its caller heard of a
        // failure.
        assert_eq!(
            after.is_ok(),
            rows.contains(&"after".to_string()),
            "{after:?} {rows:?}"
        );
        w.stop();
        drop(w);
        thread.join().unwrap();
    }

    /// Operations queued behind a busy writer: the small ones go into the
    /// next commit ahead of the large ones queued before them; the large
    /// ones follow in arrival order, as many per commit as fit within
    /// `MAX_BATCH_ROWS` (the oldest always, even one larger than that).
    #[tokio::test]
    async fn small_operations_go_first_and_large_ones_share_commits_up_to_a_row_limit() {
        let (w, thread) = start(StoreHealth::default());
        let hold = hold(&w, Duration::from_millis(300));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Polled in this order on their first poll, so queued in this order.
        let rows = |n: usize, v: &'static str| w.write_direct_rows(n, move |_, c| insert(c, v));
        // a and b do not fit together, b and c do; e alone is larger.
        let (a, b, c, d, e, f) = tokio::join!(
            rows(MAX_BATCH_ROWS * 6 / 10, "a"),
            rows(MAX_BATCH_ROWS * 6 / 10, "b"),
            rows(100, "c"),
            w.write(|_, c| insert(c, "d")),
            rows(MAX_BATCH_ROWS * 5, "e"),
            w.write(|_, c| insert(c, "f")),
        );
        hold.await.unwrap().unwrap();
        for r in [a, b, c, d, e, f] {
            r.unwrap();
        }
        let (commits, order) = w
            .run(|s, c| Ok((s.commits.clone(), values(c, "rowid")?.concat())))
            .await
            .unwrap();
        // The hold; d and f with a (b would pass the limit); b and c; e
        // alone.
        assert_eq!(commits, vec![1, 3, 2, 1]);
        assert_eq!(order, "dfabce");
        w.stop();
        drop(w);
        thread.join().unwrap();
    }

    /// Stopping finishes every operation queued before the stop, large
    /// ones waiting behind small ones included, and refuses those queued
    /// after it with `Unavailable`.
    #[tokio::test]
    async fn stop_finishes_what_was_queued_before_it() {
        let (w, thread) = start(StoreHealth::default());
        let hold = hold(&w, Duration::from_millis(200));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Polled in this order on their first poll, so queued in this order.
        // The two large ones do not fit one commit: the second still waits
        // when the stop is seen.
        let big = MAX_BATCH_ROWS * 6 / 10;
        let (first, second, small, late) = tokio::join!(
            w.write_direct_rows(big, |_, c| insert(c, "first")),
            w.write_direct_rows(big, |_, c| insert(c, "second")),
            w.write(|_, c| insert(c, "small")),
            async {
                w.stop();
                w.write(|_, c| insert(c, "late")).await
            },
        );
        hold.await.unwrap().unwrap();
        first.unwrap();
        second.unwrap();
        small.unwrap();
        assert!(matches!(late, Err(Error::Unavailable)), "{late:?}");
        drop(w);
        thread.join().unwrap();
    }

    /// In a batch that storage breaks, a `run` answered before the break
    /// gets the batch's failure, while a `run_uncommitted` keeps its own
    /// answer (its effect outlives the rollback).
    #[tokio::test]
    async fn an_uncommitted_read_keeps_its_answer_when_its_batch_rolls_back() {
        let (w, thread) = start(StoreHealth::default());
        let hold = hold(&w, Duration::from_millis(200));
        let (read, kept, broken) = tokio::join!(
            async {
                tokio::time::sleep(Duration::from_millis(40)).await;
                w.run(|_, _| Ok(1)).await
            },
            async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                w.run_uncommitted(|_, _| Ok(2)).await
            },
            async {
                tokio::time::sleep(Duration::from_millis(60)).await;
                w.write_direct(|_, c| -> Result<()> {
                    insert(c, "lost")?;
                    c.execute("INSERT INTO missing VALUES (1)", [])?;
                    Ok(())
                })
                .await
            },
        );
        hold.await.unwrap().unwrap();
        assert!(matches!(read, Err(Error::Internal(_))), "{read:?}");
        assert_eq!(kept.unwrap(), 2);
        assert!(matches!(broken, Err(Error::Storage { .. })), "{broken:?}");
        assert_eq!(w.run(|s, _| Ok(s.rollbacks)).await.unwrap(), 1);
        w.stop();
        drop(w);
        thread.join().unwrap();
    }

    /// A batch broken by a store fault (here a simulated "disk full")
    /// rolls back, turns health false and counts one write error; writes
    /// are refused with `StoreUnavailable` naming the cause (never
    /// `Internal`) until a probe commit succeeds, then health is true and
    /// writes commit again, with no restart.
    #[tokio::test]
    async fn a_store_fault_refuses_writes_until_a_probe_commits() {
        let errors = Counter::default();
        let health = StoreHealth::new(errors.clone());
        let (w, thread) = start(health.clone());
        let full = || {
            Error::from(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
                None,
            ))
        };
        let broken = w
            .write_direct(move |_, c| -> Result<()> {
                insert(c, "lost")?;
                Err(full())
            })
            .await;
        assert!(matches!(broken, Err(Error::Storage { .. })), "{broken:?}");
        assert!(!health.is_ok());
        assert_eq!(errors.get(), 1);
        let mut committed = false;
        for _ in 0..200 {
            match w.write(|_, c| insert(c, "kept")).await {
                Ok(()) => {
                    committed = true;
                    break;
                }
                Err(Error::StoreUnavailable(cause)) => {
                    assert_eq!(cause, "database or disk is full");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        assert!(committed, "the store never recovered");
        assert!(health.is_ok());
        let rows: Vec<String> = w.run(|_, c| values(c, "rowid")).await.unwrap();
        assert_eq!(rows, vec!["kept".to_string()]);
        w.stop();
        drop(w);
        thread.join().unwrap();
    }
}
