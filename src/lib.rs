//! AGQ: a durable gRPC job queue and worker coordinator.
//!
//! Clients store reusable **Plans** (pipelines of Unix tools), fan them out
//! as **Actions** (one **Job** per input) and watch the results. **Workers**
//! (`agw`) register, keep a bidirectional heartbeat stream open and receive
//! job **leases** over a server stream. State lives in SQLite.
//!
//! - [`server::run`] starts the whole server on a listener;
//!   [`local::LocalServer`] starts it inside the calling process.
//! - [`core`] holds validation, the job state machine, scheduler and reaper.
//! - [`store`] holds every SQL statement.
//! - [`service`] holds the thin tonic services; [`pb`] the generated code.

pub mod auth;
pub mod cli;
pub mod config;
pub mod core;
pub mod error;
pub mod local;
pub mod metrics;
pub mod pb;
pub mod server;
pub mod service;
pub mod store;
pub mod time;
pub mod worker;
