//! The single writer: one thread owns the write connection and the core's
//! in-memory state, and runs every state change as an operation. Operations
//! that arrive together share one transaction and one commit (group commit);
//! each runs inside its own savepoint so a failing one changes nothing.
//! Replies and side effects (lease pushes, stream commands) are released
//! only after the commit succeeded.

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use super::CheckpointSignal;
use crate::error::{Error, Result};

/// The most operations one commit carries.
const MAX_BATCH: usize = 1024;

/// State owned by the writer thread, with the hooks the batch loop calls.
pub trait BatchState: Send + 'static {
    /// Runs after the batch's operations, inside the transaction, before
    /// the commit (the dispatcher grants leases here).
    ///
    /// Errors: a storage error rolls the whole batch back.
    fn before_commit(&mut self, conn: &Connection) -> Result<()>;
    /// Runs once the commit is durable: releases buffered side effects.
    /// `ops` is the number of operations the commit carried.
    fn after_commit(&mut self, ops: usize);
    /// Runs when the batch was rolled back: drops buffered side effects and
    /// rebuilds the in-memory state from the database.
    fn after_rollback(&mut self, conn: &Connection);
    /// Runs when the writer stops, after the last batch.
    fn on_shutdown(&mut self, conn: &Connection);
}

type Reply = Box<dyn FnOnce(Result<()>) + Send>;
type TxFn<S> = Box<dyn FnOnce(&mut S, &Connection) -> (Outcome, Reply) + Send>;

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// It succeeded.
    Done,
    /// It refused (bad input, wrong state, ...).
    Refused,
    /// Storage failed under it.
    Broken,
}

impl Outcome {
    fn of<R>(r: &Result<R>) -> Outcome {
        match r {
            Ok(_) => Outcome::Done,
            Err(Error::Storage(_) | Error::Pool(_)) => Outcome::Broken,
            Err(_) => Outcome::Refused,
        }
    }
}

enum Op<S> {
    /// A state change: runs in a savepoint, rolled back when it fails.
    Write(TxFn<S>),
    /// A state change that checks everything before its first SQL write,
    /// so once it writes only a storage error can stop it: no savepoint
    /// (a savepoint copies every page the operation touches), and a storage
    /// error rolls the whole batch back; the operations after it in the
    /// batch are carried over to the next batch.
    Direct(TxFn<S>),
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

impl<S> Clone for Writer<S> {
    fn clone(&self) -> Self {
        Writer {
            tx: self.tx.clone(),
        }
    }
}

impl<S: BatchState> Writer<S> {
    /// Starts the writer thread on `conn` with `state`; `checkpoint` is
    /// woken after every commit that wrote. The returned join handle
    /// finishes after every handle is dropped and the queue drained.
    ///
    /// Errors: [`Error::Internal`] when the thread cannot be spawned.
    pub fn start(
        conn: Connection,
        state: S,
        checkpoint: CheckpointSignal,
    ) -> Result<(Self, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = std::thread::Builder::new()
            .name("agq-writer".into())
            .spawn(move || run(conn, state, rx, checkpoint))
            .map_err(|e| Error::Internal(format!("cannot start the writer thread: {e}")))?;
        Ok((Writer { tx }, handle))
    }

    /// Runs `f` as a state change and returns its result once committed.
    ///
    /// Errors: whatever `f` returns (its writes are rolled back);
    /// [`Error::Storage`] when the commit fails; [`Error::Unavailable`] when
    /// the writer has stopped.
    pub async fn write<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &Connection) -> Result<R> + Send + 'static,
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
        F: FnOnce(&mut S, &Connection) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::Direct).await
    }

    /// Runs `f` on the writer thread without a savepoint, for operations that write no SQL (reads of the
    /// in-memory state, heartbeats); the reply follows the batch's commit like any other.
    ///
    /// Errors: whatever `f` returns; [`Error::Unavailable`] when the writer
    /// has stopped.
    pub async fn run<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &Connection) -> Result<R> + Send + 'static,
    {
        self.call(f, Kind::Read).await
    }

    /// Queues a state change whose result nobody waits for (stream-closed
    /// events, reaper ticks). Returns false when the writer has stopped.
    pub fn submit<F>(&self, f: F) -> bool
    where
        F: FnOnce(&mut S, &Connection) -> Result<()> + Send + 'static,
    {
        let op: TxFn<S> = Box::new(move |s, c| {
            let r = f(s, c);
            if let Err(e) = &r {
                tracing::warn!(error = %e, "background operation failed");
            }
            (Outcome::of(&r), Box::new(|_| {}))
        });
        self.tx.send(Op::Write(op)).is_ok()
    }

    /// Asks the writer to stop after the operations queued so far; later
    /// calls fail with [`Error::Unavailable`].
    pub fn stop(&self) {
        let _ = self.tx.send(Op::Stop);
    }

    async fn call<R, F>(&self, f: F, kind: Kind) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, &Connection) -> Result<R> + Send + 'static,
    {
        let (reply_tx, reply_rx) = oneshot::channel::<Result<R>>();
        let op: TxFn<S> = Box::new(move |s, c| {
            let r = f(s, c);
            let outcome = Outcome::of(&r);
            let reply: Reply = Box::new(move |commit: Result<()>| {
                let out = match (commit, r) {
                    (Ok(()), r) => r,
                    (Err(_), Err(e)) => Err(e),
                    (Err(e), Ok(_)) => Err(e),
                };
                let _ = reply_tx.send(out);
            });
            (outcome, reply)
        });
        let op = match kind {
            Kind::Write => Op::Write(op),
            Kind::Direct => Op::Direct(op),
            Kind::Read => Op::Read(op),
        };
        self.tx.send(op).map_err(|_| Error::Unavailable)?;
        reply_rx.await.map_err(|_| Error::Unavailable)?
    }
}

/// The kind of operation [`Writer::call`] queues.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Write,
    Direct,
    Read,
}

fn run<S: BatchState>(
    conn: Connection,
    mut state: S,
    mut rx: mpsc::UnboundedReceiver<Op<S>>,
    checkpoint: CheckpointSignal,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut replies: Vec<Reply> = Vec::with_capacity(MAX_BATCH);
    // Operations not run because a storage error ended their batch.
    let mut carried: Vec<Op<S>> = Vec::new();
    let mut stopping = false;
    while !stopping || !carried.is_empty() {
        if carried.is_empty() {
            let Some(first) = rx.blocking_recv() else {
                break;
            };
            batch.push(first);
        } else {
            batch.append(&mut carried);
        }
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        if let Some(pos) = batch.iter().position(|op| matches!(op, Op::Stop)) {
            stopping = true;
            batch.truncate(pos);
            rx.close();
        }
        let ops = batch.len();
        let changes_before = conn.total_changes();
        let result = run_batch(&conn, &mut state, &mut batch, &mut replies, &mut carried);
        match result {
            Ok(()) => {
                if conn.total_changes() != changes_before {
                    checkpoint.committed();
                }
                state.after_commit(ops);
                for reply in replies.drain(..) {
                    reply(Ok(()));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "batch rolled back");
                let _ = conn.execute_batch("ROLLBACK");
                state.after_rollback(&conn);
                for reply in replies.drain(..) {
                    reply(Err(Error::Internal(format!("commit failed: {e}"))));
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

fn run_batch<S: BatchState>(
    conn: &Connection,
    state: &mut S,
    batch: &mut Vec<Op<S>>,
    replies: &mut Vec<Reply>,
    carried: &mut Vec<Op<S>>,
) -> Result<()> {
    exec(conn, "BEGIN")?;
    let mut ops = batch.drain(..);
    while let Some(op) = ops.next() {
        match op {
            Op::Write(f) => {
                exec(conn, "SAVEPOINT op")?;
                let (outcome, reply) = f(state, conn);
                if outcome != Outcome::Done {
                    exec(conn, "ROLLBACK TO op")?;
                }
                exec(conn, "RELEASE op")?;
                replies.push(reply);
            }
            Op::Direct(f) => {
                let (outcome, reply) = f(state, conn);
                replies.push(reply);
                if outcome == Outcome::Broken {
                    carried.extend(ops);
                    return Err(Error::Internal(
                        "storage failed in the middle of an operation".into(),
                    ));
                }
            }
            Op::Read(f) => {
                let (_, reply) = f(state, conn);
                replies.push(reply);
            }
            Op::Stop => {}
        }
    }
    state.before_commit(conn)?;
    exec(conn, "COMMIT")?;
    Ok(())
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
    }

    impl BatchState for Log {
        fn before_commit(&mut self, _: &Connection) -> Result<()> {
            Ok(())
        }
        fn after_commit(&mut self, _: usize) {}
        fn after_rollback(&mut self, _: &Connection) {
            self.rollbacks += 1;
        }
        fn on_shutdown(&mut self, _: &Connection) {}
    }

    fn insert(c: &Connection, v: &str) -> Result<()> {
        c.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
        Ok(())
    }

    /// A direct operation broken by storage after it wrote rolls back its
    /// whole batch; the operation queued behind it is carried over and
    /// committed in the next batch; a refused direct operation (nothing
    /// written) leaves its batch alone.
    #[tokio::test]
    async fn broken_direct_operation_rolls_back_its_batch_and_carries_the_rest() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (v TEXT NOT NULL)")
            .unwrap();
        let (w, thread) = Writer::start(conn, Log::default(), CheckpointSignal::default()).unwrap();
        // Hold the writer so the next operations queue up into one batch.
        let hold = w.write(|_, _| {
            std::thread::sleep(Duration::from_millis(200));
            Ok(())
        });
        let (held, broken, refused, after) = tokio::join!(
            hold,
            async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                w.write_direct(|_, c| {
                    insert(c, "lost")?;
                    c.execute("INSERT INTO missing VALUES (1)", [])?;
                    Ok(())
                })
                .await
            },
            async {
                tokio::time::sleep(Duration::from_millis(60)).await;
                w.write_direct(|_, _| -> Result<()> { Err(Error::invalid("no")) })
                    .await
            },
            async {
                tokio::time::sleep(Duration::from_millis(70)).await;
                w.write(|_, c| insert(c, "kept")).await
            },
        );
        held.unwrap();
        assert!(matches!(broken, Err(Error::Storage(_))), "{broken:?}");
        assert!(matches!(refused, Err(Error::InvalidArgument(_))));
        after.unwrap();
        let rows: Vec<String> = w
            .run(|s, c| {
                assert_eq!(s.rollbacks, 1);
                let mut st = c.prepare("SELECT v FROM t ORDER BY v")?;
                let v = st
                    .query_map([], |r| r.get(0))?
                    .collect::<rusqlite::Result<Vec<String>>>()?;
                Ok(v)
            })
            .await
            .unwrap();
        assert_eq!(rows, vec!["kept".to_string()]);
        w.stop();
        drop(w);
        thread.join().unwrap();
    }
}
