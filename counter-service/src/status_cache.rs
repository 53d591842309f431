//! What `GET /v1/status` ([`crate::status`]) remembers between calls: the last status built, the
//! fleet level this replica last answered a proxy, and the endpoint's token bucket. Kept apart from
//! the handler so that the service's state holds it without importing the handler's dependencies.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long one built status answers every caller.
pub const STATUS_TTL: Duration = Duration::from_secs(2);

/// The endpoint's memory: the last status built, the fleet level last answered, and its bucket.
#[derive(Debug, Default)]
pub struct StatusCache {
    last: Mutex<Option<Built>>,
    /// Held while a status is built: one at a time.
    pub(crate) building: tokio::sync::Mutex<()>,
    fleet: Mutex<Option<FleetSeen>>,
    bucket: Mutex<Option<(f64, Instant)>>,
}

/// A status built, and when.
#[derive(Debug, Clone)]
pub struct Built {
    pub at: Instant,
    pub body: Value,
}

/// What a call is answered ([`StatusCache::serve`]).
#[derive(Debug, Clone)]
pub enum Serve {
    /// The last status built, as it is.
    Cached(Built),
    /// A new status: the last one is older than [`STATUS_TTL`] (or there is none) and the call is
    /// within the rate.
    Build,
    /// 429: past the rate, and no status was ever built.
    Refuse,
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

    /// What a call at `now` is answered, at `rate` a second: the last status built while it is
    /// younger than [`STATUS_TTL`]; else a new one while the bucket has a token; past the rate,
    /// the last one however old (a flood makes it at most `1 / rate` s older: the first call
    /// within the rate builds anew), and only while none was ever built, a refusal. Every call
    /// takes a token.
    pub fn serve(&self, rate: u64, now: Instant) -> Serve {
        let admitted = self.admit(rate, now);
        match self.last() {
            Some(built) if !admitted || now.saturating_duration_since(built.at) < STATUS_TTL => {
                Serve::Cached(built)
            }
            None if !admitted => Serve::Refuse,
            _ => Serve::Build,
        }
    }

    /// The last status built, if any.
    pub fn last(&self) -> Option<Built> {
        self.last.lock().ok().and_then(|last| last.clone())
    }

    /// Keeps `body`, built at `at`, as the last status built.
    pub fn store(&self, body: Value, at: Instant) -> Built {
        let built = Built { at, body };
        if let Ok(mut last) = self.last.lock() {
            *last = Some(built.clone());
        }
        built
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

    /// Attacker's test, on the tests' clock: a client at 100 calls a second against a rate of 5,
    /// for 10 s, and a status page polling every 0.5 s. The page is never refused; a status is
    /// built at most once every 2 s, and no answer is older than 2 s plus one token's refill
    /// (0.2 s).
    #[test]
    fn a_flood_past_the_rate_refuses_no_poller_and_keeps_the_answer_fresh() {
        let cache = StatusCache::default();
        let t0 = Instant::now();
        let (mut builds, mut refused, mut polls) = (0, 0, 0);
        let mut oldest = Duration::ZERO;
        for tick in 0..1_000u64 {
            let now = t0 + Duration::from_millis(tick * 10);
            let callers = if tick % 50 == 0 { 2 } else { 1 };
            for caller in 0..callers {
                let answered = match cache.serve(5, now) {
                    Serve::Cached(built) => {
                        oldest = oldest.max(now - built.at);
                        true
                    }
                    Serve::Build => {
                        builds += 1;
                        cache.store(Value::from(tick), now);
                        true
                    }
                    Serve::Refuse => false,
                };
                if caller == 1 {
                    polls += 1;
                    refused += u32::from(!answered);
                }
            }
        }
        assert_eq!((polls, refused), (20, 0));
        assert!(builds <= 10 / 2 + 1, "{builds} builds in 10 s");
        assert!(
            oldest <= STATUS_TTL + Duration::from_millis(200),
            "{oldest:?}"
        );
    }

    #[test]
    fn past_the_rate_only_a_call_with_nothing_built_is_refused() {
        let cache = StatusCache::default();
        let t0 = Instant::now();
        // Two tokens: two calls may build (the first's build still under way), the third not.
        assert!(matches!(cache.serve(2, t0), Serve::Build));
        assert!(matches!(cache.serve(2, t0), Serve::Build));
        assert!(matches!(cache.serve(2, t0), Serve::Refuse));
        cache.store(Value::from(1), t0);
        let later = t0 + Duration::from_secs(60);
        // Stale: within the rate, built anew; past it, the stale one.
        assert!(matches!(cache.serve(2, later), Serve::Build));
        assert!(matches!(cache.serve(2, later), Serve::Build));
        assert!(matches!(cache.serve(2, later), Serve::Cached(b) if b.at == t0));
        // Fresh: answered as it is, within the rate or past it.
        cache.store(Value::from(2), later);
        assert!(matches!(cache.serve(2, later), Serve::Cached(b) if b.body == 2));
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
