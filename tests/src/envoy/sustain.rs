//! Load held for a while (bounded in time and in count) over several keep-alive connections, with every answer
//! kept: when it was sent, how long it took, its status or the transport error. For tests that change something
//! under the load (kill the counter service, stop Redis) and then look at what the edge answered meanwhile.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::client::{agent, get};

/// What to send.
#[derive(Debug, Clone)]
pub struct Load {
    /// Every request is `GET url`.
    pub url: String,
    /// Request headers, e.g. `("x-api-key", "k")`.
    pub headers: Vec<(String, String)>,
    /// Concurrent keep-alive connections, one thread each.
    pub connections: usize,
    /// No request is sent after this long.
    pub duration: Duration,
    /// No more than this many requests in all.
    pub max_requests: usize,
    /// Each connection waits this long between two requests (zero: back to back).
    pub pause: Duration,
}

impl Load {
    /// `connections` connections sending `GET url` back to back for `duration`, at most `max_requests`.
    pub fn new(url: impl Into<String>, connections: usize, duration: Duration) -> Load {
        Load {
            url: url.into(),
            headers: Vec::new(),
            connections,
            duration,
            max_requests: 100_000,
            pause: Duration::ZERO,
        }
    }
}

/// One request and how it ended.
#[derive(Debug, Clone)]
pub struct Sample {
    /// When it was sent (open-loop, [`offer_until`](super::offer_until): when it was due).
    pub at: Instant,
    /// From sent (or due) to the whole response read (or the error).
    pub latency: Duration,
    /// The status, or the transport error.
    pub outcome: Result<u16, String>,
}

/// Everything a [`sustain`] run got back, in no particular order.
#[derive(Debug, Clone)]
pub struct Sustained {
    pub started: Instant,
    pub elapsed: Duration,
    pub samples: Vec<Sample>,
}

impl Sustained {
    /// Responses with `status`.
    pub fn count(&self, status: u16) -> usize {
        self.samples
            .iter()
            .filter(|s| s.outcome == Ok(status))
            .count()
    }

    /// Responses with `status` to requests sent in `[from, to)`.
    pub fn count_between(&self, status: u16, from: Instant, to: Instant) -> usize {
        self.samples
            .iter()
            .filter(|s| s.outcome == Ok(status) && s.at >= from && s.at < to)
            .count()
    }

    /// How many responses had each status.
    pub fn statuses(&self) -> BTreeMap<u16, usize> {
        let mut statuses = BTreeMap::new();
        for sample in &self.samples {
            if let Ok(status) = sample.outcome {
                *statuses.entry(status).or_insert(0) += 1;
            }
        }
        statuses
    }

    /// The transport errors (no response at all), with when they happened relative to the start.
    pub fn errors(&self) -> Vec<(Duration, &str)> {
        self.samples
            .iter()
            .filter_map(|s| match &s.outcome {
                Err(error) => Some((s.at - self.started, error.as_str())),
                Ok(_) => None,
            })
            .collect()
    }

    /// The slowest request: its latency and when it was sent relative to the start.
    pub fn slowest(&self) -> Option<(Duration, Duration)> {
        self.samples
            .iter()
            .max_by_key(|s| s.latency)
            .map(|s| (s.latency, s.at - self.started))
    }
}

/// Sends `load` and returns every answer. A transport error is recorded, not fatal: the connection is made
/// again for the next request.
pub fn sustain(load: &Load) -> Sustained {
    sustain_until(load, &AtomicBool::new(false))
}

/// Like [`sustain`], and also stops sending once `stop` is set (from another thread).
pub fn sustain_until(load: &Load, stop: &AtomicBool) -> Sustained {
    let sent = AtomicUsize::new(0);
    let started = Instant::now();
    let deadline = started + load.duration;
    let per_thread: Vec<Vec<Sample>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..load.connections)
            .map(|_| {
                scope.spawn(|| {
                    let headers: Vec<(&str, &str)> = load
                        .headers
                        .iter()
                        .map(|(n, v)| (n.as_str(), v.as_str()))
                        .collect();
                    let mut client = agent();
                    let mut samples = Vec::new();
                    while Instant::now() < deadline
                        && !stop.load(Ordering::Relaxed)
                        && sent.fetch_add(1, Ordering::Relaxed) < load.max_requests
                    {
                        let at = Instant::now();
                        let outcome = get(&client, &load.url, &headers)
                            .map(|reply| reply.status)
                            .map_err(|error| format!("{error:#}"));
                        if outcome.is_err() {
                            client = agent();
                        }
                        samples.push(Sample {
                            at,
                            latency: at.elapsed(),
                            outcome,
                        });
                        if !load.pause.is_zero() {
                            std::thread::sleep(load.pause);
                        }
                    }
                    samples
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a load thread panicked"))
            .collect()
    });
    Sustained {
        started,
        elapsed: started.elapsed(),
        samples: per_thread.into_iter().flatten().collect(),
    }
}

/// The latency at quantile `q` (0..=1, nearest rank) of the requests of `runs` sent in `[from, to)`; zero
/// when there were none.
pub fn latency_quantile(runs: &[&Sustained], from: Instant, to: Instant, q: f64) -> Duration {
    let mut latencies: Vec<Duration> = runs
        .iter()
        .flat_map(|r| r.samples.iter())
        .filter(|s| s.at >= from && s.at < to)
        .map(|s| s.latency)
        .collect();
    latencies.sort();
    if latencies.is_empty() {
        return Duration::ZERO;
    }
    latencies[((latencies.len() - 1) as f64 * q).round() as usize]
}
