//! The one table from [`Error`] to gRPC status codes. Internal details are
//! logged here and replaced by a generic message.

use tonic::{Code, Status};

use crate::error::Error;

/// The gRPC code `err` maps to.
pub fn code(err: &Error) -> Code {
    match err {
        Error::InvalidArgument(_) => Code::InvalidArgument,
        Error::NotFound(_) => Code::NotFound,
        Error::AlreadyExists(_) => Code::AlreadyExists,
        Error::FailedPrecondition(_) => Code::FailedPrecondition,
        Error::PermissionDenied(_) => Code::PermissionDenied,
        Error::ResourceExhausted(_) => Code::ResourceExhausted,
        Error::Unavailable | Error::StoreBusy(_) | Error::StoreUnavailable(_) => Code::Unavailable,
        Error::Storage { fault: Some(_), .. } => Code::Unavailable,
        Error::Storage { fault: None, .. } | Error::Internal(_) => Code::Internal,
    }
}

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let code = code(&err);
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
            Error::Storage { .. } | Error::Internal(_) | Error::StoreBusy(_) => {
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

    /// A full disk or an I/O error is `UNAVAILABLE` with the cause named;
    /// a storage failure without a fault (a bug) stays `INTERNAL` with no
    /// detail.
    #[test]
    fn store_faults_are_unavailable_and_name_their_cause() {
        for cause in [
            "database or disk is full",
            "disk I/O error",
            "the database file is read-only",
        ] {
            let st = Status::from(Error::Storage {
                detail: "x".into(),
                fault: Some(cause),
            });
            assert_eq!(st.code(), Code::Unavailable, "{st:?}");
            assert!(st.message().contains(cause), "{st:?}");
            assert!(st.message().contains("retry"), "{st:?}");
        }
        let st = Status::from(Error::StoreUnavailable("database or disk is full"));
        assert_eq!(st.code(), Code::Unavailable);
        let st = Status::from(Error::Storage {
            detail: "constraint failed".into(),
            fault: None,
        });
        assert_eq!(st.code(), Code::Internal);
        assert_eq!(st.message(), "internal error; see the server log");
    }
}
