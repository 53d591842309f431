//! Fixtures for sluice's tests: Redis and Redis Cluster, the counter service and Envoy, each a real
//! process on loopback ports, stopped when dropped. The proxy-wasm host lives in `sluice-host`.

pub mod envoy;
pub mod redis;
pub mod reply;
pub mod service;

use std::time::{Duration, Instant};

/// Polls `condition` every 50 ms until it holds; false if it did not within `within`.
pub fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
