//! The circuit breaker around the counter service: closed while calls succeed, open after
//! `failures` consecutive failures, half-open (one probe) after a jittered cool-down.

/// Breaker state, shared by every worker of a proxy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Breaker {
    /// Consecutive failures so far.
    pub failures: u32,
    /// While `now < open_until_us` the service is not called. 0: never opened.
    pub open_until_us: u64,
}

/// What the breaker allows right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    /// The cool-down passed: the next call is a probe; requests still use fallbacks.
    HalfOpen,
}

impl Breaker {
    /// The longest a breaker opens: the longest cool-down (`service.breaker_cooldown_ms`, an
    /// hour) with the most jitter (1.5). Open further ahead means the clock was stepped back
    /// since it opened: it is half-open now, not when the clock is back where it was.
    pub const MAX_OPEN_US: u64 = 3_600_000_000 * 3 / 2;

    pub fn state(&self, threshold: u32, now_us: u64) -> BreakerState {
        if self.failures < threshold {
            BreakerState::Closed
        } else if now_us < self.open_until_us && self.open_until_us - now_us <= Self::MAX_OPEN_US {
            BreakerState::Open
        } else {
            BreakerState::HalfOpen
        }
    }

    /// Whether requests may rely on the service (leases, strict checks).
    pub fn service_up(&self, threshold: u32, now_us: u64) -> bool {
        self.state(threshold, now_us) == BreakerState::Closed
    }

    /// Whether a call may be made now (closed, or the half-open probe).
    pub fn may_call(&self, threshold: u32, now_us: u64) -> bool {
        self.state(threshold, now_us) != BreakerState::Open
    }

    pub fn succeeded(&mut self) {
        *self = Breaker::default();
    }

    /// Counts a failure; opens (again) for `cooldown_us` scaled by `jitter` in [0.5, 1.5]
    /// once `threshold` consecutive failures are reached.
    pub fn failed(&mut self, threshold: u32, now_us: u64, cooldown_us: u64, jitter: f64) {
        self.failures = self.failures.saturating_add(1);
        if self.failures >= threshold {
            let jitter = jitter.clamp(0.5, 1.5);
            self.open_until_us = now_us + (cooldown_us as f64 * jitter) as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_then_probes() {
        let mut b = Breaker::default();
        b.failed(3, 0, 1_000, 1.0);
        b.failed(3, 0, 1_000, 1.0);
        assert_eq!(b.state(3, 0), BreakerState::Closed);
        b.failed(3, 10, 1_000, 1.0);
        assert_eq!(b.state(3, 500), BreakerState::Open);
        assert!(!b.may_call(3, 500));
        assert_eq!(b.state(3, 1_010), BreakerState::HalfOpen);
        assert!(b.may_call(3, 1_010) && !b.service_up(3, 1_010));
        b.failed(3, 1_010, 1_000, 1.5);
        assert_eq!(
            b.state(3, 2_000),
            BreakerState::Open,
            "a failed probe opens again"
        );
        b.succeeded();
        assert!(b.service_up(3, 2_000));
    }

    #[test]
    fn a_clock_stepped_back_does_not_keep_it_open() {
        let mut b = Breaker::default();
        let day = 86_400_000_000;
        b.failed(1, 10 * day, 2_000_000, 1.0);
        assert_eq!(b.state(1, 10 * day + 1_000_000), BreakerState::Open);
        assert_eq!(
            b.state(1, 10 * day - 1_000_000),
            BreakerState::Open,
            "a second back: still open"
        );
        assert_eq!(
            b.state(1, 9 * day),
            BreakerState::HalfOpen,
            "a day back: a probe now, not in a day"
        );
    }
}
