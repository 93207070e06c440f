//! `agw`, the AGQ worker: advertises the Unix tools it has, keeps a heartbeat
//! and a lease stream open to the server, runs each leased Plan as real
//! processes and reports the results.
//!
//! - [`config`]: flags (`AGW_*` environment variables) and [`WorkerConfig`].
//! - [`tools`]: the advertised tool set (allowlist ∩ `$PATH`).
//! - [`template`]: `{{name}}` substitution in task arguments.
//! - [`executor`]: runs a Plan's tasks as processes (pipes, timeouts,
//!   process groups, capped capture).
//! - [`agent`]: registration, heartbeat and lease streams, reconnects, job
//!   reports, drain; [`run`] is the entry point.
//! - [`sandbox`]: the kernel sandbox around every task (Landlock,
//!   seccomp, resource limits, an unprivileged identity, a scratch
//!   directory per job).
//! - [`reporter`]: final reports, sent on one `ReportJobs` stream.
//! - [`client`], [`backoff`], [`stats`], [`error`]: the channel and auth,
//!   retry delays, heartbeat figures, fatal errors.

#![warn(missing_docs)]

pub mod agent;
pub mod backoff;
pub mod client;
pub mod config;
pub mod error;
pub mod executor;
pub mod reporter;
pub mod sandbox;
pub mod stats;
pub mod template;
pub mod tools;
pub mod units;

pub use agent::{run, Exit};
pub use config::{AgwArgs, LogFormat, WorkerConfig};
pub use error::WorkerError;
