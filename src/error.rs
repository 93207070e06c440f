//! The one error type of the AGQ server. Each variant names the gRPC code
//! it maps to; the mapping itself (`From<Error> for tonic::Status`) lives in
//! the service layer (`crate::service::status`), the only place that knows
//! gRPC. Internal details are logged, never sent to clients.

/// An error of the AGQ core or an engine.
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
    /// The store failed. With a `fault` (the environment is to blame: a
    /// full disk, an I/O error, a locked file) it maps to `UNAVAILABLE`
    /// naming the fault; without, to `INTERNAL` with `detail` logged only.
    #[error("storage error: {detail}")]
    Storage {
        /// What failed, for the log.
        detail: String,
        /// The cause in words when it lies outside AGQ.
        fault: Option<&'static str>,
    },
    /// No store connection could be had in time. Maps to `UNAVAILABLE`.
    #[error("store connection unavailable: {0}")]
    StoreBusy(String),
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

    /// The cause when this error means the store cannot write for a
    /// reason outside AGQ; `None` otherwise.
    pub fn store_fault(&self) -> Option<&'static str> {
        match self {
            Error::StoreUnavailable(cause) => Some(cause),
            Error::Storage { fault, .. } => *fault,
            _ => None,
        }
    }
}
