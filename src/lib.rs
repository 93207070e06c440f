//! AGQ: a durable gRPC job queue and worker coordinator.
//!
//! Clients store reusable **Plans** (pipelines of Unix tools), fan them out
//! as **Actions** (one **Job** per input) and watch the results. **Workers**
//! (`agw`) register, keep a bidirectional heartbeat stream open and receive
//! job **leases** over a server stream. State lives in SQLite.
//!
//! The intended API of this library, for the `agq` and `agw` binaries, the
//! benchmark (`agq-bench`) and the tests:
//!
//! - [`server::run`] starts the whole server on a listener with
//!   [`server::ServerOptions`]; [`local::LocalServer`] starts it inside the
//!   calling process (tests, the bench, `agq demo`).
//! - [`core`] is the engine-neutral core: the domain types
//!   ([`core::model`]), the engine interface the services call
//!   ([`core::Engine`]), validation, pagination.
//! - [`store`] holds the engines behind that interface and all their SQL:
//!   [`store::sqlite::SqliteEngine`] is the embedded default.
//! - [`pb`] is the generated `agq.v1` code; [`config`] the command-line
//!   settings; [`auth`] the tokens and roles; [`error`] the one error type;
//!   [`metrics`] the Prometheus registry; [`http`] the HTTP/1 serving loop
//!   of the console and the metrics endpoint; [`telemetry`] the logs and the
//!   optional OpenTelemetry tracing of both binaries.
//! - [`worker`] is `agw` (connection, heartbeat, leases, sandboxed
//!   executor); [`cli`] the client subcommands of `agq`.
//!
//! - [`service`] holds the gRPC services, which are internal, and two
//!   public parts: the protobuf ↔ domain conversions
//!   ([`service::convert`]) and the error → status table
//!   ([`service::status`]), for code that drives the engine the way the
//!   services do (the fuzz targets). `docs/architecture.md` walks a job
//!   through the files.

pub mod auth;
pub mod cli;
pub mod config;
pub mod console;
pub mod core;
pub mod error;
pub mod http;
pub mod local;
pub mod metrics;
pub mod pb;
pub mod request_budget;
pub mod server;
pub mod service;
pub mod store;
pub mod telemetry;
pub(crate) mod time;
pub mod worker;
