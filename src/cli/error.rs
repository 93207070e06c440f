//! Errors of the `agq` client and demo. Server errors keep the gRPC code's
//! canonical name and the server's message (`NOT_FOUND: plan x not found`).

use std::error::Error as _;

use tonic::{Code, Status};

/// An error of a client subcommand or of `agq demo`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The server answered with an error status.
    #[error("{}", describe_status(.0))]
    Rpc(Box<Status>),
    /// The server could not be reached or the connection set-up failed.
    #[error("cannot connect to {server}: {reason}")]
    Connect {
        /// The URL tried.
        server: String,
        /// Why, with the whole cause chain.
        reason: String,
    },
    /// A local input is invalid: a file that cannot be read, bad JSON, a
    /// glob that matches nothing.
    #[error("{0}")]
    Input(String),
    /// Printing the result failed.
    #[error("cannot write output: {0}")]
    Output(String),
    /// Stdout was closed by the reader (`agq ... | head`): stop quietly.
    #[error("stdout closed")]
    BrokenPipe,
    /// The command ran, but what it observed is a failure: an Action that
    /// finished with dead or cancelled jobs, a demo job that did not complete.
    #[error("{0}")]
    Failed(String),
}

impl From<Status> for CliError {
    fn from(status: Status) -> Self {
        CliError::Rpc(Box::new(status))
    }
}

impl CliError {
    /// The process exit code for this error: 0 for a closed stdout, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::BrokenPipe => 0,
            _ => 1,
        }
    }

    /// True when nothing should be printed for this error.
    pub fn is_silent(&self) -> bool {
        matches!(self, CliError::BrokenPipe)
    }

    /// Names `--timeout` in a call that ran past it. tonic reports the
    /// client's own deadline as `CANCELLED: Timeout expired`, which reads
    /// as if someone cancelled the call; this turns it into
    /// `DEADLINE_EXCEEDED: no answer within --timeout 30s ...`, the code
    /// gRPC specifies for a deadline. Every other error is returned as it is.
    #[must_use]
    pub fn explain_timeout(self, timeout: std::time::Duration) -> Self {
        match self {
            CliError::Rpc(s) if is_client_timeout(&s) => {
                let shown = if timeout.subsec_nanos() == 0 {
                    super::time::clock(timeout)
                } else {
                    super::time::human_duration(timeout)
                };
                CliError::Rpc(Box::new(Status::deadline_exceeded(format!(
                    "no answer within --timeout {shown} (AGQ_TIMEOUT): the server is slow or \
                     does not answer"
                ))))
            }
            other => other,
        }
    }

    /// The gRPC code, when the server returned one.
    pub fn code(&self) -> Option<Code> {
        match self {
            CliError::Rpc(s) => Some(s.code()),
            _ => None,
        }
    }
}

/// True when `status` is tonic's report of the client-side deadline
/// (`Endpoint::timeout`): `CANCELLED` caused by [`tonic::TimeoutExpired`].
fn is_client_timeout(status: &Status) -> bool {
    if status.code() != Code::Cancelled {
        return false;
    }
    let mut source = status.source();
    while let Some(s) = source {
        if s.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = s.source();
    }
    status.message() == tonic::TimeoutExpired(()).to_string()
}

/// The canonical upper-case name of a gRPC code, as in `NOT_FOUND`: tonic's
/// variant name (`NotFound`) in the upper snake case of the gRPC
/// specification's status code table.
pub fn code_name(code: Code) -> String {
    let mut name = String::new();
    for c in format!("{code:?}").chars() {
        if c.is_ascii_uppercase() && !name.is_empty() {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// `CODE: message` of a status, with the transport cause chain appended
/// when the status came from the client side (connection refused, timeout).
pub fn describe_status(status: &Status) -> String {
    let mut text = code_name(status.code());
    if !status.message().is_empty() {
        text.push_str(": ");
        text.push_str(status.message());
    }
    append_causes(&mut text, status.source());
    text
}

/// The message of an error followed by every cause, `a: b: c`.
pub fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    append_causes(&mut text, err.source());
    text
}

/// Appends `: cause` for `source` and each cause below it, skipping a cause
/// whose text is already there.
fn append_causes(text: &mut String, mut source: Option<&(dyn std::error::Error + 'static)>) {
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names_are_the_canonical_ones() {
        let names: Vec<String> = (0..=16).map(|i| code_name(Code::from_i32(i))).collect();
        assert_eq!(
            names,
            [
                "OK",
                "CANCELLED",
                "UNKNOWN",
                "INVALID_ARGUMENT",
                "DEADLINE_EXCEEDED",
                "NOT_FOUND",
                "ALREADY_EXISTS",
                "PERMISSION_DENIED",
                "RESOURCE_EXHAUSTED",
                "FAILED_PRECONDITION",
                "ABORTED",
                "OUT_OF_RANGE",
                "UNIMPLEMENTED",
                "INTERNAL",
                "UNAVAILABLE",
                "DATA_LOSS",
                "UNAUTHENTICATED",
            ]
        );
    }

    #[test]
    fn describes_a_status_by_code_and_message() {
        let e = CliError::from(Status::not_found("plan x not found"));
        assert_eq!(e.to_string(), "NOT_FOUND: plan x not found");
        assert_eq!(describe_status(&Status::unavailable("")), "UNAVAILABLE");
    }
}
