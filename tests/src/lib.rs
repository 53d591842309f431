//! Fixtures for sluice's tests: Redis and Redis Cluster, the counter service, Envoy and nginx, each a real
//! process on loopback ports, stopped when dropped, and an HTTP upstream of the test's own that answers a set status
//! or holds requests (`upstream`). The proxy-wasm host lives in `sluice-host`.

pub mod certs;
pub mod contract;
pub mod envoy;
pub mod grpc;
pub mod nginx;
pub mod redis;
pub mod reply;
pub mod service;
pub mod upstream;
pub mod zipf;

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

/// A process's resident set size (`VmRSS` of `/proc/<pid>/status`), in bytes; `None` if it is
/// gone or the line is missing.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}
