//! The built `sluice-counter-service` binary, started on a free loopback port for tests.

mod binary;
mod client;
mod process;

pub use binary::service_binary;
pub use client::Reply;
pub use process::{Service, ServiceOptions, ServiceTls};
