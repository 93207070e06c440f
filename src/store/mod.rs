//! SQLite store: opening, pragmas, versioned migrations, the read pool and
//! the single writer thread. All SQL of AGQ lives under this module.

pub mod jobs;
pub mod plans;
pub mod workers;
pub mod writer;

use std::{path::Path, time::Duration};

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::Connection;

use crate::{
    config::SyncMode,
    error::{Error, Result},
};

/// Migrations in order; migration `i` brings the schema to `user_version = i + 1`.
const MIGRATIONS: &[&str] = &[include_str!("migrations/0001_init.sql")];

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
    configure(&conn, sync)?;
    migrate(&mut conn)?;
    let manager = SqliteConnectionManager::file(path).with_init(move |c| configure(c, sync));
    let pool = r2d2::Pool::builder()
        .max_size(8)
        .connection_timeout(Duration::from_secs(10))
        .build(manager)?;
    Ok((conn, pool))
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
