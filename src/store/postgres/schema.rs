//! The PostgreSQL schema and its migrations: each applied once, in order,
//! in one transaction that first takes a transaction-level advisory lock,
//! so replicas starting at the same time take turns and the second finds
//! the work done. A database migrated by a newer binary is refused.

use crate::error::{Error, Result};

use super::db_err;

/// The migrations, in order; the index + 1 is the schema version.
const MIGRATIONS: &[&str] = &[
    include_str!("migrations/0001_init.sql"),
    include_str!("migrations/0002_job_counts.sql"),
    include_str!("migrations/0003_id_collation.sql"),
    include_str!("migrations/0004_delayed_jobs.sql"),
    include_str!("migrations/0005_jobs_open_by_selector.sql"),
    include_str!("migrations/0006_leader_resumed_at.sql"),
];

/// Key of the advisory lock the migrations run under ("agq schema").
const MIGRATION_LOCK: i64 = 0x6167_715f_7363_6d61;

/// The schema version this binary writes.
pub const SCHEMA_VERSION: i32 = MIGRATIONS.len() as i32;

/// Brings the database to [`SCHEMA_VERSION`].
///
/// Errors: `Internal` when the database's schema is newer than this
/// binary's; storage errors (the transaction is rolled back: nothing of a
/// failed migration stays).
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<()> {
    let tx = client.transaction().await.map_err(db_err)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(db_err)?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS agq_schema (
             version     integer PRIMARY KEY,
             applied_at  timestamptz NOT NULL DEFAULT now()
         )",
    )
    .await
    .map_err(db_err)?;
    let current: i32 = tx
        .query_one("SELECT coalesce(max(version), 0) FROM agq_schema", &[])
        .await
        .map_err(db_err)?
        .get(0);
    if current > SCHEMA_VERSION {
        return Err(Error::Internal(format!(
            "the database's schema is version {current}, newer than this agq's ({SCHEMA_VERSION}); \
             run a newer agq"
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(current as usize) {
        let version = i as i32 + 1;
        tx.batch_execute(sql).await.map_err(db_err)?;
        tx.execute("INSERT INTO agq_schema (version) VALUES ($1)", &[&version])
            .await
            .map_err(db_err)?;
        tracing::info!(version, "PostgreSQL schema migrated");
    }
    tx.commit().await.map_err(db_err)
}
