//! The engines behind [`crate::core::Engine`]. [`sqlite`] is the embedded
//! default: one process, in-memory queues rebuilt from the database at
//! start, one writer thread with group commit. [`postgres`] is the
//! clustered mode: any number of replicas sharing one PostgreSQL
//! database, which holds the whole state. All SQL lives under here.

pub mod postgres;
pub mod sqlite;

use crate::error::Error;

/// The refusal of ForgetWorker for worker `id` whose quarantine no admin
/// has released: the record holds the quarantine, and ForgetWorker takes
/// the worker's own token, so forgetting it would let the worker end its
/// quarantine, which only ReleaseWorker (an admin token) may.
///
/// The error is `FailedPrecondition`.
pub(crate) fn quarantined_forget(id: &str) -> Error {
    Error::precondition(format!(
        "worker {id} is quarantined; an admin must release it (ReleaseWorker) before it can \
         be forgotten"
    ))
}
