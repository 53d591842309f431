//! Backpressure: when Redis is slow or the service is busy, ask the proxies to sync less often.

use std::sync::atomic::{AtomicU64, Ordering};

/// Never ask for syncs further apart than this (unless the proxy's own interval is longer)...
pub const MAX_NEXT_SYNC_MS: u64 = 10_000;
/// ...nor more than this many times the proxy's interval.
pub const MAX_FACTOR: u64 = 10;

/// An exponentially weighted moving average, shared between threads without a lock.
pub struct Ewma {
    weight: f64,
    bits: AtomicU64,
}

impl Ewma {
    /// `weight` is the share of each new sample, in (0, 1].
    pub fn new(weight: f64) -> Ewma {
        Ewma {
            weight,
            bits: AtomicU64::new(f64::NAN.to_bits()),
        }
    }

    pub fn observe(&self, sample: f64) {
        let weight = self.weight;
        let _ = self
            .bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if old.is_nan() {
                    sample
                } else {
                    old + weight * (sample - old)
                };
                Some(new.to_bits())
            });
    }

    /// The average, or 0 before the first sample.
    pub fn value(&self) -> f64 {
        let value = f64::from_bits(self.bits.load(Ordering::Relaxed));
        if value.is_nan() {
            0.0
        } else {
            value
        }
    }
}

/// The next sync interval to advise a proxy that syncs every `interval_ms`: its own interval while
/// all is well; up to [`MAX_FACTOR`] times longer (capped at [`MAX_NEXT_SYNC_MS`]) as the Redis
/// latency average nears the Redis timeout or the requests in flight near the concurrency limit.
pub fn next_sync_ms(
    interval_ms: u64,
    redis_latency_ms: f64,
    redis_timeout_ms: u64,
    in_flight: usize,
    max_concurrency: usize,
) -> u64 {
    let latency = redis_latency_ms / redis_timeout_ms.max(1) as f64;
    let by_latency = match latency {
        l if l < 0.25 => 1,
        l if l < 0.5 => 2,
        l if l < 0.8 => 4,
        _ => MAX_FACTOR,
    };
    let load = in_flight as f64 / max_concurrency.max(1) as f64;
    let by_load = match load {
        l if l < 0.5 => 1,
        l if l < 0.8 => 2,
        l if l < 0.95 => 4,
        _ => MAX_FACTOR,
    };
    let factor = by_latency.max(by_load);
    if factor == 1 {
        return interval_ms;
    }
    interval_ms
        .saturating_mul(factor)
        .min(MAX_NEXT_SYNC_MS.max(interval_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_healthy_service_keeps_the_proxy_interval() {
        assert_eq!(next_sync_ms(100, 1.0, 50, 3, 512), 100);
    }

    #[test]
    fn slow_redis_stretches_the_interval() {
        assert_eq!(next_sync_ms(100, 15.0, 50, 0, 512), 200);
        assert_eq!(next_sync_ms(100, 30.0, 50, 0, 512), 400);
        assert_eq!(next_sync_ms(100, 49.0, 50, 0, 512), 1_000);
    }

    #[test]
    fn a_busy_service_stretches_the_interval() {
        assert_eq!(next_sync_ms(100, 0.0, 50, 300, 512), 200);
        assert_eq!(next_sync_ms(100, 0.0, 50, 512, 512), 1_000);
    }

    #[test]
    fn the_stretch_is_capped() {
        assert_eq!(next_sync_ms(5_000, 49.0, 50, 0, 512), 10_000);
        assert_eq!(
            next_sync_ms(20_000, 49.0, 50, 0, 512),
            20_000,
            "never below its own"
        );
    }

    #[test]
    fn the_average_starts_at_the_first_sample() {
        let ewma = Ewma::new(0.5);
        assert_eq!(ewma.value(), 0.0);
        ewma.observe(10.0);
        assert_eq!(ewma.value(), 10.0);
        ewma.observe(20.0);
        assert_eq!(ewma.value(), 15.0);
    }
}
