//! The SQLite engine's SQL: opening, pragmas, versioned migrations, the
//! read pool, the checkpointer, how SQLite errors become [`Error`]s, and
//! one module per table family. All SQL of the engine lives under here.

/// SQL condition on the `jobs` view or the `job_rows` table: the row is
/// one of the jobs of the action whose id is `?1`. An action's jobs are
/// inserted in one transaction at one contiguous range of rows (see
/// migration 0016), so this is a range scan of the table; `action_id` is
/// matched too.
macro_rules! of_action {
    () => {
        "id BETWEEN (SELECT first_job_row FROM actions WHERE action_id = ?1)
                AND (SELECT last_job_row FROM actions WHERE action_id = ?1)
            AND action_id = ?1"
    };
}

/// SQL join condition: job `j` is one of the jobs of action `a` (see
/// [`of_action`]).
macro_rules! job_of_action {
    () => {
        "j.id BETWEEN a.first_job_row AND a.last_job_row AND j.action_id = a.action_id"
    };
}

pub mod jobs;
pub mod plans;
pub mod retention;
pub mod schedules;
pub mod workers;

use std::{
    path::Path,
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::Connection;

use crate::{
    config::SyncMode,
    error::{Error, Result},
};

/// Migrations in order; migration `i` brings the schema to `user_version = i + 1`.
const MIGRATIONS: &[&str] = &[
    include_str!("migrations/0001_init.sql"),
    include_str!("migrations/0002_status_free_indexes.sql"),
    include_str!("migrations/0003_drop_unused_job_indexes.sql"),
    include_str!("migrations/0004_action_retention.sql"),
    include_str!("migrations/0005_worker_instance.sql"),
    include_str!("migrations/0006_worker_sandboxed.sql"),
    include_str!("migrations/0007_action_traceparent.sql"),
    include_str!("migrations/0008_action_listing.sql"),
    include_str!("migrations/0009_plan_versions.sql"),
    include_str!("migrations/0010_worker_quarantine.sql"),
    include_str!("migrations/0011_fleet_scheduling.sql"),
    include_str!("migrations/0012_schedules.sql"),
    include_str!("migrations/0013_worker_verification.sql"),
    include_str!("migrations/0014_task_results_in_job_row.sql"),
    include_str!("migrations/0015_drop_status_index.sql"),
    include_str!("migrations/0016_job_rows_without_secondary_indexes.sql"),
    include_str!("migrations/0017_job_completions.sql"),
    include_str!("migrations/0018_open_job_floor.sql"),
    include_str!("migrations/0019_cancelled_jobs_index.sql"),
];

/// Pool of read-only connections (WAL lets them read while the writer writes).
pub type ReadPool = r2d2::Pool<SqliteConnectionManager>;

/// Applies AGQ's pragmas to a connection: WAL, foreign keys, busy timeout and
/// the synchronous mode.
fn configure(conn: &Connection, sync: SyncMode) -> rusqlite::Result<()> {
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    let sync = match sync {
        SyncMode::Full => "FULL",
        SyncMode::Normal => "NORMAL",
    };
    conn.pragma_update(None, "synchronous", sync)?;
    // Statement journals (one per savepoint-wrapped operation of the
    // writer) in memory instead of temporary files: they only ever hold
    // pages of the open transaction, and writing them to disk cost one
    // pwrite per first-touched page per operation.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    // A 4 MiB page cache (1,024 pages; SQLite's default is 2 MiB). The
    // writer's hot pages (the ends of the job and completion tables, the
    // pending jobs next in line) fit many times over, and the OS page cache
    // serves the rest. A larger cache costs the writer time at every
    // commit: once a B-tree balance has swapped two pages (SQLite parks one
    // at the lock-byte page number for a moment), the end of the
    // transaction walks every page header of the cache, a cache miss each
    // (8 % of the writer's time with 32 MiB; BENCHMARKS.md, session 13).
    conn.pragma_update(None, "cache_size", CACHE_SIZE_KIB)?;
    Ok(())
}

/// Brings the schema up to date inside one transaction.
fn migrate(conn: &mut Connection) -> Result<()> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let version = usize::try_from(version).unwrap_or(0);
    if version > MIGRATIONS.len() {
        return Err(Error::Internal(format!(
            "database schema version {version} is newer than this agq ({})",
            MIGRATIONS.len()
        )));
    }
    let tx = conn.transaction()?;
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tracing::info!(version = i + 1, "applied schema migration");
    }
    tx.commit()?;
    Ok(())
}

/// The exclusive right to write one database: an advisory lock (`flock`)
/// on the file `<database>-lock` beside it, held by the one `agq serve`
/// process that writes the database and released when it is dropped or
/// the process ends. A second server on the same database would keep an
/// in-memory state of its own and lease the same jobs again.
pub struct DbLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// Takes the [`DbLock`] of the database at `path` (creating missing
/// directories and the lock file), writing this process's id into the
/// lock file.
///
/// Errors: [`Error::FailedPrecondition`] while another process holds it
/// (naming the process id it wrote); [`Error::Internal`] when the
/// directory or the lock file cannot be created.
pub fn lock(path: &Path) -> Result<DbLock> {
    use std::io::{Read, Seek, Write};
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Internal(format!("cannot create directory {}: {e}", dir.display()))
            })?;
        }
    }
    let mut name = path.as_os_str().to_owned();
    name.push("-lock");
    let lock_path = std::path::PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| Error::Internal(format!("cannot open {}: {e}", lock_path.display())))?;
    let mut lock = match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
    {
        Ok(lock) => lock,
        Err((mut file, _)) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() || holder.len() > 20 {
                "another process".to_string()
            } else {
                format!("process {holder}")
            };
            return Err(Error::precondition(format!(
                "database {} is in use by {holder} (it holds {}): only one agq serve may \
                 run on a SQLite database; stop the other one, or use the clustered mode \
                 (--store postgres://...) to run several replicas",
                path.display(),
                lock_path.display()
            )));
        }
    };
    let pid = std::process::id().to_string();
    let written = lock
        .set_len(0)
        .and_then(|()| lock.rewind())
        .and_then(|()| lock.write_all(pid.as_bytes()));
    if let Err(e) = written {
        tracing::warn!(error = %e, path = %lock_path.display(), "cannot write the process id into the lock file");
    }
    Ok(DbLock { _lock: lock })
}

/// Opens (creating if needed) the database at `path`: creates missing
/// directories, applies pragmas and migrations, and returns the writer
/// connection and a pool of read connections.
///
/// Errors: [`Error::Internal`] when the directory cannot be created or the
/// schema is newer than this binary; [`Error::Storage`] for SQLite failures.
pub fn open(path: &Path, sync: SyncMode) -> Result<(Connection, ReadPool)> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Internal(format!("cannot create directory {}: {e}", dir.display()))
            })?;
        }
    }
    let mut conn = Connection::open(path)?;
    // Before the first table: a new database gives the pages freed by the
    // retention sweep back to the file system.
    retention::enable_incremental_vacuum(&conn)?;
    configure(&conn, sync)?;
    // The [`Checkpointer`] thread copies the WAL into the database and
    // asks the writer to copy the last frames itself, so the WAL starts
    // over (see RESTART_PAGES); the writer's own automatic checkpoint is
    // only a backstop for a checkpointer that falls behind.
    conn.pragma_update(None, "wal_autocheckpoint", BACKSTOP_AUTOCHECKPOINT_PAGES)?;
    migrate(&mut conn)?;
    let manager = SqliteConnectionManager::file(path).with_init(move |c| configure(c, sync));
    let pool = r2d2::Pool::builder()
        .max_size(8)
        .connection_timeout(Duration::from_secs(10))
        .build(manager)?;
    Ok((conn, pool))
}

/// Page cache of each connection, as SQLite's `cache_size` takes it
/// (negative: KiB): 4 MiB.
const CACHE_SIZE_KIB: i64 = -4096;

/// WAL size (pages, 4 MiB) from which the [`Checkpointer`] asks the writer
/// to let the WAL start over. The checkpointer copies frames in the
/// background, but under a steady stream of commits it never catches up
/// with the last one, and SQLite starts the WAL over only once every frame
/// is in the database. So once a background checkpoint has copied a WAL
/// of at least this many pages, the writer, between two batches (with no
/// commit in flight and the batch's replies already released), copies the
/// few frames committed since and syncs the database file; its next
/// transaction then writes from the WAL's beginning. With 10,000 pages the
/// WAL grew to 40 MiB between restarts and the completion-ack p99 at peak
/// was about twice as long on a 16-core machine (BENCHMARKS.md, session 15).
const RESTART_PAGES: i64 = 1_000;

/// WAL size (pages, 40 MiB) at which the writer checkpoints by itself
/// inside its commit (SQLite's automatic checkpoint), whatever the
/// [`Checkpointer`] does: only reached when the checkpointer falls far
/// behind (it stopped, or a long read holds the WAL).
const BACKSTOP_AUTOCHECKPOINT_PAGES: i64 = 10_000;

/// Least time between two checkpoints of the [`Checkpointer`] while the WAL
/// is shorter than half of [`RESTART_PAGES`], unless
/// [`CHECKPOINT_AFTER_COMMITS`] commits come first; from half of
/// [`RESTART_PAGES`] on it checkpoints after every commit it is told of.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// Commits after which the [`Checkpointer`] checkpoints again without
/// waiting for the rest of [`CHECKPOINT_EVERY`], so a fast stream of
/// commits does not run the WAL far past [`RESTART_PAGES`] unseen.
const CHECKPOINT_AFTER_COMMITS: u32 = 64;

#[derive(Default)]
struct Wake {
    /// A commit wrote to the WAL since the last checkpoint.
    dirty: bool,
    /// Commits that wrote since the last checkpoint began.
    commits: u32,
    /// The checkpointer should end.
    stop: bool,
    /// A background checkpoint copied a WAL of at least [`RESTART_PAGES`]:
    /// the writer should copy the rest so the WAL starts over.
    restart_due: bool,
    /// The writer holds a [`WalRestart`] (from
    /// [`CheckpointSignal::committed`]) it has not run or dropped yet. The
    /// checkpointer waits meanwhile: a checkpoint of its own would hold
    /// SQLite's checkpoint lock and turn the writer's away.
    writer_copying: bool,
}

/// Wakes the [`Checkpointer`] after a commit that wrote; cheap to clone.
#[derive(Clone, Default)]
pub struct CheckpointSignal(Arc<(Mutex<Wake>, Condvar)>);

impl CheckpointSignal {
    /// Tells the checkpointer that committed pages wait in the WAL.
    /// Returns the writer's part of a WAL restart when one is due: run it
    /// ([`WalRestart::run`]) between two batches. The checkpointer waits
    /// until it is run or dropped.
    #[must_use = "a WalRestart handed over must be run (or dropped) between batches"]
    pub fn committed(&self) -> Option<WalRestart<'_>> {
        let (lock, cv) = &*self.0;
        let mut w = lock.lock().unwrap_or_else(|e| e.into_inner());
        w.commits = w.commits.saturating_add(1);
        if !w.dirty || w.commits == CHECKPOINT_AFTER_COMMITS {
            w.dirty = true;
            cv.notify_one();
        }
        if !std::mem::take(&mut w.restart_due) {
            return None;
        }
        w.writer_copying = true;
        Some(WalRestart { signal: self })
    }

    /// Records what a background checkpoint saw: `wal_pages` frames in the
    /// WAL. Returns true when the checkpointer should not wait before the
    /// next one (the WAL is half way to [`RESTART_PAGES`] or more).
    fn checkpointed(&self, wal_pages: i64) -> bool {
        let (lock, _) = &*self.0;
        if wal_pages >= RESTART_PAGES {
            lock.lock().unwrap_or_else(|e| e.into_inner()).restart_due = true;
        }
        wal_pages >= RESTART_PAGES / 2
    }

    fn stop(&self) {
        let (lock, cv) = &*self.0;
        lock.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        cv.notify_one();
    }
}

/// The writer's part of a WAL restart, handed out by
/// [`CheckpointSignal::committed`]. While it lives the checkpointer waits
/// (a checkpoint of its own would hold SQLite's checkpoint lock and turn
/// the writer's away); dropping it without running it lets the
/// checkpointer go on, and the restart is asked for again later.
pub struct WalRestart<'a> {
    signal: &'a CheckpointSignal,
}

impl WalRestart<'_> {
    /// Copies the frames of the WAL that the background checkpoints left
    /// (those committed since the last of them) into the database file and
    /// syncs it, on the writer's connection between two batches, so the
    /// writer's next transaction starts the WAL over from its beginning.
    /// A PASSIVE checkpoint: it never waits for readers (one still reading
    /// an older snapshot keeps its frames, and the restart waits for a
    /// later round).
    ///
    /// Errors: [`Error::Storage`] when the checkpoint fails (the WAL stays
    /// as it is; committed data is not affected).
    pub fn run(self, conn: &Connection) -> Result<()> {
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
        Ok(())
    }
}

impl Drop for WalRestart<'_> {
    fn drop(&mut self) {
        let (lock, cv) = &*self.signal.0;
        lock.lock()
            .unwrap_or_else(|e| e.into_inner())
            .writer_copying = false;
        cv.notify_one();
    }
}

/// Checkpoints the WAL from its own thread and connection, so the writer
/// copies few pages into the database file itself. It sleeps until the
/// writer signals a commit that wrote (no work while idle) and checkpoints
/// at most every 100 ms while the WAL is short, after every signalled
/// commit once it holds half of [`RESTART_PAGES`]. PASSIVE checkpoints
/// never block the writer; when one has copied everything, the writer's
/// next transaction restarts the WAL from its beginning. Under a steady
/// stream of commits that never happens (each checkpoint ends behind the
/// latest commit), so once the WAL holds [`RESTART_PAGES`] the
/// checkpointer runs one more (short) pass and then hands the writer a
/// [`WalRestart`], which copies the few frames committed during it and
/// lets the WAL start over.
/// Durability is unchanged: commits are durable in the WAL (synced per
/// commit with `synchronous=FULL`).
pub struct Checkpointer {
    signal: CheckpointSignal,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Checkpointer {
    /// Opens a connection to `path` and starts the checkpoint thread.
    ///
    /// Errors: [`Error::Storage`] when the database cannot be opened,
    /// [`Error::Internal`] when the thread cannot be spawned.
    pub fn start(path: &Path, sync: SyncMode) -> Result<Checkpointer> {
        let conn = Connection::open(path)?;
        configure(&conn, sync)?;
        let signal = CheckpointSignal::default();
        let theirs = signal.clone();
        let handle = std::thread::Builder::new()
            .name("agq-checkpoint".into())
            .spawn(move || {
                let (lock, cv) = &*theirs.0;
                loop {
                    {
                        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                        let mut w = cv
                            .wait_while(guard, |w| {
                                !w.stop && (!w.dirty || w.restart_due || w.writer_copying)
                            })
                            .unwrap_or_else(|e| e.into_inner());
                        if w.stop {
                            return;
                        }
                        w.dirty = false;
                        w.commits = 0;
                    }
                    let checkpoint = || {
                        // (busy, frames in the WAL, frames copied)
                        match conn
                            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get::<_, i64>(1))
                        {
                            Ok(n) => n,
                            Err(e) => {
                                tracing::warn!(error = %e, "background WAL checkpoint failed");
                                0
                            }
                        }
                    };
                    let mut wal_pages = checkpoint();
                    if wal_pages >= RESTART_PAGES {
                        // Once more before handing over: this pass is short,
                        // so it leaves the writer only the few frames
                        // committed while it ran.
                        wal_pages = checkpoint();
                    }
                    if theirs.checkpointed(wal_pages) {
                        continue;
                    }
                    // Throttle while the WAL is short: the next checkpoint
                    // after CHECKPOINT_EVERY or CHECKPOINT_AFTER_COMMITS
                    // commits, whichever comes first.
                    let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let (w, _) = cv
                        .wait_timeout_while(guard, CHECKPOINT_EVERY, |w| {
                            !w.stop && w.commits < CHECKPOINT_AFTER_COMMITS
                        })
                        .unwrap_or_else(|e| e.into_inner());
                    if w.stop {
                        return;
                    }
                }
            })
            .map_err(|e| Error::Internal(format!("cannot start the checkpoint thread: {e}")))?;
        Ok(Checkpointer {
            signal,
            handle: Some(handle),
        })
    }

    /// The handle the writer uses to wake this checkpointer.
    pub fn signal(&self) -> CheckpointSignal {
        self.signal.clone()
    }

    /// Stops the thread and waits for it (at most one checkpoint's time).
    pub fn stop(mut self) {
        self.signal.stop();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.signal.stop();
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Error::Storage {
            fault: store_fault(&e),
            detail: e.to_string(),
        }
    }
}

impl From<r2d2::Error> for Error {
    fn from(e: r2d2::Error) -> Self {
        Error::StoreBusy(e.to_string())
    }
}

/// The cause, in words, when a SQLite error means the store cannot write
/// for a reason outside AGQ: the disk or file system is full, an I/O error,
/// the database file cannot be opened or is read-only, the database is
/// locked by another process, memory ran out. `None` for every other error
/// (a constraint, a bug), which stays `INTERNAL`.
pub fn store_fault(e: &rusqlite::Error) -> Option<&'static str> {
    use rusqlite::ErrorCode;
    let rusqlite::Error::SqliteFailure(f, _) = e else {
        return None;
    };
    Some(match f.code {
        ErrorCode::DiskFull => "database or disk is full",
        ErrorCode::SystemIoFailure => "disk I/O error",
        ErrorCode::CannotOpen => "cannot open the database file",
        ErrorCode::ReadOnly => "the database file is read-only",
        ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => {
            "the database is locked by another process"
        }
        ErrorCode::OutOfMemory => "out of memory",
        ErrorCode::FileLockingProtocolFailed => "file locking failed",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::{JobStatus, TaskResult};

    /// A full disk, an I/O error or a read-only file is a store fault
    /// naming its cause (UNAVAILABLE to clients); a constraint failure (a
    /// bug) is none (INTERNAL).
    #[test]
    fn sqlite_errors_name_store_faults() {
        let err = |code| {
            Error::from(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(code),
                None,
            ))
        };
        for (code, cause) in [
            (rusqlite::ffi::SQLITE_FULL, "database or disk is full"),
            (rusqlite::ffi::SQLITE_IOERR, "disk I/O error"),
            (
                rusqlite::ffi::SQLITE_READONLY,
                "the database file is read-only",
            ),
        ] {
            assert_eq!(err(code).store_fault(), Some(cause));
        }
        assert_eq!(err(rusqlite::ffi::SQLITE_CONSTRAINT).store_fault(), None);
    }

    /// A database left at schema version 2 by an older agq is brought to
    /// the current version with its rows kept, the job indexes no query
    /// uses are gone, the action listing indexes are there, actions
    /// whose jobs all ended have a finish time (the last job's) for
    /// retention, and every plan, action and job is version 1 of its plan
    /// (the plan's body kept as that version); a database newer than this
    /// agq is refused.
    #[test]
    fn migrations_bring_an_old_database_up_to_date() {
        let mut conn = Connection::open_in_memory().unwrap();
        // As `open` migrates: with foreign keys enforced (version 16
        // rebuilds the jobs table under them).
        conn.pragma_update(None, "foreign_keys", "ON").unwrap();
        conn.execute_batch(MIGRATIONS[0]).unwrap();
        conn.execute_batch(MIGRATIONS[1]).unwrap();
        conn.pragma_update(None, "user_version", 2).unwrap();
        conn.execute_batch(
            "INSERT INTO plans VALUES ('p', 'first', x'0a0170', 7);
             INSERT INTO actions VALUES ('a', 'p', 1, 3, NULL, 0);
             INSERT INTO jobs (job_id, action_id, plan_id, status, input, max_attempts, created_at_ms, ready_at_ms)
                 VALUES ('j', 'a', 'p', 1, '{}', 3, 0, 0);
             INSERT INTO actions VALUES ('b', 'p', 2, 3, NULL, 0);
             INSERT INTO jobs (job_id, action_id, plan_id, status, input, max_attempts, created_at_ms, ready_at_ms, completed_at_ms)
                 VALUES ('k', 'b', 'p', 3, '{}', 3, 0, 0, 40), ('l', 'b', 'p', 6, '{}', 3, 0, 0, 50);
             INSERT INTO task_results VALUES
                 ((SELECT id FROM jobs WHERE job_id = 'k'), 2, 'wc', 1, 'out\"2', '', 7, 0, 1),
                 ((SELECT id FROM jobs WHERE job_id = 'k'), 1, 'cat', 0, 'a\nb', 'e', 5, 1, 0);",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version as usize, MIGRATIONS.len());
        // The first column of every row `sql` returns.
        let column = |sql: &str| -> Vec<String> {
            conn.prepare(sql)
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        let indexes = column("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'job_rows' AND sql IS NOT NULL ORDER BY name");
        // Version 15 drops the status index: the engine counts jobs per
        // status in memory. Version 16 drops the action index and the
        // unique index of every id: only the ids of the jobs created
        // before it are indexed. Version 19 indexes the cancelled rows.
        assert_eq!(
            indexes,
            ["jobs_by_legacy_id", "jobs_cancelled", "jobs_dead_by_action"]
        );
        let cancelled =
            column("SELECT job_id FROM job_rows INDEXED BY jobs_cancelled WHERE status = 6");
        assert_eq!(
            cancelled,
            ["l"],
            "the cancelled job stored before version 19"
        );
        // Version 8: the indexes ListActions walks; version 18: the
        // unfinished actions the start-up load reads.
        let action_indexes = column("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'actions' AND sql IS NOT NULL ORDER BY name");
        assert_eq!(
            action_indexes,
            [
                "actions_by_created",
                "actions_by_finished",
                "actions_by_plan",
                "actions_open"
            ]
        );
        let job: String = conn
            .query_row("SELECT job_id FROM jobs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(job, "j");
        let finished: Vec<Option<i64>> = conn
            .prepare("SELECT finished_at_ms FROM actions ORDER BY action_id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(finished, [None, Some(50)]);
        // Version 9: plan versions.
        let head: (i64, i64, i64) = conn
            .query_row(
                "SELECT version, created_at_ms, updated_at_ms FROM plans WHERE plan_id = 'p'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!(head, (1, 7, 7));
        let v1: (i64, String, Vec<u8>, i64) = conn
            .query_row(
                "SELECT version, description, body, created_at_ms FROM plan_versions WHERE plan_id = 'p'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(v1, (1, "first".to_string(), vec![0x0a, 0x01, b'p'], 7));
        let got = plans::get_version(&conn, "p", 1).unwrap().unwrap();
        assert_eq!((got.plan_id.as_str(), got.version), ("p", 1));
        assert_eq!(plans::get(&conn, "p").unwrap(), Some(got));
        let versions: Vec<i64> = conn
            .prepare("SELECT plan_version FROM jobs UNION ALL SELECT plan_version FROM actions")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(versions, [1; 5]);

        // Version 14: task results in the job row, in task order.
        let k = conn
            .query_row("SELECT id FROM jobs WHERE job_id = 'k'", [], |r| r.get(0))
            .unwrap();
        let got = jobs::get_by_row(&conn, k, true).unwrap().unwrap();
        assert_eq!(
            got.task_results,
            [
                TaskResult {
                    task_number: 1,
                    command: "cat".into(),
                    exit_code: 0,
                    stdout: "a\nb".into(),
                    stderr: "e".into(),
                    duration_ms: 5,
                    stdout_truncated: true,
                    stderr_truncated: false,
                },
                TaskResult {
                    task_number: 2,
                    command: "wc".into(),
                    exit_code: 1,
                    stdout: "out\"2".into(),
                    stderr: String::new(),
                    duration_ms: 7,
                    stdout_truncated: false,
                    stderr_truncated: true,
                },
            ]
        );
        let tables: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'task_results'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(tables, 0);

        // Version 16: each action knows the rows of its jobs, which keep
        // their ids.
        let ranges: Vec<(String, i64, i64)> = conn
            .prepare(
                "SELECT action_id, first_job_row, last_job_row FROM actions ORDER BY action_id",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(ranges, [("a".to_string(), 1, 1), ("b".to_string(), 2, 3)]);
        assert_eq!(jobs::key_by_job_id(&conn, "l").unwrap().unwrap().row, 3);
        assert_eq!(
            jobs::get_by_row(&conn, 3, false).unwrap().unwrap().job_id,
            "l"
        );
        let b = jobs::action_status(&conn, "b").unwrap().unwrap();
        assert_eq!((b.completed, b.cancelled, b.pending), (1, 1, 0));
        assert_eq!(jobs::last_row(&conn).unwrap(), 3);

        // Version 17: the job rows keep their statuses (a job completed
        // before it has no completion row) and `jobs` reads them.
        let kinds: Vec<(String, String)> = conn
            .prepare("SELECT name, type FROM sqlite_master WHERE name IN ('jobs', 'job_rows', 'job_completions') ORDER BY name")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(
            kinds,
            [
                ("job_completions".to_string(), "table".to_string()),
                ("job_rows".to_string(), "table".to_string()),
                ("jobs".to_string(), "view".to_string()),
            ]
        );
        let done = jobs::get_by_row(&conn, k, false).unwrap().unwrap();
        assert_eq!(
            (done.status, done.completed_at_ms),
            (JobStatus::Completed, Some(40))
        );
        let completions: i64 = conn
            .query_row("SELECT count(*) FROM job_completions", [], |r| r.get(0))
            .unwrap();
        assert_eq!(completions, 0);

        // Version 18: the open floor starts at 0, so the first load reads
        // every row and finds the one open job.
        assert_eq!(jobs::open_floor(&conn).unwrap(), 0);
        let open: Vec<String> = jobs::load_open(&conn, jobs::open_floor(&conn).unwrap())
            .unwrap()
            .into_iter()
            .map(|j| j.job_id)
            .collect();
        assert_eq!(open, ["j"]);

        conn.pragma_update(None, "user_version", MIGRATIONS.len() as i64 + 1)
            .unwrap();
        assert!(matches!(migrate(&mut conn), Err(Error::Internal(_))));
    }

    /// The `jobs` view is flattened into the statements that read it: a
    /// job is found by its row, its legacy id or its action's range of
    /// rows, and its completion by the job's row, never by a scan or a
    /// materialised view. A look-up that reads no completion column skips
    /// the completions table.
    #[test]
    fn the_jobs_view_reads_by_row_not_by_scan() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        let plan = |sql: &str| -> Vec<String> {
            let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let nulls = vec![rusqlite::types::Null; stmt.parameter_count()];
            stmt.query_map(rusqlite::params_from_iter(nulls), |r| r.get::<_, String>(3))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        let by_row = "SEARCH j USING INTEGER PRIMARY KEY (rowid=?)";
        let completion = "SEARCH c USING INTEGER PRIMARY KEY (rowid=?) LEFT-JOIN";
        assert_eq!(
            plan("SELECT status, task_results FROM jobs WHERE id = 1 AND job_key = 2"),
            [by_row, completion]
        );
        assert_eq!(
            plan("SELECT status FROM jobs WHERE job_id = 'j'"),
            [
                "SEARCH j USING INDEX jobs_by_legacy_id (job_id=?)",
                completion
            ]
        );
        assert_eq!(
            plan("SELECT id, job_key, job_id FROM jobs WHERE id = 1"),
            [by_row]
        );
        let range = plan(concat!(
            "SELECT count(*) FILTER (WHERE status = 3) FROM jobs WHERE ",
            of_action!()
        ));
        assert_eq!(
            range
                .iter()
                .filter(|step| step.starts_with("SEARCH j") || step.starts_with("SEARCH c"))
                .collect::<Vec<_>>(),
            [
                "SEARCH j USING INTEGER PRIMARY KEY (rowid>? AND rowid<?)",
                completion
            ]
        );
        assert!(
            range.iter().all(|step| !step.starts_with("SCAN")),
            "{range:?}"
        );
        // The start-up load reads the rows from the open floor on.
        let open = plan(jobs::LOAD_OPEN);
        assert_eq!(
            open.first().map(String::as_str),
            Some("SEARCH j USING INTEGER PRIMARY KEY (rowid>?)"),
            "{open:?}"
        );
        // Dead jobs of any action: the index of dead jobs, not the rows.
        assert_eq!(
            plan(jobs::SEARCH_DEAD),
            [
                "SCAN job_rows USING INDEX jobs_dead_by_action",
                "USE TEMP B-TREE FOR ORDER BY"
            ]
        );
        // Cancelled jobs of any action: a page of the index of cancelled
        // rows, in row order (no sort).
        assert_eq!(
            plan(jobs::SEARCH_CANCELLED),
            ["SEARCH job_rows USING INDEX jobs_cancelled (id>?)"]
        );
        assert_eq!(
            plan(jobs::OPEN_ACTION_SCHEDULING),
            ["SCAN actions USING INDEX actions_open"]
        );
        let plan_jobs = plan(concat!(
            "SELECT j.status, count(*) FROM actions a CROSS JOIN jobs j ON ",
            job_of_action!(),
            " WHERE a.plan_id = 'p' GROUP BY j.status"
        ));
        assert!(
            plan_jobs.iter().all(|step| !step.starts_with("SCAN")),
            "{plan_jobs:?}"
        );
    }

    /// `SyncMode::Full` reaches every connection the store opens: the
    /// writer's and the read pool's report `synchronous=FULL` (2), so a
    /// commit is synced before the writer acknowledges it.
    #[test]
    fn full_sync_applies_to_the_writer_and_the_readers() {
        let dir = tempfile::tempdir().unwrap();
        let (conn, pool) = open(&dir.path().join("s.db"), SyncMode::Full).unwrap();
        let sync = |c: &Connection| -> i64 {
            c.pragma_query_value(None, "synchronous", |r| r.get(0))
                .unwrap()
        };
        assert_eq!(sync(&conn), 2);
        assert_eq!(sync(&pool.get().unwrap()), 2);
        let (normal, _) = open(&dir.path().join("n.db"), SyncMode::Normal).unwrap();
        assert_eq!(sync(&normal), 1);
    }

    /// A database opened as the store opens it (with `sync`), with a table
    /// `t (x BLOB)`: its directory, its path and the writer's connection.
    fn blob_db(name: &str, sync: SyncMode) -> (tempfile::TempDir, std::path::PathBuf, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        let (conn, _pool) = open(&path, sync).unwrap();
        conn.execute_batch("CREATE TABLE t (x BLOB)").unwrap();
        (dir, path, conn)
    }

    /// One commit of a 4 KiB row (about three WAL frames).
    fn insert_blob(conn: &Connection) {
        conn.execute("INSERT INTO t VALUES (zeroblob(4096))", [])
            .unwrap();
    }

    /// Bytes of the WAL file of the database at `path` (its high-water
    /// mark: the file keeps its size when the WAL starts over).
    fn wal_len(path: &Path) -> u64 {
        std::fs::metadata(path.with_extension("db-wal"))
            .unwrap()
            .len()
    }

    /// Bytes of the database file at `path`: it grows when a checkpoint
    /// copies new pages into it.
    fn main_len(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().len()
    }

    /// How many times the WAL of the database at `path` started over: the
    /// checkpoint sequence number of its header (bytes 12..16, big-endian),
    /// which SQLite counts up at every restart.
    fn wal_restarts(path: &Path) -> u32 {
        let wal = std::fs::read(path.with_extension("db-wal")).unwrap();
        u32::from_be_bytes(wal[12..16].try_into().unwrap())
    }

    /// Under a steady stream of commits, with the checkpointer copying in
    /// the background, the WAL still starts over from its beginning every
    /// thousand-odd frames: once it holds [`RESTART_PAGES`], the
    /// checkpointer hands the writer a [`WalRestart`] to copy the last
    /// frames itself (as the writer thread does between batches), which
    /// the background checkpoint never catches up with. The WAL file's
    /// size is its high-water mark, so it shows the most frames it ever
    /// held. The commits are synced (`synchronous=FULL`, as the store's
    /// default): unsynced ones can outrun a checkpointer that a loaded
    /// machine leaves without CPU or disk, whatever the design. (Without
    /// the writer's part the WAL starts over once, at the 10,000-page
    /// backstop.)
    #[test]
    fn the_wal_starts_over_while_commits_keep_coming() {
        let (_dir, path, conn) = blob_db("w.db", SyncMode::Full);
        let cp = Checkpointer::start(&path, SyncMode::Full).unwrap();
        let signal = cp.signal();
        // 3,000 commits of a 4 KiB row each: about 10,000 frames.
        for _ in 0..3000 {
            insert_blob(&conn);
            if let Some(restart) = signal.committed() {
                restart.run(&conn).unwrap();
            }
        }
        cp.stop();
        let restarts = wal_restarts(&path);
        assert!(restarts >= 3, "the WAL started over {restarts} times");
        let page: i64 = conn
            .pragma_query_value(None, "page_size", |r| r.get(0))
            .unwrap();
        let frame = page.unsigned_abs() + 24;
        let wal = wal_len(&path);
        // 1,018–1,452 frames in runs on an idle and on a loaded machine.
        assert!(
            wal <= 3_000 * frame,
            "the WAL grew to {} frames without starting over",
            wal / frame
        );
    }

    /// A background pass that finds [`RESTART_PAGES`] in the WAL hands the
    /// writer a restart at its next commit, once; a shorter WAL hands none.
    #[test]
    fn a_long_wal_hands_the_writer_a_restart() {
        let signal = CheckpointSignal::default();
        assert!(!signal.checkpointed(RESTART_PAGES / 2 - 1));
        assert!(signal.committed().is_none());
        assert!(signal.checkpointed(RESTART_PAGES / 2));
        assert!(signal.committed().is_none());
        assert!(signal.checkpointed(RESTART_PAGES));
        let copying = || signal.0.as_ref().0.lock().unwrap().writer_copying;
        let restart = signal.committed().expect("a restart is due");
        assert!(copying(), "the checkpointer does not wait for the writer");
        drop(restart);
        assert!(!copying(), "the checkpointer still waits");
        assert!(signal.committed().is_none(), "handed over twice");
    }

    /// The writer's part of a WAL restart: after [`WalRestart::run`] the
    /// next commit writes from the WAL's beginning; without it, after the
    /// last frame. (The WAL file keeps its size when it starts over, so it
    /// grows only in the second case.)
    #[test]
    fn after_the_writers_checkpoint_the_next_commit_starts_the_wal_over() {
        let (_dir, path, conn) = blob_db("r.db", SyncMode::Normal);
        for _ in 0..200 {
            insert_blob(&conn);
        }
        let full = wal_len(&path);
        insert_blob(&conn);
        assert!(wal_len(&path) > full, "the commit was not appended");
        let full = wal_len(&path);
        let signal = CheckpointSignal::default();
        WalRestart { signal: &signal }.run(&conn).unwrap();
        insert_blob(&conn);
        assert_eq!(wal_len(&path), full, "the WAL did not start over");
    }

    /// A WAL that started over loses nothing at a crash: the files as a
    /// killed process leaves them (copied while the writer's connection is
    /// still open, without the shared-memory index) hold every committed
    /// row, the ones in the database file and the ones written over the
    /// start of the old WAL, and none of the old WAL's stale frames behind
    /// them comes back (a row updated after the restart reads its last
    /// value).
    #[test]
    fn a_crash_after_the_wal_started_over_loses_no_commit() {
        let (dir, path, conn) = blob_db("c.db", SyncMode::Normal);
        conn.execute_batch("CREATE TABLE n (v INTEGER); INSERT INTO n VALUES (0)")
            .unwrap();
        for i in 1..=300 {
            insert_blob(&conn);
            conn.execute("UPDATE n SET v = ?1", [i]).unwrap();
        }
        let signal = CheckpointSignal::default();
        WalRestart { signal: &signal }.run(&conn).unwrap();
        let before = wal_len(&path);
        for i in 301..=320 {
            insert_blob(&conn);
            conn.execute("UPDATE n SET v = ?1", [i]).unwrap();
        }
        assert_eq!(wal_len(&path), before, "the WAL did not start over");
        let copy = dir.path().join("copy.db");
        std::fs::copy(&path, &copy).unwrap();
        std::fs::copy(path.with_extension("db-wal"), copy.with_extension("db-wal")).unwrap();
        let after = Connection::open(&copy).unwrap();
        let (rows, v): (i64, i64) = after
            .query_row(
                "SELECT (SELECT count(*) FROM t), (SELECT v FROM n)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((rows, v), (320, 320));
        let ok: String = after
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(ok, "ok");
    }

    /// A [`WalRestart`] the writer drops without running lets the
    /// checkpointer go on: later commits are still copied into the
    /// database file.
    #[test]
    fn a_dropped_restart_does_not_stop_the_checkpointer() {
        let (_dir, path, conn) = blob_db("d.db", SyncMode::Normal);
        let cp = Checkpointer::start(&path, SyncMode::Normal).unwrap();
        insert_blob(&conn);
        // As a background pass that found a long WAL does.
        let signal = cp.signal();
        signal.checkpointed(RESTART_PAGES);
        drop(signal.committed().expect("a restart is due"));
        let before = main_len(&path);
        for _ in 0..50 {
            insert_blob(&conn);
            drop(cp.signal().committed());
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while main_len(&path) == before {
            assert!(
                std::time::Instant::now() < deadline,
                "the checkpointer stopped after a dropped restart"
            );
            drop(cp.signal().committed());
            std::thread::sleep(Duration::from_millis(20));
        }
        cp.stop();
    }

    /// The checkpointer copies the WAL into the database only when a commit
    /// signals it, not on a timer.
    #[test]
    fn checkpoints_follow_commits_not_a_timer() {
        let (_dir, path, conn) = blob_db("f.db", SyncMode::Normal);
        conn.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
        // Bring the main file to its settled size first.
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        let before = main_len(&path);
        let cp = Checkpointer::start(&path, SyncMode::Normal).unwrap();
        for _ in 0..50 {
            insert_blob(&conn);
        }
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(
            main_len(&path),
            before,
            "checkpointed without being signalled"
        );
        drop(cp.signal().committed());
        // The file grows page by page while the checkpoint copies: wait for
        // all 50 rows.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while main_len(&path) <= before + 50 * 4096 {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint of the 50 rows after the signal"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        cp.stop();
    }
}
