//! AGQ: a durable gRPC job queue and worker coordinator.
pub mod pb;
pub mod worker;
