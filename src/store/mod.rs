//! The engines behind [`crate::core::Engine`]. [`sqlite`] is the embedded
//! default: one process, in-memory queues rebuilt from the database at
//! start, one writer thread with group commit. All SQL lives under here.

pub mod sqlite;
