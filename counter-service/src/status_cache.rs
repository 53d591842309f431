//! What `GET /v1/status` ([`crate::status`]) remembers between calls: the last status built, the
//! fleet level this replica last answered a proxy, and the endpoint's token bucket. Kept apart from
//! the handler so that the service's state holds it without importing the handler's dependencies.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The endpoint's memory: the last status built, the fleet level last answered, and its bucket.
#[derive(Debug, Default)]
pub struct StatusCache {
    pub(crate) built: tokio::sync::Mutex<Option<(Instant, Value)>>,
    fleet: Mutex<Option<FleetSeen>>,
    bucket: Mutex<Option<(f64, Instant)>>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct FleetSeen {
    pub(crate) utilization: f64,
    pub(crate) proxies: u64,
    at: Instant,
}

impl StatusCache {
    /// Notes the fleet level this replica answered a proxy (`crate::fleet::level`).
    pub fn fleet_answered(&self, utilization: f64, proxies: u64, at: Instant) {
        if let Ok(mut fleet) = self.fleet.lock() {
            *fleet = Some(FleetSeen {
                utilization,
                proxies,
                at,
            });
        }
    }

    /// Takes one token from the bucket (`rate` a second, as deep as `rate`) at `now`: false when
    /// it is empty.
    pub fn admit(&self, rate: u64, now: Instant) -> bool {
        let Ok(mut bucket) = self.bucket.lock() else {
            return false;
        };
        let rate = rate as f64;
        let (tokens, at) = bucket.unwrap_or((rate, now));
        let refilled = (tokens + now.saturating_duration_since(at).as_secs_f64() * rate).min(rate);
        if refilled < 1.0 {
            *bucket = Some((refilled, now));
            return false;
        }
        *bucket = Some((refilled - 1.0, now));
        true
    }

    pub(crate) fn fleet_within(&self, max_age: Duration, now: Instant) -> Option<FleetSeen> {
        let fleet = self.fleet.lock().ok().and_then(|fleet| *fleet)?;
        (now.saturating_duration_since(fleet.at) < max_age).then_some(fleet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_answers_its_rate_and_refills() {
        let cache = StatusCache::default();
        let t0 = Instant::now();
        let admitted = (0..25).filter(|_| cache.admit(20, t0)).count();
        assert_eq!(admitted, 20, "as deep as one second");
        assert!(
            !cache.admit(20, t0 + Duration::from_millis(10)),
            "0.2 token"
        );
        assert!(
            cache.admit(20, t0 + Duration::from_millis(60)),
            "1.2 tokens"
        );
        let later = t0 + Duration::from_secs(60);
        let admitted = (0..25).filter(|_| cache.admit(20, later)).count();
        assert_eq!(admitted, 20, "never deeper than one second");
    }

    #[test]
    fn a_fleet_level_counts_while_fresh() {
        let cache = StatusCache::default();
        let t0 = Instant::now();
        assert!(cache.fleet_within(Duration::from_secs(5), t0).is_none());
        cache.fleet_answered(0.9, 3, t0);
        let seen = cache.fleet_within(Duration::from_secs(5), t0 + Duration::from_secs(4));
        assert_eq!(seen.map(|f| (f.utilization, f.proxies)), Some((0.9, 3)));
        assert!(cache
            .fleet_within(Duration::from_secs(5), t0 + Duration::from_secs(5))
            .is_none());
    }
}
