//! The engine-neutral core: AGQ's domain types ([`model`]), the engine
//! interface the services call ([`engine::Engine`]), request validation
//! ([`validate`]), pagination ([`page`]) and WatchAction subscriptions
//! ([`watch`]). It knows nothing of gRPC or of any database: the services
//! in `crate::service` convert wire messages to these types, and the
//! engines in `crate::store` implement the interface.

pub mod cron;
pub mod engine;
pub mod model;
pub mod page;
pub mod selector;
pub mod validate;
pub mod watch;

pub use engine::{Engine, SharedEngine};
