//! The engines behind [`crate::core::Engine`]. [`sqlite`] is the embedded
//! default: one process, in-memory queues rebuilt from the database at
//! start, one writer thread with group commit. [`postgres`] is the
//! clustered mode: any number of replicas sharing one PostgreSQL
//! database, which holds the whole state. All SQL lives under here.

pub mod postgres;
pub mod sqlite;
