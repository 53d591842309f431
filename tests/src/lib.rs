//! sluice's test harnesses.

pub mod envoy;
pub mod host;
pub mod redis;
pub mod reply;
pub mod service;
