//! `agw`, the AGQ worker: advertises the Unix tools it has, keeps a heartbeat
//! and a lease stream open to the server, runs each leased Plan as real
//! processes and reports the results.
//!
//! - [`tools`]: the advertised tool set (allowlist ∩ `$PATH`).
//! - [`template`]: `{{name}}` substitution in task arguments.
//! - [`executor`]: runs a Plan's tasks as processes (pipes, timeouts,
//!   process groups, capped capture).

pub mod executor;
pub mod template;
pub mod tools;
