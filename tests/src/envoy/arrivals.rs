//! Open-loop load: requests due at a fixed arrival rate, each sent at its time whatever the answers to
//! the others are waiting for (as long as a connection is free), bounded in count and in time, with every
//! answer kept as a [`Sustained`]. A slow answer delays no request but those queued behind it on a busy
//! connection, and that delay shows in their latencies: a sample's `at` is when it was due.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::client::{agent, get};
use super::sustain::{Sample, Sustained};

/// What to offer, and at what rate.
#[derive(Debug, Clone)]
pub struct Arrivals {
    /// Every request is `GET url`.
    pub url: String,
    /// Request headers, e.g. `("x-user", "u1")`.
    pub headers: Vec<(String, String)>,
    /// Requests due per second, evenly spaced.
    pub per_second: f64,
    /// Keep-alive connections, one thread each, that take the requests as they come due.
    pub connections: usize,
    /// No request is due after this long.
    pub duration: Duration,
    /// No more than this many requests in all.
    pub max_requests: usize,
}

impl Arrivals {
    /// `per_second` requests of `GET url` for `duration` (no more than that makes), over four connections.
    pub fn new(url: impl Into<String>, per_second: f64, duration: Duration) -> Arrivals {
        Arrivals {
            url: url.into(),
            headers: Vec::new(),
            per_second,
            connections: 4,
            duration,
            max_requests: (per_second * duration.as_secs_f64()).ceil() as usize,
        }
    }
}

/// Offers `arrivals` until they run out or `stop` is set (from another thread), and returns every answer.
/// A transport error is recorded, not fatal: that connection is made again for its next request.
pub fn offer_until(arrivals: &Arrivals, stop: &AtomicBool) -> Sustained {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let per_thread: Vec<Vec<Sample>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..arrivals.connections)
            .map(|_| {
                scope.spawn(|| {
                    let headers: Vec<(&str, &str)> = arrivals
                        .headers
                        .iter()
                        .map(|(n, v)| (n.as_str(), v.as_str()))
                        .collect();
                    let mut client = agent();
                    let mut samples = Vec::new();
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let due = started + Duration::from_secs_f64(n as f64 / arrivals.per_second);
                        if n >= arrivals.max_requests
                            || due >= started + arrivals.duration
                            || stop.load(Ordering::Relaxed)
                        {
                            return samples;
                        }
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                            if stop.load(Ordering::Relaxed) {
                                return samples;
                            }
                        }
                        let outcome = get(&client, &arrivals.url, &headers)
                            .map(|reply| reply.status)
                            .map_err(|error| format!("{error:#}"));
                        if outcome.is_err() {
                            client = agent();
                        }
                        samples.push(Sample {
                            at: due,
                            latency: due.elapsed(),
                            outcome,
                        });
                    }
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("an arrivals thread panicked"))
            .collect()
    });
    Sustained {
        started,
        elapsed: started.elapsed(),
        samples: per_thread.into_iter().flatten().collect(),
    }
}
