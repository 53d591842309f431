//! Fixtures for sluice's tests: Redis and Redis Cluster, the counter service and Envoy, each a real
//! process on loopback ports, stopped when dropped. The proxy-wasm host lives in `sluice-host`.

pub mod envoy;
pub mod redis;
pub mod reply;
pub mod service;
