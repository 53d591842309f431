//! A burst of requests over several concurrent keep-alive connections, counted by status.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::client::{agent, get};

/// What a burst got back.
#[derive(Debug, Clone)]
pub struct Burst {
    /// How many responses had each status.
    pub statuses: BTreeMap<u16, usize>,
    /// From the first request sent to the last response read.
    pub elapsed: Duration,
}

impl Burst {
    /// Responses with `status`.
    pub fn count(&self, status: u16) -> usize {
        self.statuses.get(&status).copied().unwrap_or(0)
    }
}

/// Sends `total` GETs of `url` over `connections` threads, each with its own keep-alive connection, and
/// counts the answers. Any transport error fails the burst.
pub fn burst(url: &str, total: usize, connections: usize) -> Result<Burst> {
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    let per_thread: Vec<Result<BTreeMap<u16, usize>>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                scope.spawn(|| {
                    let agent = agent();
                    let mut statuses = BTreeMap::new();
                    while next.fetch_add(1, Ordering::Relaxed) < total {
                        let reply = get(&agent, url, &[])?;
                        *statuses.entry(reply.status).or_insert(0) += 1;
                    }
                    Ok(statuses)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a burst thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut statuses = BTreeMap::new();
    for result in per_thread {
        for (status, n) in result? {
            *statuses.entry(status).or_insert(0) += n;
        }
    }
    Ok(Burst { statuses, elapsed })
}
