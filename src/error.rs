//! The one error type of the AGQ server and the one place that maps it to a
//! gRPC status code. Internal details are logged, never sent to clients.

use tonic::{Code, Status};

/// An error of the AGQ core or store, mapped to a gRPC [`Status`] by
/// `From<Error> for Status`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad input: a malformed id, a plan that fails validation, a limit
    /// exceeded by the request itself. Maps to `INVALID_ARGUMENT`.
    #[error("{0}")]
    InvalidArgument(String),
    /// The named plan, action, job or worker does not exist. Maps to `NOT_FOUND`.
    #[error("{0}")]
    NotFound(String),
    /// The id is taken. Maps to `ALREADY_EXISTS`.
    #[error("{0}")]
    AlreadyExists(String),
    /// The request is valid but not in the current state: a bad job
    /// transition, a stale lease (fencing), a plan still in use. Maps to
    /// `FAILED_PRECONDITION`.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The caller may not act on this object (another worker's job, a
    /// worker token used for a client call). Maps to `PERMISSION_DENIED`.
    #[error("{0}")]
    PermissionDenied(String),
    /// A server-side limit is reached. Maps to `RESOURCE_EXHAUSTED`.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The server is shutting down or its store is gone. Maps to `UNAVAILABLE`.
    #[error("the server is shutting down")]
    Unavailable,
    /// The store cannot commit now for a cause outside AGQ (the disk is
    /// full, an I/O error, the database file is gone or read-only); the
    /// string names the cause. Nothing was changed. Maps to `UNAVAILABLE`:
    /// retry with backoff.
    #[error("the store cannot commit ({0}); nothing was changed; retry with backoff")]
    StoreUnavailable(&'static str),
    /// SQLite failed. Maps to `UNAVAILABLE` with the cause named when the
    /// cause is the environment (see [`store_fault`]), else to `INTERNAL`
    /// with the detail logged only.
    #[error("storage error: {0}")]
    Storage(#[from] rusqlite::Error),
    /// The read connection pool failed. Maps to `UNAVAILABLE`.
    #[error("connection pool error: {0}")]
    Pool(#[from] r2d2::Error),
    /// Anything else unexpected. Maps to `INTERNAL`; the detail is logged only.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result alias of the AGQ core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// Shorthand for [`Error::NotFound`].
    pub fn not_found(msg: impl Into<String>) -> Self {
        Error::NotFound(msg.into())
    }

    /// Shorthand for [`Error::FailedPrecondition`].
    pub fn precondition(msg: impl Into<String>) -> Self {
        Error::FailedPrecondition(msg.into())
    }

    /// The gRPC code this error maps to.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::PermissionDenied(_) => Code::PermissionDenied,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::Unavailable | Error::Pool(_) | Error::StoreUnavailable(_) => Code::Unavailable,
            Error::Storage(e) if store_fault(e).is_some() => Code::Unavailable,
            Error::Storage(_) | Error::Internal(_) => Code::Internal,
        }
    }

    /// The cause when this error means the store cannot write for a
    /// reason outside AGQ (see [`store_fault`]); `None` otherwise.
    pub fn store_fault(&self) -> Option<&'static str> {
        match self {
            Error::StoreUnavailable(cause) => Some(cause),
            Error::Storage(e) => store_fault(e),
            _ => None,
        }
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

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let code = err.code();
        if let Some(cause) = err.store_fault() {
            // Expected while the disk is full: the writer logs the fault
            // once; each refused call is not an error of its own.
            tracing::debug!(error = %err, "refused: the store cannot commit");
            return Status::new(
                code,
                format!(
                    "the store cannot commit ({cause}); nothing was changed; retry with backoff"
                ),
            );
        }
        match err {
            Error::Storage(_) | Error::Internal(_) | Error::Pool(_) => {
                tracing::error!(error = %err, "internal error");
                let msg = if code == Code::Unavailable {
                    "the store is temporarily unavailable; retry"
                } else {
                    "internal error; see the server log"
                };
                Status::new(code, msg)
            }
            other => Status::new(code, other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqlite(code: std::ffi::c_int) -> Error {
        Error::Storage(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(code),
            None,
        ))
    }

    /// A full disk or an I/O error is `UNAVAILABLE` with the cause named;
    /// a constraint failure (a bug) stays `INTERNAL` with no detail.
    #[test]
    fn store_faults_are_unavailable_and_name_their_cause() {
        for (code, cause) in [
            (rusqlite::ffi::SQLITE_FULL, "database or disk is full"),
            (rusqlite::ffi::SQLITE_IOERR, "disk I/O error"),
            (rusqlite::ffi::SQLITE_READONLY, "read-only"),
        ] {
            let st = Status::from(sqlite(code));
            assert_eq!(st.code(), Code::Unavailable, "{st:?}");
            assert!(st.message().contains(cause), "{st:?}");
            assert!(st.message().contains("retry"), "{st:?}");
        }
        let st = Status::from(Error::StoreUnavailable("database or disk is full"));
        assert_eq!(st.code(), Code::Unavailable);
        let st = Status::from(sqlite(rusqlite::ffi::SQLITE_CONSTRAINT));
        assert_eq!(st.code(), Code::Internal);
        assert_eq!(st.message(), "internal error; see the server log");
    }
}
