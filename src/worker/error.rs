//! Errors that stop the worker.

/// Why `agw` could not start or had to stop. Connection losses are not
/// errors: the worker reconnects on its own.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A bad flag or file (URL, TLS files, token, worker id, tools).
    #[error("configuration: {0}")]
    Config(String),
    /// The server refused the first registration for a reason retrying
    /// cannot fix (bad id or capabilities, bad or missing token).
    #[error("registration refused: {0}")]
    Registration(String),
    /// Another live agw process runs this worker id (the server answered
    /// `ALREADY_EXISTS` to a registration carrying this process's instance
    /// id): this process must not run the id's jobs too.
    #[error("worker id {worker_id} is taken by another live agw process; refusing to run it twice ({detail})")]
    Duplicate {
        /// The worker id.
        worker_id: String,
        /// The server's message (which instance holds it, since when).
        detail: String,
    },
}
